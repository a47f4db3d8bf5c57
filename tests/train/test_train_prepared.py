"""`quietsync prepare` then `quietsync train --dataset DIR`: the run on the prepared folder is the run on the same
text given directly, and mapping the shards changes nothing against holding them in memory; flags that contradict
the folder are refused in one line before any worker starts."""

from __future__ import annotations

import json
import shutil

import pytest

from quietsync.commands.main import main
from quietsync.train.job_data import IN_MEMORY_ENV

from ._run import refused as refused_line
from ._run import train

pytestmark = pytest.mark.timeout(200)


def _losses(out) -> list[tuple]:
    return [(r.get("event", "step"), r["step"], r["loss"])
            for rank in (0, 1) for r in map(json.loads, (out / f"metrics-rank{rank}.jsonl").read_text().splitlines())
            if "loss" in r]


def _job_flags(flags: list[str]) -> list[str]:
    """The shared run's flags without the ones a prepared folder decides."""
    out = list(flags)
    for flag in ("--dataset", "--vocab-size"):
        i = out.index(flag)
        del out[i : i + 2]
    return out


@pytest.fixture
def refused(monkeypatch, capsys):
    return lambda *flags: refused_line(monkeypatch, capsys, *flags)


@pytest.fixture(scope="module")
def prepared(finished_zero1_run, tmp_path_factory):
    """The shared zero1 run's text, prepared by the command."""
    _, flags = finished_zero1_run
    text = flags[flags.index("--dataset") + 1]
    out = tmp_path_factory.mktemp("prepared") / "kjv-like"
    assert main(["prepare", "--dataset", text, "--vocab-size", "300", "--out", str(out), "--no-progress"]) == 0
    return out


def test_train_on_the_prepared_folder_in_memory_is_the_mapped_run(prepared, finished_zero1_run, tmp_path,
                                                                   monkeypatch):
    """The shared run mapped the shards of its text (prepared implicitly); this one trains on the same text
    prepared by `quietsync prepare`, with every worker holding its splits in memory (the path before mapped
    shards): the losses are equal bit for bit."""
    run, flags = finished_zero1_run
    monkeypatch.setenv(IN_MEMORY_ENV, "1")
    proc = train(*_job_flags(flags), "--dataset", str(prepared), "--strategy", "zero1", "--max-steps", "4",
                 "--save-every", "2", "--no-export", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(tmp_path / "run") == _losses(run)
    assert len(_losses(run)) >= 8


def test_flags_that_contradict_the_prepared_folder_are_refused(prepared, finished_zero1_run, refused, tmp_path):
    _, flags = finished_zero1_run
    job = [*_job_flags(flags), "--dataset", str(prepared), "--out", str(tmp_path / "o")]
    line = refused(*job, "--vocab-size", "512")
    assert "--vocab-size 512 differs from the 300 --dataset" in line and "prepare it again, or leave" in line
    assert "--text-column does not apply to --dataset" in refused(*job, "--text-column", "body")
    line = refused(*job, "--micro-batch-size", "512", "--seq-len", "256")
    assert "is too small" in line and "--micro-batch-size 512 x --seq-len 256" in line
    other = tmp_path / "other-tokenizer"
    shutil.copytree(prepared, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]  # one merge fewer: other ids
    (other / "tokenizer.json").write_text(json.dumps(spec))
    line = refused(*job, "--tokenizer", str(other))
    assert line.startswith(f"quietsync train: error: --tokenizer {other} is not the tokenizer --dataset")
    assert not (tmp_path / "o").exists()


def test_a_damaged_prepared_folder_is_refused_before_any_worker_starts(prepared, finished_zero1_run, refused,
                                                                      tmp_path):
    """A shard truncated after prepare, and an index.json cut in half, are one line naming what to do (prepare
    again), from the launcher: never a traceback in the workers, never "already prepared"."""
    _, flags = finished_zero1_run
    truncated, halved = tmp_path / "truncated", tmp_path / "halved"
    shutil.copytree(prepared, truncated)
    shutil.copytree(prepared, halved)
    index = json.loads((truncated / "index.json").read_text())
    shard = truncated / index["splits"]["train"]["shards"][-1]["path"]
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.truncate(size // 2)
    line = refused(*_job_flags(flags), "--dataset", str(truncated), "--out", str(tmp_path / "o"))
    assert f"--dataset {truncated}: shard {shard} is {size // 2} bytes, the index says {size}" in line, line
    assert line.endswith("prepare it again"), line
    text = (halved / "index.json").read_text()
    (halved / "index.json").write_text(text[: len(text) // 2])
    line = refused(*_job_flags(flags), "--dataset", str(halved), "--out", str(tmp_path / "o"))
    assert f"--dataset {halved}: cannot read index.json (JSONDecodeError" in line, line
    assert "already prepared" not in line and "prepare it again from its source" in line, line
    assert not (tmp_path / "o").exists()


def test_prepare_refusals_are_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n")
    assert main(["prepare", "--dataset", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quietsync prepare: error: --dataset must hold at least 2 documents")
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--dataset", "kjv"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "quietsync prepare: error: --out is required: the folder to write " \
                                              "the token shards and index.json to"
    with pytest.raises(SystemExit):
        main(["prepare", "--dataset", "kjv", "--out", str(tmp_path / "o"), "--shard-tokens", "0"])
    assert capsys.readouterr().err.strip() == "quietsync prepare: error: --shard-tokens must be an integer >= 1, got 0"
