"""The package's shape: a few top-level modules, none too long, imports that flow one way.

Imports are read from the source (every `import` statement, lazy ones inside functions too), so
a cycle or an upward import fails here even when no test happens to execute it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "exo_split"

# Lower layers never import higher ones: commands -> node roles -> transport/backends -> spec/kv.
LAYERS = {
    "__main__": 5,
    "cli": 4,
    "bench": 3,
    "node": 2,
    "transport": 1,
    "discovery": 1,
    "report": 1,
    "backends": 1,
    "models": 1,
    "handoff": 1,
    "fidelity": 1,
}  # anything else (errors, spec, kv, sampling, tokenizer, the package itself): 0
FRAMEWORK_FREE = ("transport", "discovery", "report", "spec", "kv", "sampling", "errors")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The exo_split modules `name` imports (a `from pkg import sub` counts as pkg.sub when
    that is a module, else as pkg), plus third-party top-level names prefixed with '!'."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [(base, a.name) for a in node.names]
        else:
            continue
        for module, attr in targets:
            if not module.startswith("exo_split"):
                found.add("!" + module.split(".")[0])
            elif attr is not None and f"{module}.{attr}" in MODULES:
                found.add(f"{module}.{attr}")
            elif module in MODULES:
                found.add(module)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_at_most_14_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 14, top


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_500_lines(name):
    n = len(MODULES[name].read_text().splitlines())
    assert n <= 500, f"{name} has {n} lines"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(m for m in GRAPH.get(node, ()) if not m.startswith("!")):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_imports_flow_down_the_layers():
    upward = [
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if not b.startswith("!") and LAYERS.get(_part(b), 0) > LAYERS.get(_part(a), 0)
    ]
    assert not upward, upward


def test_nothing_outside_the_cli_imports_it():
    importers = [a for a, t in GRAPH.items() if any(_part(b) == "cli" for b in t)]
    assert all(_part(a) == "cli" or a == "exo_split.__main__" for a in importers), importers


def _reachable(name: str) -> dict[str, str]:
    """Everything `name` imports, directly or through other exo_split modules: target -> the
    chain that gets there."""
    chains, todo = {name: name}, [name]
    while todo:
        a = todo.pop()
        for b in sorted(GRAPH.get(a, ())):
            if b not in chains:
                chains[b] = f"{chains[a]} -> {b}"
                if not b.startswith("!"):
                    todo.append(b)
    del chains[name]
    return chains


def test_the_core_never_imports_a_framework():
    """Not even through another module (e.g. a core module importing handoff, which imports
    the backends): the chain is what a Mac without torch would trip over."""
    leaks = [
        chain
        for a in sorted(GRAPH)
        if _part(a) in FRAMEWORK_FREE
        for b, chain in _reachable(a).items()
        if b in ("!torch", "!mlx", "!mlx_lm", "!transformers") or _part(b) == "backends"
    ]
    assert not leaks, leaks


def test_the_graph_is_read_at_all():
    """The checks above are only as good as the parsing: it must see real edges."""
    assert "exo_split.transport.wire" in GRAPH["exo_split.node.prefill"]
    assert "exo_split.report.figures" in GRAPH["exo_split.report"]
    assert "!aiohttp" in GRAPH["exo_split.transport.server"]
    assert "exo_split.discovery.txt" in GRAPH["exo_split.discovery.mdns"]  # relative import
