"""The supervisor: real kernel deaths (inside and outside), a real OOM, exact resume, budgets,
ordinary errors, the CLI's exit codes and messages, -p parameters, the papermill engine.

The training runs are tests/files/train.ipynb with a fault injected, compared with the `reference`
fixture (its uninterrupted run); tests/files/budget.ipynb is a run that dies in every kernel.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from colab_resilience import driver
from harness import FILES, KERNEL_NAME, cell_text, child_env, epochs, events, index, insert, load, notebook, result, run

pytestmark = pytest.mark.kernel


def test_sigkill_from_inside_resumes_exactly(tmp_path, reference):
    """A SIGKILL mid-epoch: the warm standby takes over, the parameters and set-up cells are
    replayed, the run continues at the interrupted epoch and ends bit-identical. (Staging off: the
    checkpoint of the epoch before is on disk when the kill comes; tests/test_background_saves.py
    kills during its write.)"""
    nb = load("train.ipynb", tmp_path, fault="sigkill", fault_epoch=2, staging="off")
    outcome = run(nb, tmp_path)
    assert outcome.status == 0, outcome.message
    assert [r.exit_code for r in outcome.restarts] == [-9]
    assert result(nb) == reference.result
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    train = index(out, "train")
    text = cell_text(out.cells[train])
    # the driver's standby kernel took over (tests/test_standby.py: its warm-up, priority, OOM score);
    # replayed: the parameters, the injected parameters and the set-up cell
    # no OOM kill was counted by the OS: "killed by SIGKILL", not a guess at the OOM killer
    assert ("colab_resilience: the kernel died (killed by SIGKILL); switched to the standby kernel, replayed 3 cells "
            "and resumed at iteration 2 in") in text
    assert "continuing at 2" in text
    meta = out.metadata["colab_resilience"]
    assert meta["status"] == "done" and meta["restarts"][0]["cell"] == train and meta["restarts"][0]["replayed"] == 3
    assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]


def test_what_a_cell_printed_before_the_checkpoint_a_kill_came_after_is_in_its_output(tmp_path):
    """An epoch prints its line and its safe point saves; the kernel is killed 0.05 s later. The
    kernel held the line in its stream buffer (ipykernel sends it every 0.2 s), so the kill took
    it, and the resume went on after the epoch: the line was nowhere in the notebook. The safe
    point sends what was printed before its checkpoint: the cell's output is the uninterrupted one
    with the recovery's lines among it."""
    from colab_resilience import faults

    body = ("import time\nhistory = []\nfor epoch in resume_range(3):\n    time.sleep(0.3)\n"
            "    history.append(epoch)\n    print('epoch', epoch, 'done')")
    nb = notebook("%load_ext colab_resilience\nfrom colab_resilience import resume_range",
                  "%%resilient --save history\n" + body)
    fault = json.dumps({"kind": "kill", "safe_point": 2, "phase": "after", "delay": 0.05, "mark": str(tmp_path / "m")})
    outcome = run(nb, tmp_path, standby=False, env={faults.FAULT_ENV: fault})
    assert outcome.status == 0, outcome.message
    assert faults.fired(tmp_path / "m") and len(outcome.restarts) == 1
    lines = cell_text(nb.cells[1]).splitlines()
    assert [ln for ln in lines if not ln.startswith("colab_resilience:")] == [
        "epoch 0 done", "epoch 1 done", "epoch 2 done"], lines
    assert lines[0] == "epoch 0 done" and "continuing at 1" in lines[2], lines


def test_sigkill_from_outside_by_pid_resumes_exactly(tmp_path, reference):
    """A kill from outside the kernel, by PID, in epoch 1, without a standby: jupyter_client
    restarts the kernel, the loop goes on in the new one and ends bit-identical."""
    log = tmp_path / "events.log"
    # epochs of 0.4 s: time for the killer to land in one; staging off: the checkpoint of epoch 0 is
    # on disk when the kill at the start of epoch 1 comes (tests/test_background_saves.py: during it)
    nb = load("train.ipynb", tmp_path, pause=0.05, staging="off")
    killed = []

    def killer():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            started = [e for e in events(log) if e.name == "epoch-start" and int(e.arg) >= 1]
            if started:
                os.kill(started[0].pid, signal.SIGKILL)
                killed.append(started[0].pid)
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    outcome = run(nb, tmp_path, standby=False)  # the cold path: a kernel restarted by jupyter_client
    t.join()
    assert killed and outcome.status == 0, outcome.message
    assert len(outcome.restarts) == 1
    assert "restarted it, replayed 3 cells and resumed at iteration 1 in" in cell_text(nb.cells[index(nb, "train")])
    assert json.loads(nbformat.writes(nb))["metadata"]["colab_resilience"]["restarts"][0]["kernel"] == "restarted"
    assert result(nb) == reference.result
    pids = {e.pid for e in events(log) if e.name == "epoch-start"}
    assert len(pids) == 2 and killed[0] in pids  # the loop went on in a new kernel


@pytest.mark.timeout(120)
def test_a_death_between_cells_while_the_driver_restores_is_recovered_at_once(tmp_path, reference):
    """The kernel dies while the driver, not a cell, is talking to it: in the restore that follows
    a replay. The driver notices within its poll (it used to wait out a 600 s timeout), counts a
    restart, and the run ends identical to the uninterrupted one."""
    boom = tmp_path / "boom"
    boom.touch()
    nb = load("train.ipynb", tmp_path, fault="sigkill", fault_epoch="result")  # a death after the training
    insert(nb, "train", (  # a set-up cell too: the first restore after a restart kills the kernel
        "%%replay\n"
        "import colab_resilience.kernelapi as _m\n"
        "_restore = _m.restore_finished_runs\n"
        "def _boom(*args):\n"
        f"    if os.path.exists({str(boom)!r}):\n"
        f"        os.unlink({str(boom)!r}); os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _restore(*args)\n"
        "_m.restore_finished_runs = _boom"
    ), "restore-killer")
    t0 = time.perf_counter()
    outcome = run(nb, tmp_path)
    assert outcome.status == 0, outcome.message
    assert time.perf_counter() - t0 < 90
    assert [r.cell for r in outcome.restarts] == [index(nb, "result")] * 2
    assert "died while replaying" in outcome.restarts[0].reason
    assert outcome.restarts[1].restored == ["model", "opt", "history", "epoch", "step"]  # and what it left
    assert not boom.exists()
    assert result(nb) == reference.result
    assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]  # the training was not run again


def test_real_oom_beyond_retries_restarts_and_resumes(tmp_path, reference):
    """A real allocator failure in epoch 3, in every attempt of the first kernel: past its one
    retry the kernel asks for a restart (exit 75), and the next kernel finishes bit-identical."""
    nb = load("train.ipynb", tmp_path, fault="oom", fault_epoch=3, retries=1)
    outcome = run(nb, tmp_path)
    assert outcome.status == 0, outcome.message
    assert [r.exit_code for r in outcome.restarts] == [75]
    assert outcome.restarts[0].reason == "OOM (DefaultCPUAllocator: can't allocate memory) after 2 attempts"
    assert outcome.restarts[0].iteration == "3"
    assert result(nb) == reference.result


def test_a_kernel_that_resumed_unbinds_the_failed_attempts_batch_before_its_retry(tmp_path):
    """After a SIGKILL, the new kernel resumes at epoch 1 and runs really out of memory there
    before it took a checkpoint of its own. Its retry must go back with the failed attempt's
    512 MiB batch unbound, as the first kernel's would: the retry at half the batch then fits in
    one go. It used to keep it bound (the names of the safe point were known only to the kernel
    that saved it): the retry failed too, with less room than the first kernel would have had,
    and the run went on with a batch the uninterrupted run never shrank to."""
    marker = tmp_path / "killed-once"
    nb = notebook(
        "%%replay\nimport os, resource, signal, torch\n"
        "with open('/proc/self/status') as f:  # a real OOM: at most 768 MiB more may be allocated\n"
        "    data = next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmData:'))\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (data + (768 << 20), resource.getrlimit(resource.RLIMIT_DATA)[1]))",
        "batch_size = 4096\n%config ResilienceMagics.staging_memory = 'off'",
        "%%resilient --retries 1 --shrink batch_size --save seen\n"
        "seen = []\n"
        "for epoch in resume_range(2):\n"
        f"    if epoch == 1 and not os.path.exists({str(marker)!r}):\n"
        f"        open({str(marker)!r}, 'w').close()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    x = torch.ones(batch_size * (1 + epoch), 16384)  # epoch 1: 512 MiB, bound to a global\n"
        "    y = x * 2                                       # and 512 MiB more: does not fit\n"
        "    total = float(y[0].sum())\n"
        "    del x, y\n"
        "    seen.append((epoch, batch_size))",
        "print('RESULT', seen, total)",
        tags={1: ["parameters"]},
    )
    outcome = run(nb, tmp_path)
    assert outcome.status == 0, outcome.message
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert [r.exit_code for r in outcome.restarts] == [-9], cell_text(out.cells[2])  # the kill only
    text = cell_text(out.cells[2])
    ooms = [line for line in text.splitlines() if "; retry " in line]
    assert len(ooms) == 1 and re.search(r"unbound (epoch, )?x \(new since the last safe point\)", ooms[0]), text
    assert "batch_size 4096 → 2048; retry 1/1" in ooms[0]
    assert "continuing at 1 with batch_size 2048 (what ran before it ran with batch_size 4096)" in text
    assert cell_text(out.cells[3]).strip() == "RESULT [(0, 4096), (1, 2048)] 32768.0"


