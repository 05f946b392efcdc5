"""test_warm.py: warm spares (--preload), tests/agent/warm_worker.py and warm_marker.py.

A restart adopts a spare interpreter that imported the preloaded modules;
the script sees what a plain run sees; a spare that dies is started again,
once a round; none for --preload none or `python -c`.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from agentkit import FAST, Job
from testlib import check, children, pid_alive, wait_for



WARM_DIR = os.path.dirname(os.path.abspath(__file__))


WARM_SCRIPT = os.path.join(WARM_DIR, "warm_worker.py")


def warm_python():
    """This Python under a name the agent takes for an interpreter."""
    if re.fullmatch(r"python[0-9.]*", os.path.basename(sys.executable)):
        return sys.executable
    return shutil.which("python3")


def warm_files(job, prefix):
    """The JSON records named PREFIX.PID[.json] in the job's folder."""
    out = []
    for name in os.listdir(job.dir):
        if re.fullmatch(re.escape(prefix) + r"\.\d+(\.json)?", name):
            with open(os.path.join(job.dir, name)) as f:
                out.append(json.load(f))
    return out


def warm_plain(argv):
    """What warm_worker.py reports under a plain `python ARGS...`, started
    from the agents' folder."""
    env = dict(os.environ, WARM_WORKER_PLAIN="1", PYTHONPATH=WARM_DIR)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    check(r.returncode == 0, "plain run of %s: %s" % (argv, r.stderr))
    return json.loads(r.stdout)


def warm_spares(job, agents):
    """Each agent's spare: a live child that imported warm_marker and is no
    worker (a pid no worker record has); None until every agent has one."""
    worker_pids = {r["pid"] for r in warm_files(job, "ww")}
    found = {}
    for m in warm_files(job, "marker"):
        if m["pid"] not in worker_pids and pid_alive(m["pid"]) and \
                m["pid"] in children(m["ppid"]):
            found[m["ppid"]] = m
    return found if all(a.proc.pid in found for a in agents) else None


def warm_spare_killed(job, ag):
    """SIGKILLs ag's spare and returns the one its agent starts instead."""
    first = wait_for(lambda: warm_spares(job, [ag]), 60, "a spare")[ag.proc.pid]
    os.kill(first["pid"], signal.SIGKILL)

    def other():
        s = warm_spares(job, [ag])
        return s and s[ag.proc.pid]["pid"] != first["pid"] and s[ag.proc.pid]
    again = wait_for(other, 60, "a spare started again after %d was killed" % first["pid"])
    check("the warm interpreter %d was killed by SIGKILL" % first["pid"] in ag.log(),
          "the agent reaped its spare as one:\n" + ag.log())
    return again


def warm_round(job, world, newer_than=0):
    """The newest round above newer_than whose `world` workers all wrote a
    record, as (round, records), or None."""
    by_round = {}
    for r in warm_files(job, "ww"):
        by_round.setdefault(int(r["DUCTILE_ROUND"]), []).append(r)
    rounds = [n for n, rs in by_round.items() if n > newer_than and len(rs) == world]
    return (max(rounds), by_round[max(rounds)]) if rounds else None


def check_adopted(rec, spare, plain, killed_at, what):
    """rec, a worker's record, is the spare's process running the script as
    plainly as `plain` did, with its round's environment only."""
    check(rec["pid"] == spare["pid"], "%s: worker pid %d, want the spare's %d" %
          (what, rec["pid"], spare["pid"]))
    check(spare["time"] < killed_at, "%s: the spare imported its modules before the kill" % what)
    check(spare["RANK"] is None, "%s: no RANK at import time, got %r" % (what, spare["RANK"]))
    check(spare["modules"] == "warm_marker", "%s: DUCTILE_PRELOAD_MODULES %r" %
          (what, spare["modules"]))
    check(rec["marker"], "%s: warm_marker was imported before the script ran" % what)
    for k in ("argv", "path0", "name", "dont_write_bytecode"):
        check(rec[k] == plain[k], "%s: %s %r, a plain run has %r" % (what, k, rec[k], plain[k]))
    check(rec["WARM_MARKER_STALE"] is None, "%s: a variable set before adoption survived" % what)
    check(rec["DUCTILE_PRELOAD_MODULES"] is None, "%s: the spare's own variable survived" % what)
    check(rec["ctl_open"] and rec["DUCTILE_CONTROL_FD"] == "3", "%s: control channel at fd 3" % what)
    check(not rec["fd4_open"], "%s: the go pipe is closed before the script runs" % what)


