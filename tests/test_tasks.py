"""Tasks (tclightning.tasks): config, registry, arithmetic, GSM8K / MATH loading from the
shared data and from local files, and the Task.reward contract."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from tclightning.errors import TclightningError
from tclightning.tasks import Example, Task, TaskConfig, build_task, shared_data_dir
from tclightning.tasks.arithmetic import ALPHABET
from tests.conftest import require_shared_data

DATA = shared_data_dir()
@pytest.fixture()
def needs_data_fixture() -> None:
    require_shared_data(DATA)


needs_data = pytest.mark.usefixtures("needs_data_fixture")


def _prompts(examples: Sequence[Example]) -> set[str]:
    return {e.prompt for e in examples}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _gsm8k_rows(n: int, offset: int = 0) -> list[dict]:
    return [
        {
            "question": f"Tom has {i} apples and gets 2 more. How many?",
            "answer": f"{i}+2=<<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}",
        }
        for i in range(offset, offset + n)
    ]


# --------------------------------------------------------------------------- config, registry


def test_task_config_is_an_omegaconf_structured_config() -> None:
    base = OmegaConf.structured(TaskConfig)
    assert base.name == "arithmetic" and base.path is None and base.eval_size == 64
    merged = OmegaConf.merge(
        base,
        OmegaConf.create(
            {"name": "gsm8k", "hf_name": "openai/gsm8k", "hf_config": "main", "train_size": 10}
        ),
    )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, TaskConfig)
    assert (cfg.name, cfg.hf_config, cfg.train_size) == ("gsm8k", "main", 10)
    with pytest.raises(ValidationError):  # typed: a string where an int belongs is rejected
        OmegaConf.merge(base, OmegaConf.create({"eval_size": "many"}))


def test_build_task_unknown_name_lists_known_tasks() -> None:
    with pytest.raises(TclightningError) as info:
        build_task(TaskConfig(name="gsm9k"))
    message = str(info.value)
    assert "gsm9k" in message
    assert all(name in message for name in ("arithmetic", "gsm8k", "math"))


def test_build_task_accepts_an_omegaconf_node() -> None:
    node = OmegaConf.merge(OmegaConf.structured(TaskConfig), {"num_train": 10, "eval_size": 4})
    task = build_task(node)  # type: ignore[arg-type]
    assert task.name == "arithmetic" and len(task.train_examples()) == 10


def test_prompt_template_must_name_the_question() -> None:
    with pytest.raises(TclightningError, match="question"):
        build_task(TaskConfig(name="gsm8k", prompt_template="Solve this."))


def test_shared_data_dir_honours_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TCLIGHTNING_DATA", raising=False)
    assert shared_data_dir() == Path(__file__).resolve().parents[2] / "shared" / "data"
    monkeypatch.setenv("TCLIGHTNING_DATA", str(tmp_path))
    assert shared_data_dir() == tmp_path


# --------------------------------------------------------------------------- Task contract


class _Broken(Task):
    name = "broken"

    def __init__(self, value: object) -> None:
        self.value = value

    def train_examples(self) -> Sequence[Example]:
        return ()

    def eval_examples(self) -> Sequence[Example]:
        return ()

    def score(self, completion: str, example: Example) -> float:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value  # type: ignore[return-value]


def test_reward_never_raises_and_stays_in_unit_interval() -> None:
    ex = Example("t/0", "p", "1", "1")
    assert _Broken(RuntimeError("verifier bug")).reward("x", ex) == 0.0
    assert _Broken(math.nan).reward("x", ex) == 0.0
    assert _Broken(5.0).reward("x", ex) == 1.0
    assert _Broken(-2.0).reward("x", ex) == 0.0
    assert _Broken(0.5).reward("x", ex) == 0.5
    assert _Broken(0.5).reward(None, ex) == 0.0  # type: ignore[arg-type]
    assert _Broken(0.5).rewards(["a", "b"], [ex, ex]) == [0.5, 0.5]
    with pytest.raises(ValueError):
        _Broken(0.5).rewards(["a"], [ex, ex])


# --------------------------------------------------------------------------- arithmetic


def test_arithmetic_is_deterministic_disjoint_and_correct() -> None:
    cfg = TaskConfig(name="arithmetic", num_train=500, eval_size=50, operations="+-*")
    task = build_task(cfg)
    train, evals = task.train_examples(), task.eval_examples()
    assert (len(train), len(evals)) == (500, 50)
    assert list(train) == list(build_task(cfg).train_examples())  # same config, same data
    assert list(evals) == list(build_task(cfg).eval_examples())
    assert not _prompts(train) & _prompts(evals)
    assert len(_prompts(train)) == 500  # no repeats within train either
    assert len({e.uid for e in [*train, *evals]}) == 550
    seen_ops = set()
    for e in [*train, *evals]:
        assert set(e.prompt) <= ALPHABET, e.prompt
        assert e.prompt.endswith("=")
        a, op, b = next((e.prompt[:-1].partition(op)) for op in "+-*" if op in e.prompt)
        seen_ops.add(op)
        assert 0 <= int(a) < 100 and 0 <= int(b) < 100
        assert (
            int(e.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        )
        assert int(e.answer) >= 0 and e.solution == e.answer
    assert seen_ops == {"+", "-", "*"}
    other_seed = build_task(
        TaskConfig(name="arithmetic", num_train=500, eval_size=50, operations="+-*", seed=1)
    )
    assert list(other_seed.train_examples()) != list(train)


def test_arithmetic_eval_set_does_not_move_with_train_size() -> None:
    small = build_task(TaskConfig(num_train=10, eval_size=20))
    large = build_task(TaskConfig(num_train=2000, eval_size=20))
    assert list(small.eval_examples()) == list(large.eval_examples())
    assert list(small.train_examples()) == list(large.train_examples())[:10]


def test_arithmetic_large_space_uses_sampling() -> None:
    task = build_task(TaskConfig(digits=4, operations="*", num_train=300, eval_size=30))
    train, evals = task.train_examples(), task.eval_examples()
    assert len(train) == 300 and not _prompts(train) & _prompts(evals)
    assert list(train) == list(
        build_task(
            TaskConfig(digits=4, operations="*", num_train=300, eval_size=30)
        ).train_examples()
    )
    assert max(len(e.prompt) for e in train) > 6  # 4-digit operands do appear


def test_arithmetic_small_space_is_capped_or_rejected() -> None:
    task = build_task(TaskConfig(digits=1, operations="+", num_train=5000, eval_size=64))
    assert len(task.train_examples()) == 100 - 64  # all distinct 1-digit sums, none reused
    with pytest.raises(TclightningError, match="distinct problems"):
        build_task(TaskConfig(digits=1, operations="+", eval_size=100)).train_examples()
    with pytest.raises(TclightningError, match="operations"):
        build_task(TaskConfig(operations="+/"))
    with pytest.raises(TclightningError, match="digits"):
        build_task(TaskConfig(digits=0))


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("85", 1.0),
        ("  85\n", 1.0),
        ("85 is it", 1.0),
        ("085", 1.0),
        ("it is 85", 1.0),
        ("8 5", 0.0),
        ("-85", 0.0),
        ("84", 0.0),
        ("86 not 85", 0.0),
        ("", 0.0),
        ("abc", 0.0),
        ("9" * 100_000, 0.0),
        ("\x00", 0.0),
        ("\u0668\u0665", 0.0),  # 85 in Arabic-Indic digits: int() reads them, the reward does not
        ("\uff18\uff15", 0.0),  # fullwidth 85
    ],
)
def test_arithmetic_reward(completion: str, reward: float) -> None:
    task = build_task(TaskConfig())
    ex = Example("arithmetic/x/0", "37+48=", "85", "85")
    assert task.reward(completion, ex) == reward


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("37 + 48 = 85", 1.0),  # a chat model restating the problem
        ("The answer is 85.", 1.0),
        ("85", 1.0),
        ("85, not 84", 0.0),
        ("37 + 48", 0.0),
        ("-85", 0.0),
        ("no number", 0.0),
        ("1 " + "9" * 100, 0.0),  # a giant last run is no answer
    ],
)
def test_arithmetic_reward_reads_the_last_integer_when_asked(completion: str, reward: float) -> None:
    task = build_task(TaskConfig(answer_at="last"))
    ex = Example("arithmetic/x/0", "37+48=", "85", "85")
    assert task.reward(completion, ex) == reward
    assert build_task(TaskConfig()).reward("37 + 48 = 85", ex) == 0.0  # the default reads the first


def test_arithmetic_answer_at_refuses_bad_values() -> None:
    with pytest.raises(TclightningError, match="answer_at must be 'first' or 'last'"):
        build_task(TaskConfig(answer_at="middle"))
    with pytest.raises(TclightningError, match="does not combine with task.reverse_answer"):
        build_task(TaskConfig(answer_at="last", reverse_answer=True))


# --------------------------------------------------------------------------- shared data


@needs_data
def test_gsm8k_from_the_shared_copy() -> None:
    task = build_task(TaskConfig(name="gsm8k", eval_size=16, system_prompt="Be brief."))
    train, evals = task.train_examples(), task.eval_examples()
    assert len(train) == 7473 and len(evals) == 16
    assert all(e.uid.startswith("gsm8k/train/") for e in train)
    assert all(e.uid.startswith("gsm8k/test/") for e in evals)  # held out = the test split
    assert not _prompts(train) & _prompts(evals)
    assert task.system_prompt == "Be brief."
    first = train[0]
    assert first.answer == "72" and first.prompt.startswith("Natalia sold clips")
    assert "The answer is N." in first.prompt
    assert "<<" not in first.solution and first.solution.endswith("The answer is 72.")
    sample = [*train[:50], *evals]
    assert task.rewards([e.solution for e in sample], sample) == [1.0] * len(sample)
    assert task.reward("The answer is 73.", first) == 0.0


@needs_data
def test_math500_carves_a_deterministic_held_out_set() -> None:
    cfg = TaskConfig(name="math", eval_size=50, seed=3)
    task = build_task(cfg)
    train, evals = task.train_examples(), task.eval_examples()
    assert (len(train), len(evals)) == (450, 50)  # MATH-500 has only "test": cut from it
    assert not {e.uid for e in train} & {e.uid for e in evals}
    assert not _prompts(train) & _prompts(evals)
    assert [e.uid for e in evals] == [e.uid for e in build_task(cfg).eval_examples()]
    assert [e.uid for e in evals] != [
        e.uid for e in build_task(TaskConfig(name="math", eval_size=50)).eval_examples()
    ]
    assert all("\\boxed{}" in e.prompt for e in train)
    assert all(e.answer and "The answer is:" not in e.solution for e in [*train, *evals])
    sample = [*train[:40], *evals[:10]]
    assert task.rewards([e.solution for e in sample], sample) == [1.0] * len(sample)
    assert task.rewards([r"\boxed{\sqrt{7}+1234}"] * 5, list(evals[:5])) == [0.0] * 5


# --------------------------------------------------------------------------- local files


def test_gsm8k_from_a_local_directory_with_two_splits(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(30))
    _write_jsonl(tmp_path / "test.jsonl", _gsm8k_rows(10, offset=100))
    cfg = TaskConfig(
        name="gsm8k",
        path=str(tmp_path),
        eval_size=4,
        train_size=20,
        prompt_template="Q: {question} (use \\boxed{})",
        instruction="",
    )
    task = build_task(cfg)
    train, evals = task.train_examples(), task.eval_examples()
    assert len(train) == 20 and len(evals) == 4
    assert train[0].prompt == "Q: Tom has 0 apples and gets 2 more. How many? (use \\boxed{})"
    assert train[0].answer == "2" and evals[0].uid.startswith("gsm8k/test/")
    assert all(int(e.answer) >= 102 for e in evals)


def test_single_file_is_cut_into_train_and_eval(tmp_path: Path) -> None:
    rows = _gsm8k_rows(40) + [{"question": "broken row"}]  # index 40: no answer, skipped
    rows += [{"question": "Tom has 0 apples and gets 2 more. How many?", "answer": "#### 2"}]
    _write_jsonl(tmp_path / "mine.jsonl", rows)
    # seed 3 holds out row 0 but not its duplicate, row 41: the duplicate must leave train.
    task = build_task(
        TaskConfig(name="gsm8k", path=str(tmp_path / "mine.jsonl"), eval_size=10, seed=3)
    )
    train, evals = task.train_examples(), task.eval_examples()
    assert "gsm8k/mine/0" in {e.uid for e in evals}
    assert (len(train), len(evals)) == (30, 10)
    assert "gsm8k/mine/41" not in {e.uid for e in train}
    assert not _prompts(train) & _prompts(evals)


def test_missing_data_and_splits_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TclightningError, match="not found"):
        build_task(TaskConfig(name="gsm8k", path=str(tmp_path / "nope"))).train_examples()
    _write_jsonl(tmp_path / "train.jsonl", _gsm8k_rows(5))
    _write_jsonl(tmp_path / "test.jsonl", _gsm8k_rows(5))
    with pytest.raises(TclightningError, match="available"):
        build_task(
            TaskConfig(name="gsm8k", path=str(tmp_path), split="validation")
        ).train_examples()
    with pytest.raises(TclightningError, match="eval_split"):
        build_task(TaskConfig(name="gsm8k", path=str(tmp_path), eval_split="dev")).train_examples()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train.jsonl").write_text('{"question": "x"\n')
    with pytest.raises(TclightningError, match="train.jsonl:1"):
        build_task(TaskConfig(name="gsm8k", path=str(tmp_path / "bad"))).train_examples()


def test_math_from_parquet_through_datasets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets")
    # The same datasets.load_dataset call the hub path makes; keep its cache in tmp_path.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    rows = [  # the three row shapes: HF MATH-500 / Big-Math, Hendrycks MATH
        {
            "problem": f"What is {i}/2?",
            "solution": f"Halve it: $\\boxed{{\\frac{{{i}}}{{2}}}}$",
            "answer": f"\\frac{{{i}}}{{2}}",
        }
        for i in range(1, 9)
    ] + [{"problem": "Compute 1+1.", "solution": "It is $\\boxed{2}$.", "answer": None}]
    data = tmp_path / "data"
    data.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(data / "test.parquet"))
    task = build_task(TaskConfig(name="math", path=str(data), eval_size=3))
    train, evals = task.train_examples(), task.eval_examples()
    assert (len(train), len(evals)) == (6, 3)
    by_question = {e.prompt.split("\n")[0]: e for e in [*train, *evals]}
    assert by_question["What is 3/2?"].answer == "\\frac{3}{2}"
    assert by_question["Compute 1+1."].answer == "2"
    ex = by_question["What is 3/2?"]
    assert task.reward("so it is \\boxed{1.5}", ex) == 1.0
    assert task.reward("so it is \\boxed{3}", ex) == 0.0


def test_arithmetic_reverse_answer_keeps_leading_zeros() -> None:
    from tclightning.tasks import TaskConfig, build_task

    task = build_task(TaskConfig(name="arithmetic", reverse_answer=True, eval_size=8, num_train=200))
    examples = list(task.train_examples()) + list(task.eval_examples())
    for example in examples:
        a, b = example.prompt.rstrip("=").split("+")
        assert example.answer == str(int(a) + int(b))[::-1] == example.solution
        assert task.reward(example.answer, example) == 1.0
        assert task.reward(example.answer[::-1] + "9", example) == 0.0 or example.answer[::-1] == example.answer
    forty_sixty = next((e for e in examples if e.answer.startswith("0")), None)
    if forty_sixty is not None:  # "0..." answers must match as strings, not integers
        assert task.reward(forty_sixty.answer.lstrip("0") or "1", forty_sixty) == 0.0


@pytest.mark.parametrize("nesting", ["column", "list", "struct"])
def test_a_task_file_s_declared_image_column_is_never_opened(tmp_path: Path, nesting: str) -> None:
    """A parquet file may declare a column an Image (or a list of them, or a struct holding one)
    whose rows name files: a FIFO (or a URL, or a huge PNG) there would be opened, fetched or
    decoded per row. Rows are read as values."""
    import os
    import signal

    from datasets import Dataset, Features, Image, List, Value

    from tclightning.tasks.data import read_rows

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    picture = {"path": str(fifo), "bytes": None}
    feature, value = {"column": (Image(), picture), "list": (List(Image()), [picture]),
                      "struct": ({"figure": Image()}, {"figure": picture})}[nesting]
    features = Features({"question": Value("string"), "answer": Value("string"), "picture": feature})
    Dataset.from_dict({"question": ["q"], "answer": ["#### 1"], "picture": [value]},
                      features=features).to_parquet(tmp_path / "rows.parquet")
    previous = signal.signal(signal.SIGALRM, lambda *args: pytest.fail("the row's file was opened"))
    signal.alarm(30)
    try:
        rows = read_rows(tmp_path / "rows.parquet")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert rows == [{"question": "q", "answer": "#### 1", "picture": value}]
    chained = tmp_path / "a::b.csv"  # fsspec would read "…/a", then "b.csv" inside it (datasets reads a csv)
    chained.write_text("question,answer\nq,#### 1\n")
    with pytest.raises(TclightningError, match="holds '::'"):
        read_rows(chained)


def test_a_parquet_file_that_expands_past_the_bounds_is_refused_as_it_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight rows of a 105 KB parquet file held 3.2 GB once read, and the run was killed without a
    word: a row past ROW_MAX_BYTES decoded, or rows past TASK_FILE_MAX_BYTES in all, are one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tclightning.tasks import data
    from tclightning.tasks.data import read_rows

    long = "x" * (data.ROW_MAX_BYTES + 1)
    pq.write_table(pa.table({"question": [long] * 4, "answer": ["#### 1"] * 4}), tmp_path / "bomb.parquet",
                   compression="zstd")
    assert (tmp_path / "bomb.parquet").stat().st_size < 100_000
    with pytest.raises(TclightningError, match=r"bomb.parquet: row 1 holds \d+ bytes decoded, more than a row may"):
        read_rows(tmp_path / "bomb.parquet")
    pq.write_table(pa.table({"question": ["y" * 100_000] * 40, "answer": ["#### 1"] * 40}), tmp_path / "many.parquet",
                   compression="zstd")
    monkeypatch.setattr(data, "TASK_FILE_MAX_BYTES", 2_000_000)
    with pytest.raises(TclightningError, match="many.parquet: its rows hold more than 2000000 bytes decoded"):
        read_rows(tmp_path / "many.parquet")
    monkeypatch.setattr(data, "TASK_FILE_MAX_BYTES", 8_000_000)
    assert len(read_rows(tmp_path / "many.parquet")) == 40


def test_a_parquet_or_csv_file_read_here_only_in_part_is_one_line(tmp_path: Path) -> None:
    """A .parquet date past Python's range was an OverflowError traceback; a .parquet column named
    twice kept the second silently; a .csv header field past the csv module's limit let datasets
    guess the columns' types (integer answers through float64 again)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tclightning.tasks.data import read_rows

    pq.write_table(pa.table({"question": ["q"], "answer": pa.array([2**31 - 1], pa.int32()).cast(pa.date32())}),
                   tmp_path / "date.parquet")
    with pytest.raises(TclightningError, match="date.parquet: not a readable parquet file"):
        read_rows(tmp_path / "date.parquet")
    pq.write_table(pa.Table.from_arrays([pa.array(["q"]), pa.array(["#### 1"]), pa.array(["#### 2"])],
                                        names=["question", "answer", "answer"]), tmp_path / "twice.parquet")
    with pytest.raises(TclightningError, match="twice.parquet: the column 'answer' appears twice"):
        read_rows(tmp_path / "twice.parquet")
    (tmp_path / "long.csv").write_text(f"question,answer,{'x' * 200_000}\nq,9007199254740993,\n")
    with pytest.raises(TclightningError, match="long.csv: its header is no CSV line read here"):
        read_rows(tmp_path / "long.csv")
    (tmp_path / "long-cell.csv").write_text(f"question,answer\nq,1\n{'x' * 200_000},2\n")
    with pytest.raises(TclightningError, match="long-cell.csv: a row is no CSV line read here"):
        read_rows(tmp_path / "long-cell.csv")


