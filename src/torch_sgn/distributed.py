r"""Data-parallel SGN on ``torch.distributed``.

Every rank holds the same model and one shard of the mini-batch. The full batch's loss
:math:`L = \sum_r w_r L_r` is a weighted sum of the shards' losses, with :math:`w_r = c_r / \sum_s
c_s` for a mean-reduced loss (:math:`c_r` the number of terms the shard's mean divides by:
samples, elements, or the class weights of its targets) and :math:`w_r = 1` for a sum. Since
gradients and Gauss-Newton products are linear in the loss,

.. math::
    g = \sum_r w_r\, g_r,\qquad G v = \sum_r w_r\, G_r v,

so SGN needs one all-reduce for the gradient (with the loss and the counts riding along), one
per CG product ``G v``, and one scalar all-reduce per trial-point loss (trust region and line
search). Every rank then holds the same reduced vectors and runs the same CG, trust-region and
line-search arithmetic on them, so every decision and every parameter is bit-identical across
ranks, provided the all-reduce returns the same bits everywhere (ring and tree all-reduces in
gloo and NCCL do: each element is reduced once and the result is copied to every rank) and
the ranks run the same kernels.

Per step, with ``k`` CG products and ``e`` trial-point losses::

    1 all-reduce (max) of 6 float64: step number and parameter fingerprint (overlapped with the
      forward and backward pass)
    1 all-reduce (sum) of n + 4 (+ float buffers in training mode): gradient, loss, counts
    k all-reduces (sum) of n: the products G v (each needs the previous one: not overlappable)
    e all-reduces (sum) of 1: trial-point losses

The first of these also makes failures collective: a rank whose local computation raises
(bad targets, say) still takes part, flagging its failure, and every rank raises. A rank that
dies, hangs, or does not call :meth:`SGN.step <torch_sgn.SGN.step>` makes the others fail in
their next collective: at once if its process exited, otherwise after the process group's
timeout (``init_process_group(timeout=...)``; the default is 30 minutes for gloo and 10 for
NCCL), with an error naming the step and the likely cause.

With ``solver="direct"`` the ``k`` products are replaced by one all-reduce (sum) of ``n^2``
numbers, each rank's Gauss-Newton matrix weighted as its products are; ``solver="auto"`` adds
two scalar all-reduces once, so that every rank takes the same decision from the summed
timings.

The helpers :func:`init_from_env`, :func:`shard`, :func:`is_main_process`, :func:`rank` and
:func:`world_size` are what a training loop needs around :class:`~torch_sgn.SGN`; see
``examples/distributed_train.py`` and ``docs/DISTRIBUTED.md``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import replace
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .linearization import Batch, Engine, Linearization, linearize
from .losses import OutputLoss
from .model.flat_model import FunctionalModel

__all__ = ["init_from_env", "is_main_process", "rank", "shard", "world_size"]

ProcessGroup = Optional["dist.ProcessGroup"]


# --- helpers for training loops and runners -------------------------------------------------
def init_from_env(timeout: float = 300.0, backend: Optional[str] = None) -> bool:
    """Initialises the default process group if launched by ``torchrun``; else does nothing.

    Args:
        timeout: seconds a collective waits for the other ranks before failing; it bounds how
            long a dead or hung rank can stall the others. Default 300 (torch's own default is
            30 minutes for gloo).
        backend: ``"gloo"`` or ``"nccl"``; ``None`` picks NCCL when CUDA is available, else gloo.

    Returns:
        Whether this process is part of a multi-process job (``WORLD_SIZE`` > 1 in the
        environment, as ``torchrun`` sets it).

    Raises:
        RuntimeError: NCCL was chosen and this node starts more processes than it has CUDA
            devices.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and "LOCAL_RANK" in os.environ:
            local, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
            if local >= count:
                raise RuntimeError(
                    f"NCCL needs one CUDA device per process, but local rank {local} found "
                    f"{count} device(s): start at most {count} processes per node, or pass "
                    "backend='gloo' to train on the CPU"
                )
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return True


def _active(group: ProcessGroup = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group: ProcessGroup = None) -> int:
    """This process's rank in ``group`` (default: the world); 0 when not distributed.

    Args:
        group: the process group; ``None`` for the default (world) group.

    Returns:
        The rank, 0 where no process group of more than one process is initialised.
    """
    return dist.get_rank(group) if _active(group) else 0


def world_size(group: ProcessGroup = None) -> int:
    """The number of processes in ``group`` (default: the world); 1 when not distributed.

    Args:
        group: the process group; ``None`` for the default (world) group.

    Returns:
        The group's size, 1 where no process group of more than one process is initialised.
    """
    return dist.get_world_size(group) if _active(group) else 1


