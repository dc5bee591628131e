# shellcheck shell=bash
# The small-card runs of deploy/gpu/fleet.sh (stage `small`, issue 19), sourced by fleet.sh after
# its configs (write_config, calibration, TUNED, WS_CAPPED, BUDGET_CALIBRATION) and fleet-lib.sh.
#
#   card-N     N in SMALL_CARDS_MIB (GPU: 8192 12288 24576): the mixed run's worker (concurrency 2,
#              the tuned [cuda] tables, the budget stage's calibration, default [budget]) with
#              [budget] max_mib = N: a card of N MiB, alone in its fleet. The seeded mixed storyboard
#              (SMALL_JOBS 200, MIX_STEPS 2), every job awaited (CARD_LIMIT_S): a job of a class the
#              card does not hold is sent down the degrade ladder by the worker once it waited
#              [degrade] handoff (no live worker holds it), so every job ends done, degraded or
#              failed. A worker that holds nothing exits 78 at start: recorded with its reason. An
#              entry N:TAG:MODEL renders MODEL (e.g. 8192:q4:/root/sdxl-q4, the 4-bit UNet) in run
#              card-N-TAG; SMALL_TAG with FLEET_MODEL does the same for every entry. FLEET_RUNS
#              `cards` names them all.
#   pair       two workers on one card and one NATS server: max_mib PAIR_SMALL_MIB (12288) and
#              PAIR_BIG_MIB (default the rest of the card less PAIR_SLACK_MIB, 1024), both the card
#              runs' worker; the same 200 mixed jobs, awaited. PAIR_SMALL_FAULTS (TOML keys of a
#              [faults] table, e.g. "arena_limit_mib = 2400") with PAIR_SMALL_CALIBRATION (shapes,
#              e.g. 256x256x1,384x384x1,512x512x1) make the small one run out of memory for real on
#              sizes its budget admits from probes below them: what it gives back after a real
#              out-of-memory, and who renders that. If the small one holds nothing (exit 78), it starts
#              again with PAIR_FALLBACK_MIB (24576), recorded. Worker ids fleet/small, fleet/big.
#   SMALL_PARALLEL=1  the card runs and the pair at once, each its own fleet (NATS server, store,
#              state, ports, memory sampler in its run folder) sharing the card: the shares are what
#              keeps them apart ([budget] max_mib), so the pair needs PAIR_BIG_MIB. SMALL_INTRA_THREADS
#              sets each worker's intra_threads (the CPU's cores shared between the workers whose
#              text encoders run there).
#   long-a, long-b  the 1,000-job mixed run (LONG_JOBS 1000), half each (one call each; LONG_PARTS
#              cuts it in up to 6 parts, long-a .. long-f, for side by side runs): the fused
#              UNet (LONG_MODEL, default the stage's model) under the hog (HOG_KEEP_FREE_GIB 36 left),
#              concurrency 1 and [budget] cold_renders = true, so every job's `observed peak` line is
#              its own (live predicted against observed per shape), LONG_STEPS (1) steps. FLEET_RUNS
#              `long` names both. With LONG_SHARE_MIB (e.g. 36864, the room the hog leaves) the
#              pressure is a share of the card ([budget] max_mib) instead of the hog, and with
#              SMALL_PARALLEL=1 the two halves then run side by side with the card runs, each a fleet
#              of one worker: they start once LONG_READY (a file "RC SECONDS", lease.sh's
#              optimize.rc: the fused UNet's maker has ended) says 0 and the pair has ended (its
#              shares and the halves' would not fit the card together).
#
# The CPU dry run scales the shares to the tiny model: SMALL_CARDS_MIB 150 300 1024 (no room at
# all beside the models, room for no class's largest image, room for xs), pair 1024 and the rest
# of SIM_TOTAL_MIB.

if [ "$DEVICE" = cuda ]; then
    SMALL_CARDS_MIB=${SMALL_CARDS_MIB:-8192 12288 24576}
    PAIR_SMALL_MIB=${PAIR_SMALL_MIB:-12288} PAIR_FALLBACK_MIB=${PAIR_FALLBACK_MIB:-24576}
    CARD_LIMIT_S=${CARD_LIMIT_S:-200} PAIR_LIMIT_S=${PAIR_LIMIT_S:-240}
