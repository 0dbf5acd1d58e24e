"""What benchmarks/resume.py and benchmarks/recovery.py share: an isolated Jupyter environment,
the 50M-parameter training notebook, the floor kernel, papermill re-runs, time stamps, tables.

Not a benchmark by itself. Every kernel started here runs over IPC sockets in a private
temporary folder and is shut down before the function that started it returns.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CHUNK = 16 << 20
ENV_KEYS = ("JUPYTER_PATH", "IPYTHONDIR", "COLAB_RESILIENCE_HOME", "COLAB_RESILIENCE_RUN_DIR",
            "PYDEVD_DISABLE_FILE_VALIDATION")


def size_arg(text: str) -> int:
    """``50e6``, ``50_000_000``, ``5000000``."""
    return int(float(text.replace("_", "")))


# --------------------------------------------------------------------------------------------
# the environment: a temporary folder for everything, the user's profile and key untouched


def _interpreter_prefix(argv0: str) -> str | None:
    try:
        out = subprocess.run([argv0, "-c", "import sys; print(sys.prefix)"], capture_output=True,
                             text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def kernel_runs_this_python(name: str) -> bool:
    """Does kernelspec ``name`` start this interpreter (``sys.prefix``)? jupyter_client replaces
    ``python``/``python3``/``python3.X`` with ``sys.executable``; other paths are asked."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return False
    argv0 = spec.argv[0] if spec.argv else ""
    if argv0 in {"python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2]}:
        return True
    return _interpreter_prefix(argv0) == sys.prefix


@contextmanager
def workspace(kernel: str, prefix: str):
    """A temporary root with ``home/`` (COLAB_RESILIENCE_HOME: the signing key), ``ipython/``
    (IPYTHONDIR: a fresh profile) and, when ``kernel`` does not run this interpreter, a kernelspec
    of that name pointing at ``sys.executable`` (in ``jupyter/``, put first on JUPYTER_PATH).
    Yields ``(root, kernel_name)``; restores the environment and removes the root afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    try:
        os.environ["COLAB_RESILIENCE_HOME"] = str(root / "home")
        os.environ["IPYTHONDIR"] = str(root / "ipython")
        os.environ["COLAB_RESILIENCE_RUN_DIR"] = str(root / "runs-default")
        os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        if not kernel_runs_this_python(kernel):
            spec_dir = root / "jupyter" / "kernels" / kernel
            spec_dir.mkdir(parents=True)
            (spec_dir / "kernel.json").write_text(json.dumps({
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": f"benchmark ({sys.executable})", "language": "python"}))
            paths = [str(root / "jupyter")] + ([saved["JUPYTER_PATH"]] if saved["JUPYTER_PATH"] else [])
            os.environ["JUPYTER_PATH"] = os.pathsep.join(paths)
            print(f"(kernelspec {kernel!r} does not run {sys.executable}: using a temporary one that does)")
        yield root, kernel
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# time stamps written by the kernels: "name pid time.time()" lines in a log file

MARK = '''import os, time
def _mark(name, _log={log!r}):
    with open(_log, "a") as f:
        f.write(f"{{name}} {{os.getpid()}} {{time.time():.6f}}\\n")
'''


@dataclass
class Mark:
    name: str
    pid: int
    t: float


def read_marks(path: Path) -> list[Mark]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            name, pid, t = line.split()
            out.append(Mark(name, int(pid), float(t)))
    return out


def mark_time(marks: list[Mark], name: str, pid: int | None = None, last: bool = False) -> float | None:
    hits = [m.t for m in marks if m.name == name and (pid is None or m.pid == pid)]
    return (hits[-1] if last else hits[0]) if hits else None


# --------------------------------------------------------------------------------------------
# the workload: a stack of nn.Linear layers + AdamW, trained for `epochs` iterations


@dataclass
class Workload:
    params: int = 50_000_000
    width: int = 1024
    epochs: int = 10
    steps: int = 2  # optimizer steps per epoch
    batch: int = 32
    threads: int = 0  # torch.set_num_threads in the kernel; 0: torch's default

    @property
    def layers(self) -> int:
        return max(1, round(self.params / (self.width * self.width + self.width)))

    @property
    def nparams(self) -> int:
        return self.layers * (self.width * self.width + self.width)


def add_workload_args(ap, *, steps: int, what: str, fault: str = "request") -> None:
    """The workload's size flags, --fault (default ``fault``) and --kernel."""
    ap.add_argument("--params", type=size_arg, default=50_000_000, help=f"{what} parameters (default 50e6)")
    ap.add_argument("--width", type=int, default=1024, help="width of each nn.Linear (default 1024)")
    ap.add_argument("--steps", type=int, default=steps, help=f"optimizer steps per iteration (default {steps})")
    ap.add_argument("--batch", type=int, default=32, help="rows per step (default 32)")
    ap.add_argument("--fault", choices=["request", "kill"], default=fault,
                    help=f"request: %%restart_after, the kernel asks; kill: SIGKILL from inside (default {fault})")
    ap.add_argument("--kernel", default="python3", help="kernelspec name (default python3)")


def workload_from(args, epochs: int) -> Workload:
    return Workload(params=args.params, width=args.width, epochs=epochs, steps=args.steps, batch=args.batch)


def workload_notebook(w: Workload, log: Path, *, fault: str | None = None, every: int = 0,
                      kill_at: tuple[int, ...] = (), workdir: Path | None = None, instrument: bool = False):
    """The training notebook, as a user would write it for colab_resilience.

    cells: ``%%replay`` imports | ``%%replay`` set-up (model + AdamW) | [``%restart_after``] |
    ``%%resilient --save model,opt,history`` loop over ``resume_range(epochs)``.
    ``fault="request"``: ``%restart_after every`` (planned restarts: the kernel asks the driver);
    ``fault="kill"``: SIGKILL from inside at the start of each epoch in ``kill_at`` (once each),
    right after the previous epoch's checkpoint. ``instrument`` adds time stamps at the safe
    point that triggers a planned restart and at the kernel's exit (resume.py's phases).
    """
    import nbformat

    threads = f"torch.set_num_threads({w.threads})\n" if w.threads else ""
    imports = ("%%replay\n" + MARK.format(log=str(log)) + "_mark('replay_start')\n"
               "import torch\n" + threads + "_mark('imports_end')")
    setup = (
        "%%replay\n_mark('setup_start')\n"
        f"torch.manual_seed(0)\nwidth, layers, steps, batch, epochs = {w.width}, {w.layers}, {w.steps}, {w.batch}, {w.epochs}\n"
        "model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])\n"
        "_mark('optimizer_start')\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
        "_mark('setup_end')"
    )
    kill = ""
    if fault == "kill":
        kill = (
            f"    _marker = os.path.join({str(workdir)!r}, f'killed-{{epoch}}')\n"
            f"    if epoch in {tuple(kill_at)!r} and not os.path.exists(_marker):\n"
            "        open(_marker, 'w').close(); _mark('request')\n"
            "        os.kill(os.getpid(), 9)  # SIGKILL, as the OOM killer would\n"
        )
    train = (
        f"%%resilient --save model,opt,history --max-restarts {max(3, len(kill_at) + 1)}\n"
        "_mark('cell_start')\n"
        "history = []\n"
        "for epoch in resume_range(epochs):\n"
        "    _mark(f'iter_start:{epoch}')\n"
        + kill +
        "    for step in range(steps):\n"
        "        loss = model(torch.randn(batch, width)).square().mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    history.append(loss.item())\n"
        "    _mark(f'iter_end:{epoch}')\n"
    )
    cells = [imports, setup]
    if fault == "request":
        restart = f"%restart_after {every}"
        if instrument:  # time stamps only: the restart itself is the package's
            restart += (
                "\nimport colab_resilience.restart as _r\n"
                "_mp, _ex = _r.planned_reason, _r.exit_kernel\n"
                "def _mp2(*a, **k):\n"
                "    _mark('safe_point'); return _mp(*a, **k)\n"
                "def _ex2(code):\n"
                "    _mark('exit'); _ex(code)\n"
                "_r.planned_reason, _r.exit_kernel = _mp2, _ex2"
            )
        cells.append(restart)
    cells += [train, "_mark('done')\nprint('RESULT', len(history), history[-1])"]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    return nb


def plain_notebook(nb):
    """The same notebook as users run it today, without colab_resilience: the ``%load_ext``,
    ``%%replay``, ``%%resilient`` and ``%restart_after`` lines dropped, ``resume_range`` replaced
    by ``range``. (Build it from a notebook without injected faults.)"""
    import nbformat

    out = nbformat.v4.new_notebook()
    out.metadata = dict(nb.metadata)
    for cell in nb.cells:
        if cell.cell_type != "code":
            out.cells.append(cell)
            continue
        drop = ("%load_ext colab_resilience", "%%replay", "%%resilient", "%restart_after")
        source = "\n".join(l.replace("resume_range(", "range(") for l in cell.source.splitlines()
                           if not l.strip().startswith(drop))
        if source.strip():
            new = nbformat.v4.new_code_cell(source)
            new.metadata = dict(cell.get("metadata", {}))
            out.cells.append(new)
    return out


# --------------------------------------------------------------------------------------------
# runs


def supervised(nb, out: Path, kernel: str, run_dir: Path, cwd: Path, **kw):
    """colab_resilience.run_notebook; raises if the run did not finish."""
    from colab_resilience import run_notebook

    result = run_notebook(nb, out, kernel_name=kernel, run_dir=run_dir, cwd=cwd, **kw)
    if result.status != 0:
        raise SystemExit(f"supervised run failed ({result.status}): {result.message} (notebook: {out})")
    return result


def papermill_run(nb, workdir: Path, kernel: str, parameters: dict | None = None) -> float:
    """papermill's default engine (what users run today); wall seconds, kernel start included."""
    import nbformat
    import papermill

    src, dst = workdir / "papermill-in.ipynb", workdir / "papermill-out.ipynb"
    nbformat.write(nb, src)
    t = time.perf_counter()
    papermill.execute_notebook(str(src), str(dst), parameters=parameters or {}, kernel_name=kernel,
                               progress_bar=False, cwd=str(workdir))
    return time.perf_counter() - t


def checkpoint_files(run_dir: Path) -> list[Path]:
    """The blob files the newest checkpoint (of the most recently updated run) names."""
    best, best_t = None, -1.0
    for latest in run_dir.glob("run-*/checkpoints/LATEST"):
        if latest.stat().st_mtime > best_t:
            best, best_t = latest.parent, latest.stat().st_mtime
    if best is None:
        raise SystemExit(f"no checkpoint under {run_dir}")
    cid = (best / "LATEST").read_text().strip()
    body = json.loads((best / cid / "manifest.json").read_text())["body"]
    files = [best / "blobs" / e["hash"] for e in body["entries"] + [body["rng"]]]
    return files + [best / cid / "manifest.json"]


FLOOR_CODE = '''import os, time
_t0 = time.time()
import torch
_t1 = time.time()
_bufs = []
for _p in {files!r}:
    _size = os.path.getsize(_p)
    _buf = bytearray(_size); _view = memoryview(_buf)
    with open(_p, "rb", buffering=0) as _f:
        _pos = 0
        while _pos < _size:
            _pos += _f.readinto(_view[_pos:_pos + {chunk}])
    _bufs.append(_buf)
_t2 = time.time()
print("FLOOR", _t0, _t1, _t2, sum(len(b) for b in _bufs))
'''


@dataclass
class Floor:
    kernel_start: float  # start_kernel() called -> first line of the first cell runs
    imports: float  # import torch
    read: float  # raw read of the checkpoint's files into memory
    nbytes: int

    @property
    def total(self) -> float:
        return self.kernel_start + self.imports + self.read


def floor(kernel: str, files: list[Path]) -> Floor:
    """A fresh kernel (jupyter_client, IPC sockets, like the driver's) + ``import torch`` + a raw
    read (readinto, 16 MiB chunks, no verification) of ``files``, timed with the wall clock the
    kernel shares with us."""
    from jupyter_client import KernelManager

    sockets = tempfile.mkdtemp(prefix="cr-bench-floor-")
    km = KernelManager(kernel_name=kernel, transport="ipc", ip=os.path.join(sockets, "kernel"))
    kc = None
    try:
        t0 = time.time()
        km.start_kernel(env=dict(os.environ), cwd=sockets)
        kc = km.blocking_client()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        lines = []
        reply = kc.execute_interactive(FLOOR_CODE.format(files=[str(f) for f in files], chunk=CHUNK), timeout=600,
                                       output_hook=lambda m: lines.append(m["content"].get("text", "")))
        if reply["content"]["status"] != "ok":
            raise SystemExit(f"floor kernel failed: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
        fields = "".join(lines).split("FLOOR", 1)[1].split()
        a, b, c, n = float(fields[0]), float(fields[1]), float(fields[2]), int(fields[3])
        return Floor(a - t0, b - a, c - b, n)
    finally:
        if kc is not None:
            kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        shutil.rmtree(sockets, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# output


def table(rows: list[tuple], header: tuple) -> None:
    """Left-aligned first column, right-aligned others; ``None`` prints as ``-``; a row ``()``
    prints a rule."""
    cells = [[("-" if c is None else str(c)) for c in r] for r in rows if r]
    widths = [max(len(str(header[i])), *(len(r[i]) for r in cells)) for i in range(len(header))]

    def fmt(r):
        return "  ".join(f"{c:<{widths[0]}}" if i == 0 else f"{c:>{widths[i]}}" for i, c in enumerate(r))

    line = fmt([str(h) for h in header])
    print(line)
    print("-" * len(line))
    for r in rows:
        print(fmt([("-" if c is None else str(c)) for c in r]) if r else "-" * len(line))


def secs(x: float | None) -> str | None:
    return None if x is None else f"{x:.2f}"


def ratio(x: float | None, y: float | None) -> str | None:
    return None if x is None or not y else f"{x / y:.2f}"


def target(label: str, ok: bool, detail: str) -> None:
    print(f"  [{'met' if ok else 'NOT met'}] {label}: {detail}")
