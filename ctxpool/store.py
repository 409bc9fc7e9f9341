"""Model store: factories, weight files, and weights kept ONCE in shared host memory (one segment per
model, described by a :class:`WeightManifest`, that every worker's module views). Every failure is a
:class:`ModelError` with a protocol error code and a sentence naming what to fix. Detail: docs/internals.md.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import BinaryIO, Callable, Mapping

import torch

from client_lib import protocol as p
from client_lib import tensors
from ctxpool import peer_open, safetensors
from ctxpool.hostmem import align_up
from ctxpool.messages import PeerIdentity, WeightEntry, WeightManifest

SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_LISTED = 5  # names shown per kind of mismatch


class ModelError(Exception):
    """A model that cannot be registered or attached. ``code`` is a protocol ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _model_error(message: str) -> ModelError:
    return ModelError(p.ErrorCode.MODEL, message)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else "")


# ------------------------------------------------------------------ factory


def resolve_factory(path: str) -> Callable[[], torch.nn.Module]:
    """The callable named by ``"package.module:attribute[.attribute]"``."""
    if not isinstance(path, str) or not _FACTORY_RE.match(path):
        raise _model_error(f"factory {path!r} is not of the form 'package.module:callable'")
    module_name, _, attr_path = path.partition(":")
    importlib.invalidate_caches()  # a module written after start-up must still be found
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise _model_error(f"factory {path!r}: module {exc.name!r} is not importable; "
                               f"searched sys.path {sys.path}") from None
        raise _model_error(f"factory {path!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # the module itself raised while importing
        raise _model_error(f"factory {path!r}: importing {module_name!r} raised "
                           f"{type(exc).__name__}: {exc}") from None
    target: object = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise _model_error(f"factory {path!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(target):
        raise _model_error(f"factory {path!r} names a {type(target).__name__}, which is not callable")
    return target  # type: ignore[return-value]


def build_module(factory_path: str) -> torch.nn.Module:
    """Call the factory and check it built an ``nn.Module``; set to eval mode."""
    factory = resolve_factory(factory_path)
    try:
        module = factory()
    except Exception as exc:
        raise _model_error(f"factory {factory_path!r} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(module, torch.nn.Module):
        raise _model_error(f"factory {factory_path!r} returned a {type(module).__name__}, not a torch.nn.Module")
    return module.eval()


# ------------------------------------------------------------------ weights


def load_weights(path: str, reader: PeerIdentity | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or a torch state dict (``.pt``, ``.pth``, ``.bin``),
    opened with ``reader``'s rights (the peer that named it; None: this process's own).
    Errors say what the reader could see for itself, and nothing read from the file."""
    if not os.path.isabs(path):
        raise _model_error(f"weights path {path!r} must be absolute (the workers do not share your cwd)")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SAFETENSORS_SUFFIXES + TORCH_SUFFIXES:
        raise _model_error(f"weights file {path}: unknown suffix {suffix!r}; use "
                           f"{' or '.join(SAFETENSORS_SUFFIXES + TORCH_SUFFIXES)}")
    try:
        fd = peer_open.open_as(path, reader)
    except peer_open.PeerOpenError as exc:
        raise _model_error(str(exc)) from None
    with os.fdopen(fd, "rb") as f:
        if suffix in SAFETENSORS_SUFFIXES:
            try:
                return safetensors.load_file(f, path)
            except safetensors.SafetensorsError as exc:  # its text begins with the path
                raise _model_error(f"weights file {exc}") from None
            except OSError as exc:
                raise _model_error(f"weights file {path} cannot be read: {os.strerror(exc.errno or 0)}") from None
        return _load_torch(f, path)


def _load_torch(f: BinaryIO, path: str) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError, RuntimeError (not a zip / bad magic), EOFError, ...
        # Not the exception's text: it may quote the file ("invalid load key, 'r'").
        raise _model_error(f"weights file {path} is not a torch state dict that loads with weights_only=True "
                           f"({type(exc).__name__}); try torch.load(path, weights_only=True) to see why") from None
    if isinstance(loaded, Mapping) and "state_dict" in loaded and isinstance(loaded["state_dict"], Mapping):
        loaded = loaded["state_dict"]  # a checkpoint wrapping its state dict
    if not isinstance(loaded, Mapping):
        raise _model_error(f"weights file {path} holds a {type(loaded).__name__}, not a state dict")
    bad = [str(k)[:80] for k, v in loaded.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise _model_error(f"weights file {path}: entries that are not name -> tensor: {_listed(bad)}")
    return dict(loaded)


def _aliases(module: torch.nn.Module) -> dict[str, list[str]]:
    """Every name of a parameter or buffer -> all names of the same tensor (tied weights)."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in _named_tensors(module):
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: names for names in by_tensor.values() for name in names}


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return (list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)))


def check_weights(module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str = "weights") -> None:
    """Raise :class:`ModelError` unless ``state`` fits ``module``: lists missing and
    unexpected keys and shape mismatches (a few of each). A tied weight given
    under any one of its names counts for all."""
    expected = module.state_dict(keep_vars=True)
    aliases = _aliases(module)
    missing = [k for k in expected if k not in state
               and not any(a in state for a in aliases.get(k, ()))]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k}: file {list(state[k].shape)} vs module {list(v.shape)}"
                  for k, v in expected.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    problems = [f"{len(names)} {kind} ({_listed(names)})" for kind, names in
                (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched)) if names]
    if problems:
        raise _model_error(f"{source} do not fit the module: " + "; ".join(problems))