else
    SMALL_CARDS_MIB=${SMALL_CARDS_MIB:-150 300 1024}
    PAIR_SMALL_MIB=${PAIR_SMALL_MIB:-1024} PAIR_FALLBACK_MIB=${PAIR_FALLBACK_MIB:-1536}
    CARD_LIMIT_S=${CARD_LIMIT_S:-60} PAIR_LIMIT_S=${PAIR_LIMIT_S:-90}
fi

# small_config FILE TOP BUDGET_KEYS [CALIBRATION [TABLES]]: the mixed run's worker (tuned [cuda]
# tables, the budget stage's calibration or CALIBRATION) with TOP keys, a [budget] table of
# BUDGET_KEYS and TABLES after it; SMALL_INTRA_THREADS joins the top keys.
small_config() {
    local top=$2 tables
    [ -n "${SMALL_INTRA_THREADS:-}" ] && top+=$'\n'"intra_threads = $SMALL_INTRA_THREADS"
    tables="$(calibration "${4:-$BUDGET_CALIBRATION}" 2)"$'\n\n'"$TUNED"$'\n'"$WS_CAPPED"$'\n\n[budget]\n'"$3"
    [ -n "${5:-}" ] && tables+=$'\n\n'"$5"
    write_config "$1" "$top" "$tables"
}

served_classes() {  # ADDR: the classes the worker's /readyz says it serves, comma separated
    python3 - "http://$1/readyz" << 'EOF' 2> /dev/null
import sys, urllib.error, urllib.request
try:
    body = urllib.request.urlopen(sys.argv[1], timeout=3).read().decode()
except urllib.error.HTTPError as e:
    body = e.read().decode()
except Exception:  # noqa: BLE001 - no answer: nothing served
    body = ""
print(",".join(line.split(":")[0] for line in body.splitlines() if ": served" in line))
EOF
}

card_total_mib() {  # the card's memory, MiB (the simulation's on the CPU)
    if [ "$DEVICE" = cpu ]; then echo "${SIM_TOTAL_MIB:-4096}"; return; fi
    nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "${SHOTFLEET_GPU:-0}" 2> /dev/null | head -n 1 | tr -d ' '
}

# mixed_jobs NAME JOBS STEPS [ARGS...]: the seeded mixed storyboard into $WORK/jobs.jsonl
mixed_jobs() {
    local name=$1 jobs=$2 steps=$3
    shift 3
    python3 "$REPO/deploy/gpu/storyboards.py" mixed "$WORK/jobs.jsonl" --run "$name" --set m --jobs "$jobs" \
        --steps "$steps" --scale "$SCALE" "$@" | tee -a "$RUN_DIR/storyboard.txt"
}

# The seconds the runs after this one keep back (the ones FLEET_RUNS names; none when they run
# beside it).
kept_for_later() {
    local after=$1 s=0
    if [ "${SMALL_PARALLEL:-0}" = 1 ]; then echo 0; return; fi
    case "$after" in
        cards) wanted pair && s=$((s + PAIR_LIMIT_S + 60)) ;;
    esac
    echo "$s"
}

# Runs side by side (SMALL_PARALLEL=1): each run's own memory sampler of its worker, in its folder
# (the stage's sampler follows one worker at a time).
run_sampler_start() {
    RUN_SAMPLER_PID=''
    [ "${SMALL_PARALLEL:-0}" = 1 ] || return 0
    echo > "$WORK/worker.pid"
    vram_sampler "$RUN_DIR/vram.csv" "$WORK/worker.pid" "$BASHPID" > /dev/null 2>> "$RUN_DIR/vram.err" < /dev/null &
    RUN_SAMPLER_PID=$!
}

run_sampler_stop() {
    stop_pid "$RUN_SAMPLER_PID" TERM 3
    RUN_SAMPLER_PID=''
}

card_run_name() {  # ENTRY (MIB or MIB:TAG:MODEL) -> card-MIB[-TAG]
    local mib tag model
    IFS=: read -r mib tag model <<< "$1"
    tag=${tag:-${SMALL_TAG:-}}
    echo "card-$mib${tag:+-$tag}"
}