def is_main_process(group: ProcessGroup = None) -> bool:
    """Whether this process should write files and show progress (rank 0, or no job).

    Args:
        group: the process group; ``None`` for the default (world) group.

    Returns:
        ``True`` on rank 0 of ``group``, and where the job is not distributed.
    """
    return rank(group) == 0


def shard(*tensors: Tensor, group: ProcessGroup = None) -> tuple[Tensor, ...]:
    """This rank's contiguous slice of each batch tensor, along the first dimension.

    Slices are as equal as possible (the first ``N % world_size`` ranks get one example more,
    as :func:`torch.tensor_split`); SGN weights each rank by its share, so unequal slices give
    the full batch's step exactly. Every rank must pass the same full batch (draw the batch
    order from a generator seeded identically on every rank).

    Args:
        *tensors: the full batch's tensors, each with the batch along its first dimension.
        group: the process group; ``None`` for the default (world) group.

    Returns:
        This rank's slice of each tensor, in the order given (views, not copies).

    Example:
        >>> x_r, y_r = shard(x, y)
        >>> info = opt.step(x_r, y_r)
    """
    r, w = rank(group), world_size(group)
    return tuple(torch.tensor_split(t, w)[r] for t in tensors)


# --- the communicator SGN uses ----------------------------------------------------------------
class SingleProcess:
    """The communicator of a single process: no communication at all."""

    def linearize(
        self, step: int, engine: Engine, flat: Tensor, batch: Batch, buffers_out: dict | None = None
    ) -> Linearization:
        return linearize(engine, flat, batch, buffers_out)

    def loss_value(self, compute: Callable[[], Tensor]) -> float:
        return compute().item()

    def agree(self, values: list) -> list:
        return values

    def shares(
        self, compute: Callable[[], tuple[Tensor, Tensor]], sizes: tuple[int, int], what: str
    ) -> tuple[Tensor, Tensor]:
        return compute()


