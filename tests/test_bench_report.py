"""docs/benchmarks.md written anew from its JSON files (``scripts/bench_report.py``, the last step of
``scripts/bench_all.sh``) keeps every block written by hand: before 2026-12-07 it dropped them all (400 of the page's
744 lines: the dated notes on each change, the start-up section, GPU runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_report_kept import BEGIN, END, hand_written, keep_hand_written  # noqa: E402

_PAGE = "\n".join([
    "# Benchmarks", "", "## One", "", "table one", "", BEGIN, "note after table one", END, "", "text one", "",
    "## Two", "", "old figure of two", "", BEGIN, "note after the old figure", END, "", "## Three", "", "three", "",
    BEGIN, "note of three", END, ""])


def _in_order(lines: list[str], blocks: list[list[str]]) -> bool:
    at = 0
    for block in blocks:
        found = next((i for i in range(at, len(lines) - len(block) + 1) if lines[i:i + len(block)] == block), None)
        if found is None:
            return False
        at = found + len(block)
    return True


def test_each_block_goes_back_after_its_line_else_to_its_section_else_to_the_end():
    new = ["# Benchmarks", "", "## One", "", "table one", "", "text one", "", "## Two", "", "new figure of two", "",
           "## Four", "", "four", ""]
    merged = keep_hand_written(_PAGE, new)
    assert merged[merged.index("table one") + 2:merged.index("table one") + 5] == [BEGIN, "note after table one", END]
    # its line is gone: at the end of its section, before the next heading
    two = merged.index("note after the old figure")
    assert merged.index("new figure of two") < two < merged.index("## Four")
    # its section is gone: at the end of the page
    assert merged.index("note of three") > merged.index("four")
    blocks = [b for _, _, b in hand_written(_PAGE)]
    assert _in_order(merged, blocks) and len(hand_written("\n".join(merged))) == 3
    assert keep_hand_written("\n".join(merged), new) == merged  # written anew again: the same page


def test_a_block_left_open_is_an_error_naming_its_line():
    with pytest.raises(ValueError, match="line 3"):
        hand_written("# B\n\n" + BEGIN + "\nnote\n")


def test_the_page_written_anew_keeps_every_block_written_by_hand():
    import bench_report

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    blocks = [b for _, _, b in hand_written(page)]
    assert len(blocks) >= 6  # the dated notes, start-up, the GPU runs ...
    merged = keep_hand_written(page, bench_report.page_lines())
    assert _in_order(merged, blocks)
    assert keep_hand_written("\n".join(merged), bench_report.page_lines()) == merged
