"""test_torchrun.py: the agent run as torchrun.

torchrun's command lines, as PyTorch's elastic docs (torchrun quickstart and
usage) give them, run unchanged with tests/agent/torchrun_train.py standing in
for YOUR_TRAINING_SCRIPT.py. The node's id and address come from variables
(DUCTILE_NODE_ID/ADDR), as one machine runs several nodes. Also a
PyTorchJob's PET_* variables, --log-dir/--redirects/--tee, and torch's
@record error file.
"""
import json
import os
import re
from agentkit import ETCD
from testlib import check



TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_train.py")


def train_records(job):
    """What every run of the training script saw: {(rank, restart): record}."""
    out = {}
    for name in os.listdir(job.dir):
        m = re.fullmatch(r"py\.(\d+)\.(\d*)\.json", name)
        if m:
            with open(os.path.join(job.dir, name)) as f:
                out[(int(m.group(1)), m.group(2))] = json.load(f)
    return out


def host_port(url):
    return url.split("://", 1)[-1]


def check_world(job, world, restart="0", argv=None, max_restarts=None):
    recs = {r: v for (r, rs), v in train_records(job).items() if rs == restart}
    check(sorted(recs) == list(range(world)),
          "ranks %s ran attempt %s, want 0..%d" % (sorted(recs), restart, world - 1))
    for r, v in recs.items():
        check(v["WORLD_SIZE"] == str(world), "rank %d: WORLD_SIZE %s" % (r, v["WORLD_SIZE"]))
        check(v["argv"][0] == TRAIN, "rank %d: run as a script: %r" % (r, v["argv"]))
        if argv is not None:
            check(v["argv"][1:] == argv, "rank %d: argv %r" % (r, v["argv"]))
        if max_restarts is not None:
            check(v["TORCHELASTIC_MAX_RESTARTS"] == str(max_restarts),
                  "rank %d: TORCHELASTIC_MAX_RESTARTS %s" % (r, v["TORCHELASTIC_MAX_RESTARTS"]))
    return recs


