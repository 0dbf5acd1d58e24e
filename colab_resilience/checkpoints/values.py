"""What a value is saved as: its kind, and the blob prepared for it in memory.

Kinds, decided per value at save time (:func:`prepare`):

- ``state_dict``: anything with ``state_dict()`` and ``load_state_dict()`` (``nn.Module``,
  optimizers, LR schedulers, ``GradScaler``); its state dict is saved, and restored in place. A
  Keras model, layer, optimizer or metric is one too: its variables (:mod:`.keras_state`).
- ``tensor``, ``ndarray``, ``tree`` (containers holding tensors or arrays): a safetensors blob
  (:mod:`.tensorfile`), the structure in its metadata.
- ``value``: plain values as tagged JSON (:mod:`.codec`).
- ``pytree``: a JAX pytree that is not plain data (a flax ``TrainState``, an optax state, an
  ``nnx`` object): its leaves, restored into the object the set-up cells rebuilt (:mod:`.pytree`).
- ``pickle``: anything else, pickled.

A state dict is saved as tagged JSON or safetensors too when it is plain enough, and pickled
otherwise (its kind stays ``state_dict``). Values that cannot be saved at all (generators, open
files, sockets, locks, threads, modules, live iterators, values pickle refuses, objects that raise
whatever they raise when looked at) raise :class:`~colab_resilience.errors.UnsaveableValueError`,
whose one-line message names the value and the reason; the save lists them and saves the rest.
Running out of memory while a value is prepared is not "cannot save": MemoryError and the
frameworks' out-of-memory errors (:func:`colab_resilience.oom.is_oom`) propagate as they are, for
the package's OOM handling; so do KeyboardInterrupt and SystemExit.

Pickles keep a NumPy masked array exactly (:func:`_reduce_masked_array`): NumPy's own pickling
turns "no mask" into a full False mask and drops the hard-mask flag.

A pickled value keeps the objects it shares with the other names of its save (:class:`Shared`):
where it reaches the object another saved name holds (``trainer.model is model``, both saved), or a
tensor of a saved module (``trainer.params``), the pickle holds a reference to that name, and the
restore puts the restored object there, not a copy cut off from it. A Keras object it reaches is
held by its variables, assigned at the restore into the object in its place (:mod:`.keras_state`).
Where it reaches the object of
a name that is not saved (and has a state: a module, an optimizer, a tensor, an array, a random
number generator), :attr:`Prepared.cut_off` names it, for the save to say so once.
"""

from __future__ import annotations

import copyreg
import io
import mmap
import pickle
import socket
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import NotPlainError, UnsaveableValueError
from ..oom import is_oom
from ..words import did_you_mean
from . import codec, keras_state, pytree, tensorfile
from .rng import is_generator
from .tensorfile import Payload


@dataclass
class Prepared:
    """A value turned into the bytes of its blob (still in memory), with what the manifest says
    of it. ``format``: ``"st"`` (safetensors), ``"json"`` (tagged JSON) or ``"pickle"``."""

    name: str
    kind: str
    type_name: str
    format: str
    payload: Payload
    refs: tuple[str, ...] = ()  # the other saved names a pickle refers to (:class:`Shared`)
    cut_off: tuple[str, ...] = ()  # names not saved whose object the pickle holds a copy of


