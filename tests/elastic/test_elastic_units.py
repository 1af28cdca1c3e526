"""The elastic pieces that need no job: flags, the slot book, the commit store, the
sampler's re-split, the states' round trips and the Keras callbacks."""
import os
import time

import numpy as np
import pytest

import needs

from hvdlite.elastic.store import CommitStore
from hvdlite.runner import elastic_driver, launch
from hvdlite.runner.hosts import HostSlots

pytestmark = pytest.mark.timeout(60)


def _config(*argv):
    return launch.parse_command_line([*argv, "python", "train.py"])


def test_elastic_flags_make_an_elastic_config():
    config = _config("-np", "3", "--min-np", "2", "--max-np", "4", "--reset-limit", "5",
                     "--elastic-timeout", "30", "--blacklist-cooldown-range", "1", "2")
    assert config.num_ranks == 3
    settings = config.elastic
    assert (settings.min_np, settings.max_np, settings.reset_limit) == (2, 4, 5)
    assert settings.elastic_timeout == 30 and settings.cooldown_range == (1.0, 2.0)
    assert _config("-np", "2").elastic is None


@pytest.mark.parametrize("argv, message", [
    (["-np", "5", "--min-np", "2", "--max-np", "4"], "-np 5 is outside --min-np 2 .. --max-np 4"),
    (["-np", "2", "--min-np", "3"], "--max-np 2 is less than --min-np 3"),
    (["--min-np", "2"], "elastic mode needs -np"),
    (["-np", "2", "--min-np", "1", "--elastic-timeout", "0"], "--elastic-timeout must be > 0"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "5", "1"],
     "--blacklist-cooldown-range needs 0 <= MIN <= MAX"),
    (["-np", "2", "-H", "a:2", "--host-discovery-script", "x"], "exclude each other"),
])
def test_bad_elastic_flags_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _config(*argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_slot_book_drops_a_failed_slot_and_a_lost_host_until_the_cooldown_ends():
    book = elastic_driver.SlotBook(cooldown_range=(0.3, 0.3))
    book.set_hosts([HostSlots("a", 2), HostSlots("b", 2)])
    book.drop_slot("a")
    book.lose_host("b")
    assert book.usable() == [HostSlots("a", 1)]
    assert book.pending_return()
    time.sleep(0.4)
    assert book.usable() == [HostSlots("a", 2), HostSlots("b", 2)]
    forever = elastic_driver.SlotBook(cooldown_range=None)
    forever.set_hosts([HostSlots("a", 1)])
    forever.drop_slot("a")
    assert forever.usable() == [] and not forever.pending_return()


def test_plan_takes_slots_host_by_host():
    hosts = [HostSlots("a", 2), HostSlots("b", 3)]
    assert elastic_driver.plan_world(hosts, 4) == [HostSlots("a", 2), HostSlots("b", 2)]
    assert elastic_driver.plan_world(hosts, 1) == [HostSlots("a", 1)]


def test_discovery_output_is_parsed_and_a_failing_script_named(tmp_path):
    good = tmp_path / "good.sh"
    good.write_text("#!/bin/sh\necho 'h1:2'\necho '# comment'\necho h2\n")
    good.chmod(0o755)
    assert elastic_driver.discover_hosts(str(good)) == [HostSlots("h1", 2), HostSlots("h2", 1)]
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\necho nope >&2\nexit 3\n")
    bad.chmod(0o755)
    with pytest.raises(RuntimeError, match="bad.sh.*exited with code 3: nope"):
        elastic_driver.discover_hosts(str(bad))


def test_store_keeps_the_newest_commit_and_survives_a_cut_write(tmp_path):
    a = CommitStore(str(tmp_path), generation=0, rank=0)
    b = CommitStore(str(tmp_path), generation=0, rank=1)
    def writer(data):
        return lambda f: f.write(data)

    a.write(writer(b"one"), 1)
    a.write(writer(b"two"), 2)
    b.write(writer(b"two"), 2)
    (tmp_path / ".tmp-123-c000000000003-g0-r1.state").write_bytes(b"th")  # killed mid-write
    commit_id, path = CommitStore(str(tmp_path), 1, 0).newest()
    assert commit_id == 2 and open(path, "rb").read() == b"two"
    assert a.read_own() == b"two"
    assert len([n for n in os.listdir(tmp_path) if n.startswith("c")]) == 2  # old one gone
    c = CommitStore(str(tmp_path), generation=1, rank=0)
    c.write(writer(b"two"), 3)
    c.drop_older_generations()
    assert sorted(os.listdir(tmp_path)) == ["c000000000003-g1-r0.state"]


def test_sampler_splits_the_rest_of_the_epoch_over_the_new_world(monkeypatch):
    torch = needs.import_or_skip("torch")  # noqa: F841
    from hvdlite.torch import elastic

    world = {"size": 3, "rank": 0}
    monkeypatch.setattr(elastic.runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(elastic.runtime, "size", lambda: world["size"])
    monkeypatch.setattr(elastic.runtime, "rank", lambda: world["rank"])
    done = []
    for rank in range(3):
        world["rank"] = rank
        sampler = elastic.ElasticSampler(range(30), shuffle=True, seed=5)
        done += list(sampler)[:4]       # two batches of 2 on each of 3 ranks
    sampler.record_batch(0, 2)
    sampler.record_batch(1, 2)
    saved = sampler.state_dict()
    assert saved["processed_num"] == 12
    world["size"] = 2
    rest = []
    for rank in range(2):
        world["rank"] = rank
        resumed = elastic.ElasticSampler(range(30), shuffle=True, seed=5)
        resumed.load_state_dict(saved)
        rest += list(resumed)
    assert sorted(done + rest) == list(range(30))


def test_object_state_commits_and_restores_outside_a_job():
    needs.import_or_skip("torch")
    from hvdlite import runtime
    from hvdlite.elastic import ObjectState

    if not runtime.is_initialized():
        runtime.init()
    state = ObjectState(epoch=1, seen=[1, 2])
    state.epoch = 2
    state.commit()
    state.epoch, state.seen = 9, []
    state.restore()
    assert (state.epoch, state.seen) == (2, [1, 2])


# -- Keras and TensorFlow states and callbacks, outside a job ------------------------------

def _keras():
    needs.import_or_skip("tensorflow")
    keras = needs.import_or_skip("keras")
    from hvdlite import runtime

    if not runtime.is_initialized():
        runtime.init()
    return keras


def _values(variables):
    return [v.numpy().tobytes() for v in variables]


def test_keras_state_restores_weights_and_optimizer_slots_bit_for_bit():
    keras = _keras()
    from hvdlite.keras.elastic import KerasState

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse", jit_compile=False)
    state = KerasState(model, epoch=0)
    assert model.optimizer.built  # built by the state: its slots are in every commit
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    y = np.zeros((8, 2), np.float32)
    model.fit(x, y, epochs=2, verbose=0)
    state.epoch = 2
    state.commit()
    committed = _values(model.variables) + _values(model.optimizer.variables)
    model.fit(x, y, epochs=2, verbose=0)
    state.epoch = 9
    assert _values(model.variables) != committed[:len(model.variables)]
    state.restore()
    assert _values(model.variables) + _values(model.optimizer.variables) == committed
    assert state.epoch == 2


def test_tensorflow_state_restores_variables_and_values():
    _keras()
    import tensorflow as tf
    from hvdlite.tensorflow.elastic import TensorFlowState

    variables = [tf.Variable([1.5, 2.5]), tf.Variable(np.arange(6, dtype=np.int64))]
    state = TensorFlowState(variables, step=3)
    variables[0].assign([7.0, 8.0])
    variables[1].assign_add(np.ones(6, np.int64))
    state.step = 4
    state.restore()
    assert variables[0].numpy().tolist() == [1.5, 2.5]
    assert variables[1].numpy().tolist() == list(range(6)) and state.step == 3


def test_a_failed_collective_inside_a_graph_is_recognized_by_its_status():
    _keras()
    import tensorflow as tf
    from hvdlite import errors
    from hvdlite.tensorflow.elastic import internal_error

    lost = tf.errors.UnknownError(None, None, "rank 2 ended [HVDLITE_ERR_RANK_FAILED]\n[[node]]")
    assert isinstance(internal_error(lost), errors.RankFailedError)
    mismatch = tf.errors.UnknownError(None, None, "shapes differ [HVDLITE_ERR_MISMATCH]")
    assert internal_error(mismatch) is None  # the script's own error: no reset
    assert internal_error(tf.errors.UnknownError(None, None, "disk full")) is None


class _CountingState:
    """Stands for an elastic state: records (epoch, batch) at each commit."""

    def __init__(self, epoch, batch):
        self.epoch, self.batch, self.commits = epoch, batch, []

    def commit(self):
        self.commits.append((self.epoch, self.batch))


def test_keras_callbacks_resume_mid_epoch_and_commit_each_batch_once():
    keras = _keras()
    from hvdlite.keras import elastic

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    state = _CountingState(epoch=1, batch=2)  # 2 of epoch 1's 4 batches were done
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.append((state.epoch, state.batch)))
    x, y = np.ones((40, 3), np.float32), np.ones((40, 1), np.float32)
    # Horovod's form: the epochs left, Keras numbering them from 0.
    model.fit(x, y, batch_size=2, steps_per_epoch=4, epochs=3 - state.epoch, verbose=0,
              callbacks=[record, elastic.UpdateEpochStateCallback(state),
                         elastic.UpdateBatchStateCallback(state),
                         elastic.CommitStateCallback(state, batches_per_commit=1)])
    # Epoch 1 resumed at batch 2 and ran its 2 remaining batches; epoch 2 ran whole.
    assert seen == [(1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    # Each batch committed once: an epoch's last batch by the epoch's end.
    assert state.commits == [(1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (3, 0)]
    assert (state.epoch, state.batch) == (3, 0)


@pytest.mark.timeout(150)  # a process of its own: Keras picks its backend at import
def test_keras_state_on_the_torch_backend_restores_bit_for_bit(tmp_path):
    needs.import_or_skip("torch")
    needs.import_or_skip("keras")
    import subprocess
    import sys

    script = tmp_path / "torch_backend.py"
    script.write_text(
        "import keras, numpy as np\n"
        "import hvdlite.keras as hvd\n"
        "hvd.init()\n"
        "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.1)), "
        "loss='mse')\n"
        "state = hvd.elastic.KerasState(model, batch=0)\n"
        "x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)\n"
        "values = lambda: [v.numpy().tobytes() for v in model.variables + "
        "model.optimizer.variables]\n"
        "model.fit(x, y, epochs=2, verbose=0)\n"
        "state.commit()\n"
        "committed = values()\n"
        "model.fit(x, y, epochs=2, verbose=0)\n"
        "assert values() != committed\n"
        "state.restore()\n"
        "assert values() == committed and len(committed) > 4\n"
        "print('restored', keras.backend.backend())\n")
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "restored torch" in proc.stdout, proc.stderr[-3000:]
