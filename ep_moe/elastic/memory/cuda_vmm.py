"""The GPU form of the memory model: one virtual range per rank reserved and mapped with the CUDA driver's
virtual memory management calls (``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``),
through ``ctypes`` on ``libcuda``; host segments are pinned host-NUMA allocations (the NUMA node closest to the
GPU), shared between processes as POSIX file descriptors (``cuMemExportToShareableHandle`` /
``cuMemImportFromShareableHandle``), and so are device allocations (`DeviceAllocation`: the native kernels'
symmetric memory over ranks that may share one GPU, `ep_moe.native.symmetric`).

Enum values and struct layouts are those of CUDA's ``cuda.h`` (checked against CUDA 13.0; they are stable since
CUDA 12.2, which added host-NUMA locations). `vmm_unavailable_reason` says why a device cannot use this (no
driver, no VMM, no host-NUMA VMM, no POSIX-fd export) before anything is allocated.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.utils.dlpack

from .segment_layout import ALIGNMENT_BYTES

# cuda.h
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_NONE = 0x0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_LOCATION_TYPE_HOST_NUMA = 0x3
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID = 134
CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 141


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (its name and the driver's error name are in the message)."""


_driver = None


def driver() -> ctypes.CDLL:
    """``libcuda`` with the signatures used here (loaded once). Raises `CudaDriverError` where it is missing."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaDriverError(f"ep_moe.elastic.memory: the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from exc
        u64, size_t, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        signatures = {
            "cuInit": [ctypes.c_uint],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            "cuMemGetAllocationGranularity": [ctypes.POINTER(size_t), ctypes.POINTER(CUmemAllocationProp),
                                              ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, ctypes.c_ulonglong],
            "cuMemAddressFree": [u64, size_t],
            "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.POINTER(CUmemAllocationProp), ctypes.c_ulonglong],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size_t, size_t, u64, ctypes.c_ulonglong],
            "cuMemUnmap": [u64, size_t],
            "cuMemSetAccess": [u64, size_t, ctypes.POINTER(CUmemAccessDesc), size_t],
            "cuMemExportToShareableHandle": [vp, u64, ctypes.c_int, ctypes.c_ulonglong],
            "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), vp, ctypes.c_int],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        _driver = lib
    return _driver


def _check(result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        driver().cuGetErrorName(result, ctypes.byref(name))
        raise CudaDriverError(f"ep_moe.elastic.memory: {call} failed: {(name.value or b'?').decode()} ({result})")


def _attribute(attribute: int, ordinal: int) -> int:
    value = ctypes.c_int()
    _check(driver().cuDeviceGetAttribute(ctypes.byref(value), attribute, ordinal), "cuDeviceGetAttribute")
    return value.value


def vmm_unavailable_reason(device: torch.device, exportable: bool, host: bool = True) -> str | None:
    """None when ``device`` can map memory with the VMM calls (host-NUMA memory too when ``host``; exported as a
    file descriptor when ``exportable``), else the reason."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{device} is not a CUDA device"
    try:
        lib = driver()
        _check(lib.cuInit(0), "cuInit")
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        checks = [(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management")]
        if host:
            checks.append((CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                           "host-NUMA VMM allocations"))
        if exportable:
            checks.append((CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, "POSIX-fd export"))
        for attribute, what in checks:
            if not _attribute(attribute, ordinal):
                return f"device {ordinal} does not support {what}"
    except CudaDriverError as exc:
        return str(exc)
    return None


def _prop(location_type: int, location_id: int, exportable: bool) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if exportable else CU_MEM_HANDLE_TYPE_NONE
    prop.location = CUmemLocation(location_type, location_id)
    return prop


def _create(prop: CUmemAllocationProp, size: int) -> int:
    granularity = ctypes.c_size_t()
    _check(driver().cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop),
                                                  CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
    if size % granularity.value or ALIGNMENT_BYTES % granularity.value:
        raise CudaDriverError(f"ep_moe.elastic.memory: {size} bytes are not a multiple of the allocation granularity "
                              f"{granularity.value}")
    handle = ctypes.c_uint64()
    _check(driver().cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0), "cuMemCreate")
    return handle.value


def host_numa_node(ordinal: int) -> int:
    """The host NUMA node closest to GPU ``ordinal`` (0 where the system has no NUMA)."""
    return max(_attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, ordinal), 0)


