"""Keras ``fit`` resumes at the epoch where it stopped: one callback in a ``%%resilient`` cell.

    %%resilient
    from colab_resilience.integrations.keras import ResilienceCallback
    history = model.fit(x, y, epochs=10, callbacks=[ResilienceCallback()])

Every epoch is a safe point (``--every`` counts epochs, ``%restart_after`` too), taken once every
callback has seen the epoch's end (when the next one begins, or training ends). With
``ResilienceCallback(every_steps=N)`` every N-th batch of an epoch is one too (taken when the next
batch begins), and a resumed fit goes on at the batch after it: the batches before are drawn from
the epoch's data but not trained, the epoch's running metrics go on from the safe point's, and
what the epoch's ``on_epoch_begin`` hooks change when they run again (a ``LearningRateScheduler``
scales the rate once more) goes back to the safe point's as the first batch begins (TensorFlow
backend, data of known length, one batch per step; otherwise the callback says why and keeps to
epochs). With every checkpoint, beside the cell's ``--save`` names, go:

- every variable of the model: its weights, its layers' state (normalisation statistics) and the
  state of their ``SeedGenerator``s (the randomness of ``Dropout``);
- every variable of its optimizer: its step, its moments, its learning rate;
- the state of Keras's global ``SeedGenerator`` (``keras.random`` calls without a seed);
- the logs of the finished epochs: the ``History`` that ``fit`` returns after a resume holds them all;
- the running values of the model's metrics (the epoch's mean loss so far);
- the state of the fit's other callbacks (``EarlyStopping``'s count, best value and best weights),
  put back after their own ``on_train_begin`` reset it; a fit a callback stopped stays stopped;
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

After an out-of-memory retry with ``--shrink`` of the variable fit's ``batch_size`` is read from,
the optimizer's gradient accumulation is raised so that a step takes the rows it took when the run
began (``keep_effective_batch``); it is said in one line, as is why where it cannot be (a
learning-rate schedule, a ``LossScaleOptimizer``, a backend other than TensorFlow).

What is not put back: what a callback keeps outside itself (``CSVLogger`` empties its file when
a fit begins, unless given ``append=True``). A ``CSVLogger(append=True)`` whose file holds rows
written after the checkpoint a fit resumes from (the fault struck after an epoch's end and before
the next safe point was on disk) does not write those epochs' rows again: the resumed fit trains
them again exactly, and the file ends as the uninterrupted fit's. Nothing here truncates the file;
where its last row was cut short by the fault, that is said in one line.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Mapping

import keras
import numpy as np

from ..checkpoints.keras_state import array as keras_array
from ..checkpoints.keras_state import compile_changed, compiled, dtype_policies, floatx_cause, policy_changed
from ..checkpoints.rng import keras_seed_generator
from .. import words
from ..errors import CheckpointError, RunStoppedError
from ..lint import reshuffles
from ..loops import active_run
from ..oom import is_oom
from . import accumulation_for, caller_locals, is_plain, require_loop, say_outside
from . import every_steps as check_every_steps

STATE = "keras:fit"  # the checkpoint entry holding a fit's state


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

    def __init__(self, model, callbacks: list | None = None):
        self.model = model
        self.callbacks = _stateful(callbacks or [])  # the fit's other callbacks, by a key
        # the CSVLoggers that append, by a key, and their files' sizes in the loaded checkpoint
        self.csv_loggers = {f"{i}:CSVLogger": cb for i, cb in enumerate(callbacks or [])
                            if isinstance(cb, keras.callbacks.CSVLogger) and getattr(cb, "append", False)}
        self.csv_sizes: dict[str, int] = {}
        self.epochs: list[int] = []  # the finished epochs and their logs, as History keeps them
        self.logs: dict[str, list] = {}
        self.kept: dict[str, dict] = {}  # the callbacks' state, loaded, until they have started
        self.stopped = False  # a callback stopped the fit (EarlyStopping): no epoch follows
        self.loaded = False
        self.batch_size: int | None = None  # fit's batch size when the run began
        # the optimizer's own gradient accumulation when the run began: with the batch above, the
        # samples of an optimizer step, which a --shrink of the batch keeps (keep_effective_batch)
        self.accumulation = _steps(getattr(model, "optimizer", None))
        self._saved: dict[str, Any] = {}  # the accumulation and its gradients when the loaded state was saved
        self._variables: dict[str, list] = {}  # the loaded variables' values, by group
        self.metrics: list = []  # the loaded running metrics of the epoch in progress

    @property
    def label(self) -> str:
        """What a resume says it restored."""
        # a callback without a state of its own (a LambdaCallback) is not named as restored
        names = sorted({key.split(":", 1)[1] for key, cb in self.callbacks.items() if _keeps_state(cb)})
        if not names:
            return "the Keras model, its optimizer and the epochs' logs"
        return f"the Keras model, its optimizer, the epochs' logs and the state of {', '.join(names)}"

    def _groups(self) -> dict[str, list]:
        model = self.model
        groups = {"model": list(model.variables)}
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:  # its variables are made by its first step
                optimizer.build(model.trainable_variables)
            # the gradient accumulators go apart: a --shrink may add them to an optimizer already built
            accumulators = {id(a) for a in _accumulators(optimizer)}
            groups["optimizer"] = [v for v in optimizer.variables if id(v) not in accumulators]
        others = _other_metrics_variables(model)
        if others:  # Keras never resets them: they go on from epoch to epoch
            groups["other_metrics"] = others
        seeds = keras_seed_generator()
        if seeds is not None:
            groups["seed_generator"] = [seeds.state]
        return groups

    def state_dict(self) -> dict[str, Any]:
        groups = self._groups()
        history = getattr(self.model, "history", None)
        if isinstance(history, keras.callbacks.History) and hasattr(history, "epoch"):  # it has started
            self.epochs = list(history.epoch)
            self.logs = {k: list(v) for k, v in history.history.items()}
        return {
            "variables": {k: [keras_array(v) for v in vs] for k, vs in groups.items()},
            "paths": {k: [v.path for v in vs] for k, vs in groups.items()},
            "policies": dtype_policies(self.model),
            "compiled": compiled(self.model),
            # which of its variables fit trains (layer.trainable = False freezes a backbone): no
            # variable holds it, and an optimizer is built for those of them
            "trainable": [bool(v.trainable) for v in self.model.variables],
            "epochs": list(self.epochs),
            "logs": {k: [_plain(x) for x in v] for k, v in self.logs.items()},
            "callbacks": {key: _attributes(cb) for key, cb in self.callbacks.items()},
            "stopped": self.stopped,
            # the epoch's running metrics (the loss's mean so far): a resume within the epoch goes on with them
            "metrics": [keras_array(v) for v in _metrics_variables(self.model)],
            "batch_size": self.batch_size,
            "accumulation": self.accumulation,
            # the accumulation in effect (the optimizer's iterations count its batches) and the
            # gradients summed so far (none at an epoch's end that ends a step)
            "steps": _steps(getattr(self.model, "optimizer", None)),
            "accumulators": [keras_array(a) for a in _accumulators(getattr(self.model, "optimizer", None))],
            # how much of each appending CSVLogger's file was written at the safe point (the rows of
            # the epochs before it)
            "csv": {key: size for key, cb in self.csv_loggers.items() if (size := _csv_size(cb)) is not None},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "seed_generator" in state["variables"]:
            keras_seed_generator(create=True)
        # (said before the optimizer's variables, built for other trainable ones, would be)
        problem = _trainable_changed(state["paths"]["model"], state.get("trainable"), list(self.model.variables))
        if problem:
            raise CheckpointError(f"colab_resilience: cannot restore model.fit's state: {problem}")
        groups = self._groups()
        for group, values in state["variables"].items():
            now = groups.get(group, [])
            saved_paths = state["paths"][group]
            problem = _mismatch(group, saved_paths, values, now)
            if problem:
                raise CheckpointError(f"colab_resilience: cannot restore model.fit's state: {problem}")
        problem = policy_changed("the model", state.get("policies"), self.model) or \
            compile_changed("the model", state.get("compiled"), self.model)
        if problem:
            raise CheckpointError(f"colab_resilience: cannot restore model.fit's state: {problem}")
        self._assign(groups, state["variables"])
        self._variables = state["variables"]
        self.epochs = list(state["epochs"])
        self.logs = {k: list(v) for k, v in state["logs"].items()}
        self.kept = dict(state["callbacks"])
        self.stopped = bool(state["stopped"])
        self.batch_size = state.get("batch_size", self.batch_size)
        self.accumulation = int(state.get("accumulation") or 1)
        self._saved = {"steps": int(state.get("steps") or 1), "accumulators": state.get("accumulators") or []}
        self.metrics = list(state.get("metrics") or [])
        self.csv_sizes = dict(state.get("csv") or {})
        self.loaded = True

    @staticmethod
    def _assign(groups: dict[str, list], values: dict[str, list]) -> None:
        for group, saved in values.items():
            for variable, value in zip(groups[group], saved):
                variable.assign(value)

    def assign_again(self) -> None:
        """The loaded variables assigned again, the optimizer's accumulation as
        :meth:`keep_effective_batch` made it."""
        self._assign(self._groups(), self._variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            _accumulate(optimizer, _steps(optimizer), self._saved["steps"], self._saved["accumulators"])

    def put_back(self, callbacks: dict[str, Any]) -> None:
        """A fit resumed within an epoch has run that epoch's ``on_epoch_begin`` hooks again
        after the state was loaded (a ``LearningRateScheduler`` scaled the optimizer's rate once
        more, a callback counted the epoch twice); the safe point was taken after them, as a
        batch began. Everything goes back as the checkpoint holds it: the variables (the
        optimizer's accumulation as :meth:`keep_effective_batch` made it), the callbacks' state
        (``callbacks``, as loaded) and the epoch's running metrics."""
        if not self.loaded:
            return
        self.assign_again()
        self.kept = dict(callbacks)
        self.give_callbacks()
        self.give_metrics()  # (where they do not fit, that was said as the epoch began)

    def give_metrics(self) -> str | None:
        """The epoch's running metrics as they were at the safe point within it (a resume there),
        once ``fit`` has reset them for the epoch; the line that says why not, where they do not fit."""
        now = _metrics_variables(self.model)
        if len(now) == len(self.metrics) and all(tuple(v.shape) == np.shape(a) for v, a in zip(now, self.metrics)):
            for variable, value in zip(now, self.metrics):
                variable.assign(value)
            return None
        return (f"colab_resilience: the epoch's running metrics at the safe point ({len(self.metrics)} variables) do "
                f"not fit this model's ({len(now)} now): the loss and metrics History logs for the epoch the fit "
                "resumed in count from the resume on, not from the epoch's start")

    def keep_effective_batch(self, batch: int | None) -> str | None:
        """After a ``--shrink`` of fit's batch (``batch`` now, :attr:`batch_size` when the run
        began): raise the optimizer's gradient accumulation so that a step takes the samples it
        took when the run began, as Keras's own ``gradient_accumulation_steps`` does (the step's
        gradient is the mean of its batches'), and make ``fit`` trace its step again. The
        optimizer's iterations count steps as before. Returns the line that says what was done,
        or why the effective batch is not kept; None when nothing was shrunk."""
        optimizer, first = getattr(self.model, "optimizer", None), self.batch_size
        if not self.loaded or optimizer is None:
            return None
        steps = self.accumulation
        said = None
        if batch is not None and first is not None and batch != first:
            effective = first * self.accumulation
            why = _cannot_accumulate(optimizer)
            if why:
                said = (f"colab_resilience: fit's batch is {batch} now, {first} when the run began; {why}, so the "
                        f"epochs from here on take batches of {batch} (the effective batch {effective} is not kept)")
            else:
                steps, kept = accumulation_for(batch, effective)
                said = (f"colab_resilience: fit's batch is {batch} now, {first} when the run began; the optimizer's "
                        f"gradient accumulation {self.accumulation} → {steps} {kept}")
        if _accumulate(optimizer, steps, self._saved["steps"], self._saved["accumulators"]):
            self.model.make_train_function(force=True)  # its traced step read the accumulation when made
        return said

    def give_callbacks(self) -> list[str]:
        """Put the loaded state back into the fit's other callbacks (after their own
        ``on_train_begin``, which resets it); returns those whose state was saved but that are
        not in this fit (another list of callbacks)."""
        kept, self.kept = self.kept, {}
        for key, attributes in kept.items():
            if key in self.callbacks:
                _set_attributes(self.callbacks[key], attributes)
        return [key.split(":", 1)[1] for key in kept if key not in self.callbacks]

    def skip_rows_written(self) -> list[str]:
        """Each appending ``CSVLogger`` whose file holds rows written after the loaded checkpoint
        was taken skips writing that many rows: the resumed fit trains those epochs again, exactly,
        and its rows are the ones the file holds (written again, they were there twice). Returns
        the lines to say: a file whose last row the fault cut short (the rows before it are
        skipped too)."""
        lines = []
        for key, cb in self.csv_loggers.items():
            vars(cb).pop("on_epoch_end", None)  # an earlier attempt's
            saved = self.csv_sizes.get(key) if self.loaded else None
            if not isinstance(saved, int):
                continue
            try:
                with open(cb.filename, "rb") as f:
                    f.seek(saved)
                    written = f.read()
            except (OSError, TypeError):
                continue
            if not written:
                continue
            if not written.endswith(b"\n"):
                lines.append(f"colab_resilience: {cb.filename} ends in a row that the fault cut short, after the "
                             "checkpoint this fit resumes from; the resumed fit appends its rows after it (nothing "
                             "here truncates your file): mend that line by hand")
            # an empty file gets its header with the first row; the resumed logger finds one
            rows = written.count(b"\n") - (1 if saved == 0 else 0)
            if rows > 0:
                _skip_rows(cb, rows)
        return lines


def _csv_size(cb) -> int | None:
    """The size of a ``CSVLogger``'s file, its last row flushed; None where it cannot be read."""
    f = getattr(cb, "csv_file", None)
    try:
        if f is not None and not f.closed:
            f.flush()
        return os.path.getsize(cb.filename) if os.path.exists(cb.filename) else 0
    except (OSError, TypeError, ValueError):
        return None


def _skip_rows(cb, rows: int) -> None:
    """``cb`` (a ``CSVLogger``) writes no row for the next ``rows`` epochs that end."""
    left = [rows]
    write = type(cb).on_epoch_end

    def on_epoch_end(epoch, logs=None):
        if left[0] > 0:
            left[0] -= 1
            return
        vars(cb).pop("on_epoch_end", None)
        write(cb, epoch, logs)

    cb.on_epoch_end = on_epoch_end


def _metrics_variables(model) -> list:
    """The variables of the model's metrics (the loss's running mean, compiled metrics)."""
    try:
        return list(model.metrics_variables)
    except (AttributeError, ValueError):
        return []


def _other_metrics_variables(model) -> list:
    """The variables of the metrics the model's layers track that ``model.metrics`` leaves out (a
    ``train_step``'s own counter where the model lists only some in its ``metrics``): ``fit``
    resets only those it lists at each epoch, and ``model.variables`` holds neither."""
    listed = {id(v) for v in _metrics_variables(model)}
    found = []
    try:
        layers = list(model._flatten_layers())
    except (AttributeError, TypeError):
        return []
    for layer in layers:
        for metric in getattr(layer, "_metrics", None) or []:
            for v in getattr(metric, "variables", []):
                if id(v) not in listed:
                    listed.add(id(v))
                    found.append(v)
    return found


def _steps(optimizer) -> int:
    """The batches an optimizer step takes (its ``gradient_accumulation_steps``; 1 without)."""
    return int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)


