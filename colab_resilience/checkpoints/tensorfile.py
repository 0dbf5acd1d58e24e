"""Safetensors files: tensors and arrays written from their own memory, and read back over one buffer.

A blob holding tensors or arrays is a standard safetensors file (``safetensors.safe_open`` reads
it): an 8-byte header length, a JSON header, then the data. The structure around the tensors (the
tagged JSON of :mod:`.codec`) and a description of each tensor or array go to the header's
``__metadata__`` under ``"colab_resilience"``: library, dtype, shape, device, ``requires_grad``,
Parameter or not; for NumPy, C or Fortran order; for JAX, weak typing and a PRNG key's
implementation (a key is stored as its key data). Every torch dtype is kept: dtypes safetensors has
no name for are stored as raw ``U8`` bytes, the real dtype in the description. Different views of
one storage (``{"a": t, "b": t[::2]}``) are stored as the storage span once, each view described by
its stride and offset in it.

Writing makes no copy of contiguous CPU memory: :class:`Payload` is a list of memory segments (the
header, then each tensor's own bytes). Data of more than a chunk starts at a 4 KiB boundary, so
that a header a few bytes longer than at the last save (an optimizer's learning rate printed with
more digits) leaves every chunk boundary where it was, and unchanged data is still recognised
chunk for chunk.

Reading (:func:`parse`, :func:`leaves_over`) checks every length and range, then makes tensors and
arrays that are views of the one buffer the blob was read (or mapped) into.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import sys
from typing import Any

from .hashing import CHUNK

META_KEY = "colab_resilience"
_MAX_HEADER = 256 << 20
_HEADER_ALIGN = 4096

_TORCH_ST = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
_NUMPY_ST = {
    "float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
}
_JAX_ST = {**_NUMPY_ST, "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_ST_SIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "C64": 8, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}


class Payload:
    """A blob as a list of memory segments, plus the objects that keep that memory alive.
    ``live[i]``: segment ``i`` is memory the training owns and may write again (a tensor's or an
    array's own bytes), not a private copy: a snapshot copies it before training goes on."""

    def __init__(self, segments: list, keep: list | None = None, live: list[bool] | None = None):
        self.segments = [memoryview(s).cast("B") for s in segments]
        self.size = sum(s.nbytes for s in self.segments)
        self.keep = keep or []
        self.live = live or [False] * len(self.segments)

    @property
    def live_bytes(self) -> int:
        return sum(s.nbytes for s, live in zip(self.segments, self.live) if live)


def _memory(t) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (and without NumPy)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _cpu_contiguous(t, device_copy=None):
    t = t.detach()
    if t.device.type != "cpu":
        staged = device_copy(t.contiguous()) if device_copy is not None else None
        t = staged if staged is not None else t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


def _memory_order(t) -> list[int] | None:
    """The order of ``t``'s dimensions in memory, outermost first, where it is dense but not laid
    out row-major (``channels_last``, a transpose, even a size-1 dimension's stride): written in
    that order (no copy for a CPU tensor) and read back with its strides. Layout decides results:
    a BatchNorm reduces in memory order, and gives other bits for another. None: row-major
    already, or not dense (an expanded view is written, and comes back, row-major)."""
    if t.numel() < 2 or list(t.stride()) == _row_major(t.shape):
        return None
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return order if t.permute(order).is_contiguous() else None


def _row_major(shape) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return strides[::-1]


def _live(torch, c, x) -> bool:
    """Whether ``c``, the tensor or array written for ``x``, is ``x``'s own memory."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.device.type == "cpu" and c.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    import numpy as np

    return bool(np.may_share_memory(c, x))


def _shared_spans(torch, leaves: list, add, keep: list, descs: list, device_copy=None) -> None:
    """Different views of one storage: the storage span once (``add``), a description per view."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.numel():
            groups.setdefault((x.device.type, x.device.index, x.untyped_storage().data_ptr()), []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        ts = [leaves[i] for i in members]
        if len({t.dtype for t in ts}) != 1 or any(s < 0 for t in ts for s in t.stride()):
            continue
        lo = min(t.storage_offset() for t in ts)
        hi = max(t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 for t in ts)
        if (hi - lo) > 2 * sum(t.numel() for t in ts):
            continue  # mostly gaps: cheaper to save the views apart
        base = ts[0]
        span = torch.empty(0, dtype=base.dtype, device=base.device)
        span.set_(base.untyped_storage(), lo, (hi - lo,), (1,))
        span = _cpu_contiguous(span, device_copy)
        live = _live(torch, span, base)
        keep.append(span)
        dname = str(base.dtype).removeprefix("torch.")
        st = _TORCH_ST.get(dname)
        key = add(_memory(span), st or "U8", [hi - lo] if st else [span.numel() * span.element_size()],
                  min(span.element_size(), 8), live)
        for i, t in zip(members, ts):
            descs[i] = {
                "lib": "torch", "dtype": dname, "shape": list(t.shape), "span": key,
                "stride": list(t.stride()), "offset": t.storage_offset() - lo,
                "device": str(t.device), "requires_grad": bool(t.requires_grad),
                "parameter": type(t) is not torch.Tensor,
            }


def _jax_host(x) -> tuple[Any, dict, bool]:
    """A JAX array's bytes on the host (a PRNG key's key data), its description, and whether
    those bytes are the array's own buffer (a CPU array: XLA may reuse a donated buffer, so a
    snapshot copies it) rather than a copy made here (from an accelerator)."""
    import jax
    import numpy as np

    desc: dict[str, Any] = {"lib": "jax", "shape": list(x.shape), "weak": bool(getattr(x, "weak_type", False))}
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        desc["key_impl"] = str(jax.random.key_impl(x))
        x = jax.random.key_data(x)
    c = np.asarray(x)
    if not c.flags.c_contiguous:
        c = c.copy()  # (not np.ascontiguousarray: it makes a 0-d array 1-d)
    desc["dtype"] = c.dtype.name
    desc["data_shape"] = list(c.shape)
    return c, desc, not c.flags.owndata


def payload(tree: Any, leaves: list, device_copy=None) -> Payload:
    """A safetensors file for ``leaves``; ``tree`` and each leaf's description go to metadata.
    ``device_copy(t)`` (a snapshot's :meth:`~.staging.Staging.device_copy`) copies a CUDA tensor
    to the host without waiting, or returns None for a synchronous copy."""
    torch = sys.modules.get("torch")
    entries: list[tuple] = []  # key, st dtype, shape, memory, alignment, live
    keep: list = []
    descs: list[dict | None] = [None] * len(leaves)

    def add(mem, st_dtype, shape, align, live) -> str:
        key = str(len(entries))
        entries.append((key, st_dtype, shape, mem, align, live))
        return key

    if torch is not None:
        _shared_spans(torch, leaves, add, keep, descs, device_copy)
    for i, x in enumerate(leaves):
        if descs[i] is not None:
            continue
        if torch is not None and isinstance(x, torch.Tensor):
            order = _memory_order(x)
            c = _cpu_contiguous(x.permute(order) if order else x, device_copy)
            keep.append(c)
            dname = str(x.dtype).removeprefix("torch.")
            st = _TORCH_ST.get(dname)
            nbytes = c.numel() * c.element_size()
            key = add(_memory(c), st or "U8", list(c.shape) if st else [nbytes], min(c.element_size(), 8),
                      _live(torch, c, x))
            descs[i] = {
                "lib": "torch", "dtype": dname, "shape": list(x.shape), "key": key,
                "device": str(x.device), "requires_grad": bool(x.requires_grad),
                "parameter": type(x) is not torch.Tensor,
            }
            if order:
                descs[i]["stride"] = list(x.stride())
        elif "jax" in sys.modules and isinstance(x, sys.modules["jax"].Array):
            c, desc, live = _jax_host(x)
            st = _JAX_ST.get(desc["dtype"], "U8")
            mem = memoryview(c.reshape(-1).view("uint8")) if c.nbytes else memoryview(b"")
            desc["key"] = add(mem, st, list(c.shape) if st != "U8" else [c.nbytes], min(max(c.itemsize, 1), 8), live)
            keep.append(c)
            descs[i] = desc
        else:
            import numpy as np

            order = "F" if (x.flags.f_contiguous and not x.flags.c_contiguous and x.ndim > 1) else "C"
            c = np.ascontiguousarray(x.T if order == "F" else x)
            keep.append(c)
            st = _NUMPY_ST.get(x.dtype.name) if x.dtype.isnative else None
            mem = memoryview(c.reshape(-1).view(np.uint8)) if c.nbytes else memoryview(b"")
            key = add(mem, st or "U8", list(c.shape) if st else [c.nbytes], min(max(c.itemsize, 1), 8),
                      _live(None, c, x))
            descs[i] = {"lib": "numpy", "dtype": x.dtype.str, "shape": list(x.shape), "key": key, "order": order}

    entries.sort(key=lambda e: (-e[4], int(e[0])))  # aligned offsets: 8-byte items first
    structure = json.dumps({"tree": tree, "leaves": descs}, separators=(",", ":"), allow_nan=False)
    header: dict[str, Any] = {"__metadata__": {META_KEY: structure}}
    offset = 0
    for key, st, shape, mem, _, _ in entries:
        header[key] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + mem.nbytes]}
        offset += mem.nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    # safetensors allows trailing spaces in the header; smaller data starts 8-aligned, as it does
    hbytes += b" " * (-(8 + len(hbytes)) % (_HEADER_ALIGN if offset >= CHUNK else 8))
    return Payload([struct.pack("<Q", len(hbytes)) + hbytes] + [e[3] for e in entries], keep,
                   [False] + [e[5] for e in entries])


