"""deploy/kubernetes and the Helm chart (deploy/helm/nodeagent), checked without a cluster.

Where ``helm`` and ``kubeconform`` are on PATH they render and validate (those tests say so
when they skip). Everywhere, the chart is rendered by tests/helm_subset.py and every
manifest is checked for what a schema cannot see: kinds, selectors that match their pods'
labels, mounts of volumes that exist, each ``nodeagent`` command parsed by nodeagent's own
parser, the daemon's config loaded by its own loader, the socket, state and kubelet paths
agreeing with the daemon's and the plugin's defaults and with each other, the events keys
the init container writes being the ones the daemon and the plugin read, and the
capabilities being the systemd unit's. The plain manifests and the chart deploy the same
pod."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from client_lib.endpoint import SYSTEM_SOCKET
from nodeagent.cli import build_parser
from nodeagent.config import ServeConfig, load_file
from tests.conftest import REPO
from tests.helm_subset import Chart
from tests.test_systemd import UNIT, parse_unit

PLAIN = REPO / "deploy" / "kubernetes"
CHART = REPO / "deploy" / "helm" / "nodeagent"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
KUBELET_DIR = "/var/lib/kubelet/device-plugins"  # nodeagent.k8s.plugin.KUBELET_DIR, without importing grpc
KNOWN_KINDS = {("v1", "Namespace"), ("v1", "ConfigMap"), ("apps/v1", "DaemonSet"), ("v1", "Pod"),
               ("kustomize.config.k8s.io/v1beta1", "Kustomization")}
NAMESPACED = {"ConfigMap", "DaemonSet"}


def load_docs(text: str, origin: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(io.StringIO(text)) if d is not None]
    for doc in docs:
        assert isinstance(doc, dict), f"{origin}: a document that is not a mapping"
        assert (doc.get("apiVersion"), doc.get("kind")) in KNOWN_KINDS, \
            f"{origin}: unknown apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')}"
        if doc["kind"] != "Kustomization":
            assert doc.get("metadata", {}).get("name"), f"{origin}: {doc['kind']} without metadata.name"
    return docs


def plain_docs() -> dict[str, list[dict]]:
    return {str(path.relative_to(PLAIN)): load_docs(path.read_text(), str(path))
            for path in sorted(PLAIN.rglob("*.yaml"))}


def chart_docs(values: dict | None = None) -> list[dict]:
    rendered = Chart(CHART, values=values).render()
    return [doc for name, text in rendered.items() if name.endswith(".yaml")
            for doc in load_docs(text, f"{CHART}/templates/{name}")]


def one(docs: list[dict], kind: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def containers(pod_spec: dict) -> dict[str, dict]:
    every = pod_spec.get("initContainers", []) + pod_spec["containers"]
    names = [c["name"] for c in every]
    assert len(names) == len(set(names)), f"container names repeat: {names}"
    return {c["name"]: c for c in every}


def option(command: list[str], flag: str, default: str | None = None) -> str | None:
    return command[command.index(flag) + 1] if flag in command else default


def mount_of(container: dict, volume: str) -> dict:
    [mount] = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    return mount


def daemon_config(configmap: dict) -> ServeConfig:
    """The ConfigMap's nodeagent.toml through the daemon's own loader and validation."""
    config = ServeConfig()
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(configmap["data"]["nodeagent.toml"])
        f.flush()
        load_file(config, f.name, required=True)
    config.validate()
    return config


def unit_capabilities() -> set[str]:
    unit = parse_unit(UNIT.read_text())
    return {cap.removeprefix("CAP_") for cap in unit["Service"]["CapabilityBoundingSet"][-1].split()}


def check_node_agent(docs: list[dict]) -> None:
    """Everything the DaemonSet and its ConfigMap must agree on (see the module docstring)."""
    ds, cm = one(docs, "DaemonSet"), one(docs, "ConfigMap")
    namespaces = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
    for doc in (ds, cm):
        assert doc["metadata"].get("namespace"), f"{doc['kind']} has no namespace"
        if namespaces:
            assert doc["metadata"]["namespace"] in namespaces
    spec = ds["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items(), "the selector does not match the pod's labels"
    assert pod["hostPID"] is True  # verified clients: their pids, pidfds, SIGSTOP/SIGCONT
    by_name = containers(pod)
    assert len({c["image"] for c in by_name.values()}) == 1, "every container runs the same image"

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {m["name"] for c in by_name.values() for m in c.get("volumeMounts", [])}
    assert mounted <= set(volumes), f"mounts of volumes that do not exist: {mounted - set(volumes)}"
    assert set(volumes) <= mounted, f"volumes nobody mounts: {set(volumes) - mounted}"

    commands = {name: c["command"] for name, c in by_name.items()}
    parsed = {}
    for name, command in commands.items():
        assert command[0] == "nodeagent", f"{name}: {command}"
        try:
            parsed[name] = build_parser().parse_args(command[1:])
        except SystemExit:
            pytest.fail(f"container {name}: nodeagent refuses its command line {command}")

    # The daemon: its config file is the ConfigMap, its socket and state on the host.
    daemon = by_name["daemon"]
    assert parsed["daemon"].command == "serve"
    config_path = parsed["daemon"].config
    config_mount = next(m for m in daemon["volumeMounts"] if m["mountPath"] == config_path)
    assert volumes[config_mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert config_mount["subPath"] in cm["data"]
    config = daemon_config(cm)
    socket_dir = os.path.dirname(SYSTEM_SOCKET)
    assert config.endpoint == "ipc://" + SYSTEM_SOCKET  # the daemon's own default for root
    assert mount_of(daemon, "socket-dir")["mountPath"] == socket_dir
    assert volumes["socket-dir"]["hostPath"]["path"] == socket_dir  # pods get the host's path
    assert mount_of(daemon, "state")["mountPath"] == config.state_dir == volumes["state"]["hostPath"]["path"]
    sc = daemon["securityContext"]
    assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False  # User=root, NoNewPrivileges=yes
    assert sc["capabilities"]["drop"] == ["ALL"] and set(sc["capabilities"]["add"]) == unit_capabilities()
    timeout_stop_s = float(parse_unit(UNIT.read_text())["Service"]["TimeoutStopSec"][-1])
    assert pod["terminationGracePeriodSeconds"] > timeout_stop_s
    if config.metrics_port:
        assert {p["name"]: p["containerPort"] for p in daemon["ports"]}["metrics"] == config.metrics_port
        assert config.metrics_addr == "0.0.0.0"  # else nothing outside the pod can scrape it

    # The events keys: written by the init container, read by the daemon and the plugin.
    keys = parsed["keys"]
    assert keys.command == "keys" and keys.force  # a new pod overwrites what a restart left
    assert config.cluster_keys_dir == keys.dir
    for name in ("keys", "daemon") + (("device-plugin",) if "device-plugin" in by_name else ()):
        assert mount_of(by_name[name], "keys")["mountPath"] == keys.dir
    assert "emptyDir" in volumes["keys"]  # the pod's own: the secret keys never reach the host

    plugin_args = parsed.get("device-plugin")
    if plugin_args is None:
        assert "device-plugins" not in volumes
        return
    plugin = by_name["device-plugin"]
    assert plugin_args.command == "k8s-device-plugin"
    assert plugin_args.endpoint == config.endpoint
    assert mount_of(plugin, "socket-dir")["mountPath"] == socket_dir and mount_of(plugin, "socket-dir")["readOnly"]
    kubelet_dir = plugin_args.kubelet_dir or KUBELET_DIR
    assert kubelet_dir == KUBELET_DIR == mount_of(plugin, "device-plugins")["mountPath"]
    assert volumes["device-plugins"]["hostPath"]["path"] == KUBELET_DIR
    assert plugin_args.events == config.cluster_events_endpoint
    [client] = keys.client
    assert plugin_args.events_client_key == f"{keys.dir}/clients/{client}.key_secret"
    assert plugin_args.events_server_key == f"{keys.dir}/server.key"
    assert plugin["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert "add" not in plugin["securityContext"]["capabilities"]


# ------------------------------------------------------------------ the plain manifests


def test_the_plain_manifests_hold_together():
    docs = plain_docs()
    everything = [d for name, ds in docs.items() if not name.startswith("examples/") for d in ds]
    check_node_agent(everything)
    [kustomization] = docs["kustomization.yaml"]
    listed = set(kustomization["resources"])
    assert listed == {name for name in docs if name != "kustomization.yaml" and not name.startswith("examples/")}


def test_the_example_pod_asks_for_what_the_plugin_offers():
    docs = plain_docs()
    pod = one(docs["examples/pod.yaml"], "Pod")
    ds = one(docs["daemonset.yaml"], "DaemonSet")
    plugin = containers(ds["spec"]["template"]["spec"])["device-plugin"]["command"]
    resource = option(plugin, "--resource-name", "nodeagent.io/gpu")
    [container] = pod["spec"]["containers"]
    assert resource in container["resources"]["limits"]
    gid = int(re.search(r"groupadd --system --gid (\d+) nodeagent", DOCKERFILE.read_text()).group(1))
    assert gid in pod["spec"]["securityContext"]["supplementalGroups"]
    assert yaml.safe_load((CHART / "values.yaml").read_text())["socketGroupId"] == gid


# ------------------------------------------------------------------ the chart


def test_the_chart_renders_and_holds_together_without_helm():
    check_node_agent(chart_docs())
    check_node_agent(chart_docs({"devicePlugin": {"enabled": False}}))
    check_node_agent(chart_docs({"runtimeClassName": "nvidia", "nodeSelector": {"gpu": "yes"},
                                 "daemon": {"metricsPort": 0, "extraConfig": "[scheduler]\ngrace_ms = 50.0"},
                                 "devicePlugin": {"shares": 8, "lent": "healthy"}}))
    spec = one(chart_docs({"runtimeClassName": "nvidia", "nodeSelector": {"gpu": "yes"}}),
               "DaemonSet")["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia" and spec["nodeSelector"] == {"gpu": "yes"}
    config = daemon_config(one(chart_docs({"daemon": {"extraConfig": "[scheduler]\ngrace_ms = 50.0"}}), "ConfigMap"))
    assert config.grace_ms == 50.0


def test_the_chart_deploys_the_pod_the_plain_manifests_do():
    docs = plain_docs()
    plain_ds, chart_ds = one(docs["daemonset.yaml"], "DaemonSet"), one(chart_docs(), "DaemonSet")

    def pod(ds: dict) -> dict:
        spec = yaml.safe_load(yaml.safe_dump(ds["spec"]["template"]["spec"]))
        for c in spec.get("initContainers", []) + spec["containers"]:
            c.pop("imagePullPolicy", None)
            if c["name"] == "device-plugin":  # the chart spells out every default
                args = vars(build_parser().parse_args(c["command"][1:]))
                args["kubelet_dir"] = args["kubelet_dir"] or KUBELET_DIR
                c["command"] = args
        spec["volumes"] = [dict(v, configMap={"name": "-"}) if "configMap" in v else v for v in spec["volumes"]]
        return spec

    assert pod(plain_ds) == pod(chart_ds)
    assert vars(daemon_config(one(docs["configmap.yaml"], "ConfigMap"))) == \
        vars(daemon_config(one(chart_docs(), "ConfigMap")))


def _leaves(node, path=""):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}" if path else key)
    else:
        yield path


def test_every_chart_value_is_read_by_a_template():
    chart = Chart(CHART)
    chart.render()
    unread = [leaf for leaf in _leaves(chart.values)
              if not any(leaf == used or leaf.startswith(used + ".") for used in chart.used)]
    assert not unread, f"values.yaml sets what no template reads: {unread}"


def test_helm_template_renders_the_chart():
    helm = shutil.which("helm")
    if helm is None:
        pytest.skip("helm is not on PATH: the chart is rendered by tests/helm_subset.py instead "
                    "(test_the_chart_renders_and_holds_together_without_helm)")
    done = subprocess.run([helm, "template", "nodeagent", str(CHART), "--namespace", "nodeagent-system"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check_node_agent(load_docs(done.stdout, "helm template"))
    assert Chart(CHART).render()  # and the subset renderer agrees enough to be trusted without helm
    helm_ds = one(load_docs(done.stdout, "helm template"), "DaemonSet")
    assert helm_ds["spec"]["template"]["spec"] == one(chart_docs(), "DaemonSet")["spec"]["template"]["spec"]


def test_kubeconform_validates_the_manifests(tmp_path: Path):
    kubeconform = shutil.which("kubeconform")
    if kubeconform is None:
        pytest.skip("kubeconform is not on PATH: the manifests are checked by structure only (the tests above)")
    files = [p for p in PLAIN.rglob("*.yaml") if p.name != "kustomization.yaml"]
    rendered = tmp_path / "chart.yaml"
    rendered.write_text("\n---\n".join(yaml.safe_dump(d) for d in chart_docs()))
    args = [kubeconform, "-strict", "-summary"]
    if os.environ.get("KUBECONFORM_SCHEMA_LOCATION"):  # offline: a local copy of the schemas
        args += ["-schema-location", os.environ["KUBECONFORM_SCHEMA_LOCATION"]]
    done = subprocess.run(args + [str(p) for p in files] + [str(rendered)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
