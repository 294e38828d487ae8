"""The code blocks of the user docs, and how the tests run them (tests/test_docs_run.py).

Convention (written in the doc source, right above a fence, one HTML comment per line):

* every fenced ```bash / ```sh / ```python block is run, in document order, in one temporary
  directory per doc (with ``examples/``, ``scripts/`` and ``benchmarks/`` linked in, the repo's
  venv first on PATH, so the ``hybridflow`` command is there); a doc's Python blocks share one
  interpreter, so a later block sees the names of an earlier one;
* ``<!-- docs: skip "reason" -->``: not run; the reason is required (a GPU, several nodes);
* ``<!-- docs: output -->``: the block shows what a command prints, not something to type;
* ``<!-- docs: slow -->``: the doc runs only in the slow test (``-m slow``);
* ``<!-- docs: replace "old" "new" -->``: the test runs the block with ``old`` replaced by
  ``new`` (fewer steps); ``old`` must occur in the block, so a stale replacement fails;
* ``<!-- docs: env NAME=value -->``: an environment variable for the block;
* ``<!-- docs: file PATH -->``: the block is a file the reader saves (``my_rewards.py``): it is
  written to PATH in the doc's directory instead of being run;
* ``<!-- docs: given`` ... ``-->`` (several lines): Python run just before a Python block,
  defining what the snippet takes as given (a ``batch``, a ``tokenizer``).

Bash blocks run command by command (a line ending in ``\\`` continues); comment-only lines are
skipped. A failure names the doc, the line and the command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
MARKER = re.compile(r"^<!--\s*docs:\s*(\w+)(.*?)(-->)?\s*$")
FENCE = re.compile(r"^(\s*)(`{3,})([\w+-]*)\s*$")
LINKED_INTO_WORKDIR = ("examples", "scripts", "benchmarks")
RESULT_TAG = "@@docs-result@@ "


def doc_files() -> list[Path]:
    """README.md, docs/*.md and the examples' READMEs, in a fixed order."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*/README.md"))]


