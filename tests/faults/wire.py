"""A pure-Python model of the core's wire format (native/src/cycle/message.cc).

It is the second, independent reading of the format: the protocol tests encode random
messages here and check that the core parses and re-serializes them to the same bytes.
Keep it in step with message.cc (a version byte, a u32 count, little-endian fields;
strings and lists carry a u32 length).
"""
import struct
from dataclasses import dataclass, field
from typing import List

WIRE_VERSION = 1


@dataclass
class Request:
    rank: int = 0
    name: str = ""
    op: int = 0
    dtype: int = 6
    shape: List[int] = field(default_factory=list)
    reduce_op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    root_rank: int = 0
    splits: List[int] = field(default_factory=list)
    process_set: int = 0
    device: int = -1
    group: str = ""
    group_size: int = 0
    wait_ms: int = 0
    refusal: str = ""


@dataclass
class Response:
    op: int = 0
    name: str = ""
    error: str = ""
    error_code: int = 0
    dtype: int = 6
    shape: List[int] = field(default_factory=list)
    reduce_op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    root_rank: int = 0
    contributors: int = 0
    last_joined_rank: int = -1
    cacheable: bool = False
    group: str = ""
    first_dims: List[int] = field(default_factory=list)
    splits: List[int] = field(default_factory=list)
    joined: bytes = b""
    targets: bytes = b""


class _Writer:
    def __init__(self):
        self.parts = []

    def put(self, fmt, value):
        self.parts.append(struct.pack("<" + fmt, value))

    def string(self, s):
        data = s.encode("utf-8") if isinstance(s, str) else bytes(s)
        self.put("I", len(data))
        self.parts.append(data)

    def ints(self, values):
        self.put("I", len(values))
        self.parts.append(struct.pack(f"<{len(values)}q", *values))

    def bytes(self):
        return b"".join(self.parts)


class _Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def get(self, fmt):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise ValueError("truncated")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def raw(self, n):
        if self.pos + n > len(self.data):
            raise ValueError("truncated")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def string(self):
        return self.raw(self.get("I")).decode("utf-8", "surrogateescape")

    def ints(self):
        n = self.get("I")
        return list(struct.unpack("<%dq" % n, self.raw(8 * n)))


def encode_requests(requests):
    w = _Writer()
    w.put("B", WIRE_VERSION)
    w.put("I", len(requests))
    for q in requests:
        w.put("i", q.rank)
        w.string(q.name)
        w.put("i", q.op)
        w.put("i", q.dtype)
        w.ints(q.shape)
        w.put("i", q.reduce_op)
        w.put("d", q.prescale)
        w.put("d", q.postscale)
        w.put("i", q.root_rank)
        w.ints(q.splits)
        w.put("i", q.process_set)
        w.put("i", q.device)
        w.string(q.group)
        w.put("i", q.group_size)
        w.put("q", q.wait_ms)
        w.string(q.refusal)
    return w.bytes()


def encode_responses(responses):
    w = _Writer()
    w.put("B", WIRE_VERSION)
    w.put("I", len(responses))
    for p in responses:
        w.put("i", p.op)
        w.string(p.name)
        w.string(p.error)
        w.put("i", p.error_code)
        w.put("i", p.dtype)
        w.ints(p.shape)
        w.put("i", p.reduce_op)
        w.put("d", p.prescale)
        w.put("d", p.postscale)
        w.put("i", p.root_rank)
        w.put("i", p.contributors)
        w.put("i", p.last_joined_rank)
        w.put("B", 1 if p.cacheable else 0)
        w.string(p.group)
        w.ints(p.first_dims)
        w.ints(p.splits)
        w.string(p.joined)
        w.string(p.targets)
    return w.bytes()


def decode_responses(data):
    r = _Reader(data)
    if r.get("B") != WIRE_VERSION:
        raise ValueError("bad version")
    out = []
    for _ in range(r.get("I")):
        p = Response()
        p.op = r.get("i")
        p.name = r.string()
        p.error = r.string()
        p.error_code = r.get("i")
        p.dtype = r.get("i")
        p.shape = r.ints()
        p.reduce_op = r.get("i")
        p.prescale = r.get("d")
        p.postscale = r.get("d")
        p.root_rank = r.get("i")
        p.contributors = r.get("i")
        p.last_joined_rank = r.get("i")
        p.cacheable = bool(r.get("B"))
        p.group = r.string()
        p.first_dims = r.ints()
        p.splits = r.ints()
        p.joined = r.raw(r.get("I"))
        p.targets = r.raw(r.get("I"))
        out.append(p)
    if r.pos != len(data):
        raise ValueError("trailing bytes")
    return out
