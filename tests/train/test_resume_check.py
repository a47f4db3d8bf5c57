"""Resume compares the checkpoint's config with the flags: incompatible changes are refused in one line
listing them, safe ones pass (with a note of what they change), another world size is a note where the
checkpoint can be resharded and one line naming the strategy and why where it cannot."""

from __future__ import annotations

import dataclasses

import pytest

from quietsync.strategies import get
from quietsync.train.config import TrainConfig
from quietsync.train.metrics import read_jsonl
from quietsync.train.resume_check import (
    INCOMPATIBLE,
    NOTED,
    SAFE,
    TOPOLOGY,
    ResumeMismatch,
    check_checkpoint,
    check_resume,
)
from tests.shared import copy_of

from ._run import refused, train

pytestmark = pytest.mark.timeout(60)


def _payload(cfg: TrainConfig, scfg, world: int = 2, nodes: int = 2, step: int = 4) -> dict:
    return {"config": dataclasses.asdict(cfg), "world_size": world, "nodes": nodes,
            "strategy": {"steps": step, "world_size": world, "config": dataclasses.asdict(scfg)}}


def test_every_job_field_is_classified_once():
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    classes = [set(INCOMPATIBLE), set(NOTED), set(SAFE), set(TOPOLOGY)]
    for name in fields:
        assert sum(name in c for c in classes) == 1, f"TrainConfig.{name}: classify it in resume_check.py"
    assert set().union(*classes) == set(fields)


def test_incompatible_changes_are_listed_in_one_line():
    scfg = get("zero1")[1]()
    saved = _payload(TrainConfig(seq_len=128, lr=2e-3, max_steps=8), scfg)
    now = TrainConfig(seq_len=64, lr=1e-3, max_steps=8)
    with pytest.raises(ResumeMismatch) as e:
        check_checkpoint(saved, now, get("zero1")[1](accumulation=2), 2, 2)
    msg = str(e.value)
    assert msg == ("--resume: the checkpoint was written with --seq-len 128, --lr 0.002, --accumulation 1; "
                   "this run has --seq-len 64, --lr 0.001, --accumulation 2 (these cannot change on resume: use "
                   "the checkpoint's values, or start a new run)")
    with pytest.raises(ResumeMismatch, match=r"--strategy zero1; this run has --strategy ddp"):
        check_checkpoint(saved, TrainConfig(strategy="ddp", seq_len=128, max_steps=8), get("ddp")[1](), 2, 2)
    with pytest.raises(ResumeMismatch, match=r"--precision fp32; this run has --precision bf16"):
        check_checkpoint(saved, TrainConfig(seq_len=128, lr=2e-3, max_steps=8, precision="bf16"), scfg, 2, 2)
    note = check_checkpoint(saved, TrainConfig(seq_len=128, lr=2e-3, max_steps=8, max_grad_norm=0.5), scfg, 2, 2)
    assert len(note) == 1 and "clipped to the new norm" in note[0], note


def test_the_same_dataset_spelled_another_way_is_the_same_and_another_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prep").mkdir()
    (tmp_path / "other").mkdir()
    scfg = get("zero1")[1]()
    saved = _payload(TrainConfig(max_steps=8, dataset="prep"), scfg)
    for spelling in ("./prep", str(tmp_path / "prep"), "prep/"):
        assert check_checkpoint(saved, TrainConfig(max_steps=8, dataset=spelling), scfg, 2, 2) == []
    with pytest.raises(ResumeMismatch, match="--dataset prep; this run has --dataset other"):
        check_checkpoint(saved, TrainConfig(max_steps=8, dataset="other"), scfg, 2, 2)


def test_safe_changes_pass_and_schedule_changes_get_a_note():
    scfg = get("zero1")[1]()
    saved = _payload(TrainConfig(max_steps=8, out="a", eval_every=50, progress=True), scfg)
    assert check_checkpoint(saved, TrainConfig(max_steps=8, out="b", eval_every=2, progress=False,
                                               resume="latest", timeout_s=9.0, save_every=3), scfg, 2, 2) == []
    notes = check_checkpoint(saved, TrainConfig(max_steps=40), scfg, 2, 2)
    assert len(notes) == 1 and notes[0].startswith("--resume: --max-steps 8 -> 40:")
    assert "cosine learning-rate schedule after step 4" in notes[0] and "warm-up is 2 steps instead of 1" in notes[0]
    with pytest.raises(ResumeMismatch, match="--max-steps must be > the checkpoint's step 4"):
        check_checkpoint(saved, TrainConfig(max_steps=4), scfg, 2, 2)


