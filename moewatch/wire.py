"""Frames between an EP runtime and the moewatch agent over a unix stream socket.

Frame layout (docs/protocol.md), all integers little-endian:

    magic  b"MW"   2 bytes
    version        u8   (PROTOCOL_VERSION)
    type           u8   (FrameType)
    length         u32  payload bytes, at most the decoder's max_frame_bytes
    payload        `length` bytes: JSON (UTF-8 object) for hello/plan/ack/heartbeat,
                   the binary Window (telemetry.encode_binary) for window

A decoder that meets a bad header (magic, version, type, oversized length) cannot find the next
frame boundary, so the stream is dead and the peer must reconnect. A frame whose header is fine but
whose payload does not parse is rejected alone and the stream goes on.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Union

from .plan import Plan, PlanError
from .telemetry import Window, WindowError

MAGIC = b"MW"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<2sBBI")
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
# Why an engine adapter lost a window, as its heartbeats report them (extra "windows_lost": cumulative
# counts by reason): it failed validation, a sink raised, the sender's queue was full, a send was cut
# short, it did not encode, it was still queued at shutdown, its counters' copy could not start, the
# timer failed. The agent exports these as the `reason` label; anything else is counted as "other".
WINDOW_LOSS_REASONS = ("invalid", "sink_error", "queue_full", "send_failed", "encode_error", "unsent_at_close",
                       "readout_error", "timer_error")


class FrameType(enum.IntEnum):
    HELLO = 1
    WINDOW = 2
    PLAN = 3
    ACK = 4
    HEARTBEAT = 5


class FrameError(ValueError):
    """A frame was rejected. `fatal` means the stream can no longer be framed."""

    def __init__(self, reason: str, fatal: bool):
        self.reason = reason
        self.fatal = fatal
        super().__init__(reason)


@dataclass(frozen=True)
class Hello:
    """The runtime's identity, sent first on every connection."""

    runtime: str
    model: str
    ep_group: str
    world_size: int
    num_layers: int
    num_experts: int
    num_slots: int
    epoch: int = 0
    ranks_per_node: int = 0
    pid: int = 0
    protocol: int = PROTOCOL_VERSION
    # What the runtime can do: "plan" (applies placement plans), "capacity" (capacity factor).
    capabilities: tuple[str, ...] = ()
    # A process that sends shards of its group's windows (docs/telemetry.md, "Shards"): shard
    # `shard_index` of `shard_count`. The defaults are a whole group's runtime; a hello framed with
    # the defaults leaves both out, so an agent that predates them reads it as before.
    shard_index: int = 0
    shard_count: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "capabilities", tuple(self.capabilities))
        for name in ("runtime", "model", "ep_group"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"hello.{name}: must be a string")
        for name in ("world_size", "num_layers", "num_experts", "num_slots", "epoch", "ranks_per_node",
                     "pid", "protocol", "shard_index", "shard_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"hello.{name}: must be a non-negative integer")
        if self.shard_count < 1:
            raise ValueError("hello.shard_count: must be at least 1")
        if self.shard_index >= self.shard_count:
            raise ValueError(f"hello.shard_index: {self.shard_index} is outside [0, shard_count {self.shard_count})")

    @property
    def sharded(self) -> bool:
        """Whether the process sends shards of its group's windows (one of several)."""
        return self.shard_count > 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.shard_count == 1 and self.shard_index == 0:
            del out["shard_index"], out["shard_count"]
        return out


@dataclass(frozen=True)
class Ack:
    """The runtime's answer to a plan: the epoch now in force, and whether the plan took effect."""

    plan_epoch: int
    epoch_in_force: int
    ok: bool
    error: str = ""
    step: int = 0
    stall_seconds: float = 0.0
    layers_changed: int = 0

    def __post_init__(self) -> None:
        for name in ("plan_epoch", "epoch_in_force", "step", "layers_changed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ack.{name}: must be a non-negative integer")
        if not isinstance(self.ok, bool):
            raise ValueError("ack.ok: must be true or false")
        if not isinstance(self.error, str):
            raise ValueError("ack.error: must be a string")
        if not isinstance(self.stall_seconds, (int, float)) or self.stall_seconds < 0:
            raise ValueError("ack.stall_seconds: must be a non-negative number")


@dataclass(frozen=True)
class Heartbeat:
    time: float
    epoch: int
    step: int
    frames_dropped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.time, (int, float)) or isinstance(self.time, bool):
            raise ValueError("heartbeat.time: must be a number")
        for name in ("epoch", "step", "frames_dropped"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"heartbeat.{name}: must be a non-negative integer")
        if not isinstance(self.extra, dict):
            raise ValueError("heartbeat.extra: must be an object")


