"""ductile.torch: a PyTorch DDP script that survives membership changes in place.

Under `ductile-agent --rebuild inplace` the processes of a script that uses
this helper live through every membership change: when the agent announces
a new round on the control channel (ductile.control), the helper ends the
step at its boundary (or catches the collective that failed because a peer
died), destroys the process group, builds the new round's group (gloo on
CPU, NCCL on GPU) at the address the agent gives, sends the most advanced
state (model, optimizer, sampler position, the user's fields) to every
rank, newcomers included, re-wraps DDP and calls the training function
again. The one idea that makes it exact: the state changes only in
`State.commit()`, which ends a step locally before any collective of the
next, so a collective that fails leaves every process with the consistent
state of some step, and the newest one wins; a one-integer vote at each
commit makes every rank end a round at the same step.

    state = ductile.torch.State(model=model, optimizer=opt,
                                sampler=ductile.torch.ElasticSampler(len(data), 32))

    def train(state):
        while state.sampler.epoch < EPOCHS:
            for idx in state.sampler:          # this rank's share of the next step
                loss = loss_fn(state.ddp(x[idx]), y[idx])
                opt.zero_grad(); loss.backward(); opt.step()
                state.commit(loss=loss.item())  # the step boundary

    ductile.torch.run(train, state)

Under `--rebuild restart` the same script is restarted instead (a lost peer
exits with status 75 at once, not counted as a failure); outside the agent
it runs as a plain script with one process group.
"""
import copy
import datetime
import gc
import inspect
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from . import control

__all__ = ["State", "ElasticSampler", "run"]

# How long a rebuild waits for the round's other ranks (a newcomer may be
# importing torch on a busy machine). A round that ends meanwhile ends the wait.
REBUILD_TIMEOUT_S = 300.0


def _say(msg):
    sys.stderr.write("ductile.torch: %s\n" % msg)
    sys.stderr.flush()


class _RoundEnded(BaseException):
    """The agent ended the round: rebuild (BaseException: a script's own
    `except Exception` does not swallow it)."""


class _Stop(BaseException):
    """The agent is shutting down: end at this boundary."""


class ElasticSampler:
    """Which samples each rank trains, exactly once per epoch, whatever the world size does.

    Each epoch is a seeded permutation of range(length) (or the identity
    without shuffle); the position is a global counter into it. A step
    takes the next world_size * batch_size samples (fewer at the end of an
    epoch) and rank r trains its contiguous share of them. The position
    only moves at State.commit(), so after a rebuild the new world goes on
    from the newest committed position: no sample is skipped or trained
    twice. The last step of an epoch may give a rank fewer samples than
    batch_size, and none when fewer samples are left than ranks: use a loss
    that is fine with that (the examples sum and divide by the batch size).
    """

    def __init__(self, length, batch_size, shuffle=True, seed=0):
        if length < 1 or batch_size < 1:
            raise ValueError("ElasticSampler needs length >= 1 and batch_size >= 1")
        self.length, self.batch_size, self.shuffle, self.seed = length, batch_size, shuffle, seed
        self.epoch, self.pos = 0, 0
        self.rank, self.world_size = 0, 1
        self._perm_epoch, self._perm = None, None
        self._pending = 0

    def _permutation(self):
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(self.length, generator=g)
            else:
                self._perm = torch.arange(self.length)
            self._perm_epoch = self.epoch
        return self._perm

    def _step_size(self):
        return min(self.world_size * self.batch_size, self.length - self.pos)

    def indices(self):
        """This rank's indices of the next step (a LongTensor)."""
        gb = self._step_size()
        lo = self.pos + gb * self.rank // self.world_size
        hi = self.pos + gb * (self.rank + 1) // self.world_size
        return self._permutation()[lo:hi]

    def __iter__(self):
        """This rank's batches for the rest of the current epoch."""
        epoch = self.epoch
        while self.epoch == epoch and self.pos < self.length:
            pos = self.pos
            idx = self.indices()
            self._pending = len(idx)
            yield idx
            if self.epoch == epoch and self.pos == pos:
                raise RuntimeError("ductile.torch: call state.commit() once after every batch "
                                   "of the sampler")

    def __len__(self):
        left, w = self.length - self.pos, self.world_size * self.batch_size
        return (left + w - 1) // w

    def _advance(self):
        n, self._pending = self._pending, 0
        self.pos += self._step_size()
        if self.pos >= self.length:
            self.epoch, self.pos = self.epoch + 1, 0
        return n

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos, "length": self.length,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, d):
        if (d["length"], d["shuffle"], d["seed"]) != (self.length, self.shuffle, self.seed):
            raise ValueError("ductile.torch: the sampler's state is for another data set or "
                             "seed (length %d, seed %d; this one %d, %d)" %
                             (d["length"], d["seed"], self.length, self.seed))
        self.epoch, self.pos, self.batch_size = d["epoch"], d["pos"], d["batch_size"]


