"""The parameter structs of ``kernels/kernels.h`` (and of ``kernels/expert_major.h``) as ctypes structures, for
launching the intranode kernels (`ep_moe.native.jit.intranode`) and the generic expert-major kernels
(`ep_moe.native.jit.expert_major_exchange`) from Python, and the probe that checks them against the compiler's layout.

The structs are defined once, in the headers: `struct_from_header` reads each one at import (fields in the header's
order; ctypes lays them out as C does: natural alignment, ``bool`` one byte), so a field added to a struct in
``kernels.h`` needs nothing here. `probe_source` generates a kernel that writes ``sizeof`` of every struct and
``offsetof`` of every field as the CUDA compiler sees them, and `layout_mismatches` compares those numbers with
ctypes' (the JIT module runs the probe once per process before its first launch; a CPU test compiles the same source
as a host program where a compiler is found). The constants the launchers need (`CONSTANTS`) are checked the same
way by ``ep_intranode_constants`` in ``kernels/intranode.cu``.

No CUDA and no torch here.
"""

from __future__ import annotations

import ctypes
import re
import struct as _struct
from collections.abc import Sequence
from pathlib import Path

from .source import KERNELS_DIR

KERNELS_H = KERNELS_DIR / "kernels.h"
EXPERT_MAJOR_H = KERNELS_DIR / "expert_major.h"

