#!/usr/bin/env bash
# Installs what the demo and the tests need, idempotently: a Python venv at ./.venv holding
# nats-server 2.15.1, nats-py, msgpack, ONNX Runtime 1.31.1 (its libonnxruntime.so is what the
# consumer loads) and moto's S3 server. Prints the environment the other scripts export.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
req="$root/tests/requirements.txt"
stamp="$venv/.requirements.sha256"

if ! command -v cargo >/dev/null; then
    echo "setup: cargo not found; install Rust 1.92 or newer (https://rustup.rs)" >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv"
    python3 -m venv "$venv"
fi
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing Python test dependencies into $venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
    echo "$want" >"$stamp"
fi
# The gallery's browser test loads the page in the distribution's Chromium (no browser download
# at test time); where it cannot be installed, that test says so and skips.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "setup: installing chromium (the gallery's browser test)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; then
        echo "setup: could not install chromium; the gallery's browser test will be skipped" >&2
    fi
fi
