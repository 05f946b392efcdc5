#!/usr/bin/env python3
"""agent_test.py: the agent's integration tests, one case per ctest entry.

Run under with-etcd (DUCTILE_TEST_ETCD is a real etcd on 127.0.0.1):

    with-etcd -- python3 agent_test.py --agent ductile-agent --worker agent-test-worker CASE

Every case starts real ductile-agent processes with test_worker as their
command, drives them (signals, worker commands, etcd restarts) and checks
what the workers report (tests/agent/test_worker.c) and how agents exit.
Timing bounds here are correctness bounds ("before the lease TTL") and are
generous; speed is measured in bench/agent.

This file is the driver: CASE names a case_CASE function in one of the case
files, by feature, which share tests/harness/agentkit.py (Job and Agent,
etcd's keys, the job's state):
  test_flags.py        the command line refused or listed
  test_membership.py   rounds as nodes come, are lost and leave; --standalone
  test_restarts.py     worker failures and how they are counted
  test_watchdog.py     --hang-timeout
  test_etcd_outage.py  training while etcd is away or restarted
  test_job_state.py    an ended job in etcd: reset, the install id
  test_takeover.py     one node id, two agents
  test_inplace.py      --rebuild inplace
  test_http.py         /healthz, /readyz, /metrics and `status`
  test_k8s.py          --k8s-events
  test_torchrun.py     the agent run as torchrun
  test_warm.py         warm spares (--preload)
  test_torch.py        real PyTorch (skipped without torch)
torch_test.py runs its own cases through main here.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../harness"))
import agentkit  # noqa: E402
from agentkit import FAST, job_restarts, torch_python  # noqa: E402
import test_etcd_outage  # noqa: E402
import test_flags  # noqa: E402
import test_http  # noqa: E402
import test_inplace  # noqa: E402
import test_job_state  # noqa: E402
import test_k8s  # noqa: E402
import test_membership  # noqa: E402
import test_restarts  # noqa: E402
import test_takeover  # noqa: E402
import test_torch  # noqa: E402
import test_torchrun  # noqa: E402
import test_warm  # noqa: E402
import test_watchdog  # noqa: E402

# What torch_test.py takes from here.
__all__ = ["FAST", "job_restarts", "main", "torch_python"]

CASE_FILES = (test_flags, test_membership, test_restarts, test_watchdog, test_etcd_outage,
              test_job_state, test_takeover, test_inplace, test_http, test_k8s, test_torchrun,
              test_warm, test_torch)
CASES = {name: fn for m in CASE_FILES for name, fn in vars(m).items()
         if name.startswith("case_")}


def main(cases=None):
    """Runs the case named on the command line: a case_NAME of cases (a
    module's globals(): torch_test.py's) or of the case files."""
    return agentkit.main(cases or CASES)


if __name__ == "__main__":
    sys.exit(main())
