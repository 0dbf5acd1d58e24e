"""A run: one logical execution of a ``%%resilient`` cell, surviving retries and restarts.

A run lives in ``ROOT/run-<id>/`` (``journal.json``, ``lock``, ``checkpoints/``); its id comes
from the cell's identity (the front end's cell id, else its source), so the same cell executed in
a new kernel finds its run again. The journal says whether the run is *pending* (it ended
abnormally: an OOM past the retries, a restart we asked for, a kernel that died) and so resumes
on the next execution, or ended *done* or *failed*.

Safe points are where the declared state (``--save``) is consistent: the start of the loop (or
of the cell, when it has no :func:`resume_range`), the end of every ``resume_range`` iteration,
an explicit :func:`checkpoint`, the successful end of the cell. A resumed or retried run restores
the state of the last safe point at the loop start (so ``history = []`` above the loop does not
wipe it) and skips the iterations that were finished.

How a kernel leaves for a restart (the contract with a supervising driver):

* ``COLAB_RESILIENCE_SUPERVISED=1`` in the kernel's environment means a driver started it. The
  kernel writes the journal (``status: "pending"``, ``interrupted_cell``, ``restarts``,
  ``extra.restart_requested: true``) and exits with code :data:`EXIT_RESTART` (75). The driver
  restarts the kernel, replays ``replay_cells`` and re-executes ``interrupted_cell``.
* Otherwise (Colab, JupyterLab, Notebook) the kernel installs a small startup file in the active
  IPython profile that loads this extension into the next kernel while a run is pending, writes
  the journal and exits; the server's restarter starts a new kernel. The run goes on when the
  user runs the interrupted cell again (or Run all).
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import CheckpointError, NoCheckpointError, ResilienceError
from .journal import Journal, JournalError, RunLock, make_private_dir

SUPERVISED_ENV = "COLAB_RESILIENCE_SUPERVISED"
RUN_DIR_ENV = "COLAB_RESILIENCE_RUN_DIR"
EXIT_RESTART = 75  # EX_TEMPFAIL: "restart me and re-execute the interrupted cell"
STARTUP_NAME = "00-colab_resilience.py"
DRIVE = Path("/content/drive/MyDrive")


def in_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def default_root() -> Path:
    """``$COLAB_RESILIENCE_RUN_DIR``; in Colab a mounted Drive folder; else ./.colab_resilience."""
    env = os.environ.get(RUN_DIR_ENV)
    if env:
        return Path(env).expanduser()
    if in_colab() and DRIVE.is_dir():
        return DRIVE / "colab_resilience"
    return Path.cwd() / ".colab_resilience"


def run_id_for(cell_key: str) -> str:
    return hashlib.sha256(cell_key.encode()).hexdigest()[:8]


def supervised() -> bool:
    return os.environ.get(SUPERVISED_ENV) == "1"


# --------------------------------------------------------------------------------------------
# the restart policy (%restart_after)


@dataclass
class RestartPolicy:
    every: int | None = None  # safe points between planned restarts
    memory_percent: float | None = None  # host or GPU memory in use that triggers one

    def describe(self) -> str:
        parts = []
        if self.every:
            parts.append(f"every {self.every} safe points")
        if self.memory_percent is not None:
            parts.append(f"when memory in use reaches {self.memory_percent:g}%")
        return " or ".join(parts) or "off"

    def to_dict(self) -> dict:
        return {"every": self.every, "memory_percent": self.memory_percent}


def memory_in_use_percent() -> tuple[float, str]:
    """The highest of host memory in use and (if CUDA is initialised) GPU memory in use. Under a
    supervisor, its standby kernel's memory does not count: the OOM killer takes it back first."""
    best, where = 0.0, "host RAM"
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0])
        available = info["MemAvailable"]
        if supervised():
            from .standby import standby_bytes

            available = min(info["MemTotal"], available + standby_bytes() // 1024)
        best = 100.0 * (info["MemTotal"] - available) / info["MemTotal"]
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        pass
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info()
            gpu = 100.0 * (total - free) / total
            if gpu > best:
                best, where = gpu, "GPU memory"
    except Exception:
        pass
    return best, where


# --------------------------------------------------------------------------------------------
# every: checkpoint frequency


def parse_every(text: str) -> tuple[int | None, float | None]:
    """``--every 10`` (safe points) or ``--every 5min`` / ``90s`` / ``1h`` (seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)\s*", text)
    if m:
        n, unit = float(m.group(1)), m.group(2)
        seconds = n * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[unit]
        if seconds <= 0:
            raise ValueError(text)
        return None, seconds
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n, None


# --------------------------------------------------------------------------------------------
# the names a cell reads that a restart would lose (the lint)


def _assigned(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _parse(shell, source: str) -> ast.AST | None:
    try:
        return ast.parse(shell.transform_cell(source))
    except SyntaxError:
        return None


def names_lost_on_restart(shell, body: str, saved: list[str], replay_sources: list[str]) -> list[str]:
    """Names ``body`` reads from the namespace that nothing would bring back after a restart."""
    tree = _parse(shell, body)
    if tree is None:
        return []
    read = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in read:
            read.append(node.id)
    defined = _assigned(tree) | set(saved) | set(dir(builtins)) | {"resume_range", "checkpoint", "get_ipython"}
    for src in replay_sources:
        if src.lstrip().startswith("%%replay"):  # the body, not the magic call IPython would make of it
            src = src.lstrip().partition("\n")[2]
        t = _parse(shell, src)
        if t is not None:
            defined |= _assigned(t)
    ns = shell.user_ns
    return [n for n in read if n not in defined and n in ns and not n.startswith("_")]


# --------------------------------------------------------------------------------------------
# the run


class RunStopped(ResilienceError):
    """The run cannot go on (restart budget spent, lock held, journal unusable)."""


class Run:
    """One ``%%resilient`` run, opened for one execution of its cell in this kernel."""

    def __init__(
        self,
        shell,
        root: Path,
        cell_key: str,
        source: str,
        body: str,
        *,
        names: list[str],
        max_restarts: int,
        every: tuple[int | None, float | None] = (1, None),
        policy: RestartPolicy | None = None,
        say: Callable[[str], None] = print,
        replay: Callable[[list[dict]], int] | None = None,
        run_id: str | None = None,
        shrink: list[str] = (),
    ):
        from .signing import load_or_create_key
        from .state import CheckpointStore

        self.shell = shell
        self.say = say
        self.names = names
        self.shrink = list(shrink)
        self.body = body
        self.source = source
        self.every_n, self.every_seconds = every
        self._policy_set = policy is not None  # else a resumed run keeps its journal's policy
        self.policy = policy or RestartPolicy()
        self.run_id = run_id or run_id_for(cell_key)
        self.dir = Path(root) / f"run-{self.run_id}"
        make_private_dir(root)
        self.lock = RunLock(self.dir)
        self.lock.acquire()  # RunLockedError names the holder
        self._key = load_or_create_key()
        self.store = CheckpointStore(self.dir / "checkpoints", key=self._key, run_id=self.run_id)
        self.uses_loop = "resume_range" in body
        self.safe_points = 0
        self._saved_point = -1  # the safe point the last successful save was made at
        self._names_at_checkpoint: set[str] | None = None  # the namespace's names then
        self._said_missing: set = set()  # names already reported as missing or unsaveable
        self._last_save = 0.0
        self.iteration: object = None  # the value of the iteration in progress
        self.next_index = 0  # where a resume from a checkpoint taken now would go on
        self.resume_note: str | None = None
        self.restored_from_kernel_restart = False
        self.resuming = False
        journal = None
        if Journal.exists(self.dir):
            try:
                journal = Journal.load(self.dir, key=self._key)
            except JournalError as e:
                self.lock.release()
                raise RunStopped(str(e)) from None
        if journal is not None and journal.status == "pending":
            self.journal = journal
            self._adopt_pending(replay)
        else:
            self.store.clear()
            self.journal = Journal.create(
                self.dir,
                run_id=self.run_id,
                max_restarts=max_restarts,
                interrupted_cell=source,
                extra={"names": names, "shrink": {}, "policy": self.policy.to_dict(), "cell_key": cell_key},
            )
        self.journal.kernel_pid = os.getpid()
        self.journal.interrupted_cell = source
        self.journal.status = "pending"
        self.journal.save()
        if not supervised():
            # Already now, not only before a restart we ask for: a kernel killed without warning
            # (the OOM killer) must come back with the extension loaded too.
            install_startup_file(shell, self.dir.parent)

    # -------------------------------------------------------------------------------- resume

    def _adopt_pending(self, replay) -> None:
        j = self.journal
        requested = j.extra.pop("restart_requested", False)
        in_replay = j.extra.pop("phase", None) == "replay"
        if j.kernel_pid != os.getpid() and not requested:
            # The previous kernel vanished without asking: SIGKILL, most often the OOM killer.
            why = ("the kernel died without warning while replaying the set-up cells" if in_replay
                   else "the kernel died without warning (killed by the OS, likely out of host memory)")
            if j.restarts_left == 0:
                self._fail_budget(why)
            j.record_restart(why)
        self.resuming = True
        self.restored_from_kernel_restart = j.kernel_pid != os.getpid()
        if not self._policy_set:
            p = j.extra.get("policy") or {}
            self.policy = RestartPolicy(p.get("every"), p.get("memory_percent"))
        replayed = 0
        start = time.perf_counter()
        if replay is not None and self.restored_from_kernel_restart and j.replay_cells:
            # a death during the replay is then told apart from one in the training (next kernel)
            j.kernel_pid, j.extra["phase"] = os.getpid(), "replay"
            j.save()
            replayed = replay(j.replay_cells)
            j.extra.pop("phase", None)
        self._replay_seconds = time.perf_counter() - start
        self._replayed = replayed
        for name, value in (j.extra.get("shrink") or {}).items():
            self.shell.user_ns[name] = value

    def _fail_budget(self, reason: str) -> None:
        j = self.journal
        j.restarts.append({"reason": reason, "time": time.time(), "refused": True})
        j.status = "failed"
        j.save()
        remove_startup_file_if_idle(self.shell, self.dir.parent)
        self.lock.release()
        raise RunStopped(self.budget_report(reason))

    def budget_report(self, reason: str) -> str:
        j = self.journal
        done = [r for r in j.restarts if not r.get("refused")]  # the refused one is ``reason``
        fix = "the set-up cell that kills the kernel" if "replaying" in reason else "a smaller batch, less memory"
        attempts = "; ".join(
            f"{i}. {r['reason']}" + (" (planned)" if r.get("planned") else "") for i, r in enumerate(done, 1)
        )
        return (
            f"colab_resilience: run {self.run_id} failed: restart budget spent "
            f"({j.restarts_used}/{j.max_restarts} restarts) and {reason}. Restarts: {attempts or 'none'}. "
            f"Fix the cause ({fix}), then run the cell again to start afresh, or raise --max-restarts."
        )

    def restore(self, where: str) -> int:
        """Restore the last safe point into the namespace; return the iteration index to go on from."""
        start = time.perf_counter()
        try:
            ckpt = self.store.load()
        except NoCheckpointError:
            self.say(f"colab_resilience: run {self.run_id}: no checkpoint yet, {where} starts from the beginning")
            self.resuming = False
            return 0
        restored = ckpt.restore(self.shell.user_ns, [n for n in ckpt.names if n in self.names], strict=False)
        seconds = time.perf_counter() - start
        nxt = int(ckpt.meta.get("next", 0)) if isinstance(ckpt.meta, dict) else 0
        if self.restored_from_kernel_restart:
            j = self.journal
            last = j.restarts[-1]["reason"] if j.restarts else "a restart"
            self.resume_note = (
                f"colab_resilience: resumed run {self.run_id} after kernel restart ({last}; "
                f"restart {j.restarts_used}/{j.max_restarts}): "
                + (f"replayed {self._replayed} cell{'s' if self._replayed != 1 else ''}, " if self._replayed else "")
                + f"restored {', '.join(restored) or 'nothing'} in {seconds + self._replay_seconds:.1f} s"
            )
            self.restored_from_kernel_restart = False
        self.resuming = False
        return nxt

    # ----------------------------------------------------------------------- safe points

    def attempt_start(self) -> None:
        """Before each attempt of the cell: without a loop, the cell start is the restore point."""
        if self.uses_loop:
            return
        if self.resuming:
            self.restore("the cell")
            if self.resume_note:
                self.say(self.resume_note + "; running the cell again")
                self.resume_note = None
        elif self.safe_points == 0:
            self.save(next_index=0, force=True)

    def loop_start(self, r: range) -> int:
        if self.resuming:
            nxt = self.restore("the loop")
            if self.resume_note:
                at = f"continuing at {r[nxt]}" if nxt < len(r) else "the loop had finished"
                self.say(f"{self.resume_note}; {at}")
                self.resume_note = None
            elif nxt:
                self.say(f"colab_resilience: rolled back to the last safe point; continuing at {r[nxt] if nxt < len(r) else 'the end'}")
            return nxt
        self.save(next_index=0, force=True)
        return 0

    def save(self, next_index: int | None = None, *, force: bool = False) -> None:
        due = force or (
            (self.every_n is not None and self.safe_points % self.every_n == 0)
            or (self.every_seconds is not None and time.monotonic() - self._last_save >= self.every_seconds)
        )
        if not due:
            return
        meta = {"next": next_index if next_index is not None else 0}
        ns = self.shell.user_ns
        # A name the cell has not assigned yet (checked when the cell started: it assigns it) is
        # left out of this checkpoint and saved at the next safe point that finds it.
        present = [n for n in self.names if n in ns]
        missing = [n for n in self.names if n not in ns and n not in self._said_missing]
        if missing and self.safe_points:
            self._said_missing.update(missing)
            self.say(
                f"colab_resilience: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not defined at "
                "this safe point; the checkpoint holds the other names"
            )
        try:
            report = self.store.save(ns, present, meta=meta)
        except CheckpointError as e:
            # e.g. a full disk: the previous checkpoint is intact; try again at the next safe point
            self.say(f"{str(e).splitlines()[0]} — the previous checkpoint is kept; the run goes on and tries again at the next safe point")
            return
        self._last_save = time.monotonic()
        self._saved_point = self.safe_points
        self._names_at_checkpoint = set(ns)
        for name, message in report.skipped.items():
            if ("skipped", name) not in self._said_missing:  # once per run, not at every safe point
                self._said_missing.add(("skipped", name))
                self.say(message)
        self.journal.last_checkpoint = report.checkpoint_id
        # the batch size that fits goes with the checkpoint: a new kernel starts from it
        self.journal.extra.setdefault("shrink", {}).update(
            {n: ns[n] for n in self.shrink if isinstance(ns.get(n), int) and not isinstance(ns.get(n), bool)}
        )
        self.journal.save()

    def forget_new_names(self) -> list[str]:
        """Before an in-process retry: unbind the names created since the last checkpoint, the
        point the retry goes back to, where they did not exist. A batch left bound to a global
        by the failed attempt (``x = torch.randn(batch, n)`` before the step that failed) would
        otherwise hold its memory through the retry, and the smaller batch would fail as well.
        Names that existed then are left alone; ``--save`` names are restored from the
        checkpoint. Returns the names unbound."""
        if self._names_at_checkpoint is None:
            return []
        ns, hidden = self.shell.user_ns, getattr(self.shell, "user_ns_hidden", {})
        new = [n for n in ns if n not in self._names_at_checkpoint and not n.startswith("_") and n not in hidden]
        for n in new:
            del ns[n]
        return new

    def safe_point(self, next_index: int, *, last: bool = False) -> None:
        """The end of an iteration: save if due; restart if planned (not after the last one)."""
        self.safe_points += 1
        self.save(next_index)
        if not last:
            self._maybe_planned_restart(next_index)

    def _maybe_planned_restart(self, next_index: int) -> None:
        p = self.policy
        reason = None
        if p.every and self.safe_points % p.every == 0:
            reason = f"planned restart after {p.every} safe points"
        elif p.memory_percent is not None:
            used, where = memory_in_use_percent()
            if used >= p.memory_percent:
                reason = f"planned restart: {where} in use at {used:.0f}% (threshold {p.memory_percent:g}%)"
        if reason is None:
            return
        if self._saved_point != self.safe_points:  # not saved yet at this safe point (--every)
            self.save(next_index, force=True)  # the state to resume from is this safe point's
        self.leave(reason, planned=True)

    # -------------------------------------------------------------------------- leaving

    def record_shrink(self, values: dict[str, int]) -> None:
        self.journal.extra.setdefault("shrink", {}).update(values)
        self.journal.save()

    def leave(self, reason: str, *, planned: bool = False) -> None:
        """Restart the kernel: write the journal, arrange the next kernel, exit. Returns only when
        the restart budget is spent (then :class:`RunStopped` is raised)."""
        j = self.journal
        if getattr(self.shell, "kernel", None) is None and not supervised():
            # terminal IPython, or a shell embedded in a program: no restarter would bring it back
            j.restarts.append({"reason": reason, "time": time.time(), "refused": True})
            j.status = "failed"
            j.save()
            raise RunStopped(
                f"colab_resilience: {reason}; this IPython is not a Jupyter kernel, so it cannot be "
                "restarted: the run stops here (its last checkpoint is kept)"
            )
        if not planned:
            if j.restarts_left == 0:
                self._fail_budget(reason)
            j.record_restart(reason, at=repr(self.iteration) if self.iteration is not None else None)
        else:
            j.restarts.append({"reason": reason, "time": time.time(), "planned": True})
        j.extra["restart_requested"] = True
        j.status = "pending"
        j.kernel_pid = os.getpid()
        j.save()
        where = f" in iteration {self.iteration!r}" if self.iteration is not None else ""
        count = "" if planned else f"; restart {j.restarts_used}/{j.max_restarts}"
        if supervised():
            self.say(f"colab_resilience: {reason}{where}: restarting the kernel{count}")
            _exit(EXIT_RESTART)
        self.say(
            f"colab_resilience: {reason}{where}: restarting the kernel{count}. When it is back, "
            "run this cell again (or Run all) to continue from the last safe point."
        )
        _exit(EXIT_RESTART)

    def finish(self, status: str) -> None:
        self.journal.extra.pop("restart_requested", None)
        self.journal.status = status
        self.journal.save()
        remove_startup_file_if_idle(self.shell, self.dir.parent)
        self.lock.release()


def _exit(code: int) -> None:
    """Leave the kernel now: flush what the user should see, give iopub a moment, exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # flush() returns once ipykernel's IO thread handed the output to ZMQ, whose own thread sends
    # it; 0.1 s covers that (60 of 60 lines arrived after 0.05 s, 19 of 20 with no wait at all)
    time.sleep(0.1)
    os._exit(code)


# --------------------------------------------------------------------------------------------
# the startup file that brings the extension into the next kernel

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
    tmp = path.with_suffix(".tmp")
    # IPython executes this file: never writable by others, whatever the umask (0 in some containers)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, _STARTUP.format(root=str(root)).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def pending_runs(root: Path) -> list[Path]:
    out = []
    try:
        for journal in Path(root).glob("run-*/journal.json"):
            try:
                if Journal.load(journal.parent).status == "pending":
                    out.append(journal.parent)
            except (JournalError, OSError):
                continue
    except OSError:
        pass
    return out


def remove_startup_file_if_idle(shell, root: Path) -> None:
    path = startup_path(shell)
    if path is not None and path.exists() and not pending_runs(root):
        try:
            path.unlink()
        except OSError:
            pass


# --------------------------------------------------------------------------------------------
# resume_range and checkpoint(): the public safe points

_active: list[Run] = []
_warned_outside = False


def active_run() -> Run | None:
    return _active[-1] if _active else None


def resume_range(*args: int):
    """``range(*args)`` whose iterations are safe points of the enclosing ``%%resilient`` cell.

    In a resumed (or retried) run, the declared state is restored when the loop starts and the
    finished iterations are skipped. Outside a ``%%resilient`` cell it is a plain ``range``.
    """
    global _warned_outside
    r = range(*args)
    run = active_run()
    if run is None:
        if not _warned_outside:
            _warned_outside = True
            print("colab_resilience: resume_range outside a %%resilient cell: nothing is checkpointed here", file=sys.stderr)
        yield from r
        return
    start = run.loop_start(r)
    for index in range(start, len(r)):
        run.iteration, run.next_index = r[index], index
        yield r[index]
        run.iteration, run.next_index = None, index + 1
        run.safe_point(index + 1, last=index + 1 == len(r))


def checkpoint() -> str | None:
    """An explicit safe point: save the declared state now. Returns the checkpoint id."""
    run = active_run()
    if run is None:
        print("colab_resilience: checkpoint() outside a %%resilient cell: nothing to save", file=sys.stderr)
        return None
    run.safe_points += 1
    run.save(next_index=run.next_index, force=True)
    return run.journal.last_checkpoint