def _job_config(job: list[str]) -> dict:
    """TrainConfig fields of ``small_job``'s flags."""
    flags = dict(zip(job[::2], job[1::2]))
    return {"model": flags["--model"], "micro_batch_size": int(flags["--micro-batch-size"]),
            "seq_len": int(flags["--seq-len"]), "vocab_size": int(flags["--vocab-size"]),
            "dataset": flags["--dataset"], "cache_dir": flags["--cache-dir"],
            "eval_windows": int(flags["--eval-windows"]), "eval_every": 0}


def test_another_world_size_is_one_line():
    scfg = get("zero1")[1]()
    saved = _payload(TrainConfig(max_steps=8), scfg, world=2)
    with pytest.raises(ResumeMismatch, match=r"written by 2 workers; this run has 4; .*--nproc 2\): it has no "
                                             r"world-size-independent part"):
        check_checkpoint(saved, TrainConfig(max_steps=8), scfg, 4, 4)
    cdp = _payload(TrainConfig(strategy="cdp", max_steps=8), get("cdp")[1](), world=2)
    with pytest.raises(ResumeMismatch, match=r"written by 2 workers; this run has 4; resume it with 2 workers "
                                             r"\(--nproc 2\): strategy cdp cannot be resharded: micro-batches"):
        check_checkpoint(cdp, TrainConfig(strategy="cdp", max_steps=8), get("cdp")[1](), 4, 4)
    with pytest.raises(ResumeMismatch, match=r"written on 2 nodes; this run has 1"):
        check_checkpoint(saved, TrainConfig(max_steps=8), scfg, 2, 1)


def test_flexdemo_and_fsdp_may_change_workers_per_node_and_nodes(tmp_path):
    (tmp_path / "logical").mkdir()
    (tmp_path / "logical" / ".metadata").write_bytes(b"")  # a complete logical part, as far as the check goes
    flex = get("flexdemo")[1]()
    saved = _payload(TrainConfig(strategy="flexdemo", max_steps=8), flex, world=4, nodes=2)
    notes = check_checkpoint(saved, TrainConfig(strategy="flexdemo", max_steps=8), flex, 2, 2, tmp_path)
    assert notes[0].startswith("--resume: resharding a checkpoint of 4 workers onto 2")
    notes = check_checkpoint(saved, TrainConfig(strategy="flexdemo", max_steps=8), flex, 4, 1, tmp_path)
    assert notes[0].startswith("--resume: moving a checkpoint of 2 nodes onto 1 (4 workers either way)")
    notes = check_checkpoint(saved, TrainConfig(strategy="flexdemo", max_steps=8), flex, 8, 4, tmp_path)
    assert notes[0].startswith("--resume: resharding a checkpoint of 4 workers onto 8")
    fsdp = get("fsdp")[1]()
    saved = _payload(TrainConfig(strategy="fsdp", max_steps=8), fsdp, world=4, nodes=2)
    notes = check_checkpoint(saved, TrainConfig(strategy="fsdp", max_steps=8), fsdp, 4, 1, tmp_path)
    assert notes[0].startswith("--resume: moving a checkpoint of 2 nodes onto 1 (4 workers either way)")
    assert check_checkpoint(saved, TrainConfig(strategy="fsdp", max_steps=8), fsdp, 2, 2, tmp_path)


