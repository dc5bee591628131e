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
Memory is device-wide (every process), in MiB. The summary also keeps the samples ("series": the
wall-clock time of each, epoch seconds, and its utilization), so a reader can take the busy
fraction over a window of its own (busy_between: the fleet's runs read it over the backlog,
from the first render's start to the last's, where a worker's start-up and tail leave it idle
by design).
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
        self.t: list[float] = []
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
                util = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
                self._sample(util, mem)
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
                util, mem = float(parts[0]), float(parts[1])
            except (ValueError, IndexError):
                continue
            self._sample(util, mem)

    def _sample(self, util: float, mem: float) -> None:
        # One sample's three figures together: a reader of the series pairs them by index.
        self.t.append(time.time())
        self.util.append(util)
        self.mem.append(mem)

    def stop(self, series: bool = False) -> dict:
        """Stops sampling; the summary, with every sample when `series`."""
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
        return self.summary(series)

    def summary(self, series: bool = False) -> dict:
        out = {"backend": self.backend, "interval_s": self.interval, "samples": len(self.util),
               "seconds": round((self._t1 or time.monotonic()) - self._t0, 3)}
        if self.error:
            out["error"] = self.error
        if self.util:
            out["busy_fraction"] = statistics.fmean(self.util) / 100.0
            out["busy_fraction_median"] = statistics.median(self.util) / 100.0
            out["busy_zero_samples"] = sum(1 for u in self.util if u == 0)
            if series:
                out["series"] = {"t": [round(t, 3) for t in self.t], "util": self.util}
        if self.mem:
            out["mem_used_peak_mib"] = max(self.mem)
            out["mem_used_mean_mib"] = statistics.fmean(self.mem)
            out["mem_used_first_mib"] = self.mem[0]
        return out


def busy_between(summary: dict, t0: float, t1: float) -> dict | None:
    """The busy fraction of a summary's samples taken in [t0, t1] (epoch seconds), with their
    count; None without a series or without samples in the window."""
    series = summary.get("series") or {}
    util = [u for t, u in zip(series.get("t") or [], series.get("util") or []) if t0 <= t <= t1]
    if not util:
        return None
    return {"busy_fraction": round(statistics.fmean(util) / 100.0, 4), "samples": len(util),
            "zero_samples": sum(1 for u in util if u == 0)}


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
    summary = sampler.stop(series=True)
    if cmd:
        summary["command"] = cmd
        summary["command_rc"] = rc
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "series"}), file=sys.stderr)
    sys.exit(rc)


if __name__ == "__main__":
    main()
