"""Stages: a model cut into ``N`` consecutive pieces, for Cyclic Data Parallelism (a part beside ``cdp``).

CDP runs stage ``j`` of micro-batch ``i`` at its own time step, so the strategy must be able to call each
stage on its own, with the parameter *version* the update rule prescribes. This module provides that:

* a :class:`SequentialView` of a model: a list of :class:`Segment` (the finest cut the model allows) plus
  how the model's call arguments enter the first segment. Built for ``torch.nn.Sequential`` (each child a
  segment), for Hugging Face GPT-Neo/GPT-2-style causal LMs (``transformer.wte/wpe``, each block of
  ``transformer.h``, ``transformer.ln_f``, ``lm_head`` + the model's own loss when ``labels`` are given) and for
  Llama-style decoders (``model.embed_tokens``, each of ``model.layers``, ``model.norm``, ``lm_head``: Llama,
  Qwen2, Mistral, ...). A decoder's embedding segment also computes what every layer takes besides the hidden
  states — the attention masks and the rotary position embeddings (cos, sin), once per micro-batch — by running
  the decoder's own forward with each layer replaced by a recorder, so the model's own mask and rotary code is
  used, whatever the family; the layers receive them through the micro-batch's context. A transformers model's
  cut is checked once, on a short probe sequence, against the model's own forward (else it is refused);
* :func:`partition`: consecutive segments grouped into ``N`` stages, balanced by parameter count, by FLOPs
  (forward + backward of one sample micro-batch measured with ``torch.utils.flop_counter.FlopCounterMode``)
  or by a manual list of the segment names that start stages 2..N; the :class:`StagePlan` says which
  segments each stage holds and the balance it reached (per-stage params/FLOPs and max/mean);
* :func:`run_segments`: run a stage's segments on an input with given parameter tensors
  (``torch.func.functional_call``), so one module serves several parameter versions at once.

Parameters shared by several stages (a tied output embedding) belong to the **first** stage that uses them
(their *owner*); a later stage uses the same tensor the owner's forward used for that micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

PARTITIONS = ("params", "flops", "manual")
"""How :func:`partition` balances stages."""


class _Call(nn.Module):
    """A segment as a module: holds the sub-modules it needs and calls ``fn(self.parts, x, ctx)``."""

    def __init__(self, parts: dict[str, nn.Module], fn: Callable[[nn.ModuleDict, Any, dict], Any]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        self.fn = fn

    def forward(self, x: Any, ctx: dict) -> Any:
        return self.fn(self.parts, x, ctx)


@dataclass
class Segment:
    """The smallest unit a model is cut into: ``module(x, ctx) -> x``."""

    name: str
    """Dotted name of the model module it runs (what ``manual_stages`` refers to)."""
    module: nn.Module
    """A module whose ``forward(x, ctx)`` runs the segment."""

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())


@dataclass
class SequentialView:
    """A model as consecutive segments: ``x, ctx = enter(args, kwargs)``, then each segment in turn; the last
    segment's output is what ``model(*args, **kwargs)`` returns."""

    segments: list[Segment]
    enter: Callable[[tuple, dict], tuple[Any, dict]]
    kind: str
    """``sequential``, ``causal-lm`` (GPT-2/GPT-Neo style) or ``decoder-lm`` (Llama style)."""


def _sequential_enter(args: tuple, kwargs: dict) -> tuple[Any, dict]:
    if len(args) != 1 or kwargs:
        raise TypeError("a staged nn.Sequential takes exactly one positional input: model(x)")
    return args[0], {}


def _is_causal_lm(model: nn.Module) -> bool:
    t = getattr(model, "transformer", None)
    return (t is not None and all(hasattr(t, a) for a in ("wte", "wpe", "h", "ln_f"))
            and isinstance(getattr(model, "lm_head", None), nn.Module))


