"""Supervised execution: run a notebook headless and bring its kernel back whenever it dies.

:func:`run_notebook` executes the cells one by one through a :class:`~colab_resilience.client.SupervisedClient`,
in a kernel started by jupyter_client over IPC sockets in a private folder, with the extension
loaded into it and ``COLAB_RESILIENCE_SUPERVISED=1`` in its environment. When the kernel dies
(the OOM killer, a SIGKILL, or the kernel leaving on its own request after an OOM beyond its
retries, exit code :data:`colab_resilience.restart.EXIT_RESTART`), the :class:`Supervisor`

1. puts the standby kernel in the dead one's place (:class:`colab_resilience.standby_driver.Standby`),
   or, with none alive, restarts the kernel through jupyter_client (a plain manager, never an
   auto-restarting one, whose silent restarts would leave nbclient waiting until its timeout);
2. replays the set-up cells executed so far (``%%replay`` cells and cells tagged ``replay``), in
   order, their outputs discarded;
3. re-executes the interrupted cell, which resumes its run from the last safe point;
4. puts a visible marker in that cell's outputs (why, where, how long the recovery took) and the
   restart log in ``metadata.colab_resilience``.

Every kernel it starts for a run folder gets the same ``PYTHONHASHSEED`` (:func:`hash_seed`,
unless the environment sets one): strings hash alike in the kernel that replaces one, so a set
of them iterates in the same order when the set-up cells are replayed (``chars =
list(set(text))`` makes the same vocabulary), as it did in the kernel that began the run.

Restarts are bounded twice: by each run's budget on disk (``--max-restarts`` of the cell, which
the kernel enforces) and by the driver's own ``max_restarts`` for the whole notebook (a kernel
that dies before a run can count anything, at start-up or during a replay, cannot loop forever).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import journal
from .deaths import Budgets, Restart
from .errors import NotebookInputError
from .kernels import TIMED_OUT, CellFailed, KernelDied, api_call, echo_line, kernel_pid
from .standby_driver import Standby
from .replay import MAGIC, is_replay_cell
from .restart import SUPERVISED_ENV, mark_shut_down
from .session import NOTEBOOK_ENV, RUN_DIR_ENV
from .tempdirs import TempFolder
from .words import did_you_mean

# exit codes of `colab-resilience run` (and the `status` of a RunResult)
EXIT_OK, EXIT_CELL_FAILED, EXIT_USAGE, EXIT_BUDGET = 0, 1, 2, 3
STATUS_NAMES = {EXIT_OK: "done", EXIT_CELL_FAILED: "failed", EXIT_BUDGET: "restart budget spent"}

# Run in the kernel at start-up. Unlike --ext, a later `%load_ext colab_resilience` in the
# notebook (written for Colab, where it is needed) then stays silent.
LOAD_EXTENSION = "import colab_resilience as _cr; _cr.load_ipython_extension(get_ipython()); del _cr"

CellHook = Callable[[int, Any], None]


@dataclass
class RunResult:
    status: int  # EXIT_OK, EXIT_CELL_FAILED or EXIT_BUDGET
    notebook: Any
    restarts: list[Restart]
    failed_cell: int | None = None
    message: str = ""
    seconds: float = 0.0
    written: Path | None = None  # where the executed notebook was written (not the output asked for, if that failed)
    cleared: frozenset[int] = frozenset()  # the cells (by index) that cleared their output as they ran
    timed_out: bool = False  # the failed cell ran longer than the cell timeout
    pending: bool = False  # a run was left pending, its checkpoints in the run folder (gone with it unless given)


def resolve_parameter(value: str) -> Any:
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


def unknown_parameters(nb, parameters: dict[str, Any]) -> str | None:
    """papermill's two warnings, in one line: the notebook has no cell tagged ``parameters`` (the
    values go in a cell put first, which a later cell may set again), or some of ``parameters``
    are not set in it (a typo, likely: they are set anyway, as new names)."""
    import ast

    if not parameters:
        return None
    names = ", ".join(parameters)
    cell = next((c for c in nb.cells if c.get("cell_type") == "code"
                 and "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        one = len(parameters) == 1
        return (f"-p {names}: the notebook has no cell tagged 'parameters', so {'it is' if one else 'they are'} set in "
                f"a cell put first, and a cell that sets {'it' if one else 'one'} again wins; tag the cell that sets "
                f"{'it' if one else 'them'} 'parameters'")
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:  # a magic in it: nothing can be said of what it sets
        return None
    known = [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
             for t in ast.walk(target) if isinstance(t, ast.Name)]
    unknown = [n for n in parameters if n not in known]
    if not unknown:
        return None
    close = [n + did_you_mean(n, known, quoted=False) for n in unknown]
    return (f"-p {', '.join(close)}: the parameters cell does not set {'it' if len(unknown) == 1 else 'them'} "
            f"(it sets {', '.join(known) or 'nothing'}); set anyway, as {'a new name' if len(unknown) == 1 else 'new names'}")


def read_notebook(notebook) -> tuple[Any, Path | None]:
    import nbformat

    if not isinstance(notebook, (str, os.PathLike)):
        return notebook, None
    path = Path(notebook)
    if path.is_dir():  # `colab-resilience check .`, or a notebook's folder given for it
        found = sorted(p.name for p in path.glob("*.ipynb") if p.is_file())
        held = (f"it holds {', '.join(found[:4])}{', ...' if len(found) > 4 else ''}" if found
                else "it holds no .ipynb file")
        raise NotebookInputError(f"{path} is a folder ({held}); give the path of a notebook")
    if not path.is_file():
        named = path.with_name(path.name + ".ipynb")  # `colab-resilience run train`
        hint = f" (did you mean {named}?)" if path.suffix != ".ipynb" and named.is_file() else ""
        raise NotebookInputError(f"{path}: no such notebook{hint}; give the path of an .ipynb file")
    try:
        return nbformat.read(path, as_version=4), path.parent.resolve()
    except Exception as e:  # invalid JSON, not a notebook
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NotebookInputError(f"{path}: not a readable notebook ({first[:120]})") from None


def check_output(output: str | os.PathLike) -> None:
    """Refuse, before anything runs, an output path the executed notebook could not be written to
    (a folder, a folder that does not exist or that this user cannot write): found only at the
    end, the run's outputs were lost after it had trained."""
    path = Path(output)
    if path.is_dir():
        raise NotebookInputError(f"{path} is a folder; give the path of the .ipynb file to write the executed "
                                 "notebook to")
    folder = path.parent
    if not folder.is_dir():
        raise NotebookInputError(f"cannot write the executed notebook to {path}: there is no folder {folder}; "
                                 "make it first, or give another output path")
    # tried, not asked (os.access): root may "write" anywhere by permission bits, not to /sys, nor to
    # a read-only or FUSE mount; the file that is there is opened, not written; a new one is removed
    exists = path.exists()
    try:
        if exists:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK, 0o644))
            os.unlink(path)
    except OSError as e:
        where = path if exists else f"its folder {folder}"
        raise NotebookInputError(f"cannot write the executed notebook to {path}: {where} is not writable by you "
                                 f"({e.strerror or e}); give another output path") from None


