"""What a rank's state is, and how to put it back.

:class:`StateCapture` gathers the model, the optimizer, the RNGs (torch,
numpy, python) and the user's extras (data position and anything else) into
one nested structure for :class:`~nonstop.snapshot.store.RankSnapshotStore`,
and restores it.

Memory contract of :meth:`StateCapture.restore`: nothing restored aliases
snapshot memory (which the next snapshot overwrites). The model copies out
(``load_state_dict`` copies into parameters). The optimizer's existing state
tensors are overwritten in place when their layout matches (a survivor); else
(a fresh replacement) it is given clones, because ``Optimizer.load_state_dict``
keeps references to the tensors it receives.

Sharded models (FSDP2, TP): DTensor state is snapshotted as each rank's local shard
(:mod:`nonstop.snapshot.sharded`) and restored into the live DTensors' local tensors, checked to
be laid out alike; a fresh optimizer's state is made DTensors on its parameters' meshes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from nonstop.errors import SnapshotError
from nonstop.snapshot.device import device_rng_state, set_device_rng_state
from nonstop.snapshot.sharded import LocalShard, check_matches, copy_into, is_dtensor, local_of, to_dtensor

__all__ = ["StateCapture", "restore_resharded"]

Extras = dict[str, Any]


def _rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # its 625 words as an array (a tensor in the snapshot), not 7 KB of JSON every step
        "python": [py[0], np.asarray(py[1], dtype=np.uint32), py[2]],
        "numpy": [np_state[0], np_state[1], int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    dev = device_rng_state()  # the rank's accelerator device, when one is in use
    if dev is not None:
        out["device"] = dev
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].clone())
    v, internal, gauss = state["python"]  # internal: an array, or a list (snapshots before it)
    random.setstate((v, tuple(internal.tolist() if isinstance(internal, np.ndarray) else internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "device" in state:
        set_device_rng_state(state["device"])


class StateCapture:
    """Captures and restores everything that makes up a rank's training state.

    ``extras`` returns a JSON-like dict (tensors allowed) each time it is
    called, e.g. ``{"samples_seen": n}``; ``load_extras`` receives that dict
    back on restore. ``objects``: named objects with ``state_dict()`` /
    ``load_state_dict()`` (LR schedulers, ``GradScaler``, ``StatefulDataLoader``), each
    state dict captured with the rest and loaded back on restore; a snapshot without one of
    them (written by a script that did not have it) is a :class:`SnapshotError` naming it.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extras: Callable[[], Extras] | None = None,
        load_extras: Callable[[Extras], None] | None = None,
        objects: dict[str, Any] | None = None,
    ) -> None:
        if (extras is None) != (load_extras is None):
            raise ValueError("give both extras= and load_extras=, or neither")
        self.model = model
        self.optimizer = optimizer
        self._extras = extras
        self._load_extras = load_extras
        self.objects = dict(objects or {})

    def state(self, step: int) -> dict[str, Any]:
        """The state after ``step`` optimizer steps (tensors are not copied, nor changed: the
        model's come as its own parameters and buffers, ``keep_vars``, which spares a DTensor's
        ``detach`` dispatch per parameter every step; the snapshot detaches what it copies)."""
        return {
            "step": step,
            "model": self.model.state_dict(keep_vars=True),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "rng": _rng_state(),
            "extras": self._extras() if self._extras is not None else {},
            "objects": {name: obj.state_dict() for name, obj in self.objects.items()},
        }

    def head(self) -> dict[str, Any]:
        """What a step may change outside the tensors ``optimizer.step()`` and the model's forward
        write in place -- RNGs, extras, ``objects``, the optimizer's hyperparameters -- copied
        out now, at the start of a step (:mod:`nonstop.train.rescue` pairs it with the live
        tensors should the step fail before changing them)."""
        opt = self.optimizer  # its hyperparameters (a scheduler may set them in the step)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] if opt else None
        head: dict[str, Any] = _clone_tensors(
            {
                "rng": _rng_state(),
                "extras": self._extras() if self._extras is not None else {},
                "objects": {name: obj.state_dict() for name, obj in self.objects.items()},
                "param_groups": groups,
            }
        )
        return head

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state a step writes in place: the model's parameters and buffers,
        the optimizer's state (their ``_version`` counters say whether a step touched them)."""
        out = list(self.model.state_dict(keep_vars=True).values())
        if self.optimizer is not None:
            for held in self.optimizer.state.values():
                out += list(held.values())
        # a DTensor's writes land in its local tensor, whose counter moves
        return [local_of(t) if is_dtensor(t) else t for t in out if isinstance(t, torch.Tensor)]

    def deferrable(self) -> Callable[[torch.Tensor], bool]:
        """Predicate for :meth:`RankSnapshotStore.begin`: true for the tensors only
        ``optimizer.step()`` changes (parameters the optimizer owns, and its state), so
        their copy may run in the background until the next step is fenced. Buffers,
        parameters outside the optimizer, RNG and extras are copied at once.

        Contract for overlapped capture: between two snapshots, the training step
        changes parameters and optimizer state only through ``optimizer.step()``.
        """
        ptrs: set[int] = set()
        add = ptrs.add
        opt = self.optimizer
        if opt is not None:  # (every step, ~4 tensors per parameter: kept to plain loops)
            state = opt.state
            for group in opt.param_groups:
                for p in group["params"]:
                    add(_ptr(p))
                    held = state.get(p)
                    if held:
                        for value in held.values():
                            if isinstance(value, torch.Tensor):
                                add(_ptr(value))
        # the snapshot holds a DTensor's local tensor (DTensor.data_ptr() is 0)
        return lambda t: t.data_ptr() in ptrs

    def restore(self, state: dict[str, Any]) -> int:
        """Load ``state`` (from ``RankSnapshotStore.read(..., copy=False)``); return its step.
        The model's gradients are dropped (``None``): the step of ``state`` is complete and no
        later one has begun."""
        _restore_model(self.model, state["model"])
        # The gradients of the step a failure abandoned would otherwise be summed into the redone
        # step's by a script that zeroes them after optimizer.step() (Accelerate's and Fabric's
        # examples do): its recovered run would differ from an uninterrupted one.
        for p in self.model.parameters():
            p.grad = None
        if self.optimizer is not None and state["optimizer"] is not None:
            if not _copy_into_optimizer(self.optimizer, state["optimizer"]):
                self.optimizer.load_state_dict(_fresh_optimizer_state(self.optimizer, state["optimizer"]))
        self.restore_rest(state)
        return int(state["step"])

    def restore_rest(self, state: dict[str, Any]) -> None:
        """Restore what is neither model nor optimizer: RNGs, extras and ``objects``."""
        saved = state.get("objects") or {}  # snapshots written before objects existed have none
        missing = sorted(set(self.objects) - set(saved))
        if missing:
            raise SnapshotError(
                f"the snapshot of step {state['step']} holds no state for state= object(s) {missing}: "
                "it was written by a script without them"
            )
        _set_rng_state(state["rng"])
        if self._load_extras is not None:
            self._load_extras(_clone_tensors(state["extras"]))
        for name, obj in self.objects.items():
            obj.load_state_dict(_clone_tensors(saved[name]))