def _accumulators(optimizer) -> list:
    """The optimizer's gradient accumulators (made by its build with accumulation, or added by
    :func:`_accumulate`)."""
    return [a for a in (getattr(optimizer, "_accumulated_gradients", None) or []) if a is not None]


def _cannot_accumulate(optimizer) -> str | None:
    """Why this optimizer's gradient accumulation cannot be raised to keep a step's samples."""
    if keras.backend.backend() != "tensorflow":
        return (f"the callback raises Keras's gradient accumulation with the TensorFlow backend only, "
                f"and this is {keras.backend.backend()}")
    if not hasattr(optimizer, "gradient_accumulation_steps"):
        return f"{type(optimizer).__name__} has no gradient accumulation to raise"
    if isinstance(optimizer, getattr(keras.optimizers, "LossScaleOptimizer", ())):
        return "a LossScaleOptimizer's gradient accumulation cannot be raised"
    rate = getattr(optimizer, "_learning_rate", None)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) or callable(rate):
        return ("the optimizer's learning rate is a schedule, which Keras advances at every batch, not every step, "
                "when it accumulates gradients")
    return None


def _accumulate(optimizer, steps: int, saved_steps: int, saved: list) -> bool:
    """Make ``optimizer`` take ``steps`` batches a step: its accumulators, made if it has none
    (after its other variables), hold the ``saved`` sums (zeros if they do not fit), and its
    iteration counter, loaded as counted with ``saved_steps``, counts the same steps. Returns
    whether the optimizer's accumulation changed (a traced train step must be traced again)."""
    changed = steps != _steps(optimizer)
    if steps > 1 and not _accumulators(optimizer):
        optimizer._accumulated_gradients = [
            optimizer.add_variable_from_reference(v, name="gradient_accumulator")
            for v in optimizer._trainable_variables]
        changed = True
    optimizer.gradient_accumulation_steps = steps if steps > 1 else None
    accumulators = _accumulators(optimizer)
    fits = len(saved) == len(accumulators) and all(
        tuple(np.shape(v)) == tuple(a.shape) for v, a in zip(saved, accumulators))
    for i, a in enumerate(accumulators):
        a.assign(saved[i] if fits else np.zeros(tuple(a.shape), keras.backend.standardize_dtype(a.dtype)))
    done, part = divmod(int(optimizer._iterations.numpy()), max(saved_steps, 1))
    optimizer._iterations.assign(done * steps + (part if fits and part < steps else 0))
    return changed


