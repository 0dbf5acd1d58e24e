"""Run directories nobody else controls, journals bound to their run, trust that shows what it runs.

Each test plays the attack for real: a second user (uid 54321 through ``setpriv``) prepares
folders and links where a run will write, journals are moved between run folders and old copies
put back, a run signed under another key is resumed. What must hold: an ordinary ``%%resilient``
cell refuses in one line and leaves the other side's files exactly as they were, and no set-up
cell of a journal that is not this run's newest ever executes.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from colab_resilience import replay, signing
from colab_resilience.checkpoints import CheckpointStore
from colab_resilience.errors import JournalError
from colab_resilience.journal import Journal, ReplayCell
from colab_resilience.fsutil import canonical_json
from colab_resilience.run import run_id_for
from payloads import Opaque

OTHER_UID = 54321
FOREIGN_KEY = b"\x07" * 32
BODY = "ran_body = True\n"


def one_line(text: str) -> bool:
    return bool(text.strip()) and "\n" not in text.strip()


def as_other_user(script: str) -> None:
    """Run ``script`` (sh) as uid/gid 54321, no supplementary groups: another user of this machine
    (the test is skipped, saying why, where this process may not become another user)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("acting as a second user needs root and setpriv (util-linux)")
    subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                    "sh", "-ec", script], check=True, capture_output=True, text=True)


def cell_run_id(body: str = BODY, line: str = "") -> str:
    """The run id the in-process shell gives the ``%%resilient {line}`` cell ``body``."""
    return run_id_for(replay.source_key(f"%%resilient {line}".rstrip() + "\n" + body))


