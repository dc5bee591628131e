"""Reads what deploy/gpu/fleet.sh left in a stage folder and writes the stage's JSON.

    python3 deploy/gpu/fleet_summary.py speed  RESULTS/fleet-speed  --out RESULTS/fleet-speed.json [--digest F]
    python3 deploy/gpu/fleet_summary.py budget RESULTS/fleet-budget --out RESULTS/budget.json [--digest F]
    python3 deploy/gpu/fleet_summary.py small  RESULTS/fleet-small  --out RESULTS/small.json [--digest F]
    python3 deploy/gpu/fleet_summary.py box    RESULTS/fleet-box    --out RESULTS/box.json [--digest F]
    python3 deploy/gpu/fleet_summary.py board  RESULTS/fleet-board  --out RESULTS/lora-board.json [--digest F]

The stage folder (fleet-lib.sh's header): meta.txt, runs.txt (run names in order), vram.csv, and a
folder per run with meta.txt, worker.log, jobs-KEY.jsonl, submit-KEY.txt, gpu-KEY.json, metrics.txt.

Per run: status (ok, incomplete, failed, skipped), error, warmup_s (process start to /readyz 200),
startup (load_s, resident_mib, the probe renders), peak_vram_gib (the worker's own NVML usage over
the run; device used minus the stage's baseline where NVML lists no processes), log counts
(out of memory, degrading in place, re-published one rung down, no room, job done, job failed),
the worker's jobs_total metrics by outcome, and its sets. Per set: jobs, images, wall_s (submit to
the last result), images_per_s (images / wall_s, only when every job has a result), images_per_s_steady
(images finished after the first finish / first to last finish, from the "job done" lines; a batch
of jobs finishing together counts as the first finish), busy_fraction (gpu_sampler.py over the
set), busy_backlog (the same from the first render's start to the last's, over busy_backlog_s)
and renders_in_flight over that window (one or more, two or more),
peak_vram_gib over the set, stage_ms_median (text, unet, vae, png, upload, render) and the
tally of `shotfleet submit --wait` (done, degraded, failed, and each job's status).

budget.json adds: check (the --check-budget lines, max |error|), mixed (hog, zero admission OOMs),
oom (each job's outcome, the OOM/degrade log lines, whether the same process kept serving).
small.json: cards, pair and long (small_summary.py). box.json: speed (one worker against the box's
two) and mixed (box_summary.py). lora-board.json: the runs, and per set the switches by source and
the sets placed (board_summary.py).
--digest writes a short text for a person (the call's $OUT). Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
from pathlib import Path

from gpu_sampler import busy_between  # beside this file

STAGE_FIELDS = ("text_ms", "unet_ms", "vae_ms", "png_ms", "upload_ms", "render_ms")
LOG_COUNTS = {
    "out of memory": "oom",
    "degrading in place": "degrading_in_place",
    "re-published one rung down": "republished_down",
    "no room for this job now; giving it back": "no_room",
    "job done": "job_done",
    "job failed": "job_failed",
    "observed peak": "observed_peak",
    "worker ready": "worker_ready",
}


def read_meta(path: Path) -> dict:
    meta = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            k, sep, v = line.partition("=")
            if sep:
                meta.setdefault(k, v)  # the first value wins (the first error is the cause)
    return meta


def fnum(meta: dict, key: str) -> float | None:
    try:
        return float(meta[key])
    except (KeyError, ValueError):
        return None


def ts(text) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def r(v, digits=3):
    return round(v, digits) if isinstance(v, (int, float)) else None


class WorkerLog:
    """The worker's JSON lines: records with t, level, message and fields."""

    def __init__(self, path: Path):
        self.records = []
        if not path.exists():
            return
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            fields = rec.get("fields", {})
            self.records.append({"t": ts(rec.get("timestamp")), "level": rec.get("level"),
                                 "message": fields.get("message", ""),
                                 "fields": {k: v for k, v in fields.items() if k != "message"}})

    def with_message(self, message: str) -> list[dict]:
        return [x for x in self.records if x["message"] == message]

    def counts(self) -> dict:
        out = {v: 0 for v in LOG_COUNTS.values()}
        for x in self.records:
            key = LOG_COUNTS.get(x["message"])
            if key:
                out[key] += 1
        return out

    def startup(self) -> dict:
        out = {}
        for x in self.records:
            f = x["fields"]
            if x["message"] == "models loaded":
                out.update(load_s=r(f.get("load_s"), 2), resident_mib=f.get("resident_mib"),
                           text_encoders_on_cpu=f.get("text_encoders_on_cpu"), vae_decoder=f.get("vae_decoder"),
                           unet_weights=f.get("unet_weights"))
            elif x["message"] == "worker ready":
                out.setdefault("worker_warmup_s", r(f.get("warmup_s"), 2))
            elif x["message"] == "budget":
                out["budget"] = {k: r(f.get(k), 1) for k in ("total_mib", "used_mib", "resident_mib", "budget_mib")}
            elif x["message"] == "one image of the class at its largest":
                out.setdefault("class_plan_mib", {})[str(f.get("class"))] = f.get("planned_mib")
            elif x["message"] == "probe render":
                out.setdefault("probe_renders", []).append(
                    {k: f.get(k) for k in ("width", "height", "images")} | {"peak_mib": r(f.get("peak_mib"), 1)}
                    | ({"first_render_mib": r(f["first_render_mib"], 1)} if f.get("first_render_mib") is not None else {}))
        return out

    def problems(self, limit: int = 20) -> list[str]:
        out = []
        for x in self.records:
            if x["level"] in ("WARN", "ERROR"):
                text = f"{x['level']}: {x['message']} {json.dumps(x['fields'])}"
                out.append(" ".join(text.split())[:400])
        return out[:limit]

    def lines(self, message: str, keys: tuple) -> list[dict]:
        return [{k: x["fields"].get(k) for k in keys if k in x["fields"]} for x in self.with_message(message)]


