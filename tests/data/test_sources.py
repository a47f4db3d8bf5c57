"""Inputs are read as streams: a text file block by block gives the chunks the whole file gives; the kind of a
`--dataset` is named from what is on disk; held-out files are recognised by name."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from quietsync.data import sources
from quietsync.data.corpus import chunk_text
from quietsync.data.prepare import split_stream
from quietsync.data.sources import is_held_out_file, resolve_source, stream_chunks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 20])
def test_a_file_read_block_by_block_gives_the_chunks_of_the_whole_file(monkeypatch, block):
    text = "".join(f"line {i} " + "x" * (i % 13) + ("\n" if i % 5 else "\u2028") for i in range(400))
    text += "   \n\n" + "tail without newline"
    monkeypatch.setattr(sources, "READ_BLOCK", block)
    for chunk_chars in (1, 50, 300, 10**6):
        got = list(stream_chunks(io.StringIO(text), chunk_chars))
        assert got == chunk_text(text, chunk_chars)


def test_split_stream_is_split_documents():
    from quietsync.data.corpus import split_documents

    for n, fraction in ((10, 0.25), (2, 0.1), (7, 0.5 - 1e-9), (101, 0.02)):
        docs = [f"d{i}" for i in range(n)]
        train, held = split_documents(docs, fraction)
        k = max(2, round(1 / fraction))
        labelled = list(split_stream(((d, 0) for d in docs), k))
        assert tuple(d for d, h, _ in labelled if not h) == train
        assert tuple(d for d, h, _ in labelled if h) == held


def test_kinds_are_named_from_the_disk(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("x\n")
    (tmp_path / "t" / "README.md").write_text("x\n")
    assert resolve_source(str(tmp_path / "t")).kind == "text"
    named = resolve_source(str(tmp_path / "t" / "README.md"))  # a file given by name is text whatever its suffix
    assert (named.kind, named.files) == ("text", (tmp_path / "t" / "README.md",))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "train-00.jsonl").write_text("{}\n")
    (tmp_path / "j" / "val-00.jsonl").write_text("{}\n")
    s = resolve_source(str(tmp_path / "j"))
    assert (s.kind, [p.name for p in s.files], [p.name for p in s.held_out_files]) == (
        "json", ["train-00.jsonl"], ["val-00.jsonl"])
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_dict.json").write_text("{}")
    assert resolve_source(str(tmp_path / "saved")).kind == "saved"
    assert resolve_source("kjv").kind == "kjv" and resolve_source("owner/name").kind == "hub"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "val.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="every file is named like a held-out split .*training files are needed"):
        resolve_source(str(tmp_path / "b"))
    with pytest.raises(ValueError, match="no such file or folder"):
        resolve_source("./missing")
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="holds no .txt, .jsonl"):
        resolve_source(str(tmp_path / "none"))
    with pytest.raises(ValueError, match="--token-dtype must be uint16 or uint32, got 'int8'"):
        resolve_source(str(_bin(tmp_path)), token_dtype="int8")


def test_a_tokenizer_saved_beside_the_data_is_not_data(tmp_path):
    """nanoGPT's layout with the tokenizer saved next to it (train.bin, val.bin, meta.pkl, save_pretrained's JSON and
    merges): token files, not "mixes kinds of files (1 json, 2 tokens)"; a JSONL folder keeps only its tables; the
    hub's dataset_infos.json beside Parquet files is no table either. A tokenizer file given by name is still read."""
    ng = tmp_path / "nanogpt"
    ng.mkdir()
    for name in ("train.bin", "val.bin"):
        (ng / name).write_bytes(b"\0\0")
    for name in ("meta.pkl", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                 "merges.txt"):
        (ng / name).write_text("{}")
    s = resolve_source(str(ng), token_dtype="uint16")
    assert (s.kind, s.files, s.held_out_files) == ("tokens", (ng / "train.bin",), (ng / "val.bin",))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "rows.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "j" / "tokenizer.json").write_text("{}")
    assert resolve_source(str(tmp_path / "j")).files == (tmp_path / "j" / "rows.jsonl",)
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train-0.parquet").write_bytes(b"")
    (tmp_path / "hub" / "dataset_infos.json").write_text("{}")
    assert resolve_source(str(tmp_path / "hub")).kind == "parquet"
    assert resolve_source(str(ng / "tokenizer.json")).kind == "json"


def _bin(tmp_path: Path) -> Path:
    (tmp_path / "train.bin").write_bytes(b"\0\0")
    return tmp_path / "train.bin"


@pytest.mark.parametrize("name,held", [
    ("val.bin", True), ("validation-00000-of-00002.parquet", True), ("test.jsonl", True), ("eval_1.arrow", True),
    ("dev.jsonl", True), ("train.bin", False), ("interval.parquet", False), ("contest.jsonl", False),
    ("train-val-free.bin", True), ("devices.txt", False)])
def test_held_out_files_are_recognised_by_name(name, held):
    assert is_held_out_file(Path(name)) is held


@pytest.fixture
def hub_at(monkeypatch):
    """Point the hub's endpoint at a URL (online mode), the probe's answer forgotten before and after."""
    pytest.importorskip("datasets")
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    sources.hub_unreachable.cache_clear()
    yield lambda url: monkeypatch.setattr(constants, "ENDPOINT", url)
    sources.hub_unreachable.cache_clear()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_name_fails_at_once_when_the_hub_is_unreachable_and_says_no_local_path_has_it(
        tmp_path, monkeypatch, capsys, hub_at):
    """A plain name that is no local path is looked up on the hub; with the hub unreachable (here: a closed port)
    the hub's client retried 5 times over 25 s before failing. One request without retries finds out instead, and
    the line says no file or folder of that name is here either (a mistyped path lands here too)."""
    import time

    import datasets  # noqa: F401  (imported before the clock starts)

    from quietsync.commands.prepare import prepare_main

    monkeypatch.chdir(tmp_path)
    hub_at(f"http://127.0.0.1:{_closed_port()}")
    t0 = time.perf_counter()
    assert prepare_main(["--dataset", "mydata", "--out", "o", "--no-progress"]) == 2
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"quietsync prepare: error: --dataset mydata: no file or folder of that name here ({tmp_path}), and the "
        "Hugging Face hub, where such a name is looked up as a dataset, http://127.0.0.1:"), err
    assert " cannot be reached (ConnectError: " in err and "Retrying" not in err
    assert not (tmp_path / "o").exists()


def test_the_hub_counts_as_reachable_when_it_answers_and_a_name_it_lacks_says_no_local_path_has_it(
        tmp_path, monkeypatch, hub_at):
    """Any answer of the endpoint (an error status too) means the hub is there: the look-up goes on as before, and
    a name the hub does not have is one line saying no local path has it either."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import datasets

    from quietsync.data.prepare import PrepareConfig, plan_request

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers every HEAD with 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hub_at(f"http://127.0.0.1:{server.server_address[1]}")
        assert sources.hub_unreachable() is None
    finally:
        server.shutdown()
        server.server_close()

    def not_on_the_hub(path, *args, **kwargs):
        raise datasets.exceptions.DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub or cannot be "
                                                       "accessed.")

    monkeypatch.setattr(datasets, "load_dataset", not_on_the_hub)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        plan_request(PrepareConfig(dataset="owner/mydata", progress=False))
    assert str(e.value) == (f"--dataset owner/mydata: no file or folder of that name here ({tmp_path}), nor a hub "
                            "dataset that can be read (Dataset 'owner/mydata' doesn't exist on the Hub or cannot be "
                            "accessed.)")
