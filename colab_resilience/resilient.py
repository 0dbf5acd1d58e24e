"""What one ``%%resilient`` execution does, in order:

1. open the cell's run (:meth:`colab_resilience.run.Run.open`): a pending run resumes;
2. after a kernel restart, replay the set-up cells (:func:`colab_resilience.replay.replay`), then
   start the run in this kernel;
3. check the options against the notebook (a ``--save`` name that exists nowhere, a ``--shrink``
   variable that is not an integer), and warn once about names the cell reads that a restart
   would lose;
4. run the body with in-process OOM recovery (:class:`colab_resilience.recovery.Recovery`): each
   retry rolls the run back to its last safe point; past the retries, leave the kernel for a
   restart (:func:`colab_resilience.restart.leave`);
5. finish the run: a last checkpoint and ``done``, or ``failed`` when the body raised.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import time
from dataclasses import dataclass

from . import oom, replay
from .errors import OptionError
from .recovery import Recovery, Shrink
from .run import Run, run_id_for


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
    run = Run.open(
        shell, session.root(), session.adopt or run_id_for(key),
        cell_key=key, source=source, body=body, names=options.names, shrink=shrink_names,
        max_restarts=options.max_restarts, every=options.every, policy=session.policy, say=session.say,
    )
    session.adopt = None  # after %resilience resume: this cell continued that run
    replayed, seconds = 0, 0.0
    if run.needs_replay:
        run.begin_replay()
        start = time.perf_counter()
        try:
            replayed = replay.replay(shell, run.journal.replay_cells, session.replay_log, session.say)
        except BaseException:
            run.close()  # still pending: fix the set-up cell, then run this cell again
            raise
        seconds = time.perf_counter() - start
    run.start(session.replay_log.cells, replayed=replayed, replay_seconds=seconds)
    try:
        check_options(shell, options, body)
        if key not in session.linted:
            session.linted.add(key)
            lost = names_lost_on_restart(shell, body, options.names + shrink_names,
                                         [c.source for c in session.replay_log.cells])
            if lost:
                session.say(
                    f"colab_resilience: this cell reads {', '.join(lost)}, which neither --save nor a "
                    "%%replay cell would bring back after a restart; add them to --save or define them in a %%replay cell"
                )
    except OptionError:
        run.finish("failed")
        raise
    if options.shrink:  # a new kernel gets them back from the journal, even after a SIGKILL
        run.record_shrink({n: shell.user_ns[n] for n in shrink_names})

    def give_up(exc, verdict, outcome):
        run.record_shrink({n: shell.user_ns.get(n) for n in shrink_names})
        what = f"{verdict.label}" if verdict.needs_restart else (
            f"OOM ({verdict.label}) after {outcome.attempts} attempt{'s' if outcome.attempts != 1 else ''}"
        )
        session.say(run.leave(what))  # returns only when the kernel cannot restart

    recovery = Recovery(
        shell, retries=options.retries, shrink=options.shrink, say=session.say,
        before_attempt=lambda outcome: run.attempt_start(),
        before_retry=lambda outcome: run.rollback(),
        give_up=give_up,
    )
    with run.active():
        try:
            recovery.run(header, body)
        except BaseException as e:
            if run.lock.held:
                if oom.classify(e) is None and run.safe_points:  # only when progress was made
                    last = run.journal.last_checkpoint
                    hint = (f"%resilience resume then run this cell again to continue from {last}" if last
                            else "run the cell again to start afresh")
                    session.say(f"colab_resilience: run {run.run_id} stopped by {type(e).__name__}; to go on anyway: {hint}")
                run.finish("failed")
            raise
        run.save(next_index=run.next_index, force=True)
        run.finish("done")


# -- checks of the options against the notebook ------------------------------------------------------


def _parse(shell, source: str) -> ast.AST | None:
    try:
        return ast.parse(shell.transform_cell(source))
    except SyntaxError:
        return None


def bound_names(tree: ast.AST | None, *, arguments: bool = False) -> set[str]:
    """Names a piece of code binds anywhere: assignments, deletions, definitions, imports (and,
    with ``arguments``, function parameters)."""
    names: set[str] = set()
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
        elif arguments and isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _user_variables(shell) -> list[str]:
    """The user's own names (not IPython's ``open``/``In``/``Out``, not ours), for suggestions."""
    hidden = shell.user_ns_hidden
    return [k for k in shell.user_ns if not k.startswith("_") and k not in hidden]


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_options(shell, options: Options, body: str) -> None:
    """:class:`OptionError` for a ``--save`` name that nothing defines, or a ``--shrink`` variable
    that is missing, not a positive integer, or assigned by the cell itself."""
    ns = shell.user_ns
    assigned = bound_names(_parse(shell, body))
    for name in options.names:
        if name not in ns and name not in assigned:
            raise OptionError(
                f"%%resilient: --save {name}: no variable {name!r} exists and the cell does not "
                f"assign it{_did_you_mean(name, _user_variables(shell))}; create it in a %%replay cell or in this cell"
            )
    for s in options.shrink:
        if s.name not in ns:
            ints = [k for k in _user_variables(shell) if type(ns[k]) is int]
            raise OptionError(
                f"%%resilient: --shrink {s.name}: no variable {s.name!r} exists{_did_you_mean(s.name, ints)}; "
                f"set it in an earlier cell, e.g. {s.name} = 256"
            )
        value = ns[s.name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise OptionError(
                f"%%resilient: --shrink {s.name}: {s.name} is a {type(value).__name__} "
                f"({value!r:.40}), but --shrink needs an integer such as a batch size"
            )
        if value < 1:
            raise OptionError(f"%%resilient: --shrink {s.name}: {s.name} is {value}; it must be at least 1")
        if s.name in assigned:
            raise OptionError(
                f"%%resilient: --shrink {s.name}: the cell assigns {s.name}, so every retry "
                f"would undo the shrink; set {s.name} in an earlier cell instead"
            )


def names_lost_on_restart(shell, body: str, saved: list[str], replay_sources: list[str]) -> list[str]:
    """Names ``body`` reads from the namespace that nothing would bring back after a restart."""
    tree = _parse(shell, body)
    if tree is None:
        return []
    read = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in read:
            read.append(node.id)
    defined = bound_names(tree, arguments=True) | set(saved) | set(dir(builtins))
    defined |= {"resume_range", "checkpoint", "get_ipython"}
    for src in replay_sources:
        defined |= bound_names(_parse(shell, replay.split(src)[1]), arguments=True)
    ns = shell.user_ns
    return [n for n in read if n not in defined and n in ns and not n.startswith("_")]
