#!/bin/sh
# test_train_ddp.sh: ductile-train with several ranks, as ductile-agent would
# start them (RANK, WORLD_SIZE, DUCTILE_ETCD_ENDPOINTS, DUCTILE_JOB,
# DUCTILE_ROUND=1 against a real etcd), run under with-etcd:
#  - N = 2, 3, 4 ranks with batch b end with the parameters of 1 rank with
#    batch N*b after 20 steps (DDP's defining property), with one and with
#    several gradient buckets;
#  - overlap on and off, and --accumulate, give the same parameters (the
#    N-rank runs force --overlap: auto would not overlap on a small machine);
#  - a run stopped at 2 ranks and resumed at 3 trains every sample exactly
#    once per epoch;
#  - SIGTERM to one rank stops every rank after the same step, exit 0;
#  - SIGKILL of one rank makes the others fail with one line, quickly.
# Needs TRAIN, COMPARE, FASHION_MNIST and DUCTILE_TEST_ETCD (with-etcd).
set -u
fail=0
tmp=$(mktemp -d /tmp/ductile-test-ddp-XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$tmp"' EXIT
bad() {
    echo "FAIL: $*"
    fail=1
}
json() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$@"; }

# start JOB WORLD NAME ARGS...: starts WORLD ranks in the background (pids in
# $tmp/NAME.pids, logs in $tmp/NAME.RANK.log). Round 1 is made the job's
# current round first, as the agent's rendezvous would.
start() {
    job=$1 world=$2 name=$3
    shift 3
    ETCDCTL_API=3 etcdctl --endpoints="$DUCTILE_TEST_ETCD" put "/ductile/$job/epoch" 1 >/dev/null
    : >"$tmp/$name.pids"
    r=0
    while [ $r -lt "$world" ]; do
        env RANK=$r WORLD_SIZE="$world" LOCAL_RANK=$r LOCAL_WORLD_SIZE="$world" \
            DUCTILE_ETCD_ENDPOINTS="$DUCTILE_TEST_ETCD" DUCTILE_JOB="$job" DUCTILE_ROUND=1 \
            "$TRAIN" --data "$FASHION_MNIST" --threads 1 --comm-timeout-ms 10000 "$@" \
            >"$tmp/$name.$r.log" 2>&1 &
        echo $! >>"$tmp/$name.pids"
        r=$((r + 1))
    done
}

# finish NAME [SECONDS]: waits for every rank (killing them past the
# deadline); returns the number of ranks that did not exit 0.
finish() {
    deadline=$(($(date +%s) + ${2:-240}))
    failed=0
    for pid in $(cat "$tmp/$1.pids"); do
        while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "rank pid $pid of $1 still running past its deadline: killed"
            kill -9 "$pid"
        fi
        wait "$pid" || failed=$((failed + 1))
    done
    return $failed
}

run() { # run JOB WORLD NAME ARGS...: start and finish, complaining on failure
    start "$@"
    finish "$3" || {
        bad "$3: ranks failed"
        tail -3 "$tmp/$3".*.log
    }
}

single() { # single NAME ARGS...: one process, no RANK
    name=$1
    shift
    "$TRAIN" --data "$FASHION_MNIST" --threads 1 "$@" >"$tmp/$name.log" 2>&1 ||
        bad "$name: exit $?"
}

common="--limit-train 2000 --limit-test 200 --max-steps 20 --warmup-steps 5 --log-every 1000"

echo "== N ranks x batch b == 1 rank x batch N*b after 20 steps"
for n in 2 3 4; do
    case $n in # 3 ranks: a deeper MLP in 4 buckets; the others: 2 buckets
    3) model="--hidden 64,64,64,64 --bucket-cap-mb 0.01" ;;
    *) model="--bucket-cap-mb 0.1" ;;
    esac
    run "eq-$n" $n "eq$n" $common $model --batch-size 8 --overlap --dump-params "$tmp/ddp$n" \
        --summary "$tmp/eq$n.json"
    single "one$n" $common $model --batch-size $((8 * n)) --dump-params "$tmp/one$n"
    echo "$n ranks, $(json "$tmp/eq$n.json" buckets) buckets:"
    "$COMPARE" "$tmp/ddp$n" "$tmp/one$n" 1e-5 || bad "$n ranks differ from one rank"
