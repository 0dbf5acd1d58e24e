"""Keras models, layers, optimizers and metrics in ``--save``: what their variables hold.

A custom training loop (``tf.GradientTape`` and ``optimizer.apply_gradients``) trains a Keras
model and optimizer the set-up cells built. Pickled, they came back as new objects cut off from
the training, the optimizer without its variables. Their variables are saved instead, each with
the path Keras gives it, and assigned at a restore into the object of that name, which the
replayed set-up cells rebuilt (or the same one, after an out-of-memory rollback): whatever else
holds it, a ``tf.function`` traced over its variables among them, sees the restored values.

- A model or layer: every variable (weights, normalisation statistics, the state of its layers'
  ``SeedGenerator``s: the randomness of ``Dropout``). One the set-up cells leave unbuilt (a
  ``Sequential`` without an ``Input``, built by its first call) is built from the saved build
  config first.
- A compiled model (``model.compile(optimizer=...)``, trained by ``fit`` one epoch at a time in a
  ``resume_range`` loop): its optimizer's variables too, as below; only the model holds it.
- An optimizer: every variable (its step count, learning rate, moments). One the set-up cells
  leave unbuilt (its variables are made by its first step) is built first for the variables it was
  built for: those of the Keras models of the notebook with the same paths (or, where the paths
  differ, the one model whose trainable variables have the same shapes).
- A metric (``keras.metrics.Mean``): its variables (a running mean within an epoch).

A Keras object inside a pickled value (``nets = {"a": model_a, "b": model_b}`` and their optimizers
in a dict, a model in a list or in an object of the notebook's class) is saved the same way, by
its variables, in the pickle's place of it (:class:`Saved`), and assigned at the restore into the
object in that place then (:func:`~colab_resilience.checkpoints.restore.into`). Pickled whole, it
came back a new object: a rolled-back ``tf.function`` went on training the old one, and the
optimizer lost its moments and step count. With no Keras object of its kind in that place (the
name bound anew, the dict without that key), the restore stops in one line.

A variable of another shape or dtype than the saved one stops the restore in one line, and
nothing is assigned. One saved unbuilt (at a safe point before the model's first call) and built
now (an out-of-memory error in the first iteration, retried in the kernel) raises
:class:`~colab_resilience.errors.BuiltSinceError`: only a restarted kernel's set-up cells make it
unbuilt again. Nothing here imports Keras: a value is one of these only if Keras is imported.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping

KINDS = ("layer", "optimizer", "metric")


def _keras():
    keras = sys.modules.get("keras")
    if keras is None or not (hasattr(keras, "Layer") and hasattr(keras, "optimizers") and hasattr(keras, "metrics")):
        return None  # Keras 2 (tf.keras of old) has none of this API: not handled
    return keras


def loaded() -> bool:
    """Whether Keras (3) is imported: only then can a value hold a Keras object."""
    return _keras() is not None


def kind(value: Any) -> str | None:
    """``"layer"`` (a model is a layer), ``"optimizer"``, ``"metric"``, or None for anything else."""
    keras = _keras()
    if keras is None:
        return None
    if isinstance(value, keras.Layer):
        return "layer"
    if isinstance(value, keras.optimizers.Optimizer):
        return "optimizer"
    if isinstance(value, keras.metrics.Metric):
        return "metric"
    return None


def array(variable):
    """What a Keras variable holds, as a NumPy array of its own."""
    import numpy as np

    return np.array(variable.numpy(), copy=True)


def state_dict(value: Any) -> dict[str, Any]:
    """What ``value`` holds (see the module docstring), as plain values and arrays."""
    what = kind(value)
    variables = list(value.variables)
    state: dict[str, Any] = {
        "keras": what,
        "paths": [v.path for v in variables],
        "values": [array(v) for v in variables],
    }
    if what == "layer":
        state["build"] = value.get_build_config() if value.built else None
        state["policies"] = dtype_policies(value)
        state["compiled"] = compiled(value)
        optimizer = compiled_optimizer(value)
        if optimizer is not None:  # model.compile(optimizer=...): fit steps it, and only the model holds it
            state["optimizer"] = state_dict(optimizer)
    elif what == "optimizer":
        built_for = list(getattr(value, "_trainable_variables", None) or []) if value.built else []
        state["built_for"] = [v.path for v in built_for]
        state["built_for_shapes"] = [list(v.shape) for v in built_for]
    return state


def load(name: str, target: Any, state: Mapping[str, Any], namespace: Mapping[str, Any],
         restore_layers: Callable[[], None]) -> None:
    """Assign the saved variables of ``name`` into ``target`` (building it first where it is not
    built); ``restore_layers`` restores the Keras layers of the same restore first (an optimizer
    is built for their variables). Raises :class:`~colab_resilience.errors.CheckpointError`, with
    nothing assigned, where the variables do not match."""
    from .. import words
    from ..errors import BuiltSinceError, CheckpointError

    what = state.get("keras")
    if what != kind(target):
        raise CheckpointError(f"colab_resilience: cannot restore {name!r} into what it holds now: it was saved "
                              f"as a Keras {what}, and now holds {words.a(type(target).__name__)}")
    unbuilt = (what == "layer" and state.get("build") is None) or (what == "optimizer" and not state.get("built_for"))
    if unbuilt and target.built and len(list(target.variables)) != len(state["values"]):
        raise BuiltSinceError(f"colab_resilience: cannot restore {name!r}: the Keras {what} was not built yet at the "
                              "safe point and is built now, and no saved state makes it unbuilt again")
    try:
        if what == "layer" and not target.built and state.get("build") is not None:
            target.build_from_config(state["build"])
        elif what == "optimizer" and not target.built and state.get("built_for"):
            restore_layers()
            target.build(_built_for(name, state, namespace))
    except CheckpointError:
        raise
    except Exception as e:
        from .values import first_line

        raise CheckpointError(f"colab_resilience: cannot restore {name!r}: building the Keras {what} as it was "
                              f"saved failed ({first_line(e)}); build it in a %%replay cell as it was built") from None
    variables = list(target.variables)
    problem = _mismatch(name, what, state["paths"], state["values"], variables)
    if not problem and what == "layer":
        changed = policy_changed(f"the Keras {what}", state.get("policies"), target) or \
            compile_changed(f"the Keras {what}", state.get("compiled"), target)
        problem = f"colab_resilience: cannot restore {name!r}: {changed}" if changed else None
    if problem:
        raise CheckpointError(problem)
    optimizer = state.get("optimizer")
    if isinstance(optimizer, Mapping):
        now = compiled_optimizer(target)
        if now is None:
            raise CheckpointError(f"colab_resilience: cannot restore {name!r}: the Keras model was saved compiled, "
                                  "with its optimizer, and is not compiled now; compile it in a %%replay cell as it "
                                  "was compiled")
        # checked before anything is assigned where it is as built as it was (one to build for the
        # model is checked once built; one built since the safe point: BuiltSinceError, in load)
        if bool(now.built) == bool(optimizer.get("built_for")):
            problem = _mismatch(f"{name}.optimizer", "optimizer", optimizer["paths"], optimizer["values"],
                                list(now.variables))
            if problem:
                raise CheckpointError(problem)
    for variable, value in zip(variables, state["values"]):
        variable.assign(value)
    if isinstance(optimizer, Mapping):  # the model's variables are its own now: build for them, assign
        load(f"{name}.optimizer", compiled_optimizer(target), optimizer, {**namespace, name: target},
             restore_layers=lambda: None)


class Saved:
    """A Keras object of a pickled value, as its pickle holds it: its :func:`state_dict`, assigned
    by :meth:`put` into the object in its place at the restore. ``holder``: the saved name whose
    value holds it; ``namespace``, ``restore_layers``: as :func:`load` takes them."""

    __slots__ = ("state", "holder", "namespace", "restore_layers", "placed")

    def __init__(self, state: Mapping[str, Any], holder: str, namespace: Mapping[str, Any],
                 restore_layers: Callable[[], None]):
        self.state, self.holder, self.namespace, self.restore_layers = state, holder, namespace, restore_layers
        self.placed = False

    def put(self, target: Any) -> bool:
        """Assign the saved variables into ``target``, a Keras object of the saved kind (raises
        :class:`~colab_resilience.errors.CheckpointError` where they do not fit); False, with nothing
        done, where ``target`` is not one."""
        if kind(target) != self.state.get("keras"):
            return False
        load(self.holder, target, self.state, self.namespace, self.restore_layers)
        self.placed = True
        return True

    def unplaced(self) -> str:
        """The line that stops a restore where no Keras object took this one's variables."""
        what = "model or layer" if self.state.get("keras") == "layer" else self.state.get("keras")
        paths = self.state.get("paths") or []
        named = f" ({paths[0].split('/')[0]})" if paths else ""
        return (f"colab_resilience: cannot restore {self.holder!r}: it holds a Keras {what}{named}, saved by its "
                f"variables, and no Keras {what} is in its place now to take them; build {self.holder!r} in a "
                "%%replay cell as it was built, and change it in the loop in place rather than binding it anew")


