"""The code blocks of README.md and docs/**/*.md, found by parsing the Markdown, and what each says about running.

A fenced ``python`` block is run as written (tests/test_docs_run.py) in a world of one, unless the line just before
its fence is a marker: an HTML comment, which shows in the Markdown source and not on the rendered page::

    <!-- doc-test: ranks=8 -->                                                  run it on 8 ranks of the pool
    <!-- doc-test: not run: FieldNet, x and y are examples/demo_3d.py's -->    a fragment; the reason is required

Shell blocks (``bash``, ``console`` or no language): each ``mesh3d ...`` command in them (``$ `` prompts, ``\\``
continuations and trailing ``# comments`` read as a shell would) runs through the installed console script, unless
its block is marked ``not run``. A page whose python blocks are all signatures says so once, anywhere in it:
``<!-- doc-test: page not run: REASON -->``.

Usage::

    for block in doc_blocks():
        block.where, block.lang, block.text, block.not_run, block.ranks, block.commands()
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL = ("bash", "console", "sh", "")
_MARKER = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
_ANY_MARKER = re.compile(r"<!--\s*doc-test:")
_FENCE = re.compile(r"^```(\S*)\s*$")
_PAGE = "page not run:"
#: An argument the reader fills in (``MODULE:FACTORY``, ``--world N``, ``SHAPE``, ``BATCH,DOMAIN,MODEL``).
_PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*(:[A-Z][A-Z_]*)?")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its page, the line of its opening fence, its language, its text, its marker."""

    path: Path
    line: int
    lang: str
    text: str
    marker: str  # what follows "doc-test:" on the line before the fence; "" when there is none
    page_marker: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        """Why this block is not run (its marker's or its page's reason), or None when it runs."""
        for marker, key in ((self.marker, "not run:"), (self.page_marker, _PAGE)):
            if marker.startswith(key):
                return marker[len(key):].strip()
        return None

    @property
    def ranks(self) -> int:
        match = re.fullmatch(r"ranks=(\d+)", self.marker)
        return int(match.group(1)) if match else 1

    def commands(self) -> list[tuple[str, list[str]]]:
        """The ``mesh3d`` commands of a shell block, joined over ``\\`` lines: (command, documented output lines)."""
        out: list[tuple[str, list[str]]] = []
        lines = self.text.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            command = line[2:] if line.startswith("$ ") else line
            i += 1
            while command.rstrip().endswith("\\") and i < len(lines):
                command = command.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
            if not command.startswith("mesh3d "):
                continue
            output = []
            while line.startswith("$ ") and i < len(lines) and not lines[i].startswith("$ "):
                output.append(lines[i])
                i += 1
            out.append((re.sub(r"\s+#.*$", "", command).strip(), output))
        return out


def is_synopsis(command: str) -> bool:
    """A usage line with placeholders the reader fills in (``mesh3d plan MODULE:FACTORY --world N``)."""
    return any(_PLACEHOLDER.fullmatch(token) for token in re.split(r"[\s\[\]|,]+", command))


def variants(command: str) -> list[list[str]]:
    """argv lists for a command as written: its ``[optional]`` arguments left out, and all given."""
    bare = re.sub(r"\s*\[[^\]]*\]", "", command)
    full = re.sub(r"\[([^\]]*)\]", r"\1", command)
    return [shlex.split(bare)] + ([shlex.split(full)] if full != bare else [])


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def doc_blocks(pages: list[Path] | None = None) -> list[Block]:
    """Every fenced block of ``pages`` (README.md and docs/**/*.md by default), with its marker."""
    found = []
    for path in pages or doc_pages():
        lines = path.read_text().splitlines()
        page = next((m.group(1) for line in lines if (m := _MARKER.match(line)) and m.group(1).startswith(_PAGE)), "")
        i = 0
        while i < len(lines):
            fence = _FENCE.match(lines[i])
            if fence is None:
                i += 1
                continue
            start = i
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            before = _MARKER.match(lines[start - 1]) if start else None
            found.append(Block(path, start + 1, fence.group(1), "\n".join(lines[start + 1:i]) + "\n",
                               before.group(1) if before else "", page))
            i += 1
    return found


def stray_markers(pages: list[Path] | None = None) -> list[str]:
    """Markers that sit anywhere but on the line before a fence (or are a page's), or say something unknown."""
    bad = []
    for path in pages or doc_pages():
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if not _ANY_MARKER.search(line):
                continue
            match = _MARKER.match(line)
            body = match.group(1) if match else ""
            before_fence = n + 1 < len(lines) and _FENCE.match(lines[n + 1]) is not None
            known = re.fullmatch(r"ranks=\d+", body) or (body.startswith("not run:") and len(body) > 12)
            if not (match and (body.startswith(_PAGE) and len(body) > 20 or (before_fence and known))):
                bad.append(f"{path.relative_to(ROOT)}:{n + 1}: {line.strip()}")
    return bad
