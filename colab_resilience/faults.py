"""Faults injected on purpose, for ``colab-resilience check``, and the timeline they are aimed by.

Inert unless the kernel was started with one of these in its environment (``colab-resilience
check`` sets them; nothing else does):

- ``COLAB_RESILIENCE_TIMELINE=FILE``: every safe point appends ``<number> <phase> <time> <kind>``
  to FILE, ``before`` and ``after`` its save (its snapshot, when the checkpoint is then written in
  the background) (``kind``: ``iteration``, or ``end`` for the end of a cell), and ``durable``
  (kind ``write``) once its checkpoint is on disk and the journal names it, which for a
  background save is later, on the persisting thread: the uninterrupted run tells how many safe
  points the notebook has, how long its iterations take, and when its checkpoints are written,
  so that a kill can be aimed into a background write;
- ``COLAB_RESILIENCE_FAULT=JSON``: one fault, ``{"kind": "kill" | "oom", "safe_point": N,
  "phase": "before" | "after", "delay": SECONDS, "mark": FILE}``: when safe point N reaches the
  phase (before or after its save), after ``delay`` seconds (on a timer thread, so training goes
  on meanwhile: a kill can land inside the save, or anywhere in the next iteration), the kernel
  is killed with SIGKILL, or an out-of-memory error is raised in the main thread while it runs
  the notebook's code. ``mark`` is created first: the fault fires once, not again in the kernel
  that resumes.

Safe points are counted from 1 across the ``%%resilient`` cells of the run, and across its
kernels: a kernel that takes over after a planned restart (``%restart_after``) goes on counting
where the one before stopped (the count is kept in ``FILE.count``, next to the timeline or the
mark), so the uninterrupted run's timeline numbers every safe point once and a fault can be aimed
at one that a later kernel reaches.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from .oom import INJECTED

TIMELINE_ENV = "COLAB_RESILIENCE_TIMELINE"
FAULT_ENV = "COLAB_RESILIENCE_FAULT"

_count = 0
_timeline = os.environ.get(TIMELINE_ENV)
try:
    _fault = json.loads(os.environ.get(FAULT_ENV) or "null")
except ValueError:
    _fault = None
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_INTEGRATIONS = os.path.join(_PACKAGE, "integrations") + os.sep
_injected = threading.Event()  # an out-of-memory error was raised here, not by an allocation


def take_injected() -> bool:
    """Whether the out-of-memory error being recovered from was injected (then cleared): the
    recovery does not shrink a batch for it, so the result can be compared."""
    injected = _injected.is_set()
    _injected.clear()
    return injected


def reached() -> None:
    """The out-of-memory handling has the error it recovers from: if that was the injected one, its
    mark says so. An injected error that the notebook's libraries caught themselves (a
    ``try/except Exception`` around the line it was raised at) never gets here: the run went on
    as if nothing had happened, and proves nothing about this package."""
    mark = (_fault or {}).get("mark")
    if _injected.is_set() and mark:
        with open(mark, "a") as f:
            f.write("reached\n")


def active() -> bool:
    return bool(_timeline or _fault)


def count() -> int:
    """The number of the safe point reached last (from 1; 0 before the first)."""
    return _count


def persisted(number: int) -> None:
    """Called once safe point ``number``'s checkpoint is on disk and recorded (on the persisting
    thread for a background save): the timeline's ``durable`` line."""
    if _timeline:
        with open(_timeline, "a") as f:
            f.write(f"{number} durable {time.monotonic():.6f} write\n")


def _counter() -> str | None:
    """The file that carries the safe-point count from a kernel to the one that takes over."""
    base = _timeline or (_fault or {}).get("mark")
    return f"{base}.count" if base else None


def _next_count() -> int:
    counter = _counter()
    if counter is None:
        return _count + 1
    try:
        with open(counter) as f:
            last = int(f.read().strip() or 0)
    except (OSError, ValueError):
        last = 0
    number = max(last, _count) + 1
    with open(counter, "w") as f:
        f.write(f"{number}\n")
    return number


def safe_point(phase: str, *, end: bool = False) -> None:
    """Called by a run at each safe point, ``before`` and ``after`` its save; ``end``: the one at
    the end of the cell (no code of the notebook follows it in the cell)."""
    global _count
    if phase == "before":
        _count = _next_count()
    if _timeline:
        with open(_timeline, "a") as f:
            f.write(f"{_count} {phase} {time.monotonic():.6f} {'end' if end else 'iteration'}\n")
    fault = _fault
    if not fault or fault.get("safe_point") != _count or fault.get("phase") != phase:
        return
    mark = fault.get("mark")
    if not mark or os.path.exists(mark):
        return
    with open(mark, "w") as f:
        f.write(f"armed in {os.getpid()}\n")
    delay = float(fault.get("delay") or 0.0)
    if fault.get("kind") != "kill":
        _oom_after(delay, mark)
    elif delay <= 0:
        _kill(mark)
    else:
        threading.Thread(target=_kill_later, args=(delay, mark), name="colab_resilience-fault", daemon=True).start()


