"""Which memory was written since a checkpoint read it: write tracking by the kernel's MMU.

A save that changed nothing should not have to read every byte of the state to find that out
(580 MiB is about 40 ms of memory bandwidth on a cloud VM, however fast the hash). Linux 6.7 and
later can tell exactly which pages were written since a point in time, with no cost until a page
is written and one minor fault (about a microsecond) when it first is:

* the pages are registered with a ``userfaultfd`` in *asynchronous write-protect* mode
  (``UFFD_FEATURE_WP_ASYNC``): the kernel itself resolves the write fault, clearing the page's
  write-protect bit; no handler thread, nothing in Python on the fault path;
* ``ioctl(PAGEMAP_SCAN)`` on ``/proc/self/pagemap`` reports, without changing anything, whether
  any page of a range lost its write-protect bit, i.e. was written.

Every way a process writes its own memory goes through the MMU and is seen: Python, NumPy, torch
kernels on any thread, ``.data`` and NumPy views of tensors (which autograd's version counters
miss), ``ctypes``, ``read()``/``recv()`` into a buffer (the kernel writes through the page
tables), ``/proc/PID/mem`` and ``process_vm_writev``. What the MMU does not see is excluded by the
callers and here: memory other processes can write (shared or file-backed mappings: refused
below by reading ``/proc/self/maps``) and memory a device writes by DMA (pinned tensors: the
checkpoint code never tracks them). What cannot be told apart from ordinary memory, and so would
be missed: private memory that another library pinned for a device to write into without torch
knowing (``cudaHostRegister`` from outside torch, RDMA, io_uring fixed buffers). Nothing in a
training notebook does that to the tensors it saves; a run that does can turn tracking off.

A :class:`Claim` covers whole pages of private anonymous memory. It is *clean* while no page of it
was written since it was claimed and no other claim has taken any of its pages (re-protecting a
page erases the fact that it was written, so an overlapping claim revokes the older one). Unused
tracking costs nothing; ``COLAB_RESILIENCE_WRITE_TRACKING=0`` turns it off. Where the kernel is
older, ``userfaultfd`` is not permitted (``vm.unprivileged_userfaultfd``, a container's seccomp
profile) or the architecture is not known here, :func:`tracker` returns ``None`` and the caller
reads the bytes instead.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import platform
import struct
import threading
import weakref

__all__ = ["Claim", "WriteTracker", "describe", "private_memory", "tracker"]

PAGE = mmap.PAGESIZE
ENV = "COLAB_RESILIENCE_WRITE_TRACKING"

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282, "arm64": 282}.get(platform.machine())
_UFFD_API = 0xAA
_UFFD_FEATURE_WP_UNPOPULATED = 1 << 13  # never-touched pages are protected too (markers)
_UFFD_FEATURE_WP_ASYNC = 1 << 15  # the kernel resolves write faults itself
_UFFDIO_REGISTER_MODE_WP = 2
_UFFDIO_WRITEPROTECT_MODE_WP = 1
_PAGE_IS_WRITTEN = 1 << 1
_PM_SCAN_CHECK_WPASYNC = 1 << 1  # EPERM where a page of the range is not registered for it


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _ioc(3, 0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, 0xAA, 0x00, 32)
_UFFDIO_UNREGISTER = _ioc(2, 0xAA, 0x01, 16)
_UFFDIO_WRITEPROTECT = _ioc(3, 0xAA, 0x06, 24)
_PAGEMAP_SCAN = _ioc(3, ord("f"), 16, 96)


class Claim:
    """Whole pages ``[start, end)`` write-protected at one moment; see :meth:`WriteTracker.clean`."""

    __slots__ = ("start", "end", "valid", "owner")

    def __init__(self, start: int, end: int, owner: int):
        self.start, self.end, self.owner = start, end, owner
        self.valid = True

    def __repr__(self) -> str:
        state = "valid" if self.valid else "revoked"
        return f"<Claim {self.start:#x}-{self.end:#x} {state}>"


class WriteTracker:
    """One per process (see :func:`tracker`). Thread-safe; every call is a few system calls."""

    def __init__(self, uffd: int, pagemap: int):
        self._pid = os.getpid()  # in a forked child both descriptors still name the parent
        self._uffd = uffd
        self._pagemap = pagemap
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted starts of the live claims, which never overlap
        self._claims: list[Claim] = []  # in the same order
        self._region = (ctypes.c_uint64 * 3)()  # one page_region: the scan stops at the first

    # -- claiming --

    def claim(
        self, ranges: list[tuple[int, int]], owner: int, private: list[tuple[int, int]] | None = None
    ) -> list[Claim | None]:
        """Write-protect each ``(start, end)`` (page-aligned) and return a claim for it, or
        ``None`` where the range is not private anonymous memory or the kernel refused.
        ``private``: what :func:`private_memory` returned, if the caller has it (reading
        ``/proc/self/maps`` takes milliseconds; a save claims once per chunk)."""
        if os.getpid() != self._pid:
            return [None] * len(ranges)
        maps = private_memory() if private is None else private
        out: list[Claim | None] = []
        with self._lock:
            for start, end in ranges:
                if start % PAGE or end % PAGE or end <= start or not _covered(maps, start, end):
                    out.append(None)
                    continue
                self._revoke_overlapping(start, end)
                try:
                    self._register(start, end)
                    self._protect(start, end)
                except OSError:
                    out.append(None)
                    continue
                c = Claim(start, end, owner)
                i = bisect.bisect_left(self._starts, start)
                self._starts.insert(i, start)
                self._claims.insert(i, c)
                out.append(c)
        return out

    def clean(self, claim: Claim) -> bool:
        """True while no page of ``claim`` was written (nor taken by another claim) since it was
        claimed. Any doubt (the memory unmapped and mapped again, an error) answers False."""
        with self._lock:
            if not claim.valid or os.getpid() != self._pid:
                return False
            arg = bytearray(
                struct.pack(
                    "12Q", 96, _PM_SCAN_CHECK_WPASYNC, claim.start, claim.end, 0,
                    ctypes.addressof(self._region), 1, 1, 0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN,
                )
            )
            try:
                found = fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, arg, True)
            except OSError:
                return False
            walk_end = struct.unpack_from("Q", arg, 32)[0]
            return found == 0 and walk_end >= claim.end

    def release(self, claims) -> None:
        """Stop tracking ``claims`` (writes to their pages fault no more)."""
        with self._lock:
            for c in claims:
                if c is not None and c.valid:
                    self._drop(c)

    def retain(self, owner: int, keep) -> None:
        """Release every claim of ``owner`` that is not in ``keep``."""
        keep_ids = {id(c) for c in keep if c is not None}
        with self._lock:
            for c in [c for c in self._claims if c.owner == owner and id(c) not in keep_ids]:
                self._drop(c)

    def claims_of(self, owner: int) -> list[Claim]:
        with self._lock:
            return [c for c in self._claims if c.owner == owner]

    # -- internals (lock held) --

    def _revoke_overlapping(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._starts, end) - 1
        while i >= 0 and self._claims[i].end > start:
            self._drop(self._claims[i])
            i -= 1

    def _drop(self, c: Claim) -> None:
        c.valid = False
        i = bisect.bisect_left(self._starts, c.start)
        if i == len(self._claims) or self._claims[i] is not c or os.getpid() != self._pid:
            return  # another tracker's (a forked child holds its parent's claims): nothing to undo
        del self._starts[i], self._claims[i]
        try:  # also clears the pages' write-protect bits; the memory may be gone: nothing to do
            fcntl.ioctl(self._uffd, _UFFDIO_UNREGISTER, struct.pack("QQ", c.start, c.end - c.start))
        except OSError:
            pass

    def _register(self, start: int, end: int) -> None:
        arg = bytearray(struct.pack("QQQQ", start, end - start, _UFFDIO_REGISTER_MODE_WP, 0))
        fcntl.ioctl(self._uffd, _UFFDIO_REGISTER, arg, True)

    def _protect(self, start: int, end: int) -> None:
        arg = bytearray(struct.pack("QQQ", start, end - start, _UFFDIO_WRITEPROTECT_MODE_WP))
        fcntl.ioctl(self._uffd, _UFFDIO_WRITEPROTECT, arg, True)


def private_memory() -> list[tuple[int, int]]:
    """Merged address ranges of this process's private anonymous mappings (heap included): the
    memory only this process writes, through its own page tables."""
    spans: list[tuple[int, int]] = []
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) < 5 or fields[1][3:4] != b"p" or fields[4] != b"0":
                continue  # shared, or backed by a file (inode != 0)
            path = fields[5].strip() if len(fields) > 5 else b""
            if path and path != b"[heap]" and not path.startswith(b"[anon:"):
                continue  # [stack], [vdso], [vvar], a deleted file, ...
            lo, hi = (int(x, 16) for x in fields[0].split(b"-"))
            if spans and spans[-1][1] == lo:
                spans[-1] = (spans[-1][0], hi)
            else:
                spans.append((lo, hi))
    return spans


def _covered(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    i = bisect.bisect_right(spans, (start, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= start and end <= spans[i][1]


_tracker_lock = threading.Lock()
_tracker_of: tuple[int, WriteTracker | None] | None = None  # (pid, tracker)


def tracker() -> WriteTracker | None:
    """This process's tracker, or ``None`` where the kernel cannot track writes (see the module
    docstring). Made once per process; a forked child makes its own (registrations are not
    inherited)."""
    global _tracker_of
    with _tracker_lock:
        if _tracker_of is None or _tracker_of[0] != os.getpid():
            _tracker_of = (os.getpid(), _open())
        return _tracker_of[1]


def _turned_off() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


def describe() -> str:
    """One line for ``%resilience status``: how a save finds the memory that did not change."""
    if tracker() is not None:
        return "unchanged tensors and arrays: found by the kernel's write tracking (only what was written is read)"
    if _turned_off():
        why = f"write tracking turned off by {ENV}"
    else:
        why = "write tracking needs Linux 6.7+ and userfaultfd, which this kernel does not allow"
    return f"unchanged tensors and arrays: found by a fingerprint of every byte ({why})"


def _open() -> WriteTracker | None:
    if _turned_off():
        return None
    if _SYS_USERFAULTFD is None or platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    uffd = libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
    if uffd < 0:
        return None
    pagemap = -1
    try:
        api = bytearray(struct.pack("QQQ", _UFFD_API, _UFFD_FEATURE_WP_ASYNC | _UFFD_FEATURE_WP_UNPOPULATED, 0))
        fcntl.ioctl(uffd, _UFFDIO_API, api, True)
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        t = WriteTracker(uffd, pagemap)
        if _works(t):
            weakref.finalize(t, _close_both, uffd, pagemap)
            return t
    except OSError:
        pass
    _close_both(uffd, pagemap)
    return None


def _works(t: WriteTracker) -> bool:
    """Claim two pages of a fresh private mapping, write one, and see exactly that reported."""
    m = mmap.mmap(-1, 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf = (ctypes.c_char * (2 * PAGE)).from_buffer(m)
        addr = ctypes.addressof(buf)
        first, second = t.claim([(addr, addr + PAGE), (addr + PAGE, addr + 2 * PAGE)], owner=0)
        ok = first is not None and second is not None and t.clean(first) and t.clean(second)
        buf[PAGE + 7] = b"x"
        ok = ok and t.clean(first) and not t.clean(second)
        t.release([first, second])
        del buf
        return ok
    finally:
        try:
            m.close()
        except BufferError:  # a view still exported; the mapping goes with the process
            pass


def _close_both(uffd: int, pagemap: int) -> None:
    for fd in (uffd, pagemap):
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
