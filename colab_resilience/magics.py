"""The IPython glue: magics, their options, and the configuration traits.

Argument parsing and messages live here; the work is done by :mod:`.recovery` (in-process OOM
recovery) and :mod:`.replay` (the record of set-up cells).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.utils.capture import capture_output
from traitlets import Bool, Float, Integer, Unicode

from . import execution, oom, runs, writes
from .errors import ResilienceError, RunLockedError
from .recovery import Recovery, Shrink
from .replay import ReplayLog, cell_key_from_metadata, parent_metadata, source_key


def _retries(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"needs a whole number, like --retries 2 (got {text!r})"
        ) from None
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"cannot be negative (got {n}); use --retries 0 to turn in-process retries off"
        )
    return n


def _shrink_items(text: str, default_factor: float) -> list[Shrink]:
    items = []
    for part in text.split(","):
        part = part.strip()
        name, sep, factor_text = part.partition("=")
        name = name.strip()
        if not name.isidentifier():
            raise UsageError(
                f"%%resilient: --shrink {part!r}: {name!r} is not a variable name; "
                "write --shrink NAME or --shrink NAME=FACTOR, e.g. --shrink batch_size=0.5"
            )
        factor = default_factor
        if sep:
            try:
                factor = float(factor_text)
            except ValueError:
                factor = float("nan")
            if not 0 < factor < 1:
                raise UsageError(
                    f"%%resilient: --shrink {part}: the factor must be a number between 0 and 1 "
                    f"(got {factor_text!r}), e.g. --shrink {name}=0.5"
                )
        items.append(Shrink(name, factor))
    return items


def _restarts(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a whole number, like --max-restarts 3 (got {text!r})") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"cannot be negative (got {n}); use --max-restarts 0 to never restart")
    return n


def _every(text: str):
    try:
        return runs.parse_every(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"needs a number of safe points or a duration, like --every 10 or --every 5min (got {text!r})"
        ) from None


def _names(values: list[str]) -> list[str]:
    names = []
    for text in values:
        for part in text.split(","):
            part = part.strip()
            if not part.isidentifier():
                raise UsageError(
                    f"%%resilient: --save {text!r}: {part!r} is not a variable name; "
                    "write --save model,opt,history"
                )
            if part not in names:
                names.append(part)
    return names


def _assigned_names(body: str) -> set[str]:
    """Names the body assigns at any level (a retry re-runs those assignments)."""
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


@magics_class
class ResilienceMagics(Magics):
    """``%%resilient`` and ``%%replay``. Configure with ``%config ResilienceMagics.retries = 3``
    or ``c.ResilienceMagics.retries = 3`` in ``ipython_config.py``."""

    retries = Integer(
        2, help="In-process recoveries from an out-of-memory error before giving up (--retries)."
    ).tag(config=True)
    shrink_factor = Float(
        0.5, help="Factor applied to a --shrink variable after an OOM when none is given."
    ).tag(config=True)
    verbose = Bool(True, help="Print one line for every recovery step.").tag(config=True)
    max_restarts = Integer(
        3, help="Kernel restarts a run may use, counted on disk across kernels (--max-restarts)."
    ).tag(config=True)
    run_dir = Unicode(
        "", help="Where runs keep their journal and checkpoints (default: a mounted Drive folder "
        "in Colab, else ./.colab_resilience; also $COLAB_RESILIENCE_RUN_DIR)."
    ).tag(config=True)

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.replay_log = ReplayLog()
        self.policy: runs.RestartPolicy | None = None  # None: not set in this kernel
        self._linted: set[str] = set()
        self._adopt: str | None = None

    # ----------------------------------------------------------------------------- helpers

    def say(self, line: str) -> None:
        if self.verbose:
            print(line, flush=True)

    def _cell_key(self) -> str | None:
        return cell_key_from_metadata(parent_metadata(self.shell))

    def _parse(self, magic, line: str):
        try:
            return parse_argstring(magic, line)
        except ValueError as e:  # shlex: an unclosed quote
            raise UsageError(
                f"%%{magic.__name__}: cannot read the options ({e}); close or remove the quote"
            ) from None
        except UsageError as e:
            name = magic.__name__
            text = " ".join(str(e).split())  # one line, whatever newlines the options held
            if text.startswith("unrecognized arguments:"):
                bad = text.split(":", 1)[1].strip()
                raise UsageError(
                    f"%%{name}: unknown option {bad}; the options are {self._options_hint(name)} "
                    f"(see %%{name}? for help)"
                ) from None
            raise UsageError(f"%%{name}: {text}; see %%{name}? for the options") from None

    @staticmethod
    def _options_hint(name: str) -> str:
        if name == "resilient":
            return "--save NAMES, --retries N, --shrink NAME[=FACTOR], --max-restarts N and --every N|5min"
        return "none"

    def _check_body(self, name: str, cell: str) -> None:
        if not cell.strip():
            raise UsageError(
                f"%%{name}: the cell has no code under the %%{name} line; "
                "put the code to run below it"
            )

    def root(self) -> Path:
        return Path(self.run_dir).expanduser() if self.run_dir else runs.default_root()

    def _user_variables(self) -> list[str]:
        """The user's own names (not IPython's ``open``/``In``/``Out``, not ours), for suggestions."""
        hidden = self.shell.user_ns_hidden
        return [k for k in self.shell.user_ns if not k.startswith("_") and k not in hidden]

    def _check_save(self, names: list[str], cell: str) -> None:
        ns = self.shell.user_ns
        assigned = _assigned_names(self.shell.transform_cell(cell))
        for name in names:
            if name not in ns and name not in assigned:
                close = difflib.get_close_matches(name, self._user_variables(), n=1)
                also = f" (did you mean {close[0]!r}?)" if close else ""
                raise UsageError(
                    f"%%resilient: --save {name}: no variable {name!r} exists and the cell does not "
                    f"assign it{also}; create it in a %%replay cell or in this cell"
                )

    def _replay(self, cells: list[dict]) -> int:
        """Run the recorded replay cells this kernel has not run yet, one line each."""
        done = {c.key for c in self.replay_log.cells}
        count = 0
        for cell in cells:
            if cell["key"] in done:
                continue
            source = cell["source"]
            header, _, body = source.partition("\n")
            failure = None
            with capture_output() as captured:
                try:
                    execution.run_body(self.shell, execution.compile_body(self.shell, header, body))
                except execution.BodyError as e:
                    failure = e
            first = next((l for l in body.splitlines() if l.strip()), "").strip()
            if failure is not None:
                captured.show()
                self.say(f"colab_resilience: replaying a set-up cell failed ({first[:60]}); fix it, run it, then run this cell again")
                execution.reraise(self.shell, failure.exc, failure.tb)
            self.replay_log.record(cell["key"], source)
            self.say(f"colab_resilience: replayed {first[:70]}")
            count += 1
        return count

    def _open_run(self, key: str, source: str, cell: str, names, args, shrinks) -> runs.Run:
        try:
            run = runs.Run(
                self.shell, self.root(), key, source, cell,
                names=names,
                max_restarts=self.max_restarts if args.max_restarts is None else args.max_restarts,
                every=args.every or (1, None),
                policy=self.policy,
                say=self.say,
                replay=self._replay,
                run_id=self._adopt,  # after %resilience resume: the next cell continues that run
                shrink=[s.name for s in shrinks],
            )
            self._adopt = None
        except RunLockedError as e:
            raise UsageError(str(e).splitlines()[0]) from None
        except runs.RunStopped as e:
            raise UsageError(str(e)) from None
        j = run.journal
        known = {c["key"] for c in j.replay_cells}
        j.replay_cells.extend({"key": c.key, "source": c.source} for c in self.replay_log.cells if c.key not in known)
        for entry in j.replay_cells:  # a re-run replay cell replaces its source
            for c in self.replay_log.cells:
                if c.key == entry["key"]:
                    entry["source"] = c.source
        j.save()
        return run

    def _lint(self, key: str, cell: str, names: list[str]) -> None:
        if key in self._linted:
            return
        self._linted.add(key)
        lost = runs.names_lost_on_restart(self.shell, cell, names, [c.source for c in self.replay_log.cells])
        if lost:
            self.say(
                f"colab_resilience: this cell reads {', '.join(lost)}, which neither --save nor a "
                "%%replay cell would bring back after a restart; add them to --save or define them in a %%replay cell"
            )

    def _check_shrink(self, shrinks: list[Shrink], cell: str) -> None:
        ns = self.shell.user_ns
        assigned = _assigned_names(cell)
        for s in shrinks:
            if s.name not in ns:
                ints = [k for k in self._user_variables() if type(ns[k]) is int]
                close = difflib.get_close_matches(s.name, ints, n=1)
                also = f" (did you mean {close[0]!r}?)" if close else ""
                raise UsageError(
                    f"%%resilient: --shrink {s.name}: no variable {s.name!r} exists{also}; "
                    f"set it in an earlier cell, e.g. {s.name} = 256"
                )
            value = ns[s.name]
            if not isinstance(value, int) or isinstance(value, bool):
                raise UsageError(
                    f"%%resilient: --shrink {s.name}: {s.name} is a {type(value).__name__} "
                    f"({value!r:.40}), but --shrink needs an integer such as a batch size"
                )
            if value < 1:
                raise UsageError(
                    f"%%resilient: --shrink {s.name}: {s.name} is {value}; it must be at least 1"
                )
            if s.name in assigned:
                raise UsageError(
                    f"%%resilient: --shrink {s.name}: the cell assigns {s.name}, so every retry "
                    f"would undo the shrink; set {s.name} in an earlier cell instead"
                )

    # ----------------------------------------------------------------------------- magics

    @magic_arguments()
    @argument(
        "--save", action="append", default=[], metavar="NAMES",
        help="variables checkpointed at every safe point and restored after a rollback or a "
        "restart (comma-separated); modules, optimizers and schedulers are restored in place",
    )
    @argument(
        "--retries", type=_retries, default=None, metavar="N",
        help="in-process recoveries after an out-of-memory error (default 2, see ResilienceMagics.retries)",
    )
    @argument(
        "--shrink", action="append", default=[], metavar="NAME[=FACTOR]",
        help="on OOM, multiply the integer variable NAME by FACTOR (default 0.5, never below 1) "
        "before retrying; repeat the option or separate names with commas",
    )
    @argument(
        "--max-restarts", type=_restarts, default=None, metavar="N",
        help="kernel restarts this run may use, counted on disk (default 3)",
    )
    @argument(
        "--every", type=_every, default=None, metavar="N|5min",
        help="checkpoint at every Nth safe point, or at most once per duration (default: every one)",
    )
    @cell_magic
    def resilient(self, line: str, cell: str):
        """Run the cell; on an out-of-memory error, free memory and run it again; past the
        retries, restart the kernel and resume from the last safe point.

        A recovery drops what the error holds (traceback frames, ``sys.last_*``, the cell's
        stored output), collects garbage, empties torch's allocator cache, rolls the ``--save``
        variables back to the last safe point, shrinks the ``--shrink`` variables and runs the
        cell again. Errors that are not out-of-memory errors behave exactly as without the
        magic. Example::

            %%resilient --save model,opt,history --shrink batch_size
            for epoch in resume_range(20):
                train_one_epoch(model, opt, batch_size)
                history.append(evaluate(model))
        """
        args = self._parse(self.resilient, line)
        self._check_body("resilient", cell)
        names = _names(args.save)
        shrinks = [s for text in args.shrink for s in _shrink_items(text, self.shrink_factor)]
        header = f"%%resilient {line}".rstrip()
        source = header + "\n" + cell
        key = self._cell_key() or source_key(source)
        run = self._open_run(key, source, cell, names, args, shrinks)
        try:
            self._check_save(names, cell)
            self._check_shrink(shrinks, cell)
            self._lint(key, cell, names + [s.name for s in shrinks])
        except UsageError:
            run.finish("failed")
            raise
        if shrinks:  # a new kernel gets them back from the journal, even after a SIGKILL
            run.record_shrink({s.name: self.shell.user_ns[s.name] for s in shrinks})
        retries = self.retries if args.retries is None else args.retries

        def before_retry(outcome):
            run.resuming = True  # roll back at the restore point (loop start or cell start)
            return run.forget_new_names()

        def give_up(exc, verdict, outcome):
            run.record_shrink({s.name: self.shell.user_ns.get(s.name) for s in shrinks})
            what = f"{verdict.label}" if verdict.needs_restart else (
                f"OOM ({verdict.label}) after {outcome.attempts} attempt{'s' if outcome.attempts != 1 else ''}"
            )
            try:
                run.leave(what)  # does not return unless the budget is spent
            except runs.RunStopped as stopped:
                self.say(str(stopped))

        recovery = Recovery(
            self.shell, retries=retries, shrink=tuple(shrinks), say=self.say,
            before_attempt=lambda outcome: run.attempt_start(),
            before_retry=before_retry, give_up=give_up,
        )
        runs._active.append(run)
        try:
            recovery.run(header, cell)
        except BaseException as e:
            if run.lock.held:
                if oom.classify(e) is None and run.safe_points:  # only when progress was made
                    hint = f"%resilience resume then run this cell again to continue from {run.journal.last_checkpoint}" \
                        if run.journal.last_checkpoint else "run the cell again to start afresh"
                    self.say(f"colab_resilience: run {run.run_id} stopped by {type(e).__name__}; to go on anyway: {hint}")
                run.finish("failed")
            raise
        else:
            run.save(next_index=run.next_index, force=True)
            run.finish("done")
        finally:
            runs._active.remove(run)

    @magic_arguments()
    @cell_magic
    def replay(self, line: str, cell: str):
        """Run the cell and record it as a set-up cell to replay after a kernel restart.

        Replay cells are re-run in the order they first ran, before the interrupted cell
        resumes. Re-running a cell replaces its record. Example::

            %%replay
            import torch
            model = Net(); opt = torch.optim.AdamW(model.parameters())
        """
        self._parse(self.replay, line)
        self._check_body("replay", cell)
        key = self._cell_key()
        failure = None
        try:
            execution.run_body(self.shell, execution.compile_body(self.shell, f"%%replay {line}".rstrip(), cell))
        except execution.BodyError as e:
            failure = e
        if failure is not None:
            execution.reraise(self.shell, failure.exc, failure.tb)
        self.replay_log.record(key, f"%%replay {line}".rstrip() + "\n" + cell)

    @line_magic
    def restart_after(self, line: str):
        """Plan kernel restarts at safe points: the leak guard.

        ``%restart_after N``: a fresh kernel after every N safe points of a ``%%resilient`` run.
        ``%restart_after --memory 90%``: at a safe point, restart when host RAM (or GPU memory,
        once CUDA is initialised) in use reaches 90%. ``%restart_after off`` stops both. State is
        saved first; planned restarts do not spend the restart budget.
        """
        text = line.strip()
        usage = "write %restart_after N, %restart_after --memory 90% or %restart_after off"
        current = self.policy or runs.RestartPolicy()
        if text in ("off", "0"):
            self.policy = runs.RestartPolicy()
        elif text.startswith("--memory"):
            value = text[len("--memory"):].strip().lstrip("=").strip().rstrip("%").strip()
            try:
                percent = float(value)
            except ValueError:
                raise UsageError(f"%restart_after: --memory needs a percentage (got {value!r}); {usage}") from None
            if not 0 < percent <= 100:
                raise UsageError(f"%restart_after: --memory {percent:g}% is not between 0 and 100; {usage}")
            self.policy = runs.RestartPolicy(current.every, percent)
        else:
            try:
                n = int(text)
            except ValueError:
                raise UsageError(f"%restart_after: {text!r} is not a number of safe points; {usage}") from None
            if n < 0:
                raise UsageError(f"%restart_after: {n} is negative; {usage}")
            self.policy = runs.RestartPolicy(n, current.memory_percent)
        self.say(f"colab_resilience: planned restarts {self.policy.describe()}")

    @line_magic
    def resilience(self, line: str):
        """What the runs are doing and what is on disk.

        ``%resilience status``: every run in the run directory (status, restarts, last checkpoint),
        and how saves find unchanged tensors and arrays (write tracking, or fingerprints).
        ``%resilience resume [RUN]``: replay the recorded set-up cells, restore the last checkpoint
        into the namespace, and mark the run pending so its cell continues when run again.
        ``%resilience resume --trust [RUN]``: the same for a run written under another key (another
        machine, a new Colab VM whose run directory is on Drive): you vouch for its set-up cells,
        and its journal and checkpoints are signed with this installation's key from then on.
        ``%resilience reset [RUN]``: forget a run (journal and checkpoints).
        ``%resilience dir PATH``: choose the run directory (in Colab, a mounted Drive folder
        survives the loss of the VM).
        """
        words = line.split()
        usage = "write %resilience status, resume [--trust] [RUN], reset [RUN] or dir PATH"
        if not words or words[0] == "status":
            return self._status()
        cmd, rest = words[0], words[1:]
        if cmd == "dir":
            if len(rest) != 1:
                raise UsageError("%resilience dir: give one folder, e.g. %resilience dir /content/drive/MyDrive/runs")
            path = Path(rest[0])
            try:
                path = path.expanduser()  # RuntimeError: ~user of no such user
                runs.make_private_dir(path)  # ValueError: a NUL in the path
            except (OSError, ValueError, RuntimeError) as e:
                why = getattr(e, "strerror", None) or e
                raise UsageError(f"%resilience dir: cannot use {path} ({why}); choose a writable folder") from None
            self.run_dir = str(path)
            self.say(f"colab_resilience: runs are kept in {path}")
            return None
        if cmd in ("resume", "reset"):
            trust = cmd == "resume" and "--trust" in rest
            rest = [w for w in rest if not (trust and w == "--trust")]
            bad = [w for w in rest if w.startswith("-")]
            if bad or len(rest) > 1:
                raise UsageError(
                    f"%resilience {cmd}: unexpected {' '.join(bad or rest[1:])!r}; "
                    + ("write %resilience resume [--trust] [RUN]" if cmd == "resume" else "write %resilience reset [RUN]")
                )
            run_dir = self._pick_run(cmd, rest)
            if cmd == "reset":
                return self._reset(run_dir)
            return self._resume(run_dir, trust=trust)
        raise UsageError(f"%resilience: unknown command {cmd!r}; {usage}")

    def _runs(self) -> list[Path]:
        root = self.root()
        found = [p.parent for p in root.glob("run-*/journal.json")] if root.is_dir() else []
        return sorted(found, key=lambda p: p.joinpath("journal.json").stat().st_mtime, reverse=True)

    def _pick_run(self, cmd: str, rest: list[str]) -> Path:
        found = self._runs()
        if rest:
            wanted = rest[0].removeprefix("run-")
            match = [p for p in found if p.name == f"run-{wanted}"]
            if not match:
                have = ", ".join(p.name.removeprefix("run-") for p in found) or "none"
                raise UsageError(f"%resilience {cmd}: no run {wanted!r} in {self.root()} (runs: {have})")
            return match[0]
        if not found:
            raise UsageError(f"%resilience {cmd}: no runs in {self.root()}; a %%resilient cell creates one")
        return found[0]

    def _status(self) -> None:
        from .journal import Journal, JournalError

        found = self._runs()
        policy = (self.policy or runs.RestartPolicy()).describe()
        print(f"colab_resilience: run directory {self.root()}; planned restarts {policy}")
        print(f"  {writes.describe()}")
        if not found:
            print("  no runs yet")
        for path in found:
            try:
                j = Journal.load(path)
            except JournalError as e:
                print(f"  {path.name}: unreadable ({e})")
                continue
            # read without the key (status only shows): extra may hold anything
            shrink_d, names_l = j.extra.get("shrink"), j.extra.get("names")
            shrink = ", ".join(f"{k}={v}" for k, v in shrink_d.items()) if isinstance(shrink_d, dict) else ""
            names = ", ".join(str(n) for n in names_l) if isinstance(names_l, list) else ""
            names = names or "nothing"
            last = j.restarts[-1]["reason"] if j.restarts else "none"
            print(
                f"  run {j.run_id}: {j.status}; restarts {j.restarts_used}/{j.max_restarts} (last: {last}); "
                f"saves {names}; last checkpoint {j.last_checkpoint or 'none'}; "
                f"{len(j.replay_cells)} replay cell{'s' if len(j.replay_cells) != 1 else ''}"
                + (f"; {shrink}" if shrink else "")
            )

    def _reset(self, run_dir: Path) -> None:
        import shutil

        from .journal import RunLock

        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunLockedError as e:
            raise UsageError(f"%resilience reset: {str(e).splitlines()[0]}") from None
        try:
            shutil.rmtree(run_dir)
        finally:
            lock.release()
        runs.remove_startup_file_if_idle(self.shell, self.root())
        if self._adopt and run_dir.name == f"run-{self._adopt}":
            self._adopt = None
        self.say(f"colab_resilience: forgot {run_dir.name} (journal and checkpoints removed)")

    def _resume(self, run_dir: Path, *, trust: bool = False) -> None:
        from .journal import Journal, JournalError, RunLock
        from .signing import load_or_create_key
        from .state import CheckpointStore

        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunLockedError as e:
            raise UsageError(f"%resilience resume: {str(e).splitlines()[0]}") from None
        try:
            key = load_or_create_key()
            try:
                j = Journal.load(run_dir, key=key, trust=trust)
            except JournalError as e:
                raise UsageError(str(e)) from None
            store = CheckpointStore(run_dir / "checkpoints", key=key, run_id=run_dir.name.removeprefix("run-"))
            if trust:
                # The user vouched for this run: from now on it is signed with this installation's key.
                adopted = store.adopt()
                j.save()
                firsts = "; ".join(c["source"].strip().splitlines()[0][:60] for c in j.replay_cells if c["source"].strip())
                self.say(
                    f"colab_resilience: run {j.run_id} trusted and signed with this installation's key "
                    f"(journal and {len(adopted)} checkpoint{'s' if len(adopted) != 1 else ''})"
                    + (f"; replaying: {firsts}" if firsts else "")
                )
            replayed = self._replay(j.replay_cells)
            names = [n for n in (j.extra.get("names") or [])]
            restored: list[str] = []
            try:
                ckpt = store.load()
                restored = ckpt.restore(self.shell.user_ns, [n for n in ckpt.names if n in names], strict=False)
            except ResilienceError as e:
                self.say(str(e).splitlines()[0])
            j.status = "pending"
            j.extra["restart_requested"] = True  # resumed by hand: not a kernel death to count
            j.kernel_pid = os.getpid()
            j.save()
        finally:
            lock.release()
        self._adopt = j.run_id
        self.say(
            f"colab_resilience: run {j.run_id}: replayed {replayed} cell{'s' if replayed != 1 else ''}, "
            f"restored {', '.join(restored) or 'nothing'}; the next %%resilient cell you run continues it"
        )

    def restore_finished_runs(self) -> list[str]:
        """Put back the final state of every run that finished in the run directory, oldest
        first; return the names restored. The driver calls this after a restart in a cell that
        follows a finished ``%%resilient`` cell: replaying the set-up cells alone would hand
        that cell an untrained model."""
        from .journal import Journal, JournalError
        from .signing import load_or_create_key
        from .state import CheckpointStore

        key = load_or_create_key()
        done = []
        for run_dir in reversed(self._runs()):  # oldest first: a later run's values win
            try:
                j = Journal.load(run_dir, key=key)
            except JournalError:
                continue
            if j.status == "done":
                done.append((run_dir, j))
        restored: list[str] = []
        for run_dir, j in done:
            names = j.extra.get("names") or []
            try:
                ckpt = CheckpointStore(run_dir / "checkpoints", key=key, run_id=j.run_id).load()
                got = ckpt.restore(self.shell.user_ns, [n for n in ckpt.names if n in names], strict=False)
            except ResilienceError as e:
                self.say(str(e).splitlines()[0])
                continue
            restored += [n for n in got if n not in restored]
        return restored

    def note_replay(self, source: str) -> None:
        """Record an already executed cell as a replay cell (the driver's tagged cells)."""
        self.replay_log.record(None, source)

    # ----------------------------------------------------------------------------- events

    def post_run_cell(self, result) -> None:
        execution.forget_rendered()

