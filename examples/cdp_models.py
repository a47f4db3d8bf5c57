"""Tiny models and an offline image set for the CDP example, benchmark and tests.

* :func:`tiny_resnet` — a CIFAR-style ResNet (3×3 stem, residual blocks, pooling head) as an ``nn.Sequential``
  so :mod:`quietsync.models.stages` can cut it between blocks;
* :func:`tiny_vit` — a ViT (patch embedding + class token, pre-norm transformer blocks, head) as an
  ``nn.Sequential``;
* :func:`synthetic_digits` — a deterministic, offline 10-class set of 1×16×16 images: each class is a fixed
  random template of strokes, every sample a shifted, noisy copy (nothing is downloaded; scikit-learn is not
  a dependency).
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.GroupNorm(1, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.GroupNorm(1, cout)
        self.skip = (nn.Identity() if stride == 1 and cin == cout
                     else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(1, cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


def tiny_resnet(classes: int = 10, width: int = 8, in_ch: int = 1, seed: int = 0) -> nn.Sequential:
    """stem, 4 residual blocks (two at half resolution), pooled linear head: 6 segments."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(in_ch, width, 3, 1, 1, bias=False), nn.GroupNorm(1, width), nn.ReLU()),
        ResBlock(width, width), ResBlock(width, width),
        ResBlock(width, 2 * width, 2), ResBlock(2 * width, 2 * width),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes)),
    )


class PatchEmbed(nn.Module):
    def __init__(self, size: int, patch: int, in_ch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_ch, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).flatten(2).transpose(1, 2)
        return torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1) + self.pos


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x[:, 0]))


def tiny_vit(classes: int = 10, size: int = 16, patch: int = 4, dim: int = 32, depth: int = 4, heads: int = 4,
             in_ch: int = 1, seed: int = 0) -> nn.Sequential:
    """patch embedding, ``depth`` blocks, head: ``depth + 2`` segments."""
    torch.manual_seed(seed)
    return nn.Sequential(PatchEmbed(size, patch, in_ch, dim), *[Block(dim, heads) for _ in range(depth)],
                         Head(dim, classes))


def synthetic_digits(n: int, seed: int = 0, size: int = 16, classes: int = 10,
                     noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images ``(n, 1, size, size)`` and labels; the class templates are fixed (seed 1234), ``seed`` draws
    the samples, so train and test sets come from the same distribution."""
    tg = torch.Generator().manual_seed(1234)
    templates = torch.zeros(classes, size, size)
    for c in range(classes):
        for _ in range(3):  # three random strokes per class
            r0, c0 = torch.randint(2, size - 2, (2,), generator=tg).tolist()
            dr, dc = torch.randint(-1, 2, (2,), generator=tg).tolist()
            for k in range(size):
                r, cc = r0 + dr * k // 2, c0 + dc * k // 2
                if 0 <= r < size and 0 <= cc < size:
                    templates[c, r, cc] = 1.0
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    images = torch.stack([torch.roll(templates[y], tuple(s.tolist()), (0, 1)) for y, s in zip(labels, shifts)])
    images = images + noise * torch.randn(images.shape, generator=g)
    return images.unsqueeze(1), labels
