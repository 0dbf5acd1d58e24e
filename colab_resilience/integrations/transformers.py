"""The Hugging Face ``Trainer`` resumes at the optimizer step where it stopped: one callback in a
``%%resilient`` cell.

    %%resilient
    from colab_resilience.integrations.transformers import ResilienceCallback
    trainer.add_callback(ResilienceCallback())
    trainer.train()

The end of every epoch is a safe point, and with ``ResilienceCallback(every_steps=N)`` every N-th
optimizer step too (``--every`` and ``%restart_after`` count these); each is taken once the
Trainer has logged and evaluated after it (when the next step begins, or training ends). With
every checkpoint, beside the cell's ``--save`` names, go the model's ``state_dict`` (with the
tensors it leaves out), its modes, ``requires_grad`` flags and plain attributes, the optimizer's
and the scheduler's state dicts, the ``TrainerState`` (its step, epoch, log history), what the
Trainer accumulates for its next log (the loss since the last one, the running total), the plain
attributes of its other callbacks (``EarlyStoppingCallback``'s count), the random state when the
epoch began, and Python's, NumPy's and torch's random states.

A ``Trainer`` cannot be resumed from a callback alone: ``train`` works out the epochs and steps
to skip from a checkpoint folder before the first callback event. So importing this module wraps
``Trainer.train``; the wrapper does something only for a trainer with this callback, in a
``%%resilient`` cell. On resume it loads the model in place, hands ``train`` a folder of the
run's own holding only ``trainer_state.json`` (written from the checkpoint), and stands in, for
that call, for the Trainer's own loading of model, optimizer, scheduler and random state: they
come from this package's checkpoint, into the objects the Trainer has. The Trainer then skips
the finished epochs and, within an epoch, the finished batches, as its own resume does. The
other callbacks get their state back after their ``on_train_begin``; the epoch the run goes on
with is not begun again for them (every safe point is taken as a step begins, after its epoch's
``on_epoch_begin`` hooks, whose doing the checkpoint holds), and what the hooks before the first
step change goes back to the safe point's as it begins.
An OOM retried in the kernel before the first step's safe point goes back to the checkpoint
``train`` began with, and what the failed attempt changed that ``train`` does not make anew goes
back as it was then (:meth:`TrainerCheckpoint.back_to_start`): the optimizer (``train`` keeps one
it finds), a given scheduler, the floating-point operations counted toward ``total_flos``.

A resumed run is identical to an uninterrupted one where the Trainer is deterministic (CPU, or
``full_determinism``): weights, optimizer, log history and ``training_loss``. That holds for a data
collator that draws random numbers as it makes each batch (``DataCollatorForLanguageModeling``
masks tokens at random, from torch's global state or from a generator of its own with ``seed=``):
the Trainer makes a step's batches before that step's safe point, so the random states each
batch of the training's data loader was made from are kept, and a checkpoint holds those of the
batches made ahead of it; a resume makes them again from the same states.

After an out-of-memory retry with ``--shrink trainer.args.per_device_train_batch_size``, the
gradient accumulation is raised so that an optimizer step takes the samples it took when the run
began. A resume stops in one line where the replayed set-up cells made the Trainer otherwise than
the run began with it: its model in another dtype or architecture, other ``TrainingArguments``,
training data of another length (a change a plain cell made is not made again in a new kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer_utils import TrainOutput

from .. import carried, words
from ..checkpoints import capture_rng, restore_rng
from ..errors import CheckpointError, RunStoppedError
from ..loops import active_run
from . import (accumulation_for, caller_locals, is_plain, plain_attributes, put_attributes, require_loop, say_outside,
               unsaved_attributes)
from . import every_steps as check_every_steps

STATE = "transformers:trainer"  # the checkpoint entry holding a Trainer's state
RESUME_FOLDER = "transformers-resume"  # in the run's folder: trainer_state.json for train()


class TrainerCheckpoint:
    """What a ``Trainer`` carries from step to step, as a state dict: saved with each checkpoint
    of the run, loaded in place (the model at once; the optimizer and scheduler, which ``train``
    makes, when the Trainer loads them)."""

    label = "the Trainer's model, optimizer, scheduler and state"  # what a resume says it restored

    def __init__(self, trainer: Trainer, shrinks: bool = False):
        self.trainer = trainer
        # the batch of an optimizer step as the run began: a --shrink of the per-device batch
        # raises the gradient accumulation to keep it
        self.effective_batch = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
        # as train() begins: a resume compares the new kernel's (the batch too, but in a run with a --shrink)
        self.arguments = _arguments(trainer, shrinks)
        self.epoch_rng: dict | None = None  # the random state when the epoch in progress began
        self.finished = False  # train() ended: a resume returns its output without training
        self.metrics: dict | None = None  # the metrics the ended train() returned (as its callbacks left them)
        self.loaded: dict[str, Any] | None = None
        self.callbacks_pending: dict[str, dict] = {}  # the other callbacks' loaded state, until they have begun
        self.batches: _TrainBatches | None = None  # the training data loader's collator, watched
        self.place = 0  # the epoch's batch the step about to begin starts with

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {
            # with what its state dict leaves out (non-persistent buffers, metrics' states)
            "model": carried.with_module_states(t.model, t.model.state_dict()),
            # its modes (evaluation leaves it in eval mode), requires_grad flags, plain attributes
            "carried": carried.snapshot({"model": t.model}, ["model"]),
            "optimizer": t.optimizer.state_dict() if t.optimizer is not None else None,
            "scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler is not None else None,
            "trainer_state": json.dumps(dataclasses.asdict(t.state), sort_keys=True),
            "logging": {  # what train() resets and its next log and its final loss are made of
                "tr_loss": float(t._tr_loss.item()) if hasattr(t, "_tr_loss") else 0.0,
                "total_loss": float(getattr(t, "_total_loss_scalar", 0.0)),
                "last_logged": int(getattr(t, "_globalstep_last_logged", 0)),
                "initial_step": int(getattr(t, "_initial_global_step", 0)),
                # the floating-point operations since the Trainer last added them to state.total_flos
                # (at its end, or a save of its own): a Trainer made anew counts from 0
                "current_flos": getattr(t, "current_flos", 0),
                "accumulation": getattr(t, "current_gradient_accumulation_steps", None),
            },
            "control": dataclasses.asdict(t.control),  # what the callbacks asked for last (stop training)
            "callbacks": {key: plain_attributes(cb)[0] for key, cb in _stateful(t).items()},
            "epoch_rng": self.epoch_rng,
            "rng": capture_rng(),  # the state at the safe point, for where the Trainer puts it back
            "finished": self.finished,
            "metrics": self.metrics,
            # the model's config as training left it (its first forward sets problem_type): a resume
            # that trains nothing more (the end) would leave the rebuilt model's as the set-up made it
            "config": plain_attributes(t.model.config)[0] if _config(t.model) is not None else None,
            "effective_batch": self.effective_batch,
            "arguments": self.arguments,
            # the random states the batches made ahead of this safe point were made from
            "batches": self.batches.ahead(self.place) if self.batches is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (a checkpoint of an earlier version has none)
        changed = words.differences(state["arguments"], self.arguments) if state.get("arguments") else None
        if changed:
            raise CheckpointError(
                f"colab_resilience: cannot resume the Trainer's run: the Trainer is not set up as the run began with it "
                f"({changed}): a change made in a cell that is not %%replay (trainer.args.num_train_epochs = ..., "
                "trainer.train_dataset = ...) is not made again in a new kernel, nor is data drawn without a seed "
                "drawn the same, and train() would go on with the %%replay cells' Trainer; make the change in the "
                "%%replay cell that builds the Trainer (seed its draws), or %resilience reset to start the run over")
        model = self.trainer.model
        refused = carried.refusal("the Trainer's model", model, state["model"])
        if refused:  # (load_state_dict would convert another dtype's weights, and train on in this one)
            raise CheckpointError(refused)
        model.load_state_dict(carried.put_module_states(model, state["model"]))
        carried.apply({"model": model}, ["model"], state.get("carried") or {})
        if state.get("config") and _config(self.trainer.model) is not None:
            put_attributes({"config": state["config"]}, {"config": self.trainer.model.config})
        self.epoch_rng, self.finished = state["epoch_rng"], bool(state["finished"])
        self.effective_batch = int(state.get("effective_batch") or self.effective_batch)
        self.loaded = state
        self.callbacks_pending = dict(state.get("callbacks") or {})
        self.trainer.state = self.trainer_state()  # what train() loads again from the folder it is given

    def put_back(self) -> None:
        """A resumed ``train`` has run the other callbacks' ``on_train_begin`` and its first
        step's ``on_step_begin`` hooks again (a callback that freezes a layer as training begins);
        the safe point was taken after them, as a step began. What they may have changed
        goes back as the checkpoint holds it: the model's modes, ``requires_grad`` flags and plain
        attributes, the optimizer and the scheduler, the other callbacks' state."""
        loaded, t = self.loaded, self.trainer
        carried.apply({"model": t.model}, ["model"], loaded.get("carried") or {})
        self.load_optimizer_and_scheduler()
        put_attributes(dict(loaded.get("callbacks") or {}), _stateful(t))

    def back_to_start(self) -> None:
        """Before a ``train`` that begins again from the checkpoint taken as it began (an attempt in
        this kernel failed before the first step's safe point): what that attempt changed and
        ``train`` does not make anew goes back as it was then. ``train`` keeps an optimizer it finds
        (it makes one only where there is none): the one the attempt made and stepped goes, and a
        given one (``Trainer(optimizers=...)``, or one an earlier ``train`` made) gets its saved
        state back, as does a given scheduler; the floating-point operations the attempt counted,
        which ``train`` adds to ``total_flos``, go back to the count of then."""
        loaded, t = self.loaded, self.trainer
        if loaded["optimizer"] is None:
            t.optimizer = None  # (a scheduler train() made, it makes anew itself)
        self.load_optimizer_and_scheduler()
        t.current_flos = loaded["logging"].get("current_flos", 0)

    def load_optimizer_and_scheduler(self) -> None:
        """The saved optimizer and scheduler state, into the ones ``train`` made."""
        loaded, t = self.loaded, self.trainer
        if t.optimizer is not None and loaded["optimizer"] is not None:
            t.optimizer.load_state_dict(loaded["optimizer"])
        if t.lr_scheduler is not None and loaded["scheduler"] is not None:
            t.lr_scheduler.load_state_dict(loaded["scheduler"])

    def trainer_state(self) -> TrainerState:
        return TrainerState(**json.loads(self.loaded["trainer_state"]))

    def give_callbacks(self) -> list[str]:
        """Put the loaded state back into the Trainer's other callbacks (once their
        ``on_train_begin`` and ``on_epoch_begin`` have run, as they had when it was saved);
        returns those whose state was saved but that this Trainer does not have at that place."""
        pending, self.callbacks_pending = self.callbacks_pending, {}
        return put_attributes(pending, _stateful(self.trainer))


