r"""Differential operators of a network's input, by forward (Taylor-mode) propagation.

A PDE residual such as :math:`-\Delta u(x) - f(x)` needs derivatives of the network ``u`` with
respect to its input. Nested autograd (``torch.autograd.grad(create_graph=True)``,
``torch.func.hessian``) gives them, slowly, and as a graph that Gauss-Newton engines cannot all
differentiate again. For an ``nn.Sequential`` of linear layers and smooth elementwise
activations this module instead pushes, per point, the value, the input gradient and a
(partial) Laplacian forward through the layers, the *forward Laplacian*. Every result is then an
ordinary tensor function of the parameters: reverse mode, forward mode (``torch.func.jvp``),
``torch.func.vmap`` and ``make_fx`` tracing all apply to it, with no nested autograd.

Other models take a fallback through ``torch.func`` (``vmap`` of ``jacfwd(jacrev(...))`` of the
one-point function), exact but slower.

Shapes: points ``x`` are ``(N, d)``, the model maps them to ``(N, m)``. Every operator keeps the
component axis ``m``, also for ``m == 1`` (a scalar field is ``(N, 1)``, like the model's
output), so residual terms combine without broadcasting surprises:
``laplacian(u, x) + f(x)`` with ``f`` returning ``(N, 1)``.

References:
    R. Li, H. Ye, D. Jiang, X. Wen, C. Wang, Z. Li, X. Li, D. He, J. Chen, W. Ren, L. Wang,
    "A computational framework for neural network-based variational Monte Carlo with Forward
    Laplacian", Nature Machine Intelligence 6, 2024.
    F. Dangel, J. Müller, M. Zeinhofer, "Kronecker-Factored Approximate Curvature for
    Physics-Informed Neural Networks", NeurIPS 2024.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .jet_layers import JetInput, JetLinear
from .layer_kernel import record

__all__ = [
    "Jet",
    "Sin",
    "jet",
    "gradient",
    "laplacian",
    "divergence",
    "time_derivative",
    "hessian",
    "hessian_jet",
    "HessianJet",
    "derivative",
]

_METHODS = ("auto", "forward", "func")


@dataclass(frozen=True)
class Jet:
    r"""A model's value and input derivatives at ``N`` points.

    Attributes:
        value: :math:`u(x_n)`, shape ``(N, m)``.
        gradient: :math:`\partial u_i / \partial x_k` at ``[n, i, k]``, shape ``(N, m, d)``.
        laplacian: :math:`\sum_{k \in K} \partial^2 u_i / \partial x_k^2` at ``[n, i]``, over the
            coordinates ``K`` asked for (all ``d`` by default), shape ``(N, m)``.
    """

    value: Tensor
    gradient: Tensor
    laplacian: Tensor


class Sin(nn.Module):
    """The elementwise sine, a common activation of physics-informed networks.

    It carries its derivatives (:meth:`derivatives`), so the forward Laplacian takes it.
    """

    def forward(self, z: Tensor) -> Tensor:
        """``sin z``, elementwise.

        Args:
            z: the pre-activation.

        Returns:
            ``sin z``.
        """
        return torch.sin(z)

    def derivatives(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The value and its first two derivatives, elementwise.

        Args:
            z: the pre-activation.

        Returns:
            ``(sin z, cos z, -sin z)``.
        """
        s = torch.sin(z)
        return s, torch.cos(z), -s


