"""The shared test cases: the dense reference (``cases.dense_ggn``) against a closed form, and
what it leaves as it was; every family of the zoo draws the same batch from the same seed."""

import pytest
import torch
from torch import nn

from cases import ZOO, dense_ggn, dense_parts, loss_fn, make_model

D = torch.float64


def test_dense_ggn_of_a_linear_model_is_the_closed_form():
    # z = x W^T + b with the mean squared error over its N x C outputs: the row of J for
    # z[n, i] holds x[n] at W[i] and 1 at b[i]; H = 2 I / (N C), g = J^T H (z - y).
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    J = torch.zeros(10, 8, dtype=D)
    for n in range(5):
        for i in range(2):
            J[2 * n + i, 3 * i : 3 * i + 3] = x[n]
            J[2 * n + i, 6 + i] = 1.0
    W, b = model.weight.detach(), model.bias.detach()
    residual = (x @ W.T + b - y).reshape(-1)
    G, g, theta = dense_ggn(model, "mse", x, y)
    torch.testing.assert_close(G, J.T @ J / 5, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(g, J.T @ residual / 5, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(theta, torch.cat([W.reshape(-1), b]), rtol=0, atol=0)


def test_dense_ggn_leaves_the_buffers_and_the_random_state_and_replays_one_seed():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Tanh(), nn.Linear(4, 2)
    ).double()  # training mode: batch norm writes its running statistics
    x, y = torch.randn(6, 3, dtype=D), torch.randn(6, 2, dtype=D)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    state = torch.get_rng_state()
    f, J, H, g, theta = dense_parts(model, "mse", x, y, seed=3)
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert torch.equal(torch.get_rng_state(), state)
    # the Jacobian's pass, the gradient's and f's drew the same dropout masks
    z = f(theta)
    torch.testing.assert_close(g, J.T @ (2 * (z - y).reshape(-1) / z.numel()))
    torch.testing.assert_close(H, 2 * torch.eye(12, dtype=D) / 12)
    G_other, _, _ = dense_ggn(model, "mse", x, y, seed=4)  # other masks: another matrix
    assert (G_other - J.T @ H @ J).abs().max() > 1e-3


def _tensors(batch) -> list:
    """The inputs and targets of a family, as one list of tensors."""
    inputs, targets = batch
    return [*(inputs if isinstance(inputs, tuple) else (inputs,)), targets]


@pytest.mark.parametrize("name", [n for n, case in ZOO.items() if case.targets is not None])
def test_zoo_families_draw_their_batch_from_the_seed_and_take_their_loss(name):
    model, x, y, loss = make_model(name, mode="eval")
    again, x_again, y_again, _ = make_model(name, mode="eval")
    other = make_model(name, seed=1)[1:3]
    assert all(torch.equal(a, b) for a, b in zip(_tensors((x, y)), _tensors((x_again, y_again))))
    assert not all(torch.equal(a, b) for a, b in zip(_tensors((x, y)), _tensors(other)))
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert not model.training and make_model(name)[0].training
    with torch.no_grad():
        out = model(*(x if isinstance(x, tuple) else (x,)))
        value = loss_fn(loss)(out, y)
    assert out.dtype == D and value.dtype == D and torch.isfinite(value)
