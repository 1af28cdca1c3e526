"""init/shutdown, rank queries, configuration and the loader, each in a fresh process.

A fresh interpreter per case because init and shutdown change process-wide state (MPI
is initialized at most once per process).
"""
import json
import os

import pytest

from hvdlite import build_record

pytestmark = pytest.mark.timeout(180)


def test_import_without_the_library(run_py, tmp_path):
    # A broken install must still import (the launcher's --check-build needs it) and
    # fail with the cause on first use.
    missing = str(tmp_path / "nowhere" / "libhvdlite.so")
    run_py(f"""
        import sys
        import hvdlite
        assert "hvdlite._native" not in sys.modules
        assert "init" in dir(hvdlite) and hvdlite.__version__
        try:
            hvdlite.init
        except ImportError as e:
            assert {missing!r} in str(e), str(e)
        else:
            raise AssertionError("no ImportError for a missing library")
        try:
            hvdlite.no_such_name
        except AttributeError:
            pass
    """, env={"HVDLITE_LIBRARY": missing})


def test_bad_mpi_lib_override(native, run_py, tmp_path):
    bogus = tmp_path / "libmpi.so.12"
    bogus.write_text("not an ELF file")
    run_py("""
        import hvdlite
        try:
            hvdlite.size
        except ImportError as e:
            assert "HVDLITE_MPI_LIB" in str(e), str(e)
        else:
            raise AssertionError("a bogus HVDLITE_MPI_LIB was accepted")
    """, env={"HVDLITE_MPI_LIB": str(bogus)})


def test_before_init_raises(native, run_py):
    run_py("""
        import numpy as np
        import hvdlite as hvd
        assert hvd.is_initialized() is False
        for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank,
                     hvd.cross_size, hvd.barrier,
                     lambda: hvd.allreduce(np.ones(3, np.float32), name="x"),
                     lambda: hvd.allgather(np.ones(3, np.float32)),
                     lambda: hvd.broadcast(np.ones(3, np.float32), 0)):
            try:
                call()
            except hvd.errors.NotInitializedError as e:
                assert "init" in str(e), str(e)
            else:
                raise AssertionError(f"{call} did not raise before init")
    """)


def test_init_queries_shutdown(native, run_py):
    out = run_py("""
        import json, logging
        import numpy as np
        import hvdlite as hvd
        logging.basicConfig(level=logging.WARNING)
        hvd.init()
        hvd.init()  # a second init warns and returns
        assert hvd.is_initialized()
        info = dict(size=hvd.size(), rank=hvd.rank(), local_size=hvd.local_size(),
                    local_rank=hvd.local_rank(), cross_size=hvd.cross_size(),
                    cross_rank=hvd.cross_rank(), threads=hvd.mpi_threads_supported())
        hvd.allreduce(np.ones(3, np.float32), name="x")
        info["stats"] = hvd.stats()
        hvd.shutdown()
        hvd.shutdown()  # idempotent
        assert not hvd.is_initialized()
        for call in (hvd.size, hvd.rank,
                     lambda: hvd.allreduce(np.ones(3, np.float32), name="y")):
            try:
                call()
            except hvd.errors.NotInitializedError:
                pass
            else:
                raise AssertionError("call after shutdown did not raise")
        print("RESULT " + json.dumps(info))
    """)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
    info = json.loads(line[len("RESULT "):])
    assert (info["size"], info["rank"], info["local_size"], info["local_rank"],
            info["cross_size"], info["cross_rank"]) == (1, 0, 1, 0, 1, 0)
    assert isinstance(info["threads"], bool)
    stats = info["stats"]
    assert set(stats) == {"cycles", "coordinator_gathers", "cache_hits", "cache_misses",
                          "collectives", "fused_collectives", "shm_collectives", "tensors",
                          "bytes", "errors", "wire_bytes", "hierarchical_collectives",
                          "nccl_collectives", "staged_collectives", "nccl_us",
                          "waiting_threads", "caller_cycles", "carried_collectives"}
    assert stats["tensors"] >= 1 and stats["cycles"] >= 1
    assert "already initialized" in out.stderr


def test_init_with_mpi4py_comm(native, run_py):
    run_py("""
        from mpi4py import MPI
        import numpy as np
        import hvdlite as hvd
        assert MPI.Is_initialized()
        hvd.init(comm=MPI.COMM_WORLD)
        assert (hvd.size(), hvd.rank()) == (MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank())
        assert hvd.allreduce(np.arange(4.0), name="x", op=hvd.Sum).tolist() == [0, 1, 2, 3]
        hvd.shutdown()
        # The core did not initialize MPI, so it must leave it usable.
        assert not MPI.Is_finalized()
        assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()
    """)


def test_init_rejects_a_non_communicator(native, run_py):
    run_py("""
        import hvdlite as hvd
        try:
            hvd.init(comm=[0, 1])
        except TypeError as e:
            assert "mpi4py" in str(e)
        else:
            raise AssertionError("init accepted a list")
        assert not hvd.is_initialized()
    """)


@pytest.mark.parametrize("variable,value", [
    ("HVDLITE_FUSION_THRESHOLD", "lots"),
    ("HVDLITE_CYCLE_TIME", "-3"),
    ("HVDLITE_CACHE_CAPACITY", "1.5e"),
    ("HVDLITE_STALL_CHECK_TIME", "soon"),
])
def test_bad_config_is_refused_at_init(native, run_py, variable, value):
    run_py(f"""
        import hvdlite as hvd
        try:
            hvd.init()
        except hvd.errors.InvalidArgumentError as e:
            assert {variable!r} in str(e), str(e)
        else:
            raise AssertionError("init accepted {variable}={value}")
    """, env={variable: value})


