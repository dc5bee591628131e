# shellcheck shell=bash
# The LoRA storyboard runs of deploy/gpu/fleet.sh (stage `board`, issue 14: point 5 at 1024²),
# sourced by fleet.sh after its configs (write_config, calibration, TUNED) and fleet-lib.sh. The
# model must be prepared for LoRAs: lease.sh passes FLEET_MODEL=$ROOT/sdxl-lora (stage `lora`).
#
# BOARD_COUNT (4) random LoRAs of rank BOARD_RANK (32) over the usual layers, kohya files that
# `lora_bench --write-loras` writes once per stage (LORA_BENCH, default BIN_DIR/lora_bench), are
# pushed with `shotfleet lora push` into each run's store. The storyboard (storyboards.py
# lora-board): BOARD_JOBS (48) shots over the four characters, p0 anchors of the first, p2
# backfill of the last, the rest p1, shuffled in the file (neighbours differ); BOARD_SIZE (1024)
# px, BOARD_STEPS (6) steps, one image each. Each run is one worker (concurrency 1, TUNED) and
# two sets, each submitted with --wait: `grouped` (`shotfleet submit`: by set inside each
# priority), then `filed` (`--no-group`: the file's shuffled order; other job ids).
#
#   board        the default pool ([lora] device_mib unset: half the idle room, so all four sets
#                stay on an H200 once merged): a switch between them is a rebind
#   board-small  one set on the device between jobs ([lora] device_mib = 0) and BOARD_HOST_MIB
#                (24576) of merged sets in host memory: every switch copies a set to the device,
#                as on a card without room for two 5.44 GiB sets
#
# FLEET_RUNS picks (board,board-small). fleet_summary.py's `board` adds, per set, the switches by
# source (/metrics before and after it) and the sets placed (the worker's "LoRA set on the device"
# lines: source, milliseconds).

BOARD_JOBS=${BOARD_JOBS:-48} BOARD_COUNT=${BOARD_COUNT:-4} BOARD_RANK=${BOARD_RANK:-32}
BOARD_STEPS=${BOARD_STEPS:-6} BOARD_HOST_MIB=${BOARD_HOST_MIB:-24576}
BOARD_SIDE=$(px "${BOARD_SIZE:-1024}")
LORA_BENCH=${LORA_BENCH:-$BIN_DIR/lora_bench}

# board_loras: the random LoRA files in $WORK/board-loras (once per stage); 1 when they cannot be made.
board_loras() {
    local dir=$WORK/board-loras
    [ -f "$dir/char-$BOARD_COUNT.safetensors" ] && return 0
    [ -x "$LORA_BENCH" ] || chmod +x "$LORA_BENCH" 2> /dev/null
    [ -x "$LORA_BENCH" ] || { stage_meta error "no $LORA_BENCH: build the lora_bench example and copy it into .gpu/bin"; return 1; }
    local t0=$SECONDS
    "$LORA_BENCH" --model "$MODEL" --write-loras "$dir" --count "$BOARD_COUNT" --ranks "$BOARD_RANK" \
        > "$STAGE_DIR/board-loras.jsonl" 2> "$STAGE_DIR/board-loras.err" < /dev/null \
        || { stage_meta error "lora_bench --write-loras: $(tail -n 3 "$STAGE_DIR/board-loras.err" | tr '\n' ' ')"; return 1; }
    stage_meta board_loras_s $((SECONDS - t0))
    stage_meta board_lora_bytes "$(stat -c %s "$dir/char-1.safetensors")"
    log "$BOARD_COUNT LoRAs of rank $BOARD_RANK written in $((SECONDS - t0)) s"
}

board_characters() { seq -f 'char-%g' 1 "$BOARD_COUNT" | paste -sd, -; }

# board_push: the LoRAs into this run's store, as an operator would.
board_push() {
    local t0=$SECONDS name
    for name in $(board_characters | tr , ' '); do
        "$BIN_DIR/shotfleet" lora push "$WORK/board-loras/$name.safetensors" --name "$name" --store "file://$WORK/images" \
            >> "$RUN_DIR/lora-push.txt" 2>&1 < /dev/null || { meta error "lora push $name: $(tail -n 2 "$RUN_DIR/lora-push.txt" | tr '\n' ' ')"; return 1; }
    done
    meta push_s $((SECONDS - t0))
}

# board_run NAME LABEL LORA_TABLE
board_run() {
    local name=$1 label=$2 lora=$3 set flags timeout
    wanted "$name" || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 40)) ]; then
        run_skip "$name" "$label" "$(left) s left before the deadline, a run needs $((RUN_MIN_S + 40))"
        return 0
    fi
    if run_begin "$name" "$label" && board_push; then
        meta top "concurrency = 1"
        meta cuda "$(tr '\n' ';' <<< "$TUNED")"
        [ -n "$lora" ] && meta lora "$(tr '\n' ';' <<< "$lora")"
        write_config "$WORK/$name.toml" "concurrency = 1" "$(calibration 512x512x1,1024x1024x1)"$'\n\n'"$TUNED"$'\n\n'"$lora"
        # ort=error: the LoRA-ready graph's overridable weights are graph inputs by design, and ONNX
        # Runtime warns once per weight (986) at load.
        if FLEET_RUST_LOG=${FLEET_RUST_LOG:-info,ort=error,shotfleet_consumer::worker::job=debug} worker_start "$WORK/$name.toml"; then
            for set in grouped filed; do
                flags=''
                [ "$set" = filed ] && flags=--no-group
                # The grouped set leaves time for the filed one.
                timeout=$(($(left) - STOP_S - 10))
                [ "$set" = grouped ] && timeout=$((timeout / 2))
                if [ "$timeout" -lt 20 ]; then
                    meta "set_${set}_skipped" "$(left) s left"
                    continue
                fi
                python3 "$REPO/deploy/gpu/storyboards.py" lora-board "$WORK/jobs.jsonl" --run "$name" --set "${set:0:1}" \
                    --jobs "$BOARD_JOBS" --characters "$(board_characters)" --width "$BOARD_SIDE" --height "$BOARD_SIDE" \
                    --steps "$BOARD_STEPS" > /dev/null
                SUBMIT_FLAGS=$flags submit_set "$set" "$BOARD_JOBS shots over $BOARD_COUNT characters, ${flags:-grouped by set}" \
                    "$WORK/jobs.jsonl" "$timeout"
                worker_alive || break
            done
        fi
    fi
    run_end
}

stage_board() {
    board_loras || return 0
    board_run board "LoRA storyboard, default pool" ""
    board_run board-small "LoRA storyboard, one set on the device" $'[lora]\ndevice_mib = 0\nhost_mib = '"$BOARD_HOST_MIB"
}
