"""Answer extraction and verification (tclightning.tasks.rewards) on real GSM8K / MATH-500
rows, malformed and adversarial text, and the time limit from main and worker threads."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tclightning.limits import run_with_alarm
from tclightning.tasks.rewards import (
    MAX_NUMERAL_EXPONENT,
    extract_answer_is,
    extract_boxed,
    extract_gsm8k_answer,
    gsm8k_completion_answer,
    last_number,
    load_math_verify,
    normalize_math_answer,
    numbers_equal,
    simple_math_equal,
    verify_gsm8k,
    verify_math,
)

from tclightning.tasks import shared_data_dir
from tests.conftest import require_shared_data

DATA = shared_data_dir()
PATHOLOGICAL = r"The answer is $\boxed{9^{9^{9^{9}}}}$."  # sympy grinds on this for minutes


@pytest.fixture(scope="module", autouse=True)
def _math_verify_imported() -> None:
    # Import once up front (outside every limit, as verify_math does on its first call), so
    # the timings below measure the calls, not the one-time import.
    assert load_math_verify()


def _rows(path: Path, lines: list[int]) -> list[dict]:
    require_shared_data(path)
    with path.open() as handle:
        all_rows = [json.loads(line) for line in handle]
    return [all_rows[i] for i in lines]


def _math500_gold(row: dict) -> str:
    return row["answer"].rsplit("The answer is:", 1)[1].strip()


# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{42}$.", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\fbox{7}", "7"),
        (r"\boxed {  x+1 }", "x+1"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped set braces do not close the box
        (r"\boxed{\boxed{3}}", r"\boxed{3}"),  # the outermost box wins
        (r"stray } brace \boxed{5}", "5"),
        ("no box at all 12", None),
        (r"\boxed{\frac{1}{2}", None),  # unclosed
        (r"\boxed{3} and later \boxed{4", None),  # the final answer is truncated
        (r"\boxed", None),
        ("", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_extract_boxed_is_linear_on_huge_adversarial_text() -> None:
    text = "\\boxed{" * 100_000 + "{" * 100_000 + "}" * 50_000
    start = time.monotonic()
    assert extract_boxed(text) is None
    assert extract_boxed("x" * 2_000_000 + r"\boxed{9}") == "9"
    assert time.monotonic() - start < 3.0


def test_number_extractors() -> None:
    assert last_number("1 then 2,500.75 and -3 apples") == "-3"
    assert last_number("costs $1,234.5 total") == "1234.5"
    assert last_number("none here") is None
    assert extract_gsm8k_answer("work\n#### $1,000\n") == "1000"
    assert extract_gsm8k_answer("#### 3\n#### -4 apples") == "-4"
    assert extract_gsm8k_answer("#### nothing") is None
    assert extract_gsm8k_answer("no marker 5") is None
    assert extract_answer_is("So the Answer is: $72. Then 5 more.") == "72"
    assert extract_answer_is("the answer is that we need many words before any number 9") is None
    # priority: boxed > #### > "The answer is" > last number
    assert gsm8k_completion_answer(r"The answer is 3. #### 4 \boxed{5} 6") == "5"
    assert gsm8k_completion_answer("The answer is 3. #### 4 then 6") == "4"
    assert gsm8k_completion_answer("The answer is 3. then 6") == "3"
    assert gsm8k_completion_answer("3 then 6") == "6"


def test_numbers_equal() -> None:
    assert numbers_equal("18.00", "18")
    assert numbers_equal("1,000", "1000")
    assert numbers_equal("$5.", "5")
    assert not numbers_equal("18.01", "18")
    assert not numbers_equal("abc", "abc")
    assert not numbers_equal(None, "1")
    assert not numbers_equal("nan", "nan")


def test_numerals_past_the_caps_are_refused_before_any_arithmetic() -> None:
    start = time.monotonic()
    # Fraction(Decimal("1e99999999")) alone ran for minutes: these must not build anything.
    for huge in ("1e99999999", "1e-99999999", "0e99999999", "9" * 5000, "1e" + "9" * 900):
        assert not simple_math_equal(huge, "2")
        assert not numbers_equal(huge, "2")
    assert time.monotonic() - start < 2.0
    # Inside the caps, exact comparison still works (and equal text is equal at any size).
    at_cap, past_cap = f"1e{MAX_NUMERAL_EXPONENT}", f"1e{MAX_NUMERAL_EXPONENT + 1}"
    assert simple_math_equal(at_cap, f"10e{MAX_NUMERAL_EXPONENT - 1}")
    assert numbers_equal(at_cap, f"10e{MAX_NUMERAL_EXPONENT - 1}")
    assert not simple_math_equal(past_cap, f"10e{MAX_NUMERAL_EXPONENT}")  # left to math-verify
    assert simple_math_equal("1e99999999", "1e99999999")  # same text, no arithmetic needed


def test_only_ascii_numerals_are_numbers() -> None:
    # int() and Decimal() read every script's digits; an answer is ASCII digits only.
    for other in ("\u0662", "\uff12", "\U0001d7d0"):
        assert last_number(f"so {other}") is None
        assert not numbers_equal(other, "2")
        assert not simple_math_equal(other, "2")
    assert not numbers_equal("NaN", "NaN") and not numbers_equal("1_0", "10")


def test_normalize_and_simple_equal() -> None:
    assert normalize_math_answer(r"$\left( 3, \dfrac{\pi}{2} \right)$.") == r"(3,\frac{\pi}{2})"
    assert normalize_math_answer(r"\text{(C)}") == "(C)"
    assert simple_math_equal(r"\frac{1}{2}", "0.5")
    assert simple_math_equal("-1/4", r"-\frac{1}{4}")
    assert simple_math_equal(r"90^\circ", "90")
    assert not simple_math_equal(r"\frac{1}{3}", "0.33")
    assert not simple_math_equal("x+1", "x-1")


# --------------------------------------------------------------------------- GSM8K


def test_gsm8k_rewards_on_real_rows() -> None:
    rows = _rows(DATA / "gsm8k" / "test.jsonl", [0, 1, 2, 3, 4, 50, 500, 1000])
    for row in rows:
        gold = extract_gsm8k_answer(row["answer"])
        assert gold is not None and gold.lstrip("-").isdigit()
        wrong = str(int(gold) + 1)
        for good in (
            f"Some reasoning.\nThe answer is {gold}.",
            f"so the total is $\\boxed{{{gold}}}$",
            row["answer"],  # the dataset's own solution, #### line and all
            f"We get {int(gold):,} in the end",  # last number, thousands separator
        ):
            assert verify_gsm8k(good, gold) == 1.0, (good, gold)
        for bad in (
            f"The answer is {wrong}.",
            f"First {gold}, but after correcting, {wrong}",  # the final number counts
            f"\\boxed{{{wrong}}} (not {gold})",
            "I do not know.",
            "",
        ):
            assert verify_gsm8k(bad, gold) == 0.0, (bad, gold)


# --------------------------------------------------------------------------- MATH


def test_math_rewards_on_real_rows() -> None:
    rows = _rows(DATA / "math500" / "test.jsonl", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100, 250])
    wrong = r"\boxed{\sqrt{7}+1234}"
    for row in rows:
        gold = _math500_gold(row)
        solution = row["answer"].rsplit("The answer is:", 1)[0]
        assert verify_math(solution, gold) == 1.0, gold
        assert verify_math(f"Thus the answer is $\\boxed{{{gold}}}$.", gold) == 1.0, gold
        assert verify_math(f"Final: {wrong}", gold) == 0.0, gold


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        (r"\boxed{\sqrt{8}}", r"2\sqrt{2}"),
        (r"\boxed{(x+1)^2}", "x^2+2x+1"),
        (r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        ("no box, but the result is $\\frac{14}{3}$", r"\frac{14}{3}"),
    ],
)
def test_math_equivalent_forms(pred: str, gold: str) -> None:
    assert verify_math(pred, gold) == 1.0


def test_math_equivalence_needs_math_verify() -> None:
    # These pairs are beyond the cheap string/number check, so a 1.0 proves math-verify ran.
    assert not simple_math_equal(r"\sqrt{8}", r"2\sqrt{2}")
    assert verify_math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}") == 1.0
    assert verify_math(r"\boxed{\sqrt{8}}", r"3\sqrt{2}") == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "   ",
        r"\boxed{",
        r"}}}{{{\boxed{}}",
        r"\boxed{}",
        "\\boxed{" * 10_000,
        "x" * 1_000_000,
        "9" * 100_000,
        r"\boxed{" + "(" * 300 + "}",
        r"\boxed{\frac{1}{0}}",
        r"\boxed{\frac{1}{2}" + "}" * 50,
        r"\boxed{" + "x^" * 2000 + "2}",
        "\x00\ud800 \\boxed{\x00}",
        None,
        12,
        b"\\boxed{2}",
    ],
)
def test_malformed_completions_score_zero(completion: object) -> None:
    start = time.monotonic()
    assert verify_math(completion, "2", timeout_s=1.0) == 0.0  # type: ignore[arg-type]
    # bounded by the 1 s limit (+ the worker's 1 s grace), not by the input: generous slack for a
    # loaded CI machine, still far below what an unbounded parse of these inputs takes
    assert time.monotonic() - start < 5.0
    assert verify_gsm8k(completion, "3") == 0.0  # type: ignore[arg-type]


def test_bad_gold_scores_zero() -> None:
    assert verify_math(r"\boxed{2}", "") == 0.0
    assert verify_math(r"\boxed{2}", None) == 0.0  # type: ignore[arg-type]
    assert verify_gsm8k("2", "not a number") == 0.0


# --------------------------------------------------------------------------- time limit


def test_timeout_bounds_a_pathological_answer() -> None:
    handler = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    assert verify_math(PATHOLOGICAL, "1", timeout_s=0.3) == 0.0
    elapsed = time.monotonic() - start
    # It ran until the limit (so the input really is pathological) and not much longer.
    assert 0.25 <= elapsed < 1.5, elapsed
    assert signal.getsignal(signal.SIGALRM) is handler
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e10, 0.0, -1.0], ids=["inf", "1e10", "zero", "negative"])
def test_a_limit_past_any_timer_is_no_limit_and_nan_is_refused(timeout_s: float) -> None:
    """From Python (a recipe's range is (0, 3600]): inf or 1e10 s overflowed the interval timer and
    every right answer scored 0.0."""
    assert verify_math(r"\boxed{\sqrt{4}}", "2", timeout_s=timeout_s) == 1.0
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    with pytest.raises(ValueError, match="NaN"):
        verify_math(r"\boxed{\sqrt{4}}", "2", timeout_s=float("nan"))


def test_a_math_task_built_with_a_nan_limit_is_refused() -> None:
    """From Python (a recipe's range refuses it): every completion scored 0.0, right ones included."""
    from tclightning.errors import TclightningError
    from tclightning.tasks import TaskConfig, build_task

    with pytest.raises(TclightningError, match="reward_timeout_s is NaN"):
        build_task(TaskConfig(name="math", reward_timeout_s=float("nan")))


@contextlib.contextmanager
def _program_timer(handler: Callable[[int, object], None], delay_s: float, interval_s: float = 0.0) -> Iterator[None]:
    """A program's own SIGALRM handler and interval timer for the block; the test's put back after."""
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, delay_s, interval_s)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_timeout_nests_with_an_outer_alarm() -> None:
    fired: list[float] = []

    def outer(signum: int, frame: object) -> None:
        fired.append(time.monotonic())

    with _program_timer(outer, 30.0):  # an outer timer longer than ours survives, with its remaining time
        assert verify_math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}", timeout_s=5.0) == 1.0
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 20.0 < remaining < 30.0
        assert signal.getsignal(signal.SIGALRM) is outer and not fired


