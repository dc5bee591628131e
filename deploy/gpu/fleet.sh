#!/usr/bin/env bash
# The fleet stage of the GPU lease (deploy/gpu/README.md, "fleet.sh"; called by `lease.sh fleet`):
# one shotfleet-consumer on the GPU with the exported SDXL, fed through a local NATS JetStream.
#
#   bash deploy/gpu/fleet.sh                     (from the repository root; lease.sh sets the variables)
#   FLEET_DEVICE=cpu FLEET_MODEL=onnx/tiny/model bash deploy/gpu/fleet.sh      (a dry run on the CPU)
#
# What it does:
#   1. nats-server on a free local port with a fresh store; `shotfleet setup`
#   2. shotfleet-consumer --config deploy/gpu/fleet.toml (device cuda; the CPU dry run derives a
#      config with [budget.simulate] from it); warm-up = process start to /readyz 200 (load, sessions,
#      probe renders); a background NVML sampler records device memory (and the worker's own, where
#      NVML lists processes) from before the start to the end
#   3. set a: FLEET_SINGLE_JOBS jobs of one image; set b: FLEET_BATCH_JOBS jobs of FLEET_BATCH_IMAGES
#      images; each FLEET_SIZE x FLEET_SIZE, FLEET_STEPS steps, guidance 5.0, submitted at once with
#      `shotfleet submit FILE --wait`, with gpu_sampler.py (busy fraction) around each set
#   4. stops everything it started and writes $RESULTS/fleet.json, also when something failed
#      (then with the error), and up to 4 files to $OUT
#
# Per set in fleet.json: images_per_s = images / (submit start to the last result: what a caller
# sees); images_per_s_steady = images after the first finished job / (first to last job finished,
# from the worker log); warmup_s = start to /readyz 200; start_to_first_image_s; peak_vram_gib = the
# worker's own NVML usage where NVML lists processes, else the device's used memory above what it
# was before the worker started (peak_vram_source says which); busy_fraction = mean NVML
# utilization.gpu over the set.
#
# Inputs (lease.sh sets the first group): BIN_DIR, MODEL_DIR, NATS_SERVER, SHOTFLEET_DEVICE, RESULTS,
# OUT, GPU_SAMPLER, FLEET_DEADLINE_S (it must end within: the sets are trimmed to fit).
# Knobs: FLEET_DEVICE (cuda|cpu; default SHOTFLEET_DEVICE or cuda), FLEET_MODEL (default MODEL_DIR or
# /root/sdxl), FLEET_CONFIG (deploy/gpu/fleet.toml), FLEET_SIZE (1024; cpu 64), FLEET_STEPS (30; cpu 8),
# FLEET_SINGLE_JOBS (12), FLEET_BATCH_JOBS (4), FLEET_BATCH_IMAGES (4), FLEET_WORK (scratch folder;
# cuda /root/fleet-work, cpu a new temp folder), FLEET_IMAGES (cuda /root/fleet-images).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
REPO=$PWD
T0=$SECONDS
export PYTHONUNBUFFERED=1

