"""Feature-norm ops: per-class mean feature norms (FNR-FL's statistic) and per-sample gradient norms.

``class_feature_norms`` reads a [B, D] feature matrix once and returns every row's L2 norm, the per-class sum and
mean of the norms (a segmented reduction by label, summed in a fixed order: the same bits for any number of CPU
threads) and the class counts; given logits it also counts the correct top-1 predictions. For torch tensors that
require grad it is differentiable with respect to the features through a native backward kernel (the registered
operators ``torch.ops.pyfedkern.class_feature_norms`` and ``class_feature_norms_backward``); ``row_norms`` is
differentiable too.

``per_sample_grad_norms`` gives the [B] norms of one Linear/Conv2d layer's per-sample gradients from the layer's
input activations and output gradients, without building the [B, P] per-sample gradients (see
:func:`pyfedkern.persample.grad_norms` for a whole model).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pyfedkern import _arrays
from pyfedkern._arrays import ArrayRef
from pyfedkern._runtime import native
from pyfedkern.ops import _declare

LABEL_DTYPES = ("int32", "int64")
_INT_DTYPES = ("int8", "int16", "uint8", "uint16", "uint32", "uint64")


class FeatureNorms(NamedTuple):
    """Result of :func:`class_feature_norms` (arrays of the caller's library and device).

    Attributes:
        norms: [B] L2 norm of each feature row (features' dtype).
        class_sum: [C] sum of the norms of the rows of each class (features' dtype).
        class_mean: [C] mean norm of each class; **0.0 for a class with no rows** (never NaN).
        counts: [C] int64 number of rows of each class.
        correct: 0-d int64 count of rows whose logits' argmax (first maximum, NaN counts as maximum) equals the
            label, or None when no logits were given.
    """

    norms: Any
    class_sum: Any
    class_mean: Any
    counts: Any
    correct: Any


def _check_features(features: Any, name: str = "features") -> ArrayRef:
    ref = _arrays.describe(features, name)
    if len(ref.shape) != 2:
        raise ValueError(f"{name} must be a 2-D [B, D] array, got shape {ref.shape}")
    _arrays.check_float_dtype(ref, name)
    if ref.shape[0] == 0 or ref.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {ref.shape}); need B >= 1 rows and D >= 1 columns")
    return ref


#: largest num_classes: labels of int32 reach it, and its [C] outputs already take 48 GiB (beyond it numpy and torch
#: fail to allocate them with errors that do not name num_classes)
MAX_CLASSES = 2**31 - 1


def _check_num_classes(num_classes: Any) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be an integer >= 1, got {num_classes!r}")
    if num_classes > MAX_CLASSES:
        raise ValueError(f"num_classes must be at most 2**31 - 1 = {MAX_CLASSES}, got {num_classes}")
    return int(num_classes)


def _prepare_labels(labels: Any, feats: ArrayRef, num_classes: int) -> tuple[Any, ArrayRef]:
    """labels as an int32/int64 1-D array of length B on the features' library/device (small ints are widened)."""
    ref = _arrays.describe(labels, "labels")
    if ref.lib != feats.lib or ref.device != feats.device:
        raise ValueError(f"labels is a {ref.where} array but features is a {feats.where} array; mixing is not allowed")
    if ref.dtype not in LABEL_DTYPES + _INT_DTYPES:
        raise TypeError(f"labels must have an integer dtype (int32 or int64), got {ref.dtype}")
    if ref.shape != (feats.shape[0],):
        raise ValueError(f"labels must have shape ({feats.shape[0]},) (one per feature row), got {ref.shape}")
    if ref.dtype not in LABEL_DTYPES:
        if ref.dtype in ("uint32", "uint64") and ref.device < 0 and ref.size:  # 2^63 and above would wrap to < 0
            top = int(labels.max())
            if top >= num_classes:
                raise ValueError(f"labels contain {top}, out of range [0, {num_classes})")
        labels = labels.astype(np.int64) if ref.lib != "torch" else labels.long()
        ref = _arrays.describe(labels, "labels")
    return labels, ref  # the range is checked by the kernels (on a GPU without a host round trip)


def _check_logits(logits: Any, feats: ArrayRef, num_classes: int) -> ArrayRef:
    ref = _arrays.describe(logits, "logits")
    _arrays.check_same(ref, feats, "logits", "features")
    if ref.shape != (feats.shape[0], num_classes):
        raise ValueError(
            f"logits must have shape ({feats.shape[0]}, {num_classes}) ([B, num_classes]), got {ref.shape}"
        )
    return ref


def _acc_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def _forward(feats: ArrayRef, labels: ArrayRef | None, num_classes: int, logits: ArrayRef | None) -> FeatureNorms:
    B, D = feats.shape
    norms = _arrays.empty_like_lib(feats, (B,))
    class_sum = class_mean = counts = correct = None
    if labels is not None:
        class_sum = _arrays.empty_like_lib(feats, (num_classes,))
        class_mean = _arrays.empty_like_lib(feats, (num_classes,))
        counts = _arrays.empty_like_lib(feats, (num_classes,), "int64")
    if logits is not None:
        correct = _arrays.empty_like_lib(feats, (), "int64")

    def ptr(x: Any) -> int:
        return 0 if x is None else _arrays.data_ptr(x)

    _arrays.call_native(
        native().class_feature_norms,
        feats,
        feats.device,
        _arrays.stream_handle(feats),
        feats.dtype,
        B,
        D,
        feats.ptr,
        feats.strides[0],
        feats.strides[1],
        0 if labels is None else labels.ptr,
        "" if labels is None else labels.dtype,
        0 if labels is None else labels.strides[0],
        num_classes if labels is not None else 0,
        0 if logits is None else logits.ptr,
        0 if logits is None else logits.strides[0],
        0 if logits is None else logits.strides[1],
        ptr(norms),
        ptr(class_sum),
        ptr(class_mean),
        ptr(counts),
        ptr(correct),
    )
    return FeatureNorms(norms, class_sum, class_mean, counts, correct)


def _backward(feats: ArrayRef, labels: ArrayRef, num_classes: int, grad_norms: Any, class_coef: Any) -> Any:
    """grad_f[r] = (grad_norms[r] + class_coef[labels[r]])·f[r]/‖f[r]‖ via the native kernel (torch tensors)."""
    B, D = feats.shape
    grad = _arrays.empty_like_lib(feats, (B, D))
    gn = _arrays.describe(grad_norms, "grad_norms").ptr if grad_norms is not None else 0
    cc = _arrays.describe(class_coef, "class_coef").ptr if class_coef is not None else 0
    native().class_feature_norms_backward(
        feats.device,
        _arrays.stream_handle(feats),
        feats.dtype,
        B,
        D,
        feats.ptr,
        feats.strides[0],
        feats.strides[1],
        labels.ptr,
        labels.dtype,
        labels.strides[0],
        num_classes,
        gn,
        cc,
        _arrays.describe(grad, "grad").ptr,
    )
    return grad


def _class_norms_fake(features: Any, labels: Any, num_classes: int, logits: Any) -> tuple:
    _class_norms_operands(features, labels, num_classes, logits)
    C = num_classes
    per_class = features.new_empty((C,))
    counts = labels.new_empty((C,)).long()
    return features.new_empty(features.shape[:1]), per_class, per_class.clone(), counts, counts.new_empty(())


def _class_norms_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    features, labels, num_classes, _ = inputs
    ctx.save_for_backward(features, labels, output[3])
    ctx.num_classes = num_classes
    ctx.mark_non_differentiable(output[3], output[4])


def _class_norms_backward(ctx: Any, g_norms: Any, g_sum: Any, g_mean: Any, *_: Any) -> tuple:
    """∂/∂f_r = (g_norms[r] + g_sum[y_r] + g_mean[y_r]/n_{y_r})·f_r/‖f_r‖ (0 for an all-zero row): the native kernel,
    or with ``create_graph`` (grad mode on here) the same formula in torch ops, so that it can be differentiated
    again."""
    features, labels, counts = ctx.saved_tensors
    acc = _declare.accumulation_dtype(features)
    grad_norms = None if g_norms is None else g_norms.to(acc).contiguous()
    class_coef = None
    if g_sum is not None or g_mean is not None:
        class_coef = features.new_zeros((ctx.num_classes,), dtype=acc)
        if g_sum is not None:
            class_coef = class_coef + g_sum.to(acc)
        if g_mean is not None:
            class_coef = class_coef + g_mean.to(acc) / counts.clamp(min=1).to(acc)
    if grad_norms is None and class_coef is None:
        return None, None, None, None
    if _declare.grad_enabled():
        coef = class_coef[labels] if class_coef is not None else 0.0
        coef = coef + grad_norms if grad_norms is not None else coef
        f = features.to(acc)
        norms = f.norm(dim=1, keepdim=True)
        unit = f / norms.where(norms > 0, 1.0) * (norms > 0)
        return (coef[:, None] * unit).to(features.dtype), None, None, None
    backward = _declare.torch_op("class_feature_norms_backward")
    return backward(features, labels, ctx.num_classes, grad_norms, class_coef), None, None, None


@_declare.declare(
    "class_feature_norms",
    "(Tensor features, Tensor labels, int num_classes, Tensor? logits) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_class_norms_fake,
    setup_context=_class_norms_setup,
    backward=_class_norms_backward,
)
def _class_norms_native(features: Any, labels: Any, num_classes: int, logits: Any) -> tuple:
    """The operator's outputs: ``correct`` is always a 0-d tensor (0 without logits; the public op gives None)."""
    result = _class_feature_norms(features, labels, num_classes, logits)
    correct = result.correct if result.correct is not None else result.counts.new_zeros(())
    return result.norms, result.class_sum, result.class_mean, result.counts, correct


@_declare.declare(
    "class_feature_norms_backward",
    "(Tensor features, Tensor labels, int num_classes, Tensor? grad_norms, Tensor? class_coef) -> Tensor",
    fake=lambda features, *_: features.new_empty(features.shape),
)
def _class_norms_backward_native(features: Any, labels: Any, num_classes: int, grad_norms: Any, class_coef: Any) -> Any:
    """∂/∂features of Σ grad_norms·norms + Σ_r class_coef[labels[r]]·norms[r] (grad_norms, class_coef in the
    accumulation dtype, contiguous, on the features' device)."""
    feats = _check_features(features)
    return _backward(feats, _arrays.describe(labels, "labels"), num_classes, grad_norms, class_coef)


def class_feature_norms(features: Any, labels: Any, num_classes: int, logits: Any = None) -> FeatureNorms:
    """Row L2 norms of ``features`` and their per-class sums, means and counts, in one pass over the features.

    Args:
        features: [B, D] float array (numpy, torch CPU/CUDA or cupy; float32/float64/float16/bfloat16, any
            strides). 16-bit inputs are accumulated in float32, per-class sums in float64.
        labels: [B] integer array (int32/int64; smaller integer types are widened) on the features' device, every
            value in [0, num_classes); float or bool labels raise TypeError. An out-of-range value raises
            ValueError on the CPU; on a GPU, where raising would need a host round trip, it makes every class_sum
            and class_mean NaN and every count (and ``correct``) -1, and its row's gradient NaN.
        num_classes: 1 ≤ C ≤ 2**31 − 1.
        logits: optional [B, C] array of the features' library, device and dtype; when given, ``correct`` counts
            the rows whose argmax equals the label (FNR-FL's public-set accuracy).

    Returns:
        :class:`FeatureNorms` (norms [B], class_sum [C], class_mean [C], counts [C] int64, correct 0-d int64 or
        None). A class with no rows has count 0, sum 0.0 and mean 0.0. For torch features that require grad the
        norms, sums and means are differentiable (∂‖f‖/∂f = f/‖f‖, taken as 0 for an all-zero row).
    """
    _declare.refuse_grad("class_feature_norms", ("logits",), logits)
    if _declare.use_operator(features, labels, logits):
        if _declare.is_tensor(labels) and str(labels.dtype).removeprefix("torch.") in _INT_DTYPES:
            labels = labels.long()  # small integer labels are widened (the backward kernel reads int32/int64)
        result = _declare.torch_op("class_feature_norms")(features, labels, num_classes, logits)
        return FeatureNorms(*result[:4], result[4] if logits is not None else None)
    return _class_feature_norms(features, labels, num_classes, logits)


def _class_feature_norms(features: Any, labels: Any, num_classes: int, logits: Any) -> FeatureNorms:
    """The direct path of :func:`class_feature_norms` (any library)."""
    return _forward(*_class_norms_operands(features, labels, num_classes, logits))


def _class_norms_operands(features: Any, labels: Any, num_classes: Any, logits: Any) -> tuple:
    """The checked (features, labels, num_classes, logits or None) of :func:`class_feature_norms` (direct path and
    fake function)."""
    feats = _check_features(features)
    C = _check_num_classes(num_classes)
    lab = _prepare_labels(labels, feats, C)[1]
    return feats, lab, C, None if logits is None else _check_logits(logits, feats, C)


def row_norms(x: Any) -> Any:
    """[B] L2 norms of the rows of a [B, D] float array, in the caller's library, device and dtype.

    Torch: differentiable (∂‖x_r‖/∂x_r = x_r/‖x_r‖, taken as 0 for an all-zero row).
    """
    if _declare.use_operator(x):
        return _declare.torch_op("row_norms")(x)
    return _row_norms(x)


def _row_norms_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(inputs[0], output)


def _row_norms_backward(ctx: Any, grad: Any) -> Any:
    x, norms = ctx.saved_tensors
    acc = _declare.accumulation_dtype(x)
    n = norms.to(acc)
    scale = (grad.to(acc) / n.masked_fill(n == 0, 1)).masked_fill(n == 0, 0)
    return (x.to(acc) * scale[:, None]).to(x.dtype)


def _row_norms_fake(x: Any) -> Any:
    _check_features(x, "x")
    return x.new_empty(x.shape[:1])


@_declare.declare(
    "row_norms",
    "(Tensor x) -> Tensor",
    fake=_row_norms_fake,
    setup_context=_row_norms_setup,
    backward=_row_norms_backward,
)
def _row_norms(x: Any) -> Any:
    return _forward(_check_features(x, "x"), None, 0, None).norms


# Per-sample gradient norms ---------------------------------------------------------------------------------

#: Elements one batch chunk's temporaries (unfolded conv input + Gram, or per-sample weight gradients) may take:
#: 16 MiB of float32 on the CPU, 64 MiB on a GPU (fewer, larger launches); small next to a CNN's activations.
_CHUNK_ELEMENTS = {"cpu": 1 << 22, "gpu": 1 << 24}


def _chunk_elements(x: Any) -> int:
    return _CHUNK_ELEMENTS["gpu" if x.is_cuda else "cpu"]


def per_sample_grad_norms(layer: Any, activations: Any, grad_outputs: Any, *, squared: bool = False) -> Any:
    """[B] norms of the per-sample gradients of one ``nn.Linear`` or ``nn.Conv2d`` layer (weight and bias).

    Args:
        layer: the module (only its kind, shape hyper-parameters and which parameters require grad are read).
        activations: the layer's input, [B, in] or [B, ..., in] for Linear, [B, C_in, H, W] for Conv2d.
        grad_outputs: ∂ℓ_n/∂(layer output) of each sample's own loss, shaped like the layer's output.
        squared: return squared norms (summable across layers).

    Linear with 2-D inputs uses ‖∇W‖ = ‖g_n‖·‖a_n‖ (plus ‖g_n‖² for the bias). Sequence inputs and Conv2d (T
    output positions, C_in·k·k inputs per position) use the Gram form ⟨g gᵀ, a aᵀ⟩ (cost ∝ T²·(in + out)) or the
    per-sample weight gradient (cost ∝ T·in·out), whichever is cheaper, in batch chunks of bounded memory. A
    Conv2d's Gram form unfolds its input one chunk at a time; its per-sample weight gradients are one grouped
    weight-gradient convolution per chunk (one group per sample, no unfolded input). Never builds the [B, P]
    per-sample gradients of the model.

    Built from torch operations and :func:`row_norms` (not an operator of its own: it takes a module), it is
    traced by ``torch.compile`` as it stands and is differentiable with respect to ``activations`` and
    ``grad_outputs`` (e.g. for a penalty on gradient norms) wherever the norms are non-zero.
    """
    import torch
    from torch import nn

    if not isinstance(activations, torch.Tensor) or not isinstance(grad_outputs, torch.Tensor):
        raise TypeError("per_sample_grad_norms: activations and grad_outputs must be torch tensors")
    if activations.dim() == 0 or grad_outputs.dim() == 0:
        raise ValueError(
            "per_sample_grad_norms: activations and grad_outputs need a batch dimension, got shapes "
            f"{tuple(activations.shape)} and {tuple(grad_outputs.shape)}"
        )
    if activations.shape[0] != grad_outputs.shape[0]:
        raise ValueError(
            f"activations and grad_outputs must have the same batch size, got {activations.shape[0]} and "
            f"{grad_outputs.shape[0]}"
        )
    if not isinstance(layer, (nn.Linear, nn.Conv2d)):
        raise TypeError(
            f"per_sample_grad_norms supports nn.Linear and nn.Conv2d layers, got {type(layer).__qualname__}"
        )
    if activations.shape[0] == 0:
        return activations.new_zeros(0)  # an empty batch
    if isinstance(layer, nn.Linear):
        sq = _linear_sq_norms(layer, activations, grad_outputs)
    else:
        sq = _conv2d_sq_norms(layer, activations, grad_outputs)
    return sq if squared else sq.sqrt()


def _wants(param: Any) -> bool:
    return param is not None and param.requires_grad


def _sq_rows(x: Any) -> Any:
    """Squared row norms of a 2-D torch tensor, via the native row-norm kernel for float dtypes."""
    if x.dtype.is_floating_point and x.shape[1] > 0:
        n = row_norms(x)
        return n * n
    return (x * x).sum(1)


def _linear_sq_norms(layer: Any, a: Any, g: Any) -> Any:
    if a.shape[-1] != layer.in_features or g.shape[-1] != layer.out_features:
        raise ValueError(
            f"Linear({layer.in_features}, {layer.out_features}): activations [..., {a.shape[-1]}] / grad_outputs "
            f"[..., {g.shape[-1]}] do not match"
        )
    if a.dim() == 2:
        import torch

        g_sq, weight, bias = _sq_rows(g), _wants(layer.weight), _wants(layer.bias)
        if weight and bias:
            return torch.addcmul(g_sq, g_sq, _sq_rows(a))  # ‖g‖²·(‖a‖² + 1) in one launch
        if weight:
            return g_sq * _sq_rows(a)
        return g_sq if bias else g_sq.new_zeros(g_sq.shape)
    B = a.shape[0]
    return _sequence_sq_norms(a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1]), layer.weight, layer.bias)


def _conv2d_sq_norms(layer: Any, a: Any, g: Any) -> Any:
    import torch.nn.functional as F

    if layer.groups != 1 or layer.padding_mode != "zeros":
        raise ValueError(
            f"per_sample_grad_norms: Conv2d with groups={layer.groups}, padding_mode={layer.padding_mode!r} is not "
            "supported (groups=1, padding_mode='zeros' only)"
        )
    if a.dim() != 4 or g.dim() != 4 or a.shape[1] != layer.in_channels or g.shape[1] != layer.out_channels:
        raise ValueError(
            f"Conv2d({layer.in_channels}, {layer.out_channels}): expected activations [B, {layer.in_channels}, H, W] "
            f"and grad_outputs [B, {layer.out_channels}, H', W'], got {tuple(a.shape)} and {tuple(g.shape)}"
        )
    pad_same = layer.padding == "same"
    padding = 0 if isinstance(layer.padding, str) else layer.padding

    def unfold(x: Any) -> Any:
        """[c, C_in·kh·kw, T] patches of a chunk of inputs (padded per chunk for padding='same')."""
        if pad_same:
            x = F.pad(x, layer._reversed_padding_repeated_twice)
        return F.unfold(x, layer.kernel_size, dilation=layer.dilation, padding=padding, stride=layer.stride)

    B, o = g.shape[0], g.shape[1]
    patch = layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1]
    if pad_same:  # (stride 1)
        out_hw = tuple(a.shape[2:])
    else:
        pads = (0, 0) if isinstance(layer.padding, str) else layer.padding  # 'valid'
        sizes = zip(a.shape[2:], pads, layer.dilation, layer.kernel_size, layer.stride, strict=True)
        out_hw = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, p, d, k, s in sizes)
    if tuple(g.shape[2:]) != out_hw:
        raise ValueError(
            f"grad_outputs spatial size {tuple(g.shape[2:])} does not match the layer's output {out_hw} for inputs "
            f"{tuple(a.shape[2:])}"
        )
    T = out_hw[0] * out_hw[1]
    g_flat = g.reshape(B, o, T)
    total = _sq_rows(g_flat.sum(2)) if _wants(layer.bias) else g.new_zeros(B)
    if not _wants(layer.weight):
        return total
    if gram_is_cheaper(T, patch, o):
        return total + _weight_sq_norms(
            B,
            T,
            patch,
            o,
            lambda start, stop: (unfold(a[start:stop]).transpose(1, 2), g_flat[start:stop].transpose(1, 2)),
            _chunk_elements(a),
        )
    if pad_same:
        a = F.pad(a, layer._reversed_padding_repeated_twice)
    return total + _conv2d_grouped_sq_norms(layer, a, g, padding)