_NOT_STATE = {"model", "_model", "params", "validation_data"}


def _stateful(callbacks: list) -> dict[str, Any]:
    """The callbacks whose state goes with a checkpoint: all but this package's, ``History``
    (the epochs' logs are saved apart), the progress bar and ``CSVLogger`` (what it holds is of its
    file as it found it when fit started: whether it has a header yet; put back, a resumed fit
    wrote the header again in the middle of the file); keyed by place and type."""
    skip = (keras.callbacks.History, keras.callbacks.ProgbarLogger, keras.callbacks.CSVLogger)
    return {f"{i}:{type(cb).__name__}": cb for i, cb in enumerate(callbacks)
            if not isinstance(cb, skip) and not isinstance(cb, ResilienceCallback)}


def _plain(value):
    """A NumPy scalar as the Python number it holds; other values as they are."""
    return value.item() if isinstance(value, np.generic) else value


def _keeps_state(callback) -> bool:
    """Whether :func:`_attributes` finds anything in ``callback``."""
    return any(name not in _NOT_STATE and (is_plain(_plain(value)) or _library_function(value) is not None
                                           or (isinstance(value, list) and value
                                               and all(isinstance(a, np.ndarray) for a in value)))
               for name, value in vars(callback).items())


def _attributes(callback) -> dict[str, Any]:
    """A callback's state: its attributes that are plain values (counters, the best value so
    far, flags, and lists and dicts of them: a notebook's callback that keeps each epoch's loss),
    lists of arrays (``EarlyStopping``'s best weights), and functions of Keras or NumPy by their
    names (the comparison ``EarlyStopping`` picks at its first epoch, when it also turns
    ``min_delta`` negative: the one goes with the other)."""
    import copy

    values, functions = {}, {}
    for name, value in vars(callback).items():
        if name in _NOT_STATE:
            continue
        value = _plain(value)
        if is_plain(value):
            values[name] = copy.deepcopy(value)
        elif isinstance(value, list) and value and all(isinstance(a, np.ndarray) for a in value):
            values[name] = [np.array(a, copy=True) for a in value]
        elif _library_function(value) is not None:
            functions[name] = list(_library_function(value))
    return {"values": values, "functions": functions}


