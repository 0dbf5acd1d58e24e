"""One process per run directory: an ``fcntl.flock`` on ``run_dir/lock``.

The file holds the holder's PID, so a second process is told who holds it
(:class:`~colab_resilience.errors.RunLockedError`). The kernel drops a flock when its holder
dies, SIGKILL included, so a crashed kernel never leaves a stale lock. Re-acquiring in the same
process is counted, not refused.

A flock belongs to the open file, which a forked child shares: a ``DataLoader`` worker forked
from the kernel would hold the run locked after the kernel died, until it noticed (seconds), and
the kernel that takes over would be refused. So a forked child closes its copies at once
(:func:`_close_in_child`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

from . import fsutil
from .errors import RunLockedError

LOCK_NAME = "lock"

_held: dict[str, list[int]] = {}  # realpath of lock file -> [fd, count]
_held_guard = threading.Lock()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


ORPHAN_WAIT_S = 2.0  # how long a lock whose holder has died may still be held by its children


def pid_alive(pid: int | None) -> bool:
    """Whether a process of that PID exists (someone else's counts)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _flock_or_wait_for_orphans(fd: int) -> None:
    """Take the lock, or raise. Where the process the file names has died, the lock can only be
    held by a child it forked that has not run yet (its at-fork hook closes the copy at once, see
    :func:`_close_in_child`): wait a moment for it rather than refuse the kernel that takes over."""
    deadline = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            pid = _read_pid(fd)
            if not pid or pid_alive(pid):
                raise
            if deadline is None:
                deadline = time.monotonic() + ORPHAN_WAIT_S
            elif time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class RunLock:
    """Exclusive use of one run directory by one process (re-entrant within the process). Keep a
    reference while you need it: a lock object that is garbage-collected releases its hold.
    ``create``: make the run folder where it is not there (a run that starts); otherwise (a run
    that exists: reset, resume, the exit handler, a supervisor counting a death) a folder that is
    gone raises FileNotFoundError and is not made again, nor the folders above it."""

    def __init__(self, run_dir: str | os.PathLike, *, create: bool = False):
        self.run_dir = Path(run_dir)
        self.create = create
        self.path = self.run_dir / LOCK_NAME
        self._key: str | None = None

    @property
    def held(self) -> bool:
        return self._key is not None

    def acquire(self) -> RunLock:
        if self._key is not None:
            return self
        fsutil.make_private_dir(self.run_dir, create=self.create)  # a real folder of this user's, or refused
        key = os.path.realpath(self.path)
        with _held_guard:
            if key in _held:
                _held[key][1] += 1
                self._key = key
                return self
            # never through a link planted as run_dir/lock, never someone else's file
            fd = fsutil.open_private_file(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                _flock_or_wait_for_orphans(fd)
            except OSError as e:
                pid = _read_pid(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                who, stop = (f"process {pid}" if pid else "another process"), "that kernel"
                if pid and not pid_alive(pid):
                    who, stop = f"a process that process {pid} started and left running when it exited", "it"
                raise RunLockedError(
                    f"colab_resilience: run directory {self.run_dir} is in use by {who}; "
                    f"stop {stop} or choose another run directory",
                    pid=pid,
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _held[key] = [fd, 1]
            self._key = key
        return self

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        with _held_guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del _held[key]
                try:
                    os.ftruncate(entry[0], 0)
                except OSError:
                    pass
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


def _close_in_child() -> None:
    """In a forked child: close the inherited descriptors of the locks this process held, without
    unlocking (``LOCK_UN`` would unlock the parent's hold, the same open file); the child holds
    nothing, and the lock goes when its holder does."""
    for fd, _ in list(_held.values()):  # not under _held_guard: another thread may have held it at the fork
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)
