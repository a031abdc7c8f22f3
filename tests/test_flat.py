"""pyfedkern.flat: layouts, pack/unpack of state dicts and Flower NDArrays, carried integer buffers, FlatParameters."""

import numpy as np
import pytest
import torch
from torch import nn

from pyfedkern import ops
from pyfedkern.flat import (
    FlatLayout,
    FlatParameters,
    ndarrays_to_vector,
    pack,
    parameters_to_vector,
    state_dict_to_vector,
    unpack,
    vector_to_ndarrays,
    vector_to_parameters_,
    vector_to_state_dict,
)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_layout_offsets_segments_and_mask():
    net = _bn_net()
    layout = FlatLayout.of(net.state_dict().items())
    floats = layout.float_entries
    assert [e.name for e in layout.entries if e.carried] == ["1.num_batches_tracked"]
    assert layout.size == sum(e.numel for e in floats)
    seg = layout.segments()
    assert seg[0] == 0 and seg[-1] == layout.size and np.all(np.diff(seg) > 0)
    mask = layout.include_mask()
    assert mask.tolist() == ["bias" not in e.name for e in floats]


def test_state_dict_roundtrip_keeps_integer_buffers_exact():
    net = _bn_net()
    net.train()
    net(torch.randn(8, 3, 8, 8))  # updates running stats and num_batches_tracked
    vec, carried, layout = state_dict_to_vector(net)
    assert vec.dtype == torch.float32 and vec.shape == (layout.size,)
    assert carried["1.num_batches_tracked"].dtype == torch.int64
    restored = vector_to_state_dict(vec, layout, carried)
    for name, value in net.state_dict().items():
        assert restored[name].dtype == value.dtype
        assert torch.equal(restored[name], value), name
    other = _bn_net()
    other.load_state_dict(restored)
    x = torch.randn(2, 3, 8, 8)
    net.eval(), other.eval()
    assert torch.equal(net(x), other(x))


def test_averaging_state_dict_vectors_never_averages_counters():
    """Two models' vectors averaged with weighted_sum; the counter is carried from one of them, not averaged."""
    a, b = _bn_net(), _bn_net()
    b.train()
    b(torch.randn(4, 3, 8, 8))
    va, _, layout = state_dict_to_vector(a)
    vb, cb, _ = state_dict_to_vector(b)
    mean = ops.weighted_sum([va, vb], [0.5, 0.5])
    state = vector_to_state_dict(mean, layout, cb)
    assert state["1.num_batches_tracked"].item() == 1
    for name in a.state_dict():
        if name.endswith("num_batches_tracked"):
            continue
        expect = (a.state_dict()[name].float() + b.state_dict()[name].float()) / 2
        torch.testing.assert_close(state[name], expect)


def test_ndarrays_roundtrip_with_mixed_dtypes():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 4)).astype(np.float32), np.arange(5, dtype=np.int64), rng.random(7)]
    vec, carried, layout = ndarrays_to_vector(arrays)
    assert vec.dtype == np.float32 and vec.shape == (12 + 7,)
    back = vector_to_ndarrays(vec, layout, carried)
    assert [a.dtype for a in back] == [np.float32, np.int64, np.float64]
    np.testing.assert_array_equal(back[0], arrays[0])
    np.testing.assert_array_equal(back[1], arrays[1])
    np.testing.assert_allclose(back[2], arrays[2], rtol=1e-7)  # float64 went through the float32 vector
    vec64, _, _ = ndarrays_to_vector(arrays, dtype=np.float64)
    np.testing.assert_array_equal(vector_to_ndarrays(vec64, layout, carried)[2], arrays[2])


def test_parameters_vector_roundtrip():
    net = _bn_net()
    vec = parameters_to_vector(net)
    assert vec.shape == (sum(p.numel() for p in net.parameters()),)
    vector_to_parameters_(vec * 2, net)
    torch.testing.assert_close(parameters_to_vector(net), vec * 2)
    with pytest.raises(ValueError, match="parameters"):
        vector_to_parameters_(vec[:-1], net)


def test_flat_parameters_share_memory_with_module():
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    flat = FlatParameters(net)
    assert flat.size == 4 * 3 + 3 + 3 * 2 + 2
    loss = net(torch.randn(5, 4)).pow(2).sum()
    loss.backward()
    reference = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(flat.grad, reference)
    assert flat.grad.abs().sum() > 0
    flat.data.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in net.parameters())
    flat.zero_grad()
    assert all(float(p.grad.abs().sum()) == 0 for p in net.parameters())


def test_bad_input_errors():
    with pytest.raises(ValueError, match="empty"):
        pack({})
    net = _bn_net()
    vec, carried, layout = state_dict_to_vector(net)
    with pytest.raises(ValueError, match="expected"):
        unpack(vec[:-1], layout, carried)
    with pytest.raises(ValueError, match="num_batches_tracked"):
        unpack(vec, layout, {})
    with pytest.raises(ValueError, match="do not match"):
        pack([("x", torch.zeros(2))], layout)
    with pytest.raises(ValueError, match="ReLU has no trainable parameters"):
        FlatParameters(nn.ReLU())
    with pytest.raises(ValueError, match="dtype"):
        FlatParameters(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))
