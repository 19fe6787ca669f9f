r"""Where forward-mode AD has no rule: kernels that have one, and the double-backward route.

The functional engine takes ``J v`` by forward-mode AD. Some operators have no forward-mode
rule although their gradient works: the fused attention kernels (flash, memory-efficient),
the fast paths of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` in eval mode,
oneDNN's (CPU, float32) and cuDNN's LSTM/GRU kernels, RNNs on packed sequences (their kernel
reads the tensors' memory, which ``torch.func``'s tensors lack), many losses' backward kernels
(``huber_loss_backward``), custom ``autograd.Function``\ s without a ``jvp``. The engine
then takes ``J v`` by **double backward**, for any operator whose backward is differentiable:
``J^T u`` is linear in ``u``, so ``J v = d/du [(J^T u) . v]``. The graph of ``u -> J^T u`` is
recorded once per step (the gradient's backward pass, with ``create_graph``), and each ``J v``
is one backward pass through it (:func:`jvp_by_double_backward`). The same route serves a
model whose forward pass computes from the parameters under ``torch.no_grad``
(:func:`gradient_stop`): the gradient takes such values as constants, forward mode does not;
and one with backward hooks, on tensors (``Tensor.register_hook`` in ``forward``) or on modules
(:func:`backward_hooks`): the gradient runs them, forward mode does not.

Some kernels' backward is not differentiable in turn (the fused attention kernels' is not);
those have a twin kernel whose backward is, and :func:`kernels` runs the model with it
(:data:`SWITCHES`: the math attention kernel, the modules' composite paths instead of their
fast paths, the native RNN kernels instead of oneDNN's or cuDNN's).

Double backward is the route taken first where an operator has no forward-mode rule, before
switching to a twin kernel that has one; it keeps one more graph (the gradient's) through the
step. Its cost against forward mode is in ``docs/PERFORMANCE.md``.
"""

from __future__ import annotations

import re
import sys
import warnings
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterator, Optional, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = [
    "NESTED_FORWARD",
    "PassReport",
    "SWITCHES",
    "backward_hook_handles",
    "backward_hooks",
    "gradient_stop",
    "gradient_stop_notice",
    "inspect_pass",
    "jvp_by_double_backward",
    "kernels",
    "load_decompositions",
    "missing_rule",
    "switch_for",
]

_OP = re.compile(r"forward AD with (?:aten::)?([\w.]+)")
_DERIVATIVE = re.compile(r"derivative for '?(?:aten::)?([\w.]+)'? is not implemented")

#: What each kernel switch does, for the warning that names it.
SWITCHES: Dict[str, str] = {
    "math_attention": "the math attention kernel instead of the fused ones",
    "no_mha_fast_path": "nn.MultiheadAttention and nn.TransformerEncoderLayer without their "
    "fast path",
    "no_onednn": "the native CPU kernels instead of oneDNN's (RNNs, and convolutions too)",
    "no_cudnn": "the native CUDA kernels instead of cuDNN's (RNNs, and convolutions too)",
}

# Operators without a forward-mode rule that another kernel of the same function has.
_SWITCH_OF: Tuple[Tuple[str, str], ...] = (
    ("_scaled_dot_product_", "math_attention"),  # flash, efficient, cudnn attention
    ("_flash_attention", "math_attention"),
    ("_efficient_attention", "math_attention"),
    ("_transformer_encoder_layer_fwd", "no_mha_fast_path"),
    ("_native_multi_head_attention", "no_mha_fast_path"),
    ("_nested_tensor", "no_mha_fast_path"),
    ("mkldnn_rnn", "no_onednn"),
    ("_cudnn_rnn", "no_cudnn"),
)


def load_decompositions() -> None:
    """Loads PyTorch's forward-mode decompositions now, without the ``DeprecationWarning`` their
    module raises (it scripts them with ``torch.jit.script``). PyTorch loads them at the first
    forward-mode pass; where warnings are errors (``-W error``, pytest's ``filterwarnings``)
    that pass would fail on a warning about PyTorch's own code. Once loaded, this returns at
    once; where loading fails here, PyTorch loads them itself as before."""
    if "torch._decomp.decompositions_for_jvp" in sys.modules:
        return
    import torch.autograd.forward_ad as forward_ad

    load = getattr(forward_ad, "_maybe_load_decompositions", None)
    if load is None:  # a torch that loads them otherwise
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            load()
        except Exception:  # noqa: BLE001 - PyTorch tries again at its first forward-mode pass
            pass


