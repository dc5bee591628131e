# shellcheck shell=bash
# The mixed storyboard of deploy/gpu/fleet.sh (stage `storyboard`, issue 17, point 3), sourced by
# fleet.sh after its configs (write_config, calibration, TUNED) and fleet-lib.sh.
#
# storyboards.py storyboard: STORY_JOBS (60) single-image shots over SDXL's five usual sizes
# (1024², 1152x896, 896x1152, 1216x832, 832x1216), interleaved in a fixed shuffle, STORY_STEPS (30)
# steps, all p1: the shots onnx/bench_storyboard.py renders through diffusers. The jobs are queued
# first (`shotfleet submit --wait` in the background), then a cold worker starts (empty state
# folder: no stored calibration), as a worker joins a queue that waits for it: images/s count from
# the worker's spawn to the last image. The worker is the speed stage's best (concurrency 2,
# batch_jobs 4, TUNED), calibrated on the five sizes at one image and 1024² x 2 (STORY_CALIBRATION).
#
#   storyboard   that run; fleet_summary.py's `storyboard` (storyboard_summary.py): images/s from
#                the spawn and in steady state (after every size's first image), per size the first
#                job's render against the later ones', GPU busy over the set
#   storyboard-stored  the same shots again from a new worker process that starts with the state
#                folder the first run left (its stored calibration: one fitness render instead of
#                the probes), as a fleet's worker restarts; `storyboard_stored` in the summary
#   storyboard-vae-exhaustive  as storyboard (a cold worker: other CUDA options are another
#                calibration), the VAE decoder on ONNX Runtime's exhaustive search (`[cuda.vae]
#                conv_algo_search = "exhaustive"`) against the worker's heuristic: ONNX Runtime
#                builds a convolution's plan again at every switch of size, ~1 s more a VAE decode
#                on that search, ~0.1-0.25 s on the heuristic (RESULTS.md, lease of 2026-12-05);
#                the summary's `vae_after_switch` of each run says what a switch costs
#   storyboard-unet2  as storyboard (a cold worker: a second UNet session changes what the card
#                holds), with a UNet session per slot (`unet_sessions = 2`): the two slots' UNet
#                calls at once instead of in turns (issue 17, point 2)
#   storyboard-c3  as storyboard-unet2 with three slots and three sessions (the speed runs' best,
#                c3-batch4-keep-unet3, on the 2026-12-06 fourth-session H100)
#   storyboard-no-affinity  as storyboard-stored (the first run's state folder: its figures to
#                read are steady-state ones), without affinity (`affinity_passes = 0`): each lead
#                by arrival within its priority, not one like the last group dealt
#                (worker/reserve.rs); the summary's `vae_after_switch` counts the renders after
#                another size
#   storyboard-no-lookahead  as storyboard-stored, without the worker's reserve (`lookahead = 0`):
#                each slot's batch partners come only from the jobs fetched for it, as before the
#                reserve; the summary's `renders` of each run says how many renders were groups
#
# STORY_RUNS (storyboard,storyboard-stored)
# picks, in the order they run (the deadline skips the last ones first); storyboard-stored,
# storyboard-no-affinity and storyboard-no-lookahead need storyboard in the same call.
#
# The CPU dry run divides every side by 8 (128² .. 152x104) and renders STEPS (8) steps.

STORY_JOBS=${STORY_JOBS:-60}
STORY_STEPS=${STORY_STEPS:-$STEPS}
if [ "$DEVICE" = cuda ]; then
    STORY_CALIBRATION=${STORY_CALIBRATION:-1024x1024x1,1152x896x1,896x1152x1,1216x832x1,832x1216x1,1024x1024x2}
else
    # Divided by 8 these are the dry run's shot sizes (storyboards.py rounds to multiples of 16).
    STORY_CALIBRATION=${STORY_CALIBRATION:-1024x1024x1,1152x896x1,896x1152x1,1280x768x1,768x1280x1,1024x1024x2}
fi

