"""The emulated engine's core on a fake connector (fast, deterministic): batching,
block accounting, the P hand-over and D's wait for KV, recompute on a failed push."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpath.testbed.emulated_core import EmulatedEngine, EmuRequest, EngineSpec


class FixedModel:
    """prefill 1 ms per 1000 tokens per iteration, decode 1 ms per iteration."""

    def __init__(self) -> None:
        self.prefill_batches: list[list[int]] = []
        self.decode_batches: list[int] = []

    def prefill_time(self, tokens: list[int]) -> float:
        self.prefill_batches.append(list(tokens))
        return sum(tokens) / 1e6

    def decode_time(self, contexts: list[int]) -> float:
        self.decode_batches.append(len(contexts))
        return 0.001


class FakeSender:
    def __init__(self) -> None:
        self.submitted: list[tuple] = []
        self.done: set[str] = set()
        self.events: list[tuple] = []  # layer-wise: ("begin", rid, forward, layers) | ("layers", forward, n, at)

    def begin(self, request_id, transfer_id, block_ids, lane, lease_id, transfer_key, forward, layers) -> None:
        self.events.append(("begin", request_id, forward, layers))

    def layers_done(self, forward, n) -> None:
        self.events.append(("layers", forward, n, time.monotonic()))

    def forward_done(self, forward, layers) -> None:
        self.events.append(("end", forward, layers, time.monotonic()))

    def submit_finished(self, request_id, transfer_id, block_ids, lane=None, lease_id=None, transfer_key="") -> None:
        self.submitted.append((request_id, transfer_id, list(block_ids), lane, lease_id))

    def take_finished(self) -> set[str]:
        out, self.done = self.done, set()
        return out


class FakeReceiver:
    def __init__(self) -> None:
        self.registered: list[tuple] = []
        self.released: set[str] = set()
        self.failed: set[str] = set()
        self.cancelled: list[str] = []

    def register(self, request_id, transfer_id, peer, block_ids, skip_blocks=0, peer_key=None, transfer_key="") -> None:
        self.registered.append((request_id, transfer_id, peer, list(block_ids)))

    def cancel(self, request_id) -> None:
        self.cancelled.append(request_id)

    def take(self):
        out = (self.released, self.failed)
        self.released, self.failed = set(), set()
        return out


def test_prefill_batches_by_token_budget_hands_blocks_to_the_sender_and_frees_them_after():
    async def main():
        model, sender = FixedModel(), FakeSender()
        eng = EmulatedEngine(EngineSpec("prefill", kv_bytes_per_token=100, num_blocks=64, max_batch_tokens=300),
                             model, sender=sender)
        eng.start()
        reqs = [EmuRequest(f"r{i}", 100, 1, transfer_id=f"t{i}", lane=i % 2, lease_id=f"l{i}") for i in range(5)]
        await asyncio.gather(*(eng.prefill(r) for r in reqs))
        assert model.prefill_batches == [[100, 100, 100], [100, 100]]  # 300 tokens per iteration
        assert [s[1] for s in sender.submitted] == ["t0", "t1", "t2", "t3", "t4"]
        assert [len(s[2]) for s in sender.submitted] == [7] * 5  # ceil(100 / 16)
        assert sender.submitted[3][3:] == (1, "l3")
        assert len(eng.pool.free_ids) == 64 - 35  # held until the sender says the push ended
        sender.done = {"r0", "r1", "r2", "r3", "r4"}
        await asyncio.sleep(0.05)
        assert len(eng.pool.free_ids) == 64
        await eng.stop()

    asyncio.run(main())


def test_a_layer_wise_prefill_begins_its_pushes_reports_each_group_in_time_and_commits_after():
    async def main():
        sender = FakeSender()
        spec = EngineSpec("prefill", kv_bytes_per_token=100, num_blocks=20000, layers=8, push_granularity="layer",
                          layer_group=2, max_batch_tokens=200_000)
        model = FixedModel()
        eng = EmulatedEngine(spec, model, sender=sender)
        eng.start()
        t0 = time.monotonic()
        reqs = [EmuRequest(f"r{i}", 100_000, 1, transfer_id=f"t{i}") for i in range(2)]  # 0.2 s together
        await asyncio.gather(*(eng.prefill(r) for r in reqs))
        begins = [e for e in sender.events if e[0] == "begin"]
        assert [(e[1], e[2], e[3]) for e in begins] == [("r0", 1, 8), ("r1", 1, 8)]
        assert sender.events[:2] == begins  # begun before the iteration's layers
        layers = [e for e in sender.events if e[0] == "layers"]
        assert [e[2] for e in layers] == [2, 4, 6] and sender.events[-1][:3] == ("end", 1, 8)
        # group k reported when its share of the 0.2 s passed (k/4 of it), never before
        for (_, _, n, at) in layers:
            assert at - t0 >= 0.2 * n / 8 - 0.005
        assert [s[0] for s in sender.submitted] == ["r0", "r1"]  # the commit: after the iteration
        assert all(r.prefill_end >= r.prefill_start + 0.2 - 0.005 for r in reqs)
        await eng.stop()

    asyncio.run(main())


def test_a_prefill_waits_for_blocks_while_pushes_hold_them():
    async def main():
        sender = FakeSender()
        eng = EmulatedEngine(EngineSpec("prefill", kv_bytes_per_token=100, num_blocks=10), FixedModel(), sender=sender)
        eng.start()
        await eng.prefill(EmuRequest("a", 160, 1, transfer_id="ta"))  # 10 blocks: all of them
        second = asyncio.create_task(eng.prefill(EmuRequest("b", 16, 1, transfer_id="tb")))
        await asyncio.sleep(0.05)
        assert not second.done()
        sender.done = {"a"}
        await asyncio.wait_for(second, 2)
        await eng.stop()

    asyncio.run(main())


def test_decode_waits_for_the_kv_decodes_in_one_batch_and_recomputes_a_failed_push():
    async def main():
        model, recv = FixedModel(), FakeReceiver()
        eng = EmulatedEngine(EngineSpec("decode", kv_bytes_per_token=100, num_blocks=64), model, receiver=recv)
        eng.start()
        a = EmuRequest("a", 40, 3, transfer_id="ta", peer="10.0.2.1:5600")
        b = EmuRequest("b", 40, 3, transfer_id="tb", peer="10.0.2.1:5600")
        outs: dict[str, list[int]] = {}

        async def consume(r):
            outs[r.request_id] = [t async for t in eng.generate(r)]

        tasks = [asyncio.create_task(consume(r)) for r in (a, b)]
        await asyncio.sleep(0.05)
        assert [x[0] for x in recv.registered] == ["a", "b"]
        assert [len(x[3]) for x in recv.registered] == [3, 3]  # the prompt's blocks, ceil(40 / 16)
        assert not outs and model.decode_batches == []  # nothing decodes before its KV is here
        recv.released = {"a", "b"}
        recv.failed = {"b"}  # b's push failed: D computes its prompt itself
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        assert outs == {"a": [0, 1, 2], "b": [0, 1, 2]}
        assert model.prefill_batches == [[40]]  # only b was recomputed
        assert model.decode_batches == [2, 2, 2]  # a and b decoded together
        assert b.recomputed and not a.recomputed and eng.counters["recomputed"] == 1
        assert a.first_token is not None and a.kv_ready <= a.decode_start <= a.first_token <= a.completion
        assert len(eng.pool.free_ids) == 64
        await eng.stop()

    asyncio.run(main())


def test_an_aborted_decode_frees_its_blocks_only_when_the_receiver_releases_them():
    async def main():
        recv = FakeReceiver()
        eng = EmulatedEngine(EngineSpec("decode", kv_bytes_per_token=100, num_blocks=64), FixedModel(), receiver=recv)
        eng.start()
        r = EmuRequest("a", 40, 3, transfer_id="ta", peer="10.0.2.1:5600")
        gen = eng.generate(r)
        task = asyncio.create_task(gen.__anext__())
        await asyncio.sleep(0.05)
        eng.abort(r)
        assert recv.cancelled == ["a"]
        await asyncio.sleep(0.05)
        assert len(eng.pool.free_ids) < 64  # a WRITE may still land: blocks held
        recv.released = {"a"}
        await asyncio.sleep(0.05)
        assert len(eng.pool.free_ids) == 64 and r.status == "aborted"
        task.cancel()
        await eng.stop()

    asyncio.run(main())


def test_spec_validates_the_role():
    with pytest.raises(ValueError, match="role"):
        EmulatedEngine(EngineSpec("both", kv_bytes_per_token=1), FixedModel())
