#!/usr/bin/env bash
# examples/demo.sh BUILD_DIR: the rendezvous, live, on one machine.
#
# Starts a private etcd (BUILD_DIR/tests/with-etcd) and four participants as
# separate processes (BUILD_DIR/tests/rendezvous/rdzv_participant, two
# workers each). They meet in etcd and agree on a round and their ranks;
# then one leaves cleanly and the other three form the next round at once,
# keeping their order; then the job is marked done and everyone stops.
# Exits 0 when every step happened as it should; always cleans up.
set -euo pipefail

build=${1:-build}
with_etcd="$build/tests/with-etcd"
participant="$build/tests/rendezvous/rdzv_participant"
for exe in "$with_etcd" "$participant"; do
    if [ ! -x "$exe" ]; then
        echo "demo: $exe not found; build first (cmake --build $build)" >&2
        exit 1
    fi
done
# Re-run beside a private etcd, which with-etcd stops when we exit.
if [ -z "${DUCTILE_TEST_ETCD:-}" ]; then
    exec "$with_etcd" -- "$0" "$build"
fi

tmp=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT

nodes=(node-0 node-1 node-2 node-3)
echo "etcd at $DUCTILE_TEST_ETCD; starting ${#nodes[@]} agents (2 workers each)"
for i in "${!nodes[@]}"; do
    mkfifo "$tmp/in$i"
    "$participant" --endpoints "$DUCTILE_TEST_ETCD" --job demo --node "${nodes[$i]}" \
        --addr "127.0.0.1:2950$i" --lws 2 --min 3 --max 4 --last-call-ms 1000 --ttl 10 \
        --join-timeout-ms 30000 <"$tmp/in$i" >"$tmp/out$i" 2>"$tmp/err$i" &
    pids+=($!)
    eval "exec $((10 + i))>\"$tmp/in$i\""
done

# wait_for I WORD N: until agent I has printed N lines starting with WORD.
wait_for() {
    local i=$1 word=$2 n=$3 deadline=$((SECONDS + 30))
    while [ "$(grep -c "^$word " "$tmp/out$i" 2>/dev/null || true)" -lt "$n" ]; do
        if [ $SECONDS -ge $deadline ]; then
            echo "demo: ${nodes[$i]} did not report $word in time; it said:" >&2
            cat "$tmp/out$i" "$tmp/err$i" >&2
            exit 1
        fi
        sleep 0.1
    done
}

field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p"; }

show_round() {
    local i=$1 n=$2 line
    line=$(grep "^FROZEN " "$tmp/out$i" | sed -n "${n}p")
    local round rank members world first
    round=$(echo "$line" | field round)
    rank=$(echo "$line" | field rank)
    members=$(echo "$line" | field nmembers)
    world=$(echo "$line" | field world)
    first=$(echo "$line" | field first)
    printf '  %s: round %s, node rank %s of %s, global ranks %s-%s of world size %s\n' \
        "${nodes[$i]}" "$round" "$rank" "$members" "$first" $((first + 1)) "$world"
}

for i in "${!nodes[@]}"; do wait_for "$i" FROZEN 1; done
echo "round formed:"
for i in "${!nodes[@]}"; do show_round "$i" 1; done

echo "node-3 leaves cleanly (revokes its lease):"
echo leave >&13
wait_for 3 LEFT 1
for i in 0 1 2; do wait_for "$i" FROZEN 2; done
for i in 0 1 2; do show_round "$i" 2; done

echo "node-0 marks the job done:"
echo finish >&10
for i in 0 1 2; do wait_for "$i" JOB_DONE 1; done
echo "  every agent saw the job end"
for fd in 10 11 12 13; do eval "exec $fd>&-"; done
for pid in "${pids[@]}"; do wait "$pid" || true; done
pids=()
echo "demo: ok"
