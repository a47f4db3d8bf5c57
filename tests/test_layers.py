"""The house is layered: drawn from its imports (every import, those inside functions and under TYPE_CHECKING
too), ``src/quietsync`` has no circle of modules, no circle between the rooms of any folder (an import that
runs back up a floor), and the floors stand in the order the design names: the ground kit (transport, codecs,
models, the cost vocabulary, the command-line kit) below the strategies, the strategies below the trainer, the
trainer below the planner (whose pilots are training runs), and both below the commands (``quietsync``,
``quietsync compare``). ``tests/strategies/test_contract.py`` holds the same line inside ``strategies/``
(no family imports another)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

import quietsync

SRC = Path(quietsync.__file__).parent
Edges = dict[str, dict[str, list[int]]]
"""``{importer: {imported: [line numbers]}}`` between dotted module names (a package is its ``__init__``)."""


def _modules(root: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = ("quietsync", *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> Edges:
    """Every import of every module, resolved to the module it names (``from pkg import sub``: ``pkg.sub``)."""
    edges: Edges = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: dict[str, list[int]] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
                base = ".".join(filter(None, (base, node.module or "")))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    found.setdefault(target, []).append(node.lineno)
        edges[name] = found
    return edges


def _circles(nodes: Iterable[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def _rooms(edges: Edges) -> dict[str, dict[tuple[str, str], list[str]]]:
    """Per folder, the arrows between its rooms (a file or a sub-folder): ``{folder: {(room, room): [why]}}``.
    An import between two modules counts in the deepest folder holding both, between the rooms holding each;
    a package importing its own modules (its face) or a module importing a package above it is no arrow
    between rooms (a circle it closes is a circle of modules)."""
    out: dict[str, dict[tuple[str, str], list[str]]] = {}
    for a, targets in edges.items():
        for b, lines in targets.items():
            pa, pb = a.split("."), b.split(".")
            common = 0
            while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
                common += 1
            if common in (len(pa), len(pb)):
                continue  # one contains the other
            folder = ".".join(pa[:common])
            pair = (pa[common], pb[common])
            out.setdefault(folder, {}).setdefault(pair, []).append(f"{a}:{lines[0]} -> {b}")
    return out


def _reaches(edges: Edges, start: Iterable[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        v = todo.pop()
        for w in edges.get(v, {}):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


EDGES = _imports(_modules())


def test_no_circle_of_modules():
    circles = _circles(EDGES, {a: set(t) for a, t in EDGES.items()})
    detail = [[f"{a}:{EDGES[a][b][0]} -> {b}" for a in c for b in EDGES[a] if b in c] for c in circles]
    assert not circles, detail


def test_no_import_runs_back_up_in_any_folder():
    problems = []
    for folder, arrows in sorted(_rooms(EDGES).items()):
        graph: dict[str, set[str]] = {}
        for a, b in arrows:
            graph.setdefault(a, set()).add(b)
        for circle in _circles({r for pair in arrows for r in pair}, graph):
            problems.append((folder, [why for (a, b), whys in arrows.items() if a in circle and b in circle
                                      for why in whys]))
    assert not problems, problems


# lower floor -> the rooms it must never reach (through any chain of imports)
NEVER = {
    "quietsync.transport": ("quietsync.strategies", "quietsync.cost", "quietsync.plan", "quietsync.train"),
    "quietsync.wire.codecs": ("quietsync.strategies", "quietsync.plan", "quietsync.train"),
    "quietsync.models": ("quietsync.strategies", "quietsync.cost", "quietsync.plan", "quietsync.train"),
    "quietsync.cost": ("quietsync.strategies", "quietsync.plan", "quietsync.train"),
    "quietsync.cli": ("quietsync.strategies", "quietsync.plan", "quietsync.train"),
    "quietsync.strategies": ("quietsync.plan", "quietsync.train", "quietsync.cli", "quietsync.commands"),
    "quietsync.train": ("quietsync.plan", "quietsync.commands"),
    "quietsync.plan": ("quietsync.commands",),
}


@pytest.mark.parametrize("low", sorted(NEVER))
def test_a_lower_floor_never_reaches_a_higher_one(low):
    inside = [m for m in EDGES if m == low or m.startswith(low + ".")]
    reached = _reaches(EDGES, inside)
    bad = sorted(m for m in reached for high in NEVER[low] if m == high or m.startswith(high + "."))
    assert not bad, f"{low} reaches {bad}"


def test_the_checks_can_fail():
    # a circle of two modules, and one between two folders' rooms, are found and named
    edges: Edges = {"q.a.x": {"q.b.y": [3]}, "q.b.y": {"q.a.z": [7]}, "q.a.z": {}}
    assert _circles(edges, {a: set(t) for a, t in edges.items()}) == []
    rooms = _rooms(edges)
    assert rooms == {"q": {("a", "b"): ["q.a.x:3 -> q.b.y"], ("b", "a"): ["q.b.y:7 -> q.a.z"]}}
    assert _circles(["a", "b"], {"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert "quietsync.strategies.base" in _reaches(EDGES, ["quietsync.strategies.baselines.ddp"])