class _ExportedAllocation:
    """A pinned allocation of ``size`` bytes (on GPU ``device`` itself, or, ``on_host``, in the host NUMA node
    closest to it), exported as a POSIX file descriptor (``fd``, for the other processes of the node). Released
    when collected unless a `CudaRange` took it over (`CudaRange.map_allocation`)."""

    what = "memory"  # for errors: what could not be shared

    def __init__(self, device: torch.device, size: int, on_host: bool) -> None:
        self.fd = -1
        reason = vmm_unavailable_reason(device, exportable=True, host=on_host)
        if reason is not None:
            raise CudaDriverError(f"ep_moe.elastic.memory: {self.what} cannot be shared: {reason}")
        torch.zeros(1, device=device)  # the primary context, current on this thread
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        location = (CU_MEM_LOCATION_TYPE_HOST_NUMA, host_numa_node(ordinal)) if on_host else \
            (CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
        self.size = size
        self.handle = _create(_prop(*location, True), size)
        fd = ctypes.c_int(-1)
        _check(driver().cuMemExportToShareableHandle(ctypes.byref(fd), self.handle,
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               "cuMemExportToShareableHandle")
        self.fd = fd.value

    def close_fd(self) -> None:
        close_fd(self.fd)
        self.fd = -1

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close_fd()
        if getattr(self, "handle", None) is not None and _driver is not None:
            _driver.cuMemRelease(self.handle)
            self.handle = None


class HostAllocation(_ExportedAllocation):
    """A pinned host-NUMA allocation of ``size`` bytes near GPU ``device``, exported as a POSIX file descriptor
    (``fd``, for the peers of the node). Released when collected unless a `CudaRange` took it over."""

    what = "host segments"

    def __init__(self, device: torch.device, size: int) -> None:
        super().__init__(device, size, on_host=True)


class DeviceAllocation(_ExportedAllocation):
    """``size`` bytes (a multiple of 2 MiB) of GPU ``device``'s memory, exported as a POSIX file descriptor
    (``fd``): other processes map it, on the same GPU or, with peer access, from another GPU of the node.
    Released when collected unless a `CudaRange` took it over. Contents start undefined (not zeroed)."""

    what = "device memory"

    def __init__(self, device: torch.device, size: int) -> None:
        super().__init__(device, size, on_host=False)


class _DeviceView:
    """A ``__cuda_array_interface__`` (v3) over bytes of a `CudaRange`; the tensor made from it holds it, and it
    holds the range."""

    def __init__(self, owner: CudaRange, offset: int, size: int) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (owner.address + offset, False),
                                         "version": 3, "strides": None, "stream": None}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DLDeleter)]
KDL_CUDA, KDL_UINT = 2, 1  # dlpack.h: kDLCUDA, kDLUInt
_dlpack_alive: dict[int, tuple] = {}  # manager_ctx -> what the capsule's tensor needs alive