_LIBRARIES = ("keras.", "numpy")


def _library_function(value) -> tuple[str, str] | None:
    """``(module, name)`` of a function of Keras or NumPy that its module holds by that name."""
    module, name = getattr(value, "__module__", None), getattr(value, "__name__", None)
    if not (callable(value) and isinstance(module, str) and isinstance(name, str)
            and module.startswith(_LIBRARIES) and module in sys.modules):
        return None
    return (module, name) if getattr(sys.modules[module], name, None) is value else None


def _set_attributes(callback, saved: dict[str, Any]) -> None:
    import copy

    own = vars(callback)
    for name, value in saved["values"].items():
        if name in own and not is_plain(_plain(own[name])):
            continue  # it holds something else now: what its on_train_begin made (CSVLogger's open file)
        setattr(callback, name, copy.deepcopy(value))  # (the callback may change it in place)
    for name, (module, function) in saved["functions"].items():
        if module.startswith(_LIBRARIES) and module in sys.modules:  # only what is imported already
            setattr(callback, name, getattr(sys.modules[module], function))


def _mismatch(group: str, paths: list[str], values: list, now: list) -> str | None:
    what = {"model": "the model", "optimizer": "its optimizer", "seed_generator": "Keras's global SeedGenerator",
            "other_metrics": "the metrics its layers track beside model.metrics"}.get(group, group)
    for i in range(max(len(paths), len(now))):
        if i >= len(paths) or i >= len(now):
            shown = f"{i + 1} was {paths[i] if i < len(paths) else 'nothing more'}, now " \
                    f"{now[i].path if i < len(now) else 'nothing more'}"
            return (f"{what} has other variables ({len(paths)} saved, {len(now)} now; variable {shown}); "
                    "build and compile it as it was, or `%resilience reset`")
        shape, dtype = tuple(now[i].shape), keras.backend.standardize_dtype(now[i].dtype)
        if tuple(values[i].shape) != shape or str(values[i].dtype) != dtype:
            return (f"variable {paths[i]} of {what} was saved as {values[i].dtype}{list(values[i].shape)} and is "
                    f"{dtype}{list(shape)} now; build and compile it as it was, or `%resilience reset`"
                    + floatx_cause(values[i].dtype, dtype))
    return None


