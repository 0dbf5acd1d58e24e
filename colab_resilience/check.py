"""``colab-resilience check``: prove that a notebook resumes to the same result before a long run.

The notebook runs once uninterrupted, then ``faults`` more times under supervision, each time with
one fault injected at a random moment (:mod:`colab_resilience.faults`), chosen from the safe
points the uninterrupted run went through:

- a SIGKILL between two safe points (anywhere in an iteration), just before a save, or in the
  middle of a save: of its background write where the checkpoint is written while training goes
  on (the timeline says when it was on disk), of the save itself where it is synchronous;
- an out-of-memory error raised inside a ``%%resilient`` cell (recovered in process; a ``--shrink``
  variable is left as it was, or the result could not be compared).

Each faulted run must end as the uninterrupted one did: every variable of the notebook (not only
the ``--save`` ones) the same bit for bit, by a digest of the bytes a checkpoint would hold
(:func:`colab_resilience.kernelapi.state_digest`); a name missing after a resume (a loop
variable, a plain cell's variable after a restart between cells) is no silent difference: reading
it fails. A name that already differed between the two kernels before the first ``%%resilient``
cell (a memory size, a time) and that the training did not change is not compared, and said so;
so is a plain value that only set-up cells assign, read again in the kernel that took over.
Every cell's printed output from the first ``%%resilient`` cell on, as a notebook shows it
(:func:`_rendered`: a progress bar by its last drawing), must be the same (the cells
before it run before any fault; what differs there, a library's log line with its time and
process number, is not compared, and said so)
(where a cell was interrupted, every part it printed between two recoveries must be a part of
the uninterrupted output, and the last part its end). What differs is named, with the fault that
exposed it. ``seed`` makes the choice of faults repeatable.

The runs run in the notebook's folder, as the notebook would. The check writes nothing there,
but one line names what the runs wrote there (:class:`Folder`): each run after the first finds
what the earlier ones left (a marker file would keep a later run from its own fault). A
parameter given the value :data:`RUN_FOLDER` (``-p workdir {run}``) is a folder of the check's
own instead, the same path in every run (so that no variable differs by it), new and empty as
each run begins.

What it cannot see: other side effects outside the kernel (files written elsewhere, a remote
service), and output that differs from run to run anyway (a time a cell prints in its own
words; the times that ``%%time`` prints, and numbers a line names as times or rates, are not
compared: :func:`_untimed`).
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import faults as fault_env
from . import words
from .driver import EXIT_OK, HASH_SEED, RunResult, hash_seed, inject_parameters, keep_folder, read_notebook, run_notebook
from .tempdirs import TempFolder

MARK = "colab-resilience-check"
RUN_FOLDER = "{run}"  # a parameter's value that is a folder of the check's, empty as each run begins
BEFORE = MARK + "-before-training"
_DIGEST = "__import__('json').dumps(__import__('colab_resilience.kernelapi').kernelapi.state_digest())"
CHECK_CELL = f"print({MARK!r}, {_DIGEST})"
BEFORE_CELL = f"print({BEFORE!r}, {_DIGEST})"  # runs just before the first %%resilient cell
EXIT_IDENTICAL, EXIT_DIFFERS, EXIT_USAGE, EXIT_BROKEN = 0, 1, 2, 3
KINDS = ("kill-between", "oom", "kill-during-save", "kill-before-save")
REAIM = 2  # a fault that never fired is aimed at another moment this many times


@dataclass
class Fault:
    kind: str  # one of KINDS
    safe_point: int
    delay: float
    in_write: bool = False  # a kill during a save, aimed into its background write

    def env(self, mark: Path) -> str:
        before = self.kind == "kill-before-save" or (self.kind == "kill-during-save" and not self.in_write)
        phase = "before" if before else "after"
        return json.dumps({"kind": "oom" if self.kind == "oom" else "kill", "safe_point": self.safe_point,
                           "phase": phase, "delay": self.delay, "mark": str(mark)})

    def describe(self, total: int) -> str:
        at = f"safe point {self.safe_point} of {total}"
        return {
            "kill-between": f"SIGKILL {self.delay:.2f} s after {at}",
            "oom": f"an out-of-memory error {self.delay:.2f} s after {at}",
            "kill-during-save": (f"SIGKILL {self.delay:.3f} s into the background write of the checkpoint "
                                 f"of {at}" if self.in_write else f"SIGKILL {self.delay:.3f} s into the save at {at}"),
            "kill-before-save": f"SIGKILL just before the save at {at}",
        }[self.kind]


class Folder:
    """The notebook's folder across the check's runs, which all run in it as the notebook would:
    its top-level entries when the check began, and which of them a run created or changed. The
    check writes nothing there; it says what the runs wrote, since each later run found it."""

    def __init__(self, path: Path, ignore: Path | None = None):
        self.path = path
        self.found = self._entries()
        # the check's own --keep folder, where it is in the notebook's folder
        try:
            inside = Path(os.path.abspath(ignore)).relative_to(os.path.abspath(path)).parts if ignore else ()
        except ValueError:
            inside = ()
        self.ignored = inside[0] if inside else None
        self.written: list[str] = []  # created or changed by a run, in the order first seen

    def _entries(self) -> dict[str, tuple]:
        try:
            with os.scandir(self.path) as it:
                return {e.name: _stat_key(e) for e in it}
        except OSError:
            return {}

    def after_run(self) -> None:
        for name, key in self._entries().items():
            if self.found.get(name) != key and name not in self.written and name != self.ignored:
                self.written.append(name)

    def note(self, parameters: dict[str, Any] | None = None) -> str | None:
        """The line that names what the runs wrote, and how to give them a folder of the check's;
        ``parameters`` (the notebook's parameters cell's, by name): one whose value names a folder
        they made there is named (``-p output_dir {run}``)."""
        if not self.written:
            return None

        def folder(value: Any) -> str | None:  # "./out" -> "out", where the runs made a folder "out"
            name = os.path.normpath(value) if isinstance(value, str) and not os.path.isabs(value) else None
            return name if name in self.written and (self.path / name).is_dir() else None

        named = [k for k, v in (parameters or {}).items() if folder(v) is not None]
        how = ("check with " + " ".join(f"-p {k} {RUN_FOLDER}" for k in named) if named else
               f"have the notebook write them in a folder a parameter names, and check with -p NAME {RUN_FOLDER}")
        return (f"colab-resilience check: the runs wrote {_names(sorted(self.written))} in {self.path}: each run after "
                "the first found what the earlier ones had left there, which can change what it does (a marker "
                f"file, a log it reads); where that matters, {how}: each run then finds that folder new and empty")


def _stat_key(entry: os.DirEntry) -> tuple:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return ()
    return (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)


def _names(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


@dataclass
class Outcome:
    """One run of the notebook: how it ended, its variables' digests, its cells' printed lines."""

    result: RunResult
    digests: dict[str, list]
    outputs: dict[int, list[str]]
    before: dict[str, list] = field(default_factory=dict)  # the digests just before the training
    set_up: frozenset[str] = frozenset()  # the names only set-up cells bind (see set_up_names)
    training: int = 0  # the first %%resilient cell's number: the cells before it ran before any fault
    sources: dict[int, str] = field(default_factory=dict)  # each code cell's first line
    logged: dict[int, set[str]] = field(default_factory=dict)  # each code cell's lines written to stderr
    cleared: frozenset[int] = frozenset()  # the code cells that cleared their output as they ran


@dataclass
class FaultResult:
    fault: Fault
    fired: bool
    differences: list[str] = field(default_factory=list)
    stopped: str = ""  # the line the faulted run stopped with, where it did not finish (a refusal, a failure)
    restarts: int = 0
    seconds: float = 0.0
    caught: bool = False  # an injected out-of-memory error caught where it was raised: it never reached this package

    @property
    def proves(self) -> bool:
        return self.fired and not self.caught


@dataclass
class CheckReport:
    notebook: str
    safe_points: int
    seconds: float
    results: list[FaultResult] = field(default_factory=list)
    broken: str = ""  # why the uninterrupted run itself failed
    apart: list[str] = field(default_factory=list)  # what the set-up cells made otherwise in another kernel

    @property
    def status(self) -> int:
        """Identical only if every fault fired and its run ended identical: a fault that never
        fired tested nothing (exit 1, said as such, not as a difference)."""
        if self.broken:
            return EXIT_BROKEN
        return EXIT_DIFFERS if any(r.differences or r.stopped or not r.proves for r in self.results) else EXIT_IDENTICAL

    def summary(self, seed: int) -> str:
        n = len(self.results)
        differ = sum(1 for r in self.results if r.differences and r.proves)
        stopped = sum(1 for r in self.results if r.stopped and r.proves)
        unfired = sum(1 for r in self.results if not r.fired)
        # a run its fault never struck that still ended otherwise: the notebook differs from run to run
        unfired_apart = sum(1 for r in self.results if not r.fired and (r.differences or r.stopped))
        caught = sum(1 for r in self.results if r.fired and r.caught)  # what followed proves nothing
        if not differ and not stopped and not unfired and not caught:
            return f"identical after each of {n} faults (seed {seed})" if n > 1 else f"identical after its fault (seed {seed})"
        parts = [f"{differ} of {n} faulted runs differ"] if differ else []
        if stopped:  # loudly: no silent difference, but the notebook as it is does not get through the fault
            parts.append(f"{stopped} of {n} faulted runs stopped instead of going on (see above why)")
        if unfired_apart:
            parts.append(f"{unfired} of {n} faults never fired, even aimed again, and {unfired_apart} of those runs "
                         "ended otherwise without one: the notebook does not run the same twice (see above)")
        elif unfired:
            parts.append(f"{unfired} of {n} faults never fired, even aimed again (try another --seed)")
        if caught:
            parts.append(f"{caught} of {n} out-of-memory errors were caught where they were raised (by the notebook's "
                         "code or a library's), even aimed again (try another --seed)")
        if self.apart and differ:
            parts.append(f"the set-up cells make {_names(self.apart, 4)} otherwise in each kernel: seed them, "
                         "then check again")
        return "; ".join(parts) + f" (seed {seed})"


def choose_faults(timeline: list[tuple[int, str, float, str]], count: int, seed: int) -> list[Fault]:
    """``count`` faults spread over the safe points of ``timeline`` (kinds in turn). An OOM
    follows a safe point after which the cell runs more of the notebook's code (another
    iteration); a kill between safe points may also land in what follows a loop; a kill during a
    save lands in its background write where the checkpoint was on disk only after training went
    on (``durable`` after ``after``), else between the save's start and end."""
    rng = random.Random(seed)
    before = {n: t for n, phase, t, _ in timeline if phase == "before"}
    after = {n: t for n, phase, t, _ in timeline if phase == "after"}
    durable = {n: t for n, phase, t, _ in timeline if phase == "durable"}
    ends = {n for n, _, _, kind in timeline if kind == "end"}
    points = sorted(set(before) & set(after))
    followed = [n for n in points if n + 1 in before and n not in ends] or points
    iterations = [n for n in followed if n + 1 not in ends] or followed
    out = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        n = rng.choice(iterations if kind == "oom" else followed if kind == "kill-between" else points)
        in_write = kind == "kill-during-save" and durable.get(n, 0.0) > after[n]
        if in_write:
            delay = rng.uniform(0.1, 0.9) * (durable[n] - after[n])
        elif kind == "kill-during-save":
            delay = rng.uniform(0.1, 0.9) * max(after[n] - before[n], 0.001)
        elif kind == "kill-before-save":
            delay = 0.0
        else:  # somewhere in what follows the safe point, up to the next one
            nxt = before.get(n + 1, after[n] + 0.5)
            delay = rng.uniform(0.1, 0.9) * max(nxt - after[n], 0.01)
        out.append(Fault(kind, n, delay, in_write))
    return out


