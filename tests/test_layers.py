"""The house is layered: drawn from its imports (every import, those inside functions and under TYPE_CHECKING
too), ``src/quietsync`` has no circle of modules, no circle between the rooms of any folder (an import that
runs back up a floor), and every module stands on a floor (:data:`FLOORS`) with no import from a lower floor to a
higher one: the leaves (topology, link, events) under the transport and the models, under the communication
worker, under the flat buffers, the wire, the cost vocabulary and the command-line kit, under the optimizers,
the strategies, fault tolerance, the front doors (Accelerate, Trainer, ``QuietOptimizer``), the data pipeline
(which knows nothing of training), the trainer (whose loop reads its batches), the planner (whose pilots are
training runs), the commands (``quietsync``, ``quietsync compare``), the GPU check and,
on top, the package's face. ``docs/contract.md`` draws the same floors (checked here), and ``import quietsync``
loads no floor it does not use (not the planner). ``tests/strategies/test_contract.py`` holds the same line
inside ``strategies/`` (no family imports another)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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


FACE = "quietsync"
FLOORS: dict[str, int] = {
    FACE: 14,  # the package's __init__: re-exports from the floors below, each loaded on first use
    "quietsync.__main__": 13, "quietsync.gpu_check": 13,
    "quietsync.commands": 12,
    "quietsync.plan": 11,
    "quietsync.train": 10,
    "quietsync.data": 9,
    "quietsync.accelerate": 8, "quietsync.hf_trainer": 8, "quietsync.quiet_optimizer": 8,
    "quietsync.faults": 7,
    "quietsync.strategies": 6,
    "quietsync.optim": 5,
    "quietsync.flat": 4, "quietsync.wire": 4, "quietsync.cost": 4, "quietsync.cli": 4,
    "quietsync.comm_worker": 3,
    "quietsync.transport": 2, "quietsync.models": 2,
    "quietsync.topology": 1, "quietsync.link": 1, "quietsync.events": 1, "quietsync.validate": 1,
    "quietsync.activation_memory": 1, "quietsync._versions": 1, "quietsync.errors": 1,
}
"""Module prefix (a room: a package or a module) -> its floor; an import may go down or stay on its floor, never up.
The face (``quietsync`` itself) is that one module only; every other room holds the modules under it."""


def floor_of(module: str, floors: dict[str, int] = FLOORS) -> int:
    """The floor of ``module``: that of the longest prefix naming it; KeyError for a module on no floor."""
    rooms = [p for p in floors if module == p or (p != FACE and module.startswith(p + "."))]
    if not rooms:
        raise KeyError(f"{module} stands on no floor: add its room to FLOORS (and to docs/contract.md's drawing)")
    return floors[max(rooms, key=len)]


def upward(edges: Edges, floors: dict[str, int] = FLOORS) -> list[str]:
    """Every import in ``edges`` from a lower floor to a higher one, as ``importer:line (floor) -> imported
    (floor)``."""
    out = []
    for a, targets in sorted(edges.items()):
        for b, lines in sorted(targets.items()):
            low, high = floor_of(a, floors), floor_of(b, floors)
            if high > low:
                out.append(f"{a}:{lines[0]} (floor {low}) -> {b} (floor {high})")
    return out


def test_every_module_stands_on_a_floor():
    missing = []
    for module in EDGES:
        try:
            floor_of(module)
        except KeyError as e:
            missing.append(str(e))
    assert not missing, missing
    gone = [p for p in FLOORS if not any(m == p or m.startswith(p + ".") for m in EDGES)]
    assert not gone, gone  # no floor for a room that is gone


def test_no_import_runs_up_a_floor():
    assert upward(EDGES) == []


PLANTED = [("quietsync.comm_worker", "quietsync.wire.exchange"), ("quietsync.transport.transport",
                                                                   "quietsync.comm_worker"),
           ("quietsync.flat", "quietsync.optim"), ("quietsync.topology", "quietsync.models")]
"""Four imports that would run up a floor (the communication worker into the wire, the transport into the
communication worker, the flat buffers into the optimizers, the topology into the models)."""


@pytest.mark.parametrize("low,high", PLANTED)
def test_an_import_planted_up_a_floor_is_caught(low, high):
    assert low in EDGES and high in EDGES and high not in EDGES[low]  # real modules, not an import they have
    planted = {a: dict(t) for a, t in EDGES.items()}
    planted[low][high] = [1]
    found = upward(planted)
    assert len(found) == 1 and found[0].startswith(f"{low}:1 (floor ") and f"-> {high} (floor " in found[0], found
    assert upward({low: {high: [7]}}) == [found[0].replace(":1 ", ":7 ")]  # a function of the edges it is given


def test_a_module_on_no_floor_is_named():
    with pytest.raises(KeyError, match="quietsync.annex stands on no floor"):
        upward({"quietsync.annex": {"quietsync.topology": [1]}})
    assert floor_of("quietsync.strategies.baselines.ddp") == floor_of("quietsync.strategies") == 6
    assert floor_of(FACE) == 14 and floor_of("quietsync.commands.main") == 12
    assert floor_of("quietsync.data.sequences") == floor_of("quietsync.train") - 1


CONTRACT = Path(__file__).resolve().parents[1] / "docs" / "contract.md"


def drawn_floors(text: str) -> dict[str, int]:
    """The floors docs/contract.md draws: in its Layers drawing, every ``quietsync/...`` path after a line that
    begins ``floor N`` (and before the next) stands on floor N; {module prefix: N} (``quietsync/__init__.py`` is
    the face)."""
    drawing = text.split("## Layers", 1)[1].split("```", 2)[1]
    out: dict[str, int] = {}
    floor = None
    for line in drawing.splitlines():
        match = re.match(r"\s*floor\s+(\d+)\s", line)
        floor = int(match.group(1)) if match else floor
        for path in re.findall(r"quietsync/[\w/.]*", line):
            assert floor is not None, f"{path} is drawn above every floor"
            name = path.rstrip("/").removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            out[name] = floor
    return out


def test_the_contract_draws_the_same_floors():
    drawn = drawn_floors(CONTRACT.read_text())
    assert drawn == FLOORS, {k: (drawn.get(k), FLOORS.get(k)) for k in set(drawn) | set(FLOORS)
                             if drawn.get(k) != FLOORS.get(k)}


def test_a_drawing_that_drifts_is_caught():
    text = CONTRACT.read_text()
    moved = text.replace("floor  3  quietsync/comm_worker.py", "floor  1  quietsync/comm_worker.py", 1)
    assert moved != text and drawn_floors(moved)["quietsync.comm_worker"] == 1 != FLOORS["quietsync.comm_worker"]


def _loaded_by(*statements: str) -> list[list[str]]:
    """The quietsync modules a fresh interpreter has loaded after each of ``statements``, run one after the other
    in it (one interpreter: each import of torch costs seconds)."""
    show = "print(' '.join(m for m in sys.modules if m.split('.')[0] == 'quietsync'))"
    code = "import sys\n" + "".join(f"{statement}\n{show}\n" for statement in statements)
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": src, "PATH": ""}, check=True)
    return [line.split() for line in out.stdout.splitlines()]


@pytest.mark.timeout(300)
def test_import_quietsync_loads_no_floor_it_does_not_use():
    face, used, planner = _loaded_by("import quietsync", "quietsync.make_strategy", "quietsync.plan")
    assert "quietsync.plan" not in face and "quietsync.strategies" not in face, face
    assert "quietsync.strategies" in used and "quietsync.plan" not in used  # a name loads its own floor only
    assert "quietsync.plan" in planner  # still there, on first use
    [topology] = _loaded_by("import quietsync.topology")
    assert sorted(topology) == ["quietsync", "quietsync._versions", "quietsync.topology"], topology


def test_the_checks_can_fail():
    # a circle of two modules, and one between two folders' rooms, are found and named
    edges: Edges = {"q.a.x": {"q.b.y": [3]}, "q.b.y": {"q.a.z": [7]}, "q.a.z": {}}
    assert _circles(edges, {a: set(t) for a, t in edges.items()}) == []
    rooms = _rooms(edges)
    assert rooms == {"q": {("a", "b"): ["q.a.x:3 -> q.b.y"], ("b", "a"): ["q.b.y:7 -> q.a.z"]}}
    assert _circles(["a", "b"], {"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
