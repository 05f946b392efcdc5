#!/bin/sh
# bench/recovery/run.sh BUILD_DIR [REPEATS]: time from a worker kill, an agent
# kill, a scale-down and a scale-up to the first training step at the new
# size, 4 agents, ductile in place and by restart, beside torchrun (c10d, its
# defaults and its fastest settings) running the same MLP with PyTorch DDP in
# the same run. torch comes from PyPI into BUILD_DIR/torch-venv (created here
# when absent; other benches share it).
set -eu
build=${1:?usage: bench/recovery/run.sh BUILD_DIR [REPEATS]}
here=$(cd "$(dirname "$0")" && pwd)
for f in agent/ductile-agent trainer/ductile-train; do
    if [ ! -x "$build/$f" ]; then
        echo "bench/recovery: $build/$f not built (cmake --build $build)" >&2
        exit 1
    fi
done
venv="$build/torch-venv"
if ! "$venv/bin/python" -c "import torch, numpy" 2>/dev/null; then
    echo "bench/recovery: installing torch from PyPI into $venv (large download)"
    python3 -m venv "$venv" && "$venv/bin/pip" install -q torch numpy || {
        echo "bench/recovery: cannot install torch" >&2
        exit 1
    }
fi
echo "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
exec python3 "$here/bench_recovery.py" --agent "$build/agent/ductile-agent" \
    --train "$build/trainer/ductile-train" --python "$venv/bin/python" --repeats "${2:-1}"
