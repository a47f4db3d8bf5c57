"""Image classification with Cyclic Data Parallelism on an offline data set (no download).

    PYTHONPATH=src python examples/cdp_images.py --rule v2 --stages 4 --model resnet --epochs 3
    torchrun --nproc-per-node 4 examples/cdp_images.py --rule v2 --stages 4     # N workers, one slot each

The model (a tiny ResNet or ViT, ``nn.Sequential``) is cut into ``--stages`` stages by ``--partition``; each
``forward_backward`` feeds one micro-batch; ``step()`` says when a cycle of N micro-batches was applied.
The data are deterministic synthetic 16×16 "digits" (examples/cdp_models.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cdp_models import synthetic_digits, tiny_resnet, tiny_vit  # noqa: E402

import quietsync  # noqa: E402


def ce_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rule", default="v2", choices=["dp", "v1", "v2"])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--partition", default="flops", choices=["params", "flops", "manual"])
    p.add_argument("--manual-stages", default="")
    p.add_argument("--model", default="resnet", choices=["resnet", "vit"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = tiny_resnet(seed=args.seed) if args.model == "resnet" else tiny_vit(seed=args.seed)
    xtr, ytr = synthetic_digits(2048, seed=1)
    xte, yte = synthetic_digits(1000, seed=2)
    total = args.epochs * len(xtr) // (args.stages * args.micro_batch)
    milestones = (total // 2, 3 * total // 4)
    strategy = quietsync.make_strategy(
        "cdp", model, torch.optim.SGD,
        config={"rule": args.rule, "stages": args.stages, "partition": args.partition,
                "manual_stages": args.manual_stages},
        lr_schedule=lambda step: 0.2 ** sum(step >= m for m in milestones),
        lr=args.lr, momentum=0.9, weight_decay=5e-4)
    rank, world = strategy.rank, strategy.world_size
    g = torch.Generator().manual_seed(args.seed)
    order, k, losses = torch.randperm(len(xtr), generator=g), 0, []
    while strategy.steps < total:
        if (k + 1) * args.micro_batch * world > len(order):
            order, k = torch.randperm(len(xtr), generator=g), 0
        lo = (k * world + rank) * args.micro_batch  # every worker draws its own slice of the same permutation
        idx = order[lo:lo + args.micro_batch]
        k += 1
        loss = strategy.forward_backward((xtr[idx], ytr[idx]), ce_loss)
        if loss is not None:
            losses.append(float(loss))
        if strategy.step() and rank == 0 and strategy.steps % 20 == 0:
            print(f"step {strategy.steps:4d}/{total}  loss {sum(losses[-20:]) / len(losses[-20:]):.3f}", flush=True)
    with torch.no_grad(), strategy.committed_params() as m:
        acc = (m(xte).argmax(1) == yte).float().mean().item() * 100
    if rank == 0:
        print(f"stages: {strategy.balance()}")
        print(f"rule {args.rule}: test accuracy {acc:.2f}%")
    strategy.close()


if __name__ == "__main__":
    main()
