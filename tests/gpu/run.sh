#!/bin/sh
# tests/gpu/run.sh: everything GPU, on a real Linux node with NVIDIA GPUs.
#
#   sh tests/gpu/run.sh [BUILD_DIR]     (default build-gpu in the tree; run from anywhere)
#
# Needs CUDA 12/13 with nvcc, NCCL and compute-sanitizer (/usr/local/cuda/bin),
# Debian's etcd-server, python3 and Fashion-MNIST ($FASHION_MNIST, default
# /usr/share/datasets/fashion-mnist); torch only for the baseline (optional).
# N is the number of GPUs CUDA shows (CUDA_VISIBLE_DEVICES is honoured).
# One function per step, in this order:
#   build               RelWithDebInfo against the real CUDA libraries, into BUILD_DIR
#   probe               the GPUs (gpu_probe): N
#   gpu_kernels, gpu_ddp_nccl, gpu_train
#                       ctest's single-GPU tests, with NCCL_CHECK_POINTERS=1
#   bench_1gpu          ductile-train samples/s on one GPU beside the CPU;
#                       cuBLAS SGEMM beside the device's published FP32 peak
#   ddp_mlp, ddp_cnn    world N over NCCL, one rank per GPU, under one
#                       ductile-agent --standalone: the job completes and every
#                       rank ends with the same parameters, bit for bit
#   ddp_check_pointers  ddp_mlp again with NCCL_CHECK_POINTERS=1
#   pod_kill_join       two agents of N/2 GPUs each, rebuilt in place: one is
#                       SIGKILLed mid-run and a new one joins on its GPUs;
#                       e2e.py's checks (sample accounting, equal parameters)
#   e2e_gpu_core        e2e.py's GPU core (tests/e2e), one GPU per agent (N >= 4)
#   memcheck, racecheck compute-sanitizer on ductile-train at world 1
#   bench_ddp           samples/s at world N beside PyTorch eager DDP over NCCL
#                       (bench/ddp/torch_cuda.py): "model ours/s torch/s ratio"
# Each step prints "PASS name", "FAIL name: why" or "SKIP name: why"; the last
# line is "P passed, F failed". Exit 0 when nothing failed, 1 when something
# did, 77 when there is no GPU. Every command runs under timeout(1), every
# socket is on 127.0.0.1, and the logs go to a temporary directory removed at
# exit (KEEP=1 keeps it). Knobs: GPU_BENCH_STEPS (500), GPU_BENCH_WARMUP (50),
# GPU_BENCH_BATCH (128, per rank), TORCH_PYTHON (an interpreter with torch).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-gpu}
data=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
jobs=$(nproc 2>/dev/null || echo 4)
agent=$build/agent/ductile-agent
train=$build/trainer/ductile-train
compare=$build/tests/trainer/compare_params
probe=$build/tests/gpu/gpu_probe
# NCCL's bootstrap on loopback, like everything else here.
: "${NCCL_SOCKET_IFNAME:=lo}"
export NCCL_SOCKET_IFNAME
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ductile-gpu-run-XXXXXX") || exit 1
passed=0 failed=0 skipped=0 child=
ngpu=0 gpus="" gpu_name=""

# cleanup and on_signal run from the traps (SC2317: shellcheck cannot see it).
# shellcheck disable=SC2317
cleanup() { [ -n "${KEEP:-}" ] || rm -rf "$tmp"; }
# A signal stops the command in flight (timeout(1) passes it on to the
# command's whole process group), then the EXIT trap cleans up.
# shellcheck disable=SC2317
on_signal() {
    if [ -n "$child" ]; then
        kill -TERM "$child" 2>/dev/null
        wait "$child" 2>/dev/null
    fi
    exit "$1"
}
trap cleanup EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

