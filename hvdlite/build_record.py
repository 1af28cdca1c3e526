"""The build record: ``_build_info.json``, which ``setup.py build_native`` writes beside
``libhvdlite.so`` (which MPI the core was compiled and linked against).

Read here only: by the loader (hvdlite/_native.py), which must not start on a record it
cannot read, and by the launcher (hvdlite/runner), for which the record is a hint.
Standard library only, and nothing of hvdlite's: the launcher reads it without loading
the core, and it sits at the bottom of the package's layering beside errors.py.
"""
import json
import os
from typing import Dict

FILE_NAME = "_build_info.json"
# The record of the library this package loads by default (``hvdlite/libhvdlite.so``).
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), FILE_NAME)


def path_beside(library_path: str) -> str:
    """The record written beside a library (``build_native --out-dir`` writes its own)."""
    return os.path.join(os.path.dirname(library_path), FILE_NAME)


def read(path: str = DEFAULT_PATH) -> Dict[str, object]:
    """Reads a build record.

    Args:
        path: the file to read.

    Returns:
        The parsed record; an empty dict when there is no such file (a build from before
        the record existed, or a library built elsewhere).

    Raises:
        OSError: the file exists but cannot be read.
        ValueError: it is not JSON, or not a JSON object.
    """
    try:
        with open(path, "r", encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return {}
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def read_if_readable(path: str = DEFAULT_PATH) -> Dict[str, object]:
    """Like :func:`read`, but an unreadable or malformed record is an empty one.

    The launcher's form: the record only refines its choice of mpiexec and its report,
    and the loader in each rank says what is wrong with it.
    """
    try:
        return read(path)
    except (OSError, ValueError):
        return {}
