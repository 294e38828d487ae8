"""Shipped tools: a calculator (exact arithmetic read with ``ast``, never ``eval``), Python in the bubblewrap
sandbox, and BM25 search over a local document collection (bm25s)."""

from __future__ import annotations

import ast
import json
import operator
import threading
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

from hybridflow.agents.tools import Tool, tool

_MAX_EXPRESSION_CHARS = 500
_MAX_EXPONENT = 1000
_MAX_DIGITS = 2000
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> Fraction:
    """The exact value of an arithmetic syntax tree; ValueError for anything that is not arithmetic."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponents must be whole numbers of at most {_MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        if len(str(abs(value.numerator))) > _MAX_DIGITS or len(str(value.denominator)) > _MAX_DIGITS:
            raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
        return Fraction(value)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}; allowed: numbers, + - * / // % ** and parentheses")


def _calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3 / 4".
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None
    value = _evaluate(tree)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


calculator: Tool = tool(_calculator, name="calculator")
"""The calculator tool: exact rational arithmetic, integers printed exactly, other results to 12 digits."""


def python_tool(sandbox=None, *, max_output_chars: int = 4000) -> Tool:
    """A tool named ``python`` that runs the model's program in the bubblewrap sandbox (SandboxConfig ``sandbox``).

    Refuses at once (SandboxUnavailableError, a ValueError saying what to install) where the sandbox cannot
    run, so an environment offering it fails its preflight instead of every episode.
    """
    from hybridflow.rewards.sandbox import SandboxConfig, check_available, run_python

    config = sandbox or SandboxConfig()
    check_available(config)

    def python(code: str) -> str:
        """Run a Python program in a sandbox (no network, no files kept) and return what it printed.

        Args:
            code: The program; print the values you want to see.
        """
        result = run_python(code, config=config)
        parts = [result.stdout]
        if result.stderr:
            parts.append(f"stderr:\n{result.stderr}")
        if result.timed_out:
            parts.append(f"(stopped: the program ran past {config.timeout_s:g} s)")
        elif result.returncode != 0:
            parts.append(f"(exit status {result.returncode})")
        text = "\n".join(part for part in parts if part) or "(no output)"
        return text if len(text) <= max_output_chars else text[:max_output_chars] + "\n... (output cut)"

    # the sandbox kills the program at its own limit; the tool's limit leaves time for the sandbox to start
    return tool(python, timeout_s=config.timeout_s + 30.0)


def _import_bm25s():
    """bm25s on its numpy backend. Its optional numba backend loads llvmlite, whose ffi wrappers break vLLM's
    kernel-registration scan of ``sys.modules`` when a vLLM engine starts later in the same process (vllm 0.32:
    ``'_lib_fn_wrapper' object has no attribute 'get'``), and the search tool runs inside the actor's process."""
    import sys

    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # bm25s's `from numba import njit` then raises ImportError: its numpy path
    try:
        import bm25s
    finally:
        del sys.modules["numba"]
    return bm25s


class DocumentSearch(Tool):
    """A ``search`` tool: BM25 (bm25s) over a fixed list of documents, returning the best ``top_k`` passages."""

    def __init__(self, documents: Sequence[str] | str | Path, *, top_k: int = 3, text_key: str = "text",
                 title_key: str = "title", max_chars_per_document: int = 1000, name: str = "search") -> None:
        bm25s = _import_bm25s()

        self.texts, self.titles = _documents(documents, text_key, title_key)
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k, self.max_chars = min(top_k, len(self.texts)), max_chars_per_document
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        tokens = bm25s.tokenize(self.texts, stopwords="en", show_progress=False)
        if not tokens.vocab:
            raise ValueError("DocumentSearch: the documents have no searchable words (words of two or more letters "
                             "that are not English stopwords)")
        self._index.index(tokens, show_progress=False)
        self._lock = threading.Lock()  # one retrieval at a time: calls of several episodes share the index
        super().__init__(self.search, name=name)

    def search(self, query: str) -> str:
        """Search the document collection and return the passages that best match the query.

        Args:
            query: A few keywords describing what to look for.
        """
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not any(tokens.ids):
            return "no results (the query has no searchable words)"
        with self._lock:
            indices, scores = self._index.retrieve(tokens, k=self.top_k, show_progress=False, n_threads=1)
        found = [(int(index), float(score)) for index, score in zip(indices[0], scores[0]) if score > 0]
        if not found:
            return "no results"
        return "\n\n".join(f"[{rank}] {self._title(index)}{self._excerpt(index)}"
                           for rank, (index, _) in enumerate(found, start=1))

    def _title(self, index: int) -> str:
        return f"{self.titles[index]}: " if self.titles[index] else ""

    def _excerpt(self, index: int) -> str:
        text = self.texts[index]
        return text if len(text) <= self.max_chars else text[:self.max_chars] + "..."


def _documents(source: Sequence[str] | str | Path, text_key: str, title_key: str) -> tuple[list[str], list[str]]:
    """(texts, titles) from a list of strings or a JSONL file of ``{text_key: ..., title_key: ...}`` rows."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"DocumentSearch: document file {str(path)!r} does not exist (a JSONL file of "
                             f"{{{text_key!r}: ...}} rows, or pass a list of strings)")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for number, row in enumerate(rows, start=1):
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                raise ValueError(f"DocumentSearch: line {number} of {str(path)!r} has no {text_key!r} text field")
        texts, titles = [row[text_key] for row in rows], [str(row.get(title_key) or "") for row in rows]
    else:
        texts = list(source)
        if not all(isinstance(text, str) for text in texts):
            raise ValueError("DocumentSearch: documents must be strings (or a JSONL file path)")
        titles = [""] * len(texts)
    if not texts:
        raise ValueError("DocumentSearch needs at least one document")
    return texts, titles