pass() { passed=$((passed + 1)); echo "PASS $*"; }
skip() { skipped=$((skipped + 1)); echo "SKIP $1: $2"; }
fail() { # fail NAME WHY [LOG]: the log's last lines, then the FAIL line
    failed=$((failed + 1))
    if [ $# -ge 3 ] && [ -s "$3" ]; then tail -n 25 "$3" | sed 's/^/  | /'; fi
    echo "FAIL $1: $2"
}

# run SECONDS LOG CMD...: CMD under timeout(1) (SIGKILL 15 s after the
# SIGTERM), its output in LOG; its exit status (124 or 137: timed out). In
# the background and waited for, so that a signal to this script reaches it.
run() {
    run_s=$1 run_log=$2
    shift 2
    timeout -k 15 "$run_s" "$@" >"$run_log" 2>&1 </dev/null &
    child=$!
    wait "$child"
    run_rc=$?
    child=
    return $run_rc
}
why_rc() { # why_rc RC SECONDS: a failed command's exit status in words
    case $1 in
    124 | 137) echo "timed out after $2 s" ;;
    *) echo "exited $1" ;;
    esac
}
json() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$@"; }

# ---------------------------------------------------------------- build

step_build() {
    if ! run 600 "$tmp/cmake.log" cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DDUCTILE_SANITIZE=OFF -DDUCTILE_CUDA=ON -DDUCTILE_GPU_RUNTIME=cuda; then
        fail build "cmake failed" "$tmp/cmake.log"
        return 1
    fi
    if ! grep -q "CUDA parts ON" "$tmp/cmake.log"; then
        fail build "cmake found no CUDA toolkit (nvcc, cudart, cuBLAS)" "$tmp/cmake.log"
        return 1
    fi
    if ! run 3600 "$tmp/build.log" cmake --build "$build" -j"$jobs" --target ductile-train \
        ductile-agent compare_params gpu_probe gpu_sgemm_bench test_gpu_kernels test_gpu_ddp; then
        fail build "the build failed" "$tmp/build.log"
        return 1
    fi
    pass build
}

# ---------------------------------------------------------------- probe

# The GPUs: ngpu, gpus (CUDA_VISIBLE_DEVICES's entries, else 0..N-1, comma
# separated) and gpu_name. 0 with a GPU, 77 without, 1 on an error.
step_probe() {
    run 120 "$tmp/probe.log" "$probe"
    probe_rc=$?
    sed 's/^/  /' "$tmp/probe.log"
    if [ $probe_rc = 77 ]; then
        skip probe "$(grep -m1 SKIP "$tmp/probe.log" | sed 's/^SKIP: //')"
        return 77
    elif [ $probe_rc != 0 ]; then
        fail probe "gpu_probe $(why_rc $probe_rc 120)" "$tmp/probe.log"
        return 1
    fi
    ngpu=$(grep -c '^cuda:' "$tmp/probe.log")
    gpu_name=$(head -1 "$tmp/probe.log")
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | head -n "$ngpu" | paste -sd, -)
    else
        gpus=$(seq 0 $((ngpu - 1)) | paste -sd, -)
    fi
    pass "probe ($ngpu GPUs: $gpus)"
}
gpus_from() { # gpus_from FIRST COUNT: COUNT entries of $gpus from FIRST (0-based)
    echo "$gpus" | tr ',' '\n' | sed -n "$(($1 + 1)),$(($1 + $2))p" | paste -sd, -
}
need_gpus() { # need_gpus NAME K: 0 when there are K GPUs, else SKIP NAME and 1
    [ "$ngpu" -ge "$2" ] && return 0
    skip "$1" "needs $2 GPUs, found $ngpu"
    return 1
}

# ---------------------------------------------------------------- single GPU

# ctest's GPU tests, one GPU, with NCCL checking every pointer it is handed.
step_ctest() {
    run 900 "$tmp/$1.log" env NCCL_CHECK_POINTERS=1 \
        ctest --test-dir "$build" -R "^$1\$" --output-on-failure --timeout 600
    ctest_rc=$?
    if [ $ctest_rc != 0 ]; then
        fail "$1" "ctest $(why_rc $ctest_rc 900)" "$tmp/$1.log"
    elif grep -q "No tests were found" "$tmp/$1.log"; then
        fail "$1" "ctest has no test $1 in $build" "$tmp/$1.log"
    elif grep -q "Skipped\|Not Run" "$tmp/$1.log"; then
        skip "$1" "$(grep -m1 'SKIP' "$tmp/$1.log" || echo skipped)"
    else
        pass "$1"
    fi
}