def jet(
    u: Callable[[Tensor], Tensor],
    x: Tensor,
    laplacian_dims: Optional[Sequence[int]] = None,
    *,
    method: str = "auto",
) -> Jet:
    r"""The value, input gradient and (partial) Laplacian of ``u`` at the points ``x``.

    For an ``nn.Sequential`` (nested ones too) of ``nn.Linear``, ``nn.Identity`` and smooth
    elementwise activations (and the layers of :mod:`torch_sgn.pinn.jet_layers`: branches side
    by side, :class:`ParallelLinear`, and a first layer mapping the points, :class:`InputMap`,
    which starts the propagation from its own derivatives), the forward Laplacian propagates,
    per point, the pre-activation :math:`z`, its gradient :math:`G_k = \partial z / \partial
    x_k` and its partial Laplacian :math:`L = \sum_{k \in K} \partial^2 z / \partial x_k^2`,
    starting from :math:`z = x, G_k = e_k, L = 0`:

    .. math::

        \text{Linear } W, b:\quad z \to W z + b,\quad G_k \to W G_k,\quad L \to W L

        \text{activation } \sigma:\quad z \to \sigma(z),\quad
        G_k \to \sigma'(z) \odot G_k,\quad
        L \to \sigma''(z) \odot \sum_{k \in K} G_k^{\odot 2} + \sigma'(z) \odot L

    The ``d`` gradient directions go through each linear layer as one matrix product.
    Supported activations: ``nn.Tanh``, ``nn.Sigmoid``, ``nn.SiLU``, ``nn.Softplus`` (its
    ``beta``, and its ``threshold`` as torch applies it: linear, so derivatives ``1`` and
    ``0``, above it), ``nn.GELU`` (both ``approximate`` forms), :class:`Sin`, and any module
    with a method ``derivatives(z)`` returning :math:`(\sigma(z), \sigma'(z), \sigma''(z))`.
    Parameters are read from the layers at each call, so ``torch.func.functional_call``
    substitutes them.

    Any other model takes the fallback: exact derivatives of the one-point function by
    ``torch.func.vmap`` of ``jacfwd(jacrev(...))``. It is differentiable in reverse mode with
    respect to the parameters, but slower (it forms the full ``d x d`` Hessian per point and
    output) and, being nested autograd, not traceable by every engine.

    Args:
        u: the model, mapping ``(N, d)`` points to ``(N, m)`` values, each row of the output
            depending on the same row of the input only.
        x: the points, a floating-point tensor of shape ``(N, d)``.
        laplacian_dims: the coordinates :math:`K` summed in the Laplacian; ``None``
            (default) for all ``d``; an empty sequence for none (the Laplacian is then zero and
            not computed). Negative indices count from the end.
        method: ``"auto"`` (default): the forward Laplacian where ``u`` supports it, else the
            fallback; ``"forward"``: the forward Laplacian or an error saying which layer it
            does not support; ``"func"``: the ``torch.func`` fallback.

    Returns:
        The :class:`Jet` of ``u`` at ``x``.

    Raises:
        ValueError: ``x`` not 2-D, ``laplacian_dims`` out of range or repeated, ``method``
            unknown, ``u`` a Sequential with a piecewise-linear activation such as ``nn.ReLU``
            (its second derivatives vanish), or, with ``method="forward"``, a layer the forward
            Laplacian does not support.
        TypeError: ``x`` not floating point.

    .. note::
        ``u`` must treat points independently (no batch normalisation in training mode): the
        fallback differentiates it one point at a time. Piecewise-linear activations are
        caught only in a Sequential on the forward route; through the fallback their
        Laplacian is silently zero almost everywhere.

    .. note::
        Parameters that do not reach a derivative (the last layer's bias, for the gradient
        and the Laplacian) are not in its graph: differentiate with
        ``torch.autograd.grad(..., materialize_grads=True)`` (or ``allow_unused=True``), as
        with nested autograd.
    """
    _check_points(x)
    dims = _normalize_dims(laplacian_dims, x.shape[1], "laplacian_dims")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if method != "func":
        layers = _forward_layers(u, required=method == "forward")
        if layers is not None:
            return _forward_laplacian(layers, x, dims)
    return _func_jet(u, x, dims)


def gradient(u: Callable[[Tensor], Tensor], x: Tensor, *, method: str = "auto") -> Tensor:
    r"""The input gradient :math:`\partial u_i / \partial x_k` at ``[n, i, k]``.

    Args:
        u: the model, ``(N, d)`` points to ``(N, m)`` values (see :func:`jet`).
        x: the points, ``(N, d)``.
        method: ``"auto"``, ``"forward"`` or ``"func"`` (see :func:`jet`).

    Returns:
        The gradient, ``(N, m, d)``.
    """
    return jet(u, x, laplacian_dims=(), method=method).gradient