@dataclass
class Block:
    doc: str                      # path relative to the repo
    line: int                     # 1-based line of the opening fence
    language: str                 # "bash" or "python" (or the fence's word when not run)
    code: str
    skip: str | None = None       # reason
    output: bool = False
    slow: bool = False
    replaces: list[tuple[str, str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    given: str = ""
    given_line: int = 0
    file: str | None = None        # written to this path instead of run

    @property
    def runs(self) -> bool:
        return self.language in ("bash", "python") and self.skip is None and not self.output

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def code_to_run(self) -> str:
        code = self.code
        for old, new in self.replaces:
            code = code.replace(old, new)
        return code

    def commands(self) -> list[tuple[int, str]]:
        """(doc line, command) of a bash block, continuation lines joined, comment lines dropped."""
        commands, pending, start = [], "", 0
        for offset, raw in enumerate(self.code_to_run().splitlines()):
            line = raw.rstrip()
            if not pending:
                start = self.line + 1 + offset
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            commands.append((start, pending + line))
            pending = ""
        if pending:
            commands.append((start, pending))
        return commands


def _quoted(text: str, count: int, where: str, name: str) -> list[str]:
    try:
        parts = shlex.split(text)
    except ValueError as error:
        raise ValueError(f"{where}: marker docs: {name} {text.strip()!r}: {error}") from None
    if len(parts) != count:
        raise ValueError(f"{where}: marker docs: {name} takes {count} quoted argument(s), got {text.strip()!r}")
    return parts


def parse_doc(path: Path, root: Path = REPO) -> list[Block]:
    """The fenced blocks of one doc with the markers right above each (ValueError on a bad marker)."""
    lines = path.read_text().splitlines()
    doc = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    blocks: list[Block] = []
    pending: dict = {}
    index = 0
    while index < len(lines):
        text = lines[index]
        where = f"{doc}:{index + 1}"
        marker = MARKER.match(text.strip())
        fence = FENCE.match(text)
        if marker:
            name, rest, closed = marker.group(1), marker.group(2), marker.group(3)
            if name == "given":
                if closed:
                    raise ValueError(f"{where}: docs: given takes its Python on the following lines, closed by -->")
                body, index = [], index + 1
                pending["given_line"] = index + 1
                while index < len(lines) and lines[index].strip() != "-->":
                    body.append(lines[index])
                    index += 1
                if index == len(lines):
                    raise ValueError(f"{where}: docs: given is never closed by a line -->")
                pending["given"] = "\n".join(body)
            elif not closed:
                raise ValueError(f"{where}: marker {text.strip()!r} must end with --> on the same line")
            elif name == "skip":
                reason = _quoted(rest, 1, where, name)[0].strip()
                if not reason:
                    raise ValueError(f"{where}: docs: skip needs a reason")
                pending["skip"] = reason
            elif name in ("output", "slow"):
                if rest.strip():
                    raise ValueError(f"{where}: docs: {name} takes no argument, got {rest.strip()!r}")
                pending[name] = True
            elif name == "replace":
                pending.setdefault("replaces", []).append(tuple(_quoted(rest, 2, where, name)))
            elif name == "file":
                pending["file"] = _quoted(rest, 1, where, name)[0]
            elif name == "env":
                for item in _quoted(rest, len(shlex.split(rest)), where, name):
                    key, sep, value = item.partition("=")
                    if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
                        raise ValueError(f"{where}: docs: env takes NAME=value items, got {item!r}")
                    pending.setdefault("env", {})[key] = value
            else:
                raise ValueError(f"{where}: unknown marker docs: {name}; allowed: skip, output, slow, replace, env, file, given")
            index += 1
            continue
        if fence:
            ticks, word = fence.group(2), fence.group(3).lower()
            end = index + 1
            while end < len(lines) and not (lines[end].strip().startswith(ticks) and lines[end].strip().strip("`") == ""):
                end += 1
            indent = len(fence.group(1))
            code = "\n".join(line[indent:] if line[:indent].strip() == "" else line for line in lines[index + 1:end])
            block = Block(doc=doc, line=index + 1, language=RUN_LANGUAGES.get(word, word or "text"), code=code, **pending)
            if pending and block.language not in ("bash", "python"):
                raise ValueError(f"{block.where}: docs markers above a ```{word} block, which is never run")
            if block.file and (block.given or block.env):
                raise ValueError(f"{block.where}: docs: file blocks are written, not run: no given or env")
            if block.given and block.language != "python":
                raise ValueError(f"{block.where}: docs: given is only for ```python blocks")
            for old, _ in block.replaces:
                if old not in block.code:
                    raise ValueError(f"{block.where}: docs: replace {old!r} matches nothing in the block")
            blocks.append(block)
            pending = {}
            index = end + 1
            continue
        if pending and text.strip():
            raise ValueError(f"{where}: docs markers must stand right above a fenced block")
        index += 1
    return blocks


def prepare_workdir(directory: Path) -> None:
    """A new user's checkout seen from a fresh directory: the repo's example files, nothing else."""
    for name in LINKED_INTO_WORKDIR:
        (directory / name).symlink_to(REPO / name)


def run_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The venv's bin first on PATH, this checkout importable, one thread per process."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra or {})
    return env


class DocFailure(AssertionError):
    """A doc's block failed: the message names the doc, the line and the command."""


def _tail(text: str, limit: int = 4000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


class PythonSession:
    """One interpreter per doc (tests/docs_exec.py): blocks run in order and share their names."""

    def __init__(self, workdir: Path):
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("docs_exec.py"))],
                                        cwd=workdir, env=run_environment(), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def run(self, block: Block, timeout: float) -> None:
        request = {"doc": block.doc, "line": block.line, "code": block.code_to_run(), "given": block.given,
                   "given_line": block.given_line, "env": block.env}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        output = []
        for line in self.process.stdout:
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
                if not result["ok"]:
                    raise DocFailure(f"{block.where}: the ```python block failed:\n{_indent(block.code_to_run())}\n"
                                     f"{_tail(''.join(output))}{result['error']}")
                return
            output.append(line)
        raise DocFailure(f"{block.where}: the Python process ended while running the block:\n"
                         f"{_indent(block.code_to_run())}\n{_tail(''.join(output))}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _indent(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


def run_bash(block: Block, workdir: Path, timeout: float) -> None:
    for line, command in block.commands():
        try:
            done = subprocess.run(["bash", "-c", "set -eo pipefail\n" + command], cwd=workdir,
                                  env=run_environment(block.env), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DocFailure(f"{block.doc}:{line}: `{command}` ran past {timeout:.0f} s") from None
        if done.returncode != 0:
            raise DocFailure(f"{block.doc}:{line}: `{command}` exited with {done.returncode}\n"
                             f"{_tail(done.stdout + done.stderr)}")


def run_doc(blocks: list[Block], workdir: Path, timeout: float = 900) -> None:
    """Run a doc's blocks in order in ``workdir`` (DocFailure on the first that fails)."""
    prepare_workdir(workdir)
    session = None
    try:
        for block in blocks:
            if not block.runs:
                continue
            if block.file:
                target = workdir / block.file
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.code_to_run() + "\n")
            elif block.language == "bash":
                run_bash(block, workdir, timeout)
            else:
                session = session or PythonSession(workdir)
                session.run(block, timeout)
    finally:
        if session is not None:
            session.close()
