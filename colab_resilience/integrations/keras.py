"""Keras ``fit`` resumes at the epoch where it stopped: one callback in a ``%%resilient`` cell.

    %%resilient
    from colab_resilience.integrations.keras import ResilienceCallback
    history = model.fit(x, y, epochs=10, callbacks=[ResilienceCallback()])

The end of every epoch is a safe point (``--every`` counts epochs, ``%restart_after`` too). With
every checkpoint, beside the cell's ``--save`` names, go:

- every variable of the model: its weights, its layers' state (normalisation statistics) and the
  state of their ``SeedGenerator``s (the randomness of ``Dropout``);
- every variable of its optimizer: its step, its moments, its learning rate;
- the state of Keras's global ``SeedGenerator`` (``keras.random`` calls without a seed);
- the logs of the finished epochs: the ``History`` that ``fit`` returns after a resume holds them all;
- Python's, NumPy's, torch's and TensorFlow's random states, as with every checkpoint.

They are assigned into the model and optimizer that the replayed set-up cells rebuilt (the same
objects: other references to them stay valid), and ``fit`` starts at the first unfinished epoch
(through the model's ``_initial_epoch``, which Keras reads after ``on_train_begin``, as its own
``BackupAndRestore`` does). Build and compile the model in a ``%%replay`` cell.

A resumed fit is identical to an uninterrupted one where Keras is deterministic: a seed set with
``keras.utils.set_random_seed`` (without one, Keras and TensorFlow draw other numbers in every
kernel, and the callback says so before training starts), and data whose order in an epoch does
not depend on the epochs before it. NumPy arrays and tensors are such data (``fit`` shuffles them
the same way in every epoch once a seed is set); a ``tf.data.Dataset`` that shuffles anew each
epoch (``shuffle(..., reshuffle_each_iteration=True)``, the default) is not, nor is a generator or
a ``PyDataset`` the callback cannot look into: for those the callback says once, before training
starts, that a resumed fit is not identical.

What is not saved: other callbacks' own state (``EarlyStopping``'s patience count,
``ModelCheckpoint``'s best value) starts afresh in a resumed fit.
"""

from __future__ import annotations

import sys
from typing import Any

import keras
import numpy as np

from ..errors import RunStoppedError
from ..loops import active_run

STATE = "keras:fit"  # the checkpoint entry holding a fit's state


def _numpy(variable) -> np.ndarray:
    return np.array(variable.numpy(), copy=True)


def _global_seed_generator(create: bool = False):
    """Keras's global ``SeedGenerator`` (``keras.random`` calls without a seed), or None."""
    try:
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
    except ImportError:
        return None
    found = global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
    return found if found is not None or not create else seed_generator.global_seed_generator()


def random_seed() -> int | None:
    """The seed ``keras.utils.set_random_seed`` set, or None."""
    get = getattr(keras.utils, "get_random_seed", None)
    if get is not None:
        return get()
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("global_random_seed")