def compiled_optimizer(model: Any) -> Any:
    """The Keras optimizer ``model.compile`` gave ``model``, or None."""
    try:
        optimizer = getattr(model, "optimizer", None)
    except Exception:
        return None
    return optimizer if kind(optimizer) == "optimizer" else None


def _built_for(name: str, state: Mapping[str, Any], namespace: Mapping[str, Any]) -> list:
    """The variables an unbuilt optimizer is built for: those with the saved paths among the
    Keras layers of ``namespace``, else the trainable variables of its one layer with the saved
    shapes."""
    from ..errors import CheckpointError

    layers = layers_of(namespace)
    by_path: dict[str, Any] = {}
    for layer in layers:
        for v in layer.trainable_variables:
            by_path.setdefault(v.path, v)
    paths = list(state["built_for"])
    if all(p in by_path for p in paths):
        return [by_path[p] for p in paths]
    shapes = [list(s) for s in state["built_for_shapes"]]
    alike = {id(layer): layer for layer in layers
             if [list(v.shape) for v in layer.trainable_variables] == shapes}
    if len(alike) == 1:
        return list(next(iter(alike.values())).trainable_variables)
    shown = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
    raise CheckpointError(
        f"colab_resilience: cannot restore {name!r}: the optimizer was built for the variables {shown}, and "
        f"{'no Keras model' if not alike else 'more than one Keras model'} of the notebook holds them now; build "
        f"the model in a %%replay cell and save it with the optimizer (--save model,{name})")


