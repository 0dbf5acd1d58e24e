"""``resume_range`` and ``checkpoint()``: the safe points of a ``%%resilient`` cell, and resuming
inside an iteration.

The end of every ``resume_range`` iteration is a safe point. Where it was taken is a *position*:
for every ``resume_range`` loop running at that moment, from the outermost in, its ordinal among
the loops of its parent iteration (or of the cell) and an iteration: for the innermost loop the
next one, for the others the one in progress. Beside the position a checkpoint keeps the random
state each of those outer loops had when its iteration in progress began.

A resumed (or retried) cell runs again from its first line. When its first loop starts, the
declared state is restored; loops that had finished are skipped; a loop the position runs through
starts at its iteration in progress with the random state that iteration began with, so the code
above the inner loop (``perm = torch.randperm(n)``, ``iter(loader)``) draws what it drew the
first time; the innermost loop of the position is the resume point: there the names the code
above it rebound (``running_loss = 0.0``) get their saved values back, the random state becomes
the checkpoint's, and the loop continues with its first unfinished iteration.

``resume_range`` takes the arguments of ``range``, or one iterable (a ``DataLoader``, a list, a
generator made by the cell): the finished items of an iterable are skipped by drawing them from a
fresh iterator created at the same point with the same random state, so the order is the
uninterrupted one.

``checkpoint()`` inside an iteration saves at the end of that iteration, the next point where
the state is consistent, whatever ``--every`` says. Anywhere else it is refused when called: a
cell restarted from its first line cannot resume in the middle of its code.
"""

from __future__ import annotations

import gc
import operator
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from . import words
from .errors import RetryNotExactError, RunStoppedError, UnsafeCheckpointError

LOOP_RNG = "loops:rng"  # the checkpoint entry holding the outer loops' random states


@dataclass
class Frame:
    """A running ``resume_range`` loop."""

    ordinal: int  # among the loops of its parent iteration (or of the cell)
    items: Any
    index: int = 0  # the iteration in progress
    rng: dict | None = None  # the random state when it began (None: not captured)
    children: int = 0  # loops started in the iteration in progress
    had_children: bool = True  # in its last iteration: capture the random state at the next


@dataclass
class Plan:
    """Where a resumed attempt goes: the saved position, followed loop by loop."""

    position: list[tuple[int, int]]
    rngs: list[dict]
    checkpoint: Any
    restored: dict[str, int] = field(default_factory=dict)  # name -> id() of what was restored
    depth: int = 0  # the depth whose loop the plan waits for
    # saved names the cell makes below its first loop (opt2 = Adam(...) between two loops): restored
    # where the plan arrives, or at the cell's end when every loop had finished
    later: list[str] = field(default_factory=list)
    # each loop's range where it was one, [start, stop, step] (:func:`spans`), as the position's
    spans: list | None = None


def spans(frames: list[Frame]) -> list | None:
    """The ranges of the loops of a position, ``[start, stop, step]`` (None for a loop over an
    iterable), or None where none is a range: a resumed loop goes on by its numbers
    (:meth:`Loops._resumed_index`)."""
    found = [[f.items.start, f.items.stop, f.items.step] if isinstance(f.items, range) else None for f in frames]
    return found if any(x is not None for x in found) else None


def _range_text(r: range) -> str:
    return f"resume_range({', '.join(map(str, (r.start, r.stop) if r.step == 1 else (r.start, r.stop, r.step)))})"


def _numbers(r: range) -> str:
    """A range's numbers, for people: "0 to 3", "0, 16, ..., 48", "5, 6"."""
    if len(r) <= 3:
        return ", ".join(map(str, r)) or "none"
    return f"{r[0]} to {r[-1]}" if r.step == 1 else f"{r[0]}, {r[1]}, ..., {r[-1]}"


def position_of(meta: Any) -> list[tuple[int, int]]:
    """The position a checkpoint was taken at (``next`` alone: a checkpoint of an older release)."""
    if isinstance(meta, dict):
        loops = meta.get("loops")
        if isinstance(loops, list) and all(isinstance(p, list) and len(p) == 2 for p in loops):
            return [(int(o), int(i)) for o, i in loops]
        if "next" in meta:
            return [(0, int(meta["next"]))]
    return [(0, 0)]


