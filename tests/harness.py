"""The tests' one harness: the golden notebooks under ``tests/files``, run supervised, interactively
or in this process; real kernels (jupyter_client for fine control, nbclient for whole notebooks).

Golden notebooks
    :func:`load` reads ``tests/files/NAME`` with parameters injected after its ``parameters`` cell,
    as ``colab_resilience.driver.run_notebook(..., parameters=...)`` and papermill do; :func:`index`
    finds a cell by its id (``setup``, ``train``, ``result``...), wherever injected cells put it;
    :func:`insert` adds a test's own probe cell; :func:`parameter_values` reads the parameters.
Three ways to run one
    :func:`run` supervised (``colab_resilience.driver.run_notebook`` with the test kernel, a working
    folder and a run folder in it); :func:`run_interactive` cell by cell in a :class:`Kernel`, as a
    user runs it in Jupyter (:func:`user_cells`); :func:`run_in_shell` in an in-process IPython shell.
What a run leaves
    :func:`result` (the ``RESULT`` line of ``train.ipynb``), :func:`events` and :func:`epochs` (its
    log: which kernel did what, and which epochs finished); :class:`Reference` (an uninterrupted
    run: the ``reference`` fixture of ``conftest.py``).
Kernels and the rest
    :class:`Kernel`, :func:`run_notebook` (plain nbclient), :func:`notebook` (a small inline
    notebook), :func:`cell_text`, :data:`HOST_OOM`, :data:`MEMORY_TOOLS`, :func:`child_env`,
    :func:`isolated_jupyter`.
"""

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
TESTS = Path(__file__).resolve().parent
REPO = str(TESTS.parent)
FILES = TESTS / "files"


def child_env(**extra: str) -> dict:
    """The environment for a child Python that imports this checkout and the tests' own modules
    (``payloads``: what a test pickles, a child may unpickle), before any PYTHONPATH already set,
    which is kept: a machine may carry packages there."""
    path = os.pathsep.join(filter(None, [REPO, str(TESTS), os.environ.get("PYTHONPATH")]))
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
    messages: list[dict] = field(default_factory=list)  # every iopub message of the request but its status

    @property
    def traceback_text(self) -> str:
        return strip_ansi("\n".join(self.traceback))


class Kernel:
    """One kernel started through jupyter_client, driven message by message."""

    def __init__(self, extra_env: dict | None = None):
        import os

        import tempfile

        self._sockets = tempfile.mkdtemp(prefix="cr-test-kernel-")  # not the working directory
        ip = os.path.join(self._sockets, "kernel")
        self.km = KernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=ip, connection_file=ip + ".json")
        env = dict(os.environ)
        env.update(extra_env or {})
        try:
            self.km.start_kernel(env=env)
        except BaseException:  # (no such kernel: run outside this suite, which installs it) nothing is left
            import shutil

            shutil.rmtree(self._sockets, ignore_errors=True)
            raise
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
            if kind != "status":
                result.messages.append(msg)
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
        gone = False
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=1 if gone else 0.2)
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                    stdout += msg["content"]["text"]
                continue
            except Exception:  # queue.Empty
                pass
            if gone:
                break
            if not self.km.is_alive():
                # what the kernel sent before it left may still be on its way (a loaded machine):
                # read on until a second passes without a message
                gone = True
                continue
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


# a set-up cell that resumes by itself: from own.pt, which its training loop writes each epoch
OWN_CHECKPOINT_SETUP = (
    "import os, signal, torch\n%config ResilienceMagics.staging_memory = 'off'\ntorch.manual_seed(0)\n"
    "X, Y = torch.randn(64, 4), torch.randn(64, 1)\nmodel = torch.nn.Linear(4, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.05)\nstart_epoch, history = 0, []\n"
    "if os.path.exists('own.pt'):  # the notebook's own resume, from the file its loop writes\n"
    "    state = torch.load('own.pt')\n"
    "    model.load_state_dict(state['model']); opt.load_state_dict(state['opt'])\n"
    "    start_epoch, history = state['epoch'] + 1, state['history']")


def notebook(*sources: str, tags: dict[int, list[str]] | None = None):
    nb = nbformat.v4.new_notebook()
    for i, src in enumerate(sources):
        cell = nbformat.v4.new_code_cell(src)
        if tags and i in tags:
            cell.metadata["tags"] = tags[i]
        nb.cells.append(cell)
    return nb


