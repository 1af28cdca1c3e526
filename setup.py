"""Builds native/ into hvdlite/libhvdlite.so.

The core is a plain shared library with a C API; Python loads it with cffi in ABI
mode, so nothing here compiles against Python or any deep-learning framework.

MPI: HVDLITE_MPI_DIR=/path (with include/mpi.h and lib/libmpi.so) selects a system
MPI, and the package then does not depend on the `mpich` wheel; otherwise the `mpich`
wheel in the build environment provides the headers and, at run time, the `mpich` wheel
in the installing environment provides libmpi. _build_info.json records which MPI (its
implementation from mpi.h, the libmpi soname the core needs, a system MPI's prefix) so
that the loader opens exactly that library and refuses another implementation.
HVDLITE_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer.
HVDLITE_DEBUG=1 builds without optimization.
"""
import concurrent.futures
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Command, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # older setuptools
    editable_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(HERE, "hvdlite")


def _mpi_prefix():
    """Returns (prefix, source) of the MPI to compile against."""
    user = os.environ.get("HVDLITE_MPI_DIR")
    if user:
        if not os.path.exists(os.path.join(user, "include", "mpi.h")):
            sys.exit(f"hvdlite: HVDLITE_MPI_DIR={user} has no include/mpi.h")
        return os.path.abspath(user), "system"
    # pip's isolated build environment installs the mpich wheel into an overlay prefix
    # of its own: ask the distribution where its files went.
    candidates = []
    try:
        from importlib import metadata
        dist = metadata.distribution("mpich")
        for f in dist.files or ():
            if str(f).endswith("include/mpi.h"):
                header = os.path.realpath(str(dist.locate_file(f)))
                candidates.append(os.path.dirname(os.path.dirname(header)))
    except Exception:  # no mpich distribution: fall back to the prefixes below
        pass
    candidates += [sys.prefix, sysconfig.get_paths()["data"], sys.base_prefix]
    for prefix in candidates:
        if os.path.exists(os.path.join(prefix, "include", "mpi.h")) and glob.glob(
                os.path.join(prefix, "lib", "libmpi.so*")):
            return prefix, "wheel"
    sys.exit("hvdlite: no MPI found to build against: install the 'mpich' wheel "
             "(pip install mpich) or set HVDLITE_MPI_DIR to an MPI installation")


def mpi_identity(include):
    """Returns (implementation, version) of the MPI whose mpi.h is in ``include``.

    The names match what the library's MPI_Get_library_version says (see
    hvdlite/_native.py), so the loader can compare the two.
    """
    with open(os.path.join(include, "mpi.h"), encoding="utf-8", errors="replace") as f:
        header = f.read()

    def define(name):
        match = re.search(r"^#\s*define\s+" + name + r"\s+\"?([^\"\s]+)", header, re.M)
        return match.group(1) if match else None

    if define("OMPI_MAJOR_VERSION"):
        return "Open MPI", ".".join(define(f"OMPI_{part}_VERSION") or "?"
                                    for part in ("MAJOR", "MINOR", "RELEASE"))
    if define("I_MPI_VERSION"):
        return "Intel MPI", define("I_MPI_VERSION")
    for name in ("MVAPICH_VERSION", "MVAPICH2_VERSION"):
        if define(name):
            return "MVAPICH", define(name)
    if define("MPICH_VERSION"):
        return "MPICH", define("MPICH_VERSION")
    return "unknown", None


def needed_mpi_soname(library):
    """Returns the libmpi soname a linked library needs (DT_NEEDED), or None."""
    try:
        out = subprocess.run(["readelf", "-d", library], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"\(NEEDED\).*\[(libmpi\.so[^\]]*)\]", out)
    return match.group(1) if match else None


_built = set()  # out_dirs compiled by this process: editable installs run two hooks