def _trainable_changed(paths: list[str], saved: list[bool] | None, now: list, most: int = 3) -> str | None:
    """Where the model's variables (``now``, as many as saved: else its other variables say so) are
    trainable otherwise than ``saved`` (a checkpoint of an earlier version has none), which and why,
    in words that go after "cannot restore ...: "; else None. (Within one fit they do not change:
    Keras's optimizer is built for the trainable variables as fit begins.)"""
    if saved is None or len(saved) != len(now):
        return None

    def said(trainable: bool) -> str:
        return "trainable" if trainable else "frozen"

    differ = [f"{path} {said(was)} when saved, {said(bool(v.trainable))} now"
              for path, was, v in zip(paths, saved, now) if bool(v.trainable) != was]
    if not differ:
        return None
    more = f" and {len(differ) - most} more" if len(differ) > most else ""
    return (f"the model's variables are not trainable as they were saved ({'; '.join(differ[:most])}{more}): "
            "layer.trainable set in a cell that is not %%replay is not set again in a new kernel, and fit would "
            "train other variables; set it in a %%replay cell, before model.compile")


class Stretches:
    """The stretches of a fit between two safe points, as the cell's loop iterates them: its
    epochs, or with ``every`` the batches of each epoch cut every that many. Each is named by
    where it begins, ``(epoch, batches of that epoch done before)``, as Keras's progress bar
    names them (``epoch 2/4`` is epoch 1).

    The cuts fall on the same rows whatever the batch: after a ``--shrink`` of fit's batch
    (``batch`` now, the state's ``batch_size`` when the run began), ``every`` of the run's first
    batches are that many times more of this fit's."""

    def __init__(self, first: int, stop: int, state: FitState, batches: int | None = None,
                 every: int | None = None, batch: int | None = None):
        self.first, self.stop, self.state, self.batches, self.every, self.batch = first, stop, state, batches, every, batch

    @property
    def cut(self) -> int | None:
        """The batches of this fit between two safe points within an epoch; None: epochs only."""
        if not self.every or not self.batches:
            return None
        began, now = self.state.batch_size, self.batch
        if not began or not now or began == now:
            return self.every
        if began % now:
            raise RunStoppedError(
                f"colab_resilience: fit's batch is {now} now, {began} when the run began, and {began} is not a multiple "
                f"of {now}: with every_steps the callback cannot find the row where the epoch goes on; shrink by a "
                "factor that divides the batch (`--shrink NAME=2`), or `%resilience reset`")
        return self.every * (began // now)

    @property
    def per_epoch(self) -> int:
        cut = self.cut
        return -(-self.batches // cut) if cut else 1

    def __len__(self) -> int:
        return max(0, self.stop - self.first) * self.per_epoch

    def at(self, index: int) -> tuple[int, int]:
        epoch, part = divmod(index, self.per_epoch)
        return self.first + epoch, part * (self.cut or 0)

    def __iter__(self):
        for index in range(len(self)):
            if self.state.stopped:  # a callback ended the fit early: so it stays after a resume
                return
            yield self.at(index)

    def describe(self, index: int) -> str:
        if self.state.stopped or index >= len(self):
            return "the end"
        epoch, batch = self.at(index)
        where = f"epoch {epoch + 1}/{self.stop}"
        return f"{where}, batch {batch + 1}/{self.batches}" if batch else where


def _within_epoch(epoch_iterator, done: int) -> None:
    """Make the next epoch ``fit`` runs go on after its first ``done`` batches: they are drawn
    from its iterator (its order is the epoch's, drawn anew) and not trained, and the batches
    trained are numbered as in an uninterrupted epoch."""
    enumerate_epoch = epoch_iterator._enumerate_iterator  # Keras's, bound

    def going_on():
        del epoch_iterator._enumerate_iterator  # the epochs after this one are whole
        for i, (begin, end, iterator) in enumerate(enumerate_epoch()):
            if i == 0:
                for _ in range(done):
                    next(iterator)
                epoch_iterator._steps_seen += done  # the epoch ends after its last batch, as it would have
            yield begin + done, end + done, iterator

    epoch_iterator._enumerate_iterator = going_on


def _draw_again(epoch_iterator, initial: int, first: int) -> str:
    """With ``steps_per_epoch``, an epoch draws its batches from where the epoch before it
    stopped (Keras keeps the data's iterator from epoch to epoch), and a fit resumed at epoch
    ``first`` would draw from the start of the data: the batches the epochs from ``initial`` on
    drew are drawn again, as those epochs drew them, and not trained. What was done, in a line."""
    if epoch_iterator is None or not hasattr(epoch_iterator, "catch_stop_iteration"):
        return (f"colab_resilience: fit was given steps_per_epoch, so epoch {first + 1} draws its batches from where the "
                "epoch before it stopped, and this version of Keras does not let the callback draw those again: the "
                "resumed fit starts at the data's beginning and is not identical to an uninterrupted one")
    started, drawn = time.monotonic(), 0
    for _ in range(first - initial):
        with epoch_iterator.catch_stop_iteration():  # data that ran out ends the epoch, as in fit
            for _begin, _end, got in epoch_iterator:
                if not isinstance(got, list):  # TensorFlow's: the iterator its step draws from
                    for _ in range(epoch_iterator.steps_per_execution):
                        next(got)
                drawn += epoch_iterator.steps_per_execution
    before = f"epoch {first}" if first - initial == 1 else f"epochs {initial + 1} to {first}"
    return (f"colab_resilience: fit was given steps_per_epoch, so each epoch draws its batches from where the one "
            f"before it stopped: the {drawn} batches of {before} were drawn again, not trained "
            f"({time.monotonic() - started:.1f} s), and epoch {first + 1} goes on with the next")


def _build(model, fit: Mapping[str, Any]) -> None:
    """Build a model that is not built yet (a subclassed one without an ``Input``), its optimizer
    and its compiled metrics and loss, as Keras's JAX and torch backends build them before
    ``on_train_begin``: from the shapes of the data (the dataset's element spec; no batch is drawn).
    TensorFlow's builds them when it traces the first step, after: a checkpoint taken before would
    hold no variables (and the optimizer built on none, the first step failed), a resume would have
    none to load into (a fit resumed within an epoch found its compiled metrics, ``metrics=["mae"]``,
    without their variables, and the epoch's logged loss and metrics counted from the resume on)."""
    try:
        compiled = [getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None)]
        if all(layer.built for layer in model._flatten_layers()) and \
                all(part is None or part.built for part in compiled):
            return
        spec = getattr(getattr(fit.get("epoch_iterator"), "_distributed_dataset", None), "element_spec", None)
        if spec is not None:
            model._symbolic_build(data_batch=spec)
    except Exception as e:  # Keras says why a model cannot be built when its first step runs
        if is_oom(e):
            raise


class ResilienceCallback(keras.callbacks.Callback):
    """Make the epochs of ``fit`` safe points of the ``%%resilient`` cell it runs in, and resume
    ``fit`` at the first unfinished epoch (see the module documentation). Outside a
    ``%%resilient`` cell it does nothing.

    An epoch's safe point is taken when every callback has seen its end: at the next epoch's
    start, or at the end of training (so ``History`` and ``EarlyStopping`` have counted it, in
    whatever order the callbacks were given).

    ``every_steps``: a safe point every that many batches of an epoch too (taken when the next
    batch begins), and a resume goes on at the batch after it: a fault loses at most that many
    batches. With the TensorFlow backend, data whose batches an epoch counts (arrays, tensors, a
    dataset of known length) and one batch per step (``steps_per_execution=1``); otherwise the
    callback says why in one line and keeps to epochs."""

    def __init__(self, every_steps: int | None = None):
        super().__init__()
        self.every_steps = check_every_steps(every_steps)
        self._run = None
        self._epochs = None  # the cell's loop over this fit's stretches (Loops.iterate)
        self._state: FitState | None = None
        self._first: int | None = None  # the epoch fit must start at, until it has started
        self._within = 0  # the batches of that epoch trained before the checkpoint (a resume within it)
        self._every: int | None = None  # every_steps, where this fit can be resumed within an epoch
        self._stretches: Stretches | None = None
        self._due = False  # a batch ended a stretch: its safe point comes when the next batch begins
        self._ended: int | None = None  # the last epoch that ended (its safe point is next)
        self._before: list[int] = []  # the epochs a resumed fit finished before (History's epoch list)
        self._put_back = False  # a fit resumed within an epoch: the state goes back as its first batch begins
        self._initial = 0  # the epoch fit was asked to start at (its initial_epoch)
        self._loaded_callbacks: dict[str, Any] = {}  # the callbacks' state as loaded, for that

    def on_train_begin(self, logs=None):
        run = active_run()
        if run is None:
            say_outside("keras")
            return
        require_loop(run, "epochs", "callbacks=[ResilienceCallback()]")
        fit = caller_locals("fit", self.model)  # its data, its initial_epoch, its callbacks
        _build(self.model, fit)
        epochs = self.params["epochs"]
        initial = int(fit.get("initial_epoch", 0) or 0)
        for line in _inexact(fit):
            run.say_once(line)
        self._run, self._ended = run, None
        self._state = FitState(self.model, getattr(fit.get("callbacks"), "callbacks", None))
        batch = fit.get("batch_size") if isinstance(fit.get("batch_size"), int) else None
        self._state.batch_size = batch
        run.extras[STATE] = self._state
        self._every, self._due = self._within_epochs(run, fit), False
        self._stretches = Stretches(initial, epochs, self._state, self.params.get("steps"), self._every, batch)
        self._epochs = run.loops.iterate(self._stretches)
        # a resumed run: the variables are loaded here
        self._first, self._within = next(self._epochs, (epochs, 0))
        self._loaded_callbacks, self._put_back, self._initial = dict(self._state.kept), False, initial
        said = self._state.keep_effective_batch(batch)  # a --shrink since the run began
        if said:
            run.say_once(said)
        for line in self._state.skip_rows_written():
            run.say_once(line)
        if self._state.loaded and not self._within and self._first == initial:
            # resumed from the checkpoint taken here as the fit began: the other callbacks' state
            # goes back at the place it was taken (those before this one in the list have begun
            # training, those after begin it next), not as the first epoch begins, after those
            # before this one have begun that too (a count of epochs begun came back one short)
            self._give_callbacks()
        if self._within:
            _within_epoch(fit["epoch_iterator"], self._within)
        if fit.get("steps_per_epoch") and initial < self._first < epochs:
            run.say_once(_draw_again(fit.get("epoch_iterator"), initial, self._first))
        self.model._initial_epoch = self._first
        history = getattr(self.model, "history", None)
        if self._state.loaded and isinstance(history, keras.callbacks.History):
            # History keeps its logs and empties its epoch list at its on_train_begin, after this one
            self._before = list(self._state.epochs)
            history.history = {k: list(v) for k, v in self._state.logs.items()}

    def on_epoch_begin(self, epoch, logs=None):
        if self._epochs is None:
            return
        if self._first is not None:
            first = self._first
            if self._state.loaded and not self._within and first > self._initial:
                # the callbacks before this one in the fit's list have begun the epoch again; the
                # safe point, taken here as it began, holds what they did then (a
                # LearningRateScheduler's rate): the variables go back to it (not the fit's start,
                # taken before any epoch began)
                self._state.assign_again()
            self._started()
            if epoch != first:
                raise RunStoppedError(
                    f"colab_resilience: fit started at epoch {epoch}, not at epoch {first} where the run goes on; "
                    "this version of Keras does not resume through ResilienceCallback"
                )
            if self._within:  # fit has reset the epoch's metrics: they go on from the safe point's
                unfit = self._state.give_metrics()
                if unfit:
                    self._run.say_once(unfit)
                self._put_back = True  # once the epoch's other on_epoch_begin hooks have run
            return
        self._safe_point()

    def on_train_batch_begin(self, batch, logs=None):
        if self._put_back:
            self._put_back = False
            self._state.put_back(self._loaded_callbacks)
        if self._due:
            self._due = False
            self._safe_point()

    def on_train_batch_end(self, batch, logs=None):
        if self._epochs is None or not self._every:
            return
        cut, batches = self._stretches.cut, self.params.get("steps") or 0
        if (batch + 1) % cut == 0 and batch + 1 < batches:
            self._due = True

    def on_epoch_end(self, epoch, logs=None):
        if self._epochs is not None:
            self._ended, self._due = epoch, False

    def on_train_end(self, logs=None):
        if self._epochs is None:
            return
        if self._first is not None:  # no epoch was left to run
            self._started()
        elif self._ended is not None:
            # a callback ended the fit before its last epoch, or within an epoch cut by every_steps:
            # a resume must not train on
            self._state.stopped = bool(self.model.stop_training) and (
                self._ended + 1 < self.params["epochs"] or self._stretches.per_epoch > 1)
            self._safe_point()
        self._epochs.close()
        self._epochs = None

    def _safe_point(self) -> None:
        """The safe point of the stretch that ended: saves when due, may restart as planned."""
        self._ended = None
        next(self._epochs, None)

    def _within_epochs(self, run, fit: dict) -> int | None:
        """``every_steps``, where this fit can be resumed within an epoch; otherwise None, and
        the line that says why."""
        if self.every_steps is None:
            return None
        why = None
        if keras.backend.backend() != "tensorflow":
            why = f"with the TensorFlow backend only, and this is {keras.backend.backend()}"
        elif fit.get("steps_per_epoch"):
            why = "only where an epoch is all the batches of its data, and this fit was given steps_per_epoch"
        elif not self.params.get("steps"):
            why = "only where an epoch is all the batches of its data, and this fit's data does not say how many"
        elif getattr(self.model, "steps_per_execution", 1) != 1:
            why = "only with one batch per step, and this model was compiled with steps_per_execution"
        elif not hasattr(fit.get("epoch_iterator"), "_enumerate_iterator"):
            why = "only through the epoch iterator of Keras 3's TensorFlow trainer, which this fit does not have"
        if why is None:
            return self.every_steps
        run.say_once(f"colab_resilience: ResilienceCallback(every_steps={self.every_steps}) resumes a fit within an "
                     f"epoch {why}: every epoch is a safe point, and a fault goes back to the start of its epoch")
        return None

    def _started(self) -> None:
        """The first epoch of this fit begins (or, all done, training ends): what the callbacks'
        ``on_train_begin`` reset gets its saved value back."""
        self._first = None
        self.model._initial_epoch = None  # read once by fit; a later fit must not find it
        history = getattr(self.model, "history", None)
        if self._before and isinstance(history, keras.callbacks.History):
            history.epoch = self._before + list(getattr(history, "epoch", []))
        self._give_callbacks()

    def _give_callbacks(self) -> None:
        """The loaded state into the fit's other callbacks (once); says which saved ones it lacks."""
        missing = self._state.give_callbacks()
        if missing:
            self._run.say_once(
                f"colab_resilience: the checkpoint holds the state of {', '.join(missing)}, which this fit does not "
                "have at that place in its callbacks; that state was not put back, and the fit goes on without it"
            )


def _inexact(fit: dict) -> list[str]:
    """Why a resumed fit would not be identical to an uninterrupted one, one line each."""
    out = []
    if random_seed() is None and not _tf_seeded():
        out.append("colab_resilience: no random seed is set, so Keras initialises, shuffles and drops out "
                   "differently in every kernel, and a resumed fit is not identical to an uninterrupted one; "
                   "call keras.utils.set_random_seed(...) in a %%replay cell for an exact resume")
    for callback in getattr(fit.get("callbacks"), "callbacks", None) or []:
        if isinstance(callback, keras.callbacks.CSVLogger) and not getattr(callback, "append", True):
            out.append(f"colab_resilience: CSVLogger writes {getattr(callback, 'filename', 'its file')} anew each "
                       "time fit starts (append=False): a resume after an out-of-memory error or a restart starts "
                       "fit again, and the file would hold only the epochs from there on; pass append=True (a "
                       "checkpoint holds no file, and nothing here truncates yours)")
    x = fit.get("x")
    tf = sys.modules.get("tensorflow")
    if x is None or isinstance(x, (np.ndarray, list, tuple, dict)) or _is_tensor(x):
        return out
    if tf is not None and isinstance(x, tf.data.Dataset):
        if reshuffles(x):
            out.append("colab_resilience: fit's tf.data.Dataset shuffles anew each epoch "
                       "(reshuffle_each_iteration=True), and a resumed fit cannot draw the order of the epoch it "
                       "goes on with, so it is not identical to an uninterrupted one; pass arrays, or a dataset "
                       "that shuffles with reshuffle_each_iteration=False, for an exact resume")
        return out
    out.append(f"colab_resilience: fit reads its data from {words.a(type(x).__name__)}, whose order the callback cannot "
               "put back: a resumed fit is identical to an uninterrupted one only if each epoch's batches do not "
               "depend on the epochs before it")
    return out


def _tf_seeded() -> bool:
    context = sys.modules.get("tensorflow.python.eager.context")
    return context is not None and context.global_seed() is not None


def _is_tensor(x) -> bool:
    return bool(keras.ops.is_tensor(x))
