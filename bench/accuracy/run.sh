#!/bin/sh
# bench/accuracy/run.sh BUILD_DIR: trains the MLP and the CNN on Fashion-MNIST
# with 2 ranks under ductile-agent (--standalone: a private etcd, one node,
# two workers) and prints epochs, time and test accuracy beside the published
# figures the issue asks us to reach (Fashion-MNIST's benchmark table:
# MLP 256-128-100 0.8833, 2 conv + pooling 0.916).
#
#   ACC_MODELS="mlp cnn"   which models to train
#   ACC_EPOCHS_MLP=15 ACC_EPOCHS_CNN=10
set -u
build=${1:?usage: bench/accuracy/run.sh BUILD_DIR}
agent=$build/agent/ductile-agent
train=$build/trainer/ductile-train
data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
[ -x "$train" ] || { echo "bench/accuracy: no $train (build first)" >&2; exit 1; }
[ -x "$agent" ] || { echo "bench/accuracy: no $agent (build first)" >&2; exit 1; }
tmp=$(mktemp -d /tmp/ductile-bench-acc-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

run() { # run NAME TARGET ARGS...: one 2-rank training run under the agent
    name=$1 target=$2
    shift 2
    echo "-- $name: ductile-agent --standalone --nproc-per-node 2 -- ductile-train $*"
    "$agent" --standalone --nproc-per-node 2 --last-call 0 -- \
        "$train" --data "$data" --summary "$tmp/$name.json" --log-every 200 "$@" \
        >"$tmp/$name.log" 2>&1
    rc=$?
    grep -E "test_accuracy|done:" "$tmp/$name.log" | sed 's/^/   /'
    if [ $rc != 0 ] || [ ! -s "$tmp/$name.json" ]; then
        echo "bench/accuracy: $name failed (exit $rc):" >&2
        tail -5 "$tmp/$name.log" >&2
        echo "$name - - - $target FAILED" >>"$tmp/table"
        return 1
    fi
    python3 - "$tmp/$name.json" "$name" "$target" >>"$tmp/table" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
acc, target = s["test_accuracy"], float(sys.argv[3])
print(f'{sys.argv[2]} {s["epochs"]:.0f} {s["seconds"]:.0f} {acc:.4f} {target} '
      f'{"reached" if acc >= target else "MISSED"}')
EOF
}

status=0
for model in ${ACC_MODELS:-mlp cnn}; do
    case $model in
    mlp) run mlp 0.88 --model mlp --hidden 256,128 --epochs "${ACC_EPOCHS_MLP:-15}" \
        --batch-size 64 --optimizer sgd --lr 0.05 --momentum 0.9 --weight-decay 0.0001 \
        --warmup-steps 200 || status=1 ;;
    cnn) run cnn 0.91 --model cnn --conv 16,32 --hidden 128 --epochs "${ACC_EPOCHS_CNN:-10}" \
        --batch-size 64 --optimizer sgd --lr 0.05 --momentum 0.9 --weight-decay 0.0001 \
        --warmup-steps 200 || status=1 ;;
    esac
done
echo
echo "2 ranks under ductile-agent, batch 64 per rank (global 128), SGD momentum 0.9, cosine"
printf '%-6s %7s %9s %14s %8s %s\n' model epochs seconds test_accuracy target result
while read -r m e s a t r; do
    printf '%-6s %7s %9s %14s %8s %s\n' "$m" "$e" "$s" "$a" "$t" "$r"
    [ "$r" = reached ] || status=1
done <"$tmp/table"
exit $status
