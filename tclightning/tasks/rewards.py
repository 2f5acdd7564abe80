"""Answer extraction and verification: the pure functions behind every task's reward.

Contract shared by everything public here: any ``str`` (empty, huge, malformed LaTeX,
adversarial) is accepted; extractors return ``None`` when there is no answer, verifiers
return 1.0 or 0.0 and never raise.

``verify_math`` uses math-verify (sympy) for equivalence (``\\frac{1}{2}`` = ``0.5``), and
sympy can run for minutes on hostile input (``\\boxed{9^{9^{9^9}}}``), so every math-verify
call runs under a wall-clock limit:

* main thread (POSIX): a ``SIGALRM`` interval timer around the whole parse + verify
  (math-verify's own per-call alarms are switched off: they take whole seconds and would
  clobber ours). An outer timer someone else armed (e.g. pytest-timeout) is re-armed after.
* any other thread (or no ``SIGALRM``): signals only reach the main thread, so the call
  runs in a small pool of spawned worker processes, which apply the timer themselves; a
  worker that still does not answer ``timeout_s + 1 s`` later is killed (this also bounds
  C-level work a signal cannot interrupt). The first call in a thread pays the spawn (~2-4 s,
  the worker imports math-verify before it takes work).
* if no worker can be started (e.g. inside a daemonic process), the verdict falls back to
  normalised string / exact number comparison, which needs no time limit.

Two things stay outside every limit, on purpose:

* the exact-number shortcut (``simple_math_equal``, ``numbers_equal``): its cost is bounded by
  caps checked before any ``Decimal``/``Fraction``/``int`` is built (``MAX_ANSWER_CHARS``,
  ``MAX_NUMERAL_EXPONENT``), not by a timer -- a timer cannot interrupt one big C-level
  integer operation such as ``Fraction(Decimal("1e99999999"))``;
* the import of math-verify and sympy (``load_math_verify``), done once before any timer is
  armed: an import cut short by an alarm would leave half-built modules behind.
"""

from __future__ import annotations

import math
import multiprocessing
import re
import signal
import sys
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from tclightning.limits import can_use_alarm, run_with_alarm
from tclightning.processes import safe_import_path

# A final answer longer than this is not an answer: never hand it to sympy.
MAX_ANSWER_CHARS = 1000
# Largest |exponent| of a numeral the exact-number checks accept ("1e1000"). Building a
# Fraction from a Decimal costs ~|exponent| digits of integer arithmetic in one C call, which
# no alarm can interrupt ("1e99999999" ran for minutes). A numeral past the cap takes more
# than MAX_ANSWER_CHARS digits to write out, which is already more than any answer we accept;
# and the shortcut that refuses it only ever says "equal": math-verify, under the time
# limit, still judges it. So the cap moves work under the limit and changes no verdict.
MAX_NUMERAL_EXPONENT = 1000
# Without a \boxed{}, math-verify looks for the answer in this many trailing characters only
# (its regexes and sympy are not cheap on a 100k-char ramble; the answer is at the end).
MAX_TAIL_CHARS = 4000

# --------------------------------------------------------------------------- extraction

