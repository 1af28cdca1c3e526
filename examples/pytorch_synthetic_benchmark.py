"""Synthetic-data training benchmark, after Horovod's pytorch_synthetic_benchmark.py.

    hvdliterun -np 2 python examples/pytorch_synthetic_benchmark.py [--model mlp|cnn]

Random inputs and labels, fixed per rank; prints samples/sec per rank for each
iteration, then the mean with a 95% interval and the total over all ranks.
"""
import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import hvdlite.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description="hvdlite PyTorch synthetic benchmark")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                        help="mlp: 784-2048-2048-10; cnn: a small convnet on 3x32x32")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return parser.parse_args()


def make_model(name):
    if name == "mlp":
        return (torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(),
                                    torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                    torch.nn.Linear(2048, 10)), (784,))
    return (torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)), (3, 32, 32))


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(hvd.rank())

    model, shape = make_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, *shape)
    target = torch.randint(0, 10, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(message):
        if hvd.rank() == 0:
            print(message, flush=True)

    log(f"Model: {args.model}, batch size {args.batch_size} per rank, {hvd.size()} rank(s)")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} samples/sec per rank")
        rates.append(rate)
    mean, conf = np.mean(rates), 1.96 * np.std(rates)
    log(f"Samples/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total samples/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
