"""Help text layout shared by the ``tclightning`` and ``lightning`` commands."""

from __future__ import annotations

import argparse
import textwrap


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Description and epilog as written, except that a line longer than the terminal (less
    argparse's margin) is wrapped; indented lines (command examples) are kept whole."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.splitlines():
            if line[:1].isspace() or len(indent + line) <= width:
                lines.append(indent + line)
            else:
                lines.extend(textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent))
        return "\n".join(lines)
