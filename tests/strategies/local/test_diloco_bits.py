"""diloco with fewer bits (issue 22): low-bit packed pseudo-gradients, SparseLoCo, strided fragments — each
against the single-process references of ``reference_bits.py`` / ``reference_local.py``, bytes per sync against
the hand count, exact resume, and one-line errors for bad knobs."""

from __future__ import annotations

import pytest
import torch

import quietsync
from quietsync.models.units import layer_units
from quietsync.strategies.local.fragments import strided_fragments
from tests.distributed import run_ranks
from tests.strategies.helpers.common import param_groups, tiny_model
from tests.strategies.helpers.local_common import ADAMW, train_many
from tests.strategies.helpers.reference_bits import E2M1, hand_payload, quantize_blocks, reference_packed_diloco
from tests.strategies.helpers.reference_local import reference_diloco

ADAMW_OPT = lambda g: torch.optim.AdamW(g, **ADAMW)  # noqa: E731
SIZES = [91, 65, 13, 5]  # the tiny model's tensors in param-group order: W0, W1, b0, b1
SPARSE = {"outer": "sparseloco", "pseudo_grad_dtype": "int2", "topk_chunk": 16, "topk_density": 0.25,
          "error_decay": 0.9, "outer_lr": 1.0}


def _sent(step: dict, group: str = "world") -> int:
    return step["bytes"].get(group, {}).get("sent", 0)


@pytest.mark.timeout(300)
def test_lowbit_sparseloco_strided_equal_their_references_bytes_and_resume():
    strided = {"sync_every": 4, "fragments": 2, "fragment_pattern": "strided"}
    jobs = [
        {"strategy": "diloco", "config": {"sync_every": 2, "pseudo_grad_dtype": "fp4"}, "steps": 6},    # 0
        {"strategy": "diloco", "config": {"sync_every": 2, **SPARSE}, "steps": 6},                      # 1
        {"strategy": "diloco", "config": {"sync_every": 2, **SPARSE}, "steps": 6, "resume_at": 3},      # 2
        {"strategy": "diloco", "config": strided, "steps": 8},                                          # 3
        {"strategy": "diloco", "config": {"sync_every": 2, "pseudo_grad_dtype": "int2", "pseudo_grad_rounding":
                                          "stochastic", "pseudo_grad_error_feedback": True}, "steps": 6,
         "resume_at": 3},                                                                               # 4
        {"strategy": "diloco", "config": {"sync_every": 2, "pseudo_grad_dtype": "int2", "pseudo_grad_rounding":
                                          "stochastic", "pseudo_grad_error_feedback": True}, "steps": 6},  # 5
        {"strategy": "diloco", "config": {**strided, "overlap_delay": 1, "pseudo_grad_dtype": "fp4",
                                          "pseudo_grad_block": 16}, "steps": 8},                        # 6
        {"strategy": "diloco", "config": {"sync_every": 2, "pseudo_grad_replicator": "random",
                                          "compression": 1 / 16, "pseudo_grad_dtype": "int4"}, "steps": 4},  # 7
        {"strategy": "demo", "config": {"replicator": "random", "compression": 1 / 16, "transfer_dtype": "int4"},
         "steps": 3},                                                                                   # 8
    ]
    res = run_ranks(train_many, 2, jobs, timeout=280)
    whole = [[0, 1, 2, 3]]
    ref_fp4 = reference_packed_diloco(2, 2, 6, ADAMW_OPT, whole, quantize=lambda d: quantize_blocks(d, E2M1, 64))
    ref_sparse, _ = reference_packed_diloco(
        2, 2, 6, ADAMW_OPT, whole, sparseloco={"beta": 0.9, "density": 0.25, "chunk": 16}, outer_lr=1.0)
    # Linear 0 (W0, b0) and Linear 1 (W1, b1): a layer's weight and bias together (reference_diloco indexes
    # model.parameters(): W0, b0, W1, b1)
    ref_strided = reference_diloco(2, 2, 4, 8, ADAMW_OPT, fragments=[[0, 1], [2, 3]])
    ref_plain = reference_diloco(2, 2, 2, 6, ADAMW_OPT)
    for r in range(2):
        torch.testing.assert_close(res[r][0]["params"], ref_fp4[0][r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res[r][1]["params"], ref_sparse[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res[r][3]["params"], ref_strided[r], rtol=1e-5, atol=1e-6)
        # fewer bits land near the fp32 run, not on it
        for j in (0, 1):
            diff = (res[r][j]["params"] - ref_plain[r]).abs().max()
            assert 0 < diff < 0.1, (j, diff)
        assert torch.equal(res[r][2]["params"], res[r][1]["params"])  # resumed mid-run: exact
        assert torch.equal(res[r][4]["params"], res[r][5]["params"])  # stochastic rounding + residual resumed
    # SparseLoCo's accumulators after the run are the reference's (each worker its own)
    assert res[0][1]["memory"]["pseudo_grad_residual"] == 4 * 174
    # replicas agree right after every sync
    for j in (0, 1, 5):
        for t in (1, 3, 5):
            assert torch.equal(res[0][j]["trace"][t]["params"], res[1][j]["trace"][t]["params"]), (j, t)
    # bytes: all-gather of 2 packed payloads sends one payload per worker and sync, nothing in between
    per_sync = {0: hand_payload("fp4", SIZES), 1: hand_payload("sparseloco-int2", SIZES, chunk=16, density=0.25),
                5: hand_payload("int2", SIZES)}
    assert per_sync == {0: 93, 1: 91, 5: 50}
    for j, b in per_sync.items():
        for t, step in enumerate(res[0][j]["trace"]):
            assert _sent(step) == (b if (t + 1) % 2 == 0 else 0), (j, t, step["bytes"])
            assert step["extra"]["sync_bytes"] == (b if (t + 1) % 2 == 0 else 0)
    # strided fragments: fragment 0 = Linear 0 (104 values) at steps 2, 6; fragment 1 = Linear 1 (70) at 4, 8
    extras = [s["extra"] for s in res[0][3]["trace"]]
    assert [e["fragment"] for e in extras] == [-1, 0, -1, 1, -1, 0, -1, 1]
    assert [_sent(s) for s in res[0][3]["trace"]] == [0, 4 * 104, 0, 4 * 70, 0, 4 * 104, 0, 4 * 70]
    # streaming + fp4 on strided layers: packed fragments of 104 and 70 values, scale per 16
    fp4 = [hand_payload("fp4", [104], block=16), hand_payload("fp4", [70], block=16)]
    assert [s["extra"]["sync_bytes"] for s in res[0][6]["trace"]] == [0, fp4[0], 0, fp4[1], 0, fp4[0], 0, fp4[1]]
    # overlapped: the meter counts a fragment's all-gather when its merge waits for it, one step later
    assert [_sent(s) for s in res[0][6]["trace"]][:7] == [0, 0, fp4[0], 0, fp4[1], 0, fp4[0]]
    assert [e["applied"] for e in (s["extra"] for s in res[0][6]["trace"])] == [-1, -1, 0, -1, 1, -1, 0, -1]
    # a replicator with int4 values: 1/16 of 696 bytes holds 78 values (39 code bytes + 2 bf16 scales)
    assert [_sent(s) for s in res[0][7]["trace"]] == [0, 43, 0, 43]
    demo = [_sent(s) for s in res[0][8]["trace"]]
    assert len(set(demo)) == 1 and 0 < demo[0] <= 696 / 16
    for t in range(3):  # DeMo's replicas apply the same averaged update
        assert torch.equal(res[0][8]["trace"][t]["params"], res[1][8]["trace"][t]["params"])


def test_layers_and_strided_assignment():
    model = tiny_model()
    params = [p for g in param_groups(model) for p in g["params"]]
    assert layer_units(model, params) == [[0, 2], [1, 3]]
    assert strided_fragments([[0], [1], [2], [3], [4]], 2) == [[0, 2, 4], [1, 3]]
    assert strided_fragments([[0, 5], [1], [2, 3], [4]], 3) == [[0, 4, 5], [1], [2, 3]]

    class Net(torch.nn.Module):  # embeddings + a stack of blocks + a final norm, like a transformer
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)) for _ in range(3))
            self.norm = torch.nn.LayerNorm(4)

    net = Net()
    names = {id(p): n for n, p in net.named_parameters()}
    units = layer_units(net, list(net.parameters()))
    groups = [[names[id(p)] for i, p in enumerate(net.parameters()) if i in u] for u in units]
    assert groups == [["emb.weight"],
                      *[[f"blocks.{b}.0.weight", f"blocks.{b}.0.bias", f"blocks.{b}.1.weight", f"blocks.{b}.1.bias"]
                        for b in range(3)],
                      ["norm.weight", "norm.bias"]]
    # block l of the stack is layer l + 1: with 2 fragments, blocks 0 and 2 travel with the norm
    frag = strided_fragments(units, 2)
    assert [[names[id(list(net.parameters())[i])] for i in f][:1] for f in frag] == [["emb.weight"],
                                                                                   ["blocks.0.0.weight"]]