# Tokens that matter for brace matching: a \boxed{ / \fbox{ opener, an escaped character
# (\{ \} \\ ... : skipped, so LaTeX set braces do not count), or a bare brace. finditer
# jumps over everything else in C, so a megabyte of text costs milliseconds.
_BRACE_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\\.|[{}]", re.DOTALL)
_UNBRACED_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])(?!\s*\{)")  # LaTeX's one-token argument: "\boxed 7"
# ASCII digits only (re.ASCII): the answers are ASCII, and Python's int()/Decimal() would
# otherwise also read digits of every other script ("\u0667\u0662" as 72).
# A numeral's exponent or power stays part of it ("85e3", "10**10**10", "2^{10}"): the number a
# completion wrote is all of it, not its first digits.
# ".5" is a half (an ellipsis "...5" is not a decimal point); a comma groups thousands only in threes.
_NUMERAL_CORE = r"(?:\d+(?:,\d{3}(?!\d))*(?:\.\d+)?|(?<!\.)\.\d+)(?:[eE][+-]?\d+|(?:\*\*|\^)\{?-?\d+\}?)*"
# A numeral an expression continues is read whole, continuation and all: a product, quotient or
# power of numerals ("3×10^3", "3 \times 10^3", "1/2"), superscript digits ("10²"), a hex prefix
# ("0x1F") or a comma that groups no thousands ("12,34"). Read by its first part it scored 1.0
# against that part (3, 10, 1, 0, 12). Such a run equals no plain number (``numbers_equal``),
# except a plain fraction "a/b", which is compared exactly.
# So is one a sum, a difference, a ratio or a base subscript joins unspaced ("3+1", "3-1", "3:1",
# "52_8"), or a factorial ("3!"); "10 - 5", spaced, is two numbers. A number after a plus-minus sign
# ("±5") is none of its values.
_NUMBER = re.compile(
    rf"(?<![\u00b1\u2213])-?(?:0[xX][0-9a-fA-F]+|{_NUMERAL_CORE})"
    rf"(?:[\u00b2\u00b3\u00b9\u2070\u2074-\u2079]+|,\d+|!+|[+\-:_]{_NUMERAL_CORE}"
    rf"|[ \t]*(?:[\u00d7*\u00b7/^]|\\times|\\cdot)[ \t]*-?{_NUMERAL_CORE})*",
    re.ASCII)
NUMBER_PATTERN = _NUMBER
"""A number as the rewards read it, whole (``tasks.arithmetic`` reads its integers with it)."""
_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
# A minus that follows no operand (no digit or closing bracket before it, spaces skipped) and is
# followed by spaces or zero-width spaces before a digit is that number's sign: "- 5" is -5 (its
# digits alone scored 1.0 against 5), while "10 - 5" stays a subtraction.
_SPACED_SIGN = re.compile(r"-[\s\u200b\u200c\u200d\u2060\ufeff]+(?=\.?\d)")
_BOX_OPENER = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "-$5" and "-\\$5": a currency sign between the minus and the digits; "1{,}000": LaTeX's thousands comma.
_SIGN_THEN_CURRENCY = re.compile(r"-\s*\\?\$\s*(?=\d)")
_ANSWER_IS = re.compile(r"answer\s+is", re.IGNORECASE)
_PLUS_MINUS = re.compile(r"(?:\\pm|\\mp|[\u00b1\u2213])\s*")  # "\pm 5" and "± 5": "±5", which no value reads
# Minus signs other than ASCII "-" that models and word processors write: U+2212 MINUS SIGN,
# U+2012 FIGURE DASH, U+FE63 SMALL HYPHEN-MINUS, U+FF0D FULLWIDTH HYPHEN-MINUS, U+2796 HEAVY MINUS
# SIGN, U+02D7 MODIFIER LETTER MINUS SIGN, U+207B / U+208B SUPERSCRIPT / SUBSCRIPT MINUS; and
# U+2013 EN DASH, U+2010 HYPHEN and U+2011 NON-BREAKING HYPHEN, but only as a sign: right before a
# digit and not right after one ("10\u201320" is a range). An em dash is punctuation ("the
# answer\u20145 apples"), never a sign.
_MINUS_SIGNS = str.maketrans({c: "-" for c in "\u2212\u2012\ufe63\uff0d\u2796\u02d7\u207b\u208b"})
_DASH_SIGN = re.compile(r"(?<![0-9])[\u2013\u2010\u2011](?=[0-9])")


def normalize_minus(text: str) -> str:
    """``text`` with every minus-like sign as ASCII ``-`` (``"\u22125"`` -> ``"-5"``), so that
    the number extractors (here and ``tasks.arithmetic``) read a sign however it was typed.
    One character for one: offsets into ``text`` stay valid."""
    text = text.translate(_MINUS_SIGNS)
    return _DASH_SIGN.sub("-", text) if any(c in text for c in "\u2013\u2010\u2011") else text


def join_signs(text: str) -> str:
    """``text`` with every spaced-off sign minus joined to its digits (``"= - 5"`` -> ``"= -5"``;
    ``"10 - 5"`` is left alone), see ``_SPACED_SIGN``. Expects ``normalize_minus``'d text."""
    if "-" not in text:
        return text

    def join(match: re.Match[str]) -> str:
        before = text[: match.start()].rstrip()
        return match.group() if before and (before[-1].isdigit() or before[-1] in ")]}") else "-"

    return _SPACED_SIGN.sub(join, text)


def _plain(numeral: str) -> str:
    """A numeral as the extractors return it: thousands commas dropped ("1,234.5" -> "1234.5");
    any other run (an expression: "1,5", "3×10^3") as written."""
    return numeral.replace(",", "") if _GROUPED.fullmatch(numeral) else numeral


def number_text(text: str) -> str:
    """``text`` as the number extractors read it: every minus sign ASCII, no currency sign between
    a minus and its digits (``"-$5"`` is -5), LaTeX's ``{,}`` a thousands comma and a plus-minus
    sign (``\\pm``, ``±``) joined to its number."""
    text = _SIGN_THEN_CURRENCY.sub("-", join_signs(normalize_minus(text)))
    return _PLUS_MINUS.sub("\u00b1", text.replace("{,}", ","))


def extract_boxed(text: str) -> str | None:
    """Content of the last outermost ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, or the
    word after the last ``\\boxed`` when that one is unbraced (``\\boxed 7``).

    Nested boxes resolve to the outer one. Returns ``None`` when there is none, or when a
    box is left unclosed (a truncated or malformed final answer is no answer). Escaped
    braces ``\\{ \\}`` do not count. Linear time in ``len(text)``.
    """
    if not isinstance(text, str):
        return None
    stack: list[int | None] = []  # per open brace: content start for a box, None for a group
    open_boxes = 0
    last: tuple[int, int] | None = None
    for m in _BRACE_TOKENS.finditer(text):
        token = m.group()
        if token == "{":
            stack.append(None)
        elif token == "}":
            if not stack:
                continue  # a stray closer: ignore it rather than reject the whole text
            start = stack.pop()
            if start is not None:
                open_boxes -= 1
                if open_boxes == 0:
                    last = (start, m.start())
        elif token[-1] == "{" and len(token) > 2:  # \boxed{ or \fbox{ (not the escape "\{")
            stack.append(m.end())
            open_boxes += 1
    if open_boxes:
        return None
    unbraced = None
    for unbraced in _UNBRACED_BOX.finditer(text, 0 if last is None else last[1]):
        pass
    if unbraced is not None:  # the last box is unbraced: its word ("\boxed{5} then \boxed 7" was 5)
        word = text[unbraced.end():].split(None, 1)
        return word[0].rstrip(".,;:$") or None if word else None
    return None if last is None else text[last[0] : last[1]].strip()


def last_number(text: str) -> str | None:
    """The last number in ``text`` as a plain string (``"1,234.5"`` -> ``"1234.5"``), or None
    (also when a scale word follows it: ``"72 thousand"`` is not 72)."""
    if not isinstance(text, str):
        return None
    found = None
    text = number_text(text)
    for found in _NUMBER.finditer(text):
        pass
    if found is None or _SCALE_WORD.match(text, found.end()):
        return None
    return _plain(found.group())


# Words that make a stated number another one: "#### not 72", "the answer is 72 thousand" were 72.
# A negation counts right before the number; a scale word right after it, on its line.
_NEGATED = re.compile(r"\b(?:not|no|never|isn't|isnt|nor)[\s:$]*$", re.IGNORECASE)
_SCALE_WORD = re.compile(r"[^\S\r\n]*(?:hundred|thousand|million|billion|trillion|dozen|grand)s?\b", re.IGNORECASE)


def _stated(text: str, within: int) -> tuple[bool, str | None]:
    """``(found, answer)`` for the number a statement's ``text`` gives: the first one starting
    before ``within`` that no negation comes right before (``"not 73 but 72"`` is 72); ``answer``
    None when a scale word follows it or a decimal point continues it (``"72 thousand"``,
    ``"5.00.00"``: another number, or none). ``found`` False when ``text`` states no number there."""
    found = False
    for match in _NUMBER.finditer(text):
        if match.start() >= within:
            break
        found = True
        if _NEGATED.search(text, max(0, match.start() - 40), match.start()):  # the words right before: linear
            continue
        end = match.end()
        if _SCALE_WORD.match(text, end) or text.startswith(".", end) and text[end + 1 : end + 2].isdigit():
            return True, None
        return True, _plain(match.group())
    return found, None


def _after_hashes(text: str) -> str | None:
    """The line after the last ``####``, as the extractors read it; None without a ``####``."""
    if not isinstance(text, str) or "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return number_text(tail.splitlines()[0] if tail else "").replace("$", "")


def _after_answer_is(text: str) -> str | None:
    """What follows the last "answer is", as the extractors read it; None without one."""
    if not isinstance(text, str):
        return None
    found = None
    for found in _ANSWER_IS.finditer(text):
        pass
    return None if found is None else number_text(text[found.end() : found.end() + 128])


_STATEMENTS = ((_after_hashes, 1 << 30), (_after_answer_is, 32))
"""Where a completion states its answer, and how far in the number must start ("the answer is that
... 17 steps later 12" is no answer)."""


def extract_gsm8k_answer(text: str) -> str | None:
    """The GSM8K final answer: the number on the line after the last ``####``, or None.

    Works on the dataset's ``answer`` field and on completions that copy its format.
    ``"#### $1,000"`` -> ``"1000"``; ``"#### not 72"`` and ``"#### 72 thousand"`` -> None.
    """
    line = _after_hashes(text)
    return None if line is None else _stated(line, len(line))[1]


def extract_answer_is(text: str) -> str | None:
    """The number right after the last "answer is" (``"The answer is: $72."`` -> ``"72"``; ``"The
    answer is not 72"`` -> None)."""
    window = _after_answer_is(text)
    return None if window is None else _stated(window, 32)[1]


# A boxed gsm8k answer is read whole: a number, with a currency sign, a percent sign or a unit in
# words around it at most, or a \frac of integers. By its last number, \boxed{\frac{1}{2}} was 2,
# \boxed{5 - 3} was 3 and \boxed{\sqrt{16}} was 16.
_BOX_WRAPPER = re.compile(r"\\(?:text|textbf|mathbf|mathrm|mbox)\{([^{}]*)\}")
_BOX_UNIT = re.compile(r"(?:\s|\\[,;: ])*(?:\\text|\\mbox|\\mathrm)\{\s*[A-Za-z][A-Za-z .]*\}$")
_BOX_FRAC = re.compile(r"(-?)\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}", re.ASCII)


def _boxed_number(boxed: str) -> str | None:
    """The number a gsm8k ``\\boxed{...}`` holds, read whole (``"1{,}000"`` -> ``"1000"``,
    ``"\\frac{1}{2}"`` -> ``"1/2"``), or None when it holds anything else (``"5 - 3"``)."""
    text = _BOX_UNIT.sub("", boxed.strip())
    if (whole := _BOX_WRAPPER.fullmatch(text.strip())) is not None:
        text = whole.group(1)
    text = number_text(text).replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    text = text.removesuffix(".").strip()  # the sentence's full stop
    if (frac := _BOX_FRAC.fullmatch(text)) is not None:  # its signs as one: -\frac{-144}{2} is 72
        signs = [frac.group(1), frac.group(2)[:1], frac.group(3)[:1]].count("-")
        return f"{'-' * (signs % 2)}{frac.group(2).lstrip('-')}/{frac.group(3).lstrip('-')}"
    return _plain(text) if _NUMBER.fullmatch(text) else None


def gsm8k_completion_answer(text: str) -> str | None:
    """The final number a GSM8K completion commits to, by priority:

    ``\\boxed{N}`` > ``#### N`` > ``The answer is N`` > the last number in the text. A box is read
    whole (``_boxed_number``: ``\\boxed{5 - 3}`` is no answer); one left open (a truncated final
    answer) is no answer. A numeral with an exponent or a power is read
    whole (``"10**10**10"`` is not 10).
    """
    boxed = extract_boxed(text)
    if boxed is not None:
        return _boxed_number(boxed)
    if isinstance(text, str) and _BOX_OPENER.search(text):
        return None
    for find, within in _STATEMENTS:
        statement = find(text)
        if statement is not None:
            found, answer = _stated(statement, within)
            if found:  # a number stated as another ("not 72", "72 thousand") is no answer
                return answer
    return last_number(text)


# --------------------------------------------------------------------------- comparison


# A plain ASCII numeral: what Decimal() may see (it would also take "NaN", "1_0", other
# scripts' digits and exponents of any size).
_NUMERAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def _to_decimal(text: str) -> Decimal | None:
    """``text`` as an exact Decimal, or None unless it is a plain numeral within the caps
    (at most ``MAX_ANSWER_CHARS`` characters, |exponent| at most ``MAX_NUMERAL_EXPONENT``)."""
    cleaned = text.strip().replace("$", "").rstrip(".")
    if "," in cleaned and not _THOUSANDS.fullmatch(cleaned):  # "1,5" is a list, not 15
        return None
    cleaned = cleaned.replace(",", "")
    if not cleaned or len(cleaned) > MAX_ANSWER_CHARS or not _NUMERAL.fullmatch(cleaned):
        return None
    try:
        value = Decimal(cleaned)
    except (InvalidOperation, ValueError):
        return None
    exponent = value.as_tuple().exponent
    if not isinstance(exponent, int) or abs(exponent) > MAX_NUMERAL_EXPONENT:
        return None
    return value


# A plain fraction of integers, as the number extractors return one ("1/2", "-6 / 3").
_PLAIN_FRACTION = re.compile(r"([+-]?\d{1,30})[ \t]*/[ \t]*([+-]?\d{1,30})", re.ASCII)


def _to_exact(text: str) -> Decimal | Fraction | None:
    """``text`` as an exact number: a plain numeral (``_to_decimal``) or a plain fraction of
    integers of at most 30 digits each (``"1/2"``, a zero denominator is no number); else None."""
    fraction = _PLAIN_FRACTION.fullmatch(text.strip().replace("$", "").rstrip("."))
    if fraction is None:
        return _to_decimal(text)
    denominator = int(fraction.group(2))
    return Fraction(int(fraction.group(1)), denominator) if denominator else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Exact numeric equality of number strings (``"18.00"`` == ``"18"``, ``"1/2"`` == ``"0.5"``,
    ``"6/3"`` == ``"2"``); False for non-numbers, an expression (``"3×10^3"``) or a list (``"1,5"``)."""
    if a is None or b is None:
        return False
    x, y = _to_exact(a), _to_exact(b)
    return x is not None and y is not None and Fraction(x) == Fraction(y)


def verify_gsm8k(completion: str, gold: str) -> float:
    """1.0 if the completion's final number (see ``gsm8k_completion_answer``) equals ``gold``."""
    try:
        return 1.0 if numbers_equal(gsm8k_completion_answer(completion), gold) else 0.0
    except Exception:  # noqa: BLE001 -- verifiers never raise
        return 0.0


_LATEX_NOISE = re.compile(r"\\left|\\right|\\[!,;:> ]|\\displaystyle|\^\{?\\circ\}?|\\%|%|\s+")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$|^(-?\d+)/(-?\d+)$", re.ASCII)


# Spacing between two digit runs: they are two numbers, not one ("1 5", "1\\,5", "\\text{5}\\text{6}"
# were read as 15 and 56). Only a thin space grouping thousands in threes joins digits: "1\\,000" is 1000.
_SPACING = r"(?:\s|\\[,;:! ]|~|\\q?quad)+"
_SPACED_DIGITS = re.compile(rf"(\d){_SPACING}(?=\d)", re.ASCII)
_THIN_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:\\,\d{3})+(?![\d])", re.ASCII)
_DIGIT_GAP = "\u2423"  # stands for the spacing between two digit runs in a normalised answer


