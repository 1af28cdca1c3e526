"""hvdlite.lightning in one process (an MPI singleton, size 1): the registry entry, the
reductions it takes, the refusals, and a script for hvdliterun running as plain
``python train.py``. The multi-rank behaviour is tests/multirank/test_lightning.py's."""
import pytest

import needs

pytestmark = needs.needs("lightning", needs.installed("lightning", "torch"),
                         "lightning (and torch) not installed")


@pytest.fixture(scope="module")
def L(hvd):
    import lightning

    import hvdlite.lightning  # noqa: F401
    return lightning


def _tiny(L):
    """A LightningModule (its class is made once lightning is importable)."""
    import torch

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def _loader():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _trainer(L, **kwargs):
    return L.Trainer(strategy="hvdlite", accelerator="cpu", max_epochs=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def test_registered_with_the_environment(L):
    from lightning.pytorch.strategies import StrategyRegistry

    from hvdlite.lightning import HvdliteEnvironment, HvdliteStrategy

    assert "hvdlite" in StrategyRegistry
    trainer = _trainer(L)
    assert isinstance(trainer.strategy, HvdliteStrategy)
    assert isinstance(trainer.strategy.cluster_environment, HvdliteEnvironment)
    assert (trainer.global_rank, trainer.world_size) == (0, 1)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    with pytest.raises(ValueError, match="hvdlite ranks"):
        trainer.strategy.cluster_environment.set_world_size(2)


def test_reductions(L):
    import torch
    from lightning.fabric.utilities.distributed import ReduceOp

    import hvdlite.torch as hvd
    from hvdlite.lightning.strategy import hvdlite_op

    assert hvdlite_op(None) is hvd.Average and hvdlite_op("mean") is hvd.Average
    assert hvdlite_op("avg") is hvd.Average and hvdlite_op("sum") is hvd.Sum
    assert hvdlite_op(ReduceOp.SUM) is hvd.Sum and hvdlite_op(ReduceOp.MAX) is hvd.Max
    with pytest.raises(ValueError, match="cannot reduce"):
        hvdlite_op("band")
    strategy = _trainer(L).strategy
    assert strategy.reduce("not a tensor") == "not a tensor"
    assert strategy.reduce(torch.tensor(3)).item() == 3
    with pytest.raises(ValueError, match="ProcessSet"):
        strategy.reduce(torch.tensor(1.0), group="world")


def test_one_process_fit(L):
    model = _tiny(L)
    trainer = _trainer(L)
    trainer.fit(model, _loader())
    assert trainer.global_step == 2 and "loss" in trainer.callback_metrics


def test_refusals(L):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    with pytest.raises(ValueError, match="SyncBatchNorm"):
        _trainer(L, sync_batchnorm=True).fit(_tiny(L), _loader())
    schedule = GradientAccumulationScheduler(scheduling={0: 1, 1: 2})
    with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
        _trainer(L, callbacks=[schedule]).fit(_tiny(L), _loader())
