"""The new-strategy walkthrough (``examples/custom_strategy.py``, ``docs/contract.md``) is a working strategy: on
3 workers it follows signSGD with majority vote as a plain-torch reference writes it, sends 1 byte per parameter,
keeps ``max_grad_norm`` (the committed update clipped) and fp16 (an overflow on one worker drops the round on
every worker, the scale backs off), reshards, refuses a bad knob at construction — and needs exactly the names
``docs/contract.md`` lists, no more than 20 (15 to train, 5 to declare its facts)."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_strategy.py"
STEPS, ACCUMULATION, LR = 3, 2, 0.05
SCALE0, POISON_RANK, POISON_ROUND = 1024.0, 1, 1


def _load_example() -> None:
    """Import the example (it registers ``signsgd``), once per process."""
    if "custom_strategy" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("custom_strategy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_strategy"] = module
    spec.loader.exec_module(module)


def schedule(step: int) -> float:
    return 1.0 / (1.0 + step)


def _poisoned(rank: int, fed: int) -> bool:
    """Rank 1's first micro-batch of the second round fed has a loss 1e10 times too big (fp16 overflows)."""
    return rank == POISON_RANK and fed == POISON_ROUND * ACCUMULATION


def _run(rank: int, world: int, min_votes: float, max_grad_norm: float | None, fp16: bool) -> dict:
    import quietsync
    from quietsync.strategies.parts.precision import Precision

    _load_example()
    model = tiny_model()
    strategy = quietsync.make_strategy(
        "signsgd", model, torch.optim.SGD, param_groups=param_groups(model, 0.0), lr_schedule=schedule, lr=LR,
        config={"accumulation": ACCUMULATION, "min_votes": min_votes}, max_grad_norm=max_grad_norm,
        precision=Precision("fp16", init_scale=SCALE0) if fp16 else "fp32")
    fed, out, sent, extras = 0, [], [], []
    while strategy.steps < STEPS:
        bad = fp16 and _poisoned(rank, fed)
        strategy.forward_backward(micro_batch(strategy.steps, rank, fed % ACCUMULATION),
                                  lambda m, b, bad=bad: loss_fn(m, b) * (1e10 if bad else 1.0))
        fed += 1
        if strategy.step():
            out.append(flat_params(strategy.model))
            metrics = strategy.last_step_metrics()
            sent.append(metrics.bytes_by_group["world"]["sent"])
            extras.append(dict(metrics.extra))
    logical = strategy.logical_state_dict()
    strategy.close()
    return {"params": out, "sent": sent, "extras": extras, "logical": logical}


def reference(world: int, min_votes: float, max_grad_norm: float | None = None, fp16: bool = False) -> dict:
    """signSGD-MV from its definition: each worker's mean gradient over its micro-batches, sign, summed over the
    workers; the update u = sign(votes) where |votes| > min_votes·workers, else 0; θ ← θ − lr·schedule(t)·c·u with
    c = min(1, max_grad_norm / (‖u‖ + 1e-6)) (u is the gradient the optimizer commits). fp16: each loss runs under
    fp16 autocast and is multiplied by S before backward, the gradient divided by S after; a non-finite gradient
    on any worker drops the round on every worker and halves S."""
    model = tiny_model()
    params = list(model.parameters())
    scale, fed, out, norms, skips = SCALE0, 0, [], [], 0
    while len(out) < STEPS:
        step = len(out)
        votes = torch.zeros(sum(p.numel() for p in params))
        finite = True
        for rank in range(world):
            model.zero_grad()
            for a in range(ACCUMULATION):
                bad = fp16 and _poisoned(rank, fed + a)
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    loss = loss_fn(model, micro_batch(step, rank, a)) * (1e10 if bad else 1.0)
                ((loss * scale if fp16 else loss) / ACCUMULATION).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in params]) / (scale if fp16 else 1.0)
            finite = finite and bool(torch.isfinite(grad).all())
            votes += grad.sign()
        fed += ACCUMULATION
        if not finite:
            scale, skips = scale / 2, skips + 1
            continue
        move = torch.where(votes.abs() > min_votes * world, votes.sign(), torch.zeros_like(votes))
        norm = float(move.norm())
        coef = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (norm + 1e-6))
        with torch.no_grad():
            at = 0
            for p in params:
                p -= LR * schedule(step) * coef * move[at: at + p.numel()].view_as(p)
                at += p.numel()
        out.append(flat_params(model))
        norms.append(norm)
    return {"params": out, "norms": norms, "skips": skips, "scale": scale}


