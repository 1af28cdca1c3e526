"""Process sets on real 2-, 3- and 4-rank jobs: collectives inside a set against numpy,
two sets in flight at once, adding and removing sets at run time, the errors.

Each rank records failed checks instead of raising (PRELUDE's ``check``) and reports
them with the number of checks made in one ``HVDLITE_RESULT`` line; the test asserts
that every rank made checks and none failed. Expected values come from the ranks and
the set's members alone, so bodies pass at any rank count.
"""
import os

import pytest

import needs

from harness import assert_ok, describe, run_job, share_script, shared_checks

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

JOB_TIMEOUT = 150

PRELUDE = r'''
import copy, json, os, sys, time
import numpy as np
import hvdlite as hvd
from hvdlite import errors

rank_env = None
failures, checks = [], [0]


def check(label, ok, detail=""):
    checks[0] += 1
    if not ok:
        failures.append(f"{label}: {detail}")


def close(label, got, want):
    got, want = np.asarray(got), np.asarray(want)
    check(label, got.shape == want.shape and np.allclose(got, want),
          f"got {got.tolist()} want {want.tolist()}")


def expect_error(label, cls, words, fn):
    try:
        fn()
    except cls as e:
        check(label, all(w in str(e) for w in words), f"message {e!s} lacks {words}")
        return str(e)
    except Exception as e:
        check(label, False, f"raised {type(e).__name__}: {e}")
    else:
        check(label, False, f"did not raise {cls.__name__}")


def report(**extra):
    hvd.barrier()  # no rank shuts the job down (at exit) while another still works
    print("HVDLITE_RESULT", json.dumps({"failures": failures, "checks": checks[0], **extra}),
          flush=True)


def data(r, shape, salt=0):
    n = int(np.prod(shape))
    return ((np.arange(n) * 3 + r * 5 + salt * 7) % 17 - 8).astype(np.float64).reshape(shape)
'''


def _assert_checks(result, np_, least=1):
    assert_ok(result)
    return _assert_outcomes([result.result(r) for r in range(np_)], result, least)


def _assert_outcomes(outcomes, job, least):
    """Fails with every rank's failed checks (outcomes: each rank's report) and those
    that made fewer than ``least``; returns {rank: report}."""
    problems = []
    for r, outcome in enumerate(outcomes):
        if outcome["checks"] < least:
            problems.append(f"rank {r} made only {outcome['checks']} checks")
        problems += [f"rank {r}: {f}" for f in outcome["failures"]]
    assert not problems, "\n".join(problems) + "\n" + describe(job)
    return dict(enumerate(outcomes))


