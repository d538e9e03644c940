"""Worker output: every line a worker prints reaches the console with its rank in front, and
(``--log-dir``) a file per rank and process.

The node agent reads each worker's stdout and stderr through pipes of its own, one reader
thread per worker (:class:`WorkerOutput`), so:

* nothing a worker wrote is lost when it is SIGKILLed: what it wrote before it died is in the
  pipe, and the reader reads to end-of-file (a last line without its newline included);
* a slow console never blocks or kills a worker: the reader always drains the pipe, and the
  lines for the console wait in one bounded queue per agent process (:class:`Console`); when it
  is full, lines are dropped and counted, and the console says how many once it catches up.
  The ``--log-dir`` files are written by the reader itself and get every line.

A worker learns its rank from the coordinator after it starts, and a hot spare only when it
takes a rank, so the worker tells its agent, in band: :func:`announce_rank` (called by the
worker's session for every generation it joins) flushes stdout and stderr and writes a marker
line ``ESC ] nonstop;TAG;rank=R BEL`` to each (TAG: a random token the agent gives each process in
``NONSTOP_LOG_TAG``, so no other output can pass for a marker). The reader drops the marker and
labels what follows in that stream with the new rank: every line printed before the
announcement carries the old label and every line after it the new one. Until then a process
started for a rank carries that rank (the spawn command names it), a hot spare ``[spare S]``
(S: its spawn id, the ``spawn_id`` of the events log).

Files (``--log-dir DIR``): ``DIR/rank{R}-spawn{S}.log`` holds what process S printed while it
played rank R (stdout and stderr interleaved as read, no prefix); a hot spare's lines from
before it took a rank are in ``DIR/spare-spawn{S}.log``. Spawn ids grow through the job, so
``ls DIR/rank3-*`` in spawn order is rank 3's whole life: one file per process that played it
(a replacement after a failure is a new spawn id; a survivor keeps its file through later
generations unless an elastic resize gives it another rank).

The options travel to the agent in the worker environment the launcher builds
(:meth:`LogConfig.to_env`, read back by :meth:`LogConfig.from_env`), like every other setting
a node's processes share.
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from nonstop.errors import UsageError

__all__ = [
    "PREFIXES",
    "Console",
    "Label",
    "LogConfig",
    "WorkerOutput",
    "announce_rank",
    "parse_ranks",
    "setup_logging",
]

log = logging.getLogger(__name__)

PREFIXES = ("rank", "torchrun", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")

ENV_PREFIX = "NONSTOP_LOG_PREFIX"
ENV_DIR = "NONSTOP_LOG_DIR"
ENV_RANKS = "NONSTOP_LOG_RANKS"
ENV_TAG = "NONSTOP_LOG_TAG"  # set by the agent in each worker it starts: its markers' token
MARK = b"\x1b]nonstop;"

CONSOLE_QUEUE_LINES = 10_000  # lines waiting for a slow console before new ones are dropped
MAX_LINE = 64 * 1024  # a longer run of bytes without a newline goes out in pieces this long
READ_SIZE = 64 * 1024


def parse_ranks(text: str) -> frozenset[int]:
    """``"0,2,5-7"`` as a set of ranks; UsageError naming the flag for anything else."""
    out: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",")):
            lo, dash, hi = part.partition("-")
            first, last = int(lo), int(hi) if dash else int(lo)
            if first < 0 or last < first:
                raise ValueError(part)
            out.update(range(first, last + 1))
    except ValueError:
        raise UsageError(f"--local-ranks-filter {text!r}: give ranks as R,R,R-R (e.g. 0 or 0,2-3)") from None
    return frozenset(out)


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """How a node's agent routes its workers' output.

    prefix: ``rank`` (``[rank 3] ``), ``torchrun`` (``[default3]:``) or ``none``.
    log_dir: where each process's output is also written, per rank (None: nowhere).
    ranks: the ranks whose lines reach the console (None: every process, spares included; a
        set: only processes playing one of these ranks). The files get everything."""

    prefix: str = "rank"
    log_dir: Path | None = None
    ranks: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.prefix not in PREFIXES:
            raise UsageError(f"--log-prefix must be one of {', '.join(PREFIXES)} (got {self.prefix!r})")

    def to_env(self) -> dict[str, str]:
        env = {ENV_PREFIX: self.prefix}
        if self.log_dir is not None:
            env[ENV_DIR] = str(self.log_dir.resolve())
        if self.ranks is not None:
            env[ENV_RANKS] = ",".join(str(r) for r in sorted(self.ranks))
        return env

    @classmethod
    def from_env(cls, env: dict[str, str]) -> LogConfig:
        ranks = env.get(ENV_RANKS)
        log_dir = env.get(ENV_DIR)
        return cls(
            prefix=env.get(ENV_PREFIX, "rank"),
            log_dir=Path(log_dir) if log_dir else None,
            ranks=parse_ranks(ranks) if ranks else None,
        )


@dataclass(frozen=True)
class Label:
    """Who a line comes from: the rank its process plays, or (rank None) a spare or a process
    that has not said its rank yet, by its spawn id."""

    spawn_id: int
    role: str
    rank: int | None = None

    def prefix(self, style: str) -> bytes:
        if style == "none":
            return b""
        if self.rank is not None:
            text = f"[rank {self.rank}] " if style == "rank" else f"[default{self.rank}]:"
        else:
            text = f"[{self.role} {self.spawn_id}] " if style == "rank" else f"[{self.role}{self.spawn_id}]:"
        return text.encode()

    @property
    def file_name(self) -> str:
        who = f"rank{self.rank}" if self.rank is not None else self.role
        return f"{who}-spawn{self.spawn_id}.log"


def announce_rank(rank: int) -> None:
    """Worker side: tell the agent reading this process's output that it now plays ``rank``.
    Flushes stdout and stderr first, then writes the marker to both (file descriptors 1 and 2),
    so every line printed before this call carries the old label and every line after it the
    new one. A no-op in a process not started by a nonstop agent."""
    tag = os.environ.get(ENV_TAG)
    if not tag:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    for fd in (1, 2):
        try:
            os.write(fd, marker(tag, rank))
        except OSError:
            pass  # closed by the script: nothing to label there


def marker(tag: str, rank: int) -> bytes:
    """The line :func:`announce_rank` writes (the reader drops it)."""
    return MARK + f"{tag};rank={rank}\x07\n".encode()


class BinaryOut(Protocol):
    """Where the console writes: a binary stream (``sys.stdout.buffer``)."""

    def write(self, data: bytes, /) -> int: ...
    def flush(self) -> None: ...


class Console:
    """The agent process's console: one writer thread and one bounded queue of lines.

    :meth:`put` never blocks: a full queue drops the line and counts it; the writer reports the
    count (``nonstop: N line(s) of worker output dropped ...``) once the queue has room again.
    :meth:`close` writes out what is queued (up to a timeout) and stops the thread."""

    def __init__(
        self,
        stdout: BinaryOut | None = None,
        stderr: BinaryOut | None = None,
        *,
        max_lines: int = CONSOLE_QUEUE_LINES,
    ) -> None:
        self._streams = (stdout or _binary(sys.stdout), stderr or _binary(sys.stderr))
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=max_lines)
        self._dropped = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._write, name="nonstop-console", daemon=True)
        self._thread.start()

    def put(self, stream: int, line: bytes) -> None:
        """Queue ``line`` for stdout (``stream`` 1) or stderr (2); drop it if the queue is full."""
        try:
            self._queue.put_nowait((stream, line))
        except queue.Full:
            with self._lock:
                self._dropped += 1

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    def _write(self) -> None:
        reported = 0
        while True:
            item = self._queue.get()
            if item is None:
                return
            stream, line = item
            out = self._streams[stream - 1]
            with self._lock:
                dropped = self._dropped
            try:
                if dropped > reported:
                    self._streams[1].write(
                        f"nonstop: {dropped - reported} line(s) of worker output dropped: the "
                        "console was slower than the workers (--log-dir keeps every line)\n".encode()
                    )
                    reported = dropped
                out.write(line)
                if self._queue.empty():
                    out.flush()
            except (OSError, ValueError):
                pass  # a closed console (the terminal went away): the workers go on

    def close(self, timeout: float = 5.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout)
        for out in self._streams:
            try:
                out.flush()
            except (OSError, ValueError):
                pass


def _binary(stream: IO[str]) -> BinaryOut:
    buffer: BinaryOut | None = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextAdapter(stream)


class _TextAdapter:
    """A text stream without a binary buffer (a test's captured stdout) as a binary one."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        return self._stream.write(data.decode(errors="replace"))

    def flush(self) -> None:
        self._stream.flush()


class WorkerOutput:
    """Reads one worker's stdout and stderr on a thread of its own until the worker (and anything
    holding its pipes) is gone, and routes every line.

    ``config``: prefix, ``--log-dir`` and console filter. ``console``: where prefixed lines go
    (None: nowhere). ``spawn_file``: a file that gets every line unprefixed (the launcher's
    ``redirect_output``: ``JOB_DIR/logs/{role}-{spawn_id}.log``). ``tag``: the token of this
    process's rank markers. The two fds belong to this object from :meth:`start` on and are
    closed when their pipes end."""

    def __init__(
        self,
        label: Label,
        *,
        config: LogConfig,
        console: Console | None,
        tag: str,
        spawn_file: Path | None = None,
    ) -> None:
        self.config = config
        self.console = console
        self._mark = MARK + tag.encode() + b";rank="
        self._spawn_file = spawn_file.open("ab") if spawn_file is not None else None
        self._files: dict[Label, IO[bytes]] = {}
        self._labels = {1: label, 2: label}  # per stream: each switches at its own marker
        self._partial: dict[int, bytes] = {1: b"", 2: b""}
        self._thread: threading.Thread | None = None

    @property
    def label(self) -> Label:
        """The label of the newest stdout line."""
        return self._labels[1]

    def start(self, out_fd: int, err_fd: int) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(out_fd, err_fd), name=f"nonstop-output-{self.label.spawn_id}", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the worker's pipes to end; True when every line is out."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            return not self._thread.is_alive()
        return True

    def _run(self, out_fd: int, err_fd: int) -> None:
        sel = selectors.DefaultSelector()
        streams = {out_fd: 1, err_fd: 2}
        for fd in streams:
            sel.register(fd, selectors.EVENT_READ)
        open_fds = set(streams)
        try:
            while open_fds:
                for key, _ in sel.select():
                    fd = int(key.fd)
                    if not self._read(fd, streams[fd]):
                        sel.unregister(fd)
                        os.close(fd)
                        open_fds.discard(fd)
        except Exception:  # never take the agent down for a worker's output
            log.exception("reading the output of spawn %d", self.label.spawn_id)
        finally:
            for stream in (1, 2):
                if self._partial[stream]:
                    self._emit(stream, self._partial[stream] + b"\n")
                    self._partial[stream] = b""
            for fd in open_fds:
                os.close(fd)
            sel.close()
            for f in (*self._files.values(), self._spawn_file):
                if f is not None:
                    f.close()

    def _read(self, fd: int, stream: int) -> bool:
        """Read what ``fd`` holds and emit its complete lines; False at end-of-file."""
        chunk = os.read(fd, READ_SIZE)
        if not chunk:
            return False
        *lines, rest = (self._partial[stream] + chunk).split(b"\n")
        for line in lines:
            self._line(stream, line)
        while len(rest) > MAX_LINE:
            self._emit(stream, rest[:MAX_LINE] + b"\n")
            rest = rest[MAX_LINE:]
        self._partial[stream] = rest
        return True

    def _line(self, stream: int, line: bytes) -> None:
        at = line.find(self._mark)
        if at < 0:
            self._emit(stream, line + b"\n")
            return
        if at > 0:  # a partial line printed before the announcement
            self._emit(stream, line[:at] + b"\n")
        value = line[at + len(self._mark) :].rstrip(b"\x07")
        if value.isdigit():
            old = self._labels[stream]
            self._labels[stream] = Label(old.spawn_id, old.role, int(value))

    def _emit(self, stream: int, line: bytes) -> None:
        label = self._labels[stream]
        if self._spawn_file is not None:
            self._spawn_file.write(line)
            self._spawn_file.flush()
        if self.config.log_dir is not None:
            f = self._files.get(label)
            if f is None:
                self.config.log_dir.mkdir(parents=True, exist_ok=True)
                f = self._files[label] = (self.config.log_dir / label.file_name).open("ab")
            f.write(line)
            f.flush()
        if self.console is not None and self._shown(label):
            self.console.put(stream, label.prefix(self.config.prefix) + line)

    def _shown(self, label: Label) -> bool:
        ranks = self.config.ranks
        return ranks is None or (label.rank is not None and label.rank in ranks)


def setup_logging(level: str) -> None:
    """nonstop's own log lines: ``2025-01-31 12:00:00.123 nonstop: WARNING ...`` at ``level``."""
    if level not in LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)} (got {level!r})")
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s.%(msecs)03d nonstop: %(levelname)s %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )
