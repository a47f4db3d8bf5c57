"""The peer checkpoint's packing: a state's tensors travel as raw bytes beside a pickled skeleton, and come back as
``torch.save``/``torch.load`` would give them -- every tensor bit-identical with its dtype and shape, in storage of
its own, a tensor present twice (tied weights) one tensor, everything around them (containers, numbers,
strings) as it was. The reference is torch's own round trip."""

from __future__ import annotations

import collections
import io

import torch

from quietsync.faults.peer_checkpoint import ALIGN, pack_state, unpack_state


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    tied = torch.randn(5, 3, generator=g)
    return {
        "model": collections.OrderedDict(w=torch.randn(4, 4, generator=g), tied=tied, scalar=torch.tensor(3.5)),
        "head": tied,
        "rows": [torch.arange(7), ("step", 12, 0.5), None],
        "transposed": torch.randn(6, 4, generator=g).t(),
        "bf16": torch.randn(3, generator=g).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "int8": torch.tensor([1, -2, 3], dtype=torch.int8),
        "float64": torch.randn(2, generator=g, dtype=torch.float64),
        "param": torch.nn.Parameter(torch.ones(2)),
    }


def _torch_round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


def _same(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_a_packed_state_comes_back_as_torch_load_gives_it():
    state = _state()
    skeleton, buffer = pack_state(state)
    back = unpack_state(skeleton, buffer)
    _same(back, _torch_round_trip(state))
    assert back["head"] is back["model"]["tied"]  # tied weights stay one tensor
    assert back["model"]["w"].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    back["model"]["w"].add_(1.0)  # storage of its own: the sender's state is untouched
    assert not torch.equal(back["model"]["w"], state["model"]["w"])
    assert skeleton.dtype == buffer.dtype == torch.uint8


def test_the_buffer_holds_each_distinct_tensor_once_aligned():
    state = _state()
    _, buffer = pack_state(state)
    distinct = [state["model"]["w"], state["model"]["tied"], state["model"]["scalar"], state["rows"][0],
                state["transposed"], state["bf16"], state["mask"], state["int8"], state["float64"], state["param"]]
    assert buffer.numel() == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in distinct)
