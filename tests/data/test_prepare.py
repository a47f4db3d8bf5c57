"""`quietsync prepare`: every input format gives the token ids of its documents, each followed by end-of-text, in
shards an index describes; an interrupted prepare resumes to the same bytes; bad input is refused in one line with
nothing left behind.

The expected ids are computed here from the documents read independently (``json``, ``pyarrow``, ``datasets``
directly) and encoded one by one with the tokenizer the folder names."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quietsync.data import prepare as prep
from quietsync.data.corpus import load_corpus
from quietsync.data.prepare import PrepareConfig, Refused, prepare
from quietsync.data.shards import open_prepared, tokenizer_fingerprint
from quietsync.data.tokenizer import EOS_TOKEN, train_tokenizer

from .conftest import synthetic_text

pytestmark = pytest.mark.timeout(120)


def _docs(n: int, seed: int = 0) -> list[str]:
    return [synthetic_text(3 + i % 5, seed=seed + i) for i in range(n)]


def _expected(tok, docs: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS_TOKEN)
    return np.array([t for d in docs for t in [*tok.encode(d).ids, eos]], dtype=np.int64)


def _every_kth(docs: list[str], k: int) -> tuple[list[str], list[str]]:
    return [d for i, d in enumerate(docs) if i % k != k - 1], [d for i, d in enumerate(docs) if i % k == k - 1]


def _check(folder, train_docs: list[str], held_docs: list[str]) -> None:
    data = open_prepared(folder)
    tok = data.tokenizer()
    assert np.array_equal(data.train.to_tensor().numpy(), _expected(tok, train_docs))
    assert np.array_equal(data.eval.to_tensor().numpy(), _expected(tok, held_docs))
    assert data.index["splits"]["train"]["documents"] == len(train_docs)
    assert data.index["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)


def _cfg(dataset, out, **kw) -> PrepareConfig:
    return PrepareConfig(dataset=str(dataset), out=str(out), vocab_size=300, progress=False, **kw)


def test_a_text_folder_gives_the_in_memory_corpus_ids_and_tokenizer(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(synthetic_text(900, seed=1))
    (folder / "sub" / "b.txt").write_text(synthetic_text(700, seed=2))
    (folder / "notes.md").write_text("not read\n")
    out = tmp_path / "out"
    result = prepare(_cfg(folder, out, shard_tokens=3_000), say=lambda _: None)
    corpus = load_corpus(str(folder))  # the path every worker took before: all documents in memory
    _check(out, list(corpus.documents), list(corpus.eval_documents))
    assert len(result.index["splits"]["train"]["shards"]) > 2  # several shards, read as one stream
    # the default tokenizer is the one `quietsync train` trained on the same corpus
    assert open_prepared(out).tokenizer().to_str() == train_tokenizer(corpus, 300).to_str()
    # the same command again finds it done
    assert prepare(_cfg(folder, out, shard_tokens=3_000), say=lambda _: None).already


def test_jsonl_with_a_text_column_and_a_validation_file(tmp_path):
    folder = tmp_path / "jsonl"
    folder.mkdir()
    train, held = _docs(40), _docs(6, seed=100)
    rows = [{"id": i, "body": d} for i, d in enumerate(train)] + [{"id": -1, "body": "  "}, {"id": -2, "body": None}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "validation.jsonl").write_text("".join(json.dumps({"id": 0, "body": d}) + "\n" for d in held))
    prepare(_cfg(folder, tmp_path / "out", text_column="body"), say=lambda _: None)
    _check(tmp_path / "out", train, held)  # blank and null rows are no documents


def test_parquet_files_split_every_kth_row(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    docs = _docs(120)
    pq.write_table(pa.table({"text": docs[:70], "n": list(range(70))}), folder / "part-0.parquet", row_group_size=16)
    pq.write_table(pa.table({"text": docs[70:], "n": list(range(50))}), folder / "part-1.parquet")
    prepare(_cfg(folder, tmp_path / "out", eval_fraction=0.1), say=lambda _: None)
    _check(tmp_path / "out", *_every_kth(docs, 10))


def test_a_save_to_disk_folder_and_an_arrow_file(tmp_path):
    import datasets

    docs, held = _docs(60), _docs(5, seed=7)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"story": docs, "k": list(range(60))}),
                          "validation": datasets.Dataset.from_dict({"story": held, "k": list(range(5))})}
                         ).save_to_disk(str(saved))
    prepare(_cfg(saved, tmp_path / "out"), say=lambda _: None)  # the only string column
    _check(tmp_path / "out", docs, held)
    arrow = next((saved / "train").glob("*.arrow"))
    prepare(_cfg(arrow, tmp_path / "out2", eval_fraction=0.25), say=lambda _: None)
    _check(tmp_path / "out2", *_every_kth(docs, 4))


@pytest.fixture
def tokenizer_folder(tmp_path):
    """A tokenizer folder as `--tokenizer` takes it (what OUT/model holds)."""
    from transformers import PreTrainedTokenizerFast

    from quietsync.data.corpus import Corpus

    tok = train_tokenizer(Corpus("t", tuple(_docs(50))), 400)
    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN).save_pretrained(str(folder))
    return folder, tok


def test_pretokenized_shards_are_indexed_where_they_are(tmp_path, tokenizer_folder):
    folder, tok = tokenizer_folder
    data = tmp_path / "nanogpt"
    data.mkdir()
    train, held = _expected(tok, _docs(30)), _expected(tok, _docs(4, seed=9))
    train.astype(np.uint16).tofile(data / "train.bin")
    held.astype(np.uint16).tofile(data / "val.bin")
    out = tmp_path / "out"
    result = prepare(_cfg(data, out, tokenizer=str(folder)), say=lambda _: None)
    mapped = open_prepared(out)
    assert np.array_equal(mapped.train.to_tensor().numpy(), train)
    assert np.array_equal(mapped.eval.to_tensor().numpy(), held)
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "tokenizer.json"]  # nothing copied
    assert result.index["splits"]["train"]["shards"][0]["path"] == str((data / "train.bin").resolve())
    # uint32 .npy without a held-out file: the last eval_fraction of the tokens is held out
    npy = tmp_path / "npy"
    npy.mkdir()
    np.save(npy / "shard-0.npy", train[:500].astype(np.uint32))
    np.save(npy / "shard-1.npy", train[500:].astype(np.uint32))
    prepare(_cfg(npy, tmp_path / "out2", tokenizer=str(folder), eval_fraction=0.1), say=lambda _: None)
    mapped = open_prepared(tmp_path / "out2")
    cut = train.size - int(train.size * 0.1)
    assert np.array_equal(mapped.train.to_tensor().numpy(), train[:cut])
    assert np.array_equal(mapped.eval.to_tensor().numpy(), train[cut:])
    assert mapped.index["dtype"] == "uint32"


def test_pretokenized_refusals(tmp_path, tokenizer_folder):
    folder, tok = tokenizer_folder
    data = tmp_path / "bins"
    data.mkdir()
    ids = _expected(tok, _docs(20))
    ids.astype(np.uint16).tofile(data / "train.bin")
    with pytest.raises(Refused, match="holds token ids: name the tokenizer they were made with"):
        prepare(_cfg(data, tmp_path / "o1"), say=lambda _: None)
    ids.astype(np.uint32).tofile(data / "train.bin")  # uint32 ids read as nanoGPT's uint16
    with pytest.raises(Refused, match="every other uint16 id is 0.*--token-dtype uint32"):
        prepare(_cfg(data, tmp_path / "o2", tokenizer=str(folder)), say=lambda _: None)
    (ids + 400).astype(np.uint32).tofile(data / "train.bin")  # made with a larger vocabulary
    with pytest.raises(Refused, match=r"id \d+ is outside the vocabulary of --tokenizer .* \(\d+ entries\): the shards "
                                      "were made with another tokenizer"):
        prepare(_cfg(data, tmp_path / "o3", tokenizer=str(folder), token_dtype="uint32"), say=lambda _: None)
    (data / "train.bin").write_bytes(b"")  # a shard writer that died before its first id
    with pytest.raises(Refused, match=r"train.bin holds no token ids \(an empty file\)"):
        prepare(_cfg(data, tmp_path / "o4", tokenizer=str(folder)), say=lambda _: None)
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3, 4))


def test_a_vocabulary_uint16_cannot_hold_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(70_000)} | {EOS_TOKEN: 70_000, "[UNK]": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "big"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN).save_pretrained(str(folder))
    (tmp_path / "d").mkdir()
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "d" / "train.bin")
    with pytest.raises(Refused, match="uint16 token ids cannot hold a vocabulary of 70002"):
        prepare(_cfg(tmp_path / "d", tmp_path / "o", tokenizer=str(folder)), say=lambda _: None)
    assert not (tmp_path / "o").exists()
    # text prepared with it gets uint32 shards
    (tmp_path / "t.txt").write_text("w1 w2 w69999\n" * 1000 + "\n".join(f"w{i}" for i in range(2000)))
    prepare(_cfg(tmp_path / "t.txt", tmp_path / "o4", tokenizer=str(folder), eval_fraction=0.4), say=lambda _: None)
    mapped = open_prepared(tmp_path / "o4")
    assert mapped.index["dtype"] == "uint32" and int(mapped.train.to_tensor().max()) == 70_000


def test_bad_columns_are_refused_in_one_line_with_nothing_written(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["  ", "", None] * 10, "n": list(range(30)), "title": ["x"] * 30}),
                   folder / "a.parquet")
    cases = {
        "n": "--text-column n of --dataset .* holds int64, not text \\(text columns: text, title\\)",
        "nope": "--text-column nope is not a column of --dataset .* \\(columns: text, n, title\\)",
        None: "--dataset must hold at least 2 documents .* holds none \\(only blank text\\)",  # `text`: only blanks
    }
    for column, message in cases.items():
        out = tmp_path / f"out-{column}"
        with pytest.raises(Refused, match=message) as e:
            prepare(_cfg(folder, out, text_column=column), say=lambda _: None)
        assert "\n" not in str(e.value) and not out.exists()
    pq.write_table(pa.table({"a": ["x"], "b": ["y"]}), folder / "a.parquet")
    with pytest.raises(Refused, match="several text columns \\(a, b\\): choose one with --text-column"):
        prepare(_cfg(folder, tmp_path / "o"), say=lambda _: None)


def test_one_document_is_refused_as_taken_for_held_out_evaluation_not_as_empty(tmp_path, tokenizer_folder):
    """The held-out split takes the only document, leaving 0 to train on: the line counts the input's documents and
    says where the one went (with the default tokenizer and a pretrained one: two places that refuse)."""
    (tmp_path / "one.txt").write_text("just one short line of text\n")
    expected = ("--dataset must hold at least 2 documents (non-blank chunks or rows) to split off a held-out part; "
                f"{tmp_path / 'one.txt'} holds 1 document (text is cut into documents of about 4,000 characters), "
                "taken for held-out evaluation, so none is left to train on")
    for i, tokenizer in enumerate((None, str(tokenizer_folder[0]))):
        with pytest.raises(Refused) as e:
            prepare(_cfg(tmp_path / "one.txt", tmp_path / f"o{i}", tokenizer=tokenizer), say=lambda _: None)
        assert str(e.value) == expected and not (tmp_path / f"o{i}").exists()
    (tmp_path / "rows.jsonl").write_text('{"text": "a row"}\n{"text": "  "}\n')
    with pytest.raises(Refused, match=r"rows.jsonl holds 1 document, taken for held-out evaluation, so none is left"):
        prepare(_cfg(tmp_path / "rows.jsonl", tmp_path / "o2"), say=lambda _: None)


def test_inputs_that_are_not_one_kind_are_refused(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("x\n")
    pq.write_table(pa.table({"text": ["y"]}), folder / "b.parquet")
    with pytest.raises(Refused, match=r"mixes kinds of files \(1 parquet, 1 text\): point it at one kind"):
        prepare(_cfg(folder, tmp_path / "o"), say=lambda _: None)
    with pytest.raises(Refused, match="--text-column is for tables"):
        prepare(_cfg(folder / "a.txt", tmp_path / "o", text_column="text"), say=lambda _: None)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("keep me")
    with pytest.raises(Refused, match="is not empty and holds no prepare"):
        prepare(_cfg(folder / "a.txt", tmp_path / "busy"), say=lambda _: None)
    assert (tmp_path / "busy" / "mine.txt").read_text() == "keep me"



def _interrupted(monkeypatch, cfg, after: int) -> dict[str, int]:
    """Run ``prepare(cfg)`` and stop it with Ctrl-C (a ``KeyboardInterrupt``) after ``after`` encoded batches.
    Returns the count of ``encode_ids`` calls, set far below zero: the counting stays, the dying does not."""
    real = prep.encode_ids
    calls = {"n": 0}

    def dies(*args):
        calls["n"] += 1
        if calls["n"] > after:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(prep, "encode_ids", dies)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, say=lambda _: None)
    calls["n"] = -10**9
    return calls

def test_an_interrupted_prepare_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    text = tmp_path / "book.txt"
    text.write_text(synthetic_text(3000, seed=3))
    monkeypatch.setattr(prep, "BATCH_CHARS", 4_000)
    monkeypatch.setattr(prep, "CHECKPOINT_S", 0.0)
    whole = tmp_path / "whole"
    prepare(_cfg(text, whole, shard_tokens=2_000), say=lambda _: None)

    out = tmp_path / "out"
    calls = _interrupted(monkeypatch, _cfg(text, out, shard_tokens=2_000, workers=1), after=10)
    assert (out / prep.STATE).exists() and not (out / "index.json").exists()
    # a different prepare into the half-written folder is refused; the same one resumes
    with pytest.raises(Refused, match="holds an unfinished prepare of other input or settings: --overwrite"):
        prepare(_cfg(text, out, shard_tokens=1_000), say=lambda _: None)
    (tmp_path / "journal.json").write_text((out / prep.STATE).read_text())  # what the resume starts from
    calls["n"] = -10**9
    said: list[str] = []
    prepare(_cfg(text, out, shard_tokens=2_000, workers=1), say=said.append)
    resumed = next(s for s in said if s.startswith("resuming"))
    journal = json.loads((tmp_path / "journal.json").read_text())
    itemsize = np.dtype(json.loads((whole / "index.json").read_text())["dtype"]).itemsize
    kept = sum(s["tokens"] for split in journal["shards"].values() for s in split) * itemsize
    assert journal["documents"] > 0 and kept > 0
    assert f"{journal['documents']:,} documents ({kept:,} bytes of shards) kept from the journal's last entry" in \
        resumed, resumed
    assert calls["n"] < -10**9 + 60  # the batches written before the interruption were not encoded again
    for name in sorted(p.name for p in whole.iterdir()):
        if name != "index.json":
            assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert json.loads((out / "index.json").read_text())["splits"] == json.loads(
        (whole / "index.json").read_text())["splits"]
    assert not (out / prep.STATE).exists()


def test_the_default_tokenizer_samples_a_large_corpus_across_it(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text(synthetic_text(4000, seed=4))
    out = tmp_path / "out"
    said: list[str] = []
    result = prepare(_cfg(text, out, tokenizer_sample_chars=20_000), say=said.append)
    about = result.index["tokenizer"]["about"]
    assert "trained on 1 in every " in about and " training documents (" in about
    assert any("on 1 in every " in s for s in said)


def test_inputs_a_reader_cannot_use_and_an_out_under_a_file_are_one_line(tmp_path, capsys):
    from quietsync.commands.prepare import prepare_main

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": bad\n')
    (tmp_path / "c.txt").write_text("hello world\n")
    (tmp_path / "afile").write_text("")
    cases = [
        (["--dataset", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o1")], "holds no rows (its files are "
                                                                                      "empty)"),
        (["--dataset", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o2")], "bad.jsonl: JSON parse error"),
    ]
    for argv, says in cases:
        assert prepare_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("quietsync prepare: error: --dataset ") and says in err, err
    with pytest.raises(SystemExit) as e:
        prepare_main(["--dataset", str(tmp_path / "c.txt"), "--out", str(tmp_path / "afile" / "sub")])
    assert e.value.code == 2 and "afile is a file, not a folder" in capsys.readouterr().err
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2))


def test_an_unfinished_prepare_given_as_dataset_says_how_to_finish_it(tmp_path, monkeypatch, capsys):
    """An interrupted prepare's folder (its journal, tokenizer.json and shards, no index) read as "mixes kinds of
    files (2 json, 2 tokens)". It is named as an unfinished prepare, with the command that finishes it: that command,
    run as printed (from another folder: with the cd to where the input's name was spelled), resumes it."""
    import shlex

    from quietsync.commands.prepare import prepare_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "book.txt").write_text(synthetic_text(3000, seed=3))
    monkeypatch.setattr(prep, "BATCH_CHARS", 4_000)
    monkeypatch.setattr(prep, "CHECKPOINT_S", 0.0)
    _interrupted(monkeypatch, _cfg("book.txt", "half", workers=1, eval_fraction=0.1), after=3)
    assert (tmp_path / "half" / prep.STATE).exists() and not (tmp_path / "half" / "index.json").exists()

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(Refused) as e:
        prepare(_cfg("../half", tmp_path / "o"), say=lambda _: None)
    line = str(e.value)
    assert line.startswith("--dataset ../half is an unfinished quietsync prepare (it holds prepare-state.json and no "
                           "index.json yet: it was interrupted): finish it with the same command, which resumes where "
                           "it stopped ("), line
    assert "mixes kinds" not in line and line.endswith("), then train on it")
    command = line[line.index("(cd ") + 1: -len("), then train on it")]
    assert command == (f"cd {tmp_path} && quietsync prepare --dataset book.txt --out {tmp_path / 'half'} "
                       "--vocab-size 300 --eval-fraction 0.1")
    where, argv = command.split(" && ")
    monkeypatch.chdir(where.removeprefix("cd "))
    capsys.readouterr()
    assert prepare_main([*shlex.split(argv)[2:], "--no-progress"]) == 0
    assert "quietsync prepare: resuming " in capsys.readouterr().out
    assert open_prepared(tmp_path / "half").train.numel() > 0
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / prep.STATE).write_text('{"request": ')  # a journal cut short: no command to give
    with pytest.raises(Refused, match=r"^--dataset cut is an unfinished quietsync prepare .*: run the prepare that "
                                      r"wrote it again \(it resumes where it stopped\), then train on it$"):
        prepare(_cfg("cut", tmp_path / "o"), say=lambda _: None)


