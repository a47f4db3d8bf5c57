"""The checks of ``python -m quietsync.gpu_check``, one function per kind, each returning :class:`Check` lines.

* :func:`environment` — device, versions.
* :func:`gpu_tests` — the suite's ``gpu``-marked tests (pytest in a child process; only from a source checkout).
* :func:`strategy_checks` — every strategy that runs on one device, through ``quietsync train`` (one child process
  per strategy, :mod:`quietsync.gpu_check.runs`): bf16 (and fp16 for zero1) against fp32 on the device, CUDA fp32
  against CPU fp32 step by step, CUDA peak memory beside ``memory_report()``.
* :func:`codec_checks` — DeMo's DCT on the device against an fp64 oracle written from the DCT-II definition and
  against the reference implementation's ``DCTTransform`` (PyPI ``detonation``, when importable), with both timed;
  the whole decoupled step timed.
* :func:`calibration_check` — the planner's calibrated forward + backward + optimizer step against the measured
  step time of the zero1 run.
* :func:`compile_check` — ``--compile`` against the eager run on the device.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..strategies.registry import baselines, declaration, module_flags, ordered
from .report import Check, Tolerance, compare_trajectories, compare_values
from .runs import RunSpec

# ------------------------------------------------------------------------------------------------ tolerances
MIXED_PRECISION_TOL = Tolerance(atol=0.05, rtol=0.01)
"""bf16/fp16 against fp32 on the device: the held-out loss after the run, within 0.05 nats + 1 %."""
DEVICE_VS_CPU_ATOL = 5e-3
"""CUDA fp32 against CPU fp32: the training loss of every one of the first steps, within 0.005 nats."""
COMPILE_TOL = Tolerance(atol=0.02, rtol=0.005)
"""``--compile`` against eager on the device: held-out loss within 0.02 nats + 0.5 %."""
CALIBRATION_RTOL = 0.30
"""Planner's calibrated forward + backward against the zero1 run's measured one: within 30 %."""
DCT_ORACLE_RTOL = 1e-4
"""fp32 DCT coefficients on the device against the fp64 oracle: max error ≤ 1e-4 of the largest coefficient."""

def strategy_specs() -> dict[str, list[str]]:
    """Every strategy the check trains on one device (world of one), with the flags that put its device paths to
    work, as each declares them (``Declaration.gpu_flags``; a strategy of your own, registered from a file, is
    imported by its runs through ``--strategy-module``)."""
    return {name: [*module_flags(name), *facts.gpu_flags] for name in ordered()
            if (facts := declaration(name)).gpu_flags is not None}


def mixed_precisions(name: str) -> list[str]:
    """The mixed precisions strategy ``name`` runs besides fp32 (``Declaration.gpu_precisions``)."""
    return list(declaration(name).gpu_precisions)


def reference_strategy() -> str:
    """The strategy of the calibration and compile checks: the preferred synchronous baseline."""
    return baselines()[0]


UNCHECKED = [
    "NCCL collectives between ranks (every strategy at world > 1): one device cannot hold two NCCL ranks",
    "ACCO/DPU/WP and Streaming DiLoCo overlapping a real collective on the comm worker's CUDA stream "
    "(checked here with the world-of-one collective, which does not touch the network)",
    "FSDP2 / FlexDeMo sharding across 2 GPUs "
    "(tests/strategies/baselines/test_fsdp.py::test_fsdp2_on_nccl_equals_one_process, skipped with one device)",
    "CDP's point-to-point ring on NCCL (cdp with 2 workers)",
    "two processes sharing one device over gloo: the transport keeps gloo buffers on the CPU, so a gloo run "
    "computes on the CPU, not the device",
]
"""Paths that need two devices, listed in every report."""


def _elapsed(t0: float) -> float:
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ environment
def versions() -> dict[str, str]:
    """torch, CUDA, cuDNN, NCCL, Python, quietsync and transformers versions."""
    import platform

    from .._versions import TORCH_MIN, __version__

    out = {"torch": torch.__version__, "python": platform.python_version(), "quietsync": __version__}
    found = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if found < TORCH_MIN:  # imported at all only with QUIETSYNC_UNSUPPORTED_TORCH=1: say so in the report
        out["torch"] += f" (older than the {TORCH_MIN[0]}.{TORCH_MIN[1]} quietsync supports)"
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["cudnn"] = str(torch.backends.cudnn.version())
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            out["nccl"] = "none"
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def device_name(device: str) -> str:
    """What the report calls the device."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})"
    return "cpu (dry run of the harness: no GPU path is checked)"