DEVICE=${FLEET_DEVICE:-${SHOTFLEET_DEVICE:-cuda}}
case "$DEVICE" in cuda|cpu) ;; *) echo "FLEET_DEVICE must be cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
MODEL=${FLEET_MODEL:-${MODEL_DIR:-/root/sdxl}}
case "$MODEL" in /*) ;; *) MODEL=$REPO/$MODEL ;; esac
CONFIG=${FLEET_CONFIG:-$REPO/deploy/gpu/fleet.toml}
if [ -z "${BIN_DIR:-}" ]; then
    if [ -x .gpu/bin/shotfleet-consumer ]; then BIN_DIR=$REPO/.gpu/bin; else BIN_DIR=${CARGO_TARGET_DIR:-$REPO/target}/release; fi
fi
if [ -z "${NATS_SERVER:-}" ]; then
    if [ -x /root/site/bin/nats-server ]; then NATS_SERVER=/root/site/bin/nats-server; else NATS_SERVER=$REPO/.venv/bin/nats-server; fi
fi
GPU_SAMPLER=${GPU_SAMPLER:-$REPO/deploy/gpu/gpu_sampler.py}
DEADLINE_S=${FLEET_DEADLINE_S:-900}
if [ "$DEVICE" = cuda ]; then
    SIZE=${FLEET_SIZE:-1024} STEPS=${FLEET_STEPS:-30}
    WORK=${FLEET_WORK:-/root/fleet-work}
    IMAGES=${FLEET_IMAGES:-/root/fleet-images}
else
    SIZE=${FLEET_SIZE:-64} STEPS=${FLEET_STEPS:-8}
    WORK=${FLEET_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/fleet.XXXXXX")}
    IMAGES=${FLEET_IMAGES:-$WORK/images}
fi
SINGLE_JOBS=${FLEET_SINGLE_JOBS:-12}
BATCH_JOBS=${FLEET_BATCH_JOBS:-4}
BATCH_IMAGES=${FLEET_BATCH_IMAGES:-4}
RESULTS=${RESULTS:-$WORK/results}
OUT=${OUT:-$RESULTS}
mkdir -p "$RESULTS" "$OUT" || exit 1

log() { echo "[fleet $(date +%T) +$((SECONDS - T0))s] $*"; }
left() { echo $((DEADLINE_S - (SECONDS - T0))); }
now() { date +%s.%N; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
http_status() {  # URL -> the HTTP status code, 000 when nothing answers
    if command -v curl > /dev/null; then
        curl -s -o /dev/null -m 2 -w '%{http_code}' "$1" 2> /dev/null || true
    else
        python3 - "$1" << 'EOF' 2> /dev/null || echo 000
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=2).status)
except urllib.error.HTTPError as e:
    print(e.code)
EOF
    fi
}

worker_error() {  # the worker log's last error (message and error fields of its JSON lines), else its tail
    python3 - "$WORKER_LOG" << 'EOF' 2> /dev/null || tail -n 3 "$WORKER_LOG" | tr '\n' ' ' | cut -c1-800
import json, sys
last, tail = None, []
for line in open(sys.argv[1], errors="replace"):
    tail = (tail + [line.strip()])[-3:]
    try:
        rec = json.loads(line)
    except ValueError:
        continue
    if rec.get("level") == "ERROR":
        f = rec.get("fields", {})
        last = f"{f.get('message', '')}: {f.get('error', '')}".strip(": ")
print((last or " | ".join(tail))[:1200])
EOF
}

# Everything this run writes: WORK is scratch (NATS store, state, storyboards, the worker's log);
# RESULTS gets fleet.json and the logs worth keeping (lease.sh's results.tar.gz holds RESULTS).
rm -rf "$WORK/nats" "$WORK/state" "$IMAGES"
mkdir -p "$WORK/state" "$IMAGES" || exit 1
META=$RESULTS/fleet-meta.txt         # key=value lines: times and outcomes, read by the summary
WORKER_LOG=$RESULTS/fleet-worker.log
SUBMIT_LOG=$RESULTS/fleet-submit.txt
VRAM_CSV=$RESULTS/fleet-vram.csv
METRICS=$RESULTS/fleet-metrics.txt
rm -f "$META" "$WORKER_LOG" "$SUBMIT_LOG" "$VRAM_CSV" "$METRICS" "$RESULTS"/fleet-gpu-*.json "$RESULTS/fleet.json"
meta() { echo "$1=$2" >> "$META"; }
fail() { log "FAILED: $*"; meta error "$*"; exit 1; }

pids=()
NATS_PID='' WORKER_PID='' VRAM_PID='' SAMPLER_PID=''
stop_pid() {  # PID SIGNAL SECONDS: signal, wait up to SECONDS, then SIGKILL
    local pid=$1 sig=$2 secs=$3 i
    [ -n "$pid" ] && kill -0 "$pid" 2> /dev/null || return 0
    kill "-$sig" "$pid" 2> /dev/null
    for ((i = 0; i < secs * 10; i++)); do kill -0 "$pid" 2> /dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2> /dev/null
}

# shellcheck disable=SC2317 # called by the EXIT trap
finish() {
    local rc=$?
    trap - EXIT TERM INT
    [ "$rc" = 0 ] || meta rc "$rc"
    stop_pid "$SAMPLER_PID" TERM 3
    if [ -n "$WORKER_PID" ] && kill -0 "$WORKER_PID" 2> /dev/null; then
        log "stopping the worker (SIGTERM, grace 30 s)"
        meta worker_stop_begin "$(now)"
        stop_pid "$WORKER_PID" TERM 40
        meta worker_stop_end "$(now)"
    fi
    stop_pid "$VRAM_PID" TERM 3
    stop_pid "$NATS_PID" TERM 5
    local pid
    for pid in "${pids[@]}"; do stop_pid "$pid" TERM 2; done
    summarize
    log "wrote $RESULTS/fleet.json (exit $rc)"
    cp "$RESULTS/fleet.json" "$OUT/" 2> /dev/null
    [ -f "$WORKER_LOG" ] && tail -n 400 "$WORKER_LOG" > "$OUT/fleet-worker-tail.log"
    {
        cat "$META" 2> /dev/null
        echo
        cat "$SUBMIT_LOG" 2> /dev/null
        for f in "$RESULTS"/fleet-gpu-*.json; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
        [ -f "$WORK/nats-server.log" ] && { echo "== nats-server.log (tail)"; tail -n 30 "$WORK/nats-server.log"; }
    } > "$OUT/fleet-submit.txt"
    [ -f "$METRICS" ] && cp "$METRICS" "$OUT/"
    if [ "$DEVICE" = cpu ] && [ -z "${FLEET_WORK:-}" ]; then rm -rf "$WORK/nats" "$WORK/state"; fi
    exit "$rc"
}
trap finish EXIT
trap 'meta error "stopped by a signal at +$((SECONDS - T0)) s (FLEET_DEADLINE_S=$DEADLINE_S)"; exit 143' TERM INT

# shellcheck disable=SC2317 # called from finish
summarize() {
    python3 - "$META" "$WORKER_LOG" "$VRAM_CSV" "$RESULTS" "$RESULTS/fleet.json" << 'EOF' || echo "the summary failed" >&2
import json, sys, datetime, statistics
from pathlib import Path

meta_path, log_path, vram_path, results, out = map(Path, sys.argv[1:6])
meta = {}
if meta_path.exists():
    for line in meta_path.read_text().splitlines():
        k, _, v = line.partition("=")
        meta.setdefault(k, v)  # the first value wins (the first error is the cause)

def f(key):
    try:
        return float(meta[key])
    except (KeyError, ValueError):
        return None

def ts(text):
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None

# The worker's JSON log: "job done" lines, start-up figures, warnings worth a note.
done, startup, warnings, probes = {}, {}, [], []
if log_path.exists():
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        fields = rec.get("fields", {})
        msg = fields.get("message", "")
        if msg == "job done":
            done[fields.get("job")] = {"t": ts(rec.get("timestamp")), "images": fields.get("images"),
                                       "render_ms": fields.get("render_ms")}
        elif msg == "models loaded":
            startup["load_s"] = fields.get("load_s")
            startup["resident_mib"] = fields.get("resident_mib")
        elif msg == "worker ready":
            startup["worker_warmup_s"] = fields.get("warmup_s")
        elif msg == "probe render":
            probes.append([fields.get("width"), fields.get("height"), fields.get("images"),
                           round(fields.get("peak_mib") or 0, 1)])
        if rec.get("level") in ("WARN", "ERROR"):
            warnings.append(f"{rec.get('level')}: {msg} {json.dumps({k: v for k, v in fields.items() if k != 'message'})}"[:300])

# NVML memory over time: t, device used MiB, the worker's own MiB (-1: not listed), all processes' MiB
vram = []
if vram_path.exists():
    for line in vram_path.read_text().splitlines()[1:]:
        try:
            t, dev, own, procs = (float(x) for x in line.split(","))
            vram.append((t, dev, own, procs))
        except ValueError:
            pass
baseline = f("vram_baseline_mib")

def vram_peak(t0, t1):
    rows = [r for r in vram if (t0 is None or r[0] >= t0) and (t1 is None or r[0] <= t1)]
    if not rows:
        return {}
    dev = max(r[1] for r in rows)
    own = max(r[2] for r in rows)
    procs = max(r[3] for r in rows)
    res = {"nvml_used_peak_gib": round(dev / 1024, 2)}
    if own > 0:
        res.update(peak_vram_gib=round(own / 1024, 2), peak_vram_source="NVML, the worker's process")
    elif procs > 0:
        res.update(peak_vram_gib=round(procs / 1024, 2), peak_vram_source="NVML, all compute processes (the worker's pid not listed)")
    elif baseline is not None:
        res.update(peak_vram_gib=round((dev - baseline) / 1024, 2),
                   peak_vram_source=f"NVML device used minus {baseline:.0f} MiB before the worker started")
    return res

start, ready = f("worker_start"), f("worker_ready")
runs = []
sets = [("a", f"1 worker, 1 image/job", 1), ("b", f"1 worker, {meta.get('batch_images', '?')} images/job", None)]
for key, label, batch in sets:
    if f"set_{key}_jobs" not in meta:
        continue
    jobs = meta.get(f"set_{key}_ids", "").split()
    per_job = int(meta.get(f"set_{key}_images_per_job", "1"))
    t_sub, t_end = f(f"set_{key}_submit"), f(f"set_{key}_end")
    rc = meta.get(f"set_{key}_rc")
    got = sorted((done[j]["t"], done[j]["images"] or per_job, done[j]["render_ms"]) for j in jobs if j in done and done[j]["t"])
    images = sum(g[1] for g in got)
    run = {"label": label, "batch": per_job, "workers": 1, "jobs": len(jobs), "jobs_done": len(got),
           "images": images, "size": int(meta.get("size", 0)), "steps": int(meta.get("steps", 0)),
           "device": meta.get("device")}
    if t_sub and t_end:
        run["wall_s"] = round(t_end - t_sub, 3)
        # Submit to the last result: only when every job has its result.
        if got and len(got) == len(jobs) and rc == "0":
            run["images_per_s"] = round(images / (t_end - t_sub), 4)
    if len(got) >= 2 and got[-1][0] > got[0][0]:
        steady = sum(g[1] for g in got[1:])
        run["images_per_s_steady"] = round(steady / (got[-1][0] - got[0][0]), 4)
    if got:
        run["first_result_s"] = round(got[0][0] - t_sub, 3) if t_sub else None
        renders = [g[2] / 1000 for g in got if g[2] is not None]
        run["render_s_median"] = round(statistics.median(renders), 3) if renders else None
    run["warmup_s"] = round(ready - start, 2) if start and ready else None
    if key == "a" and got and start:
        run["start_to_first_image_s"] = round(got[0][0] - start, 2)
    run.update(vram_peak(t_sub, t_end))
    warm = vram_peak(start, ready)
    if warm.get("peak_vram_gib") is not None:
        run["warmup_peak_vram_gib"] = warm["peak_vram_gib"]
    gpu = results / f"fleet-gpu-{key}.json"
    if gpu.exists():
        try:
            g = json.loads(gpu.read_text())
            run["busy_fraction"] = round(g["busy_fraction"], 4) if "busy_fraction" in g else None
            run["busy_zero_samples"] = g.get("busy_zero_samples")
            run["gpu_samples"] = g.get("samples")
            if g.get("error") and not g.get("samples"):
                run["gpu_sampler_error"] = g["error"]
        except (ValueError, KeyError):
            pass
    notes = ["ORT CUDA EP as the worker configures it (no CUDA graph; latents to the host every step)"] if meta.get("device") == "cuda" else ["CPU dry run, tiny model"]
    notes.append(f"{len(jobs)} jobs submitted at once, concurrency 1")
    if rc not in (None, "0"):
        notes.append(f"submit exit {rc}")
    if len(got) < len(jobs):
        notes.append(f"{len(jobs) - len(got)} jobs without a 'job done' line")
    run["note"] = "; ".join(notes)
    if "images_per_s" not in run:
        run["status"] = "incomplete"
    runs.append(run)

doc = {"runs": runs, "device": meta.get("device"), "model": meta.get("model"),
       "warmup_s": round(ready - start, 2) if start and ready else None, "startup": startup,
       "probe_renders": probes, "vram_baseline_mib": baseline, "warnings": warnings[:20],
       "worker_exit": meta.get("worker_exit"), "seconds": f("seconds")}
if meta.get("error"):
    doc["error"] = meta["error"]
    if not runs:
        doc["runs"] = [{"label": "1 worker", "workers": 1, "status": "failed", "note": meta["error"][:300],
                        "warmup_s": doc["warmup_s"]}]
out.write_text(json.dumps(doc, indent=2) + "\n")
print(json.dumps({"runs": [{k: r.get(k) for k in ("label", "images", "wall_s", "images_per_s", "images_per_s_steady",
                                                    "warmup_s", "peak_vram_gib", "busy_fraction", "status")} for r in doc["runs"]],
                  "error": doc.get("error")}, indent=1))
EOF
}

# NVML memory every 200 ms, from before the worker starts to the end: device used, the worker's
# own (where NVML lists its pid), all compute processes. Standard library + pynvml (the image has
# nvidia-ml-py); without NVML it writes only the header.
# exec: the background job's pid is python's own, so stop_pid reaches it (a bash subshell killed
# with SIGTERM leaves its foreground child running; on the 2026-11-30 lease that orphan held
# lease.sh's tee open until the call's 600 s limit). It also ends by itself once fleet.sh is gone.
vram_sampler() {  # CSV PIDFILE PARENT_PID
    exec python3 - "$1" "$2" "$3" << 'EOF'
import os, signal, sys, time
out, pidfile, parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
stop = False
def handler(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, handler)
signal.signal(signal.SIGINT, handler)
f = open(out, "w")
f.write("t,device_used_mib,own_mib,procs_mib\n")
f.flush()
try:
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("SHOTFLEET_GPU", "0")))
except Exception as e:  # noqa: BLE001
    print(f"vram sampler: no NVML ({type(e).__name__}: {e})", file=sys.stderr)
    sys.exit(0)
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
while not stop and alive(parent):
    try:
        used = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
        own, procs = -1.0, 0.0
        try:
            pid = int(open(pidfile).read().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        try:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                mem = (p.usedGpuMemory or 0) / 2**20
                procs += mem
                if pid and p.pid == pid:
                    own = mem
        except Exception:  # noqa: BLE001
            pass
        f.write(f"{time.time():.3f},{used:.0f},{own:.0f},{procs:.0f}\n")
        f.flush()
    except Exception as e:  # noqa: BLE001
        print(f"vram sampler: {e}", file=sys.stderr)
    time.sleep(0.2)
f.close()
EOF
}

storyboard() {  # FILE SET JOBS IMAGES: JSON Lines, distinct seeds and prompts, all p0
    local file=$1 set=$2 jobs=$3 images=$4 i
    local prompts=("a lighthouse on a cliff at dawn, ink wash" "a fox in a snowy forest, soft light"
        "a market street in the rain at night, neon" "an old sailing ship in a storm, oil painting"
        "a cat asleep on a windowsill, afternoon sun" "a desert canyon at sunset, wide shot")
    : > "$file"
    for ((i = 1; i <= jobs; i++)); do
        printf '{"job_id":"%s-%s-%02d","project":"fleet","shot_id":"%s%02d","priority":"p0","prompt":"%s","width":%d,"height":%d,"steps":%d,"guidance":5.0,"seed":%d,"images":%d}\n' \
            "$RUN_ID" "$set" "$i" "$set" "$i" "${prompts[$(((i - 1) % ${#prompts[@]}))]}" "$SIZE" "$SIZE" "$STEPS" \
            $((1000 + i)) "$images" >> "$file"
    done
}

# run_set KEY JOBS IMAGES_PER_JOB
run_set() {
    local key=$1 jobs=$2 per_job=$3 budget ids rc=0
    budget=$(($(left) - 45))   # the worker's shutdown (grace 30 s) and the summary come after
    if [ "$budget" -lt 20 ]; then
        log "set $key skipped: $(left) s left before the deadline"
        meta "set_${key}_skipped" "$(left) s left"
        return 0
    fi
    storyboard "$WORK/set-$key.jsonl" "$key" "$jobs" "$per_job"
    ids=$(sed -E 's/^\{"job_id":"([^"]+)".*/\1/' "$WORK/set-$key.jsonl" | tr '\n' ' ')
    meta "set_${key}_jobs" "$jobs"
    meta "set_${key}_images_per_job" "$per_job"
    meta "set_${key}_ids" "$ids"
    python3 "$GPU_SAMPLER" --out "$RESULTS/fleet-gpu-$key.json" > /dev/null 2>&1 < /dev/null &
    SAMPLER_PID=$!
    sleep 0.3
    log "set $key: $jobs jobs x $per_job images, ${SIZE}x${SIZE}, $STEPS steps (submit --wait, timeout ${budget}s)"
    echo "== set $key: $jobs jobs x $per_job images" >> "$SUBMIT_LOG"
    meta "set_${key}_submit" "$(now)"
    "$BIN_DIR/shotfleet" submit "$WORK/set-$key.jsonl" --wait --timeout "${budget}s" >> "$SUBMIT_LOG" 2>&1 &
    local sub=$!
    pids+=("$sub")
    wait "$sub" || rc=$?
    meta "set_${key}_end" "$(now)"
    meta "set_${key}_rc" "$rc"
    stop_pid "$SAMPLER_PID" TERM 3
    SAMPLER_PID=''
    tail -n $((jobs + 3)) "$SUBMIT_LOG"
    http_get_metrics "set $key"
    if [ "$rc" != 0 ]; then
        log "set $key: submit exited $rc"
        kill -0 "$WORKER_PID" 2> /dev/null || fail "the worker exited during set $key: $(worker_error)"
    fi
    return 0
}

