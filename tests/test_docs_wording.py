"""Docs and user-facing text state facts with their source, not the project's development
history: no "SPEC", no "session 2", no "the hub's" (the Hugging Face Hub is fine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What a reader cannot look up: an internal design file, a numbered work session, the research notes
# the project started from. Each pattern with a sample it must catch (checked below).
FORBIDDEN = {
    r"\bSPEC(\.md)?\b": "as in the SPEC",
    r"\b[Ss]ession[ -]?\d": "re-measured in session 2; the session-1 draw",
    r"\b[Dd]evelopment round\b": "in the second development round",
    r"(?i)\b(the (research )?hub\b|hub's)": "the hub's stable winner; The research hub lost runs",
}
ALLOWED_LINE = re.compile(r"Hugging Face|huggingface|hf_hub|hub name|hub dataset|hub tokenizer")


def user_facing_files() -> list[Path]:
    """Pages, READMEs, recipe and preset files, and the package's source (its docstrings become the
    reference pages and its strings the messages)."""
    files = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").rglob("*.md")),
             *sorted((REPO / "recipes").glob("*.yaml")), *sorted((REPO / "callbacks").glob("*.yaml")),
             *sorted((REPO / "tclightning").rglob("*.py"))]
    return [f for f in files if f.is_file()]


def offending_lines(text: str) -> list[str]:
    """Lines of ``text`` that name the development history (one of :data:`FORBIDDEN`)."""
    return [line.strip() for line in text.splitlines()
            if not ALLOWED_LINE.search(line) and any(re.search(p, line) for p in FORBIDDEN)]


@pytest.mark.parametrize("pattern", list(FORBIDDEN))
def test_each_pattern_catches_its_sample(pattern: str) -> None:
    for sample in FORBIDDEN[pattern].split("; "):
        assert offending_lines(sample) == [sample], sample


def test_patterns_leave_ordinary_words_alone() -> None:
    fine = ["a CutSpec per cut", "spec = importlib.util.find_spec(name)", "a hub name or a local directory",
            "loads SynthLabsAI/Big-Math-RL-Verified from the Hugging Face hub", "interleaved rounds",
            "the sessions of a long run", "the original experiments' recipe"]
    assert offending_lines("\n".join(fine)) == []


def test_docs_and_messages_do_not_name_the_development_history() -> None:
    found = {str(f.relative_to(REPO)): lines for f in user_facing_files()
             if (lines := offending_lines(f.read_text(encoding="utf-8", errors="replace")))}
    assert not found, found