def test_bad_knobs_name_the_field(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cases = [({"pseudo_grad_dtype": "int3"}, "pseudo_grad_dtype must be one of fp32, bf16, int8, fp4, fp4_e3m0, "
                                             "int4, int2, got 'int3'"),
             ({"topk_density": 0.0}, r"topk_density must be in \(0, 1\], got 0.0"),
             ({"topk_density": 1.5}, r"topk_density must be in \(0, 1\]"),
             ({"error_decay": 1.5}, r"error_decay must be in \[0, 1\]"),
             ({"outer": "adam"}, "outer must be one of sgd, sparseloco"),
             ({"fragment_pattern": "random"}, "fragment_pattern must be one of contiguous, strided"),
             ({"pseudo_grad_block": 0}, "pseudo_grad_block must be an integer >= 1"),
             ({"pseudo_grad_rounding": "up"}, "pseudo_grad_rounding must be one of nearest, stochastic"),
             ({"pseudo_grad_error_feedback": True}, "pseudo_grad_error_feedback needs a low-bit pseudo_grad_dtype"),
             ({"outer": "sparseloco", "pseudo_grad_dtype": "int8"}, "pseudo_grad_dtype must be one of fp32, bf16, "
                                                                   "fp4, fp4_e3m0, int4, int2 with outer sparseloco"),
             ({"outer": "sparseloco", "pseudo_grad_replicator": "dct"}, "pseudo_grad_replicator must be none with "
                                                                       "outer sparseloco")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=f"^{message}"):
            quietsync.make_strategy("diloco", tiny_model(), torch.optim.SGD, config=bad, lr=0.1)
    with pytest.raises(ValueError, match="^fragments must be at most the model's 2 layers with fragment_pattern"):
        quietsync.make_strategy("diloco", tiny_model(), torch.optim.SGD,
                                config={"sync_every": 4, "fragments": 4, "fragment_pattern": "strided"}, lr=0.1)