def _check(results: list[dict], expected: dict) -> None:
    for r in results:
        for got, want in zip(r["params"], expected["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.timeout(120)
def test_the_example_strategy_is_signsgd_with_majority_vote():
    results = run_ranks(_run, 3, 0.0, None, False)
    _check(results, reference(3, 0.0))
    n = sum(p.numel() for p in tiny_model().parameters())
    for r in results:
        assert r["sent"] == [2 * (3 - 1) * n // 3] * STEPS  # ring all-reduce of n int8 votes
    # the rule matters: with unanimity required, fewer coordinates move than with a simple majority
    assert not torch.equal(reference(3, 0.0)["params"][-1], reference(3, 0.5)["params"][-1])


@pytest.mark.timeout(120)
def test_the_example_clips_its_update_and_scales_fp16_losses_with_one_skip_decision():
    results = run_ranks(_run, 2, 0.5, 2.0, True)
    expected = reference(2, 0.5, max_grad_norm=2.0, fp16=True)
    assert expected["skips"] == 1 and min(expected["norms"]) > 2.0  # the oracle clips every step, skips one
    _check(results, expected)
    for r in results:
        assert [e["grad_norm"] for e in r["extras"]] == pytest.approx(expected["norms"])
        assert all(e["clipped"] for e in r["extras"])
        assert [e["overflow_skips"] for e in r["extras"]] == [0, 1, 0]
        assert r["extras"][-1]["loss_scale"] == expected["scale"] == SCALE0 / 2


@pytest.mark.timeout(120)
def test_the_example_reshards_through_its_substrate():
    import quietsync

    _load_example()
    saved = run_ranks(_run, 2, 0.0, None, False)[0]["logical"]  # written by 2 workers, read by one
    assert {k.split(".")[0] for k in saved} >= {"model", "optim", "steps"}
    model = tiny_model(1)
    fresh = quietsync.make_strategy("signsgd", model, torch.optim.SGD, param_groups=param_groups(model, 0.0),
                                    config={"accumulation": ACCUMULATION}, lr=LR)

    def read(targets: dict) -> None:
        for key, target in targets.items():
            target.copy_(saved[key])

    fresh.load_logical_state_dict({k: (tuple(v.shape), v.dtype) for k, v in saved.items()}, read)
    assert fresh.steps == STEPS
    assert torch.equal(flat_params(fresh.model), reference(2, 0.0)["params"][-1])
    fresh.close()


def _refuse(rank: int, world: int) -> str:
    import quietsync

    _load_example()  # in a worker process: the test process's registry keeps the eleven strategies only
    try:
        quietsync.make_strategy("signsgd", tiny_model(), torch.optim.SGD, config={"min_votes": 1.5}, lr=LR)
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.timeout(60)
def test_a_bad_knob_is_refused_at_construction():
    assert "min_votes" in run_ranks(_refuse, 1)[0]


# ---------------------------------------------------------------------------------------------- the names
def _names_the_example_needs() -> set[str]:
    """The quietsync names the example's code uses: what it imports from quietsync, the base's members it sets,
    overrides or reads (``self.X``), and the members it calls on those objects (``self.transport.all_reduce``) or
    on the quietsync objects it holds (``self.replicas.gradient``)."""
    import quietsync
    from quietsync.strategies import Strategy

    _load_example()
    example = sys.modules["custom_strategy"]
    tree = ast.parse(EXAMPLE.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quietsync"):
            names.update(a.name for a in node.names)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SignSGD")
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("__") and hasattr(Strategy, node.name):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name) and hasattr(Strategy, t.id))
    strategy = quietsync.make_strategy("signsgd", tiny_model(), torch.optim.SGD, lr=LR)
    own = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(cls):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
            continue
        if node.attr not in own:
            names.add(node.attr)
        value = getattr(strategy, node.attr)
        if type(value).__module__.startswith("quietsync"):
            for parent in ast.walk(cls):
                if isinstance(parent, ast.Attribute) and parent.value is node:
                    names.add(parent.attr)
    strategy.close()
    assert example.SignSGD.__mro__[1] is Strategy
    return names


def _names_the_contract_lists() -> list[str]:
    """The first code span of each row of docs/contract.md's "names you need" table, as a bare name."""
    section = (ROOT / "docs" / "contract.md").read_text().split("### Writing a strategy: the names you need", 1)[1]
    rows = section.split("\n| # |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # past the header and the rule
    out = []
    for row in rows:
        span = re.search(r"`([^`]+)`", row.split("|")[2]).group(1)
        out.append(re.sub(r"\(.*", "", span).lstrip("@").split(".")[-1])
    return out


def test_the_contract_lists_exactly_the_names_the_example_and_the_base_need():
    from quietsync.strategies import Strategy

    needed = _names_the_example_needs()
    required = {n for n in dir(Strategy) if getattr(getattr(Strategy, n), "__isabstractmethod__", False)}
    assert required <= needed  # the base's abstract hooks are among them
    listed = _names_the_contract_lists()
    assert len(listed) == len(set(listed)) <= 20
    assert set(listed) == needed, (sorted(set(listed) - needed), sorted(needed - set(listed)))
    assert len(EXAMPLE.read_text().splitlines()) <= 90
