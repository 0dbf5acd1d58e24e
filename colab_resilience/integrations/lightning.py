"""Lightning's ``Trainer.fit`` resumes where it stopped: one callback in a ``%%resilient`` cell.

    %%resilient
    from colab_resilience.integrations.lightning import ResilienceCallback
    trainer = L.Trainer(max_epochs=10, callbacks=[ResilienceCallback()])
    trainer.fit(model, train_loader)

Every epoch is a safe point, taken when the next epoch begins, once every callback and the module
have seen the epoch's end, its validation and its schedulers' step; and at the end of training.
With ``ResilienceCallback(every_steps=N)``, every N-th optimizer step is one too, taken when the
next batch begins (``--every`` and ``%restart_after`` count all of these). With every checkpoint,
beside the cell's ``--save`` names, goes what Lightning itself writes into a checkpoint of its
own: the module's ``state_dict``, the optimizers', the schedulers', the loops' progress, the state
of stateful callbacks (``ModelCheckpoint``, ``EarlyStopping``), the precision plugin's (a
``GradScaler``), the datamodule's; with them the plain attributes of the callbacks that have no
``state_dict`` (which Lightning checkpoints not at all), the random states (Python's, NumPy's, torch's) at the
safe point and when the epoch's data iterator was made, which drew its order, the module's
train/eval modes, the metrics, and within an epoch what ``self.log(..., on_epoch=True)`` has
gathered of it so far.

On resume the callback hands that checkpoint to the Trainer where it loads its own, so Lightning
restores it **into** the module and the optimizers that the replayed set-up cells and this fit
made, and starts at the first unfinished epoch, or within an epoch at the first unfinished batch:
the epoch's order is drawn again from the random state it was drawn from, the finished batches are
taken from the data iterator and dropped (loading them costs what loading them cost), and the
random state is then put back as it was before the next batch was loaded. What the hooks Lightning
runs again before the fit is back at the safe point change (``on_train_start``, an epoch's
``on_train_epoch_start``) goes back as the checkpoint holds it once it is there: the module's
modes, flags and plain attributes, the optimizers, the schedulers. A fit that had ended trains
nothing, and ``trainer.callback_metrics`` is what it was. A retry in the kernel that goes back to
the fit's start puts the callbacks back as they were then (the failed attempt had changed them),
and each ``ModelCheckpoint``'s last save (the step it saved at, which it does not save at twice)
is put back as the safe point holds it.

A resumed fit is identical to an uninterrupted one where Lightning is (on CPU; on a GPU with
``Trainer(deterministic=True)``), for training data whose order is drawn when an epoch begins
(a ``DataLoader`` over a dataset with a sampler, the usual case). Where that does not hold, the
callback says so once, in one line, before training starts: an ``IterableDataset``, whose order
the callback cannot put back; ``persistent_workers=True``, whose workers keep their random state
across epochs; a GPU fit without ``deterministic=True``; an attribute of a callback without a
``state_dict`` that is not a plain value.

After an out-of-memory retry with ``--shrink batch_size`` (the training ``DataLoader`` made in the
cell from that variable), ``accumulate_grad_batches`` is raised so that an optimizer step takes
the samples it took when the run began, and a retry that goes back within an epoch counts the
epoch's finished samples in batches of the new size.

A ``CSVLogger`` logs on into the version it logged into, and its ``metrics.csv`` holds every
row an uninterrupted fit's would: each checkpoint holds its version and the rows it logged so far
(up to 16 MiB of file), and the fit that resumes gives them to its logger's writer, which writes
the file anew with them. A ``ModelCheckpoint``'s files: each checkpoint holds the names of the
checkpoint files in its folder, and a file there that was saved after the safe point the fit goes
on from (by the kernel that died, or an attempt that failed in the kernel) is saved again under its own name
when the fit gets there, as the uninterrupted fit saved it (Lightning would give the new one
another name, ``-v1``); one line says so before training starts. Files that were there at the
safe point and that the callback's state does not name (another run's) keep Lightning's way: a
checkpoint saved under such a name gets ``-v1``, and one line names them. What is not put back:
other files. A ``TensorBoardLogger`` writes on where the new kernel's logger writes (give it a
fixed ``version`` to keep one folder).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import pickle
import warnings
import weakref
from typing import Any

import lightning.pytorch as pl
import torch

from .. import carried
from ..checkpoints import capture_rng, restore_rng
from ..errors import CheckpointError, RunStoppedError
from ..loops import active_run
from . import (accumulation_for, caller_locals, plain_attributes, put_attributes, require_loop, say_outside,
               unsaved_attributes)
from . import every_steps as check_every_steps

STATE = "lightning:fit"  # the checkpoint entry holding a fit's state


class FitCheckpoint:
    """What a Lightning fit carries from epoch to epoch, as a state dict: the Trainer's own
    checkpoint dictionary (``dump_checkpoint``), with the random states and the metrics. Loaded,
    it waits for the Trainer to restore it where it restores its own checkpoints."""

    label = "the Lightning module, its optimizers, schedulers, loops and callbacks"  # what a resume says

    def __init__(self, trainer: pl.Trainer):
        self.trainer = trainer
        self.finished = False  # fit ended: a resume trains nothing
        self.mid_epoch = False  # the safe point being taken lies between two batches of an epoch
        self.epoch_rng: dict | None = None  # the random state as the epoch's data iterator was made
        self.fetch_rng: dict | None = None  # the random state before the batch in progress was fetched
        self.loaded: dict[str, Any] | None = None
        # the samples of an optimizer step as the run began (batch x accumulation): after a
        # --shrink of the batch size, the accumulation is raised to keep it
        self.effective_batch: int | None = None
        # loaded: the plain attributes of the callbacks that Lightning does not checkpoint, to be put
        # back where the safe point was taken (as an epoch began, or a batch within one)
        self.callbacks_pending: dict[str, dict] = {}
        self.module_pending: dict[str, Any] = {}  # loaded: the module's plain attributes, put back with them
        self.callbacks_mid_epoch = False
        self.muted: list = []  # loaded: the CSV loggers' writers, which log nothing until the fit is back
        # loaded: the checkpoint files in each ModelCheckpoint's folder at the safe point (None: not
        # loaded, or by an earlier version), for the fit's start (_saved_before)
        self.files_at_safe_point: dict[str, list[str]] | None = None
        self.saves_at_safe_point: dict[str, list] | None = None  # loaded: ModelCheckpoints' last saves
        # the module's tensors' dtypes as the fit began, before the Trainer's precision converts it
        # ("bf16-true", "64-true"): what a resumed fit's set-up must have built again
        self.dtypes = carried.dtypes(trainer.lightning_module)

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        checkpoint = t._checkpoint_connector.dump_checkpoint(weights_only=False)
        # the states of the module's torchmetrics metrics (a sum over the fit, an epoch's mean so
        # far), which its state_dict leaves out: a resume reset them
        checkpoint["state_dict"] = carried.with_module_states(t.lightning_module, checkpoint["state_dict"])
        return {
            "checkpoint": checkpoint,
            # the state the fit goes on from: between two epochs, what the next one's order is drawn
            # from; within one, the state before the next batch was fetched (a fetch may draw)
            "rng": self.fetch_rng if self.mid_epoch else capture_rng(),
            "epoch_rng": self.epoch_rng if self.mid_epoch else None,
            "position": self.position(),
            # its train/eval modes and requires_grad flags, which no state_dict holds (a fit that failed
            # in its validation leaves the module in eval mode, and Lightning does not change it back)
            "carried": carried.snapshot({"module": t.lightning_module}, ["module"]),
            "metrics": {name: dict(getattr(t._logger_connector, name))
                        for name in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")},
            # within an epoch: what self.log(..., on_epoch=True) has gathered of it so far (no
            # checkpoint of Lightning's holds it), pickled: an object of Lightning's own
            "results": _dump_results(t) if self.mid_epoch else None,
            # the callbacks without a state of their own for Lightning to checkpoint: their plain attributes
            "callbacks": {key: plain_attributes(cb)[0] for key, cb in _plain_callbacks(t).items()},
            # the module's own plain attributes (a list of the losses it logged), which no state_dict holds
            "module": _module_attributes(t.lightning_module)[0],
            "finished": self.finished,
            # a fit that a callback stopped (EarlyStopping): no checkpoint of Lightning's holds the
            # flag, and a fit restored from one goes on where it had ended
            "should_stop": t.should_stop,
            "dtypes": self.dtypes,
            "effective_batch": self.effective_batch,
            # each CSVLogger's version and the rows it logged so far: its file is written from what
            # its writer holds, which a new writer (a resumed kernel's, a retried fit's) has not
            "csv_logs": _csv_logs(t),
            # the checkpoint files in each ModelCheckpoint's folder: those a resumed fit finds there
            # and not among these were saved after the safe point, and are saved again under their names
            "checkpoint_files": _checkpoint_files(t),
            # what each ModelCheckpoint keeps outside its state_dict of its last save: the step it
            # saved at, which it does not save at twice (an attempt that failed after a save left
            # it at a step the retry saves at again), and the file; and the score it last checked,
            # which its state_dict holds and its load_state_dict does not put back
            "checkpoint_saves": {str(place): [cb._last_global_step_saved, cb._last_checkpoint_saved, _score_held(cb)]
                                 for place, cb in _model_checkpoints(t)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        module = self.trainer.lightning_module
        # Lightning's load_state_dict would convert another dtype's weights (model.double() in a
        # plain cell), and the fit go on in this one (a checkpoint of an earlier version: unchecked)
        saved = state["checkpoint"]["state_dict"]
        refused = state.get("dtypes") is not None and carried.refusal(
            f"the {type(module).__name__} module", module, carried.as_built(saved, state["dtypes"], self.dtypes))
        if refused:
            raise CheckpointError(refused)
        self.loaded = state
        self.finished = bool(state["finished"])
        self.effective_batch = state.get("effective_batch") or self.effective_batch
        self.callbacks_pending = dict(state.get("callbacks") or {})
        self.module_pending = dict(state.get("module") or {})
        self.callbacks_mid_epoch = bool(state["position"]["mid_epoch"])

    def give_callbacks(self) -> list[str]:
        """Put the loaded attributes back into the fit's callbacks that Lightning does not
        checkpoint; returns those saved that this fit does not have at that place."""
        pending, self.callbacks_pending = self.callbacks_pending, {}
        module, self.module_pending = self.module_pending, {}
        put_attributes({"module": module}, {"module": self.trainer.lightning_module})
        return put_attributes(pending, _plain_callbacks(self.trainer))

    def position(self) -> dict[str, Any]:
        """Where the fit goes on: its epoch, its optimizer steps, the epoch's finished batches."""
        if self.loaded is not None:
            return self.loaded["position"]
        t = self.trainer
        batches = t.fit_loop.epoch_loop.batch_progress.current.completed if self.mid_epoch else 0
        return {"epoch": t.current_epoch, "step": t.global_step, "batches": batches, "mid_epoch": self.mid_epoch,
                "batch_size": _batch_size(t)}


