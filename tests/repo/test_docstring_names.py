"""Every name a docstring (or docs/architecture.md) writes as code exists (issue 31, part 4).

A docstring that names ``Tokens.bind_successor`` after that method is gone sends its reader
looking for code that is not there. This test collects what the package's docstrings write as
code -- ``double`` or `single` backticks, ``:meth:``/``:class:`` roles, ``module.attr``,
``Class.method``, file paths -- and checks each against an index of the package built from its
source (modules, classes, functions, methods, attributes, parameters, the string constants that
are its ops, event kinds and metric names), the config declaration (``example_toml()``: a
``table.key`` must be a setting), the wire types (``welcome.pace`` must be a field of the
message tagged ``welcome`` in ``client_lib/protocol.py``) and the repository's files. Names from outside the package are allowed by the first segment: the standard
library's modules, and the short explicit list ``EXTERNAL`` below.
"""

from __future__ import annotations

import ast
import builtins
import functools
import keyword
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
PACKAGES = ("nodeagent", "sharing", "client_lib", "ctxpool", "nodeagent_ray")
GENERATED = ("nodeagent/k8s/v1beta1/",)
DOCS = ("docs/architecture.md", "docs/internals.md")

# Third-party modules (and the few foreign names written bare) the package's text may name.
EXTERNAL = {
    "msgspec", "torch", "zmq", "numpy", "np", "prometheus_client", "ray", "grpc", "pynvml", "nvml",
    "hypothesis", "pytest", "safetensors", "transformers", "lightning", "accelerate", "huggingface_hub",
    "yaml", "kubernetes", "google", "cuda", "cupy", "triton", "vllm", "nccl", "pyzmq", "uvloop",
    "Trainer", "TrainerCallback", "LightningModule", "Callback", "nn", "optim", "F", "CUDA",
    # CUDA driver / runtime / NVML entry points the text explains itself against
    "cuMemCreate", "cuMemMap", "cuMemAddressReserve", "cuMemUnmap", "cuMemRelease", "cuMemSetAccess",
    "cuMemAddressFree", "cudaMemcpyAsync", "cudaHostRegister", "cudaMallocHost", "cudaStreamSynchronize",
    "cudaEventSynchronize", "cudaEventRecord", "cudaMalloc", "cuInit", "cudaSetDevice",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMemoryInfo", "nvmlInit", "CUresult",
    "cudaErrorInvalidValue", "cudaGetDeviceCount", "cuDeviceGetCount", "ncclCommSuspend", "ncclCommResume",
    "NCCL_SUSPEND_MEM", "EXCLUSIVE_PROCESS", "mem_get_info", "MultiheadAttention", "out_proj",
    "torch_memory_saver", "pytorch_lightning",
    # the C library and the kernel: symbols, process flags, loader variables; Kubernetes' pod field
    "dlsym", "PF_EXITING", "PR_SET_PDEATHSIG", "LD_PRELOAD", "hostPID",
    # other languages' standard libraries the wire is meant to be spoken from (Node's, Go's ``net``)
    "net",
}
# Fields the kernel writes (/proc/PID/status, fdinfo) and files in directories the operator names.
FOREIGN_FIELDS = {"Pid", "NSpid", "PPid", "allowed", "allowed/", "clients/", "server.key", "server.key_secret"}
# Words a docstring quotes that are neither code nor config: units, formats, shell words.
PLAIN = {"self", "cls", "args", "kwargs", "x", "n", "ms", "us", "µs", "s", "id", "ok", "uid", "pid", "gid",
         "json", "toml", "msgpack", "MessagePack", "http", "https", "tcp", "ipc", "unix", "root", "systemd",
         "sudo", "cpu", "cuda", "off", "on", "auto", "yes", "no"}

REF = re.compile(r":(?:meth|class|func|attr|mod|data|exc|obj):`~?\.?([^`]+)`|``([^`]+)``|(?<![`\w])`([^`\n]+)`(?!`)")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
PATHLIKE = re.compile(r"[A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-*]*)+|[A-Za-z0-9_\-]+\.(?:py|md|toml|json|yaml|sh|csv)")


