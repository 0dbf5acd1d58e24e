"""The few calls a supervising driver makes inside a kernel.

A driver (:mod:`colab_resilience.driver`) talks to its kernels only through these functions: it
sends the line :func:`colab_resilience.client.api_call` spells, which imports this module and
calls one of them. Each takes and returns plain values (literals).
"""

from __future__ import annotations

import re

from . import standby

__all__ = [
    "adopt_standby",
    "become_standby",
    "become_worker",
    "connected",
    "declare_replay_cell",
    "expect_reexecution",
    "kernel_identity",
    "new_modules",
    "preload",
    "stop_standby_imports",
    "rerun_finished",
    "restore_finished_runs",
    "state_digest",
]


def restore_finished_runs(dead_pid: int | None = None, rerun_source: str | None = None,
                          kernels: list[str] | None = None) -> dict:
    """Put back the final state of every run that finished, oldest first. After a restart in a
    cell that follows a finished ``%%resilient`` cell, replaying the set-up cells alone would hand
    that cell an untrained model. Returns ``{"restored": names, "unsaved": run ids, "rerun":
    [[run id, what it holds], ...]}``: the runs that finished in the kernel ``dead_pid`` but saved
    nothing to put back, and those whose framework state :func:`rerun_finished` puts back (not
    the run of the cell ``rerun_source``, which is run again); ``kernels``: only runs last held
    by those kernels (:func:`.journal.kernel_identity`)."""
    from .commands import restore_finished_runs as restore
    from .session import session_of

    restored, unsaved, rerun, not_back = restore(session_of(), dead_pid, rerun_source, held=kernels)
    return {"restored": restored, "unsaved": unsaved, "rerun": [list(r) for r in rerun], "not_back": not_back}


def rerun_finished(run_id: str) -> None:
    """Run the cell of the finished run ``run_id`` again, silently, so that its framework
    callback loads the run's final state into the model the set-up cells rebuilt (it trains
    nothing). Raises what the cell raised."""
    from .commands import rerun_finished as rerun
    from .session import session_of

    rerun(session_of(), run_id)


def declare_replay_cell(source: str) -> None:
    """Record a cell the driver already executed as a set-up cell (a cell tagged ``replay``:
    nbclient sends no cell metadata, so the kernel cannot see the tag)."""
    from .session import session_of

    session_of().replay_log.record(None, source)


def expect_reexecution() -> None:
    """The next ``%%resilient`` cell is the one a dead kernel was running: if its run finished
    before the death, it is not run again (:func:`restore_finished_runs` put its state back)."""
    from .session import session_of

    session_of().reexecuting = True


def new_modules() -> str:
    """The installed modules imported since the last call, with the environment they were
    imported under and whether the global random states had changed before, as JSON (see
    :func:`colab_resilience.standby.new_modules`)."""
    import json

    return json.dumps(standby.new_modules())


def become_standby(whole: bool = False) -> None:
    standby.become(whole)


def connected() -> str:
    """(Asked by a supervisor as it connects.) This kernel's identity (:func:`kernel_identity`),
    once this package's extension is loaded in it. The ``%load_ext`` the supervisor has a kernel
    run as it starts fails quietly (IPython prints why to the kernel's stderr, which nobody
    reads); this raises why (the package, or one it needs, missing from the kernel's Python), for
    the supervisor to say so before any cell fails of it."""
    from IPython import get_ipython

    from . import load_ipython_extension

    shell = get_ipython()
    if shell is not None:
        load_ipython_extension(shell)  # once loaded, it returns at once
    return kernel_identity()


def kernel_identity() -> str:
    """This kernel's identity (:func:`.journal.kernel_identity`): a supervisor puts back the
    finished runs of its own kernels only."""
    from .journal import kernel_identity as identity

    return identity()


def become_worker(oom_score_adj: int) -> str:
    """(In an isolation worker.) Volunteer for the OOM killer before the notebook's kernel; a
    standby about to be adopted takes that score when it is (it keeps the standby's till then).
    Returns this kernel's identity (:func:`.journal.kernel_identity`): the relay puts back the
    finished runs of its own workers only."""
    from . import priority
    from .journal import kernel_identity

    if not standby.keep_for_adoption(oom_score_adj):
        priority.set_oom_score_adj(oom_score_adj)
    return kernel_identity()


def preload(groups: list) -> None:
    standby.preload(groups)


def stop_standby_imports() -> str:
    return standby.stop_importing()


def adopt_standby(nice: int | None = None) -> None:
    standby.adopt(nice)


