"""Elastic data-parallel training of the digits classifier (examples/pytorch_digits.py):
a lost rank costs a rollback to the last commit, not the job.

    hvdliterun -np 3 --min-np 2 --max-np 3 python examples/pytorch_elastic_digits.py
    # the same, with rank 2 killed (SIGKILL) in the middle of epoch 3:
    hvdliterun -np 3 --min-np 2 --max-np 3 python examples/pytorch_elastic_digits.py \
        --kill-rank 2 --kill-at-epoch 3

A Horovod elastic script: with ``import horovod.torch as hvd`` it runs under
``horovodrun --min-np 2 --max-np 3`` unchanged (``--kill-*`` aside). The model, the
optimizer, the epoch and the ElasticSampler's progress are committed every
``--batches-per-commit`` batches; after a reset the new world resumes from the last
commit, the sampler splits the rest of the epoch over it, and the reset callback
rescales the learning rate to the new size.
"""
import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import hvdlite.torch as hvd
from pytorch_digits import datasets  # the same data and split as the non-elastic example


def parse_args():
    parser = argparse.ArgumentParser(description="hvdlite elastic PyTorch digits example")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    parser.add_argument("--batches-per-commit", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--kill-rank", type=int, default=-1,
                        help="this rank of the first world SIGKILLs itself ...")
    parser.add_argument("--kill-at-epoch", type=int, default=-1,
                        help="... after its second batch of this epoch")
    return parser.parse_args()


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    first_world = os.environ.get("HVDLITE_ELASTIC_GENERATION", "0") == "0"

    train_set, test_set = datasets(args.seed)
    train_sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def on_reset():
        # The effective batch follows the world size: so does the learning rate.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: {hvd.size()} rank(s) go on from epoch {state.epoch}, "
                  f"{train_sampler.processed_num} of its samples done", flush=True)

    state = hvd.elastic.TorchState(model, optimizer, sampler=train_sampler, epoch=1)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.epoch <= args.epochs:
            model.train()
            for batch, (x, y) in enumerate(train_loader):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                train_sampler.record_batch(batch, args.batch_size)
                if first_world and hvd.rank() == args.kill_rank and \
                        state.epoch == args.kill_at_epoch and batch == 1:
                    print(f"rank {hvd.rank()}: killing myself in epoch {state.epoch}",
                          flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if batch % args.batches_per_commit == 0:
                    state.commit()
            accuracy = evaluate(model, test_loader)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch:2d}  {hvd.size()} rank(s)  "
                      f"test accuracy {accuracy:.2%}", flush=True)
            state.epoch += 1
            train_sampler.set_epoch(state.epoch)
            state.commit()
        return accuracy

    start = time.perf_counter()
    accuracy = train(state)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.2%} on {hvd.size()} rank(s); "
              f"this world trained for {time.perf_counter() - start:.1f}s", flush=True)


def evaluate(model, loader):
    """Accuracy on the whole test set (every rank holds the same weights)."""
    model.eval()
    correct, seen = 0, 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
            seen += len(y)
    return correct / seen


if __name__ == "__main__":
    main()
