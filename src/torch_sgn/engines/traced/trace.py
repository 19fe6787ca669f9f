"""Tracing for the traced engine: the model, the loss, the gradient and ``G v`` as one graph
of ATen operators (``make_fx`` on fake tensors), with ``J v`` by forward mode where the model's
operators allow it (:data:`ROUTES`).

:func:`trace_product` records ``(theta, v, buffers, frozen, inputs, targets) -> (loss, g, z,
G v)``, :func:`trace_value` the loss alone (the trial points of a captured step). While
tracing, attention uses PyTorch's math kernel and recurrent layers their non-mkldnn kernels
(:func:`_plain_kernels`): the fused kernels have no forward-mode rules, the math is the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, fx, nn
from torch.func import functional_call

from ...losses import OutputLoss
from ...model.flat_model import ConstantOutputError, FunctionalModel, check_depends
from ...model.forward_mode import NESTED_FORWARD, missing_rule
from .jvp_rules import TangentRules
from .opaque_loss import OpaqueLoss, value_and_grad
from .passes import views_as_reshapes

__all__ = [
    "ROUTES",
    "Recording",
    "Traced",
    "Untraceable",
    "inputs_of",
    "reason",
    "trace_product",
    "trace_value",
]


#: record the products with the tangent formulas of :mod:`torch_sgn.engines.traced.jvp_rules` (PyTor
#: own forward-mode rules where False; the products are the same)
TANGENT_RULES = True


class Untraceable(Exception):
    """The model cannot be traced into one graph; the message says why."""


@dataclass(eq=False)  # (compared and hashed by identity: the engine keys its replays by it)
class Traced:
    """A product split in two graphs, with what it needs to be called."""

    setup: fx.GraphModule  # (theta, buffers, frozen, inputs, targets) -> (loss, g, z, *saved)
    product: fx.GraphModule  # (v, *saved) -> G v
    double_backward: bool  # J v through the reverse pass (an operator has no forward rule)
    declined: Optional[str] = None  # why the tangent rules were not used, where they failed
    missing: Optional[str] = None  # the operator without a forward-mode rule (double backward)
    compiled: Optional[Tuple[Callable, Callable]] = None  # set-up and product (compile=True)
    not_captured: Optional[str] = None  # why graphs do not apply ("": they do; None: not asked)
    route: str = "forward"  # how J v was traced (one of ROUTES)


@dataclass
class Recording:
    """The whole product as traced, before it is rewritten and split."""

    graph: fx.GraphModule  # (theta, v, buffers, frozen, inputs, targets) -> (loss, g, z, G v)
    route: str  # how J v was traced (one of ROUTES)
    declined: Optional[str]  # why the tangent rules were not used, where they failed
    missing: Optional[str]  # the operator without a forward-mode rule (route "reverse")


#: How the traced function takes ``J v``: ``"forward"`` with the dual tensors of
#: ``torch.autograd.forward_ad``; ``"transform"`` with ``torch.func.jvp``, where forward itself
#: takes forward-mode derivatives (``torch.func.hessian``, ``jacfwd``: functorch's forward
#: mode nests, forward_ad's does not); ``"reverse"`` through the reverse pass,
#: ``J v = d/du [(J^T u) . v]``, where an operator has no forward-mode rule or the gradient
#: stops.
ROUTES = ("forward", "transform", "reverse")


@contextlib.contextmanager
def _plain_kernels() -> object:
    """Kernels with forward-mode rules: the math attention kernel, recurrent layers without
    oneDNN and cuDNN (cuDNN's also reads its weights' data pointers, which the tracer's fake
    tensors do not have). Only the tracing runs under it: convolutions are recorded as
    ``aten.convolution``, which picks cuDNN again when the graph runs."""
    mkldnn, cudnn = torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled
    torch.backends.mkldnn.enabled = False
    torch.backends.cudnn.enabled = False
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, torch.backends.mkldnn, "enabled", mkldnn)
        stack.callback(setattr, torch.backends.cudnn, "enabled", cudnn)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # torch >= 2.3

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        except ImportError:  # pragma: no cover - older torch
            stack.enter_context(
                torch.backends.cuda.sdp_kernel(
                    enable_flash=False, enable_math=True, enable_mem_efficient=False
                )
            )
        yield


@contextlib.contextmanager
def _plain_checkpoints() -> object:
    """Non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint`` with
    ``use_reentrant=False``) runs the checkpointed function plainly: its saved-tensor hooks
    cannot be traced, and a trace's set-up keeps what the products read anyway, so recomputing
    would save no memory. (Its private generator is replaced while tracing; a torch without it
    traces as before.)"""
    from torch.utils import checkpoint

    name = "_checkpoint_without_reentrant_generator"
    original = getattr(checkpoint, name, None)
    if original is None:  # pragma: no cover - another torch
        yield
        return

    def plain(*args: object, **kwargs: object):
        yield  # no hooks: the function runs once, as written

    setattr(checkpoint, name, plain)
    try:
        yield
    finally:
        setattr(checkpoint, name, original)


def _slots(model: nn.Module, buffers: bool) -> List[Tuple[str, Tensor]]:
    """``(name, tensor)`` for every parameter (or buffer) slot of every module, each module
    once under its first name. ``functional_call`` swaps tensors in by name and back; a module
    reachable by two names would be swapped twice and keep the swapped-in tensor, so every
    slot is named once and tied tensors are passed under each of their slots."""
    out = []
    for prefix, module in model.named_modules():
        own = module.named_buffers if buffers else module.named_parameters
        for name, tensor in own(prefix=prefix, recurse=False, remove_duplicate=False):
            out.append((name, tensor))
    return out


def inputs_of(fmodel: FunctionalModel) -> Tuple[List[Tensor], List[Tensor]]:
    """The buffers and frozen parameters the traced function takes, each tensor once: frozen
    are those outside SGN's parameter vector (one made trainable after SGN was built too)."""
    model = fmodel.model
    trainable = {id(p) for p in fmodel.params}
    buffers = list({id(b): b for _, b in _slots(model, buffers=True)}.values())
    frozen = {id(p): p for _, p in _slots(model, buffers=False) if id(p) not in trainable}
    return buffers, list(frozen.values())