def state_digest() -> dict[str, list]:
    """For ``colab-resilience check``: every variable of the notebook as ``[digest, preview]``:
    a BLAKE3 of the bytes a checkpoint would hold for it (the same bytes for the same value),
    and a short repr for plain scalars (else None). Modules, functions, classes and IPython's
    own names are left out; a value that cannot be saved is digested by its type, and so is a
    progress bar, a display handle, a widget or a logger (what they hold, their times and display
    ids, differs between any two runs, and is no result of the training). A number that a
    dict names as a time or a rate (``train_runtime``, ``eval_samples_per_second``: the metrics a
    Hugging Face ``Trainer`` returns) is digested as "a time": it differs between any two runs."""
    import types

    import blake3

    from . import carried, lint
    from .checkpoints import values
    from .errors import UnsaveableValueError
    from .session import session_of

    shell = session_of().shell
    hidden = shell.user_ns_hidden
    out: dict[str, list] = {}
    for name, value in list(shell.user_ns.items()):
        if name.startswith("_") or name in hidden or isinstance(value, (types.ModuleType, types.FunctionType,
                                                                        types.BuiltinFunctionType, type)):
            continue
        if lint.shows_only(value):
            out[name] = [f"display:{values.type_name(value)}", None]
            continue
        if _keras_variables(value) is not None:  # what its variables hold (their names count the models made)
            h = blake3.blake3()
            _walk(value, h, set(), 0)
            out[name] = [f"keras:{h.hexdigest()}", None]
            continue
        try:
            prepared = values.prepare(name, _in_key_order(value))
        except UnsaveableValueError:
            out[name] = [f"unsaveable:{values.type_name(value)}", None]
            continue
        except Exception as e:  # a value whose state_dict() or pickle fails in an unexpected way
            out[name] = [f"error:{type(e).__name__}", None]
            continue
        h = blake3.blake3()
        # a pickle's bytes differ from process to process; a time measured differs from run to run
        if prepared.format == "pickle" or _holds_a_time(value):
            _walk(value, h, set(), 0)
        else:  # safetensors and tagged JSON: the same bytes for the same value
            for segment in prepared.payload.segments:
                h.update(segment)
            # a module is also its modes, requires_grad flags and plain attributes, which go beside
            # its state_dict (a counter its forward keeps)
            _walk(carried.snapshot({name: value}, [name]).get(name), h, set(), 0)
        plain = isinstance(value, (int, float, complex, str, bytes, bool, type(None)))
        out[name] = [f"{prepared.kind}:{h.hexdigest()}", repr(value)[:60] if plain else None]
    return out


