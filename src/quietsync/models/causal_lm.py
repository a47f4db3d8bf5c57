"""Models of `quietsync train`: GPT-Neo presets, pretrained causal LMs, and the optimizer parameter groups.

The papers' architecture, transformers' ``GPTNeoForCausalLM``, at sizes a CPU can train: ``tiny`` for tests,
``default`` for the out-of-the-box job, ``10m`` for benchmarks; built by :mod:`.gpt_neo` (the same model bit for
bit, without importing transformers). Dropout is off (the runs are short and the oracles compare strategies step
by step); the output embedding is tied to the input one.

Two transformations of the model before a strategy takes it (``--activation-checkpointing``, ``--compile``):
:func:`enable_activation_checkpointing` (each transformer block recomputes its activations in backward; the
model's own ``activation_checkpointing_enable``, non-reentrant) and :func:`compile_blocks` (``torch.compile``
of each transformer block, in place). Both work block by block, so strategies that shard by block (FSDP2) or
run blocks on their own (Cyclic DP's stages) keep working.

``--model`` also takes a local Hugging Face model folder (one with a ``config.json``, e.g. a previous run's
``OUT/model``) or, where a network exists, a hub name: any causal-LM architecture transformers knows, loaded
with ``AutoModelForCausalLM.from_pretrained`` (:func:`load_pretrained`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..validate import check_choice
from .gpt_neo import GPTNeo, GPTNeoConfig
from .units import blocks


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a GPT-Neo model (the vocabulary size comes from the tokenizer)."""

    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Attention heads per block (must divide ``hidden_size``)."""
    max_positions: int
    """Longest sequence the learned position embedding covers (``--seq-len`` may not exceed it)."""


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(hidden_size=128, num_layers=2, num_heads=4, max_positions=256),
    "default": ModelPreset(hidden_size=192, num_layers=4, num_heads=4, max_positions=256),
    "10m": ModelPreset(hidden_size=384, num_layers=5, num_heads=6, max_positions=512),
}
"""Named sizes; parameter counts at vocabulary 4096: tiny ≈ 1.0 M, default ≈ 2.6 M, 10m ≈ 10.6 M."""


def is_pretrained(name: str) -> bool:
    """Whether ``--model name`` names a pretrained model (a local folder or a hub name), not a preset."""
    return name not in PRESETS


POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
"""``config.json`` keys that bound the sequence length, by family: most (GPT-Neo, Llama, Qwen2, Mistral; rotary
models too), GPT-2, older GPT-2-style configs."""


def max_positions(name: str) -> int | None:
    """The longest sequence ``--model name`` takes: the preset's, or a local folder's ``config.json`` (the first of
    :data:`POSITION_KEYS` it has); None when unknown before loading (a hub name, a config without such a key)."""
    import json
    from pathlib import Path

    if name in PRESETS:
        return PRESETS[name].max_positions
    config = Path(name) / "config.json"
    if not config.is_file():
        return None
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in POSITION_KEYS:
        value = values.get(key) if isinstance(values, dict) else None
        # bool is an int subclass: a true in config.json must not read as 1 position
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def config_max_positions(config: object) -> int | None:
    """The same bound read from a loaded model's config (None when it has none of :data:`POSITION_KEYS`)."""
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@contextmanager
def loading_bars_off(off: bool = True) -> Iterator[None]:
    """transformers' progress bars off inside the block (``off``), then as they were: their switch is process-wide,
    and a library user's own loads keep theirs."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if off:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if off and was:
            hf_logging.enable_progress_bar()


def load_pretrained(name: str, vocab_size: int | None = None, progress: bool = True):
    """``AutoModelForCausalLM.from_pretrained(name)`` in train mode; checks the tokenizer's vocabulary fits.
    ``progress=False``: without transformers' loading bars (``--no-progress``), which are restored as they were.

    Raises ``ValueError`` (one line, naming ``--model``) when ``name`` is neither a local model folder nor a
    loadable hub model, or when the tokenizer has more tokens than the model's embedding."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    folder = Path(name)
    if folder.exists() and not (folder / "config.json").is_file():
        raise ValueError(f"--model: {name} is not a Hugging Face model folder (no config.json); "
                         f"presets: {', '.join(PRESETS)}")
    try:
        with loading_bars_off(not progress):
            model = AutoModelForCausalLM.from_pretrained(name)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--model: cannot load {name!r} as a causal LM ({first}); presets: "
                         f"{', '.join(PRESETS)}") from None
    embed = model.get_input_embeddings().num_embeddings
    if vocab_size is not None and vocab_size > embed:  # a larger embedding is fine (padded vocabularies)
        raise ValueError(f"--model: the tokenizer has {vocab_size} tokens but {name} embeds only {embed}")
    model.train()  # from_pretrained returns it in eval mode
    return model


def check_hub_model(name: str) -> None:
    """``ValueError`` (one line, naming ``--model`` and the presets) when hub name ``name`` is no model there: only
    its config is fetched. Asked before the model's tokenizer is loaded, whose failure would blame ``--tokenizer``."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--model: cannot load {name!r} ({first}); presets: {', '.join(PRESETS)}") from None


def build_model(preset: str | ModelPreset, vocab_size: int, eos_id: int = 0, seed: int | None = None) -> GPTNeo:
    """A freshly initialised GPT-Neo of ``preset`` (seeded with ``seed`` when given): :class:`~.gpt_neo.GPTNeo`,
    transformers' ``GPTNeoForCausalLM`` bit for bit without importing transformers."""
    if isinstance(preset, str):
        check_choice("model", preset, PRESETS)
        preset = PRESETS[preset]
    config = GPTNeoConfig(vocab_size=vocab_size, hidden_size=preset.hidden_size, num_layers=preset.num_layers,
                          num_heads=preset.num_heads, max_position_embeddings=preset.max_positions,
                          intermediate_size=4 * preset.hidden_size, eos_token_id=eos_id)
    if seed is not None:
        # the initial weights are drawn from torch's global generator
        torch.manual_seed(seed)
    return GPTNeo(config)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct trainable parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two torch parameter groups: matrices with ``weight_decay``; norms, biases and embeddings without.

    Embeddings are found by module type (``nn.Embedding``), so a tied output head (the same tensor)
    lands in the no-decay group once.
    """
    embedding_ids = {
        id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)
    }
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters de-duplicates tied tensors
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in embedding_ids else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block's activations during backward (the presets' GPT-Neo and Hugging Face
    models: their own ``activation_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint``, one checkpoint
    per block).

    Raises ``ValueError`` (naming ``--activation-checkpointing``) for a model that does not support it."""
    # the presets' GPT-Neo names it activation_checkpointing_enable; transformers models, gradient_checkpointing_enable
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"--activation-checkpointing: {type(model).__name__} does not support activation "
                         "checkpointing (a Hugging Face model with supports_gradient_checkpointing is needed)")
    try:
        enable({"use_reentrant": False})  # positional: the two methods name this argument differently
    except ValueError as e:
        raise ValueError(f"--activation-checkpointing: {e}") from None


def compile_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` each transformer block in place (``module.compile()``: the module, its parameters and
    its hooks stay what they were, so a strategy may still move parameters into flat buffers, shard the blocks
    with FSDP2 or call them stage by stage). Returns the number of blocks compiled.

    Raises ``ValueError`` (naming ``--compile``) for a model without repeated blocks."""
    found = blocks(model)
    if not found:
        raise ValueError(f"--compile: {type(model).__name__} has no transformer blocks (an nn.ModuleList of "
                         "layers) to compile")
    for block in found:
        block.compile()
    return len(found)