def _cpu(o):
    """o with every tensor in it on the CPU (pickled state must not name a device)."""
    if torch.is_tensor(o):
        return o.detach().cpu()
    if isinstance(o, dict):
        return {k: _cpu(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(_cpu(v) for v in o)
    return o


class State:
    """What survives a rebuild: the model, its optimizer, an ElasticSampler
    and any fields given as keywords (State(..., best_loss=9.9) is then
    state.best_loss). The helper sets, for each round: ddp (the model
    wrapped for this round's group), rank, world_size, local_rank and
    round; step counts the committed steps of the whole run; stopped is
    True when run() returned because the agent stopped the worker.
    commit() ends a step; restore() goes back to the last one."""

    def __init__(self, model, optimizer=None, sampler=None, ddp_kwargs=None, **extra):
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self._extra = list(extra)
        for k, v in extra.items():
            setattr(self, k, v)
        self.step = 0          # committed steps
        self.samples = 0       # samples this process trained, its own share
        self.ddp = None
        self.rank, self.world_size, self.local_rank, self.round = 0, 1, 0, -1
        self.stopped = False
        self._has_state = False  # trained or loaded: a newcomer's is not
        self._state_round = -1   # the round this state was last agreed in
        self._ctx = None
        self._saved = None       # (buffers, fields) as of the last commit

    # ---- the step boundary ----

    def commit(self, loss=None, samples=None):
        """Ends a step: call it right after optimizer.step(), with no
        collective of your own after optimizer.step() and before it. The
        sampler's position moves on, the step is reported to the agent
        and, when the agent has ended the round, the helper rebuilds here."""
        n = samples
        if self.sampler is not None:
            taken = self.sampler._advance()
            n = taken if n is None else n
        self.step += 1
        self.samples += n or 0
        self._has_state = True
        self._snapshot()
        ctx = self._ctx
        if ctx is not None and ctx.ch is not None:
            if torch.is_tensor(loss):
                loss = float(loss.detach())
            ctx.ch.report_step(self.step, self.samples, loss)
            ctx.ch.set_phase("compute")
            ctx.boundary(vote=True)

    def _snapshot(self):
        live = list(self.model.buffers())
        kept = self._saved[0] if self._saved is not None else None
        with torch.no_grad():
            # Copied into last commit's tensors when the buffers still match
            # them (every step but the first): no allocation per step.
            if kept is not None and len(kept) == len(live) and all(
                    k.shape == b.shape and k.dtype == b.dtype and k.device == b.device
                    for k, b in zip(kept, live)):
                for k, b in zip(kept, live):
                    k.copy_(b)
                buffers = kept
            else:
                buffers = [b.detach().clone() for b in live]
        self._saved = (buffers, copy.deepcopy({k: getattr(self, k) for k in self._extra}))

    def restore(self):
        """Back to the last commit: the model's buffers (a failed step's
        forward changed BatchNorm's running statistics) and your fields.
        Parameters, optimizer and sampler change only in optimizer.step()
        and commit(), so a step that failed before them left them as they
        were. The helper calls it before every rebuild; a commit copies the
        buffers and the fields for it (keep the fields small)."""
        if self._saved is None:
            return
        buffers, fields = self._saved
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), buffers):
                b.copy_(saved)
        for k, v in copy.deepcopy(fields).items():
            setattr(self, k, v)

    # ---- checkpoints (a whole job's restart; in place needs none) ----

    def _payload(self):
        return {"step": self.step,
                "optimizer": _cpu(self.optimizer.state_dict()) if self.optimizer else None,
                "sampler": self.sampler.state_dict() if self.sampler else None,
                "extra": {k: getattr(self, k) for k in self._extra}}

    def _take(self, p):
        self.step = p["step"]
        if self.optimizer is not None and p["optimizer"] is not None:
            self.optimizer.load_state_dict(p["optimizer"])
        if self.sampler is not None and p["sampler"] is not None:
            self.sampler.load_state_dict(p["sampler"])
        for k, v in p["extra"].items():
            setattr(self, k, v)

    def save(self, path):
        """Writes the state to path atomically (temporary file, fsync, rename)."""
        tmp = "%s.tmp.%d" % (path, os.getpid())
        with open(tmp, "wb") as f:
            torch.save({"model": _cpu(self.model.state_dict()), "state": self._payload()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path):
        """Reads a state save() wrote; False when path does not exist. A
        loaded state takes part in the agreement like a trained one."""
        if not os.path.exists(path):
            return False
        ck = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(ck["model"])
        self._take(ck["state"])
        self._has_state = True
        return True

    # ---- a round ----

    def _sync(self, rnd, device):
        """The agreement: every rank gives (has state, round of it, step);
        the newest (lowest rank on ties) sends model, optimizer, sampler
        position and fields to all. Returns (source rank, its step)."""
        key = torch.tensor([int(self._has_state), self._state_round, self.step],
                           dtype=torch.int64, device=device)
        keys = [torch.zeros_like(key) for _ in range(rnd.world_size)]
        dist.all_gather(keys, key)
        keys = [tuple(int(v) for v in k.tolist()) for k in keys]
        src = max(range(rnd.world_size), key=lambda r: (keys[r], -r))
        with torch.no_grad():
            for t in self.model.state_dict().values():
                dist.broadcast(t, src)
        box = [self._payload() if rnd.rank == src else None]
        dist.broadcast_object_list(box, src, device=device)
        if rnd.rank != src:
            self._take(box[0])
        self._has_state, self._state_round = True, rnd.number
        self._snapshot()
        return src, keys[src][2]

    def _place(self, rnd):
        self.rank, self.world_size = rnd.rank, rnd.world_size
        self.local_rank, self.round = rnd.local_rank, rnd.number
        if self.sampler is not None:
            self.sampler.rank, self.sampler.world_size = rnd.rank, rnd.world_size


class _Ctx:
    """One run's link to the agent: the channel, the round and its group."""

    def __init__(self, ch, backend, timeout):
        self.ch, self.backend, self.timeout = ch, backend, timeout
        self.rnd = None
        self.store = None
        self.device = None  # the vote's, once the round's group stands
        self.vote = None    # (work, tensor): the vote sent at the last commit

    def boundary(self, vote=False):
        """Ends the round here when the agent said so. With vote (at a
        commit, once the group stands) every rank ends at the same step:
        each says whether it heard of the end (an abort, a newer round,
        stop), and the group's maximum decides, so no rank goes on into a
        step its peers have left. The vote is sent at one commit and read
        at the next (it runs beside the step's compute, not after it): a
        round ends one step after the first rank heard, on every rank."""
        ch = self.ch
        stop = ch.stopping  # `stop`, or SIGTERM (run's handler)
        heard = int(stop or (self.rnd is not None and ch.ended(self.rnd.number) is not None))
        if not vote or self.device is None:
            if stop:
                raise _Stop()
            if heard:
                raise _RoundEnded()
            return
        decided = 0
        if self.vote is not None:
            work, t = self.vote
            self.vote = None
            work.wait()
            decided = int(t.item())
        if decided:
            if stop:
                raise _Stop()
            raise _RoundEnded()
        t = torch.tensor([heard], dtype=torch.int32, device=self.device)
        self.vote = (dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), t)

    def drop_vote(self, finished):
        """The vote in flight at the round's end: waited for when training
        finished (every rank sent it), dropped after a failure (its group
        is destroyed next)."""
        v, self.vote = self.vote, None
        if v is not None and finished:
            v[0].wait()

    def on_abort(self, number, graceful):
        # NCCL collectives do not fail when a peer dies: abort them now
        # (gloo's fail by themselves when the peer's connections close).
        if (not graceful and self.backend == "nccl" and self.rnd is not None
                and self.rnd.number == number and dist.is_initialized()):
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as e:  # noqa: BLE001 - best effort: the timeout still ends it
                _say("cannot abort the NCCL group of round %d: %s" % (number, control.one_line(e)))