def _busy(seconds: float) -> str:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass
    return "done"


def test_a_program_s_own_repeating_timer_keeps_its_ticks_and_ends_nothing() -> None:
    """A program's heartbeat (``setitimer(ITIMER_REAL, p, p)`` with its own handler) was taken for the
    limit's alarm: each tick ended the work as a timeout, and right answers were scored 0.0."""
    ticks: list[float] = []
    with _program_timer(lambda signum, frame: ticks.append(time.monotonic()), 0.01, 0.01):
        assert [verify_math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}", timeout_s=5.0) for _ in range(20)] == [1.0] * 20
        ticks.clear()
        assert run_with_alarm(lambda: _busy(0.5), 5.0) == "done"
        assert len(ticks) >= 5  # its handler ran on its ticks meanwhile (100 of them at most, at its period)
        assert signal.getitimer(signal.ITIMER_REAL)[1] == pytest.approx(0.01)  # and it goes on ticking


def test_a_program_s_timer_its_handler_cancels_stays_off() -> None:
    """A heartbeat whose handler cancels it (``setitimer(ITIMER_REAL, 0)``) at its third tick was
    taken for one left alone: called again at its period, and armed again after the call."""
    ticks: list[float] = []

    def heartbeat(signum: int, frame: object) -> None:
        ticks.append(time.monotonic())
        if len(ticks) == 3:
            signal.setitimer(signal.ITIMER_REAL, 0)

    with _program_timer(heartbeat, 0.05, 0.05):
        assert run_with_alarm(lambda: _busy(0.6), 5.0) == "done"
        assert len(ticks) == 3 and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_program_s_timer_faster_than_the_repeat_never_holds_off_the_limit() -> None:
    """A 50 Hz heartbeat of the program's: once its moments came with every alarm, the limit's own
    was never checked, and the work ran on past it (C-level chunks, the alarm handled late)."""
    with _program_timer(lambda signum, frame: None, 0.02, 0.02):
        start = time.monotonic()

        def chunks() -> str:
            while time.monotonic() - start < 20:
                sum(range(3 * 10**6))  # one C-level call of tens of milliseconds
            return "ran on"

        with pytest.raises(TimeoutError):
            run_with_alarm(chunks, 0.5)
        assert time.monotonic() - start < 5.0
        assert signal.getitimer(signal.ITIMER_REAL)[1] == pytest.approx(0.02)  # its heartbeat goes on


