"""Layer-wise push, the deterministic parts: which P requests the scheduler begins (and
with which blocks), how an abort names a begun request, how the writer's view of the
forwards takes reports that overtake a begin. Real transfers: test_layer_push_nixl.py."""

from types import SimpleNamespace

from kvpath.connector.config import KVPathConfig
from kvpath.connector.layer_progress import ForwardLayers, LayerProgress
from kvpath.connector.vllm_scheduler import KVPathScheduler


def _scheduler(granularity: str = "layer", device: str = "cpu", async_sched: bool = False) -> KVPathScheduler:
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=False),
                           kv_transfer_config=SimpleNamespace(kv_role="kv_producer"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           device_config=SimpleNamespace(device_type=device),
                           scheduler_config=SimpleNamespace(async_scheduling=async_sched))
    return KVPathScheduler(vcfg, KVPathConfig(control_plaintext=True, push_granularity=granularity), "p-engine")


def _req(rid: str, prompt: int, max_tokens: int = 1, tid: str | None = None, gran: str | None = None):
    kp = {"transfer_id": tid or f"t-{rid}"}
    if gran:
        kp["push_granularity"] = gran
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, prompt_token_ids=list(range(prompt)),
                           num_computed_tokens=0, max_tokens=max_tokens, kv_transfer_params={
                               "do_remote_decode": True, "kvpath": kp}, events=[], arrival_time=0.0)