http_get_metrics() {
    { echo "== after $1"; python3 - "http://$METRICS_ADDR/metrics" << 'EOF' 2>&1; } >> "$METRICS"
import sys, urllib.request
try:
    text = urllib.request.urlopen(sys.argv[1], timeout=3).read().decode()
except Exception as e:  # noqa: BLE001
    print(f"no metrics: {e}")
    sys.exit(0)
for line in text.splitlines():
    if line.startswith("shotfleet_") and not line.startswith(("shotfleet_queue_wait_seconds_bucket", "shotfleet_render_seconds_bucket", "shotfleet_upload_seconds_bucket")):
        print(line)
EOF
}

# --- checks -------------------------------------------------------------------------------------
meta device "$DEVICE"
meta model "$MODEL"
meta size "$SIZE"
meta steps "$STEPS"
meta batch_images "$BATCH_IMAGES"
log "device $DEVICE, model $MODEL, ${SIZE}x${SIZE} $STEPS steps; deadline ${DEADLINE_S}s; work $WORK"
for b in shotfleet-consumer shotfleet; do
    [ -x "$BIN_DIR/$b" ] || fail "no executable $BIN_DIR/$b (build it and copy it into .gpu/bin)"
done
[ -x "$NATS_SERVER" ] || fail "no nats-server at $NATS_SERVER"
[ -f "$MODEL/unet/model.onnx" ] || fail "no model at $MODEL (unet/model.onnx missing)"
[ -f "$CONFIG" ] || fail "no worker config $CONFIG"
if [ "$DEVICE" = cpu ]; then
    # The CPU variant: the same file, device cpu, small probes, a simulated 4 GiB card.
    sed -e 's/^device = "cuda"/device = "cpu"/' \
        -e 's/^shapes = .*/shapes = [[64, 64, 1], [96, 96, 1], [128, 128, 1]]/' "$CONFIG" > "$WORK/worker.toml"
    printf '\n[budget]\nreserve_mib = 64\nmargin_mib = 64\n\n[budget.simulate]\ntotal_mib = 4096\n' >> "$WORK/worker.toml"
    CONFIG=$WORK/worker.toml
