"""The per-installation key that signs checkpoint manifests.

The key is 32 random bytes in ``$COLAB_RESILIENCE_HOME/key`` (default ``~/.colab_resilience/key``).
It is created owner-only from the first byte (``O_CREAT | O_EXCL`` with mode 0600, in a folder
made 0700) and published with a hard link, so no other user can ever read it and no reader ever
sees a half-written key. A key file that group or others can read or write, or a key folder that
group or others can write (they could swap the key), is refused with :class:`KeyPermissionError`
saying which ``chmod`` fixes it.

Checkpoint manifests are signed with HMAC-SHA256 under this key (:func:`sign`, :func:`verify`):
a manifest written by another installation, or edited by hand, does not verify, so nothing it
points to is unpickled unless the user explicitly trusts it. In Colab, ``~`` is lost with the VM;
point ``COLAB_RESILIENCE_HOME`` at a Drive folder to keep trusting checkpoints kept on Drive.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from . import fsutil
from .errors import KeyFileError, KeyPermissionError

KEY_BYTES = 32
ENV_HOME = "COLAB_RESILIENCE_HOME"

def home() -> Path:
    """The folder holding the installation key: ``$COLAB_RESILIENCE_HOME`` or ``~/.colab_resilience``."""
    env = os.environ.get(ENV_HOME)
    return Path(env).expanduser() if env else Path.home() / ".colab_resilience"


def key_path() -> Path:
    """Where the installation key lives (it may not exist yet)."""
    return home() / "key"


def _check_folder(folder: Path) -> None:
    st = folder.stat()
    if st.st_mode & 0o022:
        raise KeyPermissionError(
            f"colab_resilience: key folder {folder} is writable by other users "
            f"(mode {stat.S_IMODE(st.st_mode):04o}), so the key could be replaced; "
            f"fix it with: chmod 700 {folder}"
        )


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | fsutil.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"colab_resilience: key {path} is not a regular file; remove it")
        if st.st_mode & 0o077:
            raise KeyPermissionError(
                f"colab_resilience: key file {path} is accessible by other users "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); fix it with: chmod 600 {path}"
            )
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise KeyPermissionError(
                f"colab_resilience: key file {path} belongs to another user (uid {st.st_uid}); "
                f"remove it or set {ENV_HOME} to a folder of your own"
            )
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise KeyFileError(
            f"colab_resilience: key file {path} holds {len(data)} bytes, not {KEY_BYTES}; "
            "remove it to make a new key (checkpoints signed by the old one will need trust=True)"
        )
    return data


def load_or_create_key() -> bytes:
    """Return this installation's key, creating it (owner-only, atomically) on first use."""
    path = key_path()
    folder = path.parent
    if not folder.exists():
        fsutil.make_private_dir(folder)
    _check_folder(folder)
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    tmp = folder / f".key-{os.getpid()}-{secrets.token_hex(4)}"
    fsutil.write_new(tmp, secrets.token_bytes(KEY_BYTES))  # mode 0600 from the first byte
    try:
        try:
            os.link(tmp, path)  # fails if another process published a key first: use theirs
        except FileExistsError:
            pass
        except OSError as e:  # a file system without hard links (some FUSE mounts)
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            if not path.exists():
                os.rename(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    try:
        fsutil.fsync_dir(folder)
    except OSError:
        pass
    return _read_key(path)


def sign(key: bytes, data: bytes) -> str:
    """HMAC-SHA256 of ``data`` under ``key``, as hex."""
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def verify(key: bytes, data: bytes, sig: object) -> bool:
    """Whether ``sig`` is the HMAC of ``data`` under ``key`` (constant time; any non-str is False)."""
    if not isinstance(sig, str):
        return False
    return hmac.compare_digest(sign(key, data), sig)