def _out(new=(), cached=(), sched=None, resumed=()):
    """A SchedulerOutput's fields the connector reads: new requests (req, blocks), cached
    ones (req, new blocks), tokens scheduled per request."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(b,)) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r.request_id for r, _ in cached],
                                              new_block_ids=[(b,) if b is not None else None for _, b in cached],
                                              resumed_req_ids=set(resumed)),
        num_scheduled_tokens=sched or {}, total_num_scheduled_tokens=sum((sched or {}).values()))


def test_a_prompt_is_begun_in_the_step_that_completes_it_with_every_block_so_far():
    s = _scheduler()
    a = _req("a", 100)
    s.get_num_new_matched_tokens(a, 0)
    m = s.build_connector_meta(_out(new=[(a, [3, 4, 5])], sched={"a": 48}))  # chunk 1 of 100 tokens
    assert m.computing == []
    a.num_computed_tokens = 48
    m = s.build_connector_meta(_out(cached=[(a, [9, 10, 11, 12])], sched={"a": 52}))  # the last chunk
    assert [(c.request_id, c.transfer_id, c.block_ids) for c in m.computing] == [("a", "t-a", [3, 4, 5, 9, 10, 11, 12])]
    a.num_computed_tokens = 100
    assert s.build_connector_meta(_out(cached=[(a, None)], sched={"a": 1})).computing == []  # never twice


def test_only_a_request_that_ends_after_that_forward_and_asks_for_it_is_begun():
    s = _scheduler(granularity="request")
    reqs = [_req("plain", 32), _req("asks", 32, gran="layer"), _req("more", 32, max_tokens=4, gran="layer")]
    for r in reqs:
        s.get_num_new_matched_tokens(r, 0)
    m = s.build_connector_meta(_out(new=[(r, [1, 2]) for r in reqs], sched={r.request_id: 32 for r in reqs}))
    assert [c.request_id for c in m.computing] == ["asks"]  # the knob's "request" for "plain"; "more" continues


def test_a_second_live_request_with_a_begun_transfer_id_goes_whole():
    s = _scheduler()
    a, b = _req("a", 32, tid="T"), _req("b", 32, tid="T")
    for r in (a, b):
        s.get_num_new_matched_tokens(r, 0)
    m = s.build_connector_meta(_out(new=[(a, [1, 2]), (b, [3, 4])], sched={"a": 32, "b": 32}))
    assert [c.request_id for c in m.computing] == ["a"]


def test_a_resumed_request_takes_its_blocks_anew():
    s = _scheduler()
    a = _req("a", 64)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(_out(new=[(a, [1, 2])], sched={"a": 16}))
    a.num_computed_tokens = 0  # preempted, then resumed: every block anew
    m = s.build_connector_meta(_out(cached=[(a, [7, 8, 9, 10])], sched={"a": 64}, resumed={"a"}))
    assert m.computing[0].block_ids == [7, 8, 9, 10]


def test_an_aborted_begun_request_keeps_its_blocks_and_is_named_by_request_id():
    from vllm.v1.request import RequestStatus

    s = _scheduler()
    a = _req("a", 32)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(_out(new=[(a, [1, 2])], sched={"a": 32}))
    a.status = RequestStatus.FINISHED_ABORTED
    delay, _ = s.request_finished(a, [1, 2])
    m = s.build_connector_meta(_out())
    assert delay and m.aborted_begun == [("a", "t-a")] and m.aborted == []
    assert s.has_pending_push_work()  # the engine steps until the writer reports the blocks
    b = _req("b", 32)  # never begun: freed at once, named by transfer id as before
    s.get_num_new_matched_tokens(b, 0)
    b.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(b, [5])[0] is False and s.build_connector_meta(_out()).aborted == ["t-b"]


def test_a_gpu_cache_or_asynchronous_scheduling_pushes_every_request_whole():
    for s in (_scheduler(device="cuda"), _scheduler(async_sched=True)):
        a = _req("a", 32, gran="layer")
        s.get_num_new_matched_tokens(a, 0)
        assert s.build_connector_meta(_out(new=[(a, [1, 2])], sched={"a": 32})).computing == []


def test_a_report_that_overtakes_the_begin_counts_and_ended_forwards_are_forgotten():
    fw = ForwardLayers()
    assert fw.apply([(3, 2)], now=1.0) is False  # forward 3 reported 2 layers before its begin came
    p = LayerProgress(layers=4, forward=3)
    fw.begin(p)
    assert p.done == 2 and fw.live()
    assert fw.apply([(3, 4)], now=2.0) and p.done == 4 and p.forward_end_at == 2.0
    assert not fw.live()  # every layer: no more polling for it
    q = LayerProgress(layers=4, forward=4)
    fw.begin(q)
    q.aborted = True
    fw.prune(3.0)
    assert not fw.live()
    fw.apply([(k, 1) for k in range(200)], now=4.0)
    assert len(fw.reported) <= 64  # bounded


def test_chunk_wise_every_forward_feeds_the_push_with_the_whole_blocks_it_makes_final():
    s = _scheduler(granularity="chunk")
    a = _req("a", 100)
    s.get_num_new_matched_tokens(a, 0)
    m = s.build_connector_meta(_out(new=[(a, [3, 4, 5])], sched={"a": 40}))  # tokens 0-39: blocks 0, 1 final
    assert [(c.block_ids, c.final_before, c.final_after) for c in m.computing] == [([3, 4, 5], 0, 32)]
    a.num_computed_tokens = 40
    m = s.build_connector_meta(_out(cached=[(a, [6, 7])], sched={"a": 40}))  # tokens 40-79
    assert [(c.block_ids, c.final_before, c.final_after) for c in m.computing] == [([3, 4, 5, 6, 7], 32, 80)]
    a.num_computed_tokens = 80
    m = s.build_connector_meta(_out(cached=[(a, [8])], sched={"a": 20}))  # the last chunk: layer by layer
    assert [(c.block_ids, c.final_before, c.last) for c in m.computing] == [([3, 4, 5, 6, 7, 8], 80, True)]


def test_a_preempted_begun_request_restarts_and_its_next_forward_feeds_its_new_blocks():
    s = _scheduler(granularity="chunk")
    a = _req("a", 100)
    s.get_num_new_matched_tokens(a, 0)
    s.build_connector_meta(_out(new=[(a, [3, 4, 5])], sched={"a": 40}))
    out = _out()
    out.preempted_req_ids = {"a"}
    assert s.build_connector_meta(out).restarts == [("a", "t-a")]
    a.num_computed_tokens = 0
    m = s.build_connector_meta(_out(cached=[(a, [9, 10, 11])], sched={"a": 40}, resumed={"a"}))
    assert [(c.block_ids, c.final_before, c.final_after) for c in m.computing] == [([9, 10, 11], 0, 32)]


def test_a_prefix_hit_on_p_counts_as_final_only_once_the_forward_that_may_fill_it_ends():
    s = _scheduler(granularity="chunk")
    a, b = _req("a", 100), _req("b", 48)
    for r in (a, b):
        s.get_num_new_matched_tokens(r, 0)
    a.num_computed_tokens = b.num_computed_tokens = 32  # hits on blocks another request may be filling now
    m = s.build_connector_meta(_out(new=[(a, [1, 2, 3]), (b, [1, 2, 4])], sched={"a": 40, "b": 16}))
    got = {c.request_id: (c.final_before, c.final_after) for c in m.computing}
    assert got == {"a": (0, 64), "b": (0, None)}  # nothing final before: the hit goes after (a) or layer-wise (b)
    s2 = _scheduler(granularity="chunk")
    c = _req("c", 100)
    s2.get_num_new_matched_tokens(c, 0)
    c.resumable = True  # a streaming session's request: its prompt grows, never pushed in parts
    assert s2.build_connector_meta(_out(new=[(c, [1, 2])], sched={"c": 40})).computing == []


def test_a_begun_prefill_waits_for_its_registration_until_its_request_ends_then_for_its_lease():
    from kvpath.connector.push_state import FinishedPrefill, SenderState

    now = [0.0]
    st = SenderState(lease_s=30.0, clock=lambda: now[0])
    p = LayerProgress(layers=4, forward=1)
    fp = FinishedPrefill("r", "t", [1, 2], progress=p)
    assert st.add_prefill(fp)[0] == "waiting"
    now[0] = 100.0  # a long chunked prefill: past the lease, still computing
    assert st.expire().prefills == []
    p.final = True
    st.renew_lease("t")  # its request ended now: its lease runs from here
    now[0] = 129.0
    assert st.expire().prefills == []
    now[0] = 131.0
    assert [x.request_id for x in st.expire().prefills] == ["r"]
