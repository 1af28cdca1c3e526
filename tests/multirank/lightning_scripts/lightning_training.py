"""One rank of a Lightning job on HvdliteStrategy (run by test_lightning.py).

    hvdliterun -np N python lightning_training.py CKPT_DIR
        fit (SGD with momentum, weight decay and a StepLR schedule, 2 epochs) with a
        ModelCheckpoint each epoch, then validate, test, predict; the strategy's
        all_gather, broadcast, barrier and reduce_boolean_decision; then a second fit
        with accumulate_grad_batches=2. Prints one HVDLITE_RESULT with what the test
        compares against lightning_common.reference.
    python lightning_training.py --load CKPT
        one process, no hvdlite: Lightning loads the checkpoint and prints its weights.
"""
import json
import sys

import torch

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

import lightning_common as common

torch.set_num_threads(1)


class Regression(L.LightningModule):
    def __init__(self, seed=0):
        super().__init__()
        self.save_hyperparameters()
        self.net = common.make_net(seed)
        self.seen = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.extend(index.tolist())
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        self.log("rank_value", float(self.global_rank), sync_dist=True, on_step=False,
                 on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)
        self.log("test_rank_max", float(self.global_rank), sync_dist=True, reduce_fx="max")

    def predict_step(self, batch, batch_idx):
        x, index = batch
        return index, self.net(x)

    def configure_optimizers(self):
        optimizer, scheduler = common.make_optimizer(self.net)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class CountingCheckpointIO(TorchCheckpointIO):
    """Counts the checkpoints this process writes."""

    def __init__(self):
        super().__init__()
        self.saved = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved.append(str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def weights(module):
    return {name: t.detach().flatten().tolist() for name, t in module.net.state_dict().items()}


def train_loader(size):
    x, y = common.make_data(size, seed=1)
    return DataLoader(TensorDataset(x, y, torch.arange(size)), batch_size=common.BATCH)


def trainer(**kwargs):
    return L.Trainer(strategy="hvdlite", accelerator="cpu", max_epochs=common.EPOCHS,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     **kwargs)


def main(ckpt_dir):
    import hvdlite.lightning  # noqa: F401  (registers strategy="hvdlite")
    import hvdlite.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {"rank": rank, "size": size}

    # Every rank starts from other weights: setup must broadcast rank 0's.
    model = Regression(seed=0 if rank == 0 else 100 + rank)
    io = CountingCheckpointIO()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1)
    fit = trainer(callbacks=[checkpoint], plugins=[io])
    strategy = fit.strategy
    out["strategy"] = type(strategy).__name__
    out["ranks"] = [strategy.global_rank, strategy.local_rank, strategy.world_size]
    fit.fit(model, train_loader(common.train_size(size, 1)))
    out["optimizer"] = type(strategy.optimizers[0]).__mro__[1].__name__
    out["distributed_optimizer"] = hasattr(strategy.optimizers[0], "synchronize")
    out["sampler"] = type(fit.train_dataloader.sampler).__name__
    out["seen"] = model.seen
    out["weights"] = weights(model)
    out["momentum"] = {name: strategy.optimizers[0].state[p]["momentum_buffer"].flatten().tolist()
                       for name, p in model.net.named_parameters()}
    out["lr"] = strategy.optimizers[0].param_groups[0]["lr"]
    out["logged"] = {k: float(v) for k, v in fit.callback_metrics.items()}
    out["saved"] = io.saved
    out["best"] = checkpoint.best_model_path

    xv, yv = common.make_data(common.VAL_SIZE_PER_RANK * size, seed=2)
    loader = DataLoader(TensorDataset(xv, yv), batch_size=4)
    out["validate"] = fit.validate(model, loader, verbose=False)
    out["test"] = fit.test(model, loader, verbose=False)
    xp, _ = common.make_data(common.PREDICT_SIZE, seed=3)
    predictions = fit.predict(model, DataLoader(TensorDataset(xp, torch.arange(len(xp))),
                                                batch_size=3))
    out["predict"] = [[i, float(v)] for index, value in predictions
                      for i, v in zip(index.tolist(), value.flatten().tolist())]

    out["all_gather"] = strategy.all_gather(torch.tensor([rank, 10 * rank])).tolist()
    out["all_gather_scalar"] = model.all_gather(torch.tensor(float(rank))).tolist()
    out["broadcast"] = strategy.broadcast({"from": rank}, src=size - 1)
    strategy.barrier("check")
    out["any"] = strategy.reduce_boolean_decision(rank == size - 1, all=False)
    out["all"] = strategy.reduce_boolean_decision(rank == size - 1, all=True)
    out["sum"] = strategy.reduce(torch.tensor(rank + 1), reduce_op="sum").item()
    out["int_mean"] = strategy.reduce(torch.tensor(rank + 1)).item()
    # A metric reduced every step (self.log(..., sync_dist=True)): cache hits after the first.
    before = hvd.stats()
    out["repeated_means"] = [strategy.reduce(torch.tensor(float(rank * step))).item()
                             for step in range(10)]
    out["repeated_hits"] = hvd.stats()["cache_hits"] - before["cache_hits"]

    # Gradient accumulation: 2 batches of BATCH per step, after a first fit in this process.
    accumulated = Regression(seed=0 if rank == 0 else 100 + rank)
    fit2 = trainer(accumulate_grad_batches=2, enable_checkpointing=False)
    fit2.fit(accumulated, train_loader(common.train_size(size, 2)))
    out["accumulated_weights"] = weights(accumulated)
    out["accumulated_steps"] = fit2.global_step
    print("HVDLITE_RESULT", json.dumps(out), flush=True)


def load(path):
    model = Regression.load_from_checkpoint(path)
    state = torch.load(path, weights_only=False)
    print("HVDLITE_RESULT", json.dumps({
        "weights": weights(model), "epoch": state["epoch"],
        "global_step": state["global_step"],
        "momentum": [s["momentum_buffer"].flatten().tolist()
                     for _, s in sorted(state["optimizer_states"][0]["state"].items())]}))


if __name__ == "__main__":
    if sys.argv[1] == "--load":
        load(sys.argv[2])
    else:
        main(sys.argv[1])
