"""What this package does with a kernel it started, whoever drives it: the supervisor's nbclient
client (:mod:`colab_resilience.client`), the isolation relay's blocking client
(:mod:`colab_resilience.isolate`) and the standby (:mod:`colab_resilience.standby_driver`): the
line that calls the kernel-side API (:func:`api_call`), a user expression's value, the kernel's
process, how it ended; and how a request to it ends badly, whichever client made it: the kernel
died (:class:`KernelDied`), or the cell raised (:class:`CellFailed`).

Nothing here imports nbclient or nbformat: the relay runs in the notebook's own kernel, and a
kernel restarted interactively reads its deaths (:mod:`colab_resilience.deaths`) through this
module, where importing nbformat (which imports jsonschema and its format checkers, a second or
more where JupyterLab installed them) would add to the start of isolation and to each recovery.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from jupyter_core.utils import run_sync

from . import kernelapi


class KernelDied(Exception):
    """The kernel died under a request this package made of it (a cell, a call, a replay).
    :class:`~colab_resilience.client.SupervisedClient` raises it for nbclient's
    ``DeadKernelError`` too, so that the supervisor has one death to catch whichever client runs
    its cells."""


TIMED_OUT = "CellTimeoutError"  # nbclient's name for a cell that ran past its timeout, as the cell's error


class CellFailed(Exception):
    """A cell the kernel ran raised (nbclient's ``CellExecutionError`` for the supervisor's
    client): the error's name and value, and the text to show (the traceback)."""

    def __init__(self, text: str, ename: str = "", evalue: str = ""):
        super().__init__(text)
        self.ename, self.evalue = ename, evalue


def echo_line(line: str, *, stderr: bool = False) -> None:
    """Print ``line`` for ``--log-output``, above the command's progress bar where one is drawn
    (tqdm's write clears it and draws it again below), not into it."""
    import sys

    stream = sys.stderr if stderr else sys.stdout
    bars = sys.modules.get("tqdm.std")
    if bars is not None and getattr(bars.tqdm, "_instances", None):
        bars.tqdm.write(line, file=stream)
        stream.flush()
    else:
        print(line, file=stream, flush=True)


def api_call(function: str, *args) -> str:
    """The code that runs ``colab_resilience.kernelapi.<function>(*args)`` in a kernel (args:
    literals)."""
    if function not in kernelapi.__all__:
        raise ValueError(f"{function!r} is not a kernel API function")
    return f"__import__('colab_resilience.kernelapi').kernelapi.{function}({', '.join(map(repr, args))})"


def expression_value(reply: dict, name: str = "v") -> Any:
    """The literal value of user expression ``name`` in an ``execute_reply``; None when it failed
    or is not a literal."""
    value = reply.get("content", {}).get("user_expressions", {}).get(name, {})
    if value.get("status") != "ok":
        return None
    try:
        return ast.literal_eval(value["data"]["text/plain"])
    except (KeyError, ValueError, SyntaxError, TypeError):
        return None


def kernel_process(km):
    """The ``Popen`` of the kernel ``km`` started (None before, or under another provisioner)."""
    return getattr(getattr(km, "provisioner", None), "process", None)


def kernel_pid(km) -> int | None:
    process = kernel_process(km)
    return process.pid if process is not None else None


def process_exit_code(km) -> int | None:
    """How the kernel process of ``km`` ended: its exit code, ``-N`` for signal N, None if unknown
    (or still running)."""
    process = kernel_process(km)
    try:
        return process.poll() if process is not None else None
    except Exception:
        return None


def blocking(method, *args, **kwargs):
    """Call a kernel manager's ``method`` and return its result, awaited where it is a coroutine
    (an ``AsyncKernelManager``'s; a ``KernelManager``'s returns it at once)."""
    result = method(*args, **kwargs)
    if inspect.isawaitable(result):
        async def wait():
            return await result

        return run_sync(wait)()
    return result


def discard(km) -> None:
    """Shut down (a dead kernel: clean up) ``km``; nothing it raises matters any more."""
    try:
        blocking(km.shutdown_kernel, now=True)
    except Exception:
        pass