def case_torchrun_docs(job):
    ep = host_port(ETCD)  # torchrun's HOST_NODE_ADDR form: host:port
    # Single-node multi-worker:
    #   torchrun --standalone --nnodes=1 --nproc-per-node=$NUM_TRAINERS
    #       YOUR_TRAINING_SCRIPT.py (--arg1 ... train script args...)
    args = ["--arg1", "a b", "--epochs=2", "-v"]
    a = job.start_raw("solo", ["--standalone", "--nnodes=1", "--nproc-per-node=2", TRAIN] + args,
                      env={"TEST_ARGV": json.dumps(args)})
    check(a.wait_exit(90) == 0, "standalone: exit %s\n%s" % (a.proc.returncode, a.log()))
    check_world(job, 2, argv=args)
    out = a.out()
    check("[0] stdout of rank 0" in out and "[1] stdout of rank 1" in out, "output: %r" % out)
    for name in os.listdir(job.dir):
        if name.startswith("py."):
            os.unlink(os.path.join(job.dir, name))
    # Fault tolerant (fixed sized nodes, restarts), two nodes; the first attempt
    # fails (rank 1 exits 1) and the job restarts:
    #   torchrun --nnodes=$NUM_NODES --nproc-per-node=$NUM_TRAINERS --max-restarts=3
    #       --rdzv-id=$JOB_ID --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR
    #       YOUR_TRAINING_SCRIPT.py
    cmd = ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=%s" % job.name,
           "--rdzv-backend=c10d", "--rdzv-endpoint=%s" % ep, TRAIN]
    env = {"TEST_FAIL": "once", "TEST_ARGV": "[]", "DUCTILE_LAST_CALL": "0.5"}
    nodes = [job.start_raw(n, cmd, env=env) for n in ("node-a", "node-b")]
    for n in nodes:
        check(n.wait_exit(120) == 0, "fault tolerant: %s exit %s\n%s" %
              (n.node, n.proc.returncode, n.log()))
    check_world(job, 4, restart="1", max_restarts=3)
    check((1, "0") in train_records(job), "the first attempt ran (and failed)")
    check("--rdzv-backend c10d: the rendezvous is etcd" in nodes[0].log(),
          "the backend note: %s" % nodes[0].log())
    # Elastic (min=1, max=4, tolerates up to 3 membership changes or failures):
    #   torchrun --nnodes=1:4 --nproc-per-node=$NUM_TRAINERS --max-restarts=3
    #       --rdzv-id=$JOB_ID --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR
    #       YOUR_TRAINING_SCRIPT.py
    job2 = job.name + "-elastic"
    cmd = ["--nnodes=1:4", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=%s" % job2,
           "--rdzv-backend=c10d", "--rdzv-endpoint=%s" % ep, TRAIN]
    for name in os.listdir(job.dir):
        if name.startswith("py."):
            os.unlink(os.path.join(job.dir, name))
    nodes = [job.start_raw(n, cmd, env={"DUCTILE_LAST_CALL": "3"}) for n in ("el-a", "el-b")]
    for n in nodes:
        check(n.wait_exit(120) == 0, "elastic: %s exit %s\n%s" % (n.node, n.proc.returncode,
                                                                   n.log()))
    recs = train_records(job)
    check(recs and all(v["TORCHELASTIC_RUN_ID"] == job2 for v in recs.values()), "run id")
    # The static rendezvous form (torchrun's and torch.distributed.launch's
    # --node-rank/--master-addr/--master-port): the ranks come from etcd
    # (given by variable here), the static flags are logged as ignored.
    #   torchrun --nproc-per-node=2 --nnodes=1 --node-rank=0 --master-addr=127.0.0.1
    #       --master-port=29500 YOUR_TRAINING_SCRIPT.py
    for name in os.listdir(job.dir):
        if name.startswith("py."):
            os.unlink(os.path.join(job.dir, name))
    s = job.start_raw("static", ["--nproc-per-node=2", "--nnodes=1", "--node-rank=0",
                                 "--master-addr=127.0.0.1", "--master-port=29500", TRAIN],
                      env={"DUCTILE_RDZV_ENDPOINT": ETCD, "DUCTILE_RDZV_ID": job.name + "-static",
                           "DUCTILE_LAST_CALL": "0.2"})
    check(s.wait_exit(90) == 0, "static form: exit %s\n%s" % (s.proc.returncode, s.log()))
    check_world(job, 2)
    for flag in ("--node-rank", "--master-addr", "--master-port"):
        check(len(re.findall(re.escape(flag) + " is ignored", s.log())) == 1,
              "%s noted once: %s" % (flag, s.log()))


def case_torchrun_pet(job):
    """A PyTorchJob's PET_* variables drive agents given no flags at all."""
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_RDZV_ENDPOINT": host_port(ETCD),
           "PET_RDZV_ID": job.name, "PET_RDZV_BACKEND": "c10d", "PET_MAX_RESTARTS": "2",
           "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456",
           "PET_NODE_RANK": "0", "PET_RDZV_CONF": "last_call_timeout=0.5,read_timeout=60",
           "PYTHONPATH": os.path.dirname(TRAIN), "TEST_ARGV": '["--lr", "0.1"]'}
    a = job.start_raw("pod-0", [TRAIN, "--lr", "0.1"], env=pet)
    # The second pod: -m from PET_MODULE, and DUCTILE_* over PET_* (one worker).
    b = job.start_raw("pod-1", ["torchrun_train", "--lr", "0.1"],
                      env=dict(pet, PET_MODULE="1", DUCTILE_NPROC_PER_NODE="1",
                               PET_NODE_RANK="1"))
    for n in (a, b):
        check(n.wait_exit(90) == 0, "%s exit %s\n%s" % (n.node, n.proc.returncode, n.log()))
    recs = train_records(job)
    check(sorted(r for r, _ in recs) == [0, 1, 2], "world of 3 (2 + 1): %s" % sorted(recs))
    for v in recs.values():
        check(v["WORLD_SIZE"] == "3" and v["TORCHELASTIC_MAX_RESTARTS"] == "2",
              "PET_* read: %r" % v)
        check(v["MASTER_ADDR"] == "127.0.0.1", "MASTER_ADDR from the rendezvous: %r" % v)
    by_module = [v for v in recs.values() if v["LOCAL_WORLD_SIZE"] == "1"]
    check(len(by_module) == 1 and by_module[0]["argv"][0].endswith("torchrun_train.py"),
          "-m ran the module: %r" % by_module)
    check("PET_MASTER_ADDR is ignored" in a.log() and "read_timeout ignored" in a.log(),
          "notes: %s" % a.log())


