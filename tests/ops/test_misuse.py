"""Misuse that must end in a clear error or correct behaviour: autograd's in-place rules on written
torch tensors, objects that only look like arrays, weights that are not real numbers, overflowing or missing
aggregation inputs, 0-d per-sample inputs, unsigned labels beyond int64, and row norms at 2^31 elements."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyfedkern import ops


def test_an_output_that_requires_grad_is_refused_in_grad_mode():
    w = torch.ones(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"acc requires grad.*torch.no_grad"):
        ops.accumulate_(w, torch.ones(4), 1.0)
    with pytest.raises(ValueError, match="out requires grad"):
        ops.weighted_sum(torch.ones(2, 4), [1.0, 1.0], out=w)
    with pytest.raises(ValueError, match="x requires grad"):
        ops.fedspeed_update_(w, torch.ones(4), 0.1)
    with torch.no_grad():  # as torch's own in-place ops: fine without grad mode
        ops.accumulate_(w, torch.ones(4), 1.0)
    assert w.detach().tolist() == [2.0] * 4


def test_written_tensors_get_their_version_bumped_so_autograd_detects_them():
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(3)
    loss = (w * x).sum()  # saves x for the backward pass
    before = x._version
    ops.accumulate_(x, torch.ones(3), 1.0)  # x is now 2: the saved value is stale
    assert x._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    y = torch.ones(3)
    loss = (w * y).sum()
    ops.fedspeed_update_(y, torch.ones(3), 0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    store = torch.ones(4, 3)
    loss = (w * store[1]).sum()
    ops.pbc_agg_bcast_(store, torch.zeros(3), [1, 2])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class FakeCupy:
    """Claims to be a cupy array with a host pointer."""

    __module__ = "cupy"

    def __init__(self) -> None:
        self._host = np.zeros(4, np.float32)
        self.shape, self.dtype, self.strides = (4,), self._host.dtype, (4,)
        self.__cuda_array_interface__ = {
            "data": (self._host.ctypes.data, False),
            "shape": (4,),
            "typestr": "<f4",
            "version": 3,
        }


def test_objects_that_only_look_like_cupy_arrays_are_refused():
    fake = FakeCupy()
    with pytest.raises(TypeError, match="numpy array, torch tensor or cupy array"):
        ops.weighted_sum([fake, fake], [1.0, 1.0])
    with pytest.raises(TypeError, match="numpy array, torch tensor or cupy array"):
        ops.accumulate_(fake, fake, 1.0)


@pytest.mark.parametrize(
    ("weights", "match"),
    [(["3", "1"], "real numbers"), ([None, 1.0], "real numbers"), ([1 + 2j, 1.0], "real numbers"),
     (np.array([1 + 0j, 1.0]), "real numbers"), ([1e308, np.inf], "finite"), ([object(), 1.0], "real numbers")],
)  # fmt: skip
def test_weights_that_are_not_finite_real_numbers_are_refused(weights, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ops.weighted_sum(np.ones((2, 3), np.float32), weights)


def test_complex_data_is_refused():
    with pytest.raises(TypeError, match="dtype complex"):
        ops.weighted_sum(np.ones((2, 3), np.complex64), [1.0, 1.0])


def test_per_sample_grad_norms_needs_a_batch_dimension():
    layer = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="batch dimension"):
        ops.per_sample_grad_norms(layer, torch.tensor(1.0), torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [np.uint64, np.uint32])
def test_unsigned_labels_are_reported_as_given(dtype):
    labels = np.array([0, 1, np.iinfo(dtype).max], dtype=dtype)
    with pytest.raises(ValueError, match=f"labels contain {np.iinfo(dtype).max}, out of range"):
        ops.class_feature_norms(np.ones((3, 2), np.float32), labels, 4)
    big = np.array([0, 2**63 + 1], dtype=np.uint64)
    with pytest.raises(ValueError, match=f"labels contain {2**63 + 1}"):
        ops.class_feature_norms(np.ones((2, 2), np.float32), big, 4)


def test_row_norms_stay_accurate_at_two_to_the_31_elements():
    # one row of 2^31 + 1 ones read through a zero stride: the norm is √(2^31 + 1) ≈ 46341 (a float32 sum of the
    # squares stops growing at 2^24 per lane: 16384 before the fix)
    n = 2**31 + 1
    row = np.lib.stride_tricks.as_strided(np.array([1.0], np.float32), shape=(1, n), strides=(0, 0))
    res = ops.class_feature_norms(row, np.zeros(1, np.int64), 1)
    assert abs(float(res.norms[0]) - np.sqrt(n)) <= 1e-3 * np.sqrt(n)
    assert abs(float(res.class_mean[0]) - np.sqrt(n)) <= 1e-3 * np.sqrt(n)


def test_flower_aggregate_refuses_bad_counts_and_layers():
    flower = pytest.importorskip("pyfedkern.integrations.flower", exc_type=ImportError)
    layer = [np.ones(3, np.float64)]
    with pytest.raises(ValueError, match="must sum to a finite number"):
        flower.aggregate([(layer, 1e308), (layer, 1e308)])
    with pytest.raises(TypeError, match="must be a real number"):
        flower.aggregate([(layer, "3"), (layer, 1)])
    with pytest.raises(TypeError, match="is None"):
        flower.aggregate([([None], 1), (layer, 1)])
    with pytest.raises(TypeError, match="real numbers"):
        flower.aggregate([([np.ones(3, np.complex128)], 1), (layer, 1)])


@pytest.mark.parametrize("features", [np.ones((3, 2), np.float32), torch.ones(3, 2)], ids=["numpy", "torch"])
def test_num_classes_beyond_the_limit_is_refused_by_name(features):
    labels = np.zeros(3, np.int64) if isinstance(features, np.ndarray) else torch.zeros(3, dtype=torch.int64)
    for num_classes in (2**31, 2**62, np.int64(2**62)):  # 2**62 gave numpy's "array is too big"
        with pytest.raises(ValueError, match=r"num_classes must be at most 2\*\*31 - 1 = 2147483647, got"):
            ops.class_feature_norms(features, labels, num_classes)


def test_a_grab_balancer_s_tau_beyond_the_limit_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tau must be at most 2\*\*31 - 1 = 2147483647 gradients, got 2147483648"):
        ops.GrabBalancer(2**31)