def parse(buf) -> tuple[Any, list[dict], dict[str, tuple[int, int]]]:
    """Check a safetensors buffer; return (tree, leaf descriptions, key -> absolute byte range)."""
    size = len(buf)
    if size < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > min(size - 8, _MAX_HEADER):
        raise ValueError("safetensors header length is out of range")
    header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not an object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(META_KEY), str):
        raise ValueError("not a colab_resilience safetensors file")
    structure = json.loads(meta[META_KEY])
    ranges: dict[str, tuple[int, int]] = {}
    base = 8 + n
    for key, info in header.items():
        a, b = info["data_offsets"]
        count = 1
        for d in info["shape"]:
            if type(d) is not int or d < 0:
                raise ValueError("bad shape")
            count *= d
        if type(a) is not int or type(b) is not int or not 0 <= a <= b <= size - base:
            raise ValueError(f"tensor {key!r} lies outside the file")
        if count * _ST_SIZE[info["dtype"]] != b - a:
            raise ValueError(f"tensor {key!r} has the wrong length")
        ranges[key] = (base + a, base + b)
    if not isinstance(structure, dict) or not isinstance(structure.get("leaves"), list):
        raise ValueError("no structure in the safetensors metadata")
    return structure.get("tree"), structure["leaves"], ranges


