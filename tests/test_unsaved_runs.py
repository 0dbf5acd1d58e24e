"""A run that saves nothing, or less than its cell leaves behind: the same result, or a loud line.

`%%resilient` without `--save` has nothing of its progress on disk. After a restart such a run
goes back to its start (the first checkpoint, kept for it, gives back the random state of then);
it used to resume at its last safe point, or skip the whole cell when the kernel died after the
end-of-cell checkpoint, with an untrained model and no warning (found by `colab-resilience check`
on the quickstart). A cell with `--save` that had finished is not run again: the plain values it
leaves (a step counter, a loss history) come back with its last checkpoint, and one line names
what does not. Every faulted run is compared with its uninterrupted twin.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

import harness
from colab_resilience import faults
from colab_resilience.kernels import api_call

pytestmark = pytest.mark.kernel

SETUP = ("%%replay\nimport torch\ntorch.manual_seed(0)\ntorch.set_num_threads(1)\n"
         "model = torch.nn.Linear(8, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
STEP = ("    loss = model(torch.randn(16, 8)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    losses.append(loss.item())\n")
CELLS = {
    # the quickstart's shape: no loop of ours, so two safe points: the cell's start and its end
    "plain loop": "%%resilient\nlosses = []\nfor step in range(4):\n" + STEP,
    # six safe points: the loop's start, four iterations, the cell's end
    "resume_range": "%%resilient\nlosses = []\nfor epoch in resume_range(4):\n" + STEP,
}
RESULT = "print('RESULT', model.weight.tolist(), model.bias.tolist(), losses)"

_twins: dict[str, str] = {}


def notebook(train: str, result: str = RESULT):
    return harness.notebook("%load_ext colab_resilience", SETUP, train, result)


def supervised(nb, work, fault: dict | None = None):
    env = {}
    if fault is not None:
        env[faults.FAULT_ENV] = json.dumps({"kind": "kill", "phase": "after", "delay": 0.0,
                                            "mark": str(work / "fired"), **fault})
    run = harness.run(nb, work, standby=False, env=env)
    assert run.status == 0, run.message
    if fault is not None:
        assert faults.fired(work / "fired") and len(run.restarts) == 1
    return run


def twin(tmp_path_factory, train: str) -> str:
    if train not in _twins:
        nb = notebook(train)
        supervised(nb, tmp_path_factory.mktemp("twin"))
        _twins[train] = harness.result(nb)
    return _twins[train]


@pytest.mark.parametrize("cell, safe_point, where", [
    ("plain loop", 2, "after the end-of-cell checkpoint"),
    ("resume_range", 4, "after the third iteration"),
    ("resume_range", 6, "after the end-of-cell checkpoint"),
])
@pytest.mark.one_stack("colab")
def test_a_run_that_saves_nothing_starts_again_from_its_start_after_a_kill(tmp_path, tmp_path_factory, cell,
                                                                           safe_point, where):
    """Killed {where}: the new kernel replays the set-up (an untrained model) and runs the whole
    cell again from its start with the random state of then: bit-identical, and said in one line.
    (Resumed at the third iteration, or skipped as "had finished", it ended "done" with a model
    trained on one iteration, or none.)"""
    nb = notebook(CELLS[cell])
    supervised(nb, tmp_path, {"safe_point": safe_point})
    text = harness.cell_text(nb.cells[2])
    assert "nothing to restore (no --save), so the cell starts again from its beginning" in text, text
    assert "had finished" not in text
    assert harness.result(nb) == twin(tmp_path_factory, CELLS[cell])


@pytest.mark.one_stack("colab")
def test_a_finished_cell_not_run_again_brings_back_its_plain_values_and_names_the_rest(tmp_path, tmp_path_factory):
    """--save model,opt, killed after the end-of-cell checkpoint: the cell is not run again; the
    loss history and the step counter it left (plain values) are back from that checkpoint, so
    the result is the uninterrupted one; the last loss and batch it left (tensors) and the module it
    imported are not, and one line names them and what to do."""
    train = ("%%resilient --save model,opt\nimport math\nlosses = []\nfor step in range(4):\n" + STEP
             + "    last = torch.ones(2)\n")
    result = "print('RESULT', model.weight.tolist(), model.bias.tolist(), losses, step)\nprint('loss' in globals(), 'last' in globals(), 'math' in globals())"
    reference = notebook(train, result)
    (tmp_path / "twin").mkdir()
    supervised(reference, tmp_path / "twin")
    nb = notebook(train, result)
    supervised(nb, tmp_path, {"safe_point": 2})
    text = harness.cell_text(nb.cells[2])
    assert ("restored model, opt in " in text and "the cell had finished, it is not run again; loss, last, which the "
            "cell sets without --save, are not back: add them to --save; math, which the cell imports or defines, is "
            "not back: do that in a %%replay cell") in text, text
    assert harness.result(nb) == harness.result(reference)
    assert harness.cell_text(nb.cells[3]).splitlines()[-1] == "False False False"  # the line told the truth


@pytest.mark.one_stack("colab")
def test_a_done_run_that_saves_nothing_runs_again_when_a_driver_brings_its_cell_back(tmp_path, tmp_path_factory):
    """The kernel died after the run was journalled "done", before its cell returned; a driver
    starts a kernel, replays the set-up, puts back what finished runs saved and executes the cell
    again. A run that saved something is not trained again; one that saved nothing has nothing
    of its result back, so its cell runs again from its start: the uninterrupted result."""
    env = {"COLAB_RESILIENCE_RUN_DIR": str(tmp_path / "runs"), "IPYTHONDIR": str(tmp_path / "ipython")}
    train = CELLS["resume_range"]
    first = harness.Kernel(env)
    try:
        first.ok("%load_ext colab_resilience")
        first.ok(SETUP)
        first.ok(train)
        dead = first.pid
        os.kill(dead, signal.SIGKILL)
        first.restart()  # a new kernel, as the driver starts one
        first.ok("%load_ext colab_resilience")
        first.ok(SETUP)
        # the plain values it left are put back; it is the run of the cell run again, so it is not
        # among the finished runs whose result is lost
        assert first.value(api_call("restore_finished_runs", dead, train)) == {"restored": ["losses", "epoch"],
                                                                              "unsaved": [], "rerun": [],
                                                                              "not_back": []}
        first.ok(api_call("expect_reexecution"))
        text = first.ok(train).stdout
        assert "nothing to restore (no --save), so the cell starts again from its beginning" in text, text
        assert harness.result(first.ok(RESULT).stdout) == twin(tmp_path_factory, train)
    finally:
        first.shutdown()


def test_an_in_process_retry_without_save_says_it_may_not_be_exact(ip, tmp_path, capsys):
    """Without --save, an out-of-memory retry goes on from the values in memory, which the failed
    attempt may have changed: said once per run, with what to do."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("n = [0]")
    r = ip.run_cell("%%resilient --retries 3\nn[0] += 1\nif n[0] <= 2:\n    raise MemoryError()")
    assert r.success
    out = capsys.readouterr().out
    line = ("saves nothing (no --save), so the retry goes on from the values in memory, which the failed attempt "
            "may have changed; --save the model and optimizer for a retry that is exact")
    assert out.count(line) == 1, out
    assert "retry 2/3" in out
    # with --save, the retry starts from the saved values: no line, and m is incremented once
    ip.run_cell("m, tries = [0], [0]")
    r = ip.run_cell("%%resilient --retries 1 --save m\nm[0] += 1\ntries[0] += 1\nif tries[0] <= 1:\n    raise MemoryError()")
    assert r.success and line not in capsys.readouterr().out
    assert ip.user_ns["m"] == [1] and ip.user_ns["tries"] == [2]