def snapshot(folder: Path) -> dict:
    """Everything about ``folder`` a write, truncation or chmod would change."""
    out = {".": stat.S_IMODE(folder.stat().st_mode)}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (stat.S_IMODE(st.st_mode), st.st_size, st.st_uid,
                                           p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    return out


@pytest.fixture
def base():
    """A folder the other user can pass through (pytest's own temporary folders are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="cr-private-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def mine(base):
    """A folder of this user's with a 15-byte file in it: what an attack would redirect writes to."""
    folder = base / "mine"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    (folder / "notes.txt").write_bytes(b"fifteen bytes!\n")
    return folder


def refused(ip, run_dir_setting: str) -> str:
    """Run an ordinary %%resilient cell with runs kept in ``run_dir_setting`` (set as the
    configuration would, without `%resilience dir`'s check); return its one-line refusal."""
    ip.magics_manager.registry["ResilienceMagics"].run_dir = run_dir_setting
    ip.user_ns.pop("ran_body", None)
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("resilient", "", BODY)
    said = str(info.value)
    assert one_line(said), said
    assert "ran_body" not in ip.user_ns  # refused before any of the cell ran
    return said


# -- 1. folders and files another user prepared -------------------------------------------------------


def test_a_run_root_made_by_another_user_is_refused_and_nothing_is_written(ip, base, mine):
    """Another user pre-creates the run root in a shared sticky folder (like /tmp) with the cell's
    run folder as a link to a folder of ours: `%resilience dir` and the cell both refuse, naming
    the owner, and our folder keeps its mode and content."""
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    runs = shared / "runs"
    as_other_user(f"mkdir -m 777 {runs} && ln -s {mine} {runs}/run-{cell_run_id()}")
    before = snapshot(mine)
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", f"dir {runs}")
    assert one_line(str(info.value)) and f"belongs to another user (uid {OTHER_UID})" in str(info.value)
    said = refused(ip, str(runs))
    assert f"{runs} belongs to another user (uid {OTHER_UID})" in said and "%resilience dir" in said
    assert snapshot(mine) == before


@pytest.mark.parametrize("attack", ["run folder is a link", "lock is a link", "run folder is theirs",
                                    "root writable by all"])
def test_a_prepared_run_folder_or_lock_file_is_refused_and_its_target_untouched(ip, base, mine, attack):
    """In a run root of ours, the cell's run folder planted as a link to our folder, its lock file
    as a link to our file, the run folder made by another user, or the root left writable by all
    (anyone could plant those): refused in one line; the link's target is neither truncated nor
    chmod'ed nor filled with checkpoints."""
    runs = base / "runs"
    runs.mkdir(mode=0o700)
    run_dir = runs / f"run-{cell_run_id()}"
    if attack == "run folder is a link":
        run_dir.symlink_to(mine)
        expect = "is a symbolic link where a folder of this run belongs"
    elif attack == "lock is a link":
        run_dir.mkdir(mode=0o700)
        (run_dir / "lock").symlink_to(mine / "notes.txt")
        expect = "lock is a symbolic link, not a file of yours"
    elif attack == "run folder is theirs":
        os.chmod(runs, 0o777)  # as it was when they came by
        as_other_user(f"mkdir -m 700 {run_dir}")
        os.chmod(runs, 0o700)
        expect = f"belongs to another user (uid {OTHER_UID})"
    else:
        os.chmod(runs, 0o777)
        expect = "is writable by other users (mode 0777)"
    before = snapshot(mine)
    said = refused(ip, str(runs))
    assert expect in said, said
    assert snapshot(mine) == before
    assert (mine / "notes.txt").read_bytes() == b"fifteen bytes!\n"


def test_pseudo_filesystems_are_refused_as_run_directories(ip):
    """`%resilience dir /proc` (or anything under /proc or /sys) is refused in one line that says
    why, and the setting stays as it was."""
    magics = ip.magics_manager.registry["ResilienceMagics"]
    before = magics.run_dir
    for folder in ["/proc", "/proc/self", "/sys/kernel", "/proc/colab_resilience_runs"]:
        with pytest.raises(UsageError) as info:
            ip.run_line_magic("resilience", f"dir {folder}")
        said = str(info.value)
        assert one_line(said) and "pseudo-filesystem" in said and "a folder on a disk" in said, said
        assert magics.run_dir == before


def test_a_run_directory_under_a_file_is_refused_in_one_line_and_the_file_kept(ip, tmp_path):
    """A run directory (COLAB_RESILIENCE_RUN_DIR, the configuration) whose path runs through a
    file: the cell was a NotADirectoryError traceback; now one line names the file in the way."""
    (tmp_path / "notes.txt").write_bytes(b"fifteen bytes!\n")
    said = refused(ip, str(tmp_path / "notes.txt" / "runs"))
    assert said == (f"colab_resilience: {tmp_path / 'notes.txt' / 'runs'} cannot be made ({tmp_path / 'notes.txt'} is a "
                    "file, not a folder), so nothing is written there; choose another run directory with %resilience dir")
    assert (tmp_path / "notes.txt").read_bytes() == b"fifteen bytes!\n"


def test_run_ids_cannot_be_computed_without_the_installation_key():
    """A cell's run id is the same in every kernel of one installation, but another user, who
    does not have the key, cannot work it out from the cell (it used to be sha256 of the cell)."""
    import hashlib

    cell = "%%resilient --save model\ntrain()\n"
    mine_ = run_id_for(cell)
    assert mine_ == run_id_for(cell, signing.load_or_create_key())
    assert run_id_for(cell, FOREIGN_KEY) != mine_
    assert mine_ != hashlib.sha256(cell.encode()).hexdigest()[:8]


# -- 2. journals bound to their run -----------------------------------------------------------------


def pending_journal(root: Path, run_id: str, setup: str) -> Journal:
    """A pending run left by a kernel that died (pid 1 is never this process), whose set-up cell
    is ``setup``, signed by this installation."""
    j = Journal.create(root / f"run-{run_id}", run_id, save=False, kernel_pid=1, counted_pid=1)
    j.replay_cells = [ReplayCell("setup", "%%replay\n" + setup)]
    j.save()
    return j


def test_a_signed_journal_moved_into_another_run_is_refused(ip, tmp_path):
    """Run A's journal (signed here, with A's set-up cell) copied over the journal of the cell's
    own run B: the cell and `%resilience resume` refuse it in one line, and A's set-up cell does
    not execute."""
    runs = tmp_path / "runs"
    canary = tmp_path / "canary"
    a = pending_journal(runs, "aaaaaaaa", f"open({str(canary)!r}, 'w').close()")
    b = pending_journal(runs, cell_run_id(), "pass")
    shutil.copyfile(a.path, b.path)
    said = refused(ip, str(runs))
    assert "is the journal of run 'aaaaaaaa'" in said and "moved or copied from another run" in said, said
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", f"resume {b.run_id}")
    assert one_line(str(info.value)) and "moved or copied from another run" in str(info.value)
    with pytest.raises(JournalError, match="moved or copied from another run") as info:
        Journal.load(b.run_dir, key=signing.load_or_create_key())
    assert type(info.value).__name__ == "JournalRolledBackError"
    assert not canary.exists()


def test_an_older_copy_of_a_journal_put_back_is_refused(ip, tmp_path, capsys):
    """An old journal of the run (validly signed, with the set-up cell the user has since
    replaced) put back over the newest: refused in one line naming both generations; the old
    set-up cell does not execute. The newest journal put back is accepted again."""
    runs = tmp_path / "runs"
    canary = tmp_path / "canary"
    j = pending_journal(runs, cell_run_id(), f"open({str(canary)!r}, 'w').close()")
    old = j.path.read_bytes()
    j.replay_cells = [ReplayCell("setup", "%%replay\nsetup_ran = True")]
    j.save()
    j.save()
    newest = j.path.read_bytes()
    j.path.write_bytes(old)
    said = refused(ip, str(runs))
    assert "is generation 1 of its run, older than generation 3 this installation wrote" in said, said
    assert not canary.exists()
    j.path.write_bytes(newest)
    ip.run_cell_magic("resilient", "", BODY)
    assert ip.user_ns.get("setup_ran") is True and ip.user_ns.get("ran_body") is True
    assert not canary.exists()
    assert json.loads(j.path.read_text())["generation"] > 3


def test_colab_resilience_show_refuses_an_older_copy_before_its_review(tmp_path, capsys):
    """`colab-resilience show` of a run whose journal is an older copy put back: one line on
    stderr naming both generations, exit 2, and no review of set-up cells that nothing will run
    (it printed the review, then refused)."""
    from colab_resilience import cli

    runs = tmp_path / "runs"
    j = pending_journal(runs, cell_run_id(), "old_setup = 1")
    old = j.path.read_bytes()
    j.save()
    j.path.write_bytes(old)
    capsys.readouterr()
    assert cli.main(["show", j.run_id, "--run-dir", str(runs)]) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert one_line(err.rstrip("\n")) and err.startswith("colab-resilience show: ") and \
        "is generation 1 of its run, older than generation 2 this installation wrote" in err, err


def test_a_reset_run_starts_above_the_generations_already_signed(tmp_path):
    """After `%resilience reset` removed a run folder, the run's new journal continues the
    generations (it is not refused as older than the one that was removed)."""
    key = signing.load_or_create_key()
    run_dir = tmp_path / "run-r1"
    j = Journal.create(run_dir, "r1")
    j.save()
    shutil.rmtree(run_dir)
    again = Journal.create(run_dir, "r1")
    assert again.generation == 3
    assert Journal.load(run_dir, key=key).generation == 3


# -- 3. trusting a run shows all of it first ----------------------------------------------------------


SETUP_1 = "%%replay\nimport os\nprint('SETUP-1 RAN')\nlong_name_for_a_value = 41 + 1\n"


def foreign_run(root: Path, canary: Path) -> str:
    """A run written under another installation's key: two set-up cells (the second creates
    ``canary``) and a checkpoint holding a pickled value."""
    run_id = "f0reign1"
    run_dir = root / f"run-{run_id}"
    j = Journal.create(run_dir, run_id, save=False, names=["p"], status="failed")
    j.replay_cells = [ReplayCell("c1", SETUP_1),
                      ReplayCell("c2", f"%%replay\n# the second cell\nopen({str(canary)!r}, 'w').close()\nprint('SETUP-2 RAN')")]
    data = j.to_dict()
    data["generation"] = 1
    data["signature"] = signing.sign(FOREIGN_KEY, canonical_json(data))
    j.path.write_text(json.dumps(data))
    CheckpointStore(run_dir / "checkpoints", key=FOREIGN_KEY, run_id=run_id).save({"p": Opaque(7)}, ["p"])
    return run_id


def test_trust_prints_every_set_up_cell_and_pickle_before_anything_runs(ip, tmp_path, capsys):
    """Without --trust the refusal says how many set-up cells would run, how they begin and how to
    review them; `%resilience show` prints every cell in full and every pickled value's name and
    type and runs nothing; `--trust` prints the same before the first cell runs, then runs them
    (the RUN may come before or after the flag)."""
    runs = tmp_path / "runs"
    canary = tmp_path / "canary"
    run_id = foreign_run(runs, canary)
    ip.run_line_magic("resilience", f"dir {runs}")

    with pytest.raises(UsageError) as info:
        ip.run_line_magic("resilience", f"resume {run_id}")
    said = str(info.value)
    assert one_line(said)
    assert "its 2 set-up cells (beginning: 'import os'; '# the second cell') did not run" in said, said
    assert f"review them with `%resilience show {run_id}`" in said
    assert not canary.exists()

    capsys.readouterr()
    ip.run_line_magic("resilience", f"show {run_id}")
    shown = capsys.readouterr().out
    assert SETUP_1.rstrip("\n") in shown and f"open({str(canary)!r}, 'w').close()\nprint('SETUP-2 RAN')" in shown
    assert "  p: payloads.Opaque (in ckpt-000001)" in shown
    assert f"nothing was run; `%resilience resume --trust {run_id}` runs this, `%resilience reset {run_id}` forgets it" \
        in shown and "RAN\n" not in shown.replace("print('SETUP-1 RAN')", "").replace("print('SETUP-2 RAN')", "")
    assert not canary.exists()

    ip.run_line_magic("resilience", f"resume --trust {run_id}")
    out = capsys.readouterr().out
    listing = out.index("print('SETUP-1 RAN')")
    assert listing < out.index("long_name_for_a_value = 41 + 1") < out.index("p: payloads.Opaque")
    # a replayed cell's own output is kept back unless it fails; each says it ran, in order
    assert out.index("p: payloads.Opaque") < out.index("replayed import os") < out.index("replayed # the second cell")
    assert canary.exists() and ip.user_ns["p"].v == 7 and ip.user_ns["long_name_for_a_value"] == 42



def test_show_of_a_run_signed_here_names_resume_without_trust(ip, tmp_path, capsys):
    """`%resilience show` of a run this installation wrote and signed: resuming it needs no
    --trust, and a done run's final state is what comes back (it named `resume --trust`, whatever
    the run)."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\nhistory = []")
    assert ip.run_cell("%%resilient --save history\nfor i in resume_range(2):\n    history.append(i)").success
    run_id = next((tmp_path / "runs").glob("run-*")).name.removeprefix("run-")
    capsys.readouterr()
    ip.run_line_magic("resilience", f"show {run_id}")
    assert (f"colab_resilience: nothing was run; `%resilience resume {run_id}` runs this (the run is done: its final "
            f"state comes back), `%resilience reset {run_id}` forgets it") in capsys.readouterr().out


def test_the_startup_file_is_never_written_through_a_link(ip, base, mine):
    """The IPython startup file that brings the extension into the next kernel is written through
    a new temporary file: a link left where the temporary file used to be (`.tmp` beside it) is not
    followed, and its target keeps its 15 bytes."""
    from colab_resilience import restart

    path = restart.startup_path(ip)
    path.parent.mkdir(parents=True, exist_ok=True)
    planted = path.with_suffix(".tmp")
    planted.symlink_to(mine / "notes.txt")
    try:
        ip.magics_manager.registry["ResilienceMagics"].run_dir = str(base / "runs")
        ip.run_cell_magic("resilient", "", BODY)
        assert (mine / "notes.txt").read_bytes() == b"fifteen bytes!\n"
        assert planted.is_symlink()
    finally:
        planted.unlink()
        restart.remove_startup_file_if_idle(ip, base / "runs")
