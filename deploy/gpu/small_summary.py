"""The small-card stage's figures (deploy/gpu/fleet-small.sh), for fleet_summary.py's small.json.

    card(run)            a worker on a share of the card: whether it started (exit 78: holds nothing),
                         its probes and classes, done / degraded by rung / failed, images/s, the jobs
                         left for a roomier worker, admission OOMs, crashes
    pair(run)            two workers on one card: who rendered what, every job the small one gave back
                         (no room, out of memory) and who rendered it, degrades the big one could have held
    long(runs)           the 1,000-job run (its halves merged): predicted against observed peak per shape,
                         live, from the worker's `observed peak` lines

Each takes fleet_summary.run_summary's dict (with its private _meta, _log and _dir). Standard library only.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from fleet_summary import WorkerLog, read_meta, read_submit
from storyboards import memory_class

# |predicted - observed| / predicted allowed per shape (issue 19, point 5).
WITHIN = 0.10
# `[budget] safety` of the runs (the default): a line's planned_mib is the prediction times 1 + this.
SAFETY = 0.10


def _jobs(path: Path) -> dict:
    if not path.exists():
        return {}
    return {j["job_id"]: j for j in (json.loads(x) for x in path.read_text().splitlines() if x.strip())}


def _field(rec: dict, key: str):
    return rec["fields"].get(key)


def probes(log) -> list[dict]:
    """The probes in start-up order, each with what became of it."""
    outcome = {"probe render": "measured", "probe skipped: over the room": "over_room",
               "probe skipped: past a probe that ran out of memory": "over_ceiling",
               "probe ran out of memory: this card's ceiling for the shape": "out_of_memory"}
    out = []
    for x in log.records:
        if x["message"] in outcome:
            f = x["fields"]
            row = {"shape": f"{f.get('width')}x{f.get('height')}x{f.get('images')}", "outcome": outcome[x["message"]]}
            for key in ("peak_mib", "first_render_mib", "planned_mib", "room_mib", "ceiling"):
                if key in f:
                    row[key] = f[key]
            out.append(row)
    return out


def classes(log) -> dict:
    """Each class the worker reported at start: its reason and the line /readyz showed."""
    return {_field(x, "class"): {"reason": _field(x, "reason"), "detail": _field(x, "detail")}
            for x in log.records if x["message"] in ("class served", "class not served")}


def rungs(logs: list, tally_jobs: dict) -> dict:
    """Jobs by how they ended: done whole, done with in-place rungs (batch split, tiled VAE),
    degraded by level (re-published one rung down), failed by reason."""
    in_place: dict[str, str] = {}
    levels: dict[str, int] = {}
    for log in logs:
        for x in log.with_message("degrading in place"):
            job, vae = _field(x, "job"), str(_field(x, "vae") or "")
            in_place[job] = "tiled_vae" if "Tiled" in vae or in_place.get(job) == "tiled_vae" else "batch_split"
        for x in log.with_message("re-published one rung down"):
            levels[_field(x, "job")] = max(levels.get(_field(x, "job"), 0), int(_field(x, "level") or 1))
    out = collections.Counter()
    for job, row in tally_jobs.items():
        status = row["status"]
        if status == "done":
            out[f"done_{in_place[job]}" if job in in_place else "done_whole"] += 1
        elif status == "degraded":
            out[f"degraded_level_{levels.get(job, '?')}"] += 1
        elif status == "failed":
            out[f"failed_{row['detail'].split(':')[0] or '?'}"] += 1
        else:
            out[status] += 1
    return dict(sorted(out.items()))


def card(run: dict) -> dict:
    meta, log, run_dir = run["_meta"], run["_log"], run["_dir"]
    out = {"name": run["name"], "max_mib": meta.get("max_mib"), "status": run.get("status"), "warmup_s": run.get("warmup_s")}
    if run.get("status") == "skipped":
        return out | {"note": run.get("note")}
    exit_code = meta.get("worker_exit")
    out["holds_nothing"] = exit_code == "78"
    out["started"] = meta.get("worker_ready") is not None
    startup = run.get("startup") or {}
    for key in ("resident_mib", "text_encoders_on_cpu", "vae_decoder", "unet_weights"):
        out[key] = startup.get(key)
    out["probes"] = probes(log)
    out["classes"] = classes(log)
    out["served"] = [c for c in (meta.get("served") or "").split(",") if c]
    if run.get("error"):
        out["error"] = run["error"]
    sets = {s["key"]: s for s in run.get("sets", [])}
    m = sets.get("m", {})
    tally_jobs = read_submit(run_dir / "submit-m.txt")["jobs"]
    # Jobs of classes the card does not hold: before, they were submitted apart and left queued
    # (jobs-rest.jsonl); now every job is awaited and those end down the degrade ladder.
    rest = _jobs(run_dir / "jobs-rest.jsonl")
    unheld = collections.Counter(memory_class(j["width"], j["height"]) for j in _jobs(run_dir / "jobs-m.jsonl").values()
                                 if memory_class(j["width"], j["height"]) not in out["served"])
    out.update(
        jobs_served_classes=m.get("jobs", 0), tally=m.get("tally"), ended=rungs([log], tally_jobs),
        images=m.get("images"), images_per_s=m.get("images_per_s"), images_per_s_steady=m.get("images_per_s_steady"),
        wall_s=m.get("wall_s"), stage_ms_median=m.get("stage_ms_median"), left_for_a_roomier_worker=dict(collections.Counter(memory_class(j["width"], j["height"]) for j in rest.values())),
        jobs_of_classes_not_held=dict(sorted(unheld.items())), parallel=meta.get("parallel"),
        admission_ooms=run["log_counts"]["oom"] if out["started"] else None, no_room=run["log_counts"]["no_room"],
        peak_vram_gib=run.get("peak_vram_gib"), worker_exit=exit_code,
        # Stopped by fleet.sh (0) or never ready (78 is a refusal, not a crash); anything else is one.
        crashed=exit_code not in (None, "", "0", "78"),
        set_note=m.get("note"), warnings=run.get("warnings", [])[:8])
    return out


def pair(run: dict) -> dict:
    meta, big_log, run_dir = run["_meta"], run["_log"], run["_dir"]
    out = {"name": "pair", "status": run.get("status"), "card_total_mib": meta.get("card_total_mib"),
           "big_max_mib": meta.get("big_max_mib"), "small_holds_nothing_at_mib": meta.get("small_holds_nothing_at_mib")}
    if run.get("status") == "skipped":
        return out | {"note": run.get("note")}
    small_meta = read_meta(run_dir / "small" / "meta.txt")
    small_log = WorkerLog(run_dir / "small" / "worker.log")
    out.update(small_max_mib=small_meta.get("max_mib"), small_exit=small_meta.get("worker_exit"), big_exit=meta.get("worker_exit"),
               served_small=[c for c in (meta.get("served_small") or "").split(",") if c],
               served_big=[c for c in (meta.get("served_big") or "").split(",") if c],
               small_classes=classes(small_log), big_classes=classes(big_log))
    if run.get("error"):
        out["error"] = run["error"]
    jobs = _jobs(run_dir / "jobs-m.jsonl")
    logs = {"small": small_log, "big": big_log}
    rendered_by: dict[str, list[str]] = collections.defaultdict(list)
    for who, log in logs.items():
        for x in log.with_message("job done"):
            rendered_by[_field(x, "job")].append(who)
    republished = {}
    for who, log in logs.items():
        for x in log.with_message("re-published one rung down"):
            republished.setdefault(_field(x, "job"), []).append({"by": who, "level": _field(x, "level")})
    given_back: dict[str, set] = collections.defaultdict(set)
    for message, why in (("no room for this job now; giving it back", "no_room"), ("out of memory", "out_of_memory")):
        for x in small_log.with_message(message):
            given_back[_field(x, "job")].add(why)
    tally_jobs = read_submit(run_dir / "submit-m.txt")["jobs"]
    out["given_back_by_small"] = [
        {"job": job, "why": sorted(whys), "class": memory_class(jobs[job]["width"], jobs[job]["height"]) if job in jobs else None,
         "rendered_by": rendered_by.get(job), "status": tally_jobs.get(job, {}).get("status"), "republished": republished.get(job)}
        for job, whys in sorted(given_back.items())]
    out["given_back_rendered_by_big_whole"] = sum(
        1 for g in out["given_back_by_small"] if g["rendered_by"] == ["big"] and g["status"] == "done")
    out["degraded_while_big_held_the_class"] = [
        {"job": job, "class": memory_class(jobs[job]["width"], jobs[job]["height"]), "by": r}
        for job, r in republished.items() if job in jobs and memory_class(jobs[job]["width"], jobs[job]["height"]) in out["served_big"]]
    m = {s["key"]: s for s in run.get("sets", [])}.get("m", {})
    tally = m.get("tally") or {}
    # Both workers' renders: the set's own figure counts the big one's log only.
    finished = tally.get("done", 0) + tally.get("degraded", 0)
    images = sum(j.get("images", 1) for j in jobs.values())
    images_per_s = round(images / m["wall_s"], 4) if jobs and finished == len(jobs) and m.get("wall_s") else None
    out.update(tally=m.get("tally"), images=images, images_per_s=images_per_s, wall_s=m.get("wall_s"),
               jobs_by_worker={who: sum(1 for v in rendered_by.values() if who in v) for who in logs},
               admission_ooms={who: len(log.with_message("out of memory")) for who, log in logs.items()},
               ended=rungs(list(logs.values()), tally_jobs), set_note=m.get("note"))
    return out


# A rise of the floor this large across one render is a step worth naming (RESULTS.md: the floor steps of 2026-12-02).
FLOOR_STEP_MIB = 256


def floor_steps(peaks: list[dict]) -> list[dict]:
    """Where the floor (what the process keeps outside its arenas) rose by FLOOR_STEP_MIB or more
    across one render, and whether that render ran on a thread no earlier render had: ONNX
    Runtime's CUDA provider makes a context of its own for each calling thread."""
    steps, seen = [], set()
    for f in peaks:
        before, after = f.get("held_at_start_mib") or 0, f.get("floor_mib") or 0
        thread = f.get("thread")
        if after - before >= FLOOR_STEP_MIB:
            steps.append({"job": f.get("job"), "from_mib": before, "to_mib": after,
                          "new_thread": None if thread is None else thread not in seen})
        if thread is not None:
            seen.add(thread)
    return steps


