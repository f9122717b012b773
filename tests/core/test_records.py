"""The record codec: round trips of every record type, text-only producers, and the clear
errors for malformed input."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from streamrl.records import (DeadLetter, PolicyVersion, Prompt, RecordError, Rewarded, Trajectory,
                              as_plain)
from tests.helpers import trajectory


def test_trajectory_round_trip_keeps_arrays_bit_exact():
    traj = trajectory(full=True)
    back = Trajectory.decode(traj.encode())
    assert as_plain(back) == as_plain(traj)
    logprobs = back.array("response_logprobs")
    assert logprobs.dtype == np.float32
    assert logprobs.tobytes() == np.asarray(traj.response_logprobs).tobytes()  # fp32, bit for bit
    assert back.array("response_ids").dtype == np.int32
    assert back.key == b"g1"


def test_every_record_type_round_trips():
    traj = trajectory(full=True)
    rewarded = Rewarded.from_trajectory(traj, reward=0.1, reward_info={"status": "ok", "rule": 0.1},
                                        scorer={"name": "gsm8k", "version": "1"})
    assert rewarded.reward == float(np.float32(0.1))  # computed in fp32
    records = [
        rewarded,
        Prompt(group_id="p1-e0", group_size=8, data_source="gsm8k", prompt="2+2?", ground_truth="4", epoch=0),
        PolicyVersion(version=3, weights_uri="/tmp/w/v3", trained_records=512, metrics={"loss": 0.5}),
        DeadLetter.for_message(stage="reward", reason="bad_json", detail="x", topic="t", partition=1,
                               offset=9, key=b"k", value=b"\x00\xffraw"),
    ]
    for record in records:
        back = type(record).decode(record.encode())
        assert as_plain(back) == as_plain(record), type(record).__name__
    assert records[-1].original_value() == b"\x00\xffraw"


def test_a_text_only_producer_is_accepted():
    """A producer that is not streamrl writes plain JSON: lists for token arrays, no packing."""
    raw = orjson.dumps({
        "schema": "streamrl.trajectory/1", "id": "t-1", "group_id": "g", "group_size": 1,
        "policy_version": 0, "data_source": "gsm8k", "prompt": "1+1?", "response": "2",
        "ground_truth": "2", "created_at": 1700000000.0, "response_ids": [5, 6, 7],
        "response_logprobs": [-0.5, -1.25, -2.0],
    })
    traj = Trajectory.decode(raw)
    assert traj.array("response_ids").tolist() == [5, 6, 7]
    assert traj.array("response_logprobs").tolist() == [-0.5, -1.25, -2.0]
    assert traj.array("prompt_ids") is None
    # and re-encoding packs it
    assert isinstance(orjson.loads(traj.encode())["response_ids"], dict)


@pytest.mark.parametrize("payload, reason, needle", [
    (b"{not json", "bad_json", ""),
    (b"[1, 2]", "schema", "JSON object"),
    (b'{"schema": "streamrl.trajectory/1"}', "schema", "must contain"),
])
def test_malformed_messages_give_a_reason(payload, reason, needle):
    with pytest.raises(RecordError) as err:
        Trajectory.decode(payload)
    assert err.value.reason == reason
    assert needle in str(err.value)


def test_wrong_types_name_the_field():
    data = orjson.loads(trajectory(full=True).encode())
    data["group_size"] = "4"
    with pytest.raises(RecordError, match="group_size"):
        Trajectory.decode(orjson.dumps(data))
    data = orjson.loads(trajectory(full=True).encode())
    data["surprise"] = 1
    with pytest.raises(RecordError, match="surprise|additional"):
        Trajectory.decode(orjson.dumps(data))


def test_wrong_record_kind_is_rejected():
    with pytest.raises(RecordError, match="reward"):
        Rewarded.decode(trajectory(full=True).encode())


def test_packed_arrays_are_checked():
    data = orjson.loads(trajectory(full=True).encode())
    data["response_logprobs"]["dtype"] = "int32"
    with pytest.raises(RecordError, match="response_logprobs"):
        Trajectory.decode(orjson.dumps(data))
    data = orjson.loads(trajectory(full=True).encode())
    data["response_ids"]["b64"] = base64.b64encode(b"\x01\x02\x03").decode()  # 3 bytes: not int32s
    with pytest.raises(RecordError, match="whole number"):
        Trajectory.decode(orjson.dumps(data))
    data = orjson.loads(trajectory(full=True).encode())
    data["response_ids"]["b64"] = "!!!!" * 4
    traj = Trajectory.decode(orjson.dumps(data))  # the alphabet is checked where arrays are read
    with pytest.raises(RecordError, match="base64"):
        traj.array("response_ids")


def test_oversize_is_a_clear_error_both_ways():
    big = trajectory(full=True, tokens=32_768)
    data = big.encode()
    assert 300_000 < len(data) < 500_000  # a 32k-token trajectory is ~400 KB on the wire
    with pytest.raises(RecordError) as err:
        big.encode(max_bytes=100_000)
    assert err.value.reason == "oversize"
    with pytest.raises(RecordError) as err:
        Trajectory.decode(data, max_bytes=100_000)
    assert err.value.reason == "oversize"


def test_decoding_never_executes_anything():
    """JSON that looks like an object to instantiate stays inert data."""
    data = orjson.loads(trajectory(full=True).encode())
    data["extra_info"] = {"__class__": "os.system", "py/object": "subprocess.Popen", "!!python/object": "x"}
    traj = Trajectory.decode(orjson.dumps(data))
    assert traj.extra_info["py/object"] == "subprocess.Popen"