def laplacian(
    u: Callable[[Tensor], Tensor],
    x: Tensor,
    dims: Optional[Sequence[int]] = None,
    *,
    method: str = "auto",
) -> Tensor:
    r"""The Laplacian :math:`\sum_{k \in K} \partial^2 u_i / \partial x_k^2` at ``[n, i]``.

    Shape ``(N, m)``. ``dims`` is :math:`K`, all ``d`` coordinates by default: for the heat
    equation with points ``(t, x_1, x_2)``, ``dims=[1, 2]`` is the spatial Laplacian.

    Args:
        u: the model, ``(N, d)`` points to ``(N, m)`` values (see :func:`jet`).
        x: the points, ``(N, d)``.
        dims: the coordinates :math:`K` summed (``None``: all).
        method: ``"auto"``, ``"forward"`` or ``"func"`` (see :func:`jet`).

    Returns:
        The Laplacian, ``(N, m)``.

    Raises:
        ValueError: ``dims`` empty, or as :func:`jet` raises.
    """
    if dims is not None and len(dims) == 0:
        raise ValueError("dims must name at least one coordinate, or be None for all of them")
    return jet(u, x, laplacian_dims=dims, method=method).laplacian


def divergence(u: Callable[[Tensor], Tensor], x: Tensor, *, method: str = "auto") -> Tensor:
    r"""The divergence :math:`\sum_i \partial u_i / \partial x_i` of a vector field, ``(N, 1)``.

    ``u`` must map ``(N, d)`` points to ``(N, d)`` values. The result keeps a component axis of
    size one, like every operator here, so it adds to a scalar field's ``(N, 1)`` terms.

    Args:
        u: the model, ``(N, d)`` points to ``(N, m)`` values (see :func:`jet`).
        x: the points, ``(N, d)``.
        method: ``"auto"``, ``"forward"`` or ``"func"`` (see :func:`jet`).

    Returns:
        The divergence, ``(N, 1)``.

    Raises:
        ValueError: ``u``'s output has ``m != d`` components.
    """
    grad = gradient(u, x, method=method)
    m, d = grad.shape[1], grad.shape[2]
    if m != d:
        raise ValueError(
            f"divergence needs u to map (N, d) points to (N, d) values; u gives m = {m} "
            f"components for d = {d} coordinates (for one component use gradient(u, x))"
        )
    return grad.diagonal(dim1=1, dim2=2).sum(dim=1, keepdim=True)


def time_derivative(
    u: Callable[[Tensor], Tensor], x: Tensor, dim: int = 0, *, method: str = "auto"
) -> Tensor:
    r"""The derivative :math:`\partial u_i / \partial x_{\text{dim}}` at ``[n, i]``, ``(N, m)``.

    ``dim`` is the time coordinate of the points, the first by default.

    Args:
        u: the model, ``(N, d)`` points to ``(N, m)`` values (see :func:`jet`).
        x: the points, ``(N, d)``.
        dim: the time coordinate.
        method: ``"auto"``, ``"forward"`` or ``"func"`` (see :func:`jet`).

    Returns:
        The derivative, ``(N, m)``.
    """
    _check_points(x)
    (dim,) = _normalize_dims([dim], x.shape[1], "dim")
    return gradient(u, x, method=method)[..., dim]


@dataclass(frozen=True)
class HessianJet:
    r"""A model's value, input gradient and all second partials at ``N`` points.

    Attributes:
        value: :math:`u(x_n)`, shape ``(N, m)``.
        gradient: :math:`\partial u_i / \partial x_k` at ``[n, i, k]``, shape ``(N, m, d)``.
        hessian: :math:`\partial^2 u_i / \partial x_k \partial x_l` at ``[n, i, k, l]``, shape
            ``(N, m, d, d)`` (symmetric in ``k, l``).
    """

    value: Tensor
    gradient: Tensor
    hessian: Tensor


