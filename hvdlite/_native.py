"""The only importer of the compiled core: ``ffi``, ``lib`` and ``check(status)``.

The core (``libhvdlite.so``) is a plain shared library with a C API, opened with cffi in
ABI mode: nothing is compiled against Python, and cffi releases the GIL around every
call, so ``hvdlite_wait`` blocks without holding it.

The declarations come from the block between ``/* CDEF-BEGIN */`` and ``/* CDEF-END */``
in ``c_api.h`` (and in ``testing.h``, the test-only entry points); they are never
copied by hand.

Loading order matters: the core has ``DT_NEEDED libmpi.so.12`` but, in an editable
install next to the ``mpich`` wheel, no rpath the loader can use. So libmpi is opened
first with ``RTLD_GLOBAL`` from the first of:

1. ``$HVDLITE_MPI_LIB`` (a file);
2. ``<mpi_prefix>/lib{,64}/libmpi.so*`` from ``_build_info.json`` (a system MPI build);
3. ``<sys.prefix>/lib/libmpi.so.12`` or ``libmpi.so`` (the ``mpich`` wheel);
4. whatever the dynamic loader finds by itself.

``$HVDLITE_LIBRARY`` overrides the path of ``libhvdlite.so``. A failed load raises
ImportError naming the path tried and the OS error; it never prints and carries on.
"""
import ctypes
import glob
import json
import logging
import os
import sys

_log = logging.getLogger("hvdlite")

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_CDEF_BEGIN = "/* CDEF-BEGIN */"
_CDEF_END = "/* CDEF-END */"


def _header_path(name="c_api.h"):
    """Returns the path of a header: the installed copy, else the source checkout's."""
    candidates = [
        os.path.join(_PKG_DIR, name),
        os.path.join(os.path.dirname(_PKG_DIR), "native", "include", "hvdlite", name),
    ]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise ImportError("hvdlite: cannot find the C API header; looked for "
                      + ", ".join(candidates) + " (rebuild with `python setup.py build_native`)")


def read_cdef(path=None):
    """Returns the cffi declarations: the text between the CDEF markers of c_api.h.

    Args:
        path: the header to read; None finds it next to this package or in the checkout.

    Returns:
        The declarations as a string, ready for ``FFI.cdef``.

    Raises:
        ImportError: the header or its markers are missing.
    """
    path = path or _header_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    begin = text.find(_CDEF_BEGIN)
    end = text.find(_CDEF_END)
    if begin < 0 or end < begin:
        raise ImportError(f"hvdlite: {path} has no {_CDEF_BEGIN} ... {_CDEF_END} block")
    return text[begin + len(_CDEF_BEGIN):end]


def _testing_cdef():
    """Returns the CDEF block of testing.h (test-only entry points), or "" without it."""
    try:
        return read_cdef(_header_path("testing.h"))
    except ImportError:
        return ""


def _build_info():
    path = os.path.join(_PKG_DIR, "_build_info.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ImportError(f"hvdlite: cannot read {path}: {e}") from e


def _mpi_candidates(build_info):
    """Yields the libmpi paths to try, best first (see the module docstring)."""
    env = os.environ.get("HVDLITE_MPI_LIB")
    if env:
        yield env
    prefix = build_info.get("mpi_prefix")
    if prefix:
        for libdir in ("lib", "lib64"):
            # Prefer the exact soname the core was linked against, then any other.
            paths = sorted(glob.glob(os.path.join(prefix, libdir, "libmpi.so*")),
                           key=lambda p: (not p.endswith(".so.12"), p))
            yield from paths
    for name in ("libmpi.so.12", "libmpi.so"):
        yield os.path.join(sys.prefix, "lib", name)


def _preload_mpi():
    """Opens libmpi with RTLD_GLOBAL so the core's DT_NEEDED entry resolves to it.

    Returns:
        The path that was loaded, or None when the dynamic loader is left to find it.

    Raises:
        ImportError: $HVDLITE_MPI_LIB names a file that cannot be loaded.
    """
    env = os.environ.get("HVDLITE_MPI_LIB")
    if env and not os.path.isfile(env):
        raise ImportError(f"hvdlite: HVDLITE_MPI_LIB={env} is not a file")
    for path in _mpi_candidates(_build_info()):
        if not os.path.isfile(path):
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if path == env:
                raise ImportError(f"hvdlite: cannot load HVDLITE_MPI_LIB={path}: {e}") from e
            # A broken candidate is not fatal: a later one (or the loader) may work.
            _log.debug("hvdlite: could not preload %s: %s", path, e)
            continue
        return path
    return None


def _library_path():
    env = os.environ.get("HVDLITE_LIBRARY")
    if env:
        return env
    return os.path.join(_PKG_DIR, "libhvdlite.so")


def _load():
    import cffi  # deferred so that the error for a missing cffi is an ImportError here

    ffi = cffi.FFI()
    # testing.h's hvdlite_test_* functions are for tests/faults only; declaring them
    # costs nothing and a library without them fails only if a test calls one.
    ffi.cdef(read_cdef() + _testing_cdef())
    path = _library_path()
    if not os.path.isfile(path):
        raise ImportError(
            f"hvdlite: the native library {path} does not exist; build it with "
            "`python setup.py build_native` or reinstall with `pip install .`"
            + (" (HVDLITE_LIBRARY is set)" if os.environ.get("HVDLITE_LIBRARY") else ""))
    mpi = _preload_mpi()
    try:
        lib = ffi.dlopen(path)
    except OSError as e:
        raise ImportError(
            f"hvdlite: cannot load the native library {path}: {e} "
            f"(libmpi preloaded from: {mpi or 'nowhere; left to the dynamic loader'}; "
            "set HVDLITE_MPI_LIB to the libmpi.so the core was built against)") from e
    return ffi, lib, path, mpi


ffi, lib, library_path, mpi_library_path = _load()


def _string(cdata):
    return ffi.string(cdata).decode("utf-8", "replace")


def last_error():
    """Returns the calling thread's last error message from the core."""
    return _string(lib.hvdlite_last_error())


def status_name(status):
    """Returns the name of a status code, e.g. ``"HVDLITE_ERR_MISMATCH"``."""
    return _string(lib.hvdlite_status_name(status))


def version():
    """Returns the core library's version string."""
    return _string(lib.hvdlite_version())


def error_for(status, message=None):
    """Builds the exception for a failed status, without raising it.

    Args:
        status: a non-OK status code.
        message: the text; None reads the calling thread's ``hvdlite_last_error()``.

    Returns:
        An instance of the HvdliteError subclass mapped to ``status``.
    """
    from hvdlite import errors

    if message is None:
        message = last_error()
    return errors.error_class(status)(status, status_name(status), message)


def check(status):
    """Raises the exception mapped to ``status`` unless it is HVDLITE_OK.

    The message is ``hvdlite_last_error()`` of this thread, so call ``check`` right after
    the failing native call, on the same thread.

    Raises:
        errors.HvdliteError: the subclass mapped to the status.
    """
    if status != lib.HVDLITE_OK:
        raise error_for(status)
