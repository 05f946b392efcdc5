#!/bin/sh
# bench/run.sh BUILD_DIR: runs every benchmark present (bench/*/run.sh), each
# given BUILD_DIR; exits non-zero if any failed.
set -u
build=${1:?usage: bench/run.sh BUILD_DIR}
here=$(cd "$(dirname "$0")" && pwd)
status=0
for script in "$here"/*/run.sh; do
    [ -x "$script" ] || continue
    name=$(basename "$(dirname "$script")")
    echo "== bench/$name"
    if ! "$script" "$build"; then
        echo "bench/$name: failed" >&2
        status=1
    fi
    echo
done
exit $status
