"""The LoRA storyboard stage's figures (deploy/gpu/fleet-board.sh), for fleet_summary.py's
lora-board.json.

    lora(run)   per set of a run: its images/s (fleet_summary's set summary), the switches by source
                (`shotfleet_lora_switches_total` scraped before and after the set: resident is a
                rebind, host a copy to the device, merged a merge from the files), and the sets the
                worker put on the device during the set (its "LoRA set on the device" lines: how
                many from each source, their milliseconds)

It takes fleet_summary.run_summary's dict (with its private _meta, _log and _dir). Standard
library only.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

SOURCES = ("resident", "host", "merged")


def switches_by_scrape(path: Path) -> dict:
    """`shotfleet_lora_switches_total` by source at each scrape of metrics.txt, by its label."""
    scrapes: dict = {}
    current = None
    if not path.exists():
        return scrapes
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("== "):
            current = scrapes.setdefault(line[3:].strip(), {s: 0 for s in SOURCES})
            continue
        m = re.match(r'^shotfleet_lora_switches_total\{source="([a-z]+)"\}\s+([0-9.e+]+)$', line)
        if m and current is not None:
            current[m[1]] = int(float(m[2]))
    return scrapes


def placements(log, t0: float | None, t1: float | None) -> dict:
    """The worker's sets put on the device between t0 and t1: count and milliseconds by source."""
    out: dict = {}
    for rec in log.with_message("LoRA set on the device"):
        if t0 is None or t1 is None or rec["t"] is None or not t0 <= rec["t"] <= t1:
            continue
        f = rec["fields"]
        entry = out.setdefault(f.get("source", "?"), {"count": 0, "ms": []})
        entry["count"] += 1
        if isinstance(f.get("elapsed_ms"), (int, float)):
            entry["ms"].append(f["elapsed_ms"])
    for entry in out.values():
        ms = entry.pop("ms")
        if ms:
            entry.update(ms_median=statistics.median(ms), ms_max=max(ms), ms_total=sum(ms))
    return out


def lora(run: dict) -> dict:
    meta, log, run_dir = run["_meta"], run["_log"], run["_dir"]
    scrapes = switches_by_scrape(run_dir / "metrics.txt")
    previous = scrapes.get("ready", {s: 0 for s in SOURCES})
    sets = []
    for s in run.get("sets", []):
        key = s.get("key")
        after = scrapes.get(f"set {key}")
        t0, t1 = meta.get(f"set_{key}_submit"), meta.get(f"set_{key}_end")
        t0, t1 = (float(t0) if t0 else None), (float(t1) if t1 else None)
        entry = {"key": key, "flags": meta.get(f"set_{key}_flags", ""), "status": s.get("status"),
                 "images": s.get("images"), "wall_s": s.get("wall_s"), "images_per_s": s.get("images_per_s"),
                 "images_per_s_steady": s.get("images_per_s_steady"), "stage_ms_median": s.get("stage_ms_median"),
                 "placed": placements(log, t0, t1)}
        if after:
            delta = {src: after[src] - previous.get(src, 0) for src in SOURCES}
            entry["switches"] = {**delta, "total": sum(delta.values())}
            previous = after
        sets.append(entry)
    return {"name": run["name"], "label": run.get("label"), "status": run.get("status"), "lora": meta.get("lora"),
            "warmup_s": run.get("warmup_s"), "push_s": meta.get("push_s"), "peak_vram_gib": run.get("peak_vram_gib"),
            "error": run.get("error"), "sets": sets}
