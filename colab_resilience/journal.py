"""The run's on-disk truth: its journal, and the lock that keeps one process per run directory.

``journal.json`` in the run directory says what a restarted kernel needs to go on: the run id,
its status (``pending`` after an abnormal end, ``done``, ``failed``), when it was created and last
updated (Unix seconds), every restart with its reason and time, the restart budget
(``max_restarts``, ``restarts_used``), the last checkpoint id, the replay cells' sources in order,
the interrupted cell's source and the kernel's PID. ``extra`` is free-form JSON for the glue.

Every write is atomic (temporary file, ``fsync``, ``os.replace``, ``fsync`` of the folder): a
reader sees the old journal or the new one, never half of one, even after a SIGKILL or a power
cut. :meth:`Journal.load` refuses anything that is not a journal this package wrote, with
:class:`JournalError` and one line saying what to do, never a raw ``KeyError``.

:class:`RunLock` is an ``fcntl.flock`` on ``run_dir/lock``; the file holds the holder's PID so a
second process is told who holds it (:class:`RunLockedError`). The kernel releases a flock when
its holder dies, SIGKILL included, so a crashed kernel never leaves a stale lock. Re-acquiring in
the same process is counted, not refused. Keep a reference to the lock while you need it: a
lock object that is garbage-collected releases its hold.

    with RunLock(run_dir):
        j = Journal.load(run_dir) if Journal.exists(run_dir) else Journal.create(run_dir)
        j.record_restart("CUDA out of memory")
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ResilienceError, RunLockedError

JOURNAL_NAME = "journal.json"
LOCK_NAME = "lock"
FORMAT = "colab_resilience.journal"
FORMAT_VERSION = 1
STATUSES = ("pending", "done", "failed")
_MAX_JOURNAL_BYTES = 64 << 20


class JournalError(ResilienceError, ValueError):
    """The journal file is damaged, foreign, or from a newer version of this package."""


class JournalUntrustedError(JournalError):
    """The journal is well formed but not signed by this installation's key (another machine, a
    new Colab VM, a lost key, or an edit): its replay cells are not executed unless trusted."""


class JournalNotFoundError(ResilienceError, FileNotFoundError):
    """The run directory has no journal."""


# -- file primitives (also used by state.py) ------------------------------------------------------


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a folder's entries (a rename, a new file) durable; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some FUSE file systems cannot fsync a folder
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_all(fd: int, data) -> None:
    """``os.write`` until every byte is written (large writes may be partial)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def read_limited(f, limit: int) -> bytes:
    """The bytes of the open file ``f``, or ``limit`` + 1 of them if it holds more (the caller
    refuses those). Allocates only what the file holds: ``f.read(limit + 1)`` would allocate
    ``limit`` + 1 bytes up front, and this runs after an out-of-memory error, under memory caps,
    where 64 or 256 MiB is what fails (the demo's retries all failed on such a read)."""
    size = os.fstat(f.fileno()).st_size
    return f.read(min(size, limit) + 1)


