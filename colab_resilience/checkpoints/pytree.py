"""JAX pytrees (a flax ``TrainState``, optax states, ``nnx`` modules and optimizers): saved by
their leaves, restored **into** the object the replayed set-up cells rebuilt.

A ``TrainState`` holds its ``apply_fn`` and its optax transformation (closures) beside its
arrays, so it cannot be pickled; an optax state is a tree of named tuples; an ``nnx`` object is
a mutable Python object that other objects refer to. What changes during training is only the
leaves (arrays, PRNG keys, a Python ``step``), and the set-up cells build the rest again. So a
value of kind ``pytree`` is saved as the key paths and the leaves of its tree (the arrays in the
safetensors blob, see :mod:`.tensorfile`), and restored by putting those leaves into the tree of
the object of that name that exists at restore time: ``tree_unflatten`` with its tree structure
(the static parts: functions, the optimizer, the model's class), each array put where the
rebuilt object's leaf lives (its device and sharding); an ``nnx`` object is updated in place
(``nnx.update``), so references to it stay good. A rebuilt object whose tree differs (another
model, another optimizer) is refused in one line naming the first difference, and nothing of it
is changed.

A value is a ``pytree`` only when JAX is imported, the value is not plain data (which is saved
as it is, JAX arrays included), and its tree has structure and holds a JAX array, or it is an
``nnx`` object.
"""

from __future__ import annotations

import sys
from typing import Any

from .. import words
from ..errors import CheckpointError, NotPlainError

_SCALARS = (bool, int, float, complex, str, type(None))


def _nnx(value: Any):
    """flax's ``nnx`` module if ``value`` is an ``nnx`` object (module, optimizer, ...), else None."""
    if "flax.nnx" not in sys.modules:
        return None
    nnx = sys.modules["flax.nnx"]
    base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
    return nnx if base is not None and isinstance(value, base) else None


def flatten(value: Any) -> dict | None:
    """``{"paths": [...], "leaves": [...], "nnx": bool}`` for a JAX pytree this module saves, or
    None (not one: the value is saved as before). Raises NotPlainError for a leaf that is not an
    array or a plain scalar (the value is then pickled, or refused)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    nnx = _nnx(value)
    tree = nnx.state(value) if nnx is not None else value
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if nnx is None and (treedef.num_nodes == 1 or not any(isinstance(v, jax.Array) for _, v in pairs)):
        return None
    import numpy as np

    for path, leaf in pairs:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic) + _SCALARS):
            raise NotPlainError(f"its leaf {jax.tree_util.keystr(path)} is {words.a(type(leaf).__name__)}")
    return {"paths": [jax.tree_util.keystr(p) for p, _ in pairs], "leaves": [v for _, v in pairs],
            "nnx": nnx is not None}


def restore_into(name: str, target: Any, saved: dict) -> Any:
    """The object to bind to ``name``: ``target``'s tree with the saved leaves (for an ``nnx``
    object, ``target`` itself, updated in place). CheckpointError, in one line, if the trees
    differ; ``target`` is then left as it was."""
    import jax

    nnx = _nnx(target)
    if bool(saved.get("nnx")) != (nnx is not None):
        raise CheckpointError(f"colab_resilience: cannot restore {name!r} into the {type(target).__name__} that "
                              "exists now: it was saved from " + ("an nnx object" if saved.get("nnx") else "a pytree")
                              + " and now is " + ("an nnx object" if nnx is not None else "not one"))
    tree = nnx.state(target) if nnx is not None else target
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in pairs]
    leaves = list(saved["leaves"])
    if paths != list(saved["paths"]):
        raise CheckpointError(_mismatch(name, target, list(saved["paths"]), paths))
    out = []
    for path, (_, now), new in zip(paths, pairs, leaves):
        problem = _leaf_problem(jax, now, new)
        if problem:
            raise CheckpointError(
                f"colab_resilience: cannot restore {name!r} into the {type(target).__name__} the set-up cells built: "
                f"its leaf {path} {problem}; rebuild it as it was (the same model and optimizer), or "
                "`%resilience reset` to start the run afresh"
            )
        if isinstance(now, jax.Array) and isinstance(new, jax.Array):
            new = _placed(jax, new, now)
        out.append(new)
    restored = jax.tree_util.tree_unflatten(treedef, out)
    if nnx is not None:
        nnx.update(target, restored)
        return target
    return restored


def _placed(jax, new, now):
    """``new`` on the devices (and with the sharding) of ``now``, the rebuilt object's leaf."""
    sharding = getattr(now, "sharding", None)
    if sharding is None:
        return new
    return new if new.sharding == sharding else jax.device_put(new, sharding)


def _leaf_problem(jax, now: Any, new: Any) -> str | None:
    """How a saved leaf does not fit the rebuilt one (shape, dtype), or None. A Python number and
    a 0-d array fit each other (a ``TrainState`` built with ``step=0`` holds an array once a
    jitted step has run): the saved leaf is put back as it was."""
    if hasattr(now, "dtype") and hasattr(new, "dtype"):
        if tuple(now.shape) != tuple(new.shape) or now.dtype != new.dtype:
            return f"is now {now.dtype}{list(now.shape)} and was saved as {new.dtype}{list(new.shape)}"
        return None
    array = now if hasattr(now, "dtype") else new if hasattr(new, "dtype") else None
    if array is not None and tuple(array.shape) != ():
        other = new if array is now else now
        return f"is {'now' if array is now else 'saved as'} an array of shape {list(array.shape)}, " \
               f"and {'was' if array is now else 'is now'} {words.a(type(other).__name__)}"
    return None


def _mismatch(name: str, target: Any, saved: list[str], now: list[str]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), min(len(saved), len(now)))
    was = saved[first] if first < len(saved) else "nothing more"
    is_ = now[first] if first < len(now) else "nothing more"
    return (
        f"colab_resilience: cannot restore {name!r} into the {type(target).__name__} the set-up cells built: "
        f"its tree differs ({len(saved)} leaves saved, {len(now)} now; leaf {first} was {was}, now {is_}); "
        "rebuild it as it was (the same model and optimizer), or `%resilience reset` to start the run afresh"
    )