# TrainingArguments that do not change what train() computes (where it writes, what it shows)
_ARGUMENTS_KEPT_OUT = {"output_dir", "logging_dir", "run_name", "report_to", "disable_tqdm", "overwrite_output_dir",
                       "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
                       "hub_always_push", "hub_revision"}
# those a --shrink of the per-device batch changes (the effective batch is kept: _keep_effective_batch)
_SHRUNK = {"per_device_train_batch_size", "gradient_accumulation_steps"}


def _arguments(trainer: Trainer, shrinks: bool) -> dict[str, str]:
    """What a Trainer's ``train()`` is set up with, each as JSON: its TrainingArguments (their own
    ``to_dict``, tokens masked; ``"args.num_train_epochs"``) but those in
    :data:`_ARGUMENTS_KEPT_OUT` (and in :data:`_SHRUNK` in a run with a ``--shrink``), and the
    length of its training data (``"len(train_dataset)"``: a subset set in a plain cell), where it
    has one."""
    try:
        values = trainer.args.to_dict()
    except Exception:  # not a TrainingArguments of transformers': none to compare
        values = {}
    out = _ARGUMENTS_KEPT_OUT | (_SHRUNK if shrinks else set())
    shown = {f"args.{k}": json.dumps(v, sort_keys=True, default=repr) for k, v in values.items() if k not in out}
    try:
        shown["len(train_dataset)"] = str(len(trainer.train_dataset))
    except Exception:  # none, or one without a length (an IterableDataset)
        pass
    for name in ("train_dataset", "eval_dataset"):
        held = _data_digest(getattr(trainer, name, None))
        if held is not None:
            shown[f"what {name} holds"] = held
    # (an object without a JSON form shown by its address differs in every process: not compared)
    return {k: v for k, v in shown.items() if " at 0x" not in v}