stage_storyboard() {
    # WORK outlives a call on the lease machine: a state folder kept by an earlier call's first
    # run must not pass for this call's.
    rm -rf "$WORK/state-kept"
    story_run storyboard "the mixed storyboard from a cold worker" ""
    story_run storyboard-stored "the mixed storyboard from a cold worker with the first run's state folder" "$WORK/state-kept"
    story_run storyboard-unet2 "the mixed storyboard from a cold worker, a UNet session per slot (unet_sessions = 2)" \
        "" "" "unet_sessions = 2"
    story_run storyboard-c3 "the mixed storyboard from a cold worker, three slots with a UNet session each" \
        "" "" $'concurrency = 3\nunet_sessions = 3'
    story_run storyboard-vae-exhaustive "the mixed storyboard from a cold worker, the VAE on ONNX Runtime's exhaustive search" \
        "" $'\n\n[cuda.vae]\nconv_algo_search = "exhaustive"'
    story_run storyboard-no-affinity "the mixed storyboard from the first run's state folder without affinity (affinity_passes = 0)" \
        "$WORK/state-kept" "" "affinity_passes = 0"
    story_run storyboard-no-lookahead "the mixed storyboard from the first run's state folder without a reserve (lookahead = 0)" \
        "$WORK/state-kept" "" "lookahead = 0"
}

# story_run NAME LABEL KEPT [TABLES] [TOP]: one storyboard run; KEPT, when set, the state folder
# its worker starts with; TABLES, config tables after TUNED's; TOP, top-level keys more (one that
# names `concurrency` replaces the runs' 2).
story_run() {
    local name=$1 label=$2 kept=$3 tables=${4:-} top=$'batch_jobs = 4'${5:+$'\n'$5} timeout
    grep -q '^concurrency' <<< "${5:-}" || top=$'concurrency = 2\n'"$top"
    wanted "$name" || return 0
    if [ "$(left)" -lt $((RUN_MIN_S + 60)) ]; then run_skip "$name" "$label" "$(left) s left"; return 0; fi
    if [ -n "$kept" ] && [ ! -d "$kept" ]; then run_skip "$name" "$label" "no stored calibration from a first run"; return 0; fi
    if run_begin "$name" "$label"; then
        [ -n "$kept" ] && cp -a "$kept/." "$WORK/state/"
        meta top "$(tr '\n' ';' <<< "$top")"
        meta cuda "$(tr '\n' ';' <<< "$TUNED$tables")"
        write_config "$WORK/$name.toml" "$top" "$(calibration "$STORY_CALIBRATION")"$'\n\n'"$TUNED$tables"
        python3 "$REPO/deploy/gpu/storyboards.py" storyboard "$WORK/jobs.jsonl" --run "$name" --set m \
            --jobs "$STORY_JOBS" --steps "$STORY_STEPS" --scale "$SCALE" | tee "$RUN_DIR/storyboard.txt"
        timeout=$(($(left) - STOP_S - 10))
        submit_begin m "$STORY_JOBS shots over five sizes, $STORY_STEPS steps, queued before the worker starts" \
            "$WORK/jobs.jsonl" "$timeout"
        # Queued before the worker starts: wait until submit has published them all.
        until grep -q '^queued ' "$RUN_DIR/submit-m.txt" 2> /dev/null || ! kill -0 "$SUBMIT_PID" 2> /dev/null; do
            sleep 0.2
        done
        worker_start "$WORK/$name.toml" || stop_pid "$SUBMIT_PID" TERM 3
        submit_end m
        # The second run is only what it says when its worker used the stored calibration.
        if [ -n "$kept" ] && ! grep -q 'calibration reused from a stored fingerprint' "$RUN_DIR/worker.log"; then
            meta error "the worker calibrated again instead of using the first run's stored calibration"
        fi
    fi
    run_end
    # What the first run's worker stored (its calibration) for a restart; nothing to keep when
    # it stored none (a calibration cut short is not stored).
    if [ "$name" = storyboard ] && compgen -G "$WORK/state/fingerprint-*.json" > /dev/null; then
        cp -a "$WORK/state" "$WORK/state-kept"
    fi
}