def test_a_program_s_handler_that_puts_a_handler_back_never_holds_off_the_limit() -> None:
    """A heartbeat handler that installs itself again (``signal.signal`` in the handler, the System V
    way), or another handler of the program's: the limit's own handler was no longer called, and the
    work ran on; and the handler the program switched to was undone afterwards."""
    ticks: list[str] = []

    def slow_mode(signum: int, frame: object) -> None:
        ticks.append("slow")
        signal.setitimer(signal.ITIMER_REAL, 0.05)

    def heartbeat(signum: int, frame: object) -> None:
        ticks.append("beat")
        signal.signal(signal.SIGALRM, slow_mode if len(ticks) > 3 else heartbeat)
        signal.setitimer(signal.ITIMER_REAL, 0.05)

    with _program_timer(heartbeat, 0.05):
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            run_with_alarm(lambda: _busy(20.0), 1.0)
        assert time.monotonic() - start < 5.0
        assert "beat" in ticks and "slow" in ticks and signal.getsignal(signal.SIGALRM) is slow_mode


class _ProgramLimit(Exception):
    pass


def _program_limit(signum: int, frame: object) -> None:
    raise _ProgramLimit


def test_an_enclosing_limit_still_cuts_the_work_short() -> None:
    """A program's own limit (its handler raises) and an enclosing :func:`run_with_alarm` shorter than
    ours end the work at their moment, with their exception."""
    with _program_timer(_program_limit, 0.2):
        start = time.monotonic()
        with pytest.raises(_ProgramLimit):
            run_with_alarm(lambda: _busy(10.0), 5.0)
        assert time.monotonic() - start < 3.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="after 0.3 s"):
        run_with_alarm(lambda: run_with_alarm(lambda: _busy(10.0), 5.0), 0.3)
    assert time.monotonic() - start < 3.0 and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


