"""The fleet stage's memory sampler: every 200 ms, the device's used memory, the current worker's
own (where NVML lists its pid) and all compute processes', as CSV.

    exec python3 deploy/gpu/vram_sampler.py CSV PIDFILE PARENT_PID

PIDFILE holds the current worker's pid (fleet.sh rewrites it per run; empty between runs). fleet.sh
execs it, so the pid it stops is this process's own; it also ends once PARENT_PID is gone
(stopping.py). Without NVML it writes only the header.
"""

from __future__ import annotations

import os
import sys
import time

from stopping import Stopper

MIB = 2**20


def own_pid(pidfile: str) -> int:
    try:
        with open(pidfile) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def main() -> int:
    out, pidfile, parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
    stopper = Stopper(parent)
    with open(out, "w") as f:
        f.write("t,device_used_mib,own_mib,procs_mib\n")
        f.flush()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("SHOTFLEET_GPU", "0")))
        except Exception as e:  # noqa: BLE001
            print(f"vram sampler: no NVML ({type(e).__name__}: {e})", file=sys.stderr)
            return 0
        while stopper.running():
            try:
                used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB
                own, procs, pid = -1.0, 0.0, own_pid(pidfile)
                try:
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        mem = (p.usedGpuMemory or 0) / MIB
                        procs += mem
                        if pid and p.pid == pid:
                            own = mem
                except Exception:  # noqa: BLE001 - some drivers list no processes
                    pass
                f.write(f"{time.time():.3f},{used:.0f},{own:.0f},{procs:.0f}\n")
                f.flush()
            except Exception as e:  # noqa: BLE001
                print(f"vram sampler: {e}", file=sys.stderr)
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
