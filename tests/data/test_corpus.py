"""The embedded corpus loads offline and splits deterministically; local files and folders load too."""

from __future__ import annotations

import sys

import pytest

from quietsync.data.corpus import (
    chunk_text,
    kjv_chapters,
    kjv_path,
    load_corpus,
    looks_like_path,
    split_documents,
)

pytestmark = pytest.mark.timeout(60)


def test_kjv_found_without_importing_bible():
    sys.modules.pop("bible", None)
    path = kjv_path()
    assert path.name == "kjv.jsonl" and path.stat().st_size > 6_000_000
    assert "bible" not in sys.modules


def test_kjv_chapters_and_split_are_deterministic():
    chapters = kjv_chapters()
    assert len(chapters) == 1189  # chapters of the King James Bible
    assert chapters[0].startswith("Genesis 1\n1 In the beginning God created the heaven and the earth.")
    assert chapters[-1].startswith("Revelation 22\n")
    a, b = load_corpus("kjv"), load_corpus("kjv")
    assert a.documents == b.documents and a.eval_documents == b.eval_documents
    assert a.fingerprint() == b.fingerprint()
    assert len(a.documents) + len(a.eval_documents) == 1189
    assert 0.015 < len(a.eval_documents) / 1189 < 0.025  # every 50th chapter at eval_fraction 0.02
    assert not set(a.documents) & set(a.eval_documents)
    assert 4_000_000 < a.num_chars < 4_300_000


def test_eval_fraction_changes_the_split():
    a = load_corpus("kjv", eval_fraction=0.1)
    assert 0.09 < len(a.eval_documents) / 1189 < 0.11


def test_split_documents_every_kth():
    docs = [str(i) for i in range(10)]
    train, held = split_documents(docs, 0.25)  # k = 4
    assert held == ("3", "7")
    assert train == ("0", "1", "2", "4", "5", "6", "8", "9")
    train, held = split_documents(["a", "b"], 0.1)  # fewer than k documents: the last one is held out
    assert (train, held) == (("a",), ("b",))
    with pytest.raises(ValueError, match="at least 2"):
        split_documents(["only"], 0.1)
    with pytest.raises(ValueError, match="eval_fraction"):
        split_documents(docs, 0.7)


def test_chunk_text_cuts_at_lines_and_keeps_everything():
    text = "".join(f"line {i}\n" for i in range(100))
    chunks = chunk_text(text, 50)
    assert "".join(chunks) == text
    assert all(c.endswith("\n") for c in chunks)
    assert all(len(c) < 50 + 10 for c in chunks)


def test_local_file_and_folder(tmp_path, text_file):
    c = load_corpus(str(text_file), chunk_chars=1000)
    assert c.name == str(text_file)
    assert len(c.documents) > 10 and c.eval_documents
    assert "".join(c.documents) != ""
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha line\n" * 300)
    (folder / "sub" / "b.txt").write_text("beta line\n" * 300)
    (folder / "ignored.md").write_text("not read\n" * 300)
    f = load_corpus(str(folder), chunk_chars=500)
    text = "".join(f.documents + f.eval_documents)
    assert "alpha" in text and "beta" in text and "not read" not in text


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt files"):
        load_corpus(str(tmp_path / "empty"))


def test_looks_like_path():
    assert looks_like_path("./x") and looks_like_path("/data/x") and looks_like_path("book.txt")
    assert not looks_like_path("roneneldan/TinyStories") and not looks_like_path("wikitext")


class _FakeFeature:
    def __init__(self, dtype):
        self.dtype = dtype


class _FakeSplit(list):
    def __init__(self, rows, column="body"):
        super().__init__({column: r, "id": i} for i, r in enumerate(rows))
        self.column_names = ["id", column]
        self.features = {"id": _FakeFeature("int64"), column: _FakeFeature("string")}


def _fake_datasets(monkeypatch, splits, calls):
    import types

    def load_dataset(path, config=None, streaming=False):
        assert streaming  # hub datasets are streamed, never downloaded whole
        calls.append((path, config))
        return splits

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_hub_dataset_through_datasets(monkeypatch):
    """The hub path, with a stand-in for the `datasets` package (the real one needs a network)."""
    calls = []
    rows = [f"story number {i} " * 20 for i in range(40)] + ["", "   "]
    _fake_datasets(monkeypatch, {"train": _FakeSplit(rows)}, calls)
    c = load_corpus("someone/stories", eval_fraction=0.1)
    assert calls == [("someone/stories", None)]
    assert len(c.documents) == 36 and len(c.eval_documents) == 4  # empty rows dropped, every 10th held out
    _fake_datasets(monkeypatch, {"train": _FakeSplit(rows[:10]), "validation": _FakeSplit(["held out"])}, calls)
    c = load_corpus("wikitext:wikitext-2-raw-v1", max_chars=1000)
    assert calls[-1] == ("wikitext", "wikitext-2-raw-v1")
    assert c.eval_documents == ("held out",) and 1000 <= sum(map(len, c.documents)) < 1000 + len(rows[0])


def test_hub_dataset_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(ValueError, match="pip install datasets"):
        load_corpus("someone/stories")
