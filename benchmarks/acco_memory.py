"""Memory of every buffer of acco / dpu / wp / zero1, measured on N workers, against paper 003's Table 1.

Builds the trainer's tiny GPT-Neo on N local gloo workers, runs two committed steps of each strategy,
reads ``memory_report()`` on rank 0 and writes ``results/acco_memory.md`` (+ ``.json``). Table 1 counts
bytes per parameter in the paper's mixed precision (bf16 working parameters, gradients and communication
buffer; fp32 master, m and v: K = 12); quietsync keeps the model's dtype (fp32 here), so the table also
shows the formula in fp32 terms: (4+4+4)Ψ for the three full-size buffers.

    python benchmarks/acco_memory.py [--nproc 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import RESULTS, write_markdown  # noqa: E402

STRATEGIES = ("zero1", "dpu", "wp", "acco")


def _measure(rank: int, world: int) -> dict:
    import torch

    import quietsync
    from quietsync.models import build_model

    out = {}
    for name in STRATEGIES:
        model = build_model("tiny", 4096, seed=0)
        config = {"accumulation": 1} if name == "zero1" else {"deterministic_accumulation": 1}
        strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, config=config, lr=1e-3)
        x = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(rank))
        while strategy.steps < 2:
            strategy.backward(strategy.model(input_ids=x, labels=x).loss)
            strategy.step()
        report = strategy.memory_report()
        out[name] = {"report": report, "psi": strategy.flat.numel,
                     "padded": strategy.flat.padded_numel}
        strategy.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    args = ap.parse_args()
    from tests.distributed import run_ranks

    n = args.nproc
    res = run_ranks(_measure, n, timeout=600)[0]
    psi = res["acco"]["psi"]
    keys = sorted({k for r in res.values() for k in r["report"]})
    rows = []
    for k in keys:
        rows.append([k, *[res[s]["report"].get(k, 0) / psi for s in STRATEGIES]])
    totals = [sum(res[s]["report"].values()) / psi for s in STRATEGIES]
    rows.append(["**total measured (bytes / parameter)**", *totals])
    k_opt = 12  # fp32 master + m + v
    paper = {"zero1": 2 + 2 + k_opt / n, "dpu": 2 + 2 + 2 + k_opt / n, "wp": 2 + 2 + 2 + k_opt / n,
             "acco": 2 + 2 + 2 + k_opt / n}
    fp32 = {"zero1": 4 + 4 + k_opt / n, "dpu": 4 + 4 + 4 + k_opt / n, "wp": 4 + 4 + 4 + k_opt / n,
            "acco": 4 + 4 + 4 + k_opt / n}
    rows.append([f"paper Table 1, bf16 working copies: (2+2[+2]+K/N), K=12, N={n}", *[paper[s] for s in STRATEGIES]])
    rows.append([f"same formula with fp32 working copies: (4+4[+4]+K/N), N={n}", *[fp32[s] for s in STRATEGIES]])
    rows.append(["measured - fp32 formula", *[t - fp32[s] for t, s in zip(totals, STRATEGIES)]])
    path = write_markdown(
        "acco_memory", f"Memory per worker, bytes per parameter — tiny GPT-Neo (Ψ = {psi:,}), N = {n} workers",
        ["buffer", *STRATEGIES], rows,
        notes=("Rows are `memory_report()` keys divided by Ψ (the padded buffers are a few elements longer). "
               "`params`, `grads`, `comm_buffer`: full-size flat buffers; `master_shard`, `grad_shard`, "
               "`optimizer_state`: the ZeRO-1 shard (K/N); `estimate_scratch`: the shard copy of master + "
               "optimizer state the uncommitted estimate (ACCO) or prediction (WP) runs on; "
               "`tilde_grad_shard`: ACCO's Σg̃ shard kept from stage 1 to stage 2; `committed_snapshot`: the "
               "shard of θ kept so `committed_params()` can rebuild θ while the next update is in flight. "
               "All extras are O(Ψ/N). Reproduce: `python benchmarks/acco_memory.py`."),
    )
    (RESULTS / "acco_memory.json").write_text(json.dumps(res, indent=2))
    print(path.read_text())


if __name__ == "__main__":
    main()
