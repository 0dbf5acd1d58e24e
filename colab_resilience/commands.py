"""``%resilience status | show | resume | reset | dir``, and putting back the state of finished runs.

Plain functions of a :class:`colab_resilience.session.Session`; the magic only parses. User
mistakes raise :class:`colab_resilience.errors.OptionError` (shown as a usage error).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from . import fsutil, memory, replay, restart, words
from .checkpoints import manifest as checkpoint_manifest
from .errors import CheckpointWarning, JournalError, OptionError, ResilienceError, RunLockedError, UnsafeDirectoryError
from .journal import Journal, find_runs, signed_elsewhere
from .lock import RunLock, pid_alive
from .recovery import put_back_shrunk
from .run import open_store, put_back_left, restore_latest
from .session import notebook as session_notebook


def pick_run(session, command: str, wanted: str | None) -> Path:
    """The run folder ``wanted`` names (``run-<id>`` or ``<id>``), or the most recent one (for
    ``reset`` and ``resume``: the run of this kernel's last ``%%resilient`` cell, or the only run)."""
    try:
        fsutil.check_run_root(session.root())
    except UnsafeDirectoryError as e:
        raise OptionError(f"%resilience {command}: {str(e).removeprefix('colab_resilience: ')}") from None
    found = find_runs(session.root())
    if wanted:
        wanted = wanted.removeprefix("run-")
        match = [p for p in found if p.name == f"run-{wanted}"]
        if not match:
            have = ", ".join(p.name.removeprefix("run-") for p in found) or "none"
            raise OptionError(f"%resilience {command}: no run {wanted!r} in {session.root()} (runs: {have})")
        return match[0]
    if not found:
        raise OptionError(f"%resilience {command}: no runs in {session.root()}; a %%resilient cell creates one")
    if command in ("reset", "resume"):
        # reset deletes, and the next %%resilient cell continues what resume picks: the run of this
        # kernel's last %%resilient cell, or the only one, never the newest of several, which may be
        # another cell's or another notebook's (Colab's runs share one Drive folder)
        mine = [p for p in found if p.name == f"run-{session.last_run}"]
        if mine:
            return mine[0]
        if len(found) > 1:
            have = ", ".join(p.name.removeprefix("run-") for p in found)
            raise OptionError(f"%resilience {command}: which run? {session.root()} holds {len(found)} runs ({have}, "
                              f"the newest first) and this kernel has run none of them; name it: %resilience {command} "
                              "RUN (%resilience status says whose each is)")
    return found[0]


def status(session) -> None:
    """Every run in the run directory: status, restarts, what it saves, its last checkpoint."""
    found = find_runs(session.root())
    policy = session.policy.describe() if session.policy else "not set in this kernel"
    budget, when_busy = session.saving()
    limited = memory.limited()
    saving = ("written while training waits (staging_memory off)" if budget.off else
              f"written while training waits ({limited}, which would count the staging memory and the "
              "writing threads against what the training may allocate)" if limited else
              f"written in the background (staging memory: {budget.describe()}; a busy safe point: {when_busy})")
    # every line begins as all of this package's lines do: a reader can tell them from the notebook's
    print(f"colab_resilience: run directory {session.root()}; planned restarts {policy}; checkpoints {saving}")
    if not found:
        print("colab_resilience:   no runs yet")
    from .signing import load_or_create_key

    key = load_or_create_key() if found else None
    for path in found:
        try:
            j = Journal.load(path)  # without the key: status only shows
        except (JournalError, OSError) as e:
            print(f"colab_resilience:   {path.name}: unreadable ({e})")
            continue
        elsewhere = signed_elsewhere(path, key)
        if not elsewhere:  # the journal is written after LATEST: a kill between the two leaves it one behind
            j.last_checkpoint = _newest_checkpoint(path, j.last_checkpoint)
        shrink = ", ".join(f"{k}={v}" for k, v in j.shrink.items())
        last = j.restarts[-1].reason if j.restarts else "none"
        planned = j.policy.describe()
        print(
            f"colab_resilience:   run {j.run_id}{_of_notebook(j)}: {j.status}; "
            f"restarts {j.restarts_used}/{j.max_restarts} (last: {last}); "
            f"saves {', '.join(j.names) or 'nothing'}; last checkpoint {j.last_checkpoint or 'none'}; "
            f"{words.plural(len(j.replay_cells), 'replay cell')}"
            + (f"; planned restarts {planned}" if planned != "off" else "")
            + (f"; {shrink}" if shrink else "")
        )
        if elsewhere and j.status != "done":
            print(f"colab_resilience:     written under another installation key (another machine, a new Colab VM, a lost "
                  f"key): its cell run again begins a run of its own; review it with `%resilience show {j.run_id}`, "
                  f"then `%resilience resume --trust {j.run_id}` goes on with it")
        elif j.status == "pending":
            print(f"colab_resilience:     {_pending_line(j)}")
        elif j.status == "failed" and j.stopped:
            said = _stopped_words(j)
            print(f"colab_resilience:     {said if said.startswith('stopped') else f'stopped: {said}'}")
        stats = session.saves.get(j.run_id)
        if stats is not None:  # its last execution in this kernel
            print(f"colab_resilience:     checkpoints in this kernel: {stats.line()}")


def _newest_checkpoint(run_dir: Path, recorded: str | None) -> str | None:
    """The newer of the checkpoint the journal records and the one ``LATEST`` names (what a
    resume restores), for status to show."""
    try:
        latest = checkpoint_manifest.latest_id(run_dir / "checkpoints")
    except OSError:
        return recorded
    return max(filter(None, (recorded, latest)), key=lambda cid: int(cid[5:]), default=None)


def _of_notebook(j: Journal) -> str:
    """Whose run it is, where its kernel knew (a run directory holds every notebook's runs there)."""
    if not j.notebook:
        return ""
    here = session_notebook()
    return " (this notebook)" if j.notebook == here else f" (notebook {Path(j.notebook).name})"


def _stopped_words(j: Journal) -> str:
    """The line that stopped the run's last execution (:attr:`Journal.stopped`), without the
    package's prefix and the run's id, which the status line before it names."""
    words = (j.stopped or "").removeprefix("colab_resilience: ")
    return words.removeprefix(f"run {j.run_id}: ").removeprefix(f"run {j.run_id} ")


def _pending_line(j: Journal) -> str:
    """What became of a pending run's kernel, and what the user does next."""
    from .run import uncounted_death

    cell = "run its cell again (or Run all) to continue"
    where = f"from checkpoint {j.last_checkpoint}" if j.last_checkpoint else "from the start (no checkpoint yet)"
    # a refusal repeats what it said, with what to do, where "run its cell again" would only stop it again
    stopped = _stopped_words(j) if j.stopped else None
    how = uncounted_death(j)
    if how is not None and pid_alive(j.kernel_pid):
        return f"held by kernel PID {j.kernel_pid}, which is still running"
    if how is not None:
        return (f"its kernel (PID {j.kernel_pid}) died without warning ({how}); not counted yet: "
                f"{cell} {where}; that restart will count against the budget"
                + (f"; before that, its cell had stopped: {stopped}" if stopped else ""))
    if j.kernel_pid == os.getpid():
        return f"stopped in this kernel: {stopped}" if stopped else f"left pending in this kernel: {cell} {where}"
    last = j.restarts[-1] if j.restarts else None
    why = f" ({last.reason})" if last is not None else ""
    return (f"its kernel restarted{why}: {cell} {where}"
            + (f"; before that, its cell had stopped: {stopped}" if stopped else ""))


def set_dir(session, folder: str) -> None:
    path = Path(folder)
    try:
        path = path.expanduser()  # RuntimeError: ~user of no such user
        path = fsutil.check_run_root(path, another="choose another folder")  # ValueError: a NUL in the path
    except UnsafeDirectoryError as e:
        raise OptionError(f"%resilience dir: {str(e).removeprefix('colab_resilience: ')}") from None
    except (OSError, ValueError, RuntimeError) as e:
        why = getattr(e, "strerror", None) or e
        raise OptionError(f"%resilience dir: cannot use {path} ({why}); choose a writable folder") from None
    session.settings.run_dir = str(path)
    session.say(f"colab_resilience: runs are kept in {path}")


def _locked(command: str, run_dir: Path) -> RunLock:
    lock = RunLock(run_dir)
    try:
        return lock.acquire()
    except RunLockedError as e:
        raise OptionError(f"%resilience {command}: {str(e).splitlines()[0]}") from None


def reset(session, run_dir: Path) -> None:
    """Forget a run: its journal and checkpoints."""
    lock = _locked("reset", run_dir)
    try:
        shutil.rmtree(run_dir)
    finally:
        lock.release()
    restart.remove_startup_file_if_idle(session.shell, session.root())
    if session.adopt and run_dir.name == f"run-{session.adopt}":
        session.adopt = None
    session.say(f"colab_resilience: forgot {run_dir.name} (journal and checkpoints removed)")


def unsigned_pickles(store) -> list[tuple[str, str, str]]:
    """``(checkpoint, name, type)`` of every pickled value in the checkpoints of ``store`` that
    this installation did not sign: what trusting the run would unpickle."""
    found = []
    for cid in store.checkpoint_ids():
        try:
            doc = checkpoint_manifest.read(store.run_dir / cid / checkpoint_manifest.MANIFEST)
            if doc.verify(store.key):
                continue
            entries = checkpoint_manifest.Manifest.from_body(doc.body, cid).entries
        except (ValueError, TypeError, RecursionError):  # CheckpointCorruptError: never loaded
            continue
        found += [(cid, e.name, e.type_name) for e in entries if e.format == "pickle"]
    return found


def review(j: Journal, store) -> list[str]:
    """What ``%resilience resume --trust`` would run: every set-up cell in full, then every
    pickled value of the checkpoints not signed here, by name and type."""
    lines = [f"colab_resilience: run {j.run_id} replays {words.plural(len(j.replay_cells), 'set-up cell')}:"]
    for i, cell in enumerate(j.replay_cells, 1):
        lines.append(f"---- set-up cell {i} of {len(j.replay_cells)} ----")
        lines += cell.source.rstrip("\n").splitlines() or [""]
    pickles = unsigned_pickles(store)
    if j.replay_cells:
        lines.append("---- end of the set-up cells ----")
    if pickles:
        lines.append(f"colab_resilience: and unpickles {words.plural(len(pickles), 'value')} that this installation did not sign:")
        lines += [f"  {name}: {type_name} (in {cid})" for cid, name, type_name in pickles]
    else:
        lines.append("colab_resilience: no pickled value to unpickle that this installation did not sign")
    return lines


def show(session, run_dir: Path) -> None:
    """Print what resuming the run would execute and unpickle; run nothing."""
    from .signing import load_or_create_key

    key = load_or_create_key()
    try:
        j = Journal.load(run_dir, key=key, trust=True)  # read to be shown, not run
    except JournalError as e:
        raise OptionError(str(e)) from None
    for line in review(j, open_store(run_dir, key)):
        print(line)
    try:
        Journal.load(run_dir, key=key)
        resume = f"`%resilience resume {j.run_id}`"  # signed here: --trust is not needed
    except JournalError:
        resume = f"`%resilience resume --trust {j.run_id}`"
    done = " (the run is done: its final state comes back)" if j.status == "done" else ""
    print(f"colab_resilience: nothing was run; {resume} runs this{done}, `%resilience reset {j.run_id}` forgets it")


def resume(session, run_dir: Path, *, trust: bool = False) -> None:
    """Replay a run's set-up cells, restore its last checkpoint and mark it pending, so that the
    next ``%%resilient`` cell continues it. ``trust``: the run was written under another key (the
    user vouches for it): every set-up cell and every pickled value's name and type is printed
    before anything runs, and the run is signed with this installation's key from then on."""
    from .signing import load_or_create_key

    lock = _locked("resume", run_dir)
    try:
        key = load_or_create_key()
        try:
            j = Journal.load(run_dir, key=key, trust=trust)
        except JournalError as e:
            raise OptionError(str(e)) from None
        store = open_store(run_dir, key)
        if trust:
            for line in review(j, store):  # printed whatever the verbosity: the user vouches for this
                print(line, flush=True)
            adopted = store.adopt()
            j.save()
            session.say(
                f"colab_resilience: run {j.run_id} trusted and signed with this installation's key "
                f"(journal and {words.plural(len(adopted), 'checkpoint')}); running the cells above"
            )
        replayed = replay.replay(session.shell, j.replay_cells, session.replay_log, session.say)
        restored: list[str] = []
        try:
            _, restored = restore_latest(store, session.shell.user_ns, j.names, in_place=_kept(session, j))
        except ResilienceError as e:
            session.say(str(e).splitlines()[0])
        j.status = "pending"
        j.restart_requested = True  # resumed by hand: not a kernel death to count
        j.held_here()
        j.counted_pid = j.kernel_pid
        j.save()
    finally:
        lock.release()
    session.adopt = j.run_id
    # a framework's state (a Keras model a fit's callback keeps) is put back by its callback as the
    # training begins, not here: "restored nothing" alone read as if the run would start over
    later = f" ({j.framework} come back as the training begins)" if j.framework else ""
    session.say(
        f"colab_resilience: run {j.run_id}: replayed {words.plural(replayed, 'cell')}, "
        f"restored {', '.join(restored) or 'nothing'}{later}; the next %%resilient cell you run continues it"
    )
    unheld = _trained_unsaved(session, j)
    if unheld:
        one = len(unheld) == 1
        session.say(
            f"colab_resilience: run {j.run_id}: {', '.join(unheld)} {'is' if one else 'are'} not in --save, so no checkpoint "
            f"holds {'it' if one else 'them'}: the run goes on with {'it' if one else 'them'} as {'it is' if one else 'they are'} "
            "now, not as at its safe point, and can end otherwise than an uninterrupted run; for that result, "
            f"`%resilience reset {j.run_id}`, add {'it' if one else 'them'} to --save and run the cells again")


def _trained_unsaved(session, j: Journal) -> list[str]:
    """The models and optimizers run ``j`` trains that no checkpoint of it holds: not in --save,
    and no framework's callback keeps them (a torch model the loop trains, named only at the run's
    first start by the lint)."""
    from .setup_state import trainable

    if j.framework:
        return []
    ns = session.shell.user_ns
    return [n for n in j.start_saved if n not in j.names and n in ns and trainable(ns[n])]


def restore_finished_runs(session, dead_pid: int | None = None, rerun_source: str | None = None, *,
                          held: list[str] | None = None
                          ) -> tuple[list[str], list[str], list[tuple[str, str]], list[str]]:
    """Put back the final state of every run that finished in the run directory, oldest first (a
    later run's values win); with ``held``, only of the runs last held by one of those kernels
    (:func:`.journal.kernel_identity`; a run directory shared with other notebooks holds their
    runs too, and a PID alone may be another's: PIDs are reused). Returns the names
    restored; the runs that finished in the kernel ``dead_pid`` but save nothing (no ``--save``),
    so that nothing of what they computed is back; and, as (run id, what it holds), the runs
    whose framework state (a callback's) only :func:`rerun_finished` can put back (the run of the
    cell ``rerun_source``, which is run again now, is in neither of those two); and one line for
    each saved name that could not be put back (an optimizer the loop rebound to another kind than
    the set-up cells build), which holds what the set-up cells made. Without ``dead_pid``, each of
    the runs ``held`` that saves nothing is one of the unsaved."""
    from .signing import load_or_create_key

    key = load_or_create_key()
    done = []
    for run_dir in reversed(find_runs(session.root())):
        try:
            j = Journal.load(run_dir, key=key)
        except JournalError:
            continue
        if j.status == "done" and (held is None or bool(j.kernels) and j.kernels[-1] in held):
            done.append((run_dir, j))
    restored: list[str] = []
    not_back: list[str] = []
    session.not_back = set()
    others = [j for _, j in done if rerun_source is None or not _same_cell(j.interrupted_cell, rerun_source)]
    unsaved = [j.run_id for j in others if not j.names and not j.framework
               and (j.kernel_pid == dead_pid if dead_pid is not None else held is not None)]
    rerun = [(j.run_id, j.framework) for j in others if j.framework]
    for run_dir, j in done:
        if j.framework:  # running its cell again (rerun_finished) puts back its names too
            continue
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always", CheckpointWarning)
                ckpt, got = restore_latest(open_store(run_dir, key), session.shell.user_ns, j.names,
                                           in_place=_kept(session, j))
            got += put_back_left(ckpt, session.shell.user_ns)
        except ResilienceError as e:
            session.say(str(e).splitlines()[0])
            continue
        for w in said:  # a name that could not be put back (an optimizer the loop rebound to another kind)
            if issubclass(w.category, CheckpointWarning):
                not_back.append(f"{str(w.message).splitlines()[0]} (run {j.run_id}'s final state); it holds what the "
                                "set-up cells made, and the cells after the training would run on that")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        session.not_back.update(n for n in j.names if n not in got)
        got += [n for n in put_back_shrunk(session.shell.user_ns, j.shrink) if n not in got]  # the batch sizes
        restored += [n for n in got if n not in restored]
    return restored, unsaved, rerun, not_back


def put_back_finished(session, run) -> None:
    """Interactively, a kernel that resumes ``run`` after a restart puts back, after the replay,
    the final state of the runs that had finished in the kernels that held it (what a driver does
    before it runs the cell again): a training cell run alone after the kernel died in it would
    otherwise go on with what the set-up cells make (an untrained model where a finished run had
    trained it). Not the runs this kernel ran itself (their state is here), nor any other
    notebook's: a run directory may hold theirs. Says in one line what came back, and what did not."""
    from .deaths import unsaved_line
    from .errors import RunStoppedError

    held = run.journal.held_before
    if not held or session.putting_back:
        return
    session.putting_back = True
    try:
        restored, unsaved, rerun, not_back = restore_finished_runs(session, rerun_source=run.journal.interrupted_cell,
                                                                   held=held)
        for run_id, holds in rerun:  # a framework's state: its cell runs again, and trains nothing
            try:
                rerun_finished(session, run_id)
            except Exception as e:
                why = " ".join(f"{type(e).__name__}: {e}".split())
                raise RunStoppedError(
                    f"colab_resilience: run {run.run_id}: the finished run {run_id} could not put back {holds} "
                    f"({why}), and this cell would train on what the set-up cells rebuilt; make them build what "
                    "the training had, or run the cells above this one again (Run All)") from None
            restored.append(holds)
    finally:
        session.putting_back = False
    if restored:
        session.say(f"colab_resilience: run {run.run_id}: put back {', '.join(restored)} from the training that had "
                    "finished in the kernel that died")
    if unsaved:
        session.say(unsaved_line(unsaved))
    for line in not_back:
        session.say(line)


def rerun_finished(session, run_id: str) -> None:
    """Run the cell of the finished run ``run_id`` again, for the framework state it holds (a
    Keras fit's, a Trainer's): a kernel that died in a later cell comes back with the model the
    set-up cells rebuilt, untrained, and only the framework can load its state into it. The run
    resumes at its end-of-cell checkpoint, so the framework loads that and trains nothing, and
    the cell's own code after the training runs as it ran. Its output is not shown; an error
    (the state does not fit what the set-up cells rebuilt) is raised as this call's own."""
    from IPython.utils.capture import capture_output

    from .signing import load_or_create_key

    run_dir = session.root() / f"run-{run_id}"
    with RunLock(run_dir):
        j = Journal.load(run_dir, key=load_or_create_key())
        if j.status != "done" or not j.framework or not j.interrupted_cell:
            raise ResilienceError(f"colab_resilience: run {run_id} holds no finished framework state to put back")
        j.counted_pid = j.kernel_pid  # that kernel died in a later cell: the death is not this run's
        j.save()
    header, _, body = j.interrupted_cell.partition("\n")
    session.adopt, session.reexecuting = run_id, True
    try:
        with capture_output():
            session.shell.run_cell_magic("resilient", header.removeprefix("%%resilient").strip(), body)
    finally:
        session.adopt, session.reexecuting = None, False


def _kept(session, j: Journal) -> list[str]:
    """The saved names of run ``j`` restored into the objects they hold (:func:`.lint.kept_objects`
    of its cell's code, under the magic line)."""
    from .lint import kept_objects

    return kept_objects(session.shell, (j.interrupted_cell or "").partition("\n")[2], j.names,
                        [c.source for c in j.replay_cells])


def _same_cell(recorded: str | None, source: str) -> bool:
    """Whether a journal's cell (its magic line as it ran, ``$names`` expanded) is the cell ``source``."""
    def parts(text: str | None) -> tuple[list[str], list[str]]:
        head, _, body = (text or "").strip().partition("\n")
        return head.split()[:1], body.split()

    return parts(recorded) == parts(source)