def _mark_digit_gaps(text: str) -> str:
    """``text`` with its ``\\text{}`` wrappers unwrapped, thin-space thousands groups joined and
    the spacing between any other two digit runs as ``_DIGIT_GAP``."""
    text = _TEXT_WRAPPER.sub(r" \1 ", text)  # a wrapper's edge separates as a space does
    text = _THIN_THOUSANDS.sub(lambda m: m.group().replace("\\,", ""), text)
    return _SPACED_DIGITS.sub(rf"\1{_DIGIT_GAP}", text)


def normalize_math_answer(text: str) -> str:
    """A conservative canonical form for string comparison of final answers.

    Drops ``$``, ``\\left``/``\\right``, thin spaces, degrees, percent signs, whitespace,
    a trailing period and ``\\text{}`` wrappers; maps ``\\dfrac``/``\\tfrac`` to ``\\frac``.
    Never merges answers that differ in value: spacing between two digit runs stays (as
    ``_DIGIT_GAP``), except a thin space grouping thousands (``1\\,000`` is ``1000``).
    """
    s = text.strip().rstrip(".").strip().strip("$").strip()
    s = _mark_digit_gaps(s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LATEX_NOISE.sub("", s)
    return s.rstrip(".")


def _as_fraction(text: str) -> Fraction | None:
    s = normalize_math_answer(text)
    # Fraction/Decimal of a giant literal is pointless work; 64 characters also keep every
    # int() below far under Python's int-from-str digit limit.
    if len(s) > 64:
        return None
    m = _FRAC.match(s)
    try:
        if m and m.group(2) is not None:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if m:
            return Fraction(int(m.group(4)), int(m.group(5)))
        d = _to_decimal(s)
        return Fraction(d) if d is not None else None
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def simple_math_equal(pred: str, gold: str) -> bool:
    """Cheap equivalence without sympy: normalised strings equal, or equal exact numbers
    (``0.5`` = ``\\frac{1}{2}`` = ``1/2``). Needs no time limit."""
    a, b = normalize_math_answer(pred), normalize_math_answer(gold)
    if a and a == b:
        return True
    x, y = _as_fraction(pred), _as_fraction(gold)
    return x is not None and y is not None and x == y


# --------------------------------------------------------------------------- time limits


# --------------------------------------------------------------------------- math-verify import

# The packages behind math-verify. Only their modules are ever dropped from sys.modules.
_MATH_VERIFY_PACKAGES = ("math_verify", "latex2sympy2_extended", "sympy", "mpmath", "antlr4")
# Verifications that pull in sympy's lazily imported parts (integrals, units, set handlers,
# combinatorics, antlr's analyser), so that they load here, with no limit armed.
_WARM_UP = (
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}"),
    (r"\boxed{\int_0^1 x dx}", r"\frac{1}{2}"),
    (r"\boxed{x \in [1, 2)}", "[1,2)"),
    (r"\boxed{\{1,2\}}", r"\{2,1\}"),
    (r"\boxed{10\%}", "0.1"),
    (r"\boxed{\binom{5}{2}}", "10"),
)
_load_lock = threading.Lock()
_load_state = "unloaded"  # -> "ready" | "missing"