def test_a_program_s_watchdog_that_ends_the_process_ends_it_at_its_moment() -> None:
    """A timer of the program's left to SIGALRM's default action (a watchdog), due before the limit:
    re-armed for its moment already past, the alarm fired inside its own handler until a
    RecursionError, which work catching ``Exception`` dropped: the work ran on past both."""
    import subprocess

    child = """
import signal, time
from tclightning.limits import run_with_alarm
signal.signal(signal.SIGALRM, signal.SIG_DFL)
signal.setitimer(signal.ITIMER_REAL, 0.3)
start = time.monotonic()
def work():
    while time.monotonic() - start < 10:
        try:
            sum(range(10**5))
        except Exception as err:
            print("caught", type(err).__name__, flush=True)
    return "ran on"
print(run_with_alarm(work, 5.0), flush=True)
"""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGALRM and done.stdout == "", done.stdout[:200]
    assert time.monotonic() - started < 8.0


def test_the_limit_holds_where_the_program_blocks_sigalrm() -> None:
    """With SIGALRM blocked in the main thread (``pthread_sigmask``, or a mask inherited across
    ``exec``), the alarm never came: a reward's limit, and every other one, never fired."""
    import subprocess

    child = """
import signal, time
from tclightning.limits import waited_on
from tclightning.tasks.rewards import verify_math
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
start = time.monotonic()
print(verify_math(r"\\boxed{9^{9^{9}}}", "2", timeout_s=1.0), flush=True)
try:
    waited_on(lambda: time.sleep(30), 1.0)
except TimeoutError:
    print("timed out", flush=True)
print(f"{time.monotonic() - start:.1f}", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    score, timed_out, took = done.stdout.split("\n")[:3]
    assert (score, timed_out) == ("0.0", "timed out") and float(took) < 30, done.stdout + done.stderr


def test_a_program_s_limit_the_work_swallows_leaves_ours_armed() -> None:
    """A program's one-shot limit whose exception the work drops (math-verify and sympy catch
    ``Exception``): the limit's own alarm was no longer armed after it, and the work ran on."""
    def swallowing() -> str:
        start = time.monotonic()
        while time.monotonic() - start < 15:
            try:
                sum(range(10**5))
            except Exception:  # noqa: BLE001 -- what the libraries do
                pass
        return "ran on"

    with _program_timer(_program_limit, 0.2):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="after 1.0 s"):
            run_with_alarm(swallowing, 1.0)
        assert time.monotonic() - start < 5.0


def test_a_swallowed_timeout_is_raised_again() -> None:
    # mpmath has bare "except:" blocks; a timeout they drop must not turn into no limit.
    def stubborn() -> str:
        deadline = time.monotonic() + 5.0
        swallowed = 0
        while time.monotonic() < deadline:
            try:
                while time.monotonic() < deadline:
                    pass
            except BaseException:  # noqa: BLE001 -- what a bare except does
                swallowed += 1
                if swallowed >= 3:
                    raise
        return "ran on past the limit"

    start = time.monotonic()
    with pytest.raises(TimeoutError):
        run_with_alarm(stubborn, 0.2)
    assert time.monotonic() - start < 3.0  # 0.2 s, then two repeats: far below the 5 s loop
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


def test_an_alarm_anywhere_leaves_only_a_timeout_error() -> None:
    # Limits from tiny to short land at every point of the call, set-up and clean-up included.
    for limit in (1e-6, 1e-5, 1e-4, 1e-3, 0.01):
        for _ in range(20):
            try:
                run_with_alarm(lambda: sum(range(20_000)), limit)
            except TimeoutError:
                pass
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


def test_verify_math_from_a_worker_thread() -> None:
    results: dict[str, float] = {}
    times: dict[str, float] = {}

    def work() -> None:
        results["warm"] = verify_math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}", timeout_s=2.0)
        start = time.monotonic()
        results["wrong"] = verify_math(r"\boxed{\sqrt{8}}", r"3\sqrt{2}", timeout_s=2.0)
        results["hang"] = verify_math(PATHOLOGICAL, "1", timeout_s=0.5)
        times["after_warm"] = time.monotonic() - start

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    # 1.0 for a sympy-only equivalence: math-verify really ran (in a worker process).
    assert results == {"warm": 1.0, "wrong": 0.0, "hang": 0.0}
    assert times["after_warm"] < 0.5 + 1.0 + 1.5  # limit + kill grace + slack