COLLECTIVES = PRELUDE + r'''
hvd.init()
rank, size = hvd.rank(), hvd.size()
evens = [r for r in range(size) if r % 2 == 0]
odds = [r for r in range(size) if r % 2 == 1]
even_set = hvd.add_process_set(evens)
odd_set = hvd.add_process_set(odds)
sets = [even_set, odd_set]
if size >= 3:
    sets.append(hvd.add_process_set([1, 0]))  # any order; kept sorted
ids = [ps.process_set_id for ps in sets]
check("ids are distinct and not 0", len(set(ids)) == len(ids) and 0 not in ids, str(ids))
check("global set", hvd.global_process_set.process_set_id == 0
      and hvd.global_process_set.size() == size and hvd.global_process_set.rank() == rank)
shm_before = hvd.stats()["shm_collectives"]
for ps in sets:
    members = ps.ranks
    check(f"{ps} ranks sorted", members == sorted(members))
    check(f"{ps} included", ps.included() == (rank in members))
    check(f"{ps} rank", ps.rank() == (members.index(rank) if rank in members else -1),
          f"{ps.rank()}")
    check(f"{ps} size", ps.size() == len(members))
    if not ps.included():
        continue
    n, me = len(members), members.index(rank)
    tag = f"ps{ps.process_set_id}"
    # allreduce: Sum, Average (divides by the set's size), Max; in place with out.
    x = data(rank, (3, 4))
    close(f"{tag} sum", hvd.allreduce(x, name=f"{tag}.sum", op=hvd.Sum, process_set=ps),
          sum(data(r, (3, 4)) for r in members))
    close(f"{tag} avg", hvd.allreduce(x, name=f"{tag}.avg", process_set=ps),
          sum(data(r, (3, 4)) for r in members) / n)
    close(f"{tag} max", hvd.allreduce(x, op=hvd.Max, process_set=ps),
          np.max([data(r, (3, 4)) for r in members], axis=0))
    close(f"{tag} scaled", hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                          postscale_factor=0.5, process_set=ps),
          sum(data(r, (3, 4)) for r in members))
    # Repeated under one name (the per-step path) and through the response cache.
    for step in range(3):
        close(f"{tag} repeat {step}", hvd.allreduce(x, name=f"{tag}.rep", op=hvd.Sum,
                                                     process_set=ps),
              sum(data(r, (3, 4)) for r in members))
    got = hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum, process_set=ps)
    close(f"{tag} grouped 0", got[0], sum(data(r, (3, 4)) for r in members))
    close(f"{tag} grouped 1", got[1], 2 * sum(data(r, (3, 4)) for r in members))
    # allgather: uneven first dimensions, the members' rows in rank order.
    mine = data(rank, (rank + 1, 2))
    close(f"{tag} allgather", hvd.allgather(mine, process_set=ps),
          np.concatenate([data(r, (r + 1, 2)) for r in members]))
    # broadcast from every member (global root ranks).
    for root in members:
        close(f"{tag} broadcast from {root}",
              hvd.broadcast(data(rank, (5,)), root, process_set=ps), data(root, (5,)))
    # alltoall: member j sends j + k + 1 rows to member k.
    splits = [me + k + 1 for k in range(n)]
    rows = data(rank, (sum(splits), 2))
    got, recv = hvd.alltoall(rows, splits=splits, process_set=ps)
    want = []
    for j, r in enumerate(members):
        theirs = data(r, (sum(j + k + 1 for k in range(n)), 2))
        start = sum(j + k + 1 for k in range(me))
        want.append(theirs[start:start + j + me + 1])
    close(f"{tag} alltoall", got, np.concatenate(want))
    close(f"{tag} alltoall splits", recv, [j + me + 1 for j in range(n)])
    # reducescatter: rows split among the members.
    full = sum(data(r, (2 * n + 1, 3)) for r in members)
    counts = [(2 * n + 1) // n + (1 if k < (2 * n + 1) % n else 0) for k in range(n)]
    start = sum(counts[:me])
    close(f"{tag} reducescatter",
          hvd.reducescatter(data(rank, (2 * n + 1, 3)), op=hvd.Sum, process_set=ps),
          full[start:start + counts[me]])
    hvd.barrier(process_set=ps)
    got = hvd.allgather_object({"rank": rank}, process_set=ps)
    check(f"{tag} allgather_object", got == [{"rank": r} for r in members], str(got))
    got = hvd.broadcast_object(("from", members[-1]) if rank == members[-1] else None,
                               root_rank=members[-1], process_set=ps)
    check(f"{tag} broadcast_object", got == ("from", members[-1]), str(got))
# The global set still works between and after them.
close("global sum", hvd.allreduce(np.array([rank + 1.0]), op=hvd.Sum), [size * (size + 1) / 2])
report(shm=hvd.stats()["shm_collectives"] - shm_before,
       sets={ps.process_set_id: ps.ranks for ps in sets})
'''


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("shm", ["1", "0"])
def test_collectives_in_a_set_match_numpy(np_, shm):
    result = run_job(np_, COLLECTIVES, timeout=JOB_TIMEOUT, env={"HVDLITE_SHM_ALLREDUCE": shm})
    outcomes = _assert_checks(result, np_, least=20)
    if shm == "1" and np_ == 3:
        # The even set {0, 2} reduces through its own shared-memory group.
        assert all(outcomes[r]["shm"] > 0 for r in (0, 2)), outcomes
    if shm == "0":
        assert all(outcomes[r]["shm"] == 0 for r in range(np_)), outcomes


