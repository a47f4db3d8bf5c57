"""The presets' GPT-Neo is transformers' GPTNeoForCausalLM, bit for bit: the same parameters from the same seed,
the same logits, loss and gradients from the same parameters, with and without activation checkpointing, and an
export that transformers loads back. The reference is transformers' own class (not this library's code)."""

from __future__ import annotations

import pytest
import torch

from quietsync.models.gpt_neo import GPTNeo, GPTNeoConfig

pytestmark = pytest.mark.timeout(120)

transformers = pytest.importorskip("transformers")

SHAPES = [
    GPTNeoConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16),
    GPTNeoConfig(vocab_size=97, hidden_size=24, num_layers=3, num_heads=2, max_position_embeddings=40, eos_token_id=5),
]


def _reference(config: GPTNeoConfig, seed: int):
    torch.manual_seed(seed)
    return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(**config.transformers_kwargs()))


def _ours(config: GPTNeoConfig, seed: int) -> GPTNeo:
    torch.manual_seed(seed)
    return GPTNeo(config)


@pytest.mark.parametrize("config", SHAPES)
def test_a_seed_gives_transformers_parameters_names_and_order(config):
    ref, ours = _reference(config, 7), _ours(config, 7)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert set(ours.state_dict()) == set(ref.state_dict())
    # the random stream is left where transformers leaves it: what the run draws next is the same too
    torch.manual_seed(7)
    transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(**config.transformers_kwargs()))
    after_ref = torch.get_rng_state()
    _ours(config, 7)
    assert torch.equal(torch.get_rng_state(), after_ref)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("config", SHAPES)
def test_the_same_parameters_give_transformers_logits_loss_and_gradients(config, checkpointing):
    ref, ours = _reference(config, 3), _ours(config, 3)
    if checkpointing:
        ref.activation_checkpointing_enable({"use_reentrant": False})
        ours.activation_checkpointing_enable({"use_reentrant": False})
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, config.vocab_size, (3, config.max_position_embeddings - 1), generator=g)
    want, got = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.loss, want.loss) and torch.equal(got["loss"], want["loss"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # as a Trainer reads a non-dict output
    want.loss.backward()
    got.loss.backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a.grad, b.grad), name
    with torch.no_grad():  # shorter sequences and no labels: logits only
        assert torch.equal(ours(input_ids=ids[:, :5]).logits, ref(input_ids=ids[:, :5]).logits)
        assert ours(input_ids=ids[:, :5]).loss is None


def test_bf16_autocast_matches_transformers():
    config = SHAPES[0]
    ref, ours = _reference(config, 5), _ours(config, 5)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)


def test_the_transformers_copy_holds_the_same_model(tmp_path):
    config = SHAPES[1]
    ours = _ours(config, 1)
    with torch.no_grad():
        ours.transformer.h[0].mlp.c_fc.bias.add_(0.5)  # trained away from the initial values
    ours.to_transformers().save_pretrained(tmp_path, safe_serialization=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ours(input_ids=ids).logits)


def test_bad_shapes_and_inputs_are_refused():
    with pytest.raises(ValueError, match="num_heads must divide hidden_size"):
        GPTNeoConfig(vocab_size=10, hidden_size=30, num_layers=1, num_heads=4, max_position_embeddings=8)
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        GPTNeoConfig(vocab_size=0, hidden_size=8, num_layers=1, num_heads=2, max_position_embeddings=8)
    model = _ours(SHAPES[0], 0)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        model(input_ids=torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must be all ones"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0, 0]]))


def test_a_preset_job_trains_without_importing_transformers(tmp_path):
    """What a preset job's worker imports (the training loop, the model built and stepped once) leaves transformers
    unimported, and the launcher's forkserver preloads it only for a pretrained model folder."""
    import subprocess
    import sys

    from quietsync.train.job_model import worker_preload

    code = ("import sys, torch\n"
            "from quietsync.train import loop\n"
            "from quietsync.models import build_model\n"
            "m = build_model('tiny', 300, seed=0)\n"
            "ids = torch.zeros(2, 8, dtype=torch.long)\n"
            "m(input_ids=ids, labels=ids).loss.backward()\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'transformers'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    assert "quietsync.models.warm" not in worker_preload("tiny")
    (tmp_path / "config.json").write_text("{}")
    assert "quietsync.models.warm" in worker_preload(str(tmp_path))
