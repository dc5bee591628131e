"""Samples GPU utilisation and memory every 100 ms (NVML through pynvml, else nvidia-smi).

As a library (bench_diffusers.py):
    s = GpuSampler(interval=0.1); s.start(); ...; summary = s.stop()

As a command, around another command (fleet.sh), writing the summary as JSON:
    python3 deploy/gpu/gpu_sampler.py --out $OUT/fleet-gpu.json -- CMD ARGS...
or until SIGTERM/SIGINT (start it in the background, kill it when the measured part ends):
    python3 deploy/gpu/gpu_sampler.py --out $OUT/fleet-gpu.json &

The summary: busy_fraction is the mean of NVML's utilization.gpu over the samples / 100. NVML
defines that figure as the share of the last sample period (1/6 s to 1 s, chosen by the driver)
in which at least one kernel ran, so it says "the GPU was never idle", not "the SMs were full".
Memory is device-wide (every process), in MiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time


class GpuSampler:
    def __init__(self, interval: float = 0.1, index: int = 0):
        self.interval = interval
        self.index = index
        self.util: list[float] = []
        self.mem: list[float] = []
        self.backend: str | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._t0 = 0.0
        self._t1 = 0.0

    def start(self) -> "GpuSampler":
        self._t0 = time.monotonic()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            self.backend = "pynvml"
            self._thread = threading.Thread(target=self._nvml_loop, args=(pynvml, handle), daemon=True)
        except Exception as e:  # noqa: BLE001 - no NVML: try nvidia-smi, else sample nothing
            self.error = f"pynvml: {type(e).__name__}: {e}"
            if shutil.which("nvidia-smi"):
                self.backend = "nvidia-smi"
                self._thread = threading.Thread(target=self._smi_loop, daemon=True)
        if self._thread:
            self._thread.start()
        return self

    def _nvml_loop(self, pynvml, handle) -> None:
        while not self._stop.is_set():
            try:
                self.util.append(float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                self.mem.append(pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20)
            except Exception as e:  # noqa: BLE001
                self.error = f"nvml sample: {e}"
            self._stop.wait(self.interval)
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass

    def _smi_loop(self) -> None:
        ms = max(1, int(self.interval * 1000))
        cmd = ["nvidia-smi", f"--id={self.index}", "--query-gpu=utilization.gpu,memory.used",
               "--format=csv,noheader,nounits", f"-lms={ms}"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if self._stop.is_set():
                break
            parts = [p.strip() for p in line.split(",")]
            try:
                self.util.append(float(parts[0]))
                self.mem.append(float(parts[1]))
            except (ValueError, IndexError):
                continue

    def stop(self) -> dict:
        self._t1 = time.monotonic()
        self._stop.set()
        if self._proc:
            self._proc.terminate()
            try:
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread:
            self._thread.join(3)
        return self.summary()

    def summary(self) -> dict:
        out = {"backend": self.backend, "interval_s": self.interval, "samples": len(self.util),
               "seconds": round((self._t1 or time.monotonic()) - self._t0, 3)}
        if self.error:
            out["error"] = self.error
        if self.util:
            out["busy_fraction"] = statistics.fmean(self.util) / 100.0
            out["busy_fraction_median"] = statistics.median(self.util) / 100.0
            out["busy_zero_samples"] = sum(1 for u in self.util if u == 0)
        if self.mem:
            out["mem_used_peak_mib"] = max(self.mem)
            out["mem_used_mean_mib"] = statistics.fmean(self.mem)
            out["mem_used_first_mib"] = self.mem[0]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON summary")
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS: sample while it runs")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    sampler = GpuSampler(args.interval, args.index).start()
    rc = 0
    if cmd:
        rc = subprocess.call(cmd)
    else:
        from stopping import Stopper  # beside this file; the library use above needs none

        stopper = Stopper()
        while stopper.running():
            time.sleep(0.5)
    summary = sampler.stop()
    if cmd:
        summary["command"] = cmd
        summary["command_rc"] = rc
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print(json.dumps(summary), file=sys.stderr)
    sys.exit(rc)


if __name__ == "__main__":
    main()
