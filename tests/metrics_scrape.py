"""A running daemon's Prometheus endpoint, scraped: where it serves, its families, one sample."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for


def metrics_url(daemon) -> str:
    """Where a daemon started with ``--metrics-port 0`` serves (it logs the port it got)."""
    found = wait_for(lambda: re.search(r"\[metrics\] serving (http://\S+/metrics)", daemon.log()))
    return found.group(1)


def scrape(url: str) -> tuple[str, dict]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, family: str, **labels) -> float | None:
    """The sample of ``family`` with exactly these labels (counters: its _total), or None if absent."""
    for s in families[family].samples:
        if s.labels == labels and not s.name.endswith(("_created", "_bucket", "_sum")):
            return s.value
    return None