def layers_of(namespace: Mapping[str, Any]) -> list:
    """The Keras models and layers of the notebook: those its names hold, and those in the lists,
    tuples and dicts its names hold (``nets = {"a": ..., "b": ...}``)."""
    layers = []
    for k, v in list(namespace.items()):
        if not isinstance(k, str) or k.startswith("_"):
            continue
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
        layers.extend(item for item in list(items) if kind(item) == "layer")
    return layers


def dtype_policies(layer: Any) -> list[list[str]]:
    """``[name, dtype policy]`` of ``layer`` and of each layer in it, in order. A mixed policy
    (``mixed_bfloat16``) computes in another dtype on the same float32 variables: a model built
    under another one has variables like the saved ones and computes otherwise."""
    flatten = getattr(layer, "_flatten_layers", None)
    try:
        layers = list(flatten(include_self=True, recursive=True)) if callable(flatten) else [layer]
    except Exception:
        layers = [layer]
    found = []
    for each in layers:
        policy = getattr(getattr(each, "dtype_policy", None), "name", None)
        if policy is not None:
            found.append([str(getattr(each, "name", "?")), str(policy)])
    return found


def compiled(model: Any) -> dict[str, str] | None:
    """What ``model.compile`` was given that ``fit`` computes with, each as JSON: the loss, its
    weights, the metrics, the optimizer's class (``"optimizer"``) and hyperparameters
    (``"optimizer.beta_1"``) but its name (numbered in each process), its rate's value (a variable
    of it, which goes with its state, and which a callback may lower; a schedule is compared) and
    its gradient accumulation (which a ``--shrink`` raises). None where it is not compiled (or not a
    model)."""
    import json

    get = getattr(model, "get_compile_config", None)
    try:
        config = get() if callable(get) else None
    except Exception:
        config = None
    if not config:
        return None
    config = dict(config)
    optimizer = config.pop("optimizer", None)
    if isinstance(optimizer, Mapping) and isinstance(optimizer.get("config"), Mapping):
        config["optimizer"] = optimizer.get("class_name")
        config.update({f"optimizer.{k}": v for k, v in optimizer["config"].items()
                       if k not in ("name", "gradient_accumulation_steps")})
    elif optimizer is not None:
        config["optimizer"] = optimizer
    shown = {k: json.dumps(v, sort_keys=True, default=repr) for k, v in config.items()}
    if isinstance(config.get("optimizer.learning_rate"), (int, float)):
        shown["optimizer.learning_rate"] = "a rate"  # (its value goes with the optimizer's variables)
    # (an object without a JSON form shown by its address differs in every process: not compared)
    return {k: v for k, v in shown.items() if " at 0x" not in v}