class Stretches:
    """The stretches of a fit between two safe points (epochs, or every N steps), as the cell's
    loop iterates them, until it has ended; named by where they begin, epochs as Lightning counts
    them (from 0), steps from 1."""

    def __init__(self, state: FitCheckpoint):
        self.state = state

    def __iter__(self):
        index = 0
        while not self.state.finished:
            yield index
            index += 1

    def describe(self, index: int) -> str:
        if self.state.finished:
            return "the end"
        at = self.state.position()
        return f"step {at['step'] + 1} of epoch {at['epoch']}" if at["mid_epoch"] else f"epoch {at['epoch']}"


class ResilienceCallback(pl.Callback):
    """Make the epochs of ``Trainer.fit`` safe points of the ``%%resilient`` cell it runs in, and
    resume ``fit`` where the last one was (see the module documentation). Outside a
    ``%%resilient`` cell it does nothing.

    ``every_steps``: a safe point every that many optimizer steps too, not only at each epoch's end
    (a resume then loses at most that many steps; each save costs what saving the module and the
    optimizers costs, and a resume within an epoch loads the epoch's finished batches again)."""

    def __init__(self, every_steps: int | None = None):
        super().__init__()
        self.every_steps = check_every_steps(every_steps)
        self._epochs = None  # the cell's loop over this fit's stretches (Loops.iterate)
        self._state: FitCheckpoint | None = None
        self._first: int | None = None  # the stretch this fit starts at, until its first epoch has begun
        self._run = None
        self._pending = False  # every_steps: a step is due a safe point, taken when the next batch begins
        self._stepped_at: int | None = None  # the optimizer step whose safe point is due or taken
        self._resumed_within = False  # this fit resumed within an epoch, which has not ended yet
        self._put_back: dict | None = None  # resumed: the saved optimizers, schedulers and module facts, until back

    # ------------------------------------------------------------------------------- events

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Before the Trainer restores a checkpoint: start the cell's loop, and on resume hand it ours."""
        _undo_data_patches()  # an attempt before this one may have failed while Lightning made its data
        if stage != "fit":
            return
        run = active_run()
        if run is None:
            say_outside("lightning")
            return
        require_loop(run, "epochs", "callbacks=[ResilienceCallback()]")
        if caller_locals("_run", trainer).get("ckpt_path"):
            raise RunStoppedError(
                "colab_resilience: a fit with ResilienceCallback resumes from the run's own checkpoints; call "
                "trainer.fit() without ckpt_path"
            )
        self._run = run
        self._state = state = FitCheckpoint(trainer)
        batch = _batch_size(trainer)
        state.effective_batch = batch * trainer.accumulate_grad_batches if batch else None
        run.extras[STATE] = state
        self._pending, self._put_back = False, None
        self._epochs = run.loops.iterate(Stretches(state))
        self._first = next(self._epochs, None)  # a resumed run: the checkpoint is loaded here
        _keep_effective_batch(trainer, batch, state.effective_batch, run)
        state.files_at_safe_point = None if state.loaded is None else state.loaded.get("checkpoint_files")
        state.saves_at_safe_point = None if state.loaded is None else state.loaded.get("checkpoint_saves")
        if state.loaded is not None:
            state.muted = _put_csv_logs(trainer, state.loaded.get("csv_logs"), mute=self._first != 0)
            saved = state.loaded["checkpoint"]
            saved["state_dict"] = carried.put_module_states(pl_module, saved["state_dict"])
            carried.apply({"module": pl_module}, ["module"], state.loaded["carried"])
        if state.loaded is not None and self._first == 0:  # saved as the fit began: its module as it was
            pl_module.load_state_dict(state.loaded["checkpoint"]["state_dict"])
            # and its callbacks as they were: an attempt that failed in this kernel before the first
            # epoch's safe point had changed them (the losses a callback keeps, EarlyStopping's count,
            # ModelCheckpoint's best), and the fit starts over with them
            from lightning.pytorch.trainer.call import _call_callbacks_load_state_dict

            _call_callbacks_load_state_dict(trainer, state.loaded["checkpoint"])
            state.give_callbacks()  # those without a state of Lightning's: their plain attributes, and the module's
            state.loaded = None
        elif state.loaded is not None:
            _resume(trainer, state)
            # what the hooks that run again before the fit is back at the safe point may change
            self._put_back = {"optimizers": saved.get("optimizer_states") or [],
                              "schedulers": saved.get("lr_schedulers") or [], "carried": state.loaded["carried"]}
        _watch_data(trainer, state, self.every_steps is not None)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epochs is None:
            return
        # the step the fit starts (or resumes) at has its safe point already: the next is due after
        # an optimizer step (with accumulate_grad_batches, the batches of a window before its step
        # leave global_step as it was, and their gradients are in no checkpoint)
        self._stepped_at = trainer.global_step
        for line in _inexact(trainer):  # the training data is loaded now: what it is
            self._run.say_once(line)
        for line in _saved_before(trainer, self._state.files_at_safe_point):
            self._run.say_once(line)
        _put_saves(trainer, self._state.saves_at_safe_point)
        self._state.files_at_safe_point = self._state.saves_at_safe_point = None
        unsaved = unsaved_attributes(_plain_callbacks(trainer), "the fit's callbacks without a state_dict")
        if unsaved:
            self._run.say_once(unsaved)
        left = _module_attributes(pl_module)[1]
        if left:
            self._run.say_once(
                f"colab_resilience: the plain attributes of the {type(pl_module).__name__} module go with each "
                f"checkpoint, but not {', '.join(left)} (not plain values or tensors): after a resume they hold what the module "
                "has in this kernel")
        loaded = self._state.loaded
        if loaded is not None:  # restored: the copy the Trainer loaded from goes
            _put_metrics(trainer, loaded["metrics"])  # as the callbacks saw them at the safe point
            if loaded["position"]["mid_epoch"]:  # within the epoch: its finished batches are dropped
                self._resumed_within = True
                trainer.fit_loop.epoch_loop._results = _load_results(trainer, loaded["results"])
                trainer._logger_connector._first_loop_iter = True  # the next batch is not the epoch's first
                iterator = trainer.fit_loop._data_fetcher.iterator
                for _ in range(_batches_done(trainer, loaded["position"])):
                    next(iterator)
                restore_rng(loaded["rng"])
            self._state.loaded = None
            _reloaded_as_before(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epochs is None:
            return
        self._pending = False  # the epoch's end is the safe point
        if self._first is not None:
            self._first = None
            if not self._state.callbacks_mid_epoch:  # resumed as this epoch began: where it was saved
                self._put_state_back(trainer, pl_module)
                self._give_callbacks()
            return
        next(self._epochs, None)  # the safe point of the epoch that ended: saves when due, may restart

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._resumed_within:
            # Lightning does not step a ReduceLROnPlateau at the end of an epoch it resumed within
            # (the epoch's metrics are in no checkpoint of its own): they are in ours, complete, and
            # the uninterrupted fit stepped it (its step count lagged one, its learning rate too)
            self._resumed_within = False
            trainer.fit_loop._restarting = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if self._epochs is not None and self.every_steps is not None and trainer.global_step % self.every_steps == 0 \
                and trainer.global_step != self._stepped_at:
            self._stepped_at = trainer.global_step
            self._pending = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch,
                             batch_idx: int) -> None:
        if self._epochs is None:
            return
        self._first = None  # a fit resumed within an epoch begins here
        self._put_state_back(trainer, pl_module)
        self._give_callbacks()  # (resumed between two batches: where it was saved)
        if self._pending:  # every callback has seen the step's end, and validation has run
            self._pending = False
            self._state.mid_epoch = True
            try:
                next(self._epochs, None)
            finally:
                self._state.mid_epoch = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epochs is None:
            return
        self._give_callbacks()  # a fit that had ended: as its end left them
        self._state.finished = True
        next(self._epochs, None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        state = self._state
        if self._epochs is not None and state.loaded is not None and state.loaded["finished"]:
            _put_metrics(trainer, state.loaded["metrics"])  # a fit that had ended trained nothing
            self._give_callbacks()  # (where its on_train_end did not run)
            _put_saves(trainer, state.loaded.get("checkpoint_saves"))  # nor its on_train_start
            # and the random state as the fit left it at its end: what this fit drew on its way here,
            # though it trained nothing, is not what that fit drew, and the cells after this one
            # draw on from it (a shuffle of the next fit's, killed before its first checkpoint)
            restore_rng(state.loaded["rng"])
        self._close(trainer)
        if state is not None:
            state.loaded = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        _undo_data_patches()
        self._close(trainer)

    def _put_state_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A resumed fit is back where its safe point was taken (in this callback's hook as an epoch
        began, or a batch within one): the hooks that ran again since Lightning restored the
        checkpoint may have changed what it holds (a callback's ``on_train_start`` that freezes a
        layer, an ``on_train_epoch_start`` that scales the learning rate, which had run before the
        safe point): the module's modes, ``requires_grad`` flags and plain attributes, the
        optimizers and the schedulers go back to the safe point's."""
        saved, self._put_back = self._put_back, None
        if saved is None:
            return
        carried.apply({"module": pl_module}, ["module"], saved["carried"])
        optimizers, schedulers = trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs]
        if len(optimizers) == len(saved["optimizers"]):
            for optimizer, state in zip(optimizers, saved["optimizers"]):
                optimizer.load_state_dict(state)
        if len(schedulers) == len(saved["schedulers"]):
            for scheduler, state in zip(schedulers, saved["schedulers"]):
                scheduler.load_state_dict(state)

    def _give_callbacks(self) -> None:
        """The callbacks that Lightning does not checkpoint get the plain attributes they had at the
        safe point, where it was taken (their hooks before this callback's had run then too);
        what the checkpoint holds for a callback this fit does not have is said once."""
        if self._state is not None:
            muted, self._state.muted = self._state.muted, []
            _unmute(muted)
        if self._state is None or not (self._state.callbacks_pending or self._state.module_pending):
            return
        missing = self._state.give_callbacks()
        if missing and self._run is not None:
            self._run.say_once(f"colab_resilience: the checkpoint holds the state of {', '.join(missing)}, which this "
                               "fit does not have at that place in its callbacks; that state was not put back")

    def _close(self, trainer: pl.Trainer) -> None:
        if self._state is not None:
            muted, self._state.muted = self._state.muted, []
            _unmute(muted)
        if self._epochs is not None:
            self._epochs.close()
            self._epochs = self._first = self._run = None
        for owner, names in ((trainer._checkpoint_connector, ("resume_start", "restore_loops")),
                             (trainer.fit_loop, ("_load_combined_loader_states",)),
                             (trainer.fit_loop.epoch_loop, ("on_run_start", "advance", "reset"))):
            for name in names:
                vars(owner).pop(name, None)