def sequential_view(model: nn.Module) -> SequentialView:
    """The segments of ``model`` (see the module docstring for the models understood).

    Raises:
        TypeError: for any other model, saying how to make it stageable (an ``nn.Sequential``).
    """
    if isinstance(model, nn.Sequential):
        segments = [Segment(name, _Call({"m": child}, lambda p, x, ctx: p["m"](x)))
                    for name, child in model.named_children()]
        return SequentialView(segments, _sequential_enter, "sequential")
    if _is_causal_lm(model):
        return _checked(model, _causal_lm_view(model))
    if _is_decoder_lm(model):
        return _checked(model, _decoder_lm_view(model))
    raise TypeError(f"cdp cannot cut a {type(model).__name__} into stages: {SUPPORTED}")


SUPPORTED = (
    "supported are an nn.Sequential (one child per segment), a GPT-Neo/GPT-2-style causal LM (transformer.wte/wpe/"
    "h/ln_f + lm_head) and a Llama-style decoder (model.embed_tokens/layers/norm + lm_head: Llama, Qwen2, Mistral)"
)
"""What :func:`sequential_view` can cut (quoted by its refusals)."""


def _causal_lm_enter(args: tuple, kwargs: dict) -> tuple[Any, dict]:
    kwargs = dict(kwargs)
    ids = kwargs.pop("input_ids", None)
    if args:
        if ids is not None or len(args) != 1:
            raise TypeError("a staged causal LM takes input_ids once (positional or keyword)")
        ids = args[0]
    labels = kwargs.pop("labels", None)
    extra = {k: v for k, v in kwargs.items() if v is not None}  # a keyword passed as None changes nothing
    if ids is None or extra:
        raise TypeError(f"a staged causal LM takes input_ids and labels only, got also {sorted(extra)}")
    return ids, {"labels": labels}


def _lm_head(model: nn.Module) -> Callable[[nn.ModuleDict, torch.Tensor, dict], Any]:
    """The last segment of a causal LM: logits, and the model's own loss when the call had labels."""

    def head(p: nn.ModuleDict, h: torch.Tensor, ctx: dict) -> Any:
        logits = p["m"](h)
        labels = ctx.get("labels")
        loss = None
        if labels is not None:
            loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
        return _output(model)(loss=loss, logits=logits)

    return head


def _output(model: nn.Module) -> Callable[..., Any]:
    """The type of ``model``'s own outputs: transformers' for a transformers model, else the presets' GPT-Neo's."""
    if type(model).__module__.startswith("transformers."):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast
    from .gpt_neo import CausalLMOutput

    return CausalLMOutput


def _checked(model: nn.Module, view: SequentialView) -> SequentialView:
    """``view``, once its segments run in turn reproduce ``model``'s own forward (logits and loss) on a short
    probe sequence in eval mode (no dropout); a TypeError naming what is supported otherwise."""
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    limit = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions")
                  if isinstance(getattr(config, k, None), int)), 8)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return view
    if device.type == "meta":  # a structure check (the launcher's, the planner's): the probe runs on the real model
        return view
    # varied ids within any vocabulary and position limit
    ids = (torch.arange(min(8, limit), device=device) * 7 % vocab).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        # eager even where blocks are compiled (--compile): the probe checks the cut, and compiling its no-grad
        # calls would cost each block two more compilations before the first step
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            want = model(input_ids=ids, labels=ids)
            x, ctx = view.enter((), {"input_ids": ids, "labels": ids})
            got = run_segments(view.segments, x, ctx, {id(p): p for p in model.parameters()})
            same = torch.allclose(got.logits, want.logits, rtol=1e-4, atol=1e-5) and torch.allclose(
                got.loss, want.loss, rtol=1e-4, atol=1e-5)
            diff = float((got.logits - want.logits).abs().max())
    except Exception as e:  # noqa: BLE001 - any failure of the cut is a refusal of this model
        raise TypeError(f"cdp cannot cut a {type(model).__name__} into stages (its staged forward failed: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {SUPPORTED}") from e
    finally:
        model.train(was_training)
    if not same:
        raise TypeError(f"cdp cannot cut a {type(model).__name__} into stages: its stage-by-stage forward differs "
                        f"from the model's own (max |logit difference| {diff:.2e} on a probe); {SUPPORTED}")
    return view


