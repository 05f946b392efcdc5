"""scenarios.py: the CPU fault matrix and the chaos run (tests/e2e).

Each scenario is fn(env, mode, ref): it starts a Job (job.py), injects its
fault while training runs, and verifies the job against the reference
accuracy ref. The GPU path's own scenarios are in scenarios_gpu.py; which
ones make up a suite is e2e.py's.
"""
import base64
import json
import os
import random
import re
import signal
import subprocess
import time
import urllib.request
from job import CHAOS_EPOCHS, log, once_wrapper, restart_counts, start_three, tail, verify, wait_for
from testlib import Etcd, Fail, Netns, Skip, check


def sc_worker_kill(env, mode, ref):
    with env.job("worker-kill-" + mode, mode) as job:
        start_three(job)
        a = job.agents["n2"]
        pids = a.workers()
        check(pids, "no worker under agent n2")
        log("SIGKILL worker %d of n2" % pids[0])
        os.kill(pids[0], signal.SIGKILL)
        verify(job, ref)


def sc_agent_kill(env, mode, ref):
    # A pod lost is a membership change: with no restart budget at all, the
    # job carries on at 2 and finishes (every survivor exits 0).
    with env.job("agent-kill-" + mode, mode, max_restarts=0) as job:
        start_three(job)
        log("SIGKILL agent n3 with its worker")
        job.agents["n3"].kill_tree()
        job.wait_round(job.agents["n1"], 2)
        verify(job, ref)


def sc_scale_down(env, mode, ref):
    with env.job("scale-down-" + mode, mode, max_restarts=0) as job:
        start_three(job)
        log("SIGTERM agent n3")
        job.agents["n3"].signal(signal.SIGTERM)
        job.agents["n3"].proc.wait(30)
        check(job.agents["n3"].proc.returncode == 0,
              "SIGTERM'd agent exited %d" % job.agents["n3"].proc.returncode)
        verify(job, ref, no_step_lost=True)


def sc_scale_up(env, mode, ref):
    # Steps 12 and 13 of every trainer take over 5 s (a slow GPU step): the
    # fourth agent joins during them, and the step in flight must finish, not
    # be lost, whatever the time it takes.
    with env.job("scale-up-" + mode, mode, max_restarts=0,
                 agent_env={"DUCTILE_WORKER_FAILPOINTS": "train.step=12-13:sleep:5000"}) as job:
        for _ in range(3):
            job.start()
        job.wait_step(10)
        log("a fourth agent joins during a 5 s step")
        job.start()
        job.wait_round(job.agents["n1"], 4)
        verify(job, ref, no_step_lost=True)


def sc_hot_spare(env, mode, ref):
    with env.job("hot-spare-" + mode, mode, nnodes="3:3") as job:
        start_three(job)
        spare = job.start()
        wait_for(lambda: "hot spare" in spare.text(), 60, "the spare to wait")
        log("SIGKILL agent n1; the spare takes its place")
        job.agents["n1"].kill_tree()
        job.wait_round(job.agents["n2"], 3)
        verify(job, ref)


def sc_below_min(env, mode, ref):
    with env.job("below-min-" + mode, mode, nnodes="3:3") as job:
        start_three(job)
        log("SIGKILL agent n3: below min_nodes, training pauses")
        job.agents["n3"].kill_tree()
        time.sleep(5)
        s1 = job.steps()
        time.sleep(3)
        check(job.steps() == s1, "training went on below min_nodes")
        log("a node returns")
        job.start()
        verify(job, ref)


def sc_etcd_restart(env, mode, ref):
    with env.job("etcd-restart-" + mode, mode) as job:
        start_three(job)
        log("etcd restarted")
        job.etcd.kill()
        time.sleep(2)
        job.etcd.start()
        verify(job, ref)


def sc_etcd_pause(env, mode, ref):
    # A 10 s outage with the agent's default 10 s lease: the leases may
    # expire when etcd resumes, and then every agent registers again and
    # the job goes on from the survivors' state.
    with env.job("etcd-pause-" + mode, mode, ttl=10) as job:
        start_three(job)
        log("etcd unreachable for 10 s (SIGSTOP)")
        os.kill(job.etcd.proc.pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(job.etcd.proc.pid, signal.SIGCONT)
        verify(job, ref)


def sc_slow_node(env, mode, ref):
    with env.job("slow-node-" + mode, mode) as job:
        start_three(job)
        pid = job.agents["n2"].workers()[0]
        log("worker of n2 10x slower for 8 s (SIGSTOP 90 ms / SIGCONT 10 ms)")
        end = time.monotonic() + 8
        while time.monotonic() < end:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.09)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)
        verify(job, ref)


