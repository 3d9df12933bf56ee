import msgspec
import pytest

from kvpath.connector import messages as M

LAY = M.BlockLayout([M.Region(4096, 64, 64)], 16, 16)


def good(**kw):
    base = dict(transfer_id="t", request_id="r", agent_name="a", block_ids=[1, 2])
    base.update(kw)
    return M.Register(**base)


def hello(**kw):
    base = dict(engine_id="e", agent_name="a", agent_metadata=b"m", layout=LAY, compat=M.Compat(), instance="i",
                heartbeat_s=1.0)
    base.update(kw)
    return M.Hello(**base)


def test_roundtrip():
    assert M.decode_to_prefill(M.encode(good())) == good()
    assert M.decode_to_prefill(M.encode(hello())) == hello()
    assert isinstance(M.decode_to_prefill(M.encode(M.Cancel("t"))), M.Cancel)
    ack = M.decode_to_decode(M.encode(M.Ack("t", "failed", "x", posted=True)))
    assert ack.detail == "x" and ack.posted
    assert M.decode_to_decode(M.encode(M.Pending(["a", "b"]))).transfer_ids == ["a", "b"]
    assert M.decode_to_decode(M.encode(M.Welcome("i", False, "dtype", "d"))).field == "dtype"
    assert M.parse_notif(M.make_notif("abc")) == "abc" and M.parse_notif(b"other") is None


def test_ack_and_welcome_name_the_p_process_and_its_agents_and_old_ones_decode_as_unknown():
    ack = M.decode_to_decode(M.encode(M.Ack("t", "cancelled", instance="pA")))
    assert ack.instance == "pA" and not ack.posted
    w = M.decode_to_decode(M.encode(M.Welcome("pA", True, lanes=[("10.0.0.1", 4000)], agents=["pA-lane0"])))
    assert w.agents == ["pA-lane0"] and w.lanes == [("10.0.0.1", 4000)]
    # An older P's messages: no instance (D treats it as unknown), no agents.
    old_ack = M.decode_to_decode(msgspec.msgpack.encode({"type": "ack", "transfer_id": "t", "status": "cancelled"}))
    assert old_ack.instance == ""
    old_welcome = M.decode_to_decode(msgspec.msgpack.encode({"type": "welcome", "instance": "pA", "ok": True}))
    assert old_welcome.agents == []


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\x00garbage",
        msgspec.msgpack.encode({"type": "register"}),
        msgspec.msgpack.encode({"type": "nope", "transfer_id": "t"}),
        M.encode(good(block_ids=[-1])),
        M.encode(good(block_ids=[1, 1])),
        M.encode(good(transfer_id="")),
        M.encode(good(agent_name="")),
        M.encode(good(skip_blocks=-1)),
        M.encode(good(post_by_s=0)),
        M.encode(good(post_by_s=float("inf"))),
        M.encode(good(post_by_s=float("nan"))),
        M.encode(good(post_by_s=M.MAX_POST_BY_S * 2)),
        M.encode(hello(version=99)),
        M.encode(hello(agent_metadata=b"")),
        M.encode(hello(layout=M.BlockLayout([], 16, 16))),
        M.encode(hello(heartbeat_s=0)),
        M.encode(hello(heartbeat_s=1e-6)),
        M.encode(hello(heartbeat_s=float("nan"))),
        M.encode(hello(heartbeat_s=1e9)),
        M.encode(hello(compat=M.Compat(tp_size=2, tp_rank=2))),
        M.encode(hello(compat=M.Compat(tp_size=2, tp_rank=-1))),
        M.encode(hello(compat=M.Compat(tp_size=0, tp_rank=0))),
        M.encode(hello(compat=M.Compat(tp_size=M.MAX_TP_SIZE + 1, tp_rank=0))),
        M.encode(hello(compat=M.Compat(kv_heads=-1))),
        M.encode(hello(compat=M.Compat(kv_heads=M.MAX_KV_HEADS + 1))),
        M.encode(M.Cancel("")),
        M.encode(M.Cancel("t\x001")),  # P keys a transfer's flows with a NUL
        M.encode(good(transfer_id="t\x001")),
    ],
)
def test_malformed_is_rejected_with_a_reason(data):
    with pytest.raises(M.MalformedMessage):
        M.decode_to_prefill(data)


def test_compat_names_the_first_differing_field():
    p = M.Compat(model="tiny", dtype="float32", block_size=32, kv_layout="4x[8192]")
    assert p.mismatch(p) is None and p.digest() == M.Compat(**{f: getattr(p, f) for f in p.__struct_fields__}).digest()
    field, msg = p.mismatch(M.Compat(model="tiny", dtype="bfloat16", block_size=32, kv_layout="4x[8192]"))
    assert field == "dtype" and "float32" in msg and "bfloat16" in msg
    assert p.mismatch(M.Compat(model="tiny", dtype="float32", block_size=32, kv_layout="4x[8192]", tp_size=2))[0] == "tp_size"
    assert p.digest() != M.Compat(model="other").digest()


def test_a_hello_of_another_version_is_told_apart_from_a_malformed_one():
    with pytest.raises(M.WrongVersion, match="protocol version 99, expected"):
        M.decode_to_prefill(M.encode(hello(version=99)))
    assert M.decode_to_prefill(M.encode(hello(compat=M.Compat(kv_heads=M.MAX_KV_HEADS)))).compat.kv_heads == M.MAX_KV_HEADS

