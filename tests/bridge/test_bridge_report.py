"""``kvpath bridge report``: the page references every figure it writes, and only those;
each figure kind is there; the summary has a row per trace; bad input exits cleanly."""

from __future__ import annotations

import argparse
import dataclasses
from html.parser import HTMLParser
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.trace import FiveTuple, FlowRecord, Header, RequestRecord, Trace, TraceWriter
from kvpath.trace.header import TraceSetup
from kvpath.workloads import load_workload
from kvpath.bridge import report
from kvpath.bridge.cli import add_parsers
from kvpath.bridge.compare import header_net_params
from kvpath.bridge.report_figures import in_flight
from kvpath.bridge.serving_sim import ServingConfig, simulate

PNG = b"\x89PNG\r\n\x1a\n"
MODES = ("ecmp", "dc")
# slow links so that pushes overlap: the in-flight and slowdown figures have something to show
SPEC = dataclasses.replace(FabricSpec.resolve("small"), host_link_gbps=20.0, spine_link_gbps=20.0)


def _write(path: Path, trace: Trace) -> Path:
    with TraceWriter(path, trace.header) as w:
        w.write_all([*trace.requests, *trace.flows])
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("traces")
    reqs = list(load_workload("zipf", n=40, qps=30.0, seed=3).requests)
    itm = IterationTimeModel.preset()
    return [_write(d / f"{m}.jsonl", simulate(SPEC, reqs, ServingConfig(pools=(2, 2), mode=m), itm)[0])
            for m in MODES]


def run_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    add_parsers(p.add_subparsers())
    args = p.parse_args(["bridge", "report", *argv])
    return args.func(args)


class Page(HTMLParser):
    """The images and the summary table's rows of index.html."""

    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict[str, str | None]] = []
        self.rows: list[list[str]] = []
        self.notes = 0
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._in_note = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
        elif tag == "table":
            self._table = a.get("id")
        elif tag == "tr" and self._table == "summary":
            self.rows.append([])
        elif tag == "td" and self._table == "summary":
            self._cell = []
        elif tag == "p" and a.get("class") == "note":
            self.notes += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._table = None
        elif tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def parse(out: Path) -> Page:
    page = Page()
    page.feed((out / "index.html").read_text())
    page.rows = [r for r in page.rows if r]  # the header row has th only
    return page


