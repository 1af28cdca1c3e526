"""The control connection between the launcher and each rank wrapper.

supervisor.py (the launcher's end) and rank_wrapper.py (each rank's end) speak over one
TCP connection per rank: frames of (1-byte kind, 4-byte big-endian length, payload).
Here are the frames, the message kinds, the variables that carry the connection's
address and secret, the timings both ends agree on, and the pieces of plumbing both
ends' selector loops share.

Standard library only, and no import of hvdlite: the rank wrapper, run by path with
``python -I``, loads this file by path too (see rank_wrapper.py).
"""
import os
import signal
import socket
import struct
import threading
from typing import Dict, List, Mapping, Sequence, Tuple

FRAME_HEADER = struct.Struct("!cI")
MSG_HELLO = b"H"    # wrapper -> launcher, JSON: token, rank, size, host, pid
MSG_STDOUT = b"O"   # wrapper -> launcher, one or more whole lines of the command's stdout
MSG_STDERR = b"E"   # wrapper -> launcher, same for stderr
MSG_EXIT = b"X"     # wrapper -> launcher, JSON: rank, returncode (negative: signal)
MSG_KILL = b"K"     # launcher -> wrapper: end the command now
MSG_HEARTBEAT = b"B"  # both ways, every HEARTBEAT_INTERVAL_S: "still here"
MSG_PEER_LOST = b"L"  # launcher -> wrapper, JSON: ranks, hosts, reason (for the command)
MAX_FRAME = 1 << 24

ENV_ADDR = "HVDLITE_LAUNCHER_ADDR"
ENV_TOKEN = "HVDLITE_LAUNCHER_TOKEN"
ENV_PEER_TIMEOUT = "HVDLITE_PEER_TIMEOUT"
ENV_FAULT_FD = "HVDLITE_FAULT_FD"

HEARTBEAT_INTERVAL_S = 1.0
# Seconds of silence after which the other end of a control connection is lost.
DEFAULT_PEER_TIMEOUT_S = 30.0
# After a lost-peer notice, how long a rank gets to raise (and print why) before it is
# ended.
NOTICE_GRACE_S = 5.0
# Seconds between the wrapper's SIGTERM and SIGKILL when it ends its command (the
# launcher waits this and more after its kill order).
KILL_GRACE_S = 3.0


def encode_frame(kind: bytes, payload: bytes = b"") -> bytes:
    """Returns one protocol frame."""
    return FRAME_HEADER.pack(kind, len(payload)) + payload


class FrameReader:
    """Splits a byte stream into (kind, payload) frames."""

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> List[Tuple[bytes, bytes]]:
        """Adds received bytes; returns the frames now complete.

        Raises:
            ValueError: a frame longer than MAX_FRAME (a corrupt or foreign peer).
        """
        self._buf += data
        frames = []
        while len(self._buf) >= FRAME_HEADER.size:
            kind, length = FRAME_HEADER.unpack_from(self._buf)
            if length > MAX_FRAME:
                raise ValueError("control frame too long")
            end = FRAME_HEADER.size + length
            if len(self._buf) < end:
                break
            frames.append((kind, self._buf[FRAME_HEADER.size:end]))
            self._buf = self._buf[end:]
        return frames


def peer_timeout(env: Mapping[str, str]) -> float:
    """``HVDLITE_PEER_TIMEOUT`` in seconds (default DEFAULT_PEER_TIMEOUT_S).

    Raises:
        ValueError: not a number > 0.
    """
    text = env.get(ENV_PEER_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_PEER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV_PEER_TIMEOUT}={text!r}: expected seconds > 0")
    return value


def write_all(fd: int, data: bytes) -> bool:
    """Writes ``data`` to ``fd`` in as few writes as the pipe allows.

    Both ends write output as batches of whole lines, one write per batch, so lines of
    different ranks sharing a terminal never interleave mid-line; the loop is only for
    the rare partial write.

    Returns:
        False when the reader is gone (a broken pipe), else True.
    """
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BrokenPipeError:
            return False
    return True


class SignalPipe:
    """Signals delivered as bytes on a socket that a selector loop watches.

    Both ends run one selector loop; a handler only writes the signal's number here,
    and the loop acts on it in order with everything else.
    """

    def __init__(self):
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)

    def _on_signal(self, signum, frame):
        try:
            self._writer.send(bytes([signum]))
        except OSError:
            pass

    def install(self, signums: Sequence[int]) -> Dict[int, object]:
        """Routes ``signums`` here; returns the handlers they had.

        Outside the main thread (a launcher run by a library, e.g. hvdlite.ray) nothing
        is routed: signals stay with the main thread's handlers, and :meth:`send` is how
        the loop is told to end.
        """
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._on_signal) for signum in signums}

    def send(self, signum: int):
        """Delivers ``signum`` to the loop as if the process had received it."""
        self._on_signal(signum, None)

    def received(self) -> bytes:
        """The numbers of the signals received since the last call (when readable)."""
        return self.reader.recv(64)
