"""A run folder from the command line, as the ``%resilience`` magics handle it in a notebook:
``colab-resilience reset``, ``show`` and ``resume [--trust]`` (:mod:`.cli` parses, these act).

A headless run's lines that advise a magic name these commands instead (:func:`.words.headless`).
Nothing here runs a cell: ``resume`` marks a run to go on, and the next ``colab-resilience run``
of its notebook runs its set-up cells and restores its newest checkpoint, as after a kernel death.
Each command takes the run's lock (a kernel that holds it is named), and each refusal is one line
on stderr with exit status 2 that says what to do.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .driver import EXIT_OK, EXIT_USAGE
from .errors import JournalError, JournalUntrustedError, RunLockedError, UnsafeDirectoryError
from .journal import Journal, find_runs, read_journals
from .lock import RunLock
from .words import headless, plural


class Refused(Exception):
    """What the command says on stderr, in one line, before it exits with status 2."""


def refusing(command: str, act) -> int:
    """``act()``'s exit status, or 2 after its refusal's line, ``colab-resilience COMMAND: ...``."""
    try:
        return act()
    except Refused as e:
        print(f"colab-resilience {command}: {e}", file=sys.stderr)
        return EXIT_USAGE


def run_named(command: str, run: str | None, run_dir: str | None, *, lock: bool = True) -> tuple[Path, RunLock | None]:
    """The run folder ``run`` names under ``run_dir`` (else a notebook's run root), else the only
    run there; locked (``lock``), so that no kernel runs it meanwhile. Raises :class:`Refused`."""
    from . import fsutil
    from .session import default_root

    root = Path(run_dir) if run_dir else default_root()
    # where the runs are by default is a notebook's folder: a headless run's are where its --run-dir was
    elsewhere = "" if run_dir else " (a run of `colab-resilience run --run-dir DIR`: add --run-dir DIR)"
    if not os.path.isdir(root):
        raise Refused(f"no runs in {root}: no such folder{elsewhere}")
    try:
        fsutil.check_run_root(root, another="give another --run-dir")
    except UnsafeDirectoryError as e:
        raise Refused(str(e).removeprefix("colab_resilience: ")) from None
    found = find_runs(root)
    if not found:
        raise Refused(f"no runs in {root}{elsewhere}")
    if run:
        wanted = run.removeprefix("run-")
        found = [p for p in found if p.name == f"run-{wanted}"]
        if not found:
            raise Refused(f"no run {wanted!r} in {root} (runs: {runs_in(root)})")
    if len(found) > 1:
        raise Refused(f"which run? {root} holds {len(found)} runs ({runs_in(root)}, the newest first); name it: "
                      f"colab-resilience {command} RUN{' --run-dir ' + run_dir if run_dir else ''}")
    if not lock:
        return found[0], None
    held = RunLock(found[0])
    try:
        held.acquire()
    except RunLockedError as e:
        who = str(e).splitlines()[0].removeprefix("colab_resilience: ").split("; stop ")[0]
        raise Refused(f"{who} (a kernel that runs it): stop it first, then {command}") from None
    except (UnsafeDirectoryError, OSError) as e:  # made a link, or removed, since it was found
        raise Refused(f"{found[0]}: {str(e).removeprefix('colab_resilience: ')}") from None
    return found[0], held


def runs_in(root: Path) -> str:
    """The runs under ``root``, each with its status and notebook where known: "3f2a9c1e (pending,
    train.ipynb), 07bd41aa (done)"."""
    said = {j.run_dir.name: f"{j.status}{', ' + Path(j.notebook).name if j.notebook else ''}" for j in read_journals(root)}
    return ", ".join(f"{p.name.removeprefix('run-')} ({said.get(p.name, 'unreadable journal')})" for p in find_runs(root))


def reset(run: str | None, run_dir: str | None) -> int:
    """Forget a run (its journal and checkpoints), as ``%resilience reset`` does in a notebook."""
    folder, lock = run_named("reset", run, run_dir)
    try:
        shutil.rmtree(folder)
    finally:
        lock.release()
    print(f"colab-resilience reset: forgot {folder.name} in {folder.parent} (journal and checkpoints removed)")
    return EXIT_OK


def _refused(e: JournalError, folder: Path, run_dir: str | None) -> Refused:
    """A journal's refusal, its advice in this command's words (``colab-resilience reset RUN``)."""
    said = headless(str(e).splitlines()[0], run_dir or str(folder.parent)).removeprefix("colab_resilience: ")
    return Refused(said if said.startswith(("run ", folder.as_posix())) else f"run {folder.name.removeprefix('run-')}: {said}")


def _journal(folder: Path, run_dir: str | None) -> Journal:
    """The journal of ``folder``, its form checked and its signature not (to be shown or trusted)."""
    try:
        return Journal.load(folder)
    except JournalError as e:
        raise _refused(e, folder, run_dir) from None


def _signed_here(folder: Path, key: bytes, run_dir: str | None) -> bool:
    try:
        Journal.load(folder, key=key)
    except JournalUntrustedError:
        return False
    except JournalError as e:  # signed here, but not this folder's, or older than the newest written
        raise _refused(e, folder, run_dir) from None
    return True


