"""Data-parallel training of a small classifier on scikit-learn's digits, on Ray.

    python examples/ray_digits.py --num-workers 2              # a local Ray, started here
    python examples/ray_digits.py --address auto --num-hosts 2 --workers-per-host 2

A horovod.ray script: replace ``hvdlite.ray``/``hvdlite.torch`` with ``horovod.ray``/
``horovod.torch`` and it runs unchanged. Each worker is a Ray actor and one rank; it
holds a stateful ``DigitsTrainer`` (``start(executable_cls=...)``), and the driver runs
one epoch at a time on every rank with ``execute``, printing rank 0's figures (the loss
and accuracy are averaged over ranks, so every rank has the same).
"""
import argparse

import ray

from hvdlite.ray import RayExecutor


class DigitsTrainer:
    """One rank's model, optimizer and shard of the digits (made on every worker)."""

    def __init__(self, lr=0.05, batch_size=64, seed=42):
        import torch
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        from torch.utils.data import DataLoader, TensorDataset
        from torch.utils.data.distributed import DistributedSampler

        import hvdlite.torch as hvd

        hvd.init()
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.int64)
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2,
                                                            random_state=seed, stratify=y)
        self.train_set = TensorDataset(x_train, y_train)
        self.sampler = DistributedSampler(self.train_set, num_replicas=hvd.size(),
                                          rank=hvd.rank(), shuffle=True, seed=seed)
        self.train_loader = DataLoader(self.train_set, batch_size=batch_size,
                                       sampler=self.sampler)
        test_set = TensorDataset(x_test, y_test)
        self.test_loader = DataLoader(test_set, batch_size=256, sampler=DistributedSampler(
            test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False))
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                         torch.nn.Linear(128, 10))
        # The effective batch is size() times larger: scale the learning rate alike.
        optimizer = torch.optim.SGD(self.model.parameters(), lr=lr * hvd.size(), momentum=0.9)
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=self.model.named_parameters())
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)

    def train_epoch(self, epoch):
        """One epoch on this rank's shard; returns (mean loss, test accuracy) over ranks."""
        import torch
        import torch.nn.functional as F

        import hvdlite.torch as hvd

        self.model.train()
        self.sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in self.train_loader:
            self.optimizer.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
            batches += 1
        self.model.eval()
        correct = seen = 0
        with torch.no_grad():
            for x, y in self.test_loader:
                correct += int((self.model(x).argmax(1) == y).sum())
                seen += len(y)
        loss = hvd.allreduce(torch.tensor(total / max(batches, 1), dtype=torch.float64),
                             name="loss").item()
        counts = hvd.allreduce(torch.tensor([correct, seen]), name="counts", op=hvd.Sum)
        return loss, float(counts[0]) / float(counts[1])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="hvdlite on Ray: digits")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join (e.g. auto); default: start one here")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="ranks, packed onto nodes (default 2 without --num-hosts)")
    parser.add_argument("--num-hosts", type=int, default=None,
                        help="hosts, each with --workers-per-host ranks")
    parser.add_argument("--workers-per-host", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)
    if args.num_workers is None and args.num_hosts is None:
        args.num_workers = 2
    return args


def main(argv=None):
    """Trains; returns the last epoch's (loss, accuracy)."""
    args = parse_args(argv)
    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False)
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=args.num_workers, num_hosts=args.num_hosts,
                           num_workers_per_host=args.workers_per_host)
    executor.start(executable_cls=DigitsTrainer, executable_kwargs={"lr": args.lr})
    try:
        hosts = executor.run(lambda: __import__("socket").gethostname())
        print(f"training on {len(hosts)} rank(s), hosts {sorted(set(hosts))}", flush=True)
        for epoch in range(1, args.epochs + 1):
            loss, accuracy = executor.execute(lambda trainer: trainer.train_epoch(epoch))[0]
            print(f"epoch {epoch}: loss {loss:.4f}, test accuracy {accuracy:.3f}", flush=True)
    finally:
        executor.shutdown()
    return loss, accuracy


if __name__ == "__main__":
    main()