def hessian_jet(
    u: Callable[[Tensor], Tensor],
    x: Tensor,
    *,
    method: str = "auto",
    pairs: Optional[Sequence[tuple[int, int]]] = None,
) -> HessianJet:
    r"""The value, input gradient and second partials of ``u`` at ``x``, from one pass.

    On the forward route (see :func:`jet`) the value, the ``d`` gradient directions and the
    ``d (d + 1) / 2`` second partials :math:`H_{kl}` (``k <= l``) go forward through the layers:
    a linear layer maps each by ``W``, an activation maps :math:`H_{kl}` to
    :math:`\sigma''(z) G_k G_l + \sigma'(z) H_{kl}`. The fallback is ``torch.func``'s
    ``jacfwd(jacrev(...))`` per point. See :func:`jet` for ``u``, ``x`` and ``method``.

    Args:
        u: the model, ``(N, d)`` points to ``(N, m)`` values (see :func:`jet`).
        x: the points, ``(N, d)``.
        method: ``"auto"``, ``"forward"`` or ``"func"`` (see :func:`jet`).
        pairs: the second partials ``(k, l)`` to propagate on the forward route (each fills
            ``[k, l]`` and ``[l, k]``; the others hold zeros): the few a PDE uses cost less
            than all ``d (d + 1) / 2``. ``None`` (default) for all; the fallback computes all
            in any case.

    Returns:
        A :class:`HessianJet`.

    Raises:
        ValueError: ``pairs`` out of range, an unknown ``method``, or as :func:`jet` raises.
    """
    _check_points(x)
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    d = x.shape[1]
    if pairs is None:
        pairs = [(k, j) for k in range(d) for j in range(k, d)]
    pairs = sorted({(min(k, j), max(k, j)) for k, j in pairs})
    if any(not (0 <= k < d and 0 <= j < d) for k, j in pairs):
        raise ValueError(f"pairs must index coordinates 0..{d - 1}, got {pairs}")
    if method != "func":
        layers = _forward_layers(u, required=method == "forward")
        if layers is not None:
            return _forward_hessian(layers, x, pairs)
    value = _checked_value(u, x)

    def jacobian(xi: Tensor) -> tuple[Tensor, Tensor]:
        jac = torch.func.jacrev(lambda p: u(p[None])[0])(xi)
        return jac, jac

    hess, grad = torch.func.vmap(torch.func.jacfwd(jacobian, has_aux=True))(x)
    n, m, d = value.shape[0], value.shape[1], x.shape[1]
    return HessianJet(value, grad.reshape(n, m, d), hess.reshape(n, m, d, d))


def hessian(u: Callable[[Tensor], Tensor], x: Tensor, *, method: str = "auto") -> Tensor:
    r"""The second partial derivatives :math:`\partial^2 u_i / \partial x_k \partial x_l` at
    ``[n, i, k, l]``: :func:`hessian_jet`'s ``hessian``.

    Args:
        u: the model, ``(N, d)`` points to ``(N, m)`` values (see :func:`jet`).
        x: the points, ``(N, d)``.
        method: ``"auto"``, ``"forward"`` or ``"func"`` (see :func:`jet`).

    Returns:
        The second partials, ``(N, m, d, d)``, symmetric in ``k, l``.
    """
    return hessian_jet(u, x, method=method).hessian


