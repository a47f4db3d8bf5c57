"""Stage partitioning: GPT-Neo, a small ResNet and ViT, by params / FLOPs / manual names, with its balance."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import quietsync
from quietsync.models.stages import partition, segment_flops, sequential_view
from tests.strategies.helpers.reference_cdp import reference_cdp

_spec = importlib.util.spec_from_file_location("cdp_models", Path(__file__).parents[2] / "examples" / "cdp_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)


def tiny_gpt(layers: int = 2):
    from quietsync.models import ModelPreset, build_model

    return build_model(ModelPreset(hidden_size=16, num_layers=layers, num_heads=2, max_positions=16), 40, seed=0)


def lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def test_gpt_segments_and_the_view_computes_the_model_output():
    model = tiny_gpt()
    view = sequential_view(model)
    assert [s.name for s in view.segments] == ["transformer.wte", "transformer.h.0", "transformer.h.1",
                                               "transformer.ln_f", "lm_head"]
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    x, ctx = view.enter((), {"input_ids": ids, "labels": ids})
    for seg in view.segments:
        x = seg.module(x, ctx)
    torch.testing.assert_close(x.loss, lm_loss(model, ids))


def test_the_cut_is_checked_eagerly_on_compiled_blocks():
    """The view's probe (the staged forward against the model's own, without gradients) runs a ``--compile``d
    model's blocks eagerly: compiling those calls would cost each block extra compilations before training."""
    from torch._dynamo.utils import counters

    from quietsync.models.units import blocks

    model = tiny_gpt()
    for block in blocks(model):  # as compile_blocks does; the eager backend: what counts is what dynamo captures
        block.compile(backend="eager")
    torch._dynamo.reset()
    counters.clear()
    try:
        sequential_view(model)
        assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
        ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
        lm_loss(model, ids)  # the counter sees a compilation where there is one
        assert counters["stats"]["unique_graphs"] > 0
    finally:
        torch._dynamo.reset()  # the process's later tests start with no compiled frame of this model


@pytest.mark.parametrize("how", ["params", "flops"])
def test_partitions_cover_every_segment_in_order_and_report_balance(how):
    for model, sample in ((tiny_gpt(4), ((torch.zeros(2, 8, dtype=torch.long),), {})),
                          (models.tiny_resnet(), ((torch.randn(2, 1, 16, 16),), {})),
                          (models.tiny_vit(), ((torch.randn(2, 1, 16, 16),), {}))):
        view = sequential_view(model)
        flops = segment_flops(view, *sample)
        assert len(flops) == len(view.segments) and sum(flops) > 0
        plan = partition(view, 3, how, flops=flops)
        assert [n for stage in plan.names for n in stage] == [s.name for s in view.segments]
        assert sum(plan.params) == sum(p.numel() for p in model.parameters())  # a tied tensor counts once
        b = plan.balance()
        assert b["params_max_over_mean"] >= 1 and b["flops_max_over_mean"] >= 1
        # the balanced cut is no worse than the naive equal-count cut
        key = "flops" if how == "flops" else "params"
        naive = partition(view, 3, "manual", [view.segments[k].name for k in (len(view.segments) // 3,
                                                                             2 * len(view.segments) // 3)],
                          flops=flops)
        assert max(getattr(plan, key)) <= max(getattr(naive, key))


def test_params_partition_balances_an_uneven_sequence():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 1), torch.nn.Linear(1, 1),
                                torch.nn.Linear(1, 10), torch.nn.Linear(10, 10))
    plan = partition(sequential_view(model), 2)
    assert plan.names == [["0", "1", "2"], ["3", "4"]] and plan.params == [123, 130]


def test_manual_partition_and_its_errors():
    view = sequential_view(tiny_gpt())
    plan = partition(view, 3, "manual", ["transformer.h.0", "lm_head"])
    assert plan.names == [["transformer.wte"], ["transformer.h.0", "transformer.h.1", "transformer.ln_f"], ["lm_head"]]
    assert plan.params[2] == 0  # the head is tied to wte, owned by stage 1
    with pytest.raises(ValueError, match="manual_stages names unknown segments"):
        partition(view, 2, "manual", ["nope"])
    with pytest.raises(ValueError, match="must name the 2 segments"):
        partition(view, 3, "manual", ["lm_head"])
    with pytest.raises(ValueError, match="in model order"):
        partition(view, 3, "manual", ["lm_head", "transformer.h.0"])
    with pytest.raises(ValueError, match="stages must be <= the 5 segments"):
        partition(view, 6)


