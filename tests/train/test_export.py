"""Models out: the exported folder loads with `from_pretrained` and gives the trained model's loss."""

from __future__ import annotations

import pytest
import torch

from quietsync.data.tokenizer import EOS_TOKEN, eos_id, train_tokenizer
from quietsync.models import build_model
from quietsync.train.export import export_model

pytestmark = pytest.mark.timeout(120)


def test_exported_model_and_tokenizer_load_with_auto_classes_and_match(small_corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = train_tokenizer(small_corpus, 300)
    model = build_model("tiny", tok.get_vocab_size(), eos_id(tok), seed=0)
    with torch.no_grad():  # "trained": not the initialisation from_pretrained would give
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ids = torch.tensor([tok.encode(small_corpus.eval_documents[0]).ids[:64]])
    want = model(input_ids=ids, labels=ids).loss

    folder = export_model(model, tok, tmp_path / "model")
    assert (folder / "model.safetensors").is_file() and not list(tmp_path.glob(".*tmp"))
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    got = loaded(input_ids=ids, labels=ids).loss
    assert torch.equal(got, want)
    fast = AutoTokenizer.from_pretrained(folder)
    text = small_corpus.eval_documents[0][:300]
    assert fast(text)["input_ids"] == tok.encode(text).ids
    assert fast.decode(fast(text)["input_ids"]) == text
    assert fast.eos_token == EOS_TOKEN

    export_model(model, tok, folder)  # a second export replaces the first
    assert torch.equal(AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids, labels=ids).loss, want)


def test_a_ddp_wrapped_model_exports_the_model_inside(small_corpus, tmp_path):
    """ddp's strategy.model is the DistributedDataParallel wrapper; the export writes the model it wraps."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from tests.distributed import free_port

    tok = train_tokenizer(small_corpus, 300)
    model = build_model("tiny", tok.get_vocab_size(), eos_id(tok), seed=0)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        folder = export_model(torch.nn.parallel.DistributedDataParallel(model), tok, tmp_path / "model")
    finally:
        dist.destroy_process_group()
    again = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_export_refuses_a_plain_module(tmp_path, small_corpus):
    with pytest.raises(TypeError, match="PreTrainedModel"):
        export_model(torch.nn.Linear(2, 2), train_tokenizer(small_corpus, 300), tmp_path / "m")


def test_a_run_can_start_from_an_exported_folder(small_corpus, tmp_path):
    """--model and --tokenizer take a Hugging Face folder (here one quietsync exported)."""
    from quietsync.data.tokenizer import load_pretrained_tokenizer
    from quietsync.models import is_pretrained, load_pretrained

    tok = train_tokenizer(small_corpus, 300)
    model = build_model("tiny", tok.get_vocab_size(), eos_id(tok), seed=0)
    folder = export_model(model, tok, tmp_path / "model")
    assert is_pretrained(str(folder)) and not is_pretrained("tiny")
    tok2, eos = load_pretrained_tokenizer(str(folder))
    assert eos == eos_id(tok) and tok2.encode("In the beginning").ids == tok.encode("In the beginning").ids
    again = load_pretrained(str(folder), tok2.get_vocab_size())
    assert again.training
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match="--model: .* is not a Hugging Face model folder"):
        load_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="embeds only"):
        load_pretrained(str(folder), 10_000)
    with pytest.raises(ValueError, match="--tokenizer .*missing: no such folder"):
        load_pretrained_tokenizer(str(tmp_path / "missing"))


@pytest.mark.timeout(240)
def test_a_run_ends_with_a_model_from_pretrained_loads_and_the_next_run_starts_from_it(tmp_path, monkeypatch):
    """OUT/model holds the committed parameters: loaded with the Auto classes it gives the run's last eval loss,
    and `--model OUT/model` (tokenizer from the same folder) starts a run at exactly that loss."""
    from transformers import AutoModelForCausalLM

    from quietsync.data.corpus import load_corpus
    from quietsync.data.sequences import encode_split, eval_batches
    from quietsync.data.tokenizer import load_pretrained_tokenizer
    from quietsync.train.config import TrainConfig
    from quietsync.train.loop import evaluate, run

    from .conftest import synthetic_text

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(3000))
    common = dict(strategy="acco", nproc=1, max_steps=4, micro_batch_size=2, seq_len=32, vocab_size=300,
                  dataset=str(data), cache_dir=str(tmp_path / "cache"), eval_every=0, eval_windows=4,
                  progress=False, plot=False)
    first = run(TrainConfig(out=str(tmp_path / "a"), model="tiny", **common))
    folder = tmp_path / "a" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok, eos = load_pretrained_tokenizer(str(folder))
    corpus = load_corpus(str(data), TrainConfig().eval_fraction)
    held_out = eval_batches(encode_split(tok, corpus.eval_documents, eos, str(tmp_path / "cache")), 32, 2, 4)
    assert evaluate(model, held_out, torch.device("cpu")) == pytest.approx(first["last_eval_loss"], abs=1e-6)

    second = run(TrainConfig(out=str(tmp_path / "b"), model=str(folder), **common))
    assert second["first_eval_loss"] == pytest.approx(first["last_eval_loss"], abs=1e-6)
    assert second["last_eval_loss"] < second["first_eval_loss"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["wp", "ddp"])
def test_a_two_worker_run_exports_where_the_committed_parameters_need_a_collective(strategy, text_file, tmp_path,
                                                                                    request):
    """wp gathers the committed parameters (a collective every worker must join) and ddp's model is wrapped:
    both used to fail at the end of a 2-worker run (a hang, an error) before the model folder was written.
    ddp: the shared finished 2-worker ddp run (tests/train/conftest.py), which exports."""
    from transformers import AutoModelForCausalLM

    from ._run import train

    if strategy == "ddp":
        out = request.getfixturevalue("finished_ddp_run")
    else:
        out = tmp_path / "out"
        proc = train("--strategy", strategy, "--nproc", "2", "--model", "tiny", "--max-steps", "2",
                     "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--dataset", str(text_file),
                     "--cache-dir", str(tmp_path / "cache"), "--eval-every", "0", "--no-progress", "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert AutoModelForCausalLM.from_pretrained(out / "model").num_parameters() > 0
