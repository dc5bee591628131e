#!/usr/bin/env bash
# Stage `lora` of the GPU lease (`bash deploy/gpu/lease.sh lora`; needs export and optimize-wait
# done, and .gpu/bin/lora_bench: README "LoRA stage"). Full-size SDXL, random weights:
#
#   1. $SDXL_LORA = a hard-linked copy of $SDXL (instant; lora_ready.py replaces the files it
#      rewrites, so $SDXL itself never changes);
#   2. onnx/lora_ready.py on it: the fused fp16 UNet's and the fp16 text encoders' Linear/Conv
#      weights become overridable, mapped by content against the torch modules rebuilt with
#      export_sdxl.py's seed on the same device (CUDA's random stream differs from the CPU's);
#   3. lora_bench: UNet step of a base job on today's graph and on the LoRA-ready one (same
#      run), random LoRAs of rank 32 and 128 over the usual layers (merge, placement, step time
#      with the set, device memory against the computed bytes), switches resident / from host /
#      from a local-folder library.
#
# Writes lora-ready.log, lora.jsonl, lora.txt to $RESULTS (and the last two to $OUT).
# Knobs: LORA_GRAPH (set: base renders replay CUDA graphs; the fused UNet only), LORA_RANKS (32,128), LORA_SIZE (1024), LORA_STEPS (8), LORA_RUNS (3); for a dry run on a
# CPU machine (README): LORA_SOURCE=--tiny-config LORA_DEVICE=cpu LORA_BENCH=<a CPU build>.
set -uo pipefail

: "${RESULTS:?}" "${OUT:?}" "${SDXL:?}" "${ROOT:?}"
SDXL_LORA=${SDXL_LORA:-$ROOT/sdxl-lora}
BENCH=${LORA_BENCH:-.gpu/bin/lora_bench}
log() { echo "[$(date +%T) +${SECONDS}s] $*"; }

[ -x "$BENCH" ] || chmod +x "$BENCH" 2> /dev/null
[ -x "$BENCH" ] || { echo "no $BENCH: build it with --features cuda and carry .gpu/bin (README)" >&2; exit 2; }
[ -f "$SDXL/unet/model.onnx" ] || { echo "no UNet in $SDXL: run export and optimize-wait first" >&2; exit 3; }

if [ ! -f "$SDXL_LORA/unet/lora_map.json" ]; then
    rm -rf "$SDXL_LORA"
    # A real copy: onnx refuses external data with several hard links (a "hardlink attack").
    cp -a "$SDXL" "$SDXL_LORA" || exit 4
    log "lora_ready.py on $SDXL_LORA (${LORA_SOURCE:---random-weights}, seed 0, rebuilt on ${LORA_DEVICE:-cuda})"
    t0=$SECONDS
    python3 onnx/lora_ready.py "$SDXL_LORA" "${LORA_SOURCE:---random-weights}" --seed 0 --device "${LORA_DEVICE:-cuda}" \
        > "$RESULTS/lora-ready.log" 2>&1
    rc=$?
    tail -n 8 "$RESULTS/lora-ready.log"
    log "lora_ready.py: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || exit 5
fi

log "lora_bench: today's graph $SDXL beside $SDXL_LORA"
timeout -k 10 "${LORA_BENCH_TIMEOUT_S:-240}" "$BENCH" --model "$SDXL_LORA" --base-model "$SDXL" --device "${LORA_DEVICE:-cuda}" \
    --ranks "${LORA_RANKS:-32,128}" --size "${LORA_SIZE:-1024}" --steps "${LORA_STEPS:-8}" --runs "${LORA_RUNS:-3}" ${LORA_GRAPH:+--cuda-graph} \
    > "$RESULTS/lora.jsonl" 2> "$RESULTS/lora.txt"
rc=$?
cat "$RESULTS/lora.txt"
cp "$RESULTS/lora.jsonl" "$RESULTS/lora.txt" "$OUT/" 2> /dev/null
exit "$rc"
