"""Strategy flags that depend on the model's structure, checked before any worker starts.

Three knobs can only be judged against the model: ``--fragments`` (diloco/localsgd's Streaming DiLoCo
fragments; at most one per parameter tensor), ``--stages`` (cdp; at most the segments the model can be cut
into, and a multiple of the workers) and ``--manual-stages`` (cdp; names of segments that exist, in model
order). The workers check them too, but only after loading the corpus and the model: a bad value would end
the job after seconds with a traceback. Here the model is built on the ``meta`` device from its config (no
weights, no memory, a fraction of a second), its parameter tensors counted and its segments listed, so the
launcher refuses such a value in one line (exit 2).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import TrainConfig

__all__ = ["model_problem", "needs_model_check"]


def needs_model_check(strategy: str, strategy_config: Any) -> bool:
    """Whether the job has a flag whose allowed values depend on the model (so the model must be built)."""
    if strategy == "cdp":
        return True
    return int(getattr(strategy_config, "fragments", 1) or 1) > 1


def _meta_model(cfg: TrainConfig) -> torch.nn.Module:
    """The job's model on the meta device: parameters with shapes and no storage."""
    from ..models.causal_lm import build_model, is_pretrained

    with torch.device("meta"):
        if not is_pretrained(cfg.model):
            return build_model(cfg.model, cfg.vocab_size, 0, seed=None)
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model))


def model_problem(cfg: TrainConfig, strategy_config: Any, world: int) -> str | None:
    """Why a structure-dependent strategy flag cannot work with ``cfg.model`` on ``world`` workers (one line
    naming the flag and what is allowed), or None."""
    if not needs_model_check(cfg.strategy, strategy_config):
        return None
    try:
        model = _meta_model(cfg)
    except (OSError, ValueError) as e:  # a model folder or hub name that cannot be read: the workers say why
        del e
        return None
    if cfg.strategy == "cdp":
        return _stages_problem(model, strategy_config, world)
    from ..models.causal_lm import param_groups

    tensors = sum(len(g["params"]) for g in param_groups(model, cfg.weight_decay))
    fragments = int(strategy_config.fragments)
    if fragments > tensors:
        return (f"--fragments must be <= the {tensors} parameter tensors of --model {cfg.model} (a fragment "
                f"holds whole tensors), got {fragments}")
    return None


def _stages_problem(model: torch.nn.Module, config: Any, world: int) -> str | None:
    from ..models.stages import partition, sequential_view

    view = sequential_view(model)
    names = [s.name for s in view.segments]
    n = config.stages if config.stages is not None else (world if world > 1 else 2)
    flag = "--stages" if config.stages is not None else "--stages (default: the workers)"
    if n % world:
        return f"{flag} must be a multiple of the {world} workers, got {n}"
    if n > len(names):
        return (f"{flag} must be <= the {len(names)} segments this model can be cut into "
                f"({', '.join(names)}), got {n}")
    if config.partition == "manual":
        try:
            partition(view, n, "manual", config.manual_names)
        except ValueError as e:
            text = " ".join(str(e).split())
            return "--" + text.replace("_", "-", 1) if text.startswith("manual_stages") else f"--manual-stages: {text}"
    return None