class Vram:
    """NVML memory over the stage: t, device used, the current worker's own, all processes (MiB),
    from every file given (a stage spanning calls keeps one per call)."""

    def __init__(self, paths: list[Path], baseline: float | None):
        self.rows = []
        self.baseline = baseline
        for path in paths:
            for line in path.read_text().splitlines()[1:]:
                try:
                    self.rows.append(tuple(float(x) for x in line.split(",")))
                except ValueError:
                    pass

    def peak(self, t0: float | None, t1: float | None) -> dict:
        rows = [x for x in self.rows if (t0 is None or x[0] >= t0) and (t1 is None or x[0] <= t1)]
        if not rows:
            return {}
        dev, own, procs = (max(x[i] for x in rows) for i in (1, 2, 3))
        out = {"nvml_used_peak_gib": round(dev / 1024, 2)}
        if own > 0:
            out.update(peak_vram_gib=round(own / 1024, 2), peak_vram_source="NVML, the worker's process")
        elif procs > 0:
            out.update(peak_vram_gib=round(procs / 1024, 2), peak_vram_source="NVML, all compute processes")
        elif self.baseline is not None:
            out.update(peak_vram_gib=round((dev - self.baseline) / 1024, 2),
                       peak_vram_source=f"NVML device used minus {self.baseline:.0f} MiB before the stage")
        return out


SUBMIT_ROW = re.compile(r"^(\S+)\s+(\S+)\s+(p[0-2])\s+(done|degraded|failed|unknown)\s+(\S+)\s+(\S+)\s*(.*)$")
# `submit --wait`'s last line; ", N cancelled" since cancelling exists.
TALLY = re.compile(r"^(\d+) done, (\d+) degraded, (\d+) failed(?:, (\d+) cancelled)?$")


def read_submit(path: Path) -> dict:
    """`shotfleet submit --wait`'s table: per job status and detail, and the tally line."""
    out = {"jobs": {}}
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        line = line.rstrip()
        m = TALLY.match(line)
        if m:
            out["tally"] = {"done": int(m[1]), "degraded": int(m[2]), "failed": int(m[3]), "cancelled": int(m[4] or 0)}
            continue
        m = SUBMIT_ROW.match(line)
        if m and m[1] != "job":
            out["jobs"][m[1]] = {"status": m[4], "images": m[5], "render_s": m[6], "detail": m[7][:300]}
        elif line.startswith(("shotfleet:", "error", "Error")) or "gave up after" in line:
            out.setdefault("errors", []).append(line[:400])
    return out


