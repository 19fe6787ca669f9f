r"""Cheaper tangent formulas for the traced engine (:mod:`torch_sgn.engines.traced.engine`).

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
statistics) the two means drop out. Layer normalization has the same tangent with the means
taken over the normalized dimensions and :math:`\gamma \sigma^{-1}` applied as two factors
(per feature, per row); its rule keeps the normalized input alone for the products, where
PyTorch's keeps the centred input beside it.

Attention (:func:`torch.nn.functional.scaled_dot_product_attention` without a mask tensor,
dropout or grouped heads) is recorded as its composite, ``softmax(q k^T * scale) v`` with the
causal mask added as a constant (``-inf`` above the diagonal: the reverse pass goes through it
unchanged), and a softmax (:class:`Softmax`) whose tangent reads only the attention weights,
where PyTorch's keeps the exponentials beside them: one tensor of the weights' size less per
attention layer for the products.

LSTM layers. PyTorch's recurrent kernels take the tangent one time step at a time, every term
of it: ``x_t dW_ih^T`` and ``h_{t-1} dW_hh^T`` as well as the recurrent ``dh_{t-1} W_hh^T``,
in a few dozen small operations per step. :class:`LSTMLayer` takes the terms that do not
depend on the recurrence as one matrix product over all steps (``[x_t, h_{t-1}]`` side by
side), and each time step in one small matrix product and four elementwise operations, with
the gates' derivatives folded into one factor tensor once per step of SGN; its reverse pass
likewise leaves one matrix product and four operations per time step in the loop and takes the
weights' gradients as one matrix product. Stacked and bidirectional layers are one
:class:`LSTMLayer` per layer and direction, the reverse direction on the time-reversed sequence;
dropout between layers in training mode is drawn as PyTorch's kernels draw it
(:func:`torch.nn.functional.dropout` on each layer's input but the first's).
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
_LAYER_NORM = inspect.signature(F.layer_norm)


class TangentRules(TorchFunctionMode):
    """A function mode that routes :func:`torch.nn.functional.batch_norm` through
    :class:`BatchNorm`, :func:`torch.nn.functional.layer_norm` through :class:`LayerNorm`,
    :func:`torch.nn.functional.scaled_dot_product_attention` through its composite and
    LSTM layers (``torch.lstm``, as ``nn.LSTM`` calls it, without projections) through
    :class:`LSTMLayer`; every other function runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.lstm:
            out = _lstm(*args, **kwargs)
            if out is not None:
                return out
        if func is F.scaled_dot_product_attention:
            out = _attention(*args, **kwargs)
            if out is not None:
                return out
        if func is F.layer_norm:
            bound = _LAYER_NORM.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            shape = tuple(a["normalized_shape"])
            return LayerNorm.apply(a["input"], shape, a["weight"], a["bias"], a["eps"])
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


# --- LSTM -------------------------------------------------------------------------------------
def _lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """``torch.lstm`` (the padded form ``nn.LSTM`` calls) through :class:`LSTMLayer`, one call
    per layer and direction (the reverse direction on the time-reversed sequence), with
    PyTorch's dropout between layers; ``None`` where the rule does not apply (projections,
    packed sequences)."""
    if not isinstance(hx, (list, tuple)) or input.dim() != 3:
        return None
    directions = 2 if bidirectional else 1
    per_layer = 4 if has_biases else 2
    if len(params) != per_layer * directions * num_layers:
        return None
    h0, c0 = hx
    if params[1].shape[1] != h0.shape[-1]:  # projections (proj_size > 0)
        return None
    x = input.transpose(0, 1) if batch_first else input
    hs, cs = [], []
    for layer in range(num_layers):
        if layer > 0 and train and dropout > 0:  # as PyTorch's kernels: between layers only
            x = F.dropout(x, dropout, training=True)
        outs = []
        for direction in range(directions):
            index = layer * directions + direction
            w = list(params[per_layer * index : per_layer * (index + 1)])
            b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
            seq = x if direction == 0 else x.flip(0)
            out, h, c = LSTMLayer.apply(seq, h0[index], c0[index], w[0], w[1], b_ih, b_hh)
            outs.append(out if direction == 0 else out.flip(0))
            hs.append(h)
            cs.append(c)
        x = outs[0] if directions == 1 else torch.cat(outs, 2)
    out = x.transpose(0, 1) if batch_first else x
    return out, torch.stack(hs), torch.stack(cs)


def _addmm_terms(bias: Optional[Tensor], terms, rows: int, cols: int, like: Tensor) -> Tensor:
    """``bias + sum(a @ b for a, b in terms)`` without separate additions."""
    out = None
    for a, b in terms:
        if out is None:
            out = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
        else:
            out = torch.addmm(out, a, b)
    if out is None:
        out = torch.zeros(rows, cols, dtype=like.dtype, device=like.device)
        if bias is not None:
            out = out + bias
    return out


