"""One control plane: the trainer (``src/quietsync/train``) makes no ``torch.distributed`` call of its own. Every
agreement between workers -- the budgets, the non-finite policy, resume -- goes through the transport's control
group (``Transport.agree`` / ``agree_rows``) or, under ``--fault-tolerance torchft``, torchft's manager (whose
store the fault-tolerance room builds). The one door the trainer may open is ``torch.distributed.checkpoint``:
a storage format, whose few planning collectives run on the transport's own groups."""

from __future__ import annotations

import ast
from pathlib import Path

import quietsync

TRAIN = Path(quietsync.__file__).parent / "train"
ALLOWED = "torch.distributed.checkpoint"


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def distributed_uses(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every use of ``torch.distributed`` outside ``torch.distributed.checkpoint`` in
    ``source``: an import of it (or of a name from it), or an attribute reached through ``torch``."""
    found = []
    aliases: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.distributed") and not a.name.startswith(ALLOWED):
                    found.append((node.lineno, f"import {a.name}"))
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            if not node.module.startswith(ALLOWED):
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name == "distributed":
                    found.append((node.lineno, "from torch import distributed"))
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name and name.startswith("torch.distributed.") and not name.startswith(ALLOWED):
                found.append((node.lineno, name))
    return sorted(set(found))


def test_the_trainer_makes_no_torch_distributed_call():
    uses = {p.name: distributed_uses(p.read_text()) for p in sorted(TRAIN.rglob("*.py"))}
    uses = {k: v for k, v in uses.items() if v}
    assert not uses, f"torch.distributed used in train/ (agree through the transport instead): {uses}"


def test_the_check_catches_each_way_of_calling_it():
    planted = {
        "import torch.distributed as dist\ndist.all_reduce(t)\n": 1,
        "import torch\ntorch.distributed.all_reduce(t)\n": 1,
        "from torch.distributed import TCPStore\n": 1,
        "from torch import distributed\n": 1,
        "def f():\n    import torch.distributed as dist\n    return dist.new_group([0, 1])\n": 1,
        "import torch\nx = torch.distributed.is_initialized()\n": 1,
    }
    for source, n in planted.items():
        assert len(distributed_uses(source)) >= n, source
    # the checkpoint format is allowed
    assert distributed_uses("import torch.distributed.checkpoint as dcp\n"
                            "from torch.distributed.checkpoint import FileSystemReader\n"
                            "x = torch.distributed.checkpoint.save\n") == []
