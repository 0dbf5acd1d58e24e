"""The supervisor: real kernel deaths (inside and outside), a real OOM, exact resume, budgets,
ordinary errors, the CLI's exit codes and messages, -p parameters, the papermill engine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import nbformat
import pytest

from colab_resilience import driver
from kernels import HOST_OOM, KERNEL_NAME, cell_text, notebook

pytestmark = pytest.mark.kernel

SETUP = "%%replay\nimport os, signal, time, torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)"
TRAIN = (
    "%%resilient --save model,opt,history\n"
    "history = []\n"
    "for epoch in resume_range(5):\n"
    "    loss = model(torch.randn(16, 8)).pow(2).mean()\n"
    "    opt.zero_grad(); loss.backward(); opt.step()\n"
    "    {fault}\n"
    "    history.append(round(loss.item(), 6))\n"
)
RESULT = "print('RESULT', history, [round(x, 6) for x in model.weight.flatten().tolist()])"


def result_line(nb) -> str:
    return next(l for l in cell_text(nb.cells[-1]).splitlines() if l.startswith("RESULT"))


def run(nb, tmp_path, **kw):
    kw.setdefault("kernel_name", KERNEL_NAME)
    return driver.run_notebook(nb, tmp_path / "out.ipynb", cwd=tmp_path, run_dir=tmp_path / "runs", **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    nb = notebook(SETUP, TRAIN.format(fault="pass"), RESULT)
    assert run(nb, tmp).status == 0
    return result_line(nb)


def test_sigkill_from_inside_resumes_exactly(tmp_path, reference):
    mark = tmp_path / "mark"
    fault = f"if epoch == 2 and not os.path.exists({str(mark)!r}):\n        open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)"
    nb = notebook("%load_ext colab_resilience", SETUP, TRAIN.format(fault=fault), RESULT)
    result = run(nb, tmp_path)
    assert result.status == 0, result.message
    assert [r.exit_code for r in result.restarts] == [-9]
    assert result_line(nb) == reference
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    text = cell_text(out.cells[2])
    # the driver's standby kernel took over (tests/test_standby.py: its warm-up, priority, OOM score)
    assert "colab_resilience: the kernel died (killed by SIGKILL, likely the OS out-of-memory killer); switched to the standby kernel, replayed 1 cell and resumed in" in text
    assert "continuing at 2" in text
    meta = out.metadata["colab_resilience"]
    assert meta["status"] == "done" and meta["restarts"][0]["cell"] == 2 and meta["restarts"][0]["replayed"] == 1


def test_sigkill_from_outside_by_pid_resumes_exactly(tmp_path, reference):
    pidfile = tmp_path / "pid"
    fault = f"open({str(pidfile)!r}, 'a').write(f'{{os.getpid()}} {{epoch}}\\n'); time.sleep(0.3)"
    nb = notebook(SETUP, TRAIN.format(fault=fault), RESULT)
    killed = []

    def killer():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = pidfile.read_text().split("\n") if pidfile.exists() else []
            done = [l.split() for l in lines if l.strip()]
            if done and int(done[-1][1]) >= 1:
                pid = int(done[-1][0])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    result = run(nb, tmp_path, standby=False)  # the cold path: a kernel restarted by jupyter_client
    t.join()
    assert killed and result.status == 0, result.message
    assert len(result.restarts) == 1
    assert "restarted it, replayed 1 cell and resumed in" in cell_text(nb.cells[1])
    assert json.loads(nbformat.writes(nb))["metadata"]["colab_resilience"]["restarts"][0]["kernel"] == "restarted"
    assert result_line(nb) == reference
    pids = {l.split()[0] for l in pidfile.read_text().splitlines()}
    assert len(pids) == 2  # the loop went on in a new kernel


@pytest.mark.timeout(120)
def test_a_death_between_cells_while_the_driver_restores_is_recovered_at_once(tmp_path, reference):
    """The kernel dies while the driver, not a cell, is talking to it: in the restore that follows
    a replay. The driver notices within its poll (it used to wait out a 600 s timeout), counts a
    restart, and the run ends identical to the uninterrupted one."""
    boom, later = tmp_path / "boom", tmp_path / "later"
    boom.touch()
    patch = (  # part of the replayed set-up: the first restore after a restart kills the kernel
        "\nimport colab_resilience.kernelapi as _m\n"
        "_restore = _m.restore_finished_runs\n"
        "def _boom():\n"
        f"    if os.path.exists({str(boom)!r}):\n"
        f"        os.unlink({str(boom)!r}); os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _restore()\n"
        "_m.restore_finished_runs = _boom"
    )
    kill_once = (f"if not os.path.exists({str(later)!r}):\n"
                 f"    open({str(later)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")
    nb = notebook("%load_ext colab_resilience", SETUP + patch, TRAIN.format(fault="pass"), kill_once + RESULT)
    t0 = time.perf_counter()
    result = run(nb, tmp_path)
    assert result.status == 0, result.message
    assert time.perf_counter() - t0 < 90
    assert [r.cell for r in result.restarts] == [3, 3]
    assert "died while replaying" in result.restarts[0].reason
    assert result.restarts[1].restored == ["model", "opt", "history"]
    assert not boom.exists()
    assert result_line(nb) == reference


def test_real_oom_beyond_retries_restarts_and_resumes(tmp_path, reference):
    # a real allocator failure, in the first kernel only
    fault = f"if epoch == 3 and not os.path.exists({str(tmp_path / 'm')!r}):\n        open({str(tmp_path / 'm')!r}, 'w').write(str(os.getpid()))\n    if epoch == 3 and open({str(tmp_path / 'm')!r}).read() == str(os.getpid()):\n        " + HOST_OOM
    nb = notebook(SETUP, TRAIN.format(fault=fault).replace("--save model,opt,history", "--save model,opt,history --retries 1"), RESULT)
    result = run(nb, tmp_path)
    assert result.status == 0, result.message
    assert [r.exit_code for r in result.restarts] == [75]
    assert result.restarts[0].reason == "OOM (DefaultCPUAllocator: can't allocate memory) after 2 attempts"
    assert result.restarts[0].iteration == "3"
    assert result_line(nb) == reference


def test_restart_budget_spent_exits_3_and_later_cells_do_not_run(tmp_path):
    nb = notebook(SETUP, "%%resilient --max-restarts 1\nos.kill(os.getpid(), signal.SIGKILL)", "print('not reached')")
    result = run(nb, tmp_path, max_restarts=5)
    assert result.status == driver.EXIT_BUDGET
    # the first death is counted by the second kernel; the third kernel finds the budget spent
    assert len(result.restarts) == 2
    assert "failed: restart budget spent (1/1 restarts) and the kernel died without warning" in result.message
    assert result.message.startswith("colab-resilience: cell 1 failed: UsageError: colab_resilience: run ")
    assert nb.cells[2].get("outputs", []) == []


def test_a_crash_loop_at_start_up_stops_at_the_driver_budget(tmp_path):
    nb = notebook("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "print('not reached')")
    started = time.monotonic()
    result = run(nb, tmp_path, max_restarts=2)
    assert result.status == driver.EXIT_BUDGET
    assert len(result.restarts) == 2
    assert "restart budget spent (2/2 restarts): the kernel died again in cell 0 (killed by SIGKILL" in result.message
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
    startup_killer(once=True)
    nb = notebook("print('ran', 1 + 1)")
    result = run(nb, tmp_path)
    assert result.status == 0, result.message
    assert [r.reason for r in result.restarts] == ["died while starting: killed by SIGKILL, likely the OS out-of-memory killer"]
    assert "ran 2" in cell_text(nb.cells[0])


def test_cli_a_kernel_that_never_starts_exits_3_with_a_report_not_a_traceback(tmp_path, startup_killer):
    startup_killer(once=False)
    nb = notebook("print('not reached')")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    r = cli("run", str(tmp_path / "in.ipynb"), "--max-restarts", "1", "--no-progress")
    assert r.returncode == driver.EXIT_BUDGET, r.stderr
    assert "Traceback" not in r.stderr
    assert ("colab-resilience: restart budget spent (1/1 restarts): the kernel died again in cell 0 "
            "(died while starting: killed by SIGKILL") in r.stderr
    assert "the new kernel died while starting) after" in r.stderr  # the marker does not claim a resume


def test_ordinary_error_is_reported_like_papermill(tmp_path):
    nb = notebook("x = 1", "raise ValueError('bad parameter')", "print('not reached')")
    result = run(nb, tmp_path)
    assert result.status == driver.EXIT_CELL_FAILED and result.failed_cell == 1
    assert result.message == "colab-resilience: cell 1 failed: ValueError: bad parameter"
    out = nbformat.read(tmp_path / "out.ipynb", 4)
    assert out.cells[1].outputs[0].output_type == "error"
    assert out.cells[2].get("outputs", []) == []
    assert out.metadata["colab_resilience"]["status"] == "failed"


def test_parameters_are_injected_after_the_parameters_cell(tmp_path):
    nb = notebook("lr = 0.1\nname = 'a'", "print('PARAMS', lr, name, steps)", tags={0: ["parameters"]})
    result = run(nb, tmp_path, parameters={"lr": driver.resolve_parameter("0.01"), "name": driver.resolve_parameter("b"), "steps": driver.resolve_parameter("3")})
    assert result.status == 0
    assert nb.cells[1].metadata["tags"] == ["injected-parameters"]
    assert "PARAMS 0.01 b 3" in cell_text(nb.cells[2])


def cli(*args, cwd=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "colab_resilience", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def test_cli_runs_a_notebook_with_parameters(tmp_path):
    nb = notebook("n = 1", "print('N', n * 2)", tags={0: ["parameters"]})
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    r = cli("run", str(tmp_path / "in.ipynb"), "-o", str(tmp_path / "o.ipynb"), "-p", "n", "21", "--no-progress", "--log-output", "--no-standby")
    assert r.returncode == 0, r.stderr
    assert "[cell 2] N 42" in r.stdout
    assert "colab-resilience: done in" in r.stdout and "with 0 kernel restarts; wrote" in r.stdout


@pytest.mark.parametrize(
    "make,args,expected",
    [
        (None, ["run", "missing.ipynb"], "colab-resilience: missing.ipynb: no such notebook; give the path of an .ipynb file"),
        ("{not json", ["run", "bad.ipynb"], "colab-resilience: bad.ipynb: not a readable notebook (Notebook does not appear to be JSON"),
        ("nb", ["run", "good.ipynb", "--kernel", "no-such-kernel"], "colab-resilience: no kernel named 'no-such-kernel'; list them with `jupyter kernelspec list`"),
        ("nb", ["run", "good.ipynb", "-p", "2x", "1"], "colab-resilience: -p 2x: not a Python variable name"),
        ("nb", ["run", "good.ipynb", "--max-restarts", "-1"], "argument --max-restarts: cannot be negative (got -1)"),
        (None, ["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, make, args, expected):
    if make == "nb":
        nbformat.write(notebook("1"), tmp_path / "good.ipynb")
    elif make is not None:
        (tmp_path / "bad.ipynb").write_text(make)
    r = cli(*args, cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert expected in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # no usage block, no empty progress bar
    assert not list(tmp_path.glob("*.out.ipynb"))  # nothing ran: no output that looks like a result


def test_papermill_engine(tmp_path, reference):
    import papermill

    mark = tmp_path / "mark"
    fault = f"if epoch == 1 and not os.path.exists({str(mark)!r}):\n        open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)"
    nb = notebook("steps = 5", SETUP, TRAIN.format(fault=fault).replace("resume_range(5)", "resume_range(steps)"), RESULT,
                  tags={0: ["parameters"]})
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, tmp_path / "in.ipynb")
    out = papermill.execute_notebook(str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"), engine_name="resilient",
                                     kernel_name=KERNEL_NAME, parameters={"steps": 5}, progress_bar=False)
    assert result_line(out) == reference
    assert len(out.metadata["colab_resilience"]["restarts"]) == 1
    assert out.metadata["papermill"]["exception"] is None or out.metadata["papermill"]["exception"] is False


def test_demo_is_identical_to_the_uninterrupted_run():
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
    from importlib import resources
    from pathlib import Path

    bundled = (resources.files("colab_resilience") / "notebooks" / "demo.ipynb").read_bytes()
    assert json.loads(bundled) == json.loads((Path(__file__).parent.parent / "notebooks" / "demo.ipynb").read_bytes())


@pytest.mark.parametrize("name", ["tutorial.ipynb", "quickstart.ipynb"])
def test_shipped_notebooks_run_headless(tmp_path, name):
    from pathlib import Path

    nb = nbformat.read(Path(__file__).parent.parent / "notebooks" / name, 4)
    result = run(nb, tmp_path)
    assert result.status == 0, result.message
    text = cell_text(nb.cells[-1])
    if name == "tutorial.ipynb":
        assert "final accuracy" in text and ": done; restarts 0/3" in text
    else:
        assert "trained 4 steps with batch_size=2048" in text