def _data_digest(data: Any) -> str | None:
    """What a Trainer's data set holds, as a digest (:data:`words.DIGEST`), where it is plain data:
    a list or dict of tensors and numbers (tokenized examples), a ``TensorDataset``, a ``Subset`` or
    a concatenation of those; the same for the same values. None for any other (a data set of a
    class that reads its files, or fills a cache as it is read, would differ between two moments of
    one run)."""
    from .. import setup_state

    if not setup_state.plain_data(data):
        return None
    digest = setup_state.fingerprint({"data": data}, ["data"]).get("data")
    return None if digest is None else words.DIGEST + digest


class Steps:
    """The stretches of optimizer steps between two safe points of a ``train`` call, as the
    cell's loop iterates them, until training has ended; named by the step that comes next."""

    def __init__(self, state: TrainerCheckpoint):
        self.state = state

    def __iter__(self):
        step = 0
        while not self.state.finished:
            yield step
            step += 1

    def describe(self, index: int) -> str:
        return "the end" if self.state.finished else f"step {self.state.trainer.state.global_step + 1}"


class ResilienceCallback(TrainerCallback):
    """Make the Trainer's optimizer steps safe points of the ``%%resilient`` cell it runs in, and
    resume ``train`` at the first unfinished step (see the module documentation). Outside a
    ``%%resilient`` cell it does nothing.

    ``every_steps``: a safe point every that many optimizer steps too, not only at each epoch's end
    (a resume then loses at most that many steps; each save costs what ``--save``-ing the model
    and optimizer costs)."""

    def __init__(self, every_steps: int | None = None):
        self.every_steps = check_every_steps(every_steps)
        self._new_epoch = False  # an epoch began: the step that begins next ends the epoch before
        self._steps = None  # the cell's loop over the steps (Loops.iterate)
        self._state: TrainerCheckpoint | None = None
        self._pending = False  # a step ended; its safe point comes when the Trainer has logged it
        self._logging: dict | None = None  # to put back once train() has reset it
        self._epoch_start = False  # the resumed run goes on at the start of an epoch
        self._put_back = False  # resumed: the state goes back as its first step begins
        self._resumed_at = 0  # resumed: the batches of the epoch it goes on with that were trained

    # --------------------------------------------------------------------- the wrapped train()

    def train(self, trainer: Trainer, run, call) -> TrainOutput:
        require_loop(run, "steps", "trainer.add_callback(ResilienceCallback())")
        self._state = state = TrainerCheckpoint(trainer, shrinks=bool(run.shrink))
        run.extras[STATE] = state
        self._pending, self._logging, self._epoch_start, self._put_back = False, None, False, False
        self._steps = run.loops.iterate(Steps(state))
        try:
            self._new_epoch = False
            first = next(self._steps, None)  # a resumed run: the model is loaded in place here
            _keep_effective_batch(trainer, state.effective_batch, run)
            unsaved = _unsaved_callback_state(trainer)
            if unsaved:
                run.say_once(unsaved)
            if trainer.data_collator is not None:
                state.batches = _TrainBatches(trainer.data_collator, run, _inexact_within(trainer, self.every_steps))
                _train_loader_with(trainer, state.batches)
                if self.every_steps is not None and trainer.args.dataloader_num_workers and \
                        _name(trainer.data_collator) not in _DRAW_NOTHING:
                    # it runs in the workers, where no batch of it is seen from here
                    run.say_once(
                        f"colab_resilience: the Trainer's data collator ({_name(trainer.data_collator)}) runs in the "
                        f"data loader's {trainer.args.dataloader_num_workers} worker processes, whose random states "
                        "cannot be kept: if it draws random numbers as it makes each batch (masking tokens), a resume "
                        "within an epoch makes them again from other ones, and is not identical to an uninterrupted "
                        "run (one at an epoch's start is); ResilienceCallback() without every_steps resumes at epochs' "
                        "starts only")
            if state.loaded is None or first == 0:
                if state.loaded is not None:
                    # a checkpoint taken as train() began, before any callback event: the other
                    # callbacks' state goes back now, and they begin as they did then (given at the
                    # first epoch's start, it undid what their on_epoch_begin had just counted);
                    # so do the optimizer and the operations count a failed attempt had stepped
                    self._give_callbacks()
                    state.back_to_start()
                return call(resume_from_checkpoint=None)
            return self._resume(trainer, run, call, finished=first is None)
        finally:
            vars(trainer).pop("get_train_dataloader", None)
            self._steps.close()
            self._steps = None

    def _resume(self, trainer: Trainer, run, call, *, finished: bool = False) -> TrainOutput:
        """``train`` from the run's checkpoint. ``finished``: training had ended (the kernel died
        after it, before the cell's end): ``train`` sets the Trainer up as it does to train (its
        data loader, the optimizer and scheduler it makes and loads, the accelerator's bookkeeping,
        the logging accumulators), trains nothing and evaluates nothing, and ends as its own end
        left it, without its end's callbacks, which ran then, or a second final log."""
        from .. import fsutil

        folder = run.dir / RESUME_FOLDER
        fsutil.make_private_dir(folder)
        saved = json.loads(self._state.loaded["trainer_state"])
        saved["train_batch_size"] = trainer._train_batch_size  # the batch now (a --shrink): not a mismatch to warn of
        fsutil.atomic_write(folder / "trainer_state.json", json.dumps(saved, sort_keys=True).encode())
        self._logging = self._state.loaded["logging"]
        # for this call, the Trainer loads from this package's checkpoint, into its own objects
        trainer._load_from_checkpoint = lambda *args, **kwargs: None  # the model is loaded already
        trainer._load_optimizer_and_scheduler = lambda checkpoint: self._state.load_optimizer_and_scheduler()
        trainer._load_rng_state = lambda checkpoint: self._load_rng(trainer)
        stand_ins = ["_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state"]
        handler = trainer.callback_handler
        if finished:  # the epochs left, if any (an early stop): none trained, no callback told of them
            handler.on_epoch_begin = lambda args, state, control: control
            trainer._evaluate = lambda *args, **kwargs: None  # eval_on_start: it evaluated then
            trainer._run_epoch = lambda **kwargs: setattr(trainer.control, "should_training_stop", True)
            trainer._finalize_training = lambda trial, num_train_samples, start_time: self._finished(trainer)
            stand_ins += ["_evaluate", "_run_epoch", "_finalize_training"]
        try:
            return call(resume_from_checkpoint=str(folder))
        finally:
            for name in stand_ins:
                vars(trainer).pop(name, None)
            vars(handler).pop("on_epoch_begin", None)

    def _finished(self, trainer: Trainer) -> TrainOutput:
        """The end of a ``train`` that had ended: what its end left in the Trainer (the logging
        accumulators are back already, from :meth:`on_train_begin`) and what it returned."""
        loaded = self._state.loaded
        for name, value in (loaded.get("control") or {}).items():
            setattr(trainer.control, name, value)
        self._give_callbacks()
        accumulation = loaded["logging"].get("accumulation")
        if accumulation is not None:
            trainer.current_gradient_accumulation_steps = accumulation
        trainer._memory_tracker.stop_and_update_metrics({})
        trainer.is_in_train = False
        # the model's modes as training left them (its last evaluation's eval mode): this call's
        # set-up put it in train mode
        carried.apply({"model": trainer.model}, ["model"], loaded.get("carried") or {})
        _without_neftune(trainer)  # (after: the plain attributes put back hold its setting)
        restore_rng(loaded["rng"])  # as the end of training left it
        return _output(trainer.state, loaded.get("metrics"))

    def _load_rng(self, trainer: Trainer) -> None:
        """Where the Trainer's own resume puts its saved random state back: at the start of the
        epoch it goes on with (the state when that epoch began, which draws its order), or after
        it skipped the epoch's finished batches (the state at the safe point)."""
        loaded = self._state.loaded
        if self._epoch_start and loaded["epoch_rng"] is not None:
            restore_rng(loaded["epoch_rng"])
        else:
            restore_rng(loaded["rng"])

    # ------------------------------------------------------------------------------- events

    def on_train_begin(self, args, state, control, **kwargs):
        if self._steps is None:
            if active_run() is None:
                say_outside("transformers")
            return
        if self._logging is not None:  # train() reset them for a fresh start: put back what they were
            import torch

            # what the Trainer's loop worked out from the step count: where it goes on
            loop = caller_locals("_inner_training_loop", self._state.trainer)
            self._resumed_at = loop.get("steps_trained_in_current_epoch", 0)
            self._epoch_start = self._resumed_at == 0
            t, logging = self._state.trainer, self._logging
            t._tr_loss = torch.tensor(logging["tr_loss"], device=args.device)
            t._total_loss_scalar = logging["total_loss"]
            t._globalstep_last_logged = logging["last_logged"]
            t._initial_global_step = logging["initial_step"]
            t.current_flos = logging.get("current_flos", t.current_flos)
            self._logging = None
            # the other callbacks' state, after their on_train_begin (this callback comes last), before
            # their on_epoch_begin: an epoch they begin again is counted from the safe point's count
            self._give_callbacks()
            if not self._state.finished:
                # every safe point is taken as a step begins, after its epoch's on_epoch_begin hooks
                # (an epoch's end too, as the next one's first step begins): what they did is in the
                # checkpoint, and the epoch the run goes on with is not begun again for them; what
                # the other hooks before the first step change goes back as it begins
                self._skip_epoch_begin(self._state.trainer)
                self._put_back = True

    def _skip_epoch_begin(self, trainer: Trainer) -> None:
        """The next ``on_epoch_begin`` event reaches this callback only (the Trainer's handler
        still clears ``should_epoch_stop``, as it does for every epoch)."""
        handler = trainer.callback_handler

        def resumed_epoch(args, state, control):
            vars(handler).pop("on_epoch_begin", None)
            control.should_epoch_stop = False
            self.on_epoch_begin(args, state, control)
            if self._state.batches is not None:  # its first batches are made as they were
                self._state.batches.begin_epoch(self._resumed_at, self._state.loaded.get("batches"))
            began = self._state.loaded.get("epoch_rng")
            if began is not None:
                # the random state as the epoch began, which the checkpoints taken in it keep; and
                # the epoch's order, drawn as its data loader starts (LengthGroupedSampler draws
                # from the global state), is drawn from it again: within the epoch too, where the
                # safe point's state comes back once its finished batches are skipped
                self._state.epoch_rng = began
                if not self._epoch_start:
                    restore_rng(began)
            return control

        handler.on_epoch_begin = resumed_epoch

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self._steps is not None:
            self._state.epoch_rng = capture_rng()
            self._new_epoch = True
            self._give_callbacks()
            if self._state.batches is not None:
                self._state.batches.begin_epoch(0)

    def _give_callbacks(self) -> None:
        """A resumed ``train`` has begun (their ``on_train_begin`` has run: this callback, added in
        the cell, comes after them): the other callbacks get the state they had at the safe point;
        what the checkpoint holds for a callback this Trainer lacks is said once."""
        if not self._state.callbacks_pending:
            return
        missing = self._state.give_callbacks()
        run = active_run()
        if missing and run is not None:
            run.say_once(f"colab_resilience: the checkpoint holds the state of {', '.join(missing)}, which this "
                         "Trainer does not have at that place in its callbacks; that state was not put back")

    def on_step_begin(self, args, state, control, **kwargs):
        if self._steps is None:
            return
        if self._put_back:
            self._put_back = False
            self._state.put_back()
        if self._state.batches is not None:  # the batches before it are trained: none goes back to them
            loop = caller_locals("_run_epoch", self._state.trainer) or caller_locals(
                "_inner_training_loop", self._state.trainer)
            self._state.place = loop.get("step", 0)
            self._state.batches.trained(self._state.place)
        due = self._new_epoch or (self.every_steps is not None and state.global_step % self.every_steps == 0)
        self._new_epoch = False
        if self._pending and due:
            self._safe_point()

    def on_step_end(self, args, state, control, **kwargs):
        if self._steps is not None:
            self._pending = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._steps is None:
            return
        self._state.finished = True
        # what train() returns: its final log, as the callbacks left it (a printer pops its total_flos)
        metrics = caller_locals("_finalize_training", self._state.trainer).get("metrics")
        self._state.metrics = dict(metrics) if isinstance(metrics, dict) and is_plain(dict(metrics)) else None
        self._safe_point()

    def _safe_point(self) -> None:
        self._pending = False
        next(self._steps, None)  # saves when due, may restart as planned


