"""Data-parallel training of a small classifier on scikit-learn's digits (nothing is
downloaded: the 1,797 8x8 images ship with scikit-learn).

    hvdliterun -np 2 python examples/pytorch_digits.py
    hvdliterun -np 2 python examples/pytorch_digits.py --cuda   # on GPUs

A Horovod PyTorch script: replace ``import hvdlite.torch as hvd`` with
``import horovod.torch as hvd`` and it runs under horovodrun unchanged. Each rank trains
on its shard of the data (DistributedSampler); DistributedOptimizer averages the
gradients while backward runs; rank 0 prints the loss and accuracy averaged over ranks.
With ``--cuda`` each rank pins one GPU (ranks beyond the number of GPUs share them) and
trains there.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvdlite.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description="hvdlite PyTorch digits example")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="compress gradients to float16 for the allreduce")
    parser.add_argument("--compression", default=None,
                        help="none, fp16, bf16, topk:RATIO, quantize:BITS or powersgd:RANK, "
                             "a reducer's options after colons, e.g. topk:0.1:momentum=0 "
                             "(README, 'Gradient compression')")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--cuda", action="store_true",
                        help="train on the GPU local_rank() %% device_count()")
    return parser.parse_args()


def datasets(seed):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2,
                                                        random_state=seed, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def metric_average(value, name):
    """The mean of a Python number over all ranks."""
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name).item()


def main():
    args = parse_args()
    if args.cuda and not torch.cuda.is_available():
        raise SystemExit("--cuda: torch sees no CUDA device")
    hvd.init()
    if args.cuda:
        # Pin one GPU per process, as Horovod scripts do.
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda" if args.cuda else "cpu")
    torch.set_num_threads(1)  # one compute thread per rank; ranks share the machine
    torch.manual_seed(args.seed)

    train_set, test_set = datasets(args.seed)
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                       shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                      shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).to(device)
    # The effective batch is size() times larger: scale the learning rate alike.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = hvd.Compression.parse(args.compression or
                                        ("fp16" if args.fp16_allreduce else "none"))
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
    # Start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} rank(s) ({device.type}): {len(train_set)} train / "
              f"{len(test_set)} test samples, batch {args.batch_size} per rank", flush=True)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        total_loss, batches = 0.0, 0
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
            batches += 1

        model.eval()
        correct, seen = 0, 0
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                correct += int((model(x).argmax(1) == y).sum())
                seen += len(y)
        train_loss = metric_average(total_loss / max(batches, 1), "avg_loss")
        # Sum counts over ranks rather than averaging per-rank accuracies.
        counts = hvd.allreduce(torch.tensor([correct, seen], dtype=torch.int64),
                               name="accuracy_counts", op=hvd.Sum)
        accuracy = float(counts[0]) / float(counts[1])
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  train loss {train_loss:.4f}  "
                  f"test accuracy {accuracy:.2%}", flush=True)
    if hvd.rank() == 0:
        print(f"done in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