# Sets that overlap in a chain: {0, 1}, {1, 2}, ({2, 3} at 4 ranks). A rank in two sets
# submits its ops in the order opposite to the sets' ids, and rank 0 (the first of the
# chain) waits until every later set's op has completed (a file per set says so: a
# causal wait, not a timed one), so the op of {0, 1} is in flight, unmatched, on rank 1
# while the later sets must complete: a core that served one set at a time, or took the
# sets in submission order, would hang (the job's timeout). Then every rank adds and
# removes a set while that op is still unmatched, and only then does rank 0 submit it.
IN_FLIGHT = PRELUDE + r"""
hvd.init()
rank, size = hvd.rank(), hvd.size()
signal_dir = sys.argv[1]
chain = [hvd.add_process_set([k, k + 1]) for k in range(size - 1)]
mine = sorted([ps for ps in chain if ps.included()], key=lambda ps: -ps.process_set_id)
handles = {}


def submit(ps):
    for step in range(3):
        handles[(ps.process_set_id, step)] = hvd.allreduce_async(
            np.full(4, rank + 1.0), name=f"chain.{ps.process_set_id}.{step}", op=hvd.Sum,
            process_set=ps)


def finish(ps):
    for step in range(3):
        close(f"set {ps.ranks} step {step}", hvd.synchronize(handles[(ps.process_set_id, step)]),
              np.full(4, float(sum(r + 1 for r in ps.ranks))))


if rank == 0:
    later = [ps.process_set_id for ps in chain[1:]]
    while not all(os.path.exists(os.path.join(signal_dir, f"done.{i}")) for i in later):
        time.sleep(0.01)
else:
    for ps in mine:
        submit(ps)
    for ps in mine:
        if ps is chain[0]:
            continue  # rank 1's op of {0, 1} stays unmatched
        finish(ps)
        if rank == ps.ranks[-1]:
            open(os.path.join(signal_dir, f"done.{ps.process_set_id}"), "w").close()
check("{0, 1} still in flight on rank 1",
      rank != 1 or not hvd.poll(handles[(chain[0].process_set_id, 0)]))
extra = hvd.add_process_set([0, size - 1])
if extra.included():
    close("extra", hvd.allreduce(np.array([rank + 1.0]), op=hvd.Sum, process_set=extra),
          [float(1 + size)])
hvd.remove_process_set(extra)
if rank == 0:
    submit(chain[0])
if chain[0].included():
    finish(chain[0])
report()
"""


@pytest.mark.parametrize("np_", [3, 4])
def test_two_sets_in_flight_at_once_do_not_deadlock(np_, tmp_path):
    result = run_job(np_, IN_FLIGHT, timeout=JOB_TIMEOUT, args=[str(tmp_path)])
    _assert_checks(result, np_, least=3)


