"""dashboards/kvpath.json: every query names a metric the code exports.

The exported names come from the code itself, as Prometheus would scrape them: the
proxy's ``GET /metrics`` and the reservation service's (standalone, and mounted in the
proxy at ``/reservation/metrics``) through ASGI test clients, and the connector's
families as vLLM builds them (``KVConnectorProm`` -> ``KVPathConnector.build_prom_metrics``)
into a private registry. A family becomes the series names prometheus-client writes:
a counter ``X`` is ``X_total``, a histogram ``X_bucket``, ``X_sum`` and ``X_count``,
both with ``X_created``.

The helpers (``panels``, ``queries``, ``metric_names``, ``exported_series``,
``dashboard_problems``) are importable: ``python -m tests.proxy.test_dashboard`` prints
every query's metrics and whether the code exports them.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "kvpath.json"

# PromQL's functions and aggregation operators (Prometheus 2.x and 3.x): an identifier
# followed by "(" must be one of these.
FUNCTIONS = frozenset("""
abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max clamp_min
cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv
double_exponential_smoothing exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase info irate label_join
label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_by_label
sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp vector
year start end
sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
""".split())
# Bare words that are not metrics: binary operators, modifiers and literals.
KEYWORDS = frozenset("and or unless bool atan2 offset inf nan".split())
# Clauses whose parentheses hold label names, not expressions.
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
GRAFANA_VAR = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")
GRAFANA_BUILTINS = frozenset({"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s",
                              "__range_ms", "__from", "__to", "__dashboard", "__user", "__org"})
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
NUMBER = re.compile(r"(?<![A-Za-z0-9_:.])(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z]*)")
# functions whose argument must be a counter (a monotonic series), and those meant for gauges
COUNTER_FUNCTIONS = ("rate", "irate", "increase", "resets")
GAUGE_FUNCTIONS = ("delta", "idelta", "deriv", "predict_linear")
LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)


def _strip(expr: str) -> str:
    """``expr`` without what can hold words that are not metric names: strings (label
    values), Grafana variables, label matchers, range and subquery durations,
    ``by (...)``-like label lists, ``offset``/``@`` modifiers and numbers."""
    s = STRING.sub('""', expr)
    s = GRAFANA_VAR.sub(" ", s)
    s = re.sub(r"\{[^{}]*\}", "{}", s)
    s = re.sub(r"\[[^\[\]]*\]", "[]", s)
    s = LABEL_LISTS.sub(" ", s)
    s = re.sub(r"\boffset\s+-?[\w.]+", " ", s)
    s = re.sub(r"@\s*[-+]?[\d.]+", " ", s)
    return NUMBER.sub(" ", s)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (identifiers followed by ``{``,
    ``[`` or used bare). An identifier called like a function that PromQL does not
    have is a ValueError (a metric name followed by "(" is a typo either way)."""
    if "__name__" in expr:
        raise ValueError(f"a query selecting by __name__ cannot be checked: {expr}")
    s = _strip(expr)
    names = set()
    for m in IDENT.finditer(s):
        word = m.group()
        if re.match(r"\s*\(", s[m.end():]):
            if word not in FUNCTIONS:
                raise ValueError(f"{word!r} is called like a function but PromQL has no such function: {expr}")
        elif word not in KEYWORDS:
            names.add(word)
    return names


def applied_to(expr: str, functions: tuple[str, ...]) -> set[str]:
    """Metrics selected directly inside one of ``functions`` (``rate(x{...}[5m])``)."""
    s = _strip(expr)
    return {m.group(2) for m in re.finditer(rf"\b({'|'.join(functions)})\s*\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", s)}