class _TrainBatches:
    """The Trainer's data collator as the training's data loader calls it. Before each batch it
    keeps the random states the collator may draw from: Python's, NumPy's and torch's global ones,
    and a generator of its own (``DataCollatorForLanguageModeling(seed=...)``'s, made at its first
    batch). The Trainer makes a step's batches (and, with accelerate, the next one) before that
    step's safe point, so a checkpoint holds the states of the batches made ahead of it
    (:meth:`ahead`), and a resume makes those batches again from them (:meth:`begin_epoch`); the
    states of trained batches are let go as each step begins (:meth:`trained`). Nothing is kept
    for a collator that draws nothing. Where the batches cannot be made again one by one within an
    epoch (``inexact``, with ``every_steps``), the first batch that draws says so once."""

    def __init__(self, collate, run, inexact: str | None):
        self.collate, self._run, self._inexact = collate, run, inexact
        self.draws = False  # a batch's making drew random numbers
        self._first = 0  # the epoch's batch whose state is _states[0]
        self._states: list[dict] = []
        self._again: list[dict] = []  # resumed: the states the next batches are made from

    def begin_epoch(self, first: int, again: list | None = None) -> None:
        """An epoch's data loader starts at its batch ``first`` (a resume skips the trained ones)."""
        self._first, self._states = first, []
        self._again = list(again or []) if self._inexact is None else []

    def trained(self, place: int) -> None:
        """The epoch's batches before ``place`` are trained."""
        if place > self._first:
            del self._states[:place - self._first]
            self._first = place

    def ahead(self, place: int) -> list[dict] | None:
        """The states of the batches made from the epoch's batch ``place`` on; None where
        nothing drew."""
        return list(self._states[max(place - self._first, 0):]) if self.draws else None

    def __call__(self, features):
        if self._again:
            _put_draw_state(self.collate, self._again.pop(0))
        state = _draw_state(self.collate)
        self._states.append(state)
        batch = self.collate(features)
        if not self.draws and _draw_marks(self.collate) != _draw_marks(self.collate, state):
            self.draws = True
            if self._inexact is not None:
                self._run.say_once(
                    f"colab_resilience: the Trainer's data collator ({_name(self.collate)}) draws random numbers "
                    f"as it makes each batch, and {self._inexact}: a resume within an epoch makes them again from "
                    "other random numbers, and is not identical to an uninterrupted run (one at an epoch's start "
                    "is); ResilienceCallback() without every_steps resumes at epochs' starts only")
        return batch

    def __getattr__(self, name):
        if name == "collate":  # (not made yet: a copy)
            raise AttributeError(name)
        return getattr(self.collate, name)