def build_native(out_dir):
    if out_dir in _built:
        return
    _built.add(out_dir)
    prefix, source = _mpi_prefix()
    include = os.path.join(prefix, "include")
    libdir = os.path.join(prefix, "lib")
    if not os.path.exists(os.path.join(libdir, "libmpi.so")) and os.path.exists(
            os.path.join(prefix, "lib64", "libmpi.so")):
        libdir = os.path.join(prefix, "lib64")
    cxx = os.environ.get("CXX", "g++")
    # native/src is in folders by layer (native/src/README.md); includes name a file by
    # its path under native/src, e.g. "common/common.h".
    sources = sorted(glob.glob(os.path.join(HERE, "native", "src", "**", "*.cc"), recursive=True))
    flags = ["-std=c++17", "-fPIC", "-shared", "-Wall", "-Wextra", "-Wno-unused-parameter",
             "-fvisibility=hidden", "-pthread",
             "-I" + os.path.join(HERE, "native", "include"), "-I" + os.path.join(HERE, "native", "src"),
             "-I" + include]
    if os.environ.get("HVDLITE_SANITIZE") == "1":
        flags += ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined"]
    elif os.environ.get("HVDLITE_DEBUG") == "1":
        flags += ["-O0", "-g"]
    else:
        flags += ["-O2", "-g0"]
    rpaths = ["$ORIGIN/../../.."]  # <prefix>/lib when installed next to the mpich wheel
    if source == "system":
        rpaths.insert(0, libdir)
    # --exclude-libs: a toolchain that links its libstdc++ statically (one GPU machine's
    # /opt/gcc did) would otherwise export it, and the process's own libstdc++.so (loaded
    # by Python or torch, another version) would take over some of its calls: the core
    # then crashed in the first ostream << double. Static libraries' symbols stay inside.
    link = ["-L" + libdir, "-lmpi", "-ldl", "-Wl,--exclude-libs,ALL"] + ["-Wl,-rpath," + r for r in rpaths]
    target = os.path.join(out_dir, "libhvdlite.so")
    os.makedirs(out_dir, exist_ok=True)
    # One compiler per source file, as many at once as there are cores, then one link:
    # the core's sources compile in a fraction of the time of one compiler over them all.
    with tempfile.TemporaryDirectory(prefix="hvdlite-build-") as objdir:
        objects = [os.path.join(objdir, os.path.relpath(src, HERE).replace(os.sep, "_") + ".o")
                   for src in sources]
        compile_flags = [f for f in flags if f != "-shared"]
        print(f"hvdlite: {cxx} {' '.join(compile_flags)} -c <each of {len(sources)} sources "
              f"in native/src>", flush=True)

        def compile_one(pair):
            src, obj = pair
            done = subprocess.run([cxx] + compile_flags + ["-c", src, "-o", obj],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            return src, done.returncode, done.stdout

        workers = max(1, min(len(sources), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(compile_one, zip(sources, objects)))
        for src, code, output in results:
            if output:
                sys.stdout.write(output)
        failed = [os.path.relpath(src, HERE) for src, code, _ in results if code != 0]
        if failed:
            sys.exit("hvdlite: the compiler failed on " + ", ".join(failed))
        cmd = [cxx] + flags + objects + ["-o", target] + link
        print("hvdlite: " + " ".join([cxx] + flags + ["<objects>", "-o", target] + link), flush=True)
        subprocess.check_call(cmd)
    implementation, version = mpi_identity(include)
    with open(os.path.join(out_dir, "_build_info.json"), "w") as f:
        json.dump({"mpi_source": source, "mpi_prefix": prefix if source == "system" else None,
                   "mpi_implementation": implementation, "mpi_version": version,
                   "mpi_soname": needed_mpi_soname(target),
                   "sanitize": os.environ.get("HVDLITE_SANITIZE") == "1"}, f)
    for header in ("c_api.h", "testing.h"):
        shutil.copy(os.path.join(HERE, "native", "include", "hvdlite", header),
                    os.path.join(out_dir, header))


class BuildNative(Command):
    description = "compile native/ into hvdlite/libhvdlite.so"
    # --out-dir puts a second build (e.g. a sanitized one) elsewhere, leaving the
    # package's library alone; load it with HVDLITE_LIBRARY=<dir>/libhvdlite.so.
    user_options = [("out-dir=", None, "directory for libhvdlite.so (default: hvdlite/)")]

    def initialize_options(self):
        self.out_dir = None

    def finalize_options(self):
        pass

    def run(self):
        build_native(os.path.abspath(self.out_dir) if self.out_dir else PKG)


class BuildPy(build_py):
    # A wheel's core is compiled into the build directory, not the source tree: a
    # checkout's own (editable) build stays as it is when `pip install .` builds
    # another copy from it, e.g. against a system MPI into another venv.
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            build_native(PKG)
        else:
            build_native(os.path.join(os.path.abspath(self.build_lib), "hvdlite"))


class Develop(develop):
    def run(self):
        build_native(PKG)
        super().run()


cmdclass = {"build_native": BuildNative, "build_py": BuildPy, "develop": Develop}
if editable_wheel is not None:
    class EditableWheel(editable_wheel):
        def run(self):
            build_native(PKG)
            super().run()

    cmdclass["editable_wheel"] = EditableWheel

# The mpich wheel is a dependency only of a build against it: installed beside a system
# MPI in the same prefix (a pip-installed Open MPI) it would replace that MPI's mpiexec
# and libmpi.so. build_support/hvdlite_backend.py makes the same choice for the build.
install_requires = ["cffi>=1.15", "numpy>=1.22", "ml_dtypes>=0.3"]
if not os.environ.get("HVDLITE_MPI_DIR"):
    install_requires.append("mpich; sys_platform == 'linux'")

setup(cmdclass=cmdclass, install_requires=install_requires)
