"""Loading and launching CUBINs with the CUDA driver API (``libcuda`` through ctypes): a module per (binary,
device), loaded into the device's primary context (the one torch uses), and launches on a given stream (torch's
current stream, so CUDA graph capture records them).

Per launch the host work is one ``struct.pack_into`` of the arguments into the function's own buffer (the array
of pointers into it is built once) and the ``cuLaunchKernel`` call (``cuLaunchCooperativeKernel`` for a kernel whose
blocks must all be resident at once: `Function.launch_cooperative`), under the function's lock.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Sequence

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_FOUND = 500
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
STATIC_SHARED_LIMIT = 48 * 1024  # dynamic shared memory above this needs the function attribute

# Argument kinds of a kernel signature, as ctypes types (a pointer is passed as its integer address).
PTR, I64, I32, U32, F32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float
_STRUCT_CODES = {PTR: "Q", I64: "q", I32: "i", U32: "I", F32: "f"}


class DriverError(RuntimeError):
    """A CUDA driver call failed (the message names the call and the error)."""


class _Driver:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DriverError(f"the CUDA driver library libcuda.so.1 does not load ({exc})") from exc
        self.lib = lib
        vp, c_int = ctypes.c_void_p, ctypes.c_int
        lib.cuGetErrorName.argtypes = [c_int, ctypes.POINTER(ctypes.c_char_p)]
        # no argtypes on the hot call (they cost microseconds per call): Function.launch passes ctypes objects
        # where a C int would not do (handle, stream, the parameter array)
        lib.cuLaunchKernel.restype = c_int
        lib.cuLaunchCooperativeKernel.restype = c_int
        lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(c_int), vp, c_int, ctypes.c_size_t]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [vp, c_int, c_int]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(c_int), c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), c_int]
        # typed: with 4 arguments the prototype's conversion is cheaper than a ctypes object per argument (the
        # launch's 11 are not: see above)
        self.memset_d32_async = ctypes.CFUNCTYPE(c_int, ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, vp)(
            ("cuMemsetD32Async", lib))
        self.event_record = ctypes.CFUNCTYPE(c_int, vp, vp)(("cuEventRecord", lib))
        self.event_synchronize = ctypes.CFUNCTYPE(c_int, vp)(("cuEventSynchronize", lib))
        lib.cuEventCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cuEventDestroy_v2.argtypes = [vp]
        self.check(lib.cuInit(0), "cuInit")
        self._primary: dict[int, ctypes.c_void_p] = {}

    def check(self, status: int, call: str) -> None:
        if status != CUDA_SUCCESS:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(status, ctypes.byref(name))
            raise DriverError(f"jit: {call} failed: {name.value.decode() if name.value else status}")

    def use_primary_context(self, device: int) -> None:
        """Make ``device``'s primary context current on this thread (torch's contexts are the primary ones)."""
        ctx = self._primary.get(device)
        if ctx is None:  # retained once per device, for the process's life (as torch does)
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._primary[device] = ctx
        current = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != ctx.value:
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


_driver: _Driver | None = None
_thread = threading.local()  # the device whose primary context this thread made current (Function.launch)
_driver_lock = threading.Lock()


def driver() -> _Driver:
    """The loaded driver; raises `DriverError` when libcuda is absent or does not initialize."""
    global _driver
    loaded = _driver
    if loaded is not None:  # set once, never unset: no lock on the launchers' path
        return loaded
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def _enter(device: int | None) -> None:
    """Make ``device``'s primary context current on this thread, once per thread and device (a thread that has not
    touched CUDA through the runtime yet may have no current context); None: leave it."""
    if device is not None and getattr(_thread, "device", None) != device:
        driver().use_primary_context(device)
        _thread.device = device


class Function:
    """One ``extern "C" __global__`` function of a loaded module, with its argument signature (a sequence of
    `PTR`/`I64`/`I32`/`U32`/`F32`, in the kernel's order). `launch` takes the arguments as Python ints/floats
    (pointers as ``tensor.data_ptr()``, 0 for null)."""

    def __init__(self, handle: int, name: str, signature: Sequence[type], max_dynamic_shared: int = 0,
                 launch_fn=None, device: int | None = None, cooperative_fn=None) -> None:
        self.handle = ctypes.c_void_p(handle)
        self.device = device  # its module's device: launches make that primary context current once per thread
        self.name = name
        # The arguments live in one buffer per function, packed by one struct.pack_into per launch (C alignment,
        # as the kernel's parameters); the driver reads them through a fixed array of pointers into it, and
        # copies them during cuLaunchKernel, so a lock around pack and launch makes the buffer safe to share.
        codes = [_STRUCT_CODES[t] for t in signature]
        self._struct = struct.Struct("@" + "".join(codes))
        self._buffer = ctypes.create_string_buffer(max(self._struct.size, 1))
        self._view = memoryview(self._buffer).cast("B")  # pack_into is fastest through a memoryview
        base = ctypes.addressof(self._buffer)
        offsets = [struct.calcsize("@" + "".join(codes[:i + 1])) - struct.calcsize("@" + codes[i])
                   for i in range(len(codes))]
        self._params = (ctypes.c_void_p * max(len(codes), 1))(*[base + off for off in offsets])
        self._lock = threading.Lock()
        # launch_fn: cuLaunchKernel's signature; another callable only to time the host side without a GPU
        self._launch = launch_fn if launch_fn is not None else driver().lib.cuLaunchKernel
        # cooperative_fn: cuLaunchCooperativeKernel's signature (the same less `extra`), looked up at the first
        # cooperative launch unless given (a fake, as launch_fn)
        self._launch_cooperative = cooperative_fn
        self.max_dynamic_shared = max_dynamic_shared

    def _pack(self, args: tuple) -> None:
        """``args`` into the argument buffer (under the function's lock); a wrong count or kind is a TypeError."""
        try:
            self._struct.pack_into(self._view, 0, *args)
        except struct.error as exc:
            raise TypeError(f"jit: {self.name} takes {len(self._params)} arguments of kinds "
                            f"{self._struct.format}: {exc}") from None

    def launch(self, grid: int | tuple[int, int, int], block: int, stream: int, *args: int | float,
               shared_bytes: int = 0) -> None:
        """Enqueue on ``stream`` (a ``cudaStream_t`` as int, e.g. ``torch.cuda.current_stream().cuda_stream``).
        Raises `DriverError` when the launch is refused."""
        _enter(self.device)
        gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else grid
        with self._lock:
            self._pack(args)
            status = self._launch(self.handle, gx, gy, gz, block, 1, 1, shared_bytes, ctypes.c_void_p(stream),
                                  self._params, None)
        if status != CUDA_SUCCESS:
            driver().check(status, f"cuLaunchKernel({self.name}, grid={grid}, block={block}, "
                                   f"shared={shared_bytes})")

    def launch_cooperative(self, grid: int, block: int, stream: int, *args: int | float, shared_bytes: int = 0) -> None:
        """`launch` through ``cuLaunchCooperativeKernel``: the driver starts every block at once or refuses, so the
        kernel may wait for all of its blocks (a grid barrier) even while other kernels hold SMs. ``grid`` must be
        at most `max_active_blocks` times the device's SM count. Raises `DriverError` when the launch is refused
        (e.g. ``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE``)."""
        _enter(self.device)
        launch = self._launch_cooperative
        if launch is None:
            launch = self._launch_cooperative = driver().lib.cuLaunchCooperativeKernel
        with self._lock:
            self._pack(args)
            status = launch(self.handle, grid, 1, 1, block, 1, 1, shared_bytes, ctypes.c_void_p(stream), self._params)
        if status != CUDA_SUCCESS:
            driver().check(status, f"cuLaunchCooperativeKernel({self.name}, grid={grid}, block={block}, "
                                   f"shared={shared_bytes})")

    def max_active_blocks(self, block: int, shared_bytes: int = 0) -> int:
        """How many blocks of ``block`` threads (and ``shared_bytes`` of dynamic shared memory) one SM holds at once
        (``cuOccupancyMaxActiveBlocksPerMultiprocessor``: registers, static and dynamic shared memory, threads)."""
        drv = driver()
        if self.device is not None:
            drv.use_primary_context(self.device)
        count = ctypes.c_int()
        drv.check(drv.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(count), self.handle, block,
                                                                       shared_bytes),
                  f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name}, block={block}, shared={shared_bytes})")
        return count.value

    def launch_prepared(self, grid: int, block: int, stream: int, args: ctypes.Array, shared_bytes: int = 0) -> None:
        """Enqueue with ``args``, an array of pointers to the arguments built once by the caller (`prepared_args`)
        for structs it reuses across launches (the driver copies the arguments during the call). Raises
        `DriverError` when refused."""
        _enter(self.device)
        status = self._launch(self.handle, grid, 1, 1, block, 1, 1, shared_bytes, ctypes.c_void_p(stream), args, None)
        if status != CUDA_SUCCESS:
            driver().check(status, f"cuLaunchKernel({self.name}, grid={grid}, block={block}, "
                                   f"shared={shared_bytes})")

    def launch_params(self, grid: int, block: int, stream: int, *params: ctypes.Structure | ctypes._SimpleCData,
                      shared_bytes: int = 0) -> None:
        """Enqueue a kernel whose arguments are passed by value as ctypes objects (``params``: parameter struct
        mirrors, or ``ctypes.c_uint64`` pointers; the driver copies them during the call, so no lock is needed).
        Raises `DriverError` when refused."""
        _enter(self.device)
        args = (ctypes.c_void_p * len(params))(*(ctypes.addressof(p) for p in params))
        status = self._launch(self.handle, grid, 1, 1, block, 1, 1, shared_bytes, ctypes.c_void_p(stream), args, None)
        if status != CUDA_SUCCESS:
            driver().check(status, f"cuLaunchKernel({self.name}, grid={grid}, block={block}, "
                                   f"shared={shared_bytes})")


