"""The import graph, read statically with `ast`, follows shared/DESIGN.md's layers: nothing imports upward, no cycle.

Every ``import`` and ``from ... import`` counts, wherever it stands (module level, inside a function, under
``if TYPE_CHECKING:``), and so do the import paths that packages resolve lazily (``_EXPORTS`` tables, the
command table of ``hybridflow/cli.py``): a string ``"hybridflow.x.y"`` or ``"hybridflow.x.y:name"`` assigned at
module level. A "unit" is a package under ``hybridflow/`` or a top-level module (``protocol``, ``device``...).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("trainers", "calibrate"),
    ("workers",),
    ("controller",),
    ("agents",),
    ("engine", "mapping"),
    ("parallel", "rewards"),
    ("algorithms", "models", "data"),
    ("protocol", "device", "ports"),
    ("_lazy", "__init__"),
)
"""Units by layer, top first. A module may import its own unit and units of lower layers only: units of one
layer never import each other. README.md's "## Layers" table says the same (checked below)."""

FORBIDDEN_THIRD_PARTY = {"algorithms": ("ray", "torch.distributed"), "mapping": ("ray", "torch.distributed"),
                         "engine": ("ray",)}
"""shared/DESIGN.md section 2: third-party modules a unit must not import, directly or through what it imports."""

IMPORT_PATH = re.compile(r"^hybridflow(\.\w+)+(:\w+)?$")


@dataclass(frozen=True)
class Import:
    source: str
    """Importing module (dotted)."""
    target: str
    """Imported module (dotted): a hybridflow module, or a third-party one (``torch.distributed`` kept whole)."""
    where: str
    """path:line of the import."""
    executed: bool
    """True for a module-level import that runs when the module is imported (not in a function, not under
    TYPE_CHECKING, not a lazy import path)."""


@dataclass
class Graph:
    root: Path
    modules: set[str] = field(default_factory=set)
    imports: list[Import] = field(default_factory=list)


def unit(module: str) -> str:
    """``hybridflow.engine.training`` -> ``engine``; ``hybridflow`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _third_party(module: str) -> str:
    return "torch.distributed" if module.startswith("torch.distributed") else module.split(".")[0]


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """Modules an import statement names: for ``from M import n``, ``M.n`` when that is a module, else ``M``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    if base == "torch" and any(alias.name == "distributed" for alias in node.names):
        return ["torch.distributed"]
    found = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    return found if len(found) == len(node.names) else [base, *found]


def _walk(node: ast.AST, executed: bool):
    """(node, executed) for every node below ``node``; function bodies and TYPE_CHECKING blocks do not run."""
    for child in ast.iter_child_nodes(node):
        runs = executed and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield child, executed
            for grandchild in child.body:
                yield grandchild, False
                yield from _walk(grandchild, False)
            for grandchild in child.orelse:
                yield grandchild, executed
                yield from _walk(grandchild, executed)
            continue
        yield child, runs
        yield from _walk(child, runs)


def import_graph(root: Path) -> Graph:
    """Every import of every module under ``root/hybridflow``."""
    paths = sorted((root / "hybridflow").rglob("*.py"))
    graph = Graph(root=root, modules={_module_of(root, path) for path in paths})
    for path in paths:
        module, tree = _module_of(root, path), ast.parse(path.read_text(), filename=str(path))
        is_package, relative = path.name == "__init__.py", path.relative_to(root).as_posix()
        for node, executed in _walk(tree, True):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, is_package, graph.modules):
                    graph.imports.append(Import(module, target, f"{relative}:{node.lineno}", executed))
        for statement in tree.body:  # lazy import paths: _EXPORTS tables, the CLI's command table
            if isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
                for node in ast.walk(statement.value):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_PATH.match(node.value):
                        target = node.value.split(":")[0]
                        if target in graph.modules:
                            graph.imports.append(Import(module, target, f"{relative}:{node.lineno}", False))
    return graph


def internal_edges(graph: Graph) -> list[Import]:
    """Imports from one unit of hybridflow into another."""
    return [edge for edge in graph.imports
            if edge.target.split(".")[0] == "hybridflow" and unit(edge.source) != unit(edge.target)]


def upward_imports(graph: Graph, layers=LAYERS) -> list[str]:
    """``path:line: source -> target`` for every import into a unit of the same or a higher layer."""
    depth = {name: index for index, layer in enumerate(layers) for name in layer}
    return [f"{edge.where}: {unit(edge.source)} -> {unit(edge.target)} ({edge.target})"
            for edge in internal_edges(graph) if depth[unit(edge.target)] <= depth[unit(edge.source)]]