def _math_verify_modules() -> set[str]:
    return {
        name for name in list(sys.modules) if name.split(".", 1)[0] in _MATH_VERIFY_PACKAGES
    }


def _drop_orphaned_modules(before: set[str]) -> None:
    """Forget the orphans an interrupted import left behind: math-verify's modules, imported
    after ``before`` was taken, one of whose parent packages is gone from ``sys.modules``.

    When an import is cut short, Python removes the modules whose code raised, but keeps their
    finished submodules. Importing the package again would then reuse those, and the new
    package object never gets them as attributes (``sympy.assumptions`` missing, math-verify
    silently scoring 0.0). Dropping the orphans makes the next import start afresh; modules
    that finished with their package are kept, as are all modules older than ``before``.
    """
    for name in _math_verify_modules() - before:
        parts = name.split(".")
        if any(".".join(parts[:i]) not in sys.modules for i in range(1, len(parts))):
            sys.modules.pop(name, None)


def load_math_verify() -> bool:
    """Import math-verify (sympy, antlr) completely and warm its lazy imports; True if usable.

    Call it with no time limit armed: ``math_verify_equal`` calls it before arming its own
    (and a worker process before it reports ready). Idempotent and thread-safe; the first call
    takes ~1-2 s. If anything interrupts the import (Ctrl-C, someone else's alarm), the
    modules it orphaned are dropped before the exception propagates, so a later call imports
    afresh rather than using half-built packages. Returns False (and keeps returning False)
    when math-verify is not installed.
    """
    global _load_state
    if _load_state != "unloaded":
        return _load_state == "ready"
    with _load_lock:
        if _load_state != "unloaded":
            return _load_state == "ready"
        before = _math_verify_modules()
        try:
            import math_verify.grader
            import math_verify.parser

            # We pass timeout=None on purpose; silence math-verify's "timeout disabled" warning.
            math_verify.parser.TIMEOUT_WARNING_SHOWN = True  # type: ignore[attr-defined]
            math_verify.grader.TIMEOUT_WARNING_SHOWN = True  # type: ignore[attr-defined]
        except ImportError:
            _drop_orphaned_modules(before)
            _load_state = "missing"
            return False
        except BaseException:
            _drop_orphaned_modules(before)
            raise
        try:
            for pred, gold in _WARM_UP:
                _math_verify_equal(pred, gold)
        except Exception:  # noqa: BLE001 -- best effort: a failed warm-up leaves those imports to later calls
            pass
        except BaseException:
            _drop_orphaned_modules(before)
            raise
        _load_state = "ready"
        return True


