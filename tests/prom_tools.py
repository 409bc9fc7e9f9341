"""Real Prometheus and promtool for the metrics tests, fetched once and cached under
``.venv/prom-tools`` (git-ignored with ``.venv/``): Debian's ``prometheus`` package at one
version (``apt-get download``, after ``apt-get update`` where root finds no package lists, then
its two binaries out of the ``.deb``: nothing is installed on the machine).

Each getter returns the tool's path, or raises ``ToolMissing`` (tests/tool_cache.py) whose
message says why it could not be had (no apt, no registry, not Debian): the tests skip with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.tool_cache import ToolCache, ToolMissing  # noqa: F401 (ToolMissing: raised to the tests)

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("NODEAGENT_PROM_TOOLS", REPO / ".venv" / "prom-tools"))
PACKAGE = "prometheus=2.42.0+ds-5+deb12u1"  # Debian 12's: Prometheus 2.42, promtool with it
FETCH_TIMEOUT_S = 300


def _fetch() -> None:
    """The package's .deb by ``apt-get download``, unpacked by ``dpkg-deb -x``, into CACHE/bin."""
    apt, dpkg_deb = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if apt is None or dpkg_deb is None:
        raise ToolMissing(f"apt-get and dpkg-deb are needed to fetch Debian's {PACKAGE}; this is not Debian")
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        os.chmod(tmp, 0o755)  # apt's sandbox user reads and writes the download there
        done = subprocess.run([apt, "download", "-q", PACKAGE], cwd=tmp, capture_output=True, text=True,
                              timeout=FETCH_TIMEOUT_S)
        if done.returncode != 0 and os.geteuid() == 0:  # a fresh machine may have no package lists yet
            subprocess.run([apt, "update", "-q"], capture_output=True, timeout=FETCH_TIMEOUT_S)
            done = subprocess.run([apt, "download", "-q", PACKAGE], cwd=tmp, capture_output=True, text=True,
                                  timeout=FETCH_TIMEOUT_S)
        debs = list(Path(tmp).glob("prometheus_*.deb"))
        if done.returncode != 0 or not debs:
            why = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
            raise ToolMissing(f"`apt-get download {PACKAGE}` failed ({why}); `apt-get update` may be needed")
        unpacked = Path(tmp) / "x"
        subprocess.run([dpkg_deb, "-x", str(debs[0]), str(unpacked)], check=True, timeout=FETCH_TIMEOUT_S)
        for name in _TOOLS.binaries:
            _TOOLS.install(name, (unpacked / "usr" / "bin" / name).read_bytes())


_TOOLS = ToolCache(CACHE, ("prometheus", "promtool"), _fetch)


def prometheus() -> Path:
    return _TOOLS.tool("prometheus")


def promtool() -> Path:
    return _TOOLS.tool("promtool")
