"""--log-with: flattened records to CSV, TensorBoard and W&B, from a tiny one-process run."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from quietsync.cli.flags import FlagError, build_config
from quietsync.train.config import TrainConfig
from quietsync.train.metrics import MetricsWriter, read_jsonl
from quietsync.train.sinks import CSVSink, MetricsSink, flatten, open_sinks, parse_log_with

from .conftest import synthetic_text

pytestmark = pytest.mark.timeout(180)

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None


def test_flatten_joins_nested_keys_and_prefixes_eval_records():
    step = {"step": 3, "rank": 1, "loss": 2.5, "bytes_by_group": {"replicate": {"sent": 10, "recv": 12}},
            "extra": {"k": [1, 2]}}
    assert flatten(step) == {"step": 3, "rank": 1, "loss": 2.5, "bytes/replicate/sent": 10,
                             "bytes/replicate/recv": 12, "extra/k/0": 1, "extra/k/1": 2}
    ev = {"event": "eval", "step": 4, "rank": 0, "loss": 2.0, "perplexity": 7.4}
    assert flatten(ev) == {"step": 4, "rank": 0, "eval/loss": 2.0, "eval/perplexity": 7.4}


def test_parse_log_with_and_the_flag_error():
    assert parse_log_with("csv, csv,") == ("csv",)
    assert parse_log_with(["csv"]) == ("csv",)
    assert parse_log_with(None) == ()
    with pytest.raises(FlagError, match=r"^--log-with must be a comma list of tensorboard, csv, wandb; got 'tb'$"):
        build_config(TrainConfig, {"log_with": "csv,tb"})
    assert TrainConfig(log_with="CSV,").log_with == "csv"


def test_missing_package_is_a_one_line_error(monkeypatch):
    import quietsync.train.sinks as sinks

    real = importlib.util.find_spec
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(FlagError, match=r"^--log-with wandb needs the wandb package: pip install wandb$"):
        build_config(TrainConfig, {"log_with": "csv,wandb"})


def test_csv_sink_grows_its_header(tmp_path):
    sink = CSVSink(tmp_path / "m.csv")
    assert isinstance(sink, MetricsSink)
    sink.log({"step": 0, "eval/loss": 3.0}, 0)
    sink.log({"step": 1, "loss": 2.0, "lr": None}, 1)
    sink.log({"step": 2, "loss": 1.5, "lr": 0.1}, 2)
    sink.close()
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert rows[0] == {"step": "0", "eval/loss": "3.0", "loss": "", "lr": ""}
    assert rows[2]["lr"] == "0.1"


def test_metrics_writer_feeds_sinks_and_replays_kept_records_on_resume(tmp_path):
    with MetricsWriter(tmp_path, 0, sinks=open_sinks("csv", tmp_path, 0)) as w:
        for s in (1, 2, 3):
            w.step({"step": s, "rank": 0, "loss": 1.0 / s, "lr": 0.1, "tokens": 1, "tokens_total": s,
                    "micro_batches": 1, "compute_s": 0.0, "comm_s": 0.0, "idle_s": 0.0, "bytes_sent": 0,
                    "bytes_recv": 0, "bytes_by_group": {"world": {"sent": 5 * s}}, "slow_sleep_s": 0.0,
                    "time_s": 0.0})
    with MetricsWriter(tmp_path, 0, resume_step=2, sinks=open_sinks("csv", tmp_path, 0, resume=True)):
        pass
    rows = list(csv.DictReader((tmp_path / "metrics-rank0.csv").open()))
    assert [r["step"] for r in rows] == ["1", "2"] and rows[1]["bytes/world/sent"] == "10"


def _tiny_run(tmp_path, out: str, **kw):
    from quietsync.train.loop import run

    data = tmp_path / "text.txt"
    if not data.exists():
        data.write_text(synthetic_text(3000))
    cfg = TrainConfig(nproc=1, model="tiny", max_steps=3, micro_batch_size=2, seq_len=32, vocab_size=300,
                      dataset=str(data), cache_dir=str(tmp_path / "cache"), eval_every=0, eval_windows=4,
                      progress=False, plot=False, export=False, out=str(tmp_path / out), **kw)
    return run(cfg)


def _clean_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the tensorboard package (pip install 'quietsync[train]')")
def test_a_run_writes_csv_and_tensorboard(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _clean_env(monkeypatch)
    summary = _tiny_run(tmp_path, "run", log_with="tensorboard,csv")
    out = tmp_path / "run"
    jsonl = read_jsonl(out / "metrics-rank0.jsonl")
    rows = list(csv.DictReader((out / "metrics-rank0.csv").open()))
    assert len(rows) == len(jsonl) == 3 + 2  # 3 steps, eval before and after
    steps = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in steps] == [1, 2, 3]
    assert [float(r["loss"]) for r in steps] == pytest.approx([r["loss"] for r in jsonl if "event" not in r])
    assert any(k.startswith("bytes/") for k in rows[0]) and "eval/loss" in rows[0]

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss", "lr", "eval/loss", "eval/perplexity"} <= set(tags)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    evals = acc.Scalars("eval/loss")
    assert [e.step for e in evals] == [0, 3]
    assert evals[-1].value == pytest.approx(summary["last_eval_loss"], rel=1e-6)
    assert json.loads((out / "summary.json").read_text())["config"]["log_with"] == "tensorboard,csv"


@pytest.mark.skipif(not HAS_WANDB, reason="needs the wandb package (pip install wandb)")
def test_a_run_logs_to_wandb_offline(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "run"))
    _tiny_run(tmp_path, "run", log_with="wandb")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the tensorboard package (pip install 'quietsync[train]')")
def test_tensorboard_on_resume_hides_the_earlier_writers_events(tmp_path):
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from quietsync.train.sinks import TensorBoardSink

    first = TensorBoardSink(tmp_path)
    for s in (1, 2, 3):
        first.log({"step": s, "loss": float(s)}, s)
    first.close()
    time.sleep(1.1)  # event files are named by the second they were opened
    again = TensorBoardSink(tmp_path, resume=True)  # a resume at step 2 replays the kept records
    for s in (1, 2):
        again.log({"step": s, "loss": 10.0 * s}, s)
    again.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 10.0), (2, 20.0)]


def test_csv_sink_appends_under_its_header_and_keeps_earlier_rows_when_it_grows(tmp_path):
    """A restarted torchft replica continues its CSV: the earlier rows stay, new ones follow under the same header,
    and a key new to the file rewrites it with every row so far (a row cut short by a kill stays, alone)."""
    path = tmp_path / "m.csv"
    first = CSVSink(path)
    first.log({"step": 1, "loss": 5.0}, 1)
    first.log({"step": 2, "loss": 4.5}, 2)
    first.close()
    with open(path, "a") as f:
        f.write("3,4.")  # killed mid-row
    again = CSVSink(path, append=True)
    again.log({"step": 4, "loss": 4.0}, 4)
    assert path.read_text().splitlines() == ["step,loss", "1,5.0", "2,4.5", "3,4.", "4,4.0"]
    again.log({"step": 5, "loss": 3.9, "members": 2}, 5)
    again.close()
    assert path.read_text().splitlines() == ["step,loss,members", "1,5.0,", "2,4.5,", "3,4.,", "4,4.0,", "5,3.9,2"]
    fresh = CSVSink(path)  # without append: a new file
    fresh.close()
    assert path.read_text() == ""