# ----------------------------------------------------------- shared memory


def place_in_shared_memory(module: torch.nn.Module, state: Mapping[str, torch.Tensor] | None,
                           segment_name: str, *, group: int | None = None) -> WeightManifest:
    """Copy every parameter and buffer of ``module`` (the values from ``state``
    where it has them, else the module's own) into ONE new segment named
    ``segment_name``, in the module's dtypes. The segment is closed here and
    left for :func:`attach_module`; on failure it is unlinked."""
    aliases = _aliases(module)
    kinds = {name: "parameter" for name, _ in module.named_parameters(remove_duplicate=False)}
    layout: dict[int, tuple[int, torch.Tensor]] = {}  # id(tensor) -> (offset, source)
    entries: dict[str, WeightEntry] = {}
    total = 0
    for name, tensor in _named_tensors(module):
        key = id(tensor)
        if key not in layout:
            source = tensor
            if state is not None:
                given = [a for a in aliases[name] if a in state]
                source = state[given[0]] if given else tensor
            if source.device.type == "meta":
                raise _model_error(f"{name} is on the meta device and no weights file gives its values")
            layout[key] = (total, source)
            # Each tensor's offset aligned as the engine's atoms are: neighbours then copy as one span.
            total = align_up(total + tensor.numel() * tensor.element_size())
        try:
            dtype = tensors.dtype_name(tensor.dtype)
        except tensors.TensorTransportError as exc:
            raise _model_error(f"{name}: {exc}") from None
        entries[name] = WeightEntry(kind=kinds.get(name, "buffer"), dtype=dtype, shape=list(tensor.shape),
                                    offset=layout[key][0], nbytes=tensor.numel() * tensor.element_size())
    try:  # reserved now: on a full /dev/shm the copy below would die of SIGBUS
        segment = tensors.create_segment(total, name=segment_name, group=group, reserve=True)
    except tensors.SharedMemoryFull as exc:
        raise _model_error(f"the weights cannot be placed in shared memory: {exc}") from None
    try:
        copied: set[int] = set()
        for name, tensor in _named_tensors(module):
            if entries[name].nbytes and id(tensor) not in copied:
                copied.add(id(tensor))
                target = _view(segment, entries[name])
                target.copy_(layout[id(tensor)][1].detach().reshape(target.shape))  # casts to the module's dtype
                del target
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()
    return WeightManifest(segment=segment.name, total_bytes=total, entries=entries)


def _view(segment: tensors.Segment, entry: WeightEntry) -> torch.Tensor:
    dtype = tensors.torch_dtype(entry.dtype)
    if not entry.nbytes:
        return torch.empty(entry.shape, dtype=dtype)
    if entry.offset < 0 or entry.offset + entry.nbytes > segment.size:
        raise _model_error(f"weight entry [{entry.offset}, +{entry.nbytes}) lies outside segment "
                           f"{segment.name} of {segment.size} bytes")
    raw = torch.frombuffer(segment.buf, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
    return raw.view(dtype).reshape(entry.shape)


def attach_module(module: torch.nn.Module, manifest: WeightManifest) -> tensors.Segment:
    """Rebind every parameter and buffer of ``module`` to a zero-copy view of the
    manifest's segment (tied names to one object). Returns the mapped segment:
    keep it while the module lives, close it after."""
    names = {name: tensor for name, tensor in _named_tensors(module)}
    missing = [n for n in manifest.entries if n not in names]
    unexpected = [n for n in names if n not in manifest.entries]
    wrong = [f"{n}: {list(names[n].shape)} vs stored {e.shape}" for n, e in manifest.entries.items()
             if n in names and list(names[n].shape) != e.shape]
    if missing or unexpected or wrong:
        raise _model_error("the factory built a module that differs from the prepared weights "
                           f"(is it deterministic?): missing {_listed(missing) or 'none'}; "
                           f"unexpected {_listed(unexpected) or 'none'}; shapes {_listed(wrong) or 'ok'}")
    try:
        segment = tensors.attach_segment(manifest.segment)
    except tensors.TensorTransportError as exc:
        raise _model_error(f"weights of the model are gone: {exc}") from None
    if segment.size < manifest.total_bytes:
        segment.close()
        raise _model_error(f"weight segment {manifest.segment} holds {segment.size} bytes, "
                           f"the manifest needs {manifest.total_bytes}")
    bound: dict[int, torch.Tensor] = {}  # offset -> the one object for tied names
    for name, entry in manifest.entries.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        view = bound.get(entry.offset) if entry.nbytes else None
        if view is None:
            view = _view(segment, entry)
            if entry.kind == "parameter":
                view = torch.nn.Parameter(view, requires_grad=False)
            if entry.nbytes:
                bound[entry.offset] = view
        # Straight into the dicts: keeps a buffer's persistent flag and skips setattr's checks.
        if entry.kind == "parameter":
            owner._parameters[leaf] = view
        else:
            owner._buffers[leaf] = view
    return segment


def model_bytes(manifest: WeightManifest) -> int:
    """Bytes of parameters and buffers, tied tensors counted once."""
    return sum({e.offset: e.nbytes for e in manifest.entries.values() if e.nbytes}.values())


def leaf_layers(module: torch.nn.Module) -> int:
    """Modules without children that hold a parameter or buffer of their own."""
    return sum(1 for m in module.modules()
               if not any(True for _ in m.children())
               and (any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))))
