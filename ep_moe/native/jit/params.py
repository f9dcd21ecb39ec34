"""The parameter structs of ``csrc/kernels.h`` (and of ``csrc/expert_major.h``) as ctypes structures, for launching
the intranode kernels (`ep_moe.native.jit.intranode`) and the extension's generic expert-major kernels
(`ep_moe.native.jit.expert_major_csrc`) from Python, and the probe that checks them against the compiler's layout.

Each mirror lists the header's fields in the header's order, one ``(name, type)`` line per field; ctypes lays them
out as C does (natural alignment, ``bool`` one byte), so a field added to a struct in ``kernels.h`` is one line added
here, at the same place. Nothing is trusted blindly: `probe_source` generates a kernel that writes ``sizeof`` of every
mirrored struct and ``offsetof`` of every field as the CUDA compiler sees them, and `layout_mismatches` compares those
numbers with ctypes' (the JIT module runs the probe once per process before its first launch; a CPU test compiles the
same source as a host program where a compiler is found). The constants the launchers need (`CONSTANTS`) are checked
the same way by ``ep_intranode_constants`` in ``kernels/intranode.cu``.

No CUDA and no torch here.
"""

from __future__ import annotations

import ctypes
import struct as _struct
from collections.abc import Sequence
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
KERNELS_H = CSRC_DIR / "kernels.h"
EXPERT_MAJOR_H = CSRC_DIR / "expert_major.h"

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


class KernelEnv(Params):
    _fields_ = [
        ("rank", I32),
        ("num_ranks", I32),
        ("ctrl", PTR * MAX_RANKS),
        ("state", PTR),
        ("error", PTR),
        ("timeout_ns", U64),
        ("chunks_per_pair", I32),
        ("min_chunk_rows", I32),
    ]


class LayoutParams(Params):
    _fields_ = [
        ("topk_idx", PTR),
        ("num_tokens", I32),
        ("num_topk", I32),
        ("num_experts", I32),
        ("num_ranks", I32),
        ("num_tokens_per_rank", PTR),
        ("num_tokens_per_expert", PTR),
        ("is_token_in_rank", PTR),
    ]


class HeaderCheck(Params):
    _fields_ = [
        ("header", I32 * HEADER_WORDS),
        ("digest_from_prefix", BOOL),
        ("test_perturb", PTR),
    ]


class NotifyParams(Params):
    _fields_ = [
        ("env", KernelEnv),
        ("is_token_in_rank", PTR),
        ("num_tokens_per_rank", PTR),
        ("counts_int64", BOOL),
        ("num_tokens", I32),
        ("rank_prefix_matrix", PTR),
        ("pos", PTR),
        ("send_list", PTR),
        ("host_counts", PTR),
        ("num_worst_tokens", I32),
        ("rows_capacity", I64),
        ("topk_idx", PTR),
        ("num_topk", I32),
        ("experts_per_rank", I32),
        ("expert_alignment", I32),
        ("host_expert_counts", PTR),
        ("check", HeaderCheck),
    ]


class CopyEngineParams(Params):
    _fields_ = [
        ("seq", U64),
        ("go", PTR),
        ("chunks", I32),
        ("bounds", I32 * (MAX_COPY_ENGINE_CHUNKS + 1)),
        ("trace", PTR),
    ]


class DispatchParams(Params):
    _fields_ = [
        ("env", KernelEnv),
        ("data", PTR * MAX_RANKS),
        ("off_x", I64),
        ("off_scales", I64),
        ("off_idx", I64),
        ("off_weights", I64),
        ("off_src", I64),
        ("rank_prefix_matrix", PTR),
        ("send_list", PTR),
        ("num_tokens", I32),
        ("x", PTR),
        ("x_bytes", I32),
        ("scales", PTR),
        ("num_scales", I32),
        ("has_scales", BOOL),
        ("has_topk", BOOL),
        ("topk_idx", PTR),
        ("topk_weights", PTR),
        ("num_topk", I32),
        ("experts_per_rank", I32),
        ("recv_x", PTR),
        ("recv_scales", PTR),
        ("recv_topk_idx", PTR),
        ("recv_topk_weights", PTR),
        ("recv_src_idx", PTR),
        ("recv_src_rank", PTR),
        ("num_recv_rows", I32),
        ("rows_capacity", I64),
        ("expert_scratch", PTR),
        ("num_recv_per_expert", PTR),
        ("expert_alignment", I32),
        ("write_arrival", BOOL),
        ("num_blocks", I32),
        ("num_push_blocks", I32),
        ("trace", PTR),
        ("copy_engine", CopyEngineParams),
        ("copy_engine_tokens", I32 * MAX_RANKS),
        ("copy_engine_slot_rows", I64),
        ("cached_src_idx", PTR),
        ("check", HeaderCheck),
        ("rows_in_place", BOOL),
    ]


