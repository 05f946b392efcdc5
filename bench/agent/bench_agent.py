#!/usr/bin/env python3
"""bench_agent.py: the agent's figures, each beside a baseline from the same run.

Run by bench/agent/run.sh under with-etcd. Four agents, one test worker each
(tests/agent/test_worker.c), a real etcd on 127.0.0.1. A "round running"
means every worker of the new round has started and written its report.

  SIGKILL, workers see it   an agent is killed; its peers' workers lose their
                            connection to it (AGENT_TEST_MESH) and fail the
                            round. Baseline: the lease TTL (the silent bound).
  SIGKILL, no budget        the same with --max-restarts 0: a pod lost is a
                            membership change, so the job must carry on
                            ("job failed" when an agent counted it).
  SIGKILL, silent           no worker notices; only the lease expiry does.
                            Baseline: the lease TTL.
  SIGSTOP worker            a worker stops (hung, its sockets open); its own
                            agent's watchdog (--hang-timeout 10) kills it and
                            the next round runs with a fresh one. Baseline:
                            the bound (10 s).
  pod restarted, same id    an agent and its worker are killed and the agent
                            starts again at once with its node id; it takes
                            its dead incarnation's registration over. Until
                            the next round runs with it again. Baseline: the
                            lease TTL (what the restart waited before).
  SIGTERM                   the agent leaves cleanly. Baseline: the lease TTL
                            (what a peer would wait without the clean leave).
  new agent                 a 4th agent starts beside 3 running ones (room up
                            to 4). Baseline: one agent alone (--nnodes 1)
                            from exec to its worker running: the floor of
                            any start (lease, round, spawn).
  agent RSS                 VmRSS of an agent in a running round (--http-port
                            on). Baseline: VmRSS of the test worker, a minimal
                            C process. Below it, where the agent's resident
                            set goes (/proc/PID/smaps: each library group,
                            heap, malloc arenas, thread stacks, the rest)
                            and its threads by name.
  agent RSS, own part       the same figure against the libraries' floor:
                            agent-floor (agent_floor.c) loads the agent's
                            libraries, initialises them as the agent does
                            and makes one etcd call, nothing else. Its
                            breakdown goes beside the agent's; the
                            difference is the agent's own.
  agent idle CPU            CPU seconds per second over an idle window.
                            Baseline: etcd's over the same window.
"""
import argparse
import collections
import os
import select
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
import agentkit as at  # noqa: E402

TTL = 5
LAST_CALL = 0.5


def flags(max_restarts=1000):
    return ["--lease-ttl", str(TTL), "--last-call", str(LAST_CALL), "--stop-grace", "2",
            "--nnodes", "3:4", "--max-restarts", str(max_restarts), "--join-timeout", "60"]


class JobFailed(Exception):
    pass


def four(name, env=None, max_restarts=1000):
    job = at.Job(name, flags(max_restarts))
    agents = [job.start("node-%d" % i, env=env) for i in range(4)]
    rnd = job.wait_round(4, 60)
    time.sleep(0.3)
    return job, agents, rnd


def trial_kill(i, mesh, max_restarts=1000):
    job, agents, rnd = four("bench-kill-%d-%d-%d-%d" % (mesh, max_restarts, i, os.getpid()),
                            {"AGENT_TEST_MESH": "1"} if mesh else None, max_restarts)
    try:
        t0 = time.monotonic()
        agents[3].proc.kill()

        def next_round():
            if any(not a.alive() for a in agents[:3]):
                raise JobFailed()
            r = job.running_round(3)
            return r if r is not None and r > rnd else None
        at.wait_for(next_round, TTL + 30, "a round of 3")
        return time.monotonic() - t0
    finally:
        job.cleanup(False)


HANG = 10


