"""hvdliterun, the job launcher: CLI, mpiexec command, tagged output, kill-on-failure.

Nothing here loads hvdlite's native library, so the launcher works (and
``--check-build`` can report a missing library) before the core is built. Modules:

* launch.py: the command line and ``main`` (console script ``hvdliterun``)
* hosts.py: ``-H`` strings and hostfiles
* mpi_command.py: finding mpiexec, telling Open MPI from hydra, building its argv
* supervisor.py: the launcher side of a running job
* rank_wrapper.py: what each rank runs around the user's command
* check_build.py: ``--check-build``
* testing.py: run a job from tests, with a timeout that kills the whole job
"""