def grafana_variables(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in GRAFANA_VAR.finditer(text)}


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels (a collapsed row holds its own) included."""
    out = []

    def walk(ps: list[dict]) -> None:
        for p in ps:
            out.append(p)
            walk(p.get("panels") or [])

    walk(dashboard.get("panels", []))
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = [(f"panel {p.get('id')} {p.get('title')!r} {t.get('refId')}", t.get("expr", ""))
           for p in panels(dashboard) if p.get("type") != "row" for t in p.get("targets", [])]
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else q
        m = LABEL_VALUES.match(q or "")
        out.append((f"variable {v['name']}", m.group(1) if m else q))
    return out


# ---------------------------------------------------------------- what the code exports

def series_of(families) -> dict[str, str]:
    """Series name -> "counter" (monotonic: rate() applies) or "gauge", for the families
    of prometheus-client's parser or registry (family names without ``_total``)."""
    out: dict[str, str] = {}
    for f in families:
        if f.type == "counter":
            out[f.name + "_total"] = "counter"
            out[f.name + "_created"] = "gauge"
        elif f.type in ("histogram", "gaugehistogram"):
            kind = "counter" if f.type == "histogram" else "gauge"
            for suffix in ("_bucket", "_sum", "_count"):
                out[f.name + suffix] = kind
            out[f.name + "_created"] = "gauge"
        elif f.type == "summary":
            out[f.name] = "gauge"
            out[f.name + "_sum"] = out[f.name + "_count"] = "counter"
            out[f.name + "_created"] = "gauge"
        elif f.type == "info":
            out[f.name + "_info"] = "gauge"
        else:  # gauge, unknown, stateset
            out[f.name] = "gauge"
    return out


def _scraped(text: str) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    return series_of(text_string_to_metric_families(text))


def served_series() -> dict[str, dict[str, str]]:
    """The proxy's and the reservation service's /metrics, scraped from their apps."""
    from fastapi.testclient import TestClient

    from kvpath.fabric import FabricSpec
    from kvpath.proxy.app import create_app
    from kvpath.proxy.config import ProxyConfig
    from kvpath.proxy.core import Proxy
    from kvpath.proxy.instances import Instance
    from kvpath.reservation.app import create_app as create_reservation_app
    from kvpath.reservation.decisions import ReservationService

    svc = ReservationService(FabricSpec(leaves=2, spines=2, hosts_per_leaf=2), "cc", lease_s=5)
    proxy = Proxy(ProxyConfig(mode="push", health_interval_s=0),
                  [Instance("http://127.0.0.1:9", "prefill", "l0h0", "127.0.0.1:5600")],
                  [Instance("http://127.0.0.1:10", "decode", "l1h0")])
    # no lifespan (no `with`): /metrics needs neither the proxy's session nor the expirer
    px = TestClient(create_app(proxy, create_reservation_app(svc)))
    standalone = TestClient(create_reservation_app(svc))
    out = {}
    for name, client, path in (("proxy", px, "/metrics"), ("reservation (in the proxy)", px, "/reservation/metrics"),
                               ("reservation", standalone, "/metrics")):
        r = client.get(path)
        assert r.status_code == 200, (name, r.status_code, r.text[:200])
        out[name] = _scraped(r.text)
    return out


def connector_series() -> dict[str, str]:
    """KVPathConnector's families as vLLM's PrometheusStatLogger makes them (its
    KVConnectorProm asks the connector class the factory resolves for
    ``"kv_connector": "KVPathConnector"``), registered into a private registry."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from kvpath.connector.plugin import CONNECTOR_NAME, register

    register()
    reg = CollectorRegistry()

    def private(cls):
        class Private(cls):
            def __init__(self, *a, **kw):
                kw["registry"] = reg
                super().__init__(*a, **kw)
        return Private

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = private(Gauge), private(Counter), private(Histogram)

    cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_producer"))
    prom = Prom(cfg, ["model_name", "engine"], {0: ["tiny", "0"]})  # vLLM's labels (PrometheusStatLogger)
    assert prom.prom_metrics is not None and type(prom.prom_metrics).__module__ == "kvpath.connector.vllm_metrics"
    return series_of(reg.collect())


def exported_series(served: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """Every series name the proxy, the reservation service and the connector export."""
    out: dict[str, str] = {}
    for s in (served or served_series()).values():
        out.update(s)
    out.update(connector_series())
    return out


# ---------------------------------------------------------------- the checks

def dashboard_problems(dashboard: dict, exported: dict[str, str]) -> list[str]:
    """What is wrong with the dashboard's queries, one line each (empty: nothing)."""
    defined = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    problems = []
    for where, expr in queries(dashboard):
        if not expr.strip():
            problems.append(f"{where}: empty query")
            continue
        try:
            names = metric_names(expr)
        except ValueError as e:
            problems.append(f"{where}: {e}")
            continue
        if not names:
            problems.append(f"{where}: names no metric: {expr}")
        for n in sorted(names - exported.keys()):
            problems.append(f"{where}: {n} is not exported by the code")
        for n in sorted(applied_to(expr, COUNTER_FUNCTIONS)):
            if exported.get(n) == "gauge":
                problems.append(f"{where}: rate()/increase() over the gauge {n}")
        for n in sorted(applied_to(expr, GAUGE_FUNCTIONS)):
            if exported.get(n) == "counter":
                problems.append(f"{where}: delta()/deriv() over the counter {n} (use rate or increase)")
        if "histogram_quantile" in expr:
            if not all(n.endswith("_bucket") for n in names):
                problems.append(f"{where}: histogram_quantile over a series that is not a histogram's _bucket")
            if not re.search(r"\b(?:by)\s*\([^()]*\ble\b", expr):
                problems.append(f"{where}: histogram_quantile's aggregation drops the le label")
        for var in sorted(grafana_variables(expr) - defined - GRAFANA_BUILTINS):
            problems.append(f"{where}: ${var} is not a dashboard variable")
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def served() -> dict[str, dict[str, str]]:
    return served_series()