def _is_decoder_lm(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (inner is not None and isinstance(getattr(inner, "embed_tokens", None), nn.Module)
            and isinstance(getattr(inner, "layers", None), nn.ModuleList)
            and isinstance(getattr(inner, "norm", None), nn.Module)
            and isinstance(getattr(model, "lm_head", None), nn.Module))


class _Recorded(Exception):
    """Stops a decoder's forward once its last layer's call was recorded."""


class _LayerRecorder(nn.Module):
    """Stands in for decoder layer ``k``: records the call (hidden states, keyword arguments) and passes the hidden
    states through; the last one stops the forward (the final norm is a segment of its own)."""

    def __init__(self, calls: list[tuple[torch.Tensor, dict]], last: bool) -> None:
        super().__init__()
        self.calls, self.last = calls, last

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError("a decoder layer called with positional arguments besides the hidden states")
        self.calls.append((hidden_states, kwargs))
        if self.last:
            raise _Recorded
        return hidden_states


def _layer_calls(inner: nn.Module, embeds: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
    """What the decoder ``inner`` hands each of its layers for these input embeddings: its forward run with every
    layer replaced by a :class:`_LayerRecorder` (the embeddings, masks and rotary cos/sin computed by the model's
    own code; nothing cached)."""
    layers = inner.layers
    calls: list[tuple[torch.Tensor, dict]] = []
    inner.layers = nn.ModuleList([_LayerRecorder(calls, k == len(layers) - 1) for k in range(len(layers))])
    try:
        inner(inputs_embeds=embeds, use_cache=False)
    except _Recorded:
        pass
    finally:
        inner.layers = layers
    if len(calls) != len(layers):
        raise RuntimeError(f"the decoder called {len(calls)} of its {len(layers)} layers")
    return calls


def _decoder_lm_view(model: nn.Module) -> SequentialView:
    inner = model.model

    def embed(p: nn.ModuleDict, ids: torch.Tensor, ctx: dict) -> torch.Tensor:
        calls = _layer_calls(inner, p["m"](ids))
        ctx["layer_kwargs"] = [kwargs for _, kwargs in calls]  # masks, position ids, rotary (cos, sin)
        return calls[0][0]  # the hidden states entering layer 0 (a model may scale the embeddings)

    def block(k: int) -> Callable[[nn.ModuleDict, torch.Tensor, dict], torch.Tensor]:
        def run(p: nn.ModuleDict, h: torch.Tensor, ctx: dict) -> torch.Tensor:
            out = p["m"](h, **ctx["layer_kwargs"][k])
            return out[0] if isinstance(out, tuple) else out

        return run

    segments = [Segment("model.embed_tokens", _Call({"m": inner.embed_tokens}, embed))]
    segments += [Segment(f"model.layers.{k}", _Call({"m": layer}, block(k))) for k, layer in enumerate(inner.layers)]
    segments.append(Segment("model.norm", _Call({"m": inner.norm}, lambda p, h, ctx: p["m"](h))))
    segments.append(Segment("lm_head", _Call({"m": model.lm_head}, _lm_head(model))))
    return SequentialView(segments, _causal_lm_enter, "decoder-lm")


def _causal_lm_view(model: nn.Module) -> SequentialView:
    t = model.transformer

    def embed(p: nn.ModuleDict, ids: torch.Tensor, ctx: dict) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        h = p["wte"](ids) + p["wpe"](pos)
        return p["drop"](h) if "drop" in p else h

    def block(p: nn.ModuleDict, h: torch.Tensor, ctx: dict) -> torch.Tensor:
        out = p["m"](h)
        return out[0] if isinstance(out, tuple) else out

    parts = {"wte": t.wte, "wpe": t.wpe}
    if isinstance(getattr(t, "drop", None), nn.Module):  # embedding dropout: transformers' GPT-2/GPT-Neo only
        parts["drop"] = t.drop
    segments = [Segment("transformer.wte", _Call(parts, embed))]
    segments += [Segment(f"transformer.h.{k}", _Call({"m": b}, block)) for k, b in enumerate(t.h)]
    segments.append(Segment("transformer.ln_f", _Call({"m": t.ln_f}, lambda p, h, ctx: p["m"](h))))
    segments.append(Segment("lm_head", _Call({"m": model.lm_head}, _lm_head(model))))
    return SequentialView(segments, _causal_lm_enter, "causal-lm")


def run_segments(segments: Sequence[Segment], x: Any, ctx: dict, values: dict[int, torch.Tensor]) -> Any:
    """Run ``segments`` in turn on ``x``, each parameter ``p`` replaced by ``values[id(p)]``."""
    for seg in segments:
        # every name, tied duplicates too: with tie_weights=False each needs its own value
        named = dict(seg.module.named_parameters(remove_duplicate=False))
        params = {name: values[id(p)] for name, p in named.items()}
        # strict=False: buffers (a causal mask) are not in values and stay the module's own
        x = torch.func.functional_call(seg.module, params, (x, ctx), tie_weights=False, strict=False)
    return x


# ---------------------------------------------------------------------------------------------- partition
@dataclass
class StagePlan:
    """Which segments each stage holds and how balanced the cut is."""

    stages: list[list[Segment]]
    partition: str
    params: list[int]
    """Parameters owned by each stage (a tied tensor counts in its owner, the first stage using it)."""
    flops: list[int] | None = None
    """Forward + backward FLOPs of each stage on the sample micro-batch (None if not measured)."""
    owned: list[list[nn.Parameter]] = field(default_factory=list)
    """Each stage's owned parameters, in a fixed order (the order of its gradient buffer)."""

    @property
    def names(self) -> list[list[str]]:
        return [[s.name for s in stage] for stage in self.stages]

    def balance(self) -> dict[str, Any]:
        """Per-stage params/FLOPs and their max/mean (1.0 is perfect balance)."""
        def ratio(xs: list[int]) -> float:
            mean = sum(xs) / len(xs)
            return max(xs) / mean if mean else float("nan")

        out: dict[str, Any] = {"partition": self.partition, "stages": self.names, "params": self.params,
                               "params_max_over_mean": ratio(self.params)}
        if self.flops is not None:
            out["flops"] = self.flops
            out["flops_max_over_mean"] = ratio(self.flops)
        return out


def segment_flops(view: SequentialView, sample_args: tuple, sample_kwargs: dict,
                  last: Callable[[Any], torch.Tensor] | None = None) -> list[int]:
    """Forward + backward FLOPs of each segment on one sample call, measured with ``FlopCounterMode``.

    The graph is cut between segments (each segment's input is a fresh leaf), so each count is the segment's
    own; ``last(output)`` turns the last segment's output into a scalar to back-propagate (default: its
    ``.loss`` when it has one, else the sum of the output or of its ``.logits``). Parameters are used through
    detached leaves: no ``.grad`` of the model is touched.
    """
    from torch.utils.flop_counter import FlopCounterMode

    x, ctx = view.enter(sample_args, sample_kwargs)
    counts = []
    for k, seg in enumerate(view.segments):
        values = {id(p): p.detach().requires_grad_(p.requires_grad) for p in seg.parameters()}
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.detach().requires_grad_()
        with FlopCounterMode(display=False) as counter:
            out = run_segments([seg], x, ctx, values)
            if k == len(view.segments) - 1:
                scalar = (last or _default_scalar)(out)
            else:
                # any scalar will do: only the FLOPs of its backward are counted
                scalar = out.float().sum() if isinstance(out, torch.Tensor) else None
            if scalar is not None and scalar.requires_grad:
                scalar.backward()
        counts.append(int(counter.get_total_flops()))
        x = out.detach() if isinstance(out, torch.Tensor) else out
    return counts


def _default_scalar(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits.float().sum()
    raise TypeError("the last segment returned neither a tensor nor an object with .loss or .logits")


def _owned(stages: list[list[Segment]]) -> tuple[list[list[nn.Parameter]], list[int]]:
    seen: set[int] = set()
    owned = []
    for stage in stages:
        mine = []
        for seg in stage:
            for p in seg.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    mine.append(p)
        owned.append(mine)
    return owned, [sum(p.numel() for p in ps) for ps in owned]


def _segment_params(view: SequentialView) -> list[int]:
    _, counts = _owned([[s] for s in view.segments])
    return counts


def _balanced_cuts(weights: Sequence[float], n: int) -> list[int]:
    """Start indices of ``n`` consecutive non-empty groups minimising the heaviest group (exact, O(n·S²))."""
    s = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][e]: minimal max-weight of cutting weights[:e] into k groups; arg[k][e]: start of the k-th group
    best = [[inf] * (s + 1) for _ in range(n + 1)]
    arg = [[0] * (s + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for e in range(k, s - (n - k) + 1):  # room for one segment in each of the n - k groups to come
            for b in range(k - 1, e):
                cost = max(best[k - 1][b], prefix[e] - prefix[b])
                if cost < best[k][e] - 1e-9:  # float rounding never decides between equal cuts
                    best[k][e], arg[k][e] = cost, b
    starts, e = [], s
    for k in range(n, 0, -1):
        b = arg[k][e]
        starts.append(b)
        e = b
    return sorted(starts)


def partition(view: SequentialView, n: int, how: str = "params", manual: Sequence[str] = (),
              flops: list[int] | None = None) -> StagePlan:
    """Group ``view``'s segments into ``n`` consecutive stages.

    Args:
        n: number of stages (at least 1, at most the number of segments).
        how: ``params`` (balance owned parameter counts), ``flops`` (balance ``flops``, per-segment counts
            from :func:`segment_flops`) or ``manual``.
        manual: with ``how="manual"``, the names of the ``n - 1`` segments that start stages 2..n, in order.
        flops: per-segment FLOPs (required for ``flops``; reported when given).

    Raises:
        ValueError: naming the argument (too many stages, unknown or unordered segment names, ...).
    """
    segs = view.segments
    names = [s.name for s in segs]
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"stages must be an integer >= 1, got {n!r}")
    if n > len(segs):
        raise ValueError(f"stages must be <= the {len(segs)} segments this model can be cut into "
                         f"({', '.join(names)}), got {n}")
    if how not in PARTITIONS:
        raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, got {how!r}")
    if flops is not None and len(flops) != len(segs):
        raise ValueError(f"flops must have one count per segment ({len(segs)}), got {len(flops)}")
    if how == "manual":
        manual = list(manual)
        if len(manual) != n - 1:
            raise ValueError(f"manual_stages must name the {n - 1} segments that start stages 2..{n}, "
                             f"got {len(manual)}: {manual}")
        unknown = [m for m in manual if m not in names]
        if unknown:
            raise ValueError(
                f"manual_stages names unknown segments {unknown}; segments are {', '.join(names)}"
            )
        starts = [0] + [names.index(m) for m in manual]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"manual_stages must be in model order with no empty stage, got {manual}")
    elif how == "flops":
        if flops is None:
            raise ValueError(
                "partition 'flops' needs per-segment flops (segment_flops on a sample micro-batch)"
            )
        starts = _balanced_cuts(flops, n)
    else:
        starts = _balanced_cuts(_segment_params(view), n)
    bounds = starts + [len(segs)]
    stages = [segs[a:b] for a, b in zip(bounds, bounds[1:])]
    owned, params = _owned(stages)
    stage_flops = None
    if flops is not None:
        stage_flops = [sum(flops[a:b]) for a, b in zip(bounds, bounds[1:])]
    return StagePlan(stages, how, params, stage_flops, owned)
