"""Models out: the exported folder loads with `from_pretrained` and gives the trained model's loss."""

from __future__ import annotations

import pytest
import torch

from quietsync.train.export import export_model
from quietsync.train.model import build_model
from quietsync.train.tokenizer import EOS_TOKEN, eos_id, train_tokenizer

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


def test_export_refuses_a_plain_module(tmp_path, small_corpus):
    with pytest.raises(TypeError, match="PreTrainedModel"):
        export_model(torch.nn.Linear(2, 2), train_tokenizer(small_corpus, 300), tmp_path / "m")


def test_a_run_can_start_from_an_exported_folder(small_corpus, tmp_path):
    """--model and --tokenizer take a Hugging Face folder (here one quietsync exported)."""
    from quietsync.train.model import is_pretrained, load_pretrained
    from quietsync.train.tokenizer import load_pretrained_tokenizer

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
    with pytest.raises(ValueError, match="--tokenizer: cannot load"):
        load_pretrained_tokenizer(str(tmp_path / "missing"))
