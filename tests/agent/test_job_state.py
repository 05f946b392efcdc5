"""test_job_state.py: what etcd keeps of an ended job.

An ended job's id ends at once; `ductile-agent reset` deletes its keys once
no agent of it lives. The end records the install id: another install is
refused unless it starts over (--start-over), the same one finds the job
done.
"""
import base64
import json
import os
import re
from agentkit import ETCD, FAST, etcd_call, etcd_value, finish_with, run_agent, status_of
from testlib import check, free_port



def case_reset_ended_job(job):
    """An ended job keeps its state in etcd: agents started again under its id
    end at once without training. `ductile-agent reset` refuses while an agent
    of the job is alive, and deletes the job's keys once none is: the id then
    trains again as a new job."""
    job.flags += FAST + ["--nnodes", "1", "--max-restarts", "2"]
    a = job.start("node-a")
    job.wait_round(1, 60)
    reset = ["reset", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name]
    r = run_agent(reset)
    check(r.returncode == 3 and "1 live node(s)" in r.stderr and len(r.stderr.splitlines()) == 1,
          "reset of a running job: exit %d %r" % (r.returncode, r.stderr))
    check(status_of(job)["job_state"] == "running", "nothing deleted while an agent lives")
    finish_with(job, (a,))
    check(status_of(job)["job_state"] == "done", "the job is done")
    # The trap: the same id again ends at once, no worker started.
    before = len(job.workers())
    again = job.start("node-b")
    check(again.wait_exit(30) == 0, "an agent of a done job exits 0")
    check(len(job.workers()) == before, "no worker started for a done job")
    r = run_agent(reset)
    check(r.returncode == 0 and re.match(r"job %s: [1-9]\d* key\(s\) deleted$" % job.name,
                                         r.stdout.strip()),
          "reset of an ended job: exit %d %r %r" % (r.returncode, r.stdout, r.stderr))
    check(status_of(job)["job_state"] == "none", "no trace of the job after reset")
    r = run_agent(reset)
    check(r.returncode == 0 and "0 key(s) deleted" in r.stdout, "reset again: %r" % r.stdout)
    os.remove(os.path.join(job.dir, "cmd.all"))  # the first run's "exit 0"
    c = job.start("node-c")
    rnd = job.wait_round(1, 60)
    check(rnd == 1, "the id starts over at round 1, got %d" % rnd)
    finish_with(job, (c,))
    for bad in (["reset", "--rdzv-endpoint", ETCD], ["reset", "--rdzv-id", "Bad_Id",
                "--rdzv-endpoint", ETCD], reset + ["--json"]):
        r = run_agent(bad)
        check(r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1,
              "%s: exit %d %r" % (bad, r.returncode, r.stderr))
    r = run_agent(["reset", "--rdzv-endpoint", "http://127.0.0.1:%d" % free_port(),
                   "--rdzv-id", job.name])
    check(r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1,
          "reset without etcd: exit %d %r" % (r.returncode, r.stderr))


def case_install_id(job):
    """A job's end records the install id of the agents that ended it. Agents
    of another install (a new Helm release under the same job id, whose etcd
    kept the old state) are refused with exit 2 and one line, training
    nothing; with --start-over they delete the old keys and train it again,
    several at once safely. Agents of the same install (a replacement pod)
    still find the job done and exit 0, as do agents without an install id."""
    job.flags += FAST + ["--nnodes", "2"]
    a = job.start("node-a", flags=["--install-id", "inst-A"])
    b = job.start("node-b", env={"DUCTILE_INSTALL_ID": "inst-A"})
    job.wait_round(2, 60)
    finish_with(job, (a, b))
    state, _ = etcd_value(job, "state")
    check(state == {"state": "done", "reason": "", "install": "inst-A"},
          "the end records the install: %r" % state)
    check(status_of(job).get("install") == "inst-A", "status shows the install")
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name])
    check(r.returncode == 0 and "\ninstall: inst-A " in r.stdout, "status text: %r" % r.stdout)
    done = len(job.workers())
    # Another install: refused, one line naming both installs and the way out.
    for ag in (job.start("node-a", flags=["--install-id", "inst-B"]),
               job.start("node-b", env={"DUCTILE_INSTALL_ID": "inst-B"})):
        check(ag.wait_exit(30) == 2, "another install exits 2:\n%s" % ag.log())
        lines = [ln for ln in ag.log().splitlines() if "inst-A" in ln]
        check(len(lines) == 1 and "earlier install (install inst-A); this is install inst-B"
              in lines[0] and "job.startOver=true" in lines[0], "the reason: %r" % ag.log())
    check(len(job.workers()) == done, "another install trained nothing")
    check(etcd_value(job, "state")[0] == state, "a refused install changed nothing")
    # The same install (a pod replaced after the end), and no install id: done.
    for flags in (["--install-id", "inst-A"], ["--install-id", "inst-A", "--start-over"], []):
        ag = job.start("node-c", flags=flags)
        check(ag.wait_exit(30) == 0 and "already complete" in ag.log(),
              "%s: exits 0 on a done job:\n%s" % (flags, ag.log()))
    check(len(job.workers()) == done, "nothing trained again")
    check(etcd_value(job, "state")[0] == state, "this install's end is never started over")
    # Start over: three agents at once; one deletes, all train the new job.
    os.remove(os.path.join(job.dir, "cmd.all"))
    job.flags[job.flags.index("--nnodes") + 1] = "3"
    agents = [job.start("node-%d" % i, flags=["--install-id", "inst-B", "--start-over"])
              for i in range(2)]
    agents.append(job.start("node-2", flags=["--install-id", "inst-B"],
                            env={"DUCTILE_START_OVER": "true"}))
    rnd = job.wait_round(3, 60)
    check(rnd == 1, "the job starts over at round 1, got %d" % rnd)
    logs = [ag.log() for ag in agents]
    check(sum("starts over" in lg for lg in logs) == 1,
          "one agent deleted the old keys:\n%s" % "\n".join(logs))
    check(status_of(job)["job_state"] == "running", "the job runs again")
    finish_with(job, agents)
    check(etcd_value(job, "state")[0] == {"state": "done", "reason": "", "install": "inst-B"},
          "the new end records install inst-B")
    # A failed end is refused the same way.
    check(run_agent(["reset", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name]).returncode == 0,
          "reset")
    etcd_call("/v3/kv/put", {
        "key": base64.b64encode(("/ductile/%s/state" % job.name).encode()).decode(),
        "value": base64.b64encode(json.dumps(
            {"state": "failed", "reason": "x", "install": "inst-B"}).encode()).decode()})
    ag = job.start("node-a", flags=["--install-id", "inst-C"])
    check(ag.wait_exit(30) == 2 and "ended (failed) in an earlier install" in ag.log(),
          "a failed end elsewhere: exit 2:\n%s" % ag.log())
