"""The NCCL settings nonstop gives worker processes on a CUDA node: the one place they are set.

nonstop recovers a failed rank with the survivors' processes kept, so a collective that fails
must fail *in the survivor* -- an exception the training loop hands to nonstop -- not kill it.
Values are for torch 2.13's ``ProcessGroupNCCL`` (``ProcessGroupNCCL.hpp``: ``ErrorHandlingMode``):

==================================  =====  ======================================================
variable                            value  why
==================================  =====  ======================================================
``TORCH_NCCL_ASYNC_ERROR_HANDLING``  ``2``  ``CleanUpOnly``: on a collective's error or timeout the
                                           watchdog aborts the communicators and fails the work,
                                           and does NOT tear the process down. torch's default is
                                           ``3`` (``SkipCleanUp``: tear the process down without
                                           aborting), ``1`` (``TearDown``) aborts then kills; both
                                           turn "survivors keep their processes" into a cold
                                           restart. ``0`` (``NoHandling``) would leave a timed-out
                                           collective hanging forever.
``TORCH_NCCL_BLOCKING_WAIT``         ``0``  ``wait()`` stays asynchronous: the timeout is the
                                           watchdog's (above), and the main thread can be
                                           interrupted by nonstop while a collective is queued.
``TORCH_NCCL_ENABLE_TIMING``         ``1``  A start event per collective, so NCCL's watchdog can
                                           tell a collective whose kernel *started* (the rank's own
                                           work is done: it waits on its peers) from one merely
                                           enqueued. Two CUDA events per collective.
``TORCH_FR_BUFFER_SIZE``          ``2000``  torch's flight recorder: a ring of the last 2,000
                                           collectives of every process group, whoever issued
                                           them (FSDP2, tensor parallel, DDP). The heartbeat reads
                                           the started ones (:mod:`nonstop.train.frwatch`), so the
                                           ranks waiting in FSDP2's or TP's collectives on a peer
                                           that stopped are not blamed with it. ~470 bytes per
                                           entry (measured); with a ring, torch may also write it
                                           to a file when the watchdog times out
                                           (``TORCH_NCCL_DUMP_ON_TIMEOUT``), a debugging aid.
==================================  =====  ======================================================

The collective timeout itself (the watchdog's) is the process group's ``timeout``, chosen by
:func:`nonstop.train.backend.collective_timeout_s` (``$NONSTOP_COLLECTIVE_TIMEOUT_S``, default
600 s), separate from the rebuild timeout (``--rebuild-timeout``: how long a generation's
rendezvous may take). The NCCL watchdog's own monitoring thread
(``TORCH_NCCL_ENABLE_MONITORING``, which kills a process whose watchdog is stuck inside a
hung CUDA/NCCL call) is left at torch's default: it is the last resort when an abort itself
hangs.

A value the user exported (in the launcher's environment or ``--env``) is never overridden.
Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from nonstop.errors import UsageError

__all__ = ["DEVICE_GROUPS", "INDEPENDENT", "NCCL_DEFAULTS", "SPLIT", "device_groups_mode", "nccl_env"]

# how a device node builds a sharded job's mesh groups (nonstop/train/devicegroups.py)
DEVICE_GROUPS = "NONSTOP_DEVICE_GROUPS"
INDEPENDENT, SPLIT = "independent", "split"

NCCL_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort communicators, keep the process
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "TORCH_NCCL_ENABLE_TIMING": "1",  # start events: "started" in the flight recorder
    "TORCH_FR_BUFFER_SIZE": "2000",  # the flight recorder the heartbeat reads (train/frwatch.py)
}
# other spellings torch still reads; a user who set one of them has chosen
_ALIASES = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT": "NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_ENABLE_TIMING": "NCCL_ENABLE_TIMING",
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
}


def nccl_env(device_type: str, user_env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to a worker's environment on a node whose devices are
    ``device_type`` (none unless ``cuda``), leaving out any the user set in ``user_env``
    (either spelling)."""
    if device_type != "cuda":
        return {}
    return {
        name: value
        for name, value in NCCL_DEFAULTS.items()
        if name not in user_env and _ALIASES[name] not in user_env
    }


def device_groups_mode(env: Mapping[str, str]) -> str:
    """``$NONSTOP_DEVICE_GROUPS`` in ``env``: :data:`INDEPENDENT` (unset or empty: the default) or
    :data:`SPLIT`, case and spaces ignored; anything else is a :class:`UsageError` naming the
    choices. The launcher checks it before anything starts; every worker reads it again."""
    value = env.get(DEVICE_GROUPS, INDEPENDENT).strip().lower() or INDEPENDENT
    if value not in (INDEPENDENT, SPLIT):
        raise UsageError(f"{DEVICE_GROUPS}={value!r}: must be {INDEPENDENT!r} (the default) or {SPLIT!r}")
    return value
