"""The README's annotated file tree lists every module of the package, and nothing that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^[\w.-]+(\.py|/)$")


def readme_tree_entries() -> set[str]:
    """Paths (``hybridflow/...``; directories end with ``/``) listed in the README's ``## The file tree`` block."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## The file tree", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    entries: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, directory path) of the enclosing directories
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        names = []
        for token in line.strip().split(" "):
            if not ENTRY.match(token):
                break
            names.append(token)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        if not parent and names[:1] != ["hybridflow/"]:
            continue  # scripts/, docs/, ... at the top level: not part of the package
        for name in names:
            entries.add(parent + name)
        if len(names) == 1 and names[0].endswith("/"):
            stack.append((indent, parent + names[0]))
    return entries


def test_readme_tree_lists_every_module_of_the_package():
    entries = readme_tree_entries()
    listed_dirs = {entry for entry in entries if entry.endswith("/")}
    # a directory listed without children covers its whole content (data files, task assets)
    leaf_dirs = {d for d in listed_dirs if not any(e != d and e.startswith(d) for e in entries)}
    missing = []
    for path in sorted((ROOT / "hybridflow").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" or relative in entries or any(relative.startswith(d) for d in leaf_dirs):
            continue
        missing.append(relative)
    assert not missing, f"modules missing from the README file tree: {missing}"


def test_readme_tree_lists_nothing_that_does_not_exist():
    absent = sorted(entry for entry in readme_tree_entries() if not (ROOT / entry.rstrip("/")).exists())
    assert not absent, f"README file tree lists paths that do not exist: {absent}"
