#!/bin/sh
# test_train_single.sh: ductile-train as one process, end to end.
#  - training on a small subset reduces the loss and beats chance by far;
#  - --accumulate 2 with batch 8 gives the parameters of batch 16 (no_sync);
#  - a run stopped at --max-steps and resumed from its checkpoint ends with
#    the parameters of a run that never stopped, and the recorded samples
#    show every sample exactly once per epoch;
#  - SIGTERM finishes the step, saves and exits 0; the next run resumes there;
#  - a checkpoint that cannot be written (full disk) is reported and training
#    goes on; the CNN trains;
#  - auto overlap follows the cores the process may use (under taskset),
#    and --overlap / --no-overlap force it.
# Needs TRAIN, COMPARE (compare_params) and FASHION_MNIST.
set -u
fail=0
tmp=$(mktemp -d /tmp/ductile-test-single-XXXXXX)
cleanup() {
    [ -n "${mnt:-}" ] && umount "$mnt" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
T() { "$TRAIN" --data "$FASHION_MNIST" --threads 1 "$@"; }
bad() {
    echo "FAIL: $*"
    fail=1
}
json() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$@"; }

echo "== learning"
T --limit-train 2000 --limit-test 1000 --epochs 3 --batch-size 32 --log-every 10 \
    --summary "$tmp/learn.json" >"$tmp/learn.log" 2>&1 || bad "training run exited $?"
first=$(grep -o 'loss [0-9.]*' "$tmp/learn.log" | head -1 | cut -d' ' -f2)
last=$(grep -o 'loss [0-9.]*' "$tmp/learn.log" | tail -1 | cut -d' ' -f2)
acc=$(json "$tmp/learn.json" test_accuracy)
echo "loss $first -> $last, test accuracy $acc"
python3 -c "import sys; sys.exit(not ($last < 0.7 * $first))" || bad "loss did not fall: $first -> $last"
python3 -c "import sys; sys.exit(not ($acc > 0.6))" || bad "accuracy $acc after 3 small epochs"
[ "$(json "$tmp/learn.json" steps)" = 189 ] || bad "steps $(json "$tmp/learn.json" steps), want 189"

echo "== accumulate 2 x 8 == batch 16"
common="--limit-train 1000 --limit-test 100 --max-steps 20 --warmup-steps 5"
T $common --batch-size 16 --dump-params "$tmp/b16" >/dev/null || bad "batch 16 run"
T $common --batch-size 8 --accumulate 2 --dump-params "$tmp/a2" >/dev/null || bad "accumulate run"
"$COMPARE" "$tmp/a2" "$tmp/b16" 1e-5 || bad "accumulate 2 x 8 differs from batch 16"
T $common --batch-size 16 --seed 2 --dump-params "$tmp/seed2" >/dev/null || bad "seed 2 run"
"$COMPARE" "$tmp/seed2" "$tmp/b16" 1e-5 >/dev/null && bad "another seed gave the same parameters"

echo "== stop at --max-steps, resume, compare with an uninterrupted run"
common="--limit-train 500 --limit-test 100 --batch-size 32 --epochs 2 --optimizer adamw"
T $common --checkpoint-dir "$tmp/ck" --max-steps 10 --record-samples "$tmp/rec" \
    --summary "$tmp/part1.json" >/dev/null || bad "first part"
[ "$(json "$tmp/part1.json" stopped_by)" = max_steps ] || bad "first part not stopped by max_steps"
T $common --checkpoint-dir "$tmp/ck" --record-samples "$tmp/rec" --dump-params "$tmp/resumed" \
    --summary "$tmp/part2.json" >"$tmp/part2.log" || bad "second part"
grep -q "resumed from .*step 10" "$tmp/part2.log" || bad "did not resume from step 10"
T $common --dump-params "$tmp/straight" >/dev/null || bad "uninterrupted run"
"$COMPARE" "$tmp/resumed" "$tmp/straight" 1e-6 || bad "resumed run differs from uninterrupted"
python3 - "$tmp/rec" 500 2 <<'EOF' || bad "samples not seen exactly once per epoch"
import collections, sys
n, epochs = int(sys.argv[2]), int(sys.argv[3])
seen = collections.defaultdict(list)
for line in open(sys.argv[1]):
    epoch, sample, step, rank = map(int, line.split())
    seen[epoch].append(sample)
ok = sorted(seen) == list(range(epochs))
for e in range(epochs):
    ok = ok and sorted(seen[e]) == list(range(n))
print("records:", {e: len(v) for e, v in seen.items()}, "ok" if ok else "WRONG")
sys.exit(0 if ok else 1)
EOF
ls "$tmp/ck" | grep -c '^ckpt-' | grep -qx 2 || bad "want the last two checkpoints, have: $(ls "$tmp/ck")"

echo "== SIGTERM: finish the step, save, exit 0, resume"
"$TRAIN" --data "$FASHION_MNIST" --threads 1 --limit-train 3000 --limit-test 100 --epochs 1000 \
    --log-every 5 --checkpoint-dir "$tmp/ck2" --summary "$tmp/term.json" >"$tmp/term.log" 2>&1 &
pid=$!
i=0
while ! grep -q "step 10 " "$tmp/term.log" && [ $i -lt 600 ]; do
    sleep 0.1
    i=$((i + 1))
done
kill -TERM $pid
wait $pid
rc=$?
[ $rc = 0 ] || bad "SIGTERM: exit $rc, want 0"
[ "$(json "$tmp/term.json" stopped_by)" = signal ] || bad "SIGTERM: not stopped by the signal"
steps=$(json "$tmp/term.json" steps)
ls "$tmp/ck2" | grep -q "s0*$steps.bin" || bad "SIGTERM: no checkpoint at step $steps"
T --limit-train 3000 --limit-test 100 --epochs 1000 --checkpoint-dir "$tmp/ck2" \
    --max-steps $((steps + 3)) --summary "$tmp/term2.json" >"$tmp/term2.log" 2>&1 ||
    bad "resume after SIGTERM"
[ "$(json "$tmp/term2.json" steps)" = $((steps + 3)) ] || bad "resume after SIGTERM: wrong step"
echo "stopped at step $steps, resumed to $(json "$tmp/term2.json" steps)"

echo "== full disk: the checkpoint fails, training goes on"
mnt="$tmp/full"
mkdir "$mnt"
if mount -t tmpfs -o size=64k tmpfs "$mnt" 2>/dev/null; then
    T --limit-train 512 --limit-test 100 --epochs 1 --checkpoint-dir "$mnt" --checkpoint-every 4 \
        --summary "$tmp/full.json" >"$tmp/full.out" 2>"$tmp/full.err" || bad "full disk: exit $?"
    grep -q "not saved, training on: .*No space left" "$tmp/full.err" ||
        bad "full disk not reported: $(head -2 "$tmp/full.err")"
    [ "$(json "$tmp/full.json" steps)" = 8 ] || bad "full disk: training stopped early"
    umount "$mnt"
else
    echo "SKIP full-disk case: cannot mount a tmpfs here"
fi

echo "== options from DUCTILE_TRAIN_* variables; a flag wins over its variable"
env DUCTILE_TRAIN_MAX_STEPS=3 DUCTILE_TRAIN_LIMIT_TRAIN=256 DUCTILE_TRAIN_LIMIT_TEST=64 \
    DUCTILE_TRAIN_BATCH_SIZE=100 DUCTILE_TRAIN_NO_OVERLAP=1 "$TRAIN" --data "$FASHION_MNIST" \
    --batch-size 16 --summary "$tmp/env.json" >/dev/null || bad "env run"
[ "$(json "$tmp/env.json" steps)" = 3 ] && [ "$(json "$tmp/env.json" batch_size)" = 16 ] &&
    [ "$(json "$tmp/env.json" overlap)" = False ] ||
    bad "env options: steps $(json "$tmp/env.json" steps), batch $(json "$tmp/env.json" batch_size)"

echo "== auto overlap by the cores this process may use (taskset); --overlap forces it"
# ov CPUS NAME ARGS...: one step on CPUS; the start line in $tmp/NAME.out
ov() {
    cpus=$1 name=$2
    shift 2
    taskset -c "$cpus" "$TRAIN" --data "$FASHION_MNIST" --threads 1 --limit-train 64 \
        --limit-test 16 --max-steps 1 --batch-size 16 --summary "$tmp/$name.json" "$@" \
        >"$tmp/$name.out" || bad "$name: exit $?"
}
expect_ov() { # expect_ov NAME OVERLAP TEXT
    [ "$(json "$tmp/$1.json" overlap)" = "$2" ] && grep -q "; all-reduce .*($3" "$tmp/$1.out" ||
        bad "$1: want overlap $2 ($3), got: $(grep "; all-reduce" "$tmp/$1.out")"
}
if taskset -c 0 true 2>/dev/null; then
    ov 0 ov-one
    expect_ov ov-one False "auto: 1 core for 1 local rank x 1 compute thread leave no core"
    ov 0 ov-forced --overlap
    expect_ov ov-forced True "forced by --overlap"
    if taskset -c 0,1 true 2>/dev/null; then
        ov 0,1 ov-two
        expect_ov ov-two True "auto: 2 cores for 1 local rank x 1 compute thread leave a core each"
        ov 0,1 ov-off --no-overlap
        expect_ov ov-off False "forced by --no-overlap"
    else
        echo "SKIP two-core case: fewer than 2 cores here"
    fi
else
    echo "SKIP: taskset cannot pin to cpu 0 here"
fi

echo "== cnn"
T --model cnn --limit-train 128 --limit-test 64 --epochs 1 --batch-size 32 \
    --summary "$tmp/cnn.json" >/dev/null || bad "cnn run"
json "$tmp/cnn.json" model | grep -q '^cnn' || bad "cnn summary"

exit $fail
