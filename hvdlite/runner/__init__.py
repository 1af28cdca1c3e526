"""hvdliterun, the job launcher: CLI, mpiexec command, tagged output, kill-on-failure.

Nothing here loads hvdlite's native library, so the launcher works (and
``--check-build`` can report a missing library) before the core is built.

Modules, lowest first; each imports only modules above it in this list:

* version.py: hvdlite's version, from the distribution's metadata
* wire.py: the launcher <-> rank wrapper control protocol (stdlib only)
* hosts.py: ``-H`` strings and hostfiles
* schedulers.py: the hosts of a Slurm allocation or an MPI operator's launcher pod
* remote_start.py: the ``ssh`` replacement mpiexec starts remote processes with (run by path)
* openmpi.py: what Open MPI's mpirun needs (run-as-root, -x forwarding, its arguments)
* mpi_command.py: finding mpiexec, telling Open MPI from hydra, building its argv
* rank_wrapper.py: what each rank runs around the user's command (run by path)
* supervisor.py: the launcher side of a running job
* elastic_settings.py: the elastic flags, validated
* job.py: one job: the validated request, the rank and mpiexec commands, its supervised run
* elastic_driver.py: an elastic job, one world (job) after another
* check_build.py: ``--check-build``
* launch.py: the command line and ``main`` (console script ``hvdliterun``)
* __main__.py: ``python -m hvdlite.runner``
* netns_cluster.py: network-namespace "hosts" on one machine, for tests
* testing.py: run a job from tests, with a timeout that kills the whole job
"""