@pytest.mark.timeout(300)
def test_resume_from_the_command_line(tmp_path, monkeypatch, capsys, finished_zero1_run):
    """A copy of the shared finished zero1 run (tests/train/conftest.py: 2 workers, 4 steps, checkpoints at 2
    and 4)."""
    shared, job = finished_zero1_run
    out = copy_of(shared, tmp_path / "run")
    step2 = out / "checkpoints" / "step-0000002"
    line = refused(monkeypatch, capsys, *job, "--max-steps", "4", "--out", str(out), "--resume", str(step2),
                   "--seq-len", "16")
    assert "the checkpoint was written with --seq-len 32; this run has --seq-len 16" in line
    for nproc in (1, 4):  # bare --resume: the newest checkpoint, written by 2 workers; zero1 reshards
        cfg = TrainConfig(**{**_job_config(job), "max_steps": 6, "out": str(out), "resume": "latest",
                                  "nproc": nproc})
        notes = check_resume(cfg, get("zero1")[1](), nproc, nproc)
        assert notes[0].startswith(f"--resume: resharding a checkpoint of 2 workers onto {nproc}: ")
    resumed = train(*job, "--max-steps", "6", "--out", str(out), "--resume", str(step2))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "--resume: --max-steps 4 -> 6:" in resumed.stdout and "schedule after step 2" in resumed.stdout
    steps = [r["step"] for r in read_jsonl(out / "metrics-rank0.jsonl") if "event" not in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_the_reshard_note_says_what_a_step_holds_under_each_batch_policy(tmp_path):
    """4 workers' checkpoint on 2: --batch-policy global keeps the global batch (each worker feeds twice the
    micro-batches), --batch-policy worker halves it; a strategy that adapts its micro-batches says so."""
    (tmp_path / "logical").mkdir()
    (tmp_path / "logical" / ".metadata").write_bytes(b"")
    diloco = get("diloco")[1](accumulation=1)
    saved = {**_payload(TrainConfig(strategy="diloco", max_steps=8), diloco, world=4, nodes=4),
             "nominal": {"world_size": 4, "accumulation": 1}}
    glob = check_checkpoint(saved, TrainConfig(strategy="diloco", max_steps=8), diloco, 2, 2, tmp_path)[0]
    assert "each worker now feeds 2 micro-batch(es) per step (--batch-policy global), so a step holds the same " \
           "tokens per step as the run's first steps" in glob, glob
    assert "2/4 of the old global batch" not in glob
    worker = check_checkpoint(saved, TrainConfig(strategy="diloco", max_steps=8, batch_policy="worker"), diloco, 2,
                              2, tmp_path)[0]
    assert "(--batch-policy worker), so a step holds 0.5 x the run's first tokens per step" in worker, worker
    three = check_checkpoint(saved, TrainConfig(strategy="diloco", max_steps=8), diloco, 3, 3, tmp_path)[0]
    assert "feeds 2 micro-batch(es) per step (--batch-policy global), so a step holds 1.5 x the run's first " \
           "tokens per step (rounded up to whole micro-batches)" in three, three
    acco = get("acco")[1]()
    saved = _payload(TrainConfig(strategy="acco", max_steps=8), acco, world=4, nodes=4)
    adaptive = check_checkpoint(saved, TrainConfig(strategy="acco", max_steps=8), acco, 2, 2, tmp_path)[0]
    assert "(its micro-batches per step adapt to the link), so a step holds 0.5 x" in adaptive, adaptive


def test_a_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path):
    """Resuming from step 2 of a run that saved 2, 4, 6 abandons 4 and 6 (the metrics are cut back to 2): they move
    aside, so a later bare --resume takes this branch's newest checkpoint, not the abandoned run's."""
    from quietsync.train.checkpoint import checkpoint_root, set_aside_later, step_folder

    for step in (2, 4, 6):
        step_folder(tmp_path, step).mkdir(parents=True)
    note = set_aside_later(tmp_path, step_folder(tmp_path, 2))
    root = checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["before-resume-from-step-2", "step-0000002"]
    assert sorted(p.name for p in (root / "before-resume-from-step-2").iterdir()) == ["step-0000004", "step-0000006"]
    assert note.startswith("--resume: the checkpoints of steps 4, 6 belong to the run this resume leaves")
    assert set_aside_later(tmp_path, step_folder(tmp_path, 2)) is None  # nothing later any more
    other = tmp_path / "elsewhere" / "checkpoints" / "step-0000001"
    other.mkdir(parents=True)
    step_folder(tmp_path, 3).mkdir()
    assert set_aside_later(tmp_path, other) is None and step_folder(tmp_path, 3).is_dir()  # another run's: untouched


def _prepare_text(folder, text: str):
    """``quietsync prepare`` of ``text`` into ``folder`` (replacing what it held)."""
    from quietsync.data.prepare import PrepareConfig, prepare

    source = folder.with_suffix(".txt")
    source.write_text(text)
    prepare(PrepareConfig(dataset=str(source), vocab_size=300, progress=False, overwrite=True), folder,
            say=lambda _: None)
    return folder