small_card() {  # MIB or MIB:TAG:MODEL
    local mib tag model name classes timeout
    IFS=: read -r mib tag model <<< "$1"
    model=${model:-$MODEL} name=$(card_run_name "$1")
    wanted cards || wanted "$name" || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 30)) ]; then run_skip "$name" "a $mib MiB share" "$(left) s left"; return 0; fi
    if run_begin "$name" "a $mib MiB share of the card"; then
        run_sampler_start
        meta max_mib "$mib"
        meta model "$model"
        meta top "concurrency = 2"
        meta cuda "$(tr '\n' ';' <<< "$TUNED"$'\n'"$WS_CAPPED")"
        [ "${SMALL_PARALLEL:-0}" = 1 ] && meta parallel "the other card runs and the pair shared the card meanwhile"
        small_config "$WORK/$name.toml" "concurrency = 2" "max_mib = $mib"
        if MODEL=$model worker_start "$WORK/$name.toml"; then
            classes=$(served_classes "$METRICS_ADDR")
            meta served "$classes"
            mixed_jobs "$name" "${SMALL_JOBS:-200}" "${MIX_STEPS:-2}"
            timeout=$(min_of "$CARD_LIMIT_S" $(($(left) - STOP_S - $(kept_for_later cards))))
            [ "$timeout" -ge 20 ] || timeout=20
            # Every job, awaited: those of classes the card does not hold end degraded (or failed
            # below their floor) once the worker finds that no live worker holds them.
            submit_set m "the mixed jobs, every one awaited (${MIX_STEPS:-2} steps)" "$WORK/jobs.jsonl" "$timeout"
            "$BIN_DIR/shotfleet" status > "$RUN_DIR/status.txt" 2>&1 < /dev/null
        fi
    fi
    run_end
    run_sampler_stop
}

# pair_small_start MIB: the pair's small worker, in $RUN_DIR/small (its own meta.txt, worker.toml,
# worker.log), through worker_start with its variables set aside: SMALL_PID and SMALL_ADDR after.
# PAIR_SMALL_ARENA_MIB caps its arena below what its budget believes (on the GPU [faults]
# arena_limit_mib, on the CPU cpu_arena_max_mib), PAIR_SMALL_CALIBRATION sets its probes.
pair_small_start() {
    local outer=$RUN_DIR outer_addr=$METRICS_ADDR rc=0 top="concurrency = 2" tables=''
    RUN_DIR=$outer/small
    rm -rf "$RUN_DIR"
    mkdir -p "$RUN_DIR"
    meta max_mib "$1"
    if [ -n "${PAIR_SMALL_ARENA_MIB:-}" ]; then
        meta arena_limit_mib "$PAIR_SMALL_ARENA_MIB"
        if [ "$DEVICE" = cuda ]; then
            tables=$'[faults]\n'"arena_limit_mib = $PAIR_SMALL_ARENA_MIB"
        else
            top+=$'\n'"cpu_arena_max_mib = $PAIR_SMALL_ARENA_MIB"
        fi
    fi
    [ -n "${PAIR_SMALL_CALIBRATION:-}" ] && meta calibration "$PAIR_SMALL_CALIBRATION"
    small_config "$WORK/pair-small.toml" "$top" "max_mib = $1" "${PAIR_SMALL_CALIBRATION:-}" "$tables"
    FLEET_WORKER_ID=fleet/small worker_start "$WORK/pair-small.toml" || rc=$?
    SMALL_PID=$WORKER_PID SMALL_ADDR=$METRICS_ADDR
    OTHER_WORKER_PIDS="$OTHER_WORKER_PIDS $SMALL_PID"
    WORKER_PID='' RUN_DIR=$outer METRICS_ADDR=$outer_addr
    return "$rc"
}

pair_small_stop() {
    local outer=$RUN_DIR outer_addr=$METRICS_ADDR outer_pid=$WORKER_PID
    RUN_DIR=$outer/small WORKER_PID=$SMALL_PID METRICS_ADDR=$SMALL_ADDR
    [ -n "$WORKER_PID" ] && scrape_metrics end
    worker_stop
    RUN_DIR=$outer WORKER_PID=$outer_pid METRICS_ADDR=$outer_addr SMALL_PID=''
    OTHER_WORKER_PIDS=''
}

