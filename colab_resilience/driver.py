"""Supervised execution: run a notebook headless and bring its kernel back whenever it dies.

:func:`run_notebook` executes the cells one by one with nbclient, in a kernel started by
jupyter_client over IPC sockets in a private folder, with the extension loaded into it and
``COLAB_RESILIENCE_SUPERVISED=1`` in its environment. When the kernel dies (the OOM killer, a
SIGKILL, or the kernel leaving on its own request after an OOM beyond its retries, exit code
:data:`colab_resilience.runs.EXIT_RESTART`), the driver

1. puts its standby kernel in the dead one's place (:class:`_Standby`: started ahead of need,
   warmed with the working kernel's imports), or, with none alive, restarts the kernel through
   jupyter_client (a plain manager, never an auto-restarting one, whose silent restarts would
   leave nbclient waiting until its timeout: nbclient issue 319);
2. replays the replay cells executed so far (``%%replay`` cells and cells tagged ``replay``), in
   order, their outputs discarded unless one fails;
3. re-executes the interrupted cell, which resumes its run from the last safe point;
4. puts a visible marker in that cell's outputs (why, where, how long the recovery took) and the
   restart log in ``metadata.colab_resilience``.

Restarts are bounded twice: by each run's budget on disk (``--max-restarts`` of the cell, which
the kernel enforces) and by the driver's own ``max_restarts`` for the whole notebook (a kernel
that dies before a run can count anything, at start-up or during a replay, cannot loop forever).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jupyter_core.utils import ensure_async, run_sync

from . import standby as _standby
from .runs import EXIT_RESTART, RUN_DIR_ENV, SUPERVISED_ENV

# exit codes of `colab-resilience run` (and the `status` of a RunResult)
EXIT_OK, EXIT_CELL_FAILED, EXIT_USAGE, EXIT_BUDGET = 0, 1, 2, 3

# Run in the kernel at start-up. Unlike --ext, a later `%load_ext colab_resilience` in the
# notebook (written for Colab, where it is needed) then stays silent.
LOAD_EXTENSION = "import colab_resilience as _cr; _cr.load_ipython_extension(get_ipython()); del _cr"


class NotebookInputError(ValueError):
    """The notebook, a parameter or the kernel name is unusable (exit code 2)."""


@dataclass
class Restart:
    cell: int
    reason: str
    exit_code: int | None
    iteration: str | None
    replayed: int
    seconds: float
    time: float = field(default_factory=time.time)

    restored: list = field(default_factory=list)  # names put back from runs finished earlier
    recovered: bool = True  # False: the new kernel died too (while starting or replaying)
    standby: bool = False  # True: the standby kernel took over; False: a kernel was (re)started

    def marker(self) -> str:
        where = f" in iteration {self.iteration}" if self.iteration else ""
        if not self.recovered:
            return f"colab_resilience: the kernel died{where} ({self.reason}) after {self.seconds:.1f} s\n"
        state = f", restored {', '.join(self.restored)} from the finished training" if self.restored else ""
        how = "switched to the standby kernel" if self.standby else "restarted it"
        return (
            f"colab_resilience: the kernel died{where} ({self.reason}); {how}, replayed "
            f"{self.replayed} cell{'s' if self.replayed != 1 else ''}{state} and resumed in {self.seconds:.1f} s\n"
        )


@dataclass
class RunResult:
    status: int  # EXIT_OK, EXIT_CELL_FAILED or EXIT_BUDGET
    notebook: Any
    restarts: list[Restart]
    failed_cell: int | None = None
    message: str = ""
    seconds: float = 0.0


def is_replay_cell(cell) -> bool:
    """``%%replay`` cells, cells tagged ``replay``, and the parameters (set-up by definition)."""
    if cell.get("cell_type") != "code":
        return False
    tags = set(cell.get("metadata", {}).get("tags", []) or [])
    return bool(tags & {"replay", "parameters", "injected-parameters"}) or cell.get("source", "").lstrip().startswith("%%replay")


def _resolve(value: str) -> Any:
    """papermill's -p typing: True/False/None, int, float, else the string."""
    if value in ("True", "False"):
        return value == "True"
    if value == "None":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def inject_parameters(nb, parameters: dict[str, Any]) -> None:
    """papermill's convention: a cell tagged ``injected-parameters`` after the ``parameters`` one."""
    import nbformat

    if not parameters:
        return
    lines = ["# Parameters"] + [f"{k} = {v!r}" for k, v in parameters.items()]
    new = nbformat.v4.new_code_cell("\n".join(lines))
    new.metadata["tags"] = ["injected-parameters"]
    cells = nb.cells
    cells[:] = [c for c in cells if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
    index = next((i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    cells.insert(0 if index is None else index + 1, new)


def _journal_facts(run_dir: Path) -> tuple[str | None, str | None, bool]:
    """(reason, iteration) of the newest pending run's last requested restart; budget refused?"""
    newest, refused = None, False
    for path in run_dir.glob("run-*/journal.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        restarts = data.get("restarts") or []
        if restarts and restarts[-1].get("refused") and data.get("status") == "failed":
            refused = True
        if data.get("status") == "pending" and restarts:
            if newest is None or data.get("updated", 0) > newest.get("updated", 0):
                newest = data
    if newest is None or not newest.get("extra", {}).get("restart_requested"):
        return None, None, refused
    last = newest["restarts"][-1]
    return last.get("reason"), last.get("at"), refused


def _exit_code(km) -> int | None:
    process = getattr(getattr(km, "provisioner", None), "process", None)
    try:
        return process.poll() if process is not None else None
    except Exception:
        return None


def _death_reason(code: int | None) -> str:
    if code == EXIT_RESTART:
        return "it asked for a restart"
    if code is not None and code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ", likely the OS out-of-memory killer" if code == -9 else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}" if code is not None else "it stopped answering"


def run_notebook(
    notebook: str | os.PathLike | Any,
    output: str | os.PathLike | None = None,
    *,
    parameters: dict[str, Any] | None = None,
    max_restarts: int = 3,
    cell_timeout: int | None = None,
    kernel_name: str | None = None,
    run_dir: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    progress: bool = False,
    log_output: bool = False,
    on_cell: Callable[[int, Any], None] | None = None,
    env: dict[str, str] | None = None,
    standby: bool = True,
) -> RunResult:
    """Execute ``notebook`` (a path or a NotebookNode) under supervision; see the module doc.

    ``standby``: keep a second kernel started and warmed with the working kernel's imports, to
    take over when it dies (see :mod:`colab_resilience.standby`); False restarts a kernel instead.

    Returns a :class:`RunResult`; raises :class:`NotebookInputError` for unusable input. The
    executed notebook is written to ``output`` when given (also after a failure).
    """
    import nbformat
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import NoSuchKernel

    started = time.perf_counter()
    if isinstance(notebook, (str, os.PathLike)):
        path = Path(notebook)
        if not path.is_file():
            raise NotebookInputError(f"{path}: no such notebook; give the path of an .ipynb file")
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception as e:  # invalid JSON, not a notebook
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise NotebookInputError(f"{path}: not a readable notebook ({first[:120]})") from None
        cwd = cwd or path.parent.resolve()
    else:
        nb = notebook
    inject_parameters(nb, parameters or {})
    kernel_name = kernel_name or nb.metadata.get("kernelspec", {}).get("name") or "python3"
    own_run_dir = run_dir is None
    run_root = Path(tempfile.mkdtemp(prefix="colab-resilience-runs-")) if own_run_dir else Path(run_dir)
    sockets = tempfile.mkdtemp(prefix="colab-resilience-")  # 0700: the kernel is ours alone
    kernel_env = dict(os.environ)
    kernel_env.update(env or {})
    kernel_env[SUPERVISED_ENV] = "1"
    kernel_env[RUN_DIR_ENV] = str(run_root)
    # An async manager: with a blocking one, nbclient's wait for output blocks its event loop and
    # it never notices that the kernel died.
    km = AsyncKernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(sockets, "kernel"))
    client = _client_class()(
        nb, km=km, kernel_name=kernel_name, timeout=cell_timeout,
        resources={"metadata": {"path": str(cwd or os.getcwd())}},
        extra_arguments=[f"--IPKernelApp.exec_lines={LOAD_EXTENSION}"],
    )
    result = RunResult(EXIT_OK, nb, [])
    restarts = result.restarts
    spare = _Standby(client, kernel_name, sockets, kernel_env, str(cwd or os.getcwd())) if standby else None
    bar = None
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    try:
        try:
            client.start_new_kernel(env=kernel_env)
            if not _connect(client):  # the first kernel died while starting: a death like any other
                first = code_cells[0] if code_cells else 0
                restarts.append(_restart(client, nb, first, run_root, [], max_restarts, result, None, starting=True))
            if spare is not None:
                spare.spawn()
            with client.setup_kernel(env=kernel_env):  # started above: this only cleans up
                if progress:  # once a kernel is up: no empty bar before a start-up error
                    from tqdm.auto import tqdm

                    bar = tqdm(total=len(code_cells), unit="cell", desc="colab-resilience")
                _execute_cells(client, nb, code_cells, run_root, max_restarts, result, on_cell, log_output, bar, spare)
        except NoSuchKernel:
            output = None  # nothing ran: no output notebook that would look like a result
            raise NotebookInputError(
                f"no kernel named {kernel_name!r}; list them with `jupyter kernelspec list` or pass --kernel NAME"
            ) from None
    except _Stop:
        pass
    finally:
        if bar is not None:
            bar.close()
        if spare is not None:
            spare.shutdown()
        try:
            if client.km.has_kernel:  # the first kernel, or the standby that took its place
                run_sync(client.km.shutdown_kernel)(now=True)
        except Exception:
            pass
        if client.kc is not None:
            try:
                client.kc.stop_channels()
            except Exception:
                pass
        shutil.rmtree(sockets, ignore_errors=True)
        result.seconds = time.perf_counter() - started
        nb.metadata["colab_resilience"] = {
            "status": {EXIT_OK: "done", EXIT_CELL_FAILED: "failed", EXIT_BUDGET: "restart budget spent"}[result.status],
            "restarts": [
                {"cell": r.cell, "reason": r.reason, "exit_code": r.exit_code, "iteration": r.iteration,
                 "replayed": r.replayed, "recovery_seconds": round(r.seconds, 3), "time": r.time,
                 "kernel": "standby" if r.standby else "restarted"}
                for r in restarts
            ],
            "seconds": round(result.seconds, 3),
        }
        if output is not None:
            nbformat.write(nb, output)
        if own_run_dir:
            shutil.rmtree(run_root, ignore_errors=True)
    return result


class _Stop(Exception):
    pass


POLL_ALIVE_SECONDS = 0.1


def _client_class():
    """nbclient's NotebookClient, noticing a dead kernel within 0.1 s instead of 1 s.

    nbclient checks whether the kernel lives once a second while it waits for a reply; every
    recovery waits for that check, so it is made here ten times as often (a ``poll()`` of the
    kernel process). Should nbclient's private loop be renamed, this override is simply unused.
    """
    import asyncio

    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    class Client(NotebookClient):
        async def _async_poll_kernel_alive(self) -> None:
            while True:
                await asyncio.sleep(POLL_ALIVE_SECONDS)
                try:
                    await self._async_check_alive()
                except DeadKernelError:
                    if self.task_poll_for_reply is not None:
                        self.task_poll_for_reply.cancel()
                    return

    return Client


def _execute_cells(client, nb, code_cells, run_root, max_restarts, result, on_cell, log_output, bar, spare) -> None:
    import nbformat
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    restarts = result.restarts
    replay_done: list[int] = []
    for index in code_cells:
        cell = nb.cells[index]
        earlier: list = []  # outputs of the attempts the kernel died in: every output is kept
        died = False
        while True:
            try:
                client.execute_cell(cell, index)
                if is_replay_cell(cell):
                    _declare_replay(client, cell)
                break
            except DeadKernelError:
                died = True
                earlier += cell.get("outputs", [])
                restarts.append(_restart(client, nb, index, run_root, replay_done, max_restarts, result, spare))
            except CellExecutionError as e:
                cell.outputs = earlier + cell.get("outputs", [])
                refused = _journal_facts(run_root)[2]
                result.status = EXIT_BUDGET if refused else EXIT_CELL_FAILED
                result.failed_cell = index
                errors = [o for o in cell.outputs if o.get("output_type") == "error"]
                if errors:
                    what = f"{errors[-1].get('ename')}: {errors[-1].get('evalue', '').strip()}"
                else:  # a UsageError is printed to stderr, not sent as an error output
                    streams = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
                    lines = [l for l in streams.splitlines() if l.strip()] or [
                        l for l in str(e).splitlines() if l.strip() and not set(l) <= {"-"}]
                    what = lines[-1] if lines else type(e).__name__
                result.message = f"colab-resilience: cell {index} failed: {what}"
                raise _Stop() from None
        if died:
            markers = [nbformat.v4.new_output("stream", name="stderr", text=r.marker()) for r in restarts if r.cell == index]
            cell.outputs = earlier + markers + cell.get("outputs", [])
        if is_replay_cell(cell):
            replay_done.append(index)
        if spare is not None:
            spare.follow(client)
        if on_cell is not None:
            on_cell(index, cell)
        if log_output:
            _log_cell(index, cell)
        if bar is not None:
            bar.update(1)


def _connect(client) -> bool:
    """Connect ``client`` to the kernel its manager just started; False if it died first.

    Not nbclient's start_new_kernel_client: when the kernel dies before it answers, that raises
    RuntimeError out of the run and shuts the manager down for good (its ZMQ context too); a crash
    at start-up must instead count against the budget like any other death, and a restart go ahead.
    """
    kc = client.km.client()
    kc.start_channels()
    try:
        run_sync(kc.wait_for_ready)(timeout=client.startup_timeout)
    except RuntimeError:  # "Kernel died before replying to kernel_info", or no answer in time
        kc.stop_channels()
        return False
    kc.allow_stdin = False
    client.kc = kc
    return True


def _restart(client, nb, index, run_root, replay_done, max_restarts, result, spare, starting=False) -> Restart:
    """After a death: check the budget, bring in the standby or restart the kernel, replay; the
    caller re-executes."""
    from nbclient.exceptions import DeadKernelError

    t0 = time.perf_counter()
    restarts = result.restarts
    code = _exit_code(client.km)
    reason, iteration, _ = _journal_facts(run_root)
    reason = reason or _death_reason(code)
    if starting:
        reason = f"died while starting: {reason}"
    while True:
        if len(restarts) >= max_restarts:
            result.status, result.failed_cell = EXIT_BUDGET, index
            result.message = (
                f"colab-resilience: restart budget spent ({len(restarts)}/{max_restarts} restarts): the kernel "
                f"died again in cell {index} ({reason}). Attempts: "
                + "; ".join(f"{i}. cell {r.cell}: {r.reason}" for i, r in enumerate(restarts, 1))
            )
            raise _Stop()
        adopted = spare.take() if spare is not None else None
        if adopted is not None:
            dead, client.km = client.km, adopted
            _discard(dead)
        else:
            run_sync(client.km.restart_kernel)(now=True)  # the first start's env and arguments are kept
        if client.kc is not None:
            client.kc.stop_channels()
            client.kc = None
        if _connect(client):
            break
        restarts.append(Restart(index, f"{reason}; then the new kernel died while starting", code,
                                iteration, 0, time.perf_counter() - t0, recovered=False, standby=adopted is not None))
        code = _exit_code(client.km)
        reason, t0 = f"died while starting: {_death_reason(code)}", time.perf_counter()
    replayed = 0
    try:
        if adopted is not None:
            _kernel_call(client, STANDBY.format(f"adopt(nice={os.getpriority(os.PRIO_PROCESS, 0)})"))
        for j in replay_done:
            client.execute_cell(copy.deepcopy(nb.cells[j]), j)  # outputs discarded
            replayed += 1
            _declare_replay(client, nb.cells[j])
        restored = _restore_finished_runs(client)
    except DeadKernelError:  # the caller's next execution finds the kernel dead and restarts again
        return Restart(index, f"{reason}; then died while replaying", code, iteration, replayed,
                       time.perf_counter() - t0, recovered=False, standby=adopted is not None)
    seconds = time.perf_counter() - t0
    if spare is not None:  # the next one, warming while the interrupted cell resumes
        spare.spawn()
    return Restart(index, reason, code, iteration, replayed, seconds, restored=restored,
                   standby=adopted is not None)


@functools.lru_cache(maxsize=None)
def _may_raise_priority() -> bool:
    """Whether a process of ours may lower its nice value again (root with CAP_SYS_NICE, or a
    permissive RLIMIT_NICE): tried once, on a thread of this process, which Linux renices alone."""
    import threading

    answer: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            base = os.getpriority(os.PRIO_PROCESS, tid)
            if base >= 19:
                answer.append(False)
                return
            os.setpriority(os.PRIO_PROCESS, tid, base + 1)
            os.setpriority(os.PRIO_PROCESS, tid, base)
            answer.append(True)
        except (OSError, AttributeError):
            answer.append(False)

    thread = threading.Thread(target=probe, name="colab_resilience-nice-probe")
    thread.start()
    thread.join()
    return bool(answer and answer[0])


def _discard(km) -> None:
    """Shut down (a dead kernel: clean up) ``km``; nothing it raises matters any more."""
    try:
        run_sync(km.shutdown_kernel)(now=True)
    except Exception:
        pass


STANDBY = "__import__('colab_resilience.standby').standby.{}"


class _Standby:
    """A second kernel, started ahead of need and warmed with the imports of the working kernel,
    that takes its place when it dies (the kernel side: :mod:`colab_resilience.standby`).

    It is started with the working kernel's arguments, environment and folder. After every cell
    the driver asks the working kernel for the installed modules it imported since the last
    cell, and has the standby import them (in a low-priority thread). A standby that died (the
    OOM killer's first choice) is noticed when it is needed: that restart is a cold one.
    """

    def __init__(self, client, kernel_name: str, sockets: str, env: dict, cwd: str):
        self.client, self.kernel_name, self.sockets, self.env, self.cwd = client, kernel_name, sockets, env, cwd
        self.km = self.kc = None
        self.started = 0
        self.modules: dict[str, None] = {}  # every module a working kernel reported, in order

    def spawn(self) -> None:
        from jupyter_client import AsyncKernelManager

        self.shutdown()
        self.started += 1
        km = AsyncKernelManager(kernel_name=self.kernel_name, transport="ipc",
                                ip=os.path.join(self.sockets, f"standby-{self.started}"))
        try:
            run_sync(km.start_kernel)(extra_arguments=list(self.client.extra_arguments),
                                      env={**self.env, _standby.ENV: "1"}, cwd=self.cwd)
        except Exception:  # no standby: the next restart is a cold one, as without it
            return
        self.km, self.kc = km, km.client()
        whole = _may_raise_priority()
        if whole:  # its start-up at low priority too, not only its later imports
            try:
                pid = km.provisioner.process.pid
                os.setpriority(os.PRIO_PROCESS, pid, _standby.NICE)
                _standby.set_autogroup_nice(_standby.NICE, pid)  # its session is its own group
            except (OSError, AttributeError):
                pass
        self.kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        self._send(STANDBY.format(f"become(whole={whole})"))
        if self.modules:
            self._send(STANDBY.format(f"preload({list(self.modules)!r})"))

    def _send(self, code: str) -> None:
        async def send() -> None:  # the client's sockets belong to the driver's event loop
            self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)

        run_sync(send)()

    def follow(self, client) -> None:
        """After a cell: have the standby import what the working kernel imported since the last."""
        from nbclient.exceptions import DeadKernelError

        if self.km is None:
            return
        try:  # one string: IPython's display of a list stops at 1000 items
            names = _kernel_eval(client, "' '.join(" + STANDBY.format("new_modules()") + ")", timeout=30)
        except (DeadKernelError, TimeoutError):  # the next cell finds out
            return
        fresh = [n for n in names.split() if n not in self.modules] if isinstance(names, str) else []
        self.modules.update(dict.fromkeys(fresh))
        if fresh:
            self._send(STANDBY.format(f"preload({fresh!r})"))

    def take(self):
        """The standby's kernel manager, for the driver to adopt; None when none is alive."""
        km, kc = self.km, self.kc
        self.km = self.kc = None
        if km is None:
            return None
        kc.stop_channels()
        try:
            alive = run_sync(km.is_alive)()
        except Exception:
            alive = False
        if not alive:
            _discard(km)
            return None
        return km

    def shutdown(self) -> None:
        km, kc = self.km, self.kc
        self.km = self.kc = None
        if kc is not None:
            kc.stop_channels()
        if km is not None:
            try:  # at once: jupyter_client's shutdown interrupts it first, and it would say so
                km.provisioner.process.kill()
            except (AttributeError, OSError):
                pass
            _discard(km)


def _kernel_call(client, code: str = "", *, user_expressions: dict | None = None, timeout: float = 60.0) -> dict:
    """Run ``code`` silently in the kernel and return its ``execute_reply``.

    Unlike ``execute_interactive``, which waits out its whole timeout when the kernel dies under
    it, this raises nbclient's ``DeadKernelError`` within ``POLL_ALIVE_SECONDS`` of a death, so a
    kill between two cells is recovered like a kill inside one.
    """
    from queue import Empty

    from nbclient.exceptions import DeadKernelError

    async def call() -> dict:
        kc, km = client.kc, client.km
        msg_id = kc.execute(code, silent=True, store_history=False,
                            user_expressions=user_expressions or {}, allow_stdin=False)
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = await ensure_async(kc.get_shell_msg(timeout=POLL_ALIVE_SECONDS))
            except Empty:
                if not await ensure_async(km.is_alive()):
                    raise DeadKernelError("Kernel died") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the kernel did not answer within {timeout:.0f} s") from None
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg

    return run_sync(call)()


def _kernel_eval(client, expr: str, timeout: float) -> Any:
    """The value of ``expr`` evaluated silently in the kernel (a literal: its repr is parsed back),
    or None when it failed or is not a literal. DeadKernelError and TimeoutError go to the caller."""
    import ast

    reply = _kernel_call(client, user_expressions={"v": expr}, timeout=timeout)
    value = reply.get("content", {}).get("user_expressions", {}).get("v", {})
    if value.get("status") != "ok":
        return None
    try:
        return ast.literal_eval(value["data"]["text/plain"])
    except (KeyError, ValueError, SyntaxError, TypeError):
        return None


def _restore_finished_runs(client) -> list[str]:
    """After the replay: the state of the ``%%resilient`` cells that finished before the
    interrupted cell (it is in their last checkpoints), so a later cell sees the trained model."""
    names = _kernel_eval(client, "__import__('colab_resilience')._magics_of().restore_finished_runs()", timeout=600)
    return list(names) if isinstance(names, (list, tuple)) else []


def _declare_replay(client, cell) -> None:
    """Tell the kernel that a tagged cell is a replay cell (nbclient sends no cell metadata), so
    its journal and its lint know it. A ``%%replay`` cell records itself."""
    source = cell.get("source", "")
    if source.lstrip().startswith("%%replay"):
        return
    code = f"__import__('colab_resilience')._magics_of().note_replay({source!r})"
    _kernel_call(client, code)


def _log_cell(index: int, cell) -> None:
    import sys

    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            stream = sys.stdout if out.get("name") == "stdout" else sys.stderr
            for line in out.get("text", "").splitlines():
                print(f"[cell {index}] {line}", file=stream)
        elif out.get("output_type") == "error":
            print(f"[cell {index}] {out.get('ename')}: {out.get('evalue')}", file=sys.stderr)