# --------------------------------------------------------------------------- math-verify calls


def _math_verify_equal(pred_text: str, gold: str) -> bool:
    """math-verify's verdict, with its own signal timeouts off (the caller bounds the time)."""
    from math_verify import parse, verify

    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)  # type: ignore[arg-type]
    pred_parsed = parse(pred_text, parsing_timeout=None)  # type: ignore[arg-type]
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _math_verify_local(pred_text: str, gold: str, timeout_s: float) -> bool | None:
    """``_math_verify_equal`` under a SIGALRM limit; False on timeout or any error, None if
    math-verify is not installed.

    math-verify is imported first, with no limit armed. A lazy import that a timeout still
    cuts short (some sympy parts load on first use) leaves no orphans behind (see
    ``_drop_orphaned_modules``), so the next call imports afresh.
    """
    if not load_math_verify():
        return None
    before = _math_verify_modules()
    try:
        if not _limited(timeout_s):
            return _math_verify_equal(pred_text, gold)
        return run_with_alarm(lambda: _math_verify_equal(pred_text, gold), timeout_s)
    except Exception:  # noqa: BLE001 -- includes TimeoutError
        _drop_orphaned_modules(before)
        return False
    except BaseException:  # Ctrl-C: leave no half-built module behind, then let it through
        _drop_orphaned_modules(before)
        raise


