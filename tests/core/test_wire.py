"""Frames: every type round-trips; bad frames are rejected with a reason; the decoder never crashes."""

from __future__ import annotations

import json
import socket
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moewatch import wire
from moewatch.tools.examples import scenario, simulate
from moewatch.plan import Plan, PlanError
from moewatch.telemetry import Window
from moewatch.wire import Ack, FrameDecoder, FrameError, FrameType, Heartbeat, Hello

WINDOW = simulate(scenario("overflow", steps=2), seed=2)
PLAN = Plan(epoch=7, physical_to_logical_map=np.tile(np.arange(16), (4, 1)), capacity_factor=[1.25] * 4,
            reason="replicate expert 3", meta={"predicted_gain": 0.2})
MESSAGES = [
    Hello(runtime="moewatch-runtime", model="m", ep_group="g", world_size=4, num_layers=4, num_experts=16,
          num_slots=16, epoch=3, ranks_per_node=4, pid=123, capabilities=("plan", "capacity")),
    WINDOW,
    PLAN,
    Ack(plan_epoch=7, epoch_in_force=7, ok=True, step=120, stall_seconds=0.03, layers_changed=2),
    Ack(plan_epoch=8, epoch_in_force=7, ok=False, error="rank 2 failed to receive layer 1"),
    Heartbeat(time=1790000000.5, epoch=7, step=121, frames_dropped=4),
]


def same(a, b) -> bool:
    if isinstance(a, Window):
        return a.to_json() == b.to_json()
    if isinstance(a, Plan):
        return a.to_dict() == b.to_dict()
    return a == b


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_frame_type_round_trips(message):
    frame = wire.encode(message)
    (decoded,) = FrameDecoder().feed(frame)
    assert type(decoded) is type(message) and same(decoded, message)


def test_a_stream_split_at_every_byte_decodes_the_same():
    stream = b"".join(wire.encode(m) for m in MESSAGES)
    decoder = FrameDecoder()
    out = []
    for i in range(len(stream)):
        out.extend(decoder.feed(stream[i:i + 1]))
    assert [type(m) for m in out] == [type(m) for m in MESSAGES]
    assert all(same(a, b) for a, b in zip(out, MESSAGES))
    assert decoder.finish() is None


def header(ftype=FrameType.HEARTBEAT, length=0, magic=b"MW", version=wire.PROTOCOL_VERSION) -> bytes:
    return wire.HEADER.pack(magic, version, int(ftype), length)


@pytest.mark.parametrize("raw,reason", [
    (header(magic=b"XX"), "bad magic"),
    (header(version=9), "protocol version 9"),
    (struct.pack("<2sBBI", b"MW", 1, 42, 0), "unknown frame type"),
    (header(length=10**9), "exceeds the maximum"),
])
def test_bad_headers_are_fatal_with_a_reason(raw, reason):
    decoder = FrameDecoder()
    (err,) = decoder.feed(raw + wire.encode(MESSAGES[-1]))
    assert isinstance(err, FrameError) and err.fatal and reason in err.reason
    assert decoder.feed(wire.encode(MESSAGES[-1])) == [decoder.failed]  # nothing more is accepted


def test_max_frame_size_is_enforced_both_ways():
    small = FrameDecoder(max_frame_bytes=1024)
    (err,) = small.feed(wire.encode(WINDOW))
    assert err.fatal and "exceeds" in err.reason
    with pytest.raises(FrameError):
        wire.encode(WINDOW, max_frame_bytes=1024)


@pytest.mark.parametrize("ftype,payload,reason", [
    (FrameType.HEARTBEAT, b"{not json", "malformed"),
    (FrameType.HEARTBEAT, b"[1, 2]", "not a JSON object"),
    (FrameType.ACK, json.dumps({"plan_epoch": -1, "epoch_in_force": 0, "ok": True}).encode(), "plan_epoch"),
    (FrameType.HELLO, json.dumps({"runtime": "x"}).encode(), "malformed"),
    (FrameType.PLAN, json.dumps({"epoch": 1, "physical_to_logical_map": [[0, 1]], "capacity_factor": [1, 2]}).encode(),
     "capacity_factor"),
    (FrameType.WINDOW, b"MWW1garbage", "window rejected"),
    (FrameType.HEARTBEAT, b'{"time": NaN, "epoch": 0, "step": 0}', "malformed"),
])
def test_a_bad_payload_is_rejected_alone_and_the_stream_goes_on(ftype, payload, reason):
    bad = wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, int(ftype), len(payload)) + payload
    out = FrameDecoder().feed(bad + wire.encode(MESSAGES[-1]))
    assert isinstance(out[0], FrameError) and not out[0].fatal and reason in out[0].reason
    assert out[1] == MESSAGES[-1]


def test_a_stream_cut_inside_a_frame_is_reported():
    decoder = FrameDecoder()
    frame = wire.encode(WINDOW)
    assert decoder.feed(frame[:-10]) == []
    err = decoder.finish()
    assert err is not None and err.fatal and "ended inside a frame" in err.reason


def test_read_messages_over_a_real_socket_pair():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(wire.encode(m) for m in MESSAGES))
        a.shutdown(socket.SHUT_WR)
        got = list(wire.read_messages(b))
    assert [type(m) for m in got] == [type(m) for m in MESSAGES]


def test_plan_validates_against_runtime_sizes():
    PLAN.check_against(num_layers=4, num_experts=16, num_slots=16, world_size=4)
    with pytest.raises(PlanError, match="shape"):
        PLAN.check_against(num_layers=4, num_experts=16, num_slots=20, world_size=4)
    with pytest.raises(PlanError, match="negative expert id"):
        Plan(1, [[0, -1]], [0.0])
    missing = Plan(1, np.zeros((1, 4), dtype=int), [0.0])
    with pytest.raises(PlanError, match="expert 1 has no slot"):
        missing.check_against(1, 2, 4, 2)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), chunk=st.integers(1, 64))
def test_decoder_never_crashes_on_random_bytes(data, chunk):
    decoder = FrameDecoder(max_frame_bytes=4096)
    for i in range(0, len(data), chunk):
        for item in decoder.feed(data[i:i + chunk]):
            assert isinstance(item, (FrameError, Hello, Window, Plan, Ack, Heartbeat))
    decoder.finish()


VALID_STREAM = b"".join(wire.encode(m) for m in MESSAGES if not isinstance(m, Window))


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, len(VALID_STREAM) - 1), byte=st.integers(0, 255),
       cut=st.integers(0, len(VALID_STREAM)))
def test_decoder_never_crashes_on_mutated_frames(position, byte, cut):
    mutated = bytearray(VALID_STREAM)
    mutated[position] = byte
    decoder = FrameDecoder()
    for item in decoder.feed(bytes(mutated[:cut])):
        assert isinstance(item, (FrameError, Hello, Plan, Ack, Heartbeat))
    decoder.finish()