def torchrun_files(base):
    """{relative path: text} of every file under base."""
    out = {}
    for root, _, names in os.walk(base):
        for n in names:
            p = os.path.join(root, n)
            with open(p) as f:
                out[os.path.relpath(p, base)] = f.read()
    return out


def case_torchrun_logs(job):
    logs = os.path.join(job.dir, "logs")
    # Local rank 0: stderr to its file only; local rank 1: both streams to the
    # files and the console.
    a = job.start_raw("node-a", ["--rdzv-endpoint", ETCD, "--rdzv-id", job.name,
                                 "--nproc-per-node", "2", "--log-dir", logs, "-r", "0:2",
                                 "--tee=1:3", "--last-call", "0.2", TRAIN])
    check(a.wait_exit(90) == 0, "exit %s\n%s" % (a.proc.returncode, a.log()))
    runs = os.listdir(logs)
    check(len(runs) == 1 and re.fullmatch(re.escape(job.name) + r"_\w{6}", runs[0]),
          "one run directory JOB_XXXXXX: %r" % runs)
    files = torchrun_files(os.path.join(logs, runs[0]))
    check(sorted(files) == ["attempt_0/0/stderr.log", "attempt_0/1/stderr.log",
                            "attempt_0/1/stdout.log"], "files: %r" % sorted(files))
    check(files["attempt_0/0/stderr.log"] == "stderr of rank 0\n", "0/stderr.log: %r" % files)
    check(files["attempt_0/1/stdout.log"] == "stdout of rank 1\n", "1/stdout.log: %r" % files)
    check(files["attempt_0/1/stderr.log"] == "stderr of rank 1\n", "1/stderr.log: %r" % files)
    out, err = a.out(), a.log()
    check("[0] stdout of rank 0" in out and "[1] stdout of rank 1" in out, "stdout: %r" % out)
    check("stderr of rank 0" not in err and "[1] stderr of rank 1" in err, "stderr: %r" % err)
    recs = train_records(job)
    check(recs[(0, "0")]["TORCHELASTIC_ERROR_FILE"] ==
          os.path.join(logs, runs[0], "attempt_0", "0", "error.json"), "error file: %r" % recs)
    # --local-ranks-filter: the console shows rank 1 only; the files keep both.
    logs2 = os.path.join(job.dir, "logs2")
    b = job.start_raw("node-b", ["--rdzv-endpoint", ETCD, "--rdzv-id", job.name + "-f",
                                 "--nproc_per_node=2", "--log_dir=" + logs2, "--tee", "3",
                                 "--local-ranks-filter", "1", "--last-call", "0.2", TRAIN])
    check(b.wait_exit(90) == 0, "exit %s\n%s" % (b.proc.returncode, b.log()))
    files = torchrun_files(logs2)
    check(len(files) == 4 and all(t.endswith("of rank %s\n" % p.split(os.sep)[-2])
                                  for p, t in files.items()), "files: %r" % files)
    out, err = b.out(), b.log()
    check("of rank 0" not in out + err and "[1] stdout of rank 1" in out and
          "[1] stderr of rank 1" in err, "console: %r %r" % (out, err))


def case_torchrun_error_file(job):
    """torch's @record error file: its message ends the failure line."""
    tmp = os.path.join(job.dir, "tmp")
    os.mkdir(tmp)
    a = job.start_raw("node-a", ["--rdzv-endpoint", ETCD, "--rdzv-id", job.name,
                                 "--nproc-per-node", "2", "--last-call", "0.2", TRAIN],
                      env={"TEST_FAIL": "error", "TMPDIR": tmp})
    code = a.wait_exit(90)
    check(code == 3, "the job failed: exit %d\n%s" % (code, a.log()))
    lines = [l for l in a.log().splitlines() if "exiting with code 3" in l]
    check(len(lines) == 1 and
          "worker rank 1 exited with code 1: RuntimeError: rank 1 gave up" in lines[0],
          "the failure line: %r" % lines)
    check("second line" not in a.log(), "only the message's first line")
    check(os.listdir(tmp) == [], "the private error-file directory removed: %r" % os.listdir(tmp))