@pytest.mark.parametrize("env", [
    {"HVDLITE_FUSION_THRESHOLD": "0"},
    {"HVDLITE_CACHE_CAPACITY": "0"},
    {"HVDLITE_CYCLE_TIME": "0.5", "HVDLITE_FUSION_THRESHOLD": "1024"},
], ids=lambda env: ",".join(f"{k}={v}" for k, v in env.items()))
def test_good_config_works(native, run_py, env):
    run_py("""
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        for step in range(3):
            hs = [hvd.allreduce_async(np.full(100, i, np.float32), name=f"t{i}", op=hvd.Sum)
                  for i in range(20)]
            for i, h in enumerate(hs):
                assert (hvd.synchronize(h) == i).all()
        hvd.shutdown()
    """, env=env)


def test_timeline(native, run_py, tmp_path):
    path = tmp_path / "timeline.json"
    run_py(f"""
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        hvd.start_timeline({str(path)!r}, mark_cycles=True)
        for i in range(5):
            hvd.allreduce(np.ones(10, np.float32), name="tl")
        hvd.stop_timeline()
        hvd.shutdown()
    """)
    text = path.read_text()
    assert text.lstrip().startswith("[") and "tl" in text


def test_pending_handle_fails_at_shutdown_or_completes(native, run_py):
    # Shutdown ends every handle: done, or failed with ShutdownError. Never a hang.
    run_py("""
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        hs = [hvd.allreduce_async(np.ones(1000, np.float32), name=f"p{i}") for i in range(50)]
        hvd.shutdown()
        for h in hs:
            try:
                hvd.synchronize(h, timeout=30)
            except (hvd.errors.ShutdownError, hvd.errors.NotInitializedError):
                pass
    """, timeout=90)


def test_duplicate_name_in_flight(native, run_py):
    # A long cycle time keeps the first op in flight while the second is enqueued.
    out = run_py("""
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        x = np.ones(4, np.float32)
        provoked = False
        for attempt in range(20):
            h = hvd.allreduce_async(x, name="dup")
            try:
                h2 = hvd.allreduce_async(x, name="dup")
            except hvd.errors.DuplicateNameError as e:
                assert "dup" in str(e), str(e)
                provoked = True
            else:
                hvd.synchronize(h2)
            hvd.synchronize(h)
            if provoked:
                break
        print("PROVOKED" if provoked else "NOT-PROVOKED")
        # The name is free again once the op ended.
        hvd.allreduce(x, name="dup")
        hvd.shutdown()
    """, env={"HVDLITE_CYCLE_TIME": "200"})
    if "NOT-PROVOKED" in out.stdout:
        pytest.skip("could not keep an op in flight long enough in one process")


def test_atexit_shutdown_without_explicit_call(native, run_py):
    run_py("""
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        hvd.allreduce_async(np.ones(3, np.float32), name="left.pending")
    """, timeout=60)


def test_waits_from_threads(native, run_py):
    # Waits from a non-main thread block without slicing; the op result is delivered.
    run_py("""
        import threading
        import numpy as np
        import hvdlite as hvd
        hvd.init()
        results = []
        def worker(i):
            results.append(hvd.allreduce(np.full(8, i, np.int64), name=f"th{i}", op=hvd.Sum))
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads: t.start()
        for t in threads: t.join(60)
        assert sorted(int(r[0]) for r in results) == [0, 1, 2, 3]
        hvd.shutdown()
    """)


def test_init_refuses_a_world_of_one_that_srun_started_as_four(native, run_py):
    # What srun without --mpi=pmi2 gives each of 4 tasks: Slurm's count, no PMI.
    run_py("""
        import hvdlite
        try:
            hvdlite.init()
        except hvdlite.errors.HvdliteError as e:
            assert "SLURM_STEP_NUM_TASKS=4" in str(e) and "--mpi=pmi2" in str(e), str(e)
        else:
            raise AssertionError("init() accepted a world of one")
        assert not hvdlite.is_initialized()
    """, env={"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"})


def test_a_script_run_without_a_launcher_leaves_no_mpi_shared_memory(native, run_py):
    # An MPI singleton: Open MPI 5 leaves its sm segment (16 MiB) in /dev/shm after
    # MPI_Finalize, with no launcher daemon to remove it; the core does at exit. The
    # segments are those the process mapped.
    out = run_py("""
        import json
        import numpy as np
        import hvdlite as hvd
        from hvdlite.runner.rank_wrapper import MPI_SEGMENT_PREFIXES, SHM_DIR
        hvd.init()
        hvd.allreduce(np.ones(4, np.float32), name="x")
        prefixes = tuple(f"{SHM_DIR}/{p}" for p in MPI_SEGMENT_PREFIXES)
        print(json.dumps(sorted({line.split()[-1] for line in open("/proc/self/maps")
                                 if line.split()[-1].startswith(prefixes)})))
        hvd.shutdown()
    """, env={var: None for var in os.environ if var.startswith(("OMPI_", "PMI", "HYDRA_", "PMIX_"))
              and var not in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")})
    segments = json.loads(out.stdout.strip().splitlines()[-1])
    if build_record.read_if_readable().get("mpi_implementation") == "Open MPI":
        assert segments, "an Open MPI singleton mapped no sm segment in /dev/shm"
    left = [s for s in segments if os.path.exists(s)]
    assert not left, f"MPI shared memory left in /dev/shm after the process ended: {left}"