def set_in(where: str, setting: str, imports: str, build: str, *cells: str):
    """A notebook that makes ``setting`` (a process-wide one: a dtype policy, 64-bit types) in a
    plain cell after the %%replay cell of ``imports`` (``where`` "plain-cell"), or first in the
    %%replay cell of ``build`` ("replay-cell"), then has ``cells``."""
    return notebook("%load_ext colab_resilience", "%%replay\n" + imports,
                    setting if where == "plain-cell" else "pass",
                    "%%replay\n" + (setting if where == "replay-cell" else "") + build, *cells)


def run_notebook(nb, *, allow_errors: bool = False, timeout: int = 180):
    """Execute ``nb`` headless with nbclient in a fresh kernel; return the executed notebook."""
    import os
    import shutil
    import tempfile

    sockets = tempfile.mkdtemp(prefix="cr-test-kernel-")
    ip = os.path.join(sockets, "kernel")
    km = AsyncKernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=ip, connection_file=ip + ".json")
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


# -- the golden notebooks -------------------------------------------------------------------------

USER_TAGS = {"parameters", "injected-parameters", "replay"}  # colab_resilience.replay.TAGS


def load(name: str, workdir: str | os.PathLike | None = None, **parameters):
    """``tests/files/<name>`` with ``parameters`` in a cell tagged ``injected-parameters`` after
    its ``parameters`` cell (that cell's id: ``injected-parameters``), as the driver and papermill
    put them. With ``workdir``, a notebook's ``mark`` and ``log`` parameters default to
    ``fault.mark`` and ``events.log`` there: nothing lands in the current directory."""
    from colab_resilience.driver import inject_parameters

    nb = nbformat.read(FILES / name, as_version=4)
    if workdir is not None:
        defaults = parameter_values(nb)
        for key, file in (("mark", "fault.mark"), ("log", "events.log")):
            if key in defaults:
                parameters.setdefault(key, str(Path(workdir) / file))
    inject_parameters(nb, parameters)
    for c in nb.cells:
        if "injected-parameters" in c.get("metadata", {}).get("tags", []):
            c["id"] = "injected-parameters"
    return nb


def index(nb, cell_id: str) -> int:
    """The position of the cell with id ``cell_id`` (the golden notebooks name their cells)."""
    found = [i for i, c in enumerate(nb.cells) if c.get("id") == cell_id]
    assert len(found) == 1, f"no single cell {cell_id!r} in {[c.get('id') for c in nb.cells]}"
    return found[0]


def insert(nb, before: str, source: str, cell_id: str):
    """Put a code cell (a test's probe or patch) before the cell ``before``; returns ``nb``."""
    cell = nbformat.v4.new_code_cell(source)
    cell["id"] = cell_id
    nb.cells.insert(index(nb, before), cell)
    return nb


def _tags(cell) -> set:
    return set(cell.get("metadata", {}).get("tags", []) or [])


def parameter_values(nb) -> dict:
    """The parameters' values: the ``parameters`` cell, then the injected ones (plain assignments)."""
    values: dict = {}
    for c in nb.cells:
        if c.cell_type == "code" and _tags(c) & {"parameters", "injected-parameters"}:
            exec(c.source, {}, values)
    return values


def user_cells(nb, *, verbatim: bool = False) -> list[tuple[str, str]]:
    """``(id, source)`` of the code cells as a user runs them in Jupyter, where no supervisor reads
    tags: a cell tagged ``parameters``, ``injected-parameters`` or ``replay`` starts with
    ``%%replay`` (what the supervisor makes of those tags), and ``$name`` in a magic's line is the
    parameter's value (IPython expands ``$name`` before the magic runs: after a restart, before the
    replay that defines it). ``verbatim``: the sources as they are (enough for a run without
    restarts)."""
    values = parameter_values(nb)
    out = []
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        source = c.source
        if verbatim:
            out.append((c.get("id"), source))
            continue
        if _tags(c) & USER_TAGS and not source.lstrip().startswith("%%replay"):
            source = "%%replay\n" + source
        first, sep, rest = source.partition("\n")
        if first.startswith("%"):
            first = re.sub(r"\$(\w+)", lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), first)
        out.append((c.get("id"), first + sep + rest))
    return out


def user_cell(nb, cell_id: str) -> str:
    """One cell of :func:`user_cells`."""
    return dict(user_cells(nb))[cell_id]


