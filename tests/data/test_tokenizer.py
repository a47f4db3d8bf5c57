"""The local byte-level BPE round-trips text and is trained once, then read from the cache."""

from __future__ import annotations

import threading
import time

import pytest

from quietsync.data import tokenizer as tokmod
from quietsync.data.cache import build_once
from quietsync.data.tokenizer import EOS_TOKEN, eos_id, load_or_train_tokenizer, tokenizer_path

pytestmark = pytest.mark.timeout(60)


def test_round_trip_and_vocab(small_corpus, tmp_path):
    tok = load_or_train_tokenizer(small_corpus, 300, tmp_path)
    assert tok.get_vocab_size() == 300
    assert tok.token_to_id(EOS_TOKEN) == eos_id(tok)
    for text in ["The quick brown fox.", "  tabs\tand\nnewlines  ", "Unicode: héllo wörld — ∑ 🙂", ""]:
        assert tok.decode(tok.encode(text).ids) == text
    # merges learned from the corpus make its own words short
    assert len(tok.encode(" the miller grinds wheat").ids) < len(" the miller grinds wheat") / 2


def test_cached_once(small_corpus, tmp_path, monkeypatch):
    load_or_train_tokenizer(small_corpus, 300, tmp_path)
    path = tokenizer_path(small_corpus, 300, tmp_path)
    assert path.is_file() and small_corpus.fingerprint()[:20] in path.name and path.name.endswith("-v300.json")

    def boom(*a, **k):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tokmod, "train_tokenizer", boom)
    tok = load_or_train_tokenizer(small_corpus, 300, tmp_path)
    assert tok.get_vocab_size() == 300
    with pytest.raises(AssertionError, match="retrained"):  # another vocab size is another cache entry
        load_or_train_tokenizer(small_corpus, 320, tmp_path)


def test_training_is_deterministic(small_corpus):
    a = tokmod.train_tokenizer(small_corpus, 300)
    b = tokmod.train_tokenizer(small_corpus, 300)
    assert a.to_str() == b.to_str()


def test_vocab_too_small(small_corpus):
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 257, got 100"):
        tokmod.train_tokenizer(small_corpus, 100)


