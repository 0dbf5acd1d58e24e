"""The driver's standby kernel: a second kernel, started ahead of need and warmed with the working
kernel's imports, that takes the working kernel's place when it dies.

It is started with the working kernel's arguments, environment and folder; after every cell the
driver asks the working kernel which installed modules it imported since the last cell and has the
standby import them too, each under the environment the working kernel imported it under (a
notebook that sets ``KERAS_BACKEND`` or ``JAX_ENABLE_X64`` just before the import gets the same
library in the standby). When the working kernel dies, the standby is adopted: the kernel start and
the imports (``import torch`` and what the set-up cells pull in) are already done, and only the
replay and the restore remain. A standby that died (the OOM killer's first choice) is noticed when
it is needed; that restart is a cold one. What the standby does to itself (low priority, the
imports, becoming an ordinary kernel) is :mod:`colab_resilience.standby`.
"""

from __future__ import annotations

import json
import os
import time

from jupyter_client import AsyncKernelManager
from jupyter_core.utils import ensure_async, run_sync

from . import priority, standby
from .kernels import KernelDied, api_call, blocking, discard, expression_value, kernel_pid, kernel_process

# what a working kernel is asked after each cell: the modules it imported since the last time,
# with the environment they were imported under (JSON: a long list would not survive a repr)
NEW_MODULES = api_call("new_modules")


class Standby:
    """The driver's standby kernel: started with the working kernel's arguments, environment and
    folder; fed the working kernel's imports after every cell; handed over by :meth:`take`."""

    def __init__(self, client, sockets: str, env: dict, cwd: str, limit: int | None = None):
        self.client, self.sockets, self.env, self.cwd = client, sockets, env, cwd
        self.limit = limit  # the most standbys started in all (None: no limit)
        self.km = self.kc = None
        self.started = 0
        self.modules: set[str] = set()  # every module a working kernel reported
        self.off: str | None = None  # why no standby can be used for this run
        # what a new standby imports: (environment or None: the one before, names, whether the working
        # kernel imported them before its global random states changed), in order
        self.groups: list[tuple[dict | None, list[str], bool]] = []

    def spawn(self) -> None:
        self.shutdown()
        if self.off or (self.limit is not None and self.started >= self.limit):
            return
        self.started += 1
        km = self.client.new_manager(os.path.join(self.sockets, f"standby-{self.started}"))
        try:
            blocking(km.start_kernel, extra_arguments=list(self.client.extra_arguments),
                     env={**self.env, standby.ENV: "1"}, cwd=self.cwd, **priority.die_with_parent())
        except Exception:  # no standby: the next restart is a cold one, as without it
            return
        self.km, self.kc = km, km.client()
        whole = priority.may_raise_priority()
        if whole:  # its start-up at low priority too, not only its later imports
            pid = kernel_pid(km)
            if pid is not None:
                priority.lower(pid)
        self.kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        self._send(api_call("become_standby", whole))
        if self.groups:
            self._send(api_call("preload", self.groups))

    def _send(self, code: str) -> None:
        if not isinstance(self.km, AsyncKernelManager):  # the isolation relay's blocking client
            self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
            return

        async def send() -> None:  # the client's sockets belong to the driver's event loop
            self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)

        run_sync(send)()

    def follow(self) -> None:
        """After a cell: have the standby import what the working kernel imported since the last."""
        if self.km is None:
            return
        try:
            names = self.client.evaluate(NEW_MODULES, timeout=30)
        except (KernelDied, TimeoutError):  # the next cell finds out
            return
        self.learned(names)

    def learned(self, answer) -> None:
        """The working kernel's answer to :data:`NEW_MODULES` (asked with a cell, by the relay):
        the standby imports those it has not yet, each under the environment the working kernel
        imported it under."""
        if self.km is None:
            return
        try:
            groups = json.loads(answer) if isinstance(answer, str) else []
        except ValueError:
            groups = []
        fresh_groups = []
        for env, names, *untouched in groups:
            fresh = [n for n in names if n not in self.modules]
            self.modules.update(fresh)
            if fresh or env is not None:
                fresh_groups.append((env, fresh, bool(untouched and untouched[0])))
        self.groups += fresh_groups
        if fresh_groups:
            self._send(api_call("preload", fresh_groups))

    @property
    def pid(self) -> int | None:
        """The standby's process, if one was started."""
        return kernel_pid(self.km)

    def take(self):
        """The standby's kernel manager, for the driver to adopt; None when none is alive."""
        km, kc = self.km, self.kc
        self.km = self.kc = None
        if km is None:
            return None
        try:
            alive = blocking(km.is_alive)
        except Exception:
            alive = False
        drew = self._ask(km, kc, api_call("stop_standby_imports")) if alive else None
        kc.stop_channels()
        if drew:
            self.off = (f"importing {drew} drew from Python's or NumPy's global random state, which a replay in a "
                        "kernel that imported it ahead cannot draw again")
        if not alive or drew or drew is None:  # dead, unusable, or not answering: a cold restart
            try:
                kernel_process(km).kill()
            except (AttributeError, OSError):
                pass
            discard(km)
            return None
        # jupyter_client restarts a kernel with the arguments it was first started with: should this
        # one die and no standby be ready, the kernel started in its place is a working kernel
        launch = getattr(km, "_launch_args", None)
        if isinstance(launch, dict) and isinstance(launch.get("env"), dict):
            launch["env"] = {k: v for k, v in launch["env"].items() if k != standby.ENV}
        return km

    def _ask(self, km, kc, expression: str, timeout: float = 300.0):
        """The value of ``expression`` in the standby (``kc``: its shell channel open); None when it
        died, did not answer in ``timeout`` seconds, or the value is no literal."""
        from queue import Empty

        def send() -> str:
            return kc.execute("", silent=True, store_history=False, user_expressions={"v": expression},
                              allow_stdin=False)

        deadline = time.monotonic() + timeout

        async def answer():
            msg_id = send()
            while time.monotonic() < deadline:
                try:
                    msg = await ensure_async(kc.get_shell_msg(timeout=0.1))
                except Empty:
                    if not await ensure_async(km.is_alive()):
                        return None
                    continue
                if msg.get("parent_header", {}).get("msg_id") == msg_id:
                    return expression_value(msg)
            return None

        if not isinstance(km, AsyncKernelManager):  # the isolation relay's blocking client, in a kernel
            msg_id = send()
            while time.monotonic() < deadline:
                try:
                    msg = kc.get_shell_msg(timeout=0.1)
                except Empty:
                    if not km.is_alive():
                        return None
                    continue
                if msg.get("parent_header", {}).get("msg_id") == msg_id:
                    return expression_value(msg)
            return None
        try:  # the client's sockets belong to the driver's event loop
            return run_sync(answer)()
        except Exception:
            return None

    def shutdown(self) -> None:
        km, kc = self.km, self.kc
        self.km = self.kc = None
        if kc is not None:
            kc.stop_channels()
        if km is not None:
            try:  # at once: jupyter_client's shutdown interrupts it first, and it would say so
                kernel_process(km).kill()
            except (AttributeError, OSError):  # none started
                pass
            discard(km)
