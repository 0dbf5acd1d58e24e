"""Real kernels for the tests: jupyter_client for fine control, nbclient for whole notebooks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from jupyter_client import AsyncKernelManager, KernelManager
from nbclient import NotebookClient

KERNEL_NAME = "colab-resilience-test"
REPO = str(Path(__file__).resolve().parent.parent)


def child_env(**extra: str) -> dict:
    """The environment for a child Python that imports this checkout (before any PYTHONPATH
    already set, which is kept: a machine may carry packages there)."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


@contextlib.contextmanager
def isolated_jupyter(root: Path, display_name: str = "colab_resilience tests"):
    """Kernels started inside the block run this interpreter, with a fresh IPython profile.

    A kernelspec of our own (pointing at ``sys.executable``) keeps a system-wide ``python3``
    kernelspec from sending the kernels to another Python; a private ``IPYTHONDIR`` keeps the
    user's startup files and configuration out; the package's key and runs live under ``root``.
    The environment is restored afterwards.
    """
    spec_dir = root / "data" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name, "language": "python"}))
    values = {
        "JUPYTER_PATH": str(root / "data"),
        "IPYTHONDIR": str(root / "ipython"),
        "COLAB_RESILIENCE_HOME": str(root / "home"),
        "COLAB_RESILIENCE_RUN_DIR": str(root / "runs"),
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield root
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# In the kernel: read resident memory / address-space size and cap the address space, so that
# torch's CPU allocator really fails (FACTS: a lowered soft RLIMIT_AS is a real OOM on a CPU).
MEMORY_TOOLS = r"""
import os, resource
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
def vm_size():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmSize:'):
                return int(line.split()[1]) * 1024
def cap_memory(budget):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + budget, hard))
GiB = 1 << 30
MiB = 1 << 20
"""

# One statement: a real failure of torch's CPU allocator on any machine. The address space is
# capped at 1 TiB, then 64 TiB are asked for; without the cap, a kernel that always overcommits
# (vm.overcommit_memory=1, as on the GPU machines tried) grants the 64 TiB.
HOST_OOM = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 40, resource.RLIM_INFINITY)); "
            "torch.empty(1 << 44)")


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


@dataclass
class Reply:
    status: str
    ename: str | None = None
    evalue: str | None = None
    traceback: list[str] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    outputs: list[dict] = field(default_factory=list)

    @property
    def traceback_text(self) -> str:
        return strip_ansi("\n".join(self.traceback))


class Kernel:
    """One kernel started through jupyter_client, driven message by message."""

    def __init__(self, extra_env: dict | None = None):
        import os

        import tempfile

        self._sockets = tempfile.mkdtemp(prefix="cr-test-kernel-")  # not the working directory
        self.km = KernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=os.path.join(self._sockets, "kernel"))
        env = dict(os.environ)
        env.update(extra_env or {})
        self.km.start_kernel(env=env)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def submit(self, code: str, metadata: dict | None = None) -> str:
        content = dict(code=code, silent=False, store_history=True, user_expressions={},
                       allow_stdin=False, stop_on_error=True)
        msg = self.kc.session.msg("execute_request", content, metadata=metadata or {})
        self.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    def collect(self, msg_id: str, timeout: float = 180) -> Reply:
        deadline = time.monotonic() + timeout
        reply = None
        while reply is None:
            msg = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") == msg_id:
                reply = msg
        content = reply["content"]
        result = Reply(status=content["status"], ename=content.get("ename"),
                       evalue=content.get("evalue"), traceback=content.get("traceback", []))
        # iopub: everything up to this request's 'idle'
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, c = msg["msg_type"], msg["content"]
            if kind == "status" and c["execution_state"] == "idle":
                break
            if kind == "stream":
                if c["name"] == "stdout":
                    result.stdout += c["text"]
                else:
                    result.stderr += c["text"]
            if kind in ("stream", "error", "execute_result", "display_data"):
                result.outputs.append({"type": kind, **c})
        return result

    def execute(self, code: str, metadata: dict | None = None, timeout: float = 180) -> Reply:
        reply = self.collect(self.submit(code, metadata), timeout)
        if reply.status == "aborted":
            # ipykernel 6.17 aborts what arrives before it has cleared its abort flag after an
            # error reply (the previous request's; a loaded machine widens the window): send again
            time.sleep(0.2)
            reply = self.collect(self.submit(code, metadata), timeout)
        return reply

    def ok(self, code: str, **kw) -> Reply:
        """Execute and insist on success (the assertion shows the traceback otherwise)."""
        r = self.execute(code, **kw)
        assert r.status == "ok", f"{r.ename}: {r.evalue}\n{r.traceback_text}\n{r.stdout}\n{r.stderr}"
        return r

    def value(self, expr: str):
        """Evaluate ``expr`` in the kernel and return it (it must be a literal)."""
        import ast

        r = self.ok(f"print(repr({expr}))")
        return ast.literal_eval(r.stdout.strip().splitlines()[-1])

    def execute_until_exit(self, code: str, metadata: dict | None = None, timeout: float = 180):
        """Execute ``code`` expecting the kernel to leave; return (stdout, exit code)."""
        msg_id = self.submit(code, metadata)
        deadline = time.monotonic() + timeout
        stdout = ""
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                    stdout += msg["content"]["text"]
                continue
            except Exception:  # queue.Empty
                pass
            if not self.km.is_alive():
                break
            try:
                reply = self.kc.get_shell_msg(timeout=0)
                if reply["parent_header"].get("msg_id") == msg_id:
                    c = reply["content"]
                    raise AssertionError(f"the kernel did not leave: {c['status']} {c.get('ename')} {c.get('evalue')}\n{stdout}")
            except AssertionError:
                raise
            except Exception:
                pass
        else:
            raise AssertionError(f"the kernel did not leave within {timeout} s\n{stdout}")
        process = getattr(self.km.provisioner, "process", None)
        code = process.poll() if process is not None else None
        return stdout, code

    def restart(self) -> None:
        """What a Jupyter server's restarter does after a death: a new kernel, same connection."""
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=60)

    def shutdown(self) -> None:
        import shutil

        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)
            shutil.rmtree(self._sockets, ignore_errors=True)


def notebook(*sources: str, tags: dict[int, list[str]] | None = None):
    nb = nbformat.v4.new_notebook()
    for i, src in enumerate(sources):
        cell = nbformat.v4.new_code_cell(src)
        if tags and i in tags:
            cell.metadata["tags"] = tags[i]
        nb.cells.append(cell)
    return nb


def run_notebook(nb, *, allow_errors: bool = False, timeout: int = 180):
    """Execute ``nb`` headless with nbclient in a fresh kernel; return the executed notebook."""
    import os
    import shutil
    import tempfile

    sockets = tempfile.mkdtemp(prefix="cr-test-kernel-")
    km = AsyncKernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=os.path.join(sockets, "kernel"))
    client = NotebookClient(nb, km=km, kernel_name=KERNEL_NAME, timeout=timeout, allow_errors=allow_errors)
    try:
        client.execute()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    return nb


def cell_text(cell) -> str:
    """All stream text and plain-text results of an executed cell."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(strip_ansi("\n".join(out.traceback)))
    return "".join(parts)
