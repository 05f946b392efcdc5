"""test_k8s.py: --k8s-events, Kubernetes Events posted to a stand-in API server.

Off by default; on, a round, a counted failure and the job's failure each
post one Event from the node that speaks for it, a refusing server is
logged once, and incomplete settings are refused.
"""
import json
import os
import re
import signal
import agentkit as kit
from agentkit import ETCD, FAST, Job, crash_until, run_agent, workers_of
from testlib import check, wait_for



class EventSink:
    """A stand-in for the Kubernetes API server on 127.0.0.1: records every
    POST (path, Authorization header, JSON body) and answers `status`."""

    def __init__(self):
        import http.server
        import threading
        sink = self
        self.posts, self.status = [], 201

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    obj = json.loads(body)
                except ValueError:
                    obj = None
                sink.posts.append((self.path, self.headers.get("Authorization"), obj))
                self.send_response(sink.status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}" if sink.status == 201 else b"not json")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self, reason=None):
        return [b for _, _, b in self.posts if b and (reason is None or b.get("reason") == reason)]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def case_k8s_events(job):
    sink = EventSink()
    token = os.path.join(job.dir, "token")
    with open(token, "w") as f:
        f.write("secret-token\n")
    env = {"DUCTILE_K8S_API": sink.url, "DUCTILE_K8S_TOKEN_FILE": token,
           "DUCTILE_K8S_NAMESPACE": "ml", "DUCTILE_K8S_JOB_NAME": "train-worker",
           "DUCTILE_K8S_JOB_UID": "0b5c7a38-uid"}
    others = []
    try:
        # Off (the default): the same settings, a round and a failure, nothing posted.
        off = Job(job.name + "-off", FAST + ["--nnodes", "1", "--max-restarts", "3"])
        others.append(off)
        a = off.start("node-a", env=env)
        r1 = off.wait_round(1, 60)
        off.command(workers_of(off, a)[0]["_pid"], "exit 1")
        off.wait_round(1, 40, newer_than=r1)
        wait_for(lambda: "failure recorded" in a.log(), 20, "the failure recorded")
        a.signal(signal.SIGTERM)
        a.wait_exit(30)
        check(sink.posts == [], "no Events without --k8s-events: %r" % sink.posts)

        # On: a round, a failure counted, the job failed; node rank 0 speaks for rounds.
        job.flags += FAST + ["--nnodes", "2", "--max-restarts", "1", "--k8s-events"]
        a, b = job.start("node-a", env=env), job.start("node-b", env=env)
        r1 = job.wait_round(2, 60)
        wait_for(lambda: sink.events("RoundFormed"), 20, "RoundFormed posted")
        ev = sink.events("RoundFormed")[0]
        check(ev["involvedObject"] == {"apiVersion": "batch/v1", "kind": "Job",
                                       "name": "train-worker", "namespace": "ml",
                                       "uid": "0b5c7a38-uid"}, "involvedObject: %r" % ev)
        check(ev["type"] == "Normal" and ev["kind"] == "Event" and
              ev["metadata"]["namespace"] == "ml" and
              ev["metadata"]["generateName"] == "train-worker.", "event: %r" % ev)
        check(re.match(r"round %d formed with 2 nodes, world size 2" % r1, ev["message"]),
              "RoundFormed message: " + ev["message"])
        path, auth, _ = sink.posts[0]
        check(path == "/api/v1/namespaces/ml/events" and auth == "Bearer secret-token",
              "posted to %s with %r" % (path, auth))
        r2 = crash_until(job, b, a, "exit 1", 2, r1)
        wait_for(lambda: sink.events("RestartCounted") and sink.events("WorkerFailed") and
                 len(sink.events("RoundFormed")) >= 2, 20,
                 "RestartCounted, WorkerFailed and a second RoundFormed: %r" % sink.posts)
        rc = sink.events("RestartCounted")[0]
        check(rc["type"] == "Warning" and "restarts now 1 of 1" in rc["message"] and
              "exited with code 1" in rc["message"] and rc["source"]["host"] == "node-b",
              "RestartCounted: %r" % rc)
        wf = sink.events("WorkerFailed")[0]
        check(wf["type"] == "Warning" and wf["message"].startswith("round %d ended" % r1),
              "WorkerFailed: %r" % wf)
        check(sink.events("RoundFormed")[-1]["message"].startswith("round %d formed" % r2),
              "second round's Event")
        # One Event per change: the round's Events come from node rank 0 alone.
        check(len(sink.events("RoundFormed")) == 2 and len(sink.events("WorkerFailed")) == 1,
              "no duplicates: %r" % [e["reason"] for e in sink.events()])
        job.command(workers_of(job, a)[0]["_pid"], "exit 1")
        for ag in (a, b):
            check(ag.wait_exit(40) != 0, "job failed")
        failed = sink.events("JobFailed")
        check(len(failed) == 1 and failed[0]["type"] == "Warning" and
              failed[0]["message"].startswith("job failed: restart limit") and
              failed[0]["source"]["host"] == sink.events("RoundFormed")[-1]["source"]["host"],
              "JobFailed, from node rank 0: %r" % failed)

        # An API server that refuses: logged once, training unaffected.
        sink.status = 403
        n = len(sink.posts)
        bad = Job(job.name + "-bad", FAST + ["--nnodes", "1", "--max-restarts", "3",
                                             "--k8s-events"])
        others.append(bad)
        c = bad.start("node-c", env=env)
        r1 = bad.wait_round(1, 60)
        bad.command(workers_of(bad, c)[0]["_pid"], "exit 1")
        bad.wait_round(1, 40, newer_than=r1)
        # Tried all the same: two rounds formed, a restart counted, a round ended.
        wait_for(lambda: len(sink.posts) >= n + 4, 20, "four refused posts")
        bad.command("all", "exit 0")
        check(c.wait_exit(40) == 0, "the job completes: " + c.log())
        check(c.log().count("k8s_events_failed") + c.log().count("cannot post Kubernetes") == 1,
              "the refusal logged once: " + c.log())
        # A node joins, then leaves: node rank 0 says so.
        sink.status = 201
        grow = Job(job.name + "-grow", FAST + ["--nnodes", "1:2", "--k8s-events"])
        others.append(grow)
        d = grow.start("node-d", env=env)
        r1 = grow.wait_round(1, 60)
        e = grow.start("node-e", env=env)
        grow.wait_round(2, 60, newer_than=r1)
        wait_for(lambda: sink.events("NodeJoined"), 20, "NodeJoined posted")
        joined = sink.events("NodeJoined")[0]
        check(joined["type"] == "Normal" and joined["source"]["host"] == "node-d" and
              joined["message"].startswith("round %d ended" % r1), "NodeJoined: %r" % joined)
        e.signal(signal.SIGTERM)
        check(e.wait_exit(30) == 0, "node-e left")
        wait_for(lambda: sink.events("NodeLeft"), 20, "NodeLeft posted")
        left = sink.events("NodeLeft")[0]
        check(left["source"]["host"] == "node-d" and "node-e" in left["message"],
              "NodeLeft: %r" % left)
        d.signal(signal.SIGTERM)
        d.wait_exit(30)
        # Incomplete settings: one line, exit 2.
        r = run_agent(["--rdzv-endpoint", ETCD, "--rdzv-id", job.name + "-cfg", "--k8s-events",
                       "--", kit.ARGS.worker], env={"DUCTILE_K8S_API": sink.url,
                                                "DUCTILE_K8S_NAMESPACE": "ml"})
        check(r.returncode == 2 and "DUCTILE_K8S_JOB_NAME" in r.stderr and
              len(r.stderr.strip().splitlines()) == 1, "no job name: %d %s" %
              (r.returncode, r.stderr))
    finally:
        for o in others:
            o.cleanup(keep=False)
        sink.close()