def _forward(fmodel: FunctionalModel) -> Callable:
    """``(theta, buffers, frozen, inputs) -> outputs``: the model as a function of its flat
    trainable parameters, its buffers and frozen parameters (each tensor once), to be traced."""
    model = fmodel.model
    buffers_in, frozen_in = inputs_of(fmodel)
    buffer_at = {id(b): i for i, b in enumerate(buffers_in)}
    frozen_at = {id(p): i for i, p in enumerate(frozen_in)}
    trainable_at = {id(p): i for i, p in enumerate(fmodel.params)}
    buffer_slots = [(name, buffer_at[id(b)]) for name, b in _slots(model, buffers=True)]
    param_slots = [
        (name, id(p) in trainable_at, trainable_at.get(id(p), frozen_at.get(id(p))))
        for name, p in _slots(model, buffers=False)
    ]

    def forward(theta: Tensor, buffers: List[Tensor], frozen: List[Tensor], inputs) -> Tensor:
        chunks = [c.view(s) for c, s in zip(theta.split(fmodel.numels), fmodel.shapes)]
        tensors = {name: buffers[i] for name, i in buffer_slots}
        tensors.update((name, chunks[i] if t else frozen[i]) for name, t, i in param_slots)
        with fmodel.composites(), fmodel.eager_compiled():
            out = functional_call(model, tensors, tuple(inputs), tie_weights=False)
        if not isinstance(out, Tensor):
            raise Untraceable(
                f"the model's forward returns {type(out).__name__}, not one tensor; wrap the "
                "model to select the output the loss uses"
            )
        return out

    return forward


def _value(fmodel: FunctionalModel, loss: OutputLoss) -> Callable:
    """``(theta, buffers, frozen, inputs, targets) -> loss``, to be traced."""
    forward = _forward(fmodel)

    def value(theta, buffers, frozen, inputs, targets):
        with torch.enable_grad() if fmodel.calls_autograd else torch.no_grad():
            return loss.value(forward(theta, buffers, frozen, inputs), targets).detach()

    return value


