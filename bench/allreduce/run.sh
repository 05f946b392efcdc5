#!/bin/sh
# bench/allreduce/run.sh [BUILD_DIR]: bus bandwidth of the shared-memory and
# the TCP ring allreduce for 2 and 4 ranks, 4 KiB to 64 MiB, beside this
# machine's memcpy bandwidth
# and torch.distributed's gloo allreduce at the same sizes and rank counts,
# all measured in this run. busbw = algbw * 2(W-1)/W (nccl-tests' figure).
# BUILD_DIR must be a plain (not sanitizer) build; it is configured and the
# bench built if needed. torch comes from PyPI into BUILD_DIR/torch-venv.
set -eu
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
if grep -q '^DUCTILE_SANITIZE:BOOL=ON' "$build/CMakeCache.txt"; then
    echo "bench/allreduce: $build is a sanitizer build; give a plain one" >&2
    exit 1
fi
cmake --build "$build" --target bench_allreduce -j "$(nproc)" >/dev/null
exe="$build/bench/allreduce/bench_allreduce"

venv="$build/torch-venv"
if ! "$venv/bin/python" -c 'import numpy, torch.distributed' 2>/dev/null; then
    echo "bench/allreduce: installing torch into $venv (PyPI)" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch numpy
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
reps=${REPS:-3}
for w in 2 4; do
    # Alternate ours and theirs, $reps times, and keep each size's best run:
    # on a shared machine the best is the figure least bent by others' load.
    : >"$tmp/shm$w"
    : >"$tmp/ring$w"
    : >"$tmp/gloo$w"
    i=0
    while [ "$i" -lt "$reps" ]; do
        "$exe" --memcpy >>"$tmp/memcpy"
        "$exe" --ranks "$w" --shm >>"$tmp/shm$w"
        "$exe" --ranks "$w" >>"$tmp/ring$w"
        "$venv/bin/python" "$here/torch_gloo.py" --ranks "$w" >>"$tmp/gloo$w" 2>"$tmp/err" ||
            { cat "$tmp/err" >&2; exit 1; }
        i=$((i + 1))
    done
done

memcpy=$(awk '$2 > m { m = $2 } END { print m }' "$tmp/memcpy")
echo "allreduce bus bandwidth, GB/s, best of $reps (float32 sum; loopback TCP; $(nproc) cores)"
echo "memcpy (one thread, 64 MiB): $memcpy GB/s"
printf '%5s %10s %8s %8s %8s %8s %9s %10s\n' ranks bytes shm ring gloo shm/gloo ring/gloo shm/memcpy
for w in 2 4; do
    awk -v w="$w" -v m="$memcpy" '
        FILENAME ~ /\/gloo[0-9]+$/ { if ($4 > gloo[$1]) gloo[$1] = $4; next }
        FILENAME ~ /\/shm[0-9]+$/ { if ($4 > shm[$1]) shm[$1] = $4; next }
        { if ($4 > ring[$1]) ring[$1] = $4 }
        END {
            for (b = 4096; b in ring; b *= 2)
                if (b in gloo && b in shm)
                    printf "%5d %10d %8.3f %8.3f %8.3f %8.2f %9.2f %10.2f\n", w, b, shm[b],
                           ring[b], gloo[b], shm[b] / gloo[b], ring[b] / gloo[b], shm[b] / m
        }' "$tmp/gloo$w" "$tmp/shm$w" "$tmp/ring$w"
done