CHANGES = PRELUDE + r'''
hvd.init(process_sets=[hvd.ProcessSet([0])])
rank, size = hvd.rank(), hvd.size()
from hvdlite import process_sets
table = process_sets.process_set_ids_and_ranks()
check("init registered [0] as set 1", table == {0: list(range(size)), 1: [0]}, str(table))
first = hvd.add_process_set(range(1, size))
check("next free id", first.process_set_id == 2, str(first))
check("str", str(first) == f"ProcessSet(process_set_id=2, ranks={list(range(1, size))}, "
      "mpi_comm=None)", str(first))
# A set of these ranks exists: it is answered (the same id, on every rank), so a set
# left behind by failed code does not fail every later add of the job.
twin = hvd.add_process_set(list(range(size - 1, 0, -1)))
check("duplicate answers the set", twin.process_set_id == 2 and twin is not first, str(twin))
check("table unchanged", process_sets.process_set_ids_and_ranks() == table | {2: first.ranks},
      str(process_sets.process_set_ids_and_ranks()))
# Refused alike on every rank: the global set's ranks, bad ranks.
expect_error("duplicate of global", ValueError, ["process set 0"],
             lambda: hvd.add_process_set(range(size)))
expect_error("out of range", ValueError, ["out of range"], lambda: hvd.add_process_set([0, size]))
expect_error("repeated", ValueError, ["twice"], lambda: hvd.add_process_set([0, 0]))
check("global stays", hvd.remove_process_set(hvd.global_process_set) is False)
# A rank outside a set that calls into it.
if not first.included():
    expect_error("outside", ValueError, ["rank 0 is not a member of process set 2",
                                         f"{', '.join(map(str, range(1, size)))})"],
                 lambda: hvd.allreduce(np.ones(2), name="outside", process_set=first))
    expect_error("outside barrier", ValueError, ["not a member"],
                 lambda: hvd.barrier(process_set=first))
else:
    expect_error("root outside", ValueError, ["root rank 0 is not a member of process set 2"],
                 lambda: hvd.broadcast(np.ones(2), 0, process_set=first))
    close("inside", hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=first),
          np.full(2, size - 1.0))
# Removing a set while one of its ops is in flight: the op fails, naming the set.
held = None
if first.included():
    ranks_first = first.ranks
    if first.rank() == 0 and first.size() > 1:  # (a set of one would run it at once)
        held = hvd.allreduce_async(np.ones(2), name="held", process_set=first)
    check("removed", hvd.remove_process_set(first) is True)
    check("invalidated", first.process_set_id is None)
    if held is not None:
        expect_error("in flight", ValueError, ["process set 2", "was removed", "'held'"],
                     lambda: hvd.synchronize(held))
    expect_error("after removal", ValueError, ["not registered"],
                 lambda: hvd.allreduce(np.ones(2), process_set=first))
else:
    check("removed", hvd.remove_process_set(first) is True)
table = process_sets.process_set_ids_and_ranks()
check("table after removal", table == {0: list(range(size)), 1: [0]}, str(table))
# The id is reused, and the job goes on: a set added again works.
again = hvd.add_process_set([0, size - 1] if size > 2 else [1])
check("id reused", again.process_set_id == 2, str(again))
if again.included():
    close("again", hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum, process_set=again),
          np.full(3, float(sum(r + 1 for r in again.ranks))))
# A mismatch inside a set names the set and the global ranks.
if size > 2 and again.included():
    shape = (2,) if rank == 0 else (3,)
    expect_error("mismatch", errors.MismatchError,
                 ["Mismatched shapes", f"process set 2 (ranks 0, {size - 1})",
                  "rank 0 had shape [2]", f"rank {size - 1} had shape [3]"],
                 lambda: hvd.allreduce(np.ones(shape), name="mm", process_set=again))
    close("after mismatch", hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=again),
          np.full(2, 2.0))
hvd.remove_process_set(again)
# Ranks that disagree on a change all learn it, naming the ranks; nothing changes.
if size > 2:
    ranks_given = [1] if rank == 0 else [0, 1]
    expect_error("change mismatch", errors.MismatchError,
                 ["add_process_set", "rank 0 had ranks [1]"],
                 lambda: hvd.add_process_set(ranks_given))
elif rank == 0:
    expect_error("change mismatch", errors.MismatchError,
                 ["rank 0 had add_process_set", "rank 1 had remove_process_set"],
                 lambda: hvd.add_process_set([1]))
else:
    expect_error("change mismatch", errors.MismatchError,
                 ["rank 0 had add_process_set", "rank 1 had remove_process_set"],
                 lambda: hvd.remove_process_set(process_sets.process_set_by_id(1)))
table = process_sets.process_set_ids_and_ranks()
check("table unchanged", table == {0: list(range(size)), 1: [0]}, str(table))
close("global after all", hvd.allreduce(np.array([1.0]), op=hvd.Sum), [float(size)])
report()
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_add_remove_at_run_time_and_errors(np_):
    result = run_job(np_, CHANGES, timeout=JOB_TIMEOUT)
    _assert_checks(result, np_, least=12)


# DistributedOptimizer in a set equals one process on the members' concatenated batch;
# broadcast_parameters / broadcast_optimizer_state / broadcast_object / allgather_object
# with a set reach its members only (the rank outside keeps its own values).
TORCH = PRELUDE + r'''
import torch
import hvdlite.torch as hvd
torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
members = list(range(1, size))  # [1] at 2 ranks: a set of one
ps = hvd.add_process_set(members)
B, STEPS = 4, 6


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def batch(r, step):
    g = torch.Generator().manual_seed(1000 * r + step)
    return torch.randn(B, 5, generator=g), torch.randn(B, 2, generator=g)


net = model(seed=rank)  # different on every rank until the broadcast
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
if ps.included():
    root = members[-1]
    # A step before the broadcast gives the root momentum state to send.
    x, y = batch(rank, 99)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()
    hvd.broadcast_parameters(net.state_dict(), root_rank=root, process_set=ps)
    hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=ps)
    got = [p.detach().clone() for p in net.parameters()]
    everyone = hvd.allgather_object([p.tolist() for p in got], process_set=ps)
    check("parameters equal in the set", all(e == everyone[0] for e in everyone))
    momenta = hvd.allgather_object([opt.state[p]["momentum_buffer"].tolist()
                                    for p in net.parameters()], process_set=ps)
    check("optimizer state equal in the set", all(m == momenta[0] for m in momenta))
    start = {k: v.clone() for k, v in net.state_dict().items()}
    start_opt = copy.deepcopy(opt.state_dict())  # equal in the set, as checked above
    dist = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                    process_set=ps)
    for step in range(STEPS):
        x, y = batch(rank, step)
        dist.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        dist.step()
    # One process on the members' whole batch, from the same start.
    ref = model(seed=0)
    ref.load_state_dict(start)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(start_opt)
    for step in range(STEPS):
        xs, ys = zip(*(batch(r, step) for r in members))
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(net.parameters(), ref.parameters()))
    check("trains like one process on the members' batch", diff < 2e-5, f"max diff {diff}")
