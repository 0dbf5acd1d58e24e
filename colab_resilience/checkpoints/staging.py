"""Staging memory: where a snapshot copies the live bytes of the declared state, so that training
may go on (and write its tensors) while the copy is hashed and written in the background.

A save in two phases (:meth:`CheckpointStore.snapshot`, then :meth:`CheckpointStore.persist`)
needs the bytes it will write to stay as they were at the safe point. Tensors and arrays that the
training owns are copied here; everything else a snapshot holds is already a private copy (a
pickle, tagged JSON, a safetensors header, a CUDA tensor copied to the host).

- CPU memory goes into one arena, a NumPy byte array reused from save to save: allocated and
  touched once (a VM backs memory touched for the first time slowly), grown when the state grows,
  copied into by the hashing threads (``np.copyto`` releases the GIL).
- CUDA tensors are copied device-to-host into pinned memory on their device's current stream,
  without waiting for each copy; :meth:`Staging.device_copies_done` waits for them all before the
  snapshot returns, so training never writes a tensor whose copy is still under way. The pinned
  blocks come from torch's caching host allocator, which keeps them for the next save.
- Both are bounded (:class:`Budget`: by default a quarter of the memory this process could still
  take, ``MemAvailable``, its memory cgroup's headroom and its address-space limit, less what an
  iteration of training took beyond its state since the last snapshot). A value that does not
  fit is not staged: the snapshot writes it through during the stall, from the live memory (the
  page cache then holds the copy), and leaves only its flush to the background.
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import Executor, wait
from dataclasses import dataclass

from .. import memory
from .tensorfile import Payload

_GROW = 64 << 20  # the arena grows by whole steps of this, so a slightly larger state reuses it
_PIECE = 16 << 20  # one copy task
_SMALL = 64 << 10  # a smaller segment (a bias, an optimizer's step count) is copied by the snapshot's
# own thread: handing it to the pool costs more than the copy


@dataclass(frozen=True)
class Budget:
    """How much staging memory a snapshot may hold: ``fraction`` of the memory available when it
    is taken, or a fixed number of ``bytes``; neither: none (saves are synchronous)."""

    fraction: float | None = 0.25
    bytes: int | None = None

    @property
    def off(self) -> bool:
        return not self.fraction and not self.bytes

    def limit(self, held: int, transient: int) -> int:
        """The bytes the staging may hold now: ``held`` is what it holds already (reusable),
        ``transient`` what an iteration of training needs beyond what it holds between
        iterations. Only memory left over after that is shared out, so that the staging never
        takes what the next iteration's peak needs: an out-of-memory error is no likelier than
        with synchronous saves."""
        if self.off:
            return 0
        available = memory.available_bytes()
        if available is None:
            return 0
        spare = max(0, available + held - transient)
        return min(self.bytes, spare) if self.bytes is not None else int(spare * self.fraction)

    def describe(self) -> str:
        if self.off:
            return "off"
        if self.bytes is not None:
            return memory.format_bytes(self.bytes)
        return f"{self.fraction * 100:g}% of available memory"


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_budget(text: str) -> Budget:
    """``25%`` (of the memory available at each snapshot), ``2GiB`` / ``512MB`` / a number of
    bytes, or ``0`` / ``off`` (synchronous saves). ValueError with a one-line reason otherwise."""
    t = str(text).strip().lower()
    if t in ("off", "0", "none", "sync"):
        return Budget(None, None)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", t)
    if m:
        fraction = float(m.group(1)) / 100
        if not 0 < fraction <= 1:
            raise ValueError(f"a percentage from 0 to 100 (got {text!r})")
        return Budget(fraction, None)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", t)
    if m and m.group(2) in _UNITS:
        return Budget(None, int(float(m.group(1)) * _UNITS[m.group(2)]))
    raise ValueError(f"a percentage (25%), a size (2GiB, 512MB) or off (got {text!r})")


class Staging:
    """The staging memory of one run (see the module docstring)."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self._arena = None  # NumPy uint8, reused
        self._limit = 0  # of the snapshot being taken
        self._pinned = 0  # bytes of pinned memory the snapshot being taken holds
        self._pinned_ever = False  # torch's host allocator keeps pinned blocks of ours
        self._waiting: set = set()  # devices with copies under way
        self.failed: str | None = None  # why staging memory could not be had (said once)
        self.measured = False  # an iteration's peak was measured before this snapshot
        self._begun = False

    @property
    def held(self) -> int:
        return 0 if self._arena is None else self._arena.nbytes

    def begin(self) -> None:
        """A snapshot starts: measure what it may hold (the first one, taken before any
        iteration ran, goes by the process's peak so far)."""
        self._limit = self.budget.limit(self.held, memory.transient_bytes())
        self.measured, self._begun = self._begun, True
        self._pinned = 0

    def device_copy(self, t):
        """A pinned host tensor that ``t`` (a CUDA tensor) is being copied into; None when the
        budget has no room (the caller copies it synchronously). The copy is queued on the
        stream that is current for ``t``'s device, the training's own: it starts once the work
        that produced ``t`` is done, needs no event per tensor, and the training cannot write
        ``t`` before it, since :meth:`device_copies_done` waits for it before the snapshot
        returns. (A side stream, as asynchronous checkpointing uses to let training run during
        the copy, buys nothing when the safe point waits for the copy anyway, and cost an event
        and a stream switch per tensor: 384 of them for a 50M model with AdamW.)"""
        torch = sys.modules["torch"]
        n = t.numel() * t.element_size()
        if self._pinned + n > self._limit:
            return None
        try:
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: the synchronous copy
            return None
        self._pinned += n
        self._pinned_ever = True
        dst.copy_(t, non_blocking=True)
        self._waiting.add(t.device)
        return dst

    def device_copies_done(self) -> None:
        """Wait for every device-to-host copy of this snapshot (before training goes on)."""
        if self._waiting:
            torch = sys.modules["torch"]
            for device in self._waiting:
                torch.cuda.current_stream(device).synchronize()
            self._waiting.clear()

    def stage(self, payloads: list[Payload], pool: Executor) -> list[bool]:
        """Copy the live segments of each payload that fits into the arena, in order, and point
        the payload at the copies; whether each is now safe to write in the background (True for
        a payload with nothing live). The pinned memory taken by :meth:`device_copy` counts
        against the budget."""
        need = [p.live_bytes for p in payloads]
        room = max(0, self._limit - self._pinned)
        fits, total = [], 0
        for n in need:
            ok = n == 0 or total + n <= room
            fits.append(ok)
            total += n if ok and n else 0
        if total and not self._reserve(total):
            fits = [n == 0 for n in need]
            total = 0
        if not total:
            return fits
        arena = memoryview(self._arena)
        tasks, small, pos = [], [], 0
        for p, ok in zip(payloads, fits):
            if not ok or not p.live_bytes:
                continue
            for i, (seg, live) in enumerate(zip(p.segments, p.live)):
                if not live or not seg.nbytes:
                    continue
                dst = arena[pos : pos + seg.nbytes]
                if seg.nbytes < _SMALL:
                    small.append((dst, seg))
                else:
                    tasks.extend((dst[a : a + _PIECE], seg[a : a + _PIECE]) for a in range(0, seg.nbytes, _PIECE))
                p.segments[i] = dst
                p.live[i] = False
                pos += seg.nbytes
        futures = [pool.submit(_copy, d, s) for d, s in tasks]
        for d, s in small:  # here, while the pool copies the rest
            d[:] = s
        wait(futures)
        for f in futures:
            f.result()
        return fits

    def _reserve(self, nbytes: int) -> bool:
        """An arena of at least ``nbytes``, touched; False when the memory cannot be had."""
        if self._arena is not None and self._arena.nbytes >= nbytes:
            return True
        import numpy as np

        size = -(-nbytes // _GROW) * _GROW
        if size > self._limit:
            size = nbytes
        self._arena = None  # the old one goes first: never both at once
        try:
            arena = np.empty(size, dtype=np.uint8)
            arena.fill(0)  # touch it now, once, not in the first copy
        except MemoryError:
            self.failed = f"{memory.format_bytes(size)} of staging memory could not be allocated"
            return False
        self._arena = arena
        return True

    def release(self) -> None:
        """Give the staging memory back (at the end of the run, and before an OOM retry)."""
        self._arena = None
        torch = sys.modules.get("torch")
        if torch is not None and self._pinned_ever:
            try:
                torch._C._host_emptyCache()  # the pinned blocks torch's host allocator keeps
            except Exception:
                pass
            self._pinned_ever = False


def _copy(dst: memoryview, src: memoryview) -> None:
    import numpy as np

    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
