"""Trace records for the trace's tests: a complete request and its flow, each field
overridable (``request_record(status="http 503", ...)``)."""

from __future__ import annotations

from typing import Any

from kvpath.trace import FiveTuple, FlowRecord, RequestRecord

FT0 = FiveTuple("10.0.2.1", "10.1.3.1", 41000, 5600)
FT1 = FiveTuple("10.0.3.1", "10.1.2.1", 41001, 5601)


def request_record(**kw: Any) -> RequestRecord:
    d = dict(request_id="r0", arrival_s=0.5, prompt_tokens=1024, output_tokens=8, p_instance="l0h0", d_instance="l1h1",
             p_arrival_s=0.5, prefill_start_s=0.5, prefill_end_s=0.6, kv_bytes=1000, push_start_s=0.6,
             push_end_s=0.61, lane=2, five_tuple=FT0, path_predicted="spine1", path_measured="spine1",
             decode_start_s=0.615, first_token_s=0.62, completion_s=0.7, ttft_s=0.12, tpot_s=0.01)
    d.update(kw)
    return RequestRecord(**d)


def flow_record(**kw: Any) -> FlowRecord:
    d = dict(flow_id="f0", request_id="r0", five_tuple=FT0, bytes=1000, start_s=0.6, end_s=0.61, path="spine1",
             standalone_fct_s=0.005)
    d.update(kw)
    return FlowRecord(**d)
