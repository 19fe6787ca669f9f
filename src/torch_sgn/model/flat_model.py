"""The model as a function of one flat parameter vector.

:class:`FunctionalModel` evaluates any ``nn.Module`` at parameters given as one vector (the
layout of :func:`torch.nn.utils.parameters_to_vector`) with ``torch.func.functional_call``;
every engine of :mod:`torch_sgn.engines.selection` evaluates the model through it.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from typing import Callable, ContextManager, FrozenSet, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..diagnostics import warn
from ..residual_problem import ResidualProblem, residual_problem
from .attributes import changed_attributes, model_attributes
from .composites import Composites, composite_modules, scripted_stop
from .forward_mode import backward_hooks, inspect_pass, kernels, load_decompositions

__all__ = ["ConstantOutputError", "FunctionalModel", "Inputs", "check_depends", "flat_gradient"]

#: What a model's forward takes: a tensor, or a tuple of tensors passed positionally.
Inputs = Union[Tensor, Tuple[Tensor, ...]]


class FunctionalModel:
    """Evaluates ``model`` as a function of one flat parameter vector.

    The vector holds the trainable parameters (``requires_grad=True``) in ``model.parameters()``
    order, the layout of :func:`torch.nn.utils.parameters_to_vector`. Frozen parameters and
    buffers are passed as they are.

    Modules whose forward draws random numbers (dropout) or updates buffers (batch norm in
    training mode) are made consistent within a step: :meth:`consistent` replays the same
    random numbers for every forward pass, and only the forward pass that computes the
    gradient writes the buffers; all others work on copies.
    """

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # A model wrapped by torch.compile is evaluated as the module it wraps (the same
        # tensors): the engines trace or compile it themselves, and compiled code inside
        # torch.func's transforms would compile again at every new kind of input.
        if type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), nn.Module
        ):
            model = model._orig_mod
        # A model wrapped in DistributedDataParallel is evaluated as the module it wraps: DDP's
        # forward would broadcast the buffers and prepare its gradient hooks at each of SGN's
        # passes. SGN all-reduces on its own, in DDP's process group where none is given.
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        if isinstance(model, nn.DataParallel):
            raise ValueError(
                "SGN cannot evaluate a model wrapped in nn.DataParallel (torch.func's calls "
                "refuse it): pass the module itself (model.module); to train on several "
                "devices, run one process per device with SGN's own data parallelism "
                "(SGN(..., process_group=...), see docs/DISTRIBUTED.md)"
            )
        if isinstance(model, torch.jit.ScriptModule):
            raise ValueError(
                "SGN cannot evaluate a TorchScript module as the model (torch.func's calls "
                "refuse it): pass the nn.Module before torch.jit.script or torch.jit.trace "
                "(scripted submodules inside it are fine)"
            )
        self.model = model
        #: the model as a residual problem, read once (``None``: it is not one)
        self.problem: Optional[ResidualProblem] = residual_problem(model)
        load_decompositions()  # now, not inside a pass that warnings-as-errors would fail
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (none has requires_grad)")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        complex_params = [(n, p.dtype) for n, p in named if p.is_complex()]
        if complex_params:
            name, dtype = complex_params[0]
            raise ValueError(
                f"parameter {name!r} is complex ({dtype}): SGN takes real parameters; store "
                "it as a real parameter with a last dimension of 2 (real and imaginary parts) "
                "and use torch.view_as_complex(...) of it in forward"
            )
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                "all trainable parameters must share one dtype and device, got "
                f"dtypes {sorted(map(str, dtypes))} and devices {sorted(map(str, devices))}"
            )
        self.dtype, self.device = dtypes.pop(), devices.pop()
        if not self.dtype.is_floating_point:
            raise ValueError(f"parameters must be floating point, got {self.dtype}")
        # Where each trainable parameter sits: every (module, attribute) slot, named once.
        # functional_call swaps tensors in by name and back afterwards; given two names of
        # one module (self.b = self.a, a layer used twice) it swaps that slot twice and
        # restores it to the swapped-in tensor, so the parameter silently leaves the model.
        # named_modules() visits a module once; a parameter held by several modules (tied
        # weights) is passed under each of its slots.
        index = {id(p): i for i, p in enumerate(self.params)}
        self._slots = [
            (name, index[id(p)]) for name, p in _slots(model, "_parameters") if id(p) in index
        ]
        #: kernel switches (see :mod:`torch_sgn.model.forward_mode`) every forward pass runs with.
        #: Recurrent layers start without cuDNN: ``nn.RNNBase`` reads its weights' data
        #: pointers on CUDA, which ``torch.func``'s tensors do not have.
        recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
        self.switches: FrozenSet[str] = frozenset({"no_cudnn"} if recurrent else ())
        self._rng_state: dict | None = None
        self._after_first: dict | None = None
        self._gradient_stop: Optional[str] = None
        self._stop_checked = False
        #: whether forward calls ``torch.autograd.grad`` (or ``backward``) itself, as a
        #: residual model that differentiates its inputs does: found by the checked pass
        #: (:meth:`gradient_stop`); its passes then run with autograd on (:meth:`__call__`)
        self.calls_autograd = False
        self._stop_settings: Optional[tuple] = None  # the settings the stop was checked at
        #: attributes that forward passes write themselves (``weight_norm``'s hook writes
        #: ``weight``): state of a pass, not settings (see :meth:`settings`)
        self.written: set = set()
        #: whether forward passes run within :class:`~torch_sgn.model.composites.Composites`: where
        #: the model has modules that call its functions, or the first, checked forward pass
        #: (:meth:`gradient_stop`) called one
        self._composites = composite_modules(model)
        self._compiled_parts = any(  # torch.compile(module), or module.compile() in place
            type(m).__name__ == "OptimizedModule"
            or getattr(m, "_compiled_call_impl", None) is not None
            for m in model.modules()
        )

    @contextmanager
    def composites(self) -> Iterator[None]:
        """Within this block, embedding lookups and weight norms that SGN's passes cannot
        differentiate as PyTorch computes them run as composites of differentiable operators
        (:mod:`torch_sgn.model.composites`)."""
        if self._stop_checked and not self._composites:
            yield
            return
        mode = Composites()
        try:
            with mode:
                yield
        finally:
            self._composites = self._composites or mode.routed

    def eager_compiled(self) -> ContextManager[object]:
        """Submodules wrapped by ``torch.compile`` run as the modules they wrap, as the model
        itself does (the engines trace or compile the passes themselves; compiled code cannot
        be traced, and within ``torch.func``'s transforms compiles again for each kind of
        input). Where the model has such submodules: ``torch.compiler.set_stance
        ("force_eager")`` (torch 2.6 on), and under a trace dynamo's option to run the wrapped
        function instead of refusing the trace."""
        if not self._compiled_parts:
            return nullcontext()
        stack = ExitStack()
        if hasattr(torch.compiler, "set_stance"):
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        config = getattr(getattr(torch, "_dynamo", None), "config", None)
        if config is not None and hasattr(config, "error_on_nested_fx_trace"):
            stack.enter_context(config.patch(error_on_nested_fx_trace=False))
        return stack

    def settings(self) -> tuple:
        """The model's :func:`~torch_sgn.model.attributes.model_attributes`, less those forward
        passes write (:attr:`written`): the values a recorded pass takes as constants."""
        return tuple((n, v) for n, v in model_attributes(self.model) if n not in self.written)

    # --- parameters as one vector -------------------------------------------------------------
    def flat(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        return {
            name: chunk.view(shape)
            for name, chunk, shape in zip(self.names, flat.split(self.numels), self.shapes)
        }

    def trainable_mask(self) -> Optional[Tensor]:
        """1 at the parameters still trainable, 0 at those frozen since construction; ``None``
        when none is frozen."""
        flags = [p.requires_grad for p in self.params]
        if all(flags):
            return None
        return torch.cat([
            torch.full((n,), float(f), dtype=self.dtype, device=self.device)
            for n, f in zip(self.numels, flags)
        ])  # fmt: skip

    def unfrozen(self) -> list[str]:
        """The names of the model's parameters made trainable after construction (not among
        :attr:`params`)."""
        own = {id(p) for p in self.params}
        return [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in own]

    @torch.no_grad()
    def write(self, flat: Tensor) -> None:
        """Copies ``flat`` into the model's parameters."""
        for p, chunk in zip(self.params, flat.split(self.numels)):
            p.copy_(chunk.view(p.shape))

    def write_grad(self, grad: Tensor) -> None:
        """Writes the flat ``grad`` into each trainable parameter's ``.grad``."""
        for p, g, shape in zip(self.params, grad.split(self.numels), self.shapes):
            p.grad = g.view(shape).clone()

    def vjp_at(self, theta: Tensor, inputs: Inputs) -> Callable[[Tensor], Tensor]:
        """``u -> J^T u`` of the outputs at ``theta`` by a forward and a backward pass each
        (for engines that keep no graph)."""

        def vjp(u: Tensor) -> Tensor:
            leaf = theta.detach().requires_grad_(True)
            with torch.enable_grad():
                (jtu,) = torch.autograd.grad(self(leaf, inputs), leaf, u)
            return jtu

        return vjp

    def warn_unfrozen(self) -> None:
        """Warns once about parameters made trainable after construction: the parameter vector
        was fixed then, and they stay where they are."""
        names = [] if getattr(self, "_unfrozen_warned", False) else self.unfrozen()
        if names:
            self._unfrozen_warned = True
            warn(
                f"parameter(s) {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} became "
                "trainable after SGN was built; SGN trains the parameters that were trainable "
                "then, so these keep their values. Build a new SGN to train them"
            )

    @torch.no_grad()
    def write_buffers(self, buffers: dict[str, Tensor]) -> None:
        """Copies buffers computed by a forward pass (see ``buffers_out``) into the model."""
        own = dict(self.model.named_buffers())
        for name, value in buffers.items():
            own[name].copy_(value)

    # --- forward passes -----------------------------------------------------------------------
    def __call__(self, flat: Tensor, inputs: Inputs, *, buffers_out: dict | None = None) -> Tensor:
        """The model's output at parameters ``flat``.

        A training-mode forward pass updates copies of the buffers, never the model's own; pass
        ``buffers_out`` to receive the updated copies (:meth:`write_buffers` commits them).
        Copies are made inside the call, which also keeps ``torch.func`` transforms from seeing
        captured tensors mutated.
        """
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        buffers = {id(b): b for _, b in _slots(self.model, "_buffers")}
        if self.model.training:
            copies = {key: b.clone() for key, b in buffers.items()}
            if buffers_out is not None:
                buffers_out.update((n, copies[id(b)]) for n, b in self.model.named_buffers())
            buffers = copies
        tensors = {name: buffers[id(b)] for name, b in _slots(self.model, "_buffers")}
        chunks = [c.view(s) for c, s in zip(flat.split(self.numels), self.shapes)]
        tensors.update((name, chunks[i]) for name, i in self._slots)
        with self.grad_mode(), self.replay_rng(), kernels(self.switches), self.composites():
            with self.eager_compiled():
                # Every slot is named, tied ones included: no tying by functional_call.
                try:
                    out = functional_call(self.model, tensors, args, tie_weights=False)
                except RuntimeError as error:
                    if "view of its base has been modified inplace" not in str(error):
                        raise
                    raise RuntimeError(
                        "the model's forward pass writes into a parameter in place; SGN evaluates "
                        "the model at parameters that are views of one vector, which cannot be "
                        "written. Move the write out of forward (clamp or renormalise the weights "
                        f"after each step). ({str(error).splitlines()[0]})"
                    ) from error
        if not isinstance(out, Tensor):
            raise TypeError(
                "SGN needs a model whose forward returns one tensor, got "
                f"{type(out).__name__}; wrap the model to select the output the loss uses"
            )
        return out

    def grad_mode(self) -> ContextManager[object]:
        """Autograd on where forward differentiates by itself (:attr:`calls_autograd`, or not
        yet checked), since SGN's passes run under ``torch.no_grad``; the caller's mode
        otherwise. Where nothing of the pass requires grad, autograd on records nothing."""
        if self.calls_autograd or not self._stop_checked:
            return torch.enable_grad()
        return nullcontext()

    def gradient_stop(self, flat: Tensor, inputs: Inputs) -> Optional[str]:
        """Where the gradient differs from what forward mode would differentiate, or ``None``:
        the forward pass computes from the parameters with autograd off or registers a tensor
        hook (see :func:`torch_sgn.model.forward_mode.gradient_stop`), scripted code that may do so
        (:func:`~torch_sgn.model.composites.scripted_stop`), modules with backward hooks
        (:func:`~torch_sgn.model.forward_mode.backward_hooks`, looked for at every call). Found by
        one forward pass at ``flat`` on ``inputs`` that leaves the random state as it was, run
        again where the model's :meth:`settings` changed since (a flag may switch a
        ``torch.no_grad`` block on). The same pass finds whether forward passes call a
        function that runs as a composite (:meth:`composites`), which attributes they
        write, and whether they call autograd themselves (:attr:`calls_autograd`)."""
        settings = self.settings()
        if not self._stop_checked or settings != self._stop_settings:
            rng = _get_rng(self.device)
            leaf = flat.detach().requires_grad_(True)
            before = model_attributes(self.model)
            try:
                report = inspect_pass(lambda: self(leaf, inputs))
                self._gradient_stop, self.calls_autograd = report.stop, report.calls_autograd
            except Exception:  # noqa: BLE001 - the engine's own forward pass reports it
                self._gradient_stop = None
            finally:
                _set_rng(self.device, rng)
            self.written.update(changed_attributes(before, model_attributes(self.model)))
            if self._gradient_stop is None:  # scripted code, which that pass cannot see into
                self._gradient_stop = scripted_stop(self.model)
            self._stop_checked, self._stop_settings = True, self.settings()
        return self._gradient_stop or backward_hooks(self.model)

    @contextmanager
    def consistent(self) -> Iterator[None]:
        """Within this block, every forward pass draws the same random numbers.

        On normal exit the global random state is where one forward pass would have left it;
        if the block raises, it is restored to where it was on entry.
        """
        if not self.model.training:
            yield
            return
        start = self.freeze_rng()
        try:
            yield
        except BaseException:
            _set_rng(self.device, start)
            raise
        else:
            if self._after_first is not None:
                _set_rng(self.device, self._after_first)
        finally:
            self._rng_state = self._after_first = None

    def freeze_rng(self) -> dict:
        """Makes every later forward pass replay the current random state; returns it."""
        self._rng_state = _get_rng(self.device)
        self._after_first = None
        return self._rng_state

    @contextmanager
    def replay_rng(self) -> Iterator[None]:
        if self._rng_state is None:
            yield
            return
        outside = _get_rng(self.device)
        _set_rng(self.device, self._rng_state)
        try:
            yield
        finally:
            if self._after_first is None:
                self._after_first = _get_rng(self.device)
            _set_rng(self.device, outside)


