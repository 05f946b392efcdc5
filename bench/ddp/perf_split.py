"""perf_split.py: where a training step's CPU time goes, by kind of work.

usage: perf_split.py LONG.data SHORT.data STEPS

LONG.data and SHORT.data are `perf record -F 1000` of the same run (every
process of it: perf follows children) with two step counts; STEPS is the
difference in steps times the number of ranks. What the short run also
spends (start, data loading, evaluation) cancels, and each sample is 1 ms
of one thread on a CPU, so the figures are CPU ms per rank and step, which
other work on the machine does not inflate the way it does wall time.
Used for ductile-train against torch_ddp.py (same MLP, same batch):

  perf record -F 1000 -o long.data ductile-train ... --max-steps 200
  perf record -F 1000 -o short.data ductile-train ... --max-steps 1
  python3 bench/ddp/perf_split.py long.data short.data 199
"""
import collections
import re
import subprocess
import sys

KINDS = [  # (kind, what a symbol or its library's name contains), first match wins
    ("gemm", ("gemm", "mkl_blas")),
    ("optimizer+elementwise", ("optim", "sgd", "foreach", "multi_tensor", "add_kernel",
                               "mul_kernel", "relu", "threshold")),
    ("zeroing", ("memset", "fill_kernel")),
    ("loss", ("softmax", "nll", "xent")),
    ("reducer+ring", ("ddp_", "ring_", "comm_thread")),
    ("python", ("python",)),
    ("kernel (socket copies, page faults)", ("[kernel",)),
]


def samples(path):
    out = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort", "dso,symbol",
                          "-F", "sample,dso,symbol", "--stdio"], capture_output=True,
                         text=True, check=True).stdout
    kinds = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+)\s+\[.\]\s+(.+)", line)
        if not m:
            continue
        where = (m.group(2) + " " + m.group(3)).lower()
        kind = next((k for k, keys in KINDS if any(key in where for key in keys)), "other")
        if "openblas" in where and kind == "other":
            kind = "gemm"  # OpenBLAS's packing copies
        kinds[kind] += int(m.group(1))
    return kinds


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__.strip().splitlines()[2])
    long_run, short_run, steps = samples(sys.argv[1]), samples(sys.argv[2]), int(sys.argv[3])
    long_run.subtract(short_run)
    total = sum(long_run.values())
    print(f"{total / steps:.1f} CPU ms per rank-step: " +
          ", ".join(f"{k} {v / steps:.1f}" for k, v in long_run.most_common() if v / steps >= 0.05))


if __name__ == "__main__":
    main()