@dataclass
class Index:
    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted module -> its top-level names
    classes: dict[str, set[str]] = field(default_factory=dict)  # class name -> members (all classes of it)
    bases: dict[str, set[str]] = field(default_factory=dict)    # class name -> base names
    names: set[str] = field(default_factory=set)                # every identifier defined anywhere
    used: set[str] = field(default_factory=set)                 # every attribute the code reads
    strings: set[str] = field(default_factory=set)              # every string constant
    config_keys: set[str] = field(default_factory=set)
    files: list[str] = field(default_factory=list)
    tails: dict[str, str] = field(default_factory=dict)         # a module's dotted tail -> the module
    messages: dict[str, str] = field(default_factory=dict)      # a wire message's tag -> its Struct
    config_tables: set[str] = field(default_factory=set)        # [local], [scheduler], ...

    def class_members(self, name: str, seen=None) -> set[str]:
        seen = seen or set()
        if name in seen:
            return set()
        seen.add(name)
        members = set(self.classes.get(name, ()))
        for base in self.bases.get(name, ()):
            members |= self.class_members(base, seen)
        return members


def _package_files(*, generated: bool = False) -> list[Path]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if generated or not relative.startswith(GENERATED):
                found.append(path)
    return found


def _indexed_files() -> list[Path]:
    """What names may resolve to: the package (its generated modules too), the tests and benches."""
    extra = [path for folder in ("tests", "bench", "examples") for path in sorted((REPO / folder).rglob("*.py"))
             if path != Path(__file__).resolve()]  # this file's planted names are not the package's
    return [*_package_files(generated=True), *extra]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _targets(node: ast.AST):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


def _bound(child: ast.stmt) -> set[str]:
    """The names one statement of a module or class body defines (a def, a class, an assignment)."""
    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {child.name}
    if isinstance(child, ast.Assign):
        return {name for target in child.targets for name in _targets(target)}
    if isinstance(child, ast.AnnAssign):
        return set(_targets(child.target))
    return set()


