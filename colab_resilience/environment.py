"""The environment variables a cell set that change what training computes, by their digests.

A variable that the libraries read as they import or start (``XLA_FLAGS`` with
``--xla_gpu_deterministic_ops``, ``TF_DETERMINISTIC_OPS``, ``CUBLAS_WORKSPACE_CONFIG`` for
torch's deterministic algorithms on a GPU, ``PYTORCH_CUDA_ALLOC_CONF`` against a fragmented
GPU memory's OOM, ``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``) is set in a notebook's first
cell, ``os.environ[...] = ...`` or ``%env``; where that cell is not ``%%replay``, a new kernel
starts with the environment the first one started with and the replay does not set it again: the
resumed run computes otherwise, saying nothing. A run records, as it begins, those of the
variables of :data:`PREFIXES` that differ from what the kernel's process started with (the
value's SHA-256, or None for one removed: values are not written, a variable may hold a token);
a kernel that resumes it after a restart compares, after its replay, and says in one line which
differ (:func:`message`). Putting a value back then would be too late for a library imported
already (the replay imported it, the standby kernel before that), so the line says where to set
it. Variables of logging, warnings and debugging (``TF_CPP_MIN_LOG_LEVEL``,
``CUDA_LAUNCH_BLOCKING``) are left out: they change what is shown, not what is computed.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Mapping

# the prefixes of the variables compared: XLA's and JAX's, TensorFlow's and Keras's, CUDA's and its
# libraries', torch's, and the thread pools' of OpenMP, MKL and OpenBLAS
PREFIXES = ("XLA_", "JAX_", "TF_", "KERAS_", "CUDA_", "CUBLAS_", "CUBLASLT_", "CUDNN_", "NVIDIA_", "NCCL_", "TORCH_",
            "PYTORCH_", "OMP_", "MKL_", "OPENBLAS_")
# what is shown or how errors are reported, not what is computed (TF_CPP_MIN_LOG_LEVEL, TORCH_LOGS,
# CUDA_LAUNCH_BLOCKING, TORCH_SHOW_CPP_STACKTRACES)
_SHOWN_ONLY = re.compile(r"LOG|VERBOS|WARN|SHOW|COLOR|BLOCKING|STACKTRACE|DEBUG")
_SET_BY_LIBRARIES = {"CUDA_MODULE_LOADING"}  # torch sets it as CUDA starts, wherever that is
VARIABLES = 200  # the most a run records

_AT_IMPORT = dict(os.environ)  # the environment where the process's own cannot be read (not Linux)


def started_with() -> dict[str, str]:
    """The environment the kernel's process started with: Linux keeps it apart from what the
    process set since (``/proc/self/environ``); elsewhere, the one when this module was imported
    (with the extension)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(_AT_IMPORT)
    found: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            found[os.fsdecode(name)] = os.fsdecode(value)
    return found


def _compared(name: str) -> bool:
    return name.startswith(PREFIXES) and not _SHOWN_ONLY.search(name) and name not in _SET_BY_LIBRARIES


def _digest(value: str | None) -> str | None:
    return None if value is None else hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def set_since_start() -> dict[str, str | None]:
    """The compared variables that differ now from what the process started with: name -> the
    digest of the value now, or None where it was removed."""
    start, now = started_with(), os.environ
    names = sorted(n for n in set(start) | set(now) if _compared(n) and start.get(n) != now.get(n))
    return {n: _digest(now.get(n)) for n in names[:VARIABLES]}


def differing(recorded: Mapping[str, str | None]) -> list[str]:
    """Of the variables ``recorded`` (:func:`set_since_start`, as a run began), those whose value
    differs now."""
    return sorted(n for n, digest in recorded.items() if _digest(os.environ.get(n)) != digest)


def message(run_id: str, names: list[str]) -> str:
    """The line a resume says of the variables :func:`differing` found."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    one = len(names) == 1
    it = "it" if one else "them"
    return (f"colab_resilience: the environment variable{'' if one else 's'} {shown} {'was' if one else 'were'} set "
            f"otherwise as run {run_id} began, by a cell that is not replayed (os.environ, %env), and this kernel "
            f"has {it} as a new kernel starts: the resumed run goes on without that setting, and where it changes what "
            f"the training computes, the result is not that of the run uninterrupted; set {it} in a %%replay cell "
            f"above the imports, and %resilience reset {run_id} to start over")
