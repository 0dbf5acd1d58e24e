"""How a kernel leaves for a restart and comes back: the policy, the budget, the startup file.

The contract with a supervising driver (:mod:`colab_resilience.driver`):

* ``COLAB_RESILIENCE_SUPERVISED=1`` in the kernel's environment means a driver started it. The
  kernel writes the journal (``status: "pending"``, ``interrupted_cell``, the restart and
  ``restart_requested``) and exits with :data:`EXIT_RESTART`; the driver restarts the kernel,
  replays the set-up cells and re-executes the interrupted cell.
* Otherwise (Colab, JupyterLab, Notebook) a small startup file in the active IPython profile
  loads this extension into the next kernel while a run is pending; the kernel writes the journal
  and exits, the server's restarter starts a new kernel, and the run goes on when the user runs
  the interrupted cell again (or Run all).

Unplanned restarts (an OOM past the retries, a kernel that died without warning) spend the run's
budget (``--max-restarts``), counted on disk across kernels; planned ones (``%restart_after``)
do not. Past the budget the run fails with a report of every restart.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from . import fsutil
from .journal import Journal, RestartPolicy, RestartRecord, pending_runs

__all__ = ["EXIT_RESTART", "RestartPolicy", "SUPERVISED_ENV", "leave", "planned_reason", "refuse", "supervised"]

SUPERVISED_ENV = "COLAB_RESILIENCE_SUPERVISED"
EXIT_RESTART = 75  # EX_TEMPFAIL: "restart me and re-execute the interrupted cell"
STARTUP_NAME = "00-colab_resilience.py"


def supervised() -> bool:
    return os.environ.get(SUPERVISED_ENV) == "1"


def run_again(cells: str, or_else: str) -> str:
    """How to go on after a resume refused until ``cells`` (a phrase: "that cell again, then this
    one") run again: Run All in a notebook; under `colab-resilience run`, which runs no cell twice by
    itself, the same command (it runs every cell again). ``or_else``: the other way, a clause."""
    if supervised():
        return f"the same `colab-resilience run` command runs every cell again and goes on with the run; or {or_else}"
    return (f"run {cells} (Run All does), or {or_else}; `%resilience reset` starts the run with what the "
            "%%replay cells make")


def planned_reason(policy: RestartPolicy, safe_points: int) -> str | None:
    """Why ``policy`` asks for a restart at this safe point, or None."""
    if policy.every and safe_points % policy.every == 0:
        return f"planned restart after {policy.every} safe points"
    if policy.memory_percent is not None:
        from .memory import memory_in_use_percent

        used, where = memory_in_use_percent(discount_standby=supervised())
        if used >= policy.memory_percent:
            return f"planned restart: {where} in use at {used:.0f}% (threshold {policy.memory_percent:g}%)"
    return None


def budget_report(journal: Journal, reason: str) -> str:
    done = [r for r in journal.restarts if not r.refused]
    fix = "the set-up cell that kills the kernel" if "replaying" in reason else "a smaller batch, less memory"
    attempts = "; ".join(f"{i}. {r.reason}" + (" (planned)" if r.planned and r.reason != SHUT_DOWN else "") for i, r in enumerate(done, 1))
    return (
        f"colab_resilience: run {journal.run_id} failed: restart budget spent "
        f"({journal.restarts_used}/{journal.max_restarts} restarts) and {reason}. Restarts: {attempts or 'none'}. "
        f"Fix the cause ({fix}), then run the cell again to start afresh, or raise --max-restarts."
    )


#: the reason recorded for a kernel that ended cleanly (shut down or restarted from the front end, or
#: closed by its supervisor) while it held a pending run: no death, and not counted against the budget
SHUT_DOWN = "the kernel was shut down or restarted while the run was pending (not a crash)"

_held: set[Path] = set()  # the run folders this process opened


def held(run_dir: Path) -> None:
    """This process opened the run in ``run_dir``: if it exits cleanly while it holds the run
    pending (:func:`mark_shut_down`), the next kernel counts no death."""
    if not _held:
        import atexit

        atexit.register(mark_shut_down)
    _held.add(Path(run_dir))


def mark_shut_down(run_dirs: Iterable[Path] | None = None, pid: int | None = None) -> None:
    """Each run of ``run_dirs`` (default: those this process opened) that the kernel ``pid``
    (default: this process) holds pending is marked as not having died with it: without the mark,
    the next kernel counted a death without warning against the run's budget, and said so. Run
    at a clean exit (a run left pending by a refused cell, the stop button during a resume, a
    set-up cell that failed to replay; a kill or a crash runs no exit handlers, and is counted),
    and by a supervisor once it has ended its kernel (its notebook run over, or stopped by Ctrl-C)."""
    from .lock import RunLock
    from .signing import load_or_create_key

    pid = os.getpid() if pid is None else pid
    for run_dir in sorted(_held if run_dirs is None else run_dirs):
        try:
            with RunLock(run_dir):
                if not Journal.exists(run_dir):
                    continue
                j = Journal.load(run_dir, key=load_or_create_key())
                if j.status == "pending" and j.kernel_pid == pid and j.counted_pid != pid:
                    j.restarts.append(RestartRecord(SHUT_DOWN, planned=True, at=j.resume_at))
                    j.counted_pid = pid
                    j.save()
        except Exception:  # never the exit's failure: without the mark, the next kernel counts a death
            continue


def refuse(journal: Journal, reason: str) -> str:
    """Record a restart the budget does not allow; the run fails. Returns the report to show."""
    journal.restarts.append(RestartRecord(reason, refused=True))
    journal.status = "failed"
    journal.save()
    return budget_report(journal, reason)


def leave(shell, journal: Journal, reason: str, *, planned: bool = False, iteration: str | None = None,
          say: Callable[[str], None] = print) -> str:
    """Restart the kernel: record why, arrange the next kernel, exit. Returns only when it cannot:
    the budget is spent or this IPython is not a kernel; the run has then failed, and the
    returned line says why."""
    if getattr(shell, "kernel", None) is None and not supervised():
        # terminal IPython, or a shell embedded in a program: no restarter would bring it back
        journal.restarts.append(RestartRecord(reason, refused=True))
        journal.status = "failed"
        journal.save()
        return (
            f"colab_resilience: {reason}; this IPython is not a Jupyter kernel, so it cannot be "
            "restarted: the run stops here (its last checkpoint is kept)"
        )
    at = iteration if iteration is not None else journal.resume_at
    if planned:
        journal.restarts.append(RestartRecord(reason, planned=True, at=at))
    elif journal.restarts_left == 0:
        return refuse(journal, reason)
    else:
        journal.restarts.append(RestartRecord(reason, at=at))
        journal.restarts_used += 1
    journal.restart_requested = True
    journal.status = "pending"
    journal.kernel_pid = journal.counted_pid = os.getpid()
    journal.save()
    if not supervised():  # a driver puts its own marker in the output: the news once, not twice
        where = f" in iteration {iteration}" if iteration is not None else ""
        count = "" if planned else f"; restart {journal.restarts_used}/{journal.max_restarts}"
        say(f"colab_resilience: {reason}{where}: restarting the kernel{count}. When it is back, run this "
            "cell again (or Run all) to continue from the last safe point; JupyterLab drops the cells queued "
            "after this one (Run all): run them again too.")
    exit_kernel(EXIT_RESTART)
    return ""  # not reached


def exit_kernel(code: int) -> None:
    """Leave the kernel now: flush what the user should see, give iopub a moment, exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # flush() returns once ipykernel's IO thread handed the output to ZMQ, whose own thread sends
    # it a moment later; os._exit would drop what is still queued. Half a second: on a machine
    # loaded to three runnable processes a core (CI), 0.1 s once lost the line saying why the
    # kernel left; a restart takes seconds, so the wait costs nothing a user would notice
    time.sleep(0.5)
    os._exit(code)


# -- the startup file that brings the extension into the next kernel --------------------------------

_STARTUP = '''\
# Written by colab_resilience: loads it into a kernel that replaces one it restarted, while a run
# is pending. It does nothing otherwise, and is removed when no run is pending any more.
try:
    from colab_resilience.startup import load_if_pending as _crl
    _crl(get_ipython(), {root!r})
    del _crl
except Exception:
    pass
'''


def startup_path(shell) -> Path | None:
    profile_dir = getattr(shell, "profile_dir", None)
    if profile_dir is None:
        return None
    return Path(profile_dir.startup_dir) / STARTUP_NAME


def install_startup_file(shell, root: Path) -> None:
    path = startup_path(shell)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # IPython executes this file: never writable by others whatever the umask, written through a
    # new temporary file (O_EXCL: never through a link someone left) and renamed into place
    fsutil.atomic_write(path, _STARTUP.format(root=str(root)).encode(), mode=0o644)


def remove_startup_file_if_idle(shell, root: Path) -> None:
    path = startup_path(shell)
    if path is not None and path.exists() and not pending_runs(root):
        try:
            path.unlink()
        except OSError:
            pass