# the folder ipykernel compiles each cell into, named by the kernel's process: in a warning's
# location (/tmp/ipykernel_4242/1234567.py:3: UserWarning), it differs from kernel to kernel
_KERNEL_FOLDER = re.compile(r"ipykernel_\d+")


def _lines(cell) -> list[str]:
    """What a cell printed, line by line, as a notebook shows it (:func:`_rendered`; the kernel's
    own folder in a path as ``ipykernel_PID``)."""
    text = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            text.append(out.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            text.append(str(out.get("data", {}).get("text/plain", "")) + "\n")
        elif kind == "error":
            text.append(f"{out.get('ename')}: {out.get('evalue')}\n")
    return _rendered("".join(text))


# a terminal's colours and styles (Keras's progress bar: "\x1b[1m8/8\x1b[0m \x1b[32m━━━━\x1b[0m")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _rendered(text: str) -> list[str]:
    """``text`` as a notebook (or a terminal) shows it, line by line: colours left out, a carriage
    return going back to the line's start and a backspace one character, what follows written
    over what was there (a progress bar drawn again in place: Keras's ``fit``, a ``\\r`` in a
    print), trailing blanks and blank lines left out. A line drawn again in place that this package's line
    follows, with no line break (the fault came while the bar was drawn), is a view that the next
    drawing would have replaced, not a line printed: it is left out, and this package's line kept.
    The kernel's own folder in a path is written ``ipykernel_PID``."""
    lines = []
    for raw in _ANSI.sub("", _KERNEL_FOLDER.sub("ipykernel_PID", text)).split("\n"):
        at = raw.find(words.SAID)
        if at > 0 and "\r" in raw[:at]:
            raw = raw[at:]
        if "\r" in raw or "\b" in raw:
            screen: list[str] = []
            column = 0
            for ch in raw:
                if ch == "\r":
                    column = 0
                elif ch == "\b":
                    column = max(column - 1, 0)
                else:
                    if column < len(screen):
                        screen[column] = ch
                    else:
                        screen.append(ch)
                    column += 1
            raw = "".join(screen)
        if raw.strip():  # a blank line: stdout's and stderr's line breaks come apart (tqdm's last one)
            lines.append(raw.rstrip())
    return lines


def _logged(cell) -> set[str]:
    """The lines a cell wrote to stderr: warnings, a library's logging, progress."""
    text = "".join(out.get("text", "") for out in cell.get("outputs", [])
                   if out.get("output_type") == "stream" and out.get("name") == "stderr")
    return set(_rendered(text))


def _digests(cell, mark: str) -> dict[str, list]:
    for line in _lines(cell):
        if line.startswith(mark + " "):
            return json.loads(line[len(mark) + 1:])
    return {}


def _outcome(result: RunResult, set_up: frozenset[str] = frozenset()) -> Outcome:
    """The digests and the printed lines of a run; cells are numbered as in the user's notebook
    (the cells check adds are left out: its two digest cells, and the parameters it injects)."""
    cells = result.notebook.cells
    ours = [c for c in cells if c.get("metadata", {}).get(MARK)]
    mine = [c for c in cells if not c.get("metadata", {}).get(MARK)]
    by_role = {c["metadata"][MARK]: c for c in ours}
    outputs = {i: _lines(c) for i, c in enumerate(mine) if c.get("cell_type") == "code"}
    cleared_ids = {id(cells[j]) for j in result.cleared}
    cleared = frozenset(i for i, c in enumerate(mine) if id(c) in cleared_ids)
    logged = {i: _logged(c) for i, c in enumerate(mine) if c.get("cell_type") == "code"}
    training = next((i for i, c in enumerate(mine) if c.get("cell_type") == "code"
                     and "".join(c.get("source", "")).lstrip().startswith("%%resilient")), 0)
    sources = {i: next((ln for ln in "".join(c.get("source", "")).splitlines() if ln.strip()), "")
               for i, c in enumerate(mine) if c.get("cell_type") == "code"}
    return Outcome(result, _digests(by_role.get("after", {}), MARK), outputs,
                   _digests(by_role.get("before", {}), BEFORE), set_up, training, sources, logged, cleared)


# the cells the supervisor's messages name: "colab-resilience: cell 4 failed: ...", "replaying set-up cell 1 failed"
_MESSAGE_CELL = re.compile(r"(^colab-resilience: cell |set-up cell )(\d+)\b")


def _numbered_as_yours(result: RunResult) -> str:
    """The run's message with its cells numbered as in the user's notebook, not as in the one the
    check ran (its digest cells added)."""
    cells = result.notebook.cells

    def yours(m: re.Match) -> str:
        i = int(m.group(2))
        if i >= len(cells) or cells[i].get("metadata", {}).get(MARK):
            return m.group(0)
        return m.group(1) + str(sum(1 for c in cells[:i] if not c.get("metadata", {}).get(MARK)))

    return _MESSAGE_CELL.sub(yours, result.message or "")


def _first_resilient(nb) -> int | None:
    """The index of the notebook's first ``%%resilient`` cell (None without one)."""
    return next((i for i, c in enumerate(nb.cells) if c.get("cell_type") == "code"
                 and "".join(c.get("source", "")).lstrip().startswith("%%resilient")), None)


def _add_check_cells(nb) -> None:
    """A cell that prints every variable's digest at the end, and one just before the first
    ``%%resilient`` cell (what the training starts from)."""
    import nbformat

    first = _first_resilient(nb)
    if first is not None:
        nb.cells.insert(first, nbformat.v4.new_code_cell(BEFORE_CELL, metadata={MARK: "before"}))
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_CELL, metadata={MARK: "after"}))