def _few_words(path) -> None:
    """A JSONL of few distinct words: its BPE runs out of merges well before 512 entries."""
    path.write_text("".join(json.dumps({"text": "the cat sat on the mat and the dog ran far away " * 3}) + "\n"
                            for _ in range(40)))


def test_a_vocabulary_the_text_cannot_fill_is_said_and_recorded(tmp_path, capsys):
    """The BPE stops when no pair is seen twice more: prepare said nothing and index.json held the smaller size,
    which a train with the --vocab-size asked for then refused, advising to prepare again (which gives the same)."""
    from quietsync.commands.prepare import prepare_main
    from quietsync.train.config import TrainConfig
    from quietsync.train.job_data import prepared_flag_problem

    _few_words(tmp_path / "docs.jsonl")
    out = tmp_path / "prep"
    assert prepare_main(["--dataset", str(tmp_path / "docs.jsonl"), "--out", str(out), "--vocab-size", "512",
                         "--no-progress"]) == 0
    got = json.loads((out / "index.json").read_text())["vocab_size"]
    assert got < 512
    said = [line for line in capsys.readouterr().out.splitlines() if "stopped at" in line]
    assert said == [f"quietsync prepare: the tokenizer stopped at {got} of the 512 entries asked for: the text has "
                    f"no more merges to learn (pairs seen at least twice); --vocab-size above {got} gives the same"]
    for size in (512, got + 1):
        problem = prepared_flag_problem(TrainConfig(dataset=str(out), vocab_size=size), {"vocab_size"})
        assert problem == (f"--vocab-size {size} differs from the {got} --dataset {out} was prepared with (512 were "
                           f"asked for, and its text gives at most {got}): leave --vocab-size out"), problem
    # a smaller one can be prepared: the plain advice
    problem = prepared_flag_problem(TrainConfig(dataset=str(out), vocab_size=got - 1), {"vocab_size"})
    assert problem is not None and "prepare it again, or leave --vocab-size out" in problem
