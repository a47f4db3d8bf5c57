"""What a membership change costs an elastic run (issue 21): three torchrun agents on this machine (one worker
each, one thread each, tiny model) run ``quietsync train --elastic``; agent 2 is killed (``kill -9``) after a
checkpoint, the two others go on, then agent 2 is started again and rejoins. Per strategy (diloco, zero1):

* **leave**: detection (the kill → the survivors' workers have exited: their next collective failed),
  restart (→ their agents started new workers: re-rendezvous, ``last_call_timeout``), reload (→ the first step
  the new world commits: process start-up, imports, model, checkpoint load, one step), and the work redone:
  steps committed after the checkpoint the survivors resumed from, times the step time;
* **join**: the same for the rejoin (the running agents see the waiting node at their next
  ``--monitor-interval`` check; no work is lost when a checkpoint was written right before, otherwise the
  steps since the last one);
* the checkpoint cadence (``--save-every`` default under ``--elastic``: diloco every outer sync, zero1 every
  10 steps), a checkpoint's cost (extra seconds of the steps that save, against those that do not) and size;
* **the bytes a join costs**: what each worker of a 3-worker world reads from a checkpoint written by 2 workers
  (its ``torch.distributed.checkpoint`` targets, counted in a real load on 3 local workers): a survivor reads
  the world-size-independent part and its own state, a joiner the mean of the saved replicas' inner state.

    python benchmarks/bench_elastic.py [--strategies diloco zero1] [--steps 60]

Writes ``benchmarks/results/elastic.{json,md}``. Absolute seconds depend on the machine and its load (here: 2
cores shared with other jobs); the components and their proportions are the point. Rank 0 is slowed
(``--slow-worker 0:10``, timing only) so that a tiny-model step is not negligible next to a restart, and so
that the two survivors are still training when the third agent, started right after their first step,
rejoins.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from common import RESULTS, write_markdown  # noqa: E402

from tests.elastic_agents import Agents  # noqa: E402
from tests.train.conftest import synthetic_text  # noqa: E402

CONFIGS = {"diloco": ["--strategy", "diloco", "--sync-every", "4"], "zero1": ["--strategy", "zero1"]}


def _flags(root: Path, out: Path, strategy: str, steps: int, slow: int) -> list[str]:
    slower = ["--slow-worker", f"0:{slow}"] if slow > 1 else []
    return [*CONFIGS[strategy], *slower, "--model", "tiny", "--max-steps", str(steps), "--micro-batch-size", "2",
            "--seq-len", "32", "--vocab-size", "300", "--dataset", str(root / "text.txt"), "--cache-dir",
            str(root / "cache"), "--eval-every", "0", "--eval-windows", "8", "--no-progress", "--no-plot",
            "--no-export", "--timeout-s", "30", "--threads", "1", "--out", str(out)]


def _records(out: Path, rank: int = 0) -> list[dict]:
    path = out / f"metrics-rank{rank}.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if "event" not in r]


def _newest(out: Path) -> tuple[int, int | None]:
    from quietsync.train.checkpoint import complete_checkpoints
    from quietsync.train.logical_checkpoint import logical_world

    found = complete_checkpoints(out, [0])
    return (int(found[0].name[5:]), logical_world(found[0])) if found else (0, None)


def _wait(cond, limit: float = 600) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit:
            raise TimeoutError("benchmark phase did not finish")
        time.sleep(0.05)
    return time.monotonic()


def _change(agents: Agents, t: float, out: Path, world: int, agents_kept: list[int]) -> dict:
    """Timeline of a membership change at monotonic time ``t`` to a world of ``world`` workers, and the steps
    the old world had committed after the checkpoint the new one resumed from (redone)."""
    old = [s for s in agents.seen.values() if s.worker and s.agent in agents_kept and s.first < t <= s.last + 0.5]
    resumes = len(_resumed_from(agents))
    last = [max((r["step"] for r in _records(out)), default=0)]

    def started() -> bool:
        last[0] = max([last[0], *(r["step"] for r in _records(out))])
        return any(s.worker and s.first > t for s in agents.seen.values())

    new_first = _wait(started)
    _wait(lambda: len(_resumed_from(agents)) > resumes)  # rank 0 of the new world says where it resumed
    resumed = max(_resumed_from(agents))
    first_step = _wait(lambda: any(r.get("world_size") == world and r["step"] == resumed + 1 for r in _records(out)))
    exited = max((s.last for s in old), default=t)
    return {"detect_s": exited - t, "restart_s": new_first - exited, "reload_s": first_step - new_first,
            "total_s": first_step - t, "resumed_from": resumed, "redone_steps": last[0] - resumed}


def _step_times(rows: list[dict], save_every: int) -> tuple[float, float]:
    """(median seconds of a step that does not save, median extra seconds of one that does)."""
    plain, saving = [], []
    for a, b in zip(rows, rows[1:]):
        if b.get("world_size") != a.get("world_size"):
            continue
        dt = b["time_s"] - a["time_s"]
        (saving if b["step"] % save_every == 0 else plain).append(dt)
    base = statistics.median(plain) if plain else float("nan")
    return base, (statistics.median(saving) - base) if saving else float("nan")


def _resumed_from(agents: Agents) -> list[int]:
    """The checkpoint steps the job resumed from so far (rank 0 says so at each start of the workers)."""
    lines = [ln for p in sorted(agents.folder.glob("agent*.log")) for ln in p.read_text().splitlines()]
    return sorted(int(ln.split("resuming step-")[1][:7]) for ln in lines if "--elastic: resuming step-" in ln)


def run_strategy(strategy: str, steps: int, slow: int, root: Path) -> dict:
    from quietsync.strategies import get
    from quietsync.train.elastic import default_save_every

    out = root / f"run-{strategy}"
    folder = root / f"agents-{strategy}"
    folder.mkdir()
    cfg_cls = get(strategy)[1]
    save_every = default_save_every(strategy, cfg_cls(sync_every=4) if strategy == "diloco" else cfg_cls())
    agents = Agents(folder, 3, _flags(root, out, strategy, steps, slow), nnodes="2:3", max_restarts=3,
                    env={"QUIETSYNC_AUDIT_DATA": "1"})
    try:
        agents.start_host()
        agents.start(1)
        agents.start(2)
        _wait(lambda: _newest(out)[0] >= 2 * save_every and _newest(out)[1] == 3)
        mid = _newest(out)[0] + max(1, save_every // 2)  # half-way to the next checkpoint: the expected loss
        _wait(lambda: max((r["step"] for r in _records(out)), default=0) >= mid)
        killed = agents.kill_agent(2)
        leave = _change(agents, killed, out, 2, [0, 1])
        rejoined = time.monotonic()  # right after the survivors' first step (they save while it starts)
        agents.start(2)
        join = _change(agents, rejoined, out, 3, [0, 1])
        codes = agents.wait(900)
        left = agents.survivors()
    finally:
        agents.close()
    rows = _records(out)
    step3, save3 = _step_times([r for r in rows if r["world_size"] == 3], save_every)
    step2, save2 = _step_times([r for r in rows if r["world_size"] == 2], save_every)
    leave["redone_s"] = leave["redone_steps"] * step3
    join["redone_s"] = join["redone_steps"] * step2
    sizes = {}
    for step_dir in sorted((out / "checkpoints").glob("step-*"))[-1:]:
        sizes["rank_files_bytes"] = sum(p.stat().st_size for p in step_dir.glob("rank*.pt"))
        sizes["logical_bytes"] = sum(p.stat().st_size for p in (step_dir / "logical").iterdir())
    join_bytes = _join_bytes(strategy, root, out)
    return {"strategy": strategy, "save_every": save_every, "exit_codes": codes, "processes_left": len(left),
            "step_s_3_workers": step3, "step_s_2_workers": step2, "save_extra_s": save3, "save_extra_s_2": save2,
            "leave": leave, "join": join, "checkpoint": sizes, "join_read_bytes": join_bytes,
            "final_loss": json.loads((out / "summary.json").read_text())["last_eval_loss"]}


def _join_bytes(strategy: str, root: Path, out: Path) -> list[int]:
    """Bytes each of 3 new workers reads from the newest checkpoint written by 2 workers (a real load)."""
    from quietsync.train.logical_checkpoint import logical_world
    from tests.distributed import run_ranks

    two = [d for d in sorted((out / "checkpoints").glob("step-*")) if logical_world(d) == 2]
    if not two:
        return []
    summary = json.loads((out / "summary.json").read_text())
    return run_ranks(_count_load, 3, str(two[-1]), strategy, summary["strategy_config"], str(root), timeout=300)


def _count_load(rank: int, world: int, folder: str, strategy: str, config: dict, root: str) -> int:
    import quietsync.train.logical_checkpoint as lc
    from quietsync.data.corpus import load_corpus
    from quietsync.data.sequences import ShardedSequences, encode_split
    from quietsync.data.tokenizer import job_tokenizer
    from quietsync.models import build_model, param_groups
    from quietsync.strategies import make_strategy
    from quietsync.strategies.checkpoint.logical import local_part

    corpus = load_corpus(str(Path(root) / "text.txt"), 0.02)
    tokenizer, eos = job_tokenizer(None, corpus, 300, Path(root) / "cache")
    tokens = encode_split(tokenizer, corpus.documents, eos, Path(root) / "cache")
    model = build_model("tiny", tokenizer.get_vocab_size(), eos, seed=0)
    s = make_strategy(strategy, model, torch.optim.AdamW, param_groups=param_groups(model, 0.1), config=config,
                      lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    counted = [0]
    real = lc.dcp.load

    def counting(state_dict, **kwargs):
        counted[0] += sum(local_part(t).numel() * t.element_size() for t in state_dict.values())
        return real(state_dict, **kwargs)

    lc.dcp.load = counting
    try:
        lc.load_logical(folder, s, ShardedSequences(tokens, 32, 2, rank, world, 0))
    finally:
        lc.dcp.load = real
        s.close()
    return counted[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", nargs="+", default=["diloco", "zero1"])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--slow", type=int, default=10,
                   help="--slow-worker 0:SLOW: rank 0 sleeps (SLOW-1) x its compute per micro-batch, so a tiny-model "
                        "step takes about as long as a real one would relative to a restart (1: off)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        root = Path(tmp)
        (root / "text.txt").write_text(synthetic_text(3000))
        results = [run_strategy(s, args.steps, args.slow, root) for s in args.strategies]
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]), "load_average": os.getloadavg(), "results": results}
    (RESULTS / "elastic.json").write_text(json.dumps(meta, indent=2) + "\n")
    rows = []
    for r in results:
        for kind in ("leave", "join"):
            c = r[kind]
            rows.append([r["strategy"], kind, c["detect_s"], c["restart_s"], c["reload_s"], c["total_s"],
                         c.get("redone_steps", 0), c.get("redone_s", 0.0)])
    notes = "\n".join(
        f"- {r['strategy']}: checkpoint every {r['save_every']} steps (--elastic default), "
        f"step {r['step_s_3_workers']:.3f} s "
        f"on 3 workers / {r['step_s_2_workers']:.3f} s on 2, a checkpoint adds {r['save_extra_s']:.3f} s; newest "
        f"checkpoint {r['checkpoint'].get('rank_files_bytes', 0) / 1e6:.1f} MB of rank files + "
        f"{r['checkpoint'].get('logical_bytes', 0) / 1e6:.1f} MB logical; a 3-worker world loading a 2-worker "
        f"checkpoint reads {', '.join(f'{b / 1e6:.2f}' for b in r['join_read_bytes'])} MB (ranks 0, 1, 2: "
        f"survivors, joiner); exit codes {r['exit_codes']}, processes left {r['processes_left']}; final held-out "
        f"loss {r['final_loss']:.3f}" for r in results)
    notes += f"\n\nCommand: `{meta['command']}`; load average during the run {meta['load_average'][0]:.1f}."
    write_markdown("elastic", "Membership changes of an elastic run (3 torchrun agents, tiny model, one thread each)",
                   ["strategy", "change", "detect s", "restart s", "reload s", "total s", "redone steps",
                    "redone s"], rows, notes)
    print((RESULTS / "elastic.md").read_text())


if __name__ == "__main__":
    main()
