"""Workload generators and trace importers (files written by the tests)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpath.workloads import WorkloadError, load_file, load_workload, zipf


def test_zipf_shape_is_deterministic_in_range_and_heavy_at_the_low_end():
    w = zipf(2000, qps=6, seed=3, min_prompt=1024, max_prompt=4096, pd_ratio=20)
    p = np.array([r.prompt_tokens for r in w.requests])
    assert p.min() >= 1024 and p.max() <= 4096
    # Zipf(1.1) over 3073 lengths puts about half the mass on the first ~10 values
    assert (p < 1034).mean() > 0.4 and (p > 2048).mean() < 0.15
    assert all(r.output_tokens == max(1, round(r.prompt_tokens / 20)) for r in w.requests)
    assert [r.prompt_tokens for r in zipf(2000, 6, seed=3).requests] == list(p)
    gaps = np.diff([r.arrival_s for r in w.requests])
    assert abs(gaps.mean() - 1 / 6) < 0.02  # Poisson at 6 QPS (fixed seed: deterministic)


def test_azure_burstgpt_and_mooncake_importers(tmp_path):
    az = tmp_path / "azure.csv"
    az.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                  "2023-11-16 18:15:50.1805900,1200,7\n2023-11-16 18:15:47.6805900,10,1\n")
    w = load_file(az)
    assert [(round(r.arrival_s, 3), r.prompt_tokens) for r in w.requests] == [(0.0, 374), (1.0, 10), (3.5, 1200)]
    bg = tmp_path / "burst.csv"
    bg.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                  "5,ChatGPT,100,20,120,Conversation log\n7,GPT-4,50,0,50,Conversation log\n9,GPT-4,30,3,33,API log\n")
    w = load_file(bg)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in w.requests] == [(0.0, 100, 20), (4.0, 30, 3)]
    mc = tmp_path / "mooncake.jsonl"
    mc.write_text('{"timestamp": 1000, "input_length": 5000, "output_length": 20, "hash_ids": [1, 2]}\n'
                  '{"timestamp": 3000, "input_length": 600, "output_length": 4, "hash_ids": [1]}\n')
    w = load_workload(str(mc), n=10, qps=None)
    assert [(r.arrival_s, r.prompt_tokens) for r in w.requests] == [(0.0, 5000), (2.0, 600)]
    assert load_workload(str(mc), n=10, qps=2.0).duration_s == pytest.approx(0.5)


def test_bad_files_name_the_line(tmp_path):
    bad = tmp_path / "azure.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,abc,4\n")
    with pytest.raises(WorkloadError, match="line 2"):
        load_file(bad)
    mc = tmp_path / "m.jsonl"
    mc.write_text('{"timestamp": 1}\n')
    with pytest.raises(WorkloadError, match="line 1"):
        load_file(mc)
    unknown = tmp_path / "x.csv"
    unknown.write_text("a,b\n1,2\n")
    with pytest.raises(WorkloadError, match="unknown format"):
        load_file(unknown)
