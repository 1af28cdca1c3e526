"""sync() keeps what it synchronized (issue 35.6): on 2 and 3 ranks, states built from
values that differ across ranks, then ``sync()``ed, then changed and ``restore()``d, come
back to rank 0's values on every rank (Horovod's TensorFlow states save in ``sync``).
Expected values are rank 0's construction, rebuilt on each rank from its seed.
"""
import pytest

import needs

from harness import describe, share_script, shared_checks

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

PRELUDE = r'''
import json
import numpy as np
failures = []


def check(label, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.array_equal(got, want):
        failures.append(f"{label}: got {got.ravel()[:4].tolist()}, "
                        f"want {want.ravel()[:4].tolist()}")


def values(r, shape, salt=0):
    return np.random.default_rng([r, salt]).standard_normal(shape).astype(np.float32)
'''

TORCH_BODY = PRELUDE + r'''
import torch
import hvdlite.torch as hvd
from hvdlite.elastic import ObjectState
from hvdlite.torch.elastic import TorchState
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


def model_of(r):
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(values(r, (2, 3))))
        m.bias.copy_(torch.from_numpy(values(r, (2,), 1)))
    return m


model = model_of(rank)
opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.5)
state = TorchState(model=model, optimizer=opt, epoch=rank + 10, batch=[rank] * 3)
objects = ObjectState(step=rank * 7, names={"rank": rank})
for label, s in (("torch", state), ("object", objects)):
    s.sync()
want = model_of(0)
for round_ in range(2):  # restore twice: the kept state is not used up
    with torch.no_grad():
        model.weight.add_(1.0)
        model.bias.mul_(3.0)
    opt.param_groups[0]["lr"] = 99.0
    state.epoch, state.batch = -1, []
    objects.step, objects.names = -1, {}
    state.restore()
    objects.restore()
    check(f"torch weight {round_}", model.weight.detach().numpy(), want.weight.detach().numpy())
    check(f"torch bias {round_}", model.bias.detach().numpy(), want.bias.detach().numpy())
    check(f"optimizer lr {round_}", opt.param_groups[0]["lr"], 0.1)
    check(f"torch extra values {round_}", [state.epoch] + state.batch, [10, 0, 0, 0])
    check(f"object values {round_}", [objects.step, objects.names["rank"]], [0, 0])
print("HVDLITE_RESULT " + json.dumps({"failures": failures}), flush=True)
'''

TF_BODY = PRELUDE + r'''
import tensorflow as tf
import keras
import hvdlite.tensorflow as hvd
from hvdlite.tensorflow.elastic import TensorFlowKerasState, TensorFlowState
from common import single_threaded_tensorflow  # tf_scripts/common.py
single_threaded_tensorflow()
hvd.init()
rank = hvd.rank()

variables = [tf.Variable(values(rank, (4,))), tf.Variable(values(rank, (2, 2), 1))]
tf_state = TensorFlowState(variables, step=rank + 5)


def model_of(r):
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.set_weights([values(r, (3, 2), 2), values(r, (2,), 3)])
    return m


model = model_of(rank)
optimizer = keras.optimizers.SGD(learning_rate=0.1)
model.compile(optimizer=optimizer, loss="mse")
model.train_on_batch(values(rank, (4, 3), 4), values(rank, (4, 2), 5))  # optimizer slots
keras_state = TensorFlowKerasState(model, optimizer, epoch=rank + 20)
tf_state.sync()
keras_state.sync()
synced_model = [w.copy() for w in model.get_weights()]
synced_opt = [v.numpy().copy() for v in optimizer.variables]
everyone = hvd.allgather_object([w.tolist() for w in synced_model])
for r, got in enumerate(everyone):
    for i, w in enumerate(got):
        check(f"keras weights synced to rank 0's (rank {r}, {i})", w, everyone[0][i])
for round_ in range(2):
    for v in variables:
        v.assign_add(tf.ones_like(v))
    tf_state.step = -1
    model.set_weights([w + 1 for w in model.get_weights()])
    for v in optimizer.variables:
        if "float" in str(v.dtype):  # (the iteration counter stays)
            v.assign(tf.zeros_like(v) + 7)
    keras_state.epoch = -1
    tf_state.restore()
    keras_state.restore()
    check(f"tf variable 0 {round_}", variables[0].numpy(), values(0, (4,)))
    check(f"tf variable 1 {round_}", variables[1].numpy(), values(0, (2, 2), 1))
    check(f"tf value {round_}", tf_state.step, 5)
    for i, (got, want) in enumerate(zip(model.get_weights(), synced_model)):
        check(f"keras weight {i} {round_}", got, want)
    for i, (got, want) in enumerate(zip(optimizer.variables, synced_opt)):
        check(f"optimizer variable {i} {round_}", got.numpy(), want)
    check(f"keras value {round_}", keras_state.epoch, 20)
print("HVDLITE_RESULT " + json.dumps({"failures": failures}), flush=True)
'''


# Each body runs in harness.shared_checks's job of its framework's scripts (the framework
# imported once for all of them), and leaves hvdlite shut down for the next script there.
share_script("torch_scripts", (2, 3), "elastic_sync.py", TORCH_BODY + "hvd.shutdown()\n")
share_script("tf_scripts", (2, 3), "elastic_sync.py", TF_BODY + "hvd.shutdown()\n")


def _run(folder, np_):
    bodies, job = shared_checks(folder, np_, "elastic_sync.py")
    problems = [f"rank {r}: {f}" for r, body in enumerate(bodies) for f in body["failures"]]
    assert not problems, "\n".join(problems) + "\n" + describe(job)


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_and_object_state_restore_to_what_sync_gave(np_):
    needs.import_or_skip("torch")
    _run("torch_scripts", np_)


@pytest.mark.parametrize("np_", [2, 3])
def test_tensorflow_states_restore_to_what_sync_gave(np_):
    needs.import_or_skip("tensorflow")
    _run("tf_scripts", np_)