def _module_attributes(module: pl.LightningModule) -> tuple[dict, list[str]]:
    """The module's own public attributes that are plain values (a list it appends each step's
    loss to, a counter), copied, and the names of its other public ones (not saved); its
    parameters, buffers and submodules are in its state_dict, its modes in ``carried``, and
    Lightning's own attributes are private."""
    kept, left = plain_attributes(module)
    # a tensor attribute goes with its state dict (carried.unsaved_tensors)
    keep = {name: value for name, value in kept.items()
            if not name.startswith("_") and name != "training" and not isinstance(value, torch.Tensor)}
    return keep, [name for name in left if not name.startswith("_")]


def _plain_callbacks(trainer: pl.Trainer) -> dict[str, pl.Callback]:
    """The fit's callbacks whose state no checkpoint of Lightning's holds (they have no
    ``state_dict`` of their own), but for this package's and the progress bars; keyed by place
    and type. Their plain attributes go with each checkpoint."""
    from lightning.pytorch.callbacks import ProgressBar

    callbacks = [cb for cb in trainer.callbacks
                 if not isinstance(cb, (ResilienceCallback, ProgressBar)) and type(cb).state_dict is pl.Callback.state_dict]
    return {f"{i}:{type(cb).__name__}": cb for i, cb in enumerate(callbacks)}