small_pair() {
    local total big timeout
    wanted pair || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 60)) ]; then run_skip pair "two workers on one card" "$(left) s left"; return 0; fi
    if run_begin pair "two workers on one card: a small share and the rest"; then
        run_sampler_start
        total=$(card_total_mib)
        meta card_total_mib "$total"
        SMALL_PID='' SMALL_ADDR=''
        if ! pair_small_start "$PAIR_SMALL_MIB"; then
            if [ "$(meta_get "$RUN_DIR/small" worker_exit)" = 78 ]; then
                log "the $PAIR_SMALL_MIB MiB worker holds nothing (exit 78): the pair runs with $PAIR_FALLBACK_MIB MiB"
                meta small_holds_nothing_at_mib "$PAIR_SMALL_MIB"
                mv "$RUN_DIR/small" "$RUN_DIR/small-$PAIR_SMALL_MIB"
                pair_small_start "$PAIR_FALLBACK_MIB"
            fi
        fi
        # PAIR_BIG_MIB, or the rest of the card; where its size cannot be read, the whole card (the
        # small one's usage then shows in what the card has free).
        big=${PAIR_BIG_MIB:-}
        [ -z "$big" ] && [ -n "$total" ] && big=$((total - $(meta_get "$RUN_DIR/small" max_mib) - ${PAIR_SLACK_MIB:-1024}))
        meta big_max_mib "${big:-whole card}"
        small_config "$WORK/pair-big.toml" "concurrency = 2" "${big:+max_mib = $big}"
        [ -n "$SMALL_PID" ] || meta error "the small worker did not start: $(meta_get "$RUN_DIR/small" error)"
        if [ -n "$SMALL_PID" ] && FLEET_WORKER_ID=fleet/big worker_start "$WORK/pair-big.toml"; then
            meta served_small "$(served_classes "$SMALL_ADDR")"
            meta served_big "$(served_classes "$METRICS_ADDR")"
            mixed_jobs pair "${SMALL_JOBS:-200}" "${MIX_STEPS:-2}" > /dev/null
            timeout=$(min_of "$PAIR_LIMIT_S" $(($(left) - STOP_S - 10)))
            submit_set m "${SMALL_JOBS:-200} mixed jobs, both workers (${MIX_STEPS:-2} steps)" "$WORK/jobs.jsonl" "$timeout"
        fi
        pair_small_stop
    fi
    run_end
    run_sampler_stop
}

# in_own_work DIR CMD...: CMD with WORK set to DIR for it and all it calls.
in_own_work() {
    local WORK=$1
    shift
    mkdir -p "$WORK"
    "$@"
}

# The card runs and the pair side by side (SMALL_PARALLEL=1), each in a subshell of its own with
# its own WORK (NATS, state, store, worker.pid); their lines reach this log marked with the run.
small_parallel() {
    local pids=() entry name half pair_pid='' base=$WORK
    for entry in $SMALL_CARDS_MIB pair; do
        if [ "$entry" = pair ]; then
            name=pair
            wanted pair || continue
        else
            name=$(card_run_name "$entry")
            wanted cards || wanted "$name" || continue
        fi
        if [ "$entry" = pair ]; then
            (in_own_work "$base/$name" small_pair) > >(sed -u "s/^/[$name] /") 2>&1 &
            pair_pid=$!
        else
            (in_own_work "$base/$name" small_card "$entry") > >(sed -u "s/^/[$name] /") 2>&1 &
        fi
        pids+=($!)
        sleep 2 # free_port picks the runs' ports one run at a time
    done
    if long_beside; then
        for half in $(long_parts); do
            wanted long || wanted "long-$half" || continue
            (in_own_work "$base/long-$half" small_long "$half" $pair_pid) > >(sed -u "s/^/[long-$half] /") 2>&1 &
            pids+=($!)
        done
    fi
    [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
    return 0
}

# The halves of the long run beside the card runs (SMALL_PARALLEL=1 with LONG_SHARE_MIB), not after them.
long_beside() { [ "${SMALL_PARALLEL:-0}" = 1 ] && [ -n "${LONG_SHARE_MIB:-}" ]; }

# The long run's parts, a letter each: LONG_PARTS (2, at most 6) slices of its jobs.
long_parts() {
    local letters=abcdef parts=${LONG_PARTS:-2}
    case "$parts" in
        [1-6]) echo "${letters:0:$parts}" | grep -o . ;;
        *) echo "LONG_PARTS must be 1 to 6, not '$parts'" >&2; return 2 ;;
    esac
}

