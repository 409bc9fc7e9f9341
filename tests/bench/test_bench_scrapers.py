"""bench.scrapers runs end to end (60 slow scrapers for 1.5 s) and reports what it promises."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_scrapers_bench_reports_threads_memory_scrape_cost_and_handoffs_against_idle():
    out = subprocess.run([sys.executable, "-m", "bench.scrapers", "--json", "--scrapers", "60", "--storm-s", "1.5",
                          "--handoffs", "200", "--rounds", "1", "--cost-scrapes", "3", "--metrics-timeout-ms", "500",
                          "--byte-interval-s", "0.1", "--reconnect-s", "0.1"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["benchmark"] == "scrapers" and r["scrapers"] == 60 and r["kinds"] == ["idle", "slowloris", "no-reader"]
    assert r["connect_failures"] == 0 and r["connect_s"] < 5
    assert r["closed_by_daemon"] > 0 and r["daemon_closed"]["timeout"] > 0  # 1.5 s past a 0.5 s timeout
    assert r["threads_idle"] >= 1 and r["threads_delta"] == r["threads_storm_max"] - r["threads_idle"]
    assert r["rss_delta_kb"] == r["rss_storm_max_kb"] - r["rss_idle_kb"]
    assert r["cost_scrapes"] == 3 and r["exposition_bytes"] > 1000 and r["scrape_p50_ms"] > 0
    assert r["cpu_per_scrape_ms"] is not None and r["cpu_per_scrape_ms"] >= 0
    assert r["honest_failures"] == 0 and r["honest_scrapes"] >= 1
    for phase in ("idle", "scraping", "storm"):
        assert r["samples"][phase] >= 150, phase
        assert r[f"handoff_{phase}_p50_us"] > 0 and r[f"handoff_{phase}_p99_us"] > 0
    assert r["handoff_storm_over_idle_p50"] == pytest.approx(
        r["handoff_storm_p50_us"] / r["handoff_idle_p50_us"], rel=0.01)
    goals = {g["goal"]: g for g in r["goals"]}
    assert goals["threads_delta <= 10"]["met"] == (r["threads_delta"] <= 10)
    assert goals["rss_delta_kb <= 10240"]["value"] == r["rss_delta_kb"]
    assert r["all_goals_met"] == all(g["met"] for g in r["goals"])