class LSTMLayer(torch.autograd.Function):
    """One unidirectional LSTM layer over ``x`` of shape ``(T, N, I)``: ``(out, h_T, c_T)``,
    gates in PyTorch's order ``i, f, g, o``.

    With ``d = slope * dpre`` the gates' tangents (``slope`` the derivatives of the gates'
    sigmoids and tanh at the point), the tangent of one time step is
    ``dc_t = d_i g + d_f c_{t-1} + d_g i + f dc_{t-1}`` and
    ``dh_t = d_o tanh(c_t) + o (1 - tanh(c_t)^2) dc_t``. The forward pass keeps, per step,
    ``factor = [g, c_{t-1}, i, tanh(c_t)] * slope`` (one tensor of the gates' width), the forget
    gate ``f`` and ``o (1 - tanh(c_t)^2)``: every other quantity of both recurrences is
    computed once per step of SGN, and each time step of a tangent or reverse pass is one
    small matrix product and four elementwise operations."""

    @staticmethod
    def forward(ctx, x, h0, c0, w_ih, w_hh, b_ih, b_hh):
        steps, batch, _ = x.shape
        width = w_hh.shape[1]
        bias = None
        if b_ih is not None:
            bias = b_ih + b_hh
        pre = _addmm_terms(bias, [(x.reshape(steps * batch, -1), w_ih.t())], 0, 0, x)
        pre = pre.view(steps, batch, 4 * width).unbind(0)
        w_hh_t = w_hh.t()
        h, c = h0, c0
        hs, cs, acts, gs, tanh_cs = [h0], [c0], [], [], []
        for t in range(steps):
            gates = torch.addmm(pre[t], h, w_hh_t)
            act = torch.sigmoid(gates)  # i, f and o (g's slot is not read)
            i, f, _, o = act.chunk(4, 1)
            g = torch.tanh(gates[:, 2 * width : 3 * width])
            c = torch.addcmul(f * c, i, g)
            tanh_c = torch.tanh(c)
            h = o * tanh_c
            hs.append(h)
            cs.append(c)
            acts.append(act)
            gs.append(g)
            tanh_cs.append(tanh_c)
        hs, cs = torch.stack(hs), torch.stack(cs)  # (T + 1, N, H): h_0 .. h_T
        acts, g, tanh_c = torch.stack(acts), torch.stack(gs), torch.stack(tanh_cs)
        i, f, _, o = acts.chunk(4, 2)
        # [g, c_{t-1}, i, tanh(c_t)] times the gates' derivatives: act (1 - act) for the
        # sigmoids (sigmoid_backward), 1 - g^2 for g (tanh_backward)
        factor = torch.ops.aten.sigmoid_backward(torch.cat([g, cs[:-1], i, tanh_c], 2), acts)
        factor[..., 2 * width : 3 * width] = torch.ops.aten.tanh_backward(i, g)
        ctx.factor = factor
        ctx.forget = f.contiguous()  # not a view: the products keep no more than they read
        ctx.out_factor = torch.ops.aten.tanh_backward(o, tanh_c)  # o (1 - tanh(c)^2)
        ctx.has_bias, ctx.steps = b_ih is not None, steps
        # x_t and h_{t-1} side by side: the products' terms x dW_ih^T + h dW_hh^T and the
        # weights' gradients dpre^T [x, h] are one matrix product each
        inputs = torch.cat([x, hs[:-1]], 2).view(steps * batch, -1)
        ctx.save_for_backward(inputs, w_ih, w_hh)
        ctx.save_for_forward(inputs, w_ih, w_hh)
        out = hs[1:].clone()  # not a view of a saved tensor (forward AD needs its own)
        return out, hs[-1].clone(), cs[-1].clone()

    @staticmethod
    def jvp(ctx, dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh):
        inputs, w_ih, w_hh = ctx.saved_tensors
        width, size = w_hh.shape[1], w_ih.shape[1]
        steps, batch = ctx.steps, inputs.shape[0] // ctx.steps
        terms = []
        if dw_ih is not None and dw_hh is not None:
            terms.append((inputs, torch.cat([dw_ih, dw_hh], 1).t()))
        elif dw_ih is not None:
            terms.append((inputs[:, :size], dw_ih.t()))
        elif dw_hh is not None:
            terms.append((inputs[:, size:], dw_hh.t()))
        if dx is not None:
            terms.append((dx.reshape(steps * batch, -1), w_ih.t()))
        dbias = None
        if ctx.has_bias and (db_ih is not None or db_hh is not None):
            dbias = db_ih if db_hh is None else (db_hh if db_ih is None else db_ih + db_hh)
        dpre = _addmm_terms(dbias, terms, steps * batch, 4 * width, inputs)
        dpre = dpre.view(steps, batch, 4 * width).unbind(0)
        factor, forget = ctx.factor.unbind(0), ctx.forget.unbind(0)
        out_factor = ctx.out_factor.unbind(0)
        w_hh_t = w_hh.t()
        dh, dc = dh0, dc0
        dhs = []
        for t in range(steps):
            gates = dpre[t] if dh is None else torch.addmm(dpre[t], dh, w_hh_t)
            d = (gates * factor[t]).view(batch, 4, width)
            cell = d[:, :3].sum(1)
            dc = cell if dc is None else torch.addcmul(cell, forget[t], dc)
            dh = torch.addcmul(d[:, 3], out_factor[t], dc)
            dhs.append(dh)
        return torch.stack(dhs), dh.clone(), dc.clone()

    @staticmethod
    def backward(ctx, grad_out, grad_h, grad_c):
        inputs, w_ih, w_hh = ctx.saved_tensors
        steps, batch, _ = grad_out.shape
        width, size = w_hh.shape[1], w_ih.shape[1]
        factor, forget = ctx.factor.unbind(0), ctx.forget.unbind(0)
        out_factor, grad_out = ctx.out_factor.unbind(0), grad_out.unbind(0)
        dh, dc = grad_out[-1] + grad_h, grad_c
        dpres: List[Tensor] = []
        for t in reversed(range(steps)):
            dc = torch.addcmul(dc, dh, out_factor[t])
            dpre = torch.cat([dc, dc, dc, dh], 1) * factor[t]
            dpres.append(dpre)
            dh = torch.addmm(grad_out[t - 1], dpre, w_hh) if t > 0 else torch.mm(dpre, w_hh)
            dc = dc * forget[t]
        dpre = torch.stack(dpres[::-1]).view(steps * batch, 4 * width)
        needs = ctx.needs_input_grad
        gx = torch.mm(dpre, w_ih).view(steps, batch, size) if needs[0] else None
        gw_ih = gw_hh = None
        if needs[3] and needs[4]:
            gw_ih, gw_hh = torch.mm(dpre.t(), inputs).split([size, width], 1)
        elif needs[3]:
            gw_ih = torch.mm(dpre.t(), inputs[:, :size])
        elif needs[4]:
            gw_hh = torch.mm(dpre.t(), inputs[:, size:])
        gb = dpre.sum(0) if ctx.has_bias and (needs[5] or needs[6]) else None
        return gx, dh, dc, gw_ih, gw_hh, gb, gb