def test_build_once_concurrent(tmp_path):
    calls = []

    def build(tmp):
        calls.append(1)
        time.sleep(0.2)
        tmp.write_text("built")

    results = []
    threads = [threading.Thread(target=lambda: results.append(build_once(tmp_path / "f", build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(results) == 4
    assert (tmp_path / "f").read_text() == "built"
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.tmp-*"))


def test_build_once_takes_over_stale_lock(tmp_path):
    (tmp_path / "f.lock").write_text("another-host:12345")  # no PID to probe here: stale by age
    build_once(tmp_path / "f", lambda tmp: tmp.write_text("x"), stale_s=0.0)
    assert (tmp_path / "f").read_text() == "x"


def test_build_once_times_out_on_live_lock(tmp_path):
    import os

    (tmp_path / "f.lock").write_text(str(os.getpid()))  # a live builder (this process)
    with pytest.raises(TimeoutError):
        build_once(tmp_path / "f", lambda tmp: tmp.write_text("x"), timeout_s=0.2, stale_s=60)


def test_failed_build_leaves_no_file(tmp_path):
    def bad(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        build_once(tmp_path / "f", bad)
    assert not (tmp_path / "f").exists() and not list(tmp_path.iterdir())


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_build_once_takes_over_a_lock_whose_builder_is_gone_at_once(tmp_path):
    import socket
    import time

    for holder in (f"{socket.gethostname()}:{_dead_pid()}", str(_dead_pid())):  # current and older lock format
        target = tmp_path / holder.replace(":", "_")
        target.with_name(target.name + ".lock").write_text(holder)
        t0 = time.monotonic()
        build_once(target, lambda tmp: tmp.write_text("x"), stale_s=300.0)  # the age rule alone would wait 300 s
        assert target.read_text() == "x" and time.monotonic() - t0 < 5


def test_build_once_says_whom_it_waits_for(tmp_path, capsys):
    import os
    import socket

    target = tmp_path / "f"
    holder = f"{socket.gethostname()}:{os.getpid()}"  # alive: this very process
    target.with_name("f.lock").write_text(holder)
    with pytest.raises(TimeoutError, match=f"held by {holder}"):
        build_once(target, lambda tmp: tmp.write_text("x"), timeout_s=0.3)
    err = capsys.readouterr().err
    assert err.count("waiting for") == 1 and holder in err


def test_a_long_build_that_shows_life_is_waited_for(tmp_path, monkeypatch):
    """A builder refreshes its lock while it works (a large corpus takes minutes to prepare): a waiter whose
    timeout is shorter than the build waits for it instead of giving up, and nothing is built twice."""
    from quietsync.data import cache
    from quietsync.data.cache import build_in_place

    monkeypatch.setattr(cache, "HEARTBEAT_S", 0.05)
    done, lock = tmp_path / "done", tmp_path / "done.lock"
    started = threading.Event()

    def slow_build():
        started.set()
        time.sleep(1.0)  # the builder's work, longer than the waiter's timeout
        done.write_text("x")

    builder = threading.Thread(target=lambda: build_in_place(done, lock, slow_build))
    builder.start()
    started.wait(10)
    build_in_place(done, lock, lambda: pytest.fail("built twice"), timeout_s=0.3)
    builder.join()
    assert done.read_text() == "x" and not lock.exists()


def test_the_trained_bpe_read_back_through_transformers_has_its_own_fingerprint(small_corpus, tmp_path):
    """transformers' tokenizer classes give a tokenizer without a post-processor the template ``$A`` (no special
    tokens): the same ids, so a folder prepared with the trained BPE takes that tokenizer and a model exported
    from a run on it."""
    from quietsync.data.shards import tokenizer_fingerprint, tokenizer_fingerprints
    from quietsync.data.tokenizer import load_pretrained_tokenizer

    tok = load_or_train_tokenizer(small_corpus, 300, tmp_path)
    assert tok.post_processor is None
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    back, _ = load_pretrained_tokenizer(str(folder))
    # the file itself names its folder (not a hub name tried online first); another file is refused
    assert tokenizer_fingerprint(load_pretrained_tokenizer(str(folder / "tokenizer.json"))[0]) == \
        tokenizer_fingerprint(back)
    (folder / "vocab.txt").write_text("")
    with pytest.raises(ValueError, match="is a file; give the folder that holds its tokenizer.json"):
        load_pretrained_tokenizer(str(folder / "vocab.txt"))
    text = " the miller grinds wheat\nand more"
    assert back.encode(text).ids == tok.encode(text).ids
    assert tokenizer_fingerprint(back) == tokenizer_fingerprint(tok)
    # a post-processor that adds a token changes the ids, and the fingerprint with them
    from tokenizers.processors import TemplateProcessing

    eos = tok.token_to_id(EOS_TOKEN)
    back.post_processor = TemplateProcessing(single=f"$A {EOS_TOKEN}", special_tokens=[(EOS_TOKEN, eos)])
    assert back.encode(text).ids != tok.encode(text).ids and tokenizer_fingerprint(back) != tokenizer_fingerprint(tok)
    assert tokenizer_fingerprints(back)[0] == tokenizer_fingerprint(back)


def test_a_hub_tokenizer_name_fails_at_once_naming_tokenizer_when_the_hub_cannot_be_reached(monkeypatch, tmp_path):
    """``--tokenizer owner/name`` asks whether the hub answers before the hub client's minute of retries."""
    pytest.importorskip("transformers")
    from quietsync.data import sources

    monkeypatch.chdir(tmp_path)  # no folder of that name here
    import transformers

    monkeypatch.setattr(sources, "hub_unreachable", lambda: "https://hub.example cannot be reached (ConnectError)")
    # the hub client (and its retries) is never asked
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ValueError) as e:
        tokmod.load_pretrained_tokenizer("owner/nosuch")
    assert str(e.value) == ("--tokenizer: 'owner/nosuch' is no folder here, and the Hugging Face hub, where such a "
                            "name is looked up, https://hub.example cannot be reached (ConnectError)")
