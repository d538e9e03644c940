"""DDP whose gradient sum does not depend on DDP's bucket layout.

Why: a fresh ``DistributedDataParallel`` reduces its first iteration with the
initial bucket layout and later ones with a layout rebuilt from the gradient
ready order. Gloo's ring allreduce adds the ranks' values in an order that
depends on an element's offset in the buffer, so the same gradients summed
under two layouts differ in the last bits. A worker that re-wraps its model
after a recovery would then drift from an uninterrupted run.

How: one bucket (``bucket_cap_mb`` huge) and a comm hook that packs every
gradient into a flat buffer in a fixed canonical order (the order of
``module.parameters()``), allreduces that, and unpacks. The reduction order per
element is then the same in every generation, so recovered runs are bitwise
equal to uninterrupted ones. Cost: no overlap of communication with backward
(one bucket) and two memory copies of the gradients per step.

An elastic job (``exact``) goes further: its gradient mean must not depend on the world size
either, so each shard's gradient is kept apart and summed in shard order
(:mod:`nonstop.train.exactsum`); see :meth:`CanonicalGradSync.accumulate`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # type: ignore[attr-defined]
from torch.nn.parallel import DistributedDataParallel

from nonstop.train.exactsum import exact_mean
from nonstop.train.liveness import CollectiveWatch

__all__ = ["CanonicalGradSync", "foreign_allreduce_pending", "register_canonical_hook", "wrap_ddp"]

_ONE_BUCKET_MB = float(1 << 20)


class CanonicalGradSync:
    """Holds the flat buffer and the parameter offsets; reused across re-wraps."""

    def __init__(self, module: torch.nn.Module) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        self._params = params
        self.offsets: dict[int, tuple[int, int]] = {}
        total = 0
        for p in params:
            self.offsets[p.data_ptr()] = (total, p.numel())
            total += p.numel()
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"deterministic gradient sync needs one parameter dtype, got {dtypes}")
        # on the gradients' device (a GPU's: NCCL reduces it in place; never a host round trip)
        device = params[0].device if params else torch.device("cpu")
        self.flat = torch.empty(total, dtype=params[0].dtype if params else torch.float32, device=device)
        self.pending_since: float | None = None  # read by the heartbeat thread
        # when the gradient allreduce last returned (monotonic; read by the heartbeat thread: a
        # rank's "idle" -- out of any collective without a step -- runs from the later of this
        # and its last step, so a wait for a slow peer is not counted as its own stall)
        self.left_at: float | None = None
        # issue 20: device events around each allreduce (an NCCL one returns at enqueue; the
        # heartbeat polls them: train/liveness.py). Records nothing on the CPU.
        self.watch = CollectiveWatch()
        # issue 21 (fail-slow detection): seconds the gradient allreduces waited since the last
        # take_wait_s() -- the step's time in collectives; its step report subtracts it from
        # step_s to get the rank's own compute time. Written on the thread that completes the
        # allreduce (gloo's), read by the training thread: a float assigned whole, and the step
        # reads it only after the step's allreduce completed.
        self.wait_s = 0.0
        # the gradient sum is divided by this: the data shards of the full-size job (elastic);
        # None: the world size
        self.divisor: int | None = None
        # elastic: the mean is bitwise independent of the world size (exactsum); then the shards
        # this rank plays in the generation, one row of ``_parts`` each
        self.exact = False
        self.shards: tuple[int, ...] = ()
        self._parts: torch.Tensor | None = None

    def take_wait_s(self) -> float:
        """Seconds spent in the gradient allreduce since the last call (and reset to 0)."""
        out, self.wait_s = self.wait_s, 0.0
        return out

    def in_collective(self) -> bool:
        """True while this sync's gradient reduction is in flight (read by the heartbeat thread):
        issued and not returned to the host (``pending_since``), or on a device, its completion
        event not reached while this rank's own inputs to it are (:mod:`nonstop.train.liveness`)."""
        return self.pending_since is not None or self.watch.pending()

    def _returned(self, started: float) -> None:
        """The gradient allreduce issued at ``started`` returned to the host: no longer pending,
        when it left (``left_at``), and its wait added to the step's (issue 21)."""
        self.pending_since = None
        self.left_at = now = time.monotonic()
        self.wait_s += now - started

    def set_shards(self, shards: tuple[int, ...], num_shards: int) -> None:
        """The generation's data shards: this rank's and the job's count (the divisor)."""
        self.shards, self.divisor = tuple(shards), num_shards

    def accumulate(self, ddp: DistributedDataParallel) -> Iterator[int]:
        """``Session.shard_steps`` of an exact job: yield each shard with DDP's reducer off, keep
        its gradient apart (its row of the parts, the parameters' ``.grad`` zeroed), and after the
        last one set ``.grad`` to the exact mean over every shard of the job."""
        for i, shard in enumerate(self.shards):
            with ddp.no_sync():
                yield shard
            self._stash(i)
        self._finish(ddp.process_group)

    def _rows(self) -> torch.Tensor:
        n = len(self.shards)
        if self._parts is None or self._parts.shape[0] != n:
            self._parts = torch.zeros((n, self.flat.numel()), dtype=self.flat.dtype, device=self.flat.device)
        return self._parts

    def _pack(self, dst: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Gradients into the flat ``dst``, each at its parameter's canonical offset."""
        for p, g in zip(params, grads, strict=True):
            a, n = self.offsets[p.data_ptr()]
            dst[a : a + n].copy_(g.reshape(-1))

    def _unpack(
        self, src: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> None:
        """The flat ``src`` back into the gradients."""
        for p, g in zip(params, grads, strict=True):
            a, n = self.offsets[p.data_ptr()]
            g.copy_(src[a : a + n].view_as(g))

    def _grads(self) -> list[torch.Tensor]:
        """Every parameter's ``.grad``, a zero one made for a parameter this shard did not use."""
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self._params if p.grad is not None]

    def _stash(self, i: int) -> None:
        grads = self._grads()
        self._pack(self._rows()[i], self._params, grads)
        for g in grads:
            g.zero_()

    def _finish(self, group: dist.ProcessGroup) -> None:
        self._unpack(self._mean(self._rows(), group), self._params, self._grads())

    def _mean(self, parts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        self.watch.before(parts.device)  # liveness: this rank's inputs are ready from here
        self.pending_since = started = time.monotonic()
        try:
            mean = exact_mean(parts, shards=self.shards, num_shards=self.divisor or group.size(), group=group)
            self.watch.after(parts.device)  # ordered after its collectives (they were waited on)
            return mean
        finally:
            self._returned(started)

    def hook(
        self, process_group: dist.ProcessGroup
    ) -> Callable[[object, GradBucket], torch.futures.Future[torch.Tensor]]:
        world = process_group.size()
        self.watch.clear()  # a new wrapper: a new generation's group (an aborted one's events go)

        def _hook(_state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            grads, params = bucket.gradients(), bucket.parameters()
            if len(params) != len(self.offsets):
                raise RuntimeError(
                    "nonstop: gradient bucket does not hold every parameter; "
                    "deterministic sync needs a single bucket"
                )
            if grads and grads[0].device != self.flat.device:  # follows the gradients' device
                self.flat = torch.empty_like(self.flat, device=grads[0].device)
                self._parts = None
            flat = self.flat
            self._pack(flat, params, grads)
            if self.exact:
                return self._exact_hook(process_group, bucket, flat)
            flat.div_(self.divisor or world)
            self.watch.before(flat.device)  # liveness: this rank's part is queued before here
            self.pending_since = started = time.monotonic()
            fut = dist.all_reduce(flat, group=process_group, async_op=True).get_future()

            def _unpack(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
                self._returned(started)
                f.value()  # re-raise a communication error here
                self._unpack(flat, params, grads)
                # liveness: a CUDA future runs this on a stream made to wait for the allreduce,
                # so this event is reached once the allreduce and the unpack are done
                self.watch.after(flat.device)
                out: torch.Tensor = bucket.buffer()
                return out

            chained: torch.futures.Future[torch.Tensor] = fut.then(_unpack)
            return chained

        # DDP checks these annotations at registration; keep them real objects, not strings.
        _hook.__annotations__ = {"bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}
        return _hook

    def _exact_hook(
        self, group: dist.ProcessGroup, bucket: GradBucket, flat: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """An exact job's backward outside ``shard_steps``: this rank's one shard, by exactsum."""
        if len(self.shards) != 1:
            raise RuntimeError(
                f"nonstop: this rank plays shards {list(self.shards)} in this generation (the job "
                "shrank): read each shard's batch through session.shard_steps(model)"
            )
        self._unpack(self._mean(flat.view(1, -1), group), bucket.parameters(), bucket.gradients())
        return _done(bucket.buffer())


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def wrap_ddp(
    module: torch.nn.Module,
    sync: CanonicalGradSync | None,
    process_group: dist.ProcessGroup,
    *,
    init_sync: bool = True,
    divisor: int | None = None,
) -> DistributedDataParallel:
    """Wrap ``module`` in DDP on ``process_group``; deterministic when ``sync`` is given.

    ``init_sync=False`` skips DDP's broadcast of rank 0's parameters: only for
    when every rank has just restored the same committed step. ``divisor``: what the
    gradient sum is divided by when it is not the world size (an elastic job shrunk below
    its shard count; with ``sync``, ``sync.divisor`` says it).
    """
    if sync is None:
        ddp = DistributedDataParallel(module, process_group=process_group, init_sync=init_sync)
        if divisor is not None and divisor != process_group.size():
            ddp.register_comm_hook(process_group, _sum_divided_by(divisor))
        return ddp
    ddp = DistributedDataParallel(
        module, process_group=process_group, bucket_cap_mb=_ONE_BUCKET_MB, init_sync=init_sync
    )
    ddp.register_comm_hook(None, sync.hook(process_group))
    return ddp


def register_canonical_hook(
    ddp: DistributedDataParallel, sync: CanonicalGradSync | None = None
) -> CanonicalGradSync:
    """Make a DDP wrapper someone else built (a framework's: Accelerate, Fabric) reduce its
    gradients in the canonical order, as :func:`wrap_ddp` does: call it after the wrapper is
    made and before its first forward. ``sync``: reuse one (its parameters must be
    ``ddp.module``'s); default a new one. Returns the sync.

    The wrapper must hold every gradient in one bucket, in its first iteration and after DDP
    rebuilds its buckets: build it with ``bucket_cap_mb`` at least the gradients' size (given
    explicitly: DDP's default also caps the first bucket at 1 MiB) and no ``bucket_cap_mb_list``.
    Raises ValueError, naming what to pass, when it cannot (the hook would fail in backward)."""
    sync = CanonicalGradSync(ddp.module) if sync is None else sync
    need = sync.flat.numel() * sync.flat.element_size()
    if getattr(ddp, "bucket_bytes_cap_list", None):
        raise ValueError("nonstop's canonical gradient sync needs one bucket: give DDP no bucket_cap_mb_list")
    # DDP's default bucket_cap_mb also caps the first bucket, at torch's _DEFAULT_FIRST_BUCKET_BYTES
    default_first = int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20))
    first_cap = default_first if ddp.bucket_bytes_cap_default else ddp.bucket_bytes_cap
    if need > min(first_cap, ddp.bucket_bytes_cap):
        mib = -(-need // (1 << 20))
        raise ValueError(
            f"nonstop's canonical gradient sync needs one bucket of {need} bytes: build DDP "
            f"with bucket_cap_mb={mib} or more (given explicitly)"
        )
    ddp.register_comm_hook(None, sync.hook(ddp.process_group))
    global _foreign
    _foreign = weakref.ref(sync)
    return sync


# The sync register_canonical_hook set up last: a framework's wrapper of this generation. A
# reference assigned whole (the heartbeat thread reads it): no container shared between threads.
_foreign: weakref.ref[CanonicalGradSync] | None = None


def foreign_allreduce_pending() -> bool:
    """True while the gradient allreduce of the wrapper given :func:`register_canonical_hook`
    last is in flight: the training thread is waiting on its peers (read by the heartbeat
    thread, :func:`~nonstop.train.collectives.in_collective`; a framework's DDP blocks there in
    C++, under autograd's Python frames, where the frame test cannot see it)."""
    ref = _foreign
    sync = ref() if ref is not None else None
    return sync is not None and sync.in_collective()


def _sum_divided_by(
    divisor: int,
) -> Callable[[dist.ProcessGroup, GradBucket], torch.futures.Future[torch.Tensor]]:
    """A comm hook: allreduce-sum each bucket, divided by ``divisor`` instead of the world size."""

    def _hook(group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer().div_(divisor)
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        out: torch.futures.Future[torch.Tensor] = fut.then(lambda f: f.value()[0])
        return out

    _hook.__annotations__ = {
        "group": dist.ProcessGroup,
        "bucket": GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return _hook