def _device(backend):
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _connect(ctx, rnd):
    """Round rnd's store (its rank 0 serves it at the agent's MASTER_ADDR:PORT),
    once every rank has come; raises _RoundEnded when the round ends first."""
    deadline = time.monotonic() + REBUILD_TIMEOUT_S
    short = datetime.timedelta(seconds=2)
    while True:
        ctx.boundary()
        try:
            store = dist.TCPStore(rnd.master_addr, rnd.master_port, rnd.world_size,
                                  rnd.rank == 0, timeout=short, wait_for_workers=False)
            break
        except (RuntimeError, dist.DistError) as e:
            if time.monotonic() > deadline:
                raise dist.DistNetworkError("round %d: no store at %s:%d within %.0f s: %s" % (
                    rnd.number, rnd.master_addr, rnd.master_port, REBUILD_TIMEOUT_S,
                    control.one_line(e)))
    store.set_timeout(ctx.timeout)
    store.set("ductile/in/%d" % rnd.rank, "1")
    keys = ["ductile/in/%d" % r for r in range(rnd.world_size)]
    while not store.check(keys):
        ctx.boundary()
        if time.monotonic() > deadline:
            raise dist.DistStoreError("round %d: not every rank came within %.0f s" %
                                      (rnd.number, REBUILD_TIMEOUT_S))
        time.sleep(0.01)
    return store