def _undo_data_patches() -> None:
    """Put back what Lightning patches into ``DataLoader`` and ``BatchSampler`` (and their
    subclasses) while it makes a fit's data, where an error left it patched.

    Lightning wraps their ``__init__``, ``__setattr__`` and ``__delattr__`` (keeping the originals
    as ``__old__init__`` etc.) in a context manager that puts them back only when its body returns:
    an out-of-memory error raised in there (in a ``train_dataloader`` hook, or anywhere in that
    stretch) leaves them wrapped for good. Every data loader made or changed afterwards, the user's
    own ones too, then records its arguments and attributes (``__pl_saved_args``,
    ``__pl_attrs_record``), so a retried fit leaves them other than an uninterrupted one, and a
    second failure wraps the wrappers."""
    from torch.utils.data import BatchSampler, DataLoader

    for base in (DataLoader, BatchSampler):
        classes, todo = {base}, [base]
        while todo:
            for sub in todo.pop().__subclasses__():
                if sub not in classes:
                    classes.add(sub)
                    todo.append(sub)
        for cls in classes:
            for name in ("__setattr__", "__delattr__", "__init__"):
                old = f"__old{name}"
                if old in vars(cls):
                    setattr(cls, name, vars(cls)[old])
                    delattr(cls, old)


def _batch_size(trainer: pl.Trainer) -> int | None:
    """The batch size of the DataLoader handed to this fit for training (None: another source)."""
    loader = getattr(trainer.fit_loop._data_source, "instance", None)
    size = getattr(loader, "batch_size", None) if isinstance(loader, torch.utils.data.DataLoader) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _keep_effective_batch(trainer: pl.Trainer, batch: int | None, effective: int | None, run) -> None:
    """After ``--shrink`` of the training batch size: raise ``accumulate_grad_batches`` so that an
    optimizer step takes the samples it took when the run began (the same steps, schedule and data
    order; the sums made in smaller parts)."""
    accumulation = trainer.accumulate_grad_batches
    if not batch or not effective or batch * accumulation == effective:
        return
    steps, kept = accumulation_for(batch, effective)
    trainer.accumulate_grad_batches = steps
    run.say_once(f"colab_resilience: the fit's batch is {batch} now; accumulate_grad_batches {accumulation} → {steps} "
                 f"{kept}")


