"""A strategy's facts live in its declaration: outside ``strategies/`` no code in ``src/quietsync`` names a built-in
strategy in a string (the planner, the fault tolerance, the trainer and the GPU check ask the registry), except the
CLI's documented default; and every built-in strategy declares what the planner, torchft and the GPU check must
know of it."""

from __future__ import annotations

import ast
from pathlib import Path

import quietsync
from quietsync.strategies import registry
from quietsync.strategies.declaration import Declaration, ReplicaPolicy

SRC = Path(quietsync.__file__).parent
BUILT_IN = frozenset({"acco", "cdp", "ddp", "demo", "diloco", "dpu", "flexdemo", "fsdp", "localsgd", "wp", "zero1"})
ALLOWED = {("train/config.py", "zero1")}
"""The CLI's documented defaults: ``quietsync train``'s ``--strategy`` (``DEFAULT_STRATEGY``)."""


def names_outside_strategies(root: Path = SRC) -> list[tuple[str, int, str]]:
    """``(file, line, name)`` of every string constant equal to a built-in strategy's name outside ``strategies/``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("strategies/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in BUILT_IN:
                out.append((rel, node.lineno, node.value))
    return out


def test_the_built_in_names_are_the_registered_ones():
    assert BUILT_IN <= set(registry.available())
    assert all(registry.get(n)[0].__module__.startswith("quietsync.strategies.") for n in BUILT_IN)


def test_no_code_outside_strategies_names_a_built_in_strategy():
    found = names_outside_strategies()
    assert [f for f in found if (f[0], f[2]) not in ALLOWED] == []
    assert len(found) <= len(ALLOWED)


def test_the_count_can_fail(tmp_path):
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "x.py").write_text('EXACT = ("ddp", "zero1")\nif name == "diloco": pass\nx = "diloco H"\n')
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "y.py").write_text('NAME = "ddp"\n')
    assert names_outside_strategies(tmp_path) == [("plan/x.py", 1, "ddp"), ("plan/x.py", 1, "zero1"),
                                                  ("plan/x.py", 2, "diloco")]


def test_every_built_in_strategy_declares_its_facts():
    for name in BUILT_IN:
        facts = registry.declaration(name)
        assert isinstance(facts, Declaration) and facts.schedule is registry.schedule_of(name), name
        assert facts.plan.prior is not None and facts.plan.sources or facts.plan.exact, name
        assert isinstance(facts.faults, (ReplicaPolicy, str)) and facts.faults, name
        assert facts.gpu_flags is not None and facts.order < 100, name
        for note_key in facts.plan.sources:
            assert facts.plan.sources[note_key], (name, note_key)
    # the synchronous baselines: exact, zero1 preferred, then ddp
    assert registry.baselines() == ["zero1", "ddp"]
    assert {n for n in BUILT_IN if registry.declaration(n).plan.exact} == {"ddp", "zero1", "fsdp"}


def test_register_keeps_schedule_working_and_a_declaration_on_the_class():
    from quietsync.strategies.baselines.ddp import DDP, DDPConfig

    saved = dict(registry._REGISTRY), dict(registry._SCHEDULES)
    try:
        def schedule(w, topo, cfg):
            return None

        class Mine(DDP):
            pass

        registry.register("mine", DDPConfig, schedule=schedule)(Mine)
        assert registry.schedule_of("mine") is schedule and registry.declaration("mine").schedule is schedule
        assert registry.declaration("mine").faults is None and registry.declaration("ddp").faults is not None
        assert registry.ordered()[-1] == "mine"  # undeclared order: after the built-ins
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved[0])
        registry._SCHEDULES.clear()
        registry._SCHEDULES.update(saved[1])