def _nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node under ``tree``, itself first: what ``ast.walk`` yields, in a third less time
    (the index walks every file of the repository)."""
    todo = [tree]
    for node in todo:  # grows while it is read
        for name in node._fields:
            value = getattr(node, name, None)
            if value.__class__ is list:
                todo.extend([item for item in value if isinstance(item, ast.AST)])
            elif isinstance(value, ast.AST):
                todo.append(value)
    return todo


def _class_members(node: ast.ClassDef) -> set[str]:
    members = set().union(*map(_bound, node.body))
    for sub in _nodes(node):  # self.x = ... anywhere in its methods
        if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in ("self", "cls")):
                    members.add(target.attr)
    return members


def _top_level(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        names |= _bound(node)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names if alias.name != "*")
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(_top_level(ast.Module(body=[*node.body, *getattr(node, "orelse", [])], type_ignores=[])))
            for handler in getattr(node, "handlers", []):
                names.update(_top_level(ast.Module(body=handler.body, type_ignores=[])))
    return names


def _config_keys() -> set[str]:
    from nodeagent import config

    keys = set()

    def flatten(table, prefix=""):
        for key, value in table.items():
            keys.add(prefix + key)
            keys.add(key)
            if isinstance(value, dict):
                flatten(value, prefix + key + ".")

    example = config.example_toml()
    flatten(tomllib.loads(example))
    return keys


@dataclass
class _FileFacts:
    """What one source file adds to an :class:`Index` (it is parsed and walked once per run)."""
    module: str
    top_level: set[str]
    stars: list[str]  # the modules it takes * from
    names: set[str]
    used: set[str]
    strings: set[str]
    classes: dict[str, set[str]]
    bases: dict[str, set[str]]
    messages: dict[str, str]
    docstrings: list[tuple[int, str]]


@functools.lru_cache(maxsize=None)
def _file_facts(path: Path) -> _FileFacts:
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    facts = _FileFacts(module, _top_level(tree), [], set(), set(), set(), {}, {}, {}, [])
    facts.stars = [node.module for node in tree.body
                   if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names)]
    facts.names.update(facts.top_level)
    facts.names.update(module.split("."))
    for node in _nodes(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            facts.docstrings.extend(_docstring(node))
        if isinstance(node, ast.ClassDef):
            if module == "client_lib.protocol":  # hello, welcome, ...: the wire's message names
                for keyword_ in node.keywords:
                    if keyword_.arg == "tag" and isinstance(keyword_.value, ast.Constant):
                        facts.messages[keyword_.value.value] = node.name
            members = _class_members(node)
            facts.classes.setdefault(node.name, set()).update(members)
            facts.bases.setdefault(node.name, set()).update(
                base.id if isinstance(base, ast.Name) else base.attr
                for base in node.bases if isinstance(base, (ast.Name, ast.Attribute)))
            facts.names.add(node.name)
            facts.names.update(members)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            facts.names.add(node.name)
            arguments = node.args
            for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                             arguments.vararg, arguments.kwarg]:
                if argument is not None:
                    facts.names.add(argument.arg)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.comprehension,
                               ast.NamedExpr)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                facts.names.update(_targets(target))
        elif isinstance(node, ast.keyword) and node.arg:
            facts.names.add(node.arg)
        elif isinstance(node, ast.Attribute):  # a foreign name the code itself uses (``zmq.FD``)
            facts.used.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 80:
            facts.strings.add(node.value)
    return facts


@functools.lru_cache(maxsize=2)
def build_index(with_tests: bool = False) -> Index:
    """The package's names; ``with_tests``: the tests', benches' and examples' too (the docs name
    fixtures and benches; a module's docstring must name the package's own code)."""
    index = Index()
    stars = []  # (module, the module it takes * from)
    for path in (_indexed_files() if with_tests else _package_files(generated=True)):
        facts = _file_facts(path)  # shared by both indexes: copied where the index adds to it
        index.modules[facts.module] = set(facts.top_level)
        stars.extend((facts.module, source) for source in facts.stars)
        index.names |= facts.names
        index.used |= facts.used
        index.strings |= facts.strings
        index.messages.update(facts.messages)
        for name, members in facts.classes.items():
            index.classes.setdefault(name, set()).update(members)
        for name, bases in facts.bases.items():
            index.bases.setdefault(name, set()).update(bases)
    for module, source in stars:
        index.modules[module] |= index.modules.get(source, set())
    index.config_keys = _config_keys()
    index.config_tables = {key.split(".")[0] for key in index.config_keys if "." in key}
    try:  # the repository's files, committed or not (git's ignores applied)
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        listed = []
    index.files = listed or [p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if p.is_file()]
    return index


def _known_single(index: Index, name: str) -> bool:
    return (name in index.names or name in index.used or name in index.strings or name in index.config_keys or name in EXTERNAL
            or name in PLAIN or keyword.iskeyword(name) or hasattr(builtins, name)
            or name in sys.stdlib_module_names)


def _module_prefix(index: Index, parts: list[str]) -> tuple[str, int] | None:
    """The longest leading run of ``parts`` that names a package module (dotted whole, or its tail)."""
    if not index.tails:
        for module in index.modules:
            pieces = module.split(".")
            for start in range(len(pieces)):
                index.tails.setdefault(".".join(pieces[start:]), module)
    for length in range(len(parts), 0, -1):
        module = index.tails.get(".".join(parts[:length]))
        if module is not None:
            return module, length
    return None


METRIC_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def resolves(index: Index, reference: str) -> bool:
    if reference.endswith(METRIC_SUFFIXES) and reference.rsplit("_", 1)[0] in index.strings:
        return True  # a metric as exposed: prometheus_client adds the suffix to the declared name
    if reference in index.config_keys or reference in index.strings or reference in FOREIGN_FIELDS:
        return True
    parts = reference.split(".")
    head = parts[0]
    if head in index.messages and len(parts) == 2:  # ``welcome.pace``: a field of that message
        return parts[1] in index.class_members(index.messages[head])
    prefix = _module_prefix(index, parts)
    if head in EXTERNAL or (head in sys.stdlib_module_names and (prefix is None or prefix[1] == 0)):
        return True
    if len(parts) == 1:
        return _known_single(index, head)
    if head in index.classes:
        members = index.class_members(head)
        return parts[1] in members and all(_known_single(index, part) for part in parts[2:])
    loose = all(_known_single(index, part) for part in parts)
    if prefix is not None:
        module, length = prefix
        rest = parts[length:]
        if not rest:
            return True
        if rest[0] in index.modules[module]:
            if len(rest) > 1 and rest[0] in index.classes:
                return rest[1] in index.class_members(rest[0]) and all(_known_single(index, p) for p in rest[2:])
            return all(_known_single(index, part) for part in rest[1:])
        if module + "." + rest[0] in index.modules:  # a submodule
            return True
        # a bare module tail is also a common variable name (``client.yield_point``, ``server.key``),
        # but not where it is a config table too (``local.max_queued_kb`` must be a config key)
        return length == 1 and head not in PACKAGES and head not in index.config_tables and loose
    if head in index.config_tables and len(parts) == 2:
        return False  # ``scheduler.quantum_ms`` names a setting: it is not one
    # an attribute reached through a variable (``tokens.pacing``, ``config.local``): each part exists
    return loose


def _path_exists(index: Index, path: str) -> bool:
    path = path.rstrip("/").removeprefix("./")
    if "*" in path:
        pattern = re.compile(re.escape(path).replace(r"\*", "[^/]*"))
        return any(pattern.search(f) for f in index.files)
    return any(f == path or f.endswith("/" + path) or f == path + ".py" or f.startswith(path + "/") or ("/" + path + "/") in f
               for f in index.files)


def references(text: str):
    """Each code reference in ``text``, normalised: a dotted name, or a repository path."""
    for match in REF.finditer(text):
        raw = next(group for group in match.groups() if group is not None).strip()
        raw = re.sub(r"\(.*\)$", "", raw).rstrip(":,")  # foo(), foo(a, b)
        if PATHLIKE.fullmatch(raw):
            yield "path", raw
        elif NAME.fullmatch(raw):
            yield "name", raw


def _absolute_or_templated(index: Index, path: str) -> bool:
    """A path outside the repository, or under a configured directory (``keys_dir/allowed/``)."""
    return (path.startswith(("/", "~", "$", "..")) or "<" in path or "{" in path
            or (path.split("/")[0] in index.config_keys and path.split("/")[0].endswith("_dir")))


def stale_in(index: Index, text: str) -> list[str]:
    stale = []
    for kind, reference in references(text):
        if kind == "path":
            if (reference not in FOREIGN_FIELDS and not _absolute_or_templated(index, reference)
                    and not _path_exists(index, reference)):
                stale.append(reference)
        elif not resolves(index, reference):
            stale.append(reference)
    return stale


def _docstring(node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[int, str]]:
    text = ast.get_docstring(node, clean=False)
    return [(node.body[0].lineno, text)] if text else []


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    return [docstring for node in _nodes(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            for docstring in _docstring(node)]


def stale_names(index: Index, sources: dict[Path, str] | None = None) -> list[str]:
    """Each stale name in the package's docstrings, as ``path:line `name```; ``sources`` replaces
    some files' text, and when given only those files are read."""
    found = []
    for path in (list(sources) if sources else _package_files()):
        text = (sources or {}).get(path)
        seen = set()
        for line, docstring in (_docstrings(ast.parse(text)) if text else _file_facts(path).docstrings):
            for name in stale_in(index, docstring):
                if (line, name) not in seen:
                    seen.add((line, name))
                    found.append(f"{path.relative_to(REPO)}:{line} `{name}`")
    return found


