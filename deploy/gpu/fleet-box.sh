# shellcheck shell=bash
# The two-GPU runs of deploy/gpu/fleet.sh (stage `box`, issue 18: one supervised worker per GPU),
# sourced by fleet.sh after its configs (write_config, calibration, TUNED, WS_CAPPED,
# SPEED_CALIBRATION, BUDGET_CALIBRATION, SIZE, STEPS) and fleet-lib.sh. Needs a machine with two
# GPUs (the nvidia-h200-x2 kind).
#
#   one    one worker on GPU 0 alone (`--gpu 0`, as shotfleet-consumer@0.service runs it): the speed
#          stage's c2-tuned worker (concurrency 2, [cuda.unet] heuristic, SPEED_CALIBRATION at 2
#          steps); BOX_JOBS (32) single-image jobs of SPEED_SIZE x SPEED_SIZE (1024), SPEED_STEPS
#          (30) steps, submitted at once
#   two    `shotfleet-consumer --gpus all`: the same worker on each card under the supervisor;
#          2 x BOX_JOBS of the same jobs. images/s against `one` (issue 18 asks >= 1.9x), and per card
#   mixed  the box under memory pressure on both cards: hog.py on each leaves HOG_KEEP_FREE_GIB (36);
#          each worker the budget stage's mixed-run worker (concurrency 2, WS_CAPPED,
#          BUDGET_CALIBRATION); BOX_MIX_JOBS (400) seeded mixed jobs, MIX_STEPS (4) steps. Admission
#          OOMs per card (must be 0 on both), jobs per card, given back, degraded, failed
#
# Both box runs wait for the box's /readyz to say `ready: 2 of 2`; after each set they keep the
# box's /status (restarts per card: 0 expected) and each worker's metrics (metrics-gpuN.txt); a
# sampler per card around each set (gpu-KEY.json for GPU 0, gpu-KEY-gpu1.json for GPU 1).
#
# The CPU dry run (FLEET_DEVICE=cpu): two simulated cards of SIM_TOTAL_MIB
# (`--gpus sim:SIM_TOTAL_MIB,SIM_TOTAL_MIB`), the simulation's others_used_mib for the hogs
# (pressure_start), every side divided by 8.

BOX_JOBS=${BOX_JOBS:-32}
BOX_MIX_JOBS=${BOX_MIX_JOBS:-400}
if [ "$DEVICE" = cuda ]; then
    BOX_GPUS=all BOX_SET_LIMIT_S=${BOX_SET_LIMIT_S:-150} BOX_MIX_LIMIT_S=${BOX_MIX_LIMIT_S:-300}
    # Worker N is nvidia-smi's card N: --gpu 0 below is the card the box calls gpu0.
    export CUDA_DEVICE_ORDER=PCI_BUS_ID
else
    BOX_GPUS=sim:${SIM_TOTAL_MIB:-4096},${SIM_TOTAL_MIB:-4096} BOX_SET_LIMIT_S=${BOX_SET_LIMIT_S:-90} BOX_MIX_LIMIT_S=${BOX_MIX_LIMIT_S:-150}
fi
BOX_PORTS=()

# box_config FILE TOP TABLES: write_config plus the [supervisor] table: the workers' ports (free
# ones, in BOX_PORTS) and a short first restart.
box_config() {
    BOX_PORTS=("$(free_port)" "$(free_port)")
    write_config "$1" "$2" "$3"$'\n\n[supervisor]\n'"metrics_ports = [${BOX_PORTS[0]}, ${BOX_PORTS[1]}]"$'\nrestart_backoff = "2s"'
}

# box_start CONFIG: the box through worker_start (its port is METRICS_ADDR, SHOTFLEET_BOX_ADDR),
# then both workers ready. 1 when it exits first or is not ready in time; the error is in meta.
box_start() {
    local limit until body
    # shellcheck disable=SC2034 # read by worker_start (fleet-lib.sh)
    WORKER_ARGS=(--gpus "$BOX_GPUS")
    FLEET_WORKER_ID=box worker_start "$1" || { WORKER_ARGS=(); return 1; }
    # shellcheck disable=SC2034
    WORKER_ARGS=()
    limit=$(min_of 300 $(($(left) - 30)))
    until=$((SECONDS + limit))
    while :; do
        body=$(python3 -c 'import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode().splitlines()[0])
except Exception as e:  # noqa: BLE001 - not answering, or 503: not ready
    print(e)' "http://$METRICS_ADDR/readyz" 2> /dev/null)
        case "$body" in "ready: 2 of 2"*) break ;; esac
        if ! worker_alive; then meta error "the box exited before both workers were ready: $body"; return 1; fi
        if [ "$SECONDS" -ge "$until" ]; then meta error "the box had not both workers ready after $limit s: $body"; return 1; fi
        sleep 0.2
    done
    meta box_ready "$(now)"
    box_scrape ready
    log "both workers ready: $(http_body "http://$METRICS_ADDR/readyz" | grep '^gpu' | cut -c1-160 | tr '\n' ';')"
}