# a number printed as a time or a rate under its name: {'train_runtime': '0.9376', 'train_samples_per_second': 204.8}
_PRINTED_TIME = re.compile(r"""(['"]?)(\w*?(?:runtime|time|seconds|duration|per_second))\1(\s*[:=]\s*)(['"]?)[-+0-9.eE]+\4""")


# what IPython's %%time and %time print after the cell: "CPU times: user 266 ms, sys: 24.8 ms, total:
# 291 ms" ("CPU times: total: ..." where there is no user and sys time), "Wall time: 1min 3s"; and,
# only where compiling or parsing the cell took over 0.1 s, "Compiler : 0.12 s" and "Parser   : ..."
_TIME_MAGIC = re.compile(r"^(CPU times: |Wall time: )\d.*$|^CPU times: (?:user .*, sys: .*, )?total: .*$")
_TIME_MAGIC_SOMETIMES = re.compile(r"^(?:Compiler|Parser  ) : \d.*$")


# a progress bar's line (Keras's, as drawn: "8/8 ━━━━ 0s 3ms/step - loss: 7.8491", "1/8 [==>....] -
# ETA: 1s - loss: 8.4384", "8/8 - 0s - 3ms/step - loss: 7.8491"), and the times in it: per step
# (or epoch, or sample), the time elapsed and the time left
_PROGRESS_LINE = re.compile(r"^\s*\d+/(?:\d+|Unknown)\b")
_PROGRESS_TIME = re.compile(r"\b\d+(?:s|ms|us|μs)/(\w+)|(?<= )(?:ETA: )?(?:\d+:\d\d(?::\d\d)?|\d+s)(?= |$)")


