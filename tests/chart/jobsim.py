"""The Job controller's part, played in Python for the rendered Indexed Job.

No cluster runs here, so the tests play what Kubernetes' Job controller
(pkg/controller/job) does with the Job the chart renders, reading every
number and rule from the rendered object, never from a copy in the test:

- pod_failure_action(): the podFailurePolicy rule a failed pod matches
  (pod_failure_policy.go: rules in order, the first match wins; onExitCodes
  looks only at containers that exited non-zero; no match counts).
- IndexedJob: one pod per index 0..completions-1; a pod that exits 0
  completes its index; a failed pod is judged by the policy and its index
  recreated (same index, new pod name) unless the Job failed; counted
  failures past backoffLimit (or an index past backoffLimitPerIndex) fail
  the Job; parallelism and completions change together (Elastic Indexed
  Job), a scale-down deletes the pods of the highest indices and never
  counts how they end; the Job is Complete when every index has succeeded.

Knowingly simple: replacements start at once, where the controller waits
an exponential back-off (10 s, 20 s, ...); that is the harder case for the
agents (a replacement may meet the lease of the pod it replaces).
"""

import collections

Finished = collections.namedtuple("Finished", "index pod exit_code action")


def exit_code_of(returncode):
    """A process's end as the kubelet reports a container's: 128+N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _exit_codes_match(req, container, exit_code):
    if exit_code == 0:
        return False  # only containers that failed are matched
    if req.get("containerName") not in (None, container):
        return False
    if req["operator"] == "In":
        return exit_code in req["values"]
    if req["operator"] == "NotIn":
        return exit_code not in req["values"]
    raise ValueError(f"unknown operator {req['operator']}")


def pod_failure_action(job, exit_code, container="agent", conditions=()):
    """FailJob, FailIndex, Ignore or Count for a pod of `job` that failed
    with `exit_code` in `container` and has the True `conditions`."""
    policy = job["spec"].get("podFailurePolicy")
    for rule in (policy or {}).get("rules", []):
        if "onExitCodes" in rule:
            if _exit_codes_match(rule["onExitCodes"], container, exit_code):
                return rule["action"]
        else:
            for pattern in rule["onPodConditions"]:
                if pattern.get("status", "True") == "True" and pattern["type"] in conditions:
                    return rule["action"]
    return "Count"


class IndexedJob:
    """One rendered Indexed Job and its pods; start_pod(index) makes a pod
    handle with poll() (a returncode or None), delete() (graceful: SIGTERM),
    a conditions tuple and a name."""

    def __init__(self, job, start_pod):
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["parallelism"] == spec["completions"]
        self.job = job
        self.start_pod = start_pod
        self.completions = spec["completions"]
        self.backoff_limit = spec.get("backoffLimit", 6)
        self.per_index = spec.get("backoffLimitPerIndex")
        self.max_failed_indexes = spec.get("maxFailedIndexes")
        self.active = {}  # index -> pod
        self.removed = []  # pods of indices a scale-down removed, until they end
        self.succeeded = set()
        self.failed_indexes = set()
        self.index_failures = collections.Counter()
        self.failed = 0  # counted failures (.status.failed)
        self.finished = []  # Finished, in the order seen
        self.condition = None  # "Complete" or "Failed"
        self.reason = None
        self.created = collections.defaultdict(list)  # index -> every pod made for it
        self._create_missing()

    def _create_missing(self):
        for ix in range(self.completions):
            if ix in self.active or ix in self.succeeded or ix in self.failed_indexes:
                continue
            pod = self.start_pod(ix)
            self.active[ix] = pod
            self.created[ix].append(pod)

    def _fail(self, reason):
        self.condition, self.reason = "Failed", reason
        for pod in self.active.values():
            pod.delete()

    def scale(self, n):
        """`kubectl patch job --type=merge -p {"spec":{"parallelism":n,"completions":n}}`."""
        self.completions = n
        for ix in sorted(self.active):
            if ix >= n:
                pod = self.active.pop(ix)
                pod.delete()
                self.removed.append((ix, pod))
        self.succeeded = {ix for ix in self.succeeded if ix < n}

    def sync(self):
        """One pass of the controller: account for pods that ended, then
        finish the Job or create the pods it lacks."""
        for ix, pod in list(self.removed):
            if pod.poll() is not None:
                self.removed.remove((ix, pod))
                self.finished.append(Finished(ix, pod, exit_code_of(pod.poll()), "Removed"))
        for ix in sorted(self.active):
            pod = self.active[ix]
            if pod.poll() is None:
                continue
            del self.active[ix]
            code = exit_code_of(pod.poll())
            action = "Succeeded" if code == 0 else pod_failure_action(
                self.job, code, conditions=pod.conditions)
            self.finished.append(Finished(ix, pod, code, action))
            if action == "Succeeded":
                self.succeeded.add(ix)
            elif action == "Count":
                self.failed += 1
                self.index_failures[ix] += 1
                if self.per_index is not None and self.index_failures[ix] > self.per_index:
                    self.failed_indexes.add(ix)
            elif action == "FailIndex":
                self.failed_indexes.add(ix)
            elif action == "FailJob" and self.condition is None:
                self._fail("PodFailurePolicy")
        if self.condition is not None:
            return
        if self.failed > self.backoff_limit:
            self._fail("BackoffLimitExceeded")
        elif self.max_failed_indexes is not None and \
                len(self.failed_indexes) > self.max_failed_indexes:
            self._fail("MaxFailedIndexesExceeded")
        elif set(range(self.completions)) <= self.succeeded and not self.active \
                and not self.removed:
            self.condition = "Complete"
        else:
            self._create_missing()

    def done(self):
        """Finished and no pod of it is left running."""
        return self.condition is not None and not self.active and not self.removed