def _wrap(state, ctx):
    kw = dict(state.ddp_kwargs)
    if "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kw.setdefault("init_sync", False)  # _sync sent the state already
    if ctx.backend == "nccl":
        kw.setdefault("device_ids", [torch.cuda.current_device()])
    state.ddp = DistributedDataParallel(state.model, **kw)
    ch = ctx.ch

    def hook(group, bucket):  # waiting on peers is not a hang (the agent's watchdog)
        if ch is not None:
            ch.set_phase("comm")
        return default_hooks.allreduce_hook(group, bucket)
    state.ddp.register_comm_hook(None, hook)


def _build(state, ctx, rnd):
    t0 = time.monotonic()
    ctx.rnd = rnd
    ctx.store = _connect(ctx, rnd)
    kw = {}
    if ctx.backend == "nccl":
        kw["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(ctx.backend, store=dist.PrefixStore("pg/", ctx.store),
                            rank=rnd.rank, world_size=rnd.world_size, timeout=ctx.timeout, **kw)
    state._place(rnd)
    ctx.device = _device(ctx.backend)
    src, step = state._sync(rnd, ctx.device)
    _wrap(state, ctx)
    _say("round %d: rank %d of %d, state of step %d from rank %d (%.2f s)" %
         (rnd.number, rnd.rank, rnd.world_size, step, src, time.monotonic() - t0))


def _teardown(state, ctx, finished=False):
    ctx.drop_vote(finished)
    state.ddp = None
    ctx.device = None
    if dist.is_initialized():
        dist.destroy_process_group()
    ctx.store = None
    gc.collect()  # the old DDP's hooks and the old store's socket go now


