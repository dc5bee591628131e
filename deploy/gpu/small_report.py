"""report.py's section for small.json (deploy/gpu/fleet-small.sh, issue 19): the tables that go to
deploy/gpu/RESULTS.md as they are. Standard library only.
"""

from __future__ import annotations

import json


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _mib(v) -> str:
    """`24576 MiB`, or what stands there instead (`whole card`, unknown)."""
    return f"{v} MiB" if str(v).isdigit() else str(v or "unknown")


def _probes(probes: list[dict]) -> str:
    """`512x512x1 measured 2422, 1536x1536x2 over room` in start-up order."""
    words = {"measured": "", "over_room": "over room", "over_ceiling": "past ceiling", "out_of_memory": "**OOM**"}
    parts = []
    for p in probes:
        peak = f" {_num(p.get('peak_mib'), '.0f')}" if p["outcome"] == "measured" else ""
        parts.append(f"{p['shape']}{peak}{(' ' + words[p['outcome']]) if words[p['outcome']] else ''}")
    return ", ".join(parts) or "-"


def _ended(ended: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (ended or {}).items()) or "-"


def cards_md(cards: list[dict]) -> list[str]:
    out = ["### Small cards: one worker on a share of the H200 (`[budget] max_mib`), the mixed storyboard", "",
           "| share | started | models resident (text encoders, VAE decoder, UNet weights) | serves | not served (why) | probes (peak MiB) | jobs awaited | ended | "
           "jobs of classes it does not hold | images/s | admission OOMs | crashed |",
           "| --- | --- | --- | --- | --- | --- | ---: | --- | --- | ---: | ---: | --- |"]
    for c in cards:
        if c.get("status") == "skipped":
            out.append(f"| {c.get('max_mib')} MiB | skipped: {c.get('note')} | | | | | | | | | | |")
            continue
        started = "yes" if c.get("started") else ("**no: exit 78, holds nothing**" if c.get("holds_nothing") else f"no: {str(c.get('error'))[:120]}")
        not_served = "; ".join(f"{k} {v['reason']}" for k, v in (c.get("classes") or {}).items() if v.get("reason") != "fits")
        models = (f"{_num(c.get('resident_mib'), 'd')} MiB ({'CPU' if c.get('text_encoders_on_cpu') else 'card'}, "
                  f"{c.get('vae_decoder') or '?'}, {c.get('unet_weights') or '?'})")
        out.append(
            f"| {c.get('max_mib')} MiB | {started} | {models} | {','.join(c.get('served') or []) or '-'} | {not_served or '-'} "
            f"| {_probes(c.get('probes') or [])} | {c.get('jobs_served_classes', '-')} | {_ended(c.get('ended'))} "
            f"| {json.dumps(c.get('jobs_of_classes_not_held') or c.get('left_for_a_roomier_worker') or {})} | {_num(c.get('images_per_s'), '.3f')} "
            f"| {_num(c.get('admission_ooms'), 'd')} | {'**yes**' if c.get('crashed') else 'no'} |")
    out.append("")
    if any(c.get("parallel") for c in cards):
        out += ["The card runs (and the pair) ran side by side, each its own fleet sharing the one H200: images/s are "
                "of a share of its compute and of the CPU, not of a card of that size.", ""]
    for c in cards:
        if c.get("holds_nothing") and c.get("error"):
            out += [f"{c.get('max_mib')} MiB: {c['error'][:700]}", ""]
    return out


