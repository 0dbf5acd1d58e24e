"""Lightning's ``Trainer.fit`` resumes at the epoch where it stopped: one callback in a
``%%resilient`` cell.

    %%resilient
    from colab_resilience.integrations.lightning import ResilienceCallback
    trainer = L.Trainer(max_epochs=10, callbacks=[ResilienceCallback()])
    trainer.fit(model, train_loader)

Every epoch is a safe point (``--every`` and ``%restart_after`` count epochs), taken when the next
epoch begins, once every callback and the module have seen the epoch's end, its validation and its
schedulers' step; and at the end of training. With every checkpoint, beside the cell's ``--save``
names, goes what Lightning itself writes into a checkpoint of its own: the module's
``state_dict``, the optimizers', the schedulers', the loops' progress, the state of stateful
callbacks (``ModelCheckpoint``, ``EarlyStopping``), the precision plugin's (a ``GradScaler``), the
datamodule's; with them the random states (Python's, NumPy's, torch's) when the epoch the run
goes on with begins, which draw its order, and the metrics ``fit`` ended with.

On resume the callback hands that checkpoint to the Trainer where it loads its own, so Lightning
restores it **into** the module and the optimizers that the replayed set-up cells and this fit
made, and starts at the first unfinished epoch. A fit that had ended trains nothing, and
``trainer.callback_metrics`` is what it was.

A resumed fit is identical to an uninterrupted one where Lightning is (on CPU; on a GPU with
``Trainer(deterministic=True)``), for training data whose order is drawn when an epoch begins
(a ``DataLoader`` over a dataset with a sampler, the usual case). Where that does not hold, the
callback says so once, in one line, before training starts: an ``IterableDataset``, whose order
the callback cannot put back; ``persistent_workers=True``, whose workers keep their random state
across epochs; a GPU fit without ``deterministic=True``.

Safe points are at epochs' ends only: a fault mid-epoch trains that epoch again from its start.
What is not put back: what a logger wrote (a resumed fit logs to the logger the replayed cells
made: give ``CSVLogger``/``TensorBoardLogger`` a fixed ``version`` to keep one folder).
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch

from ..checkpoints import capture_rng, restore_rng
from ..errors import RunStoppedError
from ..loops import active_run
from . import caller_locals

STATE = "lightning:fit"  # the checkpoint entry holding a fit's state


class FitCheckpoint:
    """What a Lightning fit carries from epoch to epoch, as a state dict: the Trainer's own
    checkpoint dictionary (``dump_checkpoint``), with the random states and the metrics. Loaded,
    it waits for the Trainer to restore it where it restores its own checkpoints."""

    label = "the Lightning module, its optimizers, schedulers, loops and callbacks"  # what a resume says

    def __init__(self, trainer: pl.Trainer):
        self.trainer = trainer
        self.finished = False  # fit ended: a resume trains nothing
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "checkpoint": t._checkpoint_connector.dump_checkpoint(weights_only=False),
            "rng": capture_rng(),  # at the safe point: what the next epoch's data order is drawn from
            "metrics": {name: dict(getattr(t._logger_connector, name))
                        for name in ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")},
            "finished": self.finished,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state
        self.finished = bool(state["finished"])


class Epochs:
    """The epochs of a fit, as the cell's loop iterates them, until it has ended; named as
    Lightning counts them (from 0)."""

    def __init__(self, state: FitCheckpoint):
        self.state = state

    def __iter__(self):
        epoch = 0
        while not self.state.finished:
            yield epoch
            epoch += 1

    def describe(self, index: int) -> str:
        return "the end" if self.state.finished else f"epoch {index}"


class ResilienceCallback(pl.Callback):
    """Make the epochs of ``Trainer.fit`` safe points of the ``%%resilient`` cell it runs in, and
    resume ``fit`` at the first unfinished epoch (see the module documentation). Outside a
    ``%%resilient`` cell it does nothing."""

    _said_outside = False

    def __init__(self):
        super().__init__()
        self._epochs = None  # the cell's loop over this fit's epochs (Loops.iterate)
        self._state: FitCheckpoint | None = None
        self._first: int | None = None  # the epoch this fit starts at, until it has begun
        self._run = None

    # ------------------------------------------------------------------------------- events

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Before the Trainer restores a checkpoint: start the cell's loop, and on resume hand it ours."""
        if stage != "fit":
            return
        run = active_run()
        if run is None:
            if not ResilienceCallback._said_outside:
                ResilienceCallback._said_outside = True
                print("colab_resilience: ResilienceCallback outside a %%resilient cell: nothing is checkpointed",
                      file=sys.stderr)
            return
        if not run.uses_loop:
            raise RunStoppedError(
                "colab_resilience: ResilienceCallback was made outside the %%resilient cell that trains, so the "
                "cell was not run as a loop of epochs; write `callbacks=[ResilienceCallback()]` in that cell"
            )
        if caller_locals("_run", trainer).get("ckpt_path"):
            raise RunStoppedError(
                "colab_resilience: a fit with ResilienceCallback resumes from the run's own checkpoints; call "
                "trainer.fit() without ckpt_path"
            )
        self._run = run
        self._state = state = FitCheckpoint(trainer)
        run.extras[STATE] = state
        self._epochs = run.loops.iterate(Epochs(state))
        self._first = next(self._epochs, None)  # a resumed run: the checkpoint is loaded here
        if state.loaded is not None and self._first == 0:  # saved as the fit began: its module as it was
            pl_module.load_state_dict(state.loaded["checkpoint"]["state_dict"])
            state.loaded = None
        elif state.loaded is not None:
            _resume(trainer, state)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epochs is None:
            return
        for line in _inexact(trainer):  # the training data is loaded now: what it is
            self._run.say_once(line)
        for line in _saved_before(trainer):
            self._run.say_once(line)
        if self._state.loaded is not None:  # restored: the copy the Trainer loaded from goes
            self._state.loaded = None
            _reloaded_as_before(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epochs is None:
            return
        if self._first is not None:
            first, self._first = self._first, None
            if trainer.current_epoch != first:
                raise RunStoppedError(
                    f"colab_resilience: fit started at epoch {trainer.current_epoch}, not at epoch {first} where "
                    "the run goes on; this version of Lightning does not resume through ResilienceCallback"
                )
            return
        next(self._epochs, None)  # the safe point of the epoch that ended: saves when due, may restart

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epochs is None:
            return
        self._state.finished = True
        next(self._epochs, None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        state = self._state
        if self._epochs is not None and state.loaded is not None and state.loaded["finished"]:
            # a fit that had ended trained nothing: its metrics are those it ended with
            for name, metrics in state.loaded["metrics"].items():
                setattr(trainer._logger_connector, name, dict(metrics))
        self._close(trainer)
        if state is not None:
            state.loaded = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(trainer)

    def _close(self, trainer: pl.Trainer) -> None:
        if self._epochs is not None:
            self._epochs.close()
            self._epochs = self._first = self._run = None
        for owner, names in ((trainer._checkpoint_connector, ("resume_start", "restore_loops")),
                             (trainer.fit_loop, ("_load_combined_loader_states",))):
            for name in names:
                vars(owner).pop(name, None)


def _resume(trainer: pl.Trainer, state: FitCheckpoint) -> None:
    """For this fit, the Trainer restores from this package's checkpoint where it restores from a
    file of its own, and goes on as it went on when the checkpoint was taken."""
    loaded = state.loaded
    connector, fit_loop = trainer._checkpoint_connector, trainer.fit_loop

    def resume_start(checkpoint_path=None, weights_only=None):
        connector._ckpt_path = None  # no file: nothing to name when it is done
        connector._loaded_checkpoint = loaded["checkpoint"]

    def restore_loops():
        type(connector).restore_loops(connector)
        if not state.finished:
            # taken as the epoch began: as the loops stood between that epoch and the one before,
            # going on as they went on then (not as Lightning's restart from a checkpoint of its own)
            for progress in (fit_loop.epoch_progress.total, fit_loop.epoch_progress.current):
                progress.ready -= 1
            fit_loop.restarting = False
        # no sanity check: the validation it runs (and the progress it resets) is the fit's start's
        fit_loop.epoch_loop.val_loop.restarting = True

    def load_combined_loader_states():
        type(fit_loop)._load_combined_loader_states(fit_loop)
        vars(fit_loop).pop("_load_combined_loader_states", None)  # once: the first epoch's data only
        restore_rng(loaded["rng"])  # just before the epoch's data iterator is made, as it was

    connector.resume_start = resume_start
    connector.restore_loops = restore_loops
    fit_loop._load_combined_loader_states = load_combined_loader_states


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


def _saved_before(trainer: pl.Trainer) -> list[str]:
    """Checkpoint files in a ``ModelCheckpoint``'s folder that its state (restored, or new) does not
    name, one line per folder: saved by the kernel that died after the safe point the fit goes on
    from, or by another run. An epoch trained again saves its checkpoint again, and finding the file
    there, Lightning gives the new one another name (``-v1``)."""
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint

    out = []
    for callback in trainer.checkpoint_callbacks:
        folder = getattr(callback, "dirpath", None)
        if not isinstance(callback, ModelCheckpoint) or not folder or not os.path.isdir(folder):
            continue
        known = {os.path.abspath(p) for p in [*callback.best_k_models, callback.best_model_path,
                                              callback.last_model_path, callback.kth_best_model_path] if p}
        later = sorted(name for name in os.listdir(folder) if name.endswith(callback.FILE_EXTENSION)
                       and os.path.abspath(os.path.join(folder, name)) not in known)
        if later:
            out.append(f"colab_resilience: ModelCheckpoint's folder {folder} holds {', '.join(later)}, which this fit "
                       "did not save (an earlier kernel did, after the safe point the fit goes on from, or another "
                       "run); a checkpoint saved again under a name there gets another name (-v1), so the file names "
                       "differ from an uninterrupted fit's (the weights do not)")
    return out


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
    if trainer.strategy.root_device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        out.append("colab_resilience: on a GPU without Trainer(deterministic=True) every run differs, so a resumed "
                   "fit is not identical to an uninterrupted one; pass deterministic=True for an exact resume")
    return out


__all__ = ["ResilienceCallback"]