def sc_hung_worker(env, mode, ref):
    # A worker that hangs with its sockets open (SIGSTOP) is killed by its
    # own agent's watchdog, counted once as that node's failure, and the job
    # goes on: its peers are not blamed, and the hung process is never
    # carried into the next round.
    with env.job("hung-worker-" + mode, mode, max_restarts=3,
                 agent_args=["--hang-timeout", "4"]) as job:
        start_three(job)
        a = job.agents["n2"]
        pid = a.workers()[0]
        log("SIGSTOP worker %d of n2" % pid)
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: re.search(r"\(pid \d+\) hung:", a.text()), 60,
                 "n2's watchdog to kill its hung worker")
        verify(job, ref)
        check(not os.path.exists("/proc/%d" % pid), "the hung worker %d still exists" % pid)
        hung = [ln for ln in a.text().splitlines() if re.search(r"\(pid \d+\) hung:", ln)]
        check(hung and "killing it" in hung[0], "no watchdog line on n2: %s" % tail(a.text(), 5))
        log("n2: %s" % hung[0])
        counts = restart_counts(job)
        check(counts and max(counts) == 1, "restarts recorded %s: want exactly one" % counts)
        for ag in job.agents.values():
            if ag is a:
                continue
            check(not re.search(r"\(pid \d+\) hung:", ag.text()),
                  "%s's worker was killed for n2's hang" % ag.name)


def sc_stuck_step(env, mode, ref):
    # One trainer's step 12 computes for 30 s (a wedged data loader, a kernel
    # that never returns) while its process stays alive and says so: its
    # agent kills it after --hang-timeout of no progress in local work. Its
    # peers wait for it in a collective the while, which is not watched:
    # they are neither killed nor blamed.
    with env.job("stuck-step-" + mode, mode, max_restarts=3,
                 agent_args=["--hang-timeout", "5"]) as job:
        # Only the first trainer of n2 is stuck: the one its agent starts
        # after the kill trains normally.
        job.start()
        stuck = job.start(worker_prefix=once_wrapper(job, "stuck", "train.step=12:sleep:30000"))
        job.start()
        verify(job, ref)
        hung = [ln for ln in stuck.text().splitlines() if re.search(r"\(pid \d+\) hung:", ln)]
        check(hung and "no progress" in hung[0] and "phase compute" in hung[0],
              "no watchdog line for the stuck step on %s: %s" % (stuck.name, tail(stuck.text(), 5)))
        log("%s: %s" % (stuck.name, hung[0]))
        for ag in job.agents.values():
            if ag is not stuck:
                check(not re.search(r"\(pid \d+\) hung:", ag.text()),
                      "%s's waiting worker was killed" % ag.name)
        counts = restart_counts(job)
        check(counts and max(counts) == 1, "restarts recorded %s: want exactly one" % counts)


def sc_duplicate_id(env, mode, ref):
    with env.job("duplicate-id-" + mode, mode) as job:
        start_three(job)
        dup = job.start(name="dup", node_id="n2")
        dup.proc.wait(60)
        check(dup.proc.returncode != 0, "a second agent with node id n2 exited 0")
        text = dup.text()
        check("n2" in text and re.search(r"already|in use|duplicate|exists", text, re.I),
              "no clear error for a duplicate node id: %s" % tail(text, 3))
        log("duplicate node id refused: %s" % tail(text, 1))
        dup.killed = True
        verify(job, ref)


