"""The rank wrapper's removal of MPI shared memory that ranks ended without unlinking
(rank_wrapper.remove_orphaned_mpi_segments), on segments made in a folder of this test:
what no process maps goes, what is mapped, too young, older than the job, or not MPI's
stays. The real case, a job whose rank is SIGKILLed, is tests/faults/test_rank_death.py.
"""
import mmap
import os
import time

from hvdlite.runner import rank_wrapper


def _segment(folder, name, age_s=0.0):
    path = folder / name
    path.write_bytes(b"\0" * 4096)
    if age_s:
        # ctime follows the clock, not utime: wait out the age instead of faking it.
        time.sleep(age_s)
    return path


def test_only_unmapped_mpi_segments_of_the_job_go(tmp_path):
    older = _segment(tmp_path, "mpich_shm_older_0")
    time.sleep(1.2)
    since = time.time()
    orphan = _segment(tmp_path, "mpich_shm_orphan_0")
    open_mpi_orphan = _segment(tmp_path, "sm_segment.host.0.25c10000.0")
    in_use = _segment(tmp_path, "mpich_shm_inuse_0")
    other = _segment(tmp_path, "someone_elses_0", age_s=1.1)
    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mapped:
        young = _segment(tmp_path, "mpich_shm_young_0")
        removed = rank_wrapper.remove_orphaned_mpi_segments(since, directory=str(tmp_path))
        assert mapped[0] == 0
    assert sorted(removed) == ["mpich_shm_orphan_0", "sm_segment.host.0.25c10000.0"]
    assert not orphan.exists() and not open_mpi_orphan.exists()
    for kept in (older, in_use, other, young):
        assert kept.exists(), kept.name
    # Once unmapped and old enough, the others of the job go too.
    time.sleep(1.1)
    assert sorted(rank_wrapper.remove_orphaned_mpi_segments(since, directory=str(tmp_path))) \
        == ["mpich_shm_inuse_0", "mpich_shm_young_0"]
    assert older.exists() and other.exists()
    assert rank_wrapper.remove_orphaned_mpi_segments(since, directory=str(tmp_path / "nope")) == []
    os.unlink(older)
