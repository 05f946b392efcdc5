#!/bin/sh
# tests/gpu/run.sh: everything GPU in one go, on a machine with a CUDA device.
#
#   tests/gpu/run.sh [BUILD_DIR]      (default build-gpu; run from anywhere)
#
# 1. builds the tree without sanitizers (RelWithDebInfo) into BUILD_DIR;
# 2. runs every GPU test (ctest label "gpu": kernels vs CPU references, NCCL
#    world size 1 through the DDP path, GPU vs CPU training and checkpoints);
# 3. a short throughput bench: ductile-train samples/s on the GPU beside the
#    CPU (same run, same flags), MLP and CNN; cuBLAS SGEMM at 4096^3 beside
#    the device's published dense FP32 peak;
# 4. prints a summary table. Exit 0 when every test passed, 1 if one failed,
#    77 without a device (with the reason). Meant to finish in under 5 minutes.
#
# The tests run with NCCL_CHECK_POINTERS=1 (NCCL checks every buffer it is
# handed). Multi-rank NCCL (several GPUs) is not exercised here: one GPU
# cannot host it. It runs in `make test` on the host test runtime
# (-DDUCTILE_GPU_RUNTIME=host: gpu_ddp_ranks at world 2 and 3, gpu_comm.*,
# the GPU e2e), and the NCCL backend's single-rank path runs here
# (gpu_ddp_nccl, the state sync's claim included).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-gpu}
data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
jobs=$(nproc 2>/dev/null || echo 4)
start=$(date +%s)
tmp=$(mktemp -d /tmp/ductile-gpu-run-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

echo "== build ($build)"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDUCTILE_SANITIZE=OFF \
    -DDUCTILE_CUDA=ON >"$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log"; exit 1; }
grep -q "CUDA parts ON" "$tmp/cmake.log" || { echo "run.sh: CUDA not found by cmake"; exit 1; }
cmake --build "$build" -j"$jobs" --target ductile-train compare_params gpu_probe gpu_sgemm_bench \
    test_gpu_kernels test_gpu_ddp >"$tmp/build.log" 2>&1 || { tail -40 "$tmp/build.log"; exit 1; }

probe=$build/tests/gpu/gpu_probe
"$probe" >"$tmp/probe" 2>&1
rc=$?
cat "$tmp/probe"
[ $rc = 0 ] || exit $rc
gpu_name=$(head -1 "$tmp/probe")

echo "== GPU tests (NCCL_CHECK_POINTERS=1)"
export NCCL_CHECK_POINTERS=1
results=""
failed=0
for t in gpu_kernels gpu_ddp_nccl gpu_train; do
    t0=$(date +%s)
    if ctest --test-dir "$build" -R "^$t\$" --output-on-failure >"$tmp/$t.log" 2>&1; then
        if grep -q "Skipped\|Not Run" "$tmp/$t.log"; then s=SKIP; else s=PASS; fi
    else
        s=FAIL
        failed=1
        cat "$tmp/$t.log"
    fi
    results="$results$(printf '%-16s %-5s %4ss' "$t" "$s" $(($(date +%s) - t0)))
"
done
printf '%s' "$results"

echo "== bench: ductile-train samples/s (batch 128, 200 steps each)"
json() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$@"; }
train() { # model device steps -> samples/s
    "$build/trainer/ductile-train" --data "$data" --model "$1" --device "$2" --max-steps "$3" \
        --batch-size 128 --limit-test 512 --warmup-steps 10 --log-every 1000 \
        --summary "$tmp/bench.json" >"$tmp/bench.log" 2>&1 || { echo "0"; return; }
    json "$tmp/bench.json" samples_per_s
}
bench=""
for m in mlp cnn; do
    g=$(train $m cuda 200)
    c=$(train $m cpu 200)
    r=$(python3 -c "print('%.1f' % ($g / $c) if $c > 0 else 'n/a')")
    bench="$bench$(printf '%-22s %12.0f %12.0f %8sx' "ductile-train $m" "$g" "$c" "$r")
"
done

sg=$("$build/tests/gpu/gpu_sgemm_bench" 4096 20 | awk '{print $3}')
# Published dense FP32 (non-tensor) peaks, TFLOP/s: NVIDIA's H200 datasheet
# gives 67 for H200 SXM and 60 for H200 NVL.
case "$gpu_name" in
*H200*NVL*) peak=60 ;;
*H200*) peak=67 ;;
*) peak="" ;;
esac

echo
echo "==== summary ($gpu_name)"
echo "test             result  time"
printf '%s' "$results"
echo
printf '%-22s %12s %12s %9s\n' "throughput" "GPU" "CPU" "ratio"
printf '%s' "$bench"
echo
printf '%-22s %12s %12s %9s\n' "FP32 GEMM, TFLOP/s" "measured" "peak" "ratio"
if [ -n "$peak" ]; then
    printf '%-22s %12s %12s %8sx\n' "cuBLAS SGEMM 4096^3" "$sg" "$peak" \
        "$(python3 -c "print('%.2f' % ($sg / $peak))")"
else
    printf '%-22s %12s %12s\n' "cuBLAS SGEMM 4096^3" "$sg" "unknown"
fi
echo "(peak: published dense FP32 of the device; CPU: $(nproc) cores, OpenBLAS)"
echo "multi-rank NCCL not exercised: one GPU (make test runs it on the host test runtime)"
echo "total $(($(date +%s) - start)) s"
exit $failed
