"""What the ops take as arrays: torch.Tensor subclasses (recognised the same whether or not they are the first
tensor a process shows an op), memoryviews (read as the numpy array over their buffer, in every op), numpy masked
arrays (refused, naming the argument: their mask would be ignored) and tensors without memory of their own (taken by
the registered operator, through their own dispatch)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_map

from pyfedkern import _arrays, ops

K, D, TAU, N = 4, 10, 5, 12


def _cases() -> dict[str, tuple]:
    """op name -> (op, array arguments (float64 unless indices), other arguments); every array argument is read."""
    rng = np.random.default_rng(0)

    def f64(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape)

    return {
        "weighted_sum": (ops.weighted_sum, {"updates": f64(K, D), "weights": rng.random(K), "out": f64(D)}, {}),
        "accumulate_": (ops.accumulate_, {"acc": f64(D), "update": f64(D)}, {"weight": 0.5}),
        "similarity_weights": (ops.similarity_weights, {"query": f64(D), "bank": f64(K, D)}, {"scale": 1.0}),
        "similarity_combine": (
            ops.similarity_combine,
            {
                "query": f64(D),
                "bank": f64(K, D),
                "models": f64(K, D),
                "segments": np.array([0, 4, D]),
                "include": np.array([True, False]),
            },
            {"scale": 1.0},
        ),
        "herding_select": (ops.herding_select, {"grads": f64(TAU, D)}, {"alpha": 0.4}),
        "herding_order": (ops.herding_order, {"grads": f64(TAU, D)}, {"k": 2}),
        "grab_select": (ops.grab_select, {"grads": f64(TAU, D)}, {}),
        "row_norms": (ops.row_norms, {"x": f64(N, D)}, {}),
        "centred_gram": (ops.centred_gram, {"grads": f64(TAU, D)}, {}),
        "class_feature_norms": (
            ops.class_feature_norms,
            {"features": f64(N, D), "labels": np.arange(N) % 3},
            {"num_classes": 3},
        ),
        "mifa_update_": (
            ops.mifa_update_,
            {"x": f64(D), "memory": f64(K, D), "total": f64(D), "updates": f64(2, D), "rows": np.array([1, 3])},
            {},
        ),
        "weighted_delta_": (ops.weighted_delta_, {"x": f64(D), "models": f64(K, D), "weights": rng.random(K)}, {}),
        "pbc_agg_bcast_": (ops.pbc_agg_bcast_, {"store": f64(K, D), "server": f64(D), "active": np.array([0, 2])}, {}),
        "fedspeed_update_": (
            ops.fedspeed_update_,
            {"x": f64(D), "g2": f64(D), "g1": f64(D), "anchor": f64(D)},
            {"lr": 0.1, "alpha": 0.5, "prox_coef": 0.1},
        ),
        "fedspeed_round_end_": (
            ops.fedspeed_round_end_,
            {"h": f64(D), "x_local": f64(D), "x_global": f64(D), "acc": f64(D)},
            {},
        ),
        "sam_perturb": (ops.sam_perturb, {"x": f64(D), "grad": f64(D)}, {"rho": 0.05}),
        "clip_accumulate": (
            ops.clip_accumulate,
            {"updates": f64(K, D), "center": f64(D), "out": f64(D), "norms_out": f64(K)},
            {"clip": 1.0},
        ),
        "gaussian_noise_": (ops.gaussian_noise_, {"x": f64(D)}, {"std": 0.5, "seed": 3}),
        "seeded_permutations": (
            ops.seeded_permutations,
            {"keys": np.arange(6).reshape(3, 2), "sizes": np.array([3, 4, 5])},
            {"seed": 1},
        ),
    }


CASES = _cases()


def _values(result) -> list[np.ndarray]:
    """An op's result (array, tuple or dataclass of arrays) as a flat list of numpy arrays."""
    if isinstance(result, tuple):
        return [v for item in result for v in _values(item)]
    if hasattr(result, "__dataclass_fields__"):
        return [v for name in result.__dataclass_fields__ for v in _values(getattr(result, name))]
    return [np.asarray(result)]


@pytest.mark.parametrize("op", CASES)
def test_memoryviews_give_what_the_numpy_arrays_give(op):
    fn, arrays, kwargs = CASES[op]
    expected_inputs = copy.deepcopy(arrays)
    expected = _values(fn(**expected_inputs, **kwargs))
    inputs = copy.deepcopy(arrays)
    got = _values(fn(**{name: memoryview(a) for name, a in inputs.items()}, **kwargs))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)
    for name in arrays:  # in-place ops wrote through the memoryviews into the same buffers
        np.testing.assert_array_equal(inputs[name], expected_inputs[name], err_msg=name)


@pytest.mark.parametrize(("op", "argument"), [(op, name) for op, (_, arrays, _) in CASES.items() for name in arrays])
def test_masked_arrays_are_refused_naming_the_argument(op, argument):
    fn, arrays, kwargs = CASES[op]
    arrays = copy.deepcopy(arrays)
    arrays[argument] = np.ma.masked_array(arrays[argument], mask=np.ones(arrays[argument].shape, dtype=bool))
    with pytest.raises(TypeError, match=f"^{argument} is a numpy masked array"):
        fn(**arrays, **kwargs)


