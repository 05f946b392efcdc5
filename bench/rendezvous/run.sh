#!/bin/sh
# bench/rendezvous/run.sh BUILD_DIR [N ...]: the rendezvous benchmark table.
set -eu
build=${1:?usage: bench/rendezvous/run.sh BUILD_DIR [N ...]}
shift
exe="$build/bench/rendezvous/bench_rdzv"
if [ ! -x "$exe" ]; then
    echo "bench/rendezvous: $exe not built (cmake --build $build)" >&2
    exit 1
fi
exec "$exe" "$@"
