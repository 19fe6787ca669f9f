"""CUDA graphs for the layer-wise engine: a step's launches replayed, not re-issued.

The paper's networks are small: on a GPU a gradient, a ``G v`` product or a trial-point loss
costs about as much as launching its kernels, whatever the batch. With ``cuda_graphs=True``
the layer-wise engine captures, once per batch shape, three CUDA graphs over static buffers:

* the set-up: the recorded forward pass, the loss, the gradient and what the products reuse
  (each layer's input, ``f'(z)``, the pooling indices, the softmax);
* one ``G v`` product, reading the set-up's tensors;
* the loss at a trial point (trust region, line search).

A step then copies the batch and the parameters into the static buffers and replays the
set-up, each CG iteration copies its vector in and replays the product, each trial point
replays the loss: one launch each where eager execution issues dozens. CG's vector updates
and the step's decisions stay eager, on the host, as before.

Graphs apply where the engine runs the whole chain by hand (no autograd graph): a CUDA
model whose every layer's rule allows capture (see :mod:`torch_sgn.engines.layerwise.rules`, and
``docs/LAYERS.md`` for the table; for example training-mode dropout does not) with a named
loss (``mse``, ``cross_entropy``, ``bce_with_logits``). Elsewhere
the step runs eagerly, with a one-time warning that says why; so it does after a capture
fails. A capture is keyed on the batch's shapes and dtypes, the parameters' dtype and device,
the loss's options and every layer's settings (``extra_repr``, training mode): a change of
any of these captures again, and more than :data:`_MAX_SHAPES` of them in turn warn once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ..diagnostics import warn
from ..linearization import Batch, Linearization
from ..losses import OutputLoss
from ..model.flat_model import FunctionalModel

#: How many batch shapes keep their graphs (a run has two: full batches and the last one).
_MAX_SHAPES = 4

Capture = Callable[[Sequence[Callable[[], None]], torch.device], List[Callable[[], None]]]


def _capture_cuda(
    fns: Sequence[Callable[[], None]], device: torch.device
) -> List[Callable[[], None]]:
    """Captures each of ``fns`` as a CUDA graph on ``device`` (in order, one memory pool) and
    returns their replays. They run twice first on a side stream, as capture requires (library
    workspaces, lazy initialisation)."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                for fn in fns:
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for fn in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                fn()
            graphs.append(graph)

    def replay(graph: torch.cuda.CUDAGraph) -> Callable[[], None]:
        def run() -> None:
            with torch.cuda.device(device):  # on the graph's device's current stream
                graph.replay()

        return run

    return [replay(graph) for graph in graphs]


#: Capture by device type. Tests add an eager stand-in for "cpu" (replay = call again), which
#: checks the static buffers' plumbing everywhere; only CUDA captures for real.
CAPTURE: Dict[str, Capture] = {"cuda": _capture_cuda}


def capture(fns: Sequence[Callable[[], None]], device: torch.device) -> List[Callable[[], None]]:
    """Captures each of ``fns`` on ``device`` (in order, one memory pool; they run before,
    uncaptured) and returns their replays. Raises ``RuntimeError`` where an operation cannot be
    captured. :func:`device_obstacle` says first whether the device can capture at all."""
    return CAPTURE[device.type](fns, device)


def device_obstacle(device: torch.device) -> Optional[str]:
    """Why graphs cannot be captured on ``device``; ``None`` if they can."""
    if device.type not in CAPTURE:
        return f"the model is on {device.type}, not on a CUDA device"
    return None


def obstacle(steps, loss: OutputLoss, device: torch.device) -> Optional[str]:
    """Why graphs cannot apply to this chain (of
    :class:`~torch_sgn.engines.layerwise.rules.LayerRule`),
    loss and device; ``None`` if they can. Each layer's rule says whether it can be captured
    (:attr:`~torch_sgn.engines.layerwise.rules.LayerRule.capture_obstacle`)."""
    why = device_obstacle(device)
    if why is not None:
        return why
    for step in steps:
        why = step.capture_obstacle
        if why is not None:
            return why
    if not loss.closed_form:
        return f"the loss {loss.name!r} has no closed-form Hessian"
    return None


