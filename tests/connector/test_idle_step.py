"""A step that runs no model waits in the workers for a result instead of spinning
(issue 21: at TP > 1 back-to-back empty steps starved every other thread)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvpath.connector.config import ConfigError, KVPathConfig
from kvpath.connector.push_state import FinishedPrefill
from kvpath.connector.vllm_scheduler import KVPathMetadata, KVPathScheduler, SendReq
from kvpath.connector.vllm_worker import KVPathWorker


def test_the_wait_is_on_at_tp_above_one_only_by_default():
    cfg = KVPathConfig()
    assert cfg.idle_step_wait_s(1) == 0.0
    assert cfg.idle_step_wait_s(2) == pytest.approx(0.02)
    assert KVPathConfig.from_extra_config({"idle_step_wait_ms": 5, "control_plaintext": True}).idle_step_wait_s(1) == pytest.approx(0.005)
    assert KVPathConfig.from_extra_config({"idle_step_wait_ms": 0, "control_plaintext": True}).idle_step_wait_s(4) == 0.0


@pytest.mark.parametrize("bad", [-2, 1001])
def test_a_bad_wait_names_the_knob(bad):
    with pytest.raises(ConfigError, match="idle_step_wait_ms"):
        KVPathConfig.from_extra_config({"idle_step_wait_ms": bad, "control_plaintext": True})


def _d_scheduler() -> KVPathScheduler:
    """A decode engine's scheduler side, prefix caching on, block size 32."""
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=32, enable_prefix_caching=True),
                           kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return KVPathScheduler(vcfg, KVPathConfig(), "d-engine")


def _scheduler() -> KVPathScheduler:
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=32),
                           kv_transfer_config=SimpleNamespace(kv_role="kv_producer"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return KVPathScheduler(vcfg, KVPathConfig(), "p-engine")


@pytest.mark.parametrize("tokens, idle", [(0, True), (7, False)])
def test_the_scheduler_marks_a_step_that_runs_no_model(tokens, idle):
    meta = _scheduler().build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=tokens))
    assert meta.idle is idle


class FakeSender:
    """What the worker uses of the writer: commands in, results out, one event."""

    def __init__(self):
        self.results_ready = threading.Event()
        self.finished: set[str] = set()
        self.submitted: list[str] = []

    def submit_finished(self, request_id, *args, **kw):
        self.submitted.append(request_id)

    def abort(self, tid):
        pass

    def has_results(self) -> bool:
        return bool(self.finished)

    def take_finished(self) -> set[str]:
        out, self.finished = self.finished, set()
        return out


def _worker(tp_size: int, sender: FakeSender) -> KVPathWorker:
    w = KVPathWorker(KVPathConfig(), "p-engine", "kv_producer", 32, 16, compat={"tp_size": tp_size})
    w.sender = sender
    sender.results_ready = w.results_ready  # as register_kv_caches wires it
    return w


def test_an_idle_step_returns_when_a_result_comes_not_at_its_timeout():
    s = FakeSender()
    w = _worker(2, s)
    w.idle_wait_s = 60.0  # a missed wake-up would hold this test for a minute and fail it

    def finish():
        s.finished.add("r1")
        s.results_ready.set()

    threading.Timer(0.05, finish).start()
    w.process_metadata(KVPathMetadata(idle=True))
    assert w.transfer_results()[0] == {"r1"}


def test_a_result_already_there_ends_the_wait_at_once():
    s = FakeSender()
    s.finished.add("r0")
    w = _worker(2, s)
    assert w.wait_for_results(60.0) is True


def test_nothing_to_report_waits_out_its_bound():
    w = _worker(2, FakeSender())
    assert w.wait_for_results(0.01) is False


def test_a_step_that_runs_the_model_does_not_wait():
    s = FakeSender()
    w = _worker(2, s)
    w.idle_wait_s = 60.0
    w.process_metadata(KVPathMetadata(idle=False, finished=[SendReq("r2", "t2", [1, 2], None)]))
    assert s.submitted == ["r2"]  # and it returned: no wait on a step with model work


def test_tp_one_never_waits():
    w = _worker(1, FakeSender())
    assert w.idle_wait_s == 0.0
    w.process_metadata(KVPathMetadata(idle=True))


def test_the_writer_sets_the_event_when_a_push_ends():
    from tests.connector.engine_doubles import bare_sender

    writer = bare_sender()
    ev = writer.results_ready = threading.Event()  # the worker shares its own event (vllm_worker)
    writer.freed.release(FinishedPrefill("r3", "t3", [4], None, None))
    assert ev.is_set() and writer.take_finished() == {"r3"}


def test_the_receiver_sets_the_event_after_a_step_that_released_also_one_that_failed():
    from tests.connector.engine_doubles import bare_receiver

    rx = bare_receiver()
    ev = rx.results_ready

    def body():
        rx.state.released.add("d1")
        raise RuntimeError("mid-step")

    rx.step_body = body
    with pytest.raises(RuntimeError):
        rx.step()
    assert ev.is_set() and rx.has_results()
    ev.clear()
    rx.state.released.clear()
    rx.step_body = lambda: None
    rx.step()  # a step that released nothing wakes nobody
    assert not ev.is_set() and not rx.has_results()


