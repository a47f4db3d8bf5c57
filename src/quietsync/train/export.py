"""Models out: a trained model and its tokenizer as a Hugging Face folder.

``export_model`` writes ``FOLDER/`` with ``save_pretrained`` (``config.json``, ``model.safetensors``,
``generation_config.json``) and the tokenizer (``tokenizer.json`` and its configs, through
``PreTrainedTokenizerFast``), so that::

    model = AutoModelForCausalLM.from_pretrained("runs/train/model")
    tokenizer = AutoTokenizer.from_pretrained("runs/train/model")

load the committed parameters the run ended with. The trainer calls it on rank 0 at the end of a run
(``OUT/model/``), inside ``strategy.committed_params()``: every strategy shows its committed parameters
there (ACCO's, not its estimate; CDP's θ at the last committed step).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..data.tokenizer import EOS_TOKEN

MODEL_DIR = "model"
"""Sub-folder of ``--out`` the trainer exports to."""


def export_model(model: torch.nn.Module, tokenizer: Any, folder: str | os.PathLike) -> Path:
    """Write ``model`` (a transformers ``PreTrainedModel``, or the presets' GPT-Neo) and ``tokenizer`` (a
    ``tokenizers.Tokenizer``) to ``folder`` atomically (a temporary sibling renamed into place); return the folder."""
    from transformers import PreTrainedTokenizerFast

    from ..models.causal_lm import loading_bars_off

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):  # ddp's strategy.model is the wrapper
        model = model.module
    to_transformers = getattr(model, "to_transformers", None)
    if to_transformers is not None:  # the presets' GPT-Neo: written as transformers' class, which loads it back
        model = to_transformers()
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a transformers PreTrainedModel to export, got {type(model).__name__}")
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")  # a sibling: the rename below stays on one file system
    shutil.rmtree(tmp, ignore_errors=True)  # what an export cut short left
    with loading_bars_off():  # one folder, one shard: no bar in the run's output
        model.save_pretrained(tmp, safe_serialization=True)
    # as the model's config has it: end-of-text is its bos, eos and pad (data/tokenizer.py)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)  # os.replace cannot replace a non-empty folder
    os.replace(tmp, folder)
    return folder