def device_if_present(torch, device: str):
    """The torch device named ``device`` where this machine has it, else None."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return None
    if dev.type == "cuda":
        if torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
            return dev
        return None
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    try:
        return dev if callable(available) and available() else None
    except Exception:
        return None


def own_copies(leaves: list[Any], descs: list[dict], *, everything: bool) -> list[Any]:
    """:func:`leaves_over`'s leaves in memory of their own: each torch tensor in an allocation of
    its own (the allocator's alignment, its strides kept; views of one storage stay views of one
    copy), each NumPy array too, and with ``everything`` (a mapped file) what becomes a JAX array. A tensor left in the blob lies
    at an offset aligned only to its item, and BLAS peels an unaligned start off a dot product:
    an L-BFGS whose history came back so summed in another order, and a resumed run differed in
    the last bits. A tensor going back to a device this machine has (a GPU) is left: its move
    there (``restore._place_leaves``) is its own copy, and a second one on the host would hold
    its bytes twice."""
    out = list(leaves)
    torch = sys.modules.get("torch")
    storages: dict[int, Any] = {}
    for i, (d, t) in enumerate(zip(descs, leaves)):
        if d.get("lib") == "torch" and torch is not None and isinstance(t, torch.Tensor):
            device = d.get("device", "cpu")
            if device != "cpu" and device_if_present(torch, device) is not None:
                continue
            if "span" in d:  # a view of a storage others share: the storage copied once
                key = t.untyped_storage().data_ptr()
                if key not in storages:
                    storages[key] = t.untyped_storage().clone()
                out[i] = torch.empty(0, dtype=t.dtype).set_(storages[key], t.storage_offset(), t.shape, t.stride())
            else:
                out[i] = t.clone(memory_format=torch.preserve_format)
        elif d.get("lib") == "numpy" or (everything and d.get("lib") == "jax"):  # (JAX copies its own)
            out[i] = t.copy(order="K")
    return out


def leaves_over(buf, descs: list[dict], ranges: dict[str, tuple[int, int]]) -> list[Any]:
    """Tensors and arrays over ``buf`` (a NumPy uint8 array), on the CPU, without a copy."""
    import numpy as np

    leaves: list[Any] = []
    spans: dict[str, Any] = {}
    for d in descs:
        if not isinstance(d, dict):
            raise ValueError("bad leaf description")
        shape = [int(s) for s in d["shape"]]
        count = math.prod(shape)
        if d["lib"] == "jax":  # a NumPy array here; made a JAX array when it is restored
            import jax.numpy as jnp

            dtype = jnp.dtype(d["dtype"])
            data_shape = [int(s) for s in d.get("data_shape", shape)]
            a, b = ranges[d["key"]]
            if math.prod(data_shape) * dtype.itemsize != b - a:
                raise ValueError("an array has the wrong length")
            leaves.append(buf[a:b].view(dtype).reshape(data_shape))
            continue
        if d["lib"] == "numpy":
            dtype = np.dtype(d["dtype"])
            a, b = ranges[d["key"]]
            if count * dtype.itemsize != b - a:
                raise ValueError("an array has the wrong length")
            arr = buf[a:b].view(dtype)
            arr = arr.reshape(shape[::-1]).T if d.get("order") == "F" else arr.reshape(shape)
            leaves.append(arr)
            continue
        import torch

        dtype = getattr(torch, d["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError("unknown dtype")
        if "span" in d:
            key = d["span"]
            if key not in spans:
                a, b = ranges[key]
                spans[key] = torch.from_numpy(buf[a:b]).view(dtype)
            span = spans[key]
            stride = [int(s) for s in d["stride"]]
            off = int(d["offset"])
            end = off + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if count else off
            if off < 0 or any(s < 0 for s in stride) or end > span.numel():
                raise ValueError("a view lies outside its storage")
            leaves.append(span.as_strided(shape, stride, off))
            continue
        a, b = ranges[d["key"]]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if count * itemsize != b - a:
            raise ValueError("a tensor has the wrong length")
        if count == 0:
            leaves.append(torch.empty(shape, dtype=dtype))
        elif "stride" in d:  # laid out as it was (see _memory_order)
            stride = [int(x) for x in d["stride"]]
            if len(stride) != len(shape) or any(x < 0 for x in stride) or \
                    sum((n - 1) * x for n, x in zip(shape, stride)) + 1 != count:
                raise ValueError("a tensor's strides do not fit its data")
            leaves.append(torch.from_numpy(buf[a:b]).view(dtype).as_strided(shape, stride))
        else:
            leaves.append(torch.from_numpy(buf[a:b]).view(dtype).reshape(shape))
    return leaves