def trial_stop(i):
    job = at.Job("bench-stop-%d-%d" % (i, os.getpid()), flags() + ["--hang-timeout", str(HANG)])
    try:
        for n in range(4):
            job.start("node-%d" % n)
        rnd = job.wait_round(4, 60)
        time.sleep(1.5)  # the test worker says its first step after 0.5 s: watched from then on
        victim = at.workers_of(job, job.agents[3])[0]["_pid"]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        job.wait_round(4, HANG + 60, newer_than=rnd)
        return time.monotonic() - t0
    finally:
        job.cleanup(False)


def trial_restart(i):
    job, agents, rnd = four("bench-restart-%d-%d" % (i, os.getpid()))
    try:
        t0 = time.monotonic()
        agents[3].proc.kill()
        agents[3].proc.wait()
        job.start("node-3")
        job.wait_round(4, TTL + 60, newer_than=rnd)
        return time.monotonic() - t0
    finally:
        job.cleanup(False)


def trial_term(i):
    job, agents, rnd = four("bench-term-%d-%d" % (i, os.getpid()))
    try:
        t0 = time.monotonic()
        agents[3].signal(signal.SIGTERM)
        job.wait_round(3, TTL + 30, newer_than=rnd)
        return time.monotonic() - t0
    finally:
        job.cleanup(False)


def trial_join(i):
    job = at.Job("bench-join-%d-%d" % (i, os.getpid()), flags())
    try:
        for n in range(3):
            job.start("node-%d" % n)
        rnd = job.wait_round(3, 60)
        time.sleep(0.3)
        t0 = time.monotonic()
        job.start("node-3")
        job.wait_round(4, 60, newer_than=rnd)
        return time.monotonic() - t0
    finally:
        job.cleanup(False)


def solo_start(i):
    """One agent alone (--nnodes 1) from exec to its worker running."""
    job = at.Job("bench-solo-%d-%d" % (i, os.getpid()),
                 ["--lease-ttl", str(TTL), "--last-call", str(LAST_CALL), "--nnodes", "1"])
    try:
        t0 = time.monotonic()
        job.start("solo")
        job.wait_round(1, 60)
        return time.monotonic() - t0
    finally:
        job.cleanup(False)


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# Library groups of the breakdown, by file name prefix; the first match wins.
LIB_GROUPS = [
    ("libcurl", ("libcurl",)),
    ("OpenSSL (libssl, libcrypto)", ("libssl.", "libcrypto.")),
    ("GnuTLS (nettle, gmp, p11-kit, tasn1)", ("libgnutls", "libnettle", "libhogweed", "libgmp.",
                                             "libp11-kit", "libtasn1", "libffi")),
    ("Kerberos, LDAP, SASL", ("libgssapi", "libkrb5", "libk5crypto", "libcom_err", "libkeyutils",
                              "libldap", "liblber", "libsasl2", "libresolv")),
    ("nghttp2, ssh2, rtmp, psl, idn2, brotli, zstd, zlib",
     ("libnghttp2", "libssh", "librtmp", "libpsl", "libidn2", "libunistring", "libbrotli",
      "libzstd", "libz.")),
    ("libmicrohttpd", ("libmicrohttpd",)),
    ("cJSON", ("libcjson",)),
    ("libm", ("libm.",)),
    ("glibc (libc, ld.so)", ("libc.", "ld-linux", "libpthread", "libdl.", "librt.")),
]


def task_files(pid, name):
    """The text of /proc/PID/task/TID/NAME for every thread of pid (those still there)."""
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/%s" % (pid, tid, name)) as f:
                text = f.read()
        except OSError:
            continue
        yield text


def stack_tops(pid):
    """The stack pointer of every thread of pid blocked in a system call."""
    sps = []
    for text in task_files(pid, "syscall"):
        fields = text.split()
        if len(fields) >= 8:
            sps.append(int(fields[7], 16))
    return sps


