"""The Ray scenario stays on this host (issue 24): every Ray node it starts (head, one per
node, loan nodes) and every daemon endpoint binds 127.0.0.1 unless --node-ip says otherwise.
Reads the command lines built; starts nothing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from nodeagent_ray.raynode import RayNodeSpec, ray_start_argv
from tests.conftest import REPO


def _example():
    spec = importlib.util.spec_from_file_location("ray_colocate", REPO / "examples" / "ray_colocate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ray_colocate", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _node_ip(argv: list[str]) -> str:
    assert argv.count("--node-ip-address") == 1, argv
    return argv[argv.index("--node-ip-address") + 1]


def test_a_node_without_an_address_is_left_to_ray():
    assert "--node-ip-address" not in ray_start_argv(RayNodeSpec(temp_dir="/t", plasma_dir="/p"), None)


@pytest.mark.parametrize("node_ip", [None, "10.1.2.3"])
def test_every_ray_node_and_daemon_of_the_scenario_binds_loopback_unless_told(tmp_path, node_ip):
    example = _example()
    run = example.Run(str(tmp_path)) if node_ip is None else example.Run(str(tmp_path), node_ip)
    want = node_ip or "127.0.0.1"
    head = ray_start_argv(run.spec({"nodeagent_head": 100}), None)
    node = ray_start_argv(run.spec({"nodeagent_node:n1": 100}), "127.0.0.1:6379")
    assert "--head" in head and _node_ip(head) == want and _node_ip(node) == want
    assert run.tcp_endpoint().startswith(f"tcp://{want}:")  # the daemons' cluster and events endpoints


def test_loan_nodes_get_the_address_of_their_settings(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    from nodeagent_ray.actors import LoanSettings, loan_node_spec
    settings = LoanSettings(address="127.0.0.1:6379", state_dir=str(tmp_path), temp_dir=str(tmp_path),
                            endpoint="ipc:///x.sock", node_ip="127.0.0.1")
    assert _node_ip(ray_start_argv(loan_node_spec(settings, "n1", 0, "job-7"), settings.address)) == "127.0.0.1"


def test_the_scenario_flag_defaults_to_loopback_and_reaches_the_driver():
    out = subprocess.run([sys.executable, str(REPO / "examples" / "ray_colocate.py"), "--help"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and "--node-ip" in out.stdout and "127.0.0.1" in out.stdout
    source = (REPO / "examples" / "ray_colocate.py").read_text()
    assert '"--node-ip", args.node_ip' in source and "Run(args.workdir, args.node_ip)" in source
