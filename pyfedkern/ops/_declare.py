"""Each op's declaration for PyTorch: schema, fake function, native entry point and autograd, in one place.

An op module declares its op once with :func:`declare`: the torch schema, the function that runs it on real
tensors (the op's own checked direct path, which numpy and cupy callers use too), the fake function that gives
the output shapes and dtypes without running anything, and, for a differentiable op, its autograd formula.
:func:`register` (called once by ``pyfedkern.ops`` at import, after every op module has declared its ops) builds
``torch.ops.pyfedkern.<name>`` from every declaration with ``torch.library`` (Python registration: the extension
never links libtorch).

The public op keeps its direct path in eager mode and takes the registered operator only when it must
(:func:`operator_needed`): inside ``torch.compile``/``torch.export`` (``traced``), inside a ``torch.func``
transform (``vmap``, ``grad``: its wrapped tensors have no memory the kernels could read), for a tensor of a
subclass (fake tensors, wrapper subclasses, users' own: the dispatcher hands them to their own handlers), and, for a
differentiable op, when a torch input requires grad with grad mode on (:func:`use_operator`). A non-differentiable
op refuses such inputs (:func:`refuse_grad`) instead of returning a result detached from the graph.

An op may also declare an inductor lowering: the same math built from inductor's own lowerings, so that the
inductor backend of ``torch.compile`` fuses it with the torch code around it (the FedSpeed step's update into
the kernels that assemble the gradients) instead of calling the opaque kernel. The operator still appears in the
traced graph (``torch.export``, ``aot_eager`` and the graph inductor receives all hold it); the lowering only
changes the code inductor generates for it, and hands the call back to the kernel where it does not apply.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OpDecl:
    """One op: ``torch.ops.pyfedkern.<name>`` with ``schema``, run by ``native`` (the checked direct path) on CPU
    and CUDA tensors, traced with ``fake``; differentiable through ``backward`` when given; ``lowering(*args)``
    (the schema's arguments as inductor IR) builds the op from inductor's lowerings and returns True, or returns
    False to leave the call to the kernel."""

    name: str
    schema: str
    native: Callable[..., Any]
    fake: Callable[..., Any]
    mutates: tuple[str, ...] = ()
    setup_context: Callable[..., Any] | None = None
    backward: Callable[..., Any] | None = None
    lowering: Callable[..., bool] | None = None


DECLARED: dict[str, OpDecl] = {}


def declare(
    name: str,
    schema: str,
    *,
    fake: Callable[..., Any],
    mutates: tuple[str, ...] = (),
    setup_context: Callable[..., Any] | None = None,
    backward: Callable[..., Any] | None = None,
    lowering: Callable[..., bool] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of an op's native entry point (arguments as in ``schema``): records the op's declaration."""

    def record(native: Callable[..., Any]) -> Callable[..., Any]:
        DECLARED[name] = OpDecl(name, schema, native, fake, mutates, setup_context, backward, lowering)
        return native

    return record


traced = torch.compiler.is_compiling  # whether the caller is traced by torch.compile (Dynamo) or torch.export
grad_enabled = torch.is_grad_enabled  # (in a backward formula: whether it runs with create_graph)
_transform_level = torch._C._functorch.maybe_current_level  # None outside torch.func transforms (vmap, grad, ...)
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a torch formula accumulates a tensor of t's dtype in: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def is_tensor(x: Any) -> bool:
    """Whether x is a torch tensor."""
    return isinstance(x, _Tensor)


def _requires_grad(x: Any) -> bool:
    """Whether x (a tensor, or a list or tuple of them) holds a torch tensor that requires grad."""
    if isinstance(x, _Tensor):
        return x.requires_grad
    if type(x) is list or type(x) is tuple:
        for t in x:
            if type(t) is not float and isinstance(t, _Tensor) and t.requires_grad:
                return True
    return False


def _any_requires_grad(xs: tuple[Any, ...]) -> bool:
    """Whether a torch tensor among ``xs``, or in a list or tuple among them, requires grad. Every eager call pays
    this loop: the common arguments are told apart by their type, without a call per argument, and floats and lists
    of floats (one C-level pass over their types) never reach ``isinstance(·, Tensor)``, which is slow when it
    fails."""
    for x in xs:
        kind = type(x)
        if kind is float or x is None:  # the scalars and absent operands most arguments are: passed first
            continue
        if kind is list or kind is tuple:
            if x and (type(x[0]) is not float or len(set(map(type, x))) > 1) and _requires_grad(x):
                return True
        elif isinstance(x, _Tensor) and x.requires_grad:
            return True
    return False


def _operand_wants_operator(xs: tuple[Any, ...] | list[Any], grad: bool) -> bool:
    """Whether a torch tensor among ``xs`` (or in a list or tuple among them) is of a subclass (Tensor and Parameter
    are not), or, with ``grad``, requires grad. Told apart by type as :func:`_any_requires_grad` does."""
    for x in xs:
        kind = type(x)
        if kind is float or x is None:
            continue
        if kind is _Tensor or kind is _Parameter:
            if grad and x.requires_grad:
                return True
        elif kind is list or kind is tuple:
            if x and (type(x[0]) is not float or len(set(map(type, x))) > 1) and _operand_wants_operator(x, grad):
                return True
        elif isinstance(x, _Tensor):
            return True
    return False


def operator_needed(*xs: Any) -> bool:
    """Whether an op called with ``xs`` (its torch operands, or lists of them) must take its registered operator:
    when traced, inside a ``torch.func`` transform, or for a tensor of a subclass (a fake tensor, a wrapper
    subclass, a user's subclass: the dispatcher runs the op through the subclass's own handlers). Plain tensors in
    eager mode keep the direct path."""
    return traced() or _transform_level() is not None or _operand_wants_operator(xs, False)


def use_operator(*xs: Any) -> bool:
    """Whether a differentiable op takes its registered operator: when :func:`operator_needed`, or when one of ``xs``
    (or a tensor in a list among them) requires grad while grad mode is on. Eager calls of plain tensors without
    grad keep the direct path."""
    return traced() or _transform_level() is not None or _operand_wants_operator(xs, grad_enabled())


def refuse_grad(op: str, names: tuple[str, ...], *xs: Any) -> None:
    """ValueError naming the argument when a torch input ``names``/``xs`` that ``op`` is not differentiable in
    (all of a non-differentiable op's inputs; a differentiable op's scalars) requires grad while grad mode is on:
    the gradient through it would silently be lost."""
    if not (grad_enabled() and _any_requires_grad(xs)):
        return
    for name, x in zip(names, xs, strict=True):
        if _requires_grad(x):
            raise ValueError(
                f"{op}: {name} requires grad, but {op} is not differentiable in {name} (no gradient would reach "
                "it); call it under torch.no_grad() or pass .detach()"
            )


def checks_only(check: Callable[..., Any]) -> Callable[..., None]:
    """The fake function of an op that returns nothing (an in-place op): ``check``, the direct path's operand checks
    (fake tensors are described with pointer 0, see ``pyfedkern._arrays``), so that a traced call raises the errors
    of an eager one."""

    def fake(*args: Any) -> None:
        check(*args)

    return fake


def torch_op(name: str) -> Any:
    """``torch.ops.pyfedkern.<name>``."""
    return getattr(torch.ops.pyfedkern, name)


_LIBRARY: list[torch.library.Library] = []  # keeps the registrations alive


def register() -> None:
    """Register every declared op as ``torch.ops.pyfedkern.<name>`` (pyfedkern.ops does it once, at import).

    The low-level ``torch.library`` API, so that the dispatcher calls the native entry point itself: in-place ops add
    one small kernel that bumps the version counters of what they write, differentiable ops their autograd formula.
    (``torch.library.custom_op`` wraps every call in Python layers for autograd, version counters and Dynamo that
    cost several times the native call, which a compiled training step pays at every step.)"""
    lib = torch.library.Library("pyfedkern", "FRAGMENT")
    _LIBRARY.append(lib)
    for decl in DECLARED.values():
        qualname = f"pyfedkern::{decl.name}"
        lib.define(decl.name + decl.schema)
        native = torch._disable_dynamo(decl.native)  # a kernel run while Dynamo compiles is not traced into
        lib.impl(decl.name, native, "CPU")
        lib.impl(decl.name, native, "CUDA")
        fake = decl.fake if decl.lowering is None else _registering_lowerings(decl.fake)
        torch.library.register_fake(qualname, fake, lib=lib)
        op = torch_op(decl.name).default  # also lists the op in dir(torch.ops.pyfedkern)
        if decl.mutates:
            lib.impl(decl.name, _version_bump(op), "ADInplaceOrView", with_keyset=True)
        if decl.backward is not None:
            torch.library.register_autograd(qualname, decl.backward, setup_context=decl.setup_context, lib=lib)


def _version_bump(op: Any) -> Callable[..., Any]:
    """The ADInplaceOrView kernel of the in-place op ``op``: bump the version counter of every tensor its schema
    marks as written (as torch's own in-place ops do), then run the op's kernel below that key."""
    written = [(i, a.name) for i, a in enumerate(op._schema.arguments) if a.alias_info and a.alias_info.is_write]
    below = torch._C._after_ADInplaceOrView_keyset
    increment_version = torch.autograd.graph.increment_version

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        for i, name in written:
            t = args[i] if i < len(args) else kwargs.get(name)
            if t is not None:
                increment_version(t)
        return op.redispatch(keyset & below, *args, **kwargs)

    return kernel


_lowered = False  # whether inductor has the declared lowerings


def _registering_lowerings(fake: Callable[..., Any]) -> Callable[..., Any]:
    """``fake`` that first hands inductor the declared lowerings, once inductor is loaded. Every compilation runs
    the fake functions (AOTAutograd's trace inside inductor's compile_fx among them) before inductor lowers the
    graph, and pyfedkern never imports inductor itself (seconds of import time) just for this."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not _lowered and "torch._inductor.lowering" in sys.modules:
            _register_lowerings()
        return fake(*args, **kwargs)

    return run


def _register_lowerings() -> None:
    """Register each declared lowering with inductor, falling back to the op's kernel where it returns False."""
    global _lowered
    from torch._inductor import lowering as inductor

    for decl in DECLARED.values():
        if decl.lowering is not None:
            op = torch_op(decl.name).default
            kernel = inductor.fallback_handler(op, add_to_fallback_set=False)
            inductor.register_lowering(op, type_promotion_kind=None)(
                functools.partial(_lower_or_call, decl.lowering, kernel)
            )
    _lowered = True


def _lower_or_call(lowering: Callable[..., bool], kernel: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return None if lowering(*args, **kwargs) else kernel(*args, **kwargs)