else:
    before = [p.detach().clone() for p in net.parameters()]
    expect_error("outside optimizer", ValueError, ["not a member of process set"],
                 lambda: hvd.broadcast_parameters(net.state_dict(), root_rank=members[0],
                                                  process_set=ps))
    check("outside keeps its parameters",
          all(torch.equal(a, b) for a, b in zip(before, net.parameters())))
# The whole job still agrees through the global set.
total = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum)
close("global", total.numpy(), [size * (size - 1) / 2])
report()
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_optimizer_and_broadcasts_in_a_set(np_):
    needs.import_or_skip("torch")
    result = run_job(np_, TORCH, timeout=JOB_TIMEOUT)
    _assert_checks(result, np_, least=2)


TENSORFLOW = PRELUDE + r'''
import tensorflow as tf
import hvdlite.tensorflow as hvd
hvd.init()
rank, size = hvd.rank(), hvd.size()
members = list(range(1, size))
ps = hvd.add_process_set(members)
# As Horovod's process-set suites read the table.
table = hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
check("mpi_ops._basics table", table == {0: list(range(size)), ps.process_set_id: members},
      str(table))
if ps.included():
    n = len(members)
    x = tf.constant(data(rank, (2, 3)))
    want = sum(data(r, (2, 3)) for r in members)
    close("eager sum", hvd.allreduce(x, op=hvd.Sum, process_set=ps).numpy(), want)
    close("in tf.function", tf.function(
        lambda t: hvd.allreduce(t, process_set=ps))(x).numpy(), want / n)
    close("allgather", hvd.allgather(tf.constant(data(rank, (rank, 2))), process_set=ps).numpy(),
          np.concatenate([data(r, (r, 2)) for r in members]))
    close("broadcast", hvd.broadcast(x, members[-1], process_set=ps).numpy(),
          data(members[-1], (2, 3)))
    me = members.index(rank)
    got = hvd.alltoall(tf.constant(data(rank, (n, 2))), process_set=ps)
    close("alltoall", got.numpy(),
          np.concatenate([data(r, (n, 2))[me:me + 1] for r in members]))
    # Uneven splits, one per member: member 0 gets 2 rows from everyone.
    splits = [2] + [1] * (n - 1)
    got, recv = hvd.alltoall(tf.constant(data(rank, (n + 1, 2))), splits=splits,
                             process_set=ps)
    start = sum(splits[:me])
    close("alltoall splits", got.numpy(),
          np.concatenate([data(r, (n + 1, 2))[start:start + splits[me]] for r in members]))
    close("alltoall received splits", recv.numpy(), [splits[me]] * n)
    ga, gb = hvd.grouped_allgather([tf.constant(data(rank, (1, 2))),
                                    tf.constant(data(rank, (2,)))], process_set=ps)
    close("grouped_allgather", ga.numpy(), np.concatenate([data(r, (1, 2)) for r in members]))
    close("grouped_allgather 1", gb.numpy(), np.concatenate([data(r, (2,)) for r in members]))
    (rs,) = hvd.grouped_reducescatter([tf.constant(data(rank, (n, 2)))], op=hvd.Sum,
                                      process_set=ps)
    close("grouped_reducescatter", rs.numpy(), sum(data(r, (n, 2)) for r in members)[me:me + 1])
    # IndexedSlices: values and indices gathered from the members, Average over n.
    sl = hvd.allreduce(tf.IndexedSlices(tf.constant(data(rank, (1, 2))), tf.constant([rank]),
                                        tf.constant([size, 2])), process_set=ps)
    close("sparse values", sl.values.numpy(),
          np.concatenate([data(r, (1, 2)) for r in members]) / n)
    close("sparse indices", sl.indices.numpy(), members)
    # Gradients in the set: allgather's is the members' average, then this rank's rows;
    # reducescatter(Sum)'s the gathered gradient times the set's size.
    x = tf.constant(data(rank, (rank, 2)))
    with tf.GradientTape() as t:
        t.watch(x)
        loss = tf.reduce_sum(hvd.allgather(x, process_set=ps) * float(rank + 1))
    close("allgather grad", t.gradient(loss, x).numpy(),
          np.full((rank, 2), sum(r + 1 for r in members) / n))
    x = tf.constant(data(rank, (n, 2)))
    with tf.GradientTape() as t:
        t.watch(x)
        loss = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, process_set=ps)
                             * float(rank + 1))
    close("reducescatter grad", t.gradient(loss, x).numpy(),
          np.repeat(np.array([[(r + 1.0) * n] for r in members]), 2, axis=1))
    close("size_op", hvd.size_op(ps.process_set_id).numpy(), n)
    close("process_set_included_op", hvd.process_set_included_op(ps.process_set_id).numpy(), 1)
    close("reducescatter", hvd.reducescatter(tf.constant(data(rank, (n, 2))), op=hvd.Sum,
                                             process_set=ps).numpy(),
          sum(data(r, (n, 2)) for r in members)[members.index(rank):members.index(rank) + 1])
    # DistributedGradientTape in the set: the members' average gradient.
    w = tf.Variable(tf.constant(data(rank, (3,))))
    hvd.broadcast_variables([w], root_rank=members[0], process_set=ps)
    close("broadcast_variables", w.numpy(), data(members[0], (3,)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(rank + 1))
    tape = hvd.DistributedGradientTape(tape, process_set=ps)
    (g,) = tape.gradient(loss, [w])
    close("tape", g.numpy(), np.full(3, sum(r + 1 for r in members) / n))
    hvd.barrier(process_set=ps)
else:
    expect_error("outside", ValueError, ["not a member of process set"],
                 lambda: hvd.allreduce(tf.ones(2), process_set=ps))
    close("not included", hvd.process_set_included_op(ps.process_set_id).numpy(), 0)
close("global", hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy(), [float(size)])
report()
'''


