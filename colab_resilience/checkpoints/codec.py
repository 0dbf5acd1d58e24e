"""Tagged JSON: plain Python values as JSON that reads back as the same types, with nothing executed.

JSON lacks tuples, sets, bytes, non-string keys, big or non-finite numbers; each is written as a
one-key object whose key starts with ``$``::

    {"$t": [...]} tuple       {"$s": [...]} set        {"$fs": [...]} frozenset
    {"$d": [[k, v], ...]}     a dict with a key that is not a plain string
    {"$od": [[[k, v], ...], metadata]}      an OrderedDict (a module's state_dict, with its version info)
    {"$b": base64} bytes      {"$ba": base64} bytearray
    {"$i": hex} int of more than 8000 bits  {"$f": hex of the 8 bytes} nan, inf, -inf
    {"$c": [re, im]} complex  {"$np": [dtype, base64]} NumPy scalar
    {"$lf": base64} a list of 64 or more floats (a loss history), as binary doubles
    {"$T": i} the i-th tensor or array (torch, NumPy, JAX) of the blob (stored beside the JSON, see :mod:`.tensorfile`)

A value that is not plain (an object, a container that holds itself or appears twice, a
tensor subclass, a nested tensor) makes :class:`Encoder` raise
:class:`~colab_resilience.errors.NotPlainError`; the checkpoint then pickles that value instead.
"""

from __future__ import annotations

import base64
import collections
import json
import math
import struct
import sys
from typing import Any, Sequence

from .. import words
from ..errors import NotPlainError

# what decoding malformed input raises (JSON, tags, struct, safetensors headers): a damaged checkpoint
MALFORMED = (ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error, RecursionError)


def _b64(data) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


class Encoder:
    """Plain values to tagged JSON. With ``leaves``, tensors and arrays become ``{"$T": i}`` and
    are collected in :attr:`leaves` (the same view of the same storage once)."""

    def __init__(self, leaves: bool):
        self.allow_leaves = leaves
        self.leaves: list[Any] = []
        self._leaf_ids: dict[Any, int] = {}
        self._active: set[int] = set()
        self._seen: set[int] = set()
        self.torch = sys.modules.get("torch")  # a value can only be a tensor if torch is imported
        self.np = sys.modules.get("numpy")
        self.jax = sys.modules.get("jax")

    def encode(self, x: Any) -> Any:
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return {"$i": hex(x)} if x.bit_length() > 8000 else x
        if t is float:
            return x if math.isfinite(x) else {"$f": struct.pack("<d", x).hex()}
        if t is complex:
            return {"$c": [self.encode(x.real), self.encode(x.imag)]}
        if t is bytes:
            return {"$b": _b64(x)}
        if t is bytearray:
            return {"$ba": _b64(x)}
        if t in (list, tuple, dict, set, frozenset, collections.OrderedDict):
            return self._container(x, t)
        torch, np = self.torch, self.np
        if torch is not None and isinstance(x, torch.Tensor):
            return self._leaf(x)
        if self.jax is not None and isinstance(x, self.jax.Array):
            return self._leaf(x)  # a JAX array (a PRNG key too): its bytes, its dtype by name
        if np is not None:
            if t is np.ndarray:
                return self._leaf(x)
            if isinstance(x, np.generic):
                dt = x.dtype
                if dt.hasobject or dt.fields is not None or np.dtype(dt.str) != dt:
                    raise NotPlainError("a NumPy scalar of a dtype its string does not name")
                return {"$np": [dt.str, _b64(np.asarray(x).tobytes())]}
        raise NotPlainError(f"{words.a(t.__name__)} is not plain data")

    def _container(self, x, t):
        i = id(x)
        if i in self._active:
            raise NotPlainError("it contains itself")  # pickle keeps the cycle
        if t not in (tuple, frozenset):
            if i in self._seen:
                raise NotPlainError("the same mutable container twice")  # pickle keeps the aliasing
            self._seen.add(i)
        self._active.add(i)
        try:
            enc = self.encode
            if t is list:
                if len(x) >= 64 and set(map(type, x)) == {float}:  # a history of losses: binary
                    return {"$lf": _b64(struct.pack(f"<{len(x)}d", *x))}
                return list(x) if _json_scalars(x) else [enc(v) for v in x]
            if t is tuple:
                return {"$t": list(x) if _json_scalars(x) else [enc(v) for v in x]}
            if t is set:
                return {"$s": [enc(v) for v in x]}
            if t is frozenset:
                return {"$fs": [enc(v) for v in x]}
            if t is dict:
                if all(type(k) is str and not k.startswith("$") for k in x):
                    return {k: enc(v) for k, v in x.items()}
                return {"$d": [[enc(k), enc(v)] for k, v in x.items()]}
            meta = getattr(x, "_metadata", None)  # module state_dicts carry version info here
            return {"$od": [[[enc(k), enc(v)] for k, v in x.items()], enc(meta)]}
        finally:
            self._active.discard(i)

    def _leaf(self, x) -> dict:
        if not self.allow_leaves:
            raise NotPlainError("no tensors or arrays here")
        torch = self.torch
        key: Any = id(x)
        if torch is not None and isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, torch.nn.Parameter):
                raise NotPlainError("a tensor subclass")  # FakeTensor, DTensor...: more than data
            if x.is_nested:  # torch.nested (strided layout): its pickle keeps sizes, strides, offsets
                raise NotPlainError("a nested tensor")
            if x.layout is not torch.strided or x.is_quantized or x.device.type == "meta":
                raise NotPlainError("a tensor that is not plain strided data")
            if x.numel():  # the same view of the same storage is one tensor
                key = (
                    "v", x.device.type, x.device.index, x.untyped_storage().data_ptr(),
                    x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype,
                )
        elif self.jax is None or not isinstance(x, self.jax.Array):
            if x.dtype.hasobject or x.dtype.fields is not None or self.np.dtype(x.dtype.str) != x.dtype:
                raise NotPlainError("an array of a dtype its string does not name")
        idx = self._leaf_ids.get(key)
        if idx is None:
            idx = self._leaf_ids[key] = len(self.leaves)
            self.leaves.append(x)
        return {"$T": idx}