# --- layer norm --------------------------------------------------------------------------------
class LayerNorm(torch.autograd.Function):
    """``F.layer_norm`` with the tangent formula of the module docstring; forward and reverse
    are ``aten.native_layer_norm`` and its backward, as in PyTorch."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.normalized_shape = normalized_shape
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.xhat = (x - mean) * rstd  # independent of the tangent: computed once per step
        ctx.rstd = rstd
        ctx.weight = weight
        return out

    @staticmethod
    def jvp(ctx, dx, _, dweight, dbias, __):
        xhat, rstd, weight = ctx.xhat, ctx.rstd, ctx.weight
        dims = list(range(xhat.dim() - len(ctx.normalized_shape), xhat.dim()))
        out = None
        if dx is not None:
            m1 = dx.mean(dims, keepdim=True)
            m2 = (dx * xhat).mean(dims, keepdim=True)
            t = torch.addcmul(dx - m1, xhat, m2, value=-1) * rstd
            if weight is None:
                out = t if dbias is None or not ctx.has_bias else t + dbias
            elif dbias is not None and ctx.has_bias:
                out = torch.addcmul(dbias, t, weight)
            else:
                out = t * weight
        elif dbias is not None and ctx.has_bias:
            out = dbias.expand_as(xhat).clone()
        if dweight is not None and ctx.has_weight:
            out = xhat * dweight if out is None else torch.addcmul(out, xhat, dweight)
        return torch.zeros_like(xhat) if out is None else out

    @staticmethod
    def backward(ctx, grad_out):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], ctx.has_weight and needs[2], ctx.has_bias and needs[3]]
        gx, gweight, gbias = torch.ops.aten.native_layer_norm_backward(
            grad_out.contiguous(), x, ctx.normalized_shape, mean, rstd, weight, bias, mask
        )
        return gx, None, gweight, gbias, None


# --- attention ---------------------------------------------------------------------------------
def _attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` as its composite, or ``None`` where the rule does not
    apply (a mask tensor, dropout, grouped heads)."""
    if attn_mask is not None or dropout_p > 0.0 or enable_gqa:
        return None
    if scale is None:
        scale = query.shape[-1] ** -0.5
    scores = torch.matmul(query * scale, key.transpose(-2, -1))
    if is_causal:  # an added constant: the reverse pass goes through it unchanged, the tangent
        # with one copy (masked_fill takes a copy and a fill in each)
        length, source = query.shape[-2], key.shape[-2]
        mask = torch.full((length, source), float("-inf"), dtype=scores.dtype, device=scores.device)
        scores = scores + mask.triu(1)
    return torch.matmul(Softmax.apply(scores), value)


class Softmax(torch.autograd.Function):
    """``softmax`` over the last dimension whose tangent, ``y (dx - sum(y dx))``, reads only
    its output ``y``."""

    @staticmethod
    def forward(ctx, x):
        y = torch.softmax(x, -1)
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        return y

    @staticmethod
    def jvp(ctx, dx):
        (y,) = ctx.saved_tensors
        p = y * dx
        return torch.addcmul(p, y, p.sum(-1, keepdim=True), value=-1)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, -1, y.dtype)
