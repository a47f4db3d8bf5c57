"""The command line of the GPU check: parse, refuse without a device, run the checks within a time budget, write
the report, exit 0 (all passed) / 1 (a check failed) / 2 (refused).

    python -m quietsync.gpu_check [--out DIR] [--budget-s 480] [--strategies NAME ...] [--strategy-module FILE]
                                  [--skip-tests]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

PROG = "python -m quietsync.gpu_check"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    from .checks import strategy_specs

    specs = strategy_specs()
    p = _Parser(prog=PROG, description="Check every GPU path of quietsync on one CUDA device; write gpu-check.md "
                                       "and gpu-check.json.")
    p.add_argument("--out", default="runs/gpu-check", help="folder for gpu-check.md/.json and the runs "
                                                             "(default: runs/gpu-check)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall-clock budget; checks that would start after it are reported SKIP (default 480)")
    p.add_argument("--strategies", nargs="+", default=list(specs), metavar="NAME",
                   help=f"strategies to train on the device (default: all: {' '.join(specs)})")
    p.add_argument("--strategy-module", metavar="FILE", default=None,
                   help="import a strategy of your own first (a .py file or a module name), so that it is checked "
                        "too (quietsync train --strategy-module)")
    p.add_argument("--steps", type=int, default=40, help="committed steps of each run on the device (default 40)")
    p.add_argument("--cpu-steps", type=int, default=5,
                   help="steps compared step by step between the device and the CPU (default 5; 0 = none)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked tests")
    p.add_argument("--skip-compile", action="store_true", help="do not check --compile")
    p.add_argument("--cache-dir", default=None, help="tokenizer/token cache folder (quietsync train --cache-dir)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the check); cpu runs the same harness without a GPU, to check the harness itself")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    from ..data.corpus import kjv_path
    from ..strategies.registry import load_module
    from .checks import strategy_specs

    # --strategy-module first: --strategies' default and its name check read the registry
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--strategy-module", default=None)
    module = pre.parse_known_args(argv)[0].strategy_module
    if module is not None:
        try:
            load_module(module)
        except ValueError as e:
            _Parser(prog=PROG).error(str(e))
    p = parser()
    args = p.parse_args(argv)
    specs = strategy_specs()
    unknown = [s for s in args.strategies if s not in specs]
    if unknown:
        p.error(f"--strategies must be among {', '.join(specs)}; got {', '.join(unknown)}")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s:g}")
    if args.steps < 2:
        p.error(f"--steps must be >= 2, got {args.steps}")
    if not 0 <= args.cpu_steps <= args.steps:
        p.error(f"--cpu-steps must be between 0 and --steps ({args.steps}), got {args.cpu_steps}")
    try:  # every run trains on the embedded corpus: refuse before any
        kjv_path()
    except FileNotFoundError as e:
        p.error(f"the check's runs train on the embedded corpus: {e}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here (torch.cuda.is_available() is False, torch "
                f"{torch.__version__}): run it on a machine with a GPU, or --device cpu to dry-run the harness")
    return args


def main(argv: list[str] | None = None) -> int:
    from . import checks
    from .report import Check, Report

    args = parse(list(sys.argv[1:] if argv is None else argv))
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    out = Path(args.out)
    work = str(out / "runs")
    report = Report(checks.device_name(args.device), checks.versions(), unchecked=list(checks.UNCHECKED))

    def say(c: Check) -> None:
        print(f"[{c.status}] {c.group}: {c.name} — {c.figure}", flush=True)

    def add(items: list[Check]) -> None:
        for c in items:
            say(report.add(c))

    print(f"{PROG}: {report.device}; {', '.join(f'{k} {v}' for k, v in report.versions.items())}", flush=True)
    if not args.skip_tests and args.device == "cuda":  # gpu-marked tests skip without CUDA: a dry run has none
        add(checks.gpu_tests(checks.source_checkout(), timeout_s=min(240.0, max(30.0, deadline - time.perf_counter()))))
    results, raw = checks.strategy_checks(args.strategies, device=args.device, steps=args.steps,
                                          cpu_steps=args.cpu_steps, work=work, cache_dir=args.cache_dir,
                                          deadline=deadline)
    add(results)
    for name, fn in (("codec", lambda: checks.codec_checks(args.device)),
                     ("calibration",
                      lambda: [checks.calibration_check(args.device, raw.get(checks.reference_strategy()))])):
        if deadline - time.perf_counter() < 10:
            add([Check(name, name, "SKIP", "the check's time budget ran out")])
            continue
        try:
            add(fn())
        except Exception as e:  # noqa: BLE001 - one check's crash is its FAIL, the rest still run
            add([Check(name, name, "FAIL", f"{type(e).__name__}: {e}"[:300])])
    if not args.skip_compile:
        add(checks.compile_check(args.device, min(args.steps, 20), work, args.cache_dir,
                                 timeout_s=deadline - time.perf_counter()))
    report.seconds = time.perf_counter() - t0
    md, js = report.write(out)
    counts = report.counts()
    print(f"{PROG}: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
          f"{report.seconds:.0f} s; report: {md} and {js}", flush=True)
    return 1 if report.failed else 0
