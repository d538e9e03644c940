"""Unit tier of the user-owned loop: :class:`Step`'s handling of what its body raises, the checks
of ``state=`` objects, :class:`Batches` and the capture of ``state=`` objects in a snapshot."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nonstop.errors import SnapshotError, UsageError
from nonstop.snapshot import StateCapture
from nonstop.snapshot.flatten import flatten_state, unflatten_state
from nonstop.train.link import PeerFailed
from nonstop.train.steps import Batches, Step, check_objects


def _step(index: int = 3, calls: list[str] | None = None) -> Step:
    log = calls if calls is not None else []
    return Step(
        index,
        model=torch.nn.Linear(1, 1),
        generation=2,
        new_generation=True,
        enter=lambda: log.append("enter"),
        leave=lambda: log.append("leave"),
    )


def test_a_step_is_its_index_and_tells_its_generation() -> None:
    step = _step(7)
    assert step == 7 and int(step) + 1 == 8 and [10, 20, 30, 40, 50, 60, 70, 80][step] == 80
    assert step.generation == 2 and step.new_generation and step.loss is None
    assert repr(step) == "Step(7, generation=2)"


def test_with_step_hands_an_exception_or_a_peer_failure_to_the_loop() -> None:
    for err in (RuntimeError("gloo: connection closed"), PeerFailed("a peer failed")):
        calls: list[str] = []
        step = _step(calls=calls)
        with step:
            raise err
        assert step.outcome() is err
        assert calls == ["enter", "leave"]  # in_step is set while the body runs, only then


def test_with_step_lets_keyboard_interrupt_and_system_exit_through() -> None:
    for err in (KeyboardInterrupt(), SystemExit(3)):
        step = _step()
        with pytest.raises(type(err)):
            with step:
                raise err
        assert step.outcome() is None


def test_a_completed_step_has_no_outcome_and_one_entered_twice_is_refused() -> None:
    step = _step()
    with step:
        pass
    assert step.outcome() is None
    with pytest.raises(UsageError, match="once per step"):
        with step:
            pass


def test_a_step_run_outside_with_step_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="outside `with step:`"):
        _step().outcome()


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


def test_check_objects_refuses_what_cannot_be_captured_in_one_line() -> None:
    assert check_objects(None) == {}
    with pytest.raises(UsageError, match=r"'sched'.*a object has no state_dict\(\)/load_state_dict\(\)"):
        check_objects({"sched": object()})
    with pytest.raises(UsageError, match="names must be non-empty strings"):
        check_objects({1: _Counter()})  # type: ignore[dict-item]
    with pytest.raises(UsageError, match="dict of name -> object"):
        check_objects([_Counter()])  # type: ignore[arg-type]

    class Opaque(_Counter):
        def state_dict(self) -> dict[str, Any]:
            return {"fn": lambda: 0}

    with pytest.raises(UsageError, match=r"'bad'.*cannot be snapshotted.*function") as info:
        check_objects({"bad": Opaque()})
    assert "\n" not in str(info.value)


def test_state_objects_are_captured_and_restored_with_the_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = _Counter()
    capture = StateCapture(model=model, optimizer=opt, objects={"sched": sched, "count": counter})
    for _ in range(3):
        opt.step()
        sched.step()
        counter.n += 1
    tree, tensors = flatten_state(capture.state(3))
    saved = unflatten_state(tree, [t.clone() for t in tensors])
    lr_at_3 = sched.get_last_lr()
    for _ in range(4):
        opt.step()
        sched.step()
        counter.n += 1
    assert capture.restore(saved) == 3
    assert counter.n == 3 and sched.last_epoch == 3 and sched.get_last_lr() == lr_at_3
    assert opt.param_groups[0]["lr"] == lr_at_3[0]


def test_a_snapshot_without_a_state_object_is_refused_by_name() -> None:
    model = torch.nn.Linear(2, 2)
    old = StateCapture(model=model).state(1)
    del old["objects"]  # written before state= objects existed, or by a script without them
    with pytest.raises(SnapshotError, match=r"no state for state= object\(s\) \['count'\]"):
        StateCapture(model=model, objects={"count": _Counter()}).restore(old)
    assert StateCapture(model=model).restore(old) == 1  # without objects it still loads


def test_batches_resume_after_the_restored_batch_over_epochs() -> None:
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = torch.arange(10)

    def loader() -> Any:  # shuffled from the global RNG, as nonstop restores it (an explicit
        torch.manual_seed(1)  # generator= is not resumed exactly across epochs by torchdata 0.11)
        return tdl.StatefulDataLoader(data, batch_size=3, shuffle=True)

    epochs: list[int] = []
    ref = Batches(loader(), on_epoch=epochs.append)
    expected = [next(ref).tolist() for _ in range(9)]  # 4 batches an epoch: over two epochs
    assert epochs == [0, 1, 2] and ref.epoch == 2
    live = Batches(loader())
    got = [next(live).tolist() for _ in range(5)]
    saved = unflatten_state(*flatten_state(live.state_dict()))
    got += [next(live).tolist() for _ in range(2)]  # steps that a failure throws away
    fresh = Batches(loader())  # a replacement process
    fresh.load_state_dict(saved)
    assert fresh.epoch == 1
    assert got[:5] + [next(fresh).tolist() for _ in range(4)] == expected
