"""The run's on-disk truth: its journal, and the runs under a root.

``run-<id>/journal.json`` says what a restarted kernel needs to go on: the run's status
(``pending`` after an abnormal end, ``done``, ``failed``), every restart with its reason, the
restart budget, the last checkpoint, the set-up cells to replay and the interrupted cell, the
names the run saves, the batch sizes ``--shrink`` settled on, the planned-restart policy, whether
the last kernel left on purpose and whether it died while replaying. Every field is typed; a
reader never sees a field that is not listed in :class:`Journal`.

Every write is atomic (:func:`colab_resilience.fsutil.atomic_write`) and signed with the
installation key: the journal holds code a new kernel executes. :meth:`Journal.load` refuses
anything that is not a journal this package wrote with :class:`JournalError` and one line saying
what to do, never a raw ``KeyError``.

The signature covers the run id and a generation that every write increases; the installation
remembers the newest generation it wrote for each run folder (a few bytes under
``$COLAB_RESILIENCE_HOME/journals``). With the key, a journal whose run id is not its folder's
(moved from another run), or whose generation is older than that (an old copy put back), is
refused with :class:`JournalRolledBackError`: nothing in it runs.

The run directory's lock is :class:`colab_resilience.lock.RunLock`:

    with RunLock(run_dir, create=True):
        j = Journal.load(run_dir) if Journal.exists(run_dir) else Journal.create(run_dir)
        j.record_restart("CUDA out of memory")
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from . import fsutil
from .journal_format import FORMAT, FORMAT_VERSION, SCALARS, STATUSES, bad, upgrade, validate
from .errors import (
    JournalError, JournalNotFoundError, JournalRolledBackError, JournalUntrustedError, UnsafeDirectoryError,
)

JOURNAL_NAME = "journal.json"
_MAX_JOURNAL_BYTES = 64 << 20


@dataclass(frozen=True)
class RestartPolicy:
    """``%restart_after``: a planned restart every ``every`` safe points, or when memory in use
    reaches ``memory_percent``."""

    every: int | None = None
    memory_percent: float | None = None

    def describe(self) -> str:
        parts = []
        if self.every:
            parts.append(f"every {self.every} safe points")
        if self.memory_percent is not None:
            parts.append(f"when memory in use reaches {self.memory_percent:g}%")
        return " or ".join(parts) or "off"


@dataclass
class RestartRecord:
    """One restart of a run: why, when, and whether it was planned or refused (budget spent)."""

    reason: str
    time: float = field(default_factory=time.time)
    planned: bool = False
    refused: bool = False
    at: str | None = None  # repr of the iteration in progress


@dataclass
class ReplayCell:
    """A set-up cell: ``key`` identifies it (the front end's cell id, else its source), ``source``
    is the whole cell, ``%%replay`` line included: what a new kernel executes again."""

    key: str
    source: str




@dataclass
class Journal:
    """One run's journal. Change attributes, then :meth:`save`; the helpers below save for you."""

    run_dir: Path
    run_id: str
    status: str = "pending"
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    restarts: list[RestartRecord] = field(default_factory=list)
    last_checkpoint: str | None = None
    replay_cells: list[ReplayCell] = field(default_factory=list)
    interrupted_cell: str | None = None
    cell_key: str | None = None
    names: list[str] = field(default_factory=list)  # what --save checkpoints
    shrink: dict[str, int] = field(default_factory=dict)  # --shrink values a new kernel starts from
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    max_restarts: int = 3
    restarts_used: int = 0
    kernel_pid: int | None = None
    restart_requested: bool = False  # the last kernel left on purpose (not a death to count)
    phase: str | None = None  # "replay" while a new kernel replays the set-up cells
    resume_at: str | None = None  # where the last checkpoint resumes (iteration values, for people)
    oom_kills: int | None = None  # the OS's count of OOM kills when a live kernel last wrote this
    counted_pid: int | None = None  # the kernel whose end is accounted for (counted, or planned)
    generation: int = 0  # how many times the journal of this run folder was written
    # what a framework's callback saved with a finished run (its label: "the Trainer's model, ..."):
    # only running the cell again puts it back (the framework loads it into the rebuilt objects)
    framework: str | None = None
    # a resume_range loop ran in code the cell calls (def train(): for epoch in resume_range(...)):
    # the cell's safe points are that loop's, though its own code holds none
    loops: bool = False
    notebook: str | None = None  # the notebook whose cell the run is, where the kernel knew it (session.notebook)
    # the one line that stopped the run's last execution, with what to do: a refusal of this
    # package before its first safe point (a pending run: what %resilience status says in place of
    # "run its cell again to continue", which would only stop it again), or the error that failed it
    stopped: str | None = None
    # what the names the set-up cells bind and the cell reads (not in --save) held when the run
    # began, as fingerprints: a kernel that resumes it after a replay compares (setup_state)
    setup: dict[str, str] = field(default_factory=dict)
    # of those, the ones a cell that is not replayed had changed since the set-up cells ran (said as
    # the run began): a replay does not make them so, and a resume into what it makes is refused
    setup_changed: list[str] = field(default_factory=list)
    # the notebook's own module files imported as the run began (and by each checkpoint), by their
    # real paths, and the SHA-256 of each: a kernel that resumes it says which changed on disk since
    # (module_files)
    modules: dict[str, str] = field(default_factory=dict)
    # the environment variables that change what training computes that a cell had set as the run
    # began, and the digest of each value (None: removed): one that resumes it compares (environment)
    environment: dict[str, str | None] = field(default_factory=dict)
    # as the run began: its random states (checkpoints.rng.to_json), which a kernel that resumes it
    # sets before the cell runs again (its code above the first loop draws what it drew then), and
    # the fingerprints of its --save values, which one that resumes it before its first checkpoint
    # compares (setup_state.fingerprint, saved=True)
    start_rng: dict[str, Any] | None = None
    start_saved: dict[str, str] = field(default_factory=dict)
    start_from_setup: list[str] = field(default_factory=list)  # of those, the ones as the set-up cells made them
    # the kernels that held the run, oldest first, each by :func:`kernel_identity` (a PID alone is
    # reused: a fresh Colab VM's kernel often has the PID an earlier VM's had): the runs that had
    # finished in the kernels a pending run held are what a kernel that resumes it puts back
    kernels: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / JOURNAL_NAME

    @property
    def restarts_left(self) -> int:
        return max(0, self.max_restarts - self.restarts_used)

    @classmethod
    def exists(cls, run_dir: str | os.PathLike) -> bool:
        return (Path(run_dir) / JOURNAL_NAME).is_file()

    @classmethod
    def create(
        cls, run_dir: str | os.PathLike, run_id: str | None = None, *, save: bool = True, **values: Any
    ) -> Journal:
        """A new pending journal for a run (written at once unless ``save=False``)."""
        fsutil.make_private_dir(run_dir)
        values.setdefault("kernel_pid", os.getpid())
        values.setdefault("kernels", [kernel_identity()])
        journal = cls(run_dir=Path(run_dir), run_id=run_id or new_run_id(), **values)
        validate(journal.to_dict(), journal.path)
        if save:
            journal.save()
        return journal

    @classmethod
    def load(cls, run_dir: str | os.PathLike, *, key: bytes | None = None, trust: bool = False) -> Journal:
        """Read and check the run's journal; :class:`JournalError` if it is not one of ours.

        With ``key``, the journal must carry this installation's signature (it holds the replay
        cells a new kernel executes): an unsigned, edited or foreign journal is refused with
        :class:`JournalUntrustedError`, unless ``trust`` (the user vouched for it).
        """
        path = Path(run_dir) / JOURNAL_NAME
        try:
            with os.fdopen(fsutil.open_private_file(path), "rb") as f:
                raw = fsutil.read_limited(f, _MAX_JOURNAL_BYTES)
        except FileNotFoundError:
            raise JournalNotFoundError(
                f"colab_resilience: no run journal in {run_dir}; nothing to resume"
            ) from None
        except UnsafeDirectoryError as e:  # a link, or someone else's file
            raise JournalError(str(e)) from None
        except OSError as e:
            raise JournalError(
                f"colab_resilience: cannot read the run journal {path} ({e.strerror or e})"
            ) from None
        if len(raw) > _MAX_JOURNAL_BYTES:
            bad(path, "larger than any journal this package writes")
        try:
            data = fsutil.strict_json(raw)
        except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, NaN/Infinity, huge ints
            bad(path, f"not valid JSON: {e}")
        except RecursionError:
            bad(path, "not valid JSON: nested too deep")
        validate(data, path)
        if key is not None and not trust and not _signed(key, data):
            from .signing import key_path

            run_id = data["run_id"]
            cells = [c["source"] for c in data["replay_cells"]]
            firsts = "; ".join(filter(None, (first_line(c) for c in cells)))
            raise JournalUntrustedError(
                f"colab_resilience: {path} is not signed by this installation's key ({key_path()}), "
                f"or was edited since, so its {len(cells)} set-up cell{'s' if len(cells) != 1 else ''} "
                + (f"(beginning: {firsts}) " if firsts else "")
                + f"did not run; review them with `%resilience show {run_id}`; if you wrote them (another "
                f"machine, a new Colab VM, a lost key), `%resilience resume --trust {run_id}` runs them, "
                f"else `%resilience reset {run_id}` starts the run afresh"
            )
        data = upgrade(data)
        if key is not None:
            _check_bound(Path(run_dir), path, data, rollback=not trust)
        return cls._from_dict(Path(run_dir), data)

    @classmethod
    def _from_dict(cls, run_dir: Path, data: dict[str, Any]) -> Journal:
        values = {k: data[k] for k in SCALARS}
        values["created"], values["updated"] = float(values["created"]), float(values["updated"])
        return cls(
            run_dir=run_dir,
            restarts=[RestartRecord(**{k: r[k] for k in _RESTART_KEYS if k in r}) for r in data["restarts"]],
            replay_cells=[ReplayCell(c["key"], c["source"]) for c in data["replay_cells"]],
            names=list(data["names"]),
            shrink=dict(data["shrink"]),
            setup=dict(data.get("setup") or {}),
            setup_changed=list(data.get("setup_changed") or []),
            modules=dict(data.get("modules") or {}),
            environment=dict(data.get("environment") or {}),
            start_rng=data.get("start_rng"),
            start_saved=dict(data.get("start_saved") or {}),
            start_from_setup=list(data.get("start_from_setup") or []),
            kernels=list(data.get("kernels") or []),
            policy=RestartPolicy(data["policy"]["every"], data["policy"]["memory_percent"]),
            **values,
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION}
        for f in fields(self):
            if f.name != "run_dir":
                value = getattr(self, f.name)
                data[f.name] = asdict(value) if f.name == "policy" else value
        data["restarts"] = [asdict(r) for r in self.restarts]
        data["replay_cells"] = [asdict(c) for c in self.replay_cells]
        return data

    def save(self) -> None:
        """Write the journal atomically and signed; ``updated`` becomes now."""
        from .signing import load_or_create_key, sign

        self.updated = time.time()
        fsutil.make_private_dir(self.run_dir)
        self.generation = max(self.generation, newest_generation(self.run_dir)) + 1
        data = self.to_dict()
        validate(data, self.path)
        data["signature"] = sign(load_or_create_key(), fsutil.canonical_json(data))
        fsutil.atomic_write(self.path, (json.dumps(data, indent=1, allow_nan=False) + "\n").encode())
        _remember_generation(self.run_dir, self.generation)  # after the journal: never ahead of it

    # helpers the glue calls at each event; each one saves.

    def record_restart(self, reason: str, **details: Any) -> int:
        """Count one restart with its reason (one line) and return the restarts left."""
        self.restarts.append(RestartRecord(str(reason).splitlines()[0] if reason else "", **details))
        self.restarts_used += 1
        self.status = "pending"
        self.save()
        return self.restarts_left

    def held_here(self) -> None:
        """This kernel holds the run from now on."""
        self.kernel_pid = os.getpid()
        self.stopped = None
        if self.kernels[-1:] != [kernel_identity()]:
            self.kernels.append(kernel_identity())

    @property
    def held_before(self) -> list[str]:
        """The kernels that held the run before this one."""
        return [k for k in self.kernels if k != kernel_identity()]

    def set_status(self, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        self.status = status
        self.save()

    def set_checkpoint(self, checkpoint_id: str | None) -> None:
        self.last_checkpoint = checkpoint_id
        self.save()

    def add_replay_cell(self, key: str, source: str) -> None:
        """Remember a replay cell; a cell run again (same key) keeps its place, new source."""
        merge_replay_cells(self.replay_cells, [ReplayCell(key, source)])
        self.save()


def merge_replay_cells(cells: list[ReplayCell], new: list[ReplayCell]) -> None:
    """Add ``new`` to ``cells`` in order; a cell already there (same key) keeps its place and
    takes the new source."""
    index = {c.key: c for c in cells}
    for cell in new:
        if cell.key in index:
            index[cell.key].source = cell.source
        else:
            index[cell.key] = ReplayCell(cell.key, cell.source)
            cells.append(index[cell.key])


_identity: tuple[int, str] | None = None


def kernel_identity() -> str:
    """This process, as no other process has it: its PID and a random token drawn once in it."""
    global _identity
    if _identity is None or _identity[0] != os.getpid():  # a forked process draws its own
        _identity = (os.getpid(), f"{os.getpid()}-{secrets.token_hex(8)}")
    return _identity[1]


def new_run_id() -> str:
    """A sortable, unique run id like ``20250101-120000-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


_RESTART_KEYS = tuple(f.name for f in fields(RestartRecord))


def _signed(key: bytes, data: dict) -> bool:
    from .signing import verify

    body = {k: v for k, v in data.items() if k != "signature"}
    try:
        return verify(key, fsutil.canonical_json(body), data.get("signature"))
    except (ValueError, RecursionError):  # 1e400 parses as inf, which no signed journal holds
        return False


def first_line(source: str) -> str:
    """The first line of a set-up cell that says something: not blank, not its ``%%replay``."""
    for line in source.splitlines():
        line = line.strip()
        if line and not line.startswith("%%replay"):
            return repr(line[:50] + ("..." if len(line) > 50 else ""))
    return ""


# -- binding a journal to its folder -----------------------------------------------------------------


def _generation_record(run_dir: Path) -> Path:
    from .signing import home

    where = os.path.realpath(run_dir).encode("utf-8", "surrogateescape")
    return home() / "journals" / hashlib.sha256(where).hexdigest()[:32]


def newest_generation(run_dir: str | os.PathLike) -> int:
    """The newest journal generation this installation wrote for ``run_dir`` (0: none)."""
    try:
        with os.fdopen(fsutil.open_private_file(_generation_record(Path(run_dir))), "rb") as f:
            text = f.read(32)
        return int(text.decode("ascii"))
    except (OSError, ValueError):
        return 0


def _remember_generation(run_dir: Path, generation: int) -> None:
    # not fsynced: after a power cut the record can only be older than the journal, which the
    # check accepts; what it must never be is newer, hence written after the journal
    record = _generation_record(run_dir)
    fsutil.make_private_dir(record.parent)
    fsutil.atomic_write(record, str(generation).encode(), durable=False)


def _check_bound(run_dir: Path, path: Path, data: dict[str, Any], *, rollback: bool) -> None:
    if run_dir.name != f"run-{data['run_id']}":
        raise JournalRolledBackError(
            f"colab_resilience: {path} is the journal of run {data['run_id']!r}, not of {run_dir.name} "
            "(moved or copied from another run), so nothing in it runs; remove it, or "
            f"`%resilience reset {run_dir.name.removeprefix('run-')}` to start this run afresh"
        )
    newest = newest_generation(run_dir) if rollback else 0
    if data["generation"] < newest:
        raise JournalRolledBackError(
            f"colab_resilience: {path} is generation {data['generation']} of its run, older than "
            f"generation {newest} this installation wrote (an old copy put back), so nothing in it "
            f"runs; `%resilience reset {data['run_id']}` starts the run afresh"
        )


# -- the runs under a root ---------------------------------------------------------------------------


def find_runs(root: str | os.PathLike) -> list[Path]:
    """The run folders under ``root`` that have a journal, the most recently written first."""
    found = []
    try:
        for path in Path(root).glob(f"run-*/{JOURNAL_NAME}"):
            try:
                found.append((path.stat().st_mtime, path.parent))
            except OSError:
                continue
    except OSError:
        return []
    return [p for _, p in sorted(found, key=lambda t: t[0], reverse=True)]


def read_journals(root: str | os.PathLike, key: bytes | None = None) -> Iterator[Journal]:
    """Every readable journal under ``root`` (unusable ones are left out), newest first."""
    for run_dir in find_runs(root):
        try:
            yield Journal.load(run_dir, key=key)
        except (JournalError, JournalNotFoundError, OSError):
            continue


def signed_elsewhere(run_dir: str | os.PathLike, key: bytes) -> bool:
    """Whether the journal in ``run_dir`` is well formed but not signed by ``key``: written under
    another installation key (another machine, a new Colab VM, a lost key). False where it is
    signed here, missing or unusable."""
    try:
        Journal.load(run_dir, key=key)
    except JournalUntrustedError:
        return True
    except (JournalError, JournalNotFoundError, OSError):
        pass
    return False


def pending_runs(root: str | os.PathLike) -> list[Path]:
    return [j.run_dir for j in read_journals(root) if j.status == "pending"]


def requested_restart(root: str | os.PathLike) -> RestartRecord | None:
    """The restart the newest pending run asked for when its kernel left, if it asked."""
    pending = [j for j in read_journals(root) if j.status == "pending" and j.restarts]
    if not pending:
        return None
    newest = max(pending, key=lambda j: j.updated)
    return newest.restarts[-1] if newest.restart_requested else None


def budget_refused(root: str | os.PathLike) -> bool:
    """Whether a run under ``root`` failed because its restart budget was spent."""
    return any(j.status == "failed" and j.restarts and j.restarts[-1].refused for j in read_journals(root))