def _untimed(lines: list[str]) -> list[str]:
    """Printed lines with the numbers they name as times or rates left out: they differ between
    any two runs (the metrics a Hugging Face ``Trainer`` prints at its end, what ``%%time``
    prints after its cell; its compile and parse times, printed only where they were long, are
    left out whole)."""
    return [_untimed_line(line) for line in lines if not _TIME_MAGIC_SOMETIMES.match(line)]


def _untimed_line(line: str) -> str:
    if _PROGRESS_LINE.match(line):
        return _PROGRESS_TIME.sub(lambda m: f"<time>/{m.group(1)}" if m.group(1) else "<time>", line)
    line = _TIME_MAGIC.sub(lambda m: (m.group(1) or "CPU times: ") + "<time>", line)
    return _PRINTED_TIME.sub(r"\1\2\1\3<time>", line)


def _output_difference(reference: list[str], faulted: list[str], logged: frozenset[str] | set[str] = frozenset(),
                       cleared: bool = False) -> str | None:
    """How a cell's printed lines differ from what it printed uninterrupted (the first line that
    does not fit, quoted), or None where they are the same: exactly, or, where it was recovered
    (its own lines of this package split it into parts), every part a run of the uninterrupted
    lines and the last part their end. A part's last line may be cut short: the fault came while
    the line was printed (``0`` of ``0 2.31``, then ``colab_resilience: OOM ...`` on that line).
    In a cell that ``cleared`` its output as it ran (a live plot's ``clear_output(wait=True)``),
    what an attempt showed when it died or was rolled back is a view it was about to clear:
    only the last part that shows anything is compared, and must be the uninterrupted end."""
    reference = [line for line in reference if not line.startswith("colab_resilience:")]
    parts, part, cut = [], [], []
    for line in faulted:
        at = line.find(words.SAID)
        if at == -1:
            part.append(line)
            continue
        if at > 0:
            part.append(line[:at])
        parts.append(part)
        cut.append(at > 0)
        part = []
    parts.append(part)
    cut.append(False)
    recovered = len(parts) > 1
    if cleared and recovered:  # shown after a recovery: what it logged may differ (see below)
        parts, cut = [_quiet(next((p for p in reversed(parts) if p), []), logged)], [False]
        reference = _quiet(reference, logged)

    def within(p: list[str], short: bool = False) -> bool:
        n = len(p)
        return not p or any(reference[i:i + n - 1] == p[:-1] and (
            reference[i + n - 1] == p[-1] or short and reference[i + n - 1].startswith(p[-1]))
            for i in range(len(reference) - n + 1))

    if not recovered:  # nothing of ours: no recovery in this cell
        if faulted == reference or _same_but_interleaved(reference, faulted, logged):
            return None
        at = next((i for i, (a, b) in enumerate(zip(reference, faulted)) if a != b), min(len(reference), len(faulted)))
        if at < len(faulted):
            return f"first at {_quote(faulted[at])}"
        return f"it ends before {_quote(reference[at])}"
    for i, (p, short) in enumerate(zip(parts, cut)):
        if not i and not within(p, short) and logged:
            # stdout and stderr reach the notebook apart: a line logged before a printed one may
            # come after it (the Hugging Face Trainer's "mtime may not be reliable" as it saved)
            reference, p = [line for line in reference if line not in logged], [line for line in p if line not in logged]
        if i and not within(p, short):
            # a part after a recovery: what it logged may differ (a warning Python shows once per
            # place in a process, which the retry does not repeat; a library's log line of how it
            # found its files); what it printed may not
            reference, p = _quiet(reference, logged), _quiet(p, logged)
        if not within(p, short):
            fits = max(n for n in range(len(p)) if within(p[:n]))
            return f"first at {_quote(p[fits])}"
    last = parts[-1]
    if last and reference[len(reference) - len(last):] != last:
        # what it printed last (not logged) must be what the uninterrupted run printed last
        quiet_reference = _quiet(reference, logged)
        tail = next((q for q in (_quiet(p, logged) for p in reversed(parts)) if q), [])
        if quiet_reference[len(quiet_reference) - len(tail):] != tail or (not tail and quiet_reference):
            return f"it ends otherwise, at {_quote(last[-1])}"
    return None


