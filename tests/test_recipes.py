"""Every shipped recipe loads; every kind of bad input gives one clear line and exit code 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tclightning.cli.lightning import main as lightning_main
from tclightning.cli.main import main
from tclightning.errors import RecipeError
from tclightning.recipes.loader import find_recipe, list_recipes, load_recipe, to_dataclass
from tclightning.recipes.schema import RecipeConfig

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def test_hub_lists_every_shipped_file() -> None:
    listed = {info.path.resolve() for info in list_recipes()}
    assert {p.resolve() for p in SHIPPED} <= listed
    assert all(info.description for info in list_recipes()), "every recipe needs a one-line description"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_recipe_loads(path: Path) -> None:
    recipe = to_dataclass(load_recipe(str(path)))
    assert isinstance(recipe, RecipeConfig)
    assert recipe.trainer.steps > 0
    # found by name as well as by path
    assert find_recipe(recipe.name) == path.resolve() or find_recipe(path.stem) == path.resolve()


def test_overrides_and_includes(tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text("description: child\ndefaults: [tiny]\ngrpo: {lr: 0.5}\n")
    cfg = load_recipe(str(child), ["trainer.steps=7", "sampler.group_size=3"])
    assert cfg.name == "child"
    assert cfg.grpo.lr == 0.5  # the child's own value
    assert cfg.trainer.steps == 7  # command line wins
    assert cfg.sampler.group_size == 3
    assert cfg.model.source == "tiny"  # inherited from `tiny`
    assert cfg.model.warmup.steps == load_recipe("tiny").model.warmup.steps


def _error(tmp_path: Path, text: str, *overrides: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path), overrides)
    return str(info.value)


def test_unknown_key_suggests_the_right_one(tmp_path: Path) -> None:
    message = _error(tmp_path, "description: x\ngrpo: {lrr: 0.1}\n")
    assert "bad.yaml" in message and "grpo.lrr" in message and "did you mean 'grpo.lr'" in message


def test_unknown_section_is_named(tmp_path: Path) -> None:
    message = _error(tmp_path, "description: x\ntrainr: {steps: 3}\n")
    assert "trainr" in message and "did you mean 'trainer'" in message


def test_wrong_type_names_key_and_value(tmp_path: Path) -> None:
    message = _error(tmp_path, "description: x\ntrainer: {steps: many}\n")
    assert "trainer.steps" in message and "many" in message


def test_override_errors_name_the_command_line(tmp_path: Path) -> None:
    message = _error(tmp_path, "description: x\n", "grpo.kl_cof=0.3")
    assert "command line" in message and "did you mean 'grpo.kl_coef'" in message


def test_bad_choice_and_missing_include(tmp_path: Path) -> None:
    assert "grpo.loss_aggregation" in _error(tmp_path, "description: x\ngrpo: {loss_aggregation: sum}\n")
    message = _error(tmp_path, "description: x\ndefaults: [no-such-recipe]\n")
    assert "defaults" in message and "no-such-recipe" in message


def test_unknown_callback_class(tmp_path: Path) -> None:
    message = _error(tmp_path, "description: x\ncallbacks:\n  - class_path: nowhere.Missing\n")
    assert "callbacks[0].class_path" in message and "nowhere.Missing" in message
    message = _error(tmp_path, "description: x\ncallbacks:\n  - class_path: collections.OrderedDict\n")
    assert "not a lightning Callback" in message


def test_unknown_recipe_name_suggests() -> None:
    with pytest.raises(RecipeError, match="did you mean 'tiny'"):
        find_recipe("tinny")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tclightning", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "recipe_text, overrides, fragment",
    [
        ("description: x\ngrpo: {lrr: 0.1}\n", [], "did you mean 'grpo.lr'"),
        ("description: x\ntrainer: {steps: many}\n", [], "trainer.steps"),
        ("description: x\ncallbacks:\n  - class_path: nowhere.Missing\n", [], "nowhere.Missing"),
        ("description: x\n", ["sampler.group_sise=2"], "sampler.group_size"),
        ("description: [unclosed\n", [], "not valid YAML"),
    ],
    ids=["unknown-key", "wrong-type", "unknown-callback", "bad-override", "bad-yaml"],
)
def test_cli_errors_are_one_line_exit_2_and_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    recipe_text: str, overrides: list[str], fragment: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(recipe_text)
    code, _, err = _main(capsys, "run", "--recipe", "bad.yaml", *overrides)
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]
    assert "bad.yaml" in lines[0] or "command line" in lines[0]
    assert not (tmp_path / "runs").exists(), "nothing may be written before the recipe validates"


def test_cli_missing_file_and_unknown_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = _main(capsys, "run", "--recipe", "nope/missing.yaml")
    assert code == 2 and "missing.yaml" in err
    code, _, err = _main(capsys, "run", "--recipe", "tinny")
    assert code == 2 and "did you mean 'tiny'" in err
    code, _, err = _main(capsys, "run", "--recipe", "tiny", "--resume", "last")
    assert code == 2 and "no checkpoint" in err
    assert not (tmp_path / "runs").exists()


def test_cli_process_exit_code_and_debug_traceback(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("description: x\ngrpo: {lrr: 0.1}\n")
    plain = _cli("run", "--recipe", "bad.yaml", cwd=tmp_path)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and "grpo.lrr" in plain.stderr
    debug = _cli("--debug", "run", "--recipe", "bad.yaml", cwd=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_cli_help_at_each_level(capsys: pytest.CaptureFixture[str]) -> None:
    for args, fragments in [
        (["--help"], ["run", "recipes", "analyze"]),
        (["run", "--help"], ["--resume", "key=value", "--recipe"]),
        (["recipes", "--help"], ["list", "show"]),
    ]:
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert all(f in out for f in fragments), (args, out)
    with pytest.raises(SystemExit):
        lightning_main(["run", "--help"])
    assert "lightning run --recipe" in capsys.readouterr().out


def test_recipes_list_and_show(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _main(capsys, "recipes", "list")
    assert code == 0 and "tiny" in out
    code, out, _ = _main(capsys, "recipes", "show", "tiny", "trainer.steps=3")
    assert code == 0 and "steps: 3" in out and "warmup:" in out


def test_a_recipe_is_listed_under_the_name_that_selects_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A recipe of yours with ``name: tiny`` was listed as a second ``tiny``, which selects the shipped
    one (a file's name is matched first): it is listed under its file's name, saying so."""
    (tmp_path / "mytiny.yaml").write_text("name: tiny\ndescription: mine\ndefaults: [tiny]\ntrainer: {steps: 7}\n")
    monkeypatch.setenv("TCLIGHTNING_RECIPES", str(tmp_path))
    code, out, _ = _main(capsys, "recipes", "list")
    listed = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert code == 0 and "mytiny" in listed and "its name: tiny selects another recipe" in listed["mytiny"]
    assert [line.split()[0] for line in out.splitlines() if line.strip()].count("tiny") == 1
    code, out, _ = _main(capsys, "recipes", "show", "mytiny")
    assert code == 0 and "steps: 7" in out
    # names are matched whatever their case: a file Tiny.yaml of yours is what `tiny` selects now
    (tmp_path / "mytiny.yaml").unlink()
    (tmp_path / "Tiny.yaml").write_text("name: Tiny\ndescription: mine\ntrainer: {steps: 7}\n")
    code, out, _ = _main(capsys, "recipes", "list")
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert code == 0 and "Tiny" in names and "tiny" not in names and str(REPO / "recipes" / "tiny.yaml") in names


