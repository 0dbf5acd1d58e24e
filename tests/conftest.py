"""Shared fixtures: an isolated Jupyter/IPython environment, real kernels, an in-process shell, and
the one reference run of tests/files/train.ipynb."""

from __future__ import annotations

import sys
from pathlib import Path

import IPython
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import harness  # noqa: E402


# The Jupyter stack this suite runs on: "colab" (IPython 7, the stack Google Colab ships) or
# "newest". CI runs the suite on both (README: Tests).
STACK = "colab" if IPython.version_info[0] < 8 else "newest"
STACKS = ("newest", "colab")


def pytest_addoption(parser):
    parser.addoption("--every-stack", action="store_true",
                     help="also run the tests marked one_stack(...) for the other Jupyter stack")


def pytest_collection_modifyitems(config, items):
    """A test marked ``one_stack("colab")`` or ``one_stack("newest")`` proves what no Jupyter stack
    changes (which values a checkpoint holds and puts back, what `check` concludes about a
    notebook): the package's own code, the same on both stacks, carried there by kernels and a
    driver that the other tests prove on each stack. It runs on the stack it names only (CI runs
    the suite on both, each under 15 minutes on 2 CPUs); ``--every-stack`` runs it here too."""
    kept, elsewhere = [], []
    for item in items:
        marker = item.get_closest_marker("one_stack")
        if marker is not None and (len(marker.args) != 1 or marker.args[0] not in STACKS):
            args = ", ".join(map(repr, marker.args))
            raise pytest.UsageError(f"{item.nodeid}: one_stack({args}): give it one of {STACKS}")
        here = marker is None or marker.args[0] == STACK or config.getoption("--every-stack")
        (kept if here else elsewhere).append(item)
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = kept


def pytest_report_header(config):
    other = next(s for s in STACKS if s != STACK)
    also = "run here too (--every-stack)" if config.getoption("--every-stack") else \
        "left to that stack's run (--every-stack runs them here)"
    return (f"Jupyter stack: {STACK} (IPython {IPython.__version__}); the tests marked one_stack({other!r}) "
            f"are {also}")


def pytest_configure(config):
    """This package's modules compiled once, before any kernel starts: every kernel the suite
    starts (hundreds) imports most of them, and where PYTHONDONTWRITEBYTECODE is set (it is on the
    machines this suite was measured on) each compiled them from source again, about 0.5 s of CPU
    a kernel."""
    import compileall

    import colab_resilience

    compileall.compile_dir(Path(colab_resilience.__file__).parent, quiet=1)


@pytest.fixture(scope="session", autouse=True)
def isolated_jupyter(tmp_path_factory):
    """Kernels started by the tests run this interpreter, with a fresh IPython profile."""
    with harness.isolated_jupyter(tmp_path_factory.mktemp("jupyter")) as root:
        yield root


@pytest.fixture(scope="session")
def reference(tmp_path_factory, isolated_jupyter) -> harness.Reference:
    """tests/files/train.ipynb with its default parameters, run supervised and uninterrupted once in
    the session (by one worker for all: :func:`harness.once`): the RESULT line every interrupted run
    of it must end with, bit for bit. (tests/test_golden.py proves an interactive run and a run in
    this process end with it too.)"""
    def uninterrupted(work):
        nb = harness.load("train.ipynb", work)
        run = harness.run(nb, work, standby=False)
        assert run.status == 0, run.message
        assert harness.epochs(work / "events.log") == [0, 1, 2, 3]
        return [harness.result(nb), str(work / "events.log")]

    result, log = harness.once(tmp_path_factory.getbasetemp(), "reference", uninterrupted)
    return harness.Reference(result, Path(log))


@pytest.fixture
def relay(tmp_path, monkeypatch):
    """A notebook kernel with ``%resilience isolate`` on (tests/test_isolation.py), working in ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    k = harness.Kernel()
    try:
        k.ok("%load_ext colab_resilience")
        r = k.ok("%resilience isolate")
        assert "isolation on: cells run in worker kernel PID" in r.stdout
        yield k
    finally:
        k.shutdown()


@pytest.fixture
def kernel():
    """A real kernel, started by jupyter_client, with a blocking client."""
    k = harness.Kernel()
    try:
        yield k
    finally:
        k.shutdown()


@pytest.fixture
def ip():
    """An in-process IPython shell with the extension loaded (for parsing and messages)."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "colab_resilience")
    threads = torch_threads()
    yield shell
    torch_threads(threads)  # train.ipynb, run in this process, sets 1 thread
    shell.run_line_magic("unload_ext", "colab_resilience")
    # `%config ResilienceMagics.x = ...` lands in the shared shell's config, and a later load of
    # the extension would read it: every test starts from the defaults.
    shell.config.pop("ResilienceMagics", None)
    for name in [n for n in shell.user_ns if not n.startswith("_") and n not in shell.user_ns_hidden]:
        shell.user_ns.pop(name, None)


def torch_threads(n: int | None = None) -> int | None:
    """torch's intra-op threads in this process (None: torch not imported); set them to ``n``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