def rss_breakdown(pid, exe):
    """KiB resident per part of pid's address space, from /proc/PID/smaps.

    A thread stack is the mapping a thread's stack pointer is in; a malloc
    arena (glibc gives each thread one, up to 8 per core) is an anonymous
    mapping aligned to its 64 MiB reservation."""
    sps = stack_tops(pid)
    parts = {}
    name = None
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            head = line.split(None, 5)
            if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                path = head[5].strip() if len(head) > 5 else ""
                base = os.path.basename(path)
                if path == "[heap]":
                    name = "heap (brk)"
                elif path == "[stack]" or any(lo <= sp < hi for sp in sps):
                    name = "thread stacks"
                elif os.path.realpath(path) == os.path.realpath(exe):
                    name = "ductile-agent"
                elif path.startswith("/"):
                    name = next((g for g, pre in LIB_GROUPS if base.startswith(pre)),
                                "other files")
                elif path == "" and lo % (64 << 20) == 0:
                    name = "malloc arenas (threads)"
                else:
                    name = "other anonymous" if path == "" else path
            elif line.startswith("Rss:"):
                parts[name] = parts.get(name, 0) + int(line.split()[1])
    return parts


def cpu_s(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_breakdown(pids, exe):
    """The median VmRSS of pids, and the breakdown of the pid nearest it."""
    med = statistics.median(rss_kib(p) for p in pids)
    mid = min(pids, key=lambda p: abs(rss_kib(p) - med))
    return med, mid, rss_breakdown(mid, exe)


def floors(n):
    """n agent-floor processes, each serving HTTP on a port of its own."""
    ps = [subprocess.Popen([at.ARGS.floor, at.ETCD, str(at.free_port())], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True) for _ in range(n)]
    deadline = time.monotonic() + 30
    for p in ps:
        # Its first line says it is up; a floor that says nothing in time fails the bench.
        if not select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            for q in ps:
                q.kill()
            raise at.Fail("agent-floor said nothing within 30 s")
        if not p.stdout.readline():
            raise at.Fail("agent-floor exited with %s" % p.wait())
    return ps


def costs(window):
    job = at.Job("bench-idle-%d" % os.getpid(), flags())
    agents = [job.start("node-%d" % i, ["--http-port", str(at.free_port())]) for i in range(4)]
    job.wait_round(4, 60)
    fl = []
    try:
        fl = floors(4)
        time.sleep(1.3)
        # The breakdown of the agent (and floor) whose VmRSS is nearest the median.
        agent_rss, mid, parts = median_breakdown([a.proc.pid for a in agents], at.ARGS.agent)
        floor_rss, _, floor_parts = median_breakdown([p.pid for p in fl], at.ARGS.floor)
        threads = collections.Counter(at.thread_names(mid).values())
        worker_rss = statistics.median(rss_kib(w["_pid"]) for w in job.alive_workers())
        etcd = int(os.environ["DUCTILE_TEST_ETCD_PID"])
        a0 = [cpu_s(a.proc.pid) for a in agents]
        e0 = cpu_s(etcd)
        t0 = time.monotonic()
        time.sleep(window)
        dt = time.monotonic() - t0
        agent_cpu = statistics.mean((cpu_s(a.proc.pid) - c) / dt for a, c in zip(agents, a0))
        etcd_cpu = (cpu_s(etcd) - e0) / dt
        return (agent_rss, parts, threads, worker_rss, agent_cpu, etcd_cpu, floor_rss,
                floor_parts)
    finally:
        for p in fl:
            p.stdin.close()
            p.wait()
        job.cleanup(False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--floor", required=True, help="agent-floor (bench/agent/agent_floor.c)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle-window", type=float, default=10.0)
    ap.add_argument("--costs-only", action="store_true",
                    help="only the agent's costs (RSS and its breakdown, idle CPU)")
    at.ARGS = ap.parse_args()
    n = at.ARGS.repeats
    rows = []

    def timed(label, fn, base_label, base):
        vals = [fn(i) for i in range(n)]
        med = statistics.median(vals)
        rows.append((label, "%.3f s" % med, base_label, "%.3f s" % base, med / base))

    try:
        if not at.ARGS.costs_only:
            recovery(n, timed, rows)
        (agent_rss, parts, threads, worker_rss, agent_cpu, etcd_cpu, floor_rss,
         floor_parts) = costs(at.ARGS.idle_window)
    except at.Fail as e:
        print("bench/agent: %s" % e, file=sys.stderr)
        return 1
    rows.append(("agent RSS (in a running round)", "%d KiB" % agent_rss, "test worker RSS",
                 "%d KiB" % worker_rss, agent_rss / max(worker_rss, 1)))
    rows.append(("agent RSS (in a running round)", "%d KiB" % agent_rss,
                 "its libraries (agent-floor)", "%d KiB" % floor_rss, agent_rss / floor_rss))
    rows.append(("agent idle CPU (%.0f s window)" % at.ARGS.idle_window,
                 "%.2f%% core" % (100 * agent_cpu), "etcd idle CPU", "%.2f%% core" %
                 (100 * etcd_cpu), agent_cpu / etcd_cpu if etcd_cpu > 0 else float("nan")))
    print("4 agents x 1 worker, lease TTL %d s, last call %.1f s, median of %d runs" %
          (TTL, LAST_CALL, n))
    w = max(len(r[0]) for r in rows)
    bw = max(len(r[2]) for r in rows)
    print("%-*s  %12s  %-*s  %12s  %7s" % (w, "figure", "ours", bw, "baseline", "value", "ratio"))
    for r in rows:
        print("%-*s  %12s  %-*s  %12s  %7.2f" % (w, r[0], r[1], bw, r[2], r[3], r[4]))
    print("\nwhere the agent's RSS goes (one agent, /proc/PID/smaps; the worker: %d KiB),"
          " KiB" % worker_rss)
    print("  %-52s %6s %6s  %6s %6s" % ("", "agent", "", "floor", "own"))
    total = sum(parts.values())
    for name, kib in sorted(parts.items(), key=lambda kv: -kv[1]):
        if kib:
            fk = floor_parts.get(name, 0)
            print("  %-52s %6d %5.1f%%  %6d %6d" % (name, kib, 100.0 * kib / total, fk, kib - fk))
    ftotal = sum(floor_parts.values())
    print("  %-52s %6d %6s  %6d %6d" % ("total (smaps Rss)", total, "", ftotal, total - ftotal))
    print("the same agent's threads (%d): %s" % (sum(threads.values()), ", ".join(
        n if c == 1 else "%s x%d" % (n, c) for n, c in sorted(threads.items()))))
    return 0


def recovery(n, timed, rows):
    """The recovery figures: each timed n times, the median beside its baseline."""
    timed("SIGKILL -> next round running (workers see it)", lambda i: trial_kill(i, True),
          "lease TTL", TTL)
    try:
        timed("SIGKILL, --max-restarts 0 -> next round running",
              lambda i: trial_kill(i, True, 0), "lease TTL", TTL)
    except JobFailed:
        rows.append(("SIGKILL, --max-restarts 0 -> next round running", "job failed",
                     "lease TTL", "%.3f s" % TTL, float("nan")))
    timed("SIGKILL -> next round running (silent, lease)", lambda i: trial_kill(i, False),
          "lease TTL", TTL)
    timed("SIGSTOP worker -> next round running without it", trial_stop,
          "--hang-timeout", HANG)
    timed("pod restarted, same id -> back in a running round", trial_restart, "lease TTL",
          TTL)
    timed("SIGTERM -> next round running", trial_term, "lease TTL", TTL)
    solo = statistics.median(solo_start(i) for i in range(n))
    timed("new agent -> next round running", trial_join, "one agent alone, start", solo)


if __name__ == "__main__":
    sys.exit(main())