# U+2212 MINUS SIGN, U+2012 FIGURE DASH, U+2013 EN DASH, U+FE63 SMALL HYPHEN-MINUS, U+FF0D FULLWIDTH
# HYPHEN-MINUS, U+2010 HYPHEN, U+2011 NON-BREAKING HYPHEN, U+2796 HEAVY MINUS SIGN, U+02D7 MODIFIER
# LETTER MINUS SIGN, U+207B SUPERSCRIPT MINUS, U+208B SUBSCRIPT MINUS
MINUS_SIGNS = ("\u2212", "\u2012", "\u2013", "\ufe63", "\uff0d", "\u2010", "\u2011", "\u2796", "\u02d7", "\u207b",
               "\u208b")


@pytest.mark.parametrize("minus", MINUS_SIGNS, ids=lambda m: f"U+{ord(m):04X}")
def test_a_typographic_minus_is_a_minus_in_the_gsm8k_reward(minus: str) -> None:
    for completion in (f"The answer is {minus}5.", f"work\n#### {minus}5\n", rf"\boxed{{{minus}5}}", f"so {minus}5"):
        assert verify_gsm8k(completion, "5") == 0.0, completion
        assert verify_gsm8k(completion, "-5") == 1.0, completion
    assert last_number(f"from 3 to {minus}1,250.5") == "-1250.5"
    assert extract_answer_is(f"The answer is: {minus}72.") == "-72"


def test_an_en_dash_between_numbers_stays_a_range() -> None:
    # only a sign is read as minus: "10\u201320" is still 10 to 20, and a dash before a word is punctuation
    assert last_number("pages 10\u201320") == "20" and last_number("pages 10\u201120") == "20"
    assert verify_gsm8k("The answer is \u20145 apples.", "5") == 1.0  # an em dash is punctuation
    assert verify_gsm8k("The answer is 5 \u2013 five apples.", "5") == 1.0


@pytest.mark.parametrize("minus", MINUS_SIGNS, ids=lambda m: f"U+{ord(m):04X}")
@pytest.mark.parametrize("answer_at", ["first", "last"])
def test_a_typographic_minus_is_a_minus_in_the_arithmetic_reward(minus: str, answer_at: str) -> None:
    from tclightning.tasks import Example, TaskConfig, build_task

    task = build_task(TaskConfig(answer_at=answer_at))
    completion = f"The answer is {minus}5."
    assert task.reward(completion, Example("arithmetic/x/0", "3-8=", "5", "5")) == 0.0
    assert task.reward(completion, Example("arithmetic/x/0", "3-8=", "-5", "-5")) == 1.0


def test_a_timeout_never_lands_in_a_finalizer() -> None:
    """The alarm that ends a slow verification may fire while a finalizer runs (sympy drops
    objects all the time); raised there, Python would print "Exception ignored" and carry on.
    The alarm waits for its next repeat instead: the call still times out, and nothing is left
    for sys.unraisablehook."""
    class SlowFinalizer:
        def __del__(self) -> None:
            until = time.monotonic() + 0.3  # the first alarm (0.05 s) and two repeats land in here
            while time.monotonic() < until:
                pass

    def slow() -> None:
        obj = SlowFinalizer()
        del obj
        while True:
            pass

    ignored: list[object] = []
    previous, sys.unraisablehook = sys.unraisablehook, ignored.append
    try:
        with pytest.raises(TimeoutError):
            run_with_alarm(slow, 0.05)
    finally:
        sys.unraisablehook = previous
    assert ignored == []


@pytest.mark.parametrize(("completion", "gold", "score"), [
    ("The answer is -$5", "-5", 1.0),  # a currency sign between the minus and the digits
    ("The answer is -$5", "5", 0.0),
    (r"\boxed{-\$5}", "-5", 1.0),
    ("The answer is 10**10**10", "10", 0.0),  # a power is part of the number written
    ("The answer is 5e3", "5000", 1.0),
    ("The answer is 5e3", "5", 0.0),
    (r"$\boxed{1{,}000}$", "1000", 1.0),  # LaTeX's thousands comma
    (r"so it is \boxed{5", "5", 0.0),  # a box left open: the final answer was cut off
    (r"\boxed{4} and then \boxed{5", "4", 0.0),
])
def test_the_gsm8k_reward_reads_the_whole_number_a_completion_commits_to(completion: str, gold: str,
                                                                         score: float) -> None:
    assert verify_gsm8k(completion, gold) == score


@pytest.mark.parametrize("answer_at", ["first", "last"])
def test_the_arithmetic_reward_reads_a_fraction_or_an_exponent_as_no_integer(answer_at: str) -> None:
    from tclightning.tasks import Example, TaskConfig, build_task

    task = build_task(TaskConfig(answer_at=answer_at))
    gold = Example("arithmetic/x/0", "40+45=", "85", "85")
    assert task.reward("85", gold) == 1.0
    assert task.reward("85.", gold) == 1.0  # a full stop ends the sentence
    for wrong in ("85.9", "85e3", "85.0"):
        assert task.reward(wrong, gold) == 0.0, wrong


@pytest.mark.parametrize("completion, gold, reward", [
    ("The answer is .5", "5", 0.0), ("The answer is .5", "0.5", 1.0), ("The answer is -.5", "-0.5", 1.0),
    ("so the answer is...5", "5", 1.0), ("#### .25", "25", 0.0)],
    ids=["half-is-not-five", "half", "minus-half", "ellipsis", "hashes"])