def _items(args: tuple) -> Any:
    if len(args) == 1 and not hasattr(type(args[0]), "__index__"):
        items = args[0]
        if not hasattr(items, "__iter__"):
            raise TypeError(f"resume_range takes the arguments of range, or one iterable; got {words.a(type(items).__name__)}")
        return items
    return range(*(operator.index(a) for a in args))


def _own_iterator(x: Any) -> bool:
    try:
        return hasattr(type(x), "__next__") and iter(x) is x
    except Exception:
        return False


def _iterators_in(items: Any, depth: int = 3) -> list[Any]:
    """The iterators (iterables that are their own iterator: generators) a loop over ``items``
    draws from: ``items`` itself, and those inside Python's iterator wrappers (``enumerate(gen)``,
    ``zip``, ``map``, ``itertools``)."""
    if not _own_iterator(items):
        return []
    found = [items]
    if depth and type(items).__module__ in ("builtins", "itertools") and not isinstance(items, types.GeneratorType):
        inner = gc.get_referents(items)
        inner += [x for t in inner if type(t) is tuple for x in t]  # zip and map hold theirs in a tuple
        for x in inner:
            found += [y for y in _iterators_in(x, depth - 1) if all(y is not f for f in found)]
    return found


def _describe(items: Any, index: int) -> str:
    describe = getattr(items, "describe", None)  # a framework's epochs name themselves ("epoch 2/4")
    if callable(describe):
        return describe(index)
    if isinstance(items, range):
        return str(items[index]) if index < len(items) else "the end"
    try:
        if index >= len(items):  # a loader whose last batch was the safe point's
            return "the end"
    except Exception:  # no length (a generator), or one that fails
        pass
    return f"item {index}"


