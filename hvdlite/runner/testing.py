"""Running hvdliterun jobs from tests, with a timeout that always ends the whole job.

    from hvdlite.runner.testing import run_launcher
    job = run_launcher(["-np", "2", sys.executable, str(script)], timeout=120)
    job.check()                       # AssertionError with every rank's output on failure
    assert job.lines(rank=1) == ["hello"]

The launcher is started as ``python -m hvdlite.runner`` (what users run, less the
console-script shim) in a session of its own. On timeout it gets SIGTERM, which ends
every rank through the launcher's own kill path, then SIGKILL after a grace period;
the ranks' wrappers end their commands when the launcher's connection drops.
"""
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TAG_RE = re.compile(r"^\[(\d+)(?:@[^\]]*)?\]<(stdout|stderr)>:(.*)$")  # [1@host] with --verbose


class LauncherTimeout(AssertionError):
    """The job ran past its timeout (and was ended)."""


def launcher_command(python: str = sys.executable) -> List[str]:
    """The argv prefix that runs hvdliterun with ``python``."""
    return [python, "-m", "hvdlite.runner"]


def launcher_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment for a launcher run: ours, with this hvdlite on PYTHONPATH.

    Args:
        extra: variables to add or override.

    Returns:
        A new environment mapping.
    """
    env = dict(os.environ)
    # Works from a source checkout that is not pip-installed, and makes sure the ranks
    # import this tree's hvdlite rather than some other installed copy.
    paths = [_REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra or {})
    return env


def parse_tagged_output(text: str) -> Dict[Tuple[int, str], List[str]]:
    """Splits launcher output into each rank's lines.

    Args:
        text: the launcher's stdout or stderr.

    Returns:
        (rank, "stdout"|"stderr") -> lines, in order, without tags; untagged lines
        (the launcher's own messages) are left out.
    """
    result: Dict[Tuple[int, str], List[str]] = {}
    for line in text.splitlines():
        match = _TAG_RE.match(line)
        if match:
            result.setdefault((int(match.group(1)), match.group(2)), []).append(match.group(3))
    return result


@dataclass
class LauncherRun:
    """The outcome of one launcher run."""

    argv: List[str]
    returncode: int
    stdout: str
    stderr: str

    def lines(self, rank: int, stream: str = "stdout") -> List[str]:
        """Rank ``rank``'s lines on ``stream`` ("stdout" or "stderr")."""
        text = self.stdout if stream == "stdout" else self.stderr
        return parse_tagged_output(text).get((rank, stream), [])

    def describe(self) -> str:
        """The command, exit code and all output, for assertion messages."""
        return (f"command: {' '.join(self.argv)}\nexit code: {self.returncode}\n"
                f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}")

    def check(self, expected: int = 0) -> "LauncherRun":
        """Asserts the exit code; the failure message carries every rank's output.

        Raises:
            AssertionError: the exit code differs.
        """
        if self.returncode != expected:
            raise AssertionError(f"hvdliterun exited with {self.returncode}, expected "
                                 f"{expected}\n{self.describe()}")
        return self


def _end(proc: subprocess.Popen, grace: float) -> Tuple[bytes, bytes]:
    # SIGTERM first: the launcher then ends every rank itself.
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return b"", b""


def run_launcher(args: Sequence[str], timeout: float = 120.0,
                 env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                 python: str = sys.executable, kill_grace: float = 15.0) -> LauncherRun:
    """Runs ``hvdliterun ARGS`` to the end and returns its exit code and output.

    Args:
        args: launcher arguments, e.g. ``["-np", "2", sys.executable, "script.py"]``.
        timeout: seconds before the job is ended and LauncherTimeout raised.
        env: extra environment variables.
        cwd: working directory.
        python: interpreter that runs the launcher.
        kill_grace: seconds between SIGTERM and SIGKILL on timeout.

    Returns:
        The run's outcome.

    Raises:
        LauncherTimeout: the job did not end within ``timeout``; the message carries
            the output so far.
    """
    argv = launcher_command(python) + list(args)
    proc = subprocess.Popen(argv, env=launcher_env(env), cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _end(proc, kill_grace)
        run = LauncherRun(argv, proc.returncode if proc.returncode is not None else -9,
                          out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
        raise LauncherTimeout(f"hvdliterun did not finish within {timeout:g} s and was "
                              f"killed\n{run.describe()}") from None
    except BaseException:
        _end(proc, kill_grace)
        raise
    return LauncherRun(argv, proc.returncode, out.decode("utf-8", "replace"),
                       err.decode("utf-8", "replace"))


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie (Linux /proc aware)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "r") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def stall_wrapper(seconds: float) -> None:
    """For a rank's fault tests: stops this process's parent (its rank wrapper) for
    ``seconds`` (SIGSTOP now, SIGCONT from a detached process), as a wrapper starved of
    CPU: a death right after it reaches the launcher that much later."""
    wrapper = os.getppid()
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {wrapper}"],
                     start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.kill(wrapper, signal.SIGSTOP)
