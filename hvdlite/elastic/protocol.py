"""What the elastic driver and the ranks of its worlds agree on (standard library only).

The driver (``hvdlite/runner/elastic_driver.py``) starts one world (an mpiexec job) after
another; it tells each rank, through the variables below, which job and which world it is
in, where committed states live on its host and how to ask whether hosts were added. A
rank tells the driver it left for a reset by exiting with ``RESET_EXIT_CODE``.
"""
import os
import socket
import tempfile

ENV_JOB = "HVDLITE_ELASTIC_JOB"                # job id: names the state directory
ENV_GENERATION = "HVDLITE_ELASTIC_GENERATION"  # 0 for the first world, +1 per reset
ENV_STATE_DIR = "HVDLITE_ELASTIC_STATE_DIR"    # parent of the state directory
ENV_DRIVER_ADDR = "HVDLITE_ELASTIC_DRIVER"     # host:port of the driver's update service
ENV_DRIVER_TOKEN = "HVDLITE_ELASTIC_TOKEN"

# A rank exits with this code when it leaves its world for a reset (its peer failed, or
# hosts were added): the driver counts its slot as a survivor. 75 is EX_TEMPFAIL.
RESET_EXIT_CODE = 75

# How long a rank waits for the driver's answer before it assumes nothing changed.
QUERY_TIMEOUT_S = 5.0

# Functions run just before a rank exits with RESET_EXIT_CODE: a rank whose exit code
# its launcher cannot see (a Ray actor standing in for the process mpiexec started, see
# hvdlite/ray/handoff.py) tells it this way that it left for a reset.
_reset_hooks = []


def on_leave_for_reset(hook):
    """Registers ``hook()``, run when this process leaves its world for a reset."""
    _reset_hooks.append(hook)


def run_reset_hooks():
    """Runs the registered hooks (called once, just before the exit)."""
    for hook in _reset_hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - the exit must happen whatever a hook does
            pass


def in_elastic_job(env=None):
    """Whether this process is a rank of a world started by the elastic driver."""
    return bool((os.environ if env is None else env).get(ENV_JOB))


def generation(env=None):
    """The number of resets before the current world (0 outside an elastic job)."""
    value = (os.environ if env is None else env).get(ENV_GENERATION, "0")
    return int(value) if value.isdigit() else 0


def default_state_root():
    """tmpfs (/dev/shm) where the machine has it, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def state_dir(env=None):
    """The directory of this job's committed states on this host."""
    env = os.environ if env is None else env
    root = env.get(ENV_STATE_DIR) or default_state_root()
    return os.path.join(root, f"hvdlite-elastic-{env[ENV_JOB]}")


def ask_hosts_updated(env=None, timeout=QUERY_TIMEOUT_S):
    """Asks the driver whether the current world should reset to take in added slots.

    Returns:
        True when the driver has more usable slots than this world has ranks (and the
        world is below --max-np); False when not, or when the driver cannot be reached.
    """
    env = os.environ if env is None else env
    addr = env.get(ENV_DRIVER_ADDR)
    if not addr:
        return False
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.sendall(f"{env.get(ENV_DRIVER_TOKEN, '')} {generation(env)}\n".encode())
            answer = s.makefile("rb").readline().strip()
    except (OSError, ValueError):
        return False
    return answer == b"1"
