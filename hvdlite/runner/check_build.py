"""``hvdliterun --check-build``: what this install of hvdlite has.

Nothing here imports a framework or hvdlite's native library into the launcher: framework
presence comes from import metadata, and the native library is opened in a child
process, so a broken install is reported rather than crashing the report.
"""
import ctypes
import glob
import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from typing import List, Optional, Sequence, Tuple

from hvdlite import build_record
from hvdlite.runner import mpi_command
from hvdlite.runner.version import package_version

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE_LIBRARY = os.path.join(_PACKAGE_DIR, "libhvdlite.so")

# module name -> distributions that provide it (first installed one wins).
_FRAMEWORKS = (
    ("torch", ("torch",)),
    ("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos",
                    "tf-nightly", "intel-tensorflow")),
    ("keras", ("keras", "tf-keras")),
)


def framework_version(module: str, distributions: Sequence[str]) -> Optional[str]:
    """The installed version of a framework, without importing it.

    Args:
        module: the top-level module name.
        distributions: names of the distributions that may provide it.

    Returns:
        The version, ``unknown version`` when the module exists without metadata, or
        None when the module cannot be found.
    """
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    for dist in distributions:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown version"


def _site_dirs() -> List[str]:
    return [p for p in sys.path if p and os.path.isdir(p)]


def library_candidates(env_var: str, names: Sequence[str], wheel_subdir: str) -> List[str]:
    """Paths and sonames to try for a GPU library, most specific first.

    Args:
        env_var: a variable holding an explicit path (e.g. HVDLITE_NCCL_LIB), may be unset.
        names: sonames for the dynamic loader's search (e.g. libnccl.so.2).
        wheel_subdir: where NVIDIA's wheels put it under site-packages, e.g. nvidia/nccl/lib.

    Returns:
        Candidates to pass to ctypes.CDLL.
    """
    found = []
    if env_var and os.environ.get(env_var):
        found.append(os.environ[env_var])
    for site in _site_dirs():
        for name in names:
            found.extend(sorted(glob.glob(os.path.join(site, wheel_subdir, name + "*"))))
    found.extend(names)
    return list(dict.fromkeys(found))


def try_open(candidates: Sequence[str], version_symbol: str) -> Tuple[Optional[str], str]:
    """Opens the first loadable library and asks it for its version.

    Args:
        candidates: paths or sonames.
        version_symbol: a ``int f(int*)`` version function (ncclGetVersion,
            cudaRuntimeGetVersion).

    Returns:
        (what opened, version text) or (None, the last error).
    """
    last_error = "not found"
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as exc:
            last_error = str(exc)
            continue
        version = ""
        try:
            value = ctypes.c_int(0)
            if getattr(lib, version_symbol)(ctypes.byref(value)) == 0 and value.value:
                version = _format_version(version_symbol, value.value)
        except (AttributeError, OSError):
            pass
        return candidate, version
    return None, last_error


def _format_version(symbol: str, code: int) -> str:
    if symbol == "ncclGetVersion":
        # NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
        major, rest = divmod(code, 10000)
        return f"{major}.{rest // 100}.{rest % 100}"
    major, rest = divmod(code, 1000)
    return f"{major}.{rest // 10}"


# Run in a child: loads the core as a user's import would (libmpi included) and says
# which libmpi it is bound to and what that library calls itself.
_PROBE = """
import json, os, sys
sys.path.insert(0, sys.argv[2])
os.environ["HVDLITE_LIBRARY"] = sys.argv[1]
from hvdlite import _native
print("HVDLITE_PROBE " + json.dumps({"mpi": _native.mpi_library_path,
                                     "version": _native.mpi_library_version()}))
"""


