#!/bin/sh
# bench/ddp/run.sh BUILD_DIR: training throughput (samples/s) of ductile-train
# with 1 and 2 ranks, with the all-reduce overlapping backward (--overlap)
# and after it (--no-overlap), beside PyTorch DDP (CPU, gloo) training the
# same MLP on the same data with the same per-rank batch in the same run;
# prints ours/torch for each, overlap/after for both, and which of the two
# ductile-train's default (auto) picks on this machine, and why.
#
# One BLAS/intra-op thread per rank for both. 2 ranks of ours run under
# ductile-agent --standalone (private etcd, TCP ring); torch's under
# torch.multiprocessing with gloo. torch comes from PyPI into a venv
# (DUCTILE_BENCH_VENV, default ~/.cache/ductile/bench-venv), installed on
# first use. Two models: the issue's MLP 256-128 (one 0.9 MB gradient
# bucket, so overlap has nothing to overlap) and a wide MLP 1024-1024
# (7 MB of gradients in 1 MB buckets), where overlap can pay. Last, PyTorch
# DDP through the ductile.torch helper beside plain PyTorch DDP.
#   DDP_STEPS=300 DDP_STEPS_WIDE=100 DDP_BATCH=64
set -u
build=${1:?usage: bench/ddp/run.sh BUILD_DIR}
here=$(cd "$(dirname "$0")" && pwd)
agent=$build/agent/ductile-agent
train=$build/trainer/ductile-train
data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
venv=${DUCTILE_BENCH_VENV:-$HOME/.cache/ductile/bench-venv}
batch=${DDP_BATCH:-64}
[ -x "$train" ] && [ -x "$agent" ] || { echo "bench/ddp: build $train and $agent first" >&2; exit 1; }

if ! "$venv/bin/python" -c "import torch, numpy" 2>/dev/null; then
    echo "bench/ddp: installing torch from PyPI into $venv (large download)"
    python3 -m venv "$venv" && "$venv/bin/pip" install -q torch numpy ||
        { echo "bench/ddp: cannot install torch" >&2; exit 1; }
fi
tmp=$(mktemp -d /tmp/ductile-bench-ddp-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

ours() { # ours WORLD STEPS HIDDEN CAP [--overlap|--no-overlap] -> samples/s
    world=$1 steps=$2 hidden=$3 cap=$4
    shift 4
    set -- --data "$data" --threads 1 --hidden "$hidden" --batch-size "$batch" \
        --bucket-cap-mb "$cap" --max-steps "$steps" --limit-test 1000 --log-every 100000 \
        --summary "$tmp/s.json" "$@"
    rm -f "$tmp/s.json"
    if [ "$world" = 1 ]; then
        "$train" "$@" >"$tmp/log" 2>&1
    else
        "$agent" --standalone --nproc-per-node "$world" --last-call 0 -- "$train" "$@" \
            >"$tmp/log" 2>&1
    fi || { tail -3 "$tmp/log" >&2; echo 0; return; }
    python3 -c "import json; print(round(json.load(open('$tmp/s.json'))['samples_per_s']))"
}

auto_pick() { # auto_pick WORLD HIDDEN CAP -> what the default (auto) chose, and why
    ours "$1" 2 "$2" "$3" >/dev/null
    python3 -c "import json; j = json.load(open('$tmp/s.json'))
print(('overlapped' if j['overlap'] else 'after') + ' (' + j['overlap_why'] + ')')" 2>/dev/null ||
        echo "unknown (the run failed)"
}

theirs() { # theirs WORLD STEPS HIDDEN [--no-overlap] -> samples/s
    world=$1 steps=$2 hidden=$3
    shift 3
    "$venv/bin/python" "$here/torch_ddp.py" --world "$world" --steps "$steps" --batch "$batch" \
        --hidden "$hidden" --threads 1 --data "$data" "$@" 2>"$tmp/torch.err" |
        python3 -c "import json,sys; print(round(json.loads(sys.stdin.read())['samples_per_s']))" ||
        { tail -3 "$tmp/torch.err" >&2; echo 0; }
}

echo "per-rank batch $batch, 1 thread per rank, $(nproc) cores; torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
printf '%-14s %-6s %-12s %12s %12s %10s\n' model ranks allreduce "ours/s" "torch/s" ours/torch
row() { # row MODEL RANKS MODE OURS THEIRS
    ratio=$(python3 -c "print(f'{$4 / $5:.2f}' if $5 else '-')")
    printf '%-14s %-6s %-12s %12s %12s %10s\n' "$1" "$2" "$3" "$4" "$5" "$ratio"
}
for cfg in "mlp-256-128 256,128 25 ${DDP_STEPS:-300}" "mlp-1024-1024 1024,1024 1 ${DDP_STEPS_WIDE:-100}"; do
    set -- $cfg
    name=$1 hidden=$2 cap=$3 steps=$4
    row "$name" 1 none "$(ours 1 "$steps" "$hidden" "$cap")" "$(theirs 1 "$steps" "$hidden")"
    o2=$(ours 2 "$steps" "$hidden" "$cap" --overlap)
    to2=$(theirs 2 "$steps" "$hidden")
    row "$name" 2 overlapped "$o2" "$to2"
    n2=$(ours 2 "$steps" "$hidden" "$cap" --no-overlap)
    tn2=$(theirs 2 "$steps" "$hidden" --no-overlap)
    row "$name" 2 after "$n2" "$tn2"
    echo "   $name, 2 ranks: overlapped/after $(python3 -c "print(f'{$o2 / $n2:.2f}x' if $n2 else '-')")" \
        "for ours, $(python3 -c "print(f'{$to2 / $tn2:.2f}x' if $tn2 else '-')") for torch;" \
        "ours by default: $(auto_pick 2 "$hidden" "$cap")"
done
# What ductile.torch (python/: rebuilt in place; a commit and a one-integer
# vote per step) costs a PyTorch DDP script, beside the same script without it.
plain=$(theirs 2 "${DDP_STEPS:-300}" 256,128)
helper=$(theirs 2 "${DDP_STEPS:-300}" 256,128 --helper)
echo "   torch DDP through ductile.torch, mlp-256-128, 2 ranks: $helper samples/s vs $plain" \
    "without it: $(python3 -c "print(f'{$helper / $plain:.2f}x' if $plain else '-')")"