# ------------------------------------------------------------------------------------------------ gpu tests
def gpu_test_files(repo: Path) -> list[str]:
    """The test files under ``repo/tests`` that mark a test ``gpu`` (relative paths, sorted): only these are
    collected, so a test module needing a package this machine lacks cannot fail the check."""
    return sorted(str(p.relative_to(repo)) for p in (repo / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


def gpu_tests(repo: Path | None, timeout_s: float) -> list[Check]:
    """The suite's ``gpu``-marked tests, one line each (pytest in a child process, from the checkout at ``repo``)."""
    t0 = time.perf_counter()
    if repo is None or not (repo / "tests").is_dir():
        return [Check("tests", "gpu-marked tests", "SKIP", "no source checkout with tests/ here")]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        files = gpu_test_files(repo)
        if not files:
            return [Check("tests", "gpu-marked tests", "FAIL", "no test file under tests/ is marked gpu")]
        # no .pytest_cache written into the checkout, and no addopts from its config: only these flags
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={xml}", *files]
        try:
            proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return [Check("tests", "gpu-marked tests", "FAIL", f"pytest ran past {timeout_s:.0f} s",
                          seconds=_elapsed(t0))]
        if not xml.exists():
            tail = (proc.stdout + proc.stderr)[-400:]
            return [Check("tests", "gpu-marked tests", "FAIL", f"pytest wrote no report (exit {proc.returncode})",
                          {"output": tail}, _elapsed(t0))]
        checks = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}".replace("tests.", "", 1)
            failure = case.find("failure")
            if failure is None:  # junit records a crash in setup or teardown as <error>: a failure too
                failure = case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                checks.append(Check("tests", name, "FAIL", (failure.get("message") or "failed")[:300],
                                    seconds=float(case.get("time", 0))))
            elif skipped is not None:
                checks.append(Check("tests", name, "SKIP", (skipped.get("message") or "skipped")[:200],
                                    seconds=float(case.get("time", 0))))
            else:
                checks.append(Check("tests", name, "PASS", "passed", seconds=float(case.get("time", 0))))
        if not checks:
            checks.append(Check("tests", "gpu-marked tests", "FAIL", f"no test ran (exit {proc.returncode})",
                                {"output": (proc.stdout + proc.stderr)[-400:]}, _elapsed(t0)))
        return checks


# ------------------------------------------------------------------------------------------------ strategies
def run_strategy(spec: RunSpec, timeout_s: float) -> dict[str, Any]:
    """Run ``spec`` in a child process (:mod:`quietsync.gpu_check.runs`); its result, or ``{"error": ...}``."""
    Path(spec.work).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, result_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(asdict(spec)))
        cmd = [sys.executable, "-m", "quietsync.gpu_check.runs", str(spec_file), str(result_file)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"ran past {timeout_s:.0f} s"}
        if proc.returncode != 0 or not result_file.exists():
            return {"error": f"exited {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"}
        return json.loads(result_file.read_text())["runs"]


def _run_failed(run: dict[str, Any] | None) -> str | None:
    if run is None:
        return "not run"
    if "error" in run:
        # the last line of a traceback names the exception
        return run["error"].strip().splitlines()[-1][:300] if run["error"].strip() else "failed"
    if run.get("last_eval_loss") is None or not math.isfinite(run["last_eval_loss"]):
        return f"no finite held-out loss ({run.get('last_eval_loss')})"
    return None