def _peer_loss(e, ctx):
    """A failure that came from a peer (not counted), not from this process."""
    if ctx.ch is not None and ctx.rnd is not None and ctx.ch.ended(ctx.rnd.number):
        return True
    if isinstance(e, dist.DistError):
        return True
    return "gloo" in str(e)  # gloo's errors name their source file


def _plain(fn, state, backend, timeout):
    """Outside the agent: one group for the whole run (torchrun's env:// when
    its variables are there, else a world of one)."""
    _say("no control channel (%s is not set: not started by ductile-agent): one process group "
         "for the whole run, no in-place rebuild" % control.ENV_FD)
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        rnd = control.Round.from_env()
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        rnd = control.Round(0, 0, 1, 0, 0, 1, 0, "127.0.0.1", 0, "")
    ctx = _Ctx(None, backend, timeout)
    ctx.rnd = rnd
    state._ctx = ctx
    state._place(rnd)
    state._sync(rnd, _device(backend))
    _wrap(state, ctx)
    try:
        return fn(state)
    finally:
        _teardown(state, ctx)
        state._ctx = None


def _next_round(ctx, after):
    """Waits for a round newer than `after`; None when the agent stops this
    worker or goes away. Bounded by the agent: its join timeout ends it
    (it stops the worker), and its exit closes the channel."""
    ch = ctx.ch
    while True:
        if ch.wait(lambda: ch.stopping or (ch.round is not None and ch.round.number > after),
                   60.0):
            return None if ch.stopping else ch.round
        if ch.closed:
            return None


def run(fn, state, backend=None, timeout=30.0):
    """Runs fn(state) until it returns, rebuilding in place when the job's
    membership changes; returns what fn returned, or None when the agent
    stopped the worker (state.stopped is then True; save there if you
    keep checkpoints). fn is called again after each rebuild, with the
    agreed state: write it to go on from state.sampler (and state.step).

    backend: "gloo" or "nccl" (default: nccl when the model is on a GPU).
    timeout: seconds a collective waits for a silent peer (one that died
    closes its connections and fails it at once)."""
    if backend is None:
        on_gpu = any(p.is_cuda for p in state.model.parameters())
        backend = "nccl" if on_gpu else "gloo"
    td = datetime.timedelta(seconds=timeout)
    try:
        ch = control.Channel.from_env()
    except control.ProtocolError as e:
        sys.exit("ductile.torch: %s" % e)
    if ch is None:
        return _plain(fn, state, backend, td)
    try:
        mode = ch.hello(inplace=True)
        rnd = control.Round.from_env() if mode == "restart" else None
    except control.ProtocolError as e:
        ch.failed(str(e))
        sys.exit("ductile.torch: %s" % e)
    ctx = _Ctx(ch, backend, td)
    state._ctx = ctx
    ch.on_abort = ctx.on_abort
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        def on_term(signum, frame):
            ch.request_stop()
        signal.signal(signal.SIGTERM, on_term)
    if rnd is None:
        ch.set_phase("rebuild")
        rnd = _next_round(ctx, -1)
    try:
        while rnd is not None:
            try:
                ch.set_phase("rebuild")
                _build(state, ctx, rnd)
                ch.set_phase("compute")
                ctx.boundary()
                result = fn(state)
                _teardown(state, ctx, finished=True)
                return result
            except _Stop:
                break
            except _RoundEnded:
                pass
            except Exception as e:  # noqa: BLE001 - sorted below: a peer's or ours
                why = control.one_line("%s: %s" % (type(e).__name__, e))
                if not _peer_loss(e, ctx):
                    ch.failed(why)
                    raise
                ch.peer_lost(rnd.number, why)
                _say("round %d: a peer is gone (%s)" % (rnd.number, why[:200]))
            _teardown(state, ctx)
            state.restore()
            if mode == "restart":  # the agent restarts every worker: a lost peer, not counted
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(control.EXIT_PEER_LOST)
            ch.set_phase("rebuild")
            rnd = _next_round(ctx, rnd.number)
        state.stopped = True
        _teardown(state, ctx)
        return None
    finally:
        state._ctx = None
        ch.close()
