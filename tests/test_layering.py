"""The layering of docs/architecture.md, read from the source: which stage may import which, and no cycles.

Imports inside functions count as much as those at the top: a lazy import
still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import transformer_mt

ROOT = Path(transformer_mt.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The module ``from ... import`` names, a relative one (``from .x import y``, ``from .. import z``) resolved
    against the package of ``path``, so that no import escapes the graph."""
    if node.level == 0:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]  # a module's own package; an __init__ is its package
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b`` is module a.b when that is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            found.update(f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in modules)
            found.add(module)
    return {name for name in found if name in modules}


def test_relative_imports_are_resolved() -> None:
    """``from .x import y`` and ``from .. import z`` count as the absolute imports they are."""
    node = ast.parse("from ..model import cache").body[0]
    assert _absolute(node, ROOT / "decode" / "search.py") == "transformer_mt.model"
    assert _absolute(ast.parse("from . import config").body[0], ROOT / "cli.py") == "transformer_mt"
    assert _absolute(ast.parse("from .batcher import Batcher").body[0], ROOT / "serve" / "__init__.py") == (
        "transformer_mt.serve.batcher"
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, modules) - {name} for name, path in paths.items()}


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_data_imports_no_later_stage(graph):
    """Data preparation comes first: it may use the config, the file helpers, the user-error type, the CPU count
    (its workers) and the progress display, nothing later."""
    allowed = ("transformer_mt.data", "transformer_mt.errors", "transformer_mt.files", "transformer_mt.config",
               "transformer_mt.cpus", "transformer_mt.progress")  # fmt: skip
    for name, imported in graph.items():
        if _in(name, "transformer_mt.data"):
            bad = sorted(m for m in imported if not any(_in(m, a) for a in allowed) and m != "transformer_mt")
            assert not bad, f"{name} imports {bad}"


def test_decode_does_not_import_train(graph):
    for name, imported in graph.items():
        if _in(name, "transformer_mt.decode"):
            assert not [m for m in imported if _in(m, "transformer_mt.train")], name


# docs/architecture.md's layers, first to last: a module imports only from its own layer or earlier ones (within
# the first group, only the names before it).
LAYERS = [
    *(
        ("errors",),
        ("malloc",),
        ("cpus",),
        ("files",),
        ("progress",),
        ("run_names",),
        ("config",),
        ("checkpoint",),
        ("paper",),
        ("runs",),
    ),
    *(("data",), ("metrics",), ("model",), ("decode", "export"), ("evaluate", "synthetic_corpus"), ("train",)),
    *(("report", "plots", "attention_maps", "init_config"), ("serve",), ("quickstart", "cli", "__main__")),
]


def _layer(name: str) -> int:
    top = name.split(".")[1]
    found = [i for i, layer in enumerate(LAYERS) if top in layer]
    assert found, f"{name}: give it a layer here and in docs/architecture.md"
    return found[0]


def test_every_module_imports_only_its_own_and_earlier_layers(graph):
    bad = [f"{name} -> {m}" for name, imported in graph.items() if name != "transformer_mt" for m in imported
           if m != "transformer_mt" and _layer(m) > _layer(name)]  # fmt: skip
    assert bad == []


# Inside train/, the same rule (docs/architecture.md, "Training"): the loop last, its parts before it, each part
# importing only the layers before its own; a module in the same layer as another does not import it.
TRAIN_LAYERS = [
    ("loss", "schedule", "distributed", "launch", "run_checkpoints", "mfu", "prefetch"),
    ("step",),
    ("run_files", "run_lock", "init_from", "nonfinite", "average"),
    ("build",),
    ("budget", "epochs", "validation"),
    ("run_log", "resume"),
    ("trainer",),
]


def _inner_layer(name: str, layers: list[tuple[str, ...]]) -> int:
    found = [i for i, layer in enumerate(layers) if name.split(".")[2] in layer]
    assert found, f"{name}: give it a layer in the test's list of its package and in docs/architecture.md"
    return found[0]


def _inner_imports_against_the_layers(graph: dict[str, set[str]], package: str, layers: list[tuple[str, ...]]):
    """``package``'s imports of its own modules that are not of an earlier layer (its ``__init__`` aside)."""
    inner = {name: imported for name, imported in graph.items() if name.startswith(package + ".")}
    return [f"{name} -> {m}" for name, imported in inner.items() for m in imported
            if m.startswith(package + ".") and _inner_layer(m, layers) >= _inner_layer(name, layers)]  # fmt: skip


def test_train_modules_import_only_earlier_layers_of_train(graph):
    assert "transformer_mt.train.trainer" in graph
    assert _inner_imports_against_the_layers(graph, "transformer_mt.train", TRAIN_LAYERS) == []


# Inside checkpoint/, the same rule (docs/architecture.md, "Checkpoints"): what a checkpoint holds and where a run
# keeps it, then its files, then the average of several files.
CHECKPOINT_LAYERS = [("format", "run_dir"), ("io",), ("mean",)]


def test_checkpoint_modules_import_only_earlier_layers_of_checkpoint(graph):
    assert "transformer_mt.checkpoint.mean" in graph
    assert _inner_imports_against_the_layers(graph, "transformer_mt.checkpoint", CHECKPOINT_LAYERS) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, through any chain (strongly connected components > 1)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(name: str) -> None:
        order[name] = low[name] = len(order)
        stack.append(name)
        for nxt in graph[name]:
            if nxt not in order:
                visit(nxt)
                low[name] = min(low[name], low[nxt])
            elif nxt in stack:
                low[name] = min(low[name], order[nxt])
        if low[name] == order[name]:
            group = stack[stack.index(name) :]
            del stack[stack.index(name) :]
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(graph):
        if name not in order:
            visit(name)
    return found


def test_no_import_cycles_in_data(graph):
    """No data module imports, through any chain, one that imports it: each can be read without the other."""
    data = {name: {m for m in imported if _in(m, "transformer_mt.data")} for name, imported in graph.items()}
    assert _cycles({name: data[name] for name in data if _in(name, "transformer_mt.data")}) == []


def test_no_import_cycles(graph):
    """Nowhere in the package do two modules import each other, through any chain (lazy imports included)."""
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