# the Trainer's collators that draw no random numbers
_DRAW_NOTHING = frozenset({"default_data_collator", "DataCollatorWithPadding", "DataCollatorForSeq2Seq",
                           "DataCollatorForTokenClassification", "DefaultDataCollator"})


def _inexact_within(trainer: Trainer, every_steps: int | None) -> str | None:
    """Why the batches of an epoch cannot be made again one by one from their kept states on a
    resume within it (only with ``every_steps``: a resume at an epoch's start makes them all), or
    None. (Batches made in worker processes are never seen here: said as training begins.)"""
    import torch

    if every_steps is None:
        return None
    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        return "the training data is an IterableDataset, whose batches the Trainer's resume makes again to skip them"
    if trainer.args.ignore_data_skip:
        return "the Trainer's ignore_data_skip makes an epoch's batches from its first again"
    return None


def _train_loader_with(trainer: Trainer, batches: _TrainBatches) -> None:
    """For this ``train`` call, the training's data loader is made with ``batches`` as its
    collator (evaluation's keeps the Trainer's own)."""
    make = trainer.get_train_dataloader

    def get_train_dataloader():
        collate, trainer.data_collator = trainer.data_collator, batches
        try:
            return make()
        finally:
            trainer.data_collator = collate

    trainer.get_train_dataloader = get_train_dataloader