Message = Union[Hello, Window, Plan, Ack, Heartbeat]
_TYPE_OF = {Hello: FrameType.HELLO, Window: FrameType.WINDOW, Plan: FrameType.PLAN,
            Ack: FrameType.ACK, Heartbeat: FrameType.HEARTBEAT}


def encode(message: Message, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """One frame carrying `message`. Raises FrameError if it would exceed max_frame_bytes."""
    ftype = _TYPE_OF.get(type(message))
    if ftype is None:
        raise TypeError(f"cannot frame a {type(message).__name__}")
    if ftype is FrameType.WINDOW:
        payload = message.to_bytes()
    elif ftype in (FrameType.PLAN, FrameType.HELLO):
        payload = _json_bytes(message.to_dict())
    else:
        payload = _json_bytes(asdict(message))
    if len(payload) > max_frame_bytes:
        raise FrameError(f"{ftype.name.lower()} frame of {len(payload)} bytes exceeds {max_frame_bytes}", False)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(ftype), len(payload)) + payload


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def decode_payload(ftype: FrameType, payload: bytes) -> Message:
    """Parse one frame's payload; raises FrameError (not fatal) when it does not parse."""
    try:
        if ftype is FrameType.WINDOW:
            return Window.from_bytes(payload)
        data = json.loads(payload, parse_constant=_no_constants)
        if not isinstance(data, dict):
            raise FrameError(f"{ftype.name.lower()} payload is not a JSON object", False)
        if ftype is FrameType.PLAN:
            return Plan.from_dict(data)
        cls = {FrameType.HELLO: Hello, FrameType.ACK: Ack, FrameType.HEARTBEAT: Heartbeat}[ftype]
        return cls(**data)
    except FrameError:
        raise
    except (WindowError, PlanError) as exc:
        raise FrameError(f"{ftype.name.lower()} rejected: {exc}", False) from None
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise FrameError(f"{ftype.name.lower()} payload malformed: {exc}", False) from None


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


class FrameDecoder:
    """Incremental decoder for a byte stream. Feed bytes; iterate decoded messages.

    `feed` returns a list in which each item is a decoded message or a FrameError (rejections are
    values, so one bad frame does not hide the good ones after it). After a fatal error the decoder
    accepts nothing more: the connection must be closed.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self.failed: FrameError | None = None

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Union[Message, FrameError]]:
        if self.failed is not None:
            return [self.failed]
        self._buffer.extend(data)
        out: list[Union[Message, FrameError]] = []
        while len(self._buffer) >= HEADER.size:
            magic, version, ftype_raw, length = HEADER.unpack_from(self._buffer)
            problem = None
            if magic != MAGIC:
                problem = f"bad magic {bytes(magic)!r}"
            elif version != PROTOCOL_VERSION:
                problem = f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})"
            elif ftype_raw not in FrameType._value2member_map_:
                problem = f"unknown frame type {ftype_raw}"
            elif length > self.max_frame_bytes:
                problem = f"frame of {length} bytes exceeds the maximum of {self.max_frame_bytes}"
            if problem:
                self.failed = FrameError(problem, True)
                self._buffer.clear()
                out.append(self.failed)
                return out
            if len(self._buffer) < HEADER.size + length:
                break
            payload = bytes(self._buffer[HEADER.size:HEADER.size + length])
            del self._buffer[:HEADER.size + length]
            try:
                out.append(decode_payload(FrameType(ftype_raw), payload))
            except FrameError as exc:
                out.append(exc)
        return out

    def finish(self) -> FrameError | None:
        """At end of stream: an error if a frame was cut short."""
        if self.failed is None and self._buffer:
            return FrameError(f"stream ended inside a frame ({len(self._buffer)} bytes left over)", True)
        return None


def read_messages(sock: socket.socket, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                  chunk: int = 1 << 16) -> Iterator[Union[Message, FrameError]]:
    """Blocking generator over one connection until EOF or a fatal error."""
    decoder = FrameDecoder(max_frame_bytes)
    while True:
        data = sock.recv(chunk)
        if not data:
            tail = decoder.finish()
            if tail is not None:
                yield tail
            return
        for item in decoder.feed(data):
            yield item
            if isinstance(item, FrameError) and item.fatal:
                return
