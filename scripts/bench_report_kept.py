"""The blocks of docs/benchmarks.md written by hand, kept when ``bench_report.py`` writes the page anew.

Dated notes on a change (before and after, the commits compared) and figures from runs that leave no JSON are written
into the page by hand, each between a ``<!-- by hand -->`` line and a ``<!-- /by hand -->`` line. Written anew from
the JSON files, the page gets each block back after the line that came before it (the nearest line outside any block,
where the new page still has it), else at the end of the section it was in, else at the end of the page; a block is
never dropped.

Usage (``bench_report.py``)::

    lines = keep_hand_written(old_page_text, lines)
"""

from __future__ import annotations

BEGIN, END = "<!-- by hand -->", "<!-- /by hand -->"


def hand_written(text: str) -> list[tuple[str, str, list[str]]]:
    """Each block of ``text`` written by hand: (its section's heading, the line before it, its lines with markers).

    Usage: ``for heading, anchor, block in hand_written(page): ...``
    """
    lines, blocks = text.split("\n"), []
    heading = anchor = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == BEGIN:
            try:
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == END)
            except StopIteration:
                raise ValueError(f"docs/benchmarks.md: a '{BEGIN}' at line {i + 1} has no '{END}' after it") from None
            blocks.append((heading, anchor, lines[i:end + 1]))
            i = end + 1
            continue
        if line.startswith("#"):
            heading = line
        if line.strip():
            anchor = line
        i += 1
    return blocks


def _section_end(lines: list[str], at: int) -> int:
    """The index of the first line after the section whose heading is ``lines[at]`` (a heading of its level or
    higher starts the next one), or the page's length."""
    level = len(lines[at]) - len(lines[at].lstrip("#"))
    for j in range(at + 1, len(lines)):
        if lines[j].startswith("#") and len(lines[j]) - len(lines[j].lstrip("#")) <= level:
            return j
    return len(lines)


def keep_hand_written(old: str, lines: list[str]) -> list[str]:
    """``lines`` (the page written anew) with every block written by hand in ``old`` put back (module docstring).

    Usage: ``lines = keep_hand_written(path.read_text(), lines)``
    """
    new = "\n".join(lines).split("\n")
    start = 0  # NOTE: blocks go back in their order: each anchor is looked for after the block put back before it
    for heading, anchor, block in hand_written(old):
        at = next((j + 1 for j in range(start, len(new)) if anchor and new[j] == anchor), None)
        if at is None and heading in new:
            at = _section_end(new, new.index(heading))
            while at > 0 and not new[at - 1].strip():
                at -= 1
        if at is None:  # NOTE: at the end, after one blank line, as it will be found next time (after its anchor)
            while new and not new[-1].strip():
                new.pop()
            new += ["", *block, ""]
            start = len(new)
            continue
        new[at:at] = ["", *block]
        start = at + len(block) + 1
    return new