# long_wait PID...: until LONG_READY (if set) says 0 and the PIDs have ended. Prints why not and
# returns 1 when the model's maker failed or the deadline would leave a half no room.
long_wait() {
    local rc pid ready
    while :; do
        ready=1
        if [ -n "${LONG_READY:-}" ]; then
            if [ -f "$LONG_READY" ]; then
                read -r rc _ < "$LONG_READY"
                [ "$rc" = 0 ] || { echo "the model's maker failed (exit $rc in $LONG_READY)"; return 1; }
            else
                ready=0
            fi
        fi
        for pid in "$@"; do kill -0 "$pid" 2> /dev/null && ready=0; done
        [ "$ready" = 1 ] && return 0
        if [ "$(left)" -lt $((RUN_MIN_S + 100)) ]; then
            echo "still waiting for ${LONG_READY:-the runs before it} with $(left) s left"
            return 1
        fi
        sleep 2
    done
}

small_long() {  # a|b|...: one part of the 1,000-job run (LONG_PARTS of them), once the PIDs ended
    local half=$1 name=long-$1 jobs=${LONG_JOBS:-1000} model=${LONG_MODEL:-$MODEL} slice timeout why t0=$SECONDS
    local budget="cold_renders = true" parts=${LONG_PARTS:-2} index
    wanted long || wanted "$name" || return 0
    shift
    index=$(( $(printf '%d' "'$half") - $(printf '%d' "'a") ))
    slice=$((index * jobs / parts)):$(((index + 1) * jobs / parts))
    if ! why=$(long_wait "$@"); then run_skip "$name" "1,000 mixed jobs, part $half" "$why"; return 0; fi
    # The parts become ready together: free_port picks their ports one at a time.
    long_beside && sleep $((3 * index))
    if [ "$(left)" -lt $((RUN_MIN_S + 100)) ]; then run_skip "$name" "1,000 mixed jobs, part $half" "$(left) s left"; return 0; fi
    if run_begin "$name" "the 1,000-job mixed run under memory pressure, jobs $slice"; then
        run_sampler_start
        meta waited_s $((SECONDS - t0))
        PRESSURE_SIM_MIB=0
        if [ -n "${LONG_SHARE_MIB:-}" ]; then
            meta share_mib "$LONG_SHARE_MIB"
            budget+=$'\n'"max_mib = $LONG_SHARE_MIB"
        else
            pressure_start
        fi
        long_beside && meta parallel "the card runs and the other parts shared the card meanwhile"
        meta model "$model"
        meta top "concurrency = 1"
        meta cuda "$(tr '\n' ';' <<< "$TUNED"$'\n'"$WS_CAPPED")"
        meta slice "$slice"
        SIM_OTHERS=$PRESSURE_SIM_MIB small_config "$WORK/$name.toml" "concurrency = 1" "$budget"
        if MODEL=$model worker_start "$WORK/$name.toml"; then
            mixed_jobs long "$jobs" "${LONG_STEPS:-1}" --slice "$slice"
            timeout=$(($(left) - STOP_S - 10))
            submit_set m "jobs $slice of $jobs mixed jobs, ${LONG_STEPS:-1} step(s)" "$WORK/jobs.jsonl" "$timeout"
        fi
    fi
    run_end
    hog_stop
    run_sampler_stop
}

stage_small() {
    local entry
    if [ "${SMALL_PARALLEL:-0}" = 1 ]; then
        small_parallel
    else
        for entry in $SMALL_CARDS_MIB; do small_card "$entry"; done
        small_pair
    fi
    long_beside && return 0
    local part
    for part in $(long_parts); do small_long "$part"; done
}