class _Captured:
    """The three graphs of one batch shape, with their static inputs and outputs."""

    def __init__(self, by_hand, steps, fmodel, loss, flat, inputs, targets):
        self.x, self.y, self.flat = inputs.clone(), targets.clone(), flat.detach().clone()
        self.v, self.trial = torch.zeros_like(self.flat), self.flat.clone()
        first = by_hand(steps, fmodel, loss, self.flat, self.x, self.y)  # checks the targets
        self.loss, self.grad = torch.zeros_like(first.loss), torch.zeros_like(first.grad)
        self.product = torch.zeros_like(first.grad)
        self.trial_loss = torch.zeros_like(first.loss)
        # What the targets are checked against at later steps (shape and dtype only).
        self.outputs_like = torch.empty_like(first.outputs, device="meta")
        self.lin: Linearization = first

    def capture(self, by_hand, steps, fmodel, loss) -> None:
        """Captures the set-up, one product and one trial loss (may raise: see the caller)."""

        def set_up() -> None:
            self.lin = by_hand(steps, fmodel, loss, self.flat, self.x, self.y, captured=True)
            self.loss.copy_(self.lin.loss)
            self.grad.copy_(self.lin.grad)

        def product() -> None:
            self.product.copy_(self.lin.ggn_vp(self.v))

        def trial() -> None:
            self.trial_loss.copy_(self.lin.value_at(self.trial))

        with torch.no_grad():
            self._set_up, self._product, self._trial = capture(
                [set_up, product, trial], self.flat.device
            )

    def __call__(self, flat: Tensor, inputs: Tensor, targets: Tensor) -> Linearization:
        with torch.no_grad():
            self.x.copy_(inputs)
            self.y.copy_(targets)
            self.flat.copy_(flat)
            self._set_up()
        return Linearization(self.loss.clone(), self.grad.clone(), self.ggn_vp, self.value_at)

    def ggn_vp(self, v: Tensor) -> Tensor:
        self.v.copy_(v)
        self._product()
        return self.product.clone()

    def value_at(self, flat: Tensor) -> Tensor:
        self.trial.copy_(flat)
        self._trial()
        return self.trial_loss.clone()


class Graphs:
    """The captured graphs of a chain, by batch shape (at most :data:`_MAX_SHAPES`).

    Returns ``None`` (run eagerly) once a capture has failed; warns once when more batch
    shapes than it keeps come round, since each new shape costs a capture.
    """

    def __init__(self) -> None:
        self._by_key: OrderedDict[tuple, _Captured] = OrderedDict()
        self.failed: Optional[str] = None
        self._evicted = False

    def clear(self) -> None:
        self._by_key.clear()

    def __call__(
        self,
        by_hand,
        steps,
        fmodel: FunctionalModel,
        loss: OutputLoss,
        flat: Tensor,
        batch: Batch,
    ) -> Optional[Linearization]:
        """The step's linearization from the graphs of the batch's shape (captured now if
        new); ``None``: run eagerly. ``batch.inputs`` is one tensor."""
        if self.failed is not None:
            return None
        inputs, targets = batch.inputs, batch.targets
        model = fmodel.model
        key = (
            tuple(inputs.shape), inputs.dtype, tuple(targets.shape), targets.dtype,
            flat.dtype, flat.device, id(loss), repr(sorted(vars(loss).items())),
            # what the captured kernels bake in: every layer's settings, dropout's mode
            tuple((type(m), m.extra_repr(), m.training) for m in model.modules()),
        )  # fmt: skip
        captured = self._by_key.get(key)
        if captured is None:
            captured = _Captured(by_hand, steps, fmodel, loss, flat, inputs, targets)
            try:
                captured.capture(by_hand, steps, fmodel, loss)
            except RuntimeError as e:  # an op that cannot be captured, out of memory, ...
                self.failed = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._by_key.clear()
                warn(
                    f"capturing the step as CUDA graphs failed ({self.failed}); running "
                    "eagerly from now on"
                )
                return None
            self._by_key[key] = captured
            if len(self._by_key) > _MAX_SHAPES:
                self._by_key.popitem(last=False)
                if not self._evicted:
                    self._evicted = True
                    warn(
                        f"more than {_MAX_SHAPES} batch shapes (or layer settings) came round; "
                        "each new one is captured again, which costs more than it saves if it "
                        "goes on: keep batch shapes fixed, or use cuda_graphs=False"
                    )
        else:  # the capture checked its first targets; these are new
            self._by_key.move_to_end(key)
            loss.check_targets(captured.outputs_like, targets)
        return captured(flat, inputs, targets)