# Run in harness.shared_checks's job of tf_scripts/ (TensorFlow imported once for them).
share_script("tf_scripts", (2, 3), "process_sets.py", TENSORFLOW + "hvd.shutdown()\n")


@pytest.mark.parametrize("np_", [2, 3])
def test_tensorflow_ops_in_a_set(np_):
    needs.import_or_skip("tensorflow")
    _assert_outcomes(*shared_checks("tf_scripts", np_, "process_sets.py"), least=2)


# Sets from mpi4py communicators, each rank passing the one it is in (Horovod's
# init(process_sets=[ProcessSet(comm)])): every distinct set is registered on every rank.
FROM_COMMS = PRELUDE + r'''
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
sub = MPI.COMM_WORLD.Split(rank % 2, rank)
mine = hvd.ProcessSet(sub)
hvd.init(process_sets=[mine])
size = hvd.size()
from hvdlite import process_sets
table = process_sets.process_set_ids_and_ranks()
evens = [r for r in range(size) if r % 2 == 0]
odds = [r for r in range(size) if r % 2 == 1]
check("both sets registered everywhere", sorted(table.values()) ==
      sorted([list(range(size)), evens, odds]), str(table))
check("mine has its ranks", mine.ranks == (evens if rank % 2 == 0 else odds), str(mine))
close("allreduce in mine", hvd.allreduce(np.array([rank + 1.0]), op=hvd.Sum, process_set=mine),
      [float(sum(r + 1 for r in mine.ranks))])
report()
'''


def test_sets_from_mpi4py_communicators():
    needs.import_or_skip("mpi4py")
    result = run_job(3, FROM_COMMS, timeout=JOB_TIMEOUT)
    _assert_checks(result, 3, least=3)


# A member that never submits: the set's own coordinator reports the stall, naming the
# set and the missing global rank; the rest of the job goes on.
STALL = PRELUDE + r'''
hvd.init()
rank, size = hvd.rank(), hvd.size()
tail = hvd.add_process_set(range(1, size))
if rank == 1:
    expect_error("stall", errors.StalledError,
                 [f"'lonely' in process set {tail.process_set_id}",
                  f"rank {size - 1} did not submit"],
                 lambda: hvd.allreduce(np.ones(2), name="lonely", process_set=tail))
    open(os.path.join(sys.argv[1], "stalled"), "w").close()
else:  # (the global op below would stall on rank 1 meanwhile)
    while not os.path.exists(os.path.join(sys.argv[1], "stalled")):
        time.sleep(0.01)
close("global after", hvd.allreduce(np.array([1.0]), op=hvd.Sum), [float(size)])
report()
'''


