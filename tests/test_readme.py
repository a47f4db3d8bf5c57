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


@pytest.mark.timeout(120)
def test_readme_parquet_commands_run_as_written(tmp_path, monkeypatch):
    """The two commands a user with a folder of Parquet files runs: prepare runs, and train accepts its folder."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from quietsync.commands.main import main
    from quietsync.train.args import parse_train_args
    from tests.train.conftest import synthetic_text

    text = README.read_text()
    prepare, train = re.search(r"```bash\n(quietsync prepare [^\n#]*?)\s*#[^\n]*\n(quietsync train [^\n#]*?)\s*#",
                               text).groups()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_parquet").mkdir()
    pq.write_table(pa.table({"text": [synthetic_text(60, seed=i) for i in range(60)]}),
                   tmp_path / "my_parquet" / "part-0.parquet")
    assert main([*prepare.split()[1:], "--vocab-size", "300", "--no-progress"]) == 0
    cfg, _, _ = parse_train_args(train.split()[2:])
    assert cfg.dataset == "data/mine" and (tmp_path / "data" / "mine" / "index.json").exists()
