"""The folders this package makes in the temporary directory, and the removal of those left behind.

``colab-resilience run`` keeps its kernels' sockets and, without ``--run-dir``, its run directory
(checkpoints included) in folders of the temporary directory; ``check`` and ``demo`` their
notebooks and runs; ``%resilience isolate`` its workers' sockets. Each is removed when its process
ends, but a process killed with SIGKILL (the OOM killer, a frontend's forced shutdown, a CI job's
timeout) runs no exit handler, and its folder stays: a check's may hold gigabytes of checkpoints.

The process that makes a folder holds an ``flock`` on the folder's lock file as long as it lives,
and the kernel drops the lock however the process dies: a folder of ours whose lock can be taken
is stale. The next folder this package makes, for whatever kind, first removes the stale ones.
A PID in the name would not do: it says nothing across PID namespaces that share one /tmp (a
process in another container would remove a live one's folder). Only this user's folders, of
this package's names, never through a link. A folder without the lock file (being made, or made
by an older version) stays, except a workers' one older than a minute: the versions before the
lock made those, and their relays (notebook kernels) are long gone by the time anyone upgrades.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import tempfile
import time

PREFIX = "colab-resilience-"
KINDS = ("kernel", "runs", "check", "demo", "worker")
LOCK = "in-use.lock"
_OLD_LOCK = "relay.lock"  # the workers' folders' lock file before this module
_NAME = re.compile(re.escape(PREFIX) + f"({'|'.join(KINDS)})-[A-Za-z0-9_-]+")
LOCKLESS_WORKERS_AFTER = 60  # seconds


class TempFolder:
    """A folder of ours in the temporary directory (mode 0700), held until :meth:`remove` or
    until this process ends, however it ends."""

    def __init__(self, kind: str, tag: str = ""):
        if kind not in KINDS:
            raise ValueError(f"kind is one of {KINDS}")
        sweep()
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-{tag}")
        self._fd: int | None = _hold(self.path)

    def remove(self) -> None:
        """Remove the folder and everything in it, then let go of it (in that order: a sweeper
        that took the lock first would remove it under our feet)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __fspath__(self) -> str:
        return self.path


def _hold(folder: str) -> int:
    """Lock ``folder``'s lock file for as long as this process keeps the descriptor (closed in
    children: a kernel started from here does not hold it). Locked under another name, then
    renamed: no sweeper ever finds it unlocked."""
    new = os.path.join(folder, f".{LOCK}-new")
    fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(new, os.path.join(folder, LOCK))
    return fd


def sweep() -> None:
    """Remove this user's folders of ours whose process is gone (see the module documentation)."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        match = _NAME.fullmatch(name)
        if not match:
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        fd = _open_lock(path)
        if fd is None:
            if match.group(1) == "worker" and time.time() - st.st_mtime > LOCKLESS_WORKERS_AFTER:
                shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process is alive
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


def _open_lock(folder: str) -> int | None:
    for name in (LOCK, _OLD_LOCK):
        try:
            return os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
    return None