def show(run: str | None, run_dir: str | None) -> int:
    """Print what resuming the run would execute and unpickle, as ``%resilience show`` does; run
    nothing."""
    from .commands import review
    from .run import open_store
    from .signing import load_or_create_key

    folder, _ = run_named("show", run, run_dir, lock=False)
    key = load_or_create_key()
    j = _journal(folder, run_dir)
    # a journal nothing will resume (a copy, a rollback) is refused before its review is printed
    trust = "" if _signed_here(folder, key, run_dir) else " --trust"
    for line in review(j, open_store(folder, key)):
        print(line)
    there = f" --run-dir {run_dir}" if run_dir else ""
    print(f"colab-resilience show: nothing was run; `colab-resilience resume{trust} {j.run_id}{there}` marks the run to go "
          f"on {_when(run_dir)}; `colab-resilience reset {j.run_id}{there}` forgets it")
    return EXIT_OK


def resume(run: str | None, run_dir: str | None, *, trust: bool = False) -> int:
    """Mark a run to go on from its last checkpoint when ``colab-resilience run`` (or papermill's
    engine) runs its notebook again with its run directory, or, a notebook's, when its cell runs
    again there, as ``%resilience resume`` does in a notebook: a run stopped by an error in its cell (its
    checkpoint would be dropped by the cell's next run), or a finished one (its final state comes
    back and its cell is not run again). With ``trust``, a run another installation key signed
    (another machine, a new Colab VM whose run directory is on Drive, a lost key): every set-up
    cell its resume replays and every pickled value it unpickles is printed, then its journal and
    checkpoints are signed with this installation's key, under the id this key gives its cell.
    Nothing runs here."""
    from .commands import review
    from .run import open_store, run_id_for
    from .signing import load_or_create_key

    folder, lock = run_named("resume", run, run_dir)
    root, old = folder.parent, folder.name.removeprefix("run-")
    there = f" --run-dir {run_dir}" if run_dir else ""
    adopted = None
    try:
        key = load_or_create_key()
        j = _journal(folder, run_dir)
        signed = _signed_here(folder, key, run_dir)
        if not signed and not trust:
            raise Refused(f"run {old} was written under another installation key (another machine, a new Colab VM, a lost "
                          f"key), so nothing of it runs here unless you vouch for it: review it with `colab-resilience show "
                          f"{old}{there}`, then `colab-resilience resume --trust {old}{there}`")
        if signed and j.status == "pending":
            _newest(j, open_store(folder, key))
            print(f"colab-resilience resume: run {old} is pending already: it goes on {_where(j)} {_when(run_dir)}; "
                  "nothing was run")
            return EXIT_OK
        if not signed:
            if j.cell_key is None:
                raise Refused(f"run {old} does not record which cell it is of (an older version of colab_resilience wrote "
                              f"it): go on with it in its notebook, `%resilience resume --trust {old}`, then run its cell")
            new = run_id_for(j.cell_key, key, j.notebook)
            target = root / f"run-{new}"
            if target != folder and os.path.lexists(target):
                raise Refused(f"the cell of run {old} has a run of this installation's already, {new} (runs: "
                              f"{runs_in(root)}); to go on with {old} instead, forget that one first: colab-resilience "
                              f"reset {new}{there}, then resume --trust again")
            for line in review(j, open_store(folder, key)):
                print(line, flush=True)
            if target != folder:
                # the folder first: a resume cut short after it is finished by the same command under the new id
                os.rename(folder, target)
            adopted = open_store(target, key).adopt(run_id=new)
            j.run_dir, j.run_id = target, new
        _newest(j, open_store(j.run_dir, key))
        done = j.status == "done"  # before it is marked
        where = _where(j)
        j.status = "pending"
        j.stopped = None
        j.restart_requested = True  # resumed by hand: not a kernel death to count
        j.counted_pid = j.kernel_pid
        j.save()
    finally:
        lock.release()
    if adopted is not None:
        called = f", as run {j.run_id}" if j.run_id != old else ""
        print(f"colab-resilience resume: run {old} is signed with this installation's key now{called} (journal and "
              f"{plural(len(adopted), 'checkpoint')})")
    when = _when(run_dir)
    first = f"the set-up cells{' above' if adopted is not None else ''} run first"
    goes = (f"is done: {when}, its final state comes back and its cell is not run again ({first})" if done
            else f"goes on {where} {when} ({first})")
    print(f"colab-resilience resume: run {j.run_id} {goes}; nothing was run here; `colab-resilience reset {j.run_id}{there}` "
          "forgets it")
    return EXIT_OK


def _newest(j: Journal, store) -> None:
    """The journal's record of the run's last checkpoint brought up to the newest one on disk: a
    kill between ``LATEST`` and the journal's write (a checkpoint written in the background, a
    kernel ended by --cell-timeout) leaves the journal one behind, and the run goes on from the
    newest."""
    latest = store.latest_id()
    if latest is not None and latest != j.last_checkpoint:
        j.last_checkpoint = latest
        where = store.latest_meta().get("where")
        j.resume_at = where if isinstance(where, str) else None


def _when(run_dir: str | None) -> str:
    """When a marked run goes on: a run of ``--run-dir DIR`` when the command (or papermill's engine)
    runs its notebook again with that folder; a notebook's (no ``--run-dir``: its kernel's
    ``./.colab_resilience`` or ``$COLAB_RESILIENCE_RUN_DIR``) when its cell runs again there, as
    after ``%resilience resume`` (``colab-resilience run`` without ``--run-dir`` would start afresh
    in a temporary folder)."""
    if run_dir:
        return (f"when `colab-resilience run NOTEBOOK --run-dir {run_dir}` (or papermill's resilient engine with that "
                "run directory) runs its notebook again")
    return "when its cell runs again in its notebook"


def _where(j: Journal) -> str:
    if j.resume_at:
        return f"at {j.resume_at}"
    return f"from checkpoint {j.last_checkpoint}" if j.last_checkpoint else "from its beginning (no checkpoint yet)"
