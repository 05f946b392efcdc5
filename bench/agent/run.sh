#!/bin/sh
# bench/agent/run.sh BUILD_DIR [REPEATS [FLAGS...]]: how fast 4 agents
# rebuild a round (after a SIGKILL, a SIGTERM, a new agent), and what an
# agent costs (RSS and where it goes, idle CPU), each beside a baseline
# measured in the same run (the RSS also against agent-floor, the agent's
# libraries alone). FLAGS go to bench_agent.py (--costs-only: the
# costs alone).
set -eu
build=${1:?usage: bench/agent/run.sh BUILD_DIR [REPEATS [FLAGS...]]}
repeats=${2:-3}
shift $(($# < 2 ? $# : 2))
here=$(cd "$(dirname "$0")" && pwd)
for f in agent/ductile-agent tests/agent/agent-test-worker bench/agent/agent-floor tests/with-etcd; do
    if [ ! -x "$build/$f" ]; then
        echo "bench/agent: $build/$f not built (cmake --build $build)" >&2
        exit 1
    fi
done
exec "$build/tests/with-etcd" -- python3 "$here/bench_agent.py" \
    --agent "$build/agent/ductile-agent" --worker "$build/tests/agent/agent-test-worker" \
    --floor "$build/bench/agent/agent-floor" \
    --repeats "$repeats" "$@"