def warm_kill_restart(job, agents, world, victim):
    """Waits for a round and every agent's spare, SIGKILLs victim's worker
    and returns (spares before the kill, kill time, new round, its records)."""
    r1, _ = wait_for(lambda: warm_round(job, world), 60, "the first round's workers")
    spares = wait_for(lambda: warm_spares(job, agents), 60, "a warm spare beside each worker")
    victim_pid = [r["pid"] for r in warm_files(job, "ww")
                  if int(r["DUCTILE_ROUND"]) == r1 and r["ppid"] == victim.proc.pid][0]
    killed_at = time.time()
    os.kill(victim_pid, signal.SIGKILL)
    r2, recs = wait_for(lambda: warm_round(job, world, newer_than=r1), 60,
                        "the restarted round's workers")
    return spares, killed_at, r2, recs


def warm_alone(job, name, preload, cmd, flags=None):
    """A job of one agent, apart from `job`, running cmd; returns (job, agent)."""
    j = Job(job.name + "-" + name, FAST + ["--nnodes", "1", "--preload", preload] + (flags or []))
    job.agents_elsewhere.append(j)
    return j, j.start("node-a", env={"PYTHONPATH": WARM_DIR}, cmd=cmd)


def case_warm_spare(job):
    """--preload: a restart adopts a warm spare. Two agents run a Python
    script by restart; each keeps a spare that imported warm_marker (which
    records its pid). SIGKILL one worker: the next round's workers are
    exactly those spares, and the script sees what a plain `python3 -B
    SCRIPT ARGS` sees, with the new round's variables and nothing the spare
    had before. Its exit status is its own; spares go with their agent. The
    same by -m; none with --preload none, nor for `python3 -c`."""
    py = warm_python()
    check(py, "no python3")
    job.agents_elsewhere = []
    failed = True
    try:
        warm_spare_cases(job, py)
        failed = False
    finally:
        for j in job.agents_elsewhere:
            j.cleanup(keep=failed or bool(os.environ.get("AGENT_TEST_KEEP")))