def atomic_temp_prefix(name: str) -> str:
    """How the temporary files of :func:`atomic_write` for ``name`` begin (a kill can leave one)."""
    return f".{name}.tmp-"


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` by ``data`` atomically and durably (temp + fsync + replace + fsync dir)."""
    path = Path(path)
    tmp = path.with_name(f"{atomic_temp_prefix(path.name)}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def make_private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) owner-only (0700); tighten it if it exists and is ours."""
    path = Path(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, 0o700)
    return path


# -- the journal ------------------------------------------------------------------------------------


def new_run_id() -> str:
    """A sortable, unique run id like ``20250101-120000-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


_FIELDS: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "status": (str,),
    "created": (float, int),
    "updated": (float, int),
    "restarts": (list,),
    "last_checkpoint": (str, type(None)),
    "replay_cells": (list,),
    "interrupted_cell": (str, type(None)),
    "max_restarts": (int,),
    "restarts_used": (int,),
    "kernel_pid": (int, type(None)),
    "extra": (dict,),
}


@dataclass
class Journal:
    """One run's journal. Change attributes, then :meth:`save`; the helpers below save for you."""

    run_dir: Path
    run_id: str
    status: str = "pending"
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    last_checkpoint: str | None = None
    replay_cells: list[dict[str, str]] = field(default_factory=list)
    interrupted_cell: str | None = None
    max_restarts: int = 3
    restarts_used: int = 0
    kernel_pid: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / JOURNAL_NAME

    @property
    def restarts_left(self) -> int:
        return max(0, self.max_restarts - self.restarts_used)

    @classmethod
    def exists(cls, run_dir: str | os.PathLike) -> bool:
        return (Path(run_dir) / JOURNAL_NAME).is_file()

    @classmethod
    def create(
        cls, run_dir: str | os.PathLike, run_id: str | None = None, *, save: bool = True, **fields: Any
    ) -> Journal:
        """A new pending journal for a run (written at once unless ``save=False``)."""
        make_private_dir(run_dir)
        fields.setdefault("kernel_pid", os.getpid())
        journal = cls(run_dir=Path(run_dir), run_id=run_id or new_run_id(), **fields)
        journal._validate(journal.to_dict(), journal.path)
        if save:
            journal.save()
        return journal

    @classmethod
    def load(cls, run_dir: str | os.PathLike, *, key: bytes | None = None, trust: bool = False) -> Journal:
        """Read and check the run's journal; :class:`JournalError` if it is not one of ours.

        With ``key``, the journal must carry this installation's signature (it holds the replay
        cells a new kernel executes): an unsigned, edited or foreign journal is refused with
        :class:`JournalUntrustedError`, unless ``trust`` (the user vouched for it).
        """
        path = Path(run_dir) / JOURNAL_NAME
        try:
            with open(path, "rb") as f:
                raw = read_limited(f, _MAX_JOURNAL_BYTES)
        except FileNotFoundError:
            raise JournalNotFoundError(
                f"colab_resilience: no run journal in {run_dir}; nothing to resume"
            ) from None
        except OSError as e:
            raise JournalError(
                f"colab_resilience: cannot read the run journal {path} ({e.strerror or e})"
            ) from None
        if len(raw) > _MAX_JOURNAL_BYTES:
            cls._bad(path, "larger than any journal this package writes")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, NaN/Infinity, huge ints
            cls._bad(path, f"not valid JSON: {e}")
        except RecursionError:
            cls._bad(path, "not valid JSON: nested too deep")
        cls._validate(data, path)
        if key is not None and not trust:
            from .signing import key_path, verify

            body = {k: v for k, v in data.items() if k != "signature"}
            try:
                signed = verify(key, _canonical(body), data.get("signature"))
            except (ValueError, RecursionError):  # 1e400 parses as inf, which no signed journal holds
                signed = False
            if not signed:
                raise JournalUntrustedError(
                    f"colab_resilience: {path} is not signed by this installation's key ({key_path()}), "
                    "or was edited since, so its set-up cells are not run; if you wrote it (another "
                    "machine, a new Colab VM, a lost key), `%resilience resume --trust` adopts it, "
                    "else `%resilience reset` starts the run afresh"
                )
        values = {k: data[k] for k in _FIELDS}
        values["created"] = float(values["created"])
        values["updated"] = float(values["updated"])
        return cls(run_dir=Path(run_dir), **values)

    @staticmethod
    def _bad(path: Path, why: str):
        raise JournalError(
            f"colab_resilience: {path} is not a usable run journal ({why}); "
            "remove it (or `%resilience reset`) to start the run afresh"
        )

    @classmethod
    def _validate(cls, data: Any, path: Path) -> None:
        if not isinstance(data, dict):
            cls._bad(path, "not a JSON object")
        if data.get("format") != FORMAT:
            cls._bad(path, f"format is {data.get('format')!r}, not {FORMAT!r}")
        version = data.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            cls._bad(path, f"format version {version!r}; this package reads {FORMAT_VERSION}")
        for name, types in _FIELDS.items():
            if name not in data:
                cls._bad(path, f"field {name!r} is missing")
            value = data[name]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                cls._bad(path, f"field {name!r} is {type(value).__name__}")
        if data["status"] not in STATUSES:
            cls._bad(path, f"status {data['status']!r} is not one of {', '.join(STATUSES)}")
        if data["max_restarts"] < 0 or data["restarts_used"] < 0:
            cls._bad(path, "negative restart counts")
        for cell in data["replay_cells"]:
            if not (
                isinstance(cell, dict)
                and isinstance(cell.get("key"), str)
                and isinstance(cell.get("source"), str)
            ):
                cls._bad(path, "a replay cell is not {key, source} strings")
        for r in data["restarts"]:
            if not (
                isinstance(r, dict)
                and isinstance(r.get("reason"), str)
                and isinstance(r.get("time"), (int, float))
            ):
                cls._bad(path, "a restart is not {reason, time}")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION}
        for name in _FIELDS:
            data[name] = getattr(self, name)
        return data

    def save(self) -> None:
        """Write the journal atomically; ``updated`` becomes now."""
        self.updated = time.time()
        data = self.to_dict()
        self._validate(data, self.path)
        from .signing import load_or_create_key, sign

        data["signature"] = sign(load_or_create_key(), _canonical(data))
        make_private_dir(self.run_dir)
        atomic_write(self.path, (json.dumps(data, indent=1, allow_nan=False) + "\n").encode())

    # helpers the glue calls at each event; each one saves.

    def record_restart(self, reason: str, **details: Any) -> int:
        """Count one restart with its reason (one line) and return the restarts left."""
        entry = {"reason": str(reason).splitlines()[0] if reason else "", "time": time.time()}
        entry.update(details)
        self.restarts.append(entry)
        self.restarts_used += 1
        self.status = "pending"
        self.save()
        return self.restarts_left

    def set_status(self, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        self.status = status
        self.save()

    def set_checkpoint(self, checkpoint_id: str | None) -> None:
        self.last_checkpoint = checkpoint_id
        self.save()

    def add_replay_cell(self, key: str, source: str) -> None:
        """Remember a replay cell; a cell run again (same key) keeps its place, new source."""
        for cell in self.replay_cells:
            if cell["key"] == key:
                cell["source"] = source
                break
        else:
            self.replay_cells.append({"key": key, "source": source})
        self.save()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number this package writes")


def _canonical(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


# -- the run-directory lock -------------------------------------------------------------------------

_held: dict[str, list[int]] = {}  # realpath of lock file -> [fd, count]
_held_guard = threading.Lock()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class RunLock:
    """Exclusive use of one run directory by one process (re-entrant within the process)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._key: str | None = None

    @property
    def held(self) -> bool:
        return self._key is not None

    def acquire(self) -> RunLock:
        if self._key is not None:
            return self
        make_private_dir(self.run_dir)
        key = os.path.realpath(self.path)
        with _held_guard:
            if key in _held:
                _held[key][1] += 1
                self._key = key
                return self
            fd = os.open(key, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                pid = _read_pid(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                who = f"process {pid}" if pid else "another process"
                raise RunLockedError(
                    f"colab_resilience: run directory {self.run_dir} is in use by {who}; "
                    "stop that kernel or choose another run directory",
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