@_DLDeleter
def _dlpack_deleter(managed) -> None:
    _dlpack_alive.pop(managed.contents.manager_ctx, None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _dlpack_view(owner: CudaRange, offset: int, size: int) -> torch.Tensor:
    """The same view through a DLPack capsule, which names its device (torch then asks the driver nothing about
    the pointer). The capsule's deleter drops the reference to ``owner``."""
    shape = (ctypes.c_int64 * 1)(size)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(owner.address + offset, _DLDevice(KDL_CUDA, owner.ordinal), 1,
                                  _DLDataType(KDL_UINT, 8, 1), shape, None, 0)
    key = id(managed)
    managed.manager_ctx = key
    managed.deleter = _dlpack_deleter
    _dlpack_alive[key] = (owner, managed, shape)
    return torch.utils.dlpack.from_dlpack(_capsule_new(ctypes.addressof(managed), b"dltensor", None))


class CudaRange:
    """``size`` bytes of reserved device address space on ``device``; `map_device`, `map_host`, `map_imported`
    back parts of it and grant the device read-write access. ``host=False``: no host memory will be mapped (the
    device need not support host-NUMA allocations). Unmapped and released when the last view is gone."""

    def __init__(self, size: int, device: torch.device, host: bool = True) -> None:
        reason = vmm_unavailable_reason(device, exportable=False, host=host)
        if reason is not None:
            raise CudaDriverError(f"ep_moe.elastic.memory: the CUDA VMM mapping is not available: {reason}")
        torch.zeros(1, device=device)  # the runtime's primary context is current on this thread from here on
        context = ctypes.c_void_p()
        _check(driver().cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            raise CudaDriverError("ep_moe.elastic.memory: no current CUDA context on this thread")
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.ordinal)
        self.numa_node = host_numa_node(self.ordinal) if host else None
        self.size = size
        self._mapped: list[tuple[int, int]] = []
        self._handles: list[int] = []
        address = ctypes.c_uint64()
        _check(driver().cuMemAddressReserve(ctypes.byref(address), max(size, ALIGNMENT_BYTES), ALIGNMENT_BYTES, 0,
                                            0), "cuMemAddressReserve")
        self.address = address.value

    def _map(self, offset: int, size: int, handle: int) -> None:
        """Map ``handle`` (this range now owns it) at ``offset`` and let the device read and write it."""
        self._handles.append(handle)
        _check(driver().cuMemMap(self.address + offset, size, 0, handle, 0), "cuMemMap")
        self._mapped.append((offset, size))
        access = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal),
                                 CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        _check(driver().cuMemSetAccess(self.address + offset, size, ctypes.byref(access), 1), "cuMemSetAccess")

    def map_device(self, offset: int, size: int) -> None:
        """Back ``[offset, offset + size)`` with memory of this GPU."""
        if size:
            self._map(offset, size, _create(_prop(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal, False), size))

    def map_host(self, offset: int, size: int) -> None:
        """Back ``[offset, offset + size)`` with pinned memory of the GPU's host NUMA node."""
        if self.numa_node is None:
            raise CudaDriverError("ep_moe.elastic.memory: this range was reserved without host memory (host=False)")
        if size:
            self._map(offset, size, _create(_prop(CU_MEM_LOCATION_TYPE_HOST_NUMA, self.numa_node, False), size))

    def map_allocation(self, offset: int, size: int, allocation: _ExportedAllocation) -> None:
        """Map this process's exportable allocation (a `HostAllocation` or `DeviceAllocation`) at ``offset``
        (the range takes it over)."""
        handle, allocation.handle = allocation.handle, None
        self._map(offset, size, handle)

    def map_imported(self, offset: int, size: int, fd: int) -> None:
        """Map the allocation exported as ``fd`` (another process's host segment or device memory) at ``offset``
        and grant this range's device access (a peer GPU's memory needs peer access); ``fd`` may be closed
        afterwards."""
        if not size:
            return
        handle = ctypes.c_uint64()
        _check(driver().cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               "cuMemImportFromShareableHandle")
        self._map(offset, size, handle.value)

    def view(self, offset: int, size: int) -> torch.Tensor:
        """A uint8 tensor on the device over ``[offset, offset + size)`` (GPU-visible, wherever the bytes live)."""
        if offset < 0 or offset + size > self.size:
            raise ValueError(f"ep_moe.elastic.memory: [{offset}, {offset + size}) is outside the {self.size}-byte range")
        if size == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        address = self.address + offset
        try:
            view = torch.as_tensor(_DeviceView(self, offset, size), device=self.device)
        except RuntimeError:  # torch asked the driver about the pointer (cudaPointerGetAttributes) and refused it
            view = None
        if view is None or view.data_ptr() != address or view.device != self.device:
            # refused, or placed on another device and copied (not a view): DLPack names the device itself
            view = _dlpack_view(self, offset, size)
        if view.data_ptr() != address or view.device != self.device:
            raise CudaDriverError(f"ep_moe.elastic.memory: torch did not wrap the mapped range in place on {self.device} "
                                  f"(got {view.device}, pointer {view.data_ptr():#x} for {address:#x})")
        return view

    def __del__(self) -> None:
        address = getattr(self, "address", None)
        if address is None or _driver is None:
            return
        try:
            torch.cuda.synchronize(self.device)  # no kernel may still read what is unmapped below
        except Exception:  # noqa: BLE001 - interpreter exit: the runtime may be gone already
            pass
        for offset, size in self._mapped:
            _driver.cuMemUnmap(address + offset, size)
        for handle in self._handles:
            _driver.cuMemRelease(handle)
        _driver.cuMemAddressFree(address, max(self.size, ALIGNMENT_BYTES))
        self.address = None


def close_fd(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        os.close(fd)


__all__ = ["CudaDriverError", "CudaRange", "DeviceAllocation", "HostAllocation", "close_fd", "driver",
           "vmm_unavailable_reason"]