def _same_but_interleaved(reference: list[str], faulted: list[str], logged: frozenset[str] | set[str]) -> bool:
    """The same lines, the ones written to stderr (``logged``) maybe in other places among those
    printed to stdout: the two streams reach the notebook apart."""
    from collections import Counter

    def split(lines):
        return [line for line in lines if line not in logged], Counter(line for line in lines if line in logged)

    return bool(logged) and split(reference) == split(faulted)


# a warning as Python shows it: "/path/module.py:21: UserWarning: message" (the source line below
# it, indented, goes with it)
_WARNING = re.compile(r"^\S.*\.py:\d+: ")


def _quiet(lines: list[str], logged: frozenset[str] | set[str]) -> list[str]:
    """``lines`` without what was written to stderr (``logged``) and the warnings in them."""
    return [line for line in _unwarned(lines) if line not in logged]


def _unwarned(lines: list[str]) -> list[str]:
    """``lines`` without the warnings Python showed in them (see :data:`_WARNING`)."""
    out, skip = [], False
    for line in lines:
        if _WARNING.match(line):
            skip = True
            continue
        if skip and line.startswith("  "):
            continue
        skip = False
        out.append(line)
    return out


def _quote(line: str, most: int = 80) -> str:
    line = line.strip()
    return repr(line if len(line) <= most else line[:most - 3] + "...")


def stop_line(outcome: Outcome) -> str:
    """The line a run that did not finish stopped with ("" where it finished)."""
    if outcome.result.status == EXIT_OK:
        return ""
    return _numbered_as_yours(outcome.result) or f"exit status {outcome.result.status}"


def compare(reference: Outcome, faulted: Outcome) -> list[str]:
    """What differs between two runs, one line each."""
    if faulted.result.status != EXIT_OK:  # said as the run's stop (:func:`stop_line`), not compared
        return []
    found = []
    for name in sorted(set(reference.digests) | set(faulted.digests)):
        a, b = reference.digests.get(name), faulted.digests.get(name)
        if b is None:
            continue  # missing after a resume (a loop variable, a plain cell's name): reading it fails loudly
        if a is None:
            found.append(f"{name} exists only in the faulted run")
        elif a[0] != b[0] and _why_not_compared(name, reference, faulted) is None:
            values = f" (uninterrupted {a[1]}, faulted {b[1]})" if a[1] is not None and b[1] is not None else ""
            found.append(f"{name} differs{values}")
    for index, lines in reference.outputs.items():
        logged = set(_untimed(list(reference.logged.get(index, ())))) | \
            set(_untimed(list(faulted.logged.get(index, ()))))
        cleared = index in reference.cleared or index in faulted.cleared
        how = (_output_difference(_untimed(lines), _untimed(faulted.outputs.get(index, [])), logged, cleared)
               if index >= reference.training else None)
        if how is not None:
            source = reference.sources.get(index, "")
            found.append(f"the printed output of cell {index}{f' ({_quote(source, 40)})' if source else ''} "
                         f"differs, {how}")
    return found


PRINTED_BEFORE = ("printed before the training, where no fault strikes: what differs there differs in every "
                  "kernel, such as a library's log line with its time and process number")
BEFORE_TRAINING = "set before the training, different in each kernel before any fault, and not changed by the training"
RECOMPUTED = ("a plain value only set-up cells set, which the kernel that took over ran again and which read "
              "something else there (a memory size, a time)")


def _why_not_compared(name: str, reference: Outcome, faulted: Outcome) -> str | None:
    """Why a difference in ``name`` cannot have been caused by a fault, or None. Either it
    already differed between the two kernels before the training began (the memory size or the
    time a set-up cell read) and the training left it as it was in both; or it is a plain
    value (a number, a string: only an assignment changes it), only set-up cells assign it, and
    a kernel was restarted: its value is what the replayed set-up cell computed in the new kernel."""
    a0, b0 = reference.before.get(name), faulted.before.get(name)
    a, b = reference.digests.get(name), faulted.digests.get(name)
    if a0 is not None and b0 is not None and a0[0] != b0[0] and a == a0 and b == b0:
        return BEFORE_TRAINING
    if (name in reference.set_up and a is not None and b is not None and a[1] is not None and b[1] is not None
            and (reference.result.restarts or faulted.result.restarts)):
        return RECOMPUTED
    return None


def not_compared(reference: Outcome, faulted: Outcome) -> dict[str, list[str]]:
    """The names :func:`compare` left out, by why."""
    out: dict[str, list[str]] = {}
    for n in sorted(set(reference.digests) & set(faulted.digests)):
        why = reference.digests[n][0] != faulted.digests[n][0] and _why_not_compared(n, reference, faulted)
        if why:
            out.setdefault(why, []).append(n)
    for index, lines in reference.outputs.items():
        if index < reference.training and lines != faulted.outputs.get(index, []):
            out.setdefault(PRINTED_BEFORE, []).append(f"the printed output of cell {index}")
    return out