class Loops:
    """The ``resume_range`` loops of one attempt of a run's cell."""

    def __init__(self, run):
        self.run = run
        self.frames: list[Frame] = []
        self.top = 0  # loops started at the top level of this attempt
        self.plan: Plan | None = None
        self.save_requested = False
        # iterators (an iterable that is its own iterator: a generator) the loops drew from, in
        # this attempt and in the earlier ones of this kernel: id -> a weak (or, at the top
        # level, strong) reference
        self._drawn: dict[int, Any] = {}
        self._drawn_before: dict[int, Any] = {}

    def reset(self) -> None:
        """Before each attempt of the cell."""
        self._drawn_before.update(self._drawn)
        self._drawn = {}
        self.frames.clear()
        self.top = 0
        self.plan = None
        self.save_requested = False

    # ---------------------------------------------------------------------------- entering

    def iterate(self, items: Any) -> Iterator[Any]:
        run, depth = self.run, len(self.frames)
        parent = self.frames[-1] if self.frames else None
        if parent is None:
            ordinal, self.top = self.top, self.top + 1
        else:
            ordinal, parent.children = parent.children, parent.children + 1
        if depth == 0 and ordinal == 0 and not run.uses_loop:
            run.loop_found()
        if depth == 0 and ordinal == 0 and run.resuming:
            self.plan = run.restore_for_loops()
        start, arrival = self._start(depth, ordinal, items)
        if start is None:  # a loop that had finished before the checkpoint: skipped
            return
        frame = Frame(ordinal, items, start)
        self.frames.append(frame)
        try:
            yield from self._run(frame, start, arrival)
        finally:
            # by identity: an attempt that failed may close its loop late (a framework callback's,
            # collected after the retry began), when reset() has removed it and equal frames exist
            self.frames[:] = [f for f in self.frames if f is not frame]

    def _start(self, depth: int, ordinal: int, items: Any) -> tuple[int | None, Plan | None]:
        """Where this loop starts, and the plan if it is the resume point (arrived at once its
        finished items are skipped: drawing them again consumes random numbers)."""
        plan, run = self.plan, self.run
        if plan is None or plan.depth != depth or depth >= len(plan.position):
            if plan is None and depth == 0 and ordinal == 0 and not run.resuming:
                run.first_safe_point()  # the loop start
            return 0, None
        want, at = plan.position[depth]
        if ordinal < want:
            return None, None
        if ordinal > want:
            raise RunStoppedError(
                f"colab_resilience: run {run.run_id}: the checkpoint was taken in loop {want + 1} at this "
                f"level, but this attempt of the cell started loop {ordinal + 1} first; the cell no longer "
                "runs as it did. Run `%resilience reset` to start the run afresh"
            )
        at = self._resumed_index(plan, depth, items, at, innermost=depth == len(plan.position) - 1)
        if depth == len(plan.position) - 1:
            self.plan = None
            return at, plan
        run.restore_rng(plan.rngs[depth])
        plan.depth += 1
        return at, None

    def _resumed_index(self, plan: Plan, depth: int, items: Any, at: int, *, innermost: bool) -> int:
        """Where a resumed ``range`` loop goes on: a position counts iterations, so over other
        numbers than its checkpoint was taken in it goes on by the numbers. ``resume_range(start_epoch,
        8)`` whose start the set-up cells read from a checkpoint file of the notebook's own (its own
        resume, besides this one) starts after what that file holds: at iteration 0 of
        ``range(4, 8)`` where the run had gone over 0 to 3, the next it would have run. Where no
        iteration is the next one the run went on with (the file is ahead of the run's checkpoint:
        ``range(5, 8)``), or one that ran would run again, going on would skip iterations that never
        ran or run some twice, and end "done" with another result: the run stops, pending, in one
        line. (A loop that goes on over the same numbers, longer or shorter, as a pending cell edited
        to train longer does, goes on at its iteration; where the cell shrinks a value on
        out-of-memory errors, ``--shrink``, a loop over ``range(0, n, batch_size)`` changes its step
        with it: it goes on at its iteration, and the line says what ran before ran with the old
        value.)"""
        saved = plan.spans[depth] if plan.spans and depth < len(plan.spans) else None
        if saved is None or not isinstance(items, range):
            return at
        before = range(*saved)
        if before[:at + (0 if innermost else 1)] == items[:at + (0 if innermost else 1)]:
            return at
        if self.run.shrink and before.start == items.start and before.step != items.step:
            return at  # range(0, n, batch_size), the batch shrunk: by its iteration, as the line says
        done = before[:at]  # (innermost: the iterations that ran; else those before the one in progress)
        going = before[at] if at < len(before) else None  # what the run went on with
        j = 0
        while j < len(items) and items[j] in done:
            j += 1
        rest = items[j:]
        again = next((v for v in done if v in rest), None)  # (ranges: each `in` is arithmetic)
        if again is None:
            if going is not None and j < len(items) and items[j] == going:
                return j  # the next number the run went on with: the uninterrupted run's, from here
            if going is None and innermost:
                return j  # the run's loop had finished: what the loop has beyond its numbers is new
        state = f"after {_numbers(done)} had run" if done else "before any iteration had run"
        if going is not None:
            state += f" ({going} {'next' if innermost else 'in progress'})"
        why = (f"which would run {again} again" if again is not None else
               f"which has no {going}" if going is not None and going not in items else
               f"which would go on with {items[j]}, not {going}" if j < len(items) else "which has no iteration left")
        raise RunStoppedError(
            f"colab_resilience: run {self.run.run_id}: its checkpoint was taken in {_range_text(before)} {state}, "
            f"but the loop is now {_range_text(items)}, {why}: going on would skip iterations that never ran, or "
            "run some twice. Its bounds come from something else now (a start the set-up cells read from a "
            "checkpoint file of the notebook's own, written after the run's last checkpoint: resume_range resumes "
            "by itself); make it the loop the run began with, or run `%resilience reset` to start the run afresh"
        )

    def _where(self, items: Any, at: int) -> str:
        """Where a resumed loop goes on, for people: the outer loops' iterations, then its own."""
        outer = [_describe(f.items, f.index) for f in self.frames[:-1]]  # the last is its own
        return ", ".join(outer + [_describe(items, at)])

    # ---------------------------------------------------------------------------- iterating

    def _run(self, frame: Frame, start: int, arrival: Plan | None) -> Iterator[Any]:
        run = self.run
        items = frame.items
        if isinstance(items, range):
            source: Iterable = (items[i] for i in range(start, len(items)))
        else:
            source = iter(items)
            for it in _iterators_in(items):
                self._draw_once(it, len(self.frames) == 1)
            for _ in range(start):  # drawn again from a fresh iterator: the same order, the same data
                if next(source, _END) is _END:
                    break
        if arrival is not None:
            run.arrive(arrival, at_text=self._where(items, start))
        length = len(items) if hasattr(items, "__len__") else None
        index = start
        for item in source:
            frame.index, frame.children = index, 0
            frame.rng = run.capture_rng() if (frame.had_children or len(self.frames) == 1) else None
            run.iteration = ", ".join([_describe(f.items, f.index) for f in self.frames])  # for people
            yield item
            run.iteration = None
            frame.had_children = frame.children > 0
            if self.plan is not None and self.plan.depth > len(self.frames) - 1:
                raise RunStoppedError(
                    f"colab_resilience: run {run.run_id}: the resumed iteration ended without reaching the "
                    "inner resume_range the checkpoint was taken in; the cell no longer runs as it did. "
                    "Run `%resilience reset` to start the run afresh"
                )
            index += 1
            self.safe_point(frame, index, last=length is not None and index == length)

    def _draw_once(self, items: Any, top: bool) -> None:
        """Note an iterator a loop draws from; RetryNotExactError where an earlier attempt in this
        kernel drew from it (made outside the cell, by a %%replay cell): the items it gave are
        gone, so skipping to the safe point would skip others, and a generator an OOM was raised
        in has ended. A restarted kernel's set-up cells make it afresh."""
        earlier = self._drawn_before.get(id(items))
        if earlier is not None and (earlier() if isinstance(earlier, weakref.ref) else earlier) is items:
            what = words.a(type(items).__name__)
            raise RetryNotExactError(
                f"colab_resilience: resume_range goes on over {what} an earlier attempt drew from (made outside "
                "the cell): its items up to the safe point are gone, so a retry in this kernel would skip others; "
                "a restarted kernel's set-up cells make it afresh (to retry in place, make it in the cell, above "
                "the loop)",
                f"the retry cannot draw again from {what} made outside the cell")
        try:
            self._drawn[id(items)] = weakref.ref(items)
        except TypeError:  # no weak references (map, zip): held while the run lasts, at the top level only
            if top:
                self._drawn[id(items)] = items

    def safe_point(self, frame: Frame, next_index: int, *, last: bool) -> None:
        """The end of ``frame``'s iteration: save if due (or asked for), restart if planned."""
        outer = self.frames[:-1]
        position = [(f.ordinal, f.index) for f in outer] + [(frame.ordinal, next_index)]
        rngs = [f.rng for f in outer]
        force, self.save_requested = self.save_requested, False
        if any(r is None for r in rngs):
            return  # an outer iteration began without its random state: not resumable here
        where = ", ".join([_describe(f.items, f.index) for f in outer] + [_describe(frame.items, next_index)])
        self.run.safe_point(position, rngs, force=force, last=last, where=where, spans=spans([*outer, frame]))

    def request_save(self) -> None:
        if not self.frames:
            raise UnsafeCheckpointError(
                "colab_resilience: checkpoint() outside a resume_range iteration cannot resume exactly "
                "(after a restart the cell runs again from its first line, on top of the state saved "
                "here); call it inside a `for ... in resume_range(...)` loop, where it saves at the end "
                "of the iteration, or split the cell"
            )
        self.save_requested = True


