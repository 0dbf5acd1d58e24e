"""A run: one logical execution of a ``%%resilient`` cell, surviving retries and restarts, and its
safe points (:func:`resume_range`, :func:`checkpoint`).

A run lives in ``ROOT/run-<id>/`` (``journal.json``, ``lock``, ``checkpoints/``); its id comes from
the cell's identity, so the same cell executed in a new kernel finds its run again. The journal
says whether the run is *pending* (it ended abnormally: an OOM past the retries, a restart we
asked for, a kernel that died) and so resumes on the next execution, or ended *done* or *failed*.

Opening a run (:meth:`Run.open`) takes the lock and reads or creates the journal; it runs no user
code. The caller replays the set-up cells if a kernel restart came between (:attr:`Run.needs_replay`),
then calls :meth:`Run.start`. Safe points are where the declared state (``--save``) is
consistent: the start of the first loop (or of the cell, when it has no ``resume_range``), the end
of every ``resume_range`` iteration (:mod:`colab_resilience.loops` says where a resumed attempt
goes on), the successful end of the cell. Every save records, beside the values, what a step
carries that they do not hold (:mod:`colab_resilience.carried`), and a value that cannot be saved
stops the cell at the first safe point that meets it: nothing is ever skipped later on the
strength of state that was not saved.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections import ChainMap
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Iterator, Mapping, MutableMapping

from . import carried, environment, faults, fsutil, loops, memory, module_files, restart, words
from .checkpoints import Checkpoint, CheckpointStore, capture_rng, restore_rng
from .checkpoints.rng import generator_state, is_generator, set_generator_state
from .checkpoints.staging import Budget
from .errors import BuiltSinceError, CheckpointError, JournalError, NoCheckpointError, RetryNotExactError, RunStoppedError
from .journal import Journal, ReplayCell, RestartPolicy, first_line, merge_replay_cells
from .lock import RunLock
from .loops import LOOP_RNG, Loops, Plan, position_of
from .recovery import put_back_shrunk, shrink_value
from .saving import Saver

if TYPE_CHECKING:
    from .replay import ReplayLog


def setup_cells_rebinding(shell, new: Iterable[ReplayCell],
                          began: Iterable[ReplayCell]) -> list[tuple[ReplayCell, list[tuple[str, str]]]]:
    """Each of the set-up cells ``new`` (run in this kernel, not among those a run ``began``
    with) that binds a name those bound, by another statement than the last of them that bound
    it (``seed = 1`` after the run's ``seed = 0``; not ``import torch`` again, not a pasted
    copy), with those statements, its and theirs, each in one line of 60 characters at most."""
    from .setup_state import all_bound, binding_statement

    last: dict[str, str] = {}  # name -> the source of the last cell the run began with that bound it
    for cell in began:
        last.update(dict.fromkeys(all_bound(shell, cell.source), cell.source))
    def statement(source: str, name: str) -> str:
        code = " ".join((binding_statement(shell, source, name) or "").split())
        return code if len(code) <= 60 else code[:57] + "..."

    found = []
    for cell in new:
        pairs = [(statement(cell.source, n), statement(last[n], n)) for n in sorted(all_bound(shell, cell.source) & last.keys())]
        rebound = list(dict.fromkeys(p for p in pairs if p[0] != p[1]))  # (a, b = 1, 2 binds two names)
        if rebound:
            found.append((cell, rebound))
    return found


def run_id_for(cell_key: str, key: bytes | None = None, notebook: str | None = None) -> str:
    """The run id of the cell ``cell_key`` of ``notebook`` (:func:`.session.notebook`; None where
    the kernel does not know it): the same in every kernel of this installation, and not to be
    guessed by another user (an HMAC under the installation key, not a plain hash), so nobody can
    prepare a cell's run folder before it exists. A copy of a notebook has its cells' ids, and
    without a cell id a cell is known by its code: the notebook keeps the copy's runs its own."""
    from .signing import load_or_create_key, sign

    data = b"run-id:" + cell_key.encode()
    if notebook:
        data += b"\0notebook:" + notebook.encode("utf-8", "surrogateescape")
    return sign(key or load_or_create_key(), data)[:8]


def open_store(run_dir: Path, key: bytes, *, keep_first: bool = False) -> CheckpointStore:
    """The checkpoints of the run in ``run_dir``: its folders are checked (real folders of this
    user's, nobody else can write) before anything is read, cleared or written there."""
    store = CheckpointStore(run_dir / "checkpoints", key=key, keep_first=keep_first,
                            run_id=run_dir.name.removeprefix("run-"))
    fsutil.make_private_dir(store.run_dir)
    fsutil.make_private_dir(store.blob_dir)
    return store


def _elsewhere(e: BuiltSinceError) -> RetryNotExactError:
    """What a retry in this kernel cannot undo (a model the failed attempt built for the first time,
    Keras's seed generator it made): the run goes on in a restarted kernel, whose replay makes them
    afresh."""
    return RetryNotExactError(
        f"{str(e).splitlines()[0]}; a restarted kernel's set-up cells make it afresh, and the run goes on there",
        "what the failed attempt made cannot be unmade in this kernel")


def restore_latest(store: CheckpointStore, namespace: MutableMapping, names: Iterable[str],
                   *, trust: bool = False, rng: bool = True, oldest: bool = False,
                   strict: bool = False, in_place: Iterable[str] = ()) -> tuple[Checkpoint, list[str]]:
    """Restore ``names`` from the newest loadable checkpoint of ``store`` into ``namespace``
    (in place where they were saved by ``state_dict``; with ``rng``, the random-number states
    too; with ``oldest``, from the run's first checkpoint). Returns the checkpoint and the names
    restored; :class:`NoCheckpointError` when there is none. A name that cannot be restored is
    a warning, or with ``strict`` a :class:`CheckpointError`. The names in ``in_place`` keep their
    objects where those can take the saved contents (:meth:`Checkpoint.restore`). With them goes
    what a step carries (:mod:`colab_resilience.carried`: modules' modes, flags and plain
    attributes, loaders' counts of epochs)."""
    ckpt = store.load(trust=trust, oldest=oldest)
    wanted = set(names)
    restored = ckpt.restore(namespace, [n for n in ckpt.names if n in wanted], rng=rng, strict=strict,
                            in_place=set(in_place))
    carried.apply(namespace, restored, _meta(ckpt).get("carried", {}))
    carried.put_loader_epochs(namespace, _meta(ckpt).get("loaders"))
    return ckpt, restored


def _same_build(now: object, then: object) -> bool:
    """Whether ``now`` can take the state ``then`` had: the same kind, and for a torch module the
    same tensors by name and shape (a model the loop rebuilt bigger cannot), for an optimizer
    parameters of the same shapes in its groups."""
    if type(now) is not type(then):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(now, torch.nn.Module):
        try:
            shapes = [{k: tuple(v.shape) for k, v in m.state_dict().items()} for m in (now, then)]
        except Exception:
            return True
        return shapes[0] == shapes[1]
    if torch is not None and isinstance(now, torch.optim.Optimizer):
        return ([[tuple(p.shape) for p in g["params"]] for g in now.param_groups]
                == [[tuple(p.shape) for p in g["params"]] for g in then.param_groups])
    return True


def finished_run(root: Path, run_id: str) -> Journal | None:
    """The journal of run ``run_id`` if it ended ``done``, signed by this installation."""
    from .signing import load_or_create_key

    run_dir = Path(root) / f"run-{run_id}"
    try:
        journal = Journal.load(run_dir, key=load_or_create_key())
    except (JournalError, OSError):
        return None
    return journal if journal.status == "done" else None


LEFT_BUDGET = 1 << 20  # bytes of tagged JSON: the plain values a finished cell leaves, kept with its end


def left_values(shell, body: str, names: list[str]) -> dict:
    """The values a finished cell leaves behind that ``--save`` does not name, where they are plain
    data (numbers, strings, lists and dicts of them: a step counter, a loss history) and small:
    the checkpoint at the end of the cell keeps them, so a cell not run again after a restart
    leaves them as an uninterrupted run would."""
    from .checkpoints.codec import Encoder, json_bytes
    from .errors import NotPlainError
    from .lint import cell_sets

    ns, kept, size = shell.user_ns, {}, 0
    for name in cell_sets(shell, body, definitions=False):
        if name in names or name not in ns:
            continue
        try:
            more = len(json_bytes(Encoder(leaves=False).encode(ns[name])))
        except (NotPlainError, RecursionError, ValueError):
            continue
        if size + more <= LEFT_BUDGET:
            size += more
            kept[name] = ns[name]
    return kept