def _batches_done(trainer: pl.Trainer, position: dict) -> int:
    """The epoch's finished batches, in batches of the size the fit has now: a --shrink since the
    safe point (within an epoch) counts its samples in smaller batches, and the loops' counts of
    the epoch's batches (which accumulation and the epoch's end go by) are made to agree."""
    done, before, now = position["batches"], position.get("batch_size"), _batch_size(trainer)
    if not before or not now or before == now:
        return done
    if done * before % now:
        raise RunStoppedError(
            f"colab_resilience: the fit's batch is {now} now, and the {done * before} samples of the epoch it "
            f"finished before its safe point are not a whole number of such batches, so it cannot go on within that "
            "epoch; shrink the batch by a factor that divides it (--shrink NAME=0.5)")
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for name in ("ready", "started", "processed", "completed"):
        old = getattr(progress.current, name)
        new = old * before // now
        setattr(progress.current, name, new)
        setattr(progress.total, name, getattr(progress.total, name) + new - old)
    return done * before // now


def _resume(trainer: pl.Trainer, state: FitCheckpoint) -> None:
    """For this fit, the Trainer restores from this package's checkpoint where it restores from a
    file of its own, and goes on as it went on when the checkpoint was taken."""
    loaded = state.loaded
    connector, fit_loop = trainer._checkpoint_connector, trainer.fit_loop

    def resume_start(checkpoint_path=None, weights_only=None):
        connector._ckpt_path = None  # no file: nothing to name when it is done
        connector._loaded_checkpoint = loaded["checkpoint"]
        # Lightning loads the module before its precision converts it: saved as "64-true" made it,
        # into the float32 module the set-up cells built, the weights would lose their low bits
        carried.in_saved_dtypes(trainer.lightning_module, loaded["checkpoint"]["state_dict"])

    epoch_loop = fit_loop.epoch_loop
    mid_epoch = loaded["position"]["mid_epoch"]

    def restore_loops():
        type(connector).restore_loops(connector)
        trainer.should_stop = bool(loaded.get("should_stop"))
        if state.finished:
            pass
        elif mid_epoch:
            # taken as the next batch began, fetched: as the loops stood between the two batches (the
            # epoch goes on as Lightning's own restart after a batch's end and its validation does)
            for progress in (epoch_loop.batch_progress.total, epoch_loop.batch_progress.current):
                progress.ready -= 1
        else:
            # taken as the epoch began: as the loops stood between that epoch and the one before,
            # going on as they went on then (not as Lightning's restart from a checkpoint of its own)
            for progress in (fit_loop.epoch_progress.total, fit_loop.epoch_progress.current):
                progress.ready -= 1
            fit_loop.restarting = False
        # no sanity check: the validation it runs (and the progress it resets) is the fit's start's
        epoch_loop.val_loop.restarting = True

    def reset():
        vars(epoch_loop).pop("reset", None)
        with warnings.catch_warnings():  # the dataloader "is not resumable": its batches are skipped here
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
            type(epoch_loop).reset(epoch_loop)

    connector.resume_start = resume_start
    connector.restore_loops = restore_loops
    if mid_epoch:
        epoch_loop.reset = reset


