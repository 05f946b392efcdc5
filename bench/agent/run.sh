#!/bin/sh
# bench/agent/run.sh BUILD_DIR [REPEATS]: how fast 4 agents rebuild a round
# (after a SIGKILL, a SIGTERM, a new agent), and what an agent costs (RSS,
# idle CPU), each beside a baseline measured in the same run.
set -eu
build=${1:?usage: bench/agent/run.sh BUILD_DIR [REPEATS]}
here=$(cd "$(dirname "$0")" && pwd)
for f in agent/ductile-agent tests/agent/agent-test-worker tests/with-etcd; do
    if [ ! -x "$build/$f" ]; then
        echo "bench/agent: $build/$f not built (cmake --build $build)" >&2
        exit 1
    fi
done
exec "$build/tests/with-etcd" -- python3 "$here/bench_agent.py" \
    --agent "$build/agent/ductile-agent" --worker "$build/tests/agent/agent-test-worker" \
    --repeats "${2:-3}"
