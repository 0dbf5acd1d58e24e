"""Isolation: ``%resilience isolate``. The notebook's own kernel only relays; every cell runs in a
worker kernel that it starts and owns through jupyter_client, and when the worker dies the cell
goes on in a new one within the same execution: no re-run, no "kernel died" dialog.

The notebook's kernel (the *relay*) rewrites each cell, through an input transformer, into a call
of the private cell magic ``%%_relay``, which sends the cell to the worker and forwards what comes
back as it comes: streams, ``display_data``/``update_display_data``/``clear_output``, the
``execute_result`` (shown under the notebook's own execution count), errors with the worker's
traceback (the execute reply is an error, so queued cells stop as they would), ``input()``, and
the stop button (SIGINT to the relay is passed on to the worker). Tab completion, Shift-Tab
inspection and a request's ``user_expressions`` are answered by the worker. Widgets cross both
ways: the worker's comm messages are published as the notebook kernel's, and the frontend's (a
slider moved, a button clicked) are sent on to the worker, under their own ids.

When the worker dies (the OOM killer, a SIGKILL, an OOM past its retries, a planned restart) the
relay does what the headless supervisor does, with the same code
(:meth:`colab_resilience.driver.Supervisor.recover`): it counts the death against its budget,
brings in the standby worker (the driver's :class:`~colab_resilience.standby_driver.Standby`,
warmed with the worker's imports) or starts a new worker, replays the ``%%replay`` cells run so
far, puts back the state of finished runs and runs the interrupted cell again, which resumes from
its last safe point. A one-line marker in the cell's output says what happened.

The relay imports neither torch nor any framework and holds no GPU memory; the worker is started
with ``oom_score_adj`` :data:`WORKER_OOM_SCORE_ADJ`, so that when host RAM runs out the OOM killer
takes the worker, never the notebook's kernel.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
from queue import Empty
from typing import Any

from . import priority
from .kernels import CellFailed, KernelDied, api_call, discard, expression_value, kernel_pid, process_exit_code
from .driver import EXIT_BUDGET, HASH_SEED, LOAD_EXTENSION, Supervisor, hash_seed
from .replay import is_replay_cell
from .restart import SUPERVISED_ENV
from .session import RUN_DIR_ENV
from .standby_driver import NEW_MODULES, Standby
from .tempdirs import TempFolder

WORKER_ENV = "COLAB_RESILIENCE_WORKER"
WORKER_OOM_SCORE_ADJ = 500  # before the notebook's kernel (0); after a standby (1000)
POLL = 0.05  # seconds between checks that the worker is alive while it runs a cell
IDLE_AFTER_REPLY = 2.0  # seconds to wait for the worker's last outputs once it replied
MAGIC_NAME = "_relay"
MODULES = "colab_resilience_modules"  # the user expression asking for the worker's new imports
# cells the relay runs itself: turning isolation on or off
LOCAL = re.compile(r"\s*%resilience\s+isolate\b")
# the frontend's widget messages, answered by the worker
COMM_MESSAGES = ("comm_open", "comm_msg", "comm_close", "comm_info_request")
STATUS = re.compile(r"\s*%resilience(\s+status)?\s*$")


class WorkerClient:
    """The relay's side of its worker kernel: the calls :class:`~colab_resilience.driver.Supervisor`
    makes of a client (``replace_kernel``, ``exit_code``, ``call``, ``evaluate``,
    ``execute_cell``), and :meth:`run`, which executes a cell and hands every message to a
    callback as it arrives."""

    kernel_name = "colab-resilience-worker"

    def __init__(self, sockets: str, env: dict, cwd: str):
        self.sockets, self.env, self.cwd = sockets, env, cwd
        self.extra_arguments = [f"--IPKernelApp.exec_lines={LOAD_EXTENSION}"]
        self.km = self.new_manager(os.path.join(self.sockets, "worker"))
        self.kc = None
        self.nb = None  # the notebook of relayed cells, set by the relay
        self.identities: list[str] = []  # every worker started, in order (journal.kernel_identity)
        self._shadow: tuple | None = None
        self._context = None  # the zmq context of our iopub sockets (:meth:`_connect_iopub`)
        self._iopub = None
        # between requests, a thread reads what the worker publishes (a thread's print after its
        # cell ended) and hands it to ``between``; a request, or a new worker, holds it off
        self.between = None
        self._cond = threading.Condition()
        self._held, self._reading, self._stopped = 0, False, False
        self._reader: threading.Thread | None = None
        self._wake = None  # (the reader's end, the requests' end) of an inproc pair

    def new_manager(self, ip: str):
        """A kernel manager for a worker (or its standby) whose sockets are under ``ip``."""
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

        class ThisPython(KernelSpecManager):
            """The worker runs the relay's own interpreter, whatever kernelspecs are installed."""

            def get_kernel_spec(self, kernel_name):
                return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                  display_name="colab_resilience worker", language="python")

        return KernelManager(kernel_name=self.kernel_name, kernel_spec_manager=ThisPython(), transport="ipc", ip=ip,
                             connection_file=ip + ".json")

    def start(self) -> bool:
        self.km.start_kernel(extra_arguments=list(self.extra_arguments), env=self.env, cwd=self.cwd,
                             **priority.die_with_parent())
        return self.connect()

    def connect(self) -> bool:
        """Connect to the worker just started and make it the OOM killer's choice; False if it
        died first."""
        kc = self.km.blocking_client()
        # not jupyter_client's iopub channel: the reader thread reads the worker's iopub between
        # requests, and in jupyter_client 7 that channel's socket, once read, is watched by this
        # kernel's event loop, which asks it for its events on the main thread whenever the worker
        # publishes; a libzmq socket used by two threads at once aborts the process ("Bad address
        # (src/fq.cpp:56)": the notebook's kernel died with the cell unanswered, seen in CI)
        kc.start_channels(iopub=False)
        iopub = self._connect_iopub()
        if not self._ready(kc, iopub, timeout=60):
            kc.stop_channels()
            iopub.close(linger=0)
            return False
        self.kc, self._iopub = kc, iopub
        try:
            identity = self.evaluate(api_call("become_worker", WORKER_OOM_SCORE_ADJ))
        except (KernelDied, TimeoutError):
            return False
        if isinstance(identity, str):
            self.identities.append(identity)
        return True

    def _connect_iopub(self):
        """A socket of the worker's iopub of our own, that no event loop knows: read by one thread
        at a time (the reader between requests, a request's sender while it holds the reader off)."""
        import zmq

        if self._context is None:
            self._context = zmq.Context()
        sock = self._context.socket(zmq.SUB)
        sock.linger = 0
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.km._make_url("iopub"))
        return sock

    def _ready(self, kc, iopub, timeout: float) -> bool:
        """Wait until the worker answers ``kernel_info`` and its iopub reaches ``iopub`` (what
        jupyter_client's ``wait_for_ready`` does, with our socket); then drop what it published so
        far. False if it died or did not answer within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg_id = kc.kernel_info()
            answered = False
            while not answered and time.monotonic() < deadline:
                try:
                    msg = kc.get_shell_msg(timeout=1)
                except Empty:
                    break
                answered = msg.get("parent_header", {}).get("msg_id") == msg_id
            if answered and iopub.poll(200):  # its 'busy' or 'idle' came: iopub is connected
                while iopub.poll(200):
                    _receive(kc.session, iopub)
                return True
            if not self.alive():
                return False
        return False

    def replace_kernel(self, adopted=None) -> bool:
        """A worker in place of the dead one: ``adopted`` (the standby's kernel manager) or the
        same worker restarted with its first arguments and environment."""
        with self.holding():  # the reader leaves the sockets that close now
            return self._replace_kernel(adopted)

    def _replace_kernel(self, adopted) -> bool:
        self._disconnect()
        if adopted is not None:
            dead, self.km = self.km, adopted
            discard(dead)
        else:
            self.km.restart_kernel(now=True)
        return self.connect()

    @property
    def pid(self) -> int | None:
        return kernel_pid(self.km)

    def alive(self) -> bool:
        try:
            return bool(self.km.is_alive())
        except Exception:
            return False

    def exit_code(self) -> int | None:
        return process_exit_code(self.km)

    def _wait_reply(self, msg_id: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.kc.get_shell_msg(timeout=POLL)
            except Empty:
                if not self.alive():
                    raise KernelDied("Kernel died") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the worker kernel did not answer within {timeout:.0f} s") from None
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg

    def call(self, code: str = "", *, user_expressions: dict | None = None, timeout: float = 60.0) -> dict:
        """Run ``code`` silently in the worker; its ``execute_reply``."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, user_expressions=user_expressions or {},
                                 allow_stdin=False, stop_on_error=False)
        return self._wait_reply(msg_id, timeout)

    def evaluate(self, expr: str, *, timeout: float = 60.0) -> Any:
        return expression_value(self.call(user_expressions={"v": expr}, timeout=timeout))

    def execute_cell(self, cell, index: int) -> None:
        """Replay a set-up cell, its outputs discarded (the supervisor's replay)."""
        reply = self.run(cell.source, lambda msg: None, store_history=False)
        c = reply["content"]
        if c.get("status") == "error":
            raise CellFailed("\n".join(c.get("traceback", [])), c.get("ename", ""), c.get("evalue", ""))

    def _sockets(self):
        """The worker's iopub (our own), shell and stdin sockets, for waiting on all three at once
        (the channels' own receive goes through an event loop per message in jupyter_client 7 and 8)."""
        import zmq

        if self._shadow is None or self._shadow[0] is not self.kc:
            self._shadow = (self.kc, self._iopub, *(zmq.Socket.shadow(c.socket.underlying) for c in
                                                    (self.kc.shell_channel, self.kc.stdin_channel)))
        return self._shadow[1:]

    def _disconnect(self) -> None:
        """Close the channels to the worker and our iopub socket (the reader is held off or stopped)."""
        if self.kc is not None:
            try:
                self.kc.stop_channels()
            except Exception:
                pass
            self.kc = None
        if self._iopub is not None:
            self._iopub.close(linger=0)
            self._iopub = None
        self._shadow = None

    def run(self, code: str, forward, *, msg_id: str | None = None, store_history: bool = True,
            allow_stdin: bool = False, on_input=None, user_expressions: dict | None = None) -> dict:
        """Execute ``code`` (under the frontend's own ``msg_id`` where given, so that what keys on
        it, an Output widget's capture, finds the outputs); ``forward(msg)`` for each of its iopub
        messages as it arrives; ``on_input(prompt, password)`` answers ``input()``. The
        ``execute_reply`` once the worker is idle again; ``KernelDied`` when it died; a
        KeyboardInterrupt while waiting interrupts the worker and waits on."""
        msg = self.kc.session.msg("execute_request", {
            "code": code, "silent": False, "store_history": store_history, "user_expressions": user_expressions or {},
            "allow_stdin": allow_stdin, "stop_on_error": False})
        if msg_id:
            msg["header"]["msg_id"] = msg["msg_id"] = msg_id
        return self.send(msg, forward, on_input=on_input)

    def send(self, msg: dict, forward, *, on_input=None) -> dict | None:
        """Send ``msg`` to the worker's shell as it is (its id kept), forward what the worker
        publishes in answer, and return its reply once the worker is idle again (None for the
        messages that have none: ``comm_open``, ``comm_msg``, ``comm_close``)."""
        with self.holding():
            return self._send(msg, forward, on_input)

    def _send(self, msg: dict, forward, on_input) -> dict | None:
        import zmq

        kc = self.kc
        iopub, shell, stdin = self._sockets()
        poller = zmq.Poller()
        for sock in (iopub, shell, stdin):
            poller.register(sock, zmq.POLLIN)
        kc.session.send(shell, {k: msg.get(k) or {} for k in ("header", "parent_header", "metadata", "content")},
                        buffers=msg.get("buffers") or None)
        msg_id = msg["header"]["msg_id"]
        wants_reply = msg["header"]["msg_type"].endswith("_request")
        # A comm message has no reply, and ipykernel 7 handles one that comes while its shell is
        # busy (even for the moment after an 'idle') alongside, with no 'busy' or 'idle' of its
        # own: a request sent behind it, which waits its turn, says when it has been handled.
        fence = None if wants_reply else kc.session.send(shell, "kernel_info_request", {})["header"]["msg_id"]
        fenced = False
        reply, idle, last_check, replied = None, False, time.monotonic(), 0.0
        # after the reply, the worker's 'idle' comes at once; one lost to an interrupted receive
        # must not hold the cell forever
        while not (idle and (reply is not None or not wants_reply)) and not fenced and \
                not (reply is not None and time.monotonic() - replied > IDLE_AFTER_REPLY):
            try:
                ready = dict(poller.poll(POLL * 1000))
                if iopub in ready:
                    got = _receive(kc.session, iopub)
                    parent = got.get("parent_header", {}).get("msg_id") if got is not None else None
                    if parent == msg_id:
                        if got["msg_type"] == "status":
                            idle = idle or got["content"].get("execution_state") == "idle"
                        else:
                            forward(got)
                    elif parent == fence and got["msg_type"] == "status":
                        fenced = got["content"].get("execution_state") == "idle"
                    elif got is not None and self.between is not None:  # another request's: a thread's
                        self.between(got)
                if stdin in ready:
                    request = _receive(kc.session, stdin)
                    if request is not None and request.get("msg_type") == "input_request":
                        c = request["content"]
                        answer = on_input(c.get("prompt", ""), bool(c.get("password"))) if on_input else ""
                        kc.input(answer)
                if shell in ready:
                    got = _receive(kc.session, shell)
                    if got is not None and got.get("parent_header", {}).get("msg_id") == msg_id:
                        reply, replied = got, time.monotonic()
                now = time.monotonic()
                if not ready and now - last_check > POLL:
                    last_check = now
                    if not self.alive():
                        raise KernelDied("Kernel died")
            except KeyboardInterrupt:  # the stop button: for the worker
                try:
                    self.km.interrupt_kernel()
                except Exception:
                    pass
        return reply

    # --- what the worker publishes between requests ----------------------------------------------

    def holding(self):
        """A context in which the reader of :meth:`start_reading` leaves the worker's sockets alone
        (a request, a worker replaced); re-entrant, and from any thread."""
        import contextlib

        @contextlib.contextmanager
        def held():
            with self._cond:
                self._held += 1
                if self._reading and self._wake is not None:
                    self._wake[1].send(b"")  # out of its poll at once
                while self._reading:
                    self._cond.wait()
            try:
                yield
            finally:
                with self._cond:
                    self._held -= 1
                    self._cond.notify_all()

        return held()

    def start_reading(self) -> None:
        """Read the worker's iopub between requests, on a thread, and hand each message to
        :attr:`between`: what a thread of the worker prints after its cell ended shows, as it does
        in one kernel, when it is printed, not with the next cell."""
        import zmq

        if self._reader is not None:
            return
        ctx, name = zmq.Context.instance(), f"inproc://colab-resilience-relay-wake-{id(self)}"
        own, theirs = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        own.bind(name)
        theirs.connect(name)
        self._wake = (own, theirs)
        self._reader = threading.Thread(target=self._read, name="colab-resilience-worker-iopub", daemon=True)
        self._reader.start()

    def stop_reading(self) -> None:
        with self._cond:
            self._stopped = True
            if self._wake is not None:
                self._wake[1].send(b"")
            self._cond.notify_all()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._wake is not None and not (self._reader and self._reader.is_alive()):
            for sock in self._wake:
                sock.close(linger=0)
        self._reader = self._wake = None

    def _read(self) -> None:
        import zmq

        own = self._wake[0]
        while True:
            with self._cond:
                while not self._stopped and (self._held or self.kc is None):
                    self._cond.wait(timeout=1.0)
                if self._stopped:
                    return
                self._reading = True
                kc, iopub = self.kc, self._sockets()[0]
            try:
                poller = zmq.Poller()
                poller.register(iopub, zmq.POLLIN)
                poller.register(own, zmq.POLLIN)
                ready = dict(poller.poll(1000))
                if own in ready:
                    while own.poll(0):
                        own.recv()
                elif iopub in ready:
                    got = _receive(kc.session, iopub)
                    if got is not None and self.between is not None:
                        self.between(got)
            except Exception:  # a guard: the relay goes on without what it could not read
                pass
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    # Tab and Shift-Tab wait this long for the worker (a dead one is noticed at once): a kernel's
    # first completion with jedi 0.20 took 8.8 s here (it loads its stubs), over the 10 s this was
    # on a busy machine, and the notebook's kernel then answered with its own names, not the worker's
    ANSWER_TIMEOUT = 60.0

    def complete(self, code: str, cursor_pos: int) -> dict:
        return self._wait_reply(self.kc.complete(code, cursor_pos), self.ANSWER_TIMEOUT)["content"]

    def inspect(self, code: str, cursor_pos: int, detail_level: int = 0) -> dict:
        return self._wait_reply(self.kc.inspect(code, cursor_pos, detail_level), self.ANSWER_TIMEOUT)["content"]

    def shutdown(self) -> None:
        self.stop_reading()
        self._disconnect()
        if self._context is not None:
            self._context.term()  # its sockets are closed, with no linger
            self._context = None
        try:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)
        except Exception:
            pass


