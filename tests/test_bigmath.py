"""Big-Math: the loader reads local parquet / jsonl copies with the hub's columns, filters, and verifies answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.recipes.loader import load_recipe, to_dataclass
from tclightning.tasks import TaskConfig, build_task
from tclightning.tasks.bigmath import HF_NAME, BigMathTask

# The columns of SynthLabsAI/Big-Math-RL-Verified (its dataset card): problem, answer, source, domain, llama8b_solve_rate.
ROWS = [
    {"problem": f"Compute {a} + {b}.", "answer": str(a + b), "source": "orca_math", "domain": ["Arithmetic"],
     "llama8b_solve_rate": 0.9}
    for a, b in [(1, 2), (3, 4), (10, 5), (7, 8), (20, 22), (6, 6)]
] + [
    {"problem": "What is one half as a fraction?", "answer": "\\frac{1}{2}", "source": "MATH",
     "domain": ["Algebra"], "llama8b_solve_rate": 0.5},
    {"problem": "Solve x^2 = 4 for x > 0.", "answer": "2", "source": "olympiads", "domain": ["Algebra"],
     "llama8b_solve_rate": 0.1},
    {"problem": "Find the area of a unit square.", "answer": "1", "source": "cn_k12", "domain": ["Geometry"],
     "llama8b_solve_rate": None},
]


def write_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def write_parquet(path: Path) -> Path:
    import datasets

    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    return path


@pytest.fixture(params=["jsonl", "parquet"])
def local_copy(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    writer = write_jsonl if request.param == "jsonl" else write_parquet
    return writer(tmp_path / f"bigmath.{request.param}")


def test_loader_reads_a_local_sample(local_copy: Path) -> None:
    task = build_task(TaskConfig(name="bigmath", path=str(local_copy), eval_size=2, seed=3))
    assert isinstance(task, BigMathTask)
    train, evals = task.train_examples(), task.eval_examples()
    assert len(train) + len(evals) == len(ROWS) and len(evals) == 2
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in evals)
    by_question = {e.prompt.split("\n\n")[0]: e for e in [*train, *evals]}
    half = by_question["What is one half as a fraction?"]
    assert half.answer == "\\frac{1}{2}"
    assert "\\boxed{}" in half.prompt  # the MATH instruction: reason, then box the answer
    assert all(e.uid.startswith("bigmath/") for e in train)
    # every reference solution earns its own reward (the reward self-test of Example.solution)
    assert all(task.reward(e.solution, e) == 1.0 for e in [*train, *evals])


def test_rewards_boxed_and_plain_answers(tmp_path: Path) -> None:
    task = build_task(TaskConfig(name="bigmath", path=str(write_jsonl(tmp_path / "b.jsonl")), eval_size=1))
    examples = {e.answer: e for e in [*task.train_examples(), *task.eval_examples()]}
    half, three = examples["\\frac{1}{2}"], examples["3"]
    assert task.reward("So the result is \\boxed{0.5}.", half) == 1.0  # equal value, other form
    assert task.reward("It is $\\boxed{\\dfrac{1}{2}}$", half) == 1.0
    assert task.reward("\\boxed{\\frac{1}{3}}", half) == 0.0
    assert task.reward("1 + 2 = 3, so the answer is 3", three) == 1.0  # plain answer, no box
    assert task.reward("the answer is \\boxed{4}", three) == 0.0
    assert task.rewards(["\\boxed{3}", "no idea"], [three, three]) == [1.0, 0.0]


def test_filters_by_solve_rate_and_source(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "b.jsonl"))
    hard = build_task(TaskConfig(name="bigmath", path=path, eval_size=1, solve_rate=[None, 0.6]))
    kept = [*hard.train_examples(), *hard.eval_examples()]
    assert sorted(e.answer for e in kept) == ["2", "\\frac{1}{2}"]  # rate 0.5 and 0.1; the None row is dropped
    algebra = build_task(TaskConfig(name="bigmath", path=path, eval_size=1, sources=["MATH", "cn_k12"]))
    assert sorted(e.answer for e in [*algebra.train_examples(), *algebra.eval_examples()]) == ["1", "\\frac{1}{2}"]
    with pytest.raises(TclightningError, match="solve_rate: low 0.8 exceeds high 0.2"):
        BigMathTask(TaskConfig(name="bigmath", path=path, solve_rate=[0.8, 0.2]))


def test_a_csv_task_file_s_rates_filter_as_numbers(tmp_path: Path) -> None:
    """A .csv file's cells are read as text (its integer answers keep every digit): its solve rates
    still filter as the numbers they are, and an empty one is a missing rate."""
    import csv

    path = tmp_path / "b.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["problem", "answer", "source", "llama8b_solve_rate"])
        writer.writeheader()
        for row in ROWS:
            writer.writerow({**{k: row[k] for k in ("problem", "answer", "source")},
                             "llama8b_solve_rate": "" if row["llama8b_solve_rate"] is None else row["llama8b_solve_rate"]})
    hard = build_task(TaskConfig(name="bigmath", path=str(path), eval_size=1, solve_rate=[None, 0.6]))
    assert sorted(e.answer for e in [*hard.train_examples(), *hard.eval_examples()]) == ["2", "\\frac{1}{2}"]


@pytest.mark.parametrize("column, value, setting", [
    ("llama8b_solve_rate", "about half", {"solve_rate": [0.1, 0.9]}),
    ("llama8b_solve_rate", [0.5], {"solve_rate": [0.1, 0.9]}),
    ("llama8b_solve_rate", 10**400, {"solve_rate": [0.1, 0.9]}),
    ("source", ["MATH"], {"sources": ["MATH"]}),
], ids=["rate-a-text", "rate-a-list", "rate-past-any-float", "source-a-list"])
def test_a_filter_column_of_another_type_is_one_line(tmp_path: Path, column: str, value: object,
                                                     setting: dict) -> None:
    """A text or list where a filter reads a number or a name was a TypeError traceback."""
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({**row, column: value} if i == 0 else row) + "\n" for i, row in enumerate(ROWS)))
    with pytest.raises(TclightningError, match=f"task data: a row's {column} is .*, not a"):
        task = build_task(TaskConfig(name="bigmath", path=str(path), eval_size=1, **setting))
        task.train_examples()


def test_hub_name_by_default_and_a_clear_offline_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tclightning.tasks import data

    task = BigMathTask(TaskConfig(name="bigmath"))
    assert task.cfg.hf_name == HF_NAME  # loads SynthLabsAI/Big-Math-RL-Verified by name

    def offline(self: data.DataSource) -> list[str]:
        raise TclightningError(f"cannot list splits of {self.hf_name}: no network")

    monkeypatch.setattr(data.DataSource, "splits", offline)
    monkeypatch.setattr(data, "hub_answer", lambda path: None)  # whatever this machine's network does
    with pytest.raises(TclightningError, match="set task.path to a local .parquet/.jsonl"):
        task.train_examples()


def test_bigmath_recipe_uses_the_task_and_refuses_on_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = to_dataclass(load_recipe("bigmath_shallow"))
    assert recipe.task.name == "bigmath" and recipe.sampler.backend == "vllm"
    assert recipe.pipeline.layout == "shallow"
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--recipe", "bigmath_shallow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0]
    assert not (tmp_path / "runs").exists()