def whole_modules(ns: Mapping, names: list[str], kept: Collection[str]) -> list[str]:
    """The saved torch modules a restore binds rather than loads a state dict into: those a loop
    binds anew (not ``kept``: ``best = copy.deepcopy(model)``, made in the loop, which no set-up
    cell rebuilds, so that after a restart no object of the name exists to load into), and whose
    parameters no saved optimizer steps (``model = model.to(device)`` in the loop must stay the
    module the optimizer holds)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    stepped = {id(p) for n in names if isinstance(ns.get(n), torch.optim.Optimizer)
               for group in ns[n].param_groups for p in group["params"]}
    return [n for n in names if n not in kept and isinstance(ns.get(n), torch.nn.Module)
            and not any(id(p) in stepped for p in ns[n].parameters())]


AFTER_LOOP_BUDGET = 1 << 20  # bytes of one value a loop sets and the code after it reads, kept unasked


def after_loop_refusal(value) -> str | None:
    """None where ``value`` (set in a loop, read after it) is kept with each checkpoint without
    ``--save``: a number, a string, a small tensor or array (a loss), small plain data; else what
    it is, for the line that says it is not kept."""
    from .checkpoints.codec import Encoder, json_bytes

    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return None
    nbytes = getattr(value, "nbytes", None)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.is_sparse or value.is_nested:  # kept only as plain dense tensors
            return words.a(type(value).__name__)
        nbytes = value.numel() * value.element_size()
    kind = type(value).__module__.split(".")[0]
    if kind in ("torch", "numpy", "jax", "jaxlib") and isinstance(nbytes, int):
        return None if nbytes <= AFTER_LOOP_BUDGET else f"{words.a(type(value).__name__)} of {nbytes / 2**20:.1f} MiB"
    try:
        size = len(json_bytes(Encoder(leaves=False).encode(value)))
    except Exception:  # not plain data (NotPlainError), or what encoding it raised
        return words.a(type(value).__name__)
    return None if size <= AFTER_LOOP_BUDGET else f"{words.a(type(value).__name__)} of {size / 2**20:.1f} MiB"


def put_back_left(ckpt: Checkpoint, namespace: MutableMapping) -> list[str]:
    """Bind again what :func:`left_values` kept with an end-of-cell checkpoint; the names."""
    left = _meta(ckpt).get("left")
    if not isinstance(left, dict):
        return []
    namespace.update(left)
    return list(left)


def unset_note(shell, body: str, names: list[str]) -> str:
    """For a cell that is not run again after a restart: what it sets that nothing brought back."""
    from .lint import cell_sets

    ns = shell.user_ns
    values = [n for n in cell_sets(shell, body, definitions=False) if n not in names and n not in ns]
    defined = [n for n in cell_sets(shell, body) if n not in values and n not in names and n not in ns]
    note = ""
    if values:
        one = len(values) == 1
        note += (f"; {', '.join(values)}, which the cell sets without --save, {'is' if one else 'are'} not back: "
                 f"add {'it' if one else 'them'} to --save")
    if defined:
        one = len(defined) == 1
        note += (f"; {', '.join(defined)}, which the cell imports or defines, {'is' if one else 'are'} not back: "
                 "do that in a %%replay cell")
    return note


def _meta(ckpt: Checkpoint) -> dict:
    return ckpt.meta if isinstance(ckpt.meta, dict) else {}


class Run:
    """One ``%%resilient`` run, opened for one execution of its cell in this kernel."""

    def __init__(self, shell, journal: Journal, store: CheckpointStore, lock: RunLock, *, root: Path,
                 body: str, names: list[str], shrink: list[str], every: tuple[int | None, float | None],
                 policy: RestartPolicy, resuming: bool, after_restart: bool, say: Callable[[str], None],
                 saving: tuple[Budget, str] = (Budget(), "wait")):
        self.shell, self.journal, self.store, self.lock, self.root = shell, journal, store, lock, root
        # the persisting thread records durable checkpoints in the journal: every write of it is
        # made under this lock while a run is open
        self.journal_lock = threading.Lock()
        self.saver = Saver(store, budget=saving[0], when_busy=saving[1], on_durable=self._durable, say=say)
        self.names, self.shrink, self.policy, self.say = names, shrink, policy, say
        self.every_n, self.every_seconds = every
        # the cell's safe points are loop iterations: resume_range, or a framework's epochs
        # through an integration's callback (colab_resilience.integrations)
        self.uses_loop = "resume_range" in body or "ResilienceCallback" in body or journal.loops
        # state that is not a user name and is saved with every checkpoint, restored in place
        # (state_dict/load_state_dict) when the first loop starts: a framework callback's
        # (a Keras fit's model and optimizer variables, its history); registered by the callback
        self.extras: dict[str, object] = {}
        self.body = body
        # the saved names a restore puts into the objects they hold (a history list a logger was
        # given, a weight tensor an optimizer was given): set when the set-up cells are known
        self.kept: list[str] = []
        self.resuming = resuming  # restore the last safe point at the next restore point
        self.began_here = not resuming  # this execution began the run (it was not pending)
        # a pending run whose cell's code changed: the line that says so, once the options are checked
        self.edited: str | None = None
        self.ran: str | None = None  # the code the pending run last ran (its journal's until this execution)
        self.after_restart = after_restart  # this kernel replaced the one that wrote the journal
        self.safe_points = 0
        self.iteration: str | None = None  # the iteration in progress, for people ("2, item 3")
        self.loops = Loops(self)
        self._rng_at_start: dict | None = None  # the random state the cell's first attempt in this kernel began with
        # the small --save values that attempt began with (:meth:`_small_values_at_start`)
        self._small_at_start: dict[str, object] | None = None
        self._saved_at_start: dict[str, str] = {}  # the fingerprints of what it trains, as that attempt began
        # what the first loop start has to say of the code above it (lint.at_loop_start), once
        self.at_loop_start: Callable[[], list[str]] | None = None
        self._saved_point = -1  # the safe point the last successful save was made at
        self._names_at_checkpoint: set[str] | None = None  # the namespace's names then
        # the saved objects that load a state dict, as the names held them then: a retry whose
        # failed attempt rebound one to an object of another kind (opt = SGD(...) in the loop) puts
        # the safe point's object back under its name, to load its saved state into
        self._objects_at_checkpoint: dict[str, object] = {}
        self._said: set = set()  # names already reported as missing
        self._said_graph: set = set()  # names said to hold tensors with their autograd graphs
        self._said_lines: set[str] = set()  # what say_once said
        self._said_retry_unsaved = False  # said that a retry without --save may not be exact
        self._shrunk: dict[str, int] = {}  # --shrink values before the retry that shrank them
        self._last_save = 0.0
        self._replayed, self._replay_seconds = 0, 0.0
        self._resume_note: str | None = None  # said where the run goes on after a restart
        self._later: list[str] = []  # saved names the cell makes below its first loop (Plan.later)
        self._cell_sets: set[str] | None = None
        self.finished_before = False  # resumed at its end-of-cell checkpoint: the cell is not run

    @property
    def run_id(self) -> str:
        return self.journal.run_id

    @property
    def dir(self) -> Path:
        return self.journal.run_dir

    @classmethod
    def open(cls, shell, root: Path, run_id: str, *, cell_key: str, source: str, body: str,
             notebook: str | None = None, names: list[str], shrink: list[str] = (), max_restarts: int = 3,
             every: tuple[int | None, float | None] = (1, None), policy: RestartPolicy | None = None,
             say: Callable[[str], None] = print, saving: tuple[Budget, str] = (Budget(), "wait"),
             reopen: bool = False, setup_log: ReplayLog | None = None) -> Run:
        """Take the run's lock and read its journal (a pending run resumes) or start a new one.
        ``reopen``: a run that ended ``done`` resumes too (its kernel died before the cell
        returned, and the run saves nothing that could stand for its result). Raises
        :class:`RunLockedError` (another kernel holds it) or :class:`RunStoppedError` (an unusable
        journal, a death without warning that the budget does not cover, or a replay of its set-up
        cells that would undo one of the set-up cells this kernel ran, ``setup_log``: then nothing
        is written)."""
        from .signing import load_or_create_key

        root = fsutil.check_run_root(root)
        run_dir = root / f"run-{run_id}"
        lock = RunLock(run_dir, create=True).acquire()
        restart.held(run_dir)
        try:
            key = load_or_create_key()
            # a run that saves no values resumes from its start after a restart: that checkpoint stays
            store = open_store(run_dir, key, keep_first=not names)
            journal = None
            if Journal.exists(run_dir):
                try:
                    journal = Journal.load(run_dir, key=key)
                except JournalError as e:
                    raise RunStoppedError(str(e)) from None
            edited = None
            if journal is not None and (journal.status == "pending" or reopen and journal.status == "done"):
                if journal.kernel_pid != os.getpid() and setup_log is not None:  # a new kernel replays
                    _refuse_undoing(shell, journal, setup_log)
                after_restart = _take_over(shell, journal, root)
                resuming = True
                edited = code_change(journal.interrupted_cell, source)
                ran = journal.interrupted_cell
                policy = policy or journal.policy
            else:
                if journal is not None and journal.status == "failed" and journal.resume_at:
                    # its --save values, and what it trained without them (a Keras model its callback keeps)
                    _refuse_beginning_on_what_it_left(shell, journal, [*names, *journal.start_saved], setup_log)
                    # its checkpoints go now: said where it happens, not only in the line that said
                    # how to go on when it stopped (before a kernel restart, maybe not read)
                    say(f"colab_resilience: run {run_id} of this cell had stopped before its end, with a checkpoint "
                        f"to go on at {journal.resume_at}; it starts again from its beginning now and that checkpoint "
                        f"is dropped (to go on from a stopped run's checkpoint, %resilience resume {run_id} before "
                        "running its cell)")
                store.clear()
                journal = Journal.create(run_dir, run_id, max_restarts=max_restarts, save=False)
                resuming = after_restart = False
                ran = None
                left = _left_behind(root, key, cell_key, notebook) if notebook and not reopen else None
                if left is not None:
                    say(left)
                if not reopen:
                    for line in _under_another_key(root, key, cell_key, notebook, run_id):
                        say(line)
            policy = policy or RestartPolicy()
            journal.cell_key, journal.names, journal.policy = cell_key, list(names), policy
            journal.notebook = notebook or journal.notebook
            journal.held_here()
            journal.interrupted_cell, journal.status = source, "pending"
            journal.oom_kills = memory.oom_kills()
            journal.save()
        except BaseException:
            lock.release()
            raise
        if not restart.supervised():
            # already now, not only before a restart we ask for: a kernel killed without warning
            # (the OOM killer) must come back with the extension loaded too
            restart.install_startup_file(shell, Path(root))
        run = cls(shell, journal, store, lock, root=Path(root), body=body, names=list(names),
                  shrink=list(shrink), every=every, policy=policy, resuming=resuming,
                  after_restart=after_restart, say=say, saving=saving)
        run.ran = ran
        if edited is not None:
            run.edited = (
                f"colab_resilience: the cell's code changed since run {run_id} began ({edited}): it goes on from its "
                "last checkpoint with the code as it is now, so what it did before ran the old code and the result is "
                f"not that of either run uninterrupted; to start over with this code, %resilience reset {run_id} "
                "and run the cell again")
        return run

    # -------------------------------------------------------------------------------- resume

    @property
    def needs_replay(self) -> bool:
        """Whether this kernel must run the journal's set-up cells before the run goes on."""
        return self.after_restart and bool(self.journal.replay_cells)

    def begin_replay(self) -> None:
        """Mark the replay in the journal: a death during it is then told apart from one in the
        training by the next kernel."""
        self.journal.phase = "replay"
        self.journal.save()

    def start(self, setup_cells: list[ReplayCell], *, replayed: int = 0, replay_seconds: float = 0.0,
              setup: dict[str, str] | None = None, setup_saved: dict[str, str] | None = None) -> None:
        """The run goes on in this kernel: the set-up cells it knows are recorded, the shrunk
        values of a resumed run are put back, and the saved names a restore puts into the objects
        they hold are known (:func:`.lint.kept_objects`). ``setup``: what the set-up cells' names
        held when the last of them ran in this kernel (:attr:`.replay.ReplayLog.prints`; ``setup_saved``,
        with models and optimizers: :attr:`.replay.ReplayLog.saved_prints`)."""
        self._replayed, self._replay_seconds = replayed, replay_seconds
        self._setup_edited = False  # a set-up cell edited or added since the run began (said)
        j = self.journal
        j.phase = None
        if self.resuming:
            put_back_shrunk(self.shell.user_ns, j.shrink)
            began = {c.key: c.source for c in j.replay_cells}
            for cell in setup_cells:  # a set-up cell edited and run again since the run began
                edited = code_change(began.get(cell.key), cell.source)
                if edited is not None:
                    self._setup_edited = True
                    self.say(f"colab_resilience: set-up cell {first_line(cell.source)} changed since run "
                             f"{self.run_id} began ({edited}): the run goes on with what it makes now, so what it "
                             "did before ran on the old set-up and the result is not that of either run "
                             f"uninterrupted; to start over, %resilience reset {self.run_id} and run this cell again")
            new = [c for c in setup_cells if c.key not in began]
            for cell, rebound in setup_cells_rebinding(self.shell, new, j.replay_cells):
                self._setup_edited = True
                shown = "; ".join(f"{now!r}, was {then!r}" for now, then in rebound[:3])
                self.say(f"colab_resilience: set-up cell {first_line(cell.source)} is new since run {self.run_id} "
                         f"began and binds again what its set-up cells bound ({shown}"
                         f"{f' and {len(rebound) - 3} more' if len(rebound) > 3 else ''}; a cell added, or other -p "
                         "values): the run goes on with what it makes now, so what it did before ran on the old "
                         "set-up and the result is not that of either run uninterrupted; to start over, "
                         f"%resilience reset {self.run_id} and run this cell again")
        merge_replay_cells(j.replay_cells, setup_cells)
        from . import setup_state

        self._older: list[str] = []  # what the journal's fingerprints of an earlier version leave unchecked
        with setup_state.one_moment():  # what both fingerprint is hashed once
            self._check_setup(setup or {})
            self._start_state(setup_saved or {})
        if self._older:
            self.say(setup_state.older_message(self.run_id, sorted(set(self._older))))
        j.save()
        from .lint import kept_objects, set_in_loops_read_after

        self.kept = kept_objects(self.shell, self.body, self.names, [c.source for c in j.replay_cells])
        # a loss set in the loop and printed after it: kept with each checkpoint where it is small
        self.after_loop = set_in_loops_read_after(self.shell, self.body, self.names)

    def _check_setup(self, after_setup: dict[str, str]) -> None:
        """A run that begins records what the set-up cells made that the cell reads, and says in
        one line what of it changed since they ran (``after_setup``), and the files of the notebook's
        own modules; one that a new kernel resumes after replaying them says what the replay made
        otherwise (:mod:`.setup_state`), which of those files changed on disk (:mod:`.module_files`), and
        which environment variables that change what training computes it has otherwise
        (:mod:`.environment`)."""
        from . import setup_state

        j = self.journal
        if not self.resuming:
            j.modules = module_files.local_modules()
            j.environment = environment.set_since_start()
            sources = [c.source for c in j.replay_cells]
            j.setup = setup_state.fingerprint(self.shell.user_ns, setup_state.watched(
                self.shell, self.body, sources, self.names + self.shrink))
            changed = [n for n, p in j.setup.items() if n in after_setup and after_setup[n] != p]
            j.setup_changed = changed
            if changed:
                self.say(setup_state.changed_message(
                    changed, [n for n in changed if setup_state.is_code(self.shell.user_ns.get(n))]))
        elif self.after_restart:
            edited = module_files.changed(j.modules)  # the notebook's module files, as the run recorded them
            if edited:
                self.say(module_files.message(self.run_id, edited))
            unset = environment.differing(j.environment)  # set by a cell that the replay did not run again
            if unset:
                self.say(environment.message(self.run_id, unset))
            if not j.setup:
                return
            recorded, older = setup_state.older(j.setup)
            self._older += older
            starts = setup_state.loop_starts_only(self.shell, self.body)
            differ = [n for n in setup_state.differing(recorded, self.shell.user_ns) if n not in starts]
            # a change a plain cell made (said as the run began) that the replay did not make again:
            # the resumed run would train on what the %%replay cells make, and end done, otherwise
            lost = [n for n in differ if n in j.setup_changed]
            if lost:
                raise RunStoppedError(setup_state.lost_message(
                    self.run_id, lost, [n for n in lost if setup_state.is_code(self.shell.user_ns.get(n))]))
            # the notebook's code the replay defined otherwise: a %%replay cell edited since the run
            # began, said as such (the run goes on with the new code); not a draw without a seed
            differ = [n for n in differ if not setup_state.is_code(self.shell.user_ns.get(n))]
            if differ and not self._setup_edited:  # (where one was, its line said why, and this would guess)
                self.say(setup_state.message(differ))

    def _start_state(self, after_setup: dict[str, str]) -> None:
        """A run that begins records its random states and what its ``--save`` values hold; a
        kernel that resumes it after a restart sets those random states before the cell runs
        again, so that its code above the first loop (``perm = torch.randperm(n)``, a model built
        there) draws what it drew then, not what the replay left (a cell that is not replayed may
        have drawn since the set-up cells ran). Before the run's first checkpoint, nothing holds its
        ``--save`` values but the set-up cells and the runs finished before it: where they made
        them otherwise than they were as the run began (a plain cell set an optimizer's rate,
        loaded weights), the run stops, pending, with the line that says what to do. Where they were
        as the set-up cells made them (``after_setup``) and the replay made them otherwise (a model
        initialised without a seed), nothing was lost that a re-run gives back: one line says the
        result will differ, and the run goes on."""
        from . import setup_state
        from .checkpoints import rng as rng_json
        from .checkpoints.codec import MALFORMED

        j, ns = self.journal, self.shell.user_ns
        if not self.resuming:
            j.start_rng = rng_json.to_json(self.capture_rng())
            sources = [c.source for c in j.replay_cells]
            kept = setup_state.trained(self.shell, self.body, sources, self.names)
            # (not the --shrink values: the journal has them, as the run has shrunk them since)
            carried = setup_state.carried_in(self.shell, self.body, sources, [*self.names, *kept, *self.shrink])
            j.start_saved = setup_state.fingerprint(ns, [*self.names, *kept, *carried], saved=True)
            j.start_from_setup = sorted(n for n, p in j.start_saved.items() if after_setup.get(n) == p)
            self._saved_at_start = j.start_saved
            return
        if j.last_checkpoint is None and j.start_saved:  # what a retry here compares with
            self._saved_at_start = setup_state.fingerprint(ns, list(j.start_saved), saved=True)
        if not self.after_restart:
            return
        if j.start_rng is not None:
            try:
                self._rng_at_start = rng_json.from_json(j.start_rng)
            except MALFORMED:  # a journal of this installation's: not so; the replay's state stays
                pass
        threads = rng_json.tf_threads_lost(self._rng_at_start or {})
        if threads is not None:
            then, now = (f"{n} thread{'s' if n != 1 else ''}" if n else "TensorFlow's default (one per core)"
                         for n in threads)
            raise RunStoppedError(
                f"colab_resilience: run {self.run_id}: TensorFlow's intra-op thread pool had {then} as the run began "
                f"and has {now} in this kernel, which cannot change it once TensorFlow ran an op: a cell that is not "
                f"replayed set it (tf.config.threading.set_intra_op_parallelism_threads({threads[0]})), and the resumed "
                "run would split its sums otherwise and compute otherwise; set it in a %%replay cell before "
                "TensorFlow's first op, then restart the kernel and run the cells again (the run goes on), or "
                f"`%resilience reset {self.run_id}` to start over")
        if j.last_checkpoint is None and j.start_saved:
            self._compare_start(self._saved_at_start, "the kernel died before the run's first checkpoint held {it}",
                                "make that change in this cell, before its training")
        elif j.start_saved:
            # a model the cell reads and does not --save (a frozen encoder), a value a plain cell
            # set: no checkpoint of the run holds it, ever; the set-up cells and the finished runs
            # must make it as it was (a framework's callback holds the set-up cells' models)
            made = setup_state.setup_names(self.shell, [c.source for c in j.replay_cells]) if j.framework else set()
            unheld = [n for n in j.start_saved if n not in j.names and n not in made]
            self._compare_start(setup_state.fingerprint(ns, unheld, saved=True),
                                "no checkpoint of the run holds {it} (not in --save)",
                                "make that change in a %%replay cell or add {it} to --save")

    def _compare_start(self, now: dict[str, str], unheld: str, advice: str) -> None:
        """After a restart: the run's --save values (or the models it reads, and the values it
        reads before it binds them: :func:`.setup_state.carried_in`) that nothing put back
        (``unheld``: why) but the set-up cells and the finished runs, compared with what they held
        as the run began (``now``: their fingerprints here). One a cell that is not replayed had
        changed stops the run, pending; one the replay made otherwise is said, and the run goes on."""
        from . import setup_state

        j = self.journal
        recorded, older = setup_state.older(j.start_saved)
        self._older += [n for n in older if n in now]
        differ = [n for n in recorded if n in now and now[n] != recorded[n]]
        lost = [n for n in differ if n not in j.start_from_setup]
        if lost:
            names, one = ", ".join(lost), len(lost) == 1
            it = "it" if one else "them"
            raise RunStoppedError(
                f"colab_resilience: run {self.run_id}: {names} {'is' if one else 'are'} not what the run began "
                f"with, and {unheld.format(it=it)}: a cell that is not replayed changed {it} (a plain cell, an "
                f"earlier training cell); " + restart.run_again("the cells above this one again", advice.format(it=it)))
        if differ:
            them = "it" if len(differ) == 1 else "them"
            self.say(f"colab_resilience: run {self.run_id}: the replayed set-up cells made {', '.join(differ)} "
                     f"otherwise than the kernel that began this run had them (drawn without a seed), and "
                     f"{unheld.format(it=them)}: the resumed run will not end as the uninterrupted one; seed the "
                     "%%replay cells (torch.manual_seed(0), keras.utils.set_random_seed(0))")

    def _restore(self, where: str) -> tuple[Checkpoint, list[str]] | None:
        """Restore the last safe point's declared names (not yet its random state) and what a
        step carries (:mod:`colab_resilience.carried`); None when there is no checkpoint."""
        start = time.perf_counter()
        ns = self.shell.user_ns
        # after a restart, a run that saves no values has nothing of its progress back: it goes
        # back to its start (the random state of then), never on from a later safe point
        from_start = self.after_restart and not self.names and not self.extras
        if not self.after_restart:
            for n, obj in self._objects_at_checkpoint.items():
                if n in ns and ns[n] is not obj and not _same_build(ns[n], obj):
                    ns[n] = obj
        try:
            ckpt = self.store.load(oldest=from_start)
            # an optimizer's groups added in the loop (opt.add_param_group) since, or not yet
            carried.regroup(_meta(ckpt).get("joins"), ns, [n for n in self.names if n in ns])
            self._same_joins(ckpt)
            # an object the cell makes below its first loop, not there yet (opt2 = Adam(...) between
            # two loops), that the saved state goes into, waits for the plan to arrive; a plain
            # value (a best_lr the first loop found) is bound now, for the code before that
            later = [n for n in self.names if n not in ns and n in self._made_by_cell()
                     and ckpt.kinds.get(n) in ("state_dict", "pytree")] if where != "the cell" else []
            restored = ckpt.restore(ns, [n for n in ckpt.names if (n in self.names or n in self.after_loop)
                                         and n not in later], rng=False, strict=True, in_place=self.kept)
        except NoCheckpointError:
            self.say(f"colab_resilience: run {self.run_id}: no checkpoint yet, {where} starts from the beginning")
            self.resuming = False
            return None
        except CheckpointError as e:
            if isinstance(e, BuiltSinceError) and not self.after_restart:
                raise _elsewhere(e) from None
            # the run would go on past work whose state did not come back (an optimizer the set-up
            # cells now build with other parameter groups): it stops instead
            raise RunStoppedError(
                f"colab_resilience: run {self.run_id}: {str(e).splitlines()[0].removeprefix('colab_resilience: ')}; "
                "what was finished cannot be skipped without it: build it as it was saved, or run "
                "`%resilience reset` to start the run afresh") from None
        self._restore_extras(ckpt)
        carried.apply(ns, restored, _meta(ckpt).get("carried", {}))
        carried.put_loader_epochs(ns, _meta(ckpt).get("loaders"))
        self._later = [n for n in later if n in ckpt.names]
        shown = [n for n in ckpt.names if n in restored or n in self._later]  # those too, once the cell made them
        self.resuming = False
        if self._names_at_checkpoint is None:
            # a kernel that resumed has taken no checkpoint of its own yet: the names bound now are
            # those of the safe point a retry goes back to, so that a failed attempt's batch is
            # unbound before the retry here too (else it holds its memory, and the retry, with
            # less room than in the kernel before, shrinks further)
            self._names_at_checkpoint = set(ns)
        if self.after_restart:
            self.after_restart = False
            j = self.journal
            replayed, seconds = self._replayed, time.perf_counter() - start + self._replay_seconds
            why = ""
            last = j.restarts[-1] if j.restarts else None
            shut_down = last is not None and last.reason == restart.SHUT_DOWN
            # supervised, the driver's marker above says why, but of no kernel it ended itself (the
            # run left pending by an earlier command, or an earlier kernel the user shut down)
            if not restart.supervised() or shut_down:
                budget = ("not counted" if shut_down else
                          "planned" if last is not None and last.planned else f"restart {j.restarts_used}/{j.max_restarts}")
                why = f" after kernel restart ({last.reason if last else 'a restart'}; {budget})"
            self._resume_note = (
                f"colab_resilience: resumed run {self.run_id}{why}: "
                + (f"replayed {replayed} cell{'s' if replayed != 1 else ''}, " if replayed else "")
                + (f"restored {', '.join(shown + [getattr(x, 'label', n) for n, x in self.extras.items()])} "
                   f"in {seconds:.1f} s" if not from_start else
                   "nothing to restore (no --save), so the cell starts again from its beginning")
            )
        return ckpt, restored

    def _same_joins(self, ckpt: Checkpoint) -> None:
        """RunStoppedError where an optimizer steps other tensors than at the checkpoint's safe point,
        or a scheduler drives another optimizer (:func:`.carried.joins`): the run would go on
        training otherwise than it did, to another result. Nothing is restored then."""
        ns = self.shell.user_ns
        changed = carried.joins_changed(_meta(ckpt).get("joins"), carried.joins(ns, [n for n in self.names if n in ns]))
        if changed:
            raise RunStoppedError(
                f"colab_resilience: run {self.run_id}: {changed}, so the run cannot go on as it was; to start it "
                f"afresh with them as they are now: `%resilience reset {self.run_id}`, then run this cell")

    def _restore_extras(self, ckpt: Checkpoint) -> None:
        """Load the registered extras in place from ``ckpt``. One saved by an earlier safe point
        of this run but missing here stops the run: the loop would skip work on state not saved."""
        if not self.extras:
            return
        missing = [n for n in self.extras if n not in ckpt.names]
        if missing and position_of(_meta(ckpt)) != [(0, 0)]:
            raise RunStoppedError(
                f"colab_resilience: run {self.run_id}: checkpoint {ckpt.checkpoint_id} holds no {', '.join(missing)} "
                "(the cell trained without the callback when it was saved), so what was finished cannot be "
                "skipped; run `%resilience reset` to start the run afresh"
            )
        try:
            ckpt.restore(ChainMap(self.extras, {}), [n for n in self.extras if n in ckpt.names], rng=False)
        except CheckpointError as e:  # a model built otherwise: nothing of it was changed
            raise RunStoppedError(f"colab_resilience: run {self.run_id}: {str(e).removeprefix('colab_resilience: ')}") \
                from None

    def restore_for_loops(self) -> Plan | None:
        """When the first loop of a resumed attempt starts: restore, and say where to go on."""
        got = self._restore("the training" if self.extras else "the loop")  # a framework's: fit, train()
        if got is None:
            return None
        ckpt, restored = got
        position = position_of(_meta(ckpt))
        rngs: list = []
        if len(position) > 1:
            holder: dict = {}
            ckpt.restore(holder, [LOOP_RNG], rng=False)
            rngs = holder[LOOP_RNG]
        ns = self.shell.user_ns
        if _meta(ckpt).get("end"):  # saved at the cell's end: every loop is skipped, and what they left is back
            put_back_left(ckpt, ns)
        ranges = _meta(ckpt).get("ranges")
        ranges = ranges if isinstance(ranges, list) and len(ranges) == len(position) and all(
            r is None or (isinstance(r, list) and len(r) == 3 and all(type(x) is int for x in r)) for r in ranges
        ) else None  # a checkpoint of an older release has none
        return Plan(position, rngs, ckpt, {n: ns[n] for n in restored if n in ns}, later=self._later, spans=ranges)

    def _made_by_cell(self) -> set[str]:
        """The names the cell's own code sets (:func:`.lint.cell_sets`), read once."""
        if self._cell_sets is None:
            from .lint import cell_sets

            self._cell_sets = set(cell_sets(self.shell, self.body, definitions=False))
        return self._cell_sets

    def restore_later(self, plan: Plan) -> None:
        """Restore the plan's names the cell made below its first loop (:attr:`Plan.later`), now
        that the code above the plan's loop (or the whole cell) has made them; one that is still
        not there, or cannot take its saved state, stops the run."""
        names, plan.later = plan.later, []
        if not names:
            return
        try:
            plan.checkpoint.restore(self.shell.user_ns, names, rng=False, strict=True, in_place=self.kept)
        except CheckpointError as e:
            raise RunStoppedError(
                f"colab_resilience: run {self.run_id}: {str(e).splitlines()[0].removeprefix('colab_resilience: ')}; "
                "what was finished cannot be skipped without it: build it as it was saved, or run "
                "`%resilience reset` to start the run afresh") from None
        carried.apply(self.shell.user_ns, names, _meta(plan.checkpoint).get("carried", {}))

    def arrive(self, plan: Plan, at_text: str) -> None:
        """At the loop the saved position ends in: the names the code above it rebound get their
        saved values again, and those it made (:meth:`restore_later`); the objects it may have
        changed in place (lists, dicts, sets, tensors, arrays, generators:
        :func:`.checkpoints.restore.into`; modules, optimizers, metrics: their saved state loaded
        again) their saved contents; the carried state and the random state become the safe point's."""
        ns, ckpt = self.shell.user_ns, plan.checkpoint
        rebound = [n for n, value in plan.restored.items() if ns.get(n) is not value]
        if rebound:
            ckpt.restore(ns, rebound, rng=False, strict=False)
        self.restore_later(plan)
        if len(plan.position) > 1:
            # the code above the inner loop ran with the restored values and may have changed them
            # in place (a log appended to, a generator drawn from, a metric reset, a scheduler
            # stepped): the safe point's again, in the same objects
            kept = [n for n in plan.restored if n not in rebound]
            objects = [n for n in kept if ckpt.kinds.get(n) in ("state_dict", "pytree")]
            if objects:
                ckpt.restore(ns, objects, rng=False, strict=False)
            ckpt.put_back_in_place(ns, [n for n in kept if n not in objects])
        carried.apply(ns, list(plan.restored), _meta(ckpt).get("carried", {}))
        carried.put_loader_epochs(ns, _meta(ckpt).get("loaders"))  # the code above may have iterated one
        try:
            ckpt.restore(ns, [], rng=True)
        except BuiltSinceError as e:  # Keras's seed generator, made by the failed attempt
            raise _elsewhere(e) from None
        note = self._take_note()
        finished = at_text == "the end"
        if at_text.endswith(", the end"):  # an outer iteration whose inner loop had finished
            at_text = f"{at_text[:-len(', the end')]}, its inner loop done"
        shrunk, self._shrunk = self._shrunk, {}
        if note:
            self.say(f"{note}; " + ("the loop had finished" if finished else f"continuing at {at_text}"))
        elif plan.position != [(0, 0)]:
            mixed = ""
            if shrunk:  # what ran before the safe point ran with the old values: say it, it is the result
                mixed = " with " + ", ".join(f"{n} {shrink_value(ns, n)}" for n in shrunk) + " (what ran before it ran with " \
                    + ", ".join(f"{n} {old}" for n, old in shrunk.items()) + ")"
            self.say(f"colab_resilience: rolled back to the last safe point; continuing at {at_text}{mixed}")

    def say_once(self, line: str) -> None:
        """Say ``line`` unless this run has said it in this kernel (a retried attempt does not repeat it)."""
        if line not in self._said_lines:
            self._said_lines.add(line)
            self.say(line)

    def _take_note(self) -> str | None:
        note, self._resume_note = self._resume_note, None
        return note

    # ----------------------------------------------------------------------- safe points

    def attempt_start(self) -> bool:
        """Before each attempt of the cell: without a loop, the cell start is the restore point.
        False when the cell is not to run: its last checkpoint was taken at its end (the kernel
        died after the final save, before the run could say it was done), and running it again
        would train on top of its own result."""
        self.loops.reset()
        # a retry in this kernel runs the cell's code from its first line, as the first attempt
        # did, so it starts from the random state that attempt began with: the code above the
        # first loop (perm = torch.randperm(n)) and a shuffling loader's iter() draw what they drew
        # then (they drew on from where the failed attempt had left the state)
        if self._rng_at_start is None:
            self._rng_at_start = self.capture_rng()
        else:
            try:
                self.restore_rng(self._rng_at_start)
            except BuiltSinceError:
                # the failed attempt made Keras's seed generator (the rest is back): the checkpoint
                # the retry goes back to holds its state, or says it was not made (a restart then)
                pass
        self._small_values_at_start()
        if self.uses_loop:
            return True
        if self.resuming:
            got = self._restore("the cell")
            if got is not None:
                got[0].restore(self.shell.user_ns, [], rng=True)
            note = self._take_note()
            self.finished_before = got is not None and _meta(got[0]).get("end") is True
            if self.finished_before:
                put_back_left(got[0], self.shell.user_ns)
                self.say((note or f"colab_resilience: run {self.run_id}") + "; the cell had finished, it is not run again"
                         + unset_note(self.shell, self.body, self.names))
                return False
            if note:
                self.say(note if not self.names else note + "; running the cell again")
        elif self.safe_points == 0:
            self.first_safe_point()  # the cell start
        return True

    def _small_values_at_start(self) -> None:
        """The first attempt in this kernel keeps a copy of the small ``--save`` values it begins
        with (numbers, strings, plain data, tensors and arrays of at most 1 MiB: a loss history, a
        step count); a retry puts them back, into the objects the names hold, before the cell runs
        again. The code above the first loop reads what the first attempt read there, as after a
        restart (what the set-up cells make), not what the failed attempt left: a scale taken from
        ``len(history)``, the start of ``resume_range(len(history), n)``. (The loop's start then
        restores the safe point's, as it always did. A larger value, a model, is not copied: code
        above the first loop that reads one reads it as the failed attempt left it.)"""
        import copy

        from .checkpoints.restore import into
        from .oom import is_oom

        ns = self.shell.user_ns
        if self._small_at_start is None:
            self._small_at_start = {}
            for n in self.names:
                if n in ns and after_loop_refusal(ns[n]) is None:
                    try:
                        self._small_at_start[n] = copy.deepcopy(ns[n])
                    except Exception as e:  # what cannot be copied (a tensor that is not a leaf) is left as it is
                        if is_oom(e):
                            raise
            return
        for n, value in self._small_at_start.items():
            ns[n] = into(ns[n], copy.deepcopy(value)) if n in ns else copy.deepcopy(value)

    def capture_rng(self) -> dict:
        """The random states (:func:`capture_rng`), with those of the generators in ``--save``:
        the code above a loop draws from one (``torch.randperm(n, generator=g)``, the order of a
        ``DataLoader(..., generator=g)``), and a retry, or a resume inside an iteration, must draw
        there what the first attempt drew, not go on from the failed attempt's or the safe point's."""
        state = capture_rng()
        ns = self.shell.user_ns
        generators = {n: generator_state(ns[n]) for n in self.names if n in ns and is_generator(ns[n])}
        if generators:
            state["generators"] = generators
        return state

    def restore_rng(self, state: Mapping) -> None:
        """Put back what :meth:`capture_rng` returned."""
        restore_rng(state)
        ns = self.shell.user_ns
        for n, g in (state.get("generators") or {}).items():
            if n in ns and is_generator(ns[n]):
                set_generator_state(ns[n], g)

    def safe_point(self, position: list[tuple[int, int]], rngs: list, *, force: bool = False,
                   last: bool = False, where: str | None = None, spans: list | None = None) -> None:
        """The end of an iteration (:mod:`colab_resilience.loops`): save if due; restart if
        planned (not after the last iteration). ``where``: the iteration a resume goes on with;
        ``spans``: the position's loops' ranges (:func:`.loops.spans`)."""
        self.safe_points += 1
        faults.safe_point("before")
        self.save_position(position, rngs, force=force, where=where, spans=spans)
        faults.safe_point("after")
        if last:
            return
        reason = restart.planned_reason(self.policy, self.safe_points)
        if reason is None:
            return
        if self._saved_point != self.safe_points:  # not saved yet at this safe point (--every)
            self.save_position(position, rngs, force=True, where=where, spans=spans)  # resume from this one
        raise RunStoppedError(self.leave(reason, planned=True))

    def loop_found(self) -> None:
        """A ``resume_range`` loop started in code the cell calls (``train(model, epochs)``): from
        now on, in this kernel and in the next (the journal says so), the cell is run as a loop,
        restored when that loop starts and not at the cell's first line, where the code above the
        loop would run again on the restored state."""
        self.uses_loop = True
        with self.journal_lock:
            self.journal.loops = True
            self.journal.save()

    def first_safe_point(self) -> None:
        """The start of the first loop (or of a cell without one): where a rollback of the first
        iteration goes."""
        tell, self.at_loop_start = self.at_loop_start, None
        for line in tell() if tell is not None else []:
            self.say(line)
        faults.safe_point("before")
        self.save_position([(0, 0)], [], force=True)
        faults.safe_point("after")

    def finish_save(self) -> None:
        """The end of the cell, a safe point: a resumed cell would skip every loop."""
        if self.loops.plan is not None:  # resumed at the end: every loop had finished
            self.restore_later(self.loops.plan)
            note = self._take_note()
            if note:
                self.say(f"{note}; every loop had finished" + unset_note(self.shell, self.body, self.names))
        faults.safe_point("before", end=True)
        self.save_position([(self.loops.top, 0)], [], force=True, end=True)
        faults.safe_point("after", end=True)

    def save_position(self, position: list[tuple[int, int]], rngs: list, *, force: bool = False,
                      where: str | None = None, end: bool = False, spans: list | None = None) -> None:
        due = force or (
            (self.every_n is not None and self.safe_points % self.every_n == 0)
            or (self.every_seconds is not None and time.monotonic() - self._last_save >= self.every_seconds)
        )
        if not due:
            return
        _flush_output()
        ns = self.shell.user_ns
        # A name the cell has not assigned yet (checked when the cell started: it assigns it) is
        # left out of this checkpoint and saved at the next safe point that finds it.
        present = [n for n in self.names if n in ns]
        # (not one the cell makes below its first loop: opt2 = Adam(...) between two loops)
        missing = [n for n in self.names if n not in ns and n not in self._said and n not in self._made_by_cell()]
        if missing and self.safe_points:
            self._said.update(missing)
            self.say(
                f"colab_resilience: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not defined at "
                "this safe point; the checkpoint holds the other names"
            )
        graphs = [n for n in present if n not in self._said_graph and carried.holds_a_graph(ns[n])]
        if graphs:
            self._said_graph.update(graphs)
            self.say(carried.graph_line(graphs))
        after_loop = self._kept_after_loop(ns)
        meta = {"loops": [list(p) for p in position], "carried": carried.snapshot(ns, present), "end": end,
                "where": where, "joins": carried.joins(ns, present)}
        loaders = carried.loader_epochs(ns)
        if loaders:
            meta["loaders"] = loaders
        if spans:
            meta["ranges"] = spans
        if end:
            meta["left"] = left_values(self.shell, self.body, self.names)
        namespace: Mapping = ChainMap({LOOP_RNG: rngs, **self.extras}, ns) if rngs or self.extras else ns
        # the batch size that fits goes with the checkpoint: a new kernel starts from it
        framework = "; ".join(getattr(x, "label", n) for n, x in self.extras.items()) or None
        info = (where, _integers({n: shrink_value(ns, n) for n in self.shrink}), faults.count(), framework)
        # a value that cannot be saved stops the cell here (UnsaveableValueError), before anything
        # is written; a checkpoint that cannot be written is said, and the run goes on
        saved = present + after_loop + ([LOOP_RNG] if rngs else []) + list(self.extras)
        # the run's first checkpoint is on disk before training goes on: a fault before it would
        # start the run again from what the set-up cells and the finished runs make, without what
        # a cell that is not replayed changed since (an optimizer's rate), and end otherwise
        first = self.journal.last_checkpoint is None
        if not self.saver.save(namespace, saved, meta=meta, info=info, durable=end or first, kept=self.kept,
                               whole=whole_modules(ns, present, self.kept), quiet=end):  # finish says it
            return
        self._last_save = time.monotonic()
        self._saved_point = self.safe_points
        self._names_at_checkpoint = set(ns)
        self._objects_at_checkpoint = {n: ns[n] for n in present if callable(getattr(ns[n], "load_state_dict", None))}

    def _kept_after_loop(self, ns: Mapping) -> list[str]:
        """The names a ``resume_range`` loop sets and the code after it reads, without ``--save``
        (``print(epoch, loss.item())`` below an inner loop), that this checkpoint keeps: a run
        resumed at the loop's end has them as the uninterrupted run had. Only small values (a
        number, a loss tensor: :func:`after_loop_refusal`); one line, once, names any other."""
        kept, refused = [], []
        for n in self.after_loop:
            if n not in ns:
                continue
            why = after_loop_refusal(ns[n])
            if why is None:
                kept.append(n)
            elif n not in self._said:
                self._said.add(n)
                refused.append(f"{n} ({why})")
        if refused:
            self.say(
                f"colab_resilience: {', '.join(refused)} {'is' if len(refused) == 1 else 'are'} set inside a "
                "resume_range loop and read after it, and too large or not plain enough to keep with each checkpoint "
                "without --save: a run resumed after the loop's last safe point would not have "
                f"{'it' if len(refused) == 1 else 'them'}; add {'it' if len(refused) == 1 else 'them'} to --save")
        return kept

    def _durable(self, report, info: tuple[str | None, dict[str, int], int, str | None]) -> None:
        """A checkpoint is on disk and ``LATEST`` names it: the journal says so (on the persisting
        thread, when saves are in the background)."""
        where, shrink, number, framework = info
        with self.journal_lock:
            j = self.journal
            j.last_checkpoint, j.resume_at = report.checkpoint_id, where
            j.framework = j.framework or framework  # its callback's state is in the checkpoints (a model no --save names)
            j.oom_kills = memory.oom_kills()
            j.shrink.update(shrink)
            for path, digest in module_files.local_modules().items():  # those the cell imported since it began
                if len(j.modules) < module_files.MODULES:
                    j.modules.setdefault(path, digest)
            j.save()
        faults.persisted(number)

    def forget_new_names(self) -> list[str]:
        """Unbind the names created since the last checkpoint, the point a retry goes back to,
        where they did not exist: a batch left bound to a global by the failed attempt would
        otherwise hold its memory through the retry. Names that existed then are left alone;
        ``--save`` names are restored from the checkpoint. Returns the names unbound."""
        if self._names_at_checkpoint is None:
            return []
        ns, hidden = self.shell.user_ns, getattr(self.shell, "user_ns_hidden", {})
        new = [n for n in ns if n not in self._names_at_checkpoint and not n.startswith("_") and n not in hidden]
        for n in new:
            del ns[n]
        return new

    def retry_not_exact(self) -> RetryNotExactError | None:
        """Before a retry in this kernel: an attempt that failed before the run's first checkpoint
        (above its first loop) and changed a ``--save`` value in place (``g["lr"] *= 0.5``, weights
        scaled, a loss appended) leaves nothing that puts it back, and the retry would run that code
        again on top of it. The run goes on in a restarted kernel instead, whose replay makes the
        value again (compared there with what the run began with, :meth:`_start_state`)."""
        from . import setup_state

        j = self.journal
        self.saver.settle()  # the first checkpoint, if it is being written
        if j.last_checkpoint is not None or not self._saved_at_start:
            return None
        # against what this kernel's first attempt began with (a replay may have made a model otherwise)
        differ = setup_state.differing(self._saved_at_start, self.shell.user_ns, saved=True)
        if not differ:
            return None
        it = "it" if len(differ) == 1 else "them"
        return RetryNotExactError(
            f"colab_resilience: run {self.run_id}: the failed attempt changed {', '.join(differ)} before the run's "
            f"first checkpoint, and nothing holds what {it} held; the run goes on in a restarted kernel, whose "
            f"%%replay cells make {it} again",
            f"out of memory, and the failed attempt had changed {', '.join(differ)} before the run's first checkpoint")

    def rollback(self, host_memory: bool = True) -> list[str]:
        """Before an in-process retry: restore the last safe point at the next restore point, and
        unbind what the failed attempt created (returned, to be reported). The checkpoint being
        written is waited for; after host memory ran out, the staging memory is given back."""
        if not self.names and not self.extras and not self._said_retry_unsaved:
            self._said_retry_unsaved = True
            self.say(f"colab_resilience: run {self.run_id} saves nothing (no --save), so the retry goes on from the "
                     "values in memory, which the failed attempt may have changed; --save the model and "
                     "optimizer for a retry that is exact")
        if host_memory:
            self.saver.go_synchronous("host memory ran out")
        else:
            self.saver.settle()
        self.resuming = True
        return self.forget_new_names()

    # -------------------------------------------------------------------------- leaving

    def set_policy(self, policy: RestartPolicy) -> None:
        """``%restart_after`` run inside the cell: from the next safe point on, for this run too."""
        with self.journal_lock:
            self.policy = self.journal.policy = policy
            self.journal.save()

    def record_shrink(self, values: Mapping[str, object]) -> None:
        with self.journal_lock:
            new = _integers(values)
            for name, value in new.items():
                old = self.journal.shrink.get(name)
                if old is not None and old != value:
                    self._shrunk.setdefault(name, old)
            self.journal.shrink.update(new)
            self.journal.save()

    def leave(self, reason: str, *, planned: bool = False) -> str:
        """Restart the kernel (see :func:`colab_resilience.restart.leave`). Returns only when it
        cannot; the run has then failed, and the returned line says why."""
        self.saver.close()  # the checkpoint being written goes to disk before the kernel goes
        report = restart.leave(self.shell, self.journal, reason, planned=planned, iteration=self.iteration,
                               say=self.say)
        self.close()
        return report

    def finish(self, status: str, stopped: Callable[[Journal], str | None] | None = None) -> None:
        """The run ends ``status`` ("done" or "failed"). Where its final save was not written (a
        full disk), a run that would end done stays pending and the cell stops in one line: the
        cells after it would run on state no checkpoint holds, and after a death a supervisor
        would put back the last checkpoint, from the middle of the training, as its end.
        ``stopped``: for a failed run, the line that says why and how to go on, made from the
        journal once the checkpoint being written is on disk; ``%resilience status`` repeats it."""
        self.saver.close(say=status != "done")
        unsaved = self.saver.failure if status == "done" else None
        self.journal.restart_requested = False
        if unsaved is None:
            self.journal.status = status
        self.journal.stopped = stopped(self.journal) if stopped is not None and status == "failed" else None
        self.journal.framework = "; ".join(getattr(x, "label", n) for n, x in self.extras.items()) or None
        try:
            self.journal.save()
        except OSError as e:
            if status != "done":
                raise
            self.close()
            raise RunStoppedError(
                f"colab_resilience: run {self.run_id} finished its training, but its journal could not record that "
                f"({e.strerror or e}); free space in {self.root} (or choose another folder with %resilience dir), "
                "then run this cell again") from None
        self.close()
        if unsaved is not None:
            why = getattr(unsaved.__cause__, "strerror", None) or str(unsaved).splitlines()[0]
            last = self.journal.last_checkpoint
            raise RunStoppedError(
                f"colab_resilience: run {self.run_id} finished its training, but its final state could not be saved "
                f"({why}), so the cells after it would run on state no checkpoint holds: free space in {self.root} "
                "(or choose another folder with %resilience dir), then run this cell again; it goes on from "
                + (f"checkpoint {last}" if last else "the start"))

    def withdraw(self, stopped: str | None = None) -> None:
        """This execution stops before its first safe point (an option of its line is wrong, a set-up
        cell failed to replay, a refusal, an error): a run it began is forgotten (its folder holds
        nothing of the user's: no step ran), a pending run it took over stays pending, its
        checkpoints kept and its code the code they were made with (a change is said when the
        run goes on), for the cell run again once the cause is put right. ``stopped``: the refusal
        that stopped it, which ``%resilience status`` repeats until the run is taken up again."""
        assert self.safe_points == 0
        try:
            self.saver.close()
            if self.began_here:
                shutil.rmtree(self.journal.run_dir, ignore_errors=True)
            else:  # the code it goes on with is told against what ran, not this cell's, which did not
                self.journal.interrupted_cell = self.ran
                self.journal.stopped = stopped.splitlines()[0] if stopped else None
                self.journal.save()
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the run: the lock, and the startup file once no run is pending."""
        self.saver.close()
        restart.remove_startup_file_if_idle(self.shell, self.root)
        self.lock.release()

    @contextlib.contextmanager
    def active(self) -> Iterator[Run]:
        """Make this the run that ``resume_range`` and ``checkpoint()`` report to."""
        loops.ACTIVE.append(self)
        try:
            yield self
        finally:
            loops.ACTIVE.remove(self)


def uncounted_death(journal: Journal) -> str | None:
    """How the kernel that last held ``journal``'s run ended, if it died without warning and no
    one has counted that death yet (not this kernel, not a driver): a few words, or None."""
    if journal.kernel_pid == os.getpid() or journal.counted_pid == journal.kernel_pid:
        return None
    now = memory.oom_kills()
    oom_killed = now is not None and journal.oom_kills is not None and now > journal.oom_kills
    return ("killed by the OS out-of-memory killer" if oom_killed
            else "killed or crashed; the OS recorded no out-of-memory kill")


def code_change(before: str | None, now: str) -> str | None:
    """How the code ``now`` of a run's cell differs from ``before``, the code the run was last
    executed with, in a few words (its first changed line, old and new, and how many lines
    differ); None when they are the same but for spaces at line ends and blank lines at the end."""
    import difflib

    if before is None:
        return None
    old, new = ([line.rstrip() for line in code.rstrip().splitlines()] for code in (before, now))
    if old == new:
        return None
    changes = [op for op in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes() if op[0] != "equal"]
    _, i1, i2, j1, j2 = changes[0]
    if i1 == i2:
        first = f"line {j1 + 1}, {_quoted(new[j1])}, was added"
    elif j1 == j2:
        first = f"line {j1 + 1}, {_quoted(old[i1])}, was removed"
    else:
        first = f"line {j1 + 1} was {_quoted(old[i1])}, is {_quoted(new[j1])}"
    differ = sum(max(a2 - a1, b2 - b1) for _, a1, a2, b1, b2 in changes)
    return first + (f"; {differ} lines differ" if differ > 1 else "")


def _quoted(line: str, most: int = 60) -> str:
    line = line.strip()
    return repr(line if len(line) <= most else line[:most - 3] + "...")


def _take_over(shell, journal: Journal, root: Path) -> bool:
    """A pending run found by a new execution of its cell: count a death without warning (or
    fail the run when the budget does not cover it). Returns whether the set-up cells must be
    replayed: a kernel restart came between, or their replay in this kernel stopped (a set-up
    cell that failed, the stop button), and goes on from the cell it stopped at."""
    in_replay = journal.phase == "replay"
    journal.restart_requested, journal.phase = False, None
    died = journal.kernel_pid != os.getpid()
    how = uncounted_death(journal)
    if how is not None:
        why = f"the kernel died without warning {'while replaying the set-up cells ' if in_replay else ''}({how})"
        if journal.restarts_left == 0:
            report = restart.refuse(journal, why)
            restart.remove_startup_file_if_idle(shell, root)
            raise RunStoppedError(report)
        journal.record_restart(why)
    return died or in_replay


def _left_behind(root: Path, key: bytes, cell_key: str, notebook: str) -> str | None:
    """A line where a pending run of this cell was begun in a notebook that is no longer there
    (renamed or moved while its kernel was shut down: the run id includes the notebook, so the
    cell of the notebook as it is now begins a run of its own), saying how to go on with it."""
    from .journal import read_journals

    for j in read_journals(root, key):
        if j.status == "pending" and j.cell_key == cell_key and j.notebook and j.notebook != notebook \
                and os.path.isabs(j.notebook) and not os.path.exists(j.notebook):
            at = f"it continues at {j.resume_at}" if j.resume_at else (
                f"from checkpoint {j.last_checkpoint}" if j.last_checkpoint else "no checkpoint yet")
            return (f"colab_resilience: run {j.run_id} of this cell, begun in {j.notebook}, which is no longer there "
                    f"(renamed or moved?), is pending ({at}); this notebook's cell begins a run of its own; to go on "
                    f"with that one instead, %resilience resume {j.run_id}, then run this cell")
    return None


def _under_another_key(root: Path, key: bytes, cell_key: str, notebook: str | None, run_id: str) -> list[str]:
    """A line for each run of this cell (of this notebook) in ``root`` that could go on (pending, or
    stopped with a checkpoint) and that another installation key signed: another machine, a new
    Colab VM whose run directory is on Drive, a lost key. The run id is an HMAC under the key, so
    the cell begins a run of its own from the beginning (the same result, the progress done
    again); the line says how to go on with that one instead. Its journal is read, unverified, for
    its cell, notebook and status only: nothing of it runs, and none of its text is shown."""
    from .journal import find_runs, signed_elsewhere

    lines = []
    for run_dir in find_runs(root):
        if run_dir.name == f"run-{run_id}":
            continue
        try:
            j = Journal.load(run_dir)  # unverified: compared, not used
        except (JournalError, OSError):
            continue
        if j.cell_key != cell_key or j.notebook != notebook:
            continue
        if j.status == "pending":
            which = "pending"
        elif j.status == "failed" and j.resume_at:
            which = "stopped before its end"
        else:
            continue
        if not signed_elsewhere(run_dir, key):  # signed here: a run of this cell under another id is another notebook's
            continue
        old = run_dir.name.removeprefix("run-")
        lines.append(
            f"colab_resilience: run {old} of this cell in {root}, {which}, was written under another installation key "
            "(another machine, a new Colab VM, a lost key), so this cell begins a run of its own from the beginning; "
            f"to go on with that one instead, review it with `%resilience show {old}`, then "
            f"`%resilience resume --trust {old}` and run this cell again; `%resilience reset {old}` forgets it")
    return lines


def _refuse_beginning_on_what_it_left(shell, journal: Journal, names: list[str], log: ReplayLog | None) -> None:
    """The cell of a run that stopped (an error, the stop button) run again: where the values of
    ``names`` (its ``--save`` values, and the models and optimizers it began with that its
    checkpoints keep without them: a Keras model a ``fit`` trains, a Trainer's) are not what the
    set-up cells made but what the stopped run's training left (a model trained for some epochs, a
    history appended to), a run from the loop's beginning trains on them and ends with no
    uninterrupted run's result (plain Jupyter does the same, silently). Refused, the run's
    checkpoint kept: it can still go on from there, or the set-up cells run first start it over.
    Nothing is compared where the set-up cells did not make the value."""
    if log is None or not log.saved_prints:
        return
    from . import setup_state

    made = [n for n in dict.fromkeys(names) if n in log.saved_prints]
    now = setup_state.fingerprint(shell.user_ns, made, saved=True)
    left = [n for n in made if n in now and now[n] != log.saved_prints[n]]
    if not left:
        return
    hold = "holds" if len(left) == 1 else "hold"
    raise RunStoppedError(
        f"colab_resilience: run {journal.run_id} of this cell stopped at {journal.resume_at}, and {', '.join(left)} "
        f"{hold} what its training left, not what the set-up cells made: from its beginning on that, the cell would "
        f"not give an uninterrupted run's result. To go on from its checkpoint: %resilience resume {journal.run_id}, "
        f"then run this cell; to start over: run the set-up cells first (or %resilience reset {journal.run_id} to "
        "train on the values as they are)")


def _refuse_undoing(shell, journal: Journal, log: ReplayLog) -> None:
    """Refuse, before anything is replayed or written, a replay of the run's set-up cells that
    would bind a name over what a set-up cell of this kernel's, which the run does not know, made
    (:func:`.replay.overwrites`): the run's old version of a cell edited where the front end sends
    no cell id, or another notebook's run of a cell of the same code, would silently undo it."""
    from .replay import overwrites, split
    from .setup_state import binding_line

    clash = overwrites(shell, journal.replay_cells, log)
    if clash is None:
        return
    theirs, name, ours = clash
    old, new = binding_line(shell, theirs.source, name), binding_line(shell, ours.source, name)
    if old != new:
        what = f"its set-up cell {old} over {name}, which this kernel's set-up cell {new} made"
    else:  # the same line (def step(epoch):), other code: where they differ
        change = code_change(split(theirs.source)[1], split(ours.source)[1])
        what = f"its version of the set-up cell {old} over {name}, which this kernel's version made ({change})"
    raise RunStoppedError(
        f"colab_resilience: run {journal.run_id} would replay {what} (a set-up cell edited where the front end sends "
        "no cell id, or another notebook's run of a cell with this code): nothing was replayed; to start the run over "
        f"with this kernel's set-up, %resilience reset {journal.run_id} and run this cell again; to go on with the "
        "run's, run its set-up cell as it was")


def _integers(values: Mapping[str, object]) -> dict[str, int]:
    return {n: v for n, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}


def _flush_output() -> None:
    """Send what the cell printed so far to the notebook before a checkpoint marks it done: the
    kernel's streams hold it up to 0.2 s (ipykernel's flush interval), and a kernel killed in that
    time took it with it, while a resume goes on after it and never prints it again (the log of
    the epoch that finished just before the kill was missing from the cell's output)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream a cell replaced, closed or without flush
            stream.flush()

