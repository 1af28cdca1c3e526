"""The remote shell hvdliterun starts processes with inside a Spark task.

    task_shell.py --tasks FILE HOST COMMAND

hvdlite.spark.run hands this to hvdliterun as ``--remote-shell``: where hvdliterun (its
mpiexec) would ssh to HOST, this connects to the task service of the first Spark task
on HOST (its address in FILE, a JSON object ``{host: [address, port]}``), which runs
COMMAND with ``/bin/sh -c`` inside that task and streams its output back. The exit
status is COMMAND's; 255 (ssh's) when the task cannot be reached, so that hvdliterun
ends the job naming the host. The key the service checks is in HVDLITE_SPARK_KEY (hex).

Run by path with ``python -I``: standard library only.
"""
import json
import os
import sys
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

KEY_ENV = "HVDLITE_SPARK_KEY"


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main(argv=None):
    """Entry point; returns the command's exit status (255: the task is out of reach)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4 or args[0] != "--tasks":
        sys.stderr.write(f"task_shell.py: usage: --tasks FILE HOST COMMAND; got {args!r}\n")
        return 2
    _, tasks_file, host, command = args
    try:
        with open(tasks_file, "r", encoding="utf-8") as f:
            address, port = json.load(f)[host]
        conn = Client((address, int(port)), authkey=bytes.fromhex(os.environ[KEY_ENV]))
        conn.send(("run", command))
    except (OSError, KeyError, ValueError, EOFError, AuthenticationError) as exc:
        sys.stderr.write(f"hvdlite.spark: no Spark task on host {host} to start "
                         f"processes in: {exc!r}\n")
        return 255
    with conn:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                sys.stderr.write(f"hvdlite.spark: the Spark task on host {host} ended "
                                 "while its processes ran\n")
                return 255
            if message[0] == "exit":
                return message[1]
            _write_all(message[1], message[2])


if __name__ == "__main__":
    sys.exit(main())
