"""The storyboard stage's figures (deploy/gpu/fleet-storyboard.sh), for fleet_summary.py's
storyboard.json, beside bench_storyboard.py's diffusers modes (report.py puts them side by side).

    fleet(run)   images/s from the worker's spawn to the last image (the queue waited for it), in
                 steady state (after every size's first image), the seconds from the spawn to the
                 first image, per size the first job's render against the median of its later
                 ones, GPU busy over the set, and the VAE's time after a render of the same size
                 against one after another size (`vae_after_switch`: a size switch makes ONNX
                 Runtime's convolutions build their cuDNN plans again, deploy/gpu/RESULTS.md), and
                 how the jobs went into renders (`renders`: groups of jobs sharing UNet batches and
                 jobs alone; the worker's reserve, worker/reserve.rs, finds the groups)

Takes fleet_summary.run_summary's dict (with its private _meta, _log and _dir). Standard library only.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from fleet_summary import busy_cell, fnum, r
from storyboards import firsts_of_sizes


# fleet-storyboard.sh's runs: the summary's key and the report's name for each.
FLEET_RUNS = (
    ("storyboard", "shotfleet (cold worker)"),
    ("storyboard_stored", "shotfleet (cold worker, stored calibration)"),
    ("storyboard_unet2", "shotfleet (cold worker, a UNet session per slot)"),
    ("storyboard_c3", "shotfleet (cold worker, three slots, a UNet session each)"),
    ("storyboard_vae_heuristic", "shotfleet (cold worker, VAE heuristic search)"),  # against the exhaustive default, 2026-12-05
    ("storyboard_vae_exhaustive", "shotfleet (cold worker, VAE exhaustive search)"),
    ("storyboard_no_affinity", "shotfleet (stored calibration, no affinity)"),
    ("storyboard_no_lookahead", "shotfleet (stored calibration, no reserve)"),
)


def fleet(run: dict) -> dict:
    meta, log, run_dir = run["_meta"], run["_log"], run["_dir"]
    out = {"name": run["name"], "status": run.get("status"), "warmup_s": run.get("warmup_s"), "error": run.get("error")}
    if run.get("status") == "skipped":
        return out | {"note": run.get("note")}
    jobs_file = run_dir / "jobs-m.jsonl"
    jobs = {j["job_id"]: j for j in (json.loads(x) for x in jobs_file.read_text().splitlines() if x.strip())} if jobs_file.exists() else {}
    spawned = fnum(meta, "worker_start")
    done = sorted((x for x in log.with_message("job done") if x["fields"].get("job") in jobs and x["t"]), key=lambda x: x["t"])
    if not done or not spawned:
        return out | {"jobs": len(jobs), "done": len(done)}
    size = lambda x: "{width}x{height}".format(**jobs[x["fields"]["job"]])  # noqa: E731
    first, last_first = firsts_of_sizes([size(x) for x in done])
    seen = {s: done[k] for s, k in first.items()}
    images = sum(int(x["fields"].get("images") or 0) for x in done)
    end = done[-1]["t"]
    steady = done[last_first + 1:]
    steady_s = end - done[last_first]["t"]
    per_size = {}
    for s, first in seen.items():
        later = [x["fields"].get("render_ms") for x in done if size(x) == s and x is not first]
        per_size[s] = {"first_done_after_spawn_s": r(first["t"] - spawned, 2), "first_render_ms": first["fields"].get("render_ms"),
                       "later_render_ms_median": statistics.median(later) if later else None}
    sets = {s["key"]: s for s in run.get("sets", [])}
    m = sets.get("m", {})
    out.update(
        jobs=len(jobs), done=len(done), images=images,
        to_last_image_s=r(end - spawned, 2),
        images_per_s=r(images / (end - spawned), 4),
        steady_images=sum(int(x["fields"].get("images") or 0) for x in steady),
        images_per_s_steady=r(sum(int(x["fields"].get("images") or 0) for x in steady) / steady_s, 4) if steady and steady_s > 0 else None,
        first_image_after_spawn_s=r(done[0]["t"] - spawned, 2),
        per_size=per_size,
        busy_fraction=m.get("busy_fraction"), busy_backlog=m.get("busy_backlog"), renders_in_flight=m.get("renders_in_flight"), stage_ms_median=m.get("stage_ms_median"), tally=m.get("tally"),
        submit_rc=m.get("submit_rc"), vae_after_switch=vae_after_switch(done, size), renders=renders(log, len(done)))
    return out


def renders(log, jobs: int) -> dict:
    """How `jobs` jobs went into renders: the groups the worker logged ("rendered a group", each
    with its job count) and the jobs rendered alone."""
    groups = [int(x["fields"].get("jobs") or 0) for x in log.with_message("rendered a group")]
    alone = max(jobs - sum(groups), 0)
    count = len(groups) + alone
    return {"renders": count, "groups": len(groups), "jobs_in_groups": sum(groups), "alone": alone,
            "jobs_per_render": r(jobs / count, 2) if count else None}


def vae_after_switch(done: list[dict], size) -> dict:
    """The VAE's ms per render, median, after a render of the same size and after one of another
    size. Renders in the order their jobs finished; a group's jobs share one render (the same
    render and VAE times), counted once."""
    renders, seen = [], set()
    for x in done:
        f = x["fields"]
        key = (size(x), f.get("render_ms"), f.get("vae_ms"))
        if key not in seen:
            seen.add(key)
            renders.append(key)
    after_same: dict[bool, list] = {True: [], False: []}
    for (s, _, vae), (before, _, _) in zip(renders[1:], renders):
        if vae is not None:
            after_same[s == before].append(vae)
    stat = lambda xs: {"renders": len(xs), "vae_ms_median": statistics.median(xs) if xs else None}  # noqa: E731
    return {"after_same_size": stat(after_same[True]), "after_other_size": stat(after_same[False])}


def storyboard_md(fleet_doc: dict | None, diffusers: dict | None) -> list[str]:
    """report.md's section: the fleet's cold run against each diffusers mode, from process start
    and in steady state (ratios to the best diffusers mode of each)."""
    if not fleet_doc and not diffusers:
        return []
    rows = []
    for mode, d in ((diffusers or {}).get("modes") or {}).items():
        rows.append({"system": f"diffusers {mode}", **{k: d.get(k) for k in ("shots", "images_per_s", "images_per_s_steady", "first_image_s", "to_last_image_s", "per_size", "status")}})
    for key, system in FLEET_RUNS:
        f = (fleet_doc or {}).get(key)
        if f:
            rows.append({"system": system, "shots": f.get("done"), "images_per_s": f.get("images_per_s"),
                         "images_per_s_steady": f.get("images_per_s_steady"), "first_image_s": f.get("first_image_after_spawn_s"),
                         "to_last_image_s": f.get("to_last_image_s"), "per_size": f.get("per_size"), "status": f.get("status"),
                         "vae_after_switch": f.get("vae_after_switch"), "renders": f.get("renders"),
                         "busy_fraction": f.get("busy_fraction"), "busy_backlog": f.get("busy_backlog"),
                         "renders_in_flight": f.get("renders_in_flight")})
    best = lambda key: max((x[key] for x in rows if x["system"].startswith("diffusers") and x.get(key)), default=None)  # noqa: E731
    best_cold, best_steady = best("images_per_s"), best("images_per_s_steady")
    out = ["## The mixed storyboard (issue 17, point 3)", "",
           "| system | shots | images/s from process start | x best diffusers | steady images/s | x best diffusers | first image s | last image s | GPU busy (run / backlog) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in rows:
        cold = f"{x['images_per_s'] / best_cold:.2f}" if x.get("images_per_s") and best_cold else "-"
        steady = f"{x['images_per_s_steady'] / best_steady:.2f}" if x.get("images_per_s_steady") and best_steady else "-"
        out.append(f"| {x['system']} | {x.get('shots') or '-'} | {x.get('images_per_s') or '-'} | {cold} | "
                   f"{x.get('images_per_s_steady') or '-'} | {steady} | {x.get('first_image_s') or '-'} | {x.get('to_last_image_s') or '-'} | {busy_cell(x)} |")
    out += ["", "Per size, the first image against the later ones (seconds of the call for diffusers, render ms for the fleet):", ""]
    for x in rows:
        sizes = "; ".join(f"{s} {json.dumps(v)}" for s, v in (x.get("per_size") or {}).items())
        out.append(f"- {x['system']} ({x.get('status')}): {sizes or '-'}")
        if x.get("vae_after_switch"):
            out.append(f"  - VAE after the same size / after another: {json.dumps(x['vae_after_switch'])}")
        if x.get("renders"):
            out.append(f"  - renders: {json.dumps(x['renders'])}")
        if x.get("renders_in_flight"):
            out.append(f"  - share of the backlog with renders running: {json.dumps(x['renders_in_flight'])}")
    return out + [""]


def load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None
