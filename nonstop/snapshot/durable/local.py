"""Checkpoints on a local (or locally mounted) file system: :class:`LocalStorage`.

Contract: :meth:`LocalStorage.write` returns once the object's bytes, its name and any
directory it created are fsynced; until then the object exists only under a temporary name
(:data:`~.format.TMP_MARK`), so a crash leaves the old object (or none), never a torn one.
An instance may be used from several threads: the O_DIRECT staging buffers are taken by one
write at a time, and the throttle is shared by every write of the instance.

Permissions: what it creates is its owner's alone -- files 0600, directories (the root too,
when it creates it) 0700 -- plus the group bits of the root directory: a user who shares
checkpoints with their group makes the root group-readable (``chmod 750 ROOT``) and its
checkpoints are then group-readable too (0640/0750). Never world-readable: a checkpoint holds
the model, and the umask may only take more away.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from nonstop.errors import SnapshotMissingError, UsageError
from nonstop.snapshot.codec import Buffer
from nonstop.snapshot.durable.format import TMP_MARK
from nonstop.snapshot.durable.storage import byte_view, check_rel, fsync_dir

__all__ = ["LocalStorage"]

_MAX_IO = 1 << 30  # bytes per read/write syscall (Linux caps one call just under 2 GiB)
_STAGE = 8 << 20  # O_DIRECT staging buffer; also the throttle's granularity
_DIRECT_ALIGN = 4096  # O_DIRECT needs block-aligned sizes and offsets; 4 KiB suits every device


def _set_direct(fd: int, on: bool) -> bool:
    """Switch O_DIRECT on ``fd`` on or off; return whether it is on."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError:
        if on:
            return False
        raise
    return on


