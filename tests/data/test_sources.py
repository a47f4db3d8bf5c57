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