# Worker processes for calls from non-main threads (see the module docstring).
_START_TIMEOUT_S = 120.0  # a spawned worker imports sympy: slow on a loaded 2-core box
_GRACE_S = 1.0  # how long past timeout_s the parent waits before killing a worker
_MAX_WORKERS = 4
_pool_lock = threading.Lock()
_idle_workers: list[_Worker] = []
_worker_slots = threading.BoundedSemaphore(_MAX_WORKERS)


def _worker_main(conn: Any) -> None:
    # Ctrl-C belongs to the parent; it kills us on exit (we are a daemon).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    load_math_verify()  # import and warm up before saying ready, with no limit armed
    conn.send("ready")
    while True:
        try:
            pred_text, gold, timeout_s = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_math_verify_local(pred_text, gold, timeout_s))


class _Worker:
    """One spawned verification process and its pipe."""

    def __init__(self) -> None:
        # spawn, not fork: forking a multi-threaded trainer (CUDA, dataloader threads) is unsafe.
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        with safe_import_path():  # the spawned python -c never imports from the working folder
            self.proc.start()
        child.close()
        if not self.conn.poll(_START_TIMEOUT_S) or self.conn.recv() != "ready":
            self.close()
            raise RuntimeError("verification worker did not start")

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _math_verify_in_worker(pred_text: str, gold: str, timeout_s: float) -> bool | None:
    """math-verify in a worker process; None if no worker could run (caller falls back)."""
    with _worker_slots:
        with _pool_lock:
            worker = _idle_workers.pop() if _idle_workers else None
        if worker is None:
            try:
                worker = _Worker()
            except Exception:  # noqa: BLE001 -- e.g. daemonic processes may not have children
                return None
        healthy = False
        try:
            worker.conn.send((pred_text, gold, timeout_s))
            if not worker.conn.poll(timeout_s + _GRACE_S):
                return False  # hung past its own alarm: the finally kills it
            result = worker.conn.recv()
            healthy = True
            return None if result is None else bool(result)
        except Exception:  # noqa: BLE001 -- a dead worker: report "could not verify"
            return None
        finally:
            if healthy:
                with _pool_lock:
                    _idle_workers.append(worker)
            else:
                worker.close()