class _ResultsPickler(pickle.Pickler):
    """Pickles an epoch's ``_ResultCollection`` with the Trainer's strategy by reference: each
    metric's reduction is a method of the strategy, and a copy of it would make the metric's
    description differ from the one ``self.log`` gives (Lightning refuses that)."""

    def __init__(self, file, strategy):
        super().__init__(file)
        self.strategy = strategy

    def persistent_id(self, obj):
        return "strategy" if obj is self.strategy else None


class _ResultsUnpickler(pickle.Unpickler):
    def __init__(self, file, strategy):
        super().__init__(file)
        self.strategy = strategy

    def persistent_load(self, pid):
        if pid != "strategy":
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        return self.strategy


def _dump_results(trainer: pl.Trainer) -> bytes:
    buffer = io.BytesIO()
    _ResultsPickler(buffer, trainer.strategy).dump(trainer.fit_loop.epoch_loop._results)
    return buffer.getvalue()


def _load_results(trainer: pl.Trainer, data: bytes):
    return _ResultsUnpickler(io.BytesIO(data), trainer.strategy).load()


def _put_metrics(trainer: pl.Trainer, metrics: dict) -> None:
    """``trainer.callback_metrics`` (and the logged and progress-bar metrics) as they were saved."""
    for name, values in metrics.items():
        setattr(trainer._logger_connector, name, dict(values))


def _watch_data(trainer: pl.Trainer, state: FitCheckpoint, steps: bool) -> None:
    """Keep the random state as each epoch's data iterator is made (its order is drawn then), and,
    with safe points within epochs (``steps``), before each batch is fetched; on resume, put the
    saved state back just before the first epoch's iterator is made."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    loaded = state.loaded

    def load_combined_loader_states():  # the data iterator is made next (setup_data)
        type(fit_loop)._load_combined_loader_states(fit_loop)
        nonlocal loaded
        if loaded is not None:  # once: the first epoch of a resumed fit
            at = loaded["position"]
            restore_rng(loaded["epoch_rng"] if at["mid_epoch"] else loaded["rng"])
            loaded = None
        state.epoch_rng = capture_rng()

    def on_run_start(data_fetcher):
        if trainer.current_epoch > 0 and not fit_loop.is_resuming and not epoch_loop.restarting:
            state.epoch_rng = capture_rng()  # the iterator is made again: the epoch's order is drawn
        type(epoch_loop).on_run_start(epoch_loop, data_fetcher)

    def advance(data_fetcher):
        state.fetch_rng = capture_rng()
        type(epoch_loop).advance(epoch_loop, data_fetcher)

    fit_loop._load_combined_loader_states = load_combined_loader_states
    epoch_loop.on_run_start = on_run_start
    if steps:
        epoch_loop.advance = advance


def _reloaded_as_before(trainer: pl.Trainer) -> None:
    """The epoch at which the data loaders were last made, as an uninterrupted fit has it (they
    were made at epoch 0, and again every ``reload_dataloaders_every_n_epochs``), not the epoch
    the resumed fit made them at: when they are made again depends on it."""
    every, epoch = trainer.reload_dataloaders_every_n_epochs, trainer.current_epoch
    last = epoch - epoch % every if every else 0
    trainer.fit_loop._last_train_dl_reload_epoch = last
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    if val_loop._last_val_dl_reload_epoch != float("-inf"):  # made already
        val_loop._last_val_dl_reload_epoch = last


def _model_checkpoints(trainer: pl.Trainer):
    """``(place, callback)`` for each ``ModelCheckpoint`` of the Trainer, by its place among the
    Trainer's checkpoint callbacks."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [(place, cb) for place, cb in enumerate(trainer.checkpoint_callbacks) if isinstance(cb, ModelCheckpoint)]