def set_up_names(nb) -> frozenset[str]:
    """The names that only the cells before the first ``%%resilient`` cell bind (by their code:
    assignments, definitions, imports), that no ``%%resilient`` option names (a ``--shrink``
    variable changes without an assignment) and that no function declares ``global``; empty when
    a later cell cannot be read."""
    from IPython.core.inputtransformer2 import TransformerManager

    from .lint import declared_global, bound_names

    transform = TransformerManager().transform_cell
    before: set[str] = set()
    after: set[str] = set()
    first = _first_resilient(nb)
    for i, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code" or cell.get("metadata", {}).get(MARK) in ("before", "after"):
            continue
        source = "".join(cell.get("source", ""))
        training = first is not None and i >= first
        if source.lstrip().startswith("%%"):  # a cell magic (%%replay, %%resilient): its body is the code
            header, _, source = source.lstrip().partition("\n")
            if training:  # --shrink and --save names change without an assignment
                after.update(re.findall(r"[A-Za-z_]\w*", header))
        try:
            tree = ast.parse(transform(source))
        except SyntaxError:
            if training:
                return frozenset()
            continue
        (after if training else before).update(bound_names(tree))
        # a function's global (def tick(): global steps; steps += 1) changes when the training calls it
        after.update(declared_global([tree]))
    return frozenset(before - after)