def restore_resharded(capture: StateCapture, states: list[dict[str, Any] | None], rank: int) -> int:
    """Restore ``capture`` (a sharded model just built on a new mesh) from the old ranks' states
    of a snapshot taken on another mesh (``states[r]``: old rank r's; None for one this rank's
    node did not gather, :mod:`~nonstop.reshardplan`). Each DTensor of the model
    and of the optimizer is cut from the old ranks' shards for its live layout
    (:func:`~nonstop.snapshot.sharded.reshard`: a slice they leave uncovered is an error); the
    rest (plain tensors, optimizer scalars and hyper-parameters, RNG, extras) comes from old rank
    ``rank % len(states)``. Returns the step."""
    from nonstop.snapshot.sharded import reshard, stitch

    held = rank % len(states)
    maybe = states[held]
    if maybe is None:
        raise SnapshotError(
            f"cannot reshard: old rank {held}'s state, which rank {rank} restores the rest from, is not here"
        )
    base: dict[str, Any] = maybe

    def cut(live: Any, key: Any, pick: Any, where: str) -> torch.Tensor:
        """``live`` 's local tensor (the whole tensor when ``live`` is a plain one) out of the old
        ranks' values (shards, or whole tensors: an old layout that kept it unsharded)."""
        shards = [_as_shard(pick(st)) for st in states if st is not None]
        if not all(isinstance(sh, LocalShard) for sh in shards):
            raise SnapshotError(f"cannot reshard {where}: the snapshot holds no tensor of it")
        if not is_dtensor(live):
            whole = stitch(shards)  # (a tensor the new layout keeps whole, the old one sharded)
            if tuple(whole.shape) != tuple(live.shape):
                raise SnapshotError(f"cannot reshard {where}: {tuple(whole.shape)} for {tuple(live.shape)}")
            return whole
        coord = tuple(live.device_mesh.get_coordinate() or ())
        placements = tuple(repr(pl) for pl in live.placements)
        local = reshard(shards, placements, tuple(live.device_mesh.shape), coord)
        if tuple(local.shape) != tuple(local_of(live).shape):
            raise SnapshotError(
                f"cannot reshard {where}: {tuple(local.shape)} for a local {tuple(local_of(live).shape)}"
            )
        return local

    with torch.no_grad():
        for key, cur in capture.model.state_dict().items():
            if is_dtensor(cur) or isinstance(base["model"][key], LocalShard):
                into = local_of(cur) if is_dtensor(cur) else cur
                into.copy_(cut(cur, key, lambda st, k=key: st["model"][k], f"model {key}"))
            else:
                cur.copy_(base["model"][key])
    opt = capture.optimizer
    if opt is not None and base["optimizer"] is not None:
        from torch.distributed.tensor import DTensor

        params = [p for group in opt.param_groups for p in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for i, entries in base["optimizer"]["state"].items():
            out: dict[str, Any] = {}
            for name, value in entries.items():
                like = params[int(i)] if 0 <= int(i) < len(params) else None
                if isinstance(value, LocalShard) or (is_dtensor(like) and _is_state_tensor(value, like)):
                    local = cut(
                        like,
                        name,
                        lambda st, i=i, n=name: st["optimizer"]["state"][i][n],
                        f"optimizer {i}.{name}",
                    )
                    if like is None or not is_dtensor(like):
                        out[name] = local  # (kept whole by the new layout)
                        continue
                    out[name] = DTensor.from_local(
                        local,
                        device_mesh=like.device_mesh,
                        placements=like.placements,
                        run_check=False,
                        shape=like.shape,
                        stride=like.stride(),
                    )
                else:
                    out[name] = _clone_onto(value, like)
            state[i] = out
        saved = {k: v for k, v in base["optimizer"].items() if k != "state"}
        opt.load_state_dict({**_clone_tensors(saved), "state": state})
    capture.restore_rest(base)
    return int(base["step"])


def _as_shard(value: Any) -> Any:
    """An old rank's value of a tensor as a :class:`LocalShard`: a whole (unsharded) tensor is the
    one piece at offset 0; anything else is returned as it is (the caller refuses it)."""
    if isinstance(value, LocalShard) or not isinstance(value, torch.Tensor):
        return value
    return LocalShard(
        tensor=value,
        global_shape=tuple(value.shape),
        global_stride=tuple(value.stride()),
        offset=(0,) * value.dim(),
        placements=("Replicate()",),
        mesh_shape=(1,),
        mesh_dims=None,
    )


def _is_state_tensor(value: Any, param: Any) -> bool:
    """Whether optimizer state ``value`` is a per-element tensor of ``param`` (its shape: Adam's
    moments), not a scalar such as its ``step``."""
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape) and value.dim() > 0