def _checkpoint_folders(trainer: pl.Trainer):
    """``(place, callback, folder, names)`` for each ``ModelCheckpoint`` of the Trainer with a
    folder: its place and the checkpoint files there (none where the folder is not made yet)."""
    for place, callback in _model_checkpoints(trainer):
        folder = getattr(callback, "dirpath", None)
        if folder:
            yield place, callback, folder, sorted(name for name in os.listdir(folder)
                                                  if name.endswith(callback.FILE_EXTENSION)) if os.path.isdir(folder) else []


def _put_saves(trainer: pl.Trainer, saves: dict[str, list] | None) -> None:
    """Each ``ModelCheckpoint``'s last save and last checked score as at the safe point the fit
    goes on from (``saves``, its checkpoint's): Lightning's ``load_state_dict`` leaves them as they
    are (where an attempt that failed in this kernel had saved after the safe point, the callback
    would not save at that step again; a fit that had ended, resumed, would end with no score
    checked, where it had its last epoch's)."""
    for place, callback in _model_checkpoints(trainer):
        saved = (saves or {}).get(str(place))
        if saved is not None:
            callback._last_global_step_saved, callback._last_checkpoint_saved = saved[:2]
            if len(saved) > 2:  # (a checkpoint of an earlier version has no score)
                callback.current_score = _score_from(callback, saved[2])


def _score_held(callback) -> dict[str, Any]:
    """A ``ModelCheckpoint``'s last checked score, as it holds it: where the check found it among
    the best, it is the very tensor its best score (or one of its best k) is, and a resume makes it
    that one again (its ``state_dict`` holds them once); else its value."""
    current = callback.current_score
    if current is not None:
        if current is callback.best_model_score:
            return {"same_as": "best"}
        for path, score in callback.best_k_models.items():
            if current is score:
                return {"same_as": "best_k", "path": path}
    return {"value": current}


def _score_from(callback, held: dict[str, Any]) -> Any:
    """The score :func:`_score_held` kept, in ``callback`` with its state loaded."""
    if held.get("same_as") == "best":
        return callback.best_model_score
    if held.get("same_as") == "best_k" and held.get("path") in callback.best_k_models:
        return callback.best_k_models[held["path"]]
    return held.get("value")


def _checkpoint_files(trainer: pl.Trainer) -> dict[str, list[str]]:
    """The checkpoint files in each ``ModelCheckpoint``'s folder, by the callback's place (a safe
    point's: what :func:`_saved_before` compares with)."""
    return {str(place): names for place, _, _, names in _checkpoint_folders(trainer)}


def _saved_before(trainer: pl.Trainer, at_safe_point: dict[str, list[str]] | None) -> list[str]:
    """Checkpoint files in a ``ModelCheckpoint``'s folder that its state (restored, or new) does not
    name, one line per folder. Those that were not there at the safe point the fit goes on from
    (``at_safe_point``, the names its checkpoint holds; None for a fit that begins, or a checkpoint
    of an earlier version) were saved after it (by the kernel that died, or a failed attempt): the
    epoch trained again saves each of them again under its name, as the uninterrupted fit did
    (:func:`_save_again`), where Lightning, finding the file there, would give the new one another
    name (``-v1``). The others are another run's: a checkpoint saved under such a name gets ``-v1``."""
    out = []
    for place, callback, folder, names in _checkpoint_folders(trainer):
        known = {os.path.abspath(p) for p in [*callback.best_k_models, callback.best_model_path,
                                              callback.last_model_path, callback.kth_best_model_path] if p}
        later = [name for name in names if os.path.abspath(os.path.join(folder, name)) not in known]
        listed = None if at_safe_point is None else at_safe_point.get(str(place))
        again = [] if listed is None else [name for name in later if name not in listed]
        others = [name for name in later if name not in again]
        if again:
            _save_again(callback, {os.path.abspath(os.path.join(folder, name)) for name in again})
            out.append(f"colab_resilience: ModelCheckpoint's folder {folder} holds {', '.join(again)}, saved after "
                       "the safe point the fit goes on from; the fit saves "
                       f"{'it' if len(again) == 1 else 'them'} again under {'its name' if len(again) == 1 else 'their names'} "
                       "when it gets there, as an uninterrupted fit did (not as -v1)")
        if others:
            who = ("an earlier kernel did, after the safe point the fit goes on from, or another run" if listed is None
                   else "another run did")
            out.append(f"colab_resilience: ModelCheckpoint's folder {folder} holds {', '.join(others)}, which this fit "
                       f"did not save ({who}); a checkpoint saved again under a name there gets another name (-v1), "
                       "so the file names differ from an uninterrupted fit's (the weights do not)")
    return out


# ModelCheckpoint -> the paths it takes for files that are not there (:func:`_save_again`); kept
# here, not on the callback, whose attributes are what it is (colab-resilience check compares them)
_AGAIN: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()