class ConstantOutputError(ValueError):
    """The model's output does not depend on its trainable parameters."""


def flat_gradient(params: Sequence[Tensor], grads: Sequence[Optional[Tensor]]) -> Tensor:
    """``grads``, the gradients of ``params`` (``torch.autograd.grad(..., allow_unused=True)``'s),
    as one flat vector: zeros for a parameter the output does not reach."""
    return torch.cat([
        (torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)
    ])  # fmt: skip


def check_depends(outputs: Tensor, *grads: Optional[Tensor]) -> None:
    """Raises :class:`ConstantOutputError` unless ``outputs``, computed with autograd on from
    parameters that require grad, depend on them: where they do not require grad, or where
    ``grad``, their gradient taken with ``allow_unused=True``, is ``None`` (outputs that
    depend on inputs that require grad, as a residual model's do, and not on the
    parameters)."""
    if not outputs.requires_grad or any(g is None for g in grads):
        raise ConstantOutputError(
            "the model's output does not depend on its trainable parameters: there is nothing "
            "to fit (the gradient and the Gauss-Newton matrix are zero). Check that forward "
            "uses the parameters and does not detach its output; a residual model that "
            "differentiates its inputs with torch.autograd.grad needs create_graph=True, or "
            "its derivatives are constants"
        )


def _slots(model: nn.Module, kind: str) -> Iterator[Tuple[str, Tensor]]:
    """``(name, tensor)`` for every slot of ``kind`` (``"_parameters"`` or ``"_buffers"``) of
    every module, each module once under its first name."""
    for prefix, module in model.named_modules():
        for key, tensor in getattr(module, kind).items():
            if tensor is not None:
                yield (f"{prefix}.{key}" if prefix else key), tensor


def _get_rng(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng(device: torch.device, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