def missing_rule(error: BaseException) -> Optional[str]:
    """What has no forward-mode rule (or, on the double-backward route, no derivative of its
    backward), read from the error autograd raised; ``None`` where ``error`` is another."""
    message = str(error)
    if isinstance(error, (NotImplementedError, RuntimeError)):
        # a backward without a derivative: a RuntimeError or a NotImplementedError, by operator
        match = _DERIVATIVE.search(message)
        if match:
            return match.group(1)
    if isinstance(error, NotImplementedError):
        match = _OP.search(message)
        if match:
            return match.group(1)
        if "autograd.Function" in message and "jvp" in message:
            return "a custom autograd.Function without jvp"
    if isinstance(error, RuntimeError):
        if "Nested forward mode AD is not supported" in message:
            return NESTED_FORWARD
        if "NestedTensor" in message:  # the encoder's fast path, taken without autograd
            return "_nested_tensor_from_mask (nn.TransformerEncoder's fast path)"
        if "data pointer" in message and "storage" in message:
            # torch.func's tensors have no memory; an RNN on a packed sequence reads it
            return "an operator that reads its tensors' memory (an RNN on a packed sequence)"
        if "autograd.Function" in message and "setup_context" in message:
            return "a custom autograd.Function without setup_context"  # torch.func needs it
        if "once_differentiable" in message:
            return "a custom autograd.Function marked once_differentiable"
    return None


#: what :func:`missing_rule` names where forward mode would nest in forward mode
NESTED_FORWARD = (
    "nested forward-mode AD (the forward pass itself takes forward-mode derivatives: "
    "torch.func.jvp, jacfwd or hessian)"
)


def switch_for(op: str) -> Optional[str]:
    """The kernel switch (a key of :data:`SWITCHES`) that replaces ``op`` by a kernel with a
    forward-mode rule, or ``None`` if there is none."""
    for prefix, switch in _SWITCH_OF:
        if op.startswith(prefix) or prefix in op:
            return switch
    return None


@contextmanager
def _backend_flag(module, value: bool) -> Iterator[None]:
    """Sets ``module.enabled`` (``torch.backends.mkldnn`` or ``cudnn``) for the block."""
    old = module.enabled
    module.enabled = value
    try:
        yield
    finally:
        module.enabled = old


@contextmanager
def _mha_fast_path_off() -> Iterator[None]:
    mha = getattr(torch.backends, "mha", None)
    if mha is None:  # no switch: the fast path is off whenever autograd records anyway
        yield
        return
    old = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(old)


@contextmanager
def kernels(switches: FrozenSet[str]) -> Iterator[None]:
    """Runs the block with the kernel ``switches`` (keys of :data:`SWITCHES`) applied; the
    global settings are restored on exit."""
    with ExitStack() as stack:
        if "math_attention" in switches:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        if "no_mha_fast_path" in switches:
            stack.enter_context(_mha_fast_path_off())
        if "no_onednn" in switches:
            stack.enter_context(_backend_flag(torch.backends.mkldnn, False))
        if "no_cudnn" in switches:
            stack.enter_context(_backend_flag(torch.backends.cudnn, False))
        yield


