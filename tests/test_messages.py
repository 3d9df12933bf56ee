import msgspec
import pytest

from connector import messages as M


def good(**kw):
    lay = M.BlockLayout([M.Region(4096, 64, 64)], 16, 16)
    base = dict(transfer_id="t", request_id="r", engine_id="e", agent_name="a", agent_metadata=b"m", layout=lay, block_ids=[1, 2])
    base.update(kw)
    return M.Register(**base)


def test_roundtrip():
    msg = M.decode_to_prefill(M.encode(good()))
    assert msg == good()
    assert isinstance(M.decode_to_prefill(M.encode(M.Cancel("t"))), M.Cancel)
    assert M.decode_ack(M.encode(M.Ack("t", "failed", "x"))).detail == "x"
    assert M.parse_notif(M.make_notif("abc")) == "abc" and M.parse_notif(b"other") is None


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\x00garbage",
        msgspec.msgpack.encode({"type": "register"}),
        msgspec.msgpack.encode({"type": "nope", "transfer_id": "t"}),
        M.encode(good(block_ids=[99])),
        M.encode(good(block_ids=[1, 1])),
        M.encode(good(transfer_id="")),
        M.encode(good(version=99)),
        M.encode(good(skip_blocks=-1)),
        M.encode(good(agent_metadata=b"")),
        M.encode(M.Cancel("")),
    ],
)
def test_malformed_is_rejected_with_a_reason(data):
    with pytest.raises(M.MalformedMessage):
        M.decode_to_prefill(data)