def communicator(
    fmodel: FunctionalModel, loss: OutputLoss, process_group: ProcessGroup
) -> SingleProcess | DataParallel:
    """The data-parallel communicator if a group of more than one process applies."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return SingleProcess()
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return SingleProcess()
    return DataParallel(fmodel, loss, group)


class DataParallel:
    """All-reduces what SGN's decisions depend on, weighted by each rank's share of the batch.

    It wraps one step's :class:`~torch_sgn.linearization.Linearization` (loss, gradient and
    every ``G v``) and reduces trial-point losses with the same weights. See the module's docstring.
    """

    def __init__(self, fmodel: FunctionalModel, loss: OutputLoss, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sum_reduction = loss.reduction == "sum"
        self._loss = loss
        self._fmodel = fmodel
        self._step = -1
        self._scale: Tensor | None = None  # this rank's c_r in the current step
        self._total: Tensor | None = None  # sum of c_r (1 for a sum-reduced loss)
        self._broadcast_model()

    # --- construction: every rank starts from rank 0's model ------------------------------------
    @torch.no_grad()
    def _broadcast_model(self) -> None:
        fm = self._fmodel
        others = [p for p in fm.model.parameters() if not p.requires_grad]
        others += list(fm.model.buffers())
        shape = [float(fm.numel), float(len(others)), float(sum(t.numel() for t in others))]
        self._agree(shape, "the model (trainable size, number and size of other tensors)", None)
        src = dist.get_global_rank(self.group, 0)
        flat = fm.flat()
        self._collective(lambda: dist.broadcast(flat, src, group=self.group), "parameters", None)
        fm.write(flat)
        for t in others:  # buffers and frozen parameters: once, at construction
            self._collective(lambda t=t: dist.broadcast(t, src, group=self.group), "buffers", None)

    def _agree(self, values: list, what: str, step: Optional[int]) -> None:
        """Raises on every rank unless ``values`` are equal on all ranks (one max all-reduce)."""
        both = torch.tensor(values + [-v for v in values], dtype=torch.float64)
        both = both.to(self._fmodel.device)
        self._collective(lambda: dist.all_reduce(both, dist.ReduceOp.MAX, self.group), what, step)
        high, low = both[: len(values)], -both[len(values) :]
        if not torch.equal(high, low):
            raise RuntimeError(
                f"SGN (rank {self.rank} of {self.world}): {what} differ across ranks: "
                f"between {low.tolist()} and {high.tolist()}; every rank must build the same model"
            )

    # --- one step ------------------------------------------------------------------------------
    def linearize(
        self, step: int, engine: Engine, flat: Tensor, batch: Batch, buffers_out: dict | None = None
    ) -> Linearization:
        """The full batch's linearization from this rank's shard: 2 all-reduces, 1 overlapped."""
        fmodel, loss, targets = self._fmodel, self._loss, batch.targets
        self._step = step
        header = self._start_header(step, flat)  # runs during the forward and backward pass
        n = fmodel.numel
        names = _float_buffer_names(fmodel) if buffers_out is not None else []
        error: BaseException | None = None
        lin = None
        try:
            count = targets.shape[0] if targets.dim() else 1
            # This shard's weight in the full batch's mean: what its own mean divides by.
            scale = 1.0 if self.sum_reduction else loss.normalizer(targets)
            if count == 0:  # an empty shard contributes nothing
                lin, scale = Linearization(flat.new_zeros(()), flat.new_zeros(n), None), 0.0
                if buffers_out is not None:
                    buffers_out.update({k: b.clone() for k, b in fmodel.model.named_buffers()})
            else:
                lin = linearize(engine, flat, batch, buffers_out)
                if scale == 0:  # every target ignored: its forward pass counts for the
                    # buffers only (its own mean is NaN, and NaN * 0 is NaN)
                    lin = Linearization(flat.new_zeros(()), flat.new_zeros(n), None)
            payload = [
                lin.grad * scale,
                (lin.loss * scale).reshape(1).to(flat.dtype),
                flat.new_tensor([scale, count, 0.0]),
            ]
            if names:
                payload += [buffers_out[k].reshape(-1).to(flat.dtype) * count for k in names]
            payload = torch.cat(payload)
        except Exception as e:  # take part anyway, so that every rank raises
            error, scale, count = e, 0.0, 0
            own = dict(fmodel.model.named_buffers())
            size = n + 4 + sum(own[k].numel() for k in names)
            payload = flat.new_zeros(size)
            payload[n + 3] = 1.0
        self._collective(
            lambda: dist.all_reduce(payload, group=self.group), "the gradient and loss", step
        )
        self._finish_header(header, step)
        self._raise_if_failed(payload[n + 3], error, step)
        total = payload[n + 1] if not self.sum_reduction else payload.new_ones(())
        self._scale = flat.new_tensor(float(scale))
        self._total = total
        if names:
            samples = payload[n + 2]
            chunks = payload[n + 4 :].split([buffers_out[k].numel() for k in names])
            for k, c in zip(names, chunks):
                buffers_out[k] = (c / samples).view_as(buffers_out[k]).to(buffers_out[k].dtype)
        return replace(
            lin,
            loss=payload[n] / total,
            grad=payload[:n] / total,
            ggn_vp=self._reduced_ggn_vp(lin.ggn_vp, step, n, flat),
            dense_ggn=self._reduced_ggn_matrix(lin, step, n, flat),
            sample_space=None,  # each rank holds its own samples' outputs only
        )

    def _reduced_ggn_vp(
        self, local: Callable[[Tensor], Tensor] | None, step: int, n: int, flat: Tensor
    ) -> Callable[[Tensor], Tensor]:
        scale, total = self._scale, self._total

        def ggn_vp(v: Tensor) -> Tensor:
            error = None
            try:  # a local failure takes part in the all-reduce, so that every rank raises
                gv = flat.new_zeros(n) if local is None else local(v) * scale
                payload = torch.cat([gv, gv.new_zeros(1)])
            except Exception as e:
                error, payload = e, flat.new_zeros(n + 1)
                payload[n] = 1.0
            self._collective(
                lambda: dist.all_reduce(payload, group=self.group), "a G v product", step
            )
            self._raise_if_failed(payload[n], error, step)
            return payload[:n] / total

        return ggn_vp

    def _reduced_ggn_matrix(
        self, local: Linearization, step: int, n: int, flat: Tensor
    ) -> Callable[[], Tensor]:
        """``() -> G`` of the full batch for the direct solver: every rank's ``G_r`` weighted
        and summed as ``G v`` is, in one all-reduce of ``n^2 + 1`` numbers."""
        scale, total = self._scale, self._total

        def ggn_matrix() -> Tensor:
            error = None
            try:  # a local failure takes part in the all-reduce, so that every rank raises
                if local.ggn_vp is None:  # an empty shard
                    g = flat.new_zeros((n, n), dtype=torch.float64)
                else:
                    g = local.ggn_matrix() * scale  # float64
                payload = torch.cat([g.reshape(-1), g.new_zeros(1)])
            except Exception as e:
                error, payload = e, flat.new_zeros(n * n + 1, dtype=torch.float64)
                payload[n * n] = 1.0
            self._collective(
                lambda: dist.all_reduce(payload, group=self.group), "the Gauss-Newton matrix", step
            )
            self._raise_if_failed(payload[n * n], error, step)
            return (payload[: n * n] / total).view(n, n)

        return ggn_matrix

    def agree(self, values: list) -> list:
        """The sums over the group of every rank's ``values`` (one all-reduce): what
        ``solver="auto"`` decides by, so that every rank takes the same decision."""
        payload = torch.tensor(values, dtype=torch.float64, device=self._fmodel.device)
        self._collective(
            lambda: dist.all_reduce(payload, group=self.group), "the solver's costs", self._step
        )
        return payload.tolist()

    def shares(
        self, compute: Callable[[], tuple[Tensor, Tensor]], sizes: tuple[int, int], what: str
    ) -> tuple[Tensor, Tensor]:
        """The full batch's ``(mean, sum)`` from this shard's ``compute() -> (mean, sum)``, two
        flat tensors of ``sizes``: the first a quantity of the shard's mean loss (weighted by
        the shard's share, as the gradient is), the second summed as it is. One all-reduce;
        an empty shard adds nothing, a failure on one rank raises on every rank."""
        assert self._scale is not None, "shares before linearize"
        n, m = sizes
        error = None
        # In float64, so that sums (of squares, say) agree with one process's, which takes
        # them in float64, and do not overflow in a lower precision.
        payload = self._scale.new_zeros(n + m + 1, dtype=torch.float64)
        try:
            if bool(self._scale):  # an empty shard's mean is NaN: it counts for nothing
                mean, total = compute()
                payload[:n] = mean.reshape(-1).double() * float(self._scale)
                payload[n : n + m] = total.reshape(-1)
        except Exception as e:
            error, payload[n + m] = e, 1.0
        self._collective(lambda: dist.all_reduce(payload, group=self.group), what, self._step)
        self._raise_if_failed(payload[n + m], error, self._step)
        mean = (payload[:n] / float(self._total)).to(self._scale.dtype)
        return mean, payload[n : n + m]

    def loss_value(self, compute: Callable[[], Tensor]) -> float:
        """The full batch's loss at a trial point from this shard's ``compute()``: 1 all-reduce."""
        assert self._scale is not None, "loss_value before linearize"
        error = None
        payload = self._scale.new_zeros(2)
        try:
            if bool(self._scale):  # an empty shard's mean is NaN: it counts for nothing
                payload[0] = compute().detach().reshape(()).to(payload.dtype) * self._scale
        except Exception as e:
            error, payload[1] = e, 1.0
        self._collective(
            lambda: dist.all_reduce(payload, group=self.group), "a trial-point loss", self._step
        )
        self._raise_if_failed(payload[1], error, self._step)
        return (payload[0] / self._total).item()

    def _raise_if_failed(self, flag: Tensor, error: Optional[BaseException], step: int) -> None:
        """After an all-reduce that carried a failure count: the failing rank re-raises its own
        error, the others say that another rank failed."""
        failed = int(flag.item())
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(
                f"SGN step {step}: {failed} other rank(s) of {self.world} failed in their local "
                "computation (see their error); the parameters were not changed"
            )

    # --- the step-number and parameter check ---------------------------------------------------
    def _start_header(self, step: int, flat: Tensor):
        theta = flat.detach().double()
        fingerprint = torch.stack([theta.sum(), theta.square().sum()]).nan_to_num(0.0, 1e300)
        values = torch.cat([theta.new_tensor([float(step)]), fingerprint])
        header = torch.cat([values, -values])
        work = self._collective(
            lambda: dist.all_reduce(header, dist.ReduceOp.MAX, self.group, async_op=True),
            "the step number",
            step,
        )
        return work, header

    def _finish_header(self, started, step: int) -> None:
        work, header = started
        self._collective(work.wait, "the step number", step)
        high, low = header[:3], -header[3:]
        if high[0] != low[0]:
            raise RuntimeError(
                f"SGN's step counts differ across ranks: this is step {step} on rank {self.rank}, "
                f"the ranks are between steps {int(low[0])} and {int(high[0])}. Every rank must "
                "call step once per global batch, and load the same optimizer state"
            )
        if not torch.equal(high, low):
            raise RuntimeError(
                f"SGN step {step}: the parameters differ across ranks (fingerprints between "
                f"{low[1:].tolist()} and {high[1:].tolist()}). Change the model only through "
                "SGN, or identically on every rank (e.g. load a checkpoint on all ranks)"
            )

    def _collective(self, run: Callable, what: str, step: Optional[int]):
        try:
            return run()
        except RuntimeError as e:
            where = "construction" if step is None else f"step {step}"
            raise RuntimeError(
                f"SGN {where}, rank {self.rank} of {self.world}: the collective for {what} "
                "failed. Another rank probably crashed, hung past the process group's timeout, "
                "or did not call SGN.step (every rank must call it once per global batch). "
                f"Check the other ranks' logs. Cause: {e}"
            ) from e


def _float_buffer_names(fmodel: FunctionalModel) -> list[str]:
    """The buffers a training-mode step updates and the ranks average (batch-norm statistics)."""
    if not fmodel.model.training:
        return []
    return [k for k, b in fmodel.model.named_buffers() if b.is_floating_point()]
