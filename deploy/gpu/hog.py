"""Holds GPU memory so that only about --keep-free-gib stay free: another tenant on the card.

    exec python3 deploy/gpu/hog.py --keep-free-gib 36 --report FILE --parent PID

Allocates one torch.empty(uint8) block on CUDA of (free - keep) bytes (cudaMalloc: the memory is
taken at once and NVML counts it), writes FILE as JSON ({"held_mib", "free_before_mib",
"free_after_mib", "total_mib", "pid"}, or {"error"}), then sleeps until SIGTERM/SIGINT or until
PARENT is gone (stopping.py), so a fleet.sh that dies cannot leave the card full. fleet.sh execs
it, so the pid it stops is this process's own. Needs torch with CUDA (the GPU machine's python3 has it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from stopping import Stopper

MIB = 2**20


def write(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.write("\n")
    os.replace(tmp, path)  # fleet.sh polls for the file: it must never see half of it


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep-free-gib", type=float, required=True)
    ap.add_argument("--report", required=True, help="JSON written once the memory is held")
    ap.add_argument("--parent", type=int, required=True, help="end when this process is gone")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    stopper = Stopper(args.parent)
    try:
        import torch

        torch.cuda.set_device(args.device)
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info(args.device)  # after the context is made
        size = free - int(args.keep_free_gib * 1024 * MIB)
        if size <= 0:
            raise RuntimeError(f"only {free / MIB:.0f} MiB free; nothing to hold to keep {args.keep_free_gib} GiB")
        block = torch.empty(size, dtype=torch.uint8, device=f"cuda:{args.device}")
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info(args.device)
    except Exception as e:  # noqa: BLE001 - fleet.sh records the error and runs without a hog
        write(args.report, {"error": f"{type(e).__name__}: {e}"[:500], "pid": os.getpid()})
        return 1
    write(args.report, {"held_mib": round(block.numel() / MIB), "free_before_mib": round(free / MIB),
                        "free_after_mib": round(free_after / MIB), "total_mib": round(total / MIB),
                        "keep_free_gib": args.keep_free_gib, "pid": os.getpid()})
    while stopper.running():
        time.sleep(0.5)
    del block
    return 0


if __name__ == "__main__":
    sys.exit(main())