def judge_strategy(label: str, runs: dict[str, Any], seconds: float) -> list[Check]:
    """The checks of one strategy's runs (see :func:`strategy_checks`)."""
    if "error" in runs:
        return [Check("train", f"{label} runs", "FAIL", str(runs["error"]).strip()[-300:], seconds=seconds)]
    fp32 = runs.get("fp32")
    out: list[Check] = []
    problem = _run_failed(fp32)
    if problem:
        return [Check("train", f"{label} fp32", "FAIL", problem, {"run": fp32}, seconds)]
    for precision in [k for k in runs if k not in ("fp32", "cpu_fp32")]:
        run = runs[precision]
        problem = _run_failed(run)
        if problem:
            out.append(Check("train", f"{label} {precision} vs fp32", "FAIL", problem, {"run": run}))
        else:
            out.append(compare_values("train", f"{label} {precision} vs fp32", run["last_eval_loss"],
                                      fp32["last_eval_loss"], MIXED_PRECISION_TOL,
                                      f"held-out loss after {run['steps']} steps", run["seconds"],
                                      eval=run["eval"], reference_eval=fp32["eval"]))
    cpu = runs.get("cpu_fp32")
    if cpu is not None:
        if "error" in cpu:
            out.append(Check("train", f"{label} device vs CPU", "FAIL", cpu["error"][-300:]))
        else:
            device_losses, cpu_losses = dict(map(tuple, fp32["losses"])), dict(map(tuple, cpu["losses"]))
            steps = sorted(set(device_losses) & set(cpu_losses))
            out.append(compare_trajectories("train", f"{label} device vs CPU (fp32)", [device_losses[s] for s in steps],
                                            [cpu_losses[s] for s in steps], DEVICE_VS_CPU_ATOL,
                                            "training loss per step", cpu["seconds"],
                                            # 3, or fewer if the CPU run logged fewer; none logged still fails
                                            min_steps=min(3, len(cpu_losses) or 1)))
    report = fp32.get("memory_bytes") or {}
    peak = fp32.get("cuda_peak_bytes")
    buffers = sum(report.values())
    if peak is None:
        out.append(Check("memory", label, "SKIP", f"no CUDA allocator here; memory_report() {buffers / 1e6:.2f} MB",
                         {"memory_report": report}))
    else:
        ok = peak >= buffers > 0  # the allocator must have held at least what memory_report() names; empty fails
        out.append(Check("memory", label, "PASS" if ok else "FAIL",
                         f"CUDA peak {peak / 1e6:.2f} MB {'≥' if ok else '<'} memory_report() {buffers / 1e6:.2f} MB "
                         f"({', '.join(f'{k} {v / 1e6:.2f}' for k, v in sorted(report.items()))})",
                         {"cuda_peak_bytes": peak, "memory_report": report}))
    out.insert(0, Check("train", f"{label} fp32 on the device", "PASS",
                        f"{fp32['steps']} steps, held-out loss {fp32['eval'][0]['loss']:.3f} → "
                        f"{fp32['last_eval_loss']:.3f}, {fp32['step_s'] * 1e3:.1f} ms/step"
                        if fp32.get("step_s") else f"{fp32['steps']} steps", {"eval": fp32["eval"],
                                                                              "step_s": fp32.get("step_s")},
                        fp32["seconds"]))
    return out


def strategy_checks(names: list[str], *, device: str, steps: int, cpu_steps: int, work: str, cache_dir: str | None,
                    deadline: float, per_strategy_s: float = 180.0) -> tuple[list[Check], dict[str, Any]]:
    """Every strategy of ``names``; also returns the raw runs (the calibration check reads the baseline's)."""
    checks: list[Check] = []
    raw: dict[str, Any] = {}
    for name in names:
        left = deadline - time.perf_counter()
        if left < 20:
            checks.append(Check("train", f"{name} runs", "SKIP", "the check's time budget ran out"))
            continue
        spec = RunSpec(strategy=name, flags=strategy_specs()[name], steps=steps, cpu_steps=cpu_steps,
                       precisions=mixed_precisions(name), work=work, cache_dir=cache_dir, device=device)
        t0 = time.perf_counter()
        runs = run_strategy(spec, min(per_strategy_s, left))
        raw[name] = runs
        checks += judge_strategy(name, runs, _elapsed(t0))
    return checks, raw