def _draw_state(collate) -> dict[str, Any]:
    """The random states a collator may draw from (:class:`_TrainBatches`)."""
    import numpy as np
    import torch

    state: dict[str, Any] = {"global": capture_rng()}
    own = getattr(collate, "generator", None)
    if isinstance(own, torch.Generator):
        state["torch_generator"] = own.get_state()
    elif isinstance(own, np.random.Generator):
        state["numpy_generator"] = json.dumps(own.bit_generator.state)  # (128-bit integers)
    return state


def _put_draw_state(collate, state: dict[str, Any]) -> None:
    """Put back what :func:`_draw_state` kept: the global states, and the collator's generator
    (made where the collator makes its own lazily; unmade, to be made afresh, where it had none
    yet)."""
    import numpy as np
    import torch

    restore_rng(state["global"])
    own = getattr(collate, "generator", None)
    make = getattr(collate, "create_rng", None)
    if "torch_generator" in state or "numpy_generator" in state:
        if own is None and callable(make):
            make("pt" if "torch_generator" in state else "np")
            own = getattr(collate, "generator", None)
        if "torch_generator" in state and isinstance(own, torch.Generator):
            own.set_state(state["torch_generator"])
        elif "numpy_generator" in state and isinstance(own, np.random.Generator):
            own.bit_generator.state = json.loads(state["numpy_generator"])
    elif isinstance(own, (torch.Generator, np.random.Generator)) and callable(make):
        collate.generator = None  # made from its seed at its first batch, as it was then


