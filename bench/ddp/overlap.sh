#!/bin/sh
# bench/ddp/overlap.sh BUILD_DIR: what overlap buys ductile-train here, with
# nothing else to compare: 2 ranks under ductile-agent --standalone, 1 BLAS
# thread each, --overlap and --no-overlap run in turn ROUNDS times per model,
# which goes first swapping every round (so a load that comes and goes, or
# a cost of coming second, falls on both alike); prints the median
# samples/s of each, the median of the rounds' overlapped/after ratios (each
# from two runs next to each other), and what the default (auto) picks here.
# run.sh has the same runs once each, beside torch; this one is for the
# overlap decision on a machine shared with other work.
#   OVERLAP_ROUNDS=5 DDP_STEPS=300 DDP_STEPS_WIDE=100 DDP_BATCH=64
set -u
build=${1:?usage: bench/ddp/overlap.sh BUILD_DIR}
agent=$build/agent/ductile-agent
train=$build/trainer/ductile-train
data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
rounds=${OVERLAP_ROUNDS:-5}
[ -x "$train" ] && [ -x "$agent" ] || { echo "bench/ddp: build $train and $agent first" >&2; exit 1; }
tmp=$(mktemp -d /tmp/ductile-bench-overlap-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

run() { # run STEPS HIDDEN CAP ARGS... -> samples/s (0 on failure); summary in $tmp/s.json
    steps=$1 hidden=$2 cap=$3
    shift 3
    rm -f "$tmp/s.json"
    "$agent" --standalone --nproc-per-node 2 --last-call 0 -- "$train" --data "$data" --threads 1 \
        --hidden "$hidden" --batch-size "${DDP_BATCH:-64}" --bucket-cap-mb "$cap" \
        --max-steps "$steps" --limit-test 1000 --log-every 100000 --summary "$tmp/s.json" "$@" \
        >"$tmp/log" 2>&1 || { tail -3 "$tmp/log" >&2; echo 0; return; }
    python3 -c "import json; print(round(json.load(open('$tmp/s.json'))['samples_per_s']))"
}
median() { python3 -c "import statistics, sys; print(round(statistics.median(map(float, sys.argv[1:]))))" "$@"; }
paired() { # paired "O1 O2 ..." "N1 N2 ...": the median of Oi/Ni
    python3 -c "import statistics, sys
o, n = (list(map(float, a.split())) for a in sys.argv[1:])
r = [a / b for a, b in zip(o, n) if b]
print(f'{statistics.median(r):.2f}x' if r else '-')" "$1" "$2"
}

echo "2 ranks x 1 BLAS thread, $(nproc) cores, $rounds rounds of --overlap and --no-overlap"
printf '%-14s %13s %10s %18s  %s\n' model "overlapped/s" "after/s" "overlapped/after" "auto picks"
for cfg in "mlp-256-128 256,128 25 ${DDP_STEPS:-300}" "mlp-1024-1024 1024,1024 1 ${DDP_STEPS_WIDE:-100}"; do
    set -- $cfg
    name=$1 hidden=$2 cap=$3 steps=$4
    o="" n="" i=0
    while [ $i -lt "$rounds" ]; do
        if [ $((i % 2)) = 0 ]; then
            o="$o $(run "$steps" "$hidden" "$cap" --overlap)"
            n="$n $(run "$steps" "$hidden" "$cap" --no-overlap)"
        else
            n="$n $(run "$steps" "$hidden" "$cap" --no-overlap)"
            o="$o $(run "$steps" "$hidden" "$cap" --overlap)"
        fi
        i=$((i + 1))
    done
    run 2 "$hidden" "$cap" >/dev/null
    pick=$(python3 -c "import json; j = json.load(open('$tmp/s.json'))
print(('overlapped' if j['overlap'] else 'after') + ' (' + j['overlap_why'] + ')')" 2>/dev/null ||
        echo "unknown (the run failed)")
    mo=$(median $o) mn=$(median $n)
    printf '%-14s %13s %10s %18s  %s\n' "$name" "$mo" "$mn" "$(paired "$o" "$n") paired" "$pick"
    echo "   each run, overlapped:$o; after:$n"
done