# ------------------------------------------------------------------ bounded reading: nothing hangs
ALIAS_BOMB = "\n".join(
    ["name: bomb", "defaults: [tiny]", "description: x", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    + ["model: {tiny: {hidden_size: *a8}}"]
)


def test_an_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 1000  # a billion values once expanded
    with pytest.raises(RecipeError, match="more than 20000 values once its aliases are expanded"):
        load_recipe(str(path))
    path.write_text("name: loop\nmodel: &m {tiny: *m}\n")
    with pytest.raises(RecipeError, match="refers to a value that holds it"):
        load_recipe(str(path))
    path.write_text("name: deep\nx: " + "[" * 40 + "]" * 40 + "\n")
    with pytest.raises(RecipeError, match="nested deeper than 32 levels"):
        load_recipe(str(path))


def test_a_fifo_or_device_named_yaml_on_the_search_path_hangs_nothing(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    os.mkfifo(tmp_path / "pipe.yaml")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    monkeypatch.setenv("TCLIGHTNING_RECIPES", str(tmp_path))
    listed = {info.path.name: info.description for info in list_recipes()}
    assert "not a regular file" in listed["pipe.yaml"] and "not a regular file" in listed["zero.yaml"]
    for name in ("pipe", "zero"):
        with pytest.raises(RecipeError, match="not a regular file"):
            load_recipe(name)
    assert load_recipe("tiny").name == "tiny"


def test_a_recipe_s_name_field_never_stands_in_for_another_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A file ``zz-experiment.yaml`` saying ``name: tiny`` on the search path replaced ``--recipe
    tiny`` and every shipped recipe's ``defaults: [tiny]``; by its own name it is still found."""
    from tclightning.recipes.loader import find_recipe

    (tmp_path / "zz-experiment.yaml").write_text("name: tiny\ndefaults: [dense]\ndescription: mine\n")
    monkeypatch.setenv("TCLIGHTNING_RECIPES", str(tmp_path))
    assert find_recipe("tiny").parent != tmp_path and find_recipe("zz-experiment").parent == tmp_path
    assert load_recipe("dense").name == "dense"  # its defaults: [tiny] read the shipped tiny, not a circle


def test_interpolations_and_invalid_yaml_values_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "interp.yaml"
    path.write_text("name: interp\ndefaults: [tiny]\ngrpo: {lr: '${oc.env:HOME}'}\n")
    with pytest.raises(RecipeError, match=r"key 'grpo.lr': holds an interpolation"):
        load_recipe(str(path))
    with pytest.raises(RecipeError, match=r"command line: override 'grpo.lr=\$\{oc.env:HOME\}'"):
        load_recipe("tiny", ["grpo.lr=${oc.env:HOME}"])
    with pytest.raises(RecipeError, match="override 'trainer.steps=\\[1,': the value is not valid YAML"):
        load_recipe("tiny", ["trainer.steps=[1,"])


def test_a_step_of_a_billion_completions_is_refused_before_anything_is_allocated() -> None:
    with pytest.raises(RecipeError, match=r"override 'grpo.prompts_per_step=1000000000'.*1048576"):
        load_recipe("tiny", ["grpo.prompts_per_step=1000000000"])


# ------------------------------------------------------------------ checkpoints: the sections they hold
def test_checkpoint_hyper_parameters_run_only_the_checks_of_the_sections_they_hold() -> None:
    """A checkpoint stores model, task, sampler, grpo and anchor, not trainer: the anchor mergers'
    need for ``trainer.strategy: pipeline`` cannot be judged there (it was, against the schema's
    default ``auto``, and refused every checkpoint of an anchor run), while a recipe still needs it."""
    from dataclasses import asdict

    from tclightning.anchor.config import AnchorConfig
    from tclightning.models.config import ModelConfig
    from tclightning.recipes.loader import validate_checkpoint_hparams

    for merger in ("signed_ema", "control_variate"):
        validate_checkpoint_hparams({"model": asdict(ModelConfig()), "anchor": asdict(AnchorConfig(merger=merger))},
                                    "anchor.ckpt")
        with pytest.raises(RecipeError, match="trainer.strategy: pipeline"):
            load_recipe("tiny", [f"anchor.merger={merger}"])
    with pytest.raises(RecipeError, match="anchor.ckpt: key 'anchor.merger'"):  # its own range still holds
        validate_checkpoint_hparams({"model": asdict(ModelConfig()), "anchor": {"merger": "trust"}}, "anchor.ckpt")


def test_checkpoint_hyper_parameters_of_an_earlier_version_hold_retired_keys() -> None:
    from dataclasses import asdict

    from tclightning.grpo.config import GRPOConfig
    from tclightning.models.config import ModelConfig
    from tclightning.recipes.loader import validate_checkpoint_hparams
    from tclightning.recipes.schema import RETIRED_KEYS

    model = asdict(ModelConfig())
    model["warmup"]["cache"] = True
    validate_checkpoint_hparams({"model": model, "grpo": {**asdict(GRPOConfig()), "eps": 1e-4},
                                 "anchor": {"warmup_shape": "geometric", "mask_kappa": 1.0}}, "old.ckpt")
    assert {"model.warmup.cache", "grpo.eps", "pipeline.compressed", "anchor.warmup_shape"} <= set(RETIRED_KEYS)
    with pytest.raises(RecipeError, match="grpo.eps"):  # a retired key is no recipe key
        load_recipe("tiny", ["grpo.eps=0.001"])


def test_a_file_named_like_a_shipped_recipe_or_preset_in_the_working_folder_never_stands_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--recipe tiny` and `callback_presets: [monitoring]` are names: a file `tiny` or `monitoring`
    where the command runs (a cloned repository, a shared folder) is not read, let alone its
    class paths imported. A path says so: `./tiny`, `dir/tiny`, `tiny.yaml`."""
    from tclightning.recipes.loader import find_preset, find_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("defaults: []\ndescription: not the shipped one\n")
    (tmp_path / "monitoring").write_text("- class_path: antigravity.Nope\n")
    assert find_recipe("tiny") != (tmp_path / "tiny").resolve()
    assert find_recipe("tiny").parent.name == "recipes"
    assert find_preset("monitoring", tmp_path) != (tmp_path / "monitoring").resolve()
    assert find_recipe("./tiny") == (tmp_path / "tiny").resolve()


def test_a_moved_key_is_refused_naming_its_replacement_and_an_old_checkpoint_carries_it_over(tmp_path: Path) -> None:
    """A key folded into another (``sampler.vllm_sleep`` -> ``sampler.vllm.sleep``) is one line
    naming the file, the key and what to write; a checkpoint that saved it loads with its value moved."""
    from dataclasses import asdict

    from tclightning.grpo.module import _current
    from tclightning.models.config import ModelConfig
    from tclightning.recipes.loader import validate_checkpoint_hparams
    from tclightning.recipes.schema import MOVED_KEYS, RETIRED_KEYS

    recipe = tmp_path / "old.yaml"
    recipe.write_text("defaults: [tiny]\ndescription: d\nsampler: {vllm_sleep: true}\n")
    with pytest.raises(RecipeError, match=rf"^{recipe}: key 'sampler.vllm_sleep': no longer a key: use sampler.vllm.sleep$"):
        load_recipe(str(recipe))
    with pytest.raises(RecipeError, match="unknown option 'slep' \\(did you mean 'sleep'\\?\\)"):
        load_recipe("tiny", ["sampler.vllm.slep=true"])
    assert to_dataclass(load_recipe("tiny", ["sampler.vllm.sleep=true"])).sampler.vllm_options.sleep
    assert set(MOVED_KEYS) <= set(RETIRED_KEYS)
    old = {"vllm_sleep": True, "gpu_memory_utilization": 0.4, "group_size": 4}
    validate_checkpoint_hparams({"model": asdict(ModelConfig()), "sampler": old}, "old.ckpt")
    assert _current(old, "sampler") == {"group_size": 4, "vllm": {"gpu_memory_utilization": 0.4, "sleep": True}}


def test_paired_keys_of_an_earlier_version_become_one_value() -> None:
    """``grpo.mask_ratio_low/high``, ``grpo.overlong: penalty`` with ``overlong_penalty`` and
    ``task.min/max_solve_rate`` as a checkpoint saved them load as today's single keys."""
    from tclightning.grpo.module import _current

    old_grpo = {"overlong": "penalty", "overlong_penalty": 0.5, "mask_ratio_low": 0.5, "mask_ratio_high": 2.0}
    assert _current(old_grpo, "grpo") == {"overlong": 0.5, "mask_ratio": [0.5, 2.0]}
    assert _current({"overlong": "mask", "overlong_penalty": 1.0, "mask_ratio_low": 0.0, "mask_ratio_high": 0.0},
                    "grpo") == {"overlong": "mask", "mask_ratio": None}
    assert _current({"min_solve_rate": 0.2, "max_solve_rate": None}, "task") == {"solve_rate": [0.2, None]}
    with pytest.raises(RecipeError, match="'grpo.mask_ratio_low=0.5': no longer a key: use grpo.mask_ratio: \\[low, high\\]"):
        load_recipe("tiny", ["grpo.mask_ratio_low=0.5"])
    with pytest.raises(RecipeError, match="low below high"):
        load_recipe("tiny", ["grpo.mask_ratio=[2, 1]"])
    assert to_dataclass(load_recipe("tiny", ["grpo.overlong=1.0"])).grpo.overlong_penalty == 1.0
    with pytest.raises(RecipeError, match="expected none, mask or a penalty"):
        load_recipe("tiny", ["grpo.overlong=penalty"])


def test_anchor_keys_of_an_earlier_version_load_in_todays_keys() -> None:
    """``anchor.cv_weight/cv_clip`` and ``projector_gamma/window`` move into their mappings;
    ``warmup: none`` is ``warmup_ticks: 0`` (la_warmup keeps its ticks)."""
    from tclightning.grpo.module import _current

    old = {"cv_weight": 0.5, "cv_clip": 0.25, "projector_gamma": 0.7, "projector_window": 4, "warmup": "none",
           "warmup_ticks": 100}
    assert _current(old, "anchor") == {"control_variate": {"weight": 0.5, "clip": 0.25},
                                       "projector_options": {"gamma": 0.7, "window": 4}, "warmup_ticks": 0}
    assert _current({"warmup": "la_warmup", "warmup_ticks": 60}, "anchor") == {"warmup_ticks": 60}
    with pytest.raises(RecipeError, match="no longer a key: use anchor.control_variate.clip"):
        load_recipe("robust-5-5", ["anchor.cv_clip=0.5"])
    with pytest.raises(RecipeError, match="no longer a key: use anchor.warmup_ticks"):
        load_recipe("tiny", ["anchor.warmup=la_warmup"])


def test_logging_loggers_lists_the_runs_own_loggers_and_an_earlier_record_says_the_same() -> None:
    from tclightning.recipes.schema import upgrade_sections

    assert to_dataclass(load_recipe("tiny")).logging.loggers == ["tensorboard", "csv"]
    with pytest.raises(RecipeError, match="'logging.tensorboard=false': no longer a key: use logging.loggers"):
        load_recipe("tiny", ["logging.tensorboard=false"])
    old = {"logging": {"tensorboard": False, "csv": True, "loggers": ["wandb"], "progress": "none"}}
    assert upgrade_sections(old)["logging"] == {"loggers": ["csv", "wandb"], "progress": "none"}


@pytest.mark.parametrize(("override", "hint"), [
    ("sampler.seed=3", "set trainer.seed"),
    ("model.warmup.seed=3", "the warm-up draws with a fixed seed"),
    ("pipeline.seed=3", "the PRF key is fixed"),
])
def test_a_retired_seed_is_refused_saying_what_seeds_the_run(override: str, hint: str) -> None:
    with pytest.raises(RecipeError, match=f"override '{re.escape(override)}': no longer a key: {hint}"):
        load_recipe("tiny", [override])


def test_the_clip_pair_of_an_earlier_version_is_one_key() -> None:
    from tclightning.grpo.module import _current

    assert _current({"clip_low": 0.1, "clip_high": 0.3}, "grpo") == {"clip": [0.1, 0.3]}
    cfg = to_dataclass(load_recipe("tiny", ["grpo.clip=[0.1, 0.3]"])).grpo
    assert (cfg.clip_low, cfg.clip_high) == (0.1, 0.3)
    with pytest.raises(RecipeError, match="'grpo.clip_high=0.3': no longer a key: use grpo.clip: \\[low, high\\]"):
        load_recipe("tiny", ["grpo.clip_high=0.3"])


def test_the_lowrank_basis_options_are_one_mapping_and_an_earlier_record_carries_them() -> None:
    from tclightning.recipes.schema import upgrade_sections

    old = {"refresh_every": 10, "first_fit": "ship", "refresh_tolerance": 0.02, "basis_tokens": 1024, "rate": 0.05}
    assert upgrade_sections({"pipeline": old})["pipeline"] == {
        "rate": 0.05, "basis": {"refresh_every": 10, "first_fit": "ship", "refresh_tolerance": 0.02, "tokens": 1024}}
    cfg = to_dataclass(load_recipe("smollm2-fast-only-lowrank")).pipeline
    assert (cfg.first_fit, cfg.refresh_every, cfg.basis_tokens) == ("ship", 10, 1024)
    with pytest.raises(RecipeError, match="'pipeline.basis_tokens=0': no longer a key: use pipeline.basis.tokens"):
        load_recipe("tiny", ["pipeline.basis_tokens=0"])


def test_the_shallow_count_of_an_earlier_version_is_the_layouts_count() -> None:
    from tclightning.recipes.schema import upgrade_sections

    assert upgrade_sections({"pipeline": {"layout": "shallow", "shallow_count": 2}})["pipeline"] == {"layout": "shallow:2"}
    assert upgrade_sections({"pipeline": {"layout": "shallow", "shallow_count": 1}})["pipeline"] == {"layout": "shallow"}
    assert upgrade_sections({"pipeline": {"layout": "all", "shallow_count": 3}})["pipeline"] == {"layout": "all"}
    assert to_dataclass(load_recipe("tiny", ["pipeline.layout=shallow:2"])).pipeline.layout == "shallow:2"
    with pytest.raises(RecipeError, match="'pipeline.shallow_count=2': no longer a key: set pipeline.layout=shallow:"):
        load_recipe("tiny", ["pipeline.shallow_count=2"])


def test_a_run_s_recipe_record_loads_back_as_the_same_recipe(tmp_path: Path) -> None:
    """The record a run writes (``recipe.yaml``: presets expanded into ``callbacks``) given back
    as ``--recipe`` is the same recipe, its preset callbacks once."""
    from tclightning.recipes.loader import instantiate_callbacks, load_recipe, to_yaml

    cfg = load_recipe("tiny")
    assert len(cfg.callbacks) > 0 and list(cfg.callback_presets) == []
    record = tmp_path / "recipe.yaml"
    record.write_text(to_yaml(cfg))
    again = load_recipe(str(record))
    assert to_yaml(again) == to_yaml(cfg)
    names = [type(c).__name__ for c in instantiate_callbacks(again, str(record))]
    assert names == [type(c).__name__ for c in instantiate_callbacks(cfg, "tiny")] and len(names) == len(set(names))


@pytest.mark.parametrize("override, text", [("logging.name=no", "no"), ("logging.name=1e3", "1e3"),
                                            ("logging.name=0x1F", "0x1F"), ("task.system_prompt=yes", "yes")])
def test_a_text_key_on_the_command_line_is_the_text_typed(override: str, text: str) -> None:
    """YAML 1.1 reads `no` as false and `0x1F` as 31; OmegaConf would store "False" and "31"."""
    from tclightning.recipes.loader import load_recipe

    cfg = load_recipe("tiny", [override])
    section, key = override.partition("=")[0].split(".")
    assert cfg[section][key] == text


def test_a_boolean_in_a_text_key_of_a_file_is_refused(tmp_path: Path) -> None:
    from tclightning.errors import RecipeError
    from tclightning.recipes.loader import load_recipe

    recipe = tmp_path / "mine.yaml"
    recipe.write_text("description: x\ndefaults: [tiny]\nlogging:\n  name: no\n")
    with pytest.raises(RecipeError, match=r"key 'logging.name'.*boolean false.*quote it"):
        load_recipe(str(recipe))


@pytest.mark.timeout(60)  # a regression waits on the FIFO: fail instead
@pytest.mark.parametrize("planted", ["fifo", "folder"])
def test_a_callback_preset_that_is_no_file_is_named_as_what_it_is(tmp_path, monkeypatch, capsys, planted):
    """A FIFO named evil.yaml on the preset search path was called an unknown preset, in a line
    that listed evil among the known ones."""
    import os

    (tmp_path / "cb").mkdir()
    os.mkfifo(tmp_path / "cb" / "evil.yaml") if planted == "fifo" else (tmp_path / "cb" / "evil.yaml").mkdir()
    monkeypatch.setenv("TCLIGHTNING_CALLBACKS", str(tmp_path / "cb"))
    capsys.readouterr()
    assert main(["recipes", "show", "tiny", "callback_presets=[evil]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "evil.yaml" in err[0] and "unknown callback preset" not in err[0], err
    assert ("named pipe" if planted == "fifo" else "is a directory") in err[0], err