# The constants of kernels.h and intranode.cu that the Python side uses, in the order ``ep_intranode_constants``
# writes them (name in the C++ source, value).
CONSTANTS: tuple[tuple[str, int], ...] = (
    ("kMaxRanks", 8), ("kMaxChunks", 256), ("kMaxNotifyExperts", 1024), ("kControlBytes", 128 << 10),
    ("kThreads", 512), ("kMaxCopyEngineChunks", 16), ("kMaxCopyStreams", 4), ("kErrWords", 16), ("kTraceSlots", 6),
    ("kCopyEngineTraceSlots", 1 + 8 * 16), ("kNotifyThreads", 1024), ("kLayoutThreads", 256), ("kBulkStages", 2),
    ("kReduceWarps", 512 // 32), ("kBulkHeaderBytes", (512 // 32 * 2 * (8 + 16) + 127) // 128 * 128),
    ("kBulkSmemBudget", 200 << 10), ("kHeaderLen", 8), ("kHeaderWords", 10), ("kHeaderCopySeq", 8),
    ("kMismatchWords", 3 + 8 + 8 * 8), ("sizeof(Control)", 0), ("sizeof(LocalState)", 32),
    ("EP_OFFSET_OF(Control, copy_engine_flag)", 0),
)
# A 0 means "not checked": sizeof(Control) is not used by the launchers (the control buffer is kControlBytes),
# and the copy-engine flags' offset is read from the device (`intranode.kernels(device).control_flags_offset`).
_C = dict(CONSTANTS)
MAX_RANKS = _C["kMaxRanks"]
MAX_COPY_ENGINE_CHUNKS = _C["kMaxCopyEngineChunks"]
HEADER_WORDS = _C["kHeaderWords"]

PTR = ctypes.c_uint64  # every pointer, as its address (0: null)
I32, I64, U64, BOOL = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_bool


class Params(ctypes.Structure):
    """A mirrored struct: `fields` lists its names in order (for the probe and error messages)."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [name for name, _ in cls._fields_]


# ------------------------------------------------------------------------------------------ the structs
# Generated from the headers at import: one definition per struct (the header's), read by a small parser of the
# declarations the headers use (``[const] type[*] name[, name...][[N]];`` with ``//`` comments; N a constant of
# `CONSTANTS` or a sum of them and numbers). The probe still checks the compiler's sizes and offsets.
_SCALARS: dict[str, type] = {"int": I32, "int32_t": I32, "int64_t": I64, "uint64_t": U64, "bool": BOOL}
_DECLARATION = re.compile(r"(?:const\s+)?(\w+)\s*(\*?)\s*(.+);")
_DECLARATOR = re.compile(r"(\*?)\s*(\w+)(?:\[(.+)\])?")


def _count(expr: str, where: str) -> int:
    """An array length: a sum of numbers and `CONSTANTS` names."""
    total = 0
    for term in (t.strip() for t in expr.split("+")):
        if term.isdigit():
            total += int(term)
        elif term in _C:
            total += _C[term]
        else:
            raise ValueError(f"{where}: array length {expr!r}: {term!r} is not a number or a known constant")
    return total


def struct_from_header(header: Path, name: str, known: dict[str, type[Params]] | None = None) -> type[Params]:
    """The ctypes structure of ``struct name`` in ``header``: its fields in order, pointers as `PTR`, the scalar
    types of `_SCALARS`, and structs of ``known`` (by name) as members. Raises ``ValueError`` naming the header,
    the struct and the line it cannot read."""
    known = known or {}
    match = re.search(rf"^struct {name} \{{\n(.*?)^\}};", header.read_text(), re.S | re.M)
    if match is None:
        raise ValueError(f"{header.name}: no 'struct {name} {{ ... }};'")
    fields: list[tuple[str, type]] = []
    for line in match.group(1).splitlines():
        code = line.split("//")[0].strip()
        if not code:
            continue
        where = f"{header.name}: struct {name}: {code!r}"
        declaration = _DECLARATION.fullmatch(code)
        if declaration is None:
            raise ValueError(f"{where}: not a field declaration")
        base, star, declarators = declaration.groups()
        for text in declarators.split(","):
            declarator = _DECLARATOR.fullmatch(text.strip())
            if declarator is None:
                raise ValueError(f"{where}: cannot read {text.strip()!r}")
            pointer, field, count = declarator.groups()
            if star or pointer:
                kind: type = PTR
            elif base in known:
                kind = known[base]
            elif base in _SCALARS:
                kind = _SCALARS[base]
            else:
                raise ValueError(f"{where}: unknown type {base!r}")
            fields.append((field, kind * _count(count, where) if count else kind))
    return type(name, (Params,), {"_fields_": fields, "__doc__": f"``{name}`` of ``{header.name}``."})


def _structs(header: Path, names: Sequence[str], known: dict[str, type[Params]]) -> tuple[type[Params], ...]:
    out = []
    for name in names:
        known[name] = struct_from_header(header, name, known)
        out.append(known[name])
    return tuple(out)


_KNOWN: dict[str, type[Params]] = {}
MIRRORED: tuple[type[Params], ...] = _structs(KERNELS_H, (
    "KernelEnv", "LayoutParams", "HeaderCheck", "NotifyParams", "CopyEngineParams", "DispatchParams",
    "CombineParams"), _KNOWN)
KernelEnv, LayoutParams, HeaderCheck, NotifyParams, CopyEngineParams, DispatchParams, CombineParams = MIRRORED

# --------------------------------------------------------------------------------------- kernels/expert_major.h
# The constants of expert_major.cu / expert_major.h that its launchers use, in the order
# ``ep_expert_major_constants`` (kernels/expert_major_exchange.cu) writes them.
EXPERT_MAJOR_CONSTANTS: tuple[tuple[str, int], ...] = (
    ("kRowThreads", 256), ("kRowsPerBlock", 8), ("kRowBF16", 0), ("kRowFP32", 1),
)



EXPERT_MAJOR_MIRRORED: tuple[type[Params], ...] = _structs(EXPERT_MAJOR_H, (
    "PermuteRowsParams", "UnpermuteSumParams", "RoutingMapParams"), _KNOWN)
PermuteRowsParams, UnpermuteSumParams, RoutingMapParams = EXPERT_MAJOR_MIRRORED

_PACK_CODES = {PTR: "Q", I64: "q", I32: "i", BOOL: "?"}  # (U64 is PTR's type: both c_uint64)


class FieldWriter:
    """Writes a run of consecutive fields of a mirrored struct in one ``struct.pack_into`` (the launchers' per-call
    fields: one C call instead of a ctypes attribute write each). ``names`` must be in the struct's order and cover
    every field between the first and the last (the gaps between them are padding, written as zeros, as a fresh
    struct has them); `write` takes the values in that order. Raises ``ValueError`` naming the struct when the names
    do not form such a run."""

    def __init__(self, struct_type: type[Params], names: Sequence[str]) -> None:
        kinds = dict(struct_type._fields_)
        descriptors = [getattr(struct_type, name) for name in names]
        first, last = descriptors[0].offset, descriptors[-1].offset + descriptors[-1].size
        inside = [name for name in struct_type.field_names() if first <= getattr(struct_type, name).offset < last]
        if inside != list(names):
            raise ValueError(f"FieldWriter({struct_type.__name__}): the fields must be a run in the struct's order, "
                             f"got {list(names)}, the struct has {inside} there")
        fmt, pos = "=", first
        for name, descriptor in zip(names, descriptors):
            if kinds[name] not in _PACK_CODES:
                raise ValueError(f"FieldWriter({struct_type.__name__}): field {name!r} is not a scalar")
            fmt += f"{descriptor.offset - pos}x" * (descriptor.offset > pos) + _PACK_CODES[kinds[name]]
            pos = descriptor.offset + descriptor.size
        self.struct_name, self.names, self.offset = struct_type.__name__, tuple(names), first
        self._packer = _struct.Struct(fmt)

    def write(self, view: memoryview, *values: int | bool) -> None:
        """The values into the struct that ``view`` (``memoryview(params).cast("B")``) shows; raises ``ValueError``
        naming the struct when a value does not fit its field."""
        try:
            self._packer.pack_into(view, self.offset, *values)
        except _struct.error as exc:
            raise ValueError(f"{self.struct_name}: a value does not fit its field ({', '.join(self.names)}): "
                             f"{exc}") from None


def layout_of(structs: Sequence[type[Params]] = MIRRORED) -> list[tuple[str, int]]:
    """ctypes' layout, in the probe's order: per struct ``(Struct, sizeof)``, then ``(Struct.field, offsetof)`` of
    each field."""
    out: list[tuple[str, int]] = []
    for struct in structs:
        out.append((struct.__name__, ctypes.sizeof(struct)))
        out += [(f"{struct.__name__}.{name}", getattr(struct, name).offset) for name in struct.field_names()]
    return out


def probe_source(structs: Sequence[type[Params]] = MIRRORED, host_program: bool = False,
                 header: Path = KERNELS_H) -> str:
    """CUDA source that writes, in `layout_of`'s order, the compiler's ``sizeof`` / ``offsetof`` of the mirrored
    structs and fields into ``out`` (``extern "C" __global__ void ep_params_layout(long long* out)``), or, with
    ``host_program``, a C++ program that prints them one per line (the same numbers on the host: CUDA lays structs
    out alike on both sides). ``header``: the kernels' header that declares ``structs`` (`KERNELS_H`,
    `EXPERT_MAJOR_H`)."""
    # Offsets as address differences within a local of each struct (NVRTC has neither <cstddef> nor
    # __builtin_offsetof; the structs are plain aggregates).
    locals_, values = [], []
    for i, struct in enumerate(structs):
        locals_.append(f"  ep_moe::{struct.__name__} s{i};\n")
        values.append(f"sizeof(s{i})")
        values += [f"reinterpret_cast<const char*>(&s{i}.{name}) - reinterpret_cast<const char*>(&s{i})"
                   for name in struct.field_names()]
    body = "".join(locals_) + "  const long long values[] = {\n    " + ",\n    ".join(values) + "};\n"
    # The header by its name in the kernels' folder, which every JIT compile has on its include path: the text (and
    # so the cache key) does not depend on where the package is installed; a host program includes it by its path.
    include = header.as_posix() if host_program else header.name
    head = (f"// Generated by ep_moe.native.jit.params.probe_source: the layout of {header.name}'s parameter structs.\n"
            f'#include "{include}"\n')
    if host_program:
        return (head + "#include <cstdio>\nint main() {\n" + body +
                "  for (long long v : values) std::printf(\"%lld\\n\", v);\n  return 0;\n}\n")
    return (head + 'extern "C" __global__ void ep_params_layout(long long* out) {\n' + body +
            "  if (threadIdx.x == 0 && blockIdx.x == 0)\n"
            "    for (int i = 0; i < static_cast<int>(sizeof(values) / sizeof(values[0])); ++i) out[i] = values[i];\n"
            "}\n")


def layout_mismatches(compiled: Sequence[int], structs: Sequence[type[Params]] = MIRRORED) -> list[str]:
    """The entries where the compiler's numbers (`probe_source`'s output) differ from ctypes', as
    ``"Struct.field: offset 40 in kernels.h, 36 in the mirror"`` lines (empty: the mirror is exact)."""
    expected = layout_of(structs)
    if len(compiled) != len(expected):
        return [f"the probe wrote {len(compiled)} numbers, the mirror expects {len(expected)}"]
    out = []
    for (name, mine), theirs in zip(expected, compiled):
        if mine != theirs:
            what = "offset" if "." in name else "size"
            out.append(f"{name}: {what} {theirs} in kernels.h, {mine} in the mirror")
    return out


def constant_mismatches(compiled: Sequence[int], constants: Sequence[tuple[str, int]] = CONSTANTS) -> list[str]:
    """Where ``ep_intranode_constants``' output differs from `CONSTANTS` (or ``ep_expert_major_constants``' from
    `EXPERT_MAJOR_CONSTANTS`; entries of `CONSTANTS` whose mirror value is 0 are not checked)."""
    if len(compiled) != len(constants):
        return [f"the constants kernel wrote {len(compiled)} numbers, the mirror expects {len(constants)}"]
    intranode = constants is CONSTANTS
    table = "CONSTANTS" if intranode else "EXPERT_MAJOR_CONSTANTS"
    return [f"{name}: {theirs} in the CUDA sources, {mine} in ep_moe.native.jit.params.{table}"
            for (name, mine), theirs in zip(constants, compiled) if (mine or not intranode) and mine != theirs]


__all__ = ["CONSTANTS", "EXPERT_MAJOR_CONSTANTS", "EXPERT_MAJOR_H", "EXPERT_MAJOR_MIRRORED", "KERNELS_H",
           "MIRRORED", "CombineParams", "CopyEngineParams", "DispatchParams", "FieldWriter", "HeaderCheck", "KernelEnv",
           "LayoutParams", "NotifyParams", "Params", "PermuteRowsParams", "RoutingMapParams", "UnpermuteSumParams",
           "constant_mismatches", "layout_mismatches", "layout_of", "probe_source"]
