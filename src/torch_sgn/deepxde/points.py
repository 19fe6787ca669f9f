"""The PDE's training points redrawn where its residual is large: a DeepXDE callback."""

from __future__ import annotations

import math
from typing import Optional

import deepxde
import numpy as np

__all__ = ["ResidualPoints"]


class ResidualPoints(deepxde.callbacks.Callback):
    """Every ``period`` steps, redraws the PDE's training points by its residual (RAD: Wu, Zhu,
    Tan, Kartha and Lu, 2023)::

        model.compile(torch_sgn.deepxde.SGN(model))
        model.train(iterations=1000, callbacks=[torch_sgn.deepxde.ResidualPoints()])

    ``candidates`` points are drawn uniformly in the domain (``data.geom``) and the PDE's
    residual ``r`` evaluated at them (``model.predict(x, operator=data.pde)``; a system's
    components' absolute values summed); then ``data.num_domain`` of them, without
    replacement, with probability proportional to ``|r|^k / mean(|r|^k) + c``, replace the
    PDE's points (``data.replace_with_anchors``). The boundary and initial conditions' points
    stay. Large ``c`` approaches uniform redraws (DeepXDE's ``PDEPointResampler``); ``k = 0``
    is them. The draws use NumPy's global generator, as DeepXDE's own do
    (``dde.config.set_random_seed`` seeds it). Any optimizer's run takes it; with SGN the next
    step reads the new points.

    Where to use it (the rule of docs/PINN.md, with what it measured): a solution with a shock
    or a sharp front, or a domain with a re-entrant corner, where a fixed set of points leaves
    the solution free between them (the loss small at the points, the residual large
    elsewhere).

    Args:
        period: steps between redraws (the first after ``period`` steps).
        k: the residual's exponent in the density.
        c: the density's uniform part, relative to the residual's mean (> 0: every
            candidate can be drawn).
        candidates: uniform points the PDE's points are drawn from, at least ``num_domain``
            (default: 100,000, or ``4 * num_domain`` where that is more).
        chunk: candidates evaluated at a time (memory).

    Raises:
        ValueError: a bad argument at once; at the start of training, data this callback
            cannot redraw (not ``dde.data.PDE`` / ``TimePDE`` with a PDE and domain points,
            or with auxiliary variables).

    Attributes:
        steps: the steps counted so far (over every ``train`` this callback was given to).
        redraws: the redraws made so far.
    """

    def __init__(
        self,
        period: int = 25,
        k: float = 1.0,
        c: float = 1.0,
        candidates: Optional[int] = None,
        chunk: int = 20_000,
    ):
        super().__init__()
        for name, value in (("period", period), ("chunk", chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if candidates is not None and (
            isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1
        ):
            raise ValueError(f"candidates must be a positive integer or None, got {candidates!r}")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 <= k < math.inf:
            raise ValueError(f"k must be a finite number >= 0, got {k!r}")
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < math.inf:
            raise ValueError(f"c must be a finite number > 0, got {c!r}")
        self.period, self.k, self.c = period, float(k), float(c)
        self.candidates, self.chunk = candidates, chunk
        self.steps = 0
        self.redraws = 0

    def on_train_begin(self) -> None:
        """Checks, at the start of each ``train``, that the model's data can be redrawn.

        Raises:
            ValueError: data this callback cannot redraw (see the class).
        """
        data = self.model.data
        if not isinstance(data, deepxde.data.PDE) or getattr(data, "pde", None) is None:
            raise ValueError(
                "ResidualPoints redraws a dde.data.PDE's or TimePDE's PDE points; this "
                f"model's data is {type(data).__name__} without a PDE"
            )
        if not data.num_domain:
            raise ValueError("ResidualPoints needs the data's num_domain > 0 (its PDE points)")
        if self.candidates is not None and self.candidates < data.num_domain:
            raise ValueError(
                f"candidates ({self.candidates}) must be at least the data's num_domain "
                f"({data.num_domain}): the PDE's points are drawn from them"
            )
        if data.auxiliary_var_fn is not None:
            raise ValueError(
                "ResidualPoints cannot redraw points that carry auxiliary variables "
                "(auxiliary_var_function): leave it out of this run"
            )

    def on_epoch_end(self) -> None:
        """Counts the step; redraws the points after every ``period``-th."""
        self.steps += 1
        if self.steps % self.period == 0:
            self.redraw()

    def density(self, residual: np.ndarray) -> np.ndarray:
        """The candidates' probabilities of being drawn.

        Args:
            residual: one residual per candidate (its absolute value is taken).

        Returns:
            ``|r|^k / mean(|r|^k) + c``, normalized to sum 1; equal probabilities where every
            residual is zero, or one is not finite.
        """
        r = np.abs(np.asarray(residual, dtype=np.float64)) ** self.k
        mean = float(np.mean(r))
        if not np.isfinite(r).all() or mean == 0.0:
            return np.full(len(r), 1.0 / len(r))
        w = r / mean + self.c
        return w / w.sum()

    def residual(self, x: np.ndarray) -> np.ndarray:
        """The PDE's residual at points, evaluated ``chunk`` points at a time.

        Args:
            x: points of the domain, one a row.

        Returns:
            One value a point: the absolute values of the PDE's components there, summed.
        """
        out = []
        for start in range(0, len(x), self.chunk):
            chunk = x[start : start + self.chunk]
            r = self.model.predict(chunk, operator=self.model.data.pde)
            parts = r if isinstance(r, (list, tuple)) else [r]
            out.append(sum(np.abs(np.asarray(p)).reshape(len(chunk), -1).sum(1) for p in parts))
        return np.concatenate(out)

    def redraw(self) -> None:
        """Draws the PDE's points now (what every ``period``-th step's end does)."""
        data = self.model.data
        n = data.num_domain
        size = self.candidates or max(100_000, 4 * n)
        x = data.geom.random_points(size).astype(deepxde.config.real(np))
        p = self.density(self.residual(x))
        chosen = np.random.choice(len(x), size=n, replace=False, p=p)
        data.replace_with_anchors(x[chosen])
        self.redraws += 1
