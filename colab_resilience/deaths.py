"""A kernel death as the supervisor sees it: how the kernel ended, whether the OS's out-of-memory
killer did it, where its run goes on, and which restart budget pays for it.

Every death is counted once. One that happens while a ``%%resilient`` run is open, or while the
driver brings back the cell of such a run (starting a kernel, replaying the set-up cells), counts
against that run's budget (``--max-restarts`` of its cell), written into its journal; a kernel
that asked for its restart counted it itself. Any other death (at start-up, in a plain cell,
between cells) counts against the notebook's budget (``max_restarts`` of ``run_notebook``,
``--max-restarts`` of ``colab-resilience run``). Each refusal says which budget was spent and how
to raise it. SIGKILL is put down to the OOM killer only when the OS counted an OOM kill meanwhile
(:func:`colab_resilience.memory.oom_kills`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from . import journal, memory, restart
from .kernels import kernel_pid
from .restart import EXIT_RESTART


@dataclass
class Restart:
    """One kernel the driver replaced, and how that went."""

    cell: int
    reason: str
    exit_code: int | None
    iteration: str | None  # where the run went on (the iteration of its last safe point)
    replayed: int
    seconds: float
    time: float = field(default_factory=time.time)
    restored: list = field(default_factory=list)  # names put back from runs finished earlier
    unsaved: list = field(default_factory=list)  # runs finished in the dead kernel that saved nothing
    not_back: list = field(default_factory=list)  # one line for each saved name a finished run could not put back
    recovered: bool = True  # False: the new kernel died too (while starting or replaying)
    standby: bool = False  # True: the standby kernel took over; False: a kernel was (re)started
    requested: bool = False  # the kernel left on its own request (an OOM past its retries, a plan)
    planned: bool = False  # a planned restart (%restart_after)
    cold: str | None = None  # why no standby took over, where one was kept and could not
    went_on: bool = True  # False: the cell, sent again, stopped before its run went on (it stays pending)

    def marker(self, *, live: bool = False) -> str:
        """The line that says what happened. ``live``: printed as it happens, before the cell runs
        again (``%resilience isolate``), which may yet stop before its run goes on: where it goes on
        is said as what comes, not as done."""
        if self.planned:
            what = f"colab_resilience: {self.reason}"
        elif self.requested:
            what = f"colab_resilience: the kernel restarted itself ({self.reason})"
        else:
            what = f"colab_resilience: the kernel died ({self.reason})"
        if not self.recovered:
            return f"{what} after {self.seconds:.1f} s\n"
        state = f", restored {', '.join(self.restored)} from the finished training" if self.restored else ""
        how = "switched to the standby kernel" if self.standby else "restarted it"
        if self.cold and not self.standby:
            how += f" (not the standby kernel: {self.cold})"
        at = _where(self.iteration)
        lost = unsaved_line(self.unsaved) + "\n" if self.unsaved else ""
        cells = f"{self.replayed} cell{'s' if self.replayed != 1 else ''}"
        if live:
            goes = f" to go on{at}" if at else ""
            return (f"{what}; {how} and replayed {cells}{state} in {self.seconds:.1f} s; the cell runs again{goes}\n"
                    f"{lost}" + "".join(f"{line}\n" for line in self.not_back))
        if not self.went_on:
            return (f"{what}; {how} and replayed {cells}{state} in {self.seconds:.1f} s; the cell, run again, stopped "
                    f"before it resumed{at}: its run stays pending\n{lost}"
                    + "".join(f"{line}\n" for line in self.not_back))
        return (
            f"{what}; {how}, replayed {cells}{state} "
            f"and resumed{at} in {self.seconds:.1f} s\n{lost}" + "".join(f"{line}\n" for line in self.not_back)
        )

    def to_metadata(self) -> dict:
        return {"cell": self.cell, "reason": self.reason, "exit_code": self.exit_code, "iteration": self.iteration,
                "replayed": self.replayed, "recovery_seconds": round(self.seconds, 3), "time": self.time,
                "kernel": "standby" if self.standby else "restarted", "planned": self.planned,
                "requested": self.requested, "unsaved": self.unsaved}


def unsaved_line(run_ids: list[str]) -> str:
    """What is said of the runs that finished in the kernel that died and saved nothing."""
    one = len(run_ids) == 1
    return (f"colab_resilience: run{'' if one else 's'} {', '.join(run_ids)} finished in the kernel that died but "
            f"save{'s' if one else ''} nothing (no --save), so what {'it' if one else 'they'} computed is not back "
            "and the cells after it may give another result than an uninterrupted run; --save the model and optimizer")


def _where(iteration: str | None) -> str:
    """`` at iteration 3``, `` after the loop's last iteration``, `` at iteration 2 (its inner
    loop done)`` from a position as :mod:`colab_resilience.loops` writes it."""
    if not iteration:
        return ""
    if iteration == "the end":
        return " after the loop's last iteration"
    at = " at " if iteration[:1].isalpha() else " at iteration "  # "item 3", "epoch 2/4": named already
    if iteration.endswith(", the end"):
        return f"{at}{iteration[:-len(', the end')]} (its inner loop done)"
    return f"{at}{iteration}"


@dataclass
class Death:
    """A kernel that just ended: its process, exit code, why (as far as anyone can tell), and
    where its run goes on."""

    pid: int | None
    exit_code: int | None
    reason: str
    at: str | None
    planned: bool = False
    requested: bool = False

    def restart(self, cell: int, seconds: float, *, replayed: int = 0, recovered: bool = True,
                standby: bool = False, restored: list | None = None, unsaved: list | None = None,
                then: str = "", cold: str | None = None, not_back: list | None = None) -> Restart:
        return Restart(cell, f"{self.reason}; then {then}" if then else self.reason, self.exit_code, self.at,
                       replayed, seconds, restored=restored or [], unsaved=unsaved or [], recovered=recovered,
                       not_back=not_back or [],
                       standby=standby, requested=self.requested, planned=self.planned, cold=cold)


def death_reason(code: int | None, *, oom_killed: bool = False) -> str:
    """How a kernel ended, in words: the OOM killer is named only when the OS counted a kill."""
    if code == EXIT_RESTART:
        return "it asked for a restart"
    if code is not None and code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" (the OS out-of-memory killer)" if oom_killed and code == -9 else "")
    return f"exit code {code}" if code is not None else "it stopped answering"


class Budgets:
    """The notebook's restart budget and the runs' budgets, as one driver charges them."""

    def __init__(self, run_root: Path, max_restarts: int):
        self.run_root, self.max_restarts = run_root, max_restarts
        self.notebook_restarts = 0  # deaths outside any run, against max_restarts
        self.recovering: Path | None = None  # the run whose interrupted cell is being brought back
        self.oom_kills = memory.oom_kills()  # the OS's count when the kernel started
        self.replaying = False  # the driver is replaying the set-up cells in a new kernel

    def kernel_started(self) -> None:
        self.oom_kills = memory.oom_kills()

    def death(self, client, *, starting: bool = False) -> Death:
        """What is known of the kernel that just died: how it ended, whether it asked to, where."""
        code = client.exit_code()
        pid = kernel_pid(client.km)
        asked = journal.requested_restart(self.run_root)
        if asked is not None and code == EXIT_RESTART:
            return Death(pid, code, asked.reason, asked.at, asked.planned, requested=True)
        now = memory.oom_kills()
        oom_killed = now is not None and self.oom_kills is not None and now > self.oom_kills
        reason = death_reason(code, oom_killed=oom_killed)
        if self.replaying:
            reason += " while replaying the set-up cells"
            self.replaying = False
        pending = self.run_of(pid)
        at = resume_point(pending) if pending is not None else None
        return Death(pid, code, f"died while starting: {reason}" if starting else reason, at)

    def run_of(self, pid: int | None) -> journal.Journal | None:
        """The pending run a dead kernel belongs to: the one it had open, else the one whose
        interrupted cell the driver is bringing back."""
        pending = [j for j in journal.read_journals(self.run_root) if j.status == "pending"]
        mine = [j for j in pending if pid is not None and j.kernel_pid == pid]
        if mine:
            self.recovering = mine[0].run_dir
            return mine[0]
        return next((j for j in pending if j.run_dir == self.recovering), None)

    def went_on(self) -> bool:
        """Whether the run whose interrupted cell is being brought back went on when the cell was
        sent again: a cell stopped before its run's next safe point (a refusal, an error, an
        interrupt) leaves the run pending, as it was."""
        if self.recovering is None:
            return True
        try:
            return journal.Journal.load(self.recovering).status != "pending"
        except Exception:  # gone (reset), or unreadable: nothing says it did not
            return True

    def charge(self, index: int, death: Death, restarts: list[Restart]) -> str | None:
        """Count a death against the budget it belongs to: the run's (``--max-restarts`` of its
        cell) when a run was open or being brought back, else the notebook's (``max_restarts``).
        Returns the refusal when that budget is spent."""
        run = self.run_of(death.pid)
        if run is not None:
            return self.charge_run(run, death)
        if self.notebook_restarts >= self.max_restarts:
            attempts = "; ".join(f"{i}. cell {r.cell}: {r.reason}" for i, r in enumerate(restarts, 1))
            return (
                f"colab-resilience: restart budget of the notebook spent ({self.notebook_restarts}/{self.max_restarts} "
                f"restarts of a kernel outside any %%resilient run; raise it with --max-restarts): the kernel died "
                f"again in cell {index} ({death.reason}). Attempts: {attempts or 'none'}"
            )
        self.notebook_restarts += 1
        return None

    def charge_run(self, run: journal.Journal, death: Death) -> str | None:
        from .lock import RunLock
        from .signing import load_or_create_key

        with RunLock(run.run_dir):
            j = journal.Journal.load(run.run_dir, key=load_or_create_key())
            if death.pid == j.kernel_pid and j.counted_pid == death.pid:
                return None  # the kernel counted its own restart when it asked for it
            if j.restarts_left == 0:
                return restart.refuse(j, f"the kernel died again ({death.reason})")
            j.counted_pid = j.kernel_pid  # the next kernel that opens the run must not count it again
            j.record_restart(death.reason, at=death.at)
        return None


def resume_point(run: journal.Journal) -> str | None:
    """Where a pending run goes on (the iteration, for people): its journal's ``resume_at``, or
    that of a newer checkpoint on disk. A checkpoint written in the background is recorded in
    the journal just after ``LATEST`` names it: a kill in between leaves the journal one behind,
    while the new kernel resumes from ``LATEST``. Only read, for a message: nothing from the
    manifest is run or trusted beyond that."""
    from .checkpoints import codec, manifest

    folder = run.run_dir / "checkpoints"
    try:
        cid = manifest.latest_id(folder)
        if cid is None or cid == run.last_checkpoint:
            return run.resume_at
        m = manifest.Manifest.from_body(manifest.read(folder / cid / manifest.MANIFEST).body, cid)
        meta = codec.decode(m.meta, [])
    except Exception:  # unreadable: the journal's word
        return run.resume_at
    where = meta.get("where") if isinstance(meta, dict) else None
    return where if isinstance(where, str) else run.resume_at