def jobs_total(path: Path) -> dict:
    """The last scrape's shotfleet_jobs_total, summed by outcome."""
    if not path.exists():
        return {}
    last: dict = {}
    current: dict = {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("== "):
            if current:
                last = current
            current = {}
            continue
        m = re.match(r'^shotfleet_jobs_total\{(.*)\}\s+([0-9.e+]+)$', line)
        if m:
            outcome = re.search(r'outcome="([^"]+)"', m[1])
            key = outcome[1] if outcome else "?"
            current[key] = current.get(key, 0) + int(float(m[2]))
    return current or last


def set_summary(run_dir: Path, key: str, meta: dict, log: WorkerLog, vram: Vram) -> dict:
    jobs = []
    jobs_file = run_dir / f"jobs-{key}.jsonl"
    if jobs_file.exists():
        jobs = [json.loads(x) for x in jobs_file.read_text().splitlines() if x.strip()]
    out = {"key": key, "label": meta.get(f"set_{key}_label"), "jobs": len(jobs)}
    if jobs:
        out.update(images_per_job=jobs[0].get("images") if len({j.get("images") for j in jobs}) == 1 else None,
                   requested_images=sum(j.get("images", 1) for j in jobs),
                   size=f"{jobs[0]['width']}x{jobs[0]['height']}" if len({(j["width"], j["height"]) for j in jobs}) == 1 else "mixed",
                   steps=jobs[0].get("steps"))
    if meta.get(f"set_{key}_skipped"):
        out.update(status="skipped", note=meta[f"set_{key}_skipped"])
        return out
    ids = {j["job_id"] for j in jobs}
    t_sub, t_end = fnum(meta, f"set_{key}_submit"), fnum(meta, f"set_{key}_end")
    rc = meta.get(f"set_{key}_rc")
    done = sorted((x for x in log.with_message("job done") if x["fields"].get("job") in ids and x["t"]),
                  key=lambda x: x["t"])
    images = sum(int(x["fields"].get("images") or 0) for x in done)
    submit = read_submit(run_dir / f"submit-{key}.txt")
    out.update(jobs_done_lines=len(done), images=images, submit_rc=int(rc) if rc not in (None, "") else None,
               tally=submit.get("tally"), timeout_s=fnum(meta, f"set_{key}_timeout_s"))
    if t_sub and t_end:
        out["wall_s"] = r(t_end - t_sub)
        if done and len(done) == len(ids) and rc == "0":
            out["images_per_s"] = r(images / (t_end - t_sub), 4)
    if done:
        first = done[0]["t"]
        later = [x for x in done if x["t"] > first + 0.05]
        if later and later[-1]["t"] > first:
            out["images_per_s_steady"] = r(sum(int(x["fields"].get("images") or 0) for x in later) / (later[-1]["t"] - first), 4)
        if t_sub:
            out["first_result_s"] = r(first - t_sub)
        medians = {}
        for f in STAGE_FIELDS:
            vals = [x["fields"][f] for x in done if isinstance(x["fields"].get(f), (int, float))]
            if vals:
                medians[f] = r(statistics.median(vals), 1)
        out["stage_ms_median"] = medians
    out.update(vram.peak(t_sub, t_end))
    gpu = load_json(run_dir / f"gpu-{key}.json")
    if gpu:
        out["busy_fraction"] = r(gpu.get("busy_fraction"), 4)
        out["gpu_samples"] = gpu.get("samples")
        spans = render_spans(log, done)
        window = backlog_window(spans)
        backlog = busy_between(gpu, *window) if window else None
        if backlog:
            out["busy_backlog"] = backlog["busy_fraction"]
            out["busy_backlog_s"] = r(window[1] - window[0], 1)
        if window:
            out["renders_in_flight"] = renders_in_flight(spans, window)
        if gpu.get("error") and not gpu.get("samples"):
            out["gpu_sampler_error"] = gpu["error"]
    if len(submit["jobs"]) <= 20:  # the mixed run's 200 are in submit-KEY.txt; its tally is above
        out["outcomes"] = {j: v["status"] for j, v in submit["jobs"].items()}
    bad = {j: v["detail"] for j, v in submit["jobs"].items() if v["status"] not in ("done",)}
    if bad:
        out["not_done"] = dict(list(bad.items())[:20])
    if submit.get("errors"):
        out["submit_errors"] = submit["errors"][:5]
    complete = "images_per_s" in out
    out["status"] = "ok" if complete else "incomplete"
    notes = []
    if rc not in (None, "0"):
        notes.append(f"submit exit {rc}")
    if len(done) < len(ids):
        notes.append(f"{len(ids) - len(done)} of {len(ids)} jobs without a 'job done' line")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def render_spans(log: "WorkerLog", done: list[dict]) -> list[tuple[float, float]]:
    """Each render of a set once, as (start, end). A group's from its `rendered a group` line,
    logged as the render ends, less its elapsed_ms; a job rendered alone from its `job done`
    line less its PNG, upload and render times (that line comes after the upload and the
    commit). A `job done` line whose render_ms is a group's elapsed_ms is that group's member
    (they share it), not a render of its own."""
    timed = [x for x in done if isinstance(x["fields"].get("render_ms"), (int, float))]
    if not timed:
        return []
    first = min(x["t"] - x["fields"]["render_ms"] / 1000 for x in timed) - 1.0
    last = max(x["t"] for x in timed)
    groups = [g for g in log.with_message("rendered a group")
              if g["t"] and first <= g["t"] <= last and isinstance(g["fields"].get("elapsed_ms"), (int, float))]
    spans = [(g["t"] - g["fields"]["elapsed_ms"] / 1000, g["t"]) for g in groups]
    grouped = {g["fields"]["elapsed_ms"] for g in groups}
    for x in timed:
        f = x["fields"]
        if f["render_ms"] in grouped:
            continue
        end = x["t"] - (float(f.get("png_ms") or 0) + float(f.get("upload_ms") or 0)) / 1000
        spans.append((end - f["render_ms"] / 1000, end))
    return sorted(spans)


def backlog_window(spans: list[tuple[float, float]]) -> tuple[float, float] | None:
    """From the first render's start to the last's: while jobs are still to be taken, the
    window where an idle card is a gap to close, not the start-up or the tail."""
    starts = [start for start, _ in spans]
    return (min(starts), max(starts)) if len(starts) > 1 and max(starts) > min(starts) else None


def renders_in_flight(spans: list[tuple[float, float]], window: tuple[float, float]) -> dict:
    """Over the backlog window, the share of time with at least one render running and with
    two or more. Against NVML's busy fraction it tells a card left idle between renders (the
    fleet's gap) from one idle inside them (the pipeline's)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    t0, t1 = window
    running, last, shares = 0, t0, {1: 0.0, 2: 0.0}
    for t, step in edges:
        t = min(max(t, t0), t1)
        for n in shares:
            if running >= n:
                shares[n] += t - last
        running, last = running + step, t
    length = t1 - t0
    return {"one_or_more": r(shares[1] / length, 4), "two_or_more": r(shares[2] / length, 4), "renders": len(spans)}


def busy_cell(row: dict) -> str:
    """A report's GPU busy cell: over the set (or run), and over its backlog where measured."""
    pct = lambda v: f"{v * 100:.0f}%" if isinstance(v, (int, float)) else "-"  # noqa: E731
    backlog = row.get("busy_backlog")
    return pct(row.get("busy_fraction")) + (f" / {pct(backlog)}" if isinstance(backlog, (int, float)) else "")


def top_keys(meta: dict) -> dict:
    out = {"concurrency": 1, "batch_jobs": 1}
    for part in (meta.get("top") or "").split(";"):
        k, _, v = part.partition("=")
        if k.strip():
            try:
                out[k.strip()] = int(v.strip())
            except ValueError:
                out[k.strip()] = v.strip()
    return out


def cuda_table(meta: dict) -> dict | None:
    text = meta.get("cuda") or ""
    out = {}
    for part in text.split(";"):
        k, sep, v = part.partition("=")
        if sep:
            v = v.strip().strip('"')
            out[k.strip()] = {"true": True, "false": False}.get(v, v)
    return out or None


def run_summary(run_dir: Path, vram: Vram, device: str | None) -> dict:
    meta = read_meta(run_dir / "meta.txt")
    if (run_dir / "vram.csv").exists():
        # A run beside others (fleet-small.sh, SMALL_PARALLEL) sampled its own worker.
        vram = Vram([run_dir / "vram.csv"], vram.baseline)
    out = {"name": run_dir.name, "label": meta.get("label")}
    if meta.get("skipped"):
        out.update(status="skipped", note=meta["skipped"])
        return out
    log = WorkerLog(run_dir / "worker.log")
    out.update(top_keys(meta))
    out["cuda"] = cuda_table(meta) if device == "cuda" else None
    if device != "cuda" and meta.get("cuda"):
        out["note"] = "CPU dry run: the [cuda] table was left out"
    start, ready = fnum(meta, "worker_start"), fnum(meta, "worker_ready")
    out["warmup_s"] = r(ready - start, 2) if start and ready else None
    out["startup"] = log.startup()
    out["log_counts"] = log.counts()
    out["jobs_total"] = jobs_total(run_dir / "metrics.txt")
    out["worker_pid"] = meta.get("worker_pid")
    out["worker_exit"] = meta.get("worker_exit")
    run_end = fnum(meta, "worker_stop_begin") or fnum(meta, "run_end")
    out.update(vram.peak(start, run_end))
    warm = vram.peak(start, ready)
    if warm.get("peak_vram_gib") is not None:
        out["warmup_peak_vram_gib"] = warm["peak_vram_gib"]
    keys = [k[len("set_"):-len("_label")] for k in meta if k.startswith("set_") and k.endswith("_label")]
    keys += [k[len("set_"):-len("_skipped")] for k in meta if k.startswith("set_") and k.endswith("_skipped")
             and k[len("set_"):-len("_skipped")] not in keys]
    out["sets"] = [set_summary(run_dir, k, meta, log, vram) for k in keys]
    peaks = log.with_message("observed peak")
    if peaks:
        errs = [abs(x["fields"]["error"]) for x in peaks if isinstance(x["fields"].get("error"), (int, float))]
        out["observed_peaks"] = {"count": len(peaks), "max_abs_error": r(max(errs), 4) if errs else None}
    out["warnings"] = log.problems()
    if meta.get("error"):
        out["error"] = meta["error"][:1200]
    if meta.get("error") and not any(s.get("status") == "ok" for s in out["sets"]):
        out["status"] = "failed"
    elif out["sets"] and all(s.get("status") == "ok" for s in out["sets"]):
        out["status"] = "ok"
    else:
        out["status"] = "incomplete"
    out["_meta"], out["_log"], out["_dir"] = meta, log, run_dir
    return out


def public(run: dict) -> dict:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def check_summary(run_dir: Path, vram: Vram) -> dict:
    meta = read_meta(run_dir / "meta.txt")
    out = {"label": meta.get("label"), "shapes": meta.get("shapes")}
    if meta.get("skipped"):
        return out | {"status": "skipped", "note": meta["skipped"]}
    rows, summary, junk = [], None, 0
    path = run_dir / "budget-check.jsonl"
    for line in (path.read_text(errors="replace").splitlines() if path.exists() else []):
        try:
            rec = json.loads(line)
        except ValueError:
            junk += 1
            continue
        if isinstance(rec, dict) and "summary" in rec:
            summary = rec["summary"]
        elif isinstance(rec, dict) and "width" in rec:
            pred, obs = rec.get("predicted_mib"), rec.get("observed_mib")
            if isinstance(pred, (int, float)) and isinstance(obs, (int, float)) and obs > 0:
                rec["pred_over_obs"] = round(pred / obs, 4)
            rows.append(rec)
    errors = [abs(x["error"]) for x in rows if isinstance(x.get("error"), (int, float))]
    code = meta.get("exit_code")
    start, end = fnum(meta, "worker_start"), fnum(meta, "run_end")
    out.update(exit_code=int(code) if code not in (None, "") else None, rows=rows, summary=summary,
               max_abs_error=r(max(errors), 4) if errors else None,
               under_predicted=[f"{x['width']}x{x['height']}x{x['images']}" for x in rows
                                if isinstance(x.get("pred_over_obs"), float) and x["pred_over_obs"] < 1],
               seconds=r(end - start, 1) if start and end else None, non_json_lines=junk)
    out.update(vram.peak(start, end))
    log = WorkerLog(run_dir / "worker.log")
    out["startup"] = log.startup()
    if meta.get("error"):
        out["error"] = meta["error"][:1200]
    out["status"] = "ok" if code == "0" and rows and summary is not None else ("failed" if not rows else "partial")
    return out


# The fields of the worker's "out of memory" line, as the digests print them.
OOM_FIELDS = ("job", "batch", "vae", "attempt", "planned_now", "detail")


def mixed_summary(run: dict) -> dict:
    if run.get("status") == "skipped":
        return public(run)
    meta, log = run["_meta"], run["_log"]
    out = public(run)
    out["hog"] = load_json(run["_dir"] / "hog.json")
    if meta.get("hog_error"):
        out["hog_error"] = meta["hog_error"]
    out["simulated_others_used_mib"] = fnum(meta, "simulated_others_used_mib")
    counts = run["log_counts"]
    # Only a run that rendered something can say it had no out-of-memory.
    out["zero_admission_ooms"] = counts["oom"] == 0 if counts["job_done"] else None
    out["oom_lines"] = log.lines("out of memory", OOM_FIELDS)[:20]
    out["no_room_lines"] = counts["no_room"]
    return out


def oom_summary(run: dict) -> dict:
    if run.get("status") == "skipped":
        return public(run)
    meta, log = run["_meta"], run["_log"]
    out = public(run)
    out["arena_limit_mib"] = fnum(meta, "arena_limit_mib")
    out["cpu_arena_max_mib"] = fnum(meta, "cpu_arena_max_mib")
    out["oom_lines"] = log.lines("out of memory", OOM_FIELDS)[:30]
    out["degrading_lines"] = log.lines("degrading in place", ("job", "batch", "vae"))
    out["republished_lines"] = log.lines("re-published one rung down", ("job", "level", "width", "height", "steps", "to"))
    out["failed_lines"] = log.lines("job failed", ("job", "reason", "detail"))
    sets = {s["key"]: s for s in run.get("sets", [])}
    out["big_job"] = sets.get("big", {}).get("outcomes")
    out["small_jobs"] = sets.get("small", {}).get("outcomes")
    out["pid_before"], out["pid_after"] = meta.get("pid_before"), meta.get("pid_after")
    out["alive_after"] = meta.get("alive_after") == "yes"
    small = out["small_jobs"] or {}
    out["kept_serving"] = bool(out["alive_after"] and len(small) == 3
                               and all(v in ("done", "degraded") for v in small.values())
                               and run["log_counts"]["worker_ready"] == 1)
    return out


def digest(doc: dict) -> str:
    lines = [f"fleet {doc['stage']}: device {doc.get('device')}, {doc.get('seconds')} s, error {doc.get('error')}"]

    def set_line(s):
        med = s.get("stage_ms_median") or {}
        return (f"  set {s.get('key')} {s.get('label')}: {s.get('status')}, {s.get('images')} images, wall {s.get('wall_s')} s, "
                f"{s.get('images_per_s')} img/s (steady {s.get('images_per_s_steady')}), busy {s.get('busy_fraction')}, "
                f"peak {s.get('peak_vram_gib')} GiB, tally {s.get('tally')}, medians {med} {s.get('note') or ''}")

    # The box stage's mixed is box_summary's, not a run's: it is printed below.
    for run in doc.get("runs", []) + [doc.get(k) for k in ("mixed", "oom") if doc.get(k) and "sets" in doc[k]]:
        lines.append(f"run {run.get('name')} ({run.get('label')}): {run.get('status')}, warm-up {run.get('warmup_s')} s, "
                     f"peak {run.get('peak_vram_gib')} GiB, log {run.get('log_counts')}, jobs_total {run.get('jobs_total')}")
        if run.get("error") or run.get("note"):
            lines.append(f"  error/note: {run.get('error') or run.get('note')}")
        lines += [set_line(s) for s in run.get("sets", [])]
        for key in ("hog", "zero_admission_ooms", "big_job", "small_jobs", "alive_after", "kept_serving",
                    "oom_lines", "degrading_lines", "republished_lines", "failed_lines"):
            if key in run:
                lines.append(f"  {key}: {json.dumps(run[key])[:1500]}")
        lines += [f"  {w}" for w in run.get("warnings", [])[:8]]
    for name, check in doc.items():
        if not name.startswith("check") or not isinstance(check, dict):
            continue
        lines.append(f"{name}: {check.get('status')}, exit {check.get('exit_code')}, max |error| {check.get('max_abs_error')}, "
                     f"{check.get('seconds')} s, summary {json.dumps(check.get('summary'))[:400]}")
        for x in check.get("rows", []):
            lines.append(f"  {x.get('width')}x{x.get('height')}x{x.get('images')}: predicted {x.get('predicted_mib')} "
                         f"observed {x.get('observed_mib')} error {x.get('error')} second cold {x.get('observed_again_mib')} first {x.get('first_ms')} ms "
                         f"again {x.get('again_ms')} ms (vae {x.get('again_vae_ms')}) arenas {json.dumps(x.get('arenas_mib'))}")
        if check.get("error"):
            lines.append(f"  error: {check['error']}")
    for card in doc.get("cards", []):
        lines.append(f"card {card.get('max_mib')} MiB: {json.dumps({k: v for k, v in card.items() if k != 'warnings'})[:2500]}")
    for key in ("pair", "long", "speed", "mixed"):
        if doc.get(key) and "sets" not in doc[key]:
            lines.append(f"{key}: {json.dumps(doc[key], default=str)[:4000]}")
    for board in doc.get("lora", []):
        lines.append(f"lora {board.get('name')}: {json.dumps(board)[:3000]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=("speed", "budget", "small", "box", "board", "storyboard"))
    ap.add_argument("dir", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--digest", type=Path, default=None)
    args = ap.parse_args()
    meta = read_meta(args.dir / "meta.txt")
    vram = Vram(sorted(args.dir.glob("vram*.csv")), fnum(meta, "vram_baseline_mib"))
    names = []
    if (args.dir / "runs.txt").exists():
        # A run done again in a later call (the small stage keeps its folder) is listed once.
        names = list(dict.fromkeys(n for n in (args.dir / "runs.txt").read_text().split() if n))
    doc = {"stage": f"fleet-{args.stage}", "device": meta.get("device"), "model": meta.get("model"),
           "deadline_s": fnum(meta, "deadline_s"), "seconds": fnum(meta, "seconds"),
           "vram_baseline_mib": fnum(meta, "vram_baseline_mib")}
    if args.stage == "speed":
        doc.update(size=int(meta.get("size") or 0), steps=int(meta.get("steps") or 0), guidance=5.0)
        doc["runs"] = [public(run_summary(args.dir / n, vram, meta.get("device"))) for n in names]
    elif args.stage == "board":
        import board_summary  # noqa: PLC0415 - it reads this module's run summaries

        runs = [run_summary(args.dir / n, vram, meta.get("device")) for n in names]
        doc.update(lora_bytes=fnum(meta, "board_lora_bytes"), loras_written_s=fnum(meta, "board_loras_s"))
        doc["runs"] = [public(run) for run in runs]
        doc["lora"] = [board_summary.lora(run) for run in runs if run.get("status") != "skipped"]
    elif args.stage == "small":
        import small_summary  # noqa: PLC0415 - it imports this module's readers

        runs = {n: run_summary(args.dir / n, vram, meta.get("device")) for n in names}
        doc["cards"] = [small_summary.card(run) for n, run in runs.items() if n.startswith("card-")]
        if "pair" in runs:
            doc["pair"] = small_summary.pair(runs["pair"])
        halves = [run for n, run in runs.items() if n.startswith("long-") and run.get("status") != "skipped"]
        if halves:
            doc["long"] = small_summary.long(halves)
    elif args.stage == "storyboard":
        import storyboard_summary  # noqa: PLC0415 - it imports this module's readers

        runs = {n: run_summary(args.dir / n, vram, meta.get("device")) for n in names}
        for key, _ in storyboard_summary.FLEET_RUNS:
            name = key.replace("_", "-")
            if name in runs:
                doc[key] = storyboard_summary.fleet(runs[name])
    elif args.stage == "box":
        import box_summary  # noqa: PLC0415 - it imports this module's readers

        runs = {n: run_summary(args.dir / n, vram, meta.get("device")) for n in names}
        doc["speed"] = box_summary.speed(runs.get("one"), runs.get("two"))
        if "mixed" in runs:
            doc["mixed"] = box_summary.mixed(runs["mixed"])
    else:
        for n in names:
            if n.startswith("check"):
                doc[n] = check_summary(args.dir / n, vram)
                continue
            run = run_summary(args.dir / n, vram, meta.get("device"))
            doc[n] = mixed_summary(run) if n == "mixed" else oom_summary(run) if n == "oom" else public(run)
    if meta.get("error") or meta.get("rc"):
        doc["error"] = meta.get("error") or f"fleet.sh exited {meta.get('rc')}"
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    text = digest(doc)
    print(text, end="")
    if args.digest:
        args.digest.write_text(text)


if __name__ == "__main__":
    main()