def fired(mark: str | os.PathLike) -> bool:
    """Whether the fault armed with ``mark`` went off (the kernel may have ended first)."""
    return fired_at(mark) is not None


def reached_handling(mark: str | os.PathLike) -> bool:
    """Whether the out-of-memory error armed with ``mark`` reached this package's handling
    (:func:`reached`)."""
    try:
        with open(mark) as f:
            return any(ln.strip() == "reached" for ln in f)
    except OSError:
        return False


def fired_at(mark: str | os.PathLike) -> str | None:
    """Where the fault armed with ``mark`` went off (``file:line`` for an out-of-memory error,
    "" for a kill); None if it did not."""
    try:
        with open(mark) as f:
            lines = [ln.strip() for ln in f if ln.startswith("fired")]
    except OSError:
        return None
    return lines[0].removeprefix("fired").strip() if lines else None


def _fired(mark: str, where: str = "") -> None:
    with open(mark, "a") as f:
        f.write(f"fired {where}".rstrip() + "\n")


_cleanup: dict[str, frozenset[int]] = {}


def cleanup_lines(filename: str) -> frozenset[int]:
    """The lines of ``filename`` where an injected error would skip clean-up that no real
    allocation failure can skip: a ``with`` statement's lines (Python reports the call of
    ``__exit__`` at them; an error raised there by a trace function leaves the context, such as
    ``torch.no_grad()``, unrestored), ``finally`` blocks, and ``__exit__`` methods."""
    lines = _cleanup.get(filename)
    if lines is not None:
        return lines
    import ast
    import linecache

    source = linecache.getlines(filename)
    found: set[int] = set()
    try:
        # a cell's magics (%%resilient, %time, !cmd) are not Python: blank them, keep the numbering
        tree = ast.parse("".join("\n" if ln.lstrip().startswith(("%", "!")) else ln for ln in source))
    except (SyntaxError, ValueError):
        tree = None
        found = {i for i, ln in enumerate(source, 1) if ln.lstrip().startswith(("with ", "async with "))}
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.With, ast.AsyncWith)):
            found.update(range(node.lineno, node.body[0].lineno))
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            for stmt in node.finalbody:
                found.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("__exit__", "__aexit__"):
            found.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines = _cleanup[filename] = frozenset(found)
    return lines


def _kill_later(delay: float, mark: str) -> None:
    time.sleep(delay)
    _kill(mark)


def _kill(mark: str) -> None:
    _fired(mark)
    os.kill(os.getpid(), signal.SIGKILL)


def _ours(frame) -> bool:
    return os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE)


def _passes_through(frame) -> bool:
    """A frame of an integration's wrapper (``Trainer.train``'s): the framework's training runs
    below it as the cell's own code would, so an allocation there can fail as in the cell."""
    return os.path.abspath(frame.f_code.co_filename).startswith(_INTEGRATIONS)


def _may_fail_here(frame) -> bool:
    """Whether an allocation could fail at ``frame``'s line in its place: the frame runs a
    ``%%resilient`` cell's code or what it called (it lies below
    :func:`colab_resilience.execution.run_body` with no frame of this package in between but an
    integration's wrapper, :func:`_passes_through`), and
    neither it nor any caller up to the cell is cleaning up (an ``__exit__``, a ``with``
    statement's exit, a ``finally`` block: :func:`cleanup_lines`)."""
    from .execution import run_body

    while frame is not None:
        code = frame.f_code
        if code is run_body.__code__:
            return True
        if (_ours(frame) and not _passes_through(frame)) or code.co_name in ("__exit__", "__aexit__") \
                or frame.f_lineno in cleanup_lines(code.co_filename):
            return False
        frame = frame.f_back
    return False


def _oom_after(delay: float, mark: str) -> None:
    """Raise an out-of-memory error in this (the main) thread at the first line of a
    ``%%resilient`` cell's code, or of a library it calls, that runs ``delay`` seconds from now,
    as an allocation there would. A trace function watches the lines until then; lines of this
    package, or outside such a cell, never fire it, nor lines run by clean-up, where a real
    allocation failure would not skip the rest of the clean-up (:func:`_may_fail_here`). Where
    it fired is written to ``mark``."""
    deadline = time.monotonic() + delay
    torch = sys.modules.get("torch")
    error = getattr(torch, "OutOfMemoryError", None) or MemoryError

    def trace(frame, event, arg):
        if _ours(frame):
            return None
        if event == "line" and time.monotonic() >= deadline and _may_fail_here(frame):
            stop()
            _fired(mark, f"{frame.f_code.co_filename}:{frame.f_lineno}")
            _injected.set()
            raise error(f"out of memory {INJECTED}")
        return trace

    def stop():
        sys.settrace(None)
        frame = sys._getframe()
        while frame is not None:
            frame.f_trace = None
            frame = frame.f_back

    frame = sys._getframe(1)
    while frame is not None:  # the notebook's frames already running: the cell, its functions
        if not _ours(frame):
            frame.f_trace = trace
        frame = frame.f_back
    sys.settrace(trace)