def _ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s data (a DTensor's local tensor's: ``DTensor.data_ptr()`` is 0)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # the common case, without a lookup
        return t.data_ptr()
    return (local_of(t) if is_dtensor(t) else t).data_ptr()


def _restore_model(model: torch.nn.Module, saved: dict[str, Any]) -> None:
    """Load ``saved`` into ``model``: ``load_state_dict`` for plain tensors; a sharded model's
    :class:`LocalShard` s are copied into its live DTensors' local tensors (checked)."""
    if not any(isinstance(v, LocalShard) for v in saved.values()) and not any(
        is_dtensor(p) for p in model.parameters()
    ):
        model.load_state_dict(saved)
        return
    live = model.state_dict()
    if set(live) != set(saved):
        missing, extra = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        raise SnapshotError(f"cannot restore the model: keys missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for key, value in saved.items():
            cur = live[key]
            if isinstance(value, LocalShard):
                if not is_dtensor(cur):
                    raise SnapshotError(
                        f"cannot restore model {key}: the snapshot holds a shard, the model a tensor"
                    )
                copy_into(cur, value, f"model {key}")
            elif is_dtensor(cur):
                raise SnapshotError(
                    f"cannot restore model {key}: the snapshot holds a tensor, the model a DTensor"
                )
            else:
                cur.copy_(value)


def _fresh_optimizer_state(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` for ``Optimizer.load_state_dict`` of an optimizer without state yet: tensors
    cloned (it keeps references) straight onto their parameter's device (:func:`_clone_onto`),
    a :class:`LocalShard` made a DTensor on its parameter's mesh."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for i, entries in saved["state"].items():
        out: dict[str, Any] = {}
        for key, value in entries.items():
            if isinstance(value, LocalShard):
                if not 0 <= int(i) < len(params) or not is_dtensor(params[int(i)]):
                    raise SnapshotError(
                        f"cannot restore optimizer state {i}.{key}: its parameter is not sharded"
                    )
                out[key] = to_dtensor(value, params[int(i)], f"optimizer state {i}.{key}")
            else:
                out[key] = _clone_onto(value, params[int(i)] if 0 <= int(i) < len(params) else None)
        state[i] = out
    return {**_clone_tensors({k: v for k, v in saved.items() if k != "state"}), "state": state}


def _copy_into_optimizer(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> bool:
    """Copy ``saved`` into the optimizer's existing state tensors, in place.

    A survivor already holds state of the same shapes: copying into it avoids
    allocating (and page-faulting) a second copy of the optimizer, and never
    aliases snapshot memory. Returns False, changing nothing, when the layouts
    differ (e.g. a fresh replacement whose optimizer has no state yet).
    """
    params = [p for group in opt.param_groups for p in group["params"]]
    saved_state: dict[int, dict[str, Any]] = saved["state"]
    if len(saved["param_groups"]) != len(opt.param_groups) or set(saved_state) != {
        i for i, p in enumerate(params) if p in opt.state
    }:
        return False
    for i, entries in saved_state.items():
        live = opt.state[params[i]]
        if set(entries) != set(live):
            return False
        for key, value in entries.items():
            cur = live[key]
            if isinstance(value, LocalShard):
                if not is_dtensor(cur):
                    return False
                check_matches(cur, value, f"optimizer state {i}.{key}")
                continue
            if isinstance(value, torch.Tensor) != isinstance(cur, torch.Tensor) or is_dtensor(cur):
                return False
            if isinstance(value, torch.Tensor) and (value.shape != cur.shape or value.dtype != cur.dtype):
                return False
    for i, entries in saved_state.items():
        live = opt.state[params[i]]
        for key, value in entries.items():
            if isinstance(value, LocalShard):
                copy_into(live[key], value, f"optimizer state {i}.{key}")
            elif isinstance(value, torch.Tensor):
                live[key].copy_(value)
            else:
                live[key] = value
    for group, saved_group in zip(opt.param_groups, saved["param_groups"], strict=True):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return True


def _clone_onto(value: Any, param: torch.Tensor | None) -> Any:
    """``value`` (one optimizer state entry of ``param``) copied out of snapshot memory: a tensor
    of one or more dimensions straight onto ``param``'s device (one copy, not a host clone that
    ``load_state_dict`` then copies again); scalars (Adam's ``step``) stay on the CPU, where
    ``load_state_dict`` leaves or moves them by its own rule."""
    if (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and param is not None
        and not is_dtensor(param)
        and param.device != value.device
    ):
        return value.to(param.device, copy=True)
    return _clone_tensors(value)


def _clone_tensors(obj: Any) -> Any:
    """``obj`` with every tensor and array copied out (snapshot memory is overwritten later)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tensors(v) for v in obj)
    return obj
