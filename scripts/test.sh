#!/usr/bin/env bash
# Sets up what the tests need (idempotently) and runs the whole suite:
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -E 'package(shotfleet-schema)'   # extra args go to cargo nextest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh
# The end-to-end tests run the real binaries (worker and CLI) as separate processes.
cargo build --workspace --bins --locked
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --locked --no-fail-fast "$@"
else
    echo "test: cargo-nextest not found; using cargo test (install it with: cargo install cargo-nextest)"
    cargo test --workspace --locked --no-fail-fast "$@"
fi
