"""Proves a process can use the GPU: CUDA driver API init, a context, a 256 MiB allocation.

Run inside the sandbox of deploy/systemd's unit by check-unit.sh. Only the driver library
(libcuda.so.1) is needed, no wheel. Exit 0 and one JSON line when every step worked.
"""
import ctypes
import json
import sys


def main() -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    steps = {}
    steps["cuInit"] = cuda.cuInit(0)
    count = ctypes.c_int(0)
    steps["cuDeviceGetCount"] = cuda.cuDeviceGetCount(ctypes.byref(count))
    device = ctypes.c_int(0)
    steps["cuDeviceGet"] = cuda.cuDeviceGet(ctypes.byref(device), 0)
    context = ctypes.c_void_p()
    steps["cuCtxCreate"] = cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device)
    pointer = ctypes.c_uint64()
    steps["cuMemAlloc"] = cuda.cuMemAlloc_v2(ctypes.byref(pointer), 256 << 20)
    if steps["cuMemAlloc"] == 0:
        steps["cuMemFree"] = cuda.cuMemFree_v2(pointer)
    ok = all(code == 0 for code in steps.values())
    print(json.dumps({"ok": ok, "devices": count.value, "codes": steps}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
