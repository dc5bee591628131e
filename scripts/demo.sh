#!/usr/bin/env bash
# The demo: one worker with the tiny SDXL model on the CPU renders a sample storyboard
# (9 shots, two projects, all three priorities) end to end through NATS JetStream into a
# local image folder. Uses NATS_URL when set; otherwise starts its own nats-server.
#
#   bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh
echo "demo: building (the first build takes a few minutes)"
cargo build --bins --locked --quiet
bin="$CARGO_TARGET_DIR/debug"
out="$PWD/demo-output"
mkdir -p "$out/images" "$out/state"
free_port() { "$SHOTFLEET_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

if [ -z "${NATS_URL:-}" ]; then
    port="$(free_port)"
    rm -rf "$out/nats"
    "$NATS_SERVER_BIN" -a 127.0.0.1 -p "$port" -js -sd "$out/nats" >"$out/nats-server.log" 2>&1 &
    pids+=($!)
    export NATS_URL="nats://127.0.0.1:$port"
    for _ in $(seq 50); do (echo >/dev/tcp/127.0.0.1/"$port") 2>/dev/null && break; sleep 0.1; done
    echo "demo: started nats-server $("$NATS_SERVER_BIN" --version | awk '{print $2}') at $NATS_URL"
else
    echo "demo: using NATS at $NATS_URL"
fi

"$bin/shotfleet" setup

metrics_port="$(free_port)"
SHOTFLEET_MODEL="$PWD/onnx/tiny/model" \
SHOTFLEET_STORE="file://$out/images" \
SHOTFLEET_STATE_DIR="$out/state" \
SHOTFLEET_METRICS_ADDR="127.0.0.1:$metrics_port" \
SHOTFLEET_WORKER_ID="demo/cpu0" \
    "$bin/shotfleet-consumer" --config deploy/demo/worker.toml --plain-logs >"$out/worker.log" 2>&1 &
worker=$!
pids+=("$worker")
echo "demo: worker starting (log: $out/worker.log, metrics: http://127.0.0.1:$metrics_port/metrics)"
for _ in $(seq 300); do
    if curl -sf "http://127.0.0.1:$metrics_port/readyz" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$worker" 2>/dev/null; then echo "demo: the worker exited; see $out/worker.log" >&2; tail -5 "$out/worker.log" >&2; exit 1; fi
    sleep 0.2
done

started=$(date +%s%N)
"$bin/shotfleet" submit deploy/demo/storyboard.jsonl --wait --timeout 300s
finished=$(date +%s%N)

kill -TERM "$worker"
wait "$worker" || true
images=$(find "$out/images" -name '*.png' | wc -l)
echo
echo "demo: $images images in $out/images, in $(( (finished - started) / 1000000 )) ms from submit to the last result"
find "$out/images" -name '*.png' | sort | head -20 | sed 's/^/  /'
