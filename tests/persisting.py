"""Test helper: real training states (a model, AdamW, RNG, extras) written to a durable root through
the real persist path -- each rank's snapshot in its shared-memory slots
(:class:`~nonstop.snapshot.store.RankSnapshotStore`), persisted by the agent's
:class:`~nonstop.snapshot.persist.Persister` -- without launching a job."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import torch

from nonstop.snapshot.capture import StateCapture
from nonstop.snapshot.codec import CodecConfig
from nonstop.snapshot.durable import DurableStore
from nonstop.snapshot.persist import Persister, PersistResult
from nonstop.snapshot.store import RankSnapshotStore


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16))


def trained(seed: int = 0, steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its AdamW after ``steps`` optimizer steps (deterministic in ``seed``)."""
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 256, generator=g)).square().mean().backward()
        opt.step()
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, extras: dict[str, Any]) -> Any:
    """What a rank snapshots (model, optimizer, RNG, extras), as its session captures it."""
    cap = StateCapture(model=model, optimizer=opt, extras=lambda: dict(extras), load_extras=lambda _d: None)
    return cap.state(step)


class Persisting:
    """A job's ranks' snapshot slots in ``tmp/shm`` and a Persister writing them to ``root``."""

    def __init__(self, tmp: Path, root: Path, world: int, codec: CodecConfig | None = None) -> None:
        shm = tmp / "shm"
        shm.mkdir(exist_ok=True)
        job = f"t{secrets.token_hex(4)}"
        self.stores = [RankSnapshotStore(shm_dir=shm, job_id=job, rank=r) for r in range(world)]
        self.persister = Persister(
            durable=DurableStore(root, keep=10),
            shm_dir=shm,
            job_id=job,
            world_size=world,
            codec=codec or CodecConfig(),
        )

    def persist(self, step: int, states: list[Any]) -> PersistResult:
        """Snapshot every rank's state of ``step`` and persist it; what was written."""
        for store, st in zip(self.stores, states, strict=True):
            store.write(step, st)
        res = self.persister.flush(30)
        assert res is not None and res.step == step, self.persister.last_error
        return res

    def close(self) -> None:
        self.persister.stop()
        for s in self.stores:
            s.clear()
            s.close()