def run(nb, workdir: str | os.PathLike, **kw):
    """Supervised: ``colab_resilience.driver.run_notebook`` in the test kernel, in ``workdir``, with
    its run folder ``workdir/runs`` and the executed notebook written to ``workdir/out.ipynb``.
    One standby kernel at most (``standbys=1``, as `colab-resilience check` gives a run with one
    fault): it takes over from the run's first death as the default does; another started after
    it would import the notebook's modules (torch, TensorFlow, transformers: seconds of CPU) for
    a death that most tests never bring. A test of later deaths' standbys gives ``standbys``."""
    from colab_resilience import driver

    workdir = Path(workdir)
    kw.setdefault("kernel_name", KERNEL_NAME)
    kw.setdefault("standbys", 1)
    return driver.run_notebook(nb, workdir / "out.ipynb", cwd=workdir, run_dir=workdir / "runs", **kw)


def run_ok(nb, workdir: str | os.PathLike, **kw):
    """:func:`run`, which must succeed; returns the run and what its ``train`` cell printed."""
    result = run(nb, workdir, **kw)
    assert result.status == 0, result.message
    return result, cell_text(nb.cells[index(nb, "train")])


def once(basetemp: Path, key: str, make):
    """``make(folder)``, a JSON value, computed once in the whole test session, in a folder kept for
    it: by the first pytest-xdist worker that asks, while another that asks for the same ``key``
    waits and then reads it. For an uninterrupted twin run, which is the same run whichever test
    asks for it. ``basetemp``: ``tmp_path_factory.getbasetemp()`` (``tmp_path.parent``)."""
    import fcntl
    import hashlib

    root = Path(basetemp).parent if os.environ.get("PYTEST_XDIST_WORKER") else Path(basetemp)
    folder = root / "once"
    folder.mkdir(exist_ok=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    value = folder / f"{name}.json"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not value.exists():
            work = folder / name
            work.mkdir(exist_ok=True)
            made = make(work)
            value.with_suffix(".part").write_text(json.dumps(made))
            value.with_suffix(".part").rename(value)
        return json.loads(value.read_text())


def uninterrupted_ok(ran) -> None:
    """A twin's run: it succeeded with no restart (a fault meant for the faulted run that struck in
    the twin would make the comparison one of two resumed runs)."""
    assert ran.status == 0, ran.message
    assert not ran.restarts, [r.reason for r in ran.restarts]


def twin_result(tmp_path_factory, name: str, loader=None, **parameters) -> str:
    """The RESULT line of the golden notebook ``name`` with ``parameters`` (read by ``loader(work,
    **parameters)`` where it needs more, a folder of its own in ``work``, else :func:`load`) run
    supervised and uninterrupted, once in the test session (:func:`once`): what every faulted run
    of it must end with, bit for bit."""
    def uninterrupted(work: Path) -> str:
        nb = loader(work, **parameters) if loader is not None else load(name, work, **parameters)
        uninterrupted_ok(run(nb, work, standby=False))
        return result(nb)

    return once(tmp_path_factory.getbasetemp(), f"{name} {sorted(parameters.items())}", uninterrupted)


def faulted_and_twin(tmp_path: Path, notebook, shared: str | None = None):
    """``notebook(mark)`` run supervised with its fault (which strikes once, then creates
    ``mark``), and uninterrupted (its mark made already): the run, which must succeed, the
    executed notebook and its twin's. ``shared``: a name for the twin, run once for all the tests
    that give it (:func:`once`): the fault is never raised in the twin, so the notebooks that
    differ only by the fault they would raise share one."""
    def uninterrupted(folder: Path):
        (folder / "m").touch()  # the fault has struck already: none
        twin = notebook(folder / "m")
        uninterrupted_ok(run(twin, folder, standby=False))
        return twin

    if shared is None:
        (tmp_path / "twin").mkdir()
        twin = uninterrupted(tmp_path / "twin")
    else:
        twin = nbformat.reads(once(tmp_path.parent, f"twin {shared}", lambda f: nbformat.writes(uninterrupted(f))), 4)
    nb = notebook(tmp_path / "m")
    faulted = run(nb, tmp_path, standby=False)
    assert faulted.status == 0, faulted.message
    return faulted, nb, twin


def refused_or_twin(tmp_path: Path, notebook, refused: str | None):
    """``notebook(mark)`` run uninterrupted, then with its fault: with ``refused``, the faulted run
    must fail with that line; else it must succeed after one restart, with its twin's result."""
    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "m").touch()
    twin = notebook(tmp_path / "twin" / "m")
    uninterrupted_ok(run(twin, tmp_path / "twin", standby=False))
    nb = notebook(tmp_path / "m")
    faulted = run(nb, tmp_path, standby=False)
    if refused is not None:
        assert faulted.status != 0 and refused in faulted.message, faulted.message
    else:
        assert faulted.status == 0 and len(faulted.restarts) == 1, faulted.message
        assert result(nb) == result(twin)
    return faulted, nb, twin


