# shellcheck shell=bash
# The processes of deploy/gpu/fleet.sh (sourced by it): a NATS server per run, the worker, the
# samplers, the memory hog, and a submitted set. fleet.sh holds the plans (which runs, which
# configs); this file knows nothing of them.
#
# A run is a folder RUN_DIR under STAGE_DIR holding what it measured: meta.txt (key=value lines,
# the first value of a key wins), worker.toml, worker.log (the worker's JSON lines), submit-KEY.txt
# and jobs-KEY.jsonl per set, gpu-KEY.json (gpu_sampler.py around the set), metrics.txt (/metrics
# after each set). STAGE_DIR/vram.csv is NVML memory every 200 ms over the whole stage, with the
# current worker's own usage (its pid is in WORK/worker.pid). fleet_summary.py reads all of it.
#
# Needs from fleet.sh: REPO T0 DEADLINE_S DEVICE MODEL BIN_DIR NATS_SERVER GPU_SAMPLER WORK STAGE_DIR.

log() { echo "[fleet $(date +%T) +$((SECONDS - T0))s] $*"; }
left() { echo $((DEADLINE_S - (SECONDS - T0))); }
now() { date +%s.%N; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
meta() { echo "$1=$2" >> "$RUN_DIR/meta.txt"; }
stage_meta() { echo "$1=$2" >> "$STAGE_DIR/meta.txt"; }
meta_get() { grep -m1 "^$2=" "$1/meta.txt" 2> /dev/null | cut -d= -f2-; }

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

stop_pid() {  # PID SIGNAL SECONDS: signal, wait up to SECONDS, then SIGKILL
    local pid=$1 sig=$2 secs=$3 i
    [ -n "$pid" ] && kill -0 "$pid" 2> /dev/null || return 0
    kill "-$sig" "$pid" 2> /dev/null
    for ((i = 0; i < secs * 10; i++)); do kill -0 "$pid" 2> /dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2> /dev/null
}

worker_error() {  # LOG: its last error (message and error fields of the JSON lines), else its tail
    python3 - "$1" << 'EOF' 2> /dev/null || tail -n 3 "$1" | tr '\n' ' ' | cut -c1-800
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

# --- NVML memory over the stage ------------------------------------------------------------------
# vram_sampler.py, exec'd: the background job's pid is python's own, so stop_pid reaches it (a bash
# subshell killed with SIGTERM leaves its foreground child running; on the 2026-11-30 lease that
# orphan held lease.sh's tee open until the call's 600 s limit). It also ends by itself once
# fleet.sh is gone.
vram_sampler() {  # CSV PIDFILE PARENT_PID
    exec python3 "$REPO/deploy/gpu/vram_sampler.py" "$1" "$2" "$3"
}

start_vram_sampler() {
    echo > "$WORK/worker.pid"
    vram_sampler "$STAGE_DIR/vram.csv" "$WORK/worker.pid" $$ > /dev/null 2>> "$STAGE_DIR/vram.err" < /dev/null &
    VRAM_PID=$!
    sleep 1
    local base
    base=$(awk -F, 'NR > 1 {v = $2} END {print v}' "$STAGE_DIR/vram.csv" 2> /dev/null)
    [ -n "$base" ] && stage_meta vram_baseline_mib "$base"
    return 0
}

# --- a run: its own NATS server and store, so nothing of one run reaches the next ----------------
# run_begin NAME LABEL: RUN_DIR, a fresh nats-server, `shotfleet setup`. 1 when NATS cannot start.
run_begin() {
    RUN_NAME=$1
    RUN_DIR=$STAGE_DIR/$1
    rm -rf "$RUN_DIR" "$WORK/nats" "$WORK/state" "$WORK/images"
    mkdir -p "$RUN_DIR" "$WORK/state" "$WORK/images"
    echo "$1" >> "$STAGE_DIR/runs.txt"
    meta label "$2"
    meta run_begin "$(now)"
    log "=== run $1: $2 ($(left) s left)"
    local port
    port=$(free_port) || { meta error "no free port"; return 1; }
    "$NATS_SERVER" -a 127.0.0.1 -p "$port" -js -sd "$WORK/nats" > "$RUN_DIR/nats-server.log" 2>&1 &
    NATS_PID=$!
    export NATS_URL=nats://127.0.0.1:$port
    for _ in $(seq 100); do (echo > "/dev/tcp/127.0.0.1/$port") 2> /dev/null && break; sleep 0.1; done
    if ! kill -0 "$NATS_PID" 2> /dev/null; then
        meta error "nats-server did not start: $(tail -n 3 "$RUN_DIR/nats-server.log" | tr '\n' ' ')"
        return 1
    fi
    if ! "$BIN_DIR/shotfleet" setup > "$RUN_DIR/setup.txt" 2>&1; then
        meta error "shotfleet setup: $(tr '\n' ' ' < "$RUN_DIR/setup.txt" | cut -c1-400)"
        return 1
    fi
}

# run_skip NAME LABEL WHY: a run the deadline left no room for, recorded as skipped.
run_skip() {
    mkdir -p "$STAGE_DIR/$1"
    echo "$1" >> "$STAGE_DIR/runs.txt"
    { echo "label=$2"; echo "skipped=$3"; } > "$STAGE_DIR/$1/meta.txt"
    log "=== run $1 skipped: $3"
}

run_end() {
    worker_stop
    stop_pid "$NATS_PID" TERM 5
    NATS_PID=''
    meta run_end "$(now)"
    # Renders of random weights are noise, megabytes each: the disk would fill over a stage.
    meta pngs "$(find "$WORK/images" -name '*.png' 2> /dev/null | wc -l)"
    rm -rf "$WORK/images" "$WORK/nats"
}

# The environment every worker and check process gets (the config file holds the rest), for
# `env "${WORKER_ENV[@]}" CMD`: a simple command, so a background one's $! is the process itself
# (a function run with & would be a subshell whose pid stop_pid cannot stop the worker through).
worker_env() {
    WORKER_ENV=(SHOTFLEET_DEVICE="$DEVICE" SHOTFLEET_MODEL="$MODEL" SHOTFLEET_STORE="file://$WORK/images"
        SHOTFLEET_STATE_DIR="$WORK/state" SHOTFLEET_WORKER_ID="${FLEET_WORKER_ID:-fleet/$DEVICE${SHOTFLEET_GPU:-0}}"
        RUST_LOG="${FLEET_RUST_LOG:-info,ort=warn,shotfleet_consumer::worker::job=debug}" "$@")
}

# worker_start CONFIG: the worker (with WORKER_ARGS: `--gpus all` makes it a box, whose own port is
# then METRICS_ADDR), then /readyz 200 (warm-up = start to ready). 1 when it exits first or is not
# ready in time; the error is in meta.
worker_start() {
    cp "$1" "$RUN_DIR/worker.toml"
    METRICS_ADDR=127.0.0.1:$(free_port) || { meta error "no free port"; return 1; }
    meta worker_start "$(now)"
    worker_env SHOTFLEET_METRICS_ADDR="$METRICS_ADDR" SHOTFLEET_BOX_ADDR="$METRICS_ADDR"
    env "${WORKER_ENV[@]}" "$BIN_DIR/shotfleet-consumer" --config "$RUN_DIR/worker.toml" "${WORKER_ARGS[@]}" \
        > "$RUN_DIR/worker.log" 2>&1 < /dev/null &
    WORKER_PID=$!
    echo "$WORKER_PID" > "$WORK/worker.pid"
    meta worker_pid "$WORKER_PID"
    local limit until
    limit=$(($(left) - 30))
    [ "$limit" -gt 300 ] && limit=300
    until=$((SECONDS + limit))
    while :; do
        if [ "$(http_status "http://$METRICS_ADDR/readyz")" = 200 ]; then
            meta worker_ready "$(now)"
            break
        fi
        if ! kill -0 "$WORKER_PID" 2> /dev/null; then
            local code=0
            wait "$WORKER_PID" || code=$?
            meta worker_exit "$code"
            WORKER_PID=''
            meta error "the worker exited (code $code) before it was ready: $(worker_error "$RUN_DIR/worker.log")"
            return 1
        fi
        if [ "$SECONDS" -ge "$until" ]; then
            meta error "the worker was not ready after $limit s: $(worker_error "$RUN_DIR/worker.log")"
            return 1
        fi
        sleep 0.1
    done
    log "worker pid $WORKER_PID ready after $(python3 -c 'import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))' \
        "$(meta_get "$RUN_DIR" worker_start)" "$(meta_get "$RUN_DIR" worker_ready)") s"
    grep -E '"(models loaded|probe render|worker ready)"' "$RUN_DIR/worker.log" | cut -c1-240
    scrape_metrics ready
}

worker_alive() { [ -n "$WORKER_PID" ] && kill -0 "$WORKER_PID" 2> /dev/null; }

worker_stop() {
    [ -n "$WORKER_PID" ] || return 0
    if kill -0 "$WORKER_PID" 2> /dev/null; then
        meta worker_stop_begin "$(now)"
        stop_pid "$WORKER_PID" TERM 40
        meta worker_stop_end "$(now)"
    fi
    local code=0
    wait "$WORKER_PID" 2> /dev/null || code=$?
    meta worker_exit "$code"
    WORKER_PID=''
    echo > "$WORK/worker.pid"
}

scrape_metrics() {  # LABEL: the worker's shotfleet_* lines (no histogram buckets) into metrics.txt
    [ -n "${METRICS_ADDR:-}" ] || return 0
    { echo "== $1"; python3 - "http://$METRICS_ADDR/metrics" << 'EOF' 2>&1; } >> "$RUN_DIR/metrics.txt"
import sys, urllib.request
try:
    text = urllib.request.urlopen(sys.argv[1], timeout=3).read().decode()
except Exception as e:  # noqa: BLE001
    print(f"no metrics: {e}")
    sys.exit(0)
for line in text.splitlines():
    if line.startswith("shotfleet_") and "_bucket{" not in line:
        print(line)
EOF
}

# submit_set KEY LABEL FILE TIMEOUT_S: `shotfleet submit FILE --wait` (and SUBMIT_FLAGS, e.g.
# --no-group) with gpu_sampler.py around it. Always 0: the outcome (exit code, times) is in meta; a
# worker that died is an error there.
submit_set() {
    submit_begin "$@"
    submit_end "$1"
}

# submit_begin KEY LABEL FILE TIMEOUT_S: submit_set's first half, in the background (SUBMIT_PID):
# the sampler started, the jobs being published and waited for. submit_end KEY waits for it.
submit_begin() {
    local key=$1 label=$2 file=$3 timeout=$4
    cp "$file" "$RUN_DIR/jobs-$key.jsonl"
    meta "set_${key}_label" "$label"
    meta "set_${key}_timeout_s" "$timeout"
    python3 "$GPU_SAMPLER" --out "$RUN_DIR/gpu-$key.json" > /dev/null 2>&1 < /dev/null &
    SAMPLER_PID=$!
    sleep 0.3
    log "set $key: $label (submit --wait, timeout ${timeout}s)"
    [ -n "${SUBMIT_FLAGS:-}" ] && meta "set_${key}_flags" "$SUBMIT_FLAGS"
    meta "set_${key}_submit" "$(now)"
    # shellcheck disable=SC2086 # SUBMIT_FLAGS: words
    "$BIN_DIR/shotfleet" submit "$RUN_DIR/jobs-$key.jsonl" ${SUBMIT_FLAGS:-} --wait --timeout "${timeout}s" \
        > "$RUN_DIR/submit-$key.txt" 2>&1 < /dev/null &
    SUBMIT_PID=$!
}

submit_end() {  # KEY
    local key=$1 rc=0
    wait "$SUBMIT_PID" || rc=$?
    SUBMIT_PID=''
    meta "set_${key}_end" "$(now)"
    meta "set_${key}_rc" "$rc"
    stop_pid "$SAMPLER_PID" TERM 3
    SAMPLER_PID=''
    grep -E '^[0-9]+ done, |^queued |^p[0-2]: ' "$RUN_DIR/submit-$key.txt"
    scrape_metrics "set $key"
    if [ "$rc" != 0 ]; then
        log "set $key: submit exited $rc: $(grep -v '^ *[0-9]*/' "$RUN_DIR/submit-$key.txt" | tail -n 2 | tr '\n' ' ' | cut -c1-300)"
        worker_alive || meta error "the worker exited during set $key: $(worker_error "$RUN_DIR/worker.log")"
    fi
    return 0
}

# --- the memory hog: another tenant on the card -------------------------------------------------
hog_process() { exec python3 "$REPO/deploy/gpu/hog.py" "$@"; }

# hog_start KEEP_FREE_GIB [DEVICE]: deploy/gpu/hog.py (exec'd: its pid is python's own) holds all
# but KEEP_FREE_GIB of card DEVICE (0: HOG_PID, hog.json; N: HOG_PIDS_MORE, hog-gpuN.json); waits
# for its report. 1 when it failed (the report says why).
hog_start() {
    local device=${2:-0} name=hog pid i
    [ "$device" = 0 ] || name=hog-gpu$device
    rm -f "$RUN_DIR/$name.json"
    hog_process --keep-free-gib "$1" --device "$device" --report "$RUN_DIR/$name.json" --parent $$ \
        > /dev/null 2> "$RUN_DIR/$name.err" < /dev/null &
    pid=$!
    if [ "$device" = 0 ]; then HOG_PID=$pid; else HOG_PIDS_MORE="$HOG_PIDS_MORE $pid"; fi
    meta "${name//-/_}_pid" "$pid"
    for ((i = 0; i < 600; i++)); do
        [ -f "$RUN_DIR/$name.json" ] && break
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.1
    done
    if grep -q '"held_mib"' "$RUN_DIR/$name.json" 2> /dev/null; then
        log "$name pid $pid: $(cat "$RUN_DIR/$name.json")"
        return 0
    fi
    meta "${name//-/_}_error" "the hog failed: $(cat "$RUN_DIR/$name.json" 2> /dev/null) $(tail -n 3 "$RUN_DIR/$name.err" 2> /dev/null | tr '\n' ' ' | cut -c1-400)"
    stop_pid "$pid" TERM 5
    [ "$device" = 0 ] && HOG_PID=''
    return 1
}

# pressure_start: another tenant on the card for a run: on the GPU the hog, leaving
# HOG_KEEP_FREE_GIB (36) free (a hog that fails is recorded and the run goes on without it); on
# the CPU the simulation's others_used_mib, SIM_OTHERS_MIB (3000), which PRESSURE_SIM_MIB holds for
# write_config's SIM_OTHERS.
pressure_start() {
    PRESSURE_SIM_MIB=0
    if [ "$DEVICE" = cuda ]; then
        meta hog_keep_free_gib "${HOG_KEEP_FREE_GIB:-36}"
        hog_start "${HOG_KEEP_FREE_GIB:-36}" || log "no hog: the run goes on with the whole card (recorded)"
    else
        PRESSURE_SIM_MIB=${SIM_OTHERS_MIB:-3000}
        meta simulated_others_used_mib "$PRESSURE_SIM_MIB"
    fi
}

hog_stop() {
    local pid
    for pid in $HOG_PIDS_MORE; do stop_pid "$pid" TERM 10; done
    HOG_PIDS_MORE=''
    [ -n "$HOG_PID" ] || return 0
    stop_pid "$HOG_PID" TERM 10
    [ -n "$RUN_DIR" ] && meta hog_stopped "$(now)"
    HOG_PID=''
}

# Everything still running, in order: a set's submit and sampler, worker (grace), a run's other workers
# (OTHER_WORKER_PIDS), hog, NATS, the stage's sampler.
stop_all() {
    stop_pid "$SUBMIT_PID" TERM 3
    stop_pid "$SAMPLER_PID" TERM 3
    SAMPLER_PID=''
    if [ -n "$RUN_DIR" ] && [ -n "$WORKER_PID" ]; then worker_stop; fi
    local pid
    for pid in $OTHER_WORKER_PIDS; do stop_pid "$pid" TERM 40; done
    OTHER_WORKER_PIDS=''
    hog_stop
    stop_pid "$NATS_PID" TERM 5
    stop_pid "$VRAM_PID" TERM 3
    SAMPLER_PID='' HOG_PID='' NATS_PID='' VRAM_PID=''
}

# shellcheck disable=SC2034 # RUN_NAME: read by fleet.sh
RUN_DIR='' RUN_NAME='' NATS_PID='' WORKER_PID='' VRAM_PID='' SAMPLER_PID='' SUBMIT_PID='' HOG_PID='' METRICS_ADDR='' OTHER_WORKER_PIDS=''
HOG_PIDS_MORE='' WORKER_ARGS=()
