"""In-process recovery: run a cell, and on an out-of-memory error free memory and run it again.

This is the engine behind ``%%resilient``; it knows nothing about argument parsing. One
:class:`Recovery` runs one cell:

1. run the body (see :mod:`colab_resilience.execution`);
2. an error that is not an OOM leaves exactly as it would without the magic;
3. on an OOM the ``before_retry`` hook runs (the run rolls back to the last safe point there:
   it unbinds the names created since, returned to be reported, and the declared state is
   restored when the body starts again), what the error holds is released
   (:func:`colab_resilience.oom.release`), the ``--shrink`` variables are made smaller (and handed
   to the ``on_shrink`` hook at once, so a kill before the next safe point keeps them), one line
   says what happened, and the body runs again;
4. when the retries are spent, or the error poisons the process (a CUDA device-side assert), the
   ``give_up`` hook decides what comes next. Without one, the last error is re-raised after a
   one-line summary of the attempts, its frames already cleared so the memory stays free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, MutableMapping

from . import faults, oom
from .errors import RetryNotExactError
from .execution import compile_body, render, reraise, run_body
from .memory import format_bytes, memory_in_use

PREFIX = "colab_resilience:"


@dataclass(frozen=True)
class Shrink:
    """``--shrink NAME=FACTOR``: on OOM, ``NAME = max(1, int(NAME * FACTOR))``. NAME is a variable
    or an attribute path into one (``trainer.args.per_device_train_batch_size``: a framework's
    batch size, where the set-up cells keep it)."""

    name: str
    factor: float = 0.5


_MISSING = object()


def shrink_value(ns: Mapping[str, object], name: str, default=None):
    """The value of the ``--shrink`` NAME ``name`` (a variable, or an attribute path) in ``ns``."""
    root, *attrs = name.split(".")
    value = ns.get(root, _MISSING)
    for attr in attrs:
        if value is _MISSING:
            break
        value = getattr(value, attr, _MISSING)
    return default if value is _MISSING else value


def set_shrink_value(ns: MutableMapping[str, object], name: str, value: int) -> bool:
    """Set the ``--shrink`` NAME ``name`` in ``ns``; False when its path does not lead anywhere."""
    owner, _, attr = name.rpartition(".")
    if not owner:
        ns[name] = value
        return True
    target = shrink_value(ns, owner, _MISSING)
    if target is _MISSING:
        return False
    setattr(target, attr, value)
    return True


def put_back_shrunk(ns: MutableMapping[str, object], values: Mapping[str, int]) -> list[str]:
    """Set the batch sizes a run settled on (its journal's) in ``ns``; the names set."""
    return [name for name, value in values.items() if set_shrink_value(ns, name, value)]


@dataclass
class Outcome:
    """What happened to one ``%%resilient`` execution, for hooks and for the final summary."""

    attempts: int = 0
    labels: list[str] = field(default_factory=list)
    shrink_history: dict[str, list[int]] = field(default_factory=dict)
    freed: list[int] = field(default_factory=list)

    def describe_shrinks(self) -> str:
        parts = []
        for name, values in self.shrink_history.items():
            parts.append(f"{name} " + " → ".join(str(v) for v in values))
        return "; ".join(parts)


class Recovery:
    """Run one cell body with up to ``retries`` in-process recoveries from OOM."""

    def __init__(
        self,
        shell,
        *,
        retries: int = 2,
        shrink: tuple[Shrink, ...] = (),
        say: Callable[[str], None] = print,
        before_attempt: Callable[[Outcome], None] | None = None,
        before_retry: Callable[[Outcome], list[str] | None] | None = None,
        give_up: Callable[[BaseException, oom.OOMVerdict, Outcome], None] | None = None,
        on_shrink: Callable[[dict[str, int]], None] | None = None,
        not_exact: Callable[[], RetryNotExactError | None] | None = None,
    ):
        self.shell = shell
        self.retries = retries
        self.shrink = shrink
        self.say = say
        self.before_attempt = before_attempt
        self.before_retry = before_retry
        self.give_up = give_up
        self.on_shrink = on_shrink
        self.not_exact = not_exact  # why a retry here cannot repeat the failed attempt (a restart can)
        self.outcome = Outcome()

    def run(self, header: str, body: str) -> None:
        codes = compile_body(self.shell, header, body)
        outcome = self.outcome
        ns = self.shell.user_ns
        for s in self.shrink:
            outcome.shrink_history[s.name] = [shrink_value(ns, s.name)]
        while True:
            outcome.attempts += 1
            if self.before_attempt is not None and self.before_attempt(outcome) is False:
                return  # nothing is left to run (a resumed cell that had finished)
            failure = run_body(self.shell, codes)
            if failure is None:
                return
            exc, tb = failure.exc, failure.tb
            del failure
            verdict = oom.classify(exc)
            if isinstance(exc, RetryNotExactError):  # this retry cannot go on exactly: a restart can
                verdict = oom.OOMVerdict(oom.RESTART, exc.label, exc)
            if verdict is None:
                reraise(self.shell, exc, tb)
            faults.reached()
            if not verdict.needs_restart and outcome.attempts <= self.retries and self.not_exact is not None:
                why = self.not_exact()
                if why is not None:
                    verdict = oom.OOMVerdict(oom.RESTART, why.label, why)
            outcome.labels.append(verdict.label)
            if verdict.needs_restart or outcome.attempts > self.retries:
                self._give_up(exc, tb, verdict)
                return
            del tb, verdict
            # the rollback first (it may unbind what the attempt created), so release() frees that too
            before = memory_in_use()
            dropped = self.before_retry(outcome) if self.before_retry is not None else None
            freed = oom.release(exc, self.shell, self.shell.execution_count, before=before)
            del exc
            outcome.freed.append(freed)
            if faults.take_injected():  # colab-resilience check's: compared with a run that had none
                changes = ["injected by colab-resilience check: nothing shrunk"] if self.shrink else []
            else:
                changes = self._shrink()  # after the rollback, which must not undo it
            if self.shrink and self.on_shrink is not None:  # kept at once: a kill may come next
                self.on_shrink({s.name: shrink_value(ns, s.name) for s in self.shrink
                                if _is_int(shrink_value(ns, s.name))})
            unbound = f"unbound {_names(dropped)} (new since the last safe point) and " if dropped else ""
            parts = [f"{PREFIX} OOM ({outcome.labels[-1]}) — {unbound}freed {format_bytes(freed)}"]
            parts += changes
            parts.append(f"retry {outcome.attempts}/{self.retries}")
            self.say("; ".join(parts))

    def _shrink(self) -> list[str]:
        ns = self.shell.user_ns
        changes = []
        for s in self.shrink:
            old = shrink_value(ns, s.name)
            if not _is_int(old):
                changes.append(f"{s.name} is no longer an integer ({type(old).__name__}), not shrunk")
                continue
            new = max(1, int(old * s.factor))
            try:
                set_shrink_value(ns, s.name, new)
            except Exception as e:  # an attribute that refuses it now: the retry goes on unshrunk
                changes.append(f"{s.name} could not be set ({type(e).__name__}: {' '.join(str(e).split())}), not shrunk")
                continue
            self.outcome.shrink_history[s.name].append(new)
            changes.append(f"{s.name} {old} → {new}" if new != old else f"{s.name} already {old}")
        return changes

    def _give_up(self, exc: BaseException, tb, verdict: oom.OOMVerdict) -> None:
        stb = render(self.shell, exc, tb)
        oom.release(exc, self.shell, self.shell.execution_count)
        if self.give_up is not None:  # may end the process (a restart); else the error follows
            self.give_up(exc, verdict, self.outcome)
        self.say(self.summary(verdict))
        reraise(self.shell, exc, tb, stb)

    def summary(self, verdict: oom.OOMVerdict) -> str:
        o = self.outcome
        if isinstance(verdict.exc, RetryNotExactError):
            return str(verdict.exc)
        if verdict.needs_restart:
            return (
                f"{PREFIX} {verdict.label}: the CUDA context cannot recover in this process, so no "
                "retry was made; restart the kernel and run the cell again."
            )
        shrinks = o.describe_shrinks()
        tried = f"{o.attempts} attempt{'s' if o.attempts != 1 else ''}"
        what = f" ({shrinks})" if shrinks else ""
        hint = "lower the batch size or free memory" if not shrinks else "lower the starting value or free memory"
        return (
            f"{PREFIX} still out of memory after {tried}{what}; memory was freed, the error "
            f"follows. To go on, {hint} and run the cell again, or allow more with --retries."
        )


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