def test_masked_arrays_in_a_list_or_as_a_scalar_are_refused():
    row = np.ma.masked_array(np.ones(3), mask=[False, True, False])
    with pytest.raises(TypeError, match=r"updates\[1\] is a numpy masked array"):
        ops.weighted_sum([np.ones(3), row], [0.5, 0.5])
    with pytest.raises(TypeError, match="weight is a numpy masked array"):
        ops.accumulate_(np.zeros(3), np.ones(3), np.ma.masked_array(1.0, mask=True))
    with pytest.raises(TypeError, match="weights is a numpy masked array"):
        ops.weighted_sum([np.ones(3)], np.ma.masked_array([1.0]))


def test_memoryview_layouts_and_misuse():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    strided = memoryview(base)[::2]  # rows 0 and 2: byte strides are read as they are
    np.testing.assert_array_equal(ops.weighted_sum(strided, [1.0, 2.0]), base[0] + 2 * base[2])
    assert ops.weighted_sum(memoryview(base), np.ones(4)).dtype == np.float32
    out = bytearray(8 * 6)  # a writeable buffer of another type, seen as float64 through a cast memoryview
    view = memoryview(out).cast("d")
    assert ops.weighted_sum([np.ones(6), np.full(6, 2.0)], [1.0, 1.0], out=view) is view
    np.testing.assert_array_equal(np.frombuffer(out), np.full(6, 3.0))
    with pytest.raises(ValueError, match="out is read-only"):
        ops.weighted_sum([np.ones(6)], [1.0], out=memoryview(bytes(48)).cast("d"))
    with pytest.raises(TypeError, match="updates has dtype uint8"):
        ops.weighted_sum(memoryview(bytes(12)).cast("B", (2, 6)), [1.0, 1.0])
    released = memoryview(base)
    released.release()
    with pytest.raises(TypeError, match="updates is a memoryview that numpy cannot read"):
        ops.weighted_sum(released, [1.0] * 4)


class _Wrapper(torch.Tensor):
    """A wrapper subclass: a tensor object whose data lives in another tensor (data_ptr() is 0)."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        wrapper = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        wrapper.elem = elem
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.elem if isinstance(t, _Wrapper) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_tensors_without_memory_of_their_own_take_the_registered_operator():
    wrapped = _Wrapper(torch.arange(8, dtype=torch.float64))
    assert wrapped.data_ptr() == 0
    got = ops.weighted_sum([wrapped, wrapped], [0.5, 0.25])  # the subclass's own dispatch unwraps them
    assert torch.equal(got, 0.75 * torch.arange(8, dtype=torch.float64))  # exact: small integers times 2^-2
    assert torch.equal(ops.row_norms(_Wrapper(torch.full((2, 4), 3.0))), torch.full((2,), 6.0))
    rows = torch.tensor([[3.0, 4.0], [0.6, 0.8]], dtype=torch.float64)  # norms 5 and 1: clipped to 2, kept
    clipped = ops.clip_accumulate(_Wrapper(rows), 2.0)
    assert torch.allclose(clipped, torch.tensor([1.8, 2.4], dtype=torch.float64), rtol=1e-15, atol=0)
    noisy = _Wrapper(torch.zeros(6, dtype=torch.float64))
    ops.gaussian_noise_(noisy, 1.0, 3, 1)  # written through the wrapper's dispatch: the numbers of a plain tensor
    assert torch.equal(noisy.elem, ops.gaussian_noise_(torch.zeros(6, dtype=torch.float64), 1.0, 3, 1))
    with pytest.raises(TypeError, match=r"updates\[0\] is a _Wrapper tensor without memory of its own"):
        _arrays.describe(wrapped, "updates[0]")  # what the direct path would say


_SUBCLASS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from pyfedkern import ops

    class Tagged(torch.Tensor):  # a subclass defined outside torch, as users write them
        pass

    def outcome(x):
        try:
            return ops.weighted_sum([x, 2 * x.as_subclass(torch.Tensor)], [0.5, 0.25]).tolist()
        except TypeError as exc:
            return str(exc)

    tagged = torch.arange(4, dtype=torch.float64).as_subclass(Tagged)
    parameter = torch.nn.Parameter(torch.arange(4, dtype=torch.float64))
    order = sys.argv[1].split(",")
    first = {"plain": torch.arange(4, dtype=torch.float64), "tagged": tagged, "parameter": parameter}
    print(json.dumps([outcome(first[name]) for name in order]))
    """
)


@pytest.mark.parametrize("order", ["tagged,plain,tagged", "plain,tagged", "parameter,tagged,plain"])
def test_a_tensor_subclass_is_accepted_whether_or_not_it_is_the_first_tensor_seen(order, tmp_path):
    proc = subprocess.run(  # in tmp_path: `python -c` would import a source checkout in the cwd, not the built package
        [sys.executable, "-c", _SUBCLASS_SCRIPT, order],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[0.0, 1.0, 2.0, 3.0]] * len(order.split(","))