# ductile-train's samples/s on the GPU beside the CPU (same flags, 200
# steps, the run's summary), MLP and CNN; cuBLAS SGEMM at 4096^3 beside the
# device's published dense FP32 peak.
# (A function that runs something long sets a variable rather than print
# into $(...): a signal reaches the command only when this shell runs it.)
one_gpu_rate() { # one_gpu_rate MODEL DEVICE: rate=samples/s, 0 when the run failed
    rate=0
    rm -f "$tmp/bench1.json"
    if run 600 "$tmp/bench1-$1-$2.log" "$train" --data "$data" --model "$1" --device "$2" \
        --max-steps 200 --batch-size 128 --limit-test 512 --warmup-steps 10 --log-every 1000 \
        --summary "$tmp/bench1.json"; then
        rate=$(json "$tmp/bench1.json" samples_per_s 2>/dev/null | cut -d. -f1)
        [ -n "$rate" ] || rate=0
    fi
}
step_bench_1gpu() {
    b1_bad="" b1_log=""
    b1_table=$(printf '%-22s %12s %12s %9s' "ductile-train, 1 GPU" "GPU/s" "CPU/s" "ratio")
    for m in mlp cnn; do
        one_gpu_rate $m cuda
        g=$rate
        [ "$g" = 0 ] && b1_bad="$b1_bad $m:cuda" b1_log=$tmp/bench1-$m-cuda.log
        one_gpu_rate $m cpu
        c=$rate
        [ "$c" = 0 ] && b1_bad="$b1_bad $m:cpu" b1_log=$tmp/bench1-$m-cpu.log
        r=$(python3 -c "import sys; g, c = map(float, sys.argv[1:]); print('%.1fx' % (g / c) if c else '-')" "$g" "$c")
        b1_table="$b1_table
$(printf '%-22s %12s %12s %9s' "$m" "$g" "$c" "$r")"
    done
    run 300 "$tmp/sgemm.log" "$build/tests/gpu/gpu_sgemm_bench" 4096 20
    sg=$(awk '/^sgemm/ {print $3}' "$tmp/sgemm.log")
    # Published dense FP32 (non-tensor) peaks, TFLOP/s: NVIDIA's H100 and H200
    # datasheets (H100 SXM 67, PCIe 51, NVL 60; H200 SXM 67, NVL 60).
    case "$gpu_name" in
    *H100*PCIe*) peak=51 ;;
    *H100*NVL* | *H200*NVL*) peak=60 ;;
    *H100* | *H200*) peak=67 ;;
    *) peak="" ;;
    esac
    if [ -n "$sg" ] && [ -n "$peak" ]; then
        sgr=$(python3 -c "import sys; print('%.2fx' % (float(sys.argv[1]) / float(sys.argv[2])))" "$sg" "$peak")
    else
        sgr="-"
    fi
    echo "$b1_table" | sed 's/^/  /'
    printf '  %-22s %12s %12s %9s\n' "cuBLAS SGEMM 4096^3" "${sg:-?} TF/s" "${peak:-?} TF/s" "$sgr"
    if [ -n "$b1_bad" ]; then
        fail bench_1gpu "runs failed:$b1_bad" "$b1_log"
    elif [ -z "$sg" ]; then
        fail bench_1gpu "gpu_sgemm_bench printed no result" "$tmp/sgemm.log"
    else
        pass bench_1gpu
    fi
}

# ---------------------------------------------------------------- world N

