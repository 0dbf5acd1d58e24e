"""The saves of one run: a snapshot at the safe point, then the persist in the background.

At a safe point, training waits only for the snapshot (:meth:`CheckpointStore.snapshot`: values
prepared, their live bytes copied into reused staging memory, the random states captured). A
thread of its own then hashes, writes, flushes and commits it (:meth:`CheckpointStore.persist`)
while training goes on, and once ``LATEST`` names it (every file of it on disk), records it in
the run's journal. So the journal and ``LATEST`` only ever name durable checkpoints: a kill
during a persist leaves the previous checkpoint whole, and the run resumes from it, redoing at
most the iterations since that one.

One persist is in flight at a time. A safe point that finds the previous one still writing waits
for it (``when_busy="wait"``, the default) or is not saved (``"skip"``); either is counted, and
said once. Whatever needs the checkpoint on disk waits for the persist first (:meth:`Saver.settle`):
an in-process retry after an out-of-memory error (which rolls back to it), leaving the kernel for
a restart, the end of the cell. A persist that failed (a full disk) is said at the next safe
point, and the run goes on from the previous checkpoint, as a synchronous save does.

The staging memory is bounded (:class:`~colab_resilience.checkpoints.staging.Budget`); after an
out-of-memory error the run gives it back and saves synchronously from then on, so staging never
makes a second one more likely.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

from .checkpoints import CheckpointStore
from .checkpoints.restore import goes_into
from .checkpoints.staging import Budget, Staging
from .words import plural
from .checkpoints.store import SaveReport
from .errors import CheckpointError, MissingNameError, UnsaveableValueError
from . import memory
from .memory import format_bytes

SAY_WAIT = 0.5  # seconds: a safe point that waits this long for the previous persist is said (once)
_thread_lock = threading.Lock()
_thread_of: tuple[int, ThreadPoolExecutor] | None = None  # (pid, the persisting thread)


def _persist_thread() -> ThreadPoolExecutor:
    """The one thread that persists checkpoints in this process (made once, again after a fork).
    Its work is joined at interpreter exit: a kernel that shuts down finishes its persist."""
    global _thread_of
    with _thread_lock:
        if _thread_of is None or _thread_of[0] != os.getpid():
            _thread_of = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="colab_resilience-persist"))
        return _thread_of[1]


@dataclass
class SaveStats:
    """What the saves of a run cost training (for ``%resilience status``)."""

    saves: int = 0
    stall: float = 0.0  # seconds training waited for snapshots
    longest_stall: float = 0.0
    waited: int = 0  # safe points that waited for the previous persist
    waited_seconds: float = 0.0
    skipped: int = 0  # safe points not saved because the previous persist was still writing
    staged: int = 0  # bytes of the last snapshot copied aside
    written_through: int = 0  # bytes of the last snapshot written while training waited
    synchronous: str | None = None  # why saves are synchronous, if they are

    def line(self) -> str:
        if not self.saves:
            return "no save yet"
        mean = self.stall / self.saves
        how = f"synchronous ({self.synchronous})" if self.synchronous else "in the background"
        parts = [f"{self.saves} saves {how}, training waited {mean:.3f} s per save (longest {self.longest_stall:.3f} s)"]
        if self.waited:
            parts.append(f"{plural(self.waited, 'safe point')} waited {self.waited_seconds:.1f} s for the previous write")
        if self.skipped:
            parts.append(f"{plural(self.skipped, 'safe point')} not saved (the previous write was still going)")
        return "; ".join(parts)


class Saver:
    """Takes a run's snapshots and persists them, one at a time (see the module docstring).

    ``on_durable(report, info)`` runs on the persisting thread once a checkpoint is on disk and
    named by ``LATEST`` (``info``: what the caller passed with the save); the caller serialises
    its journal writes against it. ``say`` is only ever called on the caller's thread.
    """

    def __init__(self, store: CheckpointStore, *, budget: Budget, when_busy: str = "wait",
                 on_durable: Callable[[SaveReport, Any], None], say: Callable[[str], None]):
        if when_busy not in ("wait", "skip"):
            raise ValueError("when_busy is 'wait' or 'skip'")
        self.store, self.when_busy, self.on_durable, self.say = store, when_busy, on_durable, say
        self.staging = None if budget.off else Staging(budget)
        self.stats = SaveStats(synchronous=None if self.staging else "staging_memory is off")
        self._in_flight: Future | None = None
        self._said: set[str] = set()
        self.failure: CheckpointError | None = None  # why the last save was not written, if it was not

    @property
    def busy(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def save(self, namespace: Mapping[str, Any], names: Sequence[str], *, meta: dict, info: Any,
             durable: bool = False, kept: Collection[str] = (), whole: Collection[str] = (), quiet: bool = False) -> bool:
        """Save at a safe point: True once the snapshot is taken (the checkpoint is on disk when
        this returns only with ``durable``), False when the safe point is not saved: the
        previous persist is still writing (``when_busy="skip"``) or this save failed (said).
        Raises what :meth:`CheckpointStore.snapshot` raises for the values themselves
        (:class:`UnsaveableValueError`, an out-of-memory error). ``kept``: the names a restore
        puts into the objects they hold (:func:`.checkpoints.restore.into`); a list or a notebook
        object among them keeps the objects it holds, which are then not cut off from other names.
        ``whole``: the modules saved whole (see :func:`.checkpoints.values.prepare`). ``quiet``: a
        failure of this save is not said, only kept in :attr:`failure` (the run's last save: it
        says it itself)."""
        if self.busy:
            if self.when_busy == "skip" and not durable:
                self.stats.skipped += 1
                self._once("skip", "colab_resilience: a safe point came before the previous checkpoint was "
                           "written, so it was not saved (when_busy='skip'); see %resilience status")
                return False
            t = time.perf_counter()
            self.settle()
            waited = time.perf_counter() - t
            self.stats.waited += 1
            self.stats.waited_seconds += waited
            if waited >= SAY_WAIT:  # a few milliseconds of fsync behind a tiny loop are not news
                self._once("wait", f"colab_resilience: a safe point waited {waited:.1f} s for the previous "
                           "checkpoint to be written (the disk writes slower than the loop makes checkpoints); "
                           "use --every to save less often, or ResilienceMagics.when_busy = 'skip'")
        else:
            self.settle()
        limited = memory.limited() if self.staging is not None else None
        if limited is not None:
            # a thread of its own and staging memory would take what the limit counts
            self.go_synchronous(limited)
        try:
            snap = self.store.snapshot(namespace, names, meta=meta, strict=True, staging=self.staging, whole=whole)
        except (UnsaveableValueError, MissingNameError):
            raise
        except CheckpointError as e:
            self._failed(e, say=not quiet)
            return False
        self._count(snap.stall, snap.staged, snap.written_through)
        for p in snap.prepared:
            if p.cut_off and not (p.name in kept and goes_into(namespace[p.name])):
                them = " and ".join(p.cut_off)
                one = len(p.cut_off) == 1
                self._once(f"cut_off:{p.name}:{them}", (
                    f"colab_resilience: {p.name!r} holds {them}, which {'is' if one else 'are'} not in --save: "
                    f"after a restore it would hold {'a copy of it' if one else 'copies of them'}, cut off from "
                    f"{them} (code that uses {them} would go on from the replayed state); add {them} to --save: "
                    f"{'it is' if one else 'they are'} restored in place and {p.name!r} holds "
                    f"{'it' if one else 'them'} again"))
        if self.staging is None:
            try:
                self._persist(snap, info)
            except CheckpointError as e:
                self._failed(e, say=not quiet)
                return False
            return True
        self._in_flight = _persist_thread().submit(self._persist, snap, info)
        if durable:
            self.settle(say=not quiet)
        return True

    def _persist(self, snap, info: Any) -> SaveReport:
        """Write the snapshot; once it is on disk, the run records it (on the persisting thread
        when saves are in the background)."""
        report = self.store.persist(snap)
        self.on_durable(report, info)
        self.failure = None
        return report

    def _count(self, stall: float, staged: int, through: int) -> None:
        s = self.stats
        s.saves += 1
        s.stall += stall
        s.longest_stall = max(s.longest_stall, stall)
        s.staged, s.written_through = staged, through
        st = self.staging
        if st is None:
            return
        if st.failed:
            self._once("failed", f"colab_resilience: {st.failed}; this save was written while training waited")
        elif through and st.measured:
            self._once("fit", f"colab_resilience: {format_bytes(through)} of the state did not fit in the staging "
                       f"memory ({st.budget.describe()}), so it is written while training waits ({stall:.2f} s "
                       "at this safe point); raise ResilienceMagics.staging_memory to shorten that")

    def settle(self, *, say: bool = True) -> None:
        """Wait until no persist is in flight; say it if it failed (``say``; :attr:`failure` holds
        why either way)."""
        future, self._in_flight = self._in_flight, None
        if future is None:
            return
        try:
            future.result()
        except CheckpointError as e:
            self._failed(e, say=say)

    def _failed(self, e: CheckpointError, *, say: bool = True) -> None:
        self.failure = e
        if say:  # the store's line says which checkpoint stays, if any
            self.say(f"{str(e).splitlines()[0]}; the run goes on and tries again at the next safe point")

    def go_synchronous(self, why: str) -> None:
        """Give the staging memory back and save synchronously from now on (after host memory ran
        out: ``%resilience status`` says so)."""
        self.settle()
        if self.staging is not None:
            self.staging.release()
            self.staging = None
            self.stats.synchronous = why

    def close(self, *, say: bool = True) -> None:
        """The end of the run: the persist in flight finished, the staging memory given back."""
        self.settle(say=say)
        if self.staging is not None:
            self.staging.release()

    def _once(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.say(line)
