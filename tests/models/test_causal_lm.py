"""GPT-Neo presets have the advertised sizes; norms, biases and embeddings get no weight decay."""

from __future__ import annotations

import pytest
import torch

from quietsync.models import PRESETS, build_model, count_parameters, param_groups

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "name,low,high", [("tiny", 0.8e6, 1.2e6), ("default", 2e6, 5e6), ("10m", 9e6, 12e6)]
)
def test_preset_sizes(name, low, high):
    model = build_model(name, 4096, eos_id=0, seed=0)
    n = count_parameters(model)
    assert low <= n <= high, n
    cfg = model.config
    assert cfg.hidden_size == PRESETS[name].hidden_size and cfg.num_layers == PRESETS[name].num_layers
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, counted once


def test_seeded_init_is_identical():
    a = build_model("tiny", 512, seed=3)
    b = build_model("tiny", 512, seed=3)
    c = build_model("tiny", 512, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_unknown_preset():
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("huge", 512)


def test_param_groups_no_decay_for_norms_biases_embeddings():
    model = build_model("tiny", 512, seed=0)
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decay, no_decay = ({id(p) for p in g["params"]} for g in groups)
    names = dict((id(p), n) for n, p in model.named_parameters())
    assert id(model.transformer.wte.weight) in no_decay and id(model.transformer.wpe.weight) in no_decay
    assert all(names[i].endswith("bias") or ".ln" in names[i] for i in no_decay - {
        id(model.transformer.wte.weight), id(model.transformer.wpe.weight)})
    assert all(names[i].endswith("weight") and "ln" not in names[i] for i in decay)
    assert len(decay | no_decay) == len(list(model.parameters())) and not decay & no_decay
    torch.optim.AdamW(groups, lr=1e-3)  # valid torch parameter groups


def test_forward_loss_near_uniform_at_init():
    model = build_model("tiny", 512, seed=0)
    x = torch.randint(0, 512, (2, 32))
    loss = model(input_ids=x, labels=x).loss
    assert abs(float(loss.detach()) - torch.log(torch.tensor(512.0)).item()) < 0.5


def test_a_model_folder_loads_without_loading_bars_under_no_progress_and_leaves_them_as_they_were(tmp_path, capfd):
    """``--no-progress`` reaches transformers' "Loading weights" bars too, for that load only: transformers' switch
    is process-wide, and a library user's bars stay on."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from quietsync.models.causal_lm import load_pretrained
    from tests.hf_models import build_folders

    folder = build_folders(tmp_path, ["gpt2"])["gpt2"]
    was = hf_logging.is_progress_bar_enabled()  # whatever an earlier test in this process left
    try:
        for before in (True, False):
            (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
            capfd.readouterr()
            load_pretrained(str(folder), progress=False)
            quiet = capfd.readouterr()
            assert "Loading weights" not in quiet.err + quiet.out
            assert hf_logging.is_progress_bar_enabled() == before  # as it was before the load
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_exporting_a_model_leaves_the_loading_bars_as_they_were(tmp_path):
    """The export silences transformers' bars for its own write, not for the rest of a library user's process."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from quietsync.data.corpus import Corpus
    from quietsync.data.tokenizer import train_tokenizer
    from quietsync.train.export import export_model
    from tests.train.conftest import synthetic_text

    tok = train_tokenizer(Corpus("synthetic", (synthetic_text(40, seed=1),), (synthetic_text(40, seed=2),)), 300)
    was = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.enable_progress_bar()
        export_model(build_model("tiny", tok.get_vocab_size()), tok, tmp_path / "model")
        assert hf_logging.is_progress_bar_enabled()
        assert (tmp_path / "model" / "config.json").is_file()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
