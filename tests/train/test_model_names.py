"""A ``--model`` that is no preset and no folder here is refused naming ``--model`` (not the tokenizer it lends
by default), at once: a path as no such folder, a hub name when the hub cannot be reached after one probe."""

from __future__ import annotations

import socket
import time

import pytest

from quietsync.data import sources
from quietsync.train.args import parse_train_args


@pytest.fixture
def online(monkeypatch):
    """Online mode, the hub probe's answer forgotten before and after."""
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    probe = sources.hub_unreachable  # a test may replace it before this teardown
    probe.cache_clear()
    yield constants
    probe.cache_clear()


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_train_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("name", ["./nonexistent_folder", "~/nonexistent_folder", "a/b/c", "runs/model"])
def test_a_path_that_is_no_folder_is_one_line_naming_model(name, online, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # runs/model: its parent is here, so a path, not a hub owner/name
    monkeypatch.setattr(sources, "hub_unreachable", lambda: pytest.fail("a path needs no hub"))
    err = _error(["--model", name], capsys)
    assert err == f"quietsync train: error: --model {name}: no such folder\n"


def test_a_bare_name_fails_in_seconds_naming_model_and_the_presets_when_the_hub_is_unreachable(
        online, capsys, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the socket is
    monkeypatch.setattr(online, "ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.perf_counter()
    err = _error(["--model", "huge"], capsys)
    assert time.perf_counter() - t0 < 5
    assert err.startswith("quietsync train: error: --model must be one of tiny, default, 10m, a Hugging Face model "
                          "folder or a hub name; 'huge' is no folder here, and the Hugging Face hub"), err
    assert "cannot be reached" in err and "--tokenizer" not in err


def test_a_hub_name_is_checked_as_the_model_before_its_tokenizer_is_loaded(online, tmp_path, monkeypatch):
    """With the hub reachable, the name is looked up as a model first: its tokenizer, loaded by the prepare,
    blamed ``--tokenizer`` for a mistyped model."""
    import transformers

    from quietsync.cli.flags import FlagError
    from quietsync.data import tokenizer
    from quietsync.train.config import TrainConfig
    from quietsync.train.preflight import check_data

    monkeypatch.setattr(sources, "hub_unreachable", lambda: None)

    def missing(name, *args, **kwargs):
        raise OSError(f"{name} is not a local folder and is not a valid model identifier listed on "
                      "'https://huggingface.co/models'")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", missing)
    monkeypatch.setattr(tokenizer, "load_pretrained_tokenizer", lambda *a, **k: pytest.fail("tokenizer first"))
    cfg = TrainConfig(model="huge", cache_dir=str(tmp_path))
    with pytest.raises(FlagError) as e:
        check_data(cfg, 1)
    assert str(e.value).startswith("--model: cannot load 'huge' (huge is not a local folder"), str(e.value)
    assert str(e.value).endswith("; presets: tiny, default, 10m")


def test_a_vocab_size_other_than_the_model_folders_is_refused_and_the_record_holds_the_models(
        tmp_path, capsys, monkeypatch):
    """``--model FOLDER --vocab-size 2000`` trained at the folder's 4096 and recorded 2000 in summary.json."""
    import json

    from quietsync.train.config import TrainConfig
    from quietsync.train.loop import job_record

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    (folder / "tokenizer.json").write_text("{}")
    err = _error(["--model", str(folder), "--vocab-size", "2000"], capsys)
    assert err == (f"quietsync train: error: --vocab-size 2000 differs from the 4096 of --model {folder} (its "
                   "config.json): leave --vocab-size out\n")
    cfg = parse_train_args(["--model", str(folder), "--vocab-size", "4096"])[0]  # the same: fine
    assert job_record(cfg, 4096)["vocab_size"] == 4096
    assert job_record(TrainConfig(), 284)["vocab_size"] == 284  # a prepared folder's smaller BPE, not the default
