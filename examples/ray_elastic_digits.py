"""Elastic training of the digits classifier on Ray: a node lost costs a rollback to the
last commit, a node that joins (or frees its CPUs) is taken in at the next commit.

    python examples/ray_elastic_digits.py                       # a local Ray, started here
    python examples/ray_elastic_digits.py --address auto --min-workers 2 --max-workers 8

A horovod.ray elastic script: replace ``hvdlite.ray``/``hvdlite.torch`` with
``horovod.ray``/``horovod.torch`` and it runs unchanged. ``train`` runs on every worker,
and again from its start in every new world: it builds the model and the state, and
``hvd.elastic.run`` brings them to the last commit (model, optimizer, epoch and the
ElasticSampler's progress, committed every batch). Rank 0 reports each epoch with
``ray_logger.log``; the driver's callback prints the reports.
"""
import argparse

import ray

from hvdlite.ray import RayExecutor


def train(epochs, lr, batch_size=64, seed=42):
    """One worker's training; returns the final test accuracy (every rank the same)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import TensorDataset

    import hvdlite.torch as hvd
    from hvdlite.ray import ray_logger

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    digits = load_digits()  # the same data and split as examples/pytorch_digits.py
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2,
                                                        random_state=seed, stratify=y)
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=256)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())

    def rescale_lr():
        # The effective batch follows the world's size: so does the learning rate.
        for group in optimizer.param_groups:
            group["lr"] = lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=1)
    state.register_reset_callbacks([rescale_lr])

    def accuracy():
        model.eval()
        with torch.no_grad():
            hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in test_loader)
        model.train()
        return hits / len(test_set)

    @hvd.elastic.run
    def loop(state):
        while state.epoch <= epochs:
            for batch, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                sampler.record_batch(batch, batch_size)
                state.commit()
            if hvd.rank() == 0:
                ray_logger.log({"epoch": state.epoch, "ranks": hvd.size(),
                                "accuracy": accuracy()})
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
        return accuracy()

    return loop(state)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="hvdlite on Ray: elastic digits")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join (e.g. auto); default: start one here")
    parser.add_argument("--min-workers", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=None)
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args(argv)


def main(argv=None):
    """Trains; returns the final test accuracy of each rank of the last world."""
    args = parse_args(argv)
    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60),
                           min_workers=args.min_workers, max_workers=args.max_workers,
                           cpus_per_worker=args.cpus_per_worker, elastic_timeout=300)
    executor.start()

    def show(report):
        print(f"epoch {report['epoch']}: {report['ranks']} rank(s), test accuracy "
              f"{report['accuracy']:.3f}", flush=True)

    try:
        accuracies = executor.run(train, args=[args.epochs, args.lr], callbacks=[show])
    finally:
        executor.shutdown()
    print(f"final test accuracy {accuracies[0]:.3f} on {len(accuracies)} rank(s) "
          f"(worlds of {executor.last_worlds} ranks)", flush=True)
    return accuracies


if __name__ == "__main__":
    main()
