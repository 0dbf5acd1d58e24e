"""Folders in the temporary directory left by a process killed with SIGKILL are removed by the
next one, and nothing else is: a live process's, a folder being made, an older version's, a link,
another user's, other names."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from colab_resilience import tempdirs
from harness import KERNEL_NAME, notebook

OTHER_UID = 54321
HOLD = """
import sys, time
from colab_resilience.tempdirs import TempFolder
for kind in sys.argv[1:]:
    f = TempFolder(kind)
    open(f.path + "/checkpoint", "wb").write(b"x" * 4096)
    print(f.path, flush=True)
time.sleep(600)
"""


def holder(tmp: Path, *kinds: str) -> tuple[subprocess.Popen, list[str]]:
    """A process that makes folders of ``kinds`` in ``tmp`` and lives until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, *kinds], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    return proc, [proc.stdout.readline().strip() for _ in kinds]


@pytest.fixture
def tmp():
    """A temporary directory of this test's own (TMPDIR), short enough for socket paths."""
    folder = Path(tempfile.mkdtemp(prefix="cr-tmp-"))
    os.chmod(folder, 0o1777)  # as /tmp: another user may make folders in it
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def ours(tmp: Path) -> list[str]:
    return sorted(n for n in os.listdir(tmp) if n.startswith(tempdirs.PREFIX))


def test_the_folders_of_a_killed_process_go_and_nothing_else(tmp, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    killed, stale = holder(tmp, *tempdirs.KINDS)
    alive, (live,) = holder(tmp, "check")
    try:
        assert all(os.path.isfile(f"{p}/checkpoint") for p in stale + [live])
        killed.kill()
        killed.wait()
        young = tempfile.mkdtemp(prefix="colab-resilience-check-")  # no lock yet: being made
        old_check = tempfile.mkdtemp(prefix="colab-resilience-runs-")  # no lock: an older version's, maybe alive
        old_worker = tempfile.mkdtemp(prefix="colab-resilience-worker-1-")  # no lock: from before the lock
        for folder in (old_check, old_worker):
            os.utime(folder, (time.time() - 120, time.time() - 120))
        target = tmp / "elsewhere"
        target.mkdir()
        (target / tempdirs.LOCK).write_bytes(b"")
        (target / "keep").write_bytes(b"data")
        link = tmp / "colab-resilience-runs-link"
        link.symlink_to(target)
        other_name = tempfile.mkdtemp(prefix="colab-resilience-checks-")
        Path(other_name, tempdirs.LOCK).write_bytes(b"")
        foreign = tmp / "colab-resilience-check-foreign"
        if os.geteuid() == 0 and shutil.which("setpriv"):  # another user's folder, its lock free
            subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "sh", "-ec",
                            f"mkdir -m 700 {foreign} && touch {foreign}/{tempdirs.LOCK}"], check=True)

        made = tempdirs.TempFolder("kernel")  # the next folder this package makes
        try:
            assert not [p for p in stale if os.path.exists(p)], "a killed process's folder stayed"
            assert os.path.isfile(f"{live}/checkpoint") and os.path.isdir(young) and os.path.isdir(old_check)
            assert not os.path.exists(old_worker)
            assert link.is_symlink() and (target / "keep").read_bytes() == b"data"
            assert os.path.isdir(other_name)
            if foreign.exists():
                assert (foreign / tempdirs.LOCK).exists()
        finally:
            made.remove()
        assert not os.path.exists(made.path)
    finally:
        alive.kill()
        alive.wait()


def test_a_supervisor_killed_with_sigkill_leaves_its_folders_to_the_next_run(tmp):
    """`colab-resilience run` and its kernel killed mid-run (the OOM killer, a CI job's timeout):
    its sockets and its run directory, checkpoint included, stay in the temporary directory until
    the next `colab-resilience run` removes them; that one leaves nothing behind."""
    marker = tmp / "kernel.pid"
    nb = notebook("%load_ext colab_resilience", "%%resilient --save x\nx = list(range(1000))",
                  f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp / "slow.ipynb")
    env = {**os.environ, "TMPDIR": str(tmp)}
    run = [sys.executable, "-m", "colab_resilience", "run", "--no-progress", "--no-standby"]
    proc = subprocess.Popen([*run, str(tmp / "slow.ipynb"), "-o", str(tmp / "slow-out.ipynb")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before its last cell"
            time.sleep(0.1)
        kernel = int(marker.read_text())
    finally:
        proc.kill()
        proc.wait()
    os.kill(kernel, signal.SIGKILL)
    left = ours(tmp)
    # nothing else: the kernel's connection file (its signing key) lies in its sockets' folder
    assert sorted(set(os.listdir(tmp)) - set(left)) == ["kernel.pid", "slow.ipynb"]
    assert [n for n in left if n.startswith("colab-resilience-kernel-")], left
    (runs,) = [tmp / n for n in left if n.startswith("colab-resilience-runs-")]
    assert any(p.is_file() for p in runs.rglob("*") if p.name != tempdirs.LOCK), "no checkpoint was written"

    nbformat.write(notebook("print(1)"), tmp / "quick.ipynb")
    r = subprocess.run([*run, str(tmp / "quick.ipynb"), "--kernel", KERNEL_NAME], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ours(tmp) == []