def math_verify_equal(pred_text: str, gold: str, timeout_s: float) -> bool | None:
    """math-verify's verdict on ``pred_text`` (any text; its answer is extracted) vs ``gold``
    (a bare answer), within ``timeout_s`` seconds from any thread.

    Returns None only when math-verify could not run at all (not installed, or a non-main
    thread and no worker). Bound: ``timeout_s`` on the main thread; ``timeout_s`` + 1 s from
    other threads, plus the start of a worker process when none is idle (once per worker,
    independent of the input). The first call in a process also imports math-verify (~1-2 s,
    see ``load_math_verify``).
    """
    if can_use_alarm() or not _limited(timeout_s):
        return _math_verify_local(pred_text, gold, timeout_s)
    return _math_verify_in_worker(pred_text, gold, timeout_s)


UNLIMITED_S = 1e6
"""A ``timeout_s`` at or past this (11 days; ``inf`` too) is no limit, as <= 0 is: an interval timer
takes no longer one."""


def _limited(timeout_s: float | None) -> bool:
    """Whether ``timeout_s`` asks for a limit; ``ValueError`` for NaN (a caller's bug, not a completion's)."""
    if timeout_s is not None and math.isnan(timeout_s):
        raise ValueError("timeout_s is NaN; give a number of seconds (<= 0: no limit)")
    return timeout_s is not None and 0 < timeout_s < UNLIMITED_S


# --------------------------------------------------------------------------- math verifier


# A numeral an expression continues: a product, power, superscript, exponent or hex prefix
_CONTINUED_NUMBER = re.compile(r"\d(?:\s*(?:[×*·^]|\\times|\\cdot)|[²³¹⁰⁴⁵⁶⁷⁸⁹]|[eE][+-]?\d)|0[xX][0-9a-fA-F]")
_COMMA_LIST = re.compile(r"-?\d+(?:,\d+)+", re.ASCII)
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", re.ASCII)
# A number in another base ("52_8", "1011_{2}"): math-verify drops the subscript (52_9 and 52 were 52_8)
# a numeral starts with a digit (a_{16} is a term)
_BASE_NUMERAL = re.compile(r"([0-9][0-9A-Za-z]*)_\{?([0-9]{1,2})\}?")


def _base_form(text: str) -> str:
    """A numeral with a base subscript as compared: no spaces, dollars or braces (``$52_{8}$`` -> ``52_8``)."""
    return re.sub(r"[\s$]|\\[,;:! ]", "", text).rstrip(".").replace("{", "").replace("}", "")


def _base_value(text: str) -> int | None:
    """The value of a numeral with a base subscript from 2 to 36 (``12_3`` -> 5), or None."""
    match = _BASE_NUMERAL.fullmatch(_base_form(text))
    if match is None or not 2 <= int(match.group(2)) <= 36:
        return None
    try:
        return int(match.group(1), int(match.group(2)))
    except ValueError:  # a digit past its base
        return None
# A relation other than = with nothing on its left: math-verify reads \boxed{\geq 5} or \boxed{\ne 5} as 5
_LEFTLESS_RELATION = re.compile(r"\s*(?:\\(?:neq?|geq?|leq?|gt|lt|not)(?![A-Za-z])|[<>\u2260\u2264\u2265]|!=)")