@pytest.fixture(scope="module")
def exported(served) -> dict[str, str]:
    pytest.importorskip("vllm", reason="the connector's metrics are built by vLLM's KVConnectorProm")
    return exported_series(served)


def test_every_query_names_a_metric_the_code_exports(dashboard, exported):
    assert queries(dashboard), "no queries found"
    problems = dashboard_problems(dashboard, exported)
    assert not problems, "\n".join(problems)


def test_the_exported_sets_are_what_the_docs_name(served, exported):
    # the scrape reads what the code serves: a few names the docs give, with their suffixes
    assert served["proxy"]["kvpath_proxy_requests_total"] == "counter"
    assert served["proxy"]["kvpath_proxy_e2e_seconds_bucket"] == "counter"
    assert served["proxy"]["kvpath_proxy_healthy_instances"] == "gauge"
    assert served["reservation"] == served["reservation (in the proxy)"]
    assert served["reservation"]["kvpath_reservations_total"] == "counter"
    assert served["reservation"]["kvpath_reserve_seconds_count"] == "counter"
    assert served["reservation"]["kvpath_leases_expired"] == "gauge"
    assert exported["vllm:kvpath_pushes_ok_total"] == "counter"
    assert exported["vllm:kvpath_push_seconds_bucket"] == "counter"
    assert "kvpath_proxy_requests" not in exported and "vllm:kvpath_pushes_ok" not in exported


def test_every_kvpath_metric_has_a_panel(dashboard, exported):
    """A metric added to the code without a panel fails here (``_created`` aside)."""
    shown = set().union(*(metric_names(e) for _, e in queries(dashboard)))
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in exported if not n.endswith("_created")}
    missing = sorted(f for f in families if not any(re.sub(r"_(total|bucket|sum|count)$", "", s) == f for s in shown))
    assert not missing, f"exported but on no panel of {DASHBOARD.name}: {missing}"


@pytest.mark.parametrize("expr, names", [
    ('sum by (status) (rate(kvpath_proxy_requests_total{job=~"$proxy_job",status=~"5.."}[$__rate_interval]))',
     {"kvpath_proxy_requests_total"}),
    ("histogram_quantile(0.99, sum(rate(kvpath_proxy_e2e_seconds_bucket[5m])) by (le))",
     {"kvpath_proxy_e2e_seconds_bucket"}),
    ("sum(rate(a_sum[1m])) / sum(rate(a_count[1m])) > bool 0.5 or on (instance) vector(0)", {"a_sum", "a_count"}),
    ('clamp_min(delta(kvpath_leases_expired{job="r"}[5m] offset 1h), 0) * 1e-3', {"kvpath_leases_expired"}),
    ("vllm:kvpath_pushes_ok_total", {"vllm:kvpath_pushes_ok_total"}),
    ('label_replace(up{job="x"}, "dst", "$1", "instance", "(.*):.*")', {"up"}),
    ("max_over_time(x[10m:1m]) unless ignoring (le) y", {"x", "y"}),
])
def test_the_extractor_finds_the_metric_names(expr, names):
    assert metric_names(expr) == names


