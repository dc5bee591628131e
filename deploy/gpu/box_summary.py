"""The box stage's figures (deploy/gpu/fleet-box.sh, issue 18), for fleet_summary.py's box.json.

    speed(one, two)   images/s of one worker on GPU 0 and of `--gpus all`'s two on the same jobs, the
                      ratio (issue 18 asks >= TARGET), steady ratio, per card: jobs, images, busy,
                      restarts
    mixed(run)        the box under memory pressure on both cards: the tally, per card jobs done,
                      admission OOMs (0 wanted on both), given back for no room, in-place rungs,
                      re-published, failed; the hogs; busy per card; restarts

The box's log is its workers' lines, each marked with its card (`"gpu": "gpu0"`); fleet_summary's
readers take the rest. Each takes fleet_summary.run_summary's dict (with _meta, _log and _dir).
Standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path

from fleet_summary import LOG_COUNTS, fnum, load_json, r

# Two workers' images/s over one worker's, on the same single-image jobs (issue 18, point 4).
TARGET = 1.9
GPUS = ("gpu0", "gpu1")


def per_gpu(run_dir: Path) -> dict:
    """The box log's counts per card (LOG_COUNTS' messages), and the images of its `job done` lines."""
    out = {gpu: dict.fromkeys([*LOG_COUNTS.values(), "images"], 0) for gpu in GPUS}
    path = run_dir / "worker.log"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("gpu") not in out:
            continue
        fields = rec.get("fields", {})
        key = LOG_COUNTS.get(fields.get("message", ""))
        if key:
            out[rec["gpu"]][key] += 1
        if key == "job_done":
            out[rec["gpu"]]["images"] += int(fields.get("images") or 0)
    return out


def busy(run_dir: Path, key: str) -> dict:
    """Each card's sampler over set KEY: busy fraction and memory peak (device-wide, MiB)."""
    out = {}
    for gpu, name in zip(GPUS, (f"gpu-{key}.json", f"gpu-{key}-gpu1.json")):
        doc = load_json(run_dir / name) or {}
        out[gpu] = {"busy_fraction": r(doc.get("busy_fraction"), 4), "mem_used_peak_mib": doc.get("mem_used_peak_mib"),
                    "error": doc.get("error") if not doc.get("samples") else None}
    return out


def restarts(run_dir: Path, label: str) -> dict | None:
    """Each card's worker as the box's /status said after LABEL: restarts, phase, last exit."""
    status = load_json(run_dir / f"status-{label}.json")
    if not isinstance(status, list):
        return None
    return {g.get("gpu"): {k: g.get(k) for k in ("restarts", "phase", "ready", "last_exit", "last_error")} for g in status}


def _set(run: dict | None, key: str) -> dict:
    return {s["key"]: s for s in (run or {}).get("sets", [])}.get(key, {})


def _run(run: dict | None, key: str) -> dict:
    if not run:
        return {"status": "not run"}
    if run.get("status") == "skipped":
        return {"status": "skipped", "note": run.get("note")}
    s = _set(run, key)
    meta = run["_meta"]
    start, both = fnum(meta, "worker_start"), fnum(meta, "box_ready")
    return {"name": run.get("name"), "label": run.get("label"), "status": run.get("status"), "error": run.get("error"), "warmup_s": run.get("warmup_s"),
            "warmup_both_s": r(both - start, 2) if start and both else None, "jobs": s.get("jobs"), "images": s.get("images"),
            "tally": s.get("tally"), "wall_s": s.get("wall_s"), "images_per_s": s.get("images_per_s"),
            "images_per_s_steady": s.get("images_per_s_steady"), "stage_ms_median": s.get("stage_ms_median"),
            "set_note": s.get("note"), "worker_exit": meta.get("worker_exit"),
            "warnings": [w for w in run.get("warnings", []) if "appears in graph inputs" not in w][:8]}


def speed(one: dict | None, two: dict | None) -> dict:
    out = {"one": _run(one, "a"), "two": _run(two, "a")}
    if one and one.get("status") != "skipped":
        out["one"]["busy"] = busy(one["_dir"], "a")
    if two and two.get("status") != "skipped":
        out["two"].update(per_gpu=per_gpu(two["_dir"]), busy=busy(two["_dir"], "a"), restarts=restarts(two["_dir"], "set-a"),
                          gpus=two["_meta"].get("gpus"))
    for figure in ("images_per_s", "images_per_s_steady"):
        a, b = out["one"].get(figure), out["two"].get(figure)
        out[f"ratio{figure[len('images_per_s'):]}"] = r(b / a, 3) if a and b else None
    out["target"] = TARGET
    out["meets_target"] = out["ratio"] >= TARGET if out["ratio"] is not None else None
    return out


def mixed(run: dict | None) -> dict:
    out = _run(run, "m")
    if not run or run.get("status") == "skipped":
        return out
    run_dir, meta = run["_dir"], run["_meta"]
    counts = per_gpu(run_dir)
    rendered = sum(c["job_done"] for c in counts.values())
    out.update(per_gpu=counts, busy=busy(run_dir, "m"), restarts=restarts(run_dir, "set-m"), gpus=meta.get("gpus"),
               hogs={gpu: load_json(run_dir / name) for gpu, name in zip(GPUS, ("hog.json", "hog-gpu1.json"))},
               hog_errors={k: v for k, v in (("gpu0", meta.get("hog_error")), ("gpu1", meta.get("hog_gpu1_error"))) if v},
               simulated_others_used_mib=fnum(meta, "simulated_others_used_mib"),
               admission_ooms={gpu: c["oom"] for gpu, c in counts.items()},
               # Only a run that rendered something can say it had no out-of-memory.
               zero_admission_ooms=all(c["oom"] == 0 for c in counts.values()) if rendered else None,
               jobs_by_gpu={gpu: c["job_done"] for gpu, c in counts.items()})
    return out