def test_every_name_a_docstring_writes_as_code_exists():
    stale = stale_names(build_index())
    assert not stale, f"{len(stale)} docstring names that name nothing in the package:\n" + "\n".join(stale)


def test_every_file_and_name_the_docs_write_as_code_exists():
    index = build_index(with_tests=True)
    stale = []
    for doc in DOCS:
        for number, line in enumerate((REPO / doc).read_text().splitlines(), 1):
            stale.extend(f"{doc}:{number} `{name}`" for name in stale_in(index, line))
    assert not stale, f"{len(stale)} names in the docs that name nothing in the package:\n" + "\n".join(stale)


def test_a_planted_stale_name_is_caught():
    """The check is not vacuous: a method, a module attribute, a file, a function, a wire field
    and a setting that do not exist, planted in one module's docstring, are each reported."""
    target = REPO / "nodeagent" / "daemon" / "tokens.py"
    planted = ('"""Planted: ``Tokens.bind_successor`` hands on, see :meth:`Tokens.settle_successor`,\n'
               "`nodeagent.daemon.tokens.OneHop`, ``sharing/successor.py``, ``no_such_helper()``,\n"
               "``welcome.wake_fifo`` and ``local.one_hop_min_cpus``.\"\"\"\n")
    sources = {target: planted + target.read_text()}
    index = build_index()
    found = [entry for entry in stale_names(index, sources) if entry.startswith("nodeagent/daemon/tokens.py:1 ")]
    assert {entry.split("`")[1] for entry in found} == {
        "Tokens.bind_successor", "Tokens.settle_successor", "nodeagent.daemon.tokens.OneHop",
        "sharing/successor.py", "no_such_helper", "welcome.wake_fifo", "local.one_hop_min_cpus"}
    real = '"""``Tokens.request``, ``welcome.pace``, ``local.max_queued_kb``, `tokens.py`."""\n'
    assert stale_names(index, {target: real}) == []