def pair_md(pair: dict) -> list[str]:
    if pair.get("status") == "skipped":
        return ["### Two workers on one card: skipped", "", str(pair.get("note")), ""]
    tally = pair.get("tally") or {}
    given = pair.get("given_back_by_small") or []
    out = ["### Two workers on one card: a small share and the rest", "",
           "| what | value |", "| --- | --- |",
           f"| shares | small {pair.get('small_max_mib')} MiB"
           f"{' (' + str(pair['small_holds_nothing_at_mib']) + ' MiB held nothing: exit 78)' if pair.get('small_holds_nothing_at_mib') else ''}, "
           f"big {_mib(pair.get('big_max_mib'))} of {_mib(pair.get('card_total_mib'))} |",
           f"| served | small {','.join(pair.get('served_small') or []) or '-'}; big {','.join(pair.get('served_big') or []) or '-'} |",
           f"| tally | {tally.get('done', '-')} done, {tally.get('degraded', '-')} degraded, {tally.get('failed', '-')} failed; "
           f"{_ended(pair.get('ended'))} |",
           f"| rendered by | {json.dumps(pair.get('jobs_by_worker'))} |",
           f"| given back by the small one | {len(given)} (no room {sum('no_room' in g['why'] for g in given)}, "
           f"out of memory {sum('out_of_memory' in g['why'] for g in given)}); rendered whole by the big one: "
           f"**{pair.get('given_back_rendered_by_big_whole')}** |",
           f"| degraded while the big one served the class | **{len(pair.get('degraded_while_big_held_the_class') or [])}** |",
           f"| admission OOMs | {json.dumps(pair.get('admission_ooms'))} |",
           f"| images/s | {_num(pair.get('images_per_s'), '.3f')} ({_num(pair.get('wall_s'), '.1f')} s) |", ""]
    if given:
        out += ["| given back | why | class | rendered by | status | re-published |", "| --- | --- | --- | --- | --- | --- |"]
        out += [f"| {g['job']} | {','.join(g['why'])} | {g.get('class')} | {','.join(g.get('rendered_by') or []) or '-'} "
                f"| {g.get('status')} | {json.dumps(g.get('republished')) if g.get('republished') else '-'} |" for g in given[:40]]
        out.append("")
    if pair.get("error"):
        out += [f"Error: {pair['error'][:500]}", ""]
    return out


def long_md(long: dict) -> list[str]:
    out = ["### 1,000 mixed jobs under memory pressure, the estimate checked live", "",
           "| part | jobs | tally | images/s | admission OOMs | observed peaks | render threads | floor steps (new thread) | pressure |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for h in long.get("halves", []):
        hog = h.get("hog") or {}
        if h.get("share_mib"):
            hog_text = f"a {h['share_mib']} MiB share" + (" beside the other runs" if h.get("beside") else "")
        elif hog.get("held_mib"):
            hog_text = f"hog: {_num(hog.get('held_mib'), '.0f')} MiB held, {_num(hog.get('free_after_mib'), '.0f')} MiB free"
        else:
            hog_text = h.get("hog_error") or "none"
        steps = ", ".join(f"+{st['to_mib'] - st['from_mib']}" + {True: " (yes)", False: " (no)"}.get(st.get("new_thread"), "")
                          for st in h.get("floor_steps") or []) or "none"
        out.append(f"| {h.get('name')} | {h.get('slice')} | {json.dumps(h.get('tally'))} | {_num(h.get('images_per_s'), '.3f')} "
                   f"| {h.get('admission_ooms')} | {h.get('observed_peaks')} | {h.get('threads') or '-'} | {steps} | {hog_text[:100]} |")
    out += ["", f"Admission OOMs: **{long.get('admission_ooms')}**; {long.get('shapes_within')} "
                f"(error: observed / predicted - 1 of each render, `cold_renders` on; the worker learned only from "
                f"those it judged cold; never judged cold: {', '.join(long.get('shapes_never_cold') or []) or 'none'}).", "",
            "| shape | renders | judged cold | first error | max abs error | max peak / planned | max held at start MiB | within ±10% |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for s in long.get("shapes", []):
        out.append(f"| {s['shape']} | {s['renders']} | {s['cold']} | {_num(s.get('first_error'), '+.3f')} "
                   f"| {_num(s.get('max_abs_error'), '.3f')} | {_num(s.get('max_peak_over_planned'), '.3f')} "
                   f"| {_num(s.get('max_held_at_start_mib'), '.0f')} | {'yes' if s.get('within') else '**no**'} |")
    out.append("")
    return out


def small_md(doc: dict | None) -> list[str]:
    if not doc:
        return []
    out = ["## Small cards (issue 19)", ""]
    if doc.get("cards"):
        out += cards_md(doc["cards"])
    if doc.get("pair"):
        out += pair_md(doc["pair"])
    if doc.get("long"):
        out += long_md(doc["long"])
    if doc.get("error"):
        out += [f"Stage error: {doc['error']}", ""]
    return out