def test_a_resume_on_other_data_at_the_same_path_is_refused_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """The folder a run trained on, prepared again from other text: the checkpoint's data position would index other
    ids. The launcher refuses in one line naming what the checkpoint trained on and what the folder holds now, and
    what to do; the same text prepared again (the same ids) resumes; a checkpoint that does not record its data (an
    older quietsync's) resumes with a note."""
    from quietsync.data.shards import data_identity, open_prepared
    from quietsync.train.args import parse_train_args
    from quietsync.train.checkpoint import save_checkpoint
    from quietsync.train.preflight import job_data_identity

    from .conftest import synthetic_text

    monkeypatch.chdir(tmp_path)
    flags = ["--dataset", "prep", "--out", "run", "--resume", "--max-steps", "8", "--model", "tiny", "--nproc", "2"]
    cfg, scfg, nodes = parse_train_args(flags)
    prep = _prepare_text(tmp_path / "prep", synthetic_text(600, seed=0))
    trained = data_identity(open_prepared(prep))
    for rank in (0, 1):
        save_checkpoint("run", 4, rank, {**_payload(cfg, scfg, nodes=nodes), "data_identity": trained})

    _prepare_text(prep, synthetic_text(600, seed=0))  # the same text again: the same ids
    assert check_resume(cfg, scfg, 2, nodes, data=lambda: job_data_identity(cfg)) == []

    _prepare_text(prep, synthetic_text(600, seed=7))
    now = data_identity(open_prepared(prep))
    line = refused(monkeypatch, capsys, *flags)
    step4 = "run/checkpoints/step-0000004"
    assert line.startswith(f"quietsync train: error: --resume: the checkpoint {step4} was trained on other data than "
                           "--dataset prep holds now (then: "), line
    for identity in (trained, now):
        assert f"{identity['train_tokens']:,} training and {identity['eval_tokens']:,} held-out tokens" in line
        assert f"ids digest {identity['digest'][:12]}" in line
    assert line.endswith("resume with the data it was trained on, or train on this data as a new run (a new --out)")

    for rank in (0, 1):
        save_checkpoint("run", 4, rank, _payload(cfg, scfg, nodes=nodes))
    notes = check_resume(cfg, scfg, 2, nodes, data=lambda: job_data_identity(cfg))
    assert notes == [f"--resume: the checkpoint {step4} does not record which data it was trained on (an older "
                     "quietsync wrote it): --dataset prep is taken to hold the same"]


def test_a_checkpoint_records_the_data_it_was_trained_on(finished_zero1_run):
    """Every rank file of a run holds the identity of the ids it trained on: the job's prepared folder's."""
    from quietsync.train.args import parse_train_args
    from quietsync.train.checkpoint import load_checkpoint
    from quietsync.train.preflight import job_data_identity

    shared, job = finished_zero1_run
    cfg, _, _ = parse_train_args([*job, "--out", str(shared)])
    expected = job_data_identity(cfg)
    for rank in (0, 1):
        assert load_checkpoint(shared / "checkpoints" / "step-0000004", rank, mmap=True)["data_identity"] == expected


@pytest.mark.timeout(200)
def test_a_run_whose_adapt_changed_a_knob_resumes_from_the_same_command_line(tmp_path):
    """--adapt re-picks H during the run; the checkpoint keeps the flags as given (H = 4), so the same command with
    --resume goes on (it was refused: "written with --sync-every 64"), at the adapted H."""
    from ._run import small_job

    out = tmp_path / "run"
    # 20 Mbit/s: a sync of the tiny model takes ~0.8 s, over 10% of 4 inner steps on any machine, so H grows at step 4
    flags = [*small_job(tmp_path), "--strategy", "diloco", "--sync-every", "4", "--adapt", "--adapt-every", "1",
             "--link", "inter=20mbit", "--save-every", "4", "--out", str(out)]
    first = train(*flags, "--max-steps", "8")
    assert first.returncode == 0, first.stderr[-3000:]
    again = train(*flags, "--max-steps", "12", "--resume", "latest")
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [r for r in read_jsonl(out / "metrics-rank0.jsonl") if "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, 13))
    changes = {r["step"]: r["extra"]["adapt"]["new"] for r in rows if "adapt" in r.get("extra", {})}
    assert 4 in changes and changes[4] > 4, changes
    h, expected = 4, []  # a sync at every multiple of the H in force; a change takes effect after its step
    for r in rows:
        if r["step"] % h == 0:
            expected.append(r["step"])
        h = changes.get(r["step"], h)
    assert [r["step"] for r in rows if r.get("extra", {}).get("synced")] == expected