def _whole(fmodel: FunctionalModel, loss: OutputLoss, route: str, rules: bool = True) -> Callable:
    """``(theta, v, buffers, frozen, inputs, targets) -> (loss, g, z, G v)``, to be traced,
    with ``J v`` by ``route`` (one of :data:`ROUTES`)."""
    forward = _forward(fmodel)

    def whole(theta, v, buffers, frozen, inputs, targets):
        theta = theta.detach().requires_grad_(True)
        with torch.enable_grad():
            if route == "reverse":
                out = forward(theta, buffers, frozen, inputs)
                u = torch.zeros_like(out, requires_grad=True)
                (vjp,) = torch.autograd.grad(out, theta, u, create_graph=True)
                (jv,) = torch.autograd.grad(vjp, u, v)
            elif route == "transform":
                return _whole_by_transforms(
                    forward, loss, theta, v, buffers, frozen, inputs, targets
                )
            else:
                mode = TangentRules() if rules else contextlib.nullcontext()
                with fwAD.dual_level(), mode:
                    out, jv = fwAD.unpack_dual(
                        forward(fwAD.make_dual(theta, v), buffers, frozen, inputs)
                    )
            check_depends(out)
            z = out.detach().requires_grad_(True)
            value, dz = value_and_grad(loss, z, targets)
            hjv = loss.hessian(out.detach(), targets)(jv)
            (grad,) = torch.autograd.grad(out, theta, dz, retain_graph=True, allow_unused=True)
            check_depends(out, grad)
            (gv,) = torch.autograd.grad(out, theta, hjv)
        return value.detach(), grad, out.detach(), gv

    return whole


def _whole_by_transforms(forward, loss, theta, v, buffers, frozen, inputs, targets):
    """``whole``'s results by ``torch.func`` alone (:data:`ROUTES`: ``"transform"``); autograd's
    reverse pass through ``torch.func.jvp``'s outputs does not trace on fake tensors."""

    def f(t: Tensor) -> Tensor:
        return forward(t, buffers, frozen, inputs)

    theta = theta.detach()
    out, pullback = torch.func.vjp(f, theta)
    _, jv = torch.func.jvp(f, (theta,), (v,))  # (its primal pass is the set-up's: no v)
    z = out.detach().requires_grad_(True)
    value, dz = value_and_grad(loss, z, targets)
    hjv = loss.hessian(out.detach(), targets)(jv)
    (grad,) = pullback(dz)
    (gv,) = pullback(hjv)
    return value.detach(), grad, out.detach(), gv


def _make_fx(fn: Callable, *example: object, stateless: bool = False) -> fx.GraphModule:
    """``fn`` traced on fake tensors; where that fails on torch.func's transforms inside forward
    and the model has no buffers (``stateless``), on the real tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*example)
    except TypeError as error:  # pragma: no cover - a torch without the keyword
        if "_allow_non_fake_inputs" not in str(error):
            raise
        return make_fx(fn, tracing_mode="fake")(*example)
    except RuntimeError as error:
        if not _meta_leak(error):
            raise
        if not stateless:
            raise Untraceable(
                "torch.func's transforms inside forward (hessian, jacfwd, jacrev) under "
                "autograd's reverse pass cannot be traced on fake tensors, and a real trace "
                "would write into this model's buffers; Taylor-mode operators that avoid nested "
                f"AD (torch_sgn.pinn.operators.laplacian(u, x)) trace ({reason(error)})"
            ) from error
    # torch.func's transforms in forward (vmap(hessian(u))) under autograd's reverse pass leak
    # meta tensors out of the fake ones (torch 2.13): traced on the real tensors instead, which
    # costs one real pass and writes into nothing where the model has no buffers
    return make_fx(fn, tracing_mode="real")(*example)


def _meta_leak(error: BaseException) -> bool:
    """Whether ``error`` is a fake-tensor trace that met a meta tensor it did not make."""
    message = str(error)
    return "meta" in message and "device" in message


def trace_product(
    fmodel: FunctionalModel, loss: OutputLoss, flat: Tensor, args: Sequence, targets: Tensor
) -> Recording:
    """Traces the product at these shapes, by the first of :data:`ROUTES` that works; raises
    :class:`Untraceable`. Where the trace fails on a branch on a tensor's values, it is tried
    again with the loss called as it is from the graph (:class:`~.opaque_loss.OpaqueLoss`):
    the branch may be the loss's (a callable's checks)."""
    try:
        return _trace_product(fmodel, loss, flat, args, targets)
    except Untraceable as why:
        if not _data_dependent(why):
            raise
        try:
            return _trace_product(fmodel, OpaqueLoss(loss), flat, args, targets)
        except Untraceable:
            raise why from None  # the model's own branch: the first reason stands


def _data_dependent(why: Untraceable) -> bool:
    """Whether the trace failed on a branch on a tensor's values."""
    return "DataDependent" in type(why.__cause__).__name__


