"""Durable files: atomic replacement, fsync of files and folders, private folders, canonical JSON.

The journal, the checkpoints and the installation key are written through these few functions, so
that a kill or a power cut at any moment leaves either the old file or the new one, never half of
one, and nothing a run writes is readable by other users whatever the umask.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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


def write_new(path: str | os.PathLike, data, mode: int = 0o600) -> None:
    """Create ``path`` (it must not exist) with exactly ``mode`` whatever the umask, write
    ``data`` and fsync it; the descriptor is closed on every path, errors included."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_limited(f, limit: int) -> bytes:
    """The bytes of the open file ``f``, or ``limit`` + 1 of them if it holds more (the caller
    refuses those). Allocates only what the file holds: this runs after out-of-memory errors,
    under memory caps, where allocating the limit up front is what fails."""
    size = os.fstat(f.fileno()).st_size
    return f.read(min(size, limit) + 1)


def atomic_temp_prefix(name: str) -> str:
    """How the temporary files of :func:`atomic_write` for ``name`` begin (a kill can leave one)."""
    return f".{name}.tmp-"


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` by ``data`` atomically and durably (temp + fsync + replace + fsync dir)."""
    path = Path(path)
    tmp = path.with_name(f"{atomic_temp_prefix(path.name)}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write_new(tmp, data, mode)
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


def private_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new folder inside ``parent``, owner-only (0700), with a name nobody can predict."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def canonical_json(obj: Any) -> bytes:
    """The bytes a signature covers: sorted keys, no spaces, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number this package writes")


def strict_json(raw: bytes | str) -> Any:
    """Parse JSON this package wrote: NaN and Infinity are refused (ValueError), like any other
    malformed input."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")
    return json.loads(raw, parse_constant=_no_constant)
