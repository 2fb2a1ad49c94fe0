"""Engine <-> worker messages: exact round trips, clear errors, a real zmq PUSH/PULL over ipc."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import zmq

from ppstate.batch import FreedSlot, NewRequest, SchedulerOutput, StepResult
from runtime import transport as tp
from runtime.sampling_params import SamplingParams


def step_output() -> SchedulerOutput:
    return SchedulerOutput(
        step=7, req_ids=("a", "b", "c"), slots=np.array([3, 0, 5], dtype=np.int32),
        num_scheduled_tokens=np.array([16, 1, 1], dtype=np.int32),
        start_positions=np.array([0, 40, 12], dtype=np.int32),
        is_final_chunk=np.array([False, True, True]),
        new_requests=(NewRequest("a", 3, (1, 2, 3), 40, {"temperature": 0.0, "seed": 5}),),
        freed=(FreedSlot("z", 1, "finished_stopped"),))


def assert_same_output(x: SchedulerOutput, y: SchedulerOutput) -> None:
    assert (x.step, x.req_ids, x.new_requests, x.freed) == (y.step, y.req_ids, y.new_requests, y.freed)
    for f in ("slots", "num_scheduled_tokens", "start_positions", "is_final_chunk"):
        a, b = getattr(x, f), getattr(y, f)
        assert (a.dtype, a.shape, a.tolist()) == (b.dtype, b.shape, b.tolist()), f


def test_scheduler_output_round_trip_non_empty():
    out = step_output()
    msg = tp.decode(tp.encode(tp.from_scheduler_output(out)))
    assert msg.kind == "step" and isinstance(msg, tp.StepMsg)
    back = tp.to_scheduler_output(msg)
    assert_same_output(back, out)
    assert back.new_requests[0].prompt_token_ids == (1, 2, 3)
    assert back.slots.flags.writeable
    assert back.block_digests is None             # not sent: nothing for a rank to compare
    digests = np.array([-7692374666867579918, 0, 2**62], dtype=np.int64)
    out = dataclasses.replace(out, block_digests=digests)
    back = tp.to_scheduler_output(tp.decode(tp.encode(tp.from_scheduler_output(out))))
    assert back.block_digests.dtype == np.int64 and back.block_digests.tolist() == digests.tolist()


def test_scheduler_output_round_trip_empty_and_sampling_override():
    out = SchedulerOutput.empty(3, new_requests=(NewRequest("q", 2, (9,), 5),),
                                freed=(FreedSlot("p", 0, "finished_aborted"),))
    params = SamplingParams(max_tokens=4, temperature=0.0, stop=["x"])
    back = tp.to_scheduler_output(tp.decode(tp.encode(tp.from_scheduler_output(out, {"q": params}))))
    assert back.is_empty and back.step == 3 and back.total_tokens == 0
    assert back.slots.dtype == np.int32 and back.is_final_chunk.dtype == np.bool_
    assert back.freed == (FreedSlot("p", 0, "finished_aborted"),)
    assert back.new_requests[0].sampling == params.model_dump()
    assert SamplingParams(**back.new_requests[0].sampling) == params


@pytest.mark.parametrize("dtype", ["<i4", "<i8", ">i8", "|b1", "<f4", "<u2"])
def test_arrays_keep_dtype_and_shape(dtype):
    a = np.arange(12).reshape(3, 4).astype(dtype)
    nd = msgspec.msgpack.decode(msgspec.msgpack.encode(tp.NdArray.of(a[:, ::2])), type=tp.NdArray)
    b = nd.to_numpy()
    assert b.dtype.str == dtype and b.shape == (3, 2) and b.tolist() == a[:, ::2].tolist()
    z = tp.NdArray.of(np.zeros((0, 2), dtype=dtype)).to_numpy()
    assert z.dtype.str == dtype and z.shape == (0, 2)


def test_step_result_round_trip_and_timing_only():
    res = StepResult(9, np.array([[11], [0], [13]], dtype=np.int64), np.array([1, 0, 1], dtype=np.int32),
                     np.array([0, 0, 0], dtype=np.int32), logprobs=[{"lp": -0.5}, None, {"lp": np.float32(-1.5)}])
    msg = tp.decode(tp.encode(tp.from_step_result(res, rank=1, busy_s=0.25)))
    assert (msg.kind, msg.step, msg.rank, msg.busy_s) == ("result", 9, 1, 0.25)
    back = tp.to_step_result(msg)
    assert back.sampled_token_ids.dtype == np.int64 and back.sampled_token_ids.tolist() == [[11], [0], [13]]
    assert back.num_sampled.dtype == np.int32 and back.num_sampled.tolist() == [1, 0, 1]
    assert back.num_rejected.tolist() == [0, 0, 0]
    assert back.logprobs == [{"lp": -0.5}, None, {"lp": -1.5}]
    t = tp.decode(tp.encode(tp.ResultMsg.timing_only(9, 0, 0.125, dropped_rows=3)))
    assert (t.kind, t.rank, t.busy_s, t.has_result, t.dropped_rows) == ("result", 0, 0.125, False, 3)
    with pytest.raises(tp.TransportError, match="step 9: rank 0 sent no sampled tokens"):
        tp.to_step_result(t)


def test_control_error_ready_round_trip():
    for m in (tp.ControlMsg(kind="shutdown"), tp.ControlMsg(kind="ping"),
              tp.ControlMsg(kind="corrupt_state", rank=1, slot=4, field="num_computed_tokens", delta=-2),
              tp.ReadyMsg(rank=2, info={"layers": [10, 20], "device": "cpu"})):
        assert tp.decode(tp.encode(m)) == m
    assert [tp.decode(tp.encode(m)).kind for m in (tp.ControlMsg(kind="ping"), tp.ReadyMsg(rank=0))] == \
        ["ping", "ready"]
    try:
        raise KeyError("slot 3")
    except KeyError as exc:
        err = tp.ErrorMsg.from_exception(1, 12, exc)
    back = tp.decode(tp.encode(err))
    assert (back.kind, back.rank, back.step, back.error_type, back.message) == \
        ("error", 1, 12, "KeyError", "'slot 3'")
    assert back.traceback.startswith("Traceback") and "KeyError: 'slot 3'" in back.traceback
    with pytest.raises(ValueError, match="corrupt_state needs rank, slot, field and delta"):
        tp.ControlMsg(kind="corrupt_state", rank=0)


@pytest.mark.parametrize("data", [b"", b"\xc1garbage", b"\x93\x01\x02\x03",
                                  msgspec.msgpack.encode({"type": "nope"}),
                                  msgspec.msgpack.encode({"type": "control", "kind": "reboot"}),
                                  msgspec.msgpack.encode({"type": "ready", "rank": "zero"})])
def test_garbage_raises_transport_error(data):
    with pytest.raises(tp.TransportError, match="malformed message") as ei:
        tp.decode(data)
    assert isinstance(ei.value.__cause__, msgspec.DecodeError)


def test_bad_arrays_and_unencodable_payloads():
    msg = tp.from_scheduler_output(step_output())
    msg.slots = tp.NdArray("<i4", (3,), b"\x00" * 8)  # 2 ints for 3 rows
    with pytest.raises(tp.TransportError, match=r"array <i4 \(3,\) needs 12 bytes, got 8"):
        tp.to_scheduler_output(tp.decode(tp.encode(msg)))
    msg.slots = tp.NdArray("<i4", (2,), b"\x00" * 8)
    with pytest.raises(tp.TransportError, match="row arrays"):
        tp.to_scheduler_output(msg)
    with pytest.raises(tp.TransportError, match="bad array dtype 'zz9'"):
        tp.NdArray("zz9", (1,), b"\x00").to_numpy()
    with pytest.raises(tp.TransportError, match="object array"):
        tp.NdArray.of(np.array([object()]))
    with pytest.raises(tp.TransportError, match="cannot encode ReadyMsg"):
        tp.encode(tp.ReadyMsg(rank=0, info={"x": object()}))
    with pytest.raises(tp.TransportError, match="not a message: dict"):
        tp.encode({"type": "ready"})


def test_zmq_push_pull_over_ipc_in_process():
    ctx = zmq.Context()
    addr = tp.ipc_address("test/res:0")
    assert addr.startswith("ipc://") and addr.endswith(".sock") and "test_res_0-" in addr
    assert addr != tp.ipc_address("test/res:0")
    pull = tp.make_pull(ctx, addr, bind=True)
    push = tp.make_push(ctx, addr, bind=False)
    try:
        out = step_output()
        tp.send_msg(push, tp.from_scheduler_output(out))
        tp.send_msg(push, tp.ControlMsg(kind="shutdown"))
        got = tp.recv_msg(pull, timeout_s=5.0)
        assert_same_output(tp.to_scheduler_output(got), out)
        assert tp.recv_msg(pull, timeout_s=5.0) == tp.ControlMsg(kind="shutdown")
        assert tp.recv_msg(pull, timeout_s=0.05) is None
        push.send(b"\x00not msgpack")
        with pytest.raises(tp.TransportError, match="malformed message"):
            tp.recv_msg(pull, timeout_s=5.0)
        with pytest.raises(tp.TransportError, match="cannot bind ipc:///nonexistent-ppstate-dir/"):
            tp.make_pull(ctx, "ipc:///nonexistent-ppstate-dir/x.sock", bind=True)
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_zmq_tcp_wildcard_bind():
    ctx = zmq.Context()
    pull = tp.make_pull(ctx, "tcp://127.0.0.1:*", bind=True)
    push = tp.make_push(ctx, tp.bound_endpoint(pull), bind=False)
    try:
        assert tp.bound_endpoint(pull).startswith("tcp://127.0.0.1:")
        assert tp.tcp_address().startswith("tcp://127.0.0.1:")
        tp.send_msg(push, tp.ReadyMsg(rank=3))
        assert tp.recv_msg(pull, timeout_s=5.0) == tp.ReadyMsg(rank=3)
        with pytest.raises(tp.TransportError, match="cannot bind tcp://127.0.0.1:.*in use"):
            tp.make_pull(ctx, tp.bound_endpoint(pull), bind=True)
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