def test_children_of_an_n_above_one_request_share_one_push_on_d():
    """Issue 32: vLLM serves ``n`` > 1 as child requests with the same prompt and
    kv_transfer_params. One child registers the transfer; the others wait (None: asked
    again next step) until its KV has landed and its full blocks are in D's prefix
    cache, then compute under a block locally. They never register a second time."""
    from kvpath.connector.params import decode_leg_params

    s = _d_scheduler()
    params = decode_leg_params("t1", "127.0.0.1:5600", transfer_key="k" * 24)
    kids = [SimpleNamespace(request_id=f"{i}_cmpl-x", prompt_token_ids=list(range(100)),
                            kv_transfer_params=dict(params, kvpath=dict(params["kvpath"]))) for i in range(2)]
    blocks = SimpleNamespace(get_block_ids=lambda: [[1, 2, 3, 4]], get_unhashed_block_ids=lambda: [1, 2, 3, 4])
    assert s.get_num_new_matched_tokens(kids[0], 0) == (100, True)
    s.update_state_after_alloc(kids[0], blocks, 100)
    assert [r.request_id for r in s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0)).registrations] \
        == ["0_cmpl-x"]
    assert s.get_num_new_matched_tokens(kids[1], 0) == (None, False)  # the push has not landed
    s.update_connector_output(SimpleNamespace(finished_sending=(), finished_recving={"0_cmpl-x"}))
    assert s.get_num_new_matched_tokens(kids[1], 0) == (None, False)  # landed, not cached yet
    assert s.get_num_new_matched_tokens(kids[1], 96) == (0, False)  # 3 full blocks from the cache
    assert kids[1].kv_transfer_params["do_remote_prefill"] is False
    assert s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0)).registrations == []
    # the owner ended (a failed push, an abort): a waiting child computes its prefill itself
    kid2 = SimpleNamespace(request_id="2_cmpl-x", prompt_token_ids=list(range(100)),
                           kv_transfer_params=dict(params, kvpath=dict(params["kvpath"])))
    s.request_finished(SimpleNamespace(request_id="0_cmpl-x", kv_transfer_params=kids[0].kv_transfer_params,
                                       status=None), [1, 2, 3, 4])
    assert s.get_num_new_matched_tokens(kid2, 32) == (0, False)  # never a second registration of a spent id
    assert kid2.kv_transfer_params["do_remote_prefill"] is False


def test_another_prompt_under_a_taken_transfer_id_is_not_a_sibling():
    from kvpath.connector.params import decode_leg_params

    s = _d_scheduler()
    params = decode_leg_params("t1", "127.0.0.1:5600")
    owner = SimpleNamespace(request_id="a", prompt_token_ids=list(range(100)), kv_transfer_params=dict(params))
    blocks = SimpleNamespace(get_block_ids=lambda: [[1, 2, 3, 4]], get_unhashed_block_ids=lambda: [1, 2, 3, 4])
    s.get_num_new_matched_tokens(owner, 0)
    s.update_state_after_alloc(owner, blocks, 100)
    reuse = SimpleNamespace(request_id="b", prompt_token_ids=list(range(1, 101)), kv_transfer_params=dict(params))
    assert s.get_num_new_matched_tokens(reuse, 0) == (100, True)  # registers: D's state refuses the duplicate
    # after the owner ended, only its own prompt is served from the cache
    s.request_finished(SimpleNamespace(request_id="a", kv_transfer_params=owner.kv_transfer_params, status=None), [])
    late = SimpleNamespace(request_id="c", prompt_token_ids=list(range(100)), kv_transfer_params=dict(params))
    assert s.get_num_new_matched_tokens(late, 96) == (0, False)
    stranger = SimpleNamespace(request_id="e", prompt_token_ids=[7] * 100, kv_transfer_params=dict(params))
    assert s.get_num_new_matched_tokens(stranger, 0) == (100, True)


def test_a_sibling_waits_a_few_steps_for_the_cache_then_computes_and_a_reuse_never_replaces_the_owner():
    from kvpath.connector.params import decode_leg_params
    from kvpath.connector.vllm_scheduler import SIBLING_CACHE_STEPS

    s = _d_scheduler()
    params = decode_leg_params("t1", "127.0.0.1:5600")

    def req(rid, prompt):
        return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=dict(params))

    blocks = SimpleNamespace(get_block_ids=lambda: [[1, 2, 3, 4]], get_unhashed_block_ids=lambda: [1, 2, 3, 4])
    owner, kid, reuse = req("0_x", list(range(100))), req("1_x", list(range(100))), req("r", [5] * 100)
    s.get_num_new_matched_tokens(owner, 0)
    s.update_state_after_alloc(owner, blocks, 100)
    assert s.get_num_new_matched_tokens(reuse, 0) == (100, True)
    s.update_state_after_alloc(reuse, blocks, 100)  # registers (and fails as a duplicate), owns nothing
    assert {t: o.request_id for t, o in s.owners.items()} == {"t1": "0_x"}
    s.update_connector_output(SimpleNamespace(finished_sending=(), finished_recving={"0_x"}))
    step = SimpleNamespace(total_num_scheduled_tokens=1)
    for _ in range(SIBLING_CACHE_STEPS - 1):
        s.build_connector_meta(step)
        assert s.get_num_new_matched_tokens(kid, 64) == (None, False)  # a hit of 2 of 3 full blocks, for now
    s.build_connector_meta(step)
    assert s.get_num_new_matched_tokens(kid, 64) == (0, False)  # then it computes what it lacks