def _receive(session, sock) -> dict | None:
    """One message from a socket that has one (None: not a message of ours, or none after all)."""
    import zmq

    try:
        _, msg = session.recv(sock, mode=zmq.NOBLOCK)
    except (zmq.ZMQError, ValueError):
        return None
    return msg


class RelayedError(Exception):
    """An error the worker raised, shown with the worker's traceback; its class takes the name
    of the worker's exception, so the execute reply names it too."""

    def __init__(self, evalue: str, stb: list[str]):
        super().__init__(evalue)
        self.stb = stb

    def _render_traceback_(self) -> list[str]:
        return self.stb


def relayed_error(content: dict) -> RelayedError:
    ename = content.get("ename") or "Error"
    kind = type(ename if ename.isidentifier() else "Error", (RelayedError,), {"__module__": "builtins"})
    return kind(content.get("evalue", ""), list(content.get("traceback", [])))


class Node(dict):
    """A dict whose keys read as attributes too: the relay's record of the cells it relayed, read
    by the supervisor as it reads nbformat's notebook nodes. Not nbformat's own: importing it
    imports jsonschema and its format checkers, seconds on a busy machine where JupyterLab
    installed them, at every ``%resilience isolate``."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def code_cell(source: str) -> Node:
    return Node(cell_type="code", source=source, metadata=Node(), outputs=[], execution_count=None)


class Result:
    """The worker's ``execute_result``, displayed by the notebook's kernel as its own."""

    def __init__(self, data: dict, metadata: dict):
        self.data, self.metadata = data, metadata

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.data, self.metadata

    def __repr__(self) -> str:
        return str(self.data.get("text/plain", ""))


class Relay:
    """Isolation in one notebook kernel: the worker, the cells relayed so far, the restarts."""

    def __init__(self, session):
        self.session, self.shell = session, session.shell
        # the workers' sockets (0700: ours alone), held until this process ends, however it ends
        self.folder = TempFolder("worker", f"{os.getpid()}-")
        self.sockets = self.folder.path
        # every worker hashes strings alike: a replayed set-up cell's set iterates as it did (driver.hash_seed)
        env = {HASH_SEED: hash_seed(session.root()), **os.environ, SUPERVISED_ENV: "1", WORKER_ENV: "1",
               RUN_DIR_ENV: str(session.root())}
        self.client = WorkerClient(self.sockets, env, os.getcwd())
        self.client.nb = Node(cells=[], metadata=Node())
        # a second worker, started ahead of need and warmed with the worker's imports: a restart
        # skips the kernel start and the imports (the driver's standby, the same code)
        spare = Standby(self.client, self.sockets, env, os.getcwd()) if session.settings.standby else None
        self.supervisor = Supervisor(self.client, session.root(), session.settings.max_restarts, spare=spare)
        self.comms: set[str] = set()  # the widgets' comms open with the worker
        self.own_handlers: dict = {}  # this kernel's handlers of COMM_MESSAGES, while it relays
        self.worker_count: int | None = None  # the worker's next execution count, as far as known
        # the frontend's requests relayed, by id, the latest last: what a thread of the worker
        # publishes under one of them after it ended goes to its cell (:meth:`between`)
        self.parents: dict[str, dict] = {}
        self.client.between = self.between

    @property
    def restarts(self):
        return self.supervisor.result.restarts

    def start(self, started: float) -> None:
        """Start the worker (and the standby); ``started``: when ``%resilience isolate`` began,
        which the line that isolation is on counts from."""
        if not self.client.start():
            self.close()
            from .errors import OptionError

            raise OptionError("%resilience isolate: the worker kernel died while starting; see the log of this kernel")
        if self.supervisor.spare is not None:
            self.supervisor.spare.spawn()
        self.client.start_reading()
        self.session.say(f"colab_resilience: isolation on: cells run in worker kernel PID {self.client.pid} "
                         f"(started in {time.perf_counter() - started:.1f} s); this kernel only relays, "
                         "and when the worker dies the cell goes on in a new one; %resilience isolate off ends it")

    def close(self) -> None:
        self.supervisor.close()  # the standby, then the worker
        self.folder.remove()

    def status_line(self) -> str:
        pid = self.client.pid
        memory = "?"
        try:
            with open(f"/proc/{pid}/statm") as f:
                memory = f"{int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f} MiB"
        except (OSError, ValueError, IndexError, TypeError):
            pass
        state = "running" if self.client.alive() else "dead (the next cell starts a new one)"
        spare = self.supervisor.spare.pid if self.supervisor.spare is not None else None
        standby = f"standby PID {spare}" if spare is not None else "no standby"
        last = f" (last: {self.restarts[-1].reason})" if self.restarts else ""
        return (f"colab_resilience: isolation on: worker kernel PID {pid}, {state}, resident memory {memory}, {standby}, "
                f"{len(self.restarts)} restart{'s' if len(self.restarts) != 1 else ''}{last}; "
                f"{len(self.supervisor.replay_done)} set-up cell{'s' if len(self.supervisor.replay_done) != 1 else ''} to replay")

    # --- one cell -------------------------------------------------------------------------------

    def run_cell(self, source: str):
        supervisor, nb = self.supervisor, self.client.nb
        if STATUS.match(source):
            print(self.status_line(), flush=True)
        index = len(nb.cells)
        cell = code_cell(source)
        nb.cells.append(cell)
        seen = len(self.restarts)
        self._relaying(self._parent())
        if not self.client.alive():  # it died between cells
            self._recover(index, seen)
            seen = len(self.restarts)
        while True:
            try:
                self._sync_count()
                self._result = None  # an attempt the worker died in shows no result
                reply = self.client.run(source, self.forward, msg_id=self._parent_id(), allow_stdin=self._allow_stdin(),
                                        on_input=self._input, user_expressions=self._asks())
                break
            except KernelDied:
                sys.stdout.flush()
                self._recover(index, seen)
                seen = len(self.restarts)
        supervisor.budgets.recovering = None
        content = reply["content"]
        if supervisor.spare is not None:  # the standby imports what the cell imported
            supervisor.spare.learned(expression_value(reply, MODULES))
        if isinstance(content.get("execution_count"), int):
            self.worker_count = content["execution_count"] + 1
        sys.stdout.flush()
        sys.stderr.flush()
        if content.get("status") == "error":
            raise relayed_error(content)
        if is_replay_cell(cell):
            supervisor.replay_done.append(index)
        return self._result

    def _recover(self, index: int, seen: int) -> None:
        self.worker_count = None  # a new worker counts from 1
        self._widgets_lost()
        ok = self.supervisor.recover(index)
        for r in self.restarts[seen:]:
            print(r.marker(live=True), end="", file=sys.stderr, flush=True)
        if not ok:  # the budget is spent, or the new worker could not be brought to where the dead one was
            result = self.supervisor.result
            raise relayed_error({"ename": "RestartBudgetSpent" if result.status == EXIT_BUDGET else "RecoveryFailed",
                                 "evalue": result.message, "traceback": [result.message]})

    def _sync_count(self) -> None:
        """The worker numbers the cell as the notebook shows it (tracebacks say "Cell In[7]")."""
        running = getattr(self.shell.displayhook, "exec_result", None)  # this cell's, in IPython 7 to 9
        want = getattr(running, "execution_count", None)
        if not isinstance(want, int):
            return
        if self.worker_count != want:
            self.client.call(f"get_ipython().execution_count = {int(want)}")
            self.worker_count = want

    def _asks(self) -> dict:
        """What the relay asks the worker with each cell, so that it costs no round trip more."""
        return {MODULES: NEW_MODULES} if self.supervisor.spare is not None else {}

    def _parent(self) -> dict | None:
        """The frontend's request this kernel is answering (its execute_request)."""
        kernel = getattr(self.shell, "kernel", None)
        try:
            return kernel.get_parent("shell") or None
        except (AttributeError, TypeError):
            return None

    def _parent_id(self) -> str | None:
        return (self._parent() or {}).get("header", {}).get("msg_id") or None

    def _allow_stdin(self) -> bool:
        kernel = getattr(self.shell, "kernel", None)
        return bool(getattr(kernel, "_allow_stdin", False))

    def _input(self, prompt: str, password: bool) -> str:
        if password:
            import getpass

            return getpass.getpass(prompt)
        return input(prompt)

    def forward(self, msg: dict) -> None:
        """One iopub message of the worker, published by the notebook's kernel as its own."""
        kind, c = msg["msg_type"], msg["content"]
        if kind == "stream":
            stream = sys.stderr if c.get("name") == "stderr" else sys.stdout
            stream.write(c.get("text", ""))  # ipykernel sends it on as it does a print's
        elif kind in ("display_data", "update_display_data"):  # publish() flushes the streams first
            self.shell.display_pub.publish(data=c.get("data", {}), metadata=c.get("metadata", {}),
                                           transient=c.get("transient") or {}, update=kind == "update_display_data")
        elif kind == "clear_output":
            self.shell.display_pub.clear_output(wait=bool(c.get("wait")))
        elif kind == "execute_result":
            self._result = Result(c.get("data", {}), c.get("metadata", {}))
        elif kind in ("comm_open", "comm_msg", "comm_close"):  # widgets: the worker's, shown by the frontend
            self._track(kind, c)
            sys.stdout.flush()
            sys.stderr.flush()
            self._publish(msg, self._parent())
        # error: the reply carries it (raised by run_cell); execute_input and status: the relay's own

    _result: Result | None = None

    def _relaying(self, request: dict | None) -> None:
        """``request`` (the frontend's) is relayed now: what the worker publishes under it later is
        its (the last 256 requests are known)."""
        msg_id = (request or {}).get("header", {}).get("msg_id")
        if msg_id:
            self.parents[msg_id] = request
            while len(self.parents) > 256:
                del self.parents[next(iter(self.parents))]

    def between(self, msg: dict) -> None:
        """An iopub message of the worker's that no request in flight waits for (read by the
        worker client's reader between requests, or during another's): what a thread of an earlier
        cell prints or displays, published under that cell's request, so that it shows in that
        cell's output as in one kernel; a widget's message (a bar a thread moves). What the relay's
        own calls make (the replayed set-up cells) is not shown. Nothing it meets stops the cell
        in flight or the reader."""
        try:
            self._publish_between(msg)
        except Exception:
            pass

    def _publish_between(self, msg: dict) -> None:
        kind, c = msg.get("msg_type"), msg.get("content") or {}
        parent = self.parents.get(msg.get("parent_header", {}).get("msg_id"))
        if getattr(self.shell, "kernel", None) is None:
            return
        if kind in ("comm_open", "comm_msg", "comm_close"):
            if parent is None and (kind == "comm_open" or c.get("comm_id") not in self.comms):
                return  # a widget of a replayed set-up cell's, never shown
            self._track(kind, c)
            self._publish(msg, parent or self._parent())
        elif parent is not None and kind in ("stream", "display_data", "update_display_data", "clear_output"):
            self._publish(msg, parent)

    def _publish(self, msg: dict, parent: dict) -> None:
        """The worker's iopub message ``msg``, sent by this kernel under ``parent`` (a widget's
        under its comm's identity, as ipykernel sends them)."""
        kernel, kind, c = self.shell.kernel, msg["msg_type"], msg["content"]
        ident = f"comm-{c.get('comm_id', '')}".encode("ascii", "replace") if kind.startswith("comm_") else None
        kernel.session.send(kernel.iopub_socket, kind, c, parent=parent, ident=ident,
                            metadata=msg.get("metadata") or {}, buffers=msg.get("buffers") or None)

    def user_expressions(self, expressions: dict) -> dict:
        """An execute request's ``user_expressions`` (a variable inspector's), evaluated in the
        worker, where the names are."""
        if not expressions:
            return {}
        try:
            if self.client.alive():
                return self.client.call(user_expressions=expressions)["content"].get("user_expressions", {})
        except (KernelDied, TimeoutError):
            pass
        gone = {"status": "error", "ename": "WorkerGone", "traceback": [],
                "evalue": "the isolation worker kernel is dead; the next cell starts a new one"}
        return {name: dict(gone) for name in expressions}

    def pass_on(self, msg: dict) -> dict | None:
        """A frontend's widget message (``comm_*``, ``comm_info_request``), for the worker, whose
        widgets they are; what it publishes in answer is forwarded. Its reply, if it has one;
        None when the worker is not there to answer."""
        kind, comm_id = msg["header"]["msg_type"], msg["content"].get("comm_id")
        if kind in ("comm_msg", "comm_close") and comm_id not in self.comms:
            return None  # a widget of a worker that died: nobody owns it now
        if not self.client.alive():
            self._widgets_lost()
            return None
        self._track(kind, msg["content"])
        self._relaying(msg)
        try:
            return self.client.send(msg, self.forward, on_input=self._input)
        except KernelDied:
            self._widgets_lost()
            return None

    def _track(self, kind: str, content: dict) -> None:
        """The comms (widgets) open between the frontend and this worker."""
        if kind == "comm_open":
            self.comms.add(content.get("comm_id"))
        elif kind == "comm_close":
            self.comms.discard(content.get("comm_id"))

    def _widgets_lost(self) -> None:
        """The worker died: its widgets, still drawn in the notebook, answer nobody now. Said once."""
        if self.comms:
            self.comms.clear()
            print("colab_resilience: the widgets shown before the worker kernel died are inert now (their state "
                  "was in it); run their cells again for live ones", file=sys.stderr, flush=True)

    def relay_magic(self, line: str, cell: str):
        result = self.run_cell(cell)
        self._result = None
        return result