def _save_again(callback, paths: set[str]) -> None:
    """Have ``callback`` (a ``ModelCheckpoint``) take each of ``paths`` for a file that is not there
    the first time it asks (as it picks the name of a checkpoint it is about to save): the new file
    is saved over it under its name, not as ``-v1``. Asked again, the file is there: a second save
    under that name in the same fit gets ``-v1``, as in an uninterrupted fit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _AGAIN[callback] = set(paths)
    exists = ModelCheckpoint.file_exists
    if getattr(exists, "_colab_resilience", False):
        return

    def file_exists(self, filepath, trainer) -> bool:
        again = _AGAIN.get(self)
        path = os.path.abspath(os.fspath(filepath))
        if again and path in again:
            again.discard(path)
            return False
        return exists(self, filepath, trainer)

    file_exists._colab_resilience = True
    ModelCheckpoint.file_exists = file_exists


CSV_LOG_BUDGET = 16 << 20  # bytes of a CSVLogger's file read at a safe point: a larger one is not kept


def _csv_rows_kept() -> bool:
    """Whether this Lightning's CSV writer empties its rows once it has written them to its file
    (which it appends to): then the rows of a log are its file's and the writer's."""
    writer = getattr(getattr(pl.loggers, "csv_logs", None), "ExperimentWriter", None)
    return writer is not None and callable(getattr(writer, "_record_new_keys", None))


def _csv_logs(trainer: pl.Trainer) -> dict[str, Any]:
    """For each ``CSVLogger`` of the Trainer, by its place among its loggers: its version and
    every row it has logged (those its file holds, read, and those its writer holds to write); None
    where its file is larger than :data:`CSV_LOG_BUDGET`."""
    out: dict[str, Any] = {}
    if not _csv_rows_kept():
        return out
    for i, logger in enumerate(getattr(trainer, "loggers", None) or []):
        if not isinstance(logger, pl.loggers.CSVLogger):
            continue
        writer, rows = getattr(logger, "_experiment", None), []
        if writer is not None:
            path = writer.metrics_file_path
            try:
                if os.path.getsize(path) > CSV_LOG_BUDGET:
                    out[str(i)] = None
                    continue
                with open(path, newline="") as f:
                    rows = list(csv.DictReader(f))
            except FileNotFoundError:
                pass
            rows += [dict(row) for row in writer.metrics]
        out[str(i)] = {"version": logger.version, "rows": rows}
    return out


def _put_csv_logs(trainer: pl.Trainer, saved: Any, mute: bool) -> list:
    """Give each ``CSVLogger`` of this fit what :func:`_csv_logs` saved at the safe point: its
    version (a resumed kernel's would take the next one: the folder the Trainer made for it as the
    fit began goes, while nothing is in it), and a new writer holding every row logged until then. Lightning's writer, made for a folder it finds written, empties the file
    (as it does for any new logger there), and its next save writes all the rows: the file is the
    uninterrupted run's, and so are the rows the fit logs from here on. ``mute``: the writers log
    nothing until the fit is back where the safe point was taken (:func:`_unmute`): what the hooks
    before it log again (a LearningRateMonitor as an epoch begins) is among the saved rows.
    Returns the writers muted."""
    muted = []
    loggers = getattr(trainer, "loggers", None) or []
    for key, log in (saved or {}).items() if isinstance(saved, dict) else ():
        index = int(key)
        if not isinstance(log, dict) or index >= len(loggers) or not isinstance(loggers[index], pl.loggers.CSVLogger):
            continue
        logger = loggers[index]
        # the Trainer made a writer as the fit began, in the next version's new folder where none was given
        made = getattr(getattr(logger, "_experiment", None), "log_dir", None)
        logger._version, logger._experiment = log["version"], None
        with warnings.catch_warnings():  # "Previous log files in this directory will be deleted": they come back
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            writer = logger.experiment
        writer.metrics = [dict(row) for row in log["rows"]]
        if made and os.path.abspath(made) != os.path.abspath(writer.log_dir):
            with contextlib.suppress(OSError):  # (only while empty: nothing was written in it)
                os.rmdir(made)
        if mute:
            writer.log_metrics = lambda metrics, step=None: None
            muted.append(writer)
    return muted


def _unmute(writers: list) -> None:
    for writer in writers:
        vars(writer).pop("log_metrics", None)


def _inexact(trainer: pl.Trainer) -> list[str]:
    """Why a resumed fit would not be identical to an uninterrupted one, one line each."""
    out = []
    combined = trainer.fit_loop._combined_loader
    loaders = list(combined.flattened) if combined is not None else []
    if any(isinstance(getattr(dl, "dataset", None), torch.utils.data.IterableDataset) for dl in loaders) or any(
            not isinstance(dl, torch.utils.data.DataLoader) for dl in loaders):
        out.append("colab_resilience: fit reads its training data from an iterable whose order the callback cannot "
                   "put back: a resumed fit is identical to an uninterrupted one only if each epoch's batches do not "
                   "depend on the epochs before it")
    if any(getattr(dl, "persistent_workers", False) for dl in loaders):
        out.append("colab_resilience: the training DataLoader has persistent_workers=True, whose workers keep their "
                   "random state from epoch to epoch, so a resumed fit is not identical to an uninterrupted one; "
                   "drop persistent_workers for an exact resume")
    for logger in getattr(trainer, "loggers", None) or []:
        if isinstance(logger, pl.loggers.CSVLogger) and not _csv_rows_kept():
            out.append(f"colab_resilience: the Trainer's CSVLogger writes {os.path.join(logger.log_dir, 'metrics.csv')} "
                       "from what it logged in its own kernel, and this version of Lightning keeps every row in it: "
                       "after a restart the kernel that resumes writes only the steps from the resume on; the model and "
                       "the callbacks' state come back whole, that file does not")
    if trainer.strategy.root_device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        out.append("colab_resilience: on a GPU without Trainer(deterministic=True) every run differs, so a resumed "
                   "fit is not identical to an uninterrupted one; pass deterministic=True for an exact resume")
    return out


__all__ = ["ResilienceCallback"]