def _json_scalars(items) -> bool:
    """True when every item is JSON as it is (a long history of losses: one pass, no recursion)."""
    for v in items:
        t = type(v)
        if t is float:
            if v - v != 0.0:  # inf or nan
                return False
        elif t is int:
            if v.bit_length() > 8000:
                return False
        elif not (t is str or t is bool or v is None):
            return False
    return True


def decode(x: Any, leaves: Sequence[Any]) -> Any:
    """The value tagged JSON ``x`` stands for; ``{"$T": i}`` is ``leaves[i]``. ValueError (or
    another error of malformed input) if it is not tagged JSON this package writes."""
    if isinstance(x, list):
        if not any(type(v) is list or type(v) is dict for v in x):
            return list(x)  # scalars decode to themselves (a fresh list: no aliasing across restores)
        return [decode(v, leaves) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) == 1:
        (tag, v), = x.items()
        if tag.startswith("$"):
            if tag == "$t":
                return tuple(decode(e, leaves) for e in v)
            if tag == "$d":
                return {decode(k, leaves): decode(e, leaves) for k, e in v}
            if tag == "$s":
                return {decode(e, leaves) for e in v}
            if tag == "$fs":
                return frozenset(decode(e, leaves) for e in v)
            if tag == "$f":
                return struct.unpack("<d", bytes.fromhex(v))[0]
            if tag == "$lf":
                data = base64.b64decode(v, validate=True)
                return list(struct.unpack(f"<{len(data) // 8}d", data))  # struct.error unless n*8 bytes
            if tag == "$c":
                return complex(decode(v[0], leaves), decode(v[1], leaves))
            if tag == "$b":
                return base64.b64decode(v, validate=True)
            if tag == "$ba":
                return bytearray(base64.b64decode(v, validate=True))
            if tag == "$i":
                return int(v, 16)
            if tag == "$T":
                if type(v) is not int or not 0 <= v < len(leaves):
                    raise ValueError("a tensor reference points nowhere")
                return leaves[v]
            if tag == "$np":
                import numpy as np

                return np.frombuffer(base64.b64decode(v[1], validate=True), dtype=np.dtype(v[0]))[0]
            if tag == "$od":
                items, meta = v
                od = collections.OrderedDict((decode(k, leaves), decode(e, leaves)) for k, e in items)
                meta = decode(meta, leaves)
                if meta is not None:
                    od._metadata = meta  # type: ignore[attr-defined]
                return od
            raise ValueError(f"unknown tag {tag!r}")
    return {k: decode(v, leaves) for k, v in x.items()}


def json_bytes(obj: Any) -> bytes:
    """Compact JSON (no NaN: tagged JSON never holds one)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
