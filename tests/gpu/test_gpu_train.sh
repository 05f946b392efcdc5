#!/bin/sh
# test_gpu_train.sh: ductile-train on the GPU against the CPU, end to end.
#  - 20 steps of the MLP and of the CNN (SGD with momentum) on Fashion-MNIST
#    end with the CPU run's parameters within 2e-3 (relative L2 and max, as
#    compare_params measures: cuBLAS and OpenBLAS sum in different orders,
#    and 20 steps compound it; a wrong kernel is off by far more). AdamW is
#    not compared this way: it divides by the gradient's own scale, so a
#    near-zero gradient whose sign rounding flips moves a parameter by a whole
#    step; its update kernel is compared exactly in gpu_kernels, and here the
#    CNN trains with it on the GPU and its loss must fall;
#  - a checkpoint written on the GPU resumes on the CPU, and one written on
#    the CPU resumes on the GPU, each ending where the uninterrupted run ends
#    (the checkpoint is the CPU format: parameters are copied to the host
#    before saving and back to the device after loading);
#  - --device cuda without a device is a one-line error (checked by the
#    probe's skip path: the test is skipped then, exit 77).
# Needs TRAIN, COMPARE, PROBE (gpu_probe) and FASHION_MNIST.
set -u
"$PROBE" || exit $?
fail=0
tmp=$(mktemp -d /tmp/ductile-test-gpu-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
T() { "$TRAIN" --data "$FASHION_MNIST" --threads 2 --log-every 5 "$@"; }
bad() {
    echo "FAIL: $*"
    fail=1
}
json() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$@"; }
TOL=2e-3

for model in "mlp --optimizer sgd" "cnn --optimizer sgd"; do
    name=${model%% *}
    echo "== $name: 20 steps, GPU vs CPU"
    common="--model $model --limit-train 2000 --limit-test 500 --batch-size 32 --max-steps 20 --warmup-steps 5"
    T $common --device cpu --dump-params "$tmp/$name.cpu" --summary "$tmp/$name.cpu.json" \
        >"$tmp/$name.cpu.log" 2>&1 || bad "$name cpu run exited $?"
    T $common --device cuda --dump-params "$tmp/$name.gpu" --summary "$tmp/$name.gpu.json" \
        >"$tmp/$name.gpu.log" 2>&1 || { bad "$name gpu run exited $?"; cat "$tmp/$name.gpu.log"; }
    [ "$(json "$tmp/$name.gpu.json" device)" = cuda ] || bad "$name: summary does not say cuda"
    [ "$(json "$tmp/$name.gpu.json" steps)" = 20 ] || bad "$name: gpu run did not do 20 steps"
    "$COMPARE" "$tmp/$name.gpu" "$tmp/$name.cpu" $TOL || bad "$name: GPU parameters differ from CPU"
    echo "test accuracy: cpu $(json "$tmp/$name.cpu.json" test_accuracy)" \
        "gpu $(json "$tmp/$name.gpu.json" test_accuracy)"
done

echo "== cnn with adamw on the GPU: the loss falls"
T --model cnn --optimizer adamw --device cuda --limit-train 2000 --limit-test 200 --batch-size 32 \
    --max-steps 40 --warmup-steps 5 >"$tmp/adamw.log" 2>&1 || bad "adamw gpu run exited $?"
first=$(grep -o 'loss [0-9.]*' "$tmp/adamw.log" | head -1 | cut -d' ' -f2)
last=$(grep -o 'loss [0-9.]*' "$tmp/adamw.log" | tail -1 | cut -d' ' -f2)
echo "loss $first -> $last"
python3 -c "import sys; sys.exit(not ($last < 0.8 * $first))" || bad "adamw loss did not fall: $first -> $last"

echo "== checkpoint: GPU -> CPU and CPU -> GPU"
common="--model cnn --limit-train 1000 --limit-test 200 --batch-size 32 --epochs 1"
for way in "cuda cpu" "cpu cuda"; do
    first=${way% *}
    second=${way#* }
    dir="$tmp/ck-$first"
    T $common --device "$first" --checkpoint-dir "$dir" --max-steps 10 >"$tmp/$first.part1.log" 2>&1 ||
        bad "$first: first part exited $?"
    T $common --device "$second" --checkpoint-dir "$dir" --max-steps 20 --dump-params "$tmp/$first.resumed" \
        >"$tmp/$first.part2.log" 2>&1 || bad "$second: resumed part exited $?"
    grep -q "resumed from .*step 10" "$tmp/$first.part2.log" || bad "$first -> $second: did not resume at step 10"
    T $common --device "$second" --max-steps 20 --dump-params "$tmp/$first.straight" >/dev/null 2>&1 ||
        bad "$second: uninterrupted run exited $?"
    "$COMPARE" "$tmp/$first.resumed" "$tmp/$first.straight" $TOL ||
        bad "$first -> $second: resumed parameters differ from the uninterrupted run"
done

[ $fail = 0 ] && echo "test_gpu_train: all checks passed"
exit $fail