# ------------------------------------------------------------------------------------------------ DeMo's codec
def dct_oracle(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix in fp64 from its definition: ``D[k, i] = s_k cos(π (2i + 1) k / 2n)``,
    ``s_0 = √(1/n)``, ``s_k = √(2/n)``."""
    d = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        s = math.sqrt((1.0 if k == 0 else 2.0) / n)
        for i in range(n):
            d[k, i] = s * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return d


def _oracle_blocks(t: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """fp64 DCT-II coefficients of ``t``'s blocks, ``(blocks, *block)`` in row-major block order (no padding)."""
    if len(block) == 1:
        d = dct_oracle(block[0])
        return t.reshape(-1, block[0]) @ d.T
    br, bc = block
    rows, cols = t.shape[0], t.numel() // t.shape[0]
    b = t.reshape(rows // br, br, cols // bc, bc).permute(0, 2, 1, 3)
    return (dct_oracle(br) @ b @ dct_oracle(bc).T).reshape(-1, br, bc)


def _median_s(fn: Any, device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":  # kernels run asynchronously: time them to completion, not to launch
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def codec_checks(device: str, chunk: int = 64) -> list[Check]:
    """DeMo's DCT codec on ``device`` against the fp64 oracle and the reference implementation; timings."""
    from ..models.causal_lm import build_model
    from ..wire.codecs import BlockLayout, BlockWorkspace

    t0 = time.perf_counter()
    dev = torch.device(device)
    model = build_model("tiny", 4096, seed=0)
    shapes = [tuple(p.shape) for p in model.parameters()]
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(dev, torch.float32)
    layout = BlockLayout(shapes, chunk)
    work = BlockWorkspace(layout, torch.float32, dev)
    coeffs = [c.clone() for c in work.encode(flat)]  # encode returns buffers the timed encodes below overwrite
    worst, scale, compared = 0.0, 0.0, 0
    for t, blocks, p in zip(tensors, layout.segment_blocks(coeffs), _placements(layout)):
        if p is None or p.padded:
            continue  # padded segments: the oracle here is for whole blocks
        want = _oracle_blocks(t, p.block)
        got = blocks.detach().double().cpu().reshape(want.shape)
        worst = max(worst, (got - want).abs().max().item())
        scale = max(scale, want.abs().max().item())
        compared += 1
    rel = worst / scale if scale else math.inf
    ok = rel <= DCT_ORACLE_RTOL and compared > 0  # a layout with no unpadded tensor compared nothing: no pass
    out = [Check("codec", "DeMo DCT vs fp64 oracle", "PASS" if ok else "FAIL",
                 f"{compared} tensors, max |Δ| {worst:.3g} = {rel:.2g} of the largest coefficient "
                 f"({'≤' if ok else '>'} {DCT_ORACLE_RTOL:g}), chunk {chunk}, fp32 on {dev.type}",
                 {"max_abs": worst, "rel": rel, "tensors": compared}, _elapsed(t0))]
    back = torch.empty_like(flat)
    work.decode_into(coeffs, back)
    rt = (back - flat).abs().max().item()
    out.append(Check("codec", "DeMo DCT round trip", "PASS" if rt <= 1e-4 else "FAIL",
                     f"decode(encode(x)) max |Δ| {rt:.3g} (≤ 1e-4)", {"max_abs": rt}))
    ours_s = _median_s(lambda: work.decode_into(work.encode(flat), back), dev)
    detail: dict[str, Any] = {"quietsync_encode_decode_s": ours_s}
    figure = f"quietsync encode+decode of all {len(shapes)} tensors ({flat.numel():,} elements): {ours_s * 1e3:.2f} ms"
    status = "PASS"
    try:
        from detonation.util.dct_transform import DCTTransform
    except Exception:  # noqa: BLE001 - the reference is measured when present, never a dependency
        figure += "; reference (PyPI detonation) not installed"
    else:
        params = [torch.nn.Parameter(t.to(dev, torch.float32)) for t in tensors]
        ref = DCTTransform([{"params": params}], chunk)
        agree, gap = 0, 0.0
        for p, ours in zip(params, layout.segment_blocks(coeffs)):
            if p.dim() not in (1, 2) or ours.numel() == 0:
                continue
            theirs = ref.encode(p.data)
            if theirs.numel() != ours.numel() or (p.dim() == 2 and tuple(theirs.shape[-2:]) != tuple(ours.shape[-2:])):
                continue  # the reference chose another chunk for this shape (it falls back to a smaller divisor)
            gap = max(gap, (theirs.reshape(ours.shape) - ours).abs().max().item())
            agree += 1

        def reference_step() -> None:
            for p in params:
                ref.decode(ref.encode(p.data))

        ref_s = _median_s(reference_step, dev)
        detail.update(reference_encode_decode_s=ref_s, reference_max_abs=gap, reference_tensors=agree)
        status = "PASS" if agree > 0 and gap <= DCT_ORACLE_RTOL * max(scale, 1.0) else "FAIL"
        figure += (f"; reference DCTTransform {ref_s * 1e3:.2f} ms ({ref_s / ours_s:.1f}× ours); coefficients agree "
                   f"on {agree} tensors, max |Δ| {gap:.3g}")
    out.append(Check("codec", "DeMo DCT speed beside the reference", status, figure, detail))
    from ..plan.calibrate import time_decoupled

    params = [torch.nn.Parameter(t.to(dev, torch.float32)) for t in tensors]
    step_s = time_decoupled(params, 2, base="sgd", replicator="dct", chunk=chunk, compression=1 / 32, repeats=10)
    out.append(Check("codec", "DeMo-SGD step (dct 1/32, 2 workers looped back)", "PASS",
                     f"{step_s * 1e3:.2f} ms per step on {dev.type}", {"step_s": step_s}))
    return out


def _placements(layout: Any) -> list[Any]:
    """Each segment's placement in ``layout`` (None for an empty segment), in segment order."""
    by_index = {p.index: p for p in layout.placements}
    return [by_index.get(i) for i in range(len(layout.shapes))]


# ------------------------------------------------------------------------------------------------ calibration
def calibration_check(device: str, base_runs: dict[str, Any] | None) -> Check:
    """The planner's calibrated forward + backward against the one the baseline's fp32 run measured
    (:func:`reference_strategy`: zero1) (its loop times
    every micro-batch's forward and backward, synchronising the device); the whole step beside it."""
    from ..models.causal_lm import build_model
    from ..plan.calibrate import calibrate
    from ..train.loop import lm_loss

    t0 = time.perf_counter()
    base = reference_strategy()
    run = (base_runs or {}).get("fp32") if isinstance(base_runs, dict) else None
    if not run or "error" in run:
        return Check("calibration", f"planner forward+backward vs measured ({base})", "SKIP",
                     f"the {base} fp32 run did not finish")
    if not run.get("fwd_bwd_s"):  # timed only after 3 warm-up steps
        return Check("calibration", f"planner forward+backward vs measured ({base})", "SKIP",
                     f"the {base} fp32 run timed no forward+backward after its 3 warm-up steps (--steps 5 or more "
                     "times it)")
    dev = torch.device(device)
    model = build_model("tiny", 4096, seed=0).to(dev)
    batch = torch.randint(0, 4096, (8, 128), device=dev)
    profile = calibrate(model, batch, lm_loss, optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1})
    predicted = profile.forward_s + profile.backward_s
    measured = run["fwd_bwd_s"]
    rel = (predicted - measured) / measured
    ok = abs(rel) <= CALIBRATION_RTOL
    adamw = profile.optimizer_s_per_element * profile.elements
    step = f"; whole step: calibrated forward+backward+AdamW {(predicted + adamw) * 1e3:.2f} ms vs measured " \
           f"{run['step_s'] * 1e3:.2f} ms" if run.get("step_s") else ""
    return Check("calibration", f"planner forward+backward vs measured ({base}, tiny, 8×128)",
                 "PASS" if ok else "FAIL",
                 f"calibrated forward {profile.forward_s * 1e3:.2f} + backward {profile.backward_s * 1e3:.2f} = "
                 f"{predicted * 1e3:.2f} ms vs {measured * 1e3:.2f} ms measured in the run ({rel:+.0%}; "
                 f"{'within' if ok else 'beyond'} ±{CALIBRATION_RTOL:.0%}){step}",
                 {"forward_s": profile.forward_s, "backward_s": profile.backward_s, "optimizer_s": adamw,
                  "predicted_s": predicted, "measured_s": measured, "measured_step_s": run.get("step_s")},
                 _elapsed(t0))


# ------------------------------------------------------------------------------------------------ compile
def compile_check(device: str, steps: int, work: str, cache_dir: str | None, timeout_s: float) -> list[Check]:
    """The baseline (:func:`reference_strategy`: zero1) with ``--compile`` against the same run eager, on the device
    (fp32 and bf16)."""
    t0 = time.perf_counter()
    base = reference_strategy()
    if timeout_s < 30:
        return [Check("compile", f"{base} --compile", "SKIP", "the check's time budget ran out")]
    spec = RunSpec(strategy=base, steps=steps, cpu_steps=0, precisions=["bf16"], extra_flags=["--compile"],
                   work=work, cache_dir=cache_dir, label=f"{base}-compile", device=device)
    eager = RunSpec(strategy=base, steps=steps, cpu_steps=0, precisions=["bf16"], work=work, cache_dir=cache_dir,
                    label=f"{base}-eager", device=device)
    compiled = run_strategy(spec, timeout_s)
    if "error" in compiled:
        return [Check("compile", f"{base} --compile", "FAIL", str(compiled["error"]).strip()[-300:],
                      seconds=_elapsed(t0))]
    plain = run_strategy(eager, max(30.0, timeout_s - _elapsed(t0)))
    if "error" in plain:  # the eager runs' own error, not the missing losses it leaves
        return [Check("compile", f"{base} eager (the compile check's reference)", "FAIL",
                      str(plain["error"]).strip()[-300:], seconds=_elapsed(t0))]
    out = []
    for precision in ("fp32", "bf16"):
        c, e = compiled.get(precision, {}), plain.get(precision, {})
        problem = _run_failed(c) or _run_failed(e)
        if problem:
            out.append(Check("compile", f"{base} --compile {precision}", "FAIL", problem))
            continue
        out.append(compare_values("compile", f"{base} --compile {precision} vs eager", c["last_eval_loss"],
                                  e["last_eval_loss"], COMPILE_TOL,
                                  f"held-out loss after {c['steps']} steps ({_ms(c.get('step_s'))} vs "
                                  f"{_ms(e.get('step_s'))} ms/step, first run {c['seconds']:.0f} s with compiling)",
                                  c["seconds"]))
    return out


def _ms(seconds: float | None) -> str:
    """A step time in ms, or "n/a" for a run too short to time one (steps are timed after 3 warm-up steps)."""
    return f"{seconds * 1e3:.1f}" if seconds else "n/a"


def source_checkout() -> Path | None:
    """The repository this package runs from (``src/quietsync`` inside it), if it is one."""
    here = Path(__file__).resolve().parents[3]  # this file sits at src/quietsync/gpu_check/ in a checkout
    return here if (here / "pyproject.toml").exists() and (here / "tests").is_dir() else None