def prepared_args(*params: ctypes.Structure | ctypes._SimpleCData) -> ctypes.Array:
    """The array of pointers to ``params`` that `Function.launch_prepared` passes (valid while they live)."""
    return (ctypes.c_void_p * len(params))(*(ctypes.addressof(p) for p in params))


def memset_zero_async(address: int, words: int, stream: int, device: int) -> None:
    """Zero ``words`` 32-bit words at device ``address`` on ``stream`` (``cuMemsetD32Async``, with no torch call; captured by a CUDA graph like a kernel)."""
    _enter(device)
    drv = driver()
    status = drv.memset_d32_async(address, 0, words, stream)
    if status != CUDA_SUCCESS:
        drv.check(status, f"cuMemsetD32Async({words} words)")


class HostEvent:
    """A CUDA event of ``device``'s primary context (no timing) that the host records on a stream and waits for,
    given the stream as a raw ``cudaStream_t``: no torch ``Stream`` object per wait. The waiting thread spins, as
    on a default torch event; ctypes releases the GIL meanwhile."""

    def __init__(self, device: int) -> None:
        drv = driver()
        drv.use_primary_context(device)
        self.device, self._event = device, ctypes.c_void_p()
        drv.check(drv.lib.cuEventCreate(ctypes.byref(self._event), _CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self._destroy = drv.lib.cuEventDestroy_v2

    def wait(self, stream: int) -> None:
        """Block until the work queued on ``stream`` so far ran. Raises `DriverError` with the error a kernel left
        (e.g. an illegal address) or a refused record."""
        _enter(self.device)
        drv = driver()
        status = drv.event_record(self._event, stream)
        if status != CUDA_SUCCESS:
            drv.check(status, "cuEventRecord")
        status = drv.event_synchronize(self._event)
        if status != CUDA_SUCCESS:
            drv.check(status, "cuEventSynchronize")

    def __del__(self) -> None:
        if self._event:
            self._destroy(self._event)


_CU_EVENT_DISABLE_TIMING = 0x2


def host_device_pointer(host_ptr: int, device: int) -> int:
    """The device address of pinned, mapped host memory at ``host_ptr`` (``cuMemHostGetDevicePointer``; what the
    kernels write their error record and counts through). Raises `DriverError` when the memory is not mapped."""
    drv = driver()
    drv.use_primary_context(device)
    out = ctypes.c_uint64()
    drv.check(drv.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0),
              "cuMemHostGetDevicePointer")
    return out.value


class Module:
    """A CUBIN loaded on one device; `function` looks a kernel up (once per name and signature)."""

    def __init__(self, cubin: bytes, device: int, label: str) -> None:
        drv = driver()
        drv.use_primary_context(device)
        self.label, self.device = label, device
        self._cubin = cubin  # the driver reads the image during the load only; kept for reference
        handle = ctypes.c_void_p()
        drv.check(drv.lib.cuModuleLoadData(ctypes.byref(handle), cubin), f"cuModuleLoadData({label})")
        self.handle = handle
        self._functions: dict[tuple, Function] = {}

    def function(self, name: str, signature: Sequence[type], max_dynamic_shared: int = 0) -> Function:
        """``name`` of this module; ``max_dynamic_shared`` > 48 KiB raises the function's dynamic shared memory
        limit (``cuFuncSetAttribute``)."""
        cache_key = (name, tuple(signature), max_dynamic_shared)
        found = self._functions.get(cache_key)
        if found is None:
            drv = driver()
            drv.use_primary_context(self.device)
            handle = ctypes.c_void_p()
            status = drv.lib.cuModuleGetFunction(ctypes.byref(handle), self.handle, name.encode())
            if status == CUDA_ERROR_NOT_FOUND:  # a kernel with internal linkage: look it up among all of them
                found_handle = self._enumerated(name)
                if found_handle is not None:
                    handle, status = found_handle, CUDA_SUCCESS
            drv.check(status, f"cuModuleGetFunction({self.label}, {name})")
            if max_dynamic_shared > STATIC_SHARED_LIMIT:
                drv.check(drv.lib.cuFuncSetAttribute(handle, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                     max_dynamic_shared), f"cuFuncSetAttribute({name})")
            found = self._functions[cache_key] = Function(handle.value, name, signature, max_dynamic_shared,
                                                          device=self.device)
        return found

    def _enumerated(self, name: str) -> ctypes.c_void_p | None:
        """The function called ``name`` among all of the module's (``cuModuleEnumerateFunctions`` and
        ``cuFuncGetName``, CUDA 12.4 drivers and later), or None (also where the driver lacks those calls)."""
        lib = driver().lib
        if not all(hasattr(lib, f) for f in ("cuModuleGetFunctionCount", "cuModuleEnumerateFunctions",
                                             "cuFuncGetName")):
            return None
        count = ctypes.c_uint()
        if lib.cuModuleGetFunctionCount(ctypes.byref(count), self.handle) != CUDA_SUCCESS:
            return None
        handles = (ctypes.c_void_p * count.value)()
        if lib.cuModuleEnumerateFunctions(handles, count, self.handle) != CUDA_SUCCESS:
            return None
        for handle in handles:
            text = ctypes.c_char_p()
            if lib.cuFuncGetName(ctypes.byref(text), ctypes.c_void_p(handle)) == CUDA_SUCCESS and \
                    text.value == name.encode():
                return ctypes.c_void_p(handle)
        return None


__all__ = ["F32", "I32", "I64", "PTR", "U32", "DriverError", "Function", "HostEvent", "Module", "driver",
           "host_device_pointer", "memset_zero_async", "prepared_args"]