# check_ddp DIR WORLD: the summary says cuda, world WORLD, all epochs; NCCL
# carried the collectives; the last round's WORLD ranks dumped the same
# parameters, bit for bit (compare_params says by how much when not). One
# line: what was seen, or what is wrong; exit 1 when wrong.
check_ddp() {
    python3 - "$1" "$2" "$compare" <<'EOF'
import json, os, re, subprocess, sys
d, world, compare = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def bad(why):
    print(why)
    sys.exit(1)
try:
    s = json.load(open(os.path.join(d, "summary.json")))
except (OSError, ValueError) as e:
    bad("no summary: %s" % e)
for k, want in (("device", "cuda"), ("world_size", world), ("stopped_by", "epochs")):
    if s.get(k) != want:
        bad("summary: %s is %r, want %r" % (k, s.get(k), want))
if "collectives over nccl" not in open(os.path.join(d, "log"), errors="replace").read():
    bad("the start line does not say 'collectives over nccl'")
dumps = {}
for f in os.listdir(d):
    m = re.fullmatch(r"params\.(\d+)-(\d+)", f)
    if m:
        dumps.setdefault(int(m.group(1)), {})[int(m.group(2))] = os.path.join(d, f)
if not dumps:
    bad("no parameters dumped")
rnd = max(dumps)
got = dumps[rnd]
if sorted(got) != list(range(world)):
    bad("round %d: parameters of ranks %s, want 0..%d" % (rnd, sorted(got), world - 1))
first = open(got[0], "rb").read()
for r in sorted(got):
    if open(got[r], "rb").read() != first or not first:
        c = subprocess.run([compare, got[r], got[0], "0"], capture_output=True, text=True)
        bad("round %d: rank %d's parameters differ from rank 0's: %s" %
            (rnd, r, (c.stdout + c.stderr).strip()))
if s["test_accuracy"] < 0.5:  # a lost or garbled all-reduce stays near 0.1
    bad("test accuracy %.4f is below 0.5" % s["test_accuracy"])
print("world %d, %d ranks bit-equal (%d floats), accuracy %.4f, %.0f samples/s" %
      (world, len(got), len(first) // 4, s["test_accuracy"], s["samples_per_s"]))
EOF
}

# ddp_run NAME MODEL [VAR=VALUE...]: one epoch of MODEL at world N (one
# agent, --standalone etcd, one rank per GPU), every rank dumping its
# parameters; then check_ddp.
ddp_run() {
    dn=$1 dm=$2
    shift 2
    dd=$tmp/$dn
    mkdir -p "$dd"
    run 900 "$dd/log" env "$@" "$agent" --standalone --nproc-per-node "$ngpu" \
        --node-addr 127.0.0.1 --last-call 0 -- \
        "$train" --data "$data" --device cuda --model "$dm" --epochs 1 --batch-size 64 \
        --limit-test 2000 --log-every 100 --dump-params "$dd/params.{rank}" \
        --summary "$dd/summary.json"
    ddp_rc=$?
    if [ $ddp_rc != 0 ]; then
        fail "$dn" "ductile-agent $(why_rc $ddp_rc 900)" "$dd/log"
    elif ddp_msg=$(check_ddp "$dd" "$ngpu"); then
        pass "$dn ($ddp_msg)"
    else
        fail "$dn" "$ddp_msg" "$dd/log"
    fi
}
step_ddp() { need_gpus "ddp_$1" 2 && ddp_run "ddp_$1" "$1"; }
step_check_pointers() {
    need_gpus ddp_check_pointers 2 &&
        ddp_run ddp_check_pointers mlp NCCL_CHECK_POINTERS=1 NCCL_DEBUG=WARN
}

# ---------------------------------------------------------------- elastic

# Two agents of N/2 ranks each on one node, each on its own half of the GPUs,
# --rebuild inplace. e2e.py's Job (tests/e2e) runs them and verify() checks
# the end: every surviving agent exits 0 (with no restart budget: a lost pod
# is not a failure), every epoch's counted samples are the data set exactly
# once, the last round's ranks hold the same parameters bit for bit, and the
# accuracy clears e2e.py's GPU floor. Here also: the last round has all N/2 x 2
# ranks, and nothing but NCCL's own files is left in /dev/shm. Every step
# sleeps 40 ms (a failpoint) so that the job outlasts the kill and the join
# however fast the GPUs, and the epochs scale with N/2 so that it always has
# about 375 steps at full size.
write_pod_kill_join() {
    cat >"$tmp/pod_kill_join.py" <<'EOF'
import argparse, os, re, shutil, signal, sys
root, agent, train, data, gpus_a, gpus_b, half = sys.argv[1:8]
sys.path.insert(0, os.path.join(root, "tests", "e2e"))
import e2e  # noqa: E402
from testlib import Fail, check  # noqa: E402


def on_term(sig, frame):
    raise SystemExit("pod_kill_join: signal %d: cleaning up" % sig)


signal.signal(signal.SIGTERM, on_term)
half = int(half)
env = e2e.Env(argparse.Namespace(agent=agent, train=train, data=data, seed=1, chaos_seed=0,
                                 device="cuda"))
job = env.job("pod-kill-join", "inplace", nnodes="1:2", epochs=e2e.GPU_EPOCHS * half,
              max_restarts=0, agent_args=["--nproc-per-node", str(half)])


def start(name, gpus):
    job.agent_env = {"CUDA_VISIBLE_DEVICES": gpus,
                     "DUCTILE_WORKER_FAILPOINTS": "train.step=1+:sleep:40"}
    return job.start(name)


try:
    shm_before = e2e.dev_shm()
    a = start("a", gpus_a)
    start("b", gpus_b)
    job.wait_round(a, 2)
    job.wait_step(20)
    e2e.log("SIGKILL agent b with its %d workers (GPUs %s)" % (half, gpus_b))
    job.agents["b"].kill_tree()
    job.wait_round(a, 1)
    e2e.log("agent c joins on GPUs %s" % gpus_b)
    start("c", gpus_b)
    job.wait_round(a, 2)
    e2e.verify(job, None, timeout=900)
    dumps = {}
    for f in os.listdir(job.dir):
        m = re.fullmatch(r"params\.(\d+)-(\d+)", f)
        if m:
            dumps.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    last = max(dumps)
    check(sorted(dumps[last]) == list(range(2 * half)),
          "round %d ended with ranks %s, want 0..%d" % (last, sorted(dumps[last]), 2 * half - 1))
    left = [n for n in e2e.dev_shm_leaks(shm_before) if not n.startswith("nccl")]
    check(not left, "left in /dev/shm: %s" % " ".join(left))
    print("OK round %d: %d ranks bit-equal after the kill and the join" % (last, 2 * half))
except Fail as e:
    print("FAIL %s" % e)
    sys.exit(1)
finally:
    job.cleanup()
    shutil.rmtree(env.workdir, ignore_errors=True)
EOF
}
step_pod_kill_join() {
    need_gpus pod_kill_join 2 || return
    half=$((ngpu / 2))
    write_pod_kill_join
    run 1500 "$tmp/pod_kill_join.log" env TMPDIR="$tmp" python3 "$tmp/pod_kill_join.py" \
        "$root" "$agent" "$train" "$data" "$(gpus_from 0 $half)" "$(gpus_from $half $half)" "$half"
    pkj_rc=$?
    pkj_msg=$(grep -E '^(OK|FAIL) ' "$tmp/pod_kill_join.log" | tail -1)
    if [ $pkj_rc = 0 ]; then
        pass "pod_kill_join (${pkj_msg#OK })"
    else
        pkj_msg=${pkj_msg#FAIL }
        fail pod_kill_join "${pkj_msg:-python3 $(why_rc $pkj_rc 1500)}" "$tmp/pod_kill_join.log"
    fi
}

# e2e.py's GPU core as CMakeLists.txt runs it for e2e.gpu.* (pod kill, join,
# hot spare; in place and by restart), unchanged, on real GPUs: its agents
# n1, n2, ... each run one rank, and NCCL refuses two ranks on one GPU, so
# e2e.py is handed a wrapper that starts agent nK on GPU K-1 alone. Up to
# four agents at once: needs four GPUs.
step_e2e_gpu_core() {
    need_gpus e2e_gpu_core 4 || return
    cat >"$tmp/agent-one-gpu" <<'EOF'
#!/bin/sh
# ductile-agent on one GPU of its own: node nK on the K-th entry of RUN_GPUS.
prev="" id=""
for a in "$@"; do
    [ "$prev" = --node-id ] && id=$a
    prev=$a
done
k=${id#n}
case $k in '' | *[!0-9]*) echo "agent-one-gpu: node id '$id' is not nK" >&2; exit 2 ;; esac
CUDA_VISIBLE_DEVICES=$(echo "$RUN_GPUS" | tr ',' '\n' | awk -v k="$k" '{g[NR - 1] = $0} END {print g[(k - 1) % NR]}')
export CUDA_VISIBLE_DEVICES
exec "$RUN_AGENT" "$@"
EOF
    chmod +x "$tmp/agent-one-gpu"
    run 2400 "$tmp/e2e.log" env TMPDIR="$tmp" RUN_GPUS="$gpus" RUN_AGENT="$agent" \
        python3 "$root/tests/e2e/e2e.py" --agent "$tmp/agent-one-gpu" --train "$train" \
        --data "$data" --device cuda gpu
    e2e_rc=$?
    if [ $e2e_rc = 77 ]; then
        skip e2e_gpu_core "e2e.py skipped every scenario"
        return
    fi
    e2e_bad=$(grep -E '^FAIL ' "$tmp/e2e.log" | awk '{print $2 ":" $3}' | paste -sd' ' -)
    e2e_ok=$(grep -c '^PASS ' "$tmp/e2e.log")
    if [ $e2e_rc = 0 ]; then
        pass "e2e_gpu_core ($e2e_ok scenarios)"
    else
        fail e2e_gpu_core "${e2e_bad:-e2e.py $(why_rc $e2e_rc 2400)}" "$tmp/e2e.log"
    fi
}

# ---------------------------------------------------------------- sanitizers

# compute-sanitizer --tool TOOL on 20 steps of the MLP and of the CNN at
# world 1: any error it reports fails the step (--error-exitcode 1).
step_sanitizer() {
    tool=$1
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    if [ ! -x "$cs" ]; then
        skip "$tool" "no compute-sanitizer (PATH, /usr/local/cuda/bin)"
        return
    fi
    cs_bad="" cs_log=""
    for m in mlp cnn; do
        run 900 "$tmp/$tool-$m.log" "$cs" --tool "$tool" --error-exitcode 1 \
            "$train" --data "$data" --device cuda --model $m --max-steps 20 --batch-size 32 \
            --limit-train 2000 --limit-test 256 --log-every 5
        cs_rc=$?
        if [ $cs_rc != 0 ]; then
            cs_sum=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$tmp/$tool-$m.log" | tail -1 | sed 's/^=* *//')
            cs_bad="${cs_bad:+$cs_bad; }$m: $(why_rc $cs_rc 900)${cs_sum:+ ($cs_sum)}"
            cs_log=$tmp/$tool-$m.log
        fi
    done
    if [ -n "$cs_bad" ]; then fail "$tool" "$cs_bad" "$cs_log"; else pass "$tool"; fi
}

# ---------------------------------------------------------------- bench

# Samples/s at world N, MLP and CNN, beside PyTorch eager DDP over NCCL on the
# same GPUs, same per-rank batch and steps. Both leave out the first WARMUP
# steps and time the next STEPS: ours from rank 0's progress lines (one every
# WARMUP steps; the rate over all lines but the first), torch's in
# torch_cuda.py. The evaluation at each epoch's end scores one test sample per
# rank, so it costs next to nothing.
bench_steps=${GPU_BENCH_STEPS:-500}
bench_warm=${GPU_BENCH_WARMUP:-50}
bench_batch=${GPU_BENCH_BATCH:-128}
ours_rate() { # ours_rate MODEL: rate=samples/s after the warm-up; 1 when the run failed
    rate=0
    run 900 "$tmp/ours-$1.log" "$agent" --standalone --nproc-per-node "$ngpu" \
        --node-addr 127.0.0.1 --last-call 0 -- \
        "$train" --data "$data" --device cuda --model "$1" --batch-size "$bench_batch" \
        --epochs 100000 --max-steps $((bench_warm + bench_steps)) --log-every "$bench_warm" \
        --limit-test "$ngpu" || return 1
    # Every line covers the same steps: the rate over them is the harmonic mean.
    rate=$(python3 -c 'import re, sys
rates = [float(r) for r in re.findall(r"ductile-train: step \d+ .*samples/s ([0-9.]+)",
                                      open(sys.argv[1], errors="replace").read())][1:]
if not rates or min(rates) <= 0:
    sys.exit(1)
print(round(len(rates) / sum(1 / r for r in rates)))' "$tmp/ours-$1.log") || {
        rate=0
        return 1
    }
}
torch_python() { # the first interpreter with torch and numpy: $TORCH_PYTHON, bench/ddp's venv, python3
    for py in "${TORCH_PYTHON:-}" "${DUCTILE_BENCH_VENV:-$HOME/.cache/ductile/bench-venv}/bin/python" \
        python3; do
        if [ -n "$py" ] && "$py" -c "import torch, numpy" >/dev/null 2>&1; then
            echo "$py"
            return 0
        fi
    done
    return 1
}
step_bench_ddp() {
    need_gpus bench_ddp 2 || return
    tpy=$(torch_python) || tpy=""
    tver=""
    if [ -z "$tpy" ]; then
        skip "torch baseline" "torch not installed"
    elif ! tver=$("$tpy" -c "import sys, torch, torch.distributed as d
ok = torch.cuda.is_available() and torch.cuda.device_count() >= $ngpu and d.is_nccl_available()
print(torch.__version__); sys.exit(0 if ok else 1)" 2>/dev/null); then
        skip "torch baseline" "torch ${tver:-?} ($tpy) has no CUDA with NCCL for $ngpu GPUs"
        tpy="" tver=""
    fi
    bd_bad="" bd_log=""
    bd_table=$(printf '%-6s %12s %12s %8s' model ours/s torch/s ratio)
    for m in mlp cnn; do
        if ! ours_rate $m; then
            bd_bad="$bd_bad $m"
            bd_log=$tmp/ours-$m.log
        fi
        o=$rate
        t=-
        if [ -n "$tpy" ]; then
            if run 900 "$tmp/torch-$m.log" "$tpy" "$root/bench/ddp/torch_cuda.py" --world "$ngpu" \
                --model $m --batch "$bench_batch" --steps "$bench_steps" --warmup "$bench_warm" \
                --data "$data"; then
                # torch_cuda.py's result is its last JSON line (warnings may follow it)
                t=$(python3 -c 'import json, sys
for line in reversed(open(sys.argv[1], errors="replace").read().splitlines()):
    try:
        print(round(json.loads(line)["samples_per_s"]))
        break
    except (ValueError, KeyError, TypeError):
        pass
else:
    sys.exit(1)' "$tmp/torch-$m.log") || t=-
            fi
            [ "$t" = - ] && echo "  torch baseline, $m: failed: $(tail -1 "$tmp/torch-$m.log")"
        fi
        r=$(python3 -c "import sys; o, t = sys.argv[1:]; print('%.2f' % (float(o) / float(t)) if t != '-' and float(o) > 0 else '-')" "$o" "$t")
        bd_table="$bd_table
$(printf '%-6s %12s %12s %8s' "$m" "$o" "$t" "$r")"
    done
    echo "world $ngpu, per-rank batch $bench_batch, $bench_steps steps timed after $bench_warm${tver:+; torch $tver}"
    echo "$bd_table"
    if [ -n "$bd_bad" ]; then fail bench_ddp "ductile-train failed:$bd_bad" "$bd_log"; else pass bench_ddp; fi
}

# ---------------------------------------------------------------- main

summary() {
    [ "$skipped" = 0 ] || echo "($skipped skipped)"
    echo "$passed passed, $failed failed"
}
start=$(date +%s)
echo "== ductile GPU run: tree $root, build $build, logs in $tmp${KEEP:+ (kept)}"
if ! step_build; then
    summary
    exit 1
fi
step_probe
case $? in
0) ;;
77)
    summary
    exit 77
    ;;
*)
    summary
    exit 1
    ;;
esac
for t in gpu_kernels gpu_ddp_nccl gpu_train; do step_ctest $t; done
step_bench_1gpu
step_ddp mlp
step_ddp cnn
step_check_pointers
step_pod_kill_join
step_e2e_gpu_core
step_sanitizer memcheck
step_sanitizer racecheck
step_bench_ddp
echo "total $(($(date +%s) - start)) s on $gpu_name"
summary
[ "$failed" = 0 ] && exit 0
exit 1
