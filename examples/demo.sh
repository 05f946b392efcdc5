#!/usr/bin/env bash
# examples/demo.sh BUILD_DIR: elastic training, live, on one machine.
#
# A private etcd (BUILD_DIR/tests/with-etcd), then three ductile-agents, each
# running one ductile-train: the MLP on Fashion-MNIST, on CPU (on the GPU when
# one is present), rebuilt in place when the membership changes. Midway one
# agent is killed with its worker (a pod crash) and a new one joins. Prints
# the membership changes, loss, samples/s and the final test accuracy.
# Exits 0 when the job completes; always stops every process it started.
set -euo pipefail

build=${1:-build}
with_etcd="$build/tests/with-etcd"
agent="$build/agent/ductile-agent"
train="$build/trainer/ductile-train"
data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
epochs=${DEMO_EPOCHS:-40}
for exe in "$with_etcd" "$agent" "$train"; do
    if [ ! -x "$exe" ]; then
        echo "demo: $exe not found; build first (cmake --build $build)" >&2
        exit 1
    fi
done
if [ ! -r "$data/train-images-idx3-ubyte.gz" ]; then
    echo "demo: no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)" >&2
    exit 1
fi
# Re-run beside a private etcd, which with-etcd stops when we exit.
if [ -z "${DUCTILE_TEST_ETCD:-}" ]; then
    exec "$with_etcd" -- "$0" "$build"
fi

tmp=$(mktemp -d)
declare -A pid
shower=
cleanup() {
    if [ -n "$shower" ]; then kill "$shower" 2>/dev/null || true; fi
    for name in "${!pid[@]}"; do
        # The agent; its workers die with it (PR_SET_PDEATHSIG).
        kill -9 -- "-${pid[$name]}" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT

# start NAME: one agent in its own process group; its log in $tmp/NAME.log.
start() {
    setsid "$agent" --nnodes 2:4 --rdzv-endpoint "$DUCTILE_TEST_ETCD" --rdzv-id demo \
        --node-id "$1" --node-addr 127.0.0.1 --lease-ttl 5 --last-call 1 --rebuild inplace \
        --max-restarts 10 -- \
        "$train" --data "$data" --model mlp --epochs "$epochs" --batch-size 64 --threads 1 \
        --log-every 100 --checkpoint-dir "$tmp/ckpt" --checkpoint-every 200 \
        --summary "$tmp/summary.json" >"$tmp/$1.log" 2>&1 &
    pid[$1]=$!
}

# What a person watching wants to see, one line per event, as it happens.
# tail stops by itself once this script is gone (--pid).
show() {
    tail -q -n +1 -F --pid=$$ "$@" 2>/dev/null > >(grep --line-buffered -E \
        "round [0-9]+ (frozen|ended)|rebuilt in place|ductile-train: (step|epoch|done)" |
        sed -u -E 's/^[0-9T:-]+Z //; s/^\[[0-9]+\] //') &
    shower=$!
}

echo "demo: etcd at $DUCTILE_TEST_ETCD; three agents train the MLP on Fashion-MNIST ($epochs epochs)"
for n in node-a node-b node-c; do start $n; done
show "$tmp"/node-a.log "$tmp"/node-b.log "$tmp"/node-c.log "$tmp"/node-d.log

steps() { grep -ho "ductile-train: step [0-9]*" "$tmp"/*.log 2>/dev/null | awk '{print $3}' | sort -n | tail -1; }
wait_step() { # wait_step N SECONDS
    local deadline=$((SECONDS + $2)) s
    while s=$(steps); [ "${s:-0}" -lt "$1" ]; do
        if [ $SECONDS -ge $deadline ]; then
            echo "demo: training did not reach step $1 within $2 s" >&2
            exit 1
        fi
        sleep 0.5
    done
}

total=$((epochs * 60000 / (64 * 3)))
wait_step $((total / 3)) 300
echo "demo: >>> killing node-c and its worker (SIGKILL)"
disown "${pid[node-c]}"
kill -9 -- "-${pid[node-c]}"
unset 'pid[node-c]'
sleep 3
echo "demo: >>> node-d joins"
start node-d

status=0
for n in node-a node-b node-d; do
    if ! wait "${pid[$n]}"; then
        echo "demo: agent $n failed; its log:" >&2
        tail -20 "$tmp/$n.log" >&2
        status=1
    fi
done
sleep 1.5 # let the last lines through
if [ $status -eq 0 ] && [ -s "$tmp/summary.json" ]; then
    python3 - "$tmp/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print("demo: job complete: %d steps, %.2f epochs, final test accuracy %.4f, %.0f samples/s "
      "(world size at the end %d, %s)" % (s["steps"], s["epochs"], s["test_accuracy"],
                                          s["samples_per_s"], s["world_size"], s["device"]))
EOF
else
    echo "demo: the job did not complete" >&2
    status=1
fi
exit $status