@pytest.fixture(scope="module")
def cli_report(traces: list[Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Page]:
    out = tmp_path_factory.mktemp("report")
    (out / "gantt-9.png").write_bytes(PNG)  # an older report's figure: must not survive
    assert run_cli([*map(str, traces), "--out", str(out), "--dc-delays", "0.001,0,0.02",
                    "--gantt-requests", "10"]) == 0
    return out, parse(out)


def test_every_image_exists_as_a_png_and_every_file_is_referenced(cli_report: tuple[Path, Page]) -> None:
    out, page = cli_report
    srcs = [i["src"] for i in page.imgs]
    assert srcs and all(srcs)
    for s in srcs:
        f = out / s
        assert f.parent == out and f.stat().st_size > len(PNG)
        assert f.read_bytes()[:8] == PNG
    assert {p.name for p in out.iterdir()} == {"index.html", *srcs}
    assert page.notes == 0
    assert all(i.get("alt") for i in page.imgs)


def test_each_figure_kind_is_present(cli_report: tuple[Path, Page]) -> None:
    _, page = cli_report
    srcs = {i["src"] for i in page.imgs}
    n = len(MODES)
    assert {f"gantt-{i}.png" for i in range(1, n + 1)} <= srcs
    assert "slowdown-cdf.png" in srcs
    assert {f"inflight-{i}.png" for i in range(1, n + 1)} <= srcs
    assert "dc-sweep.png" in srcs
    assert {f"scatter-{i}.png" for i in range(1, n + 1)} <= srcs


def test_summary_has_one_row_per_trace_with_its_mode(cli_report: tuple[Path, Page], traces: list[Path]) -> None:
    _, page = cli_report
    assert len(page.rows) == len(traces)
    for row, path, mode in zip(page.rows, traces, MODES):
        assert row[1] == str(path) and row[2] == mode and row[4] == "40"


def test_library_returns_the_figures_and_notes_a_trace_without_flows(traces: list[Path], tmp_path: Path) -> None:
    from kvpath.trace import read_trace

    t = read_trace(traces[0])
    no_flows = Trace(t.header, t.requests, [])
    rep = report.write_report([("a", t), ("b", no_flows)], tmp_path, dc_delays=[0.0], show_progress=False)
    assert rep.index == tmp_path / "index.html"
    assert set(rep.figures) == set(report.KINDS)
    assert [p.name for p in rep.figures["scatter"]] == ["scatter-1.png"]
    assert [p.name for p in rep.figures["inflight"]] == ["inflight-1.png"]
    assert len(rep.figures["gantt"]) == 2 and len(rep.figures["dc-sweep"]) == 1
    page = parse(tmp_path)
    assert page.notes == len(rep.notes) >= 2  # no flows: no in-flight plot, nothing to replay
    assert "nothing to replay" in (tmp_path / "index.html").read_text()
    assert {p.name for p in tmp_path.iterdir()} == {"index.html", *(i["src"] for i in page.imgs)}


def test_a_simulated_trace_replays_to_its_own_fcts(traces: list[Path], tmp_path: Path) -> None:
    # an ecmp run's flows on their spines through the same flow model: the replay is exact
    from kvpath.trace import read_trace

    rep = report.write_report([read_trace(traces[0])], tmp_path, dc_delays=[0.0], show_progress=False)
    assert "mean +0.0%, p99 +0.0%" in rep.index.read_text()


def test_sweep_inputs_from_a_testbed_style_header() -> None:
    h = Header(t0_unix=0.0, mode="cc", scale_b=500.0, scale_s=250.0, link_mbit=200.0,
               meta={"pools": "1P2D", "burst_bytes": 4096})
    q = RequestRecord(request_id="r", arrival_s=0.5, prompt_tokens=100, output_tokens=0, status="http 503")
    t = Trace(h, [q], [])
    setup = TraceSetup(t)
    assert setup.pools == (1, 2)
    assert header_net_params(setup).burst_bytes == 4096
    assert setup.time_scale == 2.0
    assert report.workload(t)[0].output_tokens == 1
    itm, note = setup.iteration_time_or_preset()
    assert itm.model.name == "llama-3-8b" and "preset" in note
    t2 = Trace(Header(t0_unix=0.0), [msgspec.structs.replace(q, p_instance="a", d_instance="b"),
                                      msgspec.structs.replace(q, p_instance="a", d_instance="c")], [])
    assert TraceSetup(t2).pools == (1, 2)


def test_in_flight_counts_end_before_start_at_one_instant() -> None:
    ft = FiveTuple("10.0.0.1", "10.0.1.1", 1, 2)
    flows = [FlowRecord(flow_id=str(i), request_id=None, five_tuple=ft, bytes=1, start_s=s, end_s=e)
             for i, (s, e) in enumerate([(0.0, 1.0), (1.0, 2.0), (0.5, 3.0)])]
    t, c = in_flight(flows)
    assert list(t) == [0.0, 0.5, 1.0, 2.0, 3.0]
    assert list(c) == [1, 2, 2, 1, 0]
    assert np.all(c >= 0)


@pytest.mark.parametrize("argv_tail, words", [
    (["--dc-delays", "0,abc"], ["--dc-delays", "not a number"]),
    (["--dc-delays", "-0.1"], ["--dc-delays", ">= 0"]),
    (["--dc-delays", ","], ["--dc-delays", "at least one"]),
    (["--dc-delays", "nan"], ["--dc-delays"]),
    (["--gantt-requests", "0"], ["--gantt-requests"]),
    (["--backend", "nope"], ["--backend", "nope"]),
])
def test_bad_options_exit_with_a_message(traces: list[Path], tmp_path: Path, argv_tail: list[str],
                                         words: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        run_cli([str(traces[0]), "--out", str(tmp_path / "r"), *argv_tail])
    msg = str(e.value.code)
    assert msg.startswith("kvpath bridge report: error: ")
    assert all(w in msg for w in words)
    assert not (tmp_path / "r").exists()


def test_bad_traces_exit_with_a_message(traces: list[Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    with TraceWriter(empty, Header(t0_unix=0.0, mode="cc")):
        pass
    blank = tmp_path / "blank.jsonl"
    blank.write_text("")
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    for bad, what in ((tmp_path / "missing.jsonl", "cannot read"), (empty, "no requests"), (blank, "empty trace"),
                      (junk, "not JSON"), (tmp_path, "cannot read")):
        with pytest.raises(SystemExit) as e:
            run_cli([str(traces[0]), str(bad), "--out", str(tmp_path / "r")])
        msg = str(e.value.code)
        assert msg.startswith("kvpath bridge report: error: TRACE: ") and what in msg and str(bad) in msg


def test_out_that_is_a_file_exits_with_a_message(traces: list[Path], tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        run_cli([str(traces[0]), "--out", str(f)])
    assert str(e.value.code).startswith("kvpath bridge report: error: --out ")


def test_a_testbed_style_trace_gets_a_sweep_on_the_preset_model(traces: list[Path], tmp_path: Path) -> None:
    from kvpath.trace import read_trace

    t = read_trace(traces[1])
    h = Header(t0_unix=1.7e9, mode="dc", fabric=t.header.fabric, scale_b=2.0, scale_s=2.0, link_mbit=20000.0,
               meta={"pools": "2P2D", "burst_bytes": 0})  # what kvpath testbed run writes: no iteration_time
    rep = report.write_report([("tb", Trace(h, t.requests, t.flows))], tmp_path, dc_delays=[0.0, 0.01],
                              show_progress=False)
    assert [p.name for p in rep.figures["dc-sweep"]] == ["dc-sweep.png"] and not rep.notes
    text = rep.index.read_text()
    assert "the llama-3-8b on h100 preset is used" in text and "pools 2P2D" in text
    with pytest.raises(ValueError, match="no requests"):
        report.write_report([Trace(h, [], [])], tmp_path / "x", show_progress=False)