def keep_folder(keep: str | os.PathLike, what: str) -> Path:
    """The folder ``--keep`` names for a check's or the demo's files (``what``: "check"), made if
    new. One that holds anything is refused: an earlier run's files there (its fault marks, its
    pending runs, its timeline) were taken for this one's, and a check reported faults that never
    fired as identical."""
    path = Path(keep)
    if path.exists() and not path.is_dir():
        raise NotebookInputError(f"--keep {path} is a file; give a new or empty folder for the {what}'s files")
    if path.is_dir():
        held = sorted(p.name for p in path.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (", …" if len(held) > 3 else "")
            raise NotebookInputError(f"--keep {path} is not empty ({shown}): files there, an earlier {what}'s say, would "
                                     f"be taken for this {what}'s; give a new or empty folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NotebookInputError(f"--keep {path}: cannot make the folder ({e.strerror or e}); give another") from None
    return path.absolute()  # the notebook's kernels run in its folder, not this command's


def write_output(nb, output: Path, result: RunResult) -> Path | None:
    """Write the executed notebook to ``output``; where that fails (the folder went away while the
    run ran, the disk is full), to a file of its own in the temporary directory, and
    ``result.message`` says where and why. Returns where it was written (None: nowhere)."""
    import nbformat

    try:
        nbformat.write(nb, output)
        return output
    except OSError as e:
        why = f"{e.strerror or e}"
    import tempfile

    try:  # a new file of ours (O_EXCL, mode 0600), never one that was there
        fd, spare = tempfile.mkstemp(prefix=f"colab-resilience-{output.stem}-", suffix=".ipynb")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            nbformat.write(nb, f)
        where: Path | None = Path(spare)
        said = f"it is in {spare}"
    except OSError as e:
        where, said = None, f"nor to the temporary directory ({e.strerror or e}): its outputs are lost"
    line = f"colab-resilience: could not write the executed notebook to {output} ({why}); {said}"
    result.message = f"{result.message}\n{line}" if result.message else line
    return where


HASH_SEED = "PYTHONHASHSEED"


def hash_seed(run_root: str | os.PathLike) -> str:
    """The ``PYTHONHASHSEED`` of the kernels started for the runs in ``run_root``: the same for
    every kernel of that folder, in this process and in a driver started again on it later (a
    nonzero number: hashing stays randomised, only not from kernel to kernel)."""
    return str(zlib.crc32(os.fsencode(os.path.abspath(run_root))) or 1)


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
    say: bool = False,
    on_cell_start: CellHook | None = None,
    on_cell_complete: CellHook | None = None,
    on_cell_error: CellHook | None = None,
    env: dict[str, str] | None = None,
    standby: bool = True,
    standbys: int | None = None,
    run_dir_named: str = "run_dir=",
) -> RunResult:
    """Execute ``notebook`` (a path or a NotebookNode) under supervision; see the module doc.

    ``log_output``: echo what the cells print as they print it, and each recovery as it happens;
    ``say``: without it, echo the lines this package says in the cells (a resume, what it could
    not make exact) and each recovery as they come, to stderr (``colab-resilience run``).
    ``standby``: keep a second kernel started and warmed with the working kernel's imports, to
    take over when it dies; False restarts a kernel instead. ``standbys``: start at most that many
    in all (``colab-resilience check`` starts one for a run with its one fault; None: a new one
    after each that took over). ``on_cell_start(index, cell)`` is called once before a code cell
    first runs, ``on_cell_complete`` once after it finished (its kernel restarts included), and
    ``on_cell_error`` then too when it failed. ``run_dir_named``: how the caller's user gives a run
    directory (``--run-dir`` to the command), in the lines that advise a run's magic where none was
    given: the run went with a temporary folder.

    Returns a :class:`RunResult`; raises :class:`NotebookInputError` for unusable input. The
    executed notebook is written to ``output`` when given (also after a failure).
    """
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import NoSuchKernel

    from .client import SupervisedClient  # nbclient's: not imported where the relay imports the Supervisor

    started = time.perf_counter()
    nb, folder = read_notebook(notebook)
    if output is not None:
        check_output(output)
    cwd = str(cwd or folder or os.getcwd())
    inject_parameters(nb, parameters or {})
    kernel_name = kernel_name or nb.metadata.get("kernelspec", {}).get("name") or "python3"
    if run_dir is not None:  # refused now, not by the first %%resilient cell, after the cells above it ran
        from . import fsutil
        from .errors import UnsafeDirectoryError

        try:
            fsutil.check_run_root(run_dir, another=f"give another {run_dir_named.rstrip('=')}")
        except UnsafeDirectoryError as e:
            raise NotebookInputError(str(e).removeprefix("colab_resilience: ")) from None
        except OSError as e:
            raise NotebookInputError(f"{run_dir_named.rstrip('=')} {run_dir}: cannot make the folder ({e.strerror or e}); "
                                     "give another") from None
    own_run_dir = TempFolder("runs") if run_dir is None else None
    run_root = Path(own_run_dir.path if own_run_dir else run_dir).absolute()
    sockets_folder = TempFolder("kernel")  # 0700: the kernel is ours alone
    sockets = sockets_folder.path
    # the run folder is the command's: a notebook whose cell ran the command (!colab-resilience
    # run ...) is not the notebook of its runs, whose ids must not depend on where it is started from
    inherited = {k: v for k, v in os.environ.items() if k != NOTEBOOK_ENV}
    kernel_env = {HASH_SEED: hash_seed(run_root), **inherited, **(env or {}), SUPERVISED_ENV: "1",
                  RUN_DIR_ENV: str(run_root)}
    # An async manager: with a blocking one, nbclient's wait for output blocks its event loop and
    # it never notices that the kernel died.
    # Its connection file (with the key that signs its messages) beside its sockets: a bare
    # manager writes it to the temporary directory itself, where a killed run leaves it.
    ip = os.path.join(sockets, "kernel")
    km = AsyncKernelManager(kernel_name=kernel_name, transport="ipc", ip=ip, connection_file=ip + ".json")
    client = SupervisedClient(
        nb, km=km, kernel_name=kernel_name, timeout=cell_timeout, resources={"metadata": {"path": cwd}},
        extra_arguments=[f"--IPKernelApp.exec_lines={LOAD_EXTENSION}"],
    )
    client.said_run_dir = None if own_run_dir else str(run_dir)  # as the command's user wrote it
    client.said_without = run_dir_named
    supervisor = Supervisor(
        client, run_root, max_restarts, spare=Standby(client, sockets, kernel_env, cwd, standbys) if standby else None,
        on_cell_start=on_cell_start, on_cell_complete=on_cell_complete, on_cell_error=on_cell_error,
        log_output=log_output, say=say, progress=progress,
    )
    stopped: BaseException | None = None  # what ended the run from outside it (Ctrl-C), if anything
    try:
        supervisor.run(kernel_env)
    except NoSuchKernel:
        output = None  # nothing ran: no output notebook that would look like a result
        raise NotebookInputError(
            f"no kernel named {kernel_name!r}; list them with `jupyter kernelspec list` or pass --kernel NAME"
        ) from None
    except NotebookInputError:
        output = None
        raise
    except BaseException as e:
        stopped = e
        raise
    finally:
        supervisor.close()
        sockets_folder.remove()
        result = supervisor.result
        result.seconds = time.perf_counter() - started
        result.cleared = frozenset(client.cleared)
        if stopped is not None:  # not "done": the notebook did not run to its end
            result.failed_cell = supervisor.cell
        nb.metadata["colab_resilience"] = {
            "status": STATUS_NAMES[result.status] if stopped is None else (
                "interrupted" if isinstance(stopped, KeyboardInterrupt) else f"stopped by {type(stopped).__name__}"),
            "restarts": [r.to_metadata() for r in result.restarts],
            "seconds": round(result.seconds, 3),
        }
        if output is not None:
            result.written = write_output(nb, Path(output), result)
        result.pending = bool(journal.pending_runs(run_root))
        if own_run_dir:
            own_run_dir.remove()
    return result


class Supervisor:
    """Runs a notebook's code cells through ``client`` and recovers from kernel deaths."""

    def __init__(self, client, run_root: Path, max_restarts: int, *, spare=None,
                 on_cell_start: CellHook | None = None, on_cell_complete: CellHook | None = None,
                 on_cell_error: CellHook | None = None, log_output: bool = False, say: bool = False,
                 progress: bool = False):
        self.client, self.nb, self.run_root, self.max_restarts, self.spare = client, client.nb, run_root, max_restarts, spare
        self.on_cell_start, self.on_cell_complete, self.on_cell_error = on_cell_start, on_cell_complete, on_cell_error
        self.log_output, self.progress = log_output, progress
        # the package's lines and each recovery echoed as they come, where the output is not
        self.say = say and not log_output
        if self.say:
            client.says = True
        self.result = RunResult(EXIT_OK, self.nb, [])
        self.cell: int | None = None  # the code cell running (or recovering), by its index
        self.replay_done: list[int] = []  # set-up cells executed so far, in order
        self.budgets = Budgets(run_root, max_restarts)
        self.code_cells = [i for i, c in enumerate(self.nb.cells) if c.cell_type == "code"]
        # the kernels whose finished runs are put back after a restart, by journal.kernel_identity:
        # a run directory given again (--run-dir) holds the runs of an earlier `run` too, and one
        # shared with notebooks (isolation) theirs
        self.kernels: list[str] = client.identities

    def run(self, kernel_env: dict) -> None:
        client = self.client
        client.start_new_kernel(env=kernel_env)
        if not client.connect():  # the first kernel died while starting: a death like any other
            recovered = self.recover(self.code_cells[0] if self.code_cells else 0, starting=True)
            self.echo_restarts(0)
            if not recovered:
                return
        if client.unusable:  # before any cell: each would fail, %load_ext's or "Cell magic not found"
            python = (getattr(client.km.kernel_spec, "argv", None) or ["its Python"])[0]
            raise NotebookInputError(
                f"the kernel {client.kernel_name!r} ({python}) cannot run colab_resilience ({client.unusable}); "
                f"install this version of it into that Python, or give --kernel a kernel that runs {sys.executable} "
                f"({sys.executable} -m ipykernel install --user --name NAME makes one)")
        if self.spare is not None:
            self.spare.spawn()
        with client.setup_kernel(env=kernel_env):  # started above: this only cleans up
            bar = None
            if self.progress:  # once a kernel is up: no empty bar before a start-up error
                from tqdm.auto import tqdm

                bar = tqdm(total=len(self.code_cells), unit="cell", desc="colab-resilience")
            try:
                for index in self.code_cells:
                    if not self.execute(index):
                        return
                    if bar is not None:
                        bar.update(1)
            finally:
                if bar is not None:
                    bar.close()

    def execute(self, index: int) -> bool:
        """Run cell ``index`` until it succeeds, restarting the kernel each time it dies; False
        when the run stops there (the cell failed, or the budget is spent)."""
        cell = self.nb.cells[index]
        self.cell = index
        earlier: list = []  # outputs of the attempts the kernel died in: every output is kept
        died = False
        if self.on_cell_start is not None:
            self.on_cell_start(index, cell)
        self.client.echo = index if self.log_output else None  # its output, as it comes (the replays' not)
        while True:
            try:
                self.client.execute_cell(cell, index)
                if is_replay_cell(cell):
                    self.declare_replay(cell)
                break
            except KernelDied:
                died = True
                earlier += cell.get("outputs", [])
                restarts = len(self.result.restarts)
                recovered = self.recover(index)
                self.echo_restarts(restarts)
                if not recovered:
                    cell.outputs = earlier + self.markers(index)
                    self.finished(index, cell, failed=True)
                    return False
            except CellFailed as e:
                if died and not self.budgets.went_on():  # said in the marker, which said "resumed" before
                    # the last restart's (one before it went on, and died again)
                    next(r for r in reversed(self.result.restarts) if r.cell == index).went_on = False
                cell.outputs = earlier + self.markers(index) + cell.get("outputs", [])
                self.fail(index, cell, e)
                self.finished(index, cell, failed=True)
                return False
        if died:
            cell.outputs = earlier + self.markers(index) + cell.get("outputs", [])
        self.budgets.recovering = None
        if is_replay_cell(cell):
            self.replay_done.append(index)
        if self.spare is not None:
            self.spare.follow()
        self.finished(index, cell)
        return True

    def finished(self, index: int, cell, *, failed: bool = False) -> None:
        if self.on_cell_complete is not None:
            self.on_cell_complete(index, cell)
        if failed and self.on_cell_error is not None:
            self.on_cell_error(index, cell)
        if self.log_output:
            self.client.end_echo()
            self.client.echo = None

    def echo_restarts(self, since: int) -> None:
        """Where the command echoes (``log_output``, ``say``): each restart after the first ``since``,
        as it happens (the notebook's marker says it when the cell ends)."""
        if not (self.log_output or self.say):
            return
        self.client.end_echo()
        for r in self.result.restarts[since:]:
            for line in r.marker(live=True).splitlines():
                echo_line(f"[cell {r.cell}] {line}", stderr=True)

    def markers(self, index: int) -> list:
        import nbformat

        return [nbformat.v4.new_output("stream", name="stderr", text=r.marker())
                for r in self.result.restarts if r.cell == index]

    def fail(self, index: int, cell, error: Exception) -> None:
        result = self.result
        result.status = EXIT_BUDGET if journal.budget_refused(self.run_root) else EXIT_CELL_FAILED
        result.failed_cell = index
        result.timed_out = getattr(error, "ename", None) == TIMED_OUT
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        if errors:
            what = f"{errors[-1].get('ename')}: {errors[-1].get('evalue', '').strip()}"
        else:  # a UsageError is printed to stderr, not sent as an error output
            streams = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
            lines = [line for line in streams.splitlines() if line.strip()] or [
                line for line in str(error).splitlines() if line.strip() and not set(line) <= {"-"}]
            what = lines[-1] if lines else type(error).__name__
        # this package's own stop in one line (a refusal; IPython shows it as a UsageError): its line
        verb = "failed"
        if what.startswith("UsageError: colab_resilience: "):
            verb, what = "stopped", what.removeprefix("UsageError: ")
        result.message = f"colab-resilience: cell {index} {verb}: {what}"

    def recover(self, index: int, *, starting: bool = False) -> bool:
        """After a death: count it against its budget, bring in the standby or restart the
        kernel, replay. False when the budget is spent (the result says so); the caller
        re-executes otherwise."""
        t0 = time.perf_counter()
        client = self.client
        death = self.budgets.death(client, starting=starting)
        dead_pid = death.pid  # the kernel whose finished runs may have left nothing to put back
        while True:
            refusal = self.budgets.charge(index, death, self.result.restarts)
            if refusal is not None:
                self.result.status, self.result.failed_cell, self.result.message = EXIT_BUDGET, index, refusal
                return False
            adopted = self.spare.take() if self.spare is not None else None
            if client.replace_kernel(adopted):
                break
            self.result.restarts.append(death.restart(index, time.perf_counter() - t0, recovered=False,
                                                      standby=adopted is not None, then="the new kernel died while starting"))
            death, t0 = self.budgets.death(client, starting=True), time.perf_counter()
        self.budgets.kernel_started()
        replayed = 0
        self.budgets.replaying = True
        try:
            if adopted is not None:
                client.call(api_call("adopt_standby", os.getpriority(os.PRIO_PROCESS, 0)))
            for j in self.replay_done:
                try:
                    client.execute_cell(copy.deepcopy(self.nb.cells[j]), j)  # outputs discarded
                except CellFailed as e:  # it ran once and not again: nothing to go on from
                    why = _error_words(e.ename, e.evalue)
                    return self.not_recovered(
                        index, death.restart(index, time.perf_counter() - t0, replayed=replayed, recovered=False,
                                             standby=adopted is not None,
                                             then=f"replaying set-up cell {j} failed ({why})"),
                        f"replaying set-up cell {j} failed ({why}); a set-up cell must run again as it ran the first "
                        "time (not read a file it then deletes, say): make it so, and run the notebook again")
                replayed += 1
                self.declare_replay(self.nb.cells[j])
            finished = client.evaluate(api_call("restore_finished_runs", dead_pid, self.nb.cells[index].source,
                                                self.kernels), timeout=600)
            restored = _strings(finished, "restored")
            for run_id, holds in _pairs(finished, "rerun"):  # a framework's state: its cell runs again
                reply = client.call(api_call("rerun_finished", run_id), timeout=600)["content"]
                if reply.get("status") != "ok":
                    why = _error_words(reply.get("ename"), reply.get("evalue"))
                    # a name its cell reads that a plain cell made (an import in the first cell): the
                    # cell's first run said so
                    todo = ("its cell, run again to put it back, reads a name no set-up cell makes: import or define "
                            "it in a %%replay cell" if reply.get("ename") == "NameError" else
                            "make them build what the training had")
                    return self.not_recovered(
                        index, death.restart(index, time.perf_counter() - t0, replayed=replayed, recovered=False,
                                             standby=adopted is not None,
                                             then=f"putting back the finished run {run_id} failed ({why})"),
                        f"the finished run {run_id} could not put back {holds} ({why}), and the cells after its "
                        f"training would see what the set-up cells rebuilt, untrained; {todo}, and run the notebook "
                        "again")
                restored.append(holds)
            client.call(api_call("expect_reexecution"))
        except KernelDied:  # the caller's next execution finds the kernel dead and restarts again
            self.result.restarts.append(death.restart(index, time.perf_counter() - t0, replayed=replayed,
                                                      recovered=False, standby=adopted is not None,
                                                      then="died while replaying"))
            return True
        self.budgets.replaying = False
        if self.spare is not None:  # the next one, warming while the interrupted cell resumes
            self.spare.spawn()
        self.result.restarts.append(death.restart(
            index, time.perf_counter() - t0, replayed=replayed, standby=adopted is not None,
            restored=restored, unsaved=_strings(finished, "unsaved"), not_back=_strings(finished, "not_back"),
            cold=self.spare.off if self.spare is not None else None))
        return True

    def not_recovered(self, index: int, restart: Restart, why: str) -> bool:
        """The kernel that took the dead one's place cannot go on where it was: the run stops at
        cell ``index``, failed, and says ``why``. False, for :meth:`recover` to return."""
        self.result.restarts.append(restart)
        self.result.status, self.result.failed_cell = EXIT_CELL_FAILED, index
        self.result.message = f"colab-resilience: cell {index} not run again: after the kernel died, {why}"
        return False

    def declare_replay(self, cell) -> None:
        """Tell the kernel that a tagged cell is a set-up cell (a ``%%replay`` cell records itself)."""
        source = cell.get("source", "")
        if not source.lstrip().startswith(MAGIC):
            self.client.call(api_call("declare_replay_cell", source))

    def close(self) -> None:
        pid = kernel_pid(self.client.km)
        if self.spare is not None:
            self.spare.shutdown()
        self.client.shutdown()
        if pid is not None:
            # ended with a kill, which runs no exit handler: the runs it held pending (its resume
            # refused, Ctrl-C) are marked as shut down, else the same command again counted a death
            mark_shut_down(journal.find_runs(self.run_root), pid)


def _error_words(ename, evalue) -> str:
    """``Name: value`` of an error, on one line."""
    return " ".join(f"{ename}: {evalue or ''}".split()).removesuffix(":")


def _strings(answer: Any, key: str) -> list[str]:
    """``answer[key]`` as a list of strings, from what a kernel evaluated (anything else: empty)."""
    got = answer.get(key) if isinstance(answer, dict) else None
    return [x for x in got if isinstance(x, str)] if isinstance(got, (list, tuple)) else []


def _pairs(answer: Any, key: str) -> list[tuple[str, str]]:
    """``answer[key]`` as a list of pairs of strings (anything else left out)."""
    got = answer.get(key) if isinstance(answer, dict) else None
    return [(x[0], x[1]) for x in got if isinstance(x, (list, tuple)) and len(x) == 2
            and all(isinstance(v, str) for v in x)] if isinstance(got, (list, tuple)) else []