def run_killed_after_training(nb, workdir: str | os.PathLike, holds: str):
    """:func:`run_ok` for a golden notebook whose ``result`` cell kills its kernel once, after the
    training cell ended: the one restart is that cell's, and its marker says that ``holds`` (a
    framework callback's label) came back from the finished training. Returns the run."""
    result, _ = run_ok(nb, workdir)
    marker = cell_text(nb.cells[index(nb, "result")])
    assert len(result.restarts) == 1 and result.restarts[0].cell == index(nb, "result"), marker
    assert f"restored {holds} from the finished training" in marker, marker
    assert "saves nothing" not in marker, marker
    return result


def run_interactive(kernel: "Kernel", nb, *, start: str | None = None, stop: str | None = None,
                    verbatim: bool = False) -> dict[str, "Reply"]:
    """Execute :func:`user_cells` in ``kernel`` one by one, each insisting on success: from the cell
    ``start`` (default: the first), up to but not including ``stop`` (default: to the end).
    Returns the replies by cell id."""
    replies, started = {}, start is None
    for cell_id, source in user_cells(nb, verbatim=verbatim):
        started = started or cell_id == start
        if cell_id == stop:
            break
        if started:
            replies[cell_id] = kernel.ok(source)
    return replies


def by_kernel(log: Path) -> list[tuple[int, int]]:
    """A golden notebook's ``pid word n`` log (``epoch 2``, ``step 12``) as ``(kernel, n)`` per line,
    the kernels numbered from 0 in the order they appear."""
    pids: dict[str, int] = {}
    out = []
    for line in Path(log).read_text().splitlines():
        pid, _, n = line.split()
        out.append((pids.setdefault(pid, len(pids)), int(n)))
    return out


def killed_and_rerun(kernel: "Kernel", nb, expect_code: int = -9) -> str:
    """As a user in Jupyter: run the cells up to the training cell, run it until the kernel dies
    (or leaves for a planned restart), let the server's restarter bring a kernel back, run the
    training cell again; returns what that last run printed. The result cell is run by the caller."""
    run_interactive(kernel, nb, stop="train")
    _, code = kernel.execute_until_exit(user_cell(nb, "train"))
    assert code == expect_code
    kernel.restart()
    return kernel.ok(user_cell(nb, "train")).stdout


def stopped_and_run_again(kernel: "Kernel", nb) -> "Reply":
    """As a user in Jupyter: run the cells up to the training cell, run it until its run stops with
    the error the notebook raises once (``fault="error"``), then run it again as it is, without
    the set-up cells; returns that second reply."""
    run_interactive(kernel, nb, stop="train")
    r = kernel.execute(user_cell(nb, "train"))
    assert r.status == "error" and r.ename == "ValueError", r.stdout
    return kernel.execute(user_cell(nb, "train"))


def run_in_shell(ip, nb, *, stop: str | None = None, verbatim: bool = False) -> None:
    """Execute :func:`user_cells` in the in-process shell ``ip`` (the extension already loaded:
    the ``load-extension`` cell is skipped), up to but not including ``stop``; each must succeed."""
    for cell_id, source in user_cells(nb, verbatim=verbatim):
        if cell_id == stop:
            break
        if cell_id != "load-extension":
            r = ip.run_cell(source)
            assert r.success, f"cell {cell_id}: {r.error_before_exec or r.error_in_exec!r}"


def result(executed) -> str:
    """The ``RESULT`` line of an executed notebook, or of text."""
    text = executed if isinstance(executed, str) else "".join(cell_text(c) for c in executed.cells)
    found = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert len(found) == 1, f"{len(found)} RESULT lines:\n{text[-3000:]}"
    return found[0]


@dataclass(frozen=True)
class Event:
    """A line of train.ipynb's log: ``pid time name [arg]``."""

    pid: int
    time: float
    name: str
    arg: str = ""


def events(log: str | os.PathLike) -> list[Event]:
    """The log's lines in order (none if it does not exist)."""
    path = Path(log)
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        pid, t, name, *arg = line.split(" ", 3)
        out.append(Event(int(pid), float(t), name, arg[0] if arg else ""))
    return out


def epochs(log: str | os.PathLike) -> list[int]:
    """The epochs that finished, in order: each once, unless a resume repeated one."""
    return [int(e.arg) for e in events(log) if e.name == "epoch-end"]


@dataclass(frozen=True)
class Reference:
    """An uninterrupted run of train.ipynb: its ``RESULT`` line and its log."""

    result: str
    log: Path
