"""How much memory is in use: this process (host RSS plus what torch holds on CUDA devices), the
machine (for ``%restart_after --memory``), and byte counts written for people.

No framework is imported here: torch is looked at only if the notebook imported it.
"""

from __future__ import annotations

import os
import sys


def rss_bytes() -> int:
    """This process's resident memory."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        # ru_maxrss is a peak, not current: the best a non-Linux system gives without psutil
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def cuda_reserved_bytes() -> int:
    """CUDA memory torch's caching allocator holds, on every device (0 before CUDA is used)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))
    except Exception:  # a poisoned CUDA context fails every call; nothing to measure then
        pass
    return 0


def memory_in_use() -> int:
    """Host resident memory plus CUDA memory reserved by torch, in bytes."""
    return rss_bytes() + cuda_reserved_bytes()


def memory_in_use_percent(*, discount_standby: bool = False) -> tuple[float, str]:
    """The higher of host memory in use and (once CUDA is initialised) GPU memory in use, and
    which one it is. ``discount_standby`` (under a supervisor): the standby kernel's memory does
    not count, since the OOM killer takes it back first."""
    best, where = 0.0, "host RAM"
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0])
        available = info["MemAvailable"]
        if discount_standby:
            from .standby import standby_bytes

            available = min(info["MemTotal"], available + standby_bytes() // 1024)
        best = 100.0 * (info["MemTotal"] - available) / info["MemTotal"]
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        pass
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info()
            gpu = 100.0 * (total - free) / total
            if gpu > best:
                best, where = gpu, "GPU memory"
    except Exception:
        pass
    return best, where


def available_bytes() -> int | None:
    """Memory this process could still take without failing an allocation or waking the OOM
    killer: the least of the machine's ``MemAvailable``, what its memory cgroup (v2) has left,
    what its address-space limit (``RLIMIT_AS``) has left, and what its data limit
    (``RLIMIT_DATA``, over ``VmData``) has left; None where none is known."""
    import resource

    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup") as f:
            group = next((line.strip().split("::", 1)[1] for line in f if line.startswith("0::")), None)
        if group is not None:
            folder = "/sys/fs/cgroup" + group.rstrip("/")
            with open(folder + "/memory.max") as f:
                limit = f.read().strip()
            if limit != "max":
                with open(folder + "/memory.current") as f:
                    found.append(max(0, int(limit) - int(f.read())))
    except (OSError, ValueError, StopIteration):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm", "rb") as f:
                size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            found.append(max(0, soft - size))
        except (OSError, ValueError, IndexError):
            pass
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status") as f:
                data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
            found.append(max(0, soft - data))
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    return min(found) if found else None


def limited() -> str | None:
    """The limit set on this process that counts a thread's stack, its malloc arena and staging
    memory against what the training may allocate (in words), if any: the address space
    (``ulimit -v``) or the data size (``ulimit -d``, which Linux counts over every private
    writable mapping since 4.7)."""
    import resource

    for limit, what in ((resource.RLIMIT_AS, "the address space is limited (ulimit -v)"),
                        (resource.RLIMIT_DATA, "the data size is limited (ulimit -d)")):
        if resource.getrlimit(limit)[0] != resource.RLIM_INFINITY:
            return what
    return None


def transient_bytes() -> int:
    """How much more memory this process took at its peak since the last call (the first time:
    since it started) than it holds now: what an iteration of training needs on top of its state
    (activations, a batch). The resident peak (``VmHWM``) is reset after reading, where the kernel
    allows it (``/proc/self/clear_refs``); under an address-space limit, the rise of the address
    space to its lifetime peak (``VmPeak``) counts too, which cannot be reset: so it only errs
    towards a larger figure."""
    import resource

    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "VmPeak", "VmSize"):
                    fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    rise = fields.get("VmHWM", 0) - fields.get("VmRSS", 0)
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        rise = max(rise, fields.get("VmPeak", 0) - fields.get("VmSize", 0))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return max(0, rise)


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed since boot (``oom_kill``
    in ``/proc/vmstat``, Linux 4.13+; memory-cgroup kills included); None where unknown. A death
    by SIGKILL is put down to the OOM killer only when this count went up meanwhile."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def format_bytes(n: float) -> str:
    """``1.5 GiB``; a value that would print as 1024.0 of a unit is written in the next one."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        shown = round(n) if unit == "B" else round(n, 1)
        if abs(shown) < 1024 or unit == "TiB":
            return f"{shown} {unit}" if unit == "B" else f"{shown:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
