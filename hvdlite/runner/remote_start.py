"""Starts a command on another host for mpiexec: hvdliterun's ``ssh`` replacement.

    remote_start.py --shell 'ssh -p 2222' -- [-x] HOST WORDS...

MPICH's hydra (``-launcher rsh -launcher-exec``) and Open MPI (``plm_rsh_agent``) call
their remote-start program like ``rsh``: options, a host, then the command's words,
which the remote side joins and runs with a shell. hvdliterun points them at a small
script that runs this file with the user's ``--remote-shell`` (or the ssh command built
from ``--ssh-port``/``--ssh-identity-file``) as ``--shell``:

* ``{host}`` in the shell command is replaced by the host; without it the host is
  appended (``ssh -p 2222 HOST ...``);
* the command's words follow as one argument (what ``ssh`` would send);
* when the remote shell cannot reach the host (it exits with 255, as ssh does, or
  cannot be run) a line ``hvdlite remote start: cannot reach host HOST ...`` goes to
  stderr; hvdliterun reads it and ends the job naming the host.

Run by path with ``python -I``: standard library only.
"""
import shlex
import subprocess
import sys

UNREACHABLE_PREFIX = "hvdlite remote start: cannot reach host "
# Options of rsh-style callers that take a value (ssh's); the rest are flags (-x, -q).
_VALUE_OPTIONS = frozenset({"-p", "-l", "-i", "-o", "-F", "-E", "-J"})


def remote_argv(shell, host, words):
    """The argv that runs ``words`` (joined, as ssh would) on ``host`` through ``shell``.

    Args:
        shell: the remote shell command (shell words; ``{host}`` marks the host).
        host: the host.
        words: the command's words.

    Returns:
        The argument vector.
    """
    parts = shlex.split(shell)
    if any("{host}" in part for part in parts):
        parts = [part.replace("{host}", host) for part in parts]
    else:
        parts.append(host)
    return parts + [" ".join(words)]


def split_caller_args(args):
    """Splits an rsh-style call ``[options] HOST WORDS...`` into (host, words)."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 2 if args[i] in _VALUE_OPTIONS else 1
    if i >= len(args) - 1:
        raise ValueError("expected [options] HOST COMMAND...")
    return args[i], args[i + 1:]


def main(argv=None):
    """Entry point; returns the remote shell's exit status (2 for bad usage)."""
    args = list(sys.argv[1:] if argv is None else argv)
    shell = None
    while args and args[0] != "--":
        if args[0] == "--shell" and len(args) > 1:
            shell, args = args[1], args[2:]
        else:
            sys.stderr.write(f"remote_start.py: unknown option {args[0]!r}\n")
            return 2
    args = args[1:]
    try:
        host, words = split_caller_args(args)
    except ValueError as exc:
        sys.stderr.write(f"remote_start.py: {exc}; got {args!r}\n")
        return 2
    argv_remote = remote_argv(shell or "ssh", host, words)
    try:
        returncode = subprocess.call(argv_remote)
    except OSError as exc:
        sys.stderr.write(f"{UNREACHABLE_PREFIX}{host}: cannot run {argv_remote[0]!r}: "
                         f"{exc.strerror}\n")
        sys.stderr.flush()
        return 255
    if returncode == 255:
        sys.stderr.write(f"{UNREACHABLE_PREFIX}{host}: '{shlex.join(argv_remote[:-1])}' "
                         f"exited with status {returncode}\n")
        sys.stderr.flush()
    return returncode


if __name__ == "__main__":
    sys.exit(main())