def compile_changed(what: str, saved: Any, model: Any) -> str | None:
    """Where ``model`` is compiled otherwise than ``saved`` (its :func:`compiled` at the safe point;
    a checkpoint of an earlier version has none), what differs and why, in words that go after
    "cannot restore ...: "; else None (also where it is not compiled now, which is said apart)."""
    now = compiled(model)
    if not saved or now is None:
        return None
    from .. import words

    shown = words.differences(saved, now)
    if shown is None:
        return None
    return (f"{what} is compiled otherwise than it was saved ({shown}): a model.compile(...) in a cell that is "
            "not %%replay is not run again in a new kernel; compile it in a %%replay cell as the run began with it")


def policy_changed(what: str, saved: Any, layer: Any) -> str | None:
    """Where a layer of ``layer`` computes with another dtype policy than ``saved`` (its
    :func:`dtype_policies` at the safe point; a checkpoint of an earlier version has none), what
    differs and why, in words that go after "cannot restore ...: "; else None."""
    if not saved:
        return None
    now = dtype_policies(layer)
    if len(now) != len(saved):  # another architecture: its variables say so
        return None
    for i, ((_, was), (name, policy)) in enumerate(zip(saved, now)):
        if was != policy:
            which = what if i == 0 else f"layer {name} of {what}"
            return (f"{which} computes with Keras's dtype policy {policy} now and was saved "
                    f"computing with {was}, on variables alike: a policy set in a plain cell "
                    "(keras.mixed_precision.set_global_policy) is not set again in a new kernel; set it in a "
                    "%%replay cell before the model is built")
    return None


def _mismatch(name: str, what: str, paths: list[str], values: list, now: list) -> str | None:
    """One line for variables that cannot take the saved values, or None."""
    import numpy as np

    if len(now) != len(values):
        return (f"colab_resilience: cannot restore {name!r}: the Keras {what} was saved with {len(values)} "
                f"variables and has {len(now)} now; build it in a %%replay cell as it was built")
    for path, value, variable in zip(paths, values, now):
        value = np.asarray(value)
        if tuple(variable.shape) != value.shape or str(variable.dtype) != str(value.dtype):
            return (f"colab_resilience: cannot restore {name!r}: variable {path} of the Keras {what} was saved as "
                    f"{value.dtype}{list(value.shape)} and is {variable.dtype}{list(variable.shape)} now; "
                    f"build it in a %%replay cell as it was built{floatx_cause(value.dtype, variable.dtype)}")
    return None


def floatx_cause(saved: Any, now: Any) -> str:
    """Where a variable made in Keras's default float type now was saved in another float type:
    the words that name ``keras.config.set_floatx`` in a plain cell as the likely cause (a new
    kernel has float32); else ""."""
    keras = _keras()
    config = getattr(keras, "config", None)
    if config is None or not hasattr(config, "floatx"):
        return ""
    saved, now, default = str(saved), str(now), str(config.floatx())
    if saved == now or now != default or not saved.startswith(("float", "bfloat")):
        return ""
    return (f" (Keras's default float type is {default} now: keras.config.set_floatx({saved!r}) in a cell that is "
            "not %%replay is not run again in a new kernel; call it in a %%replay cell before the model is built)")
