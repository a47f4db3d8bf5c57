"""``quietsync.plan.plan(...)``: measure (or describe) the job, predict every strategy, recommend.

Measured (the default): the workers are launched as ``quietsync train`` launches them (local processes, or in
place under torchrun), and each, at the same time as the others, calibrates the model and micro-batch on its
device (:mod:`~quietsync.plan.calibrate`); then they probe the links between them (:mod:`~quietsync.plan.probe`).
Rank 0 predicts. ``what_if``: nothing runs; the compute comes from the device's FLOP/s
(:class:`~quietsync.plan.cluster.Device`) and the links are the ones given.

The result (:class:`PlanResult`) holds the table (:mod:`~quietsync.plan.table`), the advice
(:mod:`~quietsync.plan.recommend`), what was measured, and can re-predict at other link speeds (the plots).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..cost.compute import ComputeProfile, codec_knobs
from ..cost.costmodel import Links
from ..cost.workload import Workload
from ..link import LinkModel
from ..strategies.registry import declaration, ordered
from ..topology import Topology
from .candidates import Candidate, LeftOut, applies, candidate, canonical_grid, unique
from .cluster import Cluster, Device
from .config import PlanConfig, PlanError, transformer_shape
from .objective import Objective, check_target, initial_objective
from .recommend import HETEROGENEOUS, advise, is_baseline
from .result import PlanResult
from .schedules import strategy_config
from .table import Row, evaluate


# ---------------------------------------------------------------------------------------------- the model
def build_workload(cfg: PlanConfig, *, real: bool) -> tuple[Workload, torch.nn.Module | None]:
    """The workload of ``cfg.model`` (and the model itself when ``real``: for calibration)."""
    stages = tuple(sorted({cfg.world, 2}))
    tokens = cfg.micro_batch_size * cfg.seq_len
    if cfg.model_kind == "described":
        shape = transformer_shape(cfg.model)
        w = Workload.transformer(**shape, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                 name=cfg.model, stages=tuple(s for s in stages if s <= shape["layers"] + 3))
        return w, None
    model = _build_model(cfg, meta=not real)
    from ..models.causal_lm import param_groups

    groups = param_groups(model, 0.1)
    ok_stages = tuple(s for s in stages if _can_cut(model, s))
    w = Workload.from_model(model, tokens_per_micro_batch=tokens, param_groups=groups, name=cfg.model,
                            stages=ok_stages, vocab=_vocab(model))
    return w, model


def _vocab(model: torch.nn.Module) -> int | None:
    """The rows of a language model's input embedding (None for a model without one)."""
    embed = getattr(model, "get_input_embeddings", None)
    rows = getattr(embed() if callable(embed) else None, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def _can_cut(model: torch.nn.Module, n: int) -> bool:
    from ..models.stages import sequential_view

    try:
        return n <= len(sequential_view(model).segments)
    except (TypeError, ValueError):
        return False


def _build_model(cfg: PlanConfig, meta: bool) -> torch.nn.Module:
    from ..models.causal_lm import build_model, load_pretrained

    ctx = torch.device("meta") if meta else torch.device("cpu")
    if cfg.model_kind == "preset":
        with ctx:
            return build_model(cfg.model, cfg.vocab_size, seed=None if meta else 0)
    if meta:  # the shapes alone: nothing loaded or allocated
        from transformers import AutoConfig, AutoModelForCausalLM

        with ctx:
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model))
    return load_pretrained(cfg.model)


