"""The supervisor's notebook client: nbclient's ``NotebookClient``, made to survive its kernel.

:class:`SupervisedClient` adds what a supervisor needs to the client papermill and nbclient use:
it notices a dead kernel within :attr:`~SupervisedClient.kernel_poll_interval` instead of a
second, connects to a kernel without giving up for good when that kernel dies while starting,
puts a new kernel (the standby, or a restarted one) in place of a dead one, and calls the
kernel-side API (:mod:`colab_resilience.kernelapi`, spelled by
:func:`~colab_resilience.kernels.api_call`) with replies that fail fast when the kernel dies under
them. A death, nbclient's ``DeadKernelError`` included, reaches the supervisor as
:class:`~colab_resilience.kernels.KernelDied`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from jupyter_core.utils import ensure_async, run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from traitlets import Bool, Float, Integer, List, Set, Unicode

from .kernels import TIMED_OUT, CellFailed, KernelDied, api_call, echo_line, discard, expression_value, process_exit_code
from .words import SAID, headless


class SupervisedClient(NotebookClient):
    """A ``NotebookClient`` whose kernel may die and be replaced between and within cells."""

    kernel_poll_interval = Float(
        0.1, help="Seconds between checks that the kernel is alive while a cell runs (nbclient: 1)."
    ).tag(config=True)
    identities = List(Unicode(), help="Every kernel connected, in order, by journal.kernel_identity.")
    cleared = Set(help="The cells that cleared their output (IPython's clear_output) while they ran, by index.")
    unusable = Unicode(None, allow_none=True,
                       help="Why the last kernel connected cannot run colab_resilience (its Python lacks it, or "
                            "has another version), as 'ename: evalue'; None when it can.")
    echo = Integer(None, allow_none=True,
                   help="The cell whose printed output and errors are echoed as they come (--log-output), by "
                        "index: to stdout and stderr, each line as '[cell N] line'; None: none.")

    says = Bool(False, help="Echo the lines this package says in any cell ('colab_resilience: ...': a resume, what "
                            "it could not make exact) to stderr as they come, each as '[cell N] line', where the "
                            "cell's whole output is not echoed (`colab-resilience run` without --log-output).")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._echo_parts: dict[str, str] = {}  # the part of a line each stream of the echo cell printed so far
        self._said_parts: dict[tuple[int, str], str] = {}  # the same, of each cell's streams, for ``says``
        self.said_run_dir: str | None = None  # the --run-dir its lines' advice names (None: a temporary one)
        self.said_without = "--run-dir"  # how its user gives a run directory, where none was given

    async def _async_poll_kernel_alive(self) -> None:
        # nbclient has no setting for how often it checks, and this coroutine is the one place
        # it does; cancelling the reply task from outside instead would leave nbclient's own
        # check running after a death, and it would later cancel a replayed cell's reply. Should
        # nbclient rename it, this override is unused and deaths are noticed after a second.
        while True:
            await asyncio.sleep(self.kernel_poll_interval)
            try:
                await self._async_check_alive()
            except DeadKernelError:
                if self.task_poll_for_reply is not None:
                    self.task_poll_for_reply.cancel()
                return

    def output(self, outs, msg, display_id, cell_index):
        """nbclient's, with this package's lines in a headless user's words (:meth:`in_headless_words`);
        the ``echo`` cell's streams and errors are echoed too, line by line."""
        msg = self.in_headless_words(msg)
        if cell_index == self.echo:
            content, kind = msg.get("content", {}), msg.get("msg_type")
            if kind == "stream":
                self._echoed(cell_index, content.get("name"), content.get("text", ""))
            elif kind == "error":
                self._echoed(cell_index, "stderr", f"{content.get('ename')}: {content.get('evalue')}\n")
        elif self.says and msg.get("msg_type") == "stream":
            self._said(cell_index, msg["content"].get("name", "stdout"), msg["content"].get("text", ""))
        return super().output(outs, msg, display_id, cell_index)

    def _headless(self, line: str) -> str:
        return headless(line, self.said_run_dir, self.said_without)

    def in_headless_words(self, msg: dict) -> dict:
        """A stream or error message whose lines of this package advise a magic, those lines as
        :func:`.words.headless` says them (``colab-resilience resume RUN --run-dir DIR``, "run the
        command again"): the executed notebook (and papermill's error, made from it) says what
        this command's user can do, as the lines echoed to stderr do. Other messages as they are."""
        content, kind = msg.get("content") or {}, msg.get("msg_type")
        if kind == "stream" and SAID in content.get("text", ""):
            said = {"text": "\n".join(map(self._said_line, content["text"].split("\n")))}
        elif kind == "error" and SAID in content.get("evalue", ""):
            said = {"evalue": self._said_line(content["evalue"]),
                    "traceback": [self._said_line(line) for line in content.get("traceback", [])]}
        else:
            return msg
        return {**msg, "content": {**content, **said}}

    def _said_line(self, line: str) -> str:
        """``line`` in a headless user's words where this package says it (it begins with
        :data:`.words.SAID`, after a progress bar drawn in place or an exception's name)."""
        at = line.find(SAID)
        return line if at < 0 else line[:at] + self._headless(line[at:])

    def _said(self, cell_index: int, name: str, text: str) -> None:
        """The package's own lines in what a cell printed, echoed (``says``)."""
        *lines, self._said_parts[cell_index, name] = (self._said_parts.get((cell_index, name), "") + text).split("\n")
        for line in lines:  # (one may follow a progress bar drawn in place, with no line break)
            at = line.find(SAID)
            if at == 0 or (at > 0 and "\r" in line[:at]):
                echo_line(f"[cell {cell_index}] {self._headless(line[at:].rstrip())}", stderr=True)

    def _echoed(self, cell_index: int, name: str | None, text: str) -> None:
        name = "stderr" if name == "stderr" else "stdout"
        *lines, self._echo_parts[name] = (self._echo_parts.get(name, "") + text).split("\n")
        for line in lines:  # as a terminal shows it: a progress bar drawn again in place, its last drawing
            echo_line(f"[cell {cell_index}] {line.rstrip(chr(13)).rsplit(chr(13), 1)[-1]}", stderr=name == "stderr")

    def end_echo(self) -> None:
        """Echo what the ``echo`` cell printed last without a newline (its kernel died, or it ended);
        forget what the cells printed last without one for ``says`` (a progress bar the dead kernel
        drew: the next kernel's lines begin anew)."""
        for name, rest in list(self._echo_parts.items()):
            if rest.strip() and self.echo is not None:
                self._echoed(self.echo, name, "\n")
        self._echo_parts.clear()
        self._said_parts.clear()

    def clear_output(self, outs, msg, cell_index):
        """nbclient's, which takes what the cell showed from the notebook; the cell is noted."""
        self.cleared.add(cell_index)
        return super().clear_output(outs, msg, cell_index)

    def execute_cell(self, cell, cell_index: int, execution_count: int | None = None, store_history: bool = True):
        """nbclient's, with a death raised as :class:`~colab_resilience.kernels.KernelDied` and
        an error as :class:`~colab_resilience.kernels.CellFailed`."""
        try:
            return super().execute_cell(cell, cell_index, execution_count, store_history)
        except DeadKernelError as e:
            raise KernelDied(str(e)) from e
        except CellExecutionError as e:
            raise CellFailed(str(e), e.ename, e.evalue) from e
        except CellTimeoutError as e:  # the run stops there, as at an error, and says why in the cell
            import nbformat

            evalue = (f"the cell ran longer than --cell-timeout allows ({self.timeout} s), and the run stopped "
                      "there; give a larger --cell-timeout (0: no limit)")
            cell.setdefault("outputs", []).append(nbformat.v4.new_output(
                "error", ename=TIMED_OUT, evalue=evalue, traceback=[f"{TIMED_OUT}: {evalue}"]))
            if self.echo == cell_index:
                self._echoed(cell_index, "stderr", f"{TIMED_OUT}: {evalue}\n")
            raise CellFailed(str(e), TIMED_OUT, evalue) from e

    def new_manager(self, ip: str):
        """A kernel manager for another kernel of this notebook (the standby), sockets under ``ip``."""
        from jupyter_client import AsyncKernelManager

        return AsyncKernelManager(kernel_name=self.kernel_name, transport="ipc", ip=ip, connection_file=ip + ".json")

    def connect(self) -> bool:
        """Connect to the kernel the manager just started; False if it died first.

        Not nbclient's ``start_new_kernel_client``: when the kernel dies before it answers, that
        raises out of the run and shuts the manager down for good (its ZMQ context too); a crash
        at start-up must instead count against the budget like any other death.
        """
        kc = self.km.client()
        kc.start_channels()
        try:
            run_sync(kc.wait_for_ready)(timeout=self.startup_timeout)
        except RuntimeError:  # "Kernel died before replying to kernel_info", or no answer in time
            kc.stop_channels()
            return False
        kc.allow_stdin = False
        self.kc = kc
        try:  # its finished runs are the ones put back after it dies (not another's with its PID)
            reply = self.call(user_expressions={"v": api_call("connected")})
        except (KernelDied, TimeoutError):
            return False
        identity = expression_value(reply)
        if isinstance(identity, str):
            self.identities.append(identity)
        failed = reply.get("content", {}).get("user_expressions", {}).get("v", {})
        if failed.get("status") == "error":  # the kernel's Python has no colab_resilience, or another version
            self.unusable = f"{failed.get('ename')}: {failed.get('evalue')}"
        return True

    def replace_kernel(self, adopted=None) -> bool:
        """A kernel in place of the dead one: ``adopted`` (a started kernel manager, the standby)
        or the same kernel restarted with its first arguments and environment. False when the new
        kernel died while starting."""
        if adopted is not None:
            dead, self.km = self.km, adopted
            discard(dead)
        else:
            run_sync(self.km.restart_kernel)(now=True)
        if self.kc is not None:
            self.kc.stop_channels()
            self.kc = None
        return self.connect()

    def exit_code(self) -> int | None:
        return process_exit_code(self.km)

    def call(self, code: str = "", *, user_expressions: dict | None = None, timeout: float = 60.0) -> dict:
        """Run ``code`` silently in the kernel and return its ``execute_reply``.

        Unlike ``execute_interactive``, which waits out its whole timeout when the kernel dies
        under it, this raises :class:`~colab_resilience.kernels.KernelDied` within a poll interval
        of a death, so a kill between two cells is recovered like a kill inside one.
        """
        from queue import Empty

        async def call() -> dict:
            kc, km = self.kc, self.km
            msg_id = kc.execute(code, silent=True, store_history=False,
                                user_expressions=user_expressions or {}, allow_stdin=False)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    msg = await ensure_async(kc.get_shell_msg(timeout=self.kernel_poll_interval))
                except Empty:
                    if not await ensure_async(km.is_alive()):
                        raise KernelDied("Kernel died") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the kernel did not answer within {timeout:.0f} s") from None
                    continue
                if msg.get("parent_header", {}).get("msg_id") == msg_id:
                    return msg

        return run_sync(call)()

    def evaluate(self, expr: str, *, timeout: float = 60.0) -> Any:
        """The value of ``expr`` evaluated silently in the kernel (a literal: its repr is parsed
        back), or None when it failed or is not a literal. ``KernelDied`` and
        ``TimeoutError`` go to the caller."""
        return expression_value(self.call(user_expressions={"v": expr}, timeout=timeout))

    def shutdown(self) -> None:
        """Stop the kernel (whichever took over) and the channels; nothing here may fail."""
        try:
            if self.km.has_kernel:
                run_sync(self.km.shutdown_kernel)(now=True)
        except Exception:
            pass
        if self.kc is not None:
            try:
                self.kc.stop_channels()
            except Exception:
                pass
