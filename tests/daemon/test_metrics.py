"""The daemon's Prometheus metrics as an operator meets them: README's table, what a
real daemon's /metrics serves, label values that stay bounded, state gauges that go
to 0 rather than vanish, and the Grafana dashboard in deploy/grafana/."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from client_lib import Client
from client_lib import protocol as p
from nodeagent.metrics import Metrics, markdown_table
from tests.conftest import REPO, wait_for
from tests.cluster_nodes import write_cluster_config
from tests.metrics_scrape import metrics_url, scrape, value

DASHBOARD = REPO / "deploy" / "grafana" / "nodeagent.json"
FORBIDDEN_LABELS = {"session", "pid", "id", "session_id", "name"}  # per-session values: a new series each time
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_names(families: dict) -> set[str]:
    """Every series name Prometheus stores for these families (with the suffixes their type adds)."""
    return {f.name + suffix for f in families.values() for suffix in SUFFIXES.get(f.type, ("",))}


# ------------------------------------------------------------------ README and registry


def test_readme_table_is_the_registry_catalogue():
    readme = (REPO / "README.md").read_text()
    expected = markdown_table(Metrics(CollectorRegistry()).catalogue())
    header = expected.splitlines()[0]
    assert header in readme, "README.md has no metrics table: paste `python -m nodeagent.metrics` under ### Metrics"
    lines = readme[readme.index(header):].splitlines()
    table = "\n".join(lines[:next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))])
    assert table + "\n" == expected, "README.md's metrics table is stale: regenerate it with python -m nodeagent.metrics"


def test_no_metric_is_labelled_by_an_id():
    for doc in Metrics(CollectorRegistry()).catalogue():
        assert not FORBIDDEN_LABELS & set(doc.labels), doc


def test_a_real_daemon_exports_the_catalogue_without_created_series_or_id_labels(start_daemon):
    d = start_daemon("--metrics-port", "0", "--quantum-ms", "training=20")
    url = metrics_url(d)
    with Client("a", endpoint=d.endpoint) as a, Client("b", workload="inference", endpoint=d.endpoint) as b:
        a.acquire(timeout=5)
        t = threading.Thread(target=lambda: (b.acquire(timeout=5), b.release()))
        t.start()  # b preempts a
        deadline = time.monotonic() + 5
        while not a.yield_point():  # asked to yield: gives the token to b and waits for it back
            assert time.monotonic() < deadline
            time.sleep(0.001)
        t.join()
        a.release()
        wait_for(lambda: d.status().devices[0].holder is None)
        text, families = scrape(url)
    catalogue = {doc.name: doc for doc in Metrics(CollectorRegistry()).catalogue()}
    served = {}
    for family in families.values():
        name = family.name + ("_total" if family.type == "counter" else "")
        served[name] = family
    assert set(served) == set(catalogue)  # every registered metric is in README's table, and the reverse
    for name, family in served.items():
        assert family.type == catalogue[name].type, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(catalogue[name].labels), (name, sample)
            assert not FORBIDDEN_LABELS & set(sample.labels), (name, sample)
    assert "_created" not in text
    assert value(families, "nodeagent_slice_seconds", device="0", workload="training") > 0
    assert value(families, "nodeagent_slice_seconds", device="0", workload="inference") > 0
    assert value(families, "nodeagent_yield_requests", device="0", reason="preempted") >= 1


def test_state_gauges_read_zero_once_the_state_empties(start_daemon):
    d = start_daemon("--metrics-port", "0")
    url = metrics_url(d)
    with Client("trainer", endpoint=d.endpoint) as trainer:
        trainer.acquire(timeout=5)
        _, held = scrape(url)
        assert value(held, "nodeagent_token_held", device="0") == 1
        assert value(held, "nodeagent_sessions", device="0", workload="training", state="holding") == 1
        assert value(held, "nodeagent_device_memory_bytes", device="0", workload="training") == 0  # declared none
        trainer.release()
        wait_for(lambda: d.status().devices[0].holder is None)
    wait_for(lambda: not d.status().devices[0].sessions)
    _, after = scrape(url)
    assert value(after, "nodeagent_token_held", device="0") == 0
    assert value(after, "nodeagent_token_queue_length", device="0") == 0
    for state in ("idle", "holding"):
        assert value(after, "nodeagent_sessions", device="0", workload="training", state=state) == 0
    assert value(after, "nodeagent_device_state", device="0", state="FREE") == 1
    assert value(after, "nodeagent_device_lost", device="0") == 0


def test_token_queue_length_counts_the_waiters(start_daemon):
    d = start_daemon("--metrics-port", "0")
    url = metrics_url(d)
    with Client("holder", endpoint=d.endpoint) as holder, Client("waiter", endpoint=d.endpoint) as waiter:
        holder.acquire(timeout=5)
        waiter.request()
        wait_for(lambda: value(scrape(url)[1], "nodeagent_token_queue_length", device="0") == 1)
        _, families = scrape(url)
        assert value(families, "nodeagent_sessions", device="0", workload="training", state="waiting") == 1
        holder.release()
        waiter.acquire(timeout=5)
        # The grant reaches the waiter in the same turn the daemon's count changes: read it after.
        wait_for(lambda: value(scrape(url)[1], "nodeagent_token_queue_length", device="0") == 0, timeout=5)
        waiter.release()


def test_lend_and_reclaim_move_the_device_state_gauge_and_are_counted(workdir, start_daemon):
    node = write_cluster_config(workdir)
    node.daemon = start_daemon("--metrics-port", "0")
    url = metrics_url(node.daemon)
    peer = node.peer()
    try:
        assert peer.call(p.Lend(id=0, device=0, borrower="job")).changed
        _, lent = scrape(url)
        states = {s.labels["state"]: s.value for s in lent["nodeagent_device_state"].samples}
        assert states == {"FREE": 0, "RUN": 0, "PROTECT": 0, "LENT": 1, "DRAINING": 0}
        assert value(lent, "nodeagent_lends", device="0") == 1
        assert value(lent, "nodeagent_reclaims", device="0") == 0
        assert peer.call(p.Reclaim(id=0, device=0)).changed
        _, back = scrape(url)
        assert value(back, "nodeagent_device_state", device="0", state="LENT") == 0  # 0, not gone
        assert value(back, "nodeagent_device_state", device="0", state="PROTECT") == 1
        assert value(back, "nodeagent_reclaims", device="0") == 1
        assert value(back, "nodeagent_reclaim_seconds") == 1  # the histogram's _count
    finally:
        peer.close()


def _prom_tool(name: str) -> str:
    """Debian's Prometheus binaries (tests/prom_tools.py), or a skip that says why not here."""
    from tests import prom_tools
    try:
        return str(getattr(prom_tools, name)())
    except prom_tools.ToolMissing as exc:
        pytest.skip(str(exc))


