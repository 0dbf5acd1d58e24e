"""Is this an out-of-memory error, what does it hold, and how is it released.

``classify(exc)`` walks an exception and its ``__cause__``/``__context__`` chain and answers with
an :class:`OOMVerdict` or ``None``. Types are checked before messages, by class *name* along the
MRO, so no framework is ever imported just to check (a TensorFlow user need not have torch, and
the other way round).

``release(exc, shell)`` drops what a caught error keeps alive: the locals of every frame in its
traceback (and in its chained exceptions'), ``sys.last_*``, the cell's entry in IPython's output
history; then it collects garbage and empties the allocator cache of a framework that is already
imported. It returns how many bytes that gave back to the operating system (host RSS plus CUDA
memory reserved by torch, :func:`colab_resilience.memory.memory_in_use`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
import sys
from dataclasses import dataclass

from .memory import memory_in_use

#: The verdicts. ``RECOVERABLE``: free memory and retry in this process.
#: ``RESTART``: the process (or its CUDA context) is unusable; only a new kernel helps.
RECOVERABLE = "recoverable"
RESTART = "restart"

#: The words in the message of an out-of-memory error ``colab-resilience check`` raises on purpose
#: (:mod:`.faults`): the label says so, not "CUDA" on a machine without a GPU.
INJECTED = "(injected by colab-resilience check)"

# (fully qualified class name or bare name, short label). Matched against every class in the
# exception's MRO, so subclasses count and nothing is imported.
_OOM_TYPES = (
    ("torch.OutOfMemoryError", "CUDA out of memory"),
    ("torch.cuda.OutOfMemoryError", "CUDA out of memory"),
    # NumPy raises numpy.core._exceptions._ArrayMemoryError (a MemoryError subclass); the plain
    # MemoryError row below catches it and every other allocation failure of CPython itself.
    ("tensorflow.python.framework.errors_impl.ResourceExhaustedError", "TensorFlow resources exhausted"),
    ("builtins.MemoryError", "MemoryError"),
)

# (pattern, short label): for errors that frameworks raise as a generic RuntimeError (torch's
# CPU allocator, TorchScript re-raising a CUDA OOM, MPS, the CUDA libraries, NCCL, DataLoader
# workers) or as their own runtime error (JAX). Phrases a user might quote must begin a line of
# the message (after an optional "SomeError: "); the libraries' status codes may stand anywhere.
# The first match names the error.
_LINE = r"(?m)^[ \t]*(?:[\w.]+(?:Error|Exception): )?"
_OOM_MESSAGES = tuple((re.compile(pattern), label) for pattern, label in (
    (_LINE + r"CUDA out of memory\.", "CUDA out of memory"),
    (_LINE + r"CUDA error: out of memory", "CUDA error: out of memory"),
    (_LINE + r"HIP error: out of memory", "HIP error: out of memory"),
    (_LINE + r"CUDA driver error: out of memory", "CUDA driver error: out of memory"),
    (r"DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: can't allocate memory"),
    (_LINE + r"MPS backend out of memory", "MPS backend out of memory"),
    (r"\bCUBLAS_STATUS_ALLOC_FAILED\b", "CUBLAS_STATUS_ALLOC_FAILED"),
    (r"\bCUDNN_STATUS_ALLOC_FAILED\b", "CUDNN_STATUS_ALLOC_FAILED"),
    (r"\bCUDNN_STATUS_\w*NOT_ENOUGH_WORKSPACE\b|\bNOT_ENOUGH_WORKSPACE\b", "cuDNN: not enough workspace"),
    (r"\bCUSOLVER_STATUS_ALLOC_FAILED\b", "CUSOLVER_STATUS_ALLOC_FAILED"),
    (r"\bCUFFT_ALLOC_FAILED\b", "CUFFT_ALLOC_FAILED"),
    (r"Cuda failure 'out of memory'", "NCCL: CUDA out of memory"),
    (r"DataLoader worker \(pid[^)]*\) is killed by signal: Killed", "a DataLoader worker was killed (out of host memory)"),
    (r"DataLoader worker \(pid[^)]*\) is killed by signal: Bus error", "a DataLoader worker ran out of shared memory"),
    (r"unable to write to file </torch_[^>]*>: No space left on device", "shared memory (/dev/shm) is full"),
    (_LINE + r"RESOURCE_EXHAUSTED: (?!.*\b(?:429|[Qq]uota)\b)(?=.*(?:[Mm]emory|allocat))", "RESOURCE_EXHAUSTED"),
    (_LINE + r"\w+ out of memory\.", "out of memory"),
))

# Messages after which a CUDA context is poisoned: every later CUDA call fails too, so an
# in-process retry cannot succeed. Checked before the OOM rows: they win when both appear.
_FATAL_MESSAGES = (
    ("device-side assert triggered", "CUDA device-side assert triggered"),
    ("illegal memory access", "CUDA illegal memory access"),
    ("CUDA error: unspecified launch failure", "CUDA unspecified launch failure"),
)

# Exception types whose message is looked at. A ValueError that mentions "memory" is a user's
# mistake, not an OOM; frameworks use these (or subclasses) for allocation failures.
_MESSAGE_BEARING = ("builtins.RuntimeError", "builtins.MemoryError")
_MESSAGE_BEARING_NAMES = ("JaxRuntimeError", "XlaRuntimeError", "AcceleratorError")


@dataclass(frozen=True)
class OOMVerdict:
    """What ``classify`` found: ``kind`` is RECOVERABLE or RESTART, ``label`` a short reason."""

    kind: str
    label: str
    exc: BaseException

    @property
    def needs_restart(self) -> bool:
        return self.kind == RESTART

    @property
    def host(self) -> bool:
        """Whether host memory ran out (not an accelerator's): see :func:`host_memory`."""
        return host_memory(self.label)


_DEVICE_WORDS = ("CUDA", "HIP", "MPS", "CUBLAS", "CUDNN", "cuDNN", "CUSOLVER", "CUFFT", "NCCL")


def host_memory(label: str) -> bool:
    """Whether the OOM labelled ``label`` may be host memory running out: anything but a GPU's
    (an unspecific label, such as JAX's RESOURCE_EXHAUSTED, counts as host memory)."""
    return not any(word in label for word in _DEVICE_WORDS)


def _qualnames(exc: BaseException):
    for cls in type(exc).__mro__:
        module = cls.__module__
        yield cls.__name__, f"{module}.{cls.__qualname__}"


def _chain(exc: BaseException | None, limit: int = 32, *, every_context: bool = False):
    """The exception, then its causes, each once (chains can be cyclic). A context (an error
    raised while another was being handled) counts only where it is wrapped: the outer message
    repeats the inner one. ``except OutOfMemoryError: raise ValueError("bad config")`` is a
    ValueError. ``every_context``: every context, for freeing what they hold."""
    seen: set[int] = set()
    stack = [exc]
    while stack and len(seen) < limit:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.append(e.__cause__)
        context = e.__context__
        if context is not None and (every_context or (e.__cause__ is None and not e.__suppress_context__
                                                      and _wraps(e, context))):
            stack.append(context)


def _wraps(outer: BaseException, inner: BaseException) -> bool:
    first = next((line.strip() for line in str(inner).splitlines() if line.strip()), "")
    return bool(first) and first in str(outer)


def _classify_one(exc: BaseException) -> tuple[str, str] | None:
    names = list(_qualnames(exc))
    qualified = {q for _, q in names}
    bare = {n for n, _ in names}
    message_bearing = bool(qualified.intersection(_MESSAGE_BEARING) or bare.intersection(_MESSAGE_BEARING_NAMES))
    message = str(exc) if message_bearing else ""
    for needle, label in _FATAL_MESSAGES:
        if needle in message:
            return RESTART, label
    for qualname, label in _OOM_TYPES:
        if qualname in qualified:
            if INJECTED in str(exc):  # colab-resilience check's, raised as torch's on any machine
                return RECOVERABLE, "out of memory, " + INJECTED.strip("()")
            if qualname == "builtins.MemoryError":
                # a bare MemoryError() carries no text; NumPy's says what it tried to allocate
                text = str(exc).split("\n", 1)[0]
                label = f"MemoryError: {text[:60]}" if text else "MemoryError"
            return RECOVERABLE, label
    for pattern, label in _OOM_MESSAGES:
        if message and pattern.search(message):
            return RECOVERABLE, label
    return None


def classify(exc: BaseException | None) -> OOMVerdict | None:
    """Return a verdict if ``exc`` (or anything in its cause/context chain) is an OOM.

    A poisoned-CUDA error anywhere in the chain makes the verdict RESTART, even if an OOM is
    also present. ``KeyboardInterrupt`` and ``SystemExit`` are never OOMs.
    """
    if exc is None or isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return None
    found: OOMVerdict | None = None
    for e in _chain(exc):
        hit = _classify_one(e)
        if hit is None:
            continue
        kind, label = hit
        if kind == RESTART:
            return OOMVerdict(RESTART, label, e)
        if found is None:
            found = OOMVerdict(kind, label, e)
    return found


def is_oom(exc: BaseException | None) -> bool:
    return classify(exc) is not None


# --------------------------------------------------------------------------------------------
# releasing what an error holds


def clear_exception(exc: BaseException | None) -> None:
    """Drop the frame locals held by ``exc``'s traceback and by every chained exception's."""
    for e in _chain(exc, every_context=True):
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            try:
                frame.clear()
            except RuntimeError:  # still executing (one of ours): nothing of the user's in it
                pass
            else:
                # Before Python 3.13, anything that read frame.f_locals (a traceback renderer,
                # a debugger) left a snapshot dict on the frame that clear() does not touch;
                # reading f_locals again re-syncs that snapshot with the now empty frame.
                frame.f_locals
            tb = tb.tb_next
        e.__traceback__ = None


_libc = None


def _malloc_trim() -> None:
    """Give freed heap pages back to the OS (glibc); otherwise RSS never shows what was freed."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def empty_framework_caches() -> None:
    """Empty the allocator caches of frameworks that are already imported (never import one)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception:
            pass
        try:
            mps = getattr(torch, "mps", None)
            if mps is not None and torch.backends.mps.is_available():
                mps.empty_cache()
        except Exception:
            pass
    _malloc_trim()


def forget_last_error(shell=None, execution_count: int | None = None) -> None:
    """Drop ``sys.last_*`` and, with a shell, the cell's stored output and IPython's copy."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            try:
                delattr(sys, name)
            except AttributeError:
                pass
    if shell is None:
        return
    out = getattr(shell, "user_ns", {}).get("Out")
    if isinstance(out, dict) and execution_count is not None:
        out.pop(execution_count, None)
    for attr in ("_last_traceback",):
        if getattr(shell, attr, None) is not None:
            setattr(shell, attr, None)


def release(exc: BaseException | None, shell=None, execution_count: int | None = None,
            before: int | None = None) -> int:
    """Free what ``exc`` holds, collect, empty caches; return the bytes given back (≥ 0), counted
    from ``before`` (a :func:`memory_in_use` the caller took before dropping references of its
    own) or from now.

    The caller must drop its own references to ``exc`` (and to anything the failing code
    returned) for the memory to go: this function can clear frames, not the caller's variables.
    """
    if before is None:
        before = memory_in_use()
    clear_exception(exc)
    forget_last_error(shell, execution_count)
    del exc
    gc.collect()
    empty_framework_caches()
    return max(0, before - memory_in_use())