def check_notebook(notebook: str | os.PathLike, *, parameters: dict[str, Any] | None = None, faults: int = 3,
                   seed: int = 0, kernel_name: str | None = None, cell_timeout: int | None = None,
                   keep: str | os.PathLike | None = None, standby: bool = True,
                   log: Callable[[str], None] = print) -> CheckReport:
    """Run ``notebook`` uninterrupted and with ``faults`` injected faults, and compare (see the
    module documentation). Raises :class:`colab_resilience.errors.NotebookInputError` for an
    unusable notebook."""
    nb, folder = read_notebook(notebook)
    import nbformat

    own = None if keep else TempFolder("check")
    work = keep_folder(keep, "check") if keep else Path(own.path)
    run_folder = work / "run-folder"
    parameters = {k: str(run_folder) if v == RUN_FOLDER else v for k, v in (parameters or {}).items()}
    injected = not any("injected-parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells)
    inject_parameters(nb, parameters)
    for cell in nb.cells:  # the cell check adds is not one of the user's: cells are numbered as in their file
        if injected and parameters and "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            cell.metadata[MARK] = "parameters"
    _add_check_cells(nb)
    cwd = str(folder or os.getcwd())
    place = Folder(Path(cwd), ignore=work)

    # the runs' kernels hash strings alike, as the kernels of one supervised run do (driver.hash_seed)
    hashing = {HASH_SEED: os.environ.get(HASH_SEED) or hash_seed(work)}

    def run(name: str, env: dict, standby: bool = standby) -> RunResult:
        # one standby kernel for a run with one fault: one started after it took over would import
        # the notebook's modules (5 s of CPU for torch's) for a further restart the fault never makes
        if str(run_folder) in parameters.values():  # -p NAME {run}: new and empty, in every run
            shutil.rmtree(run_folder, ignore_errors=True)
            run_folder.mkdir(mode=0o700)
        try:
            return run_notebook(nbformat.from_dict(json.loads(json.dumps(nb))), work / f"{name}.ipynb", cwd=cwd,
                                run_dir=work / f"runs-{name}", kernel_name=kernel_name,
                                cell_timeout=cell_timeout, env={**hashing, **env}, standby=standby, standbys=1)
        finally:
            place.after_run()

    try:
        timeline_file = work / "timeline"
        started = time.perf_counter()
        # no standby kernel for the run without faults: it would import the notebook's modules
        # beside it (5 s of CPU for torch's) for a restart that a run without faults rarely makes
        reference = _outcome(run("uninterrupted", {fault_env.TIMELINE_ENV: str(timeline_file)}, standby=False),
                             set_up_names(nb))
        seconds = time.perf_counter() - started
        timeline = _read_timeline(timeline_file)
        report = CheckReport(str(notebook), max((n for n, *_ in timeline), default=0), seconds)
        if reference.result.status != EXIT_OK:
            report.broken = _numbered_as_yours(reference.result) or "the notebook failed"
            return report
        if not timeline:
            report.broken = "the notebook has no %%resilient cell with a safe point: nothing to check"
            return report
        log(f"colab-resilience check: {notebook}: {report.safe_points} safe points, uninterrupted in {seconds:.1f} s")
        for line in warned(reference):
            log(f"  its first run said: {line}")
        for i, fault in enumerate(choose_faults(timeline, faults, seed), 1):
            for attempt in range(1 + REAIM):
                if attempt:  # the same kind at another moment
                    fault = choose_faults(timeline, i, seed + 7919 * attempt)[i - 1]
                mark = work / f"fault-{i}-{attempt}.fired"
                started = time.perf_counter()
                # no standby kernel for an out-of-memory error either: it is retried in the kernel
                outcome = _outcome(run(f"fault-{i}", {fault_env.FAULT_ENV: fault.env(mark)},
                                       standby=standby and fault.kind != "oom"))
                fired = fault_env.fired(mark)
                result = FaultResult(fault, fired, compare(reference, outcome), stop_line(outcome), len(outcome.result.restarts),
                                     time.perf_counter() - started,
                                     caught=fired and fault.kind == "oom" and not fault_env.reached_handling(mark))
                if result.proves or attempt == REAIM:
                    break
                if result.caught:
                    log(f"  fault {i}/{faults}: {fault.describe(report.safe_points)}: the error, raised at "
                        f"{fault_env.fired_at(mark)}, was caught there (by the notebook's code or a library's) and "
                        "never reached colab_resilience; aimed at another moment")
                else:
                    log(f"  fault {i}/{faults}: {fault.describe(report.safe_points)}: never fired (the run went "
                        "another way, e.g. a planned restart at that safe point); aimed at another moment")
            report.results.append(result)
            where = fault_env.fired_at(mark)
            landed = f" (the error was raised at {where})" if where else ""
            verdict = ("identical" if not result.differences else f"DIFFERS{landed}: " + "; ".join(result.differences))
            if result.stopped:  # a refusal is the loud half of "the same result, or a loud refusal"
                verdict = f"STOPPED{landed} instead of going on: {result.stopped}"
            if not result.fired:
                verdict = "the fault never fired (the run went another way), so this run proves nothing: " + verdict
            elif result.caught:
                verdict = ("the error was caught where it was raised (by the notebook's code or a library's), "
                           "never reaching colab_resilience, so this run proves nothing: " + verdict)
            log(f"  fault {i}/{faults}: {fault.describe(report.safe_points)}: {verdict} "
                f"({result.restarts} kernel restart{'s' if result.restarts != 1 else ''}, {result.seconds:.1f} s)")
            if result.differences or result.stopped:  # what the package said in that run, and not uninterrupted
                for line in warned(outcome, since=0):
                    if line not in warned(reference, since=0):
                        log(f"    it said: {line}")
            for why, names in not_compared(reference, outcome).items():
                log(f"    not compared: {', '.join(names)} ({why})")
            apart = set_up_apart(work / "runs-uninterrupted", work / f"runs-fault-{i}")
            if apart and result.differences:
                log(apart_line(apart, again=bool(report.apart)))
                report.apart += [n for n in apart if n not in report.apart]
        return report
    finally:
        note = place.note(parameter_values(nb))
        if note:
            log(note)
        if own is not None:
            own.remove()


def parameter_values(nb) -> dict[str, Any]:
    """The literal values the notebook's ``parameters`` cell assigns, by name (others left out)."""
    cell = next((c for c in nb.cells if c.get("cell_type") == "code"
                 and "parameters" in c.get("metadata", {}).get("tags", [])), None)
    try:
        tree = ast.parse(cell.source) if cell is not None else None
    except SyntaxError:
        tree = None
    found: dict[str, Any] = {}
    for statement in tree.body if tree is not None else []:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
            try:
                found[statement.targets[0].id] = ast.literal_eval(statement.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                pass
    return found


def set_up_apart(reference: Path, faulted: Path) -> list[str]:
    """The names the set-up cells made otherwise in the faulted run's first kernel than in the
    uninterrupted run's, before any fault: what each run recorded when it began (the journal's
    fingerprints of what the set-up cells bind and the training reads: :mod:`.setup_state`),
    for each run of a ``%%resilient`` cell found in both."""
    from .journal import read_journals

    began = {j.run_id: j.setup for j in read_journals(reference)}
    apart: list[str] = []
    for j in read_journals(faulted):
        before = began.get(j.run_id) or {}
        apart += [n for n, f in j.setup.items() if n in before and before[n] != f and n not in apart]
    return sorted(apart)


def apart_line(names: list[str], again: bool = False) -> str:
    shown = _names(names, 4)
    if again:
        return f"    the set-up cells made {shown} otherwise in this run's kernel too, before any fault (see above)"
    return (f"    the set-up cells made {shown} otherwise in this run's kernel than in the uninterrupted run's, before "
            "any fault (drawn without a seed, a set's order of strings): no two runs of this notebook agree, so what "
            "differs may come from there and not from the fault, and a resume after a restart trains on what the "
            "replay makes; seed the draws in the %%replay cell (torch.manual_seed(0), random_state=0), sort sets "
            "(sorted(set(...)))")


def warned(outcome: Outcome, since: int | None = None) -> list[str]:
    """The lines of this package the run printed, each once: by its ``%%resilient`` cells (what,
    uninterrupted, it said would make a resumed run differ; not what ``%resilience status``
    prints in another cell), or by every cell from cell ``since`` on."""
    lines = [line for index, printed in sorted(outcome.outputs.items())
             if (index >= since if since is not None else outcome.sources.get(index, "").startswith("%%resilient"))
             for line in printed if line.startswith("colab_resilience:") and "runs are kept in" not in line]
    return list(dict.fromkeys(lines))


def _read_timeline(path: Path) -> list[tuple[int, str, float, str]]:
    try:
        rows = [line.split() for line in path.read_text().splitlines()]
    except OSError:
        return []
    return [(int(n), phase, float(t), kind) for n, phase, t, kind in rows if n.isdigit()]
