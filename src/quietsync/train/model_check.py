"""Strategy flags that depend on the model's structure, checked before any worker starts.

Some knobs can only be judged against the model: ``--fragments`` (diloco/localsgd's Streaming DiLoCo fragments;
at most one per parameter tensor) and what a strategy declares it needs of the model (``Declaration.models``:
cdp's ``--stages``, at most the segments the model can be cut into and a multiple of the workers, and
``--manual-stages``, names of segments that exist, in model order). The workers check them too, but only after
loading the corpus and the model: a bad value would end the job after seconds with a traceback. Here the model is
built on the ``meta`` device from its config (no weights, no memory, a fraction of a second), its parameter
tensors counted and its segments listed, so the launcher refuses such a value in one line (exit 2).
"""

from __future__ import annotations

from typing import Any

import torch

from ..strategies.registry import declaration
from .config import TrainConfig

__all__ = ["model_problem", "needs_model_check"]


def needs_model_check(strategy: str, strategy_config: Any) -> bool:
    """Whether the job has a flag whose allowed values depend on the model (so the model must be built): the
    strategy declares what models it needs (``Declaration.models``), or it cuts the model into fragments."""
    if declaration(strategy).models is not None:
        return True
    return int(getattr(strategy_config, "fragments", 1) or 1) > 1


def _meta_model(cfg: TrainConfig) -> torch.nn.Module:
    """The job's model on the meta device: parameters with shapes and no storage."""
    from ..models.causal_lm import build_model, is_pretrained

    with torch.device("meta"):
        if not is_pretrained(cfg.model):
            return build_model(cfg.model, cfg.vocab_size, 0, seed=None)  # no shape depends on the eos id or the seed
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model))


def model_problem(cfg: TrainConfig, strategy_config: Any, world: int) -> str | None:
    """Why a structure-dependent strategy flag cannot work with ``cfg.model`` on ``world`` workers (one line
    naming the flag and what is allowed), or None."""
    needs = declaration(cfg.strategy).models  # what the strategy needs of the model: its one look-up here
    if needs is None and int(getattr(strategy_config, "fragments", 1) or 1) <= 1:
        return None
    try:
        model = _meta_model(cfg)
    except (OSError, ValueError) as e:  # a model folder or hub name that cannot be read: the workers say why
        del e
        return None
    if needs is not None:
        return needs(model, strategy_config, world)
    from ..models.causal_lm import param_groups

    tensors = sum(len(g["params"]) for g in param_groups(model, cfg.weight_decay))
    fragments = int(strategy_config.fragments)
    if fragments > tensors:
        return (f"--fragments must be <= the {tensors} parameter tensors of --model {cfg.model} (a fragment "
                f"holds whole tensors), got {fragments}")
    return None
