"""Faults injected on purpose, for ``colab-resilience check``, and the timeline they are aimed by.

Inert unless the kernel was started with one of these in its environment (``colab-resilience
check`` sets them; nothing else does):

- ``COLAB_RESILIENCE_TIMELINE=FILE``: every safe point appends ``<number> <phase> <time> <kind>``
  to FILE, ``before`` and ``after`` its save (``kind``: ``iteration``, or ``end`` for the end of a
  cell): the uninterrupted run tells how many safe points the notebook has and how long its
  iterations and saves take;
- ``COLAB_RESILIENCE_FAULT=JSON``: one fault, ``{"kind": "kill" | "oom", "safe_point": N,
  "phase": "before" | "after", "delay": SECONDS, "mark": FILE}``: when safe point N reaches the
  phase (before or after its save), after ``delay`` seconds (on a timer thread, so training goes
  on meanwhile: a kill can land inside the save, or anywhere in the next iteration), the kernel
  is killed with SIGKILL, or an out-of-memory error is raised in the main thread while it runs
  the notebook's code. ``mark`` is created first: the fault fires once, not again in the kernel
  that resumes.

Safe points are counted across the kernel's ``%%resilient`` cells from 1.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time

TIMELINE_ENV = "COLAB_RESILIENCE_TIMELINE"
FAULT_ENV = "COLAB_RESILIENCE_FAULT"

_count = 0
_timeline = os.environ.get(TIMELINE_ENV)
try:
    _fault = json.loads(os.environ.get(FAULT_ENV) or "null")
except ValueError:
    _fault = None
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_injected = threading.Event()  # an out-of-memory error was raised here, not by an allocation


def take_injected() -> bool:
    """Whether the out-of-memory error being recovered from was injected (then cleared): the
    recovery does not shrink a batch for it, so the result can be compared."""
    injected = _injected.is_set()
    _injected.clear()
    return injected


def active() -> bool:
    return bool(_timeline or _fault)


def safe_point(phase: str, *, end: bool = False) -> None:
    """Called by a run at each safe point, ``before`` and ``after`` its save; ``end``: the one at
    the end of the cell (no code of the notebook follows it in the cell)."""
    global _count
    if phase == "before":
        _count += 1
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
    fire = _kill if fault.get("kind") == "kill" else _oom_in_main_thread
    if delay <= 0:
        fire(mark)
    else:
        threading.Thread(target=_later, args=(delay, fire, mark), name="colab_resilience-fault", daemon=True).start()


def fired(mark: str | os.PathLike) -> bool:
    """Whether the fault armed with ``mark`` went off (the kernel may have ended first)."""
    try:
        with open(mark) as f:
            return "fired" in f.read()
    except OSError:
        return False


def _fired(mark: str) -> None:
    with open(mark, "a") as f:
        f.write("fired\n")


def _later(delay: float, fire, mark: str) -> None:
    time.sleep(delay)
    fire(mark)


def _kill(mark: str) -> None:
    _fired(mark)
    os.kill(os.getpid(), signal.SIGKILL)


def _in_notebook_code(frame) -> bool:
    """Whether ``frame`` (innermost first) runs a ``%%resilient`` cell's code or what it called:
    the body below :func:`colab_resilience.execution.run_body`, with no frame of this package
    in between (a save, a restore)."""
    from .execution import run_body

    while frame is not None:
        if frame.f_code is run_body.__code__:
            return True
        if os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
            return False
        frame = frame.f_back
    return False


def _oom_in_main_thread(mark: str) -> None:
    """Raise an out-of-memory error in the main thread, as an allocation would: at once if it
    runs the notebook's code (or a library it called), else as soon as it does."""
    main = threading.main_thread().ident
    torch = sys.modules.get("torch")
    error = getattr(torch, "OutOfMemoryError", None) or MemoryError
    for _ in range(20000):  # about 10 s
        if _in_notebook_code(sys._current_frames().get(main)):
            _fired(mark)
            _injected.set()
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(error))
            return
        time.sleep(0.0005)
