"""The only importer of the compiled core: ``ffi``, ``lib`` and ``check(status)``.

The core (``libhvdlite.so``) is a plain shared library with a C API, opened with cffi in
ABI mode: nothing is compiled against Python, and cffi releases the GIL around every
call, so ``hvdlite_wait`` blocks without holding it.

The declarations come from the block between ``/* CDEF-BEGIN */`` and ``/* CDEF-END */``
in ``c_api.h`` (and in ``testing.h``, the test-only entry points); they are never
copied by hand.

Loading order matters: the core has ``DT_NEEDED`` on libmpi's soname (``libmpi.so.12``
for MPICH, ``libmpi.so.40`` for Open MPI) but, in an editable install next to the
``mpich`` wheel, no rpath the loader can use. So libmpi is opened first with
``RTLD_GLOBAL``, by the soname ``_build_info.json`` recorded, from the first of:

1. ``$HVDLITE_MPI_LIB`` (a file);
2. ``<mpi_prefix>/lib{,64}/<soname>`` of a system MPI build;
3. ``<sys.prefix>/lib/<soname>`` (the ``mpich`` wheel);
4. whatever the dynamic loader finds by itself.

Only that soname is tried: another libmpi opened first (MPICH's beside an Open MPI
build in one prefix) would take the core's MPI symbols. Once loaded, the library the
core is bound to names itself (MPI_Get_library_version); an implementation other than
the one the core was compiled against is refused with an ImportError naming both.

``$HVDLITE_LIBRARY`` overrides the path of ``libhvdlite.so``. A failed load raises
ImportError naming the path tried and the OS error; it never prints and carries on.
"""
import ctypes
import logging
import os
import re
import sys

from hvdlite import build_record, errors, peer_faults

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


def _build_info(library_path):
    # The record beside the library (build_native --out-dir writes its own); a record
    # that cannot be read stops the load, since it names the libmpi to preload.
    path = build_record.path_beside(library_path)
    try:
        return build_record.read(path)
    except (OSError, ValueError) as e:
        raise ImportError(f"hvdlite: cannot read {path}: {e}") from e


# Build info without a soname (built before it was recorded): MPICH's.
_DEFAULT_MPI_SONAME = "libmpi.so.12"


def _mpi_candidates(build_info):
    """Yields the libmpi paths to try, best first (see the module docstring)."""
    env = os.environ.get("HVDLITE_MPI_LIB")
    if env:
        yield env
    soname = build_info.get("mpi_soname") or _DEFAULT_MPI_SONAME
    prefix = build_info.get("mpi_prefix")
    if prefix:
        for libdir in ("lib", "lib64"):
            yield os.path.join(prefix, libdir, soname)
    yield os.path.join(sys.prefix, "lib", soname)


def implementation_of(version_text):
    """Names the MPI implementation in MPI_Get_library_version's text.

    Args:
        version_text: e.g. ``Open MPI v5.0.11, package: ...`` or ``MPICH Version: 5.0.2``.

    Returns:
        ``Open MPI``, ``Intel MPI``, ``MVAPICH``, ``MPICH`` or ``unknown`` (the names the
        build records from mpi.h).
    """
    for pattern, name in ((r"Open MPI", "Open MPI"), (r"Intel\(R\) MPI|Intel MPI", "Intel MPI"),
                          (r"MVAPICH", "MVAPICH"), (r"MPICH", "MPICH")):
        if re.search(pattern, version_text, re.IGNORECASE):
            return name
    return "unknown"


