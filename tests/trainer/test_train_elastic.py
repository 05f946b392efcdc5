#!/usr/bin/env python3
"""test_train_elastic.py: ductile-train's in-place rebuilds, against a scripted agent.

This script plays ductile-agent for two real trainers: it gives each one end
of a socketpair as DUCTILE_CONTROL_FD, makes round N the job's current round
in a real etcd (run under with-etcd), sends `round` and `abort` lines, and
reads what the trainers report (include/ductile/control.h): each says
`hello 1 inplace` once, and takes the agent's `hello` answer. Failpoints
(DUCTILE_FAILPOINTS) break one trainer at a chosen call, so every case is
the same whatever the timing; waits are deadlines for something to happen:

  peer:      a collective (over shared memory: both ranks are on this host)
             fails as a dead peer (shm.collective):
             both trainers report `peer_lost 1`, never `failed`; after
             `abort 1 lost` and round 2 they rebuild and finish;
  firsthand: a step fails on rank 1 itself (train.step=N:fail): rank 1
             reports `failed`, rank 0 (whose peer vanished) `peer_lost 1`;
  rebuild:   a graceful end of round 1, then rank 1's bootstrap for
             round 2 fails (shm.connect): rank 1 reports `peer_lost 2` at
             once instead of waiting; no `failed`; round 3 forms and finishes;
  graceful:  rank 1's steps are slow (train.step=N-M:sleep:MS, longer than
             any grace the trainer ever had) when `abort 1 graceful` and then
             `round 2` come: no step fails, nobody reports a failure, both
             rebuild at a step boundary and finish; every `step` line
             carries the rank's samples and the step's loss.

Needs TRAIN, FASHION_MNIST and DUCTILE_TEST_ETCD.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from testlib import check, run_cases, wait_for  # noqa: E402

TRAIN = os.environ["TRAIN"]
DATA = os.environ["FASHION_MNIST"]
ETCD = os.environ["DUCTILE_TEST_ETCD"]
WORLD = 2
DEADLINE = 120  # seconds: for things that must happen, never a speed
MAX_STEPS = 16


class Worker:
    """One trainer with its control channel; reads what it says."""

    def __init__(self, tmp, job, rank, failpoints, args):
        self.rank = rank
        self.sock, child = socket.socketpair()
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(WORLD), DUCTILE_ETCD_ENDPOINTS=ETCD, DUCTILE_JOB=job,
                   DUCTILE_ROUND="1", DUCTILE_CONTROL_FD=str(child.fileno()))
        env.pop("DUCTILE_FAILPOINTS", None)
        if failpoints:
            env["DUCTILE_FAILPOINTS"] = failpoints
        self.log_path = os.path.join(tmp, "%s.%d.log" % (job, rank))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([TRAIN] + args, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, pass_fds=[child.fileno()])
        child.close()
        self.lines = []
        self.mu = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in self.sock.makefile("rb"):
            with self.mu:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def send(self, line):
        self.sock.sendall((line + "\n").encode())

    def said(self, word):
        """Lines whose first word is `word`."""
        with self.mu:
            return [l for l in self.lines if l.split(" ", 1)[0] == word]

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.sock.close()


class Job:
    def __init__(self, tmp, name, failpoints, extra=()):
        self.name = "%s-%d" % (name, os.getpid())
        self.summary = os.path.join(tmp, self.name + ".json")
        self.make_current(1)
        args = ["--data", DATA, "--threads", "1", "--limit-train", "2000", "--limit-test",
                "200", "--batch-size", "16", "--max-steps", str(MAX_STEPS), "--log-every", "1",
                "--warmup-steps", "5", "--comm-timeout-ms", "5000", "--summary",
                self.summary] + list(extra)
        self.workers = [Worker(tmp, self.name, r, failpoints.get(r), args) for r in range(WORLD)]
        for w in self.workers:  # the agent's answer to the trainer's hello
            w.send("hello 1 inplace")

    def make_current(self, n):
        subprocess.run(["etcdctl", "--endpoints=" + ETCD, "put", "/ductile/%s/epoch" % self.name,
                        str(n)], check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, ETCDCTL_API="3"))

    def next_round(self, n, ended):
        """Ends round n-1 (`ended`: graceful or lost) and announces round n."""
        for w in self.workers:
            w.send("abort %d %s" % (n - 1, ended))
        self.make_current(n)
        for w in self.workers:
            w.send("round %d %d %d %d 0 1 0 127.0.0.1 29500 /ductile/%s/rounds/%d/store/" %
                   (n, w.rank, WORLD, w.rank, self.name, n))

    def wait_said(self, rank, word, what):
        return wait_for(lambda: self.workers[rank].said(word), DEADLINE, what)

    def wait_log(self, rank, text, what):
        wait_for(lambda: text in self.workers[rank].log(), DEADLINE, what)

    def finish(self):
        """Both exit 0 after MAX_STEPS steps."""
        for w in self.workers:
            try:
                rc = w.proc.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                rc = "still running"
            check(rc == 0, "%s rank %d: exit %s; log:\n%s" % (self.name, w.rank, rc,
                                                            w.log()[-3000:]))
        with open(self.summary) as f:
            steps = json.load(f)["steps"]
        check(steps == MAX_STEPS, "%s: %s steps, want %d" % (self.name, steps, MAX_STEPS))
        for w in self.workers:  # it can be kept in place: said so once, first
            check(w.said("hello") == ["hello 1 inplace"] and w.lines[0] == "hello 1 inplace",
                  "%s rank %d: hello %r, first line %r" % (self.name, w.rank, w.said("hello"),
                                                          w.lines[:1]))

    def check_steps(self):
        """Every `step K` carries samples N (this rank's own, in all: the
        same share each step here) and a finite, positive loss."""
        for w in self.workers:
            steps = [l.split() for l in w.said("step")]
            check(steps, "rank %d said no step" % w.rank)
            for words in steps:
                check(len(words) == 6 and words[2] == "samples" and words[4] == "loss",
                      "rank %d: %r" % (w.rank, words))
                k, n, loss = int(words[1]), int(words[3]), float(words[5])
                check(n > 0 and n % k == 0 and n // k == int(steps[0][3]) // int(steps[0][1]),
                      "rank %d: step %d with %d samples (%r)" % (w.rank, k, n, steps[:3]))
                check(0 < loss < 100, "rank %d: loss %r" % (w.rank, loss))

    def no_failed(self):
        for w in self.workers:
            check(not w.said("failed"), "%s rank %d said %s" % (self.name, w.rank,
                                                               w.said("failed")))

    def stop(self):
        for w in self.workers:
            w.stop()


def case_peer(tmp):
    # Rank 1's collectives: 1 allgather and 3 broadcasts agree on the state,
    # then one all-reduce per step: the 10th is in step 6.
    j = Job(tmp, "peer", {1: "shm.collective=10:closed"})
    try:
        for r in range(WORLD):
            lines = j.wait_said(r, "peer_lost", "rank %d's peer_lost" % r)
            check(lines[0].startswith("peer_lost 1 a step failed"), "rank %d: %s" % (r, lines))
        check("failpoint shm.collective" in j.workers[1].said("peer_lost")[0], "rank 1's reason")
        j.no_failed()
        j.next_round(2, "lost")
        j.finish()
        j.no_failed()
        check("round 2: world 2, rebuilt in place" in j.workers[0].log(), "no rebuild logged")
        check("collectives over shm" in j.workers[0].log(), "not over shared memory")
    finally:
        j.stop()


def case_firsthand(tmp):
    j = Job(tmp, "firsthand", {1: "train.step=4:fail"})
    try:
        failed = j.wait_said(1, "failed", "rank 1's failed")
        check("failpoint train.step" in failed[0], "rank 1: %s" % failed)
        check(not j.workers[1].said("peer_lost"), "rank 1 also said peer_lost")
        lost = j.wait_said(0, "peer_lost", "rank 0's peer_lost")
        check(lost[0].startswith("peer_lost 1 "), "rank 0: %s" % lost)
        check(not j.workers[0].said("failed"), "rank 0 said failed")
        j.next_round(2, "lost")
        j.finish()
    finally:
        j.stop()


def case_rebuild(tmp):
    # shm.connect's 1st call is round 1's bootstrap, the 2nd round 2's.
    j = Job(tmp, "rebuild", {1: "shm.connect=2:fail"})
    try:
        j.wait_log(0, "ductile-train: step 3 ", "step 3")
        j.next_round(2, "graceful")
        lost = j.wait_said(1, "peer_lost", "rank 1's peer_lost")
        check(lost[0].startswith("peer_lost 2 "), "rank 1: %s" % lost)
        check("failpoint shm.connect" in j.workers[1].log(), "rank 1's log names no failpoint")
        # Rank 0 may have said the same once its own bootstrap gave up, or
        # learnt from the abort first that round 2 is over: both are right.
        for line in j.workers[0].said("peer_lost"):
            check(line.startswith("peer_lost 2 "), "rank 0: %s" % line)
        j.no_failed()
        j.next_round(3, "lost")
        j.finish()
        j.no_failed()
        check(not [l for w in j.workers for l in w.said("peer_lost")
                   if not l.startswith("peer_lost 2 ")], "a peer_lost not about round 2")
    finally:
        j.stop()


def case_graceful(tmp):
    # Rank 1's steps 6 to 9 each take 1.5 s more: the abort lands in one.
    j = Job(tmp, "graceful", {1: "train.step=6-9:sleep:1500"})
    try:
        j.wait_log(0, "ductile-train: step 5 ", "step 5")
        j.next_round(2, "graceful")
        j.wait_log(0, "round 2: world 2, rebuilt in place", "the rebuild")
        check("round 2: world 2, rebuilt in place (at a step boundary)" in j.workers[0].log(),
              "round 2 was not rebuilt at a step boundary")
        j.finish()
        j.check_steps()
        for w in j.workers:
            check(not w.said("failed") and not w.said("peer_lost"),
                  "rank %d reported %s" % (w.rank, w.lines))
            check("a step failed" not in w.log(), "rank %d lost a step" % w.rank)
    finally:
        j.stop()


CASES = {"peer": case_peer, "firsthand": case_firsthand, "rebuild": case_rebuild,
         "graceful": case_graceful}


def main():
    with tempfile.TemporaryDirectory(prefix="ductile-test-elastic-") as tmp:
        return run_cases(CASES, sys.argv[1:], tmp)


if __name__ == "__main__":
    sys.exit(main())
