"""Framework trainers whose own loops become the safe points of a ``%%resilient`` cell.

Each integration is a callback of one line, passed to the framework inside a ``%%resilient``
cell; it drives the cell's :class:`~colab_resilience.loops.Loops` as a ``resume_range`` over the
framework's epochs would, and registers what the framework carries between epochs (its model
and optimizer, restored in place) as state saved with every checkpoint:

- :mod:`colab_resilience.integrations.keras`: Keras 3 ``Model.fit``;
- :mod:`colab_resilience.integrations.transformers`: the Hugging Face ``Trainer.train``;
- :mod:`colab_resilience.integrations.lightning`: Lightning's ``Trainer.fit``.

Importing this package imports no framework.
"""

from __future__ import annotations

import sys

from ..errors import RunStoppedError

_said_outside: set[str] = set()  # the frameworks whose callback said it is outside a %%resilient cell


def say_outside(framework: str) -> None:
    """A framework's callback used outside a ``%%resilient`` cell does nothing: say so, once per kernel."""
    if framework not in _said_outside:
        _said_outside.add(framework)
        print("colab_resilience: ResilienceCallback outside a %%resilient cell: nothing is checkpointed",
              file=sys.stderr)


def require_loop(run, stretches: str, line: str) -> None:
    """Refuse a callback made outside the ``%%resilient`` cell that trains: that cell was not run
    as a loop (of ``stretches``), and a resume would train from the start; ``line`` is what to write."""
    if not run.uses_loop:
        raise RunStoppedError(
            "colab_resilience: ResilienceCallback was made outside the %%resilient cell that trains, so the cell was "
            f"not run as a loop of {stretches}; write `{line}` in that cell"
        )


def every_steps(value) -> int | None:
    """A callback's ``every_steps``: None, or a whole number of steps, 1 or more."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"colab_resilience: every_steps must be a whole number of steps, 1 or more; got {value!r}")
    return value


def accumulation_for(batch: int, effective: int) -> tuple[int, str]:
    """The gradient accumulation that makes an optimizer step take ``effective`` samples in batches
    of ``batch`` after a ``--shrink``, and the words that say what it keeps."""
    steps = -(-effective // batch)
    if batch * steps == effective:
        return steps, f"keeps the effective batch {effective}"
    return steps, (f"makes the effective batch {batch * steps}, not {effective} ({effective} is not a multiple of "
                   f"{batch}): the run goes on with another batch")


def is_plain(value) -> bool:
    """A value a checkpoint holds as it is: None, a number, a string, a flag, and lists, tuples and
    dicts of them (keyed by such values)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all((k is None or isinstance(k, (bool, int, float, str))) and is_plain(v) for k, v in value.items())
    return False


def kept(value) -> bool:
    """A value a checkpoint holds as it is (:func:`is_plain`), or a torch tensor or a NumPy array of
    numbers, or lists, tuples and dicts of such (an EMA's shadow weights a callback keeps)."""
    if is_plain(value):
        return True
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.layout == torch.strided
    if np is not None and isinstance(value, np.ndarray):
        return value.dtype != object
    if isinstance(value, (list, tuple)):
        return all(kept(v) for v in value)
    if isinstance(value, dict):
        return all((k is None or isinstance(k, (bool, int, float, str))) and kept(v) for k, v in value.items())
    return False


def _snapshot(value):
    """``value`` (:func:`kept`) for a checkpoint: plain values copied, tensors detached (the save
    copies them as it takes the safe point)."""
    import copy

    if is_plain(value):
        return copy.deepcopy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value) if type(value) in (list, tuple) else copy.deepcopy(value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    detach = getattr(value, "detach", None)
    return detach() if callable(detach) else value


def plain_attributes(callback) -> tuple[dict, list[str]]:
    """A callback's own state: its attributes that a checkpoint holds (:func:`kept`: counters, the
    best metric so far, flags, tensors, lists and dicts of them); and the names of the others,
    which are not saved. Bound methods are behaviour, not state, and neither (Lightning gives every
    callback the module's ``log`` and ``log_dict``)."""
    saved = {name: _snapshot(value) for name, value in _attributes(callback) if kept(value)}
    return saved, _unplain(callback)


def _attributes(callback):
    import inspect

    return [(name, value) for name, value in vars(callback).items() if not inspect.ismethod(value)]


def _unplain(callback) -> list[str]:
    """The names of a callback's attributes that a checkpoint does not hold (not :func:`kept`)."""
    return [name for name, value in _attributes(callback) if not kept(value)]


def unsaved_attributes(callbacks: dict, whose: str) -> str | None:
    """One line naming the attributes of ``callbacks`` (keyed ``place:type``) that a checkpoint
    cannot hold, or None; ``whose``: the callbacks the line speaks of."""
    parts = []
    for key, cb in callbacks.items():
        left = _unplain(cb)  # (without copying what is saved)
        if left:
            parts.append(f"{key.split(':', 1)[1]}.{', '.join(left)}")
    if not parts:
        return None
    return (f"colab_resilience: the state of {whose} goes with each checkpoint, but not {'; '.join(parts)} (not "
            "plain values or tensors): after a resume they hold what the callback has in this kernel")


def put_attributes(pending: dict, callbacks: dict) -> list[str]:
    """Set the saved attributes ``pending`` (by key) on ``callbacks`` (by key); returns the names of
    those saved whose key this run does not have."""
    import copy

    for key, attributes in pending.items():
        if key in callbacks:
            for name, value in attributes.items():
                setattr(callbacks[key], name, copy.deepcopy(value))  # (the callback may change it in place)
    return [key.split(":", 1)[1] for key in pending if key not in callbacks]


def caller_locals(function: str, owner) -> dict:
    """The local variables of the framework's method ``function`` of ``owner`` (its ``self``) that
    is calling back, or {} when it is not on the stack: what a framework keeps in its loop's
    locals and does not pass to callbacks (Keras ``fit``'s data, the Trainer's steps to skip)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_locals.get("self") is owner:
            return dict(frame.f_locals)
        frame = frame.f_back
    return {}