# --- turning it on and off ----------------------------------------------------------------------

_relays: dict[int, Relay] = {}


def relay_of(shell) -> Relay | None:
    return _relays.get(id(shell))


def _route(lines: list[str]) -> list[str]:
    source = "".join(lines)
    if not source.strip() or LOCAL.match(source):
        return lines
    return [f"get_ipython().run_cell_magic({MAGIC_NAME!r}, '', {source!r})\n"]


def isolate(session) -> None:
    """``%resilience isolate``: start the worker and relay every cell from now on."""
    shell = session.shell
    if relay_of(shell) is not None:
        print(relay_of(shell).status_line())
        return
    if os.environ.get(WORKER_ENV) or os.environ.get(SUPERVISED_ENV):  # the same notebook, run headless
        session.say("colab_resilience: isolation not needed: this kernel is supervised already (an isolation worker "
                    "or `colab-resilience run`), which brings it back with no click")
        return
    started = time.perf_counter()
    relay = Relay(session)
    relay.start(started)
    _relays[id(shell)] = relay
    atexit.register(relay.close)  # a kernel shut down or restarted by its frontend takes its worker along
    shell.register_magic_function(relay.relay_magic, "cell", MAGIC_NAME)
    shell.input_transformers_cleanup.append(_route)
    shell.user_expressions = relay.user_expressions
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        _wrap_kernel(kernel, relay)
    user = [n for n in shell.user_ns if not n.startswith("_") and n not in shell.user_ns_hidden
            and n not in ("In", "Out", "exit", "quit", "get_ipython")]
    if user:
        session.say(f"colab_resilience: {', '.join(sorted(user)[:8])}{'...' if len(user) > 8 else ''} "
                    "were set in this kernel before isolation and are not in the worker; run those cells again")


