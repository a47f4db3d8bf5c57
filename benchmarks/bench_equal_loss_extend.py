"""Run one equal-loss setting on past the job's caps, to resolve a prediction its capped run could only bound.

The equal-loss runs (``bench_equal_loss.py``) stop at a token cap (8 M) and a wall-time cap (600 s, evaluations
included); a setting that stops there without reaching the target gives the planner's benchmark
(``bench_time_to_target.py``) only a lower bound on its time to the target. This runs the same ``quietsync train``
flags as that run's record — the same job, link, seed and evaluations — with larger caps, and records the result
beside the others in ``results/equal_loss_extended.{json,md}`` (one entry per link and setting, the latest run
kept). Run each alone (``--wrap "taskset -c 0,1"``), as the equal-loss runs were.

    python benchmarks/bench_equal_loss_extend.py --record RUNS/job-*/1gbit/dpu-seed0.json --tokens 20000000 \\
        --time-s 1500 --out runs/extend
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, read_run, run_train, write_markdown  # noqa: E402

NAME = "equal_loss_extended"


def extended_flags(flags: list[str], tokens: int, time_s: float) -> list[str]:
    """The record's flags with the token and wall-time caps (and the launcher's timeout) raised."""
    out = list(flags)
    for flag, value in (("--max-tokens", str(tokens)), ("--max-time-s", str(time_s)),
                        ("--timeout-s", str(int(time_s) + 900))):
        if flag not in out:
            raise ValueError(f"the record's flags have no {flag}: not an equal-loss run record")
        out[out.index(flag) + 1] = value
    return out


def child(record: Path, tokens: int, time_s: float, out: Path, reuse: bool = False) -> dict[str, Any]:
    import bench_equal_loss as equal_loss

    rec = json.loads(record.read_text())
    if rec.get("link") == "shaped":
        raise SystemExit("the shaped link's runs need its namespaces: extend them with bench_equal_loss.py")
    flags = extended_flags(rec["flags"], tokens, time_s)
    t0 = time.perf_counter()
    argv = ["--nproc", str(rec["job"]["workers"]), "--nodes", str(rec["job"]["workers"]),
            "--link", f"inter={rec['link_spec']}", *flags]
    if reuse and (out / "summary.json").exists():  # a run made before with these flags: measured, not run again
        summary = read_run(out)
        cfg = summary.get("config", {})
        want = {"strategy": rec["strategy"], "seed": rec["seed"], "max_tokens": tokens, "max_time_s": time_s,
                "target_loss": rec["job"]["target"]}
        if any(cfg.get(k) != v for k, v in want.items()):
            raise SystemExit(f"{out} was run with {({k: cfg.get(k) for k in want})}, not {want}")
    else:
        summary = run_train(out, *argv, timeout=time_s * 2 + 900)
    measured = equal_loss.measure(summary, SimpleNamespace(target=rec["job"]["target"]))
    measured.update(spec=rec["spec"], link=rec["link"], link_spec=rec["link_spec"], seed=rec["seed"], flags=flags,
                    capped={"reached": rec["reached"], "stopped_by": rec["stopped_by"], "tokens": rec["tokens"],
                            "train_time_s": rec["train_time_s"], "best_loss": rec["best_loss"]},
                    record=str(record), process_s=time.perf_counter() - t0, token_cap=tokens, time_cap_s=time_s)
    return measured


def write(entry: dict[str, Any]) -> None:
    path = RESULTS / f"{NAME}.json"
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    data["runs"][f"{entry['link']} {entry['spec']} seed {entry['seed']}"] = entry
    path.write_text(json.dumps(data, indent=1) + "\n")
    rows = []
    for e in data["runs"].values():
        c = e["capped"]
        rows.append([e["link"], f"`{e['spec']}`", e["seed"],
                     f"{c['stopped_by']} at {c['tokens'] / 1e6:.2f} M tokens, {c['train_time_s']:.0f} s, "
                     f"best {c['best_loss']:.3f}",
                     f"{e['token_cap'] / 1e6:g} M / {e['time_cap_s']:g} s",
                     "yes" if e["reached"] else f"no ({e['stopped_by']}, best {e['best_loss']:.3f})",
                     f"{e['tokens_to_target'] / 1e6:.2f} M" if e["reached"] else f"> {e['tokens'] / 1e6:.2f} M",
                     f"{e['time_to_target_s']:.1f}" if e["reached"] else f"> {e['train_time_s']:.0f}"])
    write_markdown(NAME, "Equal-loss runs carried on past the caps", [
        "link", "setting", "seed", "the capped run", "caps now", "reached", "tokens to target",
        "training s to target"], rows,
        "Each the same `quietsync train` flags as the capped run's record (job, link, seed, evaluations), with larger "
        "caps, alone on an otherwise idle machine. Adaptive settings (ACCO/DPU/WP stages follow the timing) take a "
        "different trajectory from run to run.\n\nReproduce: `python benchmarks/bench_equal_loss_extend.py --record "
        "RECORD --tokens N --time-s S --wrap \"taskset -c 0,1\"`.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", type=Path, required=True, help="the capped run's record (bench_equal_loss.py)")
    ap.add_argument("--tokens", type=int, required=True, help="new token cap (all workers)")
    ap.add_argument("--time-s", type=float, required=True, help="new wall-time cap (s, evaluations included)")
    ap.add_argument("--out", type=Path, default=Path("runs/extend"), help="folder for the run")
    ap.add_argument("--wrap", default="", help='command prefix of the run, e.g. "taskset -c 0,1"')
    ap.add_argument("--reuse", action="store_true",
                    help="measure the run already in --out (made with these flags) instead of running it again")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens <= 0 or args.time_s <= 0:
        ap.error("--tokens and --time-s must be positive")
    if not args.record.is_file():
        ap.error(f"--record {args.record}: no such record (bench_equal_loss.py writes them under its --work)")
    rec = json.loads(args.record.read_text())
    out = args.out / rec["link"] / args.record.stem
    if args.child:
        print(json.dumps(child(args.record, args.tokens, args.time_s, out, args.reuse)))
        return
    cmd = [*shlex.split(args.wrap), sys.executable, __file__, "--child", "--record", str(args.record),
           "--tokens", str(args.tokens), "--time-s", str(args.time_s), "--out", str(args.out),
           *(["--reuse"] if args.reuse else [])]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    entry = json.loads(proc.stdout.strip().splitlines()[-1])
    write(entry)
    print({k: entry[k] for k in ("link", "spec", "reached", "tokens_to_target", "time_to_target_s", "best_loss")})


if __name__ == "__main__":
    main()
