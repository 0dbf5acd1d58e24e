"""What a value is saved as: its kind, and the blob prepared for it in memory.

Kinds, decided per value at save time (:func:`prepare`):

- ``state_dict``: anything with ``state_dict()`` and ``load_state_dict()`` (``nn.Module``,
  optimizers, LR schedulers, ``GradScaler``); its state dict is saved, and restored in place.
- ``tensor``, ``ndarray``, ``tree`` (containers holding tensors or arrays): a safetensors blob
  (:mod:`.tensorfile`), the structure in its metadata.
- ``value``: plain values as tagged JSON (:mod:`.codec`).
- ``pickle``: anything else, pickled.

A state dict is saved as tagged JSON or safetensors too when it is plain enough, and pickled
otherwise (its kind stays ``state_dict``). Values that cannot be saved at all (generators, open
files, sockets, locks, threads, modules, live iterators, values pickle refuses) raise
:class:`~colab_resilience.errors.UnsaveableValueError`, whose message names the value and the
reason; the save lists them and saves the rest.
"""

from __future__ import annotations

import difflib
import io
import mmap
import pickle
import socket
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import NotPlainError, UnsaveableValueError
from . import codec, tensorfile
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


def type_name(value: Any) -> str:
    """``module.QualifiedName`` of the value's type."""
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}"


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``: an error quoted inside a one-line message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def prepare(name: str, value: Any) -> Prepared:
    """The blob for ``value``, saved under ``name``; raises UnsaveableValueError."""
    sd_fn = getattr(value, "state_dict", None)
    if callable(sd_fn) and callable(getattr(value, "load_state_dict", None)) and not isinstance(value, type):
        try:
            sd = sd_fn()
        except Exception as e:
            raise unsaveable(name, value, f"its state_dict() failed: {first_line(e)}") from None
        return encode(name, "state_dict", type_name(value), sd, value)
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
    return encode(name, kind, type_name(value), value)


def encode(name: str, kind: str, of_type: str, value: Any, owner: Any = None) -> Prepared:
    """``value`` as tagged JSON, as safetensors if it holds tensors or arrays, else pickled.
    ``of_type`` is what the manifest records as its type; ``owner`` the object the value was taken
    from (the error names its type if pickling fails)."""
    enc = codec.Encoder(leaves=True)
    try:
        tree = enc.encode(value)
    except (NotPlainError, RecursionError):
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise unsaveable(name, value if owner is None else owner, f"pickle failed: {first_line(e)}") from None
        return Prepared(name, kind if kind == "state_dict" else "pickle", of_type, "pickle", Payload([data]))
    if enc.leaves:
        if kind == "value":
            kind = "tree"
        return Prepared(name, kind, of_type, "st", tensorfile.payload(tree, enc.leaves))
    return Prepared(name, kind, of_type, "json", Payload([codec.json_bytes(tree)]))


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
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
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