def test_a_csv_row_of_more_cells_than_its_header_is_one_line(tmp_path: Path) -> None:
    """pandas made a longer row's first cells an index: every row was read a column shifted
    (the question as the answer), silently."""
    from tclightning.tasks.data import read_rows

    (tmp_path / "shifted.csv").write_text("question,answer\nwhat is 1+1?,2,extra\nwhat is 2+2?,4,extra\n")
    with pytest.raises(TclightningError, match="shifted.csv: row 1 has more cells than its header has columns"):
        read_rows(tmp_path / "shifted.csv")
    (tmp_path / "one-long.csv").write_text('question,answer\n\n"a, quoted",1\nq2,2\nq3,3,x,y\n')
    with pytest.raises(TclightningError, match="one-long.csv: row 3 has more cells"):
        read_rows(tmp_path / "one-long.csv")
    (tmp_path / "short.csv").write_text('question,answer\n"a, quoted",1\nq2\n')  # a missing cell is missing
    assert read_rows(tmp_path / "short.csv") == [{"question": "a, quoted", "answer": "1"},
                                                 {"question": "q2", "answer": None}]


def test_a_task_file_of_more_columns_than_read_is_one_line(tmp_path: Path) -> None:
    """A 2 MB .csv of 160,000 columns held the reader for many minutes (a task reads a few)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tclightning.tasks.data import MAX_COLUMNS, read_rows

    names = ["question", "answer", *(f"c{i}" for i in range(MAX_COLUMNS))]
    (tmp_path / "wide.csv").write_text(",".join(names) + "\n" + ",".join(["q", "#### 1"] + ["x"] * MAX_COLUMNS) + "\n")
    pq.write_table(pa.table({name: ["x"] for name in names}), tmp_path / "wide.parquet")
    (tmp_path / "blank-first.csv").write_text("\n\r\n" + (tmp_path / "wide.csv").read_text())  # header: its first row
    for wide in ("wide.csv", "wide.parquet", "blank-first.csv"):
        with pytest.raises(TclightningError, match=f"{wide}: {MAX_COLUMNS + 2} columns, more than the {MAX_COLUMNS}"):
            read_rows(tmp_path / wide)


def test_a_numeric_answer_field_is_an_answer(tmp_path: Path) -> None:
    """``"answer": 42`` (a JSON number, as many exports write it) was skipped as a row without an answer."""
    from tclightning.tasks import TaskConfig, build_task

    rows = [{"question": f"What is {i} + {i}?", "answer": 2 * i} for i in range(6)]
    rows.append({"question": "Is it?", "answer": True})  # a boolean is no answer
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = build_task(TaskConfig(name="gsm8k", path=str(tmp_path / "rows.jsonl"), eval_size=2))
    examples = [*task.train_examples(), *task.eval_examples()]
    assert task.eval_examples() and sorted(int(example.answer) for example in examples) == [0, 2, 4, 6, 8, 10]
    assert task.reward("The answer is 10.", next(e for e in examples if e.answer == "10")) == 1.0
    assert task.skipped is not None and "1 of the rows read had no usable question or answer" in task.skipped
    # an integer past any float (309 digits and more) is an answer too: it was an OverflowError traceback
    big = 10**400
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "answer": big + i}) + "\n"
                                                for i in range(4)) + json.dumps({"question": big, "answer": 1}) + "\n")
    task = build_task(TaskConfig(name="math", path=str(tmp_path / "big.jsonl"), eval_size=1))
    assert sorted(e.answer for e in [*task.train_examples(), *task.eval_examples()]) == \
        sorted([str(big + i) for i in range(4)] + ["1"])


def test_a_float_answer_field_is_written_in_digits(tmp_path: Path) -> None:
    """``"answer": 1e16`` was the gold text ``1e+16``, which math-verify reads as e + 16 (Euler's
    e): ``\\boxed{e+16}`` scored 1.0 and the right ``\\boxed{10^{16}}`` 0.0."""
    from tclightning.tasks import TaskConfig, build_task

    rows = [{"problem": f"Ten to the sixteenth, {i}?", "answer": 1e16} for i in range(3)]
    rows += [{"problem": f"A hundred-thousandth, {i}?", "answer": 1e-05} for i in range(3)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = build_task(TaskConfig(name="math", path=str(tmp_path / "rows.jsonl"), eval_size=1))
    examples = {e.answer: e for e in [*task.train_examples(), *task.eval_examples()]}
    assert set(examples) == {"10000000000000000", "0.00001"}
    big, small = examples["10000000000000000"], examples["0.00001"]
    assert task.reward(r"\boxed{10^{16}}", big) == task.reward(r"\boxed{10^{-5}}", small) == 1.0
    assert task.reward(r"\boxed{e+16}", big) == task.reward(r"\boxed{e-05}", small) == 0.0


def test_a_test_split_without_usable_rows_is_one_line(tmp_path: Path) -> None:
    """An empty (or answerless) test split ended the run in a torch.cat traceback at its first validation."""
    from tclightning.tasks import TaskConfig, build_task

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"{i}+1", "answer": f"#### {i + 1}"}) + "\n"
                                                  for i in range(20)))
    for test in ("", json.dumps({"question": "1+1"}) + "\n"):
        (tmp_path / "test.jsonl").write_text(test)
        with pytest.raises(TclightningError, match="no usable held-out rows for task 'gsm8k' \\(its split 'test'\\)"):
            build_task(TaskConfig(name="gsm8k", path=str(tmp_path), eval_size=4)).eval_examples()


def test_a_run_says_how_many_rows_of_its_data_it_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """360 of 400 rows without a usable answer were dropped without a word, and the run trained on 40."""
    from tclightning.cli.main import main
    from tests.conftest import FAST

    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}" if i % 10 == 0 else ["x"]} for i in range(400)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--recipe", "tiny", *FAST, "task.name=gsm8k", f"task.path={tmp_path / 'rows.jsonl'}",
                 "trainer.steps=1", "trainer.val_every=0", "logging.root=runs", "--quiet"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert any("360 of the rows read had no usable question or answer" in line for line in notes), notes


def test_a_json_task_file_reads_as_datasets_reads_it(tmp_path: Path) -> None:
    """A ``.json`` file, one array of rows or JSON lines, gives the rows ``datasets`` gives (the
    project reads it with Python's own parser, which refuses deep nesting in one line)."""
    from tclightning.tasks.data import load_with_datasets, read_rows

    rows = [{"question": f"q{i} ünï", "answer": f"#### {i}"} for i in range(5)]
    (tmp_path / "array.json").write_text("\ufeff  " + json.dumps(rows, indent=2, ensure_ascii=False))
    (tmp_path / "lines.json").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name in ("array.json", "lines.json"):
        assert read_rows(tmp_path / name) == rows
    (tmp_path / "plain.json").write_text(json.dumps(rows))
    for name in ("plain.json", "lines.json"):
        assert load_with_datasets("json", split="train", data_files=str(tmp_path / name)) == rows


def test_a_split_gone_between_its_listing_and_its_read_is_one_line(tmp_path: Path) -> None:
    """A task folder's file removed after the splits were listed was a bare KeyError."""
    from tclightning.tasks.data import DataSource

    (tmp_path / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    source = DataSource(path=tmp_path)
    assert source.splits() == ["train"]
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(TclightningError, match="its split 'train' is gone"):
        source.rows("train")


def test_a_csv_task_file_s_integer_answers_keep_every_digit(tmp_path: Path) -> None:
    """An empty cell made pandas infer the answer column as float64: 9007199254740993 became
    9007199254740992.0 and 123456789012345678 became 1.2345678901234568e+17."""
    from tclightning.tasks.data import read_rows

    (tmp_path / "rows.csv").write_text("question,answer\nq1,9007199254740993\nq2,\nq3,123456789012345678\n")
    rows = read_rows(tmp_path / "rows.csv")
    assert [row["answer"] for row in rows] == ["9007199254740993", None, "123456789012345678"]
    assert [row["question"] for row in rows] == ["q1", "q2", "q3"]


@pytest.mark.parametrize("text", [" \nquestion,answer\nq,1\n", "\t\r\nquestion,answer\nq,1\n",
                                  ",question,answer\n0,q,1\n", "question,answer,\nq,1,\n"],
                         ids=["spaces-line-first", "tab-line-first", "pandas-index-column", "trailing-comma"])
def test_a_csv_task_file_pandas_reads_is_read_with_its_column_names(text: str, tmp_path: Path) -> None:
    """A line of white space before the header, or a header cell left empty (``DataFrame.to_csv``
    writes its index so), was refused with a KeyError line naming a field " " or ""."""
    from tclightning.tasks.data import read_rows

    (tmp_path / "rows.csv").write_text(text)
    (row,) = read_rows(tmp_path / "rows.csv")
    assert (row["question"], row["answer"]) == ("q", "1")


def test_a_csv_task_file_s_text_cells_are_text_however_they_read(tmp_path: Path) -> None:
    """pandas read the cells NA, None, null, NaN, n/a and #N/A as missing: a row whose answer is
    the word None was dropped as having none."""
    from tclightning.tasks.data import read_rows

    words = ["NA", "None", "null", "NaN", "n/a", "#N/A", "nan", "-NaN"]
    (tmp_path / "words.csv").write_text("question,answer\n" + "".join(f"{w},{w}\n" for w in words) + "q,\n")
    rows = read_rows(tmp_path / "words.csv")
    assert rows == [{"question": w, "answer": w} for w in words] + [{"question": "q", "answer": None}]