def test_a_wrong_name_is_found_and_reported(dashboard, exported):
    """The check can fail: a made-up name in an expression, and in the dashboard itself."""
    wrong = "kvpath_proxy_request_total"  # "requests" misspelt
    assert metric_names(f'sum by (kind) (rate({wrong}{{job=~"$proxy_job"}}[$__rate_interval]))') == {wrong}
    assert wrong not in exported
    broken = copy.deepcopy(dashboard)
    nested = next(p for p in panels(broken) if p.get("type") != "row" and p.get("targets"))
    nested["targets"][0]["expr"] = f"sum(rate({wrong}[5m]))"
    problems = dashboard_problems(broken, exported)
    assert len(problems) == 1 and wrong in problems[0], problems
    # a collapsed row's nested panels are checked too
    row = next(p for p in panels(broken) if p.get("type") == "row" and p.get("panels"))
    row["panels"][0]["targets"][0]["expr"] = "sum(rate(vllm:kvpath_pushes_okk_total[5m]))"
    assert any("vllm:kvpath_pushes_okk_total" in p for p in dashboard_problems(broken, exported))


def test_misuses_are_reported(dashboard, exported):
    def problems_of(expr: str) -> list[str]:
        d = copy.deepcopy(dashboard)
        d["panels"] = [{"type": "timeseries", "id": 1, "title": "t", "targets": [{"refId": "A", "expr": expr}]}]
        d["templating"]["list"] = [v for v in d["templating"]["list"] if v["type"] != "query"]
        return dashboard_problems(d, exported)

    assert any("gauge" in p for p in problems_of("rate(kvpath_active_leases[5m])"))
    assert any("counter" in p for p in problems_of("delta(kvpath_releases_total[5m])"))
    no_le = "histogram_quantile(0.5, sum(rate(kvpath_reserve_seconds_bucket[5m])))"
    assert any("le label" in p for p in problems_of(no_le))
    assert any("not a histogram" in p for p in problems_of("histogram_quantile(0.5, kvpath_active_leases)"))
    assert any("no such function" in p for p in problems_of("rat(kvpath_releases_total[5m])"))
    assert any("$nope" in p for p in problems_of('kvpath_active_leases{job=~"$nope"}'))
    assert problems_of("sum(rate(kvpath_releases_total[$__rate_interval]))") == []


def test_every_panel_has_a_title_and_a_query_and_ids_are_unique(dashboard):
    ps = panels(dashboard)
    ids = [p.get("id") for p in ps]
    assert all(isinstance(i, int) for i in ids), ids
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert any(p.get("type") == "row" and p.get("collapsed") and p.get("panels") for p in ps)  # nesting is walked
    for p in ps:
        assert (p.get("title") or "").strip(), f"panel {p.get('id')} has no title"
        assert {"h", "w", "x", "y"} <= set(p.get("gridPos", {})), f"panel {p['id']} has no gridPos"
        if p["type"] == "row":
            assert not p.get("targets")
            continue
        targets = p.get("targets") or []
        assert targets and all(t.get("expr", "").strip() for t in targets), f"panel {p['id']} {p['title']!r}"
        refs = [t.get("refId") for t in targets]
        assert len(refs) == len(set(refs)) and all(refs), f"panel {p['id']} refIds {refs}"
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["id"]
        assert all(t["datasource"] == p["datasource"] for t in targets), p["id"]
        assert p.get("fieldConfig", {}).get("defaults", {}).get("unit"), f"panel {p['id']} {p['title']!r} has no unit"


def test_the_dashboard_is_importable(dashboard):
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    assert "id" not in dashboard  # Grafana assigns it on import
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
            assert LABEL_VALUES.match(v["definition"]), v["name"]
    json.dumps(dashboard)  # plain JSON


if __name__ == "__main__":  # python -m tests.proxy.test_dashboard [DASHBOARD]
    d = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else DASHBOARD).read_text())
    exp = exported_series()
    for where, expr in queries(d):
        shown = [n if n in exp else f"{n} (NOT EXPORTED)" for n in sorted(metric_names(expr))]
        print(f"{where}: {', '.join(shown)}")
    problems = dashboard_problems(d, exp)
    print("\n".join(problems) or "no problems")
    sys.exit(1 if problems else 0)