def _mapped_mpi_library():
    """The path of the libmpi mapped into this process (Linux), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith("libmpi.so"):
                    return path
    except OSError:
        pass
    return None


def _preload_mpi(build_info):
    """Opens libmpi with RTLD_GLOBAL so the core's DT_NEEDED entry resolves to it.

    Args:
        build_info: the parsed ``_build_info.json`` (empty when there is none).

    Returns:
        (the path that was loaded, its MPI_Get_library_version text), or (None, None)
        when the dynamic loader is left to find it.

    Raises:
        ImportError: $HVDLITE_MPI_LIB names a file that cannot be loaded.
    """
    env = os.environ.get("HVDLITE_MPI_LIB")
    if env and not os.path.isfile(env):
        raise ImportError(f"hvdlite: HVDLITE_MPI_LIB={env} is not a file")
    for path in _mpi_candidates(build_info):
        if not os.path.isfile(path):
            continue
        try:
            handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            if path == env:
                raise ImportError(f"hvdlite: cannot load HVDLITE_MPI_LIB={path}: {e}") from e
            # A broken candidate is not fatal: a later one (or the loader) may work.
            _log.debug("hvdlite: could not preload %s: %s", path, e)
            continue
        return path, _version_text(handle)
    return None, None


def _version_text(handle):
    """MPI_Get_library_version of an opened libmpi (allowed before MPI_Init), or None."""
    try:
        function = handle.MPI_Get_library_version
    except AttributeError:
        return None
    buf = ctypes.create_string_buffer(8192)  # MPICH's MPI_MAX_LIBRARY_VERSION_STRING
    length = ctypes.c_int(0)
    if function(buf, ctypes.byref(length)) != 0:
        return None
    return buf.value.decode("utf-8", "replace")


def _refuse_other_implementation(info, version_text, core_path, mpi_path):
    """Raises ImportError when ``version_text`` is another implementation than the build's.

    Args:
        info: the core's build info (its MPI implementation, version, soname, prefix).
        version_text: what the libmpi at ``mpi_path`` says of itself; None skips the check.
        core_path: the core's path, for the message.
        mpi_path: the libmpi's path, None when the dynamic loader found it.
    """
    built = info.get("mpi_implementation")
    if not built or built == "unknown" or not version_text:
        return
    text = version_text.strip()
    loaded = implementation_of(text)
    if loaded in (built, "unknown"):
        return
    where = info.get("mpi_prefix") or "the mpich wheel"
    first_line = " ".join(text.splitlines()[0].split()) if text else ""
    raise ImportError(
        f"hvdlite: {core_path} was built against {built} {info.get('mpi_version') or ''} "
        f"({info.get('mpi_soname') or 'libmpi'} from {where}), but the MPI library loaded "
        f"at run time is {loaded} ({first_line}; from {mpi_path or 'the dynamic loader'}). "
        "Rebuild hvdlite against this MPI, or make the build's libmpi the one found "
        "(HVDLITE_MPI_LIB=<its libmpi.so>)")


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
    build_info = _build_info(path)
    mpi, mpi_version = _preload_mpi(build_info)
    # Refused before the core is opened: another implementation's libmpi may not even
    # have the symbols it needs, and the error would not say why.
    _refuse_other_implementation(build_info, mpi_version, path, mpi)
    try:
        lib = ffi.dlopen(path)
    except OSError as e:
        raise ImportError(
            f"hvdlite: cannot load the native library {path}: {e} "
            f"(libmpi preloaded from: {mpi or 'nowhere; left to the dynamic loader'}; "
            "set HVDLITE_MPI_LIB to the libmpi.so the core was built against)") from e
    return ffi, lib, path, mpi or _mapped_mpi_library(), build_info


# mpi_library_path: the libmpi the core is bound to (preloaded, else as mapped).
ffi, lib, library_path, mpi_library_path, build_info = _load()


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
    if message is None:
        message = last_error()
    name = status_name(status)
    cls = errors.class_for(name)
    if issubclass(cls, errors.RankFailedError):
        peer_faults.note_core_saw_loss()
        return peer_faults.first_cause(cls(status, name, message))
    return cls(status, name, message)


def error_class(status):
    """Returns the exception class for a status code.

    Args:
        status: a status code returned by the core.

    Returns:
        The mapped subclass, or HvdliteError itself for a code the table in
        ``hvdlite.errors`` does not know (a newer core).
    """
    return errors.class_for(status_name(status))


def check(status):
    """Raises the exception mapped to ``status`` unless it is HVDLITE_OK.

    The message is ``hvdlite_last_error()`` of this thread, so call ``check`` right after
    the failing native call, on the same thread.

    Raises:
        errors.HvdliteError: the subclass mapped to the status.
    """
    if status != lib.HVDLITE_OK:
        raise error_for(status)


def mpi_library_version():
    """Returns the version text (MPI_Get_library_version) of the libmpi the core uses."""
    buf = ffi.new("char[]", 8192)
    check(lib.hvdlite_mpi_library_version(buf, len(buf)))
    return _string(buf)


# The libmpi the core is bound to may not be the one preloaded (none was, or the
# loader chose): it names itself through the core.
_refuse_other_implementation(build_info, mpi_library_version(), library_path,
                             mpi_library_path)
