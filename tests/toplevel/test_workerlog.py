"""Worker output through the node agent (workerlog.py): rank prefixes, a spare's label
once it takes a rank, --log-dir files, the console filter, a SIGKILLed worker's last line, a
slow console that must not block a worker. Real child processes, no torch."""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from nonstop.agent.processes import Agent
from nonstop.errors import UsageError
from nonstop.workerlog import Console, Label, LogConfig, parse_ranks


class Captured(io.BytesIO):
    """A console stream a test can read while the writer thread writes."""

    def __init__(self, delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.gate = gate
        self.lock = threading.Lock()

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.gate is not None:
            self.gate.wait()
        if self.delay_s:
            time.sleep(self.delay_s)
        with self.lock:
            return super().write(data)

    def text(self) -> str:
        with self.lock:
            return self.getvalue().decode()


def _agent(tmp_path: Path, script: str, logs: LogConfig, console: Console) -> Agent:
    env = {**os.environ, **logs.to_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return Agent(
        job_id="t" + os.urandom(3).hex(),
        job_dir=tmp_path,
        shm_dir=tmp_path,
        command=[sys.executable, "-u", "-c", script],
        env=env,
        redirect_output=False,
        console=console,
    )


def _run(agent: Agent, role: str, rank: int | None = None, timeout: float = 30.0) -> int:
    sid = agent.spawn(role, rank=rank)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for got, rc in agent.poll():
            if got == sid:
                return rc
        time.sleep(0.01)
    raise AssertionError("the child did not exit")


def test_parse_ranks() -> None:
    assert parse_ranks("0") == {0}
    assert parse_ranks("0,2-4, 7") == {0, 2, 3, 4, 7}
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(UsageError, match="--local-ranks-filter"):
            parse_ranks(bad)


def test_labels_and_file_names() -> None:
    assert Label(4, "worker", 3).prefix("rank") == b"[rank 3] "
    assert Label(4, "worker", 3).prefix("torchrun") == b"[default3]:"
    assert Label(4, "spare").prefix("rank") == b"[spare 4] "
    assert Label(4, "spare").prefix("torchrun") == b"[spare4]:"
    assert Label(4, "worker", 3).prefix("none") == b""
    assert Label(4, "worker", 3).file_name == "rank3-spawn4.log"
    assert Label(4, "spare").file_name == "spare-spawn4.log"
    with pytest.raises(UsageError, match="--log-prefix"):
        LogConfig(prefix="fancy")


def test_log_config_travels_in_the_environment(tmp_path: Path) -> None:
    cfg = LogConfig(prefix="torchrun", log_dir=tmp_path, ranks=frozenset({0, 2}))
    assert LogConfig.from_env(cfg.to_env()) == cfg
    assert LogConfig.from_env({}) == LogConfig()


SPARE_TAKES_RANK = """
import sys
from nonstop.workerlog import announce_rank
print("waiting as a spare")
announce_rank(3)
print("playing rank 3")
print("an error line", file=sys.stderr)
sys.stdout.write("no newline at the end")
"""


def test_a_spare_is_relabelled_when_it_takes_a_rank(tmp_path: Path) -> None:
    out, err = Captured(), Captured()
    console = Console(out, err)
    agent = _agent(tmp_path, SPARE_TAKES_RANK, LogConfig(log_dir=tmp_path / "logs"), console)
    try:
        assert _run(agent, "spare") == 0
    finally:
        agent.shutdown()
    sid = 0
    assert out.text().splitlines() == [
        f"[spare {sid}] waiting as a spare",
        "[rank 3] playing rank 3",
        "[rank 3] no newline at the end",
    ]
    assert err.text() == "[rank 3] an error line\n"
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [f"rank3-spawn{sid}.log", f"spare-spawn{sid}.log"]
    assert (logs / f"spare-spawn{sid}.log").read_text() == "waiting as a spare\n"
    rank_file = (logs / f"rank3-spawn{sid}.log").read_text().splitlines()
    assert sorted(rank_file) == sorted(["playing rank 3", "an error line", "no newline at the end"])


def test_torchrun_prefix_and_the_console_filter(tmp_path: Path) -> None:
    out, err = Captured(), Captured()
    console = Console(out, err)
    logs = LogConfig(prefix="torchrun", log_dir=tmp_path / "logs", ranks=frozenset({1}))
    agent = _agent(tmp_path, "import os; print('hello from', os.environ['NONSTOP_SPAWN_ID'])", logs, console)
    try:
        for rank in (0, 1):
            assert _run(agent, "worker", rank=rank) == 0
        assert _run(agent, "spare") == 0
    finally:
        agent.shutdown()
    assert out.text() == "[default1]:hello from 1\n"  # rank 0 and the spare filtered out
    files = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert files == ["rank0-spawn0.log", "rank1-spawn1.log", "spare-spawn2.log"]  # files get all


LAST_WORDS = """
import os, signal, sys
print("step 41 done")
sys.stdout.write("step 42 started, no newline")
sys.stdout.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sigkilled_workers_last_lines_are_kept(tmp_path: Path) -> None:
    out, err = Captured(), Captured()
    agent = _agent(tmp_path, LAST_WORDS, LogConfig(log_dir=tmp_path / "logs"), Console(out, err))
    try:
        assert _run(agent, "worker", rank=2) == -9
    finally:
        agent.shutdown()
    assert out.text() == "[rank 2] step 41 done\n[rank 2] step 42 started, no newline\n"
    assert (tmp_path / "logs" / "rank2-spawn0.log").read_text().endswith("step 42 started, no newline\n")


CHATTY = """
import sys
for i in range(20000):
    print("line", i)
"""


def test_a_slow_console_neither_blocks_nor_kills_a_worker(tmp_path: Path) -> None:
    gate = threading.Event()  # the console cannot write at all until the worker is done
    out, err = Captured(gate=gate), Captured()
    console = Console(out, err, max_lines=100)
    agent = _agent(tmp_path, CHATTY, LogConfig(log_dir=tmp_path / "logs"), console)
    try:
        t0 = time.monotonic()
        assert _run(agent, "worker", rank=0, timeout=60) == 0
        assert time.monotonic() - t0 < 30
        assert agent._outputs[0].join(10)
        assert console.dropped > 19000
    finally:
        gate.set()
        agent.shutdown()
    lines = (tmp_path / "logs" / "rank0-spawn0.log").read_text().splitlines()
    assert len(lines) == 20000 and lines[-1] == "line 19999"  # the file has every line
    shown = out.text()
    assert "line(s) of worker output dropped" in err.text() + shown
    assert shown.count("[rank 0] line") < 20000


def test_nonstops_own_lines_are_timestamped(capsys: pytest.CaptureFixture[str]) -> None:
    import logging
    import re

    from nonstop.workerlog import setup_logging

    try:
        setup_logging("info")
        logging.getLogger("nonstop.coordinator.x").info("a line")
        logging.getLogger("nonstop.coordinator.x").debug("not shown")
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and re.fullmatch(
            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} nonstop: INFO a line", err[0]
        )
        with pytest.raises(UsageError, match="--log-level"):
            setup_logging("loud")
    finally:
        setup_logging("warning")