class LocalStorage:
    """A directory on a local (or locally mounted) file system, through plain ``os`` calls.

    An object is written to a temporary name in its directory, fsynced, renamed over the
    final name, and the directory is fsynced. Where the file system supports it (Linux,
    ``direct=True``) the data is copied into reused, page-aligned staging buffers and
    written with ``O_DIRECT`` in large sequential writes, the copy of one buffer
    overlapping the write of the other: that runs at the device's sequential speed, needs
    no page-cache allocation (slow on some VMs), and does not evict the training job's page
    cache. Elsewhere large buffered writes straight from the caller's buffers.
    ``max_bytes_per_s`` caps the write rate (all writes of this instance together) so that
    persisting never starves the training job's I/O.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes_per_s: float | None = None,
        direct: bool = True,
    ) -> None:
        root_s = os.fspath(root)
        if not root_s:
            raise UsageError("checkpoint location is empty: pass a directory path or an fsspec URL")
        if os.path.exists(root_s) and not os.path.isdir(root_s):
            raise UsageError(f"checkpoint location {root_s} is a file, not a directory: pass a directory")
        if max_bytes_per_s is not None and not max_bytes_per_s > 0:
            raise ValueError(f"max_bytes_per_s must be > 0 (got {max_bytes_per_s!r}); omit it for no limit")
        self.url = root_s
        self.root = os.path.abspath(root_s)
        self.max_bytes_per_s = max_bytes_per_s
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._tb_lock = threading.Lock()
        self._tb_next = 0.0
        self._stage_lock = threading.Lock()
        self._stages: tuple[mmap.mmap, mmap.mmap] | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._modes: tuple[int, int] | None = None  # see modes()

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *check_rel(path))

    def modes(self) -> tuple[int, int]:
        """(file mode, directory mode) of what this storage creates: 0600 and 0700 plus the
        root directory's group bits (its group reads what the root shares with it; never
        others). Fixed at the first call."""
        if self._modes is None:
            try:
                group = os.stat(self.root).st_mode & 0o070
            except FileNotFoundError:
                group = 0
            self._modes = (0o600 | (group & 0o060), 0o700 | group)
        return self._modes

    def _makedirs(self, d: str) -> None:
        missing: list[str] = []
        while not os.path.isdir(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        dir_mode = self.modes()[1]
        for m in reversed(missing):
            try:
                os.mkdir(m, dir_mode)
            except FileExistsError:
                pass
            fsync_dir(os.path.dirname(m))  # make the new directory entry durable

    def _throttle(self, n: int) -> None:
        rate = self.max_bytes_per_s
        if rate is None:
            return
        with self._tb_lock:
            now = time.monotonic()
            self._tb_next = max(self._tb_next, now) + n / rate
            delay = self._tb_next - now
        if delay > 0:
            time.sleep(delay)

    def _write_all(self, fd: int, mv: memoryview) -> int:
        """Buffered write of all of ``mv`` (in throttle-sized pieces when throttled)."""
        piece = _STAGE if self.max_bytes_per_s is not None else _MAX_IO
        n, off = len(mv), 0
        while off < n:
            done = os.write(fd, mv[off : off + piece])
            if done <= 0:
                raise OSError(f"short write to {self.url}")
            off += done
            self._throttle(done)
        return n

    def _write_staged(self, fd: int, view: memoryview, direct: bool) -> bool:
        """Write an aligned staged block, with O_DIRECT while ``direct``; return whether
        O_DIRECT is still on (it is switched off where the file system refuses it)."""
        off = 0
        while off < len(view):
            try:
                done = os.write(fd, view[off:])
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    direct = _set_direct(fd, False)
                    continue
                raise
            if done <= 0:
                raise OSError(f"short write to {self.url}")
            off += done
            if off < len(view) and direct:  # a short direct write leaves us unaligned
                direct = _set_direct(fd, False)
        self._throttle(len(view))
        return direct

    def _write_direct(self, fd: int, chunks: Iterable[Buffer]) -> int:
        """Copy ``chunks`` into two alternating page-aligned staging buffers; while one is
        being filled, a helper thread writes the other with O_DIRECT (the copy overlaps
        the device write). The unaligned tail goes through the page cache."""
        with self._stage_lock:
            if self._stages is None:  # page-aligned and reused: no page faults after the first use
                self._stages = (mmap.mmap(-1, _STAGE), mmap.mmap(-1, _STAGE))
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="nonstop-durable-write")
            views = [memoryview(b) for b in self._stages]
            pending: Future[bool] | None = None
            try:
                direct = _set_direct(fd, True)
                cur, fill, total = 0, 0, 0
                for chunk in chunks:
                    mv = byte_view(chunk)
                    pos, n = 0, len(mv)
                    while pos < n:
                        k = min(_STAGE - fill, n - pos)
                        views[cur][fill : fill + k] = mv[pos : pos + k]
                        fill += k
                        pos += k
                        if fill == _STAGE:
                            if pending is not None:
                                direct = pending.result()
                            pending = self._writer.submit(self._write_staged, fd, views[cur], direct)
                            cur, fill = 1 - cur, 0
                    total += n
                if pending is not None:
                    direct, pending = pending.result(), None
                aligned = fill // _DIRECT_ALIGN * _DIRECT_ALIGN
                if aligned:
                    direct = self._write_staged(fd, views[cur][:aligned], direct)
                if fill > aligned:
                    if direct:
                        direct = _set_direct(fd, False)
                    self._write_all(fd, views[cur][aligned:fill])
                return total
            finally:
                if pending is not None:  # never leave a write in flight on a buffer or fd we give up
                    wait([pending])
                for v in views:
                    v.release()

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        final = self._abs(path)
        parent = os.path.dirname(final)
        self._makedirs(parent)
        tmp = f"{final}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(tmp, flags, self.modes()[0])
        total = 0
        try:
            if self.direct:
                total = self._write_direct(fd, chunks)
            else:
                for chunk in chunks:
                    total += self._write_all(fd, byte_view(chunk))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        os.close(fd)
        os.replace(tmp, final)
        fsync_dir(parent)
        return total

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        p = self._abs(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise SnapshotMissingError(f"{self.url}/{path} is a directory, not an object")
            end = st.st_size
            if length is not None:
                end = min(end, offset + length)
            want = max(0, end - offset)
            if want <= _MAX_IO:
                return os.pread(fd, want, offset)  # one read, no extra copy
            parts, pos = [], offset
            while pos < end:
                got = os.pread(fd, min(_MAX_IO, end - pos), pos)
                if not got:
                    break
                parts.append(got)
                pos += len(got)
            return b"".join(parts)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_tree(self, path: str) -> None:
        p = self._abs(path)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass

    def size(self, path: str) -> int:
        try:
            return os.stat(self._abs(path)).st_size
        except (FileNotFoundError, NotADirectoryError):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist") from None