def type_name(value: Any) -> str:
    """``module.QualifiedName`` of the value's type."""
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}"


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``: an error quoted inside a one-line message (just the
    type when its message is empty, or cannot even be made)."""
    try:
        text = str(e).strip().splitlines()
    except Exception:
        text = []
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


REF = "colab_resilience"  # the first item of a pickle's reference to another saved name
KERAS = "colab_resilience.keras"  # the first item of a pickle's Keras object, saved by its variables


class Shared:
    """What the other names of one save hold, for its pickles (see the module docstring): the
    objects of the saved names (``name -> object``) and of the rest of ``namespace``. Looked at
    only once a value is pickled (most saves pickle nothing)."""

    def __init__(self, namespace: Mapping[str, Any], names: Sequence[str]):
        self._namespace, self._names = namespace, names
        self._saved: dict[int, tuple[Any, tuple]] | None = None
        self._elsewhere: dict[int, tuple[Any, str]] = {}

    def _look(self) -> None:
        saved: dict[int, tuple[Any, tuple]] = {}
        torch = sys.modules.get("torch")
        for n in self._names:
            obj = self._namespace[n]
            if not n.isidentifier() or _immutable(obj):
                continue
            saved.setdefault(id(obj), (obj, (n,)))
            if torch is not None and isinstance(obj, torch.nn.Module):
                try:  # a module is restored in place: its own tensors are the ones to refer to
                    tensors = obj.state_dict(keep_vars=True)
                except Exception:
                    tensors = {}
                for key, t in tensors.items():
                    if isinstance(t, torch.Tensor):
                        saved.setdefault(id(t), (t, (n, key)))
        for n, obj in list(self._namespace.items()):
            if (isinstance(n, str) and n.isidentifier() and not n.startswith("_") and n not in self._names
                    and id(obj) not in saved and _has_state(obj)):
                self._elsewhere.setdefault(id(obj), (obj, n))
        self._saved = saved

    def pickler(self, f, name: str, root: Any) -> pickle.Pickler:
        """A pickler of ``root`` (saved as ``name``) that refers to the objects of the other saved
        names; its ``refs`` and ``cut_off`` say what it met."""
        if self._saved is None:
            self._look()
        return _SharingPickler(f, name, root, self._saved, self._elsewhere)


class _SharingPickler(pickle.Pickler):
    def __init__(self, f, name, root, saved, elsewhere):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.name, self.root, self.saved, self.elsewhere = name, root, saved, elsewhere
        self.refs: dict[str, None] = {}
        self.cut_off: dict[str, None] = {}

    def persistent_id(self, obj):
        if obj is self.root:
            return None
        hit = self.saved.get(id(obj))
        if hit is not None and hit[0] is obj and hit[1][0] != self.name:
            self.refs[hit[1][0]] = None
            return (REF, *hit[1])
        if keras_state.kind(obj) is not None:  # by its variables, assigned into the object in its place
            return (KERAS, keras_state.state_dict(obj))
        hit = self.elsewhere.get(id(obj))
        if hit is not None and hit[0] is obj:
            self.cut_off[hit[1]] = None
        return None


def no_cycle(p: Prepared, before: Sequence[Prepared], namespace: Mapping[str, Any]) -> None:
    """UnsaveableValueError where ``p``'s pickle and those prepared ``before`` it refer to one
    another in a ring: each is unpickled into a new object, so none could be made first (a value
    restored in place can, it exists already)."""
    if p.kind != "pickle" or not p.refs:
        return
    pickles = {q.name: q.refs for q in before if q.kind == "pickle"}
    seen, todo = set(), list(p.refs)
    while todo:
        n = todo.pop()
        if n == p.name:
            ring = " and ".join(repr(q) for q in p.refs if q in pickles)
            reason = f"it and {ring} hold each other, and each is pickled, so neither could be unpickled first"
            raise UnsaveableValueError(
                f"colab_resilience: cannot save {p.name!r}: {reason}; save only one of them (the other "
                f"comes back inside it, as it was), or rebuild one in a %%replay cell", p.name,
                type_name(namespace[p.name]), reason)
        if n in pickles and n not in seen:
            seen.add(n)
            todo.extend(pickles[n])


def _immutable(obj: Any) -> bool:
    """A value whose identity nothing can observe through a change (small ints are shared)."""
    return isinstance(obj, (int, float, complex, str, bytes, bool, type(None), tuple, frozenset, range,
                            type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType))


def saved_by_state(value: Any) -> bool:
    """Whether a checkpoint holds ``value``'s state rather than ``value`` (a torch module, an
    optimizer, a Keras model: anything with a state dict): a restore loads it into the object of
    that name, which must exist by then."""
    if isinstance(value, type):
        return False
    if keras_state.kind(value) is not None:
        return True
    try:
        return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
    except Exception:  # a property, or a __getattr__, that raises
        return False


def holds_state(value: Any) -> bool:
    """Whether ``value`` holds a state that methods change in place: a random number generator, a
    module with parameters, buffers or torchmetrics metrics (not a loss function), anything with a
    state dict."""
    if isinstance(value, (type, types.ModuleType)):
        return False
    if is_generator(value) or keras_state.kind(value) is not None:
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.nn.Module):  # a torchmetrics metric keeps its states apart
        from .. import carried

        return any(True for _ in value.parameters()) or any(True for _ in value.buffers()) \
            or bool(carried.metrics_of(value))
    try:
        if getattr(value, "use_stateful_dataloader", None) is False:  # accelerate's loader: its state_dict raises
            return False
        return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
    except Exception:  # a property, or a __getattr__, that raises
        return False


def _has_state(obj: Any) -> bool:
    """An object whose copy, once cut off from it, would go its own way: a tensor, an array, or
    what :func:`holds_state`."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if (torch is not None and isinstance(obj, torch.Tensor)) or (np is not None and isinstance(obj, np.ndarray)):
        return True
    return holds_state(obj)