def test_a_leading_decimal_point_is_read_as_part_of_the_number(completion: str, gold: str, reward: float) -> None:
    from tclightning.tasks.rewards import verify_gsm8k

    assert verify_gsm8k(completion, gold) == reward


@pytest.mark.parametrize("completion, gold, reward", [
    ("The answer is 3×10^3", "3", 0.0), ("The answer is 3 \\times 10^3", "3", 0.0), ("The answer is 10²", "10", 0.0),
    ("The answer is 0x1F", "0", 0.0), ("The answer is 3e3", "3", 0.0), ("The answer is 3e3.", "3000", 1.0),
    ("\\boxed{1,5}", "15", 0.0), ("\\boxed{1,500}", "1500", 1.0), ("\\boxed{1{,}500}", "1500", 1.0),
    ("The answer is **42**.", "42", 1.0), ("So x=5", "5", 1.0), ("The answer is $3\\times10^3$", "3000", 1.0)],
    ids=["product", "latex-product", "superscript", "hex", "exponent", "exponent-whole", "list-is-not-fifteen",
         "thousands", "latex-thousands", "markdown", "equation", "math-mode-product"])
def test_the_math_reward_reads_a_number_an_expression_continues_whole(completion: str, gold: str, reward: float) -> None:
    """math-verify reads the first digits of such a number in plain text (3×10^3 as 3, 10² as 10,
    0x1F as 0) and a list ``1,5`` as 15: each scored 1.0 against the wrong gold."""
    from tclightning.tasks.rewards import verify_math

    assert verify_math(completion, gold) == reward


@pytest.mark.parametrize("completion, gold, reward", [
    ("The answer is 10².", "10", 0.0), ("The answer is 3×10^3", "3", 0.0), ("The answer is 3 \\times 10^3", "3", 0.0),
    ("The answer is 0x1F", "0", 0.0), ("The answer is 1/2", "1", 0.0), ("The answer is 12,34", "12", 0.0),
    ("#### 5/2", "5", 0.0), ("So we get 12,3456", "12345", 0.0), ("85,000", "85", 0.0), ("85,000", "85000", 1.0),
    ("The answer is 1/2", "0.5", 1.0), ("#### 6/3", "2", 1.0), ("#### 5/2", "2.5", 1.0), ("1/0", "0", 0.0),
    ("5 * 3 = 15", "15", 1.0), ("10 - 5", "5", 1.0)],
    ids=["superscript", "product", "latex-product", "hex", "fraction-is-not-one", "list", "hashes-fraction",
         "bad-grouping", "thousands-not-85", "thousands", "fraction-exact", "fraction-whole", "hashes-fraction-exact",
         "zero-denominator", "equation", "subtraction"])
def test_the_gsm8k_reward_reads_a_number_an_expression_continues_whole(completion: str, gold: str,
                                                                       reward: float) -> None:
    """Each was read by its first part (10, 3, 0, 1, 12, 5) and scored 1.0 against it."""
    assert verify_gsm8k(completion, gold) == reward


@pytest.mark.parametrize("completion", [
    "#### not 72", "#### 72 thousand", "The answer is not 72.", "The answer is 72 thousand dollars",
    "The answer is never 72", "#### 72 Hundreds", "We get 72 million in the end.", "The answer is: not 72",
    "The answer is 72 dozen", "So x isn't 72. #### not 72", "#### 72\u00a0thousand", "The answer is 72\u2009million."])
def test_the_gsm8k_reward_reads_a_number_a_word_makes_another_as_no_answer(completion: str) -> None:
    """Each was read as 72 and scored 1.0 against it: a negation before the stated number, or a
    scale word after it, makes it another number (a word's other reading is no answer either)."""
    assert verify_gsm8k(completion, "72") == 0.0
    assert verify_gsm8k(completion, "72000") == 0.0
    for plain in ("#### 72", "The answer is 72.", "We get 72.", "#### 72 apples", "#### 72, not 73",
                  # a negation counts right before the number, a scale word right after it on its line
                  "The answer is no doubt 72.", "The answer is nothing less than 72", "The answer is not 73 but 72",
                  "The answer is: 72\n\nThousands of people agree.", r"\boxed{-\frac{-144}{2}}"):
        assert verify_gsm8k(plain, "72") == 1.0, plain


@pytest.mark.parametrize("answer, gold", [
    ("#### 1/2", "1/2"), ("#### 3×10^3", None), ("#### 1,5", None), ("#### 10²", None), ("#### 1,500", "1500"),
    ("1,5", None), ("1,500", "1500")])
def test_a_gsm8k_gold_is_read_whole_or_the_row_is_skipped(answer: str, gold: str | None) -> None:
    """A task file's ``#### 1/2`` was gold 1, ``#### 3×10^3`` 3, ``#### 1,5`` 1, ``#### 10²`` 10."""
    from tclightning.tasks import TaskConfig, build_task

    parsed = build_task(TaskConfig(name="gsm8k")).parse_row({"question": "q", "answer": answer})
    assert (parsed[1] if parsed else None) == gold


@pytest.mark.parametrize("completion", ["#### 3+1", "#### 3-1", "#### 3!", "#### 3:1", "#### 3_8", "The answer is 3+0.",
                                        "#### ±3", "The answer is \\pm 3", "#### ∓ 3"])
