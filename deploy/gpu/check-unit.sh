#!/usr/bin/env bash
# Does deploy/systemd's hardened unit leave the GPU usable? Runs cuda_probe.py (CUDA init, a
# context, a 256 MiB allocation) as a transient systemd service with every hardening setting of
# shotfleet-consumer@.service, then once more without its DeviceAllow= lines as a control (that
# one must fail: the sandbox is real). Needs systemd as PID 1 and the NVIDIA driver; prints one
# JSON line per run. Exit 0: the unit's sandbox works and the control was refused; 1: the GPU
# failed inside the sandbox; 3: no systemd here, nothing checked.
#
#   bash deploy/gpu/check-unit.sh      # on the GPU machine, as root
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ "$(cat /proc/1/comm 2>/dev/null)" != systemd ]; then
    echo '{"check": "unit-gpu", "skipped": "systemd is not PID 1 on this machine"}'
    exit 3
fi
unit=deploy/systemd/shotfleet-consumer@.service
# The hardening block: from its comment to [Install], settings only, the instance name filled in.
mapfile -t settings < <(sed -n '/^# Hardening/,/^\[Install\]/p' "$unit" | grep -E '^[A-Za-z]+=' | sed 's/%i/0/g')
probe="$PWD/deploy/gpu/cuda_probe.py"
run() {
    local name="$1"; shift
    local props=()
    for s in "$@"; do props+=(-p "$s"); done
    # A readable copy of the probe: ProtectHome= may hide the checkout.
    install -m 0644 "$probe" /usr/local/lib/shotfleet-cuda-probe.py
    if systemd-run --quiet --wait --pipe --collect --unit "shotfleet-check-$name" "${props[@]}" \
        /usr/bin/python3 /usr/local/lib/shotfleet-cuda-probe.py; then
        echo "{\"check\": \"unit-gpu\", \"run\": \"$name\", \"ok\": true}"
        return 0
    fi
    echo "{\"check\": \"unit-gpu\", \"run\": \"$name\", \"ok\": false}"
    return 1
}
status=0
run hardened "${settings[@]}" || status=1
mapfile -t control < <(printf '%s\n' "${settings[@]}" | grep -v '^DeviceAllow=')
if run control "${control[@]}"; then
    echo '{"check": "unit-gpu", "note": "the control reached the GPU without DeviceAllow: DevicePolicy=closed did not apply"}'
    status=1
fi
rm -f /usr/local/lib/shotfleet-cuda-probe.py
exit "$status"
