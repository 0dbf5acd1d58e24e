"""Durable files: atomic replacement, fsync of files and folders, private folders, canonical JSON.

The journal, the checkpoints and the installation key are written through these few functions, so
that a kill or a power cut at any moment leaves either the old file or the new one, never half of
one, and nothing a run writes is readable by other users whatever the umask.

Folders another user could control are refused, never written into (:func:`make_private_dir`,
:func:`check_run_root`): a symbolic link where a run folder should be, a folder owned by someone
else or writable by others, a pseudo-filesystem such as ``/proc``. Files are created with
``O_EXCL`` (which never follows a link) and opened with ``O_NOFOLLOW``, so a link planted where a
run's file should be is an error, not a redirection of the write to the link's target.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any

from .errors import UnsafeDirectoryError

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a folder's entries (a rename, a new file) durable; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
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


def write_new(path: str | os.PathLike, data, mode: int = 0o600, *, durable: bool = True) -> None:
    """Create ``path`` (it must not exist) with exactly ``mode`` whatever the umask, write
    ``data`` and (``durable``) fsync it; the descriptor is closed on every path, errors included."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        write_all(fd, data)
        if durable:
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


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace ``path`` by ``data`` atomically (temp + replace) and, unless ``durable`` is
    False, durably (the file and its folder fsync'ed)."""
    path = Path(path)
    tmp = path.with_name(f"{atomic_temp_prefix(path.name)}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write_new(tmp, data, mode, durable=durable)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def open_private_file(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """``os.open`` that never follows a link at ``path`` and accepts only a regular file of this
    user's (:class:`UnsafeDirectoryError` otherwise); the descriptor is the caller's to close."""
    try:
        fd = os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeDirectoryError(
                f"colab_resilience: {path} is a symbolic link, not a file of yours; it is not used "
                "(nothing is written through it): remove it, or choose another run directory with "
                "%resilience dir"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafeDirectoryError(
                f"colab_resilience: {path} is not a file of yours (owner uid {st.st_uid}); it is "
                "not used: remove it, or choose another run directory with %resilience dir"
            )
        return fd
    except BaseException:
        os.close(fd)
        raise


ANOTHER = "choose another run directory with %resilience dir"  # what a refusal offers, in a notebook


def _refuse(path: Path, why: str, fix: str, another: str = ANOTHER) -> None:
    raise UnsafeDirectoryError(f"colab_resilience: {path} {why}, so nothing is written there; {fix}, or {another}")


def _check_owned(path: Path, st: os.stat_result, another: str = ANOTHER) -> None:
    if not stat.S_ISDIR(st.st_mode):
        _refuse(path, "is not a folder", "remove it", another)
    if st.st_uid != os.geteuid():
        _refuse(path, f"belongs to another user (uid {st.st_uid}), who controls what is in it",
                "remove it if it is not needed", another)
    if st.st_mode & 0o022:
        _refuse(path, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})",
                f"fix it with: chmod go-w {path}", another)


def _mkdir_private(path: Path) -> bool:
    """``mkdir path`` with mode 0700 (and its missing parents); whether this call created it."""
    try:
        os.mkdir(path, 0o700)
        return True
    except FileExistsError:
        return False
    except FileNotFoundError:
        os.makedirs(path.parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        return True
    except FileExistsError:
        return False


def make_private_dir(path: str | os.PathLike, *, create: bool = True) -> Path:
    """Create the folder ``path`` (and missing parents) owner-only (0700) and check it.
    ``create=False``: only check it; a folder that is not there raises FileNotFoundError and is
    not made (a run someone removed is not brought back, nor the folders above it).

    A ``path`` that exists must be a real folder (not a symbolic link) of this user's that no one
    else can write; what group and others may read of it is taken away (it is a run's own). Anything else is refused with
    :class:`UnsafeDirectoryError` and left as it is: nothing outside a run's folder is ever
    written, truncated or chmod'ed on the strength of a link or a folder someone else prepared.
    """
    path = Path(path)
    created = _mkdir_private(path) if create else False
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if os.path.islink(path) else "not a folder"
            _refuse(path, f"is {kind} where a folder of this run belongs", "remove it")
        raise
    try:
        st = os.fstat(fd)
        _check_owned(path, st)
        mode = stat.S_IMODE(st.st_mode)
        if created and mode != 0o700:  # a umask took owner bits away
            os.fchmod(fd, 0o700)
        elif mode & 0o077:  # readable by others: owner-only, and the owner's bits as they were
            os.fchmod(fd, mode & 0o700)
    finally:
        os.close(fd)
    return path


# file systems that are views of the kernel, not storage: writing there changes the system
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
    "configfs", "bpf", "pstore", "efivarfs", "hugetlbfs", "mqueue", "fusectl", "binfmt_misc",
    "autofs", "rpc_pipefs", "nsfs", "selinuxfs",
})


def _unescape_mount(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the file system ``path`` is (or would be) on, from ``/proc/self/mountinfo``;
    None where that cannot be told."""
    real = os.path.realpath(path)
    best, kind = -1, None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts, rest = left.split(), right.split()
                if len(parts) < 5 or not rest:
                    continue
                mount = _unescape_mount(parts[4])
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= best:
                    best, kind = len(mount), rest[0]
    except OSError:
        return None
    return kind


def check_run_root(path: str | os.PathLike, another: str = ANOTHER) -> Path:
    """Create (0700) or check the folder that holds the run folders, and return it.

    Refused with :class:`UnsafeDirectoryError`: a pseudo-filesystem (``/proc``, ``/sys``, ...);
    a folder (or the link naming it) that belongs to another user; a folder writable by others;
    a folder inside one that anybody may rename things in (world-writable without the sticky bit
    of ``/tmp``). An existing folder is not chmod'ed: it may be the user's own project folder.
    ``another``: what a refusal offers instead (in a notebook, ``%resilience dir``).
    """
    path = Path(os.path.abspath(path))
    fs = filesystem_type(path)
    if fs in PSEUDO_FILESYSTEMS:
        _refuse(path, f"is on a {fs} pseudo-filesystem (a view of the kernel, not storage)",
                "use a folder on a disk", another)
    try:
        created = not os.path.lexists(path) and _mkdir_private(path)
    except OSError as e:
        raise UnsafeDirectoryError(f"colab_resilience: {path} cannot be made ({_why_not_made(path, e)}), so nothing is "
                                   f"written there; {another}") from None
    lst = os.lstat(path)
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (os.geteuid(), 0):
        _refuse(path, f"is a symbolic link that belongs to another user (uid {lst.st_uid})", "remove it", another)
    st = os.stat(path)
    _check_owned(path, st, another)
    parent = Path(os.path.realpath(path)).parent
    pst = os.stat(parent)
    if pst.st_mode & 0o002 and not pst.st_mode & stat.S_ISVTX:
        _refuse(path, f"is in {parent}, which anybody may rename things in (mode {stat.S_IMODE(pst.st_mode):04o}, "
                      "no sticky bit)", f"fix it with: chmod +t {parent}", another)
    if created and stat.S_IMODE(st.st_mode) != 0o700:  # a umask took owner bits away
        os.chmod(path, 0o700)
    return path


def _why_not_made(path: Path, e: OSError) -> str:
    """Why ``mkdir -p path`` failed, in a few words: the file in the way, where one is."""
    if isinstance(e, (NotADirectoryError, FileExistsError)):
        for above in [path, *path.parents]:
            if os.path.lexists(above) and not os.path.isdir(above):
                return f"{above} is a file, not a folder"
    return e.strerror or str(e)


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
