"""Where a module's parameters and buffers live on the host, and where they go on the device: one
flat device buffer, copied as extents, each device tensor a view at the same place, so aliasing
(tied weights) survives. Detail: docs/internals.md.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from ctxpool.hostmem import ALIGN_BYTES, align_up
from ctxpool.streams import Span

# Atoms closer than this are copied as one span, gap included. Under a page, the gap lies on the
# pages of its two neighbours, so it is mapped memory even when the atoms are different allocations
# (a model store's tensors are separate storages over one shared segment, 512-byte aligned).
MERGE_GAP_BYTES = 4096


@dataclass
class Slot:
    tensor: torch.Tensor  # the Parameter/buffer object itself
    host: torch.Tensor  # its host data at registration (``tensor.data``), kept for switching back
    registrants: list[str]  # names of the modules that register it directly
    start: int = 0  # host address of its first byte (0 for an empty tensor)
    nbytes: int = 0  # extent in bytes (0 for an empty tensor)
    atom: int = -1  # index into Layout.atoms (-1: empty tensor, nothing to copy)
    offset_in_atom: int = 0


@dataclass
class Atom:
    start: int
    end: int
    slots: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Placement:
    group_spans: list[list[Span]]  # per group, the copies
    group_slots: list[list[int]]  # per group, the slots to switch once it has arrived
    atom_dev_offset: list[int]
    device_bytes: int
    copy_bytes: int  # bytes copied (atoms plus the small gaps merged between them)


def _extent_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


class Layout:
    """The slots and atoms of one module, and how to place them for a grouping."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.slots: list[Slot] = []
        by_id: dict[int, int] = {}
        for module_name, sub in module.named_modules():
            for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
                for attr, t in table.items():
                    if t is None:
                        continue
                    index = by_id.get(id(t))
                    if index is None:
                        _check_host_tensor(f"{module_name}.{attr}" if module_name else attr, kind, t)
                        by_id[id(t)] = index = len(self.slots)
                        self.slots.append(Slot(t, t.data, []))
                    self.slots[index].registrants.append(module_name)
        self.atoms: list[Atom] = self._atoms()
        self.model_bytes = sum(a.nbytes for a in self.atoms)

    def _atoms(self) -> list[Atom]:
        extents = []
        for i, slot in enumerate(self.slots):
            slot.nbytes = _extent_bytes(slot.host)
            if slot.nbytes:
                slot.start = slot.host.data_ptr()
                extents.append(i)
        extents.sort(key=lambda i: self.slots[i].start)
        atoms: list[Atom] = []
        for i in extents:
            slot = self.slots[i]
            end = slot.start + slot.nbytes
            if atoms and slot.start < atoms[-1].end:
                atoms[-1].end = max(atoms[-1].end, end)
            else:
                atoms.append(Atom(slot.start, end))
            atoms[-1].slots.append(i)
            slot.atom = len(atoms) - 1
            slot.offset_in_atom = slot.start - atoms[-1].start  # an atom's start never moves: sorted by start
        return atoms

    def host_ranges(self) -> list[tuple[int, int]]:
        """[start, end) of every atom whose host memory is not already page-locked."""
        return [(atom.start, atom.end) for atom in self.atoms if not self.slots[atom.slots[0]].host.is_pinned()]

    def place(self, atom_group: list[int], groups: int) -> Placement:
        """Copy spans per group and device offsets, for atoms assigned to groups (0..groups-1)."""
        per_group: list[list[int]] = [[] for _ in range(groups)]
        for a, g in enumerate(atom_group):
            per_group[g].append(a)
        dev_offset = [0] * len(self.atoms)
        group_spans: list[list[Span]] = []
        cursor = copy_bytes = 0
        for members in per_group:
            members.sort(key=lambda a: self.atoms[a].start)
            runs: list[list[int]] = []
            for a in members:
                atom = self.atoms[a]
                if runs and _mergeable(self.atoms[runs[-1][0]], self.atoms[runs[-1][-1]], atom):
                    runs[-1].append(a)
                else:
                    runs.append([a])
            spans = []
            for run in runs:
                first, last = self.atoms[run[0]], self.atoms[run[-1]]
                start = align_up(cursor)  # every atom of the run is then aligned too (see _mergeable)
                nbytes = last.end - first.start
                for a in run:
                    dev_offset[a] = start + self.atoms[a].start - first.start
                spans.append(Span(first.start, nbytes, start, _host_bytes(first.start, nbytes)))
                cursor = start + nbytes
                copy_bytes += nbytes
            group_spans.append(spans)
        group_slots: list[list[int]] = [[] for _ in range(groups)]
        for i, slot in enumerate(self.slots):
            group_slots[atom_group[slot.atom] if slot.atom >= 0 else 0].append(i)
        return Placement(group_spans, group_slots, dev_offset, align_up(max(cursor, 1)), copy_bytes)

    def device_views(self, placement: Placement, dev_buf: torch.Tensor, slots: list[int]) -> list[torch.Tensor]:
        """The device tensor of each slot in ``slots``, as views of ``dev_buf``."""
        typed: dict[torch.dtype, torch.Tensor] = {}
        out = []
        for i in slots:
            slot = self.slots[i]
            host = slot.host
            if slot.atom < 0:
                out.append(torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=dev_buf.device))
                continue
            flat = typed.get(host.dtype)
            if flat is None:
                flat = typed[host.dtype] = dev_buf.view(host.dtype)
            byte_offset = placement.atom_dev_offset[slot.atom] + slot.offset_in_atom
            out.append(torch.as_strided(flat, host.shape, host.stride(), byte_offset // host.element_size()))
        return out


def _mergeable(first: Atom, prev: Atom, atom: Atom) -> bool:
    """Whether ``atom`` may join the span of ``first``..``prev``: close after it, and at a multiple
    of the device alignment from the span's start (the span's start is aligned on the device)."""
    return 0 <= atom.start - prev.end < MERGE_GAP_BYTES and (atom.start - first.start) % ALIGN_BYTES == 0


def _host_bytes(start: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over host bytes [start, start + nbytes) (no copy; the atoms' storages keep them alive)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(start), dtype=torch.uint8)


def _check_host_tensor(name: str, kind: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{kind} {name!r} is on {t.device}; add_model takes modules whose parameters and "
                         "buffers are in host memory (the engine makes the device copy)")
    if t.layout != torch.strided or t.is_quantized:
        raise ValueError(f"{kind} {name!r} is {t.layout}{' quantized' if t.is_quantized else ''}; "
                         "only dense (strided) tensors can be swapped")
    if t.numel() and t.data_ptr() % t.element_size():
        raise ValueError(f"{kind} {name!r} ({t.dtype}) starts at an address not aligned to its element size")