def prepare(name: str, value: Any, device_copy=None, shared: Shared | None = None, *, whole: bool = False) -> Prepared:
    """The blob for ``value``, saved under ``name``; raises UnsaveableValueError, whatever
    inspecting or encoding the value raised, except an out-of-memory error (and KeyboardInterrupt
    or SystemExit), which propagates as it is. ``device_copy``: how CUDA tensors are copied to
    the host (see :func:`.tensorfile.payload`); ``shared``: what the other names of the save hold
    (a pickle refers to them). ``whole``: a torch module is pickled whole, not saved by its state
    dict, for a restore that binds it (a ``best = copy.deepcopy(model)`` the loop makes: no object
    of that name exists to load a state dict into after a restart)."""
    torch = sys.modules.get("torch")
    if whole and torch is not None and isinstance(value, torch.nn.Module):
        try:
            return encode(name, "value", type_name(value), value, device_copy=device_copy, shared=shared)
        except UnsaveableValueError:
            raise
        except Exception as e:
            _unless_oom(e)
            raise unsaveable(name, value, f"looking at it raised {first_line(e)}") from None
    try:
        return _prepare(name, value, device_copy, shared)
    except UnsaveableValueError:
        raise
    except Exception as e:
        _unless_oom(e)
        raise unsaveable(name, value, f"looking at it raised {first_line(e)}") from None


def _prepare(name: str, value: Any, device_copy, shared: Shared | None) -> Prepared:
    if keras_state.kind(value) is not None:  # its variables, assigned into the rebuilt one at a restore
        return encode(name, "state_dict", type_name(value), keras_state.state_dict(value), value, device_copy, shared)
    try:
        sd_fn = getattr(value, "state_dict", None)
        stateful = (callable(sd_fn) and callable(getattr(value, "load_state_dict", None))
                    and not isinstance(value, type))
    except Exception as e:  # a property, or a __getattr__, that raises something else than AttributeError
        _unless_oom(e)
        raise unsaveable(name, value, f"looking up its state_dict raised {first_line(e)}") from None
    if stateful:
        try:
            sd = sd_fn()
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(value, torch.nn.Module):  # what its state dict leaves out
                from .. import carried

                sd = carried.with_module_states(value, sd)
        except Exception as e:
            _unless_oom(e)
            raise unsaveable(name, value, f"its state_dict() failed: {first_line(e)}") from None
        return encode(name, "state_dict", type_name(value), sd, value, device_copy, shared)
    reason = unsaveable_reason(value)
    if reason:
        raise unsaveable(name, value, reason)
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        kind = "tensor"
    elif np is not None and isinstance(value, np.ndarray):
        kind = "ndarray"
    else:
        kind = "value"
    return encode(name, kind, type_name(value), value, device_copy=device_copy, shared=shared)


def _unless_oom(e: Exception) -> None:
    """Re-raise ``e`` if it is running out of memory (the OOM handling must see it as one)."""
    if is_oom(e):
        raise e


def encode(name: str, kind: str, of_type: str, value: Any, owner: Any = None, device_copy=None,
           shared: Shared | None = None) -> Prepared:
    """``value`` as tagged JSON, as safetensors if it holds tensors or arrays, else pickled.
    ``of_type`` is what the manifest records as its type; ``owner`` the object the value was taken
    from (the error names its type if pickling fails). Whatever the tagged JSON or safetensors
    encoding raises, the value is pickled instead; if pickling fails too, UnsaveableValueError."""
    enc = codec.Encoder(leaves=True)
    try:
        tree = enc.encode(value)
        if enc.leaves:
            return Prepared(name, "tree" if kind == "value" else kind, of_type, "st",
                            tensorfile.payload(tree, enc.leaves, device_copy))
        return Prepared(name, kind, of_type, "json", Payload([codec.json_bytes(tree)]))
    except (NotPlainError, RecursionError):
        pass
    except Exception as e:  # a tensor or container that breaks the encoder: pickle gets a try
        _unless_oom(e)
    if kind == "value":
        try:
            tree = pytree.flatten(value)
            if tree is not None:  # a TrainState, an optax state, an nnx object: by its leaves
                enc = codec.Encoder(leaves=True)
                encoded = enc.encode(tree)
                return Prepared(name, "pytree", of_type, "st" if enc.leaves else "json",
                                tensorfile.payload(encoded, enc.leaves, device_copy) if enc.leaves
                                else Payload([codec.json_bytes(encoded)]))
        except (NotPlainError, RecursionError):
            pass
    f = io.BytesIO()
    root = value if owner is None else owner
    if shared is not None and name.isidentifier():
        pickler = shared.pickler(f, name, root)
    elif keras_state.loaded():  # the Keras objects it holds, by their variables
        pickler = _SharingPickler(f, name, root, {}, {})
    else:
        pickler = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        dump(pickler, value)
    except Exception as e:
        _unless_oom(e)
        raise unsaveable(name, value if owner is None else owner, f"pickle failed: {first_line(e)}") from None
    return Prepared(name, kind if kind == "state_dict" else "pickle", of_type, "pickle", Payload([f.getvalue()]),
                    refs=tuple(getattr(pickler, "refs", ())), cut_off=tuple(getattr(pickler, "cut_off", ())))