def test_restart_budget_spent_exits_3_and_later_cells_do_not_run(tmp_path):
    """A cell that dies in every kernel stops at its run's --max-restarts (below the driver's own
    budget): exit status 3, the run's report, and the cells after it never run. The driver counts
    each death into the run's journal, and refuses the one the budget does not cover before it
    starts a kernel for it."""
    nb = load("budget.ipynb", death="sigkill", max_restarts=1)
    outcome = run(nb, tmp_path, max_restarts=5)
    assert outcome.status == driver.EXIT_BUDGET
    assert len(outcome.restarts) == 1
    assert outcome.message.startswith("colab_resilience: run ")
    assert "failed: restart budget spent (1/1 restarts) and the kernel died again (killed by SIGKILL)" in outcome.message
    assert "raise --max-restarts" in outcome.message
    assert nb.cells[index(nb, "after")].get("outputs", []) == []


# a set-up cell that runs once and not again: it deletes the file it reads
ONCE_SET_UP = "%%replay\nimport os\nprint(open('once.txt').read())\nos.remove('once.txt')\nx = 1"
KILLED_ONCE = ("%%resilient\nimport os, signal\nif not os.path.exists('m'):\n    open('m', 'w').close()\n"
               "    os.kill(os.getpid(), signal.SIGKILL)\nprint('x', x)")
ONCE_REFUSED = ("replaying set-up cell {} failed (FileNotFoundError: [Errno 2] No such file or directory: "
                "'once.txt'); a set-up cell must run again as it ran the first time")


def test_a_set_up_cell_that_fails_when_replayed_stops_the_run_in_one_line(tmp_path):
    """The kernel killed in the training cell; the set-up cell, replayed in the new kernel, fails
    (the file it read is gone): the run stops there, exit status 1, with one line that says which
    set-up cell failed and why, the marker in the cell, and the executed notebook written. (It
    raised nbclient's CellExecutionError out of run_notebook: a traceback, no notebook.)"""
    (tmp_path / "once.txt").write_text("hello")
    nb = notebook("%load_ext colab_resilience", ONCE_SET_UP, KILLED_ONCE, "print('not reached')")
    outcome = run(nb, tmp_path, standby=False)
    assert outcome.status == driver.EXIT_CELL_FAILED and outcome.failed_cell == 2, outcome.message
    assert outcome.message.startswith("colab-resilience: cell 2 not run again: after the kernel died, ")
    assert ONCE_REFUSED.format(1) in outcome.message, outcome.message
    assert len(outcome.restarts) == 1 and not outcome.restarts[0].recovered
    assert ("the kernel died (killed by SIGKILL; then replaying set-up cell 1 failed (FileNotFoundError"
            in cell_text(nb.cells[2])), cell_text(nb.cells[2])
    written = nbformat.read(tmp_path / "out.ipynb", 4)
    assert written.metadata["colab_resilience"]["status"] == "failed" and not written.cells[3].get("outputs")


def test_a_run_a_stopped_notebook_leaves_pending_costs_no_restart_when_the_same_command_goes_on(tmp_path):
    """A supervised notebook that stops with its run pending (killed in training, then the resume
    refused: a plain cell builds the model, and no set-up cell does): the driver ended its kernel
    with a kill, and the same command again (same --run-dir) counted that kernel as a death
    without warning, a restart of the run's budget spent. Once the kernel is gone, the driver marks
    the run shut down, not counted, and the next command goes on from the checkpoint to the
    uninterrupted weights. The first run's marker no longer says the cell "resumed" before the
    refusal below it."""
    train = ("%%resilient --save model,history\nfor epoch in resume_range(4):\n    with torch.no_grad():\n"
             "        model.weight.mul_(1.5).add_(epoch)\n    history.append(epoch)\n"
             f"    if epoch == 2 and not os.path.exists({str(tmp_path / 'm')!r}):\n"
             f"        open({str(tmp_path / 'm')!r}, 'w').close(); os.kill(os.getpid(), 9)")
    cells = ("%load_ext colab_resilience", "%%replay\nimport os, torch\nhistory = []",
             "torch.manual_seed(0)\nmodel = torch.nn.Linear(2, 2)", train,
             "torch.manual_seed(0); twin = torch.nn.Linear(2, 2)\n"
             "with torch.no_grad():\n    for epoch in range(4):\n        twin.weight.mul_(1.5).add_(epoch)\n"
             "print('RESULT', history, torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias))")
    first = run(nb := notebook(*cells), tmp_path, standby=False)
    assert first.status == driver.EXIT_CELL_FAILED and first.failed_cell == 3, first.message
    assert "cannot restore 'model' in place" in first.message, first.message
    # the marker said "... and resumed at iteration 2", and then the refusal
    assert re.search(r"the kernel died \(killed by SIGKILL\); restarted it and replayed 1 cell in [\d.]+ s; the cell, "
                     r"run again, stopped before it resumed at iteration [12]: its run stays pending\n",
                     cell_text(nb.cells[3])), cell_text(nb.cells[3])
    nb = notebook(*cells)
    again = run(nb, tmp_path, standby=False)
    assert again.status == 0, again.message
    assert re.search(r"resumed run \w+ after kernel restart \(the kernel was shut down or restarted while the run was "
                     r"pending \(not a crash\); not counted\): restored model, history in [\d.]+ s; continuing at [12]\n",
                     cell_text(nb.cells[3])), cell_text(nb.cells[3])
    assert "RESULT [0, 1, 2, 3] True" in cell_text(nb.cells[4]), cell_text(nb.cells[4])


def test_a_set_up_value_a_plain_cell_changed_stops_a_supervised_resume_and_the_same_command_goes_on(tmp_path):
    """``data`` made in a %%replay cell and scaled in the next, plain one; killed in training: the
    driver's new kernel replays the %%replay cell only, the resume stops in one line, and that line
    says what a supervised user does (the same command runs every cell again), not "run that cell
    again, then this one (Run All does)", which no one can do in a headless run. The same command
    then goes on from the checkpoint to the uninterrupted sum (0 + 10 + 20 + 30)."""
    mark = str(tmp_path / "m")
    cells = ("%load_ext colab_resilience", "%%replay\nimport os\ndata = list(range(8))\ntotal = 0",
             "data = [x * 10 for x in data]",
             "%%resilient --save total\nfor i in resume_range(4):\n    total += data[i]\n"
             f"    if i == 2 and not os.path.exists({mark!r}):\n        open({mark!r}, 'w').close(); os.kill(os.getpid(), 9)",
             "print('total', total)")
    first = run(notebook(*cells), tmp_path, standby=False)
    assert first.status == driver.EXIT_CELL_FAILED and first.failed_cell == 3, first.message
    # the package's own stop, its line (it was "cell 3 failed: UsageError: colab_resilience: ...")
    assert first.message.startswith("colab-resilience: cell 3 stopped: colab_resilience: run "), first.message
    assert first.message.endswith(
        "data is not what the run began with: a cell that is not replayed had changed it since the %%replay cells ran "
        "(said as the run began), and the replay made it as the %%replay cells do, so the resumed run would train on "
        "other values; the same `colab-resilience run` command runs every cell again and goes on with the run; or "
        "make the change in a %%replay cell or --save it"), first.message
    again = run(nb := notebook(*cells), tmp_path, standby=False)
    assert again.status == 0, again.message
    assert re.search(r"continuing at [12]\n", cell_text(nb.cells[3])) and cell_text(nb.cells[4]).strip() == "total 60", \
        cell_text(nb.cells[3]) + cell_text(nb.cells[4])
    journal = json.loads(next((tmp_path / "runs").glob("run-*/journal.json")).read_text())
    assert journal["restarts_used"] == 1, journal["restarts"]
    assert [(r["reason"], r["planned"]) for r in journal["restarts"][1:]] == [
        ("the kernel was shut down or restarted while the run was pending (not a crash)", True)], journal["restarts"]


