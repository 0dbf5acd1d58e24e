"""The per-installation key: created owner-only, refused when others can read it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from colab_resilience import signing
from colab_resilience.errors import KeyPermissionError
from harness import child_env


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv(signing.ENV_HOME, str(h))
    return h


def test_key_created_owner_only_and_stable(home):
    """The key is created once, 32 bytes, 0600 in a 0700 folder, read back the same, no temporary
    file left."""
    key = signing.load_or_create_key()
    assert len(key) == 32
    path = signing.key_path()
    assert path == home / "key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert signing.load_or_create_key() == key
    assert [p.name for p in home.iterdir()] == ["key"]  # no temporary file left behind


def test_default_home_is_in_the_user_folder(monkeypatch):
    """Without COLAB_RESILIENCE_HOME the key lives in ~/.colab_resilience."""
    monkeypatch.delenv(signing.ENV_HOME, raising=False)
    assert signing.key_path() == signing.Path.home() / ".colab_resilience" / "key"


def test_key_readable_by_others_is_refused(home):
    """A key others can read is refused, in one line that gives the chmod to fix it."""
    signing.load_or_create_key()
    path = signing.key_path()
    os.chmod(path, 0o644)
    with pytest.raises(KeyPermissionError) as info:
        signing.load_or_create_key()
    message = str(info.value)
    assert f"chmod 600 {path}" in message and "\n" not in message


def test_key_folder_writable_by_others_is_refused(home):
    """A key folder others can write to is refused, naming chmod 700."""
    signing.load_or_create_key()
    os.chmod(home, 0o777)
    with pytest.raises(KeyPermissionError, match="chmod 700"):
        signing.load_or_create_key()


def test_key_of_wrong_size_is_refused(home):
    """A key file of the wrong size is refused, saying its size."""
    home.mkdir(mode=0o700)
    fd = os.open(home / "key", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(signing.KeyFileError, match="5 bytes"):
        signing.load_or_create_key()


def test_concurrent_first_use_agrees_on_one_key(home):
    """Processes creating the key at the same moment all end with the same key."""
    code = "from colab_resilience import signing; print(signing.load_or_create_key().hex())"
    env = child_env()
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(4)
    ]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert keys == {signing.load_or_create_key().hex()}


def test_sign_and_verify():
    """An HMAC verifies only the same bytes under the same key; no signature never verifies."""
    key = b"k" * 32
    sig = signing.sign(key, b"data")
    assert signing.verify(key, b"data", sig)
    assert not signing.verify(key, b"datA", sig)
    assert not signing.verify(b"o" * 32, b"data", sig)
    assert not signing.verify(key, b"data", None)
