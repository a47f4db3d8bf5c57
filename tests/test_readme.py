"""The README's API example runs as written (a world of one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.timeout(180)
def test_readme_api_example_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    text = README.read_text()
    section = text[text.index("## The API in"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("    ...\n", "    pass\n")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "StepMetrics(step=2" in out  # 8 micro-batches, accumulation 4: two committed steps
    assert (tmp_path / "ckpt-rank0.pt").exists()


def test_readme_layer_diagram_puts_the_comm_worker_inside_the_strategy():
    """The comm worker is a part the strategy holds (its jobs call the transport), not a layer under the
    transport; the transport is the one door to torch.distributed."""
    text = README.read_text()
    section = text[text.index("## Layers"):]
    diagram = re.search(r"```\n(.*?)```", section, re.S).group(1)
    layers = [line.split()[1] for line in diagram.splitlines() if line.lstrip().startswith("->")]
    assert layers == ["strategy", "transport", "torch.distributed"]
    parts = diagram[diagram.index("-> strategy"):diagram.index("-> transport")]
    for part in ("parts/", "substrates/", "checkpoint/", "flat.py", "replicators/", "codecs/", "comm_worker.py"):
        assert part in parts, part
