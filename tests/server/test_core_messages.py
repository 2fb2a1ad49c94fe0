"""The msgpack messages between API servers and the engine core (``--api-server-count``): a
:class:`RequestOutput` survives the round trip field for field, logprob alternatives keyed by int
token ids included."""

from runtime.engine.faults import SHUTDOWN
from runtime.engine.outputs import RequestOutput, TokenLogprob
from runtime.server.core_messages import decode, encode, pack_output, unpack_output


def round_trip(out: RequestOutput) -> RequestOutput:
    (kind, rows), = [decode(encode(["outs", [pack_output(out)]]))]
    assert kind == "outs" and len(rows) == 1
    return unpack_output(rows[0])


def test_output_with_logprobs_and_timings_round_trips():
    out = RequestOutput("r1", [17, 4], " t17 t4", False, None, 9, 2,
                        [TokenLogprob(17, -0.25, {17: -0.25, 3: -1.5}), TokenLogprob(4, -2.0, {})],
                        scheduled_s=1234.5, queue_s=0.125)
    back = round_trip(out)
    assert back == out
    assert list(back.logprobs[0].top) == [17, 3]   # int keys, order kept


def test_final_error_output_round_trips():
    out = RequestOutput("r2", [], "", True, "abort", 5, 3, None, "the server is shutting down", SHUTDOWN)
    assert round_trip(out) == out
