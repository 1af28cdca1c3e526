"""The digits classifier (examples/pytorch_digits.py) trained on a Spark cluster through
hvdlite.spark.run: each rank is one task of a barrier stage.

    python examples/spark_digits.py                                   # local[2]
    python examples/spark_digits.py --master local-cluster[2,1,1024] --num-proc 2
    python examples/spark_digits.py --master spark://HOST:7077 --num-proc 4

The driver reads the data (scikit-learn's digits, shipped with it) and passes it to the
ranks with the function; each rank trains on its shard with DistributedOptimizer, and
the trained weights come back from rank 0 to the driver, which evaluates them on the
held-out samples itself. The workers need the driver's Python environment at the same
path (torch, scikit-learn, hvdlite and its MPI, pyspark): docs/spark.md.
"""
import argparse

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="hvdlite on Spark: the digits example")
    parser.add_argument("--master", default="local[2]", help="Spark master URL")
    parser.add_argument("--num-proc", type=int, default=None,
                        help="ranks (default: the cluster's default parallelism)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def digits(seed):
    """(x_train, y_train, x_test, y_test) as numpy arrays."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    return train_test_split(x, data.target.astype(np.int64), test_size=0.2,
                            random_state=seed, stratify=data.target)


def make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def train(x_train, y_train, epochs, batch_size, lr, seed):
    """What every rank runs: returns rank 0's trained weights (None on the others)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import hvdlite.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    train_set = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        mean_loss = hvd.allreduce(torch.tensor(total / max(batches, 1)), name="loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  train loss {mean_loss:.4f}", flush=True)
    return model.state_dict() if hvd.rank() == 0 else None


def run_training(num_proc=None, epochs=10, batch_size=64, lr=0.05, seed=42):
    """Trains through hvdlite.spark.run on the active SparkContext.

    Returns:
        The test accuracy of rank 0's weights, measured on the driver.
    """
    import torch

    import hvdlite.spark

    x_train, x_test, y_train, y_test = digits(seed)
    results = hvdlite.spark.run(train, args=(x_train, y_train, epochs, batch_size, lr, seed),
                                num_proc=num_proc)
    model = make_model()
    model.load_state_dict(results[0])
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(1).numpy()
    return float((predicted == y_test).mean())


def main(argv=None):
    args = parse_args(argv)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("hvdlite spark_digits")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    try:
        accuracy = run_training(args.num_proc, args.epochs, args.batch_size, args.lr,
                                args.seed)
    finally:
        spark.stop()
    print(f"test accuracy of rank 0's model, on the driver: {accuracy:.2%}", flush=True)


if __name__ == "__main__":
    main()
