r"""Cheaper tangent formulas for the traced engine (:mod:`torch_sgn.traced`).

While the traced engine records its product, :class:`TangentRules` replaces a few functions by
:class:`torch.autograd.Function` objects whose forward and reverse passes are PyTorch's own
kernels and whose forward-mode rule (``jvp``) is written so that the part that depends on the
tangent is as short as possible: everything else depends on the point only, so the engine's
split moves it to the once-per-step set-up. The products stay exact; only the order of the
floating-point operations changes.

Batch normalization (:func:`torch.nn.functional.batch_norm`). With
:math:`\hat x = (x - \mu) \sigma^{-1}`, :math:`y = \gamma \hat x + \beta` and
:math:`a = \gamma \sigma^{-1}` per channel, the tangent in training mode (batch statistics,
:math:`\operatorname{mean}` over every dimension but the channels) is

.. math::

    \dot y = a \dot x + \hat x \bigl(\dot\gamma - a \operatorname{mean}(\dot x \hat x)\bigr)
        + \bigl(\dot\beta - a \operatorname{mean}(\dot x)\bigr),

two full-size products and two reductions per product (PyTorch's own rule recomputes the
centred input and takes about a dozen full-size operations). In evaluation mode (running
statistics) the two means drop out.
"""

from __future__ import annotations

import inspect
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["TangentRules"]

_BATCH_NORM = inspect.signature(F.batch_norm)


class TangentRules(TorchFunctionMode):
    """A function mode that routes :func:`torch.nn.functional.batch_norm` through
    :class:`BatchNorm` (the rule above); every other function runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            bound = _BATCH_NORM.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if a["training"] or (a["running_mean"] is not None and a["running_var"] is not None):
                return BatchNorm.apply(
                    a["input"],
                    a["weight"],
                    a["bias"],
                    a["running_mean"],
                    a["running_var"],
                    bool(a["training"]),
                    a["momentum"],
                    a["eps"],
                )
        return func(*args, **kwargs)


def _channel_shape(x: Tensor) -> List[int]:
    return [1, -1] + [1] * (x.dim() - 2)


class BatchNorm(torch.autograd.Function):
    """``F.batch_norm`` with the tangent formula of the module docstring.

    Forward and reverse are ``aten.native_batch_norm`` and its backward, as in PyTorch (the
    running statistics are updated in the forward pass, in training mode)."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        running_mean: Optional[Tensor],
        running_var: Optional[Tensor],
        training: bool,
        momentum: Optional[float],
        eps: float,
    ) -> Tensor:
        if x.dim() < 2:
            raise ValueError(f"batch norm expects an input of 2 or more dimensions, got {x.dim()}")
        out, save_mean, save_invstd = torch.native_batch_norm(
            x, weight, bias, running_mean, running_var, training, momentum or 0.0, eps
        )
        if training:
            mean, invstd = save_mean, save_invstd
        else:
            mean, invstd = running_mean, torch.rsqrt(running_var + eps)
        shape = _channel_shape(x)
        ctx.training, ctx.eps = training, eps
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        # For the reverse pass: what aten's backward takes (running statistics only where it
        # reads them, in evaluation mode; training mode has just overwritten them).
        stats = (None, None) if training else (running_mean, running_var)
        ctx.save_for_backward(x, weight, *stats, save_mean, save_invstd)
        # For the tangent: the normalized input and the per-channel scale, both independent of
        # the tangent (the traced engine computes them once per step).
        ctx.xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.scale = invstd if weight is None else weight * invstd
        return out

    @staticmethod
    def jvp(ctx, dx, dweight, dbias, *_):
        xhat, scale = ctx.xhat, ctx.scale
        shape = _channel_shape(xhat)
        coef = dweight if ctx.has_weight else None  # multiplies xhat
        shift = dbias if ctx.has_bias else None  # added per channel
        if dx is not None and ctx.training:
            dims = [0] + list(range(2, xhat.dim()))
            m1 = dx.mean(dims)
            m2 = (dx * xhat).mean(dims)
            coef = -scale * m2 if coef is None else coef - scale * m2
            shift = -scale * m1 if shift is None else shift - scale * m1
        if dx is not None:
            if shift is not None:
                out = torch.addcmul(shift.view(shape), dx, scale.view(shape))
            else:
                out = dx * scale.view(shape)
        elif shift is not None:
            out = shift.view(shape).expand_as(xhat).clone()
        else:
            out = torch.zeros_like(xhat)
        if coef is not None:
            out = torch.addcmul(out, xhat, coef.view(shape))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, running_mean, running_var, save_mean, save_invstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], ctx.has_weight and needs[1], ctx.has_bias and needs[2]]
        gx, gweight, gbias = torch.ops.aten.native_batch_norm_backward(
            grad_out.contiguous(),
            x,
            weight,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            ctx.training,
            ctx.eps,
            mask,
        )
        return gx, gweight, gbias, None, None, None, None, None
