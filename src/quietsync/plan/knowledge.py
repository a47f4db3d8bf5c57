"""What this project has measured about each strategy's loss per token (its equal-token benchmarks).

The planner predicts speed; whether the faster strategy also learns as much from each token is a property of
the algorithm that only training tells. These are the equal-token results in ``benchmarks/results/``, quoted
with their file so a reader can check them (a test checks that every number quoted is in the cited file).
They are miniatures (tiny GPT-Neo on CPU, tens of steps): directions, not guarantees at scale.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One measured statement about a strategy's loss per token."""

    strategies: tuple[str, ...]
    """The strategies it concerns."""
    text: str
    """The finding, with its numbers."""
    source: str
    """The results file (relative to the repository root) it quotes."""
    numbers: tuple[str, ...]
    """The numbers quoted, as they appear in the source (checked by the tests)."""


FINDINGS: tuple[Finding, ...] = (
    Finding(("ddp", "zero1", "fsdp"), "exact synchronous data parallelism: the reference loss per token "
            "(ZeRO-1 and FSDP equal DDP up to float rounding, tested)", "benchmarks/results/baselines.md", ()),
    Finding(("acco",), "ACCO needs more tokens for the same loss (it takes more micro-batches per step): "
            "913408 vs 450560 tokens to loss 5.2 with comm≈1× compute, 1448960 vs 491520 with comm≈3× "
            "(4 workers); its wall time to that loss was 1.16× and 1.11× ZeRO-1's there",
            "benchmarks/results/acco_paper.md", ("913408", "450560", "1448960", "491520", "1.16", "1.11")),
    Finding(("acco",), "with one worker 4× slower ACCO kept 0.993 of the time busy but needed 2194432 tokens "
            "against ZeRO-1's 450560 to loss 5.19", "benchmarks/results/acco_paper.md", ("2194432", "450560", "0.993")),
    Finding(("acco",), "with a core per worker (2 workers, comm≈1× compute, 3 seeds) ACCO reached ZeRO-1's loss "
            "in 1.07 ± 0.07 of its time (adaptive extras) or 0.74 ± 0.04 (one micro-batch per stage); with one "
            "worker 4× slower in 0.94 ± 0.04 (adaptive)",
            "benchmarks/results/acco_paper_repeats.md", ("1.07 ± 0.07", "0.74 ± 0.04", "0.94 ± 0.04")),
    Finding(("demo", "flexdemo"), "FlexDeMo DCT (1/32, sign) at equal steps and tokens: held-out loss 6.16 "
            "against 6.01 for hybrid-sharded AdamW; the random replicator 7.67; DCT without sign 7.97",
            "benchmarks/results/demo_paper.md", ("6.16", "6.01", "7.67", "7.97")),
    Finding(("localsgd", "diloco"), "at equal tokens (2 workers with a core each, 256 micro-batches): full sync "
            "5.22, Local SGD K=16 5.42 at 1.7x one worker's speed, Streaming DiLoCo H=16 F=4 5.43, DiLoCo H=16 5.8, "
            "DiLoCo H=4 6.33 (outer lr 0.7 is tuned for large H); gradient accumulation 16 at the same bytes 6.74",
            "benchmarks/results/local.md", ("5.22", "5.42", "1.7", "5.43", "5.8", "6.33", "6.74")),
    Finding(("cdp",), "CDP changes which parameter version each stage sees: on the tiny ResNet at an equal batch "
            "per step, each rule at its best lr, 5 seeds, 4000 steps: test accuracy 96.61 ± 0.41% for dp, "
            "95.65 ± 0.49% for cdp-v2, 91.01 ± 4.00% for cdp-v1 (at 2000 steps some delayed-rule seeds still stall)",
            "benchmarks/results/cdp_longer.md", ("96.61 ± 0.41", "95.65 ± 0.49", "91.01 ± 4.00")),
    Finding(("dpu", "wp", "acco"), "at equal tokens and batch (4 workers, 100 steps): held-out loss ddp 5.23, ACCO "
            "5.13, DPU 5.91 without warm-up and 5.48 with 25 warm-up steps, WP 5.91 (the one-step delay costs loss)",
            "benchmarks/results/acco_dynamics.md", ("5.23", "5.13", "5.91", "5.48")),
)


def findings_for(strategy: str) -> list[Finding]:
    """The findings about ``strategy``."""
    return [f for f in FINDINGS if strategy in f.strategies]