@pytest.mark.parametrize("partition_how", ["params", "flops", "manual"])
def test_gpt_with_tied_embedding_matches_the_reference(partition_how):
    """lm_loss(model, batch) works unchanged; the tied wte/lm_head tensor follows its owner stage (1)."""
    n, steps = 2, 3
    manual = "transformer.h.1" if partition_how == "manual" else ""
    data = [torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(n * 6)]
    s = quietsync.make_strategy("cdp", tiny_gpt(), torch.optim.AdamW,
                                config={"stages": n, "rule": "v2", "partition": partition_how,
                                        "manual_stages": manual}, lr=0.01)
    got, k = [], 0
    while s.steps < steps:
        s.forward_backward(data[k], lm_loss)
        k += 1
        if s.step():
            with s.committed_params() as m:
                got.append({name: p.detach().clone() for name, p in m.named_parameters()})
    first = [seg.name for seg in s.plan.stages[0]]
    s.close()
    model = tiny_gpt()

    def stage_of(name: str) -> int:
        return 1 if any(name.startswith(prefix) for prefix in first) or name.startswith("transformer.wpe") else 2

    stage = {name: stage_of(name) for name, _ in model.named_parameters()}

    def loss(call, batch):
        return call(input_ids=batch, labels=batch).loss

    want = reference_cdp(model, torch.optim.AdamW(model.parameters(), lr=0.01), stage, "v2", n, steps,
                         lambda t, i: data[t * n + i], loss)
    for a, b in zip(got, want):
        for name in b:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- Llama-style decoders
def tiny_decoder(family: str, layers: int = 2, seed: int = 0):
    """A random-weight decoder of ``family`` (llama, qwen2, mistral) from a tiny config (nothing downloaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=40, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=32)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_decoder_segments_reproduce_the_model_forward_and_backward(family):
    """Embeddings, each layer (with the masks and rotary cos/sin computed once by the model's own code), the final
    norm, the head: the same loss and the same gradients as the model called whole."""
    model = tiny_decoder(family, layers=3)
    view = sequential_view(model)
    assert view.kind == "decoder-lm"
    assert [s.name for s in view.segments] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                               "model.layers.2", "model.norm", "lm_head"]
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    want = lm_loss(model, ids)
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x, ctx = view.enter((), {"input_ids": ids, "labels": ids})
    for seg in view.segments:
        x = seg.module(x, ctx)
    assert {"position_embeddings", "attention_mask"} <= set(ctx["layer_kwargs"][0])  # computed once, shared
    assert all(kw["position_embeddings"] is ctx["layer_kwargs"][0]["position_embeddings"] for kw in ctx["layer_kwargs"])
    x.loss.backward()
    assert torch.equal(x.loss, want)
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-7, rtol=0)


def test_llama_under_cdp_matches_the_reference():
    n, steps = 2, 3
    data = [torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(n * 6)]
    s = quietsync.make_strategy("cdp", tiny_decoder("llama"), torch.optim.AdamW, config={"stages": n, "rule": "v2"},
                                lr=0.01)
    got, k = [], 0
    while s.steps < steps:
        s.forward_backward(data[k], lm_loss)
        k += 1
        if s.step():
            with s.committed_params() as m:
                got.append({name: p.detach().clone() for name, p in m.named_parameters()})
    first = [seg.name for seg in s.plan.stages[0]]
    assert first[0] == "model.embed_tokens" and len(first) < len(s.view.segments)
    s.close()
    model = tiny_decoder("llama")
    stage = {name: 1 if any(name.startswith(prefix + ".") for prefix in first) else 2
             for name, _ in model.named_parameters()}
    want = reference_cdp(model, torch.optim.AdamW(model.parameters(), lr=0.01), stage, "v2", n, steps,
                         lambda t, i: data[t * n + i], lambda call, batch: call(input_ids=batch, labels=batch).loss)
    for a, b in zip(got, want):
        for name in b:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


def test_models_cdp_cannot_cut_are_refused_naming_what_it_supports():
    from transformers import LlamaForCausalLM

    with pytest.raises(TypeError, match="cannot cut a Linear into stages: supported are an nn.Sequential.*Llama"):
        sequential_view(torch.nn.Linear(2, 2))

    class Scaled(LlamaForCausalLM):  # a decoder whose head does more than the cut knows (say, soft-capping)
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = Scaled(tiny_decoder("llama").config)
    with pytest.raises(TypeError, match="stage-by-stage forward differs from the model's own.*supported are"):
        sequential_view(model)
    assert model.training  # the probe left the model in train mode