def stop(session) -> None:
    """``%resilience isolate off``: shut the worker down; cells run in this kernel again."""
    shell = session.shell
    relay = _relays.pop(id(shell), None)
    if relay is None:
        session.say("colab_resilience: isolation is off")
        return
    try:
        shell.input_transformers_cleanup.remove(_route)
    except ValueError:
        pass
    shell.magics_manager.magics["cell"].pop(MAGIC_NAME, None)
    shell.__dict__.pop("user_expressions", None)
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        for name in ("do_complete", "do_inspect"):
            kernel.__dict__.pop(name, None)
        for kind, handler in relay.own_handlers.items():
            if handler is None:
                kernel.shell_handlers.pop(kind, None)
            else:
                kernel.shell_handlers[kind] = handler
    relay.close()
    atexit.unregister(relay.close)
    session.say("colab_resilience: isolation off: the worker kernel was shut down; cells run in this kernel again "
                "(what the worker computed is gone)")


def _wrap_kernel(kernel, relay: Relay) -> None:
    """Tab and Shift-Tab answered by the worker (the names live there)."""
    own_complete, own_inspect = kernel.do_complete, kernel.do_inspect

    def do_complete(code, cursor_pos):
        try:
            return relay.client.complete(code, cursor_pos)
        except Exception:
            return own_complete(code, cursor_pos)

    def do_inspect(code, cursor_pos, detail_level=0, omit_sections=()):
        try:
            return relay.client.inspect(code, cursor_pos, detail_level)
        except Exception:
            return own_inspect(code, cursor_pos, detail_level)

    kernel.do_complete, kernel.do_inspect = do_complete, do_inspect
    relay.own_handlers = {kind: kernel.shell_handlers.get(kind) for kind in COMM_MESSAGES}
    for kind in COMM_MESSAGES:
        kernel.shell_handlers[kind] = _comm_handler(kernel, relay, kind)


def _comm_handler(kernel, relay: Relay, kind: str):
    """The frontend's widget messages go to the worker, which owns the widgets; a reply
    (``comm_info_reply``) comes back as this kernel's."""
    own = relay.own_handlers.get(kind)

    def handler(stream, ident, msg):
        reply = relay.pass_on(msg)
        if reply is not None:
            kernel.session.send(stream, reply["msg_type"], reply["content"], parent=msg, ident=ident,
                                metadata=reply.get("metadata") or {})
        elif kind == "comm_info_request" and own is not None:  # no worker to ask: this kernel has none
            return own(stream, ident, msg)

    return handler
