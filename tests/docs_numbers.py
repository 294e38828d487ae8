"""Which numbers a doc states as measurements, and whether each names the command that produced it.

The rule (tests/test_docs_numbers.py):

* a *measured number* is a number with a unit of measurement, written in prose or in a table
  (not inside a code span or a fenced block): a percentage (``94.5%``), a time (``3.1 min``,
  ``52 s``, ``10 ms``, ``2 h``), a throughput (``tok/s``, ``tokens/s``, ``samples/s``), a size
  (``GiB``, ``GB``, ``MiB``, ``MB``) or a speed-up (``1.24x``);
* the section that states it (the text between two headings, any level) must name its command:
  a fenced ``bash``/``sh`` block or an unlabelled fence whose lines start with a command, an
  indented (4-space) code line that starts with a command, a line
  starting with ``Command:``, an inline code span starting with ``hybridflow``, ``python``,
  ``bash``, ``pytest``, ``torchrun`` or ``PYTHONPATH=``, or a link to a section (``doc.md#anchor``
  or ``#anchor``) that does;
* numbers that are settings or facts rather than measurements (a default timeout, a machine's RAM)
  are listed, with the reason, in ``NOT_MEASURED`` of the test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from docs_snippets import REPO

MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:%|x(?![\w])|×|ms\b|s\b|min\b|minutes?\b|h\b|hours?\b|tok/s|tokens/s|"
    r"samples/s|GiB\b|GB\b|MiB\b|MB\b)")
COMMAND_WORDS = r"(?:hybridflow|python3?|bash|pytest|torchrun|PYTHONPATH=)"
INLINE_COMMAND = re.compile(r"`" + COMMAND_WORDS + r"[^`]*`")
COMMAND_LINE = re.compile(r"^\s*(?:\$\s*)?" + COMMAND_WORDS)
INDENTED_COMMAND = re.compile(r"^ {4,}(?:\$\s*)?" + COMMAND_WORDS)
LINK = re.compile(r"\]\(([^)\s]*?)#([\w-]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")
HTML_COMMENT = re.compile(r"<!--.*?-->")


def number_docs() -> list[Path]:
    """The docs whose numbers are checked: README.md, docs/*.md, the examples' READMEs, benchmarks/README.md."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*/README.md")),
            REPO / "benchmarks" / "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@dataclass
class Section:
    doc: str
    line: int
    heading: str
    numbers: list[tuple[int, str]] = field(default_factory=list)   # (line, "94.5%")
    has_command: bool = False
    links: list[tuple[str, str]] = field(default_factory=list)     # (doc, anchor)


def sections_of(path: Path) -> list[Section]:
    doc = str(path.relative_to(REPO))
    section = Section(doc, 1, "")
    sections = [section]
    fence, fence_language = None, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence) and not stripped.strip("`"):
                fence = None
            elif fence_language in ("bash", "sh", "shell", "console", "") and COMMAND_LINE.match(line):
                section.has_command = True
            continue
        opening = re.match(r"^(`{3,})([\w+-]*)", stripped)
        if opening:
            fence, fence_language = opening.group(1), opening.group(2).lower()
            continue
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            section = Section(doc, number, heading.group(1))
            sections.append(section)
            continue
        if INDENTED_COMMAND.match(line):       # an indented (4-space) code block holding a command
            section.has_command = True
            continue
        if stripped.startswith("Command:") or INLINE_COMMAND.search(line):
            section.has_command = True
        for target, anchor in LINK.findall(line):
            resolved = doc if not target else str((path.parent / target).resolve().relative_to(REPO))
            section.links.append((resolved, anchor))
        prose = CODE_SPAN.sub(" ", HTML_COMMENT.sub(" ", line))
        section.numbers.extend((number, match.group(0)) for match in MEASURED.finditer(prose))
    return sections


def numbers_without_command(not_measured: dict[tuple[str, str], str]) -> list[str]:
    """'doc:line: "94.5%" (section "...")' for every measured number whose section names no command."""
    all_sections = {path: sections_of(path) for path in number_docs()}
    by_anchor = {(section.doc, slug(section.heading)): section for sections in all_sections.values()
                 for section in sections}

    def names_command(section: Section) -> bool:
        return section.has_command or any(
            (target := by_anchor.get(link)) is not None and target.has_command for link in section.links)

    missing = []
    for sections in all_sections.values():
        for section in sections:
            if names_command(section):
                continue
            for line, text in section.numbers:
                if (section.doc, text) not in not_measured:
                    missing.append(f'{section.doc}:{line}: "{text}" (section "{section.heading}")')
    return missing
