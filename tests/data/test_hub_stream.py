"""Hub datasets are streamed (`datasets` from the train extra): tested offline on a local data folder."""

from __future__ import annotations

import importlib.util
import json

import pytest

from quietsync.data.corpus import load_hub

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets (the train extra)"),
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_a_streamed_dataset_gives_documents_from_its_text_column_up_to_max_chars(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    folder = tmp_path / "ds"
    folder.mkdir()
    _write(folder / "train.jsonl",
           [{"id": i, "body": f"line {i} " * 10} for i in range(100)] + [{"id": -1, "body": " "}])
    _write(folder / "validation.jsonl", [{"id": i, "body": f"held {i}"} for i in range(5)])
    corpus = load_hub(str(folder), 0.02, max_chars=500)
    assert corpus.documents[0] == "line 0 " * 10
    assert 500 <= sum(map(len, corpus.documents)) < 500 + 80  # stops once max_chars is reached
    assert corpus.eval_documents == tuple(f"held {i}" for i in range(5))
