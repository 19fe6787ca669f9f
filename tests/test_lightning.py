"""SGN under PyTorch Lightning: manual optimization counts, checkpoints and resumes the run;
automatic optimization is refused with what to do instead (examples/lightning_sgn.py)."""

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

from torch_sgn import SGN, StepInfo

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_sgn.py"


def _lightning():
    """Lightning, imported where a test runs (its import takes seconds, and every test process
    collects this module)."""
    import lightning

    return lightning


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("lightning_sgn", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        # Lightning's advice for tiny runs (num_workers, log_every_n_steps)
        warnings.filterwarnings("ignore", module="lightning")
        yield


def _fit(example, root, max_steps, ckpt_path=None, model=None):
    config = example.Config(points=50, batch_size=10, hidden=8, float64=True)
    model = model or example.Regression(config.hidden, config.seed, config.float64)
    L = _lightning()
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=True,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        # 5 batches an epoch; saved at the train-batch end of the epoch's last batch, where
        # Lightning resumes at the next epoch's first batch. Its default end-of-epoch
        # checkpoint, under max_steps, resumes with one more step on a restarted epoch's first
        # batch (with torch.optim.SGD too), which no uninterrupted run takes.
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=5)],
    )
    trainer.fit(model, example.make_loader(config), ckpt_path=ckpt_path)
    return trainer, model


def _sgn_state(opt: SGN) -> dict:
    return opt.state_dict()["state"][0]  # SGN keeps its step count and damping there


def _trajectory(model) -> list:
    return [(i.loss, i.loss_after, i.damping, i.next_damping, i.step_size) for i in model.steps]


def test_manual_optimization_counts_steps_checkpoints_and_resumes_the_same_run(example, tmp_path):
    trainer, model = _fit(example, tmp_path / "first", max_steps=5)
    assert trainer.global_step == 5
    assert len(model.steps) == 5 and all(isinstance(i, StepInfo) for i in model.steps)
    assert model.steps[-1].loss_after < 0.5 * model.steps[0].loss  # the loss fell
    checkpoint = trainer.checkpoint_callback.best_model_path
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["global_step"] == 5
    saved_state = saved["optimizer_states"][0]["state"][0]
    assert saved_state["step"] == 5
    assert saved_state["damping"] == _sgn_state(trainer.optimizers[0])["damping"]

    class Resumed(example.Regression):
        def on_train_start(self):  # after Lightning restored the checkpoint, before a step
            self.restored = dict(_sgn_state(self.optimizers().optimizer))

    resumed = Resumed(8, 0, True)
    trainer, resumed = _fit(
        example, tmp_path / "resumed", max_steps=10, ckpt_path=checkpoint, model=resumed
    )
    assert trainer.global_step == 10
    assert resumed.restored["step"] == saved_state["step"]
    assert resumed.restored["damping"] == saved_state["damping"]
    assert _sgn_state(trainer.optimizers[0])["step"] == 10

    _, whole = _fit(example, tmp_path / "whole", max_steps=10)
    assert len(resumed.steps) == 5 and len(whole.steps) == 10
    torch.testing.assert_close(
        torch.tensor(_trajectory(resumed), dtype=torch.float64),
        torch.tensor(_trajectory(whole)[5:], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )
    for p, q in zip(resumed.parameters(), whole.parameters()):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_lightnings_hooks_run_once_per_step(example, tmp_path):
    # LightningOptimizer always passes SGN a closure that runs on_before_optimizer_step.
    class Counted(example.Regression):
        hooks = 0

        def on_before_optimizer_step(self, optimizer):
            self.hooks += 1

    trainer, model = _fit(example, tmp_path, max_steps=3, model=Counted(8, 0, True))
    assert trainer.global_step == 3 and model.hooks == 3


def test_automatic_optimization_is_refused_with_how_to_switch(example, tmp_path):
    class Automatic(example.Regression):
        def __init__(self):
            super().__init__(8, 0, True)
            self.automatic_optimization = True

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

    model = Automatic()
    before = [p.detach().clone() for p in model.parameters()]
    expected = r"not a closure.*`self\.automatic_optimization = False`.*step\(inputs=x, targets=y\)"
    with pytest.raises(TypeError, match=expected):
        _fit(example, tmp_path, max_steps=2, model=model)
    assert model.trainer.global_step == 0
    for p, q in zip(model.parameters(), before):  # no step was taken
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "accelerator",
    [
        "cpu",
        pytest.param(
            "gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_bf16_mixed_precision_trains(example, tmp_path, accelerator):
    """``precision="bf16-mixed"``: SGN's passes run under Lightning's bfloat16 autocast, the
    parameters stay float32 and the loss falls as in float32."""
    config = example.Config(points=200, batch_size=50, hidden=8)
    model = example.Regression(config.hidden, config.seed)
    trainer = _lightning().Trainer(
        max_steps=8, accelerator=accelerator, devices=1, precision="bf16-mixed", logger=False,
        enable_checkpointing=False, default_root_dir=tmp_path, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, example.make_loader(config))
    assert trainer.global_step == 8
    assert all(p.dtype == torch.float32 for p in model.parameters())
    losses = torch.tensor([[i.loss, i.loss_after] for i in model.steps])
    assert torch.isfinite(losses).all()
    assert model.steps[-1].loss_after < 0.5 * model.steps[0].loss