def _draw_marks(collate, state: dict[str, Any] | None = None) -> tuple:
    """Where the global random streams and the collator's own generator are (now, or in ``state``)."""
    import torch

    if state is None:
        state = _draw_state(collate)
    own = state.get("torch_generator")
    return (_random_marks(state["global"]), bytes(own.numpy()) if isinstance(own, torch.Tensor) else None,
            state.get("numpy_generator"))


def _name(f) -> str:
    return f.__name__ if isinstance(getattr(f, "__name__", None), str) else type(f).__name__


def _random_marks(state: dict[str, Any]) -> tuple:
    """Where Python's, NumPy's and torch's global random streams are in ``state`` (:func:`capture_rng`)."""
    legacy = state.get("numpy")
    return (state.get("python"), None if legacy is None else (legacy[1].tobytes(), legacy[2]),
            bytes(state["torch"].numpy()) if "torch" in state else None)


_DISPLAYS = ("ProgressCallback", "PrinterCallback", "NotebookProgressCallback")  # their state is a display's


def _stateful(trainer: Trainer) -> dict[str, TrainerCallback]:
    """The Trainer's callbacks whose state goes with a checkpoint: all but this package's and the
    progress displays; keyed by place and type."""
    callbacks = [cb for cb in trainer.callback_handler.callbacks
                 if not isinstance(cb, ResilienceCallback) and type(cb).__name__ not in _DISPLAYS]
    return {f"{i}:{type(cb).__name__}": cb for i, cb in enumerate(callbacks)}


