#!/usr/bin/env bash
# The fleet stages of the GPU lease (deploy/gpu/README.md; called by `lease.sh fleet-speed` and
# `lease.sh fleet-budget`): shotfleet-consumer on the GPU with the exported SDXL, fed through a
# local NATS JetStream, one worker process per run, each with its own config.
#
#   bash deploy/gpu/fleet.sh speed|budget|small|see|box|board|storyboard  (from the repository root; lease.sh sets the variables)
#   FLEET_DEVICE=cpu FLEET_MODEL=onnx/tiny/model bash deploy/gpu/fleet.sh speed   (a dry run on the CPU)
#
# speed -> $RESULTS/fleet-speed.json. Runs, in this order (the deadline trims from the end; a run
# that fails is recorded with its error and the next one starts):
#   c1-tuned   concurrency 1, [cuda.unet] conv_algo_search "heuristic"; 16 jobs x 1 image
#   c2-tuned   concurrency 2, the same [cuda.unet]; 16 x 1, then 4 x 4
#   c1-capped  c1-tuned with cuDNN's workspace capped on the UNet and the VAE (WS_CAPPED): its speed cost
#   c2-batch4  concurrency 2, batch_jobs 4, the same [cuda.unet]; 16 x 1 (same size/steps/guidance)
#   c2-batch4-capped  c2-batch4 with WS_CAPPED
#   c1-keep, c2-batch4-keep  c1-tuned, c2-batch4 with [budget] vae_keeps_arena = true (VAE_KEEPS):
#              the cost of the VAE's per-decode arena shrink, the default since the sixth lease
#   c2-unet2, c2-batch4-keep-unet2  c2-tuned's first set, c2-batch4-keep, with a UNet session per
#              slot (`unet_sessions = 2`): the slots' UNet calls at once instead of in turns
#   c3-batch4-keep-unet3  c2-batch4-keep-unet2 at concurrency 3 with three sessions
#   c3-batch8-keep-unet3  the same with batch_jobs 8: UNet batches of 16 with guidance, where the
#              matrix work runs nearer its roof (the profile: 0.92 at batch 8 against 0.86 at 2)
#   c4-batch4-keep-unet4  c3-batch4-keep-unet3 with a fourth slot and session (c2 -> c3 gave +7%
#              steady on the 2026-12-06 fourth-session H100: is there more to fill?)
#   c1-graph   concurrency 1, the same [cuda.unet] plus graph = true; 16 x 1
#   c1-batch4-graph  c2-batch4-keep at concurrency 1 (a captured graph needs it) with graph = true:
#              the UNet's launch gaps (9% of a call, RESULTS.md's profile) closed by replaying a
#              captured graph per shape
#   c1-best    concurrency 1, the UNet benchmark's best: heuristic, fuse_conv_bias, graph; 16 x 1
#   c1-stock   concurrency 1, ONNX Runtime's defaults (both graphs' searches set back to exhaustive); 16 x 1
# All SPEED_SIZE x SPEED_SIZE (1024), SPEED_STEPS (30) steps, guidance 5, submitted at once with
# `shotfleet submit FILE --wait`, gpu_sampler.py around each set.
#
# see -> $RESULTS/see-the-work.json (issue 16; deploy/gpu/see_summary.py): one worker (TUNED); a
#   long job (SEE_SIZE 1024, SEE_IMAGES 4 images, SEE_STEPS 50 steps) and two 1-image jobs behind
#   it, submitted with `submit --wait` (its progress lines, queue positions), `status --watch
#   --project see` beside it; once the long job is past step SEE_CANCEL_AT (10), `shotfleet cancel`
#   of it and of the first job behind it: how long until the fleet answered and until the render
#   stopped (the worker's "cancelled" line); the last job must still render; /metrics in full.
#
# budget -> $RESULTS/budget.json, $RESULTS/budget-check*.jsonl (in the order mixed, oom, check, check-ws,
# check-nopattern):
#   check      `shotfleet-consumer --check-budget SHAPES` (no NATS): predicted vs observed peaks,
#              with cuDNN's workspace on ONNX Runtime's default (as much as the card has)
#   check-ws   the same with conv_max_workspace = false on the UNet and the VAE (WS_CAPPED): cuDNN's
#              search and algorithms held to 32 MiB of workspace. (The fourth lease ran check-vae,
#              the VAE alone: no peak changed, so the UNet's workspace is the next suspect.)
#   check-nopattern  the same with mem_pattern = false on the UNet and the VAE (NO_PATTERN): ONNX
#              Runtime allocating tensor by tensor on every run, not one planned block from the
#              second run of a shape on; do a new size's first renders stop costing more, and
#              what does it cost (the rows' again_ms against check's)?
#   mixed      hog.py holds all but HOG_KEEP_FREE_GIB (36) of the card; a worker at concurrency 2,
#              classes xs..l, default [budget], WS_CAPPED; MIX_JOBS (200) seeded jobs of 512..1536 px, 1-4
#              images, MIX_STEPS (4) steps, p0/p1/p2 (storyboards.py mixed); then the hog stops
#   oom        concurrency 1, [faults] arena_limit_mib = OOM_ARENA_MIB (6144): one 1536x1536 x 4
#              job (4 steps) that really runs out of memory, then 3 jobs 768x768 x 1 that the
#              same process must still serve
# The check and the mixed run calibrate on the mixed run's sizes (BUDGET_CALIBRATION) at 2 steps; all three
# use the tuned [cuda] options of the speed runs (what an operator would run).
#
# small -> $RESULTS/small.json (issue 19: small cards, two workers on one card, 1,000 mixed jobs
# checked live): the runs card-N, pair, long-a, long-b of deploy/gpu/fleet-small.sh (its header).
#
# box -> $RESULTS/box.json (issue 18, two GPUs: one supervised worker per GPU): the runs one, two,
# mixed of deploy/gpu/fleet-box.sh (its header).
# storyboard -> $RESULTS/storyboard.json (issue 17, point 3: the mixed storyboard from a cold worker,
# the shots onnx/bench_storyboard.py renders through diffusers): deploy/gpu/fleet-storyboard.sh.
# board -> $RESULTS/lora-board.json (issue 14: 48 shots over 4 LoRA characters, grouped by set vs
# --no-group, images/s and switches): the runs board, board-small of deploy/gpu/fleet-board.sh (its
# header); FLEET_MODEL must be prepared for LoRAs (lease.sh fleet-board: $ROOT/sdxl-lora).
#
# The CPU dry run (FLEET_DEVICE=cpu, tiny model): every side divided by 8 (1024 -> 128, 64..192
# px), SPEED_STEPS 8, no [cuda.*] table, a simulated card ([budget.simulate] total_mib SIM_TOTAL_MIB)
# whose others_used_mib (SIM_OTHERS_MIB) stands in for the hog, and cpu_arena_max_mib
# (CPU_ARENA_MIB) for the CUDA arena cap.
#
# Inputs (lease.sh sets the first group): BIN_DIR, MODEL_DIR, NATS_SERVER, SHOTFLEET_DEVICE, RESULTS,
# OUT, GPU_SAMPLER, FLEET_DEADLINE_S (it must end within: runs are skipped or cut to fit).
# Knobs: FLEET_DEVICE, FLEET_MODEL, FLEET_CONFIG (deploy/gpu/fleet.toml), FLEET_WORK (scratch;
# cuda /root/fleet-work, cpu a temp folder), FLEET_RUNS (speed runs to do, comma list; default
# all ten; budget: mixed,oom,check,check-ws,check-nopattern), SPEED_JOBS (16), SPEED_BATCH_JOBS (4), SPEED_BATCH_IMAGES (4), and those named above.
# Figures per run and set: fleet_summary.py's docstring. At most 4 files go to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
REPO=$PWD
T0=$SECONDS
export PYTHONUNBUFFERED=1

