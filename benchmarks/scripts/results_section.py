"""A benchmark's own section of a results file: several scripts (or runs) share one file in
docs/results/, and each rewrites only what it wrote."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, name: str, lines: list[str], title: str) -> None:
    """``lines`` as the section ``name`` of the markdown file ``path``, between
    ``<!-- begin NAME -->`` and ``<!-- end NAME -->``: the rest of the file (the other script's
    section, notes written by hand) stays as it is. A file without the section gets it at its
    end; a new file starts with ``title``."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    section = "\n".join([begin, *lines, end])
    text = path.read_text(encoding="utf-8") if path.exists() else f"# {title}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