def derivative(
    u: Callable[[Tensor], Tensor], x: Tensor, dim: int = 0, order: int = 1, *, method: str = "auto"
) -> Tensor:
    r"""The derivative :math:`\partial^p u_i / \partial x_{\text{dim}}^p` of order ``p`` =
    ``order`` (1 to 4) along one coordinate, at ``[n, i]``, shape ``(N, m)``: KdV's
    :math:`u_{xxx}`, the Euler beam's fourth derivative.

    On the forward route the derivatives :math:`z_1 \dots z_p` of each layer's output along
    the coordinate go forward (Taylor mode): a linear layer maps each by ``W``, an activation
    by Faa di Bruno's formula,

    .. math::
        y_1 = \sigma_1 z_1,\quad y_2 = \sigma_2 z_1^2 + \sigma_1 z_2,\quad
        y_3 = \sigma_3 z_1^3 + 3 \sigma_2 z_1 z_2 + \sigma_1 z_3,

        y_4 = \sigma_4 z_1^4 + 6 \sigma_3 z_1^2 z_2 + \sigma_2 (3 z_2^2 + 4 z_1 z_3)
        + \sigma_1 z_4,

    :math:`\sigma_j` the activation's ``j``-th derivative. Orders 3 and 4 need the third and
    fourth: ``nn.Tanh``, ``nn.Sigmoid``, :class:`Sin`, or a module whose ``derivatives(z)``
    returns five values :math:`(\sigma, \sigma_1, \dots, \sigma_4)`; other networks take the
    fallback, ``torch.func.jacfwd`` nested ``order`` times per point.

    Args:
        u: the model, ``(N, d)`` points to ``(N, m)`` values (see :func:`jet`).
        x: the points, ``(N, d)``.
        dim: the coordinate.
        order: ``p``, 1 to 4.
        method: ``"auto"``, ``"forward"`` or ``"func"`` (see :func:`jet`).

    Returns:
        The derivative, ``(N, m)``.

    Raises:
        ValueError: ``order`` not in 1 to 4, ``dim`` out of range, or as :func:`jet` does.
    """
    _check_points(x)
    (dim,) = _normalize_dims([dim], x.shape[1], "dim")
    if order not in (1, 2, 3, 4):
        raise ValueError(f"order must be 1, 2, 3 or 4, got {order!r}")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if method != "func":
        layers = _forward_layers(u, required=method == "forward")
        if layers is not None and (order <= 2 or all(_higher_of(f) for f in layers)):
            return _forward_taylor(layers, x, dim, order)
        if layers is not None and method == "forward":
            raise ValueError(
                f"method='forward' needs the third and fourth derivatives of every activation "
                f"for order {order}: nn.Tanh, nn.Sigmoid, Sin, or derivatives(z) returning five "
                "values; use method='auto' or 'func' for the fallback"
            )
    _checked_value(u, x)
    e = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
    e[dim] = 1

    def along(t: Tensor, xi: Tensor) -> Tensor:  # u on the line through xi along e
        return u((xi + t * e)[None])[0]

    f: Callable = along
    for _ in range(order):
        f = torch.func.jacfwd(f)
    return torch.func.vmap(f, in_dims=(None, 0))(x.new_zeros(()), x)


# --- validation -------------------------------------------------------------------------------


def _check_points(x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor of points of shape (N, d), got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(
            f"x must have shape (N, d) (one point per row), got shape {tuple(x.shape)}; "
            "for a single point use x[None], for a grid use x.reshape(-1, d)"
        )
    if not x.is_floating_point():
        raise TypeError(
            f"x must be floating point to be differentiated, got {x.dtype}; "
            "convert it with x.to(torch.float64) (or the parameters' dtype)"
        )


def _normalize_dims(dims: Optional[Sequence[int]], d: int, name: str) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(d))
    out = []
    for k in dims:
        if not -d <= int(k) < d:
            raise ValueError(
                f"{name} entries must index the d = {d} coordinates of x (0 to {d - 1}, or "
                f"negative from the end), got {k}"
            )
        out.append(int(k) % d)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} names a coordinate twice: {list(dims)}")
    return tuple(out)


# --- the forward Laplacian --------------------------------------------------------------------

# (layer, z) -> (sigma(z), sigma'(z), sigma''(z)), each as torch computes the layer's value.
_Derivatives = Callable[[nn.Module, Tensor], "tuple[Tensor, Tensor, Tensor]"]


