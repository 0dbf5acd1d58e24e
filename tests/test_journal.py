"""The run journal (atomic, validated) and the run-directory lock (real second processes)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from colab_resilience.errors import JournalError, JournalNotFoundError, RunLockedError
from colab_resilience.journal import Journal, ReplayCell
from colab_resilience.lock import RunLock
from harness import child_env



def test_create_save_load_round_trip(tmp_path):
    """Everything a journal records reads back the same (replay cells in first-run order, the first
    line of a restart's reason); owner-only files, no temporary file left."""
    run = tmp_path / "run"
    j = Journal.create(run, "r1", max_restarts=5)
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE(j.path.stat().st_mode) == 0o600
    j.add_replay_cell("c1", "import torch")
    j.add_replay_cell("c2", "model = Net()")
    j.add_replay_cell("c1", "import torch, numpy")  # same cell again keeps its place
    j.interrupted_cell = "for e in resume_range(3): train()"
    j.set_checkpoint("ckpt-000004")
    left = j.record_restart("CUDA out of memory. Tried to allocate 2 GiB\nmore text")
    assert left == 4
    back = Journal.load(run)
    assert back.run_id == "r1" and back.status == "pending"
    assert back.replay_cells == [ReplayCell("c1", "import torch, numpy"), ReplayCell("c2", "model = Net()")]
    assert back.interrupted_cell.startswith("for e")
    assert back.last_checkpoint == "ckpt-000004"
    assert back.restarts_used == 1 and back.max_restarts == 5
    assert back.restarts[0].reason == "CUDA out of memory. Tried to allocate 2 GiB"
    assert back.kernel_pid == os.getpid()
    assert back.created <= back.updated
    back.set_status("done")
    assert Journal.load(run).status == "done"
    assert sorted(p.name for p in run.iterdir()) == ["journal.json"]  # no temporary files left


def test_the_kernels_that_held_a_run_are_told_apart_by_more_than_their_pid(tmp_path):
    """A run records each kernel that held it, by its PID and a token drawn once in that process: a
    PID is reused (a fresh Colab VM's kernel often has an earlier one's), and a kernel that resumes
    a run puts back what finished in the kernels before it, no other's. A forked process draws its
    own; the list reads back; one that is not strings is refused in one line."""
    from colab_resilience.journal import kernel_identity

    j = Journal.create(tmp_path, "r")
    me = kernel_identity()
    assert j.kernels == [me] and me.startswith(f"{os.getpid()}-") and j.held_before == []
    j.kernels = ["1234-00ff00ff00ff00ff"]  # the kernel that died
    j.held_here()
    j.held_here()  # held again by the same kernel: listed once
    j.save()
    back = Journal.load(tmp_path)
    assert back.kernels == ["1234-00ff00ff00ff00ff", me] and back.held_before == ["1234-00ff00ff00ff00ff"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own identity, not its parent's
        os.write(write, kernel_identity().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    assert child.startswith(f"{pid}-") and child != me
    data = back.to_dict()
    data["kernels"] = [1234]
    j.path.write_text(json.dumps(data))
    with pytest.raises(JournalError, match="the kernels that held the run are not strings"):
        Journal.load(tmp_path)


def test_missing_journal(tmp_path):
    """A folder without a journal says so."""
    assert not Journal.exists(tmp_path)
    with pytest.raises(JournalNotFoundError, match="no run journal"):
        Journal.load(tmp_path)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"format": "someone.else"}).encode(), "format"),
        (None, "field 'restarts_used' is missing"),
        ("wrongtype", "field 'max_restarts' is str"),
        ("badstatus", "status 'paused'"),
        ("newer", "format version"),
    ],
)
def test_damaged_or_foreign_journal_is_refused_clearly(tmp_path, content, why):
    """A journal that is not a JSON object, another program's, lacks a field, has a wrong type or
    status, or comes from a newer version is refused in one line that says why."""
    j = Journal.create(tmp_path, "r")
    data = j.to_dict()
    if content is None:
        del data["restarts_used"]
        content = json.dumps(data).encode()
    elif content == "wrongtype":
        data["max_restarts"] = "3"
        content = json.dumps(data).encode()
    elif content == "badstatus":
        data["status"] = "paused"
        content = json.dumps(data).encode()
    elif content == "newer":
        data["format_version"] = 99
        content = json.dumps(data).encode()
    j.path.write_bytes(content)
    with pytest.raises(JournalError) as info:
        Journal.load(tmp_path)
    assert why in str(info.value) and "\n" not in str(info.value)


def test_bad_status_is_refused_before_writing(tmp_path):
    """An unknown status is refused before anything is written."""
    j = Journal.create(tmp_path, "r")
    with pytest.raises(ValueError):
        j.set_status("paused")
    assert Journal.load(tmp_path).status == "pending"