def test_promtool_finds_nothing_to_complain_about(start_daemon):
    d = start_daemon("--metrics-port", "0")
    text, _ = scrape(metrics_url(d))
    out = subprocess.run([_prom_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


# ------------------------------------------------------------------ the Grafana dashboard

_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                 "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: what is left once strings, label
    matchers, ranges, label lists, Grafana variables, functions and keywords are set aside."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)
    s = _LABEL_LISTS.sub(" ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group().lower() in _PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group())
    return names


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets, then variable queries."""
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
        exprs.append(m.group(1) if m else query)
    return exprs


def test_metric_names_are_read_from_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le, device) (rate(nodeagent_a_bucket{device=~"$device",'
                        ' x="a{b}"}[$__rate_interval]))) / on (device) group_left nodeagent_b * 1e3') == {
        "nodeagent_a_bucket", "nodeagent_b"}
    assert metric_names("sum(rate(nodeagent_c_total[5m])) by (kind) > bool 0") == {"nodeagent_c_total"}
    assert dashboard_queries({"panels": [], "templating": {"list": [
        {"query": {"query": 'label_values(nodeagent_d{instance=~"$instance"}, device)'}}]}}) == [
        'nodeagent_d{instance=~"$instance"}']


def test_dashboard_is_an_importable_grafana_dashboard():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["title"] and dashboard["uid"]
    assert [(i["name"], i["type"], i["pluginId"]) for i in dashboard["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")]
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    ids, cells = set(), set()
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids, panel["title"]
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == source and panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source and target["expr"].strip(), panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == source, variable["name"]


def test_dashboard_shows_what_operators_watch():
    exprs = dashboard_queries(json.loads(DASHBOARD.read_text()))
    used = set().union(*map(metric_names, exprs))
    assert {"nodeagent_token_held", "nodeagent_token_queue_length", "nodeagent_yield_requests_total",
            "nodeagent_enforcements_total", "nodeagent_suspends_total", "nodeagent_parked_bytes_total",
            "nodeagent_device_memory_bytes", "nodeagent_journal_ok", "nodeagent_sessions", "nodeagent_lends_total",
            "nodeagent_reclaims_total"} <= used
    for histogram in ("nodeagent_token_wait_seconds", "nodeagent_token_handoff_seconds"):
        for q in ("0.5", "0.99"):
            assert any(e.lstrip("(").startswith(f"histogram_quantile({q},") and f"{histogram}_bucket" in e
                       for e in exprs), (
                histogram, q)


def test_every_dashboard_expression_names_a_metric_the_daemon_exports(start_daemon):
    d = start_daemon("--metrics-port", "0")
    _, families = scrape(metrics_url(d))
    exported = exported_names(families)
    for expr in dashboard_queries(json.loads(DASHBOARD.read_text())):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{sorted(names - exported)} in {expr!r} is not exported by the daemon"


@pytest.mark.parametrize("sharing", ["corun", "exclusive"])
def test_every_series_the_dashboard_reads_has_a_sample_on_a_fresh_daemon(start_daemon, sharing):
    """A healthy node that has seen nothing yet: every panel has a series to show (at 0),
    not "No data". A labelled metric with no sample is exported as its HELP line alone.
    Co-run (the GPU's default) has every series; an exclusive daemon has no pacing, and its
    pacing panels say so (test_a_panel_that_can_be_empty_says_why)."""
    d = start_daemon("--metrics-port", "0", "--sharing", sharing)
    _, families = scrape(metrics_url(d))
    sampled = {s.name for f in families.values() for s in f.samples}
    read = set().union(*map(metric_names, dashboard_queries(json.loads(DASHBOARD.read_text()))))
    if sharing == "exclusive":
        read -= {"nodeagent_pace_duty_permille", "nodeagent_pace_changes_total"}
    assert not read - sampled, f"no sample on a fresh daemon for {sorted(read - sampled)}: start them at 0"


def test_every_exported_family_is_on_a_panel(start_daemon):
    d = start_daemon("--metrics-port", "0", "--sharing", "corun")
    _, families = scrape(metrics_url(d))
    used = set().union(*map(metric_names, dashboard_queries(json.loads(DASHBOARD.read_text()))))
    missing = sorted(f.name for f in families.values()
                     if f.name.startswith("nodeagent_") and not any(
                         f.name + suffix in used for suffix in SUFFIXES.get(f.type, ("",))))
    assert not missing, f"exported but on no panel of {DASHBOARD.name}: {missing}"


def _quantile_samples_free(expr: str) -> bool:
    """Whether ``expr``, a quantile, draws nothing where it has no samples: NaN filtered out."""
    return re.fullmatch(r"\(histogram_quantile\(.*\)\) >= 0", expr) is not None


def test_a_panel_that_can_be_empty_says_why():
    """A quantile over a window with no samples is NaN, which Grafana draws as nothing at all
    (10 of the dashboard's expressions on a fresh daemon, 6 under the README's walkthrough):
    each quantile keeps only numbers, and its panel says what it waits for."""
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel.get("targets", ())]
        quantiles = [e for e in exprs if "histogram_quantile" in e]
        may_be_empty = quantiles or any("nodeagent_pace_" in e for e in exprs)
        for expr in quantiles:
            assert _quantile_samples_free(expr), f"{panel['title']!r}: {expr} draws NaN before its first sample"
        if may_be_empty:
            no_value = panel["fieldConfig"]["defaults"].get("noValue", "")
            assert no_value.startswith("no "), f"{panel['title']!r} says nothing while it has no samples"
    assert _quantile_samples_free('(histogram_quantile(0.5, sum by (le) (rate(x_bucket[1m])))) >= 0')
    assert not _quantile_samples_free('histogram_quantile(0.5, sum by (le) (rate(x_bucket[1m])))')


def test_the_label_values_started_at_0_are_those_the_daemon_uses():
    """The places and reasons started at 0 are read off the daemon's code, so that a new one
    added there without being added to nodeagent/metrics.py fails here, not on a dashboard."""
    from nodeagent import metrics

    daemon = REPO / "nodeagent" / "daemon"
    code = "\n".join(path.read_text() for path in daemon.glob("*.py"))
    places = set(re.findall(r'_(?:contain|count_bug)\("([\w-]+)"', code)) | set(
        re.findall(r'internal_errors\.labels\("([\w-]+)"\)', code)) | set(
        re.findall(r'_dispatch\([^)]*?"([\w-]+)",', code))
    assert places and places <= set(metrics.INTERNAL_ERROR_PLACES), sorted(places - set(metrics.INTERNAL_ERROR_PLACES))
    local = set(re.findall(r'self\._drop\(peer, "(\w+)"', (daemon / "loop.py").read_text())) - {"closed", "shutdown"}
    server = set(re.findall(r'self\._drop\(\w+, "(\w+)"', (daemon / "server.py").read_text())) - {"bye"}
    reasons = local | server | {"process_exited", "disconnected"}  # what a closed connection becomes
    assert reasons == set(metrics.SESSION_LOST_REASONS), (sorted(reasons), metrics.SESSION_LOST_REASONS)


def test_host_memory_kept_for_parked_state_is_summed_per_device_and_pinning():
    from nodeagent.metrics import DeviceRow, SessionRow
    m = Metrics(CollectorRegistry())
    rows = [SessionRow("0", "training", "idle", 0, 4096, True), SessionRow("0", "training", "idle", 0, 8192, True),
            SessionRow("0", "training", "idle", 0, 100, False), SessionRow("1", "training", "idle", 0)]
    m.watch(2, lambda: [DeviceRow(str(i), "FREE", False, False, 0) for i in range(2)], lambda: rows)
    from prometheus_client import generate_latest
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    kept = {(s.labels["device"], s.labels["pinned"]): s.value for s in families["nodeagent_host_kept_bytes"].samples}
    assert kept == {("0", "true"): 12288, ("0", "false"): 100, ("1", "true"): 0, ("1", "false"): 0}


def test_the_hot_path_instruments_export_what_prometheus_client_would_byte_for_byte():
    """token_wait, token_handoff and slice_seconds are written on every handoff by the loop
    alone, so they are plain floats (no lock, no bucket loop) exported by their own collector:
    the text a scrape gets must be what prometheus_client's own instruments would write."""
    import math

    import prometheus_client
    from prometheus_client import Counter, Histogram, generate_latest

    from nodeagent.metrics import LoopCounter, LoopHistogram

    prometheus_client.disable_created_metrics()
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    buckets = (0.0001, 0.0005, 0.001, 0.0025, 0.01)
    hist = LoopHistogram("h_seconds", "a histogram", ("device", "workload"), buckets)
    count = LoopCounter("c_seconds", "a counter", ("device",))
    ours.register(hist)
    ours.register(count)
    ref_hist = Histogram("h_seconds", "a histogram", ("device", "workload"), buckets=buckets, registry=theirs)
    ref_count = Counter("c_seconds", "a counter", ("device",), registry=theirs)
    # On a bound, between bounds, past the last, 0, and a label set that is never written.
    for value in (0.0, 0.0001, 0.00010001, 0.0007, 0.0025, 0.5, 7.0, 1e-12):
        hist.labels("0", "training").observe(value)
        ref_hist.labels("0", "training").observe(value)
        count.labels(1).inc(value)
        ref_count.labels("1").inc(value)
    hist.labels("1", "inference")
    ref_hist.labels("1", "inference")
    assert generate_latest(ours) == generate_latest(theirs)
    with pytest.raises(ValueError):
        count.labels("1").inc(-1.0)
    with pytest.raises(ValueError):
        hist.labels("0")  # one label of two
    assert hist.labels("0", "training").counts[-1] == 2.0 and not math.isnan(hist.labels("0", "training").sum)


def test_the_daemon_writes_its_hot_path_metrics_through_the_loop_instruments():
    from nodeagent.metrics import LoopCounter, LoopHistogram

    m = Metrics(CollectorRegistry())
    assert isinstance(m.token_wait, LoopHistogram) and isinstance(m.token_handoff, LoopHistogram)
    assert isinstance(m.slice_seconds, LoopCounter)
    text = {f.name: f for f in text_string_to_metric_families(
        __import__("prometheus_client").generate_latest(m.registry).decode())}
    assert text["nodeagent_token_handoff_seconds"].type == "histogram"
    assert text["nodeagent_slice_seconds"].type == "counter"


# ------------------------------------------------------------------ a real Prometheus

class _Prometheus:
    """A real Prometheus on loopback scraping one daemon every second, for the dashboard's
    expressions evaluated as Grafana asks them (its variables filled in)."""

    def __init__(self, tmp_path, target: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = tmp_path / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                          "scrape_configs:\n"
                          f"  - {{job_name: nodeagent, static_configs: [{{targets: ['{target}']}}]}}\n")
        self.log = tmp_path / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [_prom_tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def scrapes(self) -> int:
        """How many scrapes of the daemon it has stored in the last minute."""
        try:
            found = self.query('count_over_time(up{job="nodeagent"}[1m])')
        except OSError:  # not listening yet
            return 0
        return int(float(found[0]["value"][1])) if found else 0

    def draws(self, expr: str) -> bool:
        """Whether Grafana draws something for ``expr``: a series with a number (NaN is nothing)."""
        for name, fill in (("$__rate_interval", "10s"), ("$instance", ".*"), ("$device", ".*")):
            expr = expr.replace(name, fill)
        return any(not math.isnan(float(series["value"][1])) for series in self.query(expr))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _silent_panels(prom: _Prometheus) -> dict[str, bool]:
    """Each panel that draws nothing -> whether it says why (its noValue text)."""
    silent = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] != "row" and not any(prom.draws(t["expr"]) for t in panel["targets"]):
            silent[panel["title"]] = panel["fieldConfig"]["defaults"].get("noValue", "").startswith("no ")
    return silent


@pytest.mark.slow
def test_a_real_prometheus_draws_every_panel_or_says_why_fresh_and_under_load(start_daemon, tmp_path):
    """Issue 29's operator check, live: Prometheus 2.42 scrapes a co-run daemon every second and
    evaluates every panel's expressions. On a fresh daemon each panel draws or says what it waits
    for; after slices of two trainers and a service the token panels draw."""
    d = start_daemon("--metrics-port", "0", "--sharing", "corun")
    prom = _Prometheus(tmp_path, metrics_url(d).split("/")[2])
    try:
        wait_for(lambda: prom.scrapes() >= 3, timeout=60, interval=0.25)
        silent = _silent_panels(prom)
        assert all(silent.values()), f"fresh daemon: panels that draw nothing and say nothing: {silent}"

        stop = threading.Event()

        def take_turns(name: str, workload: str) -> None:
            with Client(name, workload=workload, endpoint=d.endpoint) as c:
                while not stop.is_set():
                    c.acquire(timeout=10)
                    time.sleep(0.01)
                    c.release()
        # Two trainers hand the token to each other (a co-run service runs beside them, no handoff).
        turns = [threading.Thread(target=take_turns, args=(n, w)) for n, w in (
            ("trainer-a", "training"), ("trainer-b", "training"), ("service", "inference"))]
        for t in turns:
            t.start()
        try:
            time.sleep(3.0)  # a few scrapes with slices in them
        finally:
            stop.set()
            for t in turns:
                t.join(timeout=30)
        seen = prom.scrapes()
        wait_for(lambda: prom.scrapes() >= seen + 2, timeout=30, interval=0.25)
        silent = _silent_panels(prom)
        assert all(silent.values()), f"under load: panels that draw nothing and say nothing: {silent}"
        for drawn in ("Token wait p50 / p99, by workload", "Token handoff p50 / p99, by device",
                      "GPU time held, by workload", "Token holder per device", "Sessions by workload"):
            assert drawn not in silent, f"{drawn!r} draws nothing after slices were taken"
    finally:
        prom.close()