def _lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _activation_estimate(w: Workload, cfg: PlanConfig) -> int:
    """Activation bytes of one micro-batch of a GPT-style model not run here: Korthikanti et al. (2022)'s
    ``s·b·h·(34 + 5·a·s/h)`` bytes per layer in 16-bit, heads ``a = h / 128``."""
    shapes = [s for s in w.shapes if len(s) == 2 and s[0] == s[1]]
    if not shapes:
        return 0
    h = shapes[0][0]
    layers = max(1, len(shapes) // 4)
    s, b = cfg.seq_len, cfg.micro_batch_size
    a = max(1, h // 128)
    return int(layers * s * b * h * (34 + 5 * a * s / h))


# ---------------------------------------------------------------------------------------------- candidates
def uneven(compute: ComputeProfile, world: int) -> bool:
    """Whether the workers compute at different speeds: the slowest beyond :data:`HETEROGENEOUS` times the fastest
    (the calibration's noise; a ``slow_worker`` factor counts)."""
    scales = compute.scales(world)
    return max(scales) / min(scales) > HETEROGENEOUS


def varying(cluster_links: Links) -> bool:
    """Whether a link of the plan varies during the run (given as a schedule)."""
    return any(link.scheduled for link in cluster_links.model.values())


def link_phases(links: Links) -> list[tuple[float, Links]]:
    """The steady stretches of links that vary (given as schedules): ``(start seconds, the links then)``, one per
    change of any of them; one stretch from 0 s for steady links."""
    starts = sorted({r.at_s for link in links.model.values() for r in link.rates()})
    out = []
    for t in starts:
        model = {k: LinkModel(link.rate_at(t).bandwidth, link.rate_at(t).latency) if link.scheduled else link
                 for k, link in links.model.items()}
        out.append((t, dataclasses.replace(links, model=model)))
    return out


def candidates(cfg: PlanConfig, w: Workload, topo: Topology, uneven: bool | None = None, varying: bool = False
               ) -> tuple[list[Candidate], list[LeftOut]]:
    """The settings to evaluate — the canonical grid (with its wide settings for ``what_if``, its uneven ones for
    workers of different speeds, its varying ones for a link that changes) unless ``only``, and the ``strategies``
    given — one per setting, and the settings left out with why (a strategy given where its declaration says it does
    not apply too, e.g. FlexDeMo with one worker per node). ``uneven`` None: as the slow workers given say (before
    the calibration has measured them)."""
    stages = tuple(sorted(w.stage_numels)) if w.stage_numels else ()
    uneven = bool(cfg.slow) if uneven is None else uneven
    grid, left = ([], []) if cfg.only else canonical_grid(topo, stages, wide=cfg.what_if, uneven=uneven,
                                                          varying=varying)
    asked = []
    for c in (candidate(n, k) for n, k in cfg.extra):
        why = applies(c.strategy, topo, stages, asked=True)
        if why is None:
            asked.append(c)
        elif all(x.spec != c.spec for x in left):  # the grid's own may already be left out for it
            left.append(LeftOut(c.spec, c.strategy, why))
    return unique(grid + asked), left


def codec_keys(cfg: PlanConfig, w: Workload, topo: Topology) -> list[str]:
    """The codecs the calibration times: those of the settings planned, and those the strategies declare for every
    plan (``PlanFacts.codec`` and ``calibrate``)."""
    keys = []
    cands, _ = candidates(cfg, w, topo)
    always = [(name, dict(knobs)) for name in ordered() for knobs in declaration(name).plan.calibrate]
    for name, knobs in [(c.strategy, c.knob_dict) for c in cands] + always:
        codec = declaration(name).plan.codec
        key = codec(strategy_config(name, knobs)) if codec is not None else None
        if key is not None and key not in keys:
            keys.append(key)
    return keys


def _measure_worker(cfg: PlanConfig, keys: list[str], result_path: str) -> None:
    """In every worker: calibrate (all at once), agree on per-worker speeds, probe the links; rank 0 writes."""
    from ..transport import Transport
    from .calibrate import calibrate
    from .probe import probe

    torch.set_num_threads(cfg.threads_per_worker())
    topo = Topology.from_env(cfg.node_count)
    transport = Transport(topo, links={}, timeout_s=cfg.timeout_s)  # unemulated: the probe measures the real network
    try:
        _, model = build_workload(cfg, real=True)
        assert model is not None
        model.to(transport.device).train()
        vocab = model.get_input_embeddings().num_embeddings
        # one fixed batch: every worker times the same work
        batch = torch.randint(0, vocab, (cfg.micro_batch_size, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        batch = batch.to(transport.device)
        transport.barrier()  # all calibrate at once, sharing the cores as in training
        profile = calibrate(model, batch, _lm_loss, codecs={k: codec_knobs(k) for k in keys},
                            codec_group=topo.world_size, repeats=cfg.repeats)
        mine = torch.tensor([profile.micro_batch_s], dtype=torch.float64, device=transport.device)
        every = torch.empty(topo.world_size, dtype=torch.float64, device=transport.device)
        transport.all_gather(every, mine, name="plan/calibration")
        times = every.tolist()
        del model
        result = probe(transport) if cfg.probe and topo.world_size > 1 else None
        if topo.rank == 0:
            payload = {"profile": dataclasses.asdict(profile), "micro_batch_s": times,
                       "probe": None if result is None else {
                           "seconds": result.seconds,
                           "samples": {k: [dataclasses.asdict(s) for s in v] for k, v in result.samples.items()},
                           "fits": {k: _fit_json(f) for k, f in result.fits.items()},
                           "by_kind": {k: {c: _fit_json(f) for c, f in v.items()} for k, v in result.by_kind.items()}},
                       "nodes": topo.nodes, "world": topo.world_size}
            Path(result_path).write_text(json.dumps(payload))
    finally:
        transport.close()


def _fit_json(f: Any) -> dict[str, float]:
    return {"bandwidth": f.link.bandwidth, "latency": f.link.latency, "rel_error": f.rel_error}


def _under_torchrun() -> bool:
    from ..cli.launch import under_torchrun

    return under_torchrun()


def measure(cfg: PlanConfig, keys: list[str]) -> dict[str, Any] | None:
    """Launch the workers (or run in place under torchrun) and return rank 0's measurements (None on other
    ranks under torchrun)."""
    from ..cli.launch import launch

    with tempfile.TemporaryDirectory(prefix="quietsync-plan-") as tmp:
        path = str(Path(tmp, "measured.json"))
        launch(_measure_worker, (cfg, keys, path), nproc=cfg.nproc)
        if int(os.environ.get("RANK", "0")) != 0:
            return None
        return json.loads(Path(path).read_text())


def compute_from(measured: dict[str, Any], slow: dict[int, float]) -> ComputeProfile:
    """The calibrated profile at the median worker's speed, each worker's speed relative to it, ``slow``
    factors applied."""
    p = dict(measured["profile"])
    times = measured["micro_batch_s"]
    median = statistics.median(times)
    scale = [t / median for t in times]
    if max(scale) / min(scale) < HETEROGENEOUS:  # within calibration noise: equal workers
        scale = [1.0] * len(times)
    for r, f in slow.items():
        scale[r] *= f
    # rank 0's profile, rescaled to the median worker's forward + backward
    k = median / (p["forward_s"] + p["backward_s"])
    p.update(forward_s=p["forward_s"] * k, backward_s=p["backward_s"] * k, worker_scale=tuple(scale))
    p["codec_s"] = dict(p["codec_s"])
    return ComputeProfile(**p)


def links_from_probe(cfg: PlanConfig, measured: dict[str, Any] | None) -> tuple[Links, list[str]]:
    """Given links as the model, the probe's fits as their floor (or as the links where none is given); per
    collective kind where the probe fitted one."""
    model = dict(cfg.links)
    floor: dict[str, LinkModel] = {}
    by_kind: dict[str, dict[str, LinkModel]] = {}
    notes = []
    probed = (measured or {}).get("probe") or {}
    for kind, f in (probed.get("fits") or {}).items():
        fitted = LinkModel(f["bandwidth"], f["latency"])
        per = {c: LinkModel(g["bandwidth"], g["latency"])
               for c, g in (probed.get("by_kind") or {}).get(kind, {}).items()}
        by_kind[kind] = per
        each = "; per collective " + ", ".join(f"{c} {m}" for c, m in sorted(per.items())) if per else ""
        if kind in model:
            floor[kind] = fitted
            notes.append(f"{kind}: given {model[kind]}; the real transport measured {fitted} (median fit error "
                         f"{f['rel_error']:.0%}){each}, used as a floor")
        else:
            model[kind] = fitted
            notes.append(f"{kind}: measured {fitted} by the probe (median fit error {f['rel_error']:.0%}){each}")
    given = set(cfg.links)
    return Links(model=model, floor=floor, model_by_kind={k: v for k, v in by_kind.items() if k not in given},
                 floor_by_kind={k: v for k, v in by_kind.items() if k in given}), notes


# ---------------------------------------------------------------------------------------------- predicting
def predict(cfg: PlanConfig, w: Workload, cluster: Cluster, compute: ComputeProfile, *,
            probe: dict[str, Any] | None = None, assumptions: list[str] | None = None,
            objective: Objective | None = None, adjust: Callable[[Row], Row] | None = None) -> PlanResult:
    """Evaluate the candidates (one row each; ``adjust`` may replace a row, e.g. with a pilot's measured speed), score
    them against the objective (the priors' unless one is given, e.g. after the pilots), advise."""
    topo = Topology(0, cluster.world, cluster.nodes)
    rows: list[Row] = []
    assumptions = list(assumptions or [])
    changing = varying(cluster.links)
    cands, left = candidates(cfg, w, topo, uneven(compute, cluster.world), changing)
    memory = cluster.device.memory_bytes if cluster.device is not None else None
    phases = link_phases(cluster.links) if changing else []
    speeds: dict[str, tuple[tuple[float, float], ...]] = {}
    too_big: list[int] = []  # memory per worker of the settings that do not fit
    for c in cands:
        try:
            row = evaluate(c.strategy, c.knob_dict, w, topo, compute, phases[0][1] if phases else cluster.links)
            if phases:  # each steady stretch of the link at its own speed (time to target integrates them)
                speeds[row.spec] = tuple((t, evaluate(c.strategy, c.knob_dict, w, topo, compute, links).tokens_per_s)
                                         for t, links in phases)
        except ValueError as e:  # a setting this model or topology cannot take (e.g. too few CDP stages)
            left.append(LeftOut(c.spec, c.strategy, str(e)))
            continue
        if adjust is not None:  # e.g. the speed a pilot measured through the link
            row = adjust(row)
        if memory is not None and row.memory_bytes > memory:
            too_big.append(row.memory_bytes)
            left.append(LeftOut(c.spec, c.strategy, f"does not fit: {row.memory_bytes / 1e9:.3g} GB per worker > "
                                                    f"{memory / 1e9:.3g} GB"))
            continue
        rows.append(row)
    if not rows:
        raise PlanError(_nothing_to_rank(left, too_big, memory))
    if objective is None:
        exact = [r for r in rows if is_baseline(r)] or rows
        objective = initial_objective(cfg, w.params, cluster.world, cluster.nodes,
                                      exact[0].tokens_per_step if exact else w.tokens_per_micro_batch, vocab=w.vocab)
    if phases:
        objective = dataclasses.replace(objective, link_phases=speeds)
    scored = [objective.score(r) for r in rows]
    ranked = {r.strategy for r in rows}
    # a strategy with no ranked setting is named once; otherwise each of its settings left out
    out = [(x.strategy, x.reason) for x in left if x.strategy not in ranked]
    out += [(f"`{x.spec}`", x.reason) for x in left if x.strategy in ranked]
    advice = advise(scored, compute, cluster.world, objective.description, out, varying=changing)
    return PlanResult(cfg, w, cluster, compute, rows, objective, scored, advice, left, probe, assumptions)


def _nothing_to_rank(left: list[LeftOut], too_big: list[int], memory: int | None) -> str:
    """One line on why every setting was left out: how many do not fit and the least memory one needs, then the
    other reasons, each once."""
    parts = []
    if too_big and memory is not None:
        parts.append(f"{len(too_big)} do not fit in the device's {memory / 1e9:.3g} GB (the smallest needs "
                     f"{min(too_big) / 1e9:.3g} GB per worker; --device-memory)")
    others = dict.fromkeys(f"{x.strategy}: {x.reason}" for x in left if not x.reason.startswith("does not fit"))
    parts += list(others)
    return f"no setting is left to rank: {'; '.join(parts) or 'none was given'}"


def plan(config: PlanConfig | None = None, **kwargs: Any) -> PlanResult | None:
    """Plan a job: ``quietsync.plan.plan(model="tiny", nproc=4, nodes=2, link=["inter=1gbit,20ms"])`` (the fields of
    :class:`~quietsync.plan.config.PlanConfig`). Measures unless ``what_if``; returns the :class:`PlanResult`
    (None on ranks other than 0 under torchrun). Bad arguments raise ``ValueError`` before anything starts."""
    cfg = config if config is not None else PlanConfig(**kwargs)
    if config is not None and kwargs:
        cfg = dataclasses.replace(config, **kwargs)
    if cfg.what_if:
        w = build_workload(cfg, real=False)[0]
        check_target(cfg, w.params, w.vocab)
        return _what_if(cfg, w)
    if _under_torchrun() and cfg.pilot_tokens is not None:
        raise ValueError("pilot_tokens launches local pilot workers: not under torchrun (plan with local workers, "
                         "or use what_if)")
    if _under_torchrun():  # the launcher decides the world; nodes: one per torchrun agent unless given
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cfg = dataclasses.replace(cfg, nproc=world, nodes=cfg.nodes or max(1, world // max(1, local)))
    w, _ = build_workload(cfg, real=False)
    topo = Topology(0, cfg.world, cfg.node_count)
    ranked, left = candidates(cfg, w, topo)
    if not ranked:  # e.g. --only with settings that do not apply: before any worker starts
        raise PlanError(_nothing_to_rank(left, [], None))
    measured = measure(cfg, codec_keys(cfg, w, topo))
    if measured is None:
        return None
    compute = compute_from(measured, cfg.slow)
    links, notes = links_from_probe(cfg, measured)
    cluster = Cluster(topo.nodes, topo.workers_per_node, links)
    assumptions = notes + [f"worker {r} computes {f:g}× slower (slow_worker)" for r, f in cfg.slow.items()]
    result = predict(cfg, w, cluster, compute, probe=measured.get("probe"), assumptions=assumptions)
    if cfg.pilot_tokens is not None:
        from .pilot_plan import run_pilots

        result = run_pilots(result, predict)
    return result


def _what_if(cfg: PlanConfig, w: Workload) -> PlanResult:
    nodes = cfg.node_count
    wpn = cfg.world // nodes
    device: Device = cfg.device
    topo = Topology(0, nodes * wpn, nodes)
    # a codec key starts with its replicator's name (cost.compute.codec_key)
    compute = device.profile(w, {k: k.split(":")[0] for k in codec_keys(cfg, w, topo)})
    compute = dataclasses.replace(compute, activation_bytes=_activation_estimate(w, cfg))
    if cfg.slow:
        scale = [1.0] * (nodes * wpn)
        for r, f in cfg.slow.items():
            scale[r] = f
        compute = dataclasses.replace(compute, worker_scale=tuple(scale))
    from .cluster import ADAMW_BYTES, CODEC_BYTES, CODEC_FLOPS, CODEC_MFU

    assumptions = [
        f"compute from FLOPs: {w.training_flops() / w.tokens_per_micro_batch:.3g} FLOPs per token (6 × parameters + "
        f"attention), {device.flops / 1e12:g} TFLOP/s peak at {device.mfu:.0%} MFU; forward 1/3, backward 2/3",
        f"optimizer: AdamW in fp32, {ADAMW_BYTES:g} bytes per parameter through "
        f"{device.memory_bandwidth / 1e12:g} TB/s",
        f"DeMo codec: DCT {CODEC_FLOPS:g} FLOPs/element at {CODEC_MFU:.0%} of peak + {CODEC_BYTES:g} bytes/element of "
        "memory traffic (random/striding: the memory part only)",
        "parameters, gradients and communication in fp32 (the library's default); links as given, alpha-beta, "
        "full duplex, ring collectives",
        "activations: Korthikanti et al. (2022), 16-bit, heads of 128",
    ]
    cluster = Cluster(nodes, wpn, Links(model=dict(cfg.links)), device)
    return predict(cfg, w, cluster, compute, assumptions=assumptions)


__all__ = ["PlanResult", "build_workload", "measure", "plan", "predict"]