def test_a_stall_in_a_set_names_the_set_and_the_missing_rank(tmp_path):
    result = run_job(3, STALL, timeout=JOB_TIMEOUT, args=[str(tmp_path)], env={
        "HVDLITE_STALL_CHECK_TIME": "1", "HVDLITE_STALL_SHUTDOWN_TIME": "2"})
    _assert_checks(result, 3, least=1)


SINGLE_RANK = PRELUDE + r'''
import torch
import hvdlite.torch as hvd
torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
# Horovod's split: even and odd ranks (sets of one rank at 2 ranks, and {1} at 3),
# plus one set per rank.
even = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
odd = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
singles = [hvd.add_process_set([r]) for r in range(size)]
mine, mine_members = singles[rank], [rank]
members = list(range(rank % 2, size, 2))
this = even if rank % 2 == 0 else odd


def sparse(r, rows, salt):
    """Rank r's sparse tensor: some rows zero, the others data()."""
    dense = torch.from_numpy(data(r, (rows, 3), salt))
    dense[(torch.arange(rows) + r + salt) % 3 == 0] = 0
    return dense.to_sparse()


# Sparse Average in a set equals the dense Average in the same set, and the members'
# mean computed here from their data (one-rank sets: the tensor itself).
for label, ps, ranks in (("own set", mine, mine_members), ("even/odd", this, members)):
    tensors = [sparse(rank, rows, i) for i, rows in enumerate((5, 8, 3))]
    dense = [hvd.allreduce(t.to_dense(), op=hvd.Average, process_set=ps) for t in tensors]
    handles = [hvd.sparse_allreduce_async(t, op=hvd.Average, name=f"sp.{label}.{i}",
                                          process_set=ps) for i, t in enumerate(tensors)]
    for i, (h, d) in enumerate(zip(handles, dense)):
        got = h().to_dense()
        want = sum(sparse(r, d.shape[0], i).to_dense() for r in ranks) / len(ranks)
        close(f"{label} sparse average {i} vs dense", got.numpy(), d.numpy())
        close(f"{label} sparse average {i} vs members' mean", got.numpy(), want.numpy())
    close(f"{label} sum", hvd.allreduce(torch.from_numpy(data(rank, (4,))), op=hvd.Sum,
                                        process_set=ps).numpy(),
          sum(data(r, (4,)) for r in ranks))


# DistributedOptimizer in a set: as Horovod's test, every rank wraps its optimizer with
# the even set; members step on the members' average gradient, the others on their own
# gradient (no hooks, no collectives). Then again with each rank's own one-rank set.
def model_and_batch(r):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    g = torch.Generator().manual_seed(100 + r)
    return model, torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def local_grads(r):
    model, x, y = model_and_batch(r)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def expected_after_step(ranks):
    model, _, _ = model_and_batch(rank)
    grads = [local_grads(r) for r in ranks]
    with torch.no_grad():
        return [(p - 0.1 * sum(g[i] for g in grads) / len(grads)).numpy()
                for i, p in enumerate(model.parameters())]


evens = list(range(0, size, 2))
for label, ps, ranks in (("even set", even, evens if rank in evens else [rank]),
                         ("own set", mine, [rank])):
    model, x, y = model_and_batch(rank)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=ps)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    for i, (p, want) in enumerate(zip(model.parameters(), expected_after_step(ranks))):
        close(f"{label} optimizer param {i}", p.detach().numpy(), want)
    # The members agree on the result.
    if ps.included():
        gathered = hvd.allgather(list(model.parameters())[-1].detach().reshape(1, -1),
                                 process_set=ps)
        close(f"{label} members agree", gathered.numpy(),
              np.repeat(gathered[:1].numpy(), gathered.shape[0], axis=0))
for ps in singles + [odd, even]:
    hvd.remove_process_set(ps)
close("global after", hvd.allreduce(torch.ones(1), op=hvd.Sum).numpy(), [float(size)])
report()
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_single_rank_sets_optimizer_and_sparse_average(np_):
    needs.import_or_skip("torch")
    result = run_job(np_, SINGLE_RANK, timeout=JOB_TIMEOUT)
    _assert_checks(result, np_, least=10)