done

echo "== overlap off, and accumulate 2 x 4 per rank, give the same parameters"
run eq-noov 2 noov $common --bucket-cap-mb 0.1 --batch-size 8 --no-overlap \
    --dump-params "$tmp/noov"
"$COMPARE" "$tmp/noov" "$tmp/ddp2" 1e-6 || bad "overlap off differs from overlap on"
run eq-acc 2 acc $common --bucket-cap-mb 0.1 --batch-size 4 --accumulate 2 \
    --dump-params "$tmp/acc"
"$COMPARE" "$tmp/acc" "$tmp/one2" 1e-5 || bad "2 ranks x accumulate 2 x 4 differs from batch 16"

echo "== stop at 2 ranks, resume at 3: every sample once per epoch"
common2="--limit-train 600 --limit-test 100 --batch-size 16 --epochs 2 --checkpoint-dir $tmp/ck"
run resize-a 2 ra $common2 --max-steps 7 --record-samples "$tmp/rec"
run resize-b 3 rb $common2 --record-samples "$tmp/rec" --summary "$tmp/rb.json"
grep -q "resumed from .*step 7," "$tmp/rb.0.log" || bad "3 ranks did not resume from step 7"
python3 - "$tmp/rec" 600 2 <<'EOF' || bad "samples not seen exactly once per epoch"
import collections, sys
n, epochs = int(sys.argv[2]), int(sys.argv[3])
seen, ranks = collections.defaultdict(list), set()
for line in open(sys.argv[1]):
    epoch, sample, step, rank = map(int, line.split())
    seen[epoch].append(sample)
    ranks.add(rank)
ok = sorted(seen) == list(range(epochs)) and ranks == {0, 1, 2}
for e in range(epochs):
    ok = ok and sorted(seen[e]) == list(range(n))
print("records per epoch:", {e: len(v) for e, v in seen.items()}, "ranks", sorted(ranks),
      "ok" if ok else "WRONG")
sys.exit(0 if ok else 1)
EOF
[ "$(json "$tmp/rb.json" samples)" = 1200 ] || bad "resumed run: $(json "$tmp/rb.json" samples) samples"

echo "== SIGTERM to rank 1 only: both stop after the same step, exit 0"
start term 2 term --limit-train 60000 --limit-test 100 --epochs 100 --log-every 5 \
    --checkpoint-dir "$tmp/ck-term" --summary "$tmp/term.json"
i=0
while ! grep -q "step 10 " "$tmp/term.0.log" && [ $i -lt 600 ]; do
    sleep 0.1
    i=$((i + 1))
done
kill -TERM "$(sed -n 2p "$tmp/term.pids")"
finish term 60 || bad "SIGTERM: a rank exited non-zero"
[ "$(json "$tmp/term.json" stopped_by)" = peer ] || bad "rank 0 did not stop on rank 1's request"
steps=$(json "$tmp/term.json" steps)
ls "$tmp/ck-term" | grep -q "s0*$steps.bin" || bad "no checkpoint at step $steps"
echo "stopped together at step $steps"

echo "== SIGKILL of rank 2 of 3: the others fail, one line each"
start dead 3 dead --limit-train 60000 --limit-test 100 --epochs 100 --log-every 5 \
    --comm-timeout-ms 5000
i=0
while ! grep -q "step 10 " "$tmp/dead.0.log" && [ $i -lt 600 ]; do
    sleep 0.1
    i=$((i + 1))
done
kill -9 "$(sed -n 3p "$tmp/dead.pids")"
t0=$(date +%s)
finish dead 30
failed=$?
echo "$failed ranks failed, $(($(date +%s) - t0)) s after the kill"
[ $failed = 3 ] || bad "want 3 failed ranks (1 killed, 2 erroring), got $failed"
for r in 0 1; do
    err=$(grep -v -e "parameters in" -e "epoch [0-9]* loss" -e "test_accuracy" "$tmp/dead.$r.log")
    echo "  rank $r: $err"
    [ -n "$err" ] && [ "$(echo "$err" | wc -l)" = 1 ] && echo "$err" | grep -q "rank $r" ||
        bad "rank $r: want one error line naming the rank, got: '$err'"
done

exit $fail