_END = object()


# --------------------------------------------------------------------------------------------
# the public functions

ACTIVE: list = []  # the runs whose %%resilient cells are running, innermost last
_warned_outside = False


def active_run():
    """The run of the ``%%resilient`` cell running now, or None."""
    return ACTIVE[-1] if ACTIVE else None


def resume_range(*args):
    """``range(*args)`` (or one iterable) whose iterations are safe points of the enclosing
    ``%%resilient`` cell.

    In a resumed (or retried) run, the declared state is restored when the first loop starts,
    finished iterations are skipped, and a nested loop resumes at its first unfinished inner
    iteration (see the module documentation). Outside a ``%%resilient`` cell it is a plain
    ``range`` (or the iterable itself).
    """
    global _warned_outside
    items = _items(args)
    run = active_run()
    if run is None:
        if not _warned_outside:
            _warned_outside = True
            print("colab_resilience: resume_range outside a %%resilient cell: nothing is checkpointed here", file=sys.stderr)
        yield from items
        return
    yield from run.loops.iterate(items)


def checkpoint() -> None:
    """Save the declared state at the end of the current ``resume_range`` iteration, whatever
    ``--every`` says. Refused (:class:`UnsafeCheckpointError`) outside an iteration."""
    run = active_run()
    if run is None:
        print("colab_resilience: checkpoint() outside a %%resilient cell: nothing to save", file=sys.stderr)
        return None
    run.loops.request_save()
    return None
