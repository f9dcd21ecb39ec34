"""The kernel names a CUBIN holds, read from its ELF symbol table, so that kernels with C++ names (templates, an
unnamed namespace: their mangled names carry a per-build hash) can be looked up with ``cuModuleGetFunction``.

No CUDA here: plain ELF64 parsing (tested on CPU with CUBINs from nvcc and NVRTC).
"""

from __future__ import annotations

import struct

_STT_FUNC = 2
_SHT_SYMTAB = 2


class CubinError(ValueError):
    """The bytes are not a CUBIN, or the kernel looked for is absent or ambiguous."""


def function_symbols(cubin: bytes) -> list[str]:
    """Names of every function symbol of ``cubin`` (an ELF64 little-endian image), in table order."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise CubinError("not a 64-bit little-endian ELF image (a CUBIN)")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names: list[str] = []
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != _SHT_SYMTAB or entsize == 0:
            continue
        str_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize):
            st_name, st_info = struct.unpack_from("<IB", cubin, pos)
            if st_info & 0xF != _STT_FUNC or st_name == 0:
                continue
            start = str_offset + st_name
            names.append(cubin[start:cubin.index(b"\0", start)].decode())
    return names


def find_kernel(symbols: list[str], fragment: str, namespace: str = "ep_moe") -> str:
    """The one symbol of a kernel in C++ namespace ``namespace`` whose mangled name holds ``fragment`` (its
    length-prefixed name and what follows, e.g. ``13notify_kernelE`` or ``14combine_kernelILi1EE``). Raises
    `CubinError` naming the fragment when there is none or more than one."""
    prefix = f"_ZN{len(namespace)}{namespace}"
    found = [s for s in symbols if s.startswith(prefix) and fragment in s and "$" not in s]
    if len(found) != 1:
        raise CubinError(f"jit: the CUBIN has {len(found)} kernels matching {fragment!r} in {namespace} "
                         f"(expected one){': ' + ', '.join(found) if found else ''}")
    return found[0]


__all__ = ["CubinError", "find_kernel", "function_symbols"]
