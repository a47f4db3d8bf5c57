"""Tiny random-weight Hugging Face causal LMs of several families, saved as local folders (nothing downloaded),
for the tests of ``quietsync train --model DIR``: built from a config with ``AutoConfig.for_model`` and
``AutoModelForCausalLM.from_config``, saved with ``save_pretrained`` beside one byte-level BPE tokenizer (trained
once on a synthetic corpus and saved into every folder)."""

from __future__ import annotations

from pathlib import Path

FAMILIES: dict[str, dict] = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
    "gpt_neo": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 64,
                "attention_types": [[["global", "local"], 1]], "window_size": 16},
    "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64},
    "qwen2": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64},
}
"""Config fields of each family's tiny model (64 positions; the vocabulary is the tokenizer's)."""


def build_folders(root: Path, families: list[str] | None = None, vocab_size: int = 300) -> dict[str, Path]:
    """One folder per family under ``root`` (``config.json``, ``model.safetensors``, ``tokenizer.json``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from quietsync.data.corpus import Corpus
    from quietsync.data.tokenizer import EOS_TOKEN, eos_id, train_tokenizer
    from tests.train.conftest import synthetic_text

    corpus = Corpus("synthetic", tuple(synthetic_text(40, seed=s) for s in range(30)), (synthetic_text(40, seed=99),))
    tok = train_tokenizer(corpus, vocab_size)
    eos = eos_id(tok)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    out = {}
    for family in families or list(FAMILIES):
        config = AutoConfig.for_model(family, vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos,
                                      pad_token_id=eos, **FAMILIES[family])
        torch.manual_seed(0)
        folder = root / family
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        fast.save_pretrained(folder)
        out[family] = folder
    return out