def test_a_crash_loop_at_start_up_stops_at_the_driver_budget(tmp_path):
    """A plain first cell that kills every kernel (no run to count restarts) stops at the driver's
    own budget, quickly, and says it was the notebook's budget and how to raise it."""
    nb = notebook("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "print('not reached')")
    started = time.monotonic()
    outcome = run(nb, tmp_path, max_restarts=2)
    assert outcome.status == driver.EXIT_BUDGET
    assert len(outcome.restarts) == 2
    assert ("restart budget of the notebook spent (2/2 restarts of a kernel outside any %%resilient run; raise it "
            "with --max-restarts): the kernel died again in cell 0 (killed by SIGKILL") in outcome.message
    assert time.monotonic() - started < 60


@pytest.fixture
def startup_killer(tmp_path):
    """An IPython startup file that SIGKILLs every kernel while it starts, before it answers; or
    only the first one (``once=True``). Removed afterwards."""
    path = os.path.join(os.environ["IPYTHONDIR"], "profile_default", "startup", "50-test-killer.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def install(once: bool) -> None:
        mark = tmp_path / "started-once"
        cond = f"not os.path.exists({str(mark)!r})" if once else "True"
        with open(path, "w") as f:
            f.write(f"import os, signal\nif {cond}:\n    open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")

    yield install
    os.unlink(path)


def test_the_first_kernel_dying_while_starting_is_restarted_like_any_death(tmp_path, startup_killer):
    """The very first kernel dies before it answers: a death like any other, restarted."""
    startup_killer(once=True)
    nb = notebook("print('ran', 1 + 1)")
    outcome = run(nb, tmp_path)
    assert outcome.status == 0, outcome.message
    assert [r.reason for r in outcome.restarts] == ["died while starting: killed by SIGKILL"]
    assert "ran 2" in cell_text(nb.cells[0])


def test_cli_a_kernel_that_never_starts_exits_3_with_a_report_not_a_traceback(tmp_path, startup_killer):
    """`colab-resilience run` with kernels that always die while starting: exit status 3 and a
    report of the attempts, never a traceback, never a claim that a kernel resumed."""
    startup_killer(once=False)
    nb = notebook("print('not reached')")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    r = cli("run", str(tmp_path / "in.ipynb"), "--max-restarts", "1", "--no-progress")
    assert r.returncode == driver.EXIT_BUDGET, r.stderr
    assert "Traceback" not in r.stderr
    assert ("colab-resilience: restart budget of the notebook spent (1/1 restarts of a kernel outside any "
            "%%resilient run; raise it with --max-restarts): the kernel died again in cell 0 "
            "(died while starting: killed by SIGKILL") in r.stderr
    assert "the new kernel died while starting) after" in r.stderr  # the marker does not claim a resume


def test_ordinary_error_is_reported_like_papermill(tmp_path):
    """An ordinary exception is no death: the run stops at that cell (exit status 1), its error in
    the output notebook, the later cells not run."""
    nb = notebook("x = 1", "raise ValueError('bad parameter')", "print('not reached')")
    outcome = run(nb, tmp_path)
    assert outcome.status == driver.EXIT_CELL_FAILED and outcome.failed_cell == 1
    assert outcome.message == "colab-resilience: cell 1 failed: ValueError: bad parameter"
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert out.cells[1].outputs[0].output_type == "error"
    assert out.cells[2].get("outputs", []) == []
    assert out.metadata["colab_resilience"]["status"] == "failed"


def test_parameters_are_injected_after_the_parameters_cell(tmp_path):
    """papermill's convention: typed -p values in a cell tagged injected-parameters right after the
    cell tagged parameters, overriding its values and adding new names."""
    nb = notebook("lr = 0.1\nname = 'a'", "print('PARAMS', lr, name, steps)", tags={0: ["parameters"]})
    outcome = run(nb, tmp_path, parameters={"lr": driver.resolve_parameter("0.01"), "name": driver.resolve_parameter("b"), "steps": driver.resolve_parameter("3")})
    assert outcome.status == 0
    assert nb.cells[1].metadata["tags"] == ["injected-parameters"]
    assert "PARAMS 0.01 b 3" in cell_text(nb.cells[2])


def cli(*args, cwd=None, timeout=240, env=None):
    """``python -m colab_resilience ARGS`` in a child process (``env``: added to this one's)."""
    return subprocess.run([sys.executable, "-m", "colab_resilience", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=None if env is None else dict(os.environ, **env))


def test_cli_runs_a_notebook_with_parameters(tmp_path):
    """`colab-resilience run -p n 21 --log-output`: the value reaches the kernel, the cells' output
    is echoed with their index, and a summary line ends the run."""
    nb = notebook("n = 1", "print('N', n * 2)", tags={0: ["parameters"]})
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    r = cli("run", str(tmp_path / "in.ipynb"), "-o", str(tmp_path / "o.ipynb"), "-p", "n", "21", "--no-progress", "--log-output", "--no-standby")
    assert r.returncode == 0, r.stderr
    assert "[cell 2] N 42" in r.stdout
    assert "colab-resilience: done in" in r.stdout and "with 0 kernel restarts; wrote" in r.stdout
    assert r.stderr == "", r.stderr  # n is the parameters cell's


def _killed_at_its_seventh_safe_point(tmp_path, nb, *options: str, stderr_only: bool):
    """``colab-resilience run`` with ``options`` on ``nb`` (written to ``tmp_path/in.ipynb``), its
    kernel killed once after the seventh safe point: each line the command wrote (its stderr, or
    its stdout and stderr together), with when it came, and when the command closed them."""
    from colab_resilience import faults

    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    fault = json.dumps({"kind": "kill", "safe_point": 7, "phase": "after", "delay": 0.1, "mark": str(tmp_path / "m")})
    p = subprocess.Popen([sys.executable, "-m", "colab_resilience", "run", "in.ipynb", "-o", "out.ipynb",
                          "--no-progress", "--no-standby", *options], cwd=tmp_path,
                         stdout=subprocess.DEVNULL if stderr_only else subprocess.PIPE,
                         stderr=subprocess.PIPE if stderr_only else subprocess.STDOUT, text=True,
                         env=dict(os.environ, **{faults.FAULT_ENV: fault}))
    lines = []
    try:
        for line in p.stderr if stderr_only else p.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
        ended = time.monotonic()  # the command has closed them: it is ending
        assert p.wait(timeout=240) == 0, lines
    finally:
        p.kill()
    return lines, ended


def test_cli_log_output_echoes_each_line_as_it_comes_and_the_recovery_when_it_happens(tmp_path):
    """`--log-output` on a training cell of 20 steps of 0.15 s, killed after its sixth checkpoint:
    each printed line is echoed as the cell prints it (the first long before the command ends),
    a line drawn again in place (`\\r`) by its last drawing, the recovery when it happens (the
    replayed set-up cell's output not echoed again), the resumed lines after it. It echoed each
    cell's output when the cell ended, markers last: nothing for the length of a training."""
    nb = notebook("%load_ext colab_resilience", "%%replay\nimport time\nh = []\nprint('SET UP')",
                  "%%resilient --save h\nfor i in resume_range(20):\n    time.sleep(0.15); h.append(i)\n"
                  "    print(f'step {i}', end='\\r'); print(f'step {i} done')",
                  "print('RESULT', h == list(range(20)))")
    lines, ended = _killed_at_its_seventh_safe_point(tmp_path, nb, "--log-output", stderr_only=False)
    text = [line for _, line in lines if "Kernel is running over TCP" not in line]
    first = next(t for t, line in lines if line == "[cell 2] step 0 done")
    assert ended - first > 1.5, text  # echoed as it came, not when the cell ended (2 s later)
    assert text.count("[cell 1] SET UP") == 1, text
    died = next(i for i, line in enumerate(text) if line.startswith("[cell 2] colab_resilience: the kernel died"))
    assert text[died] == ("[cell 2] colab_resilience: the kernel died (killed by SIGKILL); restarted it and replayed 1 "
                          "cell in " + text[died].split(" cell in ")[1].split(" s;")[0] + " s; the cell runs again to "
                          "go on at iteration 6"), text
    assert text[died - 1] == "[cell 2] step 5 done" and "[cell 2] step 6 done" in text[died:], text
    assert [line for line in text if line.startswith("[cell 2] step")] == [f"[cell 2] step {i} done" for i in range(20)]
    assert "[cell 3] RESULT True" in text


def test_cli_says_the_packages_own_lines_as_they_come_without_log_output(tmp_path):
    """Without `--log-output` the terminal showed a run's restarts only when it had ended, and
    nothing else a cell said: a resume that could not be exact ("the replayed set-up cells made V
    otherwise ... will not end as the uninterrupted one") was in the written notebook alone, and
    the terminal said "done". The package's own lines in any cell go to stderr as they come now,
    with each recovery as it happens, in order; what the cells print otherwise does not."""
    nb = notebook("%load_ext colab_resilience", "%%replay\nimport random, time\nV = random.random()\nh = []",
                  "%%resilient --save h\nfor i in resume_range(20):\n    time.sleep(0.15); h.append(i + V)\n"
                  "    print(f'step {i} done')",
                  "print('RESULT', len(h))")
    lines, ended = _killed_at_its_seventh_safe_point(tmp_path, nb, stderr_only=True)
    text = [line for _, line in lines if "Kernel is running over TCP" not in line]
    ours = [line for line in text if line.startswith("[cell 2] colab_resilience: ")]
    assert len(ours) == 3 and ours == [line for line in text if line.startswith("[cell")], text
    assert ours[0].startswith("[cell 2] colab_resilience: the kernel died (killed by SIGKILL); restarted it and "
                              "replayed 1 cell in ") and ours[0].endswith("; the cell runs again to go on at iteration 6")
    assert ours[1].startswith("[cell 2] colab_resilience: the replayed set-up cells made V otherwise than the kernel "
                              "that began this run had them"), ours
    assert ours[2].startswith("[cell 2] colab_resilience: resumed run ") and ours[2].endswith("; continuing at 6"), ours
    resumed = next(t for t, line in lines if line == ours[2])
    assert ended - resumed > 1.5, text  # said as it came, not when the run ended (14 steps of 0.15 s later)
    assert "step" not in "".join(text)


def test_a_parameter_the_notebook_does_not_set_is_said_as_papermill_warns():
    """A -p name the parameters cell does not set (a typo: the run went on with the notebook's
    value, and nothing said so), or a notebook without a parameters cell: one line, as papermill
    warns; the value is set anyway (papermill's rule, `-p steps 3` adds a name)."""
    nb = notebook("epochs = 4  # parameters\nlr: float = 0.1\nname, width = 'a', 8", "print(epochs)",
                  tags={0: ["parameters"]})
    assert driver.unknown_parameters(nb, {"epochs": 2, "lr": 0.01, "width": 4}) is None
    assert driver.unknown_parameters(nb, {"epoch": 2, "lr": 0.01}) == (
        "-p epoch (did you mean epochs?): the parameters cell does not set it (it sets epochs, lr, name, width); "
        "set anyway, as a new name")
    assert driver.unknown_parameters(nb, {"steps": 3, "withd": 4}).startswith(
        "-p steps, withd (did you mean width?): the parameters cell does not set them (")
    untagged = notebook("epochs = 4", "print(epochs)")
    assert driver.unknown_parameters(untagged, {"epochs": 2}) == (
        "-p epochs: the notebook has no cell tagged 'parameters', so it is set in a cell put first, and a cell that "
        "sets it again wins; tag the cell that sets it 'parameters'")
    assert driver.unknown_parameters(untagged, {}) is None


def test_cli_a_relative_run_dir_is_where_the_command_was_given_not_the_notebooks_folder(tmp_path):
    """`--run-dir runs` given in one folder for a notebook in another: the runs land beside the
    command, as any path on a command line would. (The kernel, which runs in the notebook's folder,
    used to read it there, and filled the notebook's folder with a `runs` of its own.)"""
    project, here = tmp_path / "project", tmp_path / "here"
    project.mkdir()
    here.mkdir()
    nb = notebook("%load_ext colab_resilience", "%%resilient --save n\nn = 2")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, project / "in.ipynb")
    r = cli("run", str(project / "in.ipynb"), "-o", str(here / "o.ipynb"), "--run-dir", "runs", "--no-progress",
            "--no-standby", cwd=here)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in project.iterdir()) == ["in.ipynb"]
    assert [p.name for p in (here / "runs").iterdir() if p.name.startswith("run-")]


def test_cli_run_ids_do_not_depend_on_the_notebook_the_command_was_given_from(tmp_path):
    """`!colab-resilience run ... --run-dir runs` in a notebook's cell hands the command that
    notebook's $JPY_SESSION_NAME, which names a kernel's notebook and so its runs: the supervised
    kernels got it, and the same command given from a terminal afterwards did not find the runs
    it was to go on from (another run id). The run folder is the command's: its kernels get none."""
    nb = notebook("%load_ext colab_resilience", "import os\nprint('NAME', os.environ.get('JPY_SESSION_NAME'))",
                  "%%resilient --save n\nn = 2")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    folders = []
    for env in ({"JPY_SESSION_NAME": str(tmp_path / "analysis.ipynb")}, {}):
        r = cli("run", "in.ipynb", "-o", "o.ipynb", "--run-dir", "runs", "--no-progress", "--no-standby", cwd=tmp_path,
                env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "NAME None" in cell_text(nbformat.read(tmp_path / "o.ipynb", 4).cells[1])
        folders.append(sorted(p.name for p in (tmp_path / "runs").glob("run-*")))
    assert folders[0] == folders[1] and len(folders[0]) == 1, folders


@pytest.mark.parametrize(
    "make,args,expected",
    [
        (None, ["run", "missing.ipynb"], "colab-resilience: missing.ipynb: no such notebook; give the path of an .ipynb file"),
        ("nb", ["run", "good"], "colab-resilience: good: no such notebook (did you mean good.ipynb?); give the path of "
         "an .ipynb file"),
        # a folder: it was "no such notebook", which it is not
        ("nb", ["check", "."], "colab-resilience: . is a folder (it holds good.ipynb); give the path of a notebook"),
        (None, ["run", "."], "colab-resilience: . is a folder (it holds no .ipynb file); give the path of a notebook"),
        ("{not json", ["run", "bad.ipynb"], "colab-resilience: bad.ipynb: not a readable notebook (Notebook does not appear to be JSON"),
        ('{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "source": "1"}]}',
         ["run", "bad.ipynb"], "colab-resilience: bad.ipynb: not a readable notebook (The notebook is invalid and is "
         "missing an expected key: metadata)"),
        ("nb", ["run", "good.ipynb", "--kernel", "no-such-kernel"], "colab-resilience: no kernel named 'no-such-kernel'; list them with `jupyter kernelspec list`"),
        ("nb", ["run", "good.ipynb", "-p", "2x", "1"], "colab-resilience: -p 2x: not a Python variable name"),
        ("nb", ["run", "good.ipynb", "--max-restarts", "-1"], "argument --max-restarts: cannot be negative (got -1)"),
        (None, ["frobnicate"], "invalid choice: 'frobnicate'"),
        # said by the command given, with the command whose option it is: it was `colab-resilience
        # --help`, whose text names no command's options
        ("nb", ["run", "good.ipynb", "--faults", "2"], "colab-resilience run: unrecognized arguments: --faults 2 "
         "(--faults is an option of `colab-resilience check`); see `colab-resilience run --help`"),
        ("nb", ["check", "good.ipynb", "-o", "x.ipynb"], "colab-resilience check: unrecognized arguments: -o x.ipynb "
         "(-o is an option of `colab-resilience run`); see `colab-resilience check --help`"),
        ("nb", ["run", "good.ipynb", "--no-standy"], "colab-resilience run: unrecognized arguments: --no-standy "
         "(did you mean --no-standby?); see `colab-resilience run --help`"),
        # found only after the run, the executed notebook was lost with a traceback
        ("nb", ["run", "good.ipynb", "-o", "missing/o.ipynb"], "colab-resilience: cannot write the executed notebook to "
         "missing/o.ipynb: there is no folder missing; make it first, or give another output path"),
        # root "may write" there by its permission bits: found only after the run
        ("nb", ["run", "good.ipynb", "-o", "/sys/o.ipynb"], "colab-resilience: cannot write the executed notebook to "
         "/sys/o.ipynb: its folder /sys is not writable by you (Permission denied); give another output path"),
        ("nb", ["run", "good.ipynb", "-o", "."], "colab-resilience: . is a folder; give the path of the .ipynb file to "
         "write the executed notebook to"),
        # found by the first %%resilient cell, after the cells above it had run
        ("nb", ["run", "good.ipynb", "--run-dir", "good.ipynb"], "good.ipynb is not a folder, so nothing is written "
         "there; remove it, or give another --run-dir"),
        # an earlier check's fault marks there were taken for this one's: faults that never fired, "identical"
        ("nb", ["check", "good.ipynb", "--keep", "."], "colab-resilience: --keep . is not empty (good.ipynb): files "
         "there, an earlier check's say, would be taken for this check's; give a new or empty folder"),
        ("nb", ["demo", "--keep", "good.ipynb"], "colab-resilience: --keep good.ipynb is a file; give a new or empty "
         "folder for the demo's files"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, make, args, expected):
    """Unusable input is exit status 2 and one line that says what to do; nothing runs."""
    if make == "nb":
        nbformat.write(notebook("1"), tmp_path / "good.ipynb")
    elif make is not None:
        (tmp_path / "bad.ipynb").write_text(make)
    r = cli(*args, cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert expected in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # no usage block, no empty progress bar
    assert not list(tmp_path.glob("*.out.ipynb"))  # nothing ran: no output that looks like a result


def test_cli_a_kernel_whose_python_cannot_import_the_package_is_said_before_any_cell(tmp_path, monkeypatch):
    """A kernel (--kernel, or the notebook's kernelspec) that runs a Python without this package,
    a common slip with several environments: exit status 2 and one line naming the kernel, its
    Python and the import error, and how to mend it; no notebook is written. It was "cell 0 failed:
    ModuleNotFoundError" where the notebook loads the extension, and "Cell magic `%%replay` not
    found" where it leaves that to the supervisor. (The kernel here is this Python with the package
    made unimportable: a real kernel, a real ImportError.)"""
    spec = tmp_path / "data" / "kernels" / "no-package"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", "import sys; sys.modules['colab_resilience'] = None; "
                 "from ipykernel import kernelapp; kernelapp.launch_new_instance()", "-f", "{connection_file}"],
        "display_name": "no package", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", f"{tmp_path / 'data'}{os.pathsep}{os.environ.get('JUPYTER_PATH', '')}")
    nbformat.write(notebook("%%replay\nx = 1", "print(x)"), tmp_path / "in.ipynb")
    r = cli("run", "in.ipynb", "--kernel", "no-package", "--no-progress", "--no-standby", cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == (
        f"colab-resilience: the kernel 'no-package' ({sys.executable}) cannot run colab_resilience "
        "(ModuleNotFoundError: No module named 'colab_resilience.kernelapi'; 'colab_resilience' is not a package); "
        "install this version of it "
        f"into that Python, or give --kernel a kernel that runs {sys.executable} ({sys.executable} -m ipykernel "
        "install --user --name NAME makes one)"), r.stderr
    assert not (tmp_path / "in.out.ipynb").exists()


def test_cli_an_output_folder_gone_by_the_end_of_the_run_loses_nothing(tmp_path):
    """The output's folder went away while the notebook ran (here a cell removes it): the executed
    notebook, every output in it, is written to a file of its own in the temporary directory, and
    one line says where and why; the last line names that file. It was a traceback, and the run's
    outputs were gone."""
    import tempfile

    out = tmp_path / "out"
    out.mkdir()
    nb = notebook("import shutil", f"shutil.rmtree({str(out)!r})\nprint('TRAINED', 6 * 7)")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    r = cli("run", str(tmp_path / "in.ipynb"), "-o", str(out / "trained.ipynb"), "--no-progress", "--no-standby")
    assert r.returncode == 0, r.stdout + r.stderr
    spare = re.search(r"; it is in (\S+)$", r.stderr.strip())
    assert spare, r.stderr
    try:
        assert r.stderr.strip() == (f"colab-resilience: could not write the executed notebook to {out / 'trained.ipynb'} "
                                    f"(No such file or directory); it is in {spare[1]}")
        assert Path(spare[1]).parent == Path(tempfile.gettempdir())
        assert r.stdout.strip().endswith(f"with 0 kernel restarts; wrote {spare[1]}"), r.stdout
        assert "TRAINED 42" in cell_text(nbformat.read(spare[1], 4).cells[1])
        assert stat.S_IMODE(os.stat(spare[1]).st_mode) == 0o600
    finally:
        Path(spare[1]).unlink()


def _interrupted_in_training(tmp_path, command: list[str], signum: int = signal.SIGINT) -> tuple[int, str]:
    """``command`` (on ``tmp_path/in.ipynb``: 30 steps of 0.2 s, each logged) sent ``signum`` (SIGINT,
    as Ctrl-C does) after its fifth step; its exit status and stderr."""
    log = tmp_path / "steps.log"
    nb = notebook("%load_ext colab_resilience", "%%replay\nimport time\nh = []",
                  f"%%resilient --save h\nfor i in resume_range(30):\n    time.sleep(0.2); h.append(i)\n"
                  f"    with open({str(log)!r}, 'a') as f: print(i, file=f)",
                  "print('RESULT', h == list(range(30)))")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    # as at a terminal: a command started in the background of a shell without job control (as CI
    # may start this suite) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    p = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().split()) >= 5) and time.monotonic() < deadline:
            assert p.poll() is None, p.communicate()
            time.sleep(0.1)
        p.send_signal(signum)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    return p.returncode, err


def _own_lines(err: str) -> list[str]:
    """The command's lines on stderr, not those it echoes of the cells (`[cell N] colab_resilience:
    ...`: the cell's log file is named, as the loop writes it)."""
    return [line for line in err.strip().splitlines() if not line.startswith("[cell ")]


def test_cli_ctrl_c_in_a_check_is_one_line_not_a_traceback(tmp_path):
    """Ctrl-C while `check` runs the notebook: exit status 130 and one line saying it was not checked."""
    returncode, err = _interrupted_in_training(
        tmp_path, [sys.executable, "-m", "colab_resilience", "check", "in.ipynb", "--faults", "1", "--no-standby"])
    assert returncode == 130, err
    assert err.strip() == "colab-resilience check: interrupted; in.ipynb not checked", err


def test_cli_ctrl_c_says_where_in_one_line_and_the_same_command_goes_on_from_the_last_checkpoint(tmp_path):
    """Ctrl-C (SIGINT to the command) in the middle of a training cell: exit status 130 and one line
    that names the cell, the notebook written (its metadata says "interrupted", not "done") and how
    to go on; the same command with the same --run-dir goes on from the run's last checkpoint and
    ends as the uninterrupted run would, none of the run's restarts spent. It was a KeyboardInterrupt traceback, asyncio's "Task
    exception was never retrieved", and a notebook that said "done"."""
    command = [sys.executable, "-m", "colab_resilience", "run", "in.ipynb", "-o", "out.ipynb", "--run-dir", "runs",
               "--no-progress", "--no-standby"]
    returncode, err = _interrupted_in_training(tmp_path, command)
    assert returncode == 130, err
    assert _own_lines(err) == ["colab-resilience: interrupted in cell 2; wrote out.ipynb; the same command (--run-dir "
                               "runs) goes on from the last checkpoint of its run"], err
    assert nbformat.read(tmp_path / "out.ipynb", 4).metadata["colab_resilience"]["status"] == "interrupted"
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert re.search(r"colab_resilience: resumed run \w+ after kernel restart \(the kernel was shut down or restarted "
                     r"while the run was pending \(not a crash\); not counted\): restored h in [\d.]+ s; continuing "
                     r"at [1-9]", cell_text(out.cells[2])), cell_text(out.cells[2])
    assert "RESULT True" in cell_text(out.cells[3])
    assert out.metadata["colab_resilience"]["status"] == "done"
    # the kernel ended by Ctrl-C is no death: it spent none of the run's restarts (it spent one)
    journal = json.loads(next((tmp_path / "runs").glob("run-*/journal.json")).read_text())
    assert journal["restarts_used"] == 0 and [r["planned"] for r in journal["restarts"]] == [True], journal["restarts"]


def test_cli_sigterm_stops_a_run_as_ctrl_c_does(tmp_path):
    """SIGTERM (`kill`, a job's time limit, `timeout`) in the middle of a training cell: the same
    as Ctrl-C, exit status 143. It ended the command at once: no executed notebook, no line, its
    temporary folder left for the next command to remove."""
    command = [sys.executable, "-m", "colab_resilience", "run", "in.ipynb", "-o", "out.ipynb", "--run-dir", "runs",
               "--no-progress", "--no-standby"]
    returncode, err = _interrupted_in_training(tmp_path, command, signal.SIGTERM)
    assert returncode == 143, err
    assert _own_lines(err) == ["colab-resilience: stopped by SIGTERM in cell 2; wrote out.ipynb; the same command "
                               "(--run-dir runs) goes on from the last checkpoint of its run"], err
    assert nbformat.read(tmp_path / "out.ipynb", 4).metadata["colab_resilience"]["status"] == "interrupted"


def test_cli_a_cell_past_its_timeout_stops_the_run_in_one_line_and_the_same_command_goes_on(tmp_path):
    """`--cell-timeout 1` on a training cell of 2 s: the run stops there, exit status 1, with one
    line that says what to do and how to go on, an error in the cell of the notebook written (as
    papermill finds failed cells); the same command without the timeout goes on from the run's
    last checkpoint. It was nbclient's CellTimeoutError traceback, and no notebook."""
    nb = notebook("%load_ext colab_resilience", "%%replay\nimport time\nh = []",
                  "%%resilient --save h\nfor i in resume_range(20):\n    time.sleep(0.1); h.append(i)",
                  "print('RESULT', h == list(range(20)))")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    command = [sys.executable, "-m", "colab_resilience", "run", "in.ipynb", "-o", "out.ipynb", "--run-dir", "runs",
               "--no-progress", "--no-standby"]
    r = subprocess.run(command + ["--cell-timeout", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip() == (
        "colab-resilience: cell 2 failed: CellTimeoutError: the cell ran longer than --cell-timeout allows (1 s), and "
        "the run stopped there; give a larger --cell-timeout (0: no limit); the same command (--run-dir runs) goes on "
        "from the last checkpoint of its run"), r.stderr
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert [o.ename for o in out.cells[2].outputs if o.output_type == "error"] == ["CellTimeoutError"]
    assert out.metadata["colab_resilience"]["status"] == "failed"
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert re.search(r"not counted\): restored h in [\d.]+ s; continuing at [1-9]", cell_text(out.cells[2])), \
        cell_text(out.cells[2])
    assert "RESULT True" in cell_text(out.cells[3])


def _seeded_draws(tmp_path) -> list[str]:
    """``tmp_path/in.ipynb``: a parameters cell ``seed = 0``, a %%replay cell that seeds a
    ``random.Random`` with it, 20 draws of 0.1 s each saved with the generator, and a last cell
    that prints whether they are the uninterrupted run's for that seed; the command that runs it
    with ``--run-dir runs``."""
    nb = notebook("%load_ext colab_resilience", "seed = 0", "%%replay\nimport random, time\nrng = random.Random(seed)\nh = []",
                  "%%resilient --save h,rng\nfor i in resume_range(20):\n    time.sleep(0.1); h.append(rng.random())",
                  "twin = random.Random(seed)\nprint('RESULT', seed, h == [twin.random() for _ in range(20)])",
                  tags={1: ["parameters"]})
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    return [sys.executable, "-m", "colab_resilience", "run", "in.ipynb", "-o", "out.ipynb", "--run-dir", "runs",
            "--no-progress", "--no-standby"]


def test_cli_a_refusal_says_the_command_that_forgets_the_run_and_colab_resilience_reset_does(tmp_path):
    """A headless run stopped pending (its cell past --cell-timeout), then the same command with
    another -p seed: the resume is refused (it would replay the run's `seed = 0` over this one's),
    and the line says what a headless user does, `colab-resilience reset RUN --run-dir runs` and
    the command again, not `%resilience reset RUN` and "run this cell again", which no one can do
    there. That command forgets the run, and the command then trains the new seed's run from its
    start: the uninterrupted run's draws for seed 1."""
    command = _seeded_draws(tmp_path)
    first = subprocess.run(command + ["-p", "seed", "0", "--cell-timeout", "1"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=240)
    assert first.returncode == 1 and "CellTimeoutError" in first.stderr, first.stdout + first.stderr
    refused = subprocess.run(command + ["-p", "seed", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    line = _own_lines(refused.stderr)[-1]
    found = re.fullmatch(r"colab-resilience: cell 4 stopped: colab_resilience: run (\w+) would replay its set-up cell "
                         r"'seed = 0' over seed, which this kernel's set-up cell 'seed = 1' made .*; to start the run "
                         r"over with this kernel's set-up, `colab-resilience reset (\w+) --run-dir runs` and run the "
                         r"command again; to go on with the run's, run the command with the set-up it began with \(the notebook, the -p "
                         r"values\)", line)
    assert found and found[1] == found[2], line
    assert "%resilience" not in line and "this cell" not in line, line
    forgot = cli("reset", found[1], "--run-dir", "runs", cwd=tmp_path)
    assert (forgot.returncode, forgot.stderr) == (0, ""), forgot.stderr
    assert forgot.stdout == f"colab-resilience reset: forgot run-{found[1]} in runs (journal and checkpoints removed)\n"
    assert list((tmp_path / "runs").iterdir()) == []
    again = subprocess.run(command + ["-p", "seed", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert "resumed" not in cell_text(out.cells[4]), cell_text(out.cells[4])
    assert cell_text(out.cells[5]).strip() == "RESULT 1 True", cell_text(out.cells[5])


def test_cli_reset_names_what_is_wrong_in_one_line_and_forgets_nothing_then(tmp_path):
    """`colab-resilience reset` without a run where the folder holds two: which run?, both named
    with their status; a run that is not there; a run a live process holds (a second process
    that took its lock, as a kernel does): refused, exit status 2, nothing removed. Then the run
    named goes, the other stays. Without --run-dir it looks where a notebook's runs are
    (./.colab_resilience), and says where a headless run's are found."""
    nb = notebook("%load_ext colab_resilience", "%%resilient --save a\nfor i in resume_range(2):\n    a = i",
                  "%%resilient --save b\nfor i in resume_range(2):\n    b = i")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    done = cli("run", "in.ipynb", "--run-dir", "runs", "--no-progress", "--no-standby", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    runs = sorted(p.name.removeprefix("run-") for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 2, runs

    def refused(*args: str) -> str:
        r = cli("reset", *args, cwd=tmp_path, env={"COLAB_RESILIENCE_RUN_DIR": ""})  # (set for this suite)
        assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
        assert sorted(p.name.removeprefix("run-") for p in (tmp_path / "runs").iterdir()) == runs  # nothing removed
        return r.stderr.strip()

    which = refused("--run-dir", "runs")
    assert re.fullmatch(r"colab-resilience reset: which run\? runs holds 2 runs \((\w+) \(done\), (\w+) \(done\), the "
                        r"newest first\); name it: colab-resilience reset RUN --run-dir runs", which), which
    assert sorted(re.findall(r"(\w+) \(done\)", which)) == runs, which
    assert refused("nope", "--run-dir", "runs") == (
        f"colab-resilience reset: no run 'nope' in runs (runs: {which.split('(', 1)[1].split(', the newest')[0]})")
    assert refused() == (f"colab-resilience reset: no runs in {tmp_path / '.colab_resilience'}: no such folder (a run "
                         "of `colab-resilience run --run-dir DIR`: add --run-dir DIR)")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from colab_resilience.lock import RunLock\n"
         f"lock = RunLock({str(tmp_path / 'runs' / ('run-' + runs[0]))!r}).acquire(); print('held', flush=True); "
         "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert refused(runs[0], "--run-dir", "runs") == (
            f"colab-resilience reset: run directory runs/run-{runs[0]} is in use by process {holder.pid} (a kernel "
            "that runs it): stop it first, then reset")
    finally:
        holder.kill()
        holder.wait()
    forgot = cli("reset", f"run-{runs[0]}", "--run-dir", "runs", cwd=tmp_path)
    assert forgot.returncode == 0, forgot.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [f"run-{runs[1]}"]


def test_cli_a_run_another_key_signed_is_named_and_resume_trust_goes_on_with_it(tmp_path):
    """A headless run left pending (its cell past --cell-timeout) in a --run-dir that outlives the
    machine (Drive), then the same command under a new installation key (a new Colab VM): the run
    id is an HMAC under the key, so the command trains from the beginning, to the uninterrupted
    result, and says which run the old key signed and the commands that go on with it. `show`
    prints the set-up cells it replays and runs nothing; `resume` without --trust refuses; --trust
    refuses while this key's own run of the cell is there; after `reset` of that one it prints the
    set-up cells, signs the run under this key's id, and the command then goes on from its
    checkpoint, to the same result."""
    command = _seeded_draws(tmp_path) + ["-p", "seed", "0"]
    first = subprocess.run(command + ["--cell-timeout", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert first.returncode == 1 and "CellTimeoutError" in first.stderr, first.stdout + first.stderr
    (old,) = [p.name.removeprefix("run-") for p in (tmp_path / "runs").iterdir()]
    home = {"COLAB_RESILIENCE_HOME": str(tmp_path / "new-vm-home")}
    afresh = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=dict(os.environ, **home))
    assert afresh.returncode == 0, afresh.stdout + afresh.stderr
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert "resumed" not in cell_text(out.cells[4]) and cell_text(out.cells[5]).strip() == "RESULT 0 True"
    said = [line for line in afresh.stderr.splitlines() if f"run {old} " in line]
    assert said == [
        f"[cell 4] colab_resilience: run {old} of this cell in {tmp_path / 'runs'}, pending, was written under another "
        "installation key (another machine, a new Colab VM, a lost key), so this cell begins a run of its own from the "
        f"beginning; to go on with that one instead, review it with `colab-resilience show {old} --run-dir runs`, then "
        f"`colab-resilience resume --trust {old} --run-dir runs` and run the command again; `colab-resilience reset {old} "
        "--run-dir runs` forgets it"], afresh.stderr
    (new,) = [p.name.removeprefix("run-") for p in (tmp_path / "runs").iterdir() if p.name != f"run-{old}"]

    def runs(*args: str) -> subprocess.CompletedProcess:
        return cli(*args, "--run-dir", "runs", cwd=tmp_path, env=home)

    setup = [f"colab_resilience: run {old} replays 3 set-up cells:", "---- set-up cell 1 of 3 ----", "seed = 0",
             "---- set-up cell 2 of 3 ----", "# Parameters", "seed = 0", "---- set-up cell 3 of 3 ----", "%%replay",
             "import random, time", "rng = random.Random(seed)", "h = []", "---- end of the set-up cells ----"]
    shown = runs("show", old)
    assert shown.returncode == 0 and shown.stdout.splitlines()[:len(setup)] == setup, shown.stdout + shown.stderr
    assert shown.stdout.splitlines()[-1] == (
        f"colab-resilience show: nothing was run; `colab-resilience resume --trust {old} --run-dir runs` marks the run to "
        "go on when `colab-resilience run NOTEBOOK --run-dir runs` (or papermill's resilient engine with that run "
        "directory) runs its notebook again; `colab-resilience reset "
        f"{old} --run-dir runs` forgets it")
    untrusted = runs("resume", old)
    assert (untrusted.returncode, untrusted.stdout) == (2, ""), untrusted.stdout + untrusted.stderr
    assert untrusted.stderr == (
        f"colab-resilience resume: run {old} was written under another installation key (another machine, a new Colab "
        "VM, a lost key), so nothing of it runs here unless you vouch for it: review it with `colab-resilience show "
        f"{old} --run-dir runs`, then `colab-resilience resume --trust {old} --run-dir runs`\n")
    refused = runs("resume", "--trust", old)
    assert (refused.returncode, refused.stdout) == (2, ""), refused.stdout + refused.stderr
    assert refused.stderr.startswith(f"colab-resilience resume: the cell of run {old} has a run of this installation's "
                                     f"already, {new} (runs: "), refused.stderr
    assert refused.stderr.endswith(f"forget that one first: colab-resilience reset {new} --run-dir runs, then resume "
                                   "--trust again\n"), refused.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted([f"run-{old}", f"run-{new}"])  # as they were
    assert runs("reset", new).returncode == 0
    trusted = runs("resume", "--trust", old)
    assert (trusted.returncode, trusted.stderr) == (0, ""), trusted.stdout + trusted.stderr
    lines = trusted.stdout.splitlines()
    assert lines[:len(setup)] == setup, lines
    kept = len(list((tmp_path / "runs" / f"run-{new}" / "checkpoints").glob("ckpt-*")))  # the last two, or one
    values = "1 value" if kept == 1 else f"{kept} values"
    at = lines.index(f"colab_resilience: and unpickles {values} that this installation did not sign:")
    assert all(re.fullmatch(r"  rng: random\.Random \(in ckpt-\d+\)", line) for line in lines[at + 1:-2]), lines
    assert lines[-2:] == [
        f"colab-resilience resume: run {old} is signed with this installation's key now, as run {new} (journal and "
        f"{kept} checkpoint{'s' if kept > 1 else ''})",
        f"colab-resilience resume: run {new} goes on at {_resume_at(lines[-1])} when `colab-resilience run NOTEBOOK "
        "--run-dir runs` (or papermill's resilient engine with that run directory) runs its notebook again (the set-up "
        "cells above run first); nothing was run here; "
        f"`colab-resilience reset {new} --run-dir runs` forgets it"], lines
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [f"run-{new}"]
    again = runs("resume", new)
    assert (again.returncode, again.stdout) == (0, f"colab-resilience resume: run {new} is pending already: it goes on "
                                                    f"at {_resume_at(lines[-1])} when `colab-resilience run NOTEBOOK "
                                                    "--run-dir runs` (or papermill's resilient engine with that run "
                                                    "directory) runs its notebook again; nothing was run\n"), \
        again.stdout + again.stderr
    resumed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=dict(os.environ, **home))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert cell_text(out.cells[4]).strip().endswith(f"continuing at {_resume_at(lines[-1])}"), cell_text(out.cells[4])
    assert cell_text(out.cells[5]).strip() == "RESULT 0 True", cell_text(out.cells[5])
    assert f"run {old}" not in resumed.stderr, resumed.stderr


def _resume_at(line: str) -> str:
    """Where a run goes on, as `colab-resilience resume` said it: "i=9"."""
    return re.search(r" goes on at (\S+) ", line)[1]


def _a_bug_at_12(tmp_path) -> None:
    """``tmp_path/in.ipynb``: 20 seeded draws saved with their generator, each printed, and a
    ValueError at draw 12 while ``tmp_path/fixed`` does not exist; a last cell prints whether the
    draws are the uninterrupted run's."""
    nb = notebook("%load_ext colab_resilience", "%%replay\nimport os, random, time\nrng = random.Random(0)\nh = []",
                  "%%resilient --save h,rng\nfor i in resume_range(20):\n    time.sleep(0.02); h.append(rng.random())\n"
                  "    print('draw', i)\n    if i == 12 and not os.path.exists('fixed'):\n        raise ValueError('a bug')",
                  "twin = random.Random(0)\nprint('RESULT', h == [twin.random() for _ in range(20)])")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")


def test_cli_resume_goes_on_with_a_run_an_error_stopped_from_its_checkpoint(tmp_path):
    """An error in the %%resilient cell stops a headless run; its line names `colab-resilience
    resume RUN --run-dir runs`, not `%resilience resume`. That command marks the run to go on, and
    the command run again goes on from its checkpoint, past the fixed error, to the uninterrupted
    run's draws, the draws before the error not drawn again (also where the journal lags a
    checkpoint behind the newest). The finished run resumed the same way puts back its final state
    and its cell draws nothing."""
    _a_bug_at_12(tmp_path)
    command = ["run", "in.ipynb", "-o", "out.ipynb", "--run-dir", "runs", "--no-progress", "--no-standby"]
    stopped = cli(*command, cwd=tmp_path)
    assert stopped.returncode == 1 and "ValueError: a bug" in stopped.stderr, stopped.stderr
    (run,) = [p.name.removeprefix("run-") for p in (tmp_path / "runs").iterdir()]
    said = (f"colab_resilience: run {run} stopped by ValueError; to go on anyway: `colab-resilience resume {run} "
            "--run-dir runs`, then run the command again: it goes on at 12")
    assert f"[cell 2] {said}" in stopped.stderr.splitlines(), stopped.stderr
    assert said in cell_text(nbformat.read(tmp_path / "out.ipynb", 4).cells[2]).splitlines()  # the notebook says the same
    # the journal one checkpoint behind, as a kill between LATEST and the journal's write leaves it:
    # resume says, and the run goes on from, the newest checkpoint
    from colab_resilience.journal import Journal
    from colab_resilience.signing import load_or_create_key

    j = Journal.load(tmp_path / "runs" / f"run-{run}", key=load_or_create_key())
    older = sorted(p.name for p in (tmp_path / "runs" / f"run-{run}" / "checkpoints").glob("ckpt-*"))[0]
    assert (j.resume_at, j.last_checkpoint != older) == ("12", True), (j.resume_at, j.last_checkpoint, older)
    j.last_checkpoint, j.resume_at = older, "11"
    j.save()
    marked = cli("resume", run, "--run-dir", "runs", cwd=tmp_path)
    assert (marked.returncode, marked.stderr) == (0, ""), marked.stderr
    assert marked.stdout == (f"colab-resilience resume: run {run} goes on at 12 when `colab-resilience run NOTEBOOK "
                             "--run-dir runs` (or papermill's resilient engine with that run directory) runs its "
                             "notebook again (the set-up cells run first); nothing was run here; `colab-resilience "
                             f"reset {run} --run-dir runs` forgets it\n")
    (tmp_path / "fixed").touch()
    again = cli(*command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    draws = re.findall(r"draw (\d+)", cell_text(out.cells[2]))
    assert draws == [str(i) for i in range(12, 20)], cell_text(out.cells[2])  # from its checkpoint at 12
    assert cell_text(out.cells[3]).strip() == "RESULT True", cell_text(out.cells[3])
    # a finished run resumed: its final state comes back, its cell does not draw again
    finished = cli("resume", run, "--run-dir", "runs", cwd=tmp_path)
    assert finished.stdout == (f"colab-resilience resume: run {run} is done: when `colab-resilience run NOTEBOOK --run-dir "
                               "runs` (or papermill's resilient engine with that run directory) runs its notebook again, "
                               "its final state comes back and its cell is not run again "
                               f"(the set-up cells run first); nothing was run here; `colab-resilience reset {run} "
                               "--run-dir runs` forgets it\n"), finished.stdout + finished.stderr
    last = cli(*command, cwd=tmp_path)
    assert last.returncode == 0, last.stderr
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert "draw" not in cell_text(out.cells[2]) and "every loop had finished" in cell_text(out.cells[2])
    assert cell_text(out.cells[3]).strip() == "RESULT True", cell_text(out.cells[3])


def test_papermill_keeps_runs_in_colab_resilience_run_dir_and_resume_goes_on_with_one(tmp_path):
    """papermill's command line (`papermill in.ipynb out.ipynb --engine resilient`), an error at
    draw 12: without $COLAB_RESILIENCE_RUN_DIR the run went with a temporary folder, and the
    notebook says so (it advised `%resilience resume`, a magic nobody can type there, for a run
    that was gone); with it, the run is kept there, the notebook names `colab-resilience resume
    RUN --run-dir DIR`, and after that command papermill run again goes on from the checkpoint,
    drawing 12..19 only, to the uninterrupted run's draws."""
    _a_bug_at_12(tmp_path)

    def papermill(run_dir: str) -> tuple[subprocess.CompletedProcess, str]:
        r = subprocess.run([sys.executable, "-m", "papermill", "in.ipynb", "out.ipynb", "--engine", "resilient",
                            "--no-progress-bar"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                           env=dict(os.environ, COLAB_RESILIENCE_RUN_DIR=run_dir))
        # (papermill puts a cell that names the failed one first, when one failed)
        (cell,) = [c for c in nbformat.read(tmp_path / "out.ipynb", 4).cells if c.source.startswith("%%resilient")]
        return r, cell_text(cell)

    gone, said = papermill("")
    assert gone.returncode != 0 and "ValueError: a bug" in gone.stderr, gone.stderr
    (line,) = [line for line in said.splitlines() if line.startswith("colab_resilience: ")]
    assert re.fullmatch(r"colab_resilience: run \w+ stopped by ValueError; to go on anyway: %resilience resume \w+, then "
                        r"run this cell again: it goes on at 12 \(headless, without \$COLAB_RESILIENCE_RUN_DIR: the run "
                        r"went with this command's temporary folder; the command run again starts it afresh\)", line), line
    runs = str(tmp_path / "runs")
    stopped, said = papermill(runs)
    assert stopped.returncode != 0 and "ValueError: a bug" in stopped.stderr, stopped.stderr
    (run,) = [p.name.removeprefix("run-") for p in (tmp_path / "runs").iterdir()]
    assert (f"colab_resilience: run {run} stopped by ValueError; to go on anyway: `colab-resilience resume {run} --run-dir "
            f"{runs}`, then run the command again: it goes on at 12") in said.splitlines(), said
    assert cli("resume", run, "--run-dir", runs).returncode == 0
    (tmp_path / "fixed").touch()
    again, said = papermill(runs)
    assert again.returncode == 0, again.stderr
    assert re.findall(r"draw (\d+)", said) == [str(i) for i in range(12, 20)], said
    assert cell_text(nbformat.read(tmp_path / "out.ipynb", 4).cells[3]).strip() == "RESULT True"


def test_papermill_engine(tmp_path, reference):
    """`papermill --engine resilient` runs train.ipynb (its parameters injected by papermill) through
    a SIGKILL in epoch 1 and writes the reference's RESULT and the restart to the notebook; its
    run is kept where the engine option run_dir says."""
    import papermill

    files = {"mark": str(tmp_path / "fault.mark"), "log": str(tmp_path / "events.log")}
    out = papermill.execute_notebook(str(FILES / "train.ipynb"), str(tmp_path / "out.ipynb"), engine_name="resilient",
                                     kernel_name=KERNEL_NAME, parameters={"fault": "sigkill", "fault_epoch": 1, "staging": "off", **files},
                                     progress_bar=False, run_dir=str(tmp_path / "runs"))
    assert [p.name[:4] for p in (tmp_path / "runs").iterdir()] == ["run-"]
    assert result(out) == reference.result
    assert len(out.metadata["colab_resilience"]["restarts"]) == 1
    assert out.metadata["papermill"]["exception"] is None or out.metadata["papermill"]["exception"] is False
    assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]


def test_demo_is_identical_to_the_uninterrupted_run():
    """`colab-resilience demo`: a real OOM recovered in process and a SIGKILL recovered by a restart,
    and the result bit-identical to the uninterrupted run."""
    r = cli("demo", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical to the uninterrupted run: yes (bit for bit)" in r.stdout
    # the real OOM is recovered in process: a smaller batch fits once the failed attempt's batch,
    # left bound to a global, is released (how many halvings depends on the machine's libraries:
    # 2 here, 3 with a CUDA build of torch)
    assert "batch_size 8192 → 4096; retry 1/3" in r.stdout
    assert re.search(r"OOM recoveries in process \(--shrink\) +[123] +0\n", r.stdout), r.stdout
    assert re.search(r"kernel restarts +1 +0\n", r.stdout), r.stdout
    assert "restart 1: killed by SIGKILL" in r.stdout


def test_bundled_demo_and_notebooks_copy_are_the_same():
    """The demo notebook shipped in the package is notebooks/demo.ipynb."""
    from importlib import resources

    bundled = (resources.files("colab_resilience") / "notebooks" / "demo.ipynb").read_bytes()
    assert json.loads(bundled) == json.loads((Path(__file__).parent.parent / "notebooks" / "demo.ipynb").read_bytes())


def test_the_command_starts_without_building_jsonschemas_iri_parsers():
    """nbformat imports jsonschema, which imports rfc3987-syntax where it is installed (Jupyter
    Server's jupyter-events pulls it in, as in this suite's environments): some 35 Lark parsers
    built at import, most of the command's 2.5 s start before any work (0.7 s without). The
    command does without that one checker (no notebook schema checks an IRI), and still refuses
    a notebook that breaks the schema (test_cli_bad_input_exits_2_with_one_line)."""
    import importlib.util

    if importlib.util.find_spec("rfc3987_syntax") is None:
        pytest.skip("rfc3987-syntax is not installed here (Jupyter Server's jupyter-events installs it)")
    r = subprocess.run([sys.executable, "-c", "import sys, colab_resilience.cli, nbformat\n"
                        "print(sorted(m for m, v in sys.modules.items() if v and m.split('.')[0] in ('lark', 'rfc3987_syntax')))"],
                       capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
