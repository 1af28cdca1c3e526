"""hvdlite for PyTorch Lightning 2.x (the ``lightning`` package).

    import hvdlite.lightning  # registers strategy="hvdlite"
    trainer = lightning.Trainer(strategy="hvdlite", accelerator="cpu", max_epochs=5)
    trainer.fit(model, datamodule)

and ``hvdliterun -np 4 python train.py``: each process is one rank, Lightning puts a
DistributedSampler on the dataloaders, the optimizers become hvdlite
DistributedOptimizers, ``self.log(..., sync_dist=True)`` is averaged through hvdlite,
and rank 0 writes the checkpoints. Lightning 2 has no Horovod strategy; this is one.
"""
from lightning.pytorch.strategies import StrategyRegistry

from hvdlite.lightning.environment import HvdliteEnvironment
from hvdlite.lightning.strategy import HvdliteStrategy

HvdliteStrategy.register_strategies(StrategyRegistry)

__all__ = ["HvdliteEnvironment", "HvdliteStrategy"]
