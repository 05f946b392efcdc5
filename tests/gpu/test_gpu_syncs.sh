#!/bin/sh
# test_gpu_syncs.sh: ductile-train on the GPU waits for the device at most
# once an optimizer step in steady state. The host test runtime counts
# every host synchronisation (stream, event and device syncs, copies into
# pageable memory, cudaFree) and writes the count at exit
# (DUCTILE_GPURT_SYNCS); two runs that differ only in --max-steps, with no
# epoch end, evaluation or checkpoint between, differ by the steps' own.
# Needs TRAIN, PROBE (gpu_probe) and FASHION_MNIST; host runtime only.
set -u
"$PROBE" || exit $?
tmp=$(mktemp -d /tmp/ductile-test-gpu-syncs-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail=0
for model in mlp cnn; do
    for steps in 20 60; do
        DUCTILE_GPURT_SYNCS="$tmp/$model.$steps" "$TRAIN" --data "$FASHION_MNIST" --threads 1 \
            --model "$model" --device cuda --limit-train 4000 --limit-test 100 --batch-size 32 \
            --max-steps "$steps" --log-every 1000 >"$tmp/$model.$steps.log" 2>&1 ||
            { echo "FAIL: $model, $steps steps: exit $?"; cat "$tmp/$model.$steps.log"; fail=1; }
    done
    a=$(sed -n 's/^syncs //p' "$tmp/$model.20" 2>/dev/null)
    b=$(sed -n 's/^syncs //p' "$tmp/$model.60" 2>/dev/null)
    if [ -z "$a" ] || [ -z "$b" ]; then
        echo "FAIL: $model: no sync count written"
        fail=1
        continue
    fi
    per=$(python3 -c "print((int('$b') - int('$a')) / 40)")
    echo "$model: $a host syncs in 20 steps, $b in 60: $per a step"
    python3 -c "import sys; sys.exit(not ($per <= 1.0))" ||
        { echo "FAIL: $model: $per host syncs a step, want at most 1"; fail=1; }
done
[ $fail = 0 ] && echo "test_gpu_syncs: all checks passed"
exit $fail
