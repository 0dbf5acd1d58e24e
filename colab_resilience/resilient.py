"""What one ``%%resilient`` execution does, in order:

1. open the cell's run (:meth:`colab_resilience.run.Run.open`): a pending run resumes;
2. after a kernel restart, replay the set-up cells (:func:`colab_resilience.replay.replay`), then
   start the run in this kernel;
3. check the options against the notebook and warn once about what would make a resumed run
   differ (:mod:`colab_resilience.lint`);
4. run the body with in-process OOM recovery (:class:`colab_resilience.recovery.Recovery`): each
   retry rolls the run back to its last safe point; past the retries, leave the kernel for a
   restart (:func:`colab_resilience.restart.leave`);
5. finish the run: a last checkpoint and ``done``, or ``failed`` when the body raised.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from . import commands, lint, oom, replay, restart
from .errors import OptionError, ResilienceError
from .execution import compile_body
from .recovery import Recovery, Shrink, shrink_value
from .run import Run, finished_run, run_id_for, unset_note
from .session import notebook


@dataclass(frozen=True)
class Options:
    """The parsed options of a ``%%resilient`` line."""

    names: list[str]
    retries: int
    shrink: tuple[Shrink, ...]
    max_restarts: int
    every: tuple[int | None, float | None]


def execute(session, line: str, body: str, options: Options) -> None:
    """Run one ``%%resilient`` cell (``line``: its options, ``body``: the code under them)."""
    shell = session.shell
    header = f"%%resilient {line}".rstrip()
    source = header + "\n" + body
    key = replay.current_cell_key(shell) or replay.source_key(source)
    shrink_names = [s.name for s in options.shrink]
    reexecuting, session.reexecuting = session.reexecuting, False
    run_id = session.adopt or run_id_for(key, notebook=notebook())
    compile_body(shell, header, body)  # a syntax error touches no run (it is compiled again before it runs)
    session.last_run = run_id  # a refusal's "%resilience reset" means this run
    done = finished_run(session.root(), run_id) if reexecuting else None
    # the kernel died after the run finished, before the cell returned (or, for a framework's
    # state, in a later cell: see kernelapi.rerun_finished); a framework's state comes back only
    # by running the cell again, which resumes at its end and trains nothing
    if done is not None and done.names and done.framework is None:
        back = [n for n in done.names if n not in session.not_back]
        missing = [n for n in done.names if n in session.not_back]
        session.say(f"colab_resilience: run {done.run_id} had finished before the kernel died; its final "
                    f"state ({', '.join(back) or 'nothing'}) is back"
                    + (f", but not {', '.join(missing)} (said above)" if missing else "")
                    + ", and the cell is not run again" + unset_note(shell, body, done.names))
        return
    run = Run.open(
        shell, session.root(), run_id, cell_key=key, notebook=notebook(), source=source, body=body,
        names=options.names, shrink=shrink_names,
        max_restarts=options.max_restarts, every=options.every, policy=session.policy, say=session.say,
        saving=session.saving(), reopen=done is not None,  # saves nothing: it goes back to its start
        setup_log=session.replay_log,
    )
    adopted, session.adopt = session.adopt, None  # after %resilience resume: this cell continues that run

    def withdraw(e: BaseException) -> None:  # before its first safe point: the run as it was, adopted still
        run.withdraw(str(e) if isinstance(e, ResilienceError) else None)  # a refusal: status repeats it
        session.adopt = adopted

    replayed, seconds = 0, 0.0
    if run.needs_replay:
        run.begin_replay()
        start = time.perf_counter()
        try:
            replayed = replay.replay(shell, run.journal.replay_cells, session.replay_log, session.say)
        except BaseException as e:
            withdraw(e)  # still pending: fix the set-up cell, then run this cell again
            raise
        seconds = time.perf_counter() - start
    try:
        if run.after_restart and not restart.supervised():  # a driver has put them back before it ran the cell
            commands.put_back_finished(session, run)
        run.start(session.replay_log.cells, replayed=replayed, replay_seconds=seconds, setup=session.replay_log.prints,
                  setup_saved=session.replay_log.saved_prints)
    except BaseException as e:
        withdraw(e)  # still pending: a change the run began with and no checkpoint holds (it says which)
        raise
    try:
        # a --save name made by a cell that is not replayed comes back from the checkpoint
        lint.check_options(shell, options.names, options.shrink, body,
                           restorable=run.store.latest_names() if run.resuming else ())
    except OptionError as e:
        withdraw(e)  # a pending run stays pending, its checkpoints kept: put the option right, run it again
        raise
    if run.edited is not None:
        session.say(run.edited)
    if key not in session.linted:  # once per cell and kernel: after a restart, said again
        session.linted.add(key)
        saved = options.names + shrink_names
        later: list[str] = []  # carried names the cell makes: told at the loop's start, by their values
        for line in lint.warnings(shell, body, saved, [c.source for c in session.replay_log.cells], later,
                                  shrink=shrink_names):
            session.say(line)
        known = set(shell.user_ns)
        run.at_loop_start = lambda: lint.at_loop_start(shell, body, saved, known, later)
    if options.shrink:  # a new kernel gets them back from the journal, even after a SIGKILL
        run.record_shrink({n: shrink_value(shell.user_ns, n) for n in shrink_names})

    def give_up(exc, verdict, outcome):
        run.record_shrink({n: shrink_value(shell.user_ns, n) for n in shrink_names})
        what = f"{verdict.label}" if verdict.needs_restart else (
            f"OOM ({verdict.label}) after {outcome.attempts} attempt{'s' if outcome.attempts != 1 else ''}"
        )
        session.say(run.leave(what))  # returns only when the kernel cannot restart

    recovery = Recovery(
        shell, retries=options.retries, shrink=options.shrink, say=session.say,
        before_attempt=lambda outcome: run.attempt_start(),
        before_retry=lambda outcome: run.rollback(host_memory=oom.host_memory(outcome.labels[-1])),
        give_up=give_up,
        on_shrink=run.record_shrink,
        not_exact=run.retry_not_exact,
    )
    session.saves[run.run_id] = run.saver.stats  # for %resilience status
    with run.active():
        try:
            recovery.run(header, body)
        except BaseException as e:
            if run.lock.held and not run.began_here and not run.safe_points and oom.classify(e) is None:
                # the pending run did not go on in this execution (a refusal of ours, which says what
                # to do; an error or the stop button before its next safe point): it stays as it was
                if not isinstance(e, ResilienceError):
                    session.say(f"colab_resilience: run {run.run_id} stopped by {type(e).__name__} before its next safe "
                                f"point; it stays pending: run this cell again to go on from where it was "
                                f"(%resilience reset {run.run_id} to start over)")
                withdraw(e)
            elif run.lock.held:
                # the line is made once the checkpoint being written is on disk: it names it
                run.finish("failed", functools.partial(_failed_line, run, e))  # status repeats it
                if run.journal.stopped and not isinstance(e, ResilienceError):
                    session.say(run.journal.stopped)
            raise
        if not run.finished_before:
            run.finish_save()
        run.finish("done")


def _failed_line(run, error: BaseException, j) -> str | None:
    """Why ``run`` failed and how to go on, in one line, for the journal ``j`` it ends with: a
    refusal of ours as it was said (it says what to do); an error after progress with the hint to
    resume; None for an out-of-memory error (the recovery said it) or no progress."""
    if isinstance(error, ResilienceError):
        return str(error).splitlines()[0] if str(error) else None
    if oom.classify(error) is not None or not run.safe_points:
        return None
    at = f"at {j.resume_at}" if j.resume_at else f"from {j.last_checkpoint}"
    hint = (f"%resilience resume {run.run_id}, then run this cell again: it goes on {at}"
            if j.last_checkpoint else "run the cell again to start afresh")
    return f"colab_resilience: run {run.run_id} stopped by {type(error).__name__}; to go on anyway: {hint}"