def dump(pickler: pickle.Pickler, value: Any) -> None:
    """``pickler.dump(value)``, with NumPy masked arrays kept exactly (:func:`_reduce_masked_array`)."""
    ma = sys.modules.get("numpy.ma")  # a masked array exists only if numpy.ma was imported
    if ma is not None:
        pickler.dispatch_table = {**copyreg.dispatch_table, ma.MaskedArray: _reduce_masked_array}
    pickler.dump(value)


def _reduce_masked_array(a):
    """Pickle a ``numpy.ma.MaskedArray`` (that exact type) as its parts: the data, the mask
    (None for ``nomask``), the fill value as set (None if never set), the hard-mask and
    shared-mask flags, the base class. NumPy's own ``__reduce__`` saves ``getmaskarray()``,
    so "no mask" came back as a full False mask, and the hard-mask flag was lost."""
    import numpy as np

    mask = a._mask
    return _masked_array, (
        type(a), a.view(np.ndarray), None if mask is np.ma.nomask else mask, a._fill_value,
        bool(a._hardmask), bool(a._sharedmask), a._baseclass, bool(a._isfield),
    )


def _masked_array(cls, data, mask, fill_value, hardmask, sharedmask, baseclass, isfield):
    """The masked array :func:`_reduce_masked_array` took apart. Pickles name this function:
    it is part of the checkpoint format, keep its name and arguments."""
    import numpy as np

    a = data.view(cls)
    a._mask = np.ma.nomask if mask is None else mask
    a._fill_value = fill_value
    a._hardmask = hardmask
    a._sharedmask = sharedmask
    a._baseclass = baseclass
    a._isfield = isfield
    return a


def unsaveable_reason(value: Any) -> str | None:
    """Why ``value`` cannot be checkpointed, or None."""
    if isinstance(value, (types.GeneratorType, types.AsyncGeneratorType)):
        return "a generator's position inside its code cannot be stored"
    if isinstance(value, types.CoroutineType):
        return "a coroutine's position inside its code cannot be stored"
    if isinstance(value, io.IOBase):
        return "an open file or stream belongs to this process"
    if isinstance(value, socket.socket):
        return "a socket is a live connection"
    if isinstance(value, mmap.mmap):
        return "a memory map belongs to this process"
    if isinstance(value, (type(threading.Lock()), type(threading.RLock()), threading.Condition,
                          threading.Semaphore, threading.Event)):
        return "a lock or synchronisation primitive belongs to running threads"
    if isinstance(value, threading.Thread):
        return "a thread is running code in this process"
    if isinstance(value, types.ModuleType):
        return "a module is imported again, not saved; import it in a %%replay cell"
    if isinstance(value, type):
        return ("a class is saved by its name, not by its attributes, and comes back as the class the replayed "
                "cells define; keep what changes in an object of it (cfg = Cfg()) and save that")
    if isinstance(value, (types.FrameType, types.TracebackType)):
        return "a frame belongs to running code"
    tp = type(value)
    if hasattr(tp, "__next__") and hasattr(tp, "__iter__"):
        try:
            if iter(value) is value:
                return "a live iterator has no stable state"
        except Exception:
            pass
    return None


def unsaveable(name: str, value: Any, reason: str) -> UnsaveableValueError:
    """The error for a value that cannot be saved (its message is what the save reports)."""
    message = (
        f"colab_resilience: cannot save {name!r}: {type(value).__name__} objects cannot be "
        f"checkpointed ({reason}); recreate it in a %%replay cell and save what it holds instead "
        f"(its arrays, its state_dict()), or leave it out of --save"
    )
    return UnsaveableValueError(message, name, type_name(value), reason)


def missing_name_message(name: str, namespace: Mapping[str, Any], verb: str) -> str:
    """One line for a name that is not in ``namespace``: the closest user name, and what exists."""
    names = _user_names(namespace)
    hint = did_you_mean(name, names)
    shown = ", ".join(names[:15]) + (", ..." if len(names) > 15 else "")
    return (
        f"colab_resilience: cannot {verb} {name!r}: no variable of that name{hint}; "
        f"defined: {shown or 'nothing'}; nothing was written"
    )


def _user_names(namespace: Mapping[str, Any]) -> list[str]:
    hidden = {"In", "Out", "exit", "quit", "get_ipython", "open", "resume_range", "checkpoint"}
    return sorted(
        n for n, v in namespace.items()
        if isinstance(n, str) and not n.startswith("_") and n not in hidden and not isinstance(v, types.ModuleType)
    )
