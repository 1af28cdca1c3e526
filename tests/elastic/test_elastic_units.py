"""The elastic pieces that need no job: flags, the slot book, the commit store, the
sampler's re-split, the states' round trips and the Keras callbacks."""
import os
import time

import numpy as np
import pytest

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
    torch = pytest.importorskip("torch")  # noqa: F841
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
    pytest.importorskip("torch")
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