def jvp_by_double_backward(
    outputs: Tensor, leaf: Tensor, cotangent: Tensor
) -> Tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``J^T cotangent`` and the map ``v -> J v``, by reverse mode alone.

    ``outputs`` must have been computed from ``leaf`` with autograd recording. One backward
    pass with ``create_graph`` gives ``J^T u`` at ``u = cotangent`` together with its graph as
    a function of ``u``; since ``J^T u`` is linear in ``u``, a backward pass through that graph
    with the cotangent ``v`` is ``J v`` (the same at every ``u``). That graph is kept for the
    step and each ``J v`` reuses it.
    """
    with torch.enable_grad():
        u = cotangent.detach().requires_grad_(True)
        (jtu,) = torch.autograd.grad(outputs, leaf, u, retain_graph=True, create_graph=True)

    # J^T u is linear in u: where it is nonzero yet independent of u, the backward pass cut
    # the graph (a custom autograd.Function whose backward detaches, or runs without grad).
    def cut() -> RuntimeError:
        return RuntimeError(
            "J v by double backward needs a differentiable backward pass, but this model's "
            "gradient does not depend on the output cotangent (a custom autograd.Function "
            "whose backward detaches or runs without grad?); give that Function a jvp"
        )

    if not jtu.requires_grad and bool(jtu.any()):
        raise cut()

    def jvp(v: Tensor) -> Tensor:
        jv = None
        if jtu.requires_grad:
            with torch.enable_grad():
                (jv,) = torch.autograd.grad(jtu, u, v, retain_graph=True, allow_unused=True)
        if jv is None:
            if bool(jtu.any()):
                raise cut()
            return torch.zeros_like(outputs)  # J = 0 here
        return jv

    return jtu.detach(), jvp


def gradient_stop(run: Callable[[], object], inputs: str = "the parameters") -> Optional[str]:
    """Where ``run()`` differentiates otherwise in reverse mode than in forward mode, said as
    "the forward pass ...", or ``None``.

    An operation computed from tensors that require grad while autograd is off
    (``torch.no_grad``), whose result reaches an operation with autograd on as a constant:
    the gradient takes such values as constants, forward mode does not, so its ``J v`` would
    be of another matrix than the gradient's ``J^T u`` and ``G`` not symmetric. Where this
    finds one, ``J v`` is taken in reverse mode. A custom ``autograd.Function``'s forward also
    runs with autograd off, but its result requires grad again: not a stop. A gradient hook
    registered in the pass (``Tensor.register_hook`` on a tensor that requires grad) is one
    too: the gradient runs it, forward mode does not. ``run`` is called
    once, with autograd on; ``inputs`` names the tensors it differentiates, for the message.
    """
    return inspect_pass(run, inputs).stop


@dataclass(frozen=True)
class PassReport:
    """What :func:`inspect_pass` found in one forward pass.

    Attributes:
        stop: where the gradient stops (:func:`gradient_stop`), or ``None``.
        calls_autograd: whether the pass calls ``torch.autograd.grad`` or ``backward``: a
            residual model that differentiates its inputs inside ``forward`` (a
            physics-informed network's ``u_xx``). Its passes need autograd on, and
            ``torch.func``'s transforms refuse its ``requires_grad_()``.
    """

    stop: Optional[str]
    calls_autograd: bool


def inspect_pass(run: Callable[[], object], inputs: str = "the parameters") -> PassReport:
    """Runs ``run()`` once with autograd on and reports where its gradient stops
    (:func:`gradient_stop`) and whether it calls autograd itself."""
    mode = _GradientStops(inputs)
    with torch.enable_grad(), mode:
        run()
    return PassReport(mode.found, mode.calls_autograd)


def backward_hook_handles(model: torch.nn.Module) -> tuple:
    """The backward hooks the model's gradient runs, by their handles: the global ones', then
    ``(id(module), hooks, pre-hooks)`` of each module that has any; ``()`` where there are
    none. What a recorded pass depends on (it runs the hooks it saw)."""
    registry = torch.nn.modules.module
    global_ = tuple(registry._global_backward_hooks) + tuple(
        getattr(registry, "_global_backward_pre_hooks", ())
    )
    modules = tuple(
        (id(m), tuple(m._backward_hooks), tuple(getattr(m, "_backward_pre_hooks", ())))
        for m in model.modules()
        if m._backward_hooks or getattr(m, "_backward_pre_hooks", None)
    )
    return (global_, modules) if global_ or modules else ()


def backward_hooks(model: torch.nn.Module) -> Optional[str]:
    """Where the model's gradient runs backward hooks (:func:`backward_hook_handles`), said as
    "the forward pass ..." for :func:`gradient_stop_notice`; else ``None``. A hook may change
    the gradient; forward mode does not run it, so ``J v`` is taken in reverse mode there too."""
    handles = backward_hook_handles(model)
    if not handles:
        return None
    global_, modules = handles
    if global_:
        return (
            "runs modules with global backward hooks (register_module_full_backward_hook): "
            "they may change the gradient, forward-mode AD does not run them"
        )
    name = next(n for n, m in model.named_modules() if id(m) == modules[0][0])
    return (
        f"runs module {name or 'model'!r}, which has backward hooks: they may change "
        "the gradient, forward-mode AD does not run them"
    )


def gradient_stop_notice(op: str) -> str:
    """The one-time warning for what :func:`gradient_stop` found, ``op``."""
    return (
        f"the model's forward pass {op}; so J v is taken by double backward (reverse mode "
        "alone). Products stay exact"
    )


#: the calls by which a forward pass differentiates by itself (they dispatch to function modes)
_AUTOGRAD_CALLS = (torch.autograd.grad, torch.autograd.backward, Tensor.backward)


def _in_transform() -> bool:
    """Whether this runs inside one of ``torch.func``'s transforms."""
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None


class _GradientStops(TorchFunctionMode):
    def __init__(self, inputs: str):
        super().__init__()
        self.inputs = inputs  # what the tensors that require grad are, for the message
        self.found: Optional[str] = None
        self.calls_autograd = False
        # id -> (weak reference, the operation it came from): results computed from tensors
        # that require grad (or from such results) with autograd off
        self._stopped: Dict[int, Tuple[weakref.ref, str]] = {}

    def _origin(self, t: Tensor) -> Optional[str]:
        entry = self._stopped.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on = torch.is_grad_enabled()
        if func in _AUTOGRAD_CALLS and not _in_transform():  # (torch.func's jacrev calls it)
            self.calls_autograd = True
        out = func(*args, **kwargs)
        if self.found is not None:
            return out
        inputs = list(_tensors((args, kwargs)))
        if func is Tensor.register_hook and on and inputs and inputs[0].requires_grad:
            # the hook may change the gradient; forward mode does not run it
            self.found = (
                "registers a gradient hook on a tensor (Tensor.register_hook): the hook may "
                "change the gradient, forward-mode AD does not run it"
            )
            return out
        if on:  # a stopped value used as a constant where autograd records
            for t in inputs:
                origin = self._origin(t)
                if origin is not None and not t.requires_grad:
                    self.found = origin
                    return out
            return out
        origins = [self._origin(t) for t in inputs]
        origin = next((o for o in origins if o is not None), None)
        if origin is None and any(t.requires_grad for t in inputs):
            name = getattr(func, "__name__", None) or repr(func)
            origin = (
                f"computes {name} from {self.inputs} under torch.no_grad: the gradient takes "
                "it as a constant, forward-mode AD would differentiate through it"
            )
        if origin is not None:
            for t in _tensors(out):
                if t.is_floating_point():
                    self._stopped[id(t)] = (weakref.ref(t), origin)
        return out


def _tensors(tree) -> Iterator[Tensor]:
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _tensors(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _tensors(t)
