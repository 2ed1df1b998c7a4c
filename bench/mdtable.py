"""One markdown-table formatter for the bench scripts (run as `python bench/X.py`, so this
directory is on sys.path and they `from mdtable import markdown_table`)."""

from __future__ import annotations

_RULE = {"l": "---", "r": "---:", "c": ":---:"}


def markdown_table(headers: list[str], rows: list[list[object]], align: str | None = None) -> str:
    """A GitHub-flavoured markdown table. `align` has one letter per column: l(eft), r(ight),
    c(enter) (default: all left); cells are str()-ed as they are."""
    align = align or "l" * len(headers)
    if len(align) != len(headers) or any(len(r) != len(headers) for r in rows):
        raise ValueError(f"markdown_table: {len(headers)} headers, align {align!r}, rows of "
                         f"{sorted({len(r) for r in rows})} cells")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(_RULE[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