def unit_cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected sets of more than one unit (Tarjan), each sorted."""
    successors: dict[str, set[str]] = {}
    for edge in internal_edges(graph):
        successors.setdefault(unit(edge.source), set()).add(unit(edge.target))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(successors.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return cycles


def forbidden_imports(graph: Graph, rules=FORBIDDEN_THIRD_PARTY) -> list[str]:
    """Imports that break ``rules``: direct ones anywhere in a unit, and indirect ones through the hybridflow
    modules its module-level imports load (a submodule loads its packages' ``__init__`` first)."""
    executed: dict[str, set[str]] = {}
    for edge in graph.imports:
        if edge.executed:
            executed.setdefault(edge.source, set()).add(edge.target)
    found = []
    for edge in graph.imports:
        banned = rules.get(unit(edge.source), ())
        if _third_party(edge.target) in banned:
            found.append(f"{edge.where}: {edge.source} imports {edge.target}")
    for source in sorted(module for module in graph.modules if unit(module) in rules):
        seen, todo = {source}, [source]
        while todo:
            module = todo.pop()
            for target in executed.get(module, ()):
                parts = target.split(".")
                for loaded in (".".join(parts[:end]) for end in range(1, len(parts) + 1)):
                    if loaded.split(".")[0] != "hybridflow":
                        if _third_party(loaded) in rules[unit(source)] and unit(module) != unit(source):
                            found.append(f"{source} loads {loaded} through {module}")
                    elif loaded in graph.modules and loaded not in seen:
                        seen.add(loaded)
                        todo.append(loaded)
    return sorted(set(found))


def _report(title: str, lines: list) -> str:
    return f"{title} ({len(lines)}):\n" + "\n".join(f"  {line}" for line in lines)


def test_every_package_and_top_level_module_has_exactly_one_layer():
    listed = [name for layer in LAYERS for name in layer]
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == {unit(module) for module in import_graph(ROOT).modules}


def test_no_module_imports_a_unit_of_its_own_or_a_higher_layer():
    upward = upward_imports(import_graph(ROOT))
    assert not upward, _report("imports that run up the layers of tests/test_layering.py::LAYERS", upward)


def test_the_units_import_each_other_without_a_cycle():
    cycles = unit_cycles(import_graph(ROOT))
    assert not cycles, _report("import cycles between units", cycles)


def test_algorithms_and_mapping_import_neither_ray_nor_torch_distributed_and_engine_never_imports_ray():
    found = forbidden_imports(import_graph(ROOT))
    assert not found, _report("imports that shared/DESIGN.md section 2 forbids", found)


def _lazy_packages(root: Path) -> list[Path]:
    return sorted(path for path in (root / "hybridflow").glob("*/__init__.py") if "_EXPORTS" in path.read_text())


@pytest.mark.parametrize("path", _lazy_packages(ROOT), ids=lambda path: path.parent.name)
def test_a_lazy_packages_type_checking_imports_name_exactly_its_export_table(path):
    tree = ast.parse(path.read_text())
    exports = next(ast.literal_eval(node.value) for node in tree.body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS")
    mirrored = {alias.asname or alias.name: node.module
                for block in tree.body if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert mirrored == exports
    public = next(ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__")
    assert sorted(public) == sorted(exports)


def test_the_readme_layer_table_lists_the_same_layers():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"^\|\s*\d+\s*\|", line)]
    layers = tuple(tuple(name.removesuffix("/").removesuffix(".py") for name in re.findall(r"`([^`]+)`",
                                                                                          row.split("|")[2]))
                   for row in rows)
    assert layers == LAYERS


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checker_reports_upward_imports_cycles_and_banned_imports_with_file_and_line(tmp_path):
    root = _write(tmp_path, {
        "hybridflow/__init__.py": "",
        "hybridflow/low/__init__.py": "",
        "hybridflow/low/a.py": "def f():\n    from hybridflow.high.b import g\n",
        "hybridflow/high/__init__.py": "TABLE = {'g': 'hybridflow.high.b'}\n",
        "hybridflow/high/b.py": "import hybridflow.low.a\nimport torch.distributed as dist\n",
        "hybridflow/mapping/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ray\n",
        "hybridflow/mapping/c.py": "from hybridflow.high import b\n",
    })
    graph = import_graph(root)
    layers = (("mapping",), ("high",), ("low",), ("__init__",))
    assert upward_imports(graph, layers) == ["hybridflow/low/a.py:2: low -> high (hybridflow.high.b)"]
    assert unit_cycles(graph) == [["high", "low"]]
    assert forbidden_imports(graph, {"mapping": ("ray", "torch.distributed")}) == [
        "hybridflow.mapping.c loads torch.distributed through hybridflow.high.b",
        "hybridflow/mapping/__init__.py:3: hybridflow.mapping imports ray",
    ]