def test_the_gsm8k_reward_reads_a_sum_a_factorial_or_a_plus_minus_as_no_plain_number(completion: str) -> None:
    """Each was read by its first part (or without its ±) and scored 1.0 against 3."""
    assert verify_gsm8k(completion, "3") == 0.0
    assert verify_gsm8k("10 - 3", "3") == verify_gsm8k("#### 3", "3") == 1.0  # spaced: two numbers, the last 3


@pytest.mark.parametrize("answer_at", ["first", "last"])
def test_the_arithmetic_reward_reads_a_number_an_expression_continues_as_no_integer(answer_at: str) -> None:
    from tclightning.tasks import Example, TaskConfig, build_task

    task = build_task(TaskConfig(answer_at=answer_at))
    gold = Example("arithmetic/x/0", "40+45=", "85", "85")
    wrong = ["85²", "85/2", "85,000", "85×10^3", "85 \\times 10^3", "85^2", "0x85", "85+1", "85-1", "85!", "85:2",
             "85_9", "±85", "\\pm 85"]
    if answer_at == "last":
        wrong += ["2/85", "3×85", "10^85", "3 \\cdot 85", "1+85", "100-85", "2:85"]
    for completion in wrong:
        assert task.reward(completion, gold) == 0.0, completion
    assert task.reward("85, then 86" if answer_at == "first" else "86, then 85", gold) == 1.0
    assert task.reward("85000", Example("arithmetic/x/1", "85000+0=", "85000", "85000")) == 1.0
    assert task.reward("85,000", Example("arithmetic/x/1", "85000+0=", "85000", "85000")) == 1.0


@pytest.mark.parametrize("completion", ["The answer is \u2212 5.", "- 5", "-\u200b5", "#### - 5", "The answer is -  5",
                                        "\\boxed{- 5}", "x = - 5"])
def test_a_spaced_off_minus_is_the_number_s_sign(completion: str) -> None:
    """The sign was dropped: each scored 1.0 against 5."""
    assert verify_gsm8k(completion, "5") == 0.0
    assert verify_gsm8k(completion, "-5") == 1.0


def test_a_minus_after_an_operand_is_still_a_subtraction() -> None:
    from tclightning.tasks.arithmetic import first_integer, last_integer

    assert verify_gsm8k("10 - 5", "5") == 1.0
    assert verify_gsm8k("(3 + 7) - 5", "5") == 1.0
    assert first_integer("- 85") == -85 and first_integer("-\u200b85") == -85 and last_integer("so - 85") == -85
    assert last_integer("100 - 15") == 15


@pytest.mark.parametrize("completion, gold, reward", [
    (r"\boxed{\frac{1}{2}}", "2", 0.0), (r"\boxed{5 - 3}", "3", 0.0), (r"\boxed{\sqrt{16}}", "16", 0.0),
    (r"\boxed{2^{-1}}", "1", 0.0), (r"\boxed{3 \times 10^3}", "3", 0.0), (r"\boxed{x = 5}", "5", 0.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0), (r"\boxed{-\dfrac{6}{3}}", "-2", 1.0), (r"\boxed{\tfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{1/2}", "0.5", 1.0), (r"\boxed{\$18.}", "18", 1.0), (r"\boxed{18 \text{ dollars}}", "18", 1.0),
    (r"\boxed{25\%}", "25", 1.0), (r"\boxed{\text{18}}", "18", 1.0), (r"$\boxed{1{,}000}$", "1000", 1.0)],
    ids=["frac-is-not-2", "difference", "root", "power-expression", "product", "equation", "frac", "dfrac", "tfrac",
         "slash", "currency", "unit", "percent", "text", "latex-thousands"])
def test_the_gsm8k_reward_reads_a_box_whole(completion: str, gold: str, reward: float) -> None:
    """A box was read by its last number: \\frac{1}{2} as 2, 5 - 3 as 3, \\sqrt{16} as 16."""
    assert verify_gsm8k(completion, gold) == reward


@pytest.mark.parametrize("completion", [
    r"\boxed{2 \ast 5}", r"\boxed{2 \uparrow 5}", r"\boxed{7 \bmod 5}", r"\boxed{2 \wedge 5}", r"\boxed{2 \setminus 5}",
    r"\boxed{\neg 5}", r"\boxed{x \mapsto 5}", r"\boxed{2 \to 5}"])
def test_the_math_reward_refuses_a_command_math_verify_would_drop(completion: str) -> None:
    """math-verify dropped the unknown command and read what followed it: each scored 1.0 against 5."""
    assert verify_math(completion, "5") == 0.0
    assert verify_math(completion, completion[len(r"\boxed{"):-1]) == 1.0  # written as the gold is


def test_many_numbers_after_the_hashes_are_read_in_linear_time() -> None:
    """Each number looked for a negation over all the text before it: 8,000 took 36 s."""
    started = time.monotonic()
    assert verify_gsm8k("#### " + "not 1 " * 200_000, "1") == 0.0
    assert time.monotonic() - started < 20  # quadratic: hours