# The LaTeX commands math-verify reads as part of a value. Any other one it may drop, keeping only
# what follows (\boxed{2 \ast 5}, \boxed{7 \bmod 5}, \boxed{\neg 5}, \boxed{2 \to 5} were 5), so
# a boxed answer holding one is refused unless it is written as the gold is (simple_math_equal).
# An allow-list: a command missing here costs a right answer in that notation, a deny-list's gap
# a wrong answer scored right.
_KNOWN_COMMANDS = frozenset("""
    frac dfrac tfrac cfrac sqrt binom dbinom tbinom pi infty circ cdot times div pm mp
    left right text textbf mathrm mathbf mbox
    displaystyle quad qquad boxed
    sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp min max gcd lcm
    le leq ge geq lt gt ne neq cup cap in subset subseteq emptyset varnothing mathbb
    begin end matrix pmatrix bmatrix vmatrix cases array ldots cdots prime
    alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi
    rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Phi Psi Omega
""".split())
_COMMAND = re.compile(r"\\(?:([A-Za-z]+)|.)", re.DOTALL)
_KNOWN_ESCAPES = frozenset({"\\,", "\\;", "\\:", "\\!", "\\ ", "\\$", "\\%", "\\{", "\\}", "\\\\"})


def _foreign_command(text: str) -> str | None:
    """The first LaTeX command (or escape) in ``text`` that is not in ``_KNOWN_COMMANDS``, or None."""
    for match in _COMMAND.finditer(text):
        name = match.group(1)
        if (name not in _KNOWN_COMMANDS) if name is not None else (match.group() not in _KNOWN_ESCAPES):
            return match.group()
    return None


def _final_token(text: str) -> str | None:
    """The last whitespace-separated word of ``text`` that holds a digit, without the punctuation
    and markdown around it (``"**3e3**."`` -> ``"3e3"``)."""
    for word in reversed(text.split()):
        if any(c.isdigit() for c in word):
            return word.strip("*_()[]").rstrip(".,;:!?").strip("*_()[]")
    return None


def verify_math(completion: str, gold: str, timeout_s: float = 2.0) -> float:
    """1.0 if ``completion``'s final answer is mathematically equal to ``gold``, else 0.0.

    The answer is the last ``\\boxed{}``; without one, math-verify's own extraction over
    the last ``MAX_TAIL_CHARS`` characters. Order: a cheap normalised string / exact-number
    check, then math-verify (sympy) under ``timeout_s`` (see the module docstring; <= 0 or
    :data:`UNLIMITED_S` and more disable the limit). A timeout or any error scores 0.0. Never
    raises for a completion; a NaN ``timeout_s`` is ``ValueError``.
    """
    _limited(timeout_s)  # a caller's NaN is its bug, not a wrong answer
    try:
        if not isinstance(completion, str) or not isinstance(gold, str) or not gold.strip():
            return 0.0
        boxed = extract_boxed(completion)
        in_base = _base_value(gold) is not None  # read as written only: no verifier knows bases
        if boxed is not None:
            if not boxed or len(boxed) > MAX_ANSWER_CHARS:
                return 0.0
            if simple_math_equal(boxed, gold):
                return 1.0
            if in_base:  # written in the gold's base, digit for digit
                return 1.0 if _base_form(boxed) == _base_form(gold) else 0.0
            if _BASE_NUMERAL.fullmatch(_base_form(boxed)):  # another base's numeral: by its value (9_8: none)
                value = _base_value(boxed)
                return 1.0 if value is not None and numbers_equal(str(value), gold) else 0.0
            if _COMMA_LIST.fullmatch(boxed.strip()) and not _THOUSANDS.fullmatch(boxed.strip()):
                return 0.0  # "1,5" is a list; math-verify reads it as 15
            if _DIGIT_GAP in _mark_digit_gaps(boxed):
                return 0.0  # "1 5", "1\\,5": two numbers; math-verify reads them as 15
            if _LEFTLESS_RELATION.match(boxed):
                return 0.0  # "\\geq 5", "\\ne 5", "< 5": a bound or an exclusion, which math-verify reads as 5
            if _foreign_command(boxed) is not None:
                return 0.0  # math-verify drops what it does not know: \boxed{2 \ast 5} was 5
            pred_text = "\\boxed{" + boxed + "}"
        else:
            pred_text = completion[-MAX_TAIL_CHARS:]
            final = _final_token(pred_text)
            if in_base:
                return 1.0 if final is not None and _base_form(final) == _base_form(gold) else 0.0
            if final is not None and "$" not in final and _CONTINUED_NUMBER.search(final):
                # "3×10^3", "10²", "0x1F", "3e3": math-verify reads plain text's first digits (3, 10, 0, 3)
                return 1.0 if simple_math_equal(final, gold) else 0.0
        verdict = math_verify_equal(pred_text, gold, timeout_s)
        if verdict is None:  # math-verify unavailable here: exact numbers are all we can check
            return 1.0 if boxed is None and numbers_equal(last_number(pred_text), gold) else 0.0
        return 1.0 if verdict else 0.0
    except Exception:  # noqa: BLE001 -- verifiers never raise
        return 0.0