def warm_spare_cases(job, py):
    args = ["one", "two words"]
    cmd = [py, "-B", WARM_SCRIPT] + args
    plain = warm_plain(cmd)
    job.flags += FAST + ["--nnodes", "2", "--max-restarts", "1", "--preload", "warm_marker"]
    # RANK in the agents' own environment: a stale value no worker may see.
    env = {"PYTHONPATH": WARM_DIR, "RANK": "99"}
    a, b = job.start("node-a", env=env, cmd=cmd), job.start("node-b", env=env, cmd=cmd)
    spares, killed_at, r2, recs = warm_kill_restart(job, [a, b], 2, a)
    check(sorted(r["RANK"] for r in recs) == ["0", "1"], "ranks 0 and 1: %r" % recs)
    for rec in recs:
        node = "node-a" if rec["ppid"] == a.proc.pid else "node-b"
        check(rec["WORLD_SIZE"] == "2", "%s: WORLD_SIZE %r" % (node, rec["WORLD_SIZE"]))
        check_adopted(rec, spares[rec["ppid"]], plain, killed_at, node)
    for ag in (a, b):
        check(re.search(r"round %d: started 1 workers, ranks \d\.\.\d \(1 from a warm "
                        r"interpreter: warm_marker preloaded\)" % r2, ag.log()),
              "%s logs the adoption:\n%s" % (ag.node, ag.log()))
    # What the adopted worker prints is passed through with its rank.
    for rec in recs:
        wait_for(lambda: "[%s] warm worker %d in round %d" % (rec["RANK"], rec["pid"], r2)
                 in a.out() + b.out(), 10, "the adopted worker's output, prefixed")
    # The next restart's spares are ready again.
    wait_for(lambda: warm_spares(job, [a, b]), 60, "new spares after the restart")
    # The script's exit status is its own: 7 is a failure, the restart budget is spent.
    spare_pids = [m["pid"] for m in warm_files(job, "marker")]
    job.command("all", "exit 7")
    for ag in (a, b):
        check(ag.wait_exit(30) == 3, "agent %s: job failed, exit 3:\n%s" % (ag.node, ag.log()))
    check("exited with code 7" in a.log() + b.log(), "a worker exited with code 7")
    left = [p for p in spare_pids if pid_alive(p)]
    check(not left, "spares outlived their agent: %s" % left)

    # python -m MODULE: the module's file is argv[0], the folder it runs in sys.path[0].
    mcmd = [py, "-m", "warm_worker", "m-arg"]
    mplain = warm_plain(mcmd)
    j, m = warm_alone(job, "module", "warm_marker", mcmd, ["--max-restarts", "2"])
    r1, _ = wait_for(lambda: warm_round(j, 1), 60, "-m: the first round's worker")
    # A spare that dies is reaped as no worker (the round goes on) and started again.
    second = warm_spare_killed(j, m)
    check(warm_round(j, 1)[0] == r1 and len(warm_files(j, "ww")) == 1,
          "-m: a spare's death ended the round:\n" + m.log())
    check("stopping the other workers" not in m.log(), "-m: a spare taken for a worker")
    killed_at = time.time()
    os.kill(warm_files(j, "ww")[0]["pid"], signal.SIGKILL)
    r2, recs = wait_for(lambda: warm_round(j, 1, newer_than=r1), 60, "-m: the restarted worker")
    check_adopted(recs[0], second, mplain, killed_at, "-m")
    # Started again once a round: after two deaths the next restart starts cold.
    fourth = warm_spare_killed(j, m)
    markers = len(warm_files(j, "marker"))
    os.kill(fourth["pid"], signal.SIGKILL)
    time.sleep(2)  # a spare is started again as soon as its death is reaped
    check(len(warm_files(j, "marker")) == markers and not warm_spares(j, [m]),
          "-m: a third spare in one round:\n" + m.log())
    os.kill(recs[0]["pid"], signal.SIGKILL)
    r3, recs = wait_for(lambda: warm_round(j, 1, newer_than=r2), 60, "-m: the cold worker")
    check(not recs[0]["marker"], "-m: the worker after two spare deaths started cold")
    check("round %d: started 1 workers, ranks 0..0 (0 from a warm interpreter" % r3 in m.log(),
          "-m: the launch says it started cold:\n" + m.log())
    j.command("all", "exit 0")
    check(m.wait_exit(30) == 0, "-m: the job completes:\n%s" % m.log())

    # --preload none, and a command that is no script: no spare, the worker alone.
    code = "import runpy; runpy.run_path(%r, run_name='__main__')" % WARM_SCRIPT
    for name, preload, c, why in (
            ("none", "none", [py, "-B", WARM_SCRIPT], None),
            ("dash-c", "warm_marker", [py, "-c", code],
             "no warm interpreters despite --preload warm_marker: the command runs python -c")):
        j, n = warm_alone(job, name, preload, c)
        _, recs = wait_for(lambda: warm_round(j, 1), 60, name + ": the worker")
        time.sleep(1)  # a spare would be started right after the launch
        check(children(n.proc.pid) == [recs[0]["pid"]], "%s: the agent's children are %s, "
              "want its worker %d only" % (name, children(n.proc.pid), recs[0]["pid"]))
        check(not recs[0]["marker"] and not warm_files(j, "marker"), name + ": nothing preloaded")
        check("warm interpreter" not in n.log() or why, name + ": no spare: " + n.log())
        check(why is None or why in n.log(), "%s: the log says why: %s" % (name, n.log()))
        j.command("all", "exit 0")
        check(n.wait_exit(30) == 0, "%s: the job completes:\n%s" % (name, n.log()))