def _trace_product(
    fmodel: FunctionalModel, loss: OutputLoss, flat: Tensor, args: Sequence, targets: Tensor
) -> Recording:
    buffers, frozen = inputs_of(fmodel)
    example = (flat.detach(), torch.zeros_like(flat), buffers, frozen, list(args), targets)
    errors: List[BaseException] = []
    declined = None  # why the tangent rules could not be used, if they could not
    # where the gradient stops (torch.no_grad) forward mode does not: reverse mode alone
    stops = fmodel.gradient_stop(flat, args) is not None
    for route in ("reverse",) if stops else ROUTES:
        if route == "transform" and not (errors and _nests(errors[-1])):
            continue  # (only where forward_ad's forward mode would nest)
        try:
            with _plain_kernels(), _plain_checkpoints():
                if TANGENT_RULES and route == "forward":
                    try:
                        whole = _whole(fmodel, loss, route, rules=True)
                        graph = _make_fx(whole, *example, stateless=not buffers)
                        break
                    except (Untraceable, ConstantOutputError):
                        raise
                    except Exception as error:  # noqa: BLE001 - PyTorch's own rules may work
                        if _nests(error):
                            raise
                        declined = reason(error)
                whole = _whole(fmodel, loss, route, rules=False)
                graph = _make_fx(whole, *example, stateless=not buffers)
            break
        except (Untraceable, ConstantOutputError):
            raise
        except (NotImplementedError, RuntimeError) as error:
            if not (isinstance(error, NotImplementedError) or _nests(error)):
                raise Untraceable(reason(error)) from error
            # a forward-mode rule is missing, or forward mode nests: the next route
            errors.append(error)
            declined = None  # the other routes record no tangent rules: nothing to report
            continue
        except Exception as error:  # noqa: BLE001 - any failure to trace means: not traceable
            raise Untraceable(reason(error)) from error
    else:
        raise Untraceable(reason(errors[-1]))
    missing = missing_rule(errors[-1]) if route == "reverse" and errors else None
    return Recording(graph, route, declined, missing)


def _nests(error: BaseException) -> bool:
    """Whether ``error`` says forward_ad's forward mode would nest in the model's own."""
    return missing_rule(error) == NESTED_FORWARD


def trace_value(fmodel: FunctionalModel, loss: OutputLoss, inputs: tuple) -> fx.GraphModule:
    """The loss at other parameters on the same batch, traced as the product was (the math
    attention kernel, recurrent layers without oneDNN and cuDNN); raises :class:`Untraceable`."""
    flat, buffers, frozen, args, targets = inputs
    try:
        with _plain_kernels(), _plain_checkpoints():
            graph = _make_fx(
                _value(fmodel, loss),
                *(flat.detach(), buffers, frozen, list(args), targets),
                stateless=not buffers,
            )
    except Exception as error:  # noqa: BLE001 - the product's trace worked, so this is rare
        raise Untraceable(reason(error)) from error
    views_as_reshapes(graph.graph)  # (a real kernel's layout may differ: see there)
    graph.recompile()
    return graph


def reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:300] + "..."
    why = f"{type(error).__name__}: {first}"
    if "DataDependent" in type(error).__name__:
        # an `if` on a tensor's values: torch.fx's guard, or its fake tensors' exception (a
        # loss's own branch is traced around: trace_product)
        return (
            "the model branches on a tensor's values (an `if` on a tensor, `.item()`), which a "
            f"trace at fixed shapes cannot follow ({why})"
        )
    return why