def _conv2d_grouped_sq_norms(layer: Any, a: Any, g: Any, padding: Any) -> Any:
    """[B] squared norms of a Conv2d's per-sample weight gradients, [c, C_out, C_in, kh, kw] per batch chunk of c
    samples, each chunk as one weight-gradient convolution with one group per sample (input a [B, C_in, H, W],
    already padded for padding='same'; g [B, C_out, H', W'])."""
    import torch

    B, c_in, H, W = a.shape
    o = g.shape[1]
    weight_shape = (o, c_in, *layer.kernel_size)
    size = max(1, min(B, _chunk_elements(a) // (o * c_in * layer.kernel_size[0] * layer.kernel_size[1])))
    parts = []
    for start in range(0, B, size):
        aa, gg = a[start : start + size], g[start : start + size]
        c = aa.shape[0]
        grads = torch.nn.grad.conv2d_weight(
            aa.reshape(1, c * c_in, H, W),
            (c * o, *weight_shape[1:]),
            gg.reshape(1, c * o, *g.shape[2:]),
            stride=layer.stride,
            padding=padding,
            dilation=layer.dilation,
            groups=c,
        )
        parts.append(_sq_rows(grads.reshape(c, -1)))
    return torch.cat(parts)


def _sequence_sq_norms(a: Any, g: Any, weight: Any, bias: Any) -> Any:
    """Squared per-sample norms of Σ_t g_tᵀ a_t (weight) and Σ_t g_t (bias) for a [B, T, i], g [B, T, o]."""
    B, T, i = a.shape
    total = _sq_rows(g.sum(1)) if _wants(bias) else g.new_zeros(B)
    if _wants(weight):
        total += _weight_sq_norms(
            B, T, i, g.shape[2], lambda start, stop: (a[start:stop], g[start:stop]), _chunk_elements(a)
        )
    return total


def _weight_sq_norms(B: int, T: int, i: int, o: int, chunk: Any, budget: int) -> Any:
    """[B] squared norms of the per-sample weight gradients Σ_t g_tᵀ a_t, batch chunk by batch chunk.

    ``chunk(start, stop)`` returns that chunk's a [c, T, i] and g [c, T, o] (built per chunk, e.g. an unfolded
    conv input, so that no temporary of the whole batch exists); chunks are sized so that a chunk's inputs and
    products stay within ``budget`` elements.
    """
    import torch

    gram = gram_is_cheaper(T, i, o)
    per_sample = T * i + (2 * T * T if gram else i * o)
    size = max(1, min(B, budget // per_sample))
    parts = []
    for start in range(0, B, size):
        aa, gg = chunk(start, min(B, start + size))
        if gram:
            sq = torch.einsum("bst,bst->b", torch.bmm(gg, gg.transpose(1, 2)), torch.bmm(aa, aa.transpose(1, 2)))
        else:
            grad = torch.bmm(gg.transpose(1, 2), aa)
            sq = torch.einsum("boi,boi->b", grad, grad)
        parts.append(sq)
    return torch.cat(parts)


def gram_is_cheaper(T: int, in_features: int, out_features: int) -> bool:
    """Whether the Gram form (T²·(in+out)) beats per-sample materialisation (T·in·out) for a [T, in] input."""
    return T * (in_features + out_features) < in_features * out_features
