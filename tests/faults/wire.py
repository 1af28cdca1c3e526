"""A pure-Python model of the core's wire format (native/src/cycle/message.cc).

It is the second, independent reading of the format: the protocol tests encode random
messages here and check that the core parses and re-serializes them to the same bytes.
Keep it in step with message.cc (a version byte, a u32 count, little-endian fields;
strings and lists carry a u32 length).
"""
import struct
from dataclasses import field, make_dataclass

WIRE_VERSION = 1


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


# Each message's fields in wire order, with their encoding and default: a struct format
# for a fixed-size number, "str" (u32 length + UTF-8), "bytes" (u32 length + raw),
# "bool" (u8 0/1) or "ints" (u32 count + little-endian int64s; default empty).
REQUEST_FIELDS = (
    ("rank", "i", 0), ("name", "str", ""), ("op", "i", 0), ("dtype", "i", 6),
    ("shape", "ints", None), ("reduce_op", "i", 1), ("prescale", "d", 1.0),
    ("postscale", "d", 1.0), ("root_rank", "i", 0), ("splits", "ints", None),
    ("process_set", "i", 0), ("device", "i", -1), ("group", "str", ""),
    ("group_size", "i", 0), ("wait_ms", "q", 0), ("refusal", "str", ""),
)
RESPONSE_FIELDS = (
    ("op", "i", 0), ("name", "str", ""), ("error", "str", ""), ("error_code", "i", 0),
    ("dtype", "i", 6), ("on_device", "bool", False), ("shape", "ints", None),
    ("reduce_op", "i", 1), ("prescale", "d", 1.0), ("postscale", "d", 1.0),
    ("root_rank", "i", 0), ("contributors", "i", 0), ("last_joined_rank", "i", -1), ("cacheable", "bool", False),
    ("group", "str", ""), ("first_dims", "ints", None), ("splits", "ints", None),
    ("joined", "bytes", b""), ("targets", "bytes", b""),
)


def _message_class(name, fields):
    return make_dataclass(name, [
        (field_name, object,
         field(default_factory=list) if kind == "ints" else field(default=default))
        for field_name, kind, default in fields])


Request = _message_class("Request", REQUEST_FIELDS)
Response = _message_class("Response", RESPONSE_FIELDS)


def _encode(messages, fields):
    w = _Writer()
    w.put("B", WIRE_VERSION)
    w.put("I", len(messages))
    for message in messages:
        for name, kind, _ in fields:
            value = getattr(message, name)
            if kind in ("str", "bytes"):
                w.string(value)
            elif kind == "ints":
                w.ints(value)
            elif kind == "bool":
                w.put("B", 1 if value else 0)
            else:
                w.put(kind, value)
    return w.bytes()


def _decode(data, fields, cls):
    r = _Reader(data)
    if r.get("B") != WIRE_VERSION:
        raise ValueError("bad version")
    out = []
    for _ in range(r.get("I")):
        message = cls()
        for name, kind, _ in fields:
            if kind == "str":
                value = r.string()
            elif kind == "bytes":
                value = r.raw(r.get("I"))
            elif kind == "ints":
                value = r.ints()
            elif kind == "bool":
                value = bool(r.get("B"))
            else:
                value = r.get(kind)
            setattr(message, name, value)
        out.append(message)
    if r.pos != len(data):
        raise ValueError("trailing bytes")
    return out


def encode_requests(requests):
    return _encode(requests, REQUEST_FIELDS)


def encode_responses(responses):
    return _encode(responses, RESPONSE_FIELDS)


def decode_responses(data):
    return _decode(data, RESPONSE_FIELDS, Response)
