"""Data, model and plain-torch reference shared by the Lightning rank script
(lightning_training.py) and the test that checks it (test_lightning.py).

Pure torch: the reference is one process training on the whole batch with a plain loop,
no Lightning and no hvdlite, so it is computed independently of what it checks.
"""
import torch

FEATURES = 6
BATCH = 4          # per rank, per step
STEPS = 3          # optimizer steps per epoch (per accumulation group of batches)
EPOCHS = 2
LR = 0.05
VAL_SIZE_PER_RANK = 8
PREDICT_SIZE = 10  # not a multiple of the rank counts: the predict sampler does not pad


def make_data(n, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 1, generator=generator)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=generator)
    return x, y


def make_net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1))


def make_optimizer(net):
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return optimizer, scheduler


def train_size(ranks, accumulate):
    return ranks * BATCH * accumulate * STEPS


def epoch_order(n, epoch):
    """The order in which the DistributedSampler that Lightning puts on a training loader
    (shuffled, seed 0, ``set_epoch`` each epoch) deals the samples: rank r of R takes
    ``order[r::R]``, so step j of all ranks together covers
    ``order[j*R*B:(j+1)*R*B]`` for B samples per rank and step."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()


def reference(ranks, accumulate):
    """One process, batch ranks*BATCH*accumulate, the same epochs, sample order and
    schedule.

    Returns:
        (net, optimizer, the mean loss of the last epoch's steps) after training.
    """
    x, y = make_data(train_size(ranks, accumulate), seed=1)
    net = make_net(seed=0)
    optimizer, scheduler = make_optimizer(net)
    batch = ranks * BATCH * accumulate
    for epoch in range(EPOCHS):
        losses = []
        order = torch.tensor(epoch_order(len(x), epoch))
        for start in range(0, len(x), batch):
            rows = order[start:start + batch]
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows])
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
        scheduler.step()
    return net, optimizer, sum(losses) / len(losses)
