r"""Residual least squares: physics-informed networks, operator fits, curve fits.

A problem is a sum of weighted blocks of residuals,

.. math::
    L(\theta) = \sum_b \frac{w_b}{N_b} \sum_{i=1}^{N_b} \lVert r_b(\theta; x_{b,i}) \rVert^2,

each block ``b`` a function of the network and its own ``N_b`` points (the interior of a domain
and its boundary, say), or of the parameters alone. :class:`Residuals` is that problem as an
``nn.Module`` whose output is the vector of weighted residuals
:math:`\sqrt{w_b / N_b}\, r_b`, so that :class:`~torch_sgn.SGN` with the sum of squares
(:attr:`Residuals.loss`) takes Gauss-Newton steps on :math:`L` itself: ``G = 2 J^T J``.

Each point's residual depends on that point alone, so SGN forms the Jacobian row-batched, one
block at a time (``jacobian_blocks``; see :mod:`torch_sgn.engines.functional`), for its exact
steps: through the ``P x P`` matrix where the parameters are few, through the ``R x R`` Gram
matrix ``J J^T`` where the residuals are fewer.

Example (the 2-D Poisson equation :math:`-\Delta u = f` with zero boundary values)::

    net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    problem = Residuals(net, {
        "interior": Residual(lambda u, x: -laplacian(u, x) - f(x), points=x_interior),
        "boundary": Residual(lambda u, x: u(x), points=x_boundary),
    })
    opt = SGN(problem, problem.loss, solver="auto")
    for step in range(1000):
        info = opt.step(*problem.batch(step))
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..model.flat_model import FunctionalModel
from ..residual_problem import JacobianBlock
from . import layer_kernel
from .causal import ANNEAL_ABOVE, Causal, CausalWeights, slab_weights

__all__ = ["Residual", "Residuals"]

Points = Union[Tensor, Sequence[Tensor]]


class Residual:
    """One block of residuals.

    Args:
        fn: ``fn(u, *points) -> residuals`` with ``u`` the network (call it, or pass it to the
            operators of :mod:`torch_sgn.pinn.operators`) and ``points`` this block's tensors,
            whose leading dimension counts the points; the residuals have that leading
            dimension too (one row, of any shape, per point). For a block without points,
            ``fn(u)`` returns a tensor of any shape (a residual of the parameters alone: a
            prior, a constraint, a curve fit's data folded into ``fn``).
        points: a tensor, or a tuple of tensors sharing their leading dimension; ``None`` for
            a block without points. A block with zero points contributes nothing.
        weight: ``w_b >= 0``, the block's weight in the loss (its mean squared residual is
            multiplied by it).
        sample: ``step -> points``, drawn anew at each step (:meth:`Residuals.batch`); replaces
            ``points``.
        causal: weights the block's points along time (:class:`~torch_sgn.pinn.Causal`):
            each point by its time slab's weight, computed from the current parameters at
            each :meth:`Residuals.batch` and held constant through the step (``None``: off).

    Raises:
        TypeError: ``fn`` or ``sample`` not callable; points that are not tensors; ``causal``
            not a :class:`~torch_sgn.pinn.Causal`.
        ValueError: a negative or non-finite ``weight``; points without a leading dimension,
            or tensors that differ in it; ``causal`` on a block without points.
    """

    def __init__(
        self,
        fn: Callable[..., Tensor],
        points: Optional[Points] = None,
        weight: float = 1.0,
        sample: Optional[Callable[[int], Points]] = None,
        causal: Optional[Causal] = None,
    ):
        if not callable(fn):
            raise TypeError(f"Residual needs a callable fn(u, *points), got {type(fn).__name__}")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"invalid weight={weight!r}: must be a finite number >= 0")
        if sample is not None and not callable(sample):
            raise TypeError("sample must be a callable step -> points")
        self.fn, self.weight, self.sample = fn, float(weight), sample
        self.points = None if points is None else _as_points(points, "points")
        if causal is not None and not isinstance(causal, Causal):
            raise TypeError(f"causal must be a torch_sgn.pinn.Causal, got {type(causal).__name__}")
        if causal is not None and not self.has_points:
            raise ValueError(
                "causal weighting needs the block's points (their time coordinate); this block "
                "has none: give points= or sample=, or leave causal=None"
            )
        self.causal = causal

    @property
    def has_points(self) -> bool:
        """Whether the block has points (fixed, or drawn at each step)."""
        return self.points is not None or self.sample is not None


class Residuals(nn.Module):
    """A least-squares problem of residual blocks, as a module whose output is the weighted
    residual vector (see the module's docstring).

    Args:
        network: the module whose parameters are fitted (a network, or an ``nn.Module`` of
            ``nn.Parameter`` for a curve fit); each block's ``fn`` receives it.
        blocks: the residual blocks by name, in the order their rows are stacked.

    The module's ``forward(*tensors)`` takes every block's point tensors in order (as
    :meth:`batch` gives them) and returns the weighted residuals, flat.

    Raises:
        TypeError: ``network`` not an ``nn.Module``; ``blocks`` empty or not all
            :class:`Residual`.
    """

    #: The loss SGN takes with this problem: the sum of squares of :meth:`forward`'s output
    #: (targets zero, :meth:`batch`), which equals the weighted sum of the blocks' mean squared
    #: residuals.
    loss = nn.MSELoss(reduction="sum")

    def __init__(self, network: nn.Module, blocks: Mapping[str, Residual]):
        super().__init__()
        if not isinstance(network, nn.Module):
            raise TypeError(f"network must be an nn.Module, got {type(network).__name__}")
        if not blocks or not all(isinstance(b, Residual) for b in blocks.values()):
            raise TypeError("blocks must be a non-empty mapping of names to Residual blocks")
        self.network = network
        self.names: Tuple[str, ...] = tuple(blocks)
        self.blocks: Tuple[Residual, ...] = tuple(blocks.values())
        self._arity: Tuple[int, ...] = tuple(self._count(b) for b in self.blocks)
        # a causal block's tensors end with its points' weights (batch)
        self._carried: Tuple[int, ...] = tuple(int(b.causal is not None) for b in self.blocks)
        self._causal: Dict[str, CausalWeights] = {}  # the last batch's, by block
        self._schedule_at: Dict[str, int] = {}  # each causal block's place in its schedule
        self._counts: Dict[tuple, int] = {}  # the points' shapes -> R (see count)
        self._factors_ok: Dict[tuple, bool] = {}  # the points' shapes -> layer factors checked

    @staticmethod
    def _count(block: Residual) -> int:
        if block.points is not None:
            return len(block.points)
        if block.sample is not None:
            return len(_as_points(block.sample(0), "sample(0)"))
        return 0

    # --- data ---------------------------------------------------------------------------------
    def batch(self, step: Optional[int] = None) -> Tuple[Tuple[Tensor, ...], Tensor]:
        """``(inputs, targets)`` for ``opt.step(inputs, targets)``.

        Args:
            step: the step, which blocks with ``sample`` draw their points with (``None``: as
                at step 0); fixed points are the same at every step.

        Returns:
            Every block's point tensors in order, a causal block's followed by its points'
            causal weights (computed here, from the current parameters: see
            :class:`~torch_sgn.pinn.Causal`), and zero targets, one per residual.

        Raises:
            ValueError: a block's ``sample`` returned another number of tensors than at step
                0, or points on another device than the network's parameters; a causal
                block's ``time`` outside its first point tensor's columns.
        """
        like = next(self.network.parameters(), None)
        inputs = self._inputs(step, weigh=True)
        with torch.no_grad():
            n = self.count(inputs)
        targets = torch.zeros(
            n,
            dtype=like.dtype if like is not None else torch.get_default_dtype(),
            device=like.device if like is not None else None,
        )
        return inputs, targets

    def _inputs(self, step: Optional[int], weigh: bool) -> Tuple[Tensor, ...]:
        """:meth:`batch`'s inputs; a causal block's weights all 1 unless ``weigh``."""
        like = next(self.network.parameters(), None)
        tensors: List[Tensor] = []
        for name, block, arity in zip(self.names, self.blocks, self._arity):
            if block.sample is not None:
                pts = _as_points(block.sample(0 if step is None else step), f"{name}: sample")
                if len(pts) != arity:
                    raise ValueError(
                        f"block {name!r}: sample returned {len(pts)} tensors, expected {arity}"
                    )
            else:
                pts = block.points or ()
            if like is not None and any(p.device != like.device for p in pts):
                raise ValueError(
                    f"block {name!r}: its points are on {pts[0].device}, the network's "
                    f"parameters on {like.device}; create the points on the network's device "
                    "(points=x.to(device))"
                )
            tensors.extend(pts)
            if block.causal is not None and weigh:
                tensors.append(self._causal_weights(name, block, pts))
            elif block.causal is not None:
                tensors.append(pts[0].new_ones(pts[0].shape[0]))
        return tuple(tensors)

    def _causal_weights(self, name: str, block: Residual, pts: Tuple[Tensor, ...]) -> Tensor:
        """The causal weight of each of the block's points at the current parameters, with
        the block's place in its ``epsilon`` schedule advanced (:class:`Causal`)."""
        causal = block.causal
        x = pts[0]
        if x.dim() != 2 or not -x.shape[1] <= causal.time < x.shape[1]:
            columns = x.shape[1] if x.dim() == 2 else None
            raise ValueError(
                f"block {name!r}: causal time={causal.time} is not a column of its first point "
                f"tensor (shape {tuple(x.shape)}"
                + (f", columns -{columns}..{columns - 1}" if columns else ", not N x d")
                + "); set Causal(time=...) to the column that holds time"
            )
        n = x.shape[0]
        if n == 0:
            return x.new_ones(0)
        with torch.no_grad():
            squares = self.residual(name, *pts).reshape(n, -1).square().sum(1)
            schedule = causal.schedule
            at = self._schedule_at.get(name, 0)
            times = x[:, causal.time]
            while True:
                weights, losses, per_point = slab_weights(
                    times, squares, causal.slabs, schedule[at], causal.span
                )
                if at + 1 == len(schedule) or not bool(weights.min() > ANNEAL_ABOVE):
                    break
                at += 1
        self._schedule_at[name] = at
        self._causal[name] = CausalWeights(schedule[at], weights, losses)
        return per_point.to(x.dtype)

    def causal_weights(self) -> Dict[str, CausalWeights]:
        """The causal blocks' weights as the last :meth:`batch` computed them.

        Returns:
            Each causal block's :class:`~torch_sgn.pinn.causal.CausalWeights` (its
            ``epsilon``, its slabs' weights and mean squared residuals), by its name; empty
            before the first :meth:`batch`.
        """
        return dict(self._causal)

    def _parts(self, inputs: Sequence[Tensor]):
        """``(name, block, points, causal weights or None, points' count or 1)`` of each
        block with rows on ``inputs`` (points and a weight)."""
        for (name, pts), block in zip(self.split(inputs).items(), self.blocks):
            weight = None
            if block.causal is not None:
                pts, weight = pts[:-1], pts[-1]
            n = pts[0].shape[0] if pts else 1
            if n == 0 or block.weight == 0:
                continue
            yield name, block, pts, weight, n

    def count(self, inputs: Sequence[Tensor]) -> int:
        """The number of residuals ``R`` on ``inputs``: each block's rows per point, from its
        residuals at two of its points, times its points (a block's rows per point do not
        change), the first time the points have these shapes; remembered after. Memory of two
        points, whatever their number.

        Args:
            inputs: every block's point tensors, as :meth:`batch` lays them out.

        Returns:
            ``R``.
        """
        key = (
            tuple(tuple(p.shape) for p in inputs),
            tuple(block.weight == 0 for block in self.blocks),  # a block of weight 0 adds none
        )
        if key not in self._counts:
            try:
                total = self._rows_by_block(inputs)
            except (RuntimeError, IndexError, ValueError, TypeError):
                total = self(*inputs).numel()  # the error as on all the points, or the count
            self._counts[key] = total
        return self._counts[key]

    def _rows_by_block(self, inputs: Sequence[Tensor]) -> int:
        total = 0
        with torch.no_grad():
            for name, _, pts, _, n in self._parts(inputs):
                if not pts:  # a residual of the parameters alone
                    total += self.residual(name).numel()
                    continue
                k = min(n, 2)
                total += n * (self.residual(name, *(p[:k] for p in pts)).numel() // k)
        return total

    def split(self, inputs: Sequence[Tensor]) -> Dict[str, Tuple[Tensor, ...]]:
        """The blocks' point tensors.

        Args:
            inputs: every block's point tensors, as :meth:`batch` lays them out.

        Returns:
            Each block's tensors, by its name (a causal block's end with its points' causal
            weights, as :meth:`batch` lays them out).

        Raises:
            ValueError: another number of tensors than the blocks take, or a block's tensors
                that differ in their leading dimension.
        """
        arities = [a + c for a, c in zip(self._arity, self._carried)]
        if len(inputs) != sum(arities):
            raise ValueError(
                f"Residuals takes {sum(arities)} point tensors (blocks "
                f"{dict(zip(self.names, arities))}, causal weights included), got "
                f"{len(inputs)}: pass problem.batch()'s inputs"
            )
        out, i = {}, 0
        for name, arity in zip(self.names, arities):
            pts = tuple(inputs[i : i + arity])
            i += arity
            if arity and any(p.shape[0] != pts[0].shape[0] for p in pts):
                raise ValueError(
                    f"block {name!r}: its point tensors differ in their leading dimension "
                    f"{[tuple(p.shape) for p in pts]}"
                )
            out[name] = pts
        return out

    def points(self, inputs: Sequence[Tensor]) -> List[int]:
        """The number of points of each block.

        Args:
            inputs: every block's point tensors, as :meth:`batch` lays them out.

        Returns:
            Each block's points, in the blocks' order (0 for a block without points).
        """
        return [pts[0].shape[0] if pts else 0 for pts in self.split(inputs).values()]

    def subset(self, inputs: Sequence[Tensor], index: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """A subset of the points. The weighted residuals of the subset estimate the full
        problem's without bias: each block's mean squared residual is taken over its points
        drawn.

        Args:
            inputs: every block's point tensors, as :meth:`batch` lays them out.
            index: for each block, the indices of its points to keep.

        Returns:
            ``inputs`` with only the points ``index[b]`` of each block ``b``, in the same
            layout.
        """
        out: List[Tensor] = []
        for pts, idx in zip(self.split(inputs).values(), index):
            out.extend(p[idx.to(p.device)] for p in pts)
        return tuple(out)

    # --- residuals ----------------------------------------------------------------------------
    def residual(self, name: str, *points: Tensor) -> Tensor:
        """One block's residuals.

        Args:
            name: the block's name.
            *points: its point tensors.

        Returns:
            Its residuals on ``points``, unweighted, one row per point.

        Raises:
            TypeError: ``fn`` returned something other than a tensor.
            ValueError: residuals without one row per point.
        """
        block = self.blocks[self.names.index(name)]
        try:
            r = block.fn(self.network, *points)
        except (RuntimeError, IndexError) as error:  # points of the wrong shape, typically
            shapes = [tuple(p.shape) for p in points]
            kind = RuntimeError if isinstance(error, RuntimeError) else IndexError
            raise kind(f"block {name!r} on points of shape {shapes}: {error}") from error
        if not isinstance(r, Tensor):
            raise TypeError(f"block {name!r}: fn returned {type(r).__name__}, not a tensor")
        if points and (r.dim() == 0 or r.shape[0] != points[0].shape[0]):
            raise ValueError(
                f"block {name!r}: fn returned residuals of shape {tuple(r.shape)} for "
                f"{points[0].shape[0]} points; return one row per point (leading dimension "
                f"{points[0].shape[0]})"
            )
        return r

    def forward(self, *inputs: Tensor, only: Optional[str] = None) -> Tensor:
        r"""The weighted residual vector.

        Args:
            *inputs: every block's point tensors, as :meth:`batch` lays them out.
            only: a block's name: that block's rows on ``inputs`` (its own tensors, as
                :meth:`split` gives them) without the block's weight ``w_b / N_b`` instead
                (a causal block's times its points' causal weights' square roots).

        Returns:
            The residuals :math:`\sqrt{w_b / N_b}\, r_b` of every block, flat (a causal
            block's point ``n`` times :math:`\sqrt{w_{i(n)}}` too).
        """
        if only is not None:  # one block's rows (the Jacobian's blocks)
            block = self.blocks[self.names.index(only)]
            if block.causal is None:
                return self.residual(only, *inputs)
            return _causally(self.residual(only, *inputs[:-1]), inputs[-1])
        parts = []
        for name, block, pts, weight, n in self._parts(inputs):
            r = self.residual(name, *pts)
            if weight is not None:
                r = _causally(r, weight)
            parts.append(r.reshape(-1) * math.sqrt(block.weight / n))
        if not parts:
            like = next(self.network.parameters())
            return like.new_zeros(0)
        return torch.cat(parts)

    def losses(self, inputs: Optional[Sequence[Tensor]] = None) -> Dict[str, float]:
        """Each block's mean squared residual, unweighted.

        Args:
            inputs: every block's point tensors (:meth:`batch`'s points by default, the
                causal weights neither computed nor advanced).

        Returns:
            The mean squared residual of each block, by its name (without causal weights).
        """
        if inputs is None:
            inputs = self._inputs(None, weigh=False)
        with torch.no_grad():
            out = {}
            for (name, pts), block in zip(self.split(inputs).items(), self.blocks):
                if block.causal is not None:
                    pts = pts[:-1]
                if pts and pts[0].shape[0] == 0:
                    out[name] = 0.0
                    continue
                r = self.residual(name, *pts)
                n = pts[0].shape[0] if pts else 1
                out[name] = float(r.square().sum()) / n
        return out

    def non_finite(self, inputs: Sequence[Tensor]) -> Optional[str]:
        """Where the residuals are NaN or infinite, said for an error message.

        Args:
            inputs: every block's point tensors, as :meth:`batch` lays them out.

        Returns:
            Each block whose residuals are not finite everywhere, with how many of its points
            give such a residual and the first of them (its index and coordinates); ``None``
            where every residual is finite.
        """
        found = []
        with torch.no_grad():
            for name, _, pts, _, n in self._parts(inputs):
                r = self.residual(name, *pts)
                rows = r.reshape(n, -1) if pts else r.reshape(1, -1)
                bad = ~torch.isfinite(rows).all(dim=1)
                if not bool(bad.any()):
                    continue
                if not pts:
                    found.append(f"block {name!r} (a residual of the parameters alone)")
                    continue
                first = int(bad.nonzero()[0])
                at = ", ".join(
                    f"{[round(v, 6) for v in p[first].reshape(-1).tolist()]}" for p in pts
                )
                found.append(
                    f"block {name!r} at {int(bad.sum())} of its {n} points (the first: point "
                    f"{first}, {at})"
                )
        return "; ".join(found) if found else None

    # --- the row-batched Jacobian (torch_sgn.engines.functional) --------------------------------
    def jacobian_blocks(
        self, fmodel: FunctionalModel, inputs: Sequence[Tensor]
    ) -> List[JacobianBlock]:
        """The blocks of rows whose Jacobians are formed separately
        (:class:`~torch_sgn.residual_problem.ResidualProblem`).

        Args:
            fmodel: the problem as a function of its flat parameters.
            inputs: every block's point tensors, as :meth:`batch` lays them out.

        Returns:
            One :class:`~torch_sgn.residual_problem.JacobianBlock` per residual block with
            points and a weight: the weighted rows of one point, at a flat parameter vector
            (its tensors a causal block's points and their causal weights).
        """
        out = []
        for name, block, pts, weight, n in self._parts(inputs):
            scale = math.sqrt(block.weight / n)
            tensors = tuple(pts) if weight is None else (*pts, weight)
            out.append(JacobianBlock(_Rows(self, fmodel, name, scale), tensors))
        return out

    @property
    def factors_follow(self) -> bool:
        """Whether the layers' factors (:meth:`layer_factors`) have been checked against
        ``J``'s rows and followed them, on some points: steps on every row of a problem of
        many points take them (:func:`torch_sgn.route_plan.row_stage`)."""
        return any(self._factors_ok.values())

    def layer_factors(
        self, fmodel: FunctionalModel, flat: Tensor, inputs: Sequence[Tensor]
    ) -> Optional[layer_kernel.LayerFactors]:
        """``J J^T`` and ``J^T u`` from the network's linear layers
        (:mod:`torch_sgn.pinn.layer_kernel`), checked against a few rows of ``J`` the first
        time the points have these shapes.

        Args:
            fmodel: the problem as a function of its flat parameters.
            flat: the parameters.
            inputs: every block's point tensors, as :meth:`batch` lays them out.

        Returns:
            The layers' factors, or ``None`` where they do not give ``J`` (then ``J`` is
            formed row by row).
        """
        key = tuple((tuple(p.shape), p.dtype) for p in inputs)
        if self._factors_ok.get(key) is False:
            return None
        try:
            factors = layer_kernel.layer_factors(self, fmodel, flat, inputs)
            if factors is not None and key not in self._factors_ok:
                self._factors_ok[key] = layer_kernel.checked(factors, fmodel, flat, self, inputs)
        except Exception:  # noqa: BLE001 - a network the factors cannot follow: rows instead
            factors = None
        if factors is None:
            self._factors_ok[key] = False
            return None
        return factors if self._factors_ok[key] else None


class _Rows:
    """``(flat, *point) -> block name's weighted residual rows at one point``."""

    def __init__(self, problem: Residuals, fmodel: FunctionalModel, name: str, scale: float):
        self.problem, self.fmodel, self.name, self.scale = problem, fmodel, name, scale

    def __call__(self, flat: Tensor, *point: Tensor) -> Tensor:
        params = self.fmodel.unflatten(flat)
        one = tuple(p.unsqueeze(0) for p in point)
        r = torch.func.functional_call(
            self.problem, params, one, {"only": self.name}, tie_weights=False
        )
        return r.reshape(-1) * self.scale


def _causally(r: Tensor, weight: Tensor) -> Tensor:
    """A block's rows ``r`` (one per point) times their points' causal weights' roots."""
    return r * weight.sqrt().reshape(-1, *([1] * (r.dim() - 1)))


def _as_points(points: Points, what: str) -> Tuple[Tensor, ...]:
    pts = (points,) if isinstance(points, Tensor) else tuple(points)
    if not pts or not all(isinstance(p, Tensor) for p in pts):
        raise TypeError(f"{what} must be a tensor or a tuple of tensors")
    if any(p.dim() == 0 for p in pts):
        raise ValueError(f"{what}: each tensor needs a leading dimension counting the points")
    if any(p.shape[0] != pts[0].shape[0] for p in pts):
        raise ValueError(
            f"{what}: the tensors differ in their leading dimension {[tuple(p.shape) for p in pts]}"
        )
    return pts