fi
RUN_ID=fleet-$(date +%H%M%S)

# --- NATS ---------------------------------------------------------------------------------------
port=$(free_port) || fail "no free port"
"$NATS_SERVER" -a 127.0.0.1 -p "$port" -js -sd "$WORK/nats" > "$WORK/nats-server.log" 2>&1 &
NATS_PID=$!
export NATS_URL=nats://127.0.0.1:$port
for _ in $(seq 100); do (echo > "/dev/tcp/127.0.0.1/$port") 2> /dev/null && break; sleep 0.1; done
kill -0 "$NATS_PID" 2> /dev/null || fail "nats-server did not start: $(tail -n 3 "$WORK/nats-server.log" | tr '\n' ' ')"
log "nats-server $("$NATS_SERVER" --version 2>&1 | head -1) at $NATS_URL"
"$BIN_DIR/shotfleet" setup > "$WORK/setup.txt" 2>&1 || fail "shotfleet setup: $(tr '\n' ' ' < "$WORK/setup.txt" | cut -c1-400)"

# --- the worker ---------------------------------------------------------------------------------
METRICS_ADDR=127.0.0.1:$(free_port) || fail "no free port"
echo > "$WORK/worker.pid"
vram_sampler "$VRAM_CSV" "$WORK/worker.pid" $$ > /dev/null 2>> "$RESULTS/fleet-vram.err" < /dev/null &
VRAM_PID=$!
sleep 1
base=$(awk -F, 'NR > 1 {v = $2} END {print v}' "$VRAM_CSV" 2> /dev/null)
[ -n "$base" ] && meta vram_baseline_mib "$base"
meta worker_start "$(now)"
SHOTFLEET_DEVICE=$DEVICE \
SHOTFLEET_MODEL=$MODEL \
SHOTFLEET_STORE=file://$IMAGES \
SHOTFLEET_STATE_DIR=$WORK/state \
SHOTFLEET_METRICS_ADDR=$METRICS_ADDR \
SHOTFLEET_WORKER_ID=fleet/$DEVICE${SHOTFLEET_GPU:-0} \
RUST_LOG=${FLEET_RUST_LOG:-info,ort=warn} \
    "$BIN_DIR/shotfleet-consumer" --config "$CONFIG" > "$WORKER_LOG" 2>&1 &