def _tanh(layer: nn.Module, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    t = torch.tanh(z)
    d1 = 1 - t * t
    return t, d1, -2 * t * d1


def _sigmoid(layer: nn.Module, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    s = torch.sigmoid(z)
    d1 = s * (1 - s)
    return s, d1, d1 * (1 - 2 * s)


def _silu(layer: nn.Module, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    s = torch.sigmoid(z)
    ds = s * (1 - s)
    return z * s, s + z * ds, ds * (2 + z * (1 - 2 * s))


def _softplus(layer: nn.Softplus, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # torch returns z itself where beta * z > threshold; its derivatives there are 1 and 0.
    beta, threshold = layer.beta, layer.threshold
    s = torch.sigmoid(beta * z)
    linear = beta * z > threshold
    d1 = torch.where(linear, torch.ones_like(s), s)
    d2 = torch.where(linear, torch.zeros_like(s), beta * s * (1 - s))
    return F.softplus(z, beta, threshold), d1, d2


def _gelu(layer: nn.GELU, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if layer.approximate == "tanh":
        # z (1 + tanh a) / 2, a = c (z + 0.044715 z^3), c = sqrt(2 / pi)
        c, k = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(c * (z + k * z**3))
        sech2 = 1 - t * t
        da = c * (1 + 3 * k * z * z)
        d1 = (1 + t) / 2 + z * sech2 * da / 2
        d2 = sech2 * (da + z * (3 * c * k * z - t * da * da))
        return F.gelu(z, approximate="tanh"), d1, d2
    # z Phi(z): Phi' = phi, phi' = -z phi
    phi = torch.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    cdf = (1 + torch.erf(z / math.sqrt(2))) / 2
    return F.gelu(z), cdf + z * phi, phi * (2 - z * z)


_ACTIVATIONS: dict[type, _Derivatives] = {
    nn.Tanh: _tanh,
    nn.Sigmoid: _sigmoid,
    nn.SiLU: _silu,
    nn.Softplus: _softplus,
    nn.GELU: _gelu,
}

# Their second derivatives vanish almost everywhere: a Laplacian through them is zero.
_PIECEWISE_LINEAR = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.RReLU,
    nn.Hardtanh,
    nn.Threshold,
)


def _derivatives_of(layer: nn.Module) -> Optional[Callable[[Tensor], tuple]]:
    own = getattr(layer, "derivatives", None)
    if callable(own):
        return own
    rule = _ACTIVATIONS.get(type(layer))
    return None if rule is None else (lambda z: rule(layer, z))


def _flatten(module: nn.Sequential, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, layer in module.named_children():
        if type(layer) is nn.Sequential:
            yield from _flatten(layer, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", layer


def _forward_layers(u: object, required: bool) -> Optional[list[nn.Module]]:
    """The layers of ``u`` for the forward Laplacian, or None where it does not apply."""
    if type(u) is not nn.Sequential:
        if required:
            raise ValueError(
                f"method='forward' needs u to be an nn.Sequential, got {type(u).__name__}; "
                "use method='auto' or 'func' for the torch.func fallback"
            )
        return None
    layers = []
    unsupported = None
    for name, layer in _flatten(u):
        if isinstance(layer, _PIECEWISE_LINEAR):
            raise ValueError(
                f"u's layer {name} ({type(layer).__name__}) is piecewise linear: its second "
                "derivatives vanish, so every Laplacian through it is zero; use a smooth "
                "activation (nn.Tanh, nn.Softplus, nn.GELU, nn.SiLU, Sin)"
            )
        if isinstance(layer, nn.Identity):
            continue
        if _is_input_map(layer):
            if layers and unsupported is None:  # it reads the points, not a layer's output
                unsupported = f"{name} ({type(layer).__name__}, which must come first)"
            layers.append(layer)
        elif _is_linear(layer) or _derivatives_of(layer) is not None:
            layers.append(layer)
        elif unsupported is None:
            unsupported = f"{name} ({type(layer).__name__})"
    if unsupported is None:
        return layers
    if required:
        raise ValueError(
            f"method='forward' does not support u's layer {unsupported}: it takes nn.Linear, "
            f"nn.Identity, ParallelLinear, an InputMap first, "
            f"{', '.join(t.__name__ for t in _ACTIVATIONS)}, Sin, or a module with "
            "derivatives(z) -> (f, f', f''); use method='auto' or 'func' for the fallback"
        )
    return None


def _is_input_map(layer: nn.Module) -> bool:
    """A first layer that gives its own jet at the points (a
    :class:`~torch_sgn.pinn.jet_layers.JetInput`)."""
    return isinstance(layer, JetInput)


def _is_linear(layer: nn.Module) -> bool:
    """A layer that maps every channel of a jet by one linear map: ``nn.Linear``, or a
    :class:`~torch_sgn.pinn.jet_layers.JetLinear`."""
    return type(layer) is nn.Linear or isinstance(layer, JetLinear)


def _linear(layer: nn.Module, channels: list[Tensor]) -> list[Tensor]:
    """``layer`` applied to the channels of a jet: ``channels[0]`` the value, which takes the
    bias, the others derivatives (each ``(..., N, in)``), which do not; recorded for
    :mod:`~torch_sgn.pinn.layer_kernel`'s ``J J^T``."""
    if type(layer) is not nn.Linear:
        return layer.propagate(channels)
    weight = layer.weight
    out = [F.linear(channels[0], weight, layer.bias)] + [c @ weight.T for c in channels[1:]]
    record(layer, channels, out, (True,) + (False,) * (len(channels) - 1))
    return out


def _forward_laplacian(layers: list[nn.Module], x: Tensor, dims: tuple[int, ...]) -> Jet:
    n, d = x.shape
    with_laplacian = len(dims) > 0
    if layers and _is_input_map(layers[0]):
        value, grad, second = layers[0].input_jet(x, [(k, k) for k in dims])
        lap = second.sum(0) if with_laplacian else None
        layers = layers[1:]
    else:
        value = x
        grad = torch.eye(d, dtype=x.dtype, device=x.device)[:, None, :].expand(d, n, d)
        lap = x.new_zeros(n, d) if with_laplacian else None
    for layer in layers:
        if _is_linear(layer):  # all d directions in one product
            if lap is None:
                value, grad = _linear(layer, [value, grad])
            else:
                value, grad, lap = _linear(layer, [value, grad, lap])
            continue
        f, d1, d2 = _derivatives_of(layer)(value)
        if with_laplacian:
            squares = grad.square().sum(0) if len(dims) == d else sum(grad[k] ** 2 for k in dims)
            lap = d2 * squares + d1 * lap
        value, grad = f, d1 * grad
    lap = torch.zeros_like(value) if lap is None else lap
    return Jet(value, grad.permute(1, 2, 0), lap)


def _forward_hessian(
    layers: list[nn.Module], x: Tensor, pairs: Sequence[tuple[int, int]]
) -> HessianJet:
    n, d = x.shape
    first = torch.tensor([k for k, _ in pairs], dtype=torch.long, device=x.device)
    second = torch.tensor([j for _, j in pairs], dtype=torch.long, device=x.device)
    if layers and _is_input_map(layers[0]):
        value, grad, hess = layers[0].input_jet(x, pairs)
        layers = layers[1:]
    else:
        value = x
        grad = torch.eye(d, dtype=x.dtype, device=x.device)[:, None, :].expand(d, n, d)
        hess = x.new_zeros(len(pairs), n, d)
    for layer in layers:
        if _is_linear(layer):
            value, grad, hess = _linear(layer, [value, grad, hess])
            continue
        f, d1, d2 = _derivatives_of(layer)(value)[:3]
        hess = d2 * grad[first] * grad[second] + d1 * hess
        value, grad = f, d1 * grad
    out = value.new_zeros(n, value.shape[1], d, d)
    for p, (k, j) in enumerate(pairs):
        out[:, :, k, j] = hess[p]
        out[:, :, j, k] = hess[p]
    return HessianJet(value, grad.permute(1, 2, 0), out)


def _tanh_higher(z: Tensor) -> tuple[Tensor, ...]:
    t = torch.tanh(z)
    d1 = 1 - t * t
    return t, d1, -2 * t * d1, d1 * (6 * t * t - 2), 8 * t * d1 * (2 - 3 * t * t)


def _sigmoid_higher(z: Tensor) -> tuple[Tensor, ...]:
    s = torch.sigmoid(z)
    d1 = s * (1 - s)
    d2 = d1 * (1 - 2 * s)
    return s, d1, d2, d1 * (1 - 6 * s + 6 * s * s), d2 * (1 - 12 * s + 12 * s * s)


def _sin_higher(z: Tensor) -> tuple[Tensor, ...]:
    s, c = torch.sin(z), torch.cos(z)
    return s, c, -s, -c, s


# type -> z -> (sigma, sigma_1, ..., sigma_4): the activations of derivatives of order 3 and 4.
_HIGHER: dict[type, Callable[[Tensor], tuple]] = {
    nn.Tanh: _tanh_higher,
    nn.Sigmoid: _sigmoid_higher,
    Sin: _sin_higher,
}


def _higher_of(layer: nn.Module) -> Optional[Callable[[Tensor], tuple]]:
    """``z -> (sigma, sigma_1, ..., sigma_4)`` of an activation, or None where it has no
    fourth derivative here (a linear layer or an input map: its identity; not called)."""
    if _is_linear(layer) or _is_input_map(layer):
        return lambda z: (z,)
    rule = _HIGHER.get(type(layer))
    if rule is not None:
        return rule
    own = getattr(layer, "derivatives", None)
    if not callable(own) or type(layer) in _ACTIVATIONS:
        return None
    try:  # a module's own derivatives, if they go to the fourth
        five = len(own(torch.zeros(1, dtype=torch.float64))) >= 5
    except Exception:  # noqa: BLE001 - derivatives that take other inputs: not used here
        return None
    return own if five else None


def _forward_taylor(layers: list[nn.Module], x: Tensor, dim: int, order: int) -> Tensor:
    n = x.shape[0]
    if layers and _is_input_map(layers[0]):
        value, zs = layers[0].input_taylor(x, dim, order)
        layers = layers[1:]
    else:
        value = x
        direction = x.new_zeros(n, x.shape[1])
        direction[:, dim] = 1
        zs = [direction] + [x.new_zeros(n, x.shape[1]) for _ in range(order - 1)]
    for layer in layers:
        if _is_linear(layer):
            value, *zs = _linear(layer, [value, *zs])
            continue
        s = _higher_of(layer)(value) if order > 2 else _derivatives_of(layer)(value)[:3]
        z1 = zs[0]
        out = [s[1] * z1]
        if order >= 2:
            out.append(s[2] * z1 * z1 + s[1] * zs[1])
        if order >= 3:
            out.append(s[3] * z1**3 + 3 * s[2] * z1 * zs[1] + s[1] * zs[2])
        if order >= 4:
            out.append(
                s[4] * z1**4
                + 6 * s[3] * z1 * z1 * zs[1]
                + s[2] * (3 * zs[1] * zs[1] + 4 * z1 * zs[2])
                + s[1] * zs[3]
            )
        value, zs = s[0], out
    return zs[order - 1]


# --- the torch.func fallback ------------------------------------------------------------------


def _checked_value(u: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    value = u(x)
    if not isinstance(value, Tensor) or value.dim() != 2 or value.shape[0] != x.shape[0]:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"u must map (N, d) points to (N, m) values; for x of shape {tuple(x.shape)} it "
            f"gave {shape} (for a scalar output use keepdim=True or out[:, None])"
        )
    return value


def _func_jet(u: Callable[[Tensor], Tensor], x: Tensor, dims: tuple[int, ...]) -> Jet:
    value = _checked_value(u, x)

    def one_point(xi: Tensor) -> Tensor:
        return u(xi[None])[0]

    if not dims:
        grad = torch.func.vmap(torch.func.jacrev(one_point))(x)
        return Jet(value, grad, torch.zeros_like(value))

    def jacobian(xi: Tensor) -> tuple[Tensor, Tensor]:
        jac = torch.func.jacrev(one_point)(xi)
        return jac, jac

    hess, grad = torch.func.vmap(torch.func.jacfwd(jacobian, has_aux=True))(x)
    index = torch.tensor(dims, device=x.device)
    lap = hess.diagonal(dim1=2, dim2=3).index_select(2, index).sum(2)
    return Jet(value, grad, lap)