def test_the_last_box_is_read_also_when_it_is_unbraced() -> None:
    """``\\boxed{5} then \\boxed 7`` scored 1.0 against 5 (a lone ``\\boxed 7`` counts as 7); and
    gsm8k's ``#### 5.00.00`` against 5."""
    assert verify_math(r"\boxed{5} then \boxed 7", "5") == 0.0
    assert verify_math(r"\boxed{5} then \boxed 7", "7") == verify_math(r"\boxed 7.", "7") == 1.0
    assert verify_gsm8k(r"\boxed{5} then \boxed 7", "7") == 1.0
    assert extract_boxed(r"\boxed{\boxed 3}") == r"\boxed 3" and extract_boxed("\\boxed") is None
    assert verify_gsm8k("#### 5.00.00", "5") == 0.0 and verify_gsm8k("#### 5.00", "5") == 1.0


@pytest.mark.parametrize("completion, gold, reward", [
    (r"\boxed{52}", "52_8", 0.0), (r"\boxed{52_9}", "52_8", 0.0), (r"\boxed{10001}", "10001_2", 0.0),
    (r"\boxed{12_3}", "12", 0.0), (r"\boxed{101_{2}}", "101", 0.0), ("so it is 52.", "52_8", 0.0),
    (r"\boxed{52_8}", "52_8", 1.0), (r"\boxed{52_{8}}", "52_8", 1.0), ("The answer is $52_{8}$.", "52_8", 1.0),
    (r"\boxed{12_3}", "5", 1.0), (r"\boxed{x_1}", "x_1", 1.0), (r"\boxed{a_1 + a_2}", "a_2 + a_1", 1.0),
    (r"\boxed{a_{16}}", "10", 0.0), (r"\boxed{9_8}", "9", 0.0), (r"\boxed{1_1}", "1", 0.0)],
    ids=["plain-for-base-8", "base-9-for-base-8", "plain-for-base-2", "base-3-for-plain", "base-2-for-plain",
         "unboxed-plain", "same", "braced", "unboxed-same", "by-value", "variable", "variables-reordered",
         "a-term-no-numeral", "digit-past-its-base", "base-1"])
def test_the_math_reward_reads_a_base_subscript(completion: str, gold: str, reward: float) -> None:
    """math-verify drops a base subscript: ``\\boxed{52}`` and ``\\boxed{52_9}`` scored 1.0 against
    MATH-500's ``52_8`` (42), and ``\\boxed{12_3}`` 1.0 against 12."""
    assert verify_math(completion, gold) == reward


@pytest.mark.parametrize("boxed", [r"\geq 5", r"\ge 5", r"\ne 5", r"\neq 5", r"\leq 5", r"\le5", r"< 5", r">5",
                                   "\u2260 5", "\u2265 5", "!= 5", r"\not= 5", r"\gt 5", r"\lt 5"])
def test_the_math_reward_refuses_a_relation_with_nothing_on_its_left(boxed: str) -> None:
    """math-verify read a bound or an exclusion with no left side as its number: \\boxed{\\geq 5}
    and \\boxed{\\ne 5} scored 1.0 against 5. The same answer with its left side was already 0.0."""
    assert verify_math(f"\\boxed{{{boxed}}}", "5") == 0.0
    assert verify_math(f"\\boxed{{{boxed}}}", boxed) == 1.0  # written as the gold is
    assert verify_math(r"\boxed{= 5}", "5") == verify_math(r"\boxed{x = 5}", "5") == 1.0  # equal to 5 is 5


@pytest.mark.parametrize("completion, gold, reward", [
    (r"\boxed{1 5}", "15", 0.0), (r"\boxed{1\,5}", "15", 0.0), (r"\boxed{1\ 5}", "15", 0.0), (r"\boxed{1\!5}", "15", 0.0),
    (r"\boxed{\text{5}\text{6}}", "56", 0.0), (r"\boxed{1~5}", "15", 0.0), (r"\boxed{1\,000}", "1000", 1.0),
    (r"\boxed{12\,345\,678}", "12345678", 1.0), (r"\boxed{15}", "15", 1.0), (r"\boxed{2 \sqrt{3}}", r"2\sqrt{3}", 1.0)],
    ids=["space", "thin-space", "control-space", "negative-thin-space", "two-texts", "tie", "thin-thousands",
         "thin-millions", "plain", "coefficient"])
def test_the_math_reward_reads_digits_spacing_separates_as_two_numbers(completion: str, gold: str,
                                                                       reward: float) -> None:
    """``normalize_math_answer`` dropped every space, and math-verify joins them too: each scored 1.0 against 15 (56)."""
    assert verify_math(completion, gold) == reward


def test_every_shared_math_gold_scores_one_against_itself() -> None:
    """The refusals above (an unknown command, spaced digit runs) never refuse a MATH-500 gold,
    so a right answer in a gold's notation still reaches the checks."""
    from tclightning.tasks.rewards import _DIGIT_GAP, _LEFTLESS_RELATION, _foreign_command, _mark_digit_gaps

    path = DATA / "math500" / "test.jsonl"
    require_shared_data(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) >= 500
    for row in rows:
        gold = _math500_gold(row)
        assert _foreign_command(gold) is None, gold
        assert not _LEFTLESS_RELATION.match(gold), gold
        assert _DIGIT_GAP not in _mark_digit_gaps(gold), gold
        assert verify_math(f"so the answer is $\\boxed{{{gold}}}$.", gold) == 1.0, gold