def probe_native_library(path: str = NATIVE_LIBRARY,
                         timeout: float = 30.0) -> Tuple[str, Optional[dict]]:
    """Loads the native library in a child process, as ``import hvdlite`` would.

    Args:
        path: the library's path.
        timeout: seconds for the loading child.

    Returns:
        (a one-line status, the loaded MPI as ``{"mpi": path, "version": text}`` or None
        when the library did not load).
    """
    if not os.path.exists(path):
        return (f"MISSING: {path} is not built (build it with 'pip install -e .' or "
                f"'python setup.py build_native' in a source checkout)"), None
    try:
        result = subprocess.run([sys.executable, "-I", "-c", _PROBE, path,
                                 os.path.dirname(_PACKAGE_DIR)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"{path} (loading it took more than {timeout:g} s)", None
    lines = result.stdout.decode("utf-8", "replace").strip().splitlines()
    if result.returncode != 0:
        return (f"{path} (CANNOT LOAD: {lines[-1] if lines else 'exit ' + str(result.returncode)})",
                None)
    found = [l for l in lines if l.startswith("HVDLITE_PROBE ")]
    return f"{path} (loads)", json.loads(found[-1].split(" ", 1)[1]) if found else None


def _mpi_lines(loaded: Optional[dict]) -> List[str]:
    lines = []
    info = build_record.read_if_readable()
    if info:
        source = info.get("mpi_source", "?")
        prefix = info.get("mpi_prefix") or "the mpich wheel"
        built = " ".join(str(info[k]) for k in ("mpi_implementation", "mpi_version")
                         if info.get(k))
        soname = f", {info['mpi_soname']}" if info.get("mpi_soname") else ""
        lines.append(f"    built against:  {built + ', ' if built else ''}{source} MPI "
                     f"({prefix}{soname})")
    else:
        lines.append("    built against:  unknown (no _build_info.json next to the package)")
    if loaded:
        text = loaded.get("version", "").strip()
        first = " ".join(text.splitlines()[0].split()) if text else "(no version text)"
        lines.append(f"    [X] libmpi:     {loaded.get('mpi') or 'found by the dynamic loader'}")
        lines.append(f"    implementation: {first}")
    else:
        lines.append("    [ ] libmpi:     not loaded (see the native library above)")
        lines.append("    implementation: unknown (the library did not load)")
    try:
        path = mpi_command.find_mpiexec()
    except mpi_command.MpiNotFoundError as exc:
        lines.append(f"    [ ] launcher:   {exc}")
        return lines
    launcher = mpi_command.probe_launcher(path)
    lines.append(f"    [X] launcher:   {path} ({launcher.implementation})")
    mismatch = mpi_command.launcher_mismatch(info, launcher)
    if mismatch:
        lines.append(f"    MISMATCH:       {mismatch}")
    return lines


# How CUDA tensors travel, and what of it has run on a real GPU (docs/gpu.md).
GPU_PATHS = (
    "NCCL:    when each rank of a host has its own GPU and NCCL opens (HVDLITE_GPU_OPERATIONS=NCCL "
    "insists)",
    "staged:  through pinned host memory into the CPU paths otherwise, or with "
    "HVDLITE_GPU_OPERATIONS=MPI",
    "run on a GPU: both, on one H200 (tests/gpu: every op and dtype, 1 rank NCCL, 2 and 3 "
    "ranks staged); multi-GPU NCCL not yet (docs/gpu.md)",
)


def report() -> str:
    """Builds the --check-build report.

    Returns:
        The report text, one item per line.
    """
    status, loaded = probe_native_library()
    lines = [f"hvdlite {package_version()} (Python {sys.version.split()[0]}, "
             f"{sys.executable})", "",
             "Native library:", "    " + status, "",
             "Frameworks:"]
    for module, dists in _FRAMEWORKS:
        version = framework_version(module, dists)
        mark = "X" if version else " "
        lines.append(f"    [{mark}] {module:<11} {version or 'not installed'}")
    lines += ["", "MPI:"] + _mpi_lines(loaded) + ["", "GPU libraries:"]
    gpu = (
        ("NCCL", "HVDLITE_NCCL_LIB", ("libnccl.so.2", "libnccl.so"), "nvidia/nccl/lib",
         "ncclGetVersion"),
        ("CUDA runtime", "HVDLITE_CUDART_LIB",
         ("libcudart.so.13", "libcudart.so.12", "libcudart.so"), "nvidia/cuda_runtime/lib",
         "cudaRuntimeGetVersion"),
        # Only for the kernel that packs fused tensors on NCCL (docs/gpu.md).
        ("CUDA driver", "HVDLITE_CUDA_LIB", ("libcuda.so.1", "libcuda.so"), "nvidia/cuda_driver/lib",
         "cuDriverGetVersion"),
    )
    for label, env_var, names, subdir, symbol in gpu:
        opened, detail = try_open(library_candidates(env_var, names, subdir), symbol)
        if opened:
            lines.append(f"    [X] {label:<13} {opened}" + (f" (version {detail})"
                                                              if detail else ""))
        else:
            lines.append(f"    [ ] {label:<13} cannot be opened ({detail})")
    lines += ["", "GPU paths (CUDA tensors in hvdlite.torch; the libraries above are opened by "
              "the core at run time):"] + [f"    {line}" for line in GPU_PATHS]
    return "\n".join(lines) + "\n"


def check_build() -> int:
    """Prints the report; returns the exit code (always 0: a report, not a test)."""
    sys.stdout.write(report())
    sys.stdout.flush()
    return 0