STAGE=${1:-}
case "$STAGE" in speed|budget|small|see|box|board|storyboard) ;; *) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;; esac
DEVICE=${FLEET_DEVICE:-${SHOTFLEET_DEVICE:-cuda}}
case "$DEVICE" in cuda|cpu) ;; *) echo "FLEET_DEVICE must be cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
MODEL=${FLEET_MODEL:-${MODEL_DIR:-/root/sdxl}}
case "$MODEL" in /*) ;; *) MODEL=$REPO/$MODEL ;; esac
BASE_CONFIG=${FLEET_CONFIG:-$REPO/deploy/gpu/fleet.toml}
if [ -z "${BIN_DIR:-}" ]; then
    if [ -x .gpu/bin/shotfleet-consumer ]; then BIN_DIR=$REPO/.gpu/bin; else BIN_DIR=${CARGO_TARGET_DIR:-$REPO/target}/release; fi
fi
if [ -z "${NATS_SERVER:-}" ]; then
    for NATS_SERVER in /root/nats-site/bin/nats-server /root/site/bin/nats-server "$REPO/.venv/bin/nats-server"; do
        [ -x "$NATS_SERVER" ] && break
    done
fi
GPU_SAMPLER=${GPU_SAMPLER:-$REPO/deploy/gpu/gpu_sampler.py}
DEADLINE_S=${FLEET_DEADLINE_S:-900}
if [ "$DEVICE" = cuda ]; then
    SCALE=1 STEPS=${SPEED_STEPS:-30}
    WORK=${FLEET_WORK:-/root/fleet-work}
    RUN_MIN_S=${FLEET_RUN_MIN_S:-50}   # a run needs warm-up (~12 s), one set, the worker's stop
    STOP_S=40                          # the worker's grace (30 s) and more, after a set's timeout
else
    SCALE=8 STEPS=${SPEED_STEPS:-8}
    WORK=${FLEET_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/fleet.XXXXXX")}
    RUN_MIN_S=${FLEET_RUN_MIN_S:-15}
    STOP_S=15
fi
SIZE=$((${SPEED_SIZE:-1024} / SCALE))
SPEED_JOBS=${SPEED_JOBS:-16}
case "$STAGE" in
    speed) RUNS=,${FLEET_RUNS:-c1-tuned,c1-capped,c1-keep,c2-tuned,c2-batch4,c2-batch4-capped,c2-batch4-keep,c1-graph,c1-best,c1-stock}, ;;
    budget) RUNS=,${FLEET_RUNS:-mixed,oom,check,check-ws,check-nopattern}, ;;
    small) RUNS=,${FLEET_RUNS:-cards,pair,long}, ;;
    see) RUNS=,see, ;;
    box) RUNS=,${FLEET_RUNS:-one,two,mixed}, ;;
    board) RUNS=,${FLEET_RUNS:-board,board-small}, ;;
    storyboard) RUNS=,${STORY_RUNS:-storyboard,storyboard-stored}, ;;
esac
RESULTS=${RESULTS:-$WORK/results}
OUT=${OUT:-$RESULTS}
STAGE_DIR=$RESULTS/fleet-$STAGE
mkdir -p "$RESULTS" "$OUT" "$WORK" || exit 1
if { [ "$STAGE" = small ] || [ "$STAGE" = box ]; } && [ -d "$STAGE_DIR" ]; then
    # The small and box stages' runs span calls (long-a in one, long-b in the next): their folders stay,
    # the last call's memory samples are set aside (fleet_summary.py reads every vram*.csv).
    [ -f "$STAGE_DIR/vram.csv" ] && mv "$STAGE_DIR/vram.csv" "$STAGE_DIR/vram-$(date +%s).csv"
    rm -f "$STAGE_DIR/meta.txt"
else
    rm -rf "$STAGE_DIR"
fi
mkdir -p "$STAGE_DIR" || exit 1
# shellcheck source=deploy/gpu/fleet-lib.sh
source "$REPO/deploy/gpu/fleet-lib.sh"

# --- worker configs -----------------------------------------------------------------------------
px() { echo $(($1 / SCALE)); }   # a side at SDXL scale -> this device's
wanted() { case "$RUNS" in *",$1,"*) return 0 ;; *) return 1 ;; esac; }   # FLEET_RUNS names it

shapes_arg() {  # "512x512x1,768x768x1" with the sides scaled, for --check-budget
    local out='' s w h n
    IFS=, read -r -a list <<< "$1"
    for s in "${list[@]}"; do
        IFS=x read -r w h n <<< "$s"
        out+="${out:+,}$(px "$w")x$(px "$h")x$n"
    done
    echo "$out"
}

shapes_toml() {  # the same list as TOML: [[512, 512, 1], [768, 768, 1]] (sides scaled)
    echo "[$(shapes_arg "$1" | sed -E 's/([0-9]+)x([0-9]+)x([0-9]+)/[\1, \2, \3]/g; s/\],\[/], [/g')]"
}

# write_config FILE TOP TABLES: TOP (top-level keys) before fleet.toml, TABLES after it. On the
# CPU: device "cpu", no [cuda.*] or [faults] arena cap, a simulated card (others_used_mib from
# SIM_OTHERS, set per run) and a degrade floor at the tiny model's scale.
write_config() {
    local file=$1 top=$2 tables=$3
    # A run that names no UNet sessions keeps one, the baseline of every lease's figures (the
    # worker's default, "auto", gives a large card one per slot).
    grep -q '^unet_sessions' <<< "$top" || top=${top:+$top$'\n'}"unet_sessions = 1"
    if [ "$DEVICE" = cpu ]; then
        tables=$(awk '/^\[cuda[].]/ {skip = 1; next} /^\[/ {skip = 0} !skip' <<< "$tables")
        # A run's own [budget] keys (e.g. vae_keeps_arena) join the dry run's in one table.
        local budget_keys
        budget_keys=$(awk '/^\[budget\]/ {on = 1; next} /^\[/ {on = 0} on && NF' <<< "$tables")
        tables=$(awk '/^\[budget\]/ {skip = 1; next} /^\[/ {skip = 0} !skip' <<< "$tables")
        tables+=$'\n'"[budget]"$'\n'"reserve_mib = 64"$'\n'"margin_mib = 64"
        [ -n "$budget_keys" ] && tables+=$'\n'"$budget_keys"
        tables+=$'\n\n'"[budget.simulate]"$'\n'"total_mib = ${SIM_TOTAL_MIB:-4096}"$'\n'"others_used_mib = ${SIM_OTHERS:-0}"
        tables+=$'\n\n'"[degrade]"$'\n'"min_side = 64"
    fi
    {
        echo "# fleet.sh run $RUN_NAME ($DEVICE): top-level keys, then $(basename "$BASE_CONFIG"), then the run's tables"
        [ -n "$top" ] && echo "$top"
        if [ "$DEVICE" = cpu ]; then sed 's/^device = "cuda"/device = "cpu"/' "$BASE_CONFIG"; else cat "$BASE_CONFIG"; fi
        echo
        echo "$tables"
    } > "$file"
}

calibration() {  # SHAPES [STEPS [COLD]]: COLD false runs the probes back to back without shrinking
    printf '[calibration]\nshapes = %s\nsteps = %s\ncold = %s\n' "$(shapes_toml "$1")" "${2:-2}" "${3:-true}"
}

SPEED_CALIBRATION=512x512x1,768x768x1,1024x1024x1,1024x1024x2
# Every size the mixed run serves (storyboards.py MIXED_SIZES) at one image, plus the batch probes
# (768x768 x 4, 1024x1024 x 2, 1536x1536 x 2: the batch terms, which grow with the square of the
# tokens where attention is not fused): a probed size's offset from the model carries to its other
# image counts, which the check's 1152x896 x 2 and 896x1152 x 3 then test.
BUDGET_CALIBRATION=${BUDGET_CALIBRATION:-512x512x1,640x768x1,768x768x1,768x768x4,896x1152x1,1152x896x1,1024x1024x1,1024x1024x2,1280x1280x1,1536x1536x1,1536x1536x2}
# fuse_conv_bias is left out: with it a worker died of an illegal memory access on the first
# budget lease (2026-11-30, 13:22) once shapes changed; it was measured at one fixed shape only.
# UNET_TUNING: more [cuda.unet] keys for every run of the call, e.g. `attention = "flash"` once
# `lease.sh tune` has timed ONNX Runtime's attention kernels (its `opt:sdpa_kernel=N` variants).
TUNED=$'[cuda.unet]\nconv_algo_search = "heuristic"'${UNET_TUNING:+$'\n'"$UNET_TUNING"}
# The VAE's cuDNN search capped at 32 MiB of workspace. First renders of new shapes peak over the
# estimate (+39% to +61% at 1152x896); capping the VAE alone changed no peak (fourth lease), so
# WS_CAPPED caps the UNet's too: it continues TUNED's [cuda.unet] table.
VAE_SAFE=$'[cuda.vae]\nconv_max_workspace = false'
WS_CAPPED=$'conv_max_workspace = false\n\n'"$VAE_SAFE"
# ONNX Runtime's memory patterns off on both graphs (it continues TUNED's [cuda.unet] table).
NO_PATTERN=$'mem_pattern = false\n\n[cuda.vae]\nmem_pattern = false'
# The VAE decoder keeping its arena between decodes, as before the sixth lease: what the
# per-decode shrink (the default) costs in images/s.
VAE_KEEPS=$'[budget]\nvae_keeps_arena = true'

# --- speed --------------------------------------------------------------------------------------
# speed_run NAME LABEL TOP CUDA_TABLE SET...: SET is KEY:JOBSxIMAGES (e.g. a:16x1).
speed_run() {
    local name=$1 label=$2 top=$3 cuda=$4 set key jobs images timeout
    shift 4
    wanted "$name" || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 10)) ]; then
        run_skip "$name" "$label" "$(left) s left before the deadline, a run needs $((RUN_MIN_S + 10))"
        return 0
    fi
    if run_begin "$name" "$label"; then
        meta top "$(tr '\n' ';' <<< "$top")"
        [ -n "$cuda" ] && meta cuda "$(tr '\n' ';' <<< "$cuda")"
        write_config "$WORK/$name.toml" "$top" "$(calibration "$SPEED_CALIBRATION")"$'\n\n'"$cuda"
        if worker_start "$WORK/$name.toml"; then
            for set in "$@"; do
                key=${set%%:*} jobs=${set#*:} images=${jobs#*x} jobs=${jobs%x*}
                timeout=$(($(left) - STOP_S - 10))
                if [ "$timeout" -lt 15 ]; then
                    meta "set_${key}_skipped" "$(left) s left"
                    log "set $key skipped: $(left) s left"
                    continue
                fi
                python3 "$REPO/deploy/gpu/storyboards.py" uniform "$WORK/jobs.jsonl" --run "$name" --set "$key" \
                    --jobs "$jobs" --images "$images" --width "$SIZE" --height "$SIZE" --steps "$STEPS" > /dev/null
                submit_set "$key" "$jobs jobs x $images image(s)" "$WORK/jobs.jsonl" "$timeout"
                worker_alive || break
            done
        fi
    fi
    run_end
}

stage_speed() {
    local b_jobs=${SPEED_BATCH_JOBS:-4} b_images=${SPEED_BATCH_IMAGES:-4}
    speed_run c1-tuned "c1 tuned" "concurrency = 1" "$TUNED" "a:${SPEED_JOBS}x1"
    speed_run c2-tuned "c2 tuned" "concurrency = 2" "$TUNED" "a:${SPEED_JOBS}x1" "b:${b_jobs}x${b_images}"
    speed_run c1-capped "c1 tuned, workspace capped" "concurrency = 1" "$TUNED"$'\n'"$WS_CAPPED" "a:${SPEED_JOBS}x1"
    speed_run c2-batch4 "c2 batch_jobs 4" $'concurrency = 2\nbatch_jobs = 4' "$TUNED" "a:${SPEED_JOBS}x1"
    speed_run c2-batch4-capped "c2 batch_jobs 4, workspace capped" $'concurrency = 2\nbatch_jobs = 4' \
        "$TUNED"$'\n'"$WS_CAPPED" "a:${SPEED_JOBS}x1"
    speed_run c1-keep "c1 tuned, VAE keeps its arena" "concurrency = 1" "$TUNED"$'\n\n'"$VAE_KEEPS" "a:${SPEED_JOBS}x1"
    speed_run c2-batch4-keep "c2 batch_jobs 4, VAE keeps its arena" $'concurrency = 2\nbatch_jobs = 4' \
        "$TUNED"$'\n\n'"$VAE_KEEPS" "a:${SPEED_JOBS}x1"
    speed_run c2-unet2 "c2 tuned, a UNet session per slot" $'concurrency = 2\nunet_sessions = 2' "$TUNED" "a:${SPEED_JOBS}x1"
    speed_run c2-batch4-keep-unet2 "c2 batch_jobs 4, VAE keeps its arena, a UNet session per slot" \
        $'concurrency = 2\nbatch_jobs = 4\nunet_sessions = 2' "$TUNED"$'\n\n'"$VAE_KEEPS" "a:${SPEED_JOBS}x1"
    speed_run c3-batch4-keep-unet3 "c3 batch_jobs 4, VAE keeps its arena, a UNet session per slot" \
        $'concurrency = 3\nbatch_jobs = 4\nunet_sessions = 3' "$TUNED"$'\n\n'"$VAE_KEEPS" "a:${SPEED_JOBS}x1"
    speed_run c3-batch8-keep-unet3 "c3 batch_jobs 8, VAE keeps its arena, a UNet session per slot" \
        $'concurrency = 3\nbatch_jobs = 8\nunet_sessions = 3' "$TUNED"$'\n\n'"$VAE_KEEPS" "a:${SPEED_JOBS}x1"
    speed_run c4-batch4-keep-unet4 "c4 batch_jobs 4, VAE keeps its arena, a UNet session per slot" \
        $'concurrency = 4\nbatch_jobs = 4\nunet_sessions = 4' "$TUNED"$'\n\n'"$VAE_KEEPS" "a:${SPEED_JOBS}x1"
    speed_run c1-graph "c1 cuda graph" "concurrency = 1" "$TUNED"$'\ngraph = true' "a:${SPEED_JOBS}x1"
    speed_run c1-batch4-graph "c1 batch_jobs 4, CUDA graph, VAE keeps its arena" $'concurrency = 1\nbatch_jobs = 4' \
        "$TUNED"$'\ngraph = true\n\n'"$VAE_KEEPS" "a:${SPEED_JOBS}x1"
    speed_run c1-best "c1 best" "concurrency = 1" "$TUNED"$'\nfuse_conv_bias = true\ngraph = true' "a:${SPEED_JOBS}x1"
    speed_run c1-stock "c1 stock" "concurrency = 1" $'[cuda.unet]\nconv_algo_search = "exhaustive"\n\n[cuda.vae]\nconv_algo_search = "exhaustive"' "a:${SPEED_JOBS}x1"
}

# --- budget -------------------------------------------------------------------------------------
CHECK_SHAPES=${CHECK_SHAPES:-512x512x1,768x768x1,1024x1024x1,1024x1024x2,1024x1024x4,1536x1536x1,1536x1536x2,1152x896x2,896x1152x3,768x768x4,512x512x4}

# budget_check NAME LABEL TABLES: --check-budget with the tuned UNet plus TABLES (written right
# after TUNED: keys before any header belong to [cuda.unet]); its lines go to
# $RESULTS/budget-NAME.jsonl.
budget_check() {
    local name=$1 label=$2 extra=$3 limit rc=0 lines
    wanted "$name" || return 0
    lines=$RESULTS/budget-$name.jsonl
    limit=$(min_of "${CHECK_LIMIT_S:-150}" $(($(left) - 20)))
    if [ "$limit" -lt 30 ]; then run_skip "$name" "$label" "$(left) s left"; return 0; fi
    RUN_NAME=$name RUN_DIR=$STAGE_DIR/$name
    mkdir -p "$RUN_DIR" "$WORK/state"
    rm -rf "$WORK/state"/*
    echo "$name" >> "$STAGE_DIR/runs.txt"
    meta label "$label"
    meta shapes "$(shapes_arg "$CHECK_SHAPES")"
    [ -n "$extra" ] && meta cuda "$(tr '\n' ';' <<< "$extra")"
    log "=== run $name: --check-budget $(shapes_arg "$CHECK_SHAPES") (limit $limit s)"
    SIM_OTHERS=0 write_config "$WORK/$name.toml" "" "$(calibration "$BUDGET_CALIBRATION")"$'\n\n'"$TUNED"$'\n'"$extra"
    cp "$WORK/$name.toml" "$RUN_DIR/worker.toml"
    worker_env SHOTFLEET_METRICS_ADDR="127.0.0.1:$(free_port)"
    meta worker_start "$(now)"
    env "${WORKER_ENV[@]}" timeout -k 5 "$limit" "$BIN_DIR/shotfleet-consumer" --config "$RUN_DIR/worker.toml" \
        --check-budget "$(shapes_arg "$CHECK_SHAPES")" > "$lines" 2> "$RUN_DIR/worker.log" < /dev/null &
    WORKER_PID=$!
    echo "$WORKER_PID" > "$WORK/worker.pid"
    wait "$WORKER_PID" || rc=$?
    WORKER_PID=''
    echo > "$WORK/worker.pid"
    meta run_end "$(now)"
    meta exit_code "$rc"
    case "$rc" in
        0) ;;
        1) meta note "a check render failed (exit 1)" ;;
        124|137) meta error "--check-budget ran past $limit s" ;;
        *) meta error "--check-budget exited $rc: $(worker_error "$RUN_DIR/worker.log")" ;;
    esac
    cp "$lines" "$RUN_DIR/budget-check.jsonl"
    log "$name: exit $rc, $(wc -l < "$lines") lines"
    cut -c1-200 "$lines"
    RUN_DIR=''
}

min_of() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

budget_mixed() {
    local jobs=${MIX_JOBS:-200} timeout
    wanted mixed || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 100)) ]; then run_skip mixed "mixed run under memory pressure" "$(left) s left"; return 0; fi
    if run_begin mixed "mixed run under memory pressure"; then
        pressure_start
        meta top "concurrency = 2"
        meta cuda "$(tr '\n' ';' <<< "$TUNED"$'\n'"$WS_CAPPED")"
        SIM_OTHERS=$PRESSURE_SIM_MIB write_config "$WORK/mixed.toml" "concurrency = 2" \
            "$(calibration "$BUDGET_CALIBRATION" 2 "${MIX_COLD:-true}")"$'\n\n'"$TUNED"$'\n'"$WS_CAPPED"
        if worker_start "$WORK/mixed.toml"; then
            python3 "$REPO/deploy/gpu/storyboards.py" mixed "$WORK/jobs.jsonl" --run mixed --set m --jobs "$jobs" \
                --steps "${MIX_STEPS:-4}" --scale "$SCALE" | tee -a "$RUN_DIR/storyboard.txt"
            # What the forced-OOM run needs after this one is kept back.
            timeout=$(($(left) - STOP_S - ${OOM_RESERVE_S:-60} - ${CHECK_RESERVE_S:-110}))
            [ "$timeout" -ge 20 ] || timeout=20
            submit_set m "$jobs mixed jobs, ${MIX_STEPS:-4} steps" "$WORK/jobs.jsonl" "$timeout"
        fi
    fi
    run_end
    hog_stop
}

budget_oom() {
    local pid steps=${MIX_STEPS:-4} top tables='' timeout
    wanted oom || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 20)) ]; then run_skip oom "forced out-of-memory" "$(left) s left"; return 0; fi
    if run_begin oom "forced out-of-memory"; then
        if [ "$DEVICE" = cuda ]; then
            top="concurrency = 1"
            tables="$TUNED"$'\n\n[faults]\n'"arena_limit_mib = ${OOM_ARENA_MIB:-6144}"
            meta arena_limit_mib "${OOM_ARENA_MIB:-6144}"
        else
            top=$'concurrency = 1\n'"cpu_arena_max_mib = ${CPU_ARENA_MIB:-8}"
            meta cpu_arena_max_mib "${CPU_ARENA_MIB:-8}"
        fi
        meta top "$(tr '\n' ';' <<< "$top")"
        # Probes small enough for the capped arena: the budget extrapolates, and admits the big job.
        SIM_OTHERS=0 write_config "$WORK/oom.toml" "$top" \
            "$(calibration "${OOM_CALIBRATION:-512x512x1,768x768x1}" 2 false)"$'\n\n'"$tables"
        if worker_start "$WORK/oom.toml"; then
            pid=$WORKER_PID
            meta pid_before "$pid"
            python3 "$REPO/deploy/gpu/storyboards.py" uniform "$WORK/jobs.jsonl" --run oom --set big --jobs 1 \
                --images 4 --width "$(px 1536)" --height "$(px 1536)" --steps "$steps" > /dev/null
            timeout=$(min_of "${OOM_BIG_LIMIT_S:-240}" $(($(left) - STOP_S - 40 - ${CHECK_RESERVE_S:-110})))
            submit_set big "1 job $(px 1536)x$(px 1536) x 4 images, $steps steps" "$WORK/jobs.jsonl" "$timeout"
            if worker_alive; then
                python3 "$REPO/deploy/gpu/storyboards.py" uniform "$WORK/jobs.jsonl" --run oom --set small --jobs 3 \
                    --images 1 --width "$(px 768)" --height "$(px 768)" --steps "$steps" > /dev/null
                timeout=$(min_of 90 $(($(left) - STOP_S - 5 - ${CHECK_RESERVE_S:-110})))
                submit_set small "3 jobs $(px 768)x$(px 768) x 1 image, $steps steps" "$WORK/jobs.jsonl" "$timeout"
            fi
            meta pid_after "$WORKER_PID"
            if [ "$WORKER_PID" = "$pid" ] && worker_alive; then meta alive_after yes; else meta alive_after no; fi
        fi
    fi
    run_end
}

# The checks last (the mixed run is the point-3 figure that needs the most time); the capped one
# after the default one, so a crash of either leaves the other's rows.
stage_budget() {
    budget_mixed
    budget_oom
    budget_check check "budget check" ""
    budget_check check-ws "budget check, cuDNN workspace capped (UNet and VAE)" "$WS_CAPPED"
    budget_check check-nopattern "budget check, memory patterns off (UNet and VAE)" "$NO_PATTERN"
}

# shellcheck source=deploy/gpu/fleet-small.sh
source "$REPO/deploy/gpu/fleet-small.sh"
# shellcheck source=deploy/gpu/fleet-box.sh
source "$REPO/deploy/gpu/fleet-box.sh"
# shellcheck source=deploy/gpu/fleet-board.sh
source "$REPO/deploy/gpu/fleet-board.sh"
# shellcheck source=deploy/gpu/fleet-storyboard.sh
source "$REPO/deploy/gpu/fleet-storyboard.sh"

# --- see: progress, cancel mid-render, status --watch, metrics (issue 16) ------------------------
see_jobs() {  # FILE: the long job, then two behind it
    python3 - "$1" "$(px "${SEE_SIZE:-1024}")" "${SEE_IMAGES:-4}" "${SEE_STEPS:-50}" << 'EOF'
import json, sys
path, side, images, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def job(job_id, n, s):
    return {"job_id": job_id, "project": "see", "shot_id": job_id.split("-", 1)[1], "priority": "p1",
            "prompt": "a lighthouse keeper at dawn, ink wash", "width": side, "height": side,
            "steps": s, "guidance": 5.0, "seed": 7, "images": n}
with open(path, "w") as f:
    for j in (job("see-long", images, steps), job("see-q1", 1, 20), job("see-q2", 1, 20)):
        f.write(json.dumps(j) + "\n")
EOF
}

see_step_reached() {  # WATCH_FILE STEP: status --watch printed the long job past STEP
    python3 - "$1" "$2" << 'EOF'
import re, sys
steps = [int(m) for m in re.findall(r"see/see-long step (\d+)/", open(sys.argv[1], errors="replace").read())]
sys.exit(0 if steps and max(steps) >= int(sys.argv[2]) else 1)
EOF
}

stage_see() {
    local name=see at=${SEE_CANCEL_AT:-10} watch submit until rc=0
    wanted "$name" || return 0
    if run_begin "$name" "progress, cancel mid-render, status --watch, metrics"; then
        write_config "$WORK/see.toml" "" "$(calibration 512x512x1,1024x1024x1)"$'\n\n'"$TUNED"
        if worker_start "$WORK/see.toml"; then
            see_jobs "$RUN_DIR/jobs-see.jsonl"
            "$BIN_DIR/shotfleet" status --watch --project see > "$RUN_DIR/status-watch.txt" 2>&1 < /dev/null &
            watch=$!
            meta submit_begin "$(now)"
            "$BIN_DIR/shotfleet" submit "$RUN_DIR/jobs-see.jsonl" --wait --timeout "$(($(left) - STOP_S - 20))s" \
                > "$RUN_DIR/submit-see.txt" 2>&1 < /dev/null &
            submit=$!
            until=$((SECONDS + 180))
            until see_step_reached "$RUN_DIR/status-watch.txt" "$at"; do
                if [ "$SECONDS" -ge "$until" ] || ! worker_alive; then meta error "see-long never reached step $at"; break; fi
                sleep 0.2
            done
            meta cancel_begin "$(now)"
            "$BIN_DIR/shotfleet" cancel --project see --by fleet.sh see-long see-q1 > "$RUN_DIR/cancel.txt" 2>&1 < /dev/null || rc=$?
            meta cancel_answered "$(now)"
            meta cancel_rc "$rc"
            cat "$RUN_DIR/cancel.txt"
            wait "$submit" || meta submit_rc $?
            meta submit_end "$(now)"
            stop_pid "$watch" TERM 3
            python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())' \
                "http://$METRICS_ADDR/metrics" > "$RUN_DIR/metrics-full.txt" 2>&1
            tail -n 6 "$RUN_DIR/submit-see.txt"
        fi
    fi
    run_end
    python3 "$REPO/deploy/gpu/see_summary.py" "$RUN_DIR" "$RESULTS/see-the-work.json" || stage_meta error "the see summary failed"
}

# --- the end: stop everything, summarize, copy to $OUT -----------------------------------------
# shellcheck disable=SC2317,SC2329 # called by the EXIT trap
finish() {
    local rc=$?
    trap - EXIT TERM INT
    stop_all
    stage_meta seconds $((SECONDS - T0))
    [ "$rc" = 0 ] || stage_meta rc "$rc"
    local json=$RESULTS/fleet-speed.json
    [ "$STAGE" = budget ] && json=$RESULTS/budget.json
    if [ "$STAGE" = see ]; then
        json=$RESULTS/see-the-work.json
        tar czf "$OUT/see-the-work.tar.gz" -C "$STAGE_DIR" . 2> /dev/null
    else
        [ "$STAGE" = small ] && json=$RESULTS/small.json
        [ "$STAGE" = box ] && json=$RESULTS/box.json
        [ "$STAGE" = board ] && json=$RESULTS/lora-board.json
        [ "$STAGE" = storyboard ] && json=$RESULTS/storyboard.json
        python3 "$REPO/deploy/gpu/fleet_summary.py" "$STAGE" "$STAGE_DIR" --out "$json" \
            --digest "$OUT/fleet-$STAGE.txt" || echo "the summary failed" >&2
    fi
    cp "$json" "$OUT/" 2> /dev/null
    [ "$STAGE" = budget ] && cp "$RESULTS"/budget-check*.jsonl "$OUT/" 2> /dev/null
    log "wrote $json (exit $rc)"
    if [ "$DEVICE" = cpu ] && [ -z "${FLEET_WORK:-}" ]; then rm -rf "$WORK/nats" "$WORK/state" "$WORK/images"; fi
    exit "$rc"
}
trap finish EXIT
trap 'stage_meta error "stopped by a signal at +$((SECONDS - T0)) s (FLEET_DEADLINE_S=$DEADLINE_S)"; exit 143' TERM INT

# --- checks, then the stage ---------------------------------------------------------------------
stage_meta stage "$STAGE"
stage_meta device "$DEVICE"
stage_meta model "$MODEL"
stage_meta size "$SIZE"
stage_meta steps "$STEPS"
stage_meta deadline_s "$DEADLINE_S"
log "stage $STAGE: device $DEVICE, model $MODEL; deadline ${DEADLINE_S}s; work $WORK"
for b in shotfleet-consumer shotfleet; do
    [ -x "$BIN_DIR/$b" ] || { stage_meta error "no executable $BIN_DIR/$b (build it and copy it into .gpu/bin)"; exit 2; }
done
[ -x "$NATS_SERVER" ] || { stage_meta error "no nats-server at $NATS_SERVER"; exit 2; }
[ -f "$MODEL/unet/model.onnx" ] || { stage_meta error "no model at $MODEL (unet/model.onnx missing)"; exit 2; }
[ -f "$BASE_CONFIG" ] || { stage_meta error "no worker config $BASE_CONFIG"; exit 2; }
start_vram_sampler
case "$STAGE" in
    speed) stage_speed ;;
    budget) stage_budget ;;
    small) stage_small ;;
    see) stage_see ;;
    box) stage_box ;;
    board) stage_board ;;
    storyboard) stage_storyboard ;;
esac
log "stage $STAGE done"
exit 0
