"""PyTorch Lightning on hvdlite: a small classifier on scikit-learn's digits (nothing
is downloaded), trained data-parallel with ``Trainer(strategy="hvdlite")``.

    hvdliterun -np 2 python examples/lightning_digits.py
    hvdliterun -np 2 python examples/lightning_digits.py --accumulate 2 --epochs 8

The script is a plain Lightning script: importing ``hvdlite.lightning`` registers the
strategy, hvdliterun starts the processes, and Lightning does the rest through the
strategy (a DistributedSampler on each dataloader, hvdlite's DistributedOptimizer
around the optimizer, metrics logged with ``sync_dist=True`` averaged over ranks,
checkpoints written by rank 0). The last checkpoint loads in one process:
``DigitsClassifier.load_from_checkpoint(path)``.
"""
import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import hvdlite.lightning  # noqa: F401  (registers strategy="hvdlite")


def parse_args():
    parser = argparse.ArgumentParser(description="hvdlite Lightning digits example")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--accumulate", type=int, default=1,
                        help="accumulate_grad_batches: batches per optimizer step")
    parser.add_argument("--root-dir", default="lightning_runs",
                        help="where rank 0 writes the CSV logs and checkpoints")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


class DigitsClassifier(L.LightningModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch, stage):
        x, y = batch
        logits = self.net(x)
        self.log(f"{stage}_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                               T_max=self.trainer.max_epochs)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def loaders(batch_size, seed):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2,
                                                        random_state=seed, stratify=y)
    # No sampler here: Lightning adds a DistributedSampler from the strategy.
    return (DataLoader(TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x_test, y_test), batch_size=batch_size))


def main():
    args = parse_args()
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    train, test = loaders(args.batch_size, args.seed)
    model = DigitsClassifier(lr=args.lr)
    checkpoint = ModelCheckpoint(monitor="val_accuracy", mode="max", save_last=True)
    trainer = L.Trainer(strategy="hvdlite", accelerator="cpu", max_epochs=args.epochs,
                        accumulate_grad_batches=args.accumulate,
                        default_root_dir=args.root_dir, logger=CSVLogger(args.root_dir),
                        callbacks=[checkpoint], enable_progress_bar=False)
    trainer.fit(model, train, test)
    results = trainer.test(model, test, verbose=False)[0]
    if trainer.is_global_zero:
        print(f"ranks {trainer.world_size}, test accuracy "
              f"{100 * results['test_accuracy']:.2f}%, loss {results['test_loss']:.4f}; "
              f"best checkpoint {checkpoint.best_model_path}", flush=True)


if __name__ == "__main__":
    main()
