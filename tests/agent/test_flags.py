"""test_flags.py: the agent's command line refused or listed.

Bad flags, DUCTILE_* and torchrun's PET_* values and DUCTILE_FAILPOINTS each
end the agent with exit 2 and one line; --help lists every flag, torchrun's
(torch 2.x's list) with its PET_* variable.
"""
from agentkit import ETCD, run_agent
from testlib import check



# torchrun's flags (torch 2.x `torchrun --help`).
TORCHRUN_FLAGS = [
    "nnodes", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf",
    "standalone", "max-restarts", "monitor-interval", "start-method", "event-log-handler",
    "role", "module", "no-python", "run-path", "log-dir", "redirects", "tee",
    "log-line-prefix-template", "local-ranks-filter", "duplicate-stdout-filters",
    "duplicate-stderr-filters", "node-rank", "master-addr", "master-port", "local-addr",
    "logs-specs", "numa-binding", "signals-to-handle", "shutdown-timeout", "virtual-local-rank",
    "print-completion"]


def case_bad_flags(job):
    bad = [
        ["--nnodes", "x"], ["--nnodes", "3:2"], ["--nnodes", "0"], ["--nnodes", "1:"],
        ["--nnodes", "2:x"], ["--nproc-per-node", "0"], ["--nproc-per-node", "2x"],
        ["--nproc-per-node", "99999999999999999999"], ["--nproc-per-node", "gpus"], ["--max-restarts", "-1"],
        ["--lease-ttl", "1"], ["--lease-ttl", "5.5"], ["--last-call", "abc"],
        ["--join-timeout", "-3"], ["--shutdown-timeout", "nan"], ["--rebuild", "sometimes"],
        ["--log-format", "xml"], ["--http-port", "70000"], ["--rdzv-id", "Bad_Id"],
        ["--node-id", "a b"], ["--standalone=maybe"], ["--no-such-flag", "1"], ["--nnodes"],
        ["--leave-exit-code", "256"], ["--leave-exit-code", "-1"],
        ["--hang-timeout", "0"], ["--hang-timeout", "-5"], ["--hang-timeout", "1e9"],
        ["--hang-timeout", "never"], ["--hang-timeout", "inf"], ["--hang-timeout", ""],
        # torchrun's flags are checked as torchrun checks them
        ["--rdzv-conf", "no_such_key=1"], ["--rdzv-conf", "timeout"],
        ["--rdzv-conf", "timeout=x"], ["--rdzv_conf=keep_alive_interval=5000"],
        ["--rdzv-backend", "zookeeper"], ["-r", "4"], ["--tee", "0:x"], ["-t"],
        ["--redirects", "0:1,"], ["--start-method", "thread"], ["--local-ranks-filter", "a"],
        ["--master-port", "70000"], ["--node-rank", "-1"], ["--numa-binding", "cpu"],
        ["--monitor-interval", "soon"], ["-m"], ["-x"], ["-mx"], ["--log-dir="],
        ["--preload", ""], ["--preload="], ["--preload", "1torch"], ["--preload", "torch,"],
        ["--preload", ",torch"], ["--preload", "torch..nn"], ["--preload", "torch.nn."],
        ["--preload", "torch numpy"], ["--preload", "torch;rm"], ["--preload", "x" * 300],
        ["--install-id", "a_b"], ["--install-id", "x" * 65], ["--install-id", "a b"],
        ["--install-id", "a/b"], ["--start-over=maybe"],
    ]
    base = ["--rdzv-endpoint", ETCD, "--rdzv-id", "j"]
    for flags in bad:
        r = run_agent(base + flags + ["--", "true"])
        check(r.returncode == 2, "%s: exit %d, want 2" % (flags, r.returncode))
        lines = r.stderr.strip().splitlines()
        check(len(lines) == 1 and lines[0].startswith("ductile-agent: "),
              "%s: want one error line, got %r" % (flags, r.stderr))
    # Missing pieces.
    for args in (["--rdzv-id", "j", "--", "true"], ["--rdzv-endpoint", ETCD, "--", "true"],
                 base):
        r = run_agent(args, env={"DUCTILE_RDZV_ENDPOINT": "", "DUCTILE_RDZV_ID": ""}
                      if False else None)
        check(r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1,
              "%s: exit %d %r" % (args, r.returncode, r.stderr))
    # The same checks apply to DUCTILE_* variables, and they name the variable.
    r = run_agent(base + ["--", "true"], env={"DUCTILE_NNODES": "two"})
    check(r.returncode == 2 and "DUCTILE_NNODES" in r.stderr, "env: %r" % r.stderr)
    # torchrun's PET_* too, and they name theirs.
    for var, val in (("PET_NNODES", "two"), ("PET_RDZV_CONF", "is_host=1,bogus=2"),
                     ("PET_TEE", "9")):
        r = run_agent(base + ["--", "true"], env={var: val})
        check(r.returncode == 2 and r.stderr.startswith("ductile-agent: " + var) and
              len(r.stderr.strip().splitlines()) == 1, "%s: %r" % (var, r.stderr))
    # An unknown --rdzv-conf key names the key and the known ones.
    r = run_agent(base + ["--rdzv-conf", "timeout=60,no_such_key=1", "x.py"])
    check("unknown key 'no_such_key'" in r.stderr and "join_timeout" in r.stderr,
          "rdzv-conf: %r" % r.stderr)
    # -m and --no-python together, or -m after --, are torchrun's errors too.
    for flags in (["-m", "--no-python", "mod"], ["--module", "--", "mod"]):
        r = run_agent(base + flags)
        check(r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1,
              "%s: exit %d %r" % (flags, r.returncode, r.stderr))
    r = run_agent(base + ["--", "true"], env={"DUCTILE_PRELOAD": "torch,,numpy"})
    check(r.returncode == 2 and "DUCTILE_PRELOAD" in r.stderr and len(r.stderr.splitlines()) == 1,
          "env: %r" % r.stderr)
    # --help lists every flag with its variable.
    r = run_agent(["--help"])
    check(r.returncode == 0, "--help exit %d" % r.returncode)
    for flag in ["nnodes", "nproc-per-node", "rdzv-endpoint", "rdzv-id", "max-restarts",
                 "node-id", "node-addr", "lease-ttl", "last-call", "join-timeout",
                 "shutdown-timeout", "rebuild", "standalone", "http-port", "log-format",
                 "leave-exit-code", "hang-timeout", "preload",
                 "etcd-cacert", "etcd-cert", "etcd-key", "etcd-user", "etcd-password"]:
        check("--" + flag in r.stdout, "--help lacks --" + flag)
        check("DUCTILE_" + flag.upper().replace("-", "_") in r.stdout, "--help lacks env of " + flag)
    # ... and every torchrun flag (torch 2.x's list) with its PET_* variable.
    for flag in TORCHRUN_FLAGS:
        check("--" + flag + " " in r.stdout or "--" + flag + "\n" in r.stdout,
              "--help lacks torchrun's --" + flag)
        check("PET_" + flag.upper().replace("-", "_") in r.stdout, "--help lacks PET_ of " + flag)
    for short in ("-m, --module", "-r, --redirects", "-t, --tee"):
        check(short in r.stdout, "--help lacks " + short)
    r = run_agent(["status", "--rdzv-id", "j"])
    check(r.returncode == 2, "status without endpoint: exit %d" % r.returncode)


def case_bad_failpoints(job):
    r = run_agent(["--rdzv-endpoint", ETCD or "http://127.0.0.1:1", "--rdzv-id", "x", "--", "true"],
                  env={"DUCTILE_FAILPOINTS": "etcd.api.txn=0:unavailable"})
    check(r.returncode == 2, "exit 2, got %d" % r.returncode)
    lines = r.stderr.strip().splitlines()
    check(len(lines) == 1 and "DUCTILE_FAILPOINTS" in lines[0], "one line: %r" % r.stderr)