def _unsaved_callback_state(trainer: Trainer) -> str | None:
    """One line naming the callbacks' attributes that a checkpoint cannot hold, or None."""
    return unsaved_attributes(_stateful(trainer), "the Trainer's callbacks")


def _keep_effective_batch(trainer: Trainer, effective: int, run) -> None:
    """After ``--shrink trainer.args.per_device_train_batch_size``: raise the gradient accumulation
    so that an optimizer step takes the batch it took when the run began (the steps, the schedule
    and the samples of each step stay those of the run; the sums are made in smaller parts), and
    make the Trainer batch its data by the new size (it reads it once, when it is made)."""
    args = trainer.args
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if per_device * accumulation != effective:
        steps, kept = accumulation_for(per_device, effective)
        args.gradient_accumulation_steps = steps
        run.say_once(f"colab_resilience: the Trainer's batch is {per_device} per device now; gradient accumulation "
                     f"{accumulation} → {steps} {kept}")
    trainer._train_batch_size = args.train_batch_size


def _config(model) -> Any:
    """The model's ``PretrainedConfig``, or None."""
    from transformers import PretrainedConfig

    config = getattr(model, "config", None)
    return config if isinstance(config, PretrainedConfig) else None


def _output(state: TrainerState, returned: dict | None = None) -> TrainOutput:
    """The ``TrainOutput`` a finished ``train`` returned: with the metrics it returned where the
    checkpoint holds them, else those of its final log."""
    if returned is None:
        final = next((log for log in reversed(state.log_history) if "train_loss" in log), {})
        returned = {k: v for k, v in final.items() if k not in ("epoch", "step")}
    return TrainOutput(state.global_step, returned.get("train_loss", 0.0), dict(returned))


_original_train = getattr(Trainer.train, "__wrapped__", Trainer.train)  # imported again: wrapped once


@functools.wraps(_original_train)
def _train(self, resume_from_checkpoint=None, *args, **kwargs):
    callback = next((c for c in self.callback_handler.callbacks if isinstance(c, ResilienceCallback)), None)
    run = active_run()
    if callback is None or run is None:
        return _original_train(self, resume_from_checkpoint, *args, **kwargs)
    if resume_from_checkpoint:
        raise RunStoppedError(
            "colab_resilience: a Trainer with ResilienceCallback resumes from the run's own checkpoints; "
            "call trainer.train() without resume_from_checkpoint"
        )
    try:
        return callback.train(self, run, functools.partial(_original_train, self, *args, **kwargs))
    finally:
        # it belongs to this call: the cell adds a new one when it runs again (a retry), and the
        # Trainer would warn of two
        self.callback_handler.remove_callback(callback)
        # so does NEFTune's hook, which train() removes only where it returns: a retry added a
        # second, and the noise was added twice
        _without_neftune(self)


def _without_neftune(trainer: Trainer) -> None:
    """NEFTune's hook off the model's embedding, and its setting, as train()'s end leaves them."""
    handle = getattr(trainer, "neftune_hook_handle", None)
    if getattr(trainer, "neftune_noise_alpha", None) is None or handle is None:
        return
    from transformers.integrations.neftune import deactivate_neftune

    deactivate_neftune(trainer.model, handle, trainer.accelerator)


Trainer.train = _train
__all__ = ["ResilienceCallback"]
