"""CPU priority and OOM-killer preference of processes (Linux; elsewhere these do nothing).

The supervisor's standby kernel must use only CPU time the working kernel leaves idle and be the
OOM killer's first choice; the kernel that takes over must be an ordinary kernel again. Linux sets
nice values per thread, and with autogroups (the default of most distributions) it first shares
the CPUs between sessions, then by nice value within each: a kernel started by jupyter_client
leads a session of its own, so its scheduling group must be niced too.
"""

from __future__ import annotations

import functools
import os
import threading
import time

NICE = 19
OOM_SCORE_ADJ = 1000  # the OOM killer's first choice


def renice_all(value: int) -> None:
    """Every thread of this process to nice ``value``."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except OSError:
            pass


def renice_this_thread(value: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), value)
    except (OSError, AttributeError):
        pass


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of the scheduling group (autogroup) of process ``pid``; None without one."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().rsplit("nice", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(value: int, pid: int | str = "self") -> bool:
    """Set the nice value of the scheduling group of ``pid``; False where that did not happen.
    Only where ``pid`` leads its session: the group is the whole session's, and another process's
    session may be the driver's own. Some kernels refuse a second write within a short interval
    system-wide (``EAGAIN``) without ``CAP_SYS_ADMIN``: retried for a second."""
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


def set_oom_score_adj(value: int | str) -> str | None:
    """Set this process's ``oom_score_adj``; return the value it had (None where there is none)."""
    try:
        with open("/proc/self/oom_score_adj") as f:
            previous = f.read().strip()
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
        return previous
    except OSError:  # not Linux, or a sandbox without /proc
        return None


@functools.lru_cache(maxsize=None)
def may_raise_priority() -> bool:
    """Whether a process of ours may lower its nice value again (root with CAP_SYS_NICE, or a
    permissive RLIMIT_NICE): tried once, on a thread of this process, which Linux renices alone."""
    answer: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            base = os.getpriority(os.PRIO_PROCESS, tid)
            if base >= NICE:
                answer.append(False)
                return
            os.setpriority(os.PRIO_PROCESS, tid, base + 1)
            os.setpriority(os.PRIO_PROCESS, tid, base)
            answer.append(True)
        except (OSError, AttributeError):
            answer.append(False)

    thread = threading.Thread(target=probe, name="colab_resilience-nice-probe")
    thread.start()
    thread.join()
    return bool(answer and answer[0])


def lower(pid: int) -> None:
    """A process we started (leading its own session) to the lowest priority, group included."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, NICE)
        set_autogroup_nice(NICE, pid)
    except OSError:
        pass


_PR_SET_PDEATHSIG = 1


@functools.lru_cache(maxsize=None)
def _prctl():
    """libc's ``prctl``, looked up before any fork (None where there is none: not Linux)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent() -> dict:
    """Keyword arguments for starting a kernel (``KernelManager.start_kernel``, passed on to
    ``Popen``) that is SIGKILLed by Linux the moment the process that starts it dies: a worker
    or standby kernel outlives its relay or driver by nothing, even while it is still starting at
    the lowest priority, before ipykernel's parent poller runs (starved, a standby lived on for
    minutes, preloading torch). Linux sends the signal when the *thread* that started the child
    ends: kernels are started from the relay's or the driver's main thread or the event-loop
    thread jupyter_core keeps for it, which last as long as the process. Elsewhere: nothing."""
    prctl = _prctl()
    if prctl is None:
        return {}
    import signal

    def in_the_child() -> None:  # between fork and exec: one system call, nothing else
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))

    return {"preexec_fn": in_the_child}