class CombineParams(Params):
    _fields_ = [
        ("env", KernelEnv),
        ("data", PTR * MAX_RANKS),
        ("off_y", I64),
        ("off_weights", I64),
        ("rows_capacity", I64),
        ("rank_prefix_matrix", PTR),
        ("is_token_in_rank", PTR),
        ("pos", PTR),
        ("num_tokens", I32),
        ("y", PTR),
        ("y_type", I32),
        ("hidden", I32),
        ("has_weights", BOOL),
        ("weights", PTR),
        ("num_topk", I32),
        ("bias0", PTR),
        ("bias1", PTR),
        ("bias0_type", I32),
        ("bias1_type", I32),
        ("out", PTR),
        ("out_weights", PTR),
        ("num_blocks", I32),
        ("num_push_blocks", I32),
        ("trace", PTR),
        ("copy_engine", CopyEngineParams),
        ("bulk_reduce", BOOL),
        ("bulk_piece16", I32),
        ("check", HeaderCheck),
        ("expert_y", PTR),
        ("expert_weights", PTR),
        ("sorted_slots", PTR),
        ("expert_topk", I32),
        ("expert_slots", I64),
        ("summation_order", PTR),
    ]


MIRRORED: tuple[type[Params], ...] = (KernelEnv, LayoutParams, HeaderCheck, NotifyParams, CopyEngineParams,
                                      DispatchParams, CombineParams)


# ------------------------------------------------------------------------------------------ csrc/expert_major.h
# The constants of expert_major.cu / expert_major.h that its launchers use, in the order
# ``ep_expert_major_constants`` (kernels/expert_major_csrc.cu) writes them.
EXPERT_MAJOR_CONSTANTS: tuple[tuple[str, int], ...] = (
    ("kRowThreads", 256), ("kRowsPerBlock", 8), ("kRowBF16", 0), ("kRowFP32", 1),
)


class PermuteRowsParams(Params):
    _fields_ = [
        ("x", PTR),
        ("out", PTR),
        ("row_bytes", I64),
        ("pair_of_slot", PTR),
        ("num_slots", I64),
        ("num_pairs", I64),
        ("num_topk", I32),
        ("values", PTR),
        ("slot_values", PTR),
        ("own_x", PTR),
        ("own_tokens", PTR),
        ("rank_prefix_matrix", PTR),
        ("num_ranks", I32),
        ("rank", I32),
        ("num_own_rows", I64),
    ]


class UnpermuteSumParams(Params):
    _fields_ = [
        ("y", PTR),
        ("out", PTR),
        ("dtype", I32),
        ("hidden", I64),
        ("num_rows", I64),
        ("num_slots", I64),
        ("num_topk", I32),
        ("weights", PTR),
        ("sorted_slots", PTR),
        ("slot_values", PTR),
        ("slot_of_pair", PTR),
        ("pair_values", PTR),
        ("rank_prefix_matrix", PTR),
        ("num_ranks", I32),
        ("rank", I32),
    ]


class RoutingMapParams(Params):
    _fields_ = [
        ("routing_map", PTR),
        ("probs", PTR),
        ("probs_dtype", I32),
        ("num_tokens", I64),
        ("num_experts", I32),
        ("num_topk", I32),
        ("topk_idx", PTR),
        ("topk_weights", PTR),
        ("grad_probs", PTR),
    ]


EXPERT_MAJOR_MIRRORED: tuple[type[Params], ...] = (PermuteRowsParams, UnpermuteSumParams, RoutingMapParams)


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
    out alike on both sides). ``header``: the csrc header that declares ``structs`` (`KERNELS_H`,
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
    # kernels.h through the JIT kernels' folder, which every JIT compile has on its include path: the text (and so
    # the cache key) does not depend on where the package is installed; a host program includes it by its path.
    include = header.as_posix() if host_program else f"../../csrc/{header.name}"
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


__all__ = ["CONSTANTS", "CSRC_DIR", "EXPERT_MAJOR_CONSTANTS", "EXPERT_MAJOR_H", "EXPERT_MAJOR_MIRRORED", "KERNELS_H",
           "MIRRORED", "CombineParams", "CopyEngineParams", "DispatchParams", "FieldWriter", "HeaderCheck", "KernelEnv",
           "LayoutParams", "NotifyParams", "Params", "PermuteRowsParams", "RoutingMapParams", "UnpermuteSumParams",
           "constant_mismatches", "layout_mismatches", "layout_of", "probe_source"]
