"""The kernel side of the supervisor's standby kernel.

While a notebook runs under :func:`colab_resilience.run_notebook`, the driver keeps a second
kernel started and warm: after every cell it asks the working kernel which installed modules it
has imported (:func:`new_modules`) and has the standby import them too (:func:`preload`). When the
working kernel dies, the standby takes its place (:func:`adopt`): the kernel start and the imports
(``import torch`` and what the set-up cells pull in, such as the ``torch._dynamo`` that torch's
optimizers import: seconds) are already done, and only the replay of the set-up cells and the
restore remain.

A standby must cost the run as little as possible:

- it runs at the lowest CPU priority (nice 19), so it uses only CPU time that the working kernel
  leaves idle: the whole process where the kernel that takes over may raise its priority back
  (the driver checks), else only the thread that imports (Linux sets nice values per thread).
  In the first case its scheduling group is niced too: with autogroups (the default of most
  distributions, ``/proc/sys/kernel/sched_autogroup_enabled``) Linux first shares the CPUs
  between sessions, and only then by nice within each, and jupyter_client starts every kernel
  in a session of its own; a standby niced thread by thread still took half of a 2-CPU machine
  from the working kernel while it imported torch (its first epoch after a restart: 2.8-3.4 s
  instead of 0.85 s);
- it is the OOM killer's first choice (``oom_score_adj`` 1000): when host RAM runs out, it is
  killed before the working kernel and gives its memory back; the next restart is then a cold one;
- it imports only modules installed in the interpreter's own folders (the standard library and
  site-packages), never the notebook's own files, and never a module that starts a CUDA context
  on import (``pycuda.autoinit``): a standby holds no GPU memory.

A standby is started with ``COLAB_RESILIENCE_STANDBY=1`` in its environment (:func:`adopt`
removes it from ``os.environ``). Nothing here runs unless the driver asks; in a kernel started
by hand it is never imported.
"""

from __future__ import annotations

import functools
import importlib
import os
import queue
import sys
import sysconfig
import threading
import time

# modules that must not be imported ahead of need: they create a CUDA context (GPU memory) on import
_NEVER = (".autoinit",)
ENV = "COLAB_RESILIENCE_STANDBY"
NICE = 19
OOM_SCORE_ADJ = 1000

_reported: set[str] = set()
_queue: queue.SimpleQueue | None = None
_stop = threading.Event()
_worker: threading.Thread | None = None
_saved_adj: str | None = None
_imported: list[str] = []  # what the standby imported ahead of need (for tests and reports)


@functools.lru_cache(maxsize=None)
def _roots() -> tuple[str, ...]:
    import site

    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # virtualenv's old site.py
        pass
    user = getattr(site, "getusersitepackages", lambda: None)()
    if user:
        paths.add(user)
    roots = set()
    for p in paths:
        if p:
            roots.add(os.path.join(os.path.realpath(p), ""))
            roots.add(os.path.join(os.path.abspath(p), ""))
    return tuple(roots)


def new_modules() -> list[str]:
    """(In the working kernel.) The installed modules imported since the last call, in the order
    they were imported; the first call lists every one."""
    roots = _roots()
    out = []
    for name, module in list(sys.modules.items()):
        if name in _reported:
            continue
        _reported.add(name)
        path = getattr(module, "__file__", None)
        if not path or name == "__main__" or name.endswith(_NEVER) or name.startswith("colab_resilience"):
            continue
        if path.startswith(roots) or os.path.realpath(path).startswith(roots):
            out.append(name)
    return out


def _renice_all(value: int) -> None:
    """Every thread of this process to nice ``value`` (Linux; elsewhere nothing)."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except OSError:
            pass


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of the scheduling group (autogroup) of process ``pid``; None without one."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().rsplit("nice", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(value: int, pid: int | str = "self") -> bool:
    """Set the nice value of the scheduling group of ``pid`` (Linux with autogroups; lowering it
    below 0 needs what lowering a nice value needs); False where that did not happen. Only where
    ``pid`` leads its session (a kernel started by jupyter_client does): the group is the whole
    session's, and another process's session may be the driver's own. Some kernels refuse a
    second write within 0.1 s system-wide (``EAGAIN``) without ``CAP_SYS_ADMIN``: retried."""
    leader = os.getpid() if pid == "self" else int(pid)
    try:
        if os.getsid(leader) != leader:
            return False
    except OSError:
        return False
    for _ in range(20):
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(value))
            return True
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:
            return False
    return False


def become(whole: bool = False) -> None:
    """(In a new standby.) Volunteer for the OOM killer; start the low-priority import thread;
    ``whole``: the whole process at low priority (the driver found that it may be undone)."""
    global _queue, _worker, _saved_adj
    if _worker is not None:
        return
    if whole:
        _renice_all(NICE)
        if autogroup_nice() != NICE:  # the driver usually did it already
            set_autogroup_nice(NICE)
    try:
        with open("/proc/self/oom_score_adj") as f:
            _saved_adj = f.read().strip()
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
    except OSError:  # not Linux, or a sandbox without /proc: a standby all the same
        _saved_adj = None
    _queue = queue.SimpleQueue()
    _worker = threading.Thread(target=_import_forever, args=(_queue,), name="colab_resilience-standby", daemon=True)
    _worker.start()


def preload(names: list[str]) -> None:
    """(In a standby.) Import ``names`` in the background, in order; failures are ignored."""
    if _stop.is_set():  # adopted: it imports what it needs itself
        return
    if _queue is None:
        become()
    assert _queue is not None
    _queue.put(list(names))


def _import_forever(q: queue.SimpleQueue) -> None:
    try:  # this thread only: on Linux a thread has its own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (OSError, AttributeError):
        pass
    while True:
        names = q.get()
        if names is None:
            return
        for name in names:
            if _stop.is_set():
                return
            if name in sys.modules or name.endswith(_NEVER):
                continue
            try:
                importlib.import_module(name)
                _imported.append(name)
            except BaseException:  # an import that only works in its own context: the replay does it
                pass


def adopt(nice: int | None = None) -> None:
    """(In the standby that replaces a dead kernel.) Be an ordinary kernel again: the OOM score
    it had, the priority ``nice`` where allowed, the scheduling group's nice value 0 (what the
    new session of a freshly started kernel gets, whatever the driver's group has), and no more
    imports (the one under way finishes: the replay may need it)."""
    global _queue
    _stop.set()
    os.environ.pop(ENV, None)
    if _saved_adj is not None:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(_saved_adj)
        except OSError:
            pass
    if _queue is not None:
        _queue.put(None)
        _queue = None
    if nice is not None:  # allowed for root (CAP_SYS_NICE) or within RLIMIT_NICE
        _renice_all(nice)
    if autogroup_nice() not in (None, 0):
        set_autogroup_nice(0)


def is_standby(pid: int) -> bool:
    """Whether process ``pid`` was started as a standby (it may have taken over since)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{ENV}=1".encode() in f.read().split(b"\0")
    except OSError:
        return False


def standby_bytes() -> int:
    """(In a working kernel.) The resident memory of the standby kernels beside this one (started
    by the same driver): memory the OOM killer takes back first, so not memory in use for
    ``%restart_after --memory``."""
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    me, parent = os.getpid(), os.getppid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != parent or not is_standby(int(entry)):
                continue
            with open(f"/proc/{entry}/statm", "rb") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total