def test_atomic_write_keeps_old_content_when_interrupted(tmp_path):
    """A writer SIGKILLed mid-write never leaves a torn journal."""
    Journal.create(tmp_path, "r")
    code = (
        "import sys, os, signal\n"
        "from colab_resilience.journal import Journal\n"
        "import colab_resilience.fsutil as jm\n"
        f"j = Journal.load({str(tmp_path)!r})\n"
        "j.interrupted_cell = 'x' * 5_000_000\n"
        "orig = jm.write_all\n"
        "def dying(fd, data):\n"
        "    orig(fd, bytes(data)[:1000])\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "jm.write_all = dying\n"
        "j.save()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=child_env())
    assert proc.returncode == -signal.SIGKILL
    assert Journal.load(tmp_path).interrupted_cell is None


def _started(code: str, ready_file) -> subprocess.Popen:
    """A Python process running ``code``, once it has written ``ready_file`` (whole)."""
    proc = subprocess.Popen([sys.executable, "-c", code], env=child_env())
    deadline = time.time() + 30
    while not ready_file.exists() or not ready_file.read_text():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    return proc


def _holder(run_dir, ready_file):
    return _started(
        "import sys, time, pathlib\n"
        "from colab_resilience.lock import RunLock\n"
        f"lock = RunLock({str(run_dir)!r}, create=True).acquire()\n"
        f"pathlib.Path({str(ready_file)!r}).write_text('ok')\n"
        "time.sleep(60)\n", ready_file)


def test_lock_held_by_another_process_names_its_pid(tmp_path):
    """A run locked by another live process is refused naming that PID; once that process is
    SIGKILLed the lock is free."""
    run = tmp_path / "run"
    proc = _holder(run, tmp_path / "ready")
    try:
        with pytest.raises(RunLockedError) as info:
            RunLock(run).acquire()
        assert info.value.pid == proc.pid
        assert f"process {proc.pid}" in str(info.value)
    finally:
        proc.kill()
        proc.wait()
    # SIGKILL released it: the kernel drops a dead holder's flock
    with RunLock(run) as lock:
        assert lock.held
        assert (run / "lock").read_text().strip() == str(os.getpid())


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_is_killed(tmp_path):
    """A DataLoader worker is a child the kernel forked, which shares the kernel's open files: the
    run's lock must go with the kernel (SIGKILL), not wait for the worker, or the kernel that
    takes over is refused ("in use by process ..."). The child still runs when the lock is taken.
    The child says it is ready itself: by then ``os.fork`` has returned in it, after its at-fork
    hooks (a child the scheduler has not run yet still holds the parent's open files)."""
    run, ready = tmp_path / "run", tmp_path / "ready"
    code = (
        "import os, time, pathlib\n"
        "from colab_resilience.lock import RunLock\n"
        f"lock = RunLock({str(run)!r}, create=True).acquire()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        f"    pathlib.Path({str(ready) + '.part'!r}).write_text(str(os.getpid()))\n"
        f"    os.rename({str(ready) + '.part'!r}, {str(ready)!r})\n"
        "    time.sleep(60); os._exit(0)\n"
        "time.sleep(60)\n"
    )
    proc = _started(code, ready)
    child = int(ready.read_text())
    try:
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # alive: it would hold the lock if it had kept the file open
        with RunLock(run) as lock:
            assert lock.held
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("closes_after", [0.5, None], ids=["child-closes-late", "child-keeps-it"])
def test_a_lock_whose_holder_died_waits_a_moment_for_its_children(tmp_path, closes_after):
    """A child that holds a copy of the lock's open file after its holder was killed (one forked
    that the scheduler had not run yet, which closes it as soon as it runs) delays the kernel that
    takes over by a moment, not refuses it; a child that keeps it is named as what holds it."""
    run, ready = tmp_path / "run", tmp_path / "ready"
    child_code = (
        "import os, sys, time\n"
        f"delay = {closes_after!r}\n"
        "time.sleep(delay or 60)\n"
        "os.close(int(sys.argv[1]))\n"
        "time.sleep(60)\n"
    )
    code = (
        "import os, sys, subprocess, pathlib\n"
        "from colab_resilience.lock import RunLock, _held\n"
        f"lock = RunLock({str(run)!r}, create=True).acquire()\n"
        "fd = next(iter(_held.values()))[0]\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}, str(fd)], pass_fds=[fd])\n"
        f"pathlib.Path({str(ready)!r}).write_text(str(child.pid))\n"
        "import time; time.sleep(60)\n"
    )
    proc = _started(code, ready)
    child = int(ready.read_text())
    try:
        proc.kill()
        proc.wait()
        if closes_after is None:
            with pytest.raises(RunLockedError, match="started and left running when it exited; stop it or"):
                RunLock(run).acquire()
        else:
            with RunLock(run) as lock:
                assert lock.held
    finally:
        os.kill(child, signal.SIGKILL)


def test_lock_is_reentrant_in_one_process_and_released_on_close(tmp_path):
    """One process may take its own run's lock twice; another process is refused until the last
    holder releases it."""
    run = tmp_path / "run"
    a = RunLock(run, create=True).acquire()
    b = RunLock(run).acquire()  # same process: fine
    a.release()
    code = (
        "from colab_resilience.lock import RunLock\n"
        "from colab_resilience.errors import RunLockedError\n"
        f"try:\n    RunLock({str(run)!r}, create=True).acquire(); print('got')\n"
        "except RunLockedError as e:\n    print('locked', e.pid)\n"
    )
    env = child_env()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
    assert out.split() == ["locked", str(os.getpid())]  # b still holds it
    b.release()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
    assert out.strip() == "got"


def test_a_version_1_journal_is_read_as_typed_fields(tmp_path):
    """A run left pending by the previous version (free-form ``extra``) resumes after an upgrade:
    its fields come back typed, and it is written back as version 2."""
    from colab_resilience import fsutil, signing
    from colab_resilience.journal import RestartPolicy

    run = tmp_path / "run-r1"
    j = Journal.create(run, "r1", save=False)
    data = {k: v for k, v in j.to_dict().items()
            if k not in ("cell_key", "names", "shrink", "policy", "restart_requested", "phase", "generation")}
    data["format_version"] = 1
    data["restarts"] = [{"reason": "CUDA out of memory", "time": 1.0, "at": "3"}]
    data["extra"] = {"names": ["model", "opt", 7], "shrink": {"bs": 32, "bad": None},
                     "policy": {"every": 2, "memory_percent": None}, "cell_key": "c9",
                     "restart_requested": True, "phase": "replay"}
    data["signature"] = signing.sign(signing.load_or_create_key(), fsutil.canonical_json(data))
    j.path.write_text(json.dumps(data))
    back = Journal.load(run, key=signing.load_or_create_key())
    assert (back.names, back.shrink, back.cell_key) == (["model", "opt"], {"bs": 32}, "c9")
    assert back.policy == RestartPolicy(2, None)
    assert back.restart_requested is True and back.phase == "replay"
    assert back.restarts[0].reason == "CUDA out of memory" and back.restarts[0].at == "3"
    back.save()
    assert json.loads(j.path.read_text())["format_version"] == 2
    assert Journal.load(run, key=signing.load_or_create_key()).names == ["model", "opt"]


def test_the_driver_reads_restart_requests_through_the_journal(tmp_path):
    """What a supervisor learns after a death comes from the typed journal: the newest pending
    run's requested restart, and whether a run failed on its budget."""
    from colab_resilience.journal import RestartRecord, budget_refused, requested_restart

    a = Journal.create(tmp_path / "run-a", "a")
    a.restarts.append(RestartRecord("planned restart after 2 safe points", planned=True, at="4"))
    a.restart_requested = True
    a.save()
    assert requested_restart(tmp_path).at == "4" and not budget_refused(tmp_path)
    b = Journal.create(tmp_path / "run-b", "b")  # newer, pending, but it did not ask: a death
    b.record_restart("the kernel died without warning")
    assert requested_restart(tmp_path) is None
    b.restarts.append(RestartRecord("CUDA out of memory", refused=True))
    b.set_status("failed")
    assert budget_refused(tmp_path)
    (tmp_path / "run-c").mkdir()
    (tmp_path / "run-c" / "journal.json").write_text("{damaged")  # left out, never a crash
    assert requested_restart(tmp_path).reason == "planned restart after 2 safe points"


def test_a_runs_cell_code_is_compared_line_by_line_but_for_spaces_at_line_ends():
    """What the line for a cell edited since its run began quotes (:func:`run.code_change`): the
    first changed line by its number in the new code, old and new, or added, or removed; a long
    line cut; spaces at line ends and blank lines at the end are no change."""
    from colab_resilience.run import code_change

    cell = "%%resilient --save model\nfor epoch in resume_range(5):\n    train(model)\n"
    assert code_change(cell, cell.replace("\n", "  \n") + "\n\n") is None
    assert code_change(None, cell) is None
    assert code_change(cell, cell.replace("train(model)", "train(model, lr)")) == (
        "line 3 was 'train(model)', is 'train(model, lr)'")
    assert code_change(cell, cell + "    evaluate(model)\n") == "line 4, 'evaluate(model)', was added"
    assert code_change(cell, cell.replace("    train(model)\n", "")) == "line 3, 'train(model)', was removed"
    long = "x" * 100
    assert code_change(cell, cell.replace("5", "6").replace("train(model)", long)) == (
        "line 2 was 'for epoch in resume_range(5):', is 'for epoch in resume_range(6):'; 2 lines differ")
    assert code_change(cell, cell.replace("train(model)", long)) == f"line 3 was 'train(model)', is '{'x' * 57}...'"