http_body() { python3 -c 'import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())
except urllib.error.HTTPError as e:
    print(e.read().decode())
except Exception as e:  # noqa: BLE001
    print(f"no answer: {e}")' "$1" 2> /dev/null; }

# box_scrape LABEL: the box's /status (status-LABEL.json) and each worker's shotfleet_* lines.
box_scrape() {
    local n
    http_body "http://$METRICS_ADDR/status" > "$RUN_DIR/status-$1.json"
    for n in 0 1; do
        { echo "== $1"; http_body "http://127.0.0.1:${BOX_PORTS[$n]}/metrics" | grep -E '^shotfleet_' | grep -v '_bucket{'; } \
            >> "$RUN_DIR/metrics-gpu$n.txt"
    done
}

# box_set KEY LABEL FILE TIMEOUT_S: submit_set with a second sampler on GPU 1, then box_scrape.
box_set() {
    python3 "$GPU_SAMPLER" --index 1 --out "$RUN_DIR/gpu-$1-gpu1.json" > /dev/null 2>&1 < /dev/null &
    local second=$!
    OTHER_WORKER_PIDS="$OTHER_WORKER_PIDS $second"
    submit_set "$@"
    stop_pid "$second" TERM 3
    box_scrape "set-$1"
}

uniform_jobs() {  # NAME JOBS: single images of SIZE x SIZE, STEPS steps, into $WORK/jobs.jsonl
    python3 "$REPO/deploy/gpu/storyboards.py" uniform "$WORK/jobs.jsonl" --run "$1" --set a --jobs "$2" \
        --images 1 --width "$SIZE" --height "$SIZE" --steps "$STEPS" > /dev/null
}

box_one() {
    wanted one || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 20)) ]; then run_skip one "one worker on GPU 0" "$(left) s left"; return 0; fi
    if run_begin one "one worker on GPU 0, the other card idle"; then
        meta top "concurrency = 2"
        meta cuda "$(tr '\n' ';' <<< "$TUNED")"
        write_config "$WORK/one.toml" "concurrency = 2" "$(calibration "$SPEED_CALIBRATION")"$'\n\n'"$TUNED"
        if SHOTFLEET_GPU=0 worker_start "$WORK/one.toml"; then
            uniform_jobs one "$BOX_JOBS"
            submit_set a "$BOX_JOBS jobs x 1 image, one GPU" "$WORK/jobs.jsonl" "$(min_of "$BOX_SET_LIMIT_S" $(($(left) - STOP_S - 10)))"
        fi
    fi
    run_end
}

box_two() {
    local jobs=$((2 * BOX_JOBS))
    wanted two || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 30)) ]; then run_skip two "one worker per GPU, supervised" "$(left) s left"; return 0; fi
    if run_begin two "shotfleet-consumer --gpus $BOX_GPUS: one worker per GPU"; then
        meta top "concurrency = 2"
        meta cuda "$(tr '\n' ';' <<< "$TUNED")"
        meta gpus "$BOX_GPUS"
        box_config "$WORK/two.toml" "concurrency = 2" "$(calibration "$SPEED_CALIBRATION")"$'\n\n'"$TUNED"
        if box_start "$WORK/two.toml"; then
            uniform_jobs two "$jobs"
            box_set a "$jobs jobs x 1 image, two GPUs" "$WORK/jobs.jsonl" "$(min_of "$BOX_SET_LIMIT_S" $(($(left) - STOP_S - 10)))"
        fi
    fi
    run_end
}

# The hogs: on the GPU one per card (hog_start DEVICE), on the CPU the simulation's others_used_mib.
box_mixed() {
    local timeout
    wanted mixed || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 100)) ]; then run_skip mixed "the box under memory pressure" "$(left) s left"; return 0; fi
    if run_begin mixed "the box under memory pressure on both cards"; then
        pressure_start
        if [ "$DEVICE" = cuda ]; then
            hog_start "${HOG_KEEP_FREE_GIB:-36}" 1 || log "no hog on GPU 1: the run goes on with the whole card (recorded)"
        fi
        meta top "concurrency = 2"
        meta cuda "$(tr '\n' ';' <<< "$TUNED"$'\n'"$WS_CAPPED")"
        meta gpus "$BOX_GPUS"
        SIM_OTHERS=$PRESSURE_SIM_MIB box_config "$WORK/mixed.toml" "concurrency = 2" \
            "$(calibration "$BUDGET_CALIBRATION" 2)"$'\n\n'"$TUNED"$'\n'"$WS_CAPPED"
        if box_start "$WORK/mixed.toml"; then
            python3 "$REPO/deploy/gpu/storyboards.py" mixed "$WORK/jobs.jsonl" --run box-mixed --set m --jobs "$BOX_MIX_JOBS" \
                --steps "${MIX_STEPS:-4}" --scale "$SCALE" | tee -a "$RUN_DIR/storyboard.txt"
            timeout=$(min_of "$BOX_MIX_LIMIT_S" $(($(left) - STOP_S - 10)))
            [ "$timeout" -ge 20 ] || timeout=20
            box_set m "$BOX_MIX_JOBS mixed jobs, ${MIX_STEPS:-4} steps, both cards under pressure" "$WORK/jobs.jsonl" "$timeout"
        fi
    fi
    run_end
    hog_stop
}

stage_box() {
    box_one
    box_two
    box_mixed
}