def _in_key_order(value, depth: int = 0):
    """``value`` with its plain dicts (and those in its lists, tuples and dicts) in the order of
    their keys: two equal dicts are one value whatever the order their keys were set in (an
    optimizer's param group, loaded from a state dict, has ``params`` last, not first)."""
    if depth > 20:
        return value
    if type(value) is dict:
        try:
            items = sorted(value.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        except Exception:
            return value
        return {k: _in_key_order(v, depth + 1) for k, v in items}
    if type(value) in (list, tuple):
        return type(value)(_in_key_order(v, depth + 1) for v in value)
    return value


def _walk(value, h, seen: set, depth: int) -> None:
    """Feed ``h`` with what ``value`` holds: the bytes of tensors and arrays, the repr of plain
    leaves, the attributes of objects (each object once; code by its name only)."""
    import types

    import random

    h.update(type(value).__qualname__.encode())
    torch, np = __import__("sys").modules.get("torch"), __import__("sys").modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return
    if np is not None and isinstance(value, np.ndarray):
        h.update(f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
        return
    if isinstance(value, (int, float, complex, str, bytes, bool, type(None))) or depth > 32:
        h.update(repr(value).encode())
        return
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType)):
        h.update(getattr(value, "__qualname__", getattr(value, "__name__", "")).encode())
        return
    if type(value) not in (tuple, frozenset):  # an immutable value shared or not is the same value
        if id(value) in seen:
            h.update(b"<seen>")
            return
        seen.add(id(value))
    variables = _keras_variables(value)
    if variables is not None:  # a Keras model, layer or optimizer is what its variables hold
        for v in variables:
            _walk(np.asarray(v.numpy()), h, seen, depth + 1)
        return
    tf = __import__("sys").modules.get("tensorflow")
    if tf is not None and isinstance(value, (tf.Variable, tf.Tensor)):  # its value (its __dict__ holds handles)
        try:
            _walk(np.asarray(value.numpy()), h, seen, depth + 1)
            return
        except Exception:  # a symbolic tensor: no value
            pass
    if tf is not None and isinstance(value, tf.GradientTape):  # what a tape recorded is not a result
        return
    table = _pandas_contents(value)
    if table is not None:  # a DataFrame is what it holds: its __dict__ is caches and block layout
        _walk(table, h, seen, depth + 1)
        return
    checkpoint = _lightning_checkpoint(value)
    if checkpoint is not None:  # a Lightning Trainer is what its checkpoint holds (it keeps clock readings)
        _walk(checkpoint, h, seen, depth + 1)
        return
    state = _lightning_callback_state(value)
    if state is not None:  # a Lightning callback in a list too is what a name bound to it is: its state_dict
        _walk(state, h, seen, depth + 1)
        return
    if isinstance(value, random.Random):  # its state is not in its __dict__
        _walk(value.getstate(), h, seen, depth + 1)
        return
    if isinstance(value, dict):
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            if _is_a_time(k, value[k]):
                h.update(b"<a time>")
                continue
            _walk(value[k], h, seen, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk(v, h, seen, depth + 1)
    elif isinstance(value, (set, frozenset)):
        for v in sorted(value, key=repr):
            _walk(v, h, seen, depth + 1)
    elif hasattr(value, "__dict__"):
        _walk(vars(value), h, seen, depth + 1)
    else:
        _walk_reduced(value, h, seen, depth)


def _pandas_contents(value) -> dict | None:
    """What a pandas DataFrame, Series or Index holds, for :func:`_walk` (None for anything else):
    its labels, dtypes and values, column by column. Its attributes are caches and a block layout
    that differ between two equal frames (one unpickled), and hold no values a walk reaches."""
    pd = __import__("sys").modules.get("pandas")
    if pd is None or not isinstance(value, (pd.DataFrame, pd.Series, pd.Index)):
        return None

    def values(x) -> object:
        a = x.to_numpy()
        return a.tolist() if a.dtype.hasobject else a

    if isinstance(value, pd.Index):
        return {"index": values(value), "dtype": str(value.dtype), "name": value.name}
    if isinstance(value, pd.Series):
        return {"index": _pandas_contents(value.index), "dtype": str(value.dtype), "name": value.name,
                "values": values(value)}
    return {"index": _pandas_contents(value.index), "columns": _pandas_contents(value.columns),
            "dtypes": [str(t) for t in value.dtypes], "values": [values(value.iloc[:, i]) for i in range(value.shape[1])],
            "attrs": value.attrs}


_TIME = re.compile(r"(^|_)(runtime|time|seconds|duration)$|_per_second$")


def _is_a_time(key, value) -> bool:
    """A number a dict names as a time or a rate (``train_runtime``, ``samples_per_second``)."""
    return (isinstance(key, str) and isinstance(value, (int, float)) and not isinstance(value, bool)
            and _TIME.search(key) is not None)


def _holds_a_time(value, depth: int = 0) -> bool:
    """Whether a plain value holds a number named as a time (see :func:`_is_a_time`)."""
    if depth > 4:
        return False
    if isinstance(value, dict):
        return any(_is_a_time(k, v) or _holds_a_time(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds_a_time(v, depth + 1) for v in value[:1000])
    return False


def _walk_reduced(value, h, seen: set, depth: int) -> None:
    """An object without a ``__dict__`` (a NumPy ``Generator``, an extension type): what it pickles
    as (its constructor's arguments and its state), else its repr without memory addresses (which
    differ from process to process)."""
    import re

    try:
        reduced = value.__reduce_ex__(4)
    except Exception:
        reduced = None
    if isinstance(reduced, tuple) and len(reduced) >= 2:
        _walk(list(reduced[1:3]), h, seen, depth + 1)
        return
    h.update(re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value)).encode())


def _lightning_callback_state(value):
    """What a Lightning callback with a ``state_dict`` of its own holds (what Lightning writes of it
    into a checkpoint, and what :func:`state_digest` digests of one bound to a name), or None for
    anything else (a callback without one is its attributes, which the integration saves). Its
    other attributes are its workings: ``ModelCheckpoint`` keeps the clock reading of its last
    check."""
    import sys

    pl = sys.modules.get("lightning.pytorch")
    if pl is None or not isinstance(value, pl.Callback) or type(value).state_dict is pl.Callback.state_dict:
        return None
    try:
        return value.state_dict()
    except Exception:  # a callback whose state_dict fails: walked by its attributes
        return None


def _lightning_checkpoint(value):
    """What a Lightning ``Trainer`` that has a module writes into a checkpoint (the module's, the
    optimizers', the schedulers', the loops', the callbacks' state), or None for anything else."""
    import sys

    pl = sys.modules.get("lightning.pytorch")
    if pl is None or not isinstance(value, pl.Trainer) or value.lightning_module is None:
        return None
    try:
        return value._checkpoint_connector.dump_checkpoint(weights_only=False)
    except Exception:  # a Trainer between fits, in a state it cannot dump
        return None


def _keras_variables(value):
    """The variables of a Keras layer or model (and of its optimizer), optimizer or metric, or
    None for anything else."""
    from .checkpoints import keras_state

    kind = keras_state.kind(value)
    if kind is None:
        return None
    optimizer = getattr(value, "optimizer", None) if kind == "layer" else None
    return list(value.variables) + (list(optimizer.variables) if optimizer is not None else [])
