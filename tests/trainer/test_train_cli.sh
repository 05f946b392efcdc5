#!/bin/sh
# test_train_cli.sh: ductile-train refuses bad input with one line and the
# right exit status: bad flags and environment values (2 for flags, 1 for
# the environment), missing, malformed and truncated data files (1).
# Needs TRAIN (the binary) and FASHION_MNIST (the real data set).
set -u
fail=0
tmp=$(mktemp -d /tmp/ductile-test-cli-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# expect STATUS WORD CMD...: exit status STATUS, stderr one line containing WORD.
expect() {
    want=$1 word=$2
    shift 2
    "$@" >"$tmp/out" 2>"$tmp/err"
    got=$?
    lines=$(wc -l <"$tmp/err")
    if [ "$got" != "$want" ] || [ "$lines" != 1 ] || ! grep -q -- "$word" "$tmp/err"; then
        echo "FAIL: $* -> exit $got (want $want), $lines stderr lines (want 1 with '$word'):"
        sed 's/^/    /' "$tmp/err" | head -20
        fail=1
    else
        echo "ok: $* -> $got: $(cat "$tmp/err")"
    fi
}

"$TRAIN" --help >"$tmp/out" 2>&1 || { echo "FAIL: --help exits non-zero"; fail=1; }
grep -q -- "--bucket-cap-mb" "$tmp/out" || { echo "FAIL: --help lists no options"; fail=1; }

expect 2 "mlp or cnn" "$TRAIN" --model resnet
expect 2 "batch-size" "$TRAIN" --batch-size 0
expect 2 "epochs" "$TRAIN" --epochs ten
expect 2 "lr" "$TRAIN" --lr -1
expect 2 "sgd or adamw" "$TRAIN" --optimizer adam
expect 2 "hidden" "$TRAIN" --hidden 256,,128
expect 2 "kernel" "$TRAIN" --kernel 4
expect 2 "unknown" "$TRAIN" --no-such-flag
expect 2 "incomplete" "$TRAIN" --epochs
expect 2 "unexpected" "$TRAIN" extra
expect 2 "bucket-cap-mb" env DUCTILE_TRAIN_BUCKET_CAP_MB=lots "$TRAIN"
expect 2 "auto, ring or shm" "$TRAIN" --comm tcp
expect 2 "auto, ring or shm" env DUCTILE_TRAIN_COMM=nccl "$TRAIN"
expect 1 "RANK" env WORLD_SIZE=2 RANK=2 "$TRAIN" --data "$FASHION_MNIST"
expect 1 "WORLD_SIZE" env WORLD_SIZE=0 "$TRAIN" --data "$FASHION_MNIST"
expect 1 "DUCTILE_ETCD_ENDPOINTS" env WORLD_SIZE=2 RANK=0 "$TRAIN" --data "$FASHION_MNIST"

# Failpoints: a malformed spec is refused at start; train.step=N:fail fails
# step N here (first-hand), sleep:MS only slows it, another action is named
# and ignored.
expect 2 "DUCTILE_FAILPOINTS" env DUCTILE_FAILPOINTS="train.step" "$TRAIN"
expect 2 "DUCTILE_FAILPOINTS" env DUCTILE_FAILPOINTS="train.step=0:fail" "$TRAIN"
small="--data $FASHION_MNIST --limit-train 256 --limit-test 64 --batch-size 32 --threads 1"
# shellcheck disable=SC2086
expect 1 "failpoint train.step" env DUCTILE_FAILPOINTS="train.step=3:fail" "$TRAIN" $small
# shellcheck disable=SC2086
expect 0 "unknown action 'explode'" env DUCTILE_FAILPOINTS="train.step=1:explode" "$TRAIN" \
    $small --max-steps 2
# shellcheck disable=SC2086
if ! env DUCTILE_FAILPOINTS="train.step=1-2:sleep:20" "$TRAIN" $small --max-steps 3 \
    >"$tmp/out" 2>"$tmp/err" || [ -s "$tmp/err" ]; then
    echo "FAIL: train.step=1-2:sleep:20 did not train quietly:"
    sed 's/^/    /' "$tmp/err" | head -20
    fail=1
fi

# Data: missing directory, then a copy of the real set with one file broken.
expect 1 "train-images" "$TRAIN" --data "$tmp/none"
mkdir "$tmp/d"
cp "$FASHION_MNIST"/*.gz "$tmp/d/"
size=$(stat -c %s "$tmp/d/t10k-images-idx3-ubyte.gz")
truncate -s $((size / 2)) "$tmp/d/t10k-images-idx3-ubyte.gz"
expect 1 "t10k-images" "$TRAIN" --data "$tmp/d" --limit-train 64
cp "$FASHION_MNIST/t10k-images-idx3-ubyte.gz" "$tmp/d/"
printf '\000\000\010\004\000\000\000\001' | gzip >"$tmp/d/train-labels-idx1-ubyte.gz"
expect 1 "magic" "$TRAIN" --data "$tmp/d"
# Labels of the test set paired with the training images: counts differ.
cp "$FASHION_MNIST/t10k-labels-idx1-ubyte.gz" "$tmp/d/train-labels-idx1-ubyte.gz"
expect 1 "labels for" "$TRAIN" --data "$tmp/d"
# Not gzip at all, not IDX either.
echo "hello" >"$tmp/d/train-labels-idx1-ubyte.gz"
expect 1 "train-labels" "$TRAIN" --data "$tmp/d"

exit $fail