@pytest.mark.one_stack("colab")
def test_a_kill_after_a_finished_run_that_saved_nothing_says_its_result_is_lost(tmp_path):
    """A run that saved nothing finished; the kernel dies in the next %%resilient cell. Nothing can
    bring back what the first run trained (the replay rebuilds an untrained model), so the result
    differs from the uninterrupted one, and the restart's marker says so in one line, naming the
    run and what to do. (It used to end "done" with another result and no word.)"""
    later = "%%resilient --save total\ntotal = 0\nfor i in resume_range(2):\n    total += i"
    cells = ("%load_ext colab_resilience", SETUP, CELLS["plain loop"], later, RESULT)
    reference = harness.notebook(*cells)
    (tmp_path / "twin").mkdir()
    supervised(reference, tmp_path / "twin")
    nb = harness.notebook(*cells)
    run = supervised(nb, tmp_path, {"safe_point": 3})  # the later cell's first safe point
    marker = harness.cell_text(nb.cells[3])
    [unsaved] = run.restarts[0].unsaved
    assert (f"colab_resilience: run {unsaved} finished in the kernel that died but saves nothing (no --save), so "
            "what it computed is not back and the cells after it may give another result than an uninterrupted "
            "run; --save the model and optimizer") in marker, marker
    assert harness.result(nb) != harness.result(reference)