def long(runs: list[dict]) -> dict:
    """The halves of the 1,000-job run, merged: per shape, every observed peak against the need
    predicted for it at that moment, (observed - predicted) / predicted: the line's `error` where
    the worker judged the render cold (and learned from it), else from its planned_mib (the
    prediction plus SAFETY). The run has `cold_renders` on, so every render starts from arenas
    given back; what a GPU process keeps outside them (CUDA and cuDNN state) is in the probes'
    peaks too, measured from the same baseline, but can keep a small render from counting as cold."""
    shapes: dict[str, dict] = {}
    halves = []
    for run in runs:
        meta, log = run["_meta"], run["_log"]
        m = {s["key"]: s for s in run.get("sets", [])}.get("m", {})
        hog = None
        if (run["_dir"] / "hog.json").exists():
            hog = json.loads((run["_dir"] / "hog.json").read_text())
        peaks = [x["fields"] for x in log.with_message("observed peak")]
        halves.append({"name": run["name"], "status": run.get("status"), "slice": meta.get("slice"), "tally": m.get("tally"),
                       "threads": len({f["thread"] for f in peaks if f.get("thread")}) or None, "floor_steps": floor_steps(peaks),
                       "images": m.get("images"), "images_per_s": m.get("images_per_s"), "wall_s": m.get("wall_s"),
                       "admission_ooms": run["log_counts"]["oom"], "observed_peaks": run["log_counts"]["observed_peak"],
                       "hog": hog, "hog_error": meta.get("hog_error"), "share_mib": meta.get("share_mib"),
                       "waited_s": meta.get("waited_s"), "beside": meta.get("parallel"), "worker_exit": meta.get("worker_exit"),
                       "error": run.get("error"), "note": m.get("note") or run.get("note")})
        for f in peaks:
            key = f"{f.get('width')}x{f.get('height')}x{f.get('images')}"
            s = shapes.setdefault(key, {"shape": key, "renders": 0, "cold": 0, "first_error": None, "errors": [],
                                        "max_peak_over_planned": 0.0, "max_held_at_start_mib": 0})
            s["renders"] += 1
            s["max_held_at_start_mib"] = max(s["max_held_at_start_mib"], f.get("held_at_start_mib") or 0)
            s["max_floor_mib"] = max(s.get("max_floor_mib", 0), f.get("floor_mib") or 0)
            error = f.get("error") if isinstance(f.get("error"), (int, float)) else None
            if f.get("cold"):
                s["cold"] += 1
            # The need above the floor (what the process keeps outside its arenas) where the
            # worker logs it, else (before 2026-12-02) the peak above the models.
            need = f.get("need_mib", f.get("peak_mib")) or 0
            if f.get("planned_mib"):
                s["max_peak_over_planned"] = max(s["max_peak_over_planned"], need / f["planned_mib"])
                if error is None:
                    error = need / (f["planned_mib"] / (1 + SAFETY)) - 1
            if error is not None:
                s["errors"].append(error)
                if s["first_error"] is None:
                    s["first_error"] = error
    rows = []
    for s in sorted(shapes.values(), key=lambda s: [int(v) for v in s["shape"].split("x")]):
        errors = s.pop("errors")
        s["max_abs_error"] = round(max(map(abs, errors)), 4) if errors else None
        s["first_error"] = round(s["first_error"], 4) if s["first_error"] is not None else None
        s["max_peak_over_planned"] = round(s["max_peak_over_planned"], 4)
        s["within"] = s["max_abs_error"] is not None and s["max_abs_error"] <= WITHIN
        rows.append(s)
    return {"halves": halves, "shapes": rows,
            "shapes_within": f"{sum(s['within'] for s in rows)} of {len(rows)} shapes within ±{WITHIN:.0%}",
            "shapes_never_cold": [s["shape"] for s in rows if not s["cold"]],
            "admission_ooms": sum(h["admission_ooms"] for h in halves),
            "jobs": sum(sum((h["tally"] or {}).values()) for h in halves)}
