"""Package namespaces that import their submodules on first use (PEP 562).

The config dataclasses live in light modules, but importing ``hybridflow.engine.config`` runs
``hybridflow/engine/__init__.py`` first; if that imported the engines it would pull in torch,
transformers and Ray (seconds) before a config error could be reported. A package built with
``lazy_exports`` resolves ``hybridflow.engine.TrainingEngine`` on first access instead.

Each such package repeats its table as imports under ``if TYPE_CHECKING:`` (never run), so type checkers,
IDEs and tests/test_layering.py see the import graph; that test keeps the two equal.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(``__getattr__``, ``__dir__``) for ``package``: ``exports`` maps a public name to its submodule."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