WORKER_PID=$!
echo "$WORKER_PID" > "$WORK/worker.pid"
log "worker pid $WORKER_PID, metrics http://$METRICS_ADDR; waiting for /readyz"
ready_limit=$(($(left) - 60))
[ "$ready_limit" -gt 600 ] && ready_limit=600
ready_until=$((SECONDS - T0 + ready_limit))
while :; do
    if [ "$(http_status "http://$METRICS_ADDR/readyz")" = 200 ]; then meta worker_ready "$(now)"; break; fi
    if ! kill -0 "$WORKER_PID" 2> /dev/null; then
        wait "$WORKER_PID"
        meta worker_exit "$?"
        WORKER_PID=''
        fail "the worker exited (code $(grep '^worker_exit=' "$META" | cut -d= -f2)) before it was ready: $(worker_error)"
    fi
    [ $((SECONDS - T0)) -lt "$ready_until" ] || fail "the worker was not ready after $ready_limit s: $(worker_error)"
    sleep 0.1
done
ready_s=$(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" \
    "$(grep '^worker_start=' "$META" | cut -d= -f2)" "$(grep '^worker_ready=' "$META" | cut -d= -f2)")
log "worker ready after $ready_s s (process start to /readyz 200)"
grep -E '"(models loaded|probe render|worker ready)"' "$WORKER_LOG" | cut -c1-300
http_get_metrics "ready"

# --- the timed sets -----------------------------------------------------------------------------
run_set a "$SINGLE_JOBS" 1
run_set b "$BATCH_JOBS" "$BATCH_IMAGES"
meta seconds $((SECONDS - T0))
log "done; $(find "$IMAGES" -name '*.png' | wc -l) images in $IMAGES"
exit 0
