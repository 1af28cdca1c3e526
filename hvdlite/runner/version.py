"""hvdlite's version as the launcher reports it (``--version``, ``--check-build``).

Standard library only: read from the installed distribution's metadata, not from the
package, so that nothing of hvdlite's core is imported.
"""
import os
from importlib import metadata

_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "pyproject.toml")


def package_version() -> str:
    """hvdlite's version, without importing the package's native parts.

    Returns:
        The installed distribution's version, else the one in a source checkout's
        pyproject.toml, else ``unknown``.
    """
    try:
        return metadata.version("hvdlite")
    except Exception:  # noqa: BLE001 - not installed: fall back to the source tree
        pass
    try:
        with open(_PYPROJECT, "r", encoding="utf-8") as f:
            for line in f:
                if line.startswith("version"):
                    return line.split("=", 1)[1].strip().strip('"\'')
    except OSError:
        pass
    return "unknown"
