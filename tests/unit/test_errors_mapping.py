"""Status codes map, through one table, to distinct exception classes."""
import builtins
import os
import pickle
import re

import pytest

from hvdlite import errors

COLLECTIVE_FAILURES = ["HVDLITE_ERR_MISMATCH", "HVDLITE_ERR_SHUTDOWN", "HVDLITE_ERR_STALLED",
                       "HVDLITE_ERR_MPI", "HVDLITE_ERR_RANK_FAILED", "HVDLITE_ERR_ABORTED"]


def _header_status_names():
    # Read the header directly: importing hvdlite._native would need the library.
    import hvdlite

    pkg = os.path.dirname(hvdlite.__file__)
    for path in (os.path.join(pkg, "c_api.h"),
                 os.path.join(pkg, os.pardir, "native", "include", "hvdlite", "c_api.h")):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return re.findall(r"\b(HVDLITE_ERR_[A-Z_]+)\s*=", f.read())
    pytest.skip("c_api.h not found")


def test_importing_errors_does_not_load_the_library(run_py):
    run_py("""
        import sys
        import hvdlite
        from hvdlite import errors
        assert issubclass(errors.MismatchError, errors.HorovodInternalError)
        assert "hvdlite._native" not in sys.modules, "import hvdlite loaded the core"
    """)


def test_every_header_status_has_its_own_class():
    names = _header_status_names()
    assert names, "no HVDLITE_ERR_* constants found in the header"
    assert set(names) == set(errors.STATUS_CLASSES)
    classes = [errors.STATUS_CLASSES[name] for name in names]
    assert len(set(classes)) == len(classes)
    for cls in classes:
        assert issubclass(cls, errors.HvdliteError) and cls is not errors.HvdliteError


def test_builtin_bases():
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.NotInitializedError, RuntimeError)
    assert issubclass(errors.WaitTimeoutError, builtins.TimeoutError)
    for name in COLLECTIVE_FAILURES:
        assert issubclass(errors.STATUS_CLASSES[name], errors.HorovodInternalError)
    for name in ("HVDLITE_ERR_INVALID_ARGUMENT", "HVDLITE_ERR_NOT_INITIALIZED",
                 "HVDLITE_ERR_DUPLICATE_NAME"):
        assert not issubclass(errors.STATUS_CLASSES[name], errors.HorovodInternalError)


def test_python_raised_errors_carry_the_message():
    e = errors.InvalidArgumentError("tensor 'x' is bad")
    assert str(e) == "tensor 'x' is bad" and e.status is None


def test_pickle_keeps_fields():
    e = errors.MismatchError(4, "HVDLITE_ERR_MISMATCH", "ranks disagree")
    copy = pickle.loads(pickle.dumps(e))
    assert type(copy) is errors.MismatchError
    assert (copy.status, copy.status_name, copy.message) == (4, e.status_name, e.message)
    assert "ranks disagree" in str(copy) and "HVDLITE_ERR_MISMATCH" in str(copy)


def test_codes_map_through_the_library(native):
    lib = native.lib
    for name, cls in errors.STATUS_CLASSES.items():
        code = getattr(lib, name)
        assert native.error_class(code) is cls
        assert native.status_name(code) == name
        err = native.error_for(code, "some text")
        assert type(err) is cls and err.status == code and "some text" in str(err)
    assert native.status_name(lib.HVDLITE_OK) == "HVDLITE_OK"
    assert native.error_class(10_000) is errors.HvdliteError
    assert errors.class_for("HVDLITE_ERR_FROM_A_NEWER_CORE") is errors.HvdliteError
    assert native.check(lib.HVDLITE_OK) is None


def test_message_is_the_native_last_error(native, run_py):
    # Before init, the core refuses with its own message; check() must carry it.
    run_py("""
        from hvdlite import _native, errors
        from hvdlite._native import ffi, lib
        out = ffi.new("int32_t *")
        status = lib.hvdlite_size(out)
        assert status == lib.HVDLITE_ERR_NOT_INITIALIZED, status
        text = _native.last_error()
        assert text, "hvdlite_last_error() is empty after a failure"
        try:
            _native.check(status)
        except errors.NotInitializedError as e:
            assert text in str(e), (text, str(e))
            assert e.status == status
        else:
            raise AssertionError("check() did not raise")
    """)


def test_version_strings(hvd):
    from hvdlite import _native, runtime

    assert _native.version()
    assert runtime.mpi_library_version()