def sc_disk_full(env, mode, ref):
    job = env.job("disk-full-" + mode, mode)
    mnt = os.path.join(job.dir, "small")
    os.makedirs(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", mnt],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise Skip("cannot mount a small tmpfs: %s" % r.stderr.strip())
    try:
        # Two checkpoints of ~2 MB each do not fit in 3 MB: a save fails while
        # the previous one stays, and training goes on.
        for _ in range(3):
            job.start(ckpt=mnt)
        job.wait_step(10)
        job.agents["n3"].kill_tree()
        verify(job, ref)
        text = "".join(a.text() for a in job.agents.values())
        check("not saved" in text, "no checkpoint failed to save on the full disk")
    finally:
        job.cleanup()
        subprocess.run(["umount", "-l", mnt])


def etcd_has(etcd, key):
    """Whether etcd holds key now (its v3 HTTP/JSON range call)."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                       "count_only": True}).encode()
    req = urllib.request.Request(etcd.endpoint + "/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return int(json.load(r).get("count", 0)) > 0


def sc_netns(env, mode, ref):
    """One node in its own network namespace, reached over a veth pair with
    addresses in a private /30; etcd listens on the host side. Cutting the
    link makes its lease expire; when it comes back it must rejoin in a new
    round and take the job's state, never push its old one."""
    suffix = "%d" % (os.getpid() % 10000)
    ns, vh, vn = "e2e%s" % suffix, "e2eh%s" % suffix, "e2en%s" % suffix
    net = "10.213.%d" % (os.getpid() % 200 + 20)
    host_ip, ns_ip = net + ".1", net + ".2"
    link = Netns(ns, vh, vn, host_ip, ns_ip)
    try:
        link.setup()
        etcd = Etcd(env.workdir, hosts=("127.0.0.1", host_ip))
        etcd.start()
        with env.job("netns-" + mode, mode, etcd=etcd) as job:
            # The three root-namespace agents reach each other on 127.0.0.1 and
            # the namespaced node on the veth: their ring listens on host_ip.
            # The cut node joins first: rank 0 of round 1, the one that saves.
            job.extra = ["--host", ns_ip]
            cut = job.start(name="cut", endpoint="http://%s:%d" % (host_ip, etcd.port),
                            prefix=link.prefix())
            # Ranks follow join order: the others start once cut has joined.
            wait_for(lambda: etcd_has(etcd, "/ductile/%s/rounds/1/joined/cut" % job.job), 60,
                     "node 'cut' to join round 1")
            job.extra = ["--host", host_ip]
            for _ in range(2):
                job.start()
            job.wait_step(10)
            check(re.search(r"\[0\] ductile-train: checkpoint", cut.text()),
                  "the node to cut off is not the one saving checkpoints")
            log("link of node 'cut' down")
            mark = len(cut.text())
            link.link(up=False)
            job.wait_round(job.agents["n2"], 2, timeout=60)
            time.sleep(4)
            log("link of node 'cut' up again")
            link.link(up=True)
            verify(job, ref, expect_fail=("cut",))
            # Rounds of all three: two ranks share the root namespace, the
            # cut node has its own: shared memory there, the ring between
            # (trainer/comm_hier.c); rank 0 says so.
            check(any("collectives over hier" in a.text() for a in job.agents.values()),
                  "no round of three was hierarchical")
            after = cut.text()[mark:]
            check("ductile-train: checkpoint" not in after,
                  "the cut-off node saved a checkpoint after it was cut off")
            rounds = [int(m) for m in re.findall(r"ckpt-r(\d+)-", " ".join(os.listdir(job.ck)))]
            check(rounds and min(rounds) >= 2, "checkpoints of round 1 left: %s" % rounds)
            log("cut-off node: %s" % tail(after, 1))
            etcd.stop()
    finally:
        link.close()


def sc_chaos(env, mode, ref):
    """A seeded random schedule of 20 kills, joins and leaves over one run
    (2 to 4 agents); events wait for training to move on between them."""
    seed = env.chaos_seed
    rng = random.Random(seed)
    log("chaos seed %d (rerun: e2e.py ... --chaos-seed %d chaos)" % (seed, seed))
    job = env.job("chaos-" + mode, mode, nnodes="2:4", epochs=CHAOS_EPOCHS)
    try:
        for _ in range(3):
            job.start()
        done = []
        for i in range(20):
            job.wait_step(30 + 40 * i, timeout=180)
            alive = [a for a in job.agents.values() if a.proc.poll() is None]
            kinds = ["worker_kill", "join"]
            if len(alive) > 2:
                kinds += ["agent_kill", "leave"]
            kind = rng.choice(kinds)
            victim = rng.choice(alive)
            if kind == "worker_kill":
                pids = victim.workers()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
            elif kind == "agent_kill":
                victim.kill_tree()
            elif kind == "leave":
                victim.signal(signal.SIGTERM)
                victim.proc.wait(30)
                check(victim.proc.returncode == 0, "agent %s left with code %d" %
                      (victim.name, victim.proc.returncode))
                victim.killed = True
            else:
                victim = job.start()
            done.append("%s:%s" % (kind, victim.name))
            log("chaos event %d: %s %s" % (i + 1, kind, victim.name))
        verify(job, ref, timeout=600)
    except Fail as e:
        raise Fail("chaos seed %d: %s (events: %s)" % (seed, e, " ".join(done)))
    finally:
        job.cleanup()
