"""Workload generators, the Workload operations and the trace importers (files written by the tests)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvpath.workloads.importers import (detect_format, load_azure, load_burstgpt, load_file, load_mooncake,
                                       parse_datetime)
from kvpath.workloads import Request, Workload, WorkloadError, load_workload, poisson, zipf


def _zipf_mass(a: float, lo: int, hi: int, upto: int) -> float:
    """P(lo <= X < upto) of the bounded Zipf, computed here from its definition."""
    w = np.arange(1, hi - lo + 2, dtype=float) ** -a
    return float(w[: upto - lo].sum() / w.sum())


# ---- generators -----------------------------------------------------------------------
def test_zipf_lengths_in_range_heavy_at_the_low_end_and_deterministic():
    n = 5000
    w = zipf(n, qps=6, seed=3, min_prompt=1024, max_prompt=4096)
    p = np.array([r.prompt_tokens for r in w])
    assert p.min() >= 1024 and p.max() <= 4096
    decile = 1024 + (4096 - 1024 + 1) // 10
    q = _zipf_mass(1.1, 1024, 4096, decile)  # ~0.81, where a uniform draw would give 0.1
    share = (p < decile).mean()
    assert share > q - 5 * np.sqrt(q * (1 - q) / n)
    assert share < q + 5 * np.sqrt(q * (1 - q) / n)
    assert (p == 1024).mean() > (p == 1025).mean() > (p == 1030).mean()
    again = zipf(n, qps=6, seed=3)
    assert again.requests == w.requests
    assert [r.prompt_tokens for r in zipf(n, 6, seed=4)] != list(p)


def test_zipf_small_range_matches_the_pmf():
    n, a = 20000, 1.1
    p = np.array([r.prompt_tokens for r in zipf(n, 1, seed=1, min_prompt=10, max_prompt=13, a=a)])
    pmf = np.arange(1, 5, dtype=float) ** -a
    pmf /= pmf.sum()
    freq = np.array([(p == v).mean() for v in range(10, 14)])
    assert freq.sum() == 1.0
    assert np.all(np.abs(freq - pmf) < 5 * np.sqrt(pmf * (1 - pmf) / n))


def test_poisson_arrivals_and_pd_ratio():
    w = zipf(20000, qps=6, seed=7)
    gaps = np.diff([0.0] + [r.arrival_s for r in w])
    assert abs(gaps.mean() - 1 / 6) < 0.03 / 6  # fixed seed: deterministic, not a timing test
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential gaps: coefficient of variation 1
    assert all(r.output_tokens == max(1, round(r.prompt_tokens / 20)) for r in w)
    w5 = zipf(100, qps=6, seed=7, pd_ratio=5)
    assert all(r.output_tokens == max(1, round(r.prompt_tokens / 5)) for r in w5)
    assert all(r.output_tokens == 1 for r in zipf(50, 6, min_prompt=1, max_prompt=10, pd_ratio=100))


def test_poisson_fixed_and_uniform_lengths():
    w = poisson(300, qps=4, seed=2, min_prompt=512, max_prompt=512, min_output=8, max_output=8)
    assert {(r.prompt_tokens, r.output_tokens) for r in w} == {(512, 8)}
    u = poisson(3000, qps=4, seed=2, min_prompt=100, max_prompt=200, min_output=1, max_output=4)
    p = np.array([r.prompt_tokens for r in u])
    assert p.min() == 100 and p.max() == 200 and abs(p.mean() - 150) < 3
    assert {r.output_tokens for r in u} == {1, 2, 3, 4}
    with pytest.raises(WorkloadError, match="prompt range"):
        poisson(3, qps=1, min_prompt=10, max_prompt=5)
    with pytest.raises(WorkloadError, match="qps"):
        zipf(3, qps=0)


# ---- Workload operations ----------------------------------------------------------------
def test_workload_scale_sample_limit_rate_stats_and_jsonl(tmp_path):
    w = zipf(1000, qps=5, seed=0)
    arr = np.array([r.arrival_s for r in w])
    s = w.scale_time(2.0)
    assert np.allclose(np.diff([r.arrival_s for r in s]), 2 * np.diff(arr))
    sub = w.sample(100, seed=9)
    assert len(sub) == 100 and sub.requests == w.sample(100, seed=9).requests
    assert sub.requests != w.sample(100, seed=10).requests
    ids = [r.request_id for r in w]
    pos = [ids.index(r.request_id) for r in sub]
    assert pos == sorted(pos)  # arrival order kept
    assert len(w.sample(5000)) == 1000
    lim = w.limit_tokens(max_prompt=1100, max_output=30)
    assert max(r.prompt_tokens for r in lim) == 1100 and max(r.output_tokens for r in lim) == 30
    assert w.rate_qps(20).mean_qps == pytest.approx(20)
    st = w.stats()
    p = np.array([r.prompt_tokens for r in w])
    assert st["count"] == 1000 and st["duration_s"] == pytest.approx(arr[-1] - arr[0])
    assert st["prompt_tokens"]["p50"] == np.percentile(p, 50) and st["prompt_tokens"]["max"] == p.max()
    assert st["mean_qps"] == pytest.approx(999 / (arr[-1] - arr[0]))
    w.to_jsonl(tmp_path / "w.jsonl")
    back = Workload.from_jsonl(tmp_path / "w.jsonl")
    assert back.requests == w.requests and detect_format(tmp_path / "w.jsonl") == "kvpath"
    assert load_workload(str(tmp_path / "w.jsonl"), n=10, seed=1).requests == w.sample(10, seed=1).requests


def test_workload_sorts_and_validates():
    w = Workload([Request("b", 2.0, 5, 1), Request("a", 1.0, 5, 1), Request("c", 1.0, 7, 1)])
    assert [r.request_id for r in w] == ["a", "c", "b"]
    with pytest.raises(WorkloadError):
        Request("x", 0.0, 0, 1)
    with pytest.raises(WorkloadError, match="one instant"):
        Workload([Request("a", 1.0, 5, 1), Request("b", 1.0, 5, 1)]).rate_qps(2)
    with pytest.raises(WorkloadError):
        w.scale_time(0)


# ---- importers --------------------------------------------------------------------------
AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 23:59:58.6805900,374,44\n"
         "2023-11-17 00:00:02.1805901,1200,7\n"   # across midnight, 7 fractional digits
         "2023-11-16 23:59:59.6805900,10,1\n"     # out of order in the file
         "2023-11-16 23:59:59.9,55,0\n")          # 0 generated tokens: dropped


def test_azure_2023_and_2024(tmp_path):
    f = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    f.write_text(AZURE)
    w = load_file(f)
    assert w.meta["format"] == "azure" and w.meta["dropped"]["zero_output"] == 1
    assert [r.prompt_tokens for r in w] == [374, 10, 1200]
    assert [r.arrival_s for r in w] == pytest.approx([0.0, 1.0, 3.5000001], abs=1e-9)
    assert [r.request_id for r in w] == ["r0", "r1", "r2"]
    # 2024: same columns; header names with spaces and another case; ISO 'T' and a zone
    g = tmp_path / "azure2024.csv"
    g.write_text(" timestamp , contextTokens , GENERATEDTOKENS \n2024-05-10 00:00:00.0099130,100,3\n"
                 "2024-05-10T00:00:10.0099130Z,200,4\n")
    assert [r.arrival_s for r in load_azure(g)] == pytest.approx([0.0, 10.0])
    assert load_azure(g, time_scale=0.5).duration_s == pytest.approx(5.0)
    assert parse_datetime("2023-11-16 18:15:46.6805900") == pytest.approx(1700158546.68059)
    assert parse_datetime("2023-11-16T19:15:46.5+01:00") == pytest.approx(parse_datetime("2023-11-16 18:15:46.5"))


def test_burstgpt_drops_failures_filters_model_scales_and_samples(tmp_path, caplog):
    f = tmp_path / "BurstGPT_1.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,100,20,120,Conversation log\n"
                 "7,GPT-4,50,0,50,Conversation log\n"       # failed request
                 "9,GPT-4,30,3,33,API log\n"
                 "11,ChatGPT,0,0,0,Conversation log\n"      # failed request
                 "13,ChatGPT,70,7,77,API log\n")
    with caplog.at_level(logging.INFO, logger="kvpath.workloads.importers"):
        w = load_file(f)
    assert "dropped 2 failed requests" in caplog.text
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in w] == [(0.0, 100, 20), (4.0, 30, 3),
                                                                             (8.0, 70, 7)]
    assert w.meta["failed"] == 2 and w.meta["format"] == "burstgpt"
    g = load_burstgpt(f, model="gpt-4")
    assert [r.prompt_tokens for r in g] == [30] and g.meta["filtered"] == 3
    assert [r.prompt_tokens for r in load_burstgpt(f, log_type="API log")] == [30, 70]
    assert [r.arrival_s for r in load_burstgpt(f, time_scale=0.25)] == [0.0, 1.0, 2.0]
    s = load_burstgpt(f, n=2, seed=0)
    assert len(s) == 2 and s.requests[0].arrival_s == 0.0 and s.requests == load_burstgpt(f, n=2, seed=0).requests
    assert {r.request_id for r in s} <= {"r0", "r1", "r2"}  # ids are positions in the whole trace


def test_mooncake_and_load_workload_rates(tmp_path):
    f = tmp_path / "mooncake_trace.jsonl"
    f.write_text('{"timestamp": 1000, "input_length": 5000, "output_length": 20, "hash_ids": [1, 2]}\n'
                 '\n'
                 '{"timestamp": 3000, "input_length": 600, "output_length": 4, "hash_ids": [1]}\n'
                 '{"timestamp": 2000, "input_length": 700, "output_length": 5, "hash_ids": []}\n')
    w = load_mooncake(f)
    assert [(r.arrival_s, r.prompt_tokens) for r in w] == [(0.0, 5000), (1.0, 700), (2.0, 600)]
    assert load_workload(str(f), qps=2.0).duration_s == pytest.approx(1.0)
    assert load_workload(str(f), n=2, seed=5, time_scale=3.0).requests == load_mooncake(f, n=2, seed=5,
                                                                                         time_scale=3.0).requests
    lim = load_workload(str(f), clip_prompt=1000, clip_output=4)
    assert [(r.prompt_tokens, r.output_tokens) for r in lim] == [(1000, 4), (700, 4), (600, 4)]
    # a format override reads a file whose header or name says nothing
    g = tmp_path / "trace.txt"
    g.write_text("t,contexttokens,generatedtokens\n")
    with pytest.raises(WorkloadError, match="no column 'timestamp'"):
        load_file(g)
    zw = load_workload("zipf", n=40, qps=2.0, seed=0, min_prompt=1024, max_prompt=4096, pd_ratio=20.0)
    assert len(zw) == 40 and zw.requests == zipf(40, 2.0, 0).requests


def test_format_override_and_detection(tmp_path):
    f = tmp_path / "requests.log"
    f.write_text("Timestamp,Request tokens,Response tokens\n1.5,10,2\n")
    assert detect_format(f) == "burstgpt"
    assert len(load_file(f, format="burstgpt")) == 1
    with pytest.raises(WorkloadError, match="format must be"):
        load_file(f, format="sharegpt")
    with pytest.raises(WorkloadError, match="BurstGPT files only"):
        load_file(tmp_path / "requests.log", format="azure", model="x")


# ---- errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,text,where", [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,1,4\n2023-11-16 18:15:47,abc,4\n",
     r"a.csv: line 3, column 2 \(ContextTokens\): cannot read 'abc'"),
    ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 25:15:46.68,1,4\n",
     r"b.csv: line 2, column 1 \(TIMESTAMP\): cannot read .* as a date-time"),
    ("c.csv", "Timestamp,Model,Request tokens,Response tokens\n1,m,2,3\n2,m,2\n", r"c.csv: line 3: 3 column"),
    ("d.csv", "Timestamp,Model,Request tokens,Response tokens\n1,m,-2,3\n",
     r"d.csv: line 2, column 3 \(Request tokens\)"),
    ("e.jsonl", '{"timestamp": 1, "input_length": 2, "output_length": 3}\n{"timestamp": 1, "input_length": }\n',
     r"e.jsonl: line 2, column 34: invalid JSON"),
    ("f.jsonl", '{"timestamp": 1, "input_length": 2}\n', r"f.jsonl: line 1: no field 'output_length'"),
    ("g.jsonl", '{"timestamp": 1, "input_length": "2", "output_length": 3}\n',
     r"g.jsonl: line 1: field 'input_length'"),
    ("h.jsonl", '{"request_id": "a", "arrival_s": 1, "prompt_tokens": 0, "output_tokens": 3}\n', r"h.jsonl: line 1"),
    ("i.csv", "a,b\n1,2\n", r"i.csv: line 1: cannot tell the workload format"),
    ("j.csv", "", r"j.csv: empty file"),
])
def test_bad_files_name_file_line_and_column(tmp_path, name, text, where):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(WorkloadError, match=where):
        load_workload(str(f))


def test_missing_file_and_unknown_spec(tmp_path):
    with pytest.raises(WorkloadError, match="neither zipf nor poisson"):
        load_workload(str(tmp_path / "nope.csv"))
    with pytest.raises(WorkloadError, match="does not exist"):
        load_file(tmp_path / "nope.csv")
    with pytest.raises(WorkloadError, match="needs a number of requests"):
        load_workload("zipf", qps=1.0)