class FitState:
    """What a Keras ``fit`` carries from epoch to epoch, as a state dict: saved with each
    checkpoint of the run and loaded in place (see the module documentation)."""

    label = "the Keras model, its optimizer and the epochs' logs"  # what a resume says it restored

    def __init__(self, model):
        self.model = model
        self.epochs: list[int] = []  # the finished epochs and their logs, as History keeps them
        self.logs: dict[str, list] = {}
        self.loaded = False

    def _groups(self) -> dict[str, list]:
        model = self.model
        groups = {"model": list(model.variables)}
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:  # its variables are made by its first step
                optimizer.build(model.trainable_variables)
            groups["optimizer"] = list(optimizer.variables)
        seeds = _global_seed_generator()
        if seeds is not None:
            groups["seed_generator"] = [seeds.state]
        return groups

    def state_dict(self) -> dict[str, Any]:
        groups = self._groups()
        return {
            "variables": {k: [_numpy(v) for v in vs] for k, vs in groups.items()},
            "paths": {k: [v.path for v in vs] for k, vs in groups.items()},
            "epochs": list(self.epochs),
            "logs": {k: list(v) for k, v in self.logs.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "seed_generator" in state["variables"]:
            _global_seed_generator(create=True)
        groups = self._groups()
        for group, values in state["variables"].items():
            now = groups.get(group, [])
            saved_paths = state["paths"][group]
            problem = _mismatch(group, saved_paths, values, now)
            if problem:
                raise ValueError(problem)
        for group, values in state["variables"].items():
            for variable, value in zip(groups[group], values):
                variable.assign(value)
        self.epochs = list(state["epochs"])
        self.logs = {k: list(v) for k, v in state["logs"].items()}
        self.loaded = True

    def record(self, epoch: int, logs: dict | None) -> None:
        """An epoch ended: its logs as ``History`` records them."""
        self.epochs.append(epoch)
        for k, v in (logs or {}).items():
            self.logs.setdefault(k, []).append(v)


def _mismatch(group: str, paths: list[str], values: list, now: list) -> str | None:
    what = {"model": "the model", "optimizer": "its optimizer", "seed_generator": "Keras's global SeedGenerator"}[group]
    for i in range(max(len(paths), len(now))):
        if i >= len(paths) or i >= len(now):
            shown = f"{i + 1} was {paths[i] if i < len(paths) else 'nothing more'}, now " \
                    f"{now[i].path if i < len(now) else 'nothing more'}"
            return (f"{what} has other variables ({len(paths)} saved, {len(now)} now; variable {shown}); "
                    "build and compile it as it was, or `%resilience reset`")
        shape, dtype = tuple(now[i].shape), keras.backend.standardize_dtype(now[i].dtype)
        if tuple(values[i].shape) != shape or str(values[i].dtype) != dtype:
            return (f"variable {paths[i]} of {what} was saved as {values[i].dtype}{list(values[i].shape)} and is "
                    f"{dtype}{list(shape)} now; build and compile it as it was, or `%resilience reset`")
    return None


class Epochs:
    """The epochs of a fit, as the cell's loop iterates them: named as Keras's progress bar names
    them (``epoch 2/4`` is epoch 1)."""

    def __init__(self, first: int, stop: int):
        self.epochs = range(first, stop)

    def __len__(self) -> int:
        return len(self.epochs)

    def __iter__(self):
        return iter(self.epochs)

    def describe(self, index: int) -> str:
        return f"epoch {self.epochs[index] + 1}/{self.epochs.stop}" if index < len(self.epochs) else "the end"


class ResilienceCallback(keras.callbacks.Callback):
    """Make the epochs of ``fit`` safe points of the ``%%resilient`` cell it runs in, and resume
    ``fit`` at the first unfinished epoch (see the module documentation). Outside a
    ``%%resilient`` cell it does nothing."""

    _said_outside = False

    def __init__(self):
        super().__init__()
        self._epochs = None  # the cell's loop over this fit's epochs (Loops.iterate)
        self._state: FitState | None = None
        self._first: int | None = None  # the epoch fit must start at, until it has started
        self._before: list[int] = []  # the epochs a resumed fit finished before (History's epoch list)

    def on_train_begin(self, logs=None):
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
        fit = _fit_locals(self.model)
        epochs = self.params["epochs"]
        initial = int(fit.get("initial_epoch", 0) or 0)
        for line in _inexact(fit):
            run.say_once(line)
        self._state = FitState(self.model)
        run.extras[STATE] = self._state
        self._epochs = run.loops.iterate(Epochs(initial, epochs))
        self._first = next(self._epochs, epochs)
        self.model._initial_epoch = self._first
        history = getattr(self.model, "history", None)
        if self._state.loaded and isinstance(history, keras.callbacks.History):
            # History keeps its logs and empties its epoch list at its on_train_begin, after this one
            self._before = list(self._state.epochs)
            history.history = {k: list(v) for k, v in self._state.logs.items()}

    def on_epoch_begin(self, epoch, logs=None):
        if self._first is None:
            return
        first, self._first = self._first, None
        self.model._initial_epoch = None  # read once by fit; a later fit must not find it
        self._give_epochs()
        if epoch != first:
            raise RunStoppedError(
                f"colab_resilience: fit started at epoch {epoch}, not at epoch {first} where the run goes on; "
                "this version of Keras does not resume through ResilienceCallback"
            )

    def on_epoch_end(self, epoch, logs=None):
        if self._epochs is None:
            return
        self._state.record(epoch, logs)
        next(self._epochs, None)  # the safe point: saves when due, may restart as planned

    def on_train_end(self, logs=None):
        if self._epochs is not None:
            self._epochs.close()  # stopped early (EarlyStopping): the loop is over
            self._epochs = None
        if self._first is not None:  # no epoch was left to run
            self._first = None
            self.model._initial_epoch = None
            self._give_epochs()

    def _give_epochs(self) -> None:
        """A resumed fit's ``History`` lists the epochs finished before it (their logs it has)."""
        history = getattr(self.model, "history", None)
        if self._before and isinstance(history, keras.callbacks.History):
            history.epoch = self._before + list(getattr(history, "epoch", []))


def _fit_locals(model) -> dict:
    """The local variables of the ``fit`` of ``model`` that is calling back (its data, its
    ``initial_epoch``), or an empty dict when it is not found on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            return dict(frame.f_locals)
        frame = frame.f_back
    return {}


def _inexact(fit: dict) -> list[str]:
    """Why a resumed fit would not be identical to an uninterrupted one, one line each."""
    out = []
    if random_seed() is None and not _tf_seeded():
        out.append("colab_resilience: no random seed is set, so Keras initialises, shuffles and drops out "
                   "differently in every kernel, and a resumed fit is not identical to an uninterrupted one; "
                   "call keras.utils.set_random_seed(...) in a %%replay cell for an exact resume")
    x = fit.get("x")
    tf = sys.modules.get("tensorflow")
    if x is None or isinstance(x, (np.ndarray, list, tuple, dict)) or _is_tensor(x):
        return out
    if tf is not None and isinstance(x, tf.data.Dataset):
        if _reshuffles(x):
            out.append("colab_resilience: fit's tf.data.Dataset shuffles anew each epoch "
                       "(reshuffle_each_iteration=True), and a resumed fit cannot draw the order of the epoch it "
                       "goes on with, so it is not identical to an uninterrupted one; pass arrays, or a dataset "
                       "that shuffles with reshuffle_each_iteration=False, for an exact resume")
        return out
    out.append(f"colab_resilience: fit reads its data from a {type(x).__name__}, whose order the callback cannot "
               "put back: a resumed fit is identical to an uninterrupted one only if each epoch's batches do not "
               "depend on the epochs before it")
    return out


def _tf_seeded() -> bool:
    context = sys.modules.get("tensorflow.python.eager.context")
    return context is not None and context.global_seed() is not None


def _is_tensor(x) -> bool:
    return bool(keras.ops.is_tensor(x))


def _reshuffles(dataset) -> bool:
    """Whether a ``tf.data`` pipeline holds a shuffle that reshuffles on each iteration."""
    seen, todo = set(), [dataset]
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        if type(d).__name__.lstrip("_") == "ShuffleDataset" and getattr(d, "_reshuffle_each_iteration", True):
            return True
        try:
            todo.extend(d._inputs())
        except (AttributeError, NotImplementedError, TypeError):  # not a tf.data dataset of its own
            continue
    return False
