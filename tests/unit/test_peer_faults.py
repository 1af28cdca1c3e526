"""The lost-peer notice reaches the core: ``peer_faults.when_lost`` callbacks (the core's
``hvdlite_note_lost_peers``, which ends a blocking call's own cycle waiting inside MPI
for a peer that is gone; tests/cluster/test_cluster_faults.py shows that end to end)."""
import threading
import time

import pytest

from hvdlite import errors, peer_faults


@pytest.fixture
def fresh(monkeypatch):
    """A process that has heard no notice yet."""
    monkeypatch.setattr(peer_faults, "_failure", None)
    monkeypatch.setattr(peer_faults, "_on_lost", [])
    monkeypatch.setattr(peer_faults, "_noticed", threading.Event())
    monkeypatch.setattr(peer_faults, "_started", False)
    monkeypatch.setattr(peer_faults, "_cause_wait_spent", False)


def test_callbacks_hear_the_first_notice_once(fresh):
    heard = []
    peer_faults.when_lost(lambda: heard.append("a"))
    peer_faults.when_lost(lambda: heard.append("b"))
    assert heard == [] and peer_faults.failure() is None
    peer_faults.record({"ranks": [3], "hosts": ["h2"], "reason": "was killed"})
    assert heard == ["a", "b"]
    peer_faults.record({"ranks": [1], "hosts": ["h1"], "reason": "was killed"})
    assert heard == ["a", "b"]  # the first notice wins, and is told once
    assert isinstance(peer_faults.failure(), errors.RankFailedError)
    assert "rank 3 on host h2" in str(peer_faults.failure())


def test_a_callback_registered_after_the_notice_is_called_at_once(fresh):
    peer_faults.record({"ranks": [2], "reason": "no word from them"})
    heard = []
    peer_faults.when_lost(lambda: heard.append(True))
    assert heard == [True]


def test_await_notice_returns_once_the_notice_comes(fresh, monkeypatch):
    # Outside hvdliterun (no fault pipe read) nothing will come: no wait at all.
    start = time.monotonic()
    assert peer_faults.await_notice(5.0) is None
    assert time.monotonic() - start < 1.0
    monkeypatch.setattr(peer_faults, "_started", True)
    assert peer_faults.await_notice(0.2) is None  # a notice that never comes: the bound
    later = threading.Timer(0.3, peer_faults.record, [{"ranks": [2], "reason": "was killed"}])
    later.start()
    try:
        start = time.monotonic()
        failure = peer_faults.await_notice(30.0)
        assert time.monotonic() - start < 10.0
    finally:
        later.cancel()
        later.join()
    assert isinstance(failure, errors.RankFailedError) and "rank 2" in str(failure)


def test_an_op_failed_on_a_peer_the_core_saw_end_is_recorded(fresh, monkeypatch, native):
    # core.shutdown() then awaits the launcher's notice (test_rank_death.py shows why).
    from hvdlite import _native

    monkeypatch.setattr(peer_faults, "_core_saw_loss", False)
    codes = {_native.status_name(code): code for code in range(1, 64)}
    _native.error_for(codes["HVDLITE_ERR_MISMATCH"], "shapes differ")
    assert not peer_faults.core_saw_loss()
    error = _native.error_for(codes["HVDLITE_ERR_RANK_FAILED"], "rank 2 ended")
    assert isinstance(error, errors.RankFailedError) and peer_faults.core_saw_loss()


def test_a_peer_seen_ending_is_named_by_the_notice_that_follows(fresh, monkeypatch, native):
    # A peer on this host that heard of a host cut off first ends; the core then sees it
    # end. The launcher's notice, a moment later here, names the loss that started it.
    from hvdlite import _native

    codes = {_native.status_name(code): code for code in range(1, 64)}
    seen = "rank 1 on host h1 (pid 7) ended during a shared-memory collective"
    alone = _native.error_for(codes["HVDLITE_ERR_RANK_FAILED"], seen)
    assert alone.message == seen  # outside hvdliterun: no notice to wait for
    monkeypatch.setattr(peer_faults, "_started", True)
    later = threading.Timer(0.3, peer_faults.record,
                            [{"ranks": [2, 3], "hosts": ["h2"], "reason": "no word from them"}])
    later.start()
    try:
        error = _native.error_for(codes["HVDLITE_ERR_RANK_FAILED"], seen)
    finally:
        later.cancel()
        later.join()
    assert type(error) is type(alone) and error.status_name == "HVDLITE_ERR_RANK_FAILED"
    assert error.message.startswith("lost ranks 2, 3 on host h2: no word from them"), error
    assert error.message.endswith(f"(this rank: {seen})"), error
    # An error that already carries the notice keeps its words.
    told = f"{peer_faults.failure().message}; no cycle can run again"
    assert _native.error_for(codes["HVDLITE_ERR_RANK_FAILED"], told).message == told


def test_a_notice_that_never_comes_costs_the_bound_once(fresh, monkeypatch):
    monkeypatch.setattr(peer_faults, "_started", True)
    error = errors.RankFailedError("rank 1 ended")
    start = time.monotonic()
    assert peer_faults.first_cause(error, timeout=0.2) is error
    assert 0.15 < time.monotonic() - start < 5.0
    # Once: a group's other failed ops (each ends in an error) and later calls do not
    # wait again.
    start = time.monotonic()
    for _ in range(20):
        assert peer_faults.first_cause(error, timeout=0.2) is error
    assert time.monotonic() - start < 0.15
