"""The golden notebooks under tests/files: valid, self-describing, and one reference for every way
of running train.ipynb (supervised, interactively in a kernel, in this process's shell), which is
what lets every other test compare its interrupted runs with the one `reference` fixture."""

from __future__ import annotations

import re

import nbformat
import pytest

import harness

GOLDEN = sorted(harness.FILES.glob("*.ipynb"))
# the notebooks whose every parameter the markdown must describe: all of them
DOCUMENTED = [p.name for p in GOLDEN if any("parameters" in c.get("metadata", {}).get("tags", [])
                                             for c in nbformat.read(p, as_version=4).cells)]


@pytest.mark.parametrize("path", GOLDEN, ids=[p.name for p in GOLDEN])
def test_a_golden_notebook_is_valid_and_says_what_it_is(path):
    """Valid nbformat 4 for the test kernel, never executed, every cell named (tests find cells by
    id), a markdown cell first that names the notebook, at most one `parameters` cell."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == harness.KERNEL_NAME
    ids = [c.get("id") for c in nb.cells]
    assert len(set(ids)) == len(ids) and all(ids)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith(f"# `{path.name}`")
    assert len([c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]) <= 1
    assert all(c.get("outputs", []) == [] for c in nb.cells if c.cell_type == "code")  # never executed


@pytest.mark.parametrize("name", DOCUMENTED)
def test_a_golden_notebook_documents_each_parameter(name):
    """The first cell says what each name of the `parameters` cell does: the notebook reads as
    its own specification."""
    nb = nbformat.read(harness.FILES / name, as_version=4)
    [params] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    names = re.findall(r"^(\w+) = ", params.source, re.M)
    assert names
    for parameter in names:
        assert f"`{parameter}`" in nb.cells[0].source, f"parameter {parameter} is not described"


def test_the_notebooks_real_host_oom_is_the_harness_one():
    """The "oom" fault and death are tests/harness.py's HOST_OOM statement, word for word."""
    for name, cell in [("train.ipynb", "setup"), ("budget.ipynb", "setup")]:
        nb = harness.load(name)
        assert harness.HOST_OOM in nb.cells[harness.index(nb, cell)].source, name


@pytest.mark.kernel
def test_an_uninterrupted_interactive_run_is_the_reference(tmp_path, reference):
    """train.ipynb run cell by cell in one kernel, as a user runs it in Jupyter, ends with the
    supervised reference's RESULT line, bit for bit, each epoch run once (the cells as they are:
    IPython expands the training cell's $retries and $max_restarts)."""
    nb = harness.load("train.ipynb", tmp_path)
    k = harness.Kernel({"COLAB_RESILIENCE_RUN_DIR": str(tmp_path / "runs"), "IPYTHONDIR": str(tmp_path / "ipython")})
    try:
        replies = harness.run_interactive(k, nb, verbatim=True)
    finally:
        k.shutdown()
    assert harness.result(replies["result"].stdout) == reference.result
    assert harness.epochs(tmp_path / "events.log") == [0, 1, 2, 3]


@pytest.mark.kernel  # the reference is a kernel's run
def test_an_uninterrupted_run_in_this_process_is_the_reference(ip, tmp_path, capsys, reference):
    """train.ipynb run in an in-process IPython shell (tests/test_runs.py) ends with the same
    RESULT line as in a kernel: torch, seeded and single-threaded, computes the same bits here."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    harness.run_in_shell(ip, harness.load("train.ipynb", tmp_path), verbatim=True)
    assert harness.result(capsys.readouterr().out) == reference.result
    assert harness.epochs(tmp_path / "events.log") == [0, 1, 2, 3]
