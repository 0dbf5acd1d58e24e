"""`colab-resilience check`: a notebook run uninterrupted and with injected faults, compared.

Faults are real: SIGKILLs of the kernel between safe points, just before a save and in the middle
of one, and out-of-memory errors raised in the main thread while it runs a %%resilient cell.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import harness

pytestmark = pytest.mark.kernel


def check(*args: str, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colab_resilience", "check", *args], capture_output=True,
                          text=True, cwd=cwd, env=harness.child_env(), timeout=timeout)


@pytest.mark.one_stack("colab")
def test_a_notebook_that_resumes_exactly_passes_every_kind_of_fault():
    """The nested-loop notebook, a DataLoader in it: each of four faults (a kill between safe
    points, an OOM, a kill during a save, aimed into its background write by the timeline of the
    uninterrupted run, a kill just before one) ends identical: exit status 0."""
    r = check(str(harness.FILES / "resume_nested.ipynb"), "-p", "use_loader", "True", "--faults", "4", "--seed", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"colab-resilience check: {harness.FILES / 'resume_nested.ipynb'}: 23 safe points")  # the loop start, 3 × (6 + 1), the cell's end
    faults = [line for line in lines if line.startswith("  fault ")]
    assert len(faults) == 4 and all(": identical (" in line for line in faults), r.stdout
    kinds = ("into the background write", "just before the save", "SIGKILL", "an out-of-memory error")
    assert ["SIGKILL", "an out-of-memory error", "into the background write", "just before the save"] == [
        next(k for k in kinds if k in line) for line in faults]
    assert lines[-1].endswith("identical after each of 4 faults (seed 1)")


@pytest.mark.one_stack("colab")
def test_a_loop_that_mutates_an_unsaved_global_fails_naming_it():
    """steps_done is counted by the loop and not saved: after a restart or a rollback it is wrong,
    and check names it with both values, and the cell that printed it otherwise by its first line
    and the first line it printed otherwise: exit status 1. What the first run said would make a
    resumed run differ is shown first, and under a run that differs, what the package said in it."""
    r = check(str(harness.FILES / "check_unsaved.ipynb"), "--faults", "2", "--seed", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DIFFERS: steps_done differs (uninterrupted 12, faulted " in r.stdout
    assert ("the printed output of cell 5 (\"print('steps done:', steps_done)\") differs, first at 'steps done: "
            in r.stdout), r.stdout
    assert ("\n  its first run said: colab_resilience: the resume_range loop carries steps_done from one iteration "
            "to the next without --save") in r.stdout, r.stdout
    assert "\n    it said: colab_resilience: the kernel died (killed by SIGKILL)" in r.stdout, r.stdout  # that run's
    assert r.stdout.splitlines()[-1].endswith("faulted runs differ (seed 0)")


def check_cells(path: Path, cells: list[str], *args: str) -> subprocess.CompletedProcess:
    """``check`` of a notebook of ``cells`` written to ``path``, in the tests' kernel."""
    nb = harness.notebook(*cells)
    nb.metadata["kernelspec"] = {"name": harness.KERNEL_NAME, "language": "python", "display_name": "tests"}
    nbformat.write(nb, path)
    return check(str(path), *args)


def _printed(notebook: Path) -> str:
    """What the cells of an executed notebook printed, all together."""
    return "\n".join(harness.cell_text(c) for c in nbformat.read(notebook, 4).cells if c.cell_type == "code")


def test_the_shipped_tutorial_passes(tmp_path):
    """It passes, and says nothing of what its first run said: its %%resilient cells warn of
    nothing (what `%resilience status` prints in its later cells is no warning). Its run without
    faults (kept) ran to its end as users see it run. --keep names a folder relative to the
    command's folder, not the notebook's, where its kernels run (it stopped with "cannot check:
    ... FileNotFoundError: 'kept/timeline.count'")."""
    r = check(str(harness.REPO) + "/notebooks/tutorial.ipynb", "--faults", "2", "--kernel", harness.KERNEL_NAME,
              "--keep", "kept", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "its first run said" not in r.stdout, r.stdout
    text = _printed(tmp_path / "kept" / "uninterrupted.ipynb")
    assert "final accuracy" in text and ": done; restarts 0/3" in text, text


@pytest.mark.one_stack("colab")
def test_the_shipped_quickstart_passes_and_says_what_it_did_not_compare(tmp_path):
    """The quickstart reads its kernel's memory size (`vm`) in a plain cell before the training.
    That size is often, not always, the same in two kernels; a clock read there (`started`, added
    here) always differs. The training changes neither, so neither is compared, and check says so
    for each name that differed; with an out-of-memory error injected (fault 2 of seed 0) it used to
    report "vm differs". (This test once asserted that vm always differs: a CI run where it did not
    failed it.)"""
    nb = nbformat.read(Path(harness.REPO) / "notebooks" / "quickstart.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "VmSize" in c.source)
    # and prints it: what a set-up cell prints, before any fault, is not compared either (a
    # library's log line with its time: TensorFlow prints one); a NumPy Generator is digested
    # by its state, not by its repr (which holds its address: it differed in every kernel)
    cell.source = ("import time, numpy as np\nstarted = time.time_ns()\nprint('set up at', started)\n"
                   "generator = np.random.default_rng(0)\n" + cell.source)
    nbformat.write(nb, tmp_path / "quickstart.ipynb")
    # a parameter given: check puts a cell for it first (the notebook has no parameters cell)
    r = check(str(tmp_path / "quickstart.ipynb"), "--faults", "2", "--kernel", harness.KERNEL_NAME,
              "-p", "batch_size", "8192", "--keep", str(tmp_path / "kept"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr.startswith("colab-resilience check: -p batch_size: the notebook has no cell tagged 'parameters', "
                               "so it is set in a cell put first, and a cell that sets it again wins"), r.stderr
    # as users see it run: its memory cap's OOMs shrink the batch twice, and the training ends
    text = _printed(tmp_path / "kept" / "uninterrupted.ipynb")
    assert "trained 4 steps with batch_size=2048" in text, text
    assert "an out-of-memory error" in r.stdout and "DIFFERS" not in r.stdout, r.stdout
    skipped = re.findall(r"^    not compared: (.*) \(set before the training", r.stdout, re.MULTILINE)
    assert skipped and all("started" in names.split(", ") for names in skipped), r.stdout
    assert all(set(names.split(", ")) <= {"started", "vm"} for names in skipped), r.stdout
    printed = re.findall(r"^    not compared: the printed output of cell (\d+) \(printed before the training, where no "
                         r"fault strikes", r.stdout, re.MULTILINE)
    # numbered from 0 as in the notebook, markdown cells counted, not the cell check put first
    assert printed == ["5", "5"], r.stdout


@pytest.mark.one_stack("colab")
def test_the_demo_passes_though_it_really_runs_out_of_memory_and_writes_in_its_folder(tmp_path):
    """The demo notebook caps its kernel's memory (a real OOM: --shrink halves the batch until it
    fits), kills itself once in epoch 2 (a marker file in its folder says it did) and logs epochs
    to a file there. The cap is a %%replay cell: a kernel that takes over after the fault has it
    too (when it was not replayed, a kill before the first OOM let the new kernel train at 8192:
    "batch_size differs"); a kernel that took over unbinds a failed attempt's batch before its
    retry (it kept it: the retry shrank to 1024). The set-up cell's `data` (a memory size) is read
    again in each new kernel, and so is a clock read added to that cell here (`started`; the memory
    size is often the same in two kernels, the time never): not compared, and said so. Safe points
    are counted across the kernels of a run, 6 in all (before, each kernel counted from 1, and the
    timeline mixed the kernel that killed itself with the one that took over: "of 3"). The check
    writes nothing in the notebook's folder, and names what the runs wrote there."""
    folder = tmp_path / "project"
    folder.mkdir()
    nb = nbformat.read(Path(harness.REPO) / "notebooks" / "demo.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "VmData" in c.source)
    cell.source += "\nstarted = time.time_ns()"
    train = next(c for c in nb.cells if "resume_range" in c.source)  # and a log of its own, beside the marker
    train.source = train.source.replace("    print(f'epoch", "    with open(os.path.join(workdir, 'epochs.log'), 'a') as f:\n"
                                        "        f.write(f'{epoch}\\n')\n    print(f'epoch")
    assert "epochs.log" in train.source
    nbformat.write(nb, folder / "demo.ipynb")
    (folder / "epochs.log").write_text("from before\n")
    r = check(str(folder / "demo.ipynb"), "--faults", "2", "--seed", "14", "--kernel", harness.KERNEL_NAME,
              "--keep", str(folder / "kept"))  # check's own folder: not named as the runs'

    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"fault 1/2: SIGKILL [0-9.]+ s after safe point 1 of 6: identical \(", r.stdout), r.stdout
    assert "an out-of-memory error" in r.stdout
    recomputed = re.findall(r"^    not compared: (.*) \(a plain value only set-up cells set, which the kernel that "
                            r"took over ran again", r.stdout, re.MULTILINE)
    assert recomputed and all({"started"} <= set(n.split(", ")) <= {"started", "data"} for n in recomputed), r.stdout
    assert (f"colab-resilience check: the runs wrote epochs.log, killed-once in {folder}: each run after the first "
            "found what the earlier ones had left there") in r.stdout, r.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["demo.ipynb", "epochs.log", "kept", "killed-once"]
    uninterrupted = nbformat.read(folder / "kept" / "uninterrupted.ipynb", 4)
    printed = "".join(o.get("text", "") for c in uninterrupted.cells for o in c.get("outputs", []))
    assert "batch_size 8192 → 4096" in printed and "batch_size 4096 → 2048" in printed  # a real OOM, twice
    assert '"batch_size": 2048' in printed


def test_a_parameter_given_run_is_a_folder_new_and_empty_in_every_run(tmp_path):
    """`-p workdir {run}`, what the line that names the files the runs wrote advises: each run
    finds the folder empty (the runs found the marker an earlier one had left), the path is the
    same in every run (a variable that held it would differ otherwise), nothing is written in the
    notebook's folder, and no line names what the runs wrote there."""
    folder = tmp_path / "project"
    folder.mkdir()
    nb = harness.notebook(
        "%load_ext colab_resilience", "workdir = '.'",
        "import os\nprint('FOUND', sorted(os.listdir(workdir)), workdir)\nopen(os.path.join(workdir, 'marker'), 'w').close()",
        "%%replay\nimport time\nh = []",
        "%%resilient --save h\nfor i in resume_range(4):\n    time.sleep(0.05); h.append(i)", tags={1: ["parameters"]})
    nb.metadata["kernelspec"] = {"name": harness.KERNEL_NAME, "display_name": "t", "language": "python"}
    nbformat.write(nb, folder / "nb.ipynb")
    r = check(str(folder / "nb.ipynb"), "--faults", "2", "-p", "workdir", "{run}", "--keep", str(tmp_path / "kept"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the runs wrote" not in r.stdout and sorted(p.name for p in folder.iterdir()) == ["nb.ipynb"], r.stdout
    found = [line for name in ("uninterrupted", "fault-1", "fault-2")
             for line in harness.cell_text(nbformat.read(tmp_path / "kept" / f"{name}.ipynb", 4).cells[3]).splitlines()]
    assert found == [f"FOUND [] {tmp_path / 'kept' / 'run-folder'}"] * 3, found
    assert (tmp_path / "kept" / "run-folder" / "marker").exists()  # the last run's


def test_the_line_of_what_the_runs_wrote_names_the_parameter_that_names_it(tmp_path):
    """Where the notebook's parameters cell names a folder the runs made (the Trainer's
    `output_dir = "trainer-output"`, `./logs`), the line says `-p output_dir {run}`; a file they
    wrote (`{run}` would make it a folder), a file in a folder they made, the notebook's folder
    itself ('.'), an absolute path or another value is not named."""
    from colab_resilience.check import Folder, parameter_values

    place = Folder(tmp_path)
    (tmp_path / "trainer-output").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "marker").touch()
    place.after_run()
    nb = harness.notebook("output_dir = 'trainer-output'\nlogs = './logs'\nlog = 'logs/run.txt'\nmark = 'marker'\n"
                          "workdir = '.'\nlr = 0.1\nelsewhere = '/tmp/marker'\nsteps = int('3')", tags={0: ["parameters"]})
    assert parameter_values(nb) == {"output_dir": "trainer-output", "logs": "./logs", "log": "logs/run.txt",
                                    "mark": "marker", "workdir": ".", "lr": 0.1, "elsewhere": "/tmp/marker"}
    assert place.note(parameter_values(nb)).endswith(
        "where that matters, check with -p output_dir {run} -p logs {run}: each run then finds that folder new and empty")
    assert place.note({"workdir": "."}).endswith("have the notebook write them in a folder a parameter names, and "
                                                 "check with -p NAME {run}: each run then finds that folder new and empty")


def test_a_notebook_that_fails_without_faults_is_exit_3_and_usage_errors_exit_2(tmp_path):
    nb = harness.load("resume_nested.ipynb")
    harness.insert(nb, "train", "raise ValueError('broken set-up')", "broken")
    nbformat.write(nb, tmp_path / "broken.ipynb")
    r = check(str(tmp_path / "broken.ipynb"), "--faults", "1")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "cannot check: colab-resilience: cell 4 failed: ValueError: broken set-up" in r.stderr
    # a cell after the training, numbered as in the notebook given, not as in the one run (the
    # check's cell before the training added: it said the next number)
    nb = harness.load("resume_nested.ipynb")
    harness.insert(nb, "result", "raise ValueError('broken evaluation')", "broken")
    nbformat.write(nb, tmp_path / "broken_after.ipynb")
    r = check(str(tmp_path / "broken_after.ipynb"), "--faults", "1")
    assert r.returncode == 3, r.stdout + r.stderr
    assert (f"cannot check: colab-resilience: cell {harness.index(nb, 'broken')} failed: ValueError: broken "
            "evaluation") in r.stderr, r.stderr
    r = check(str(tmp_path / "missing.ipynb"))
    assert r.returncode == 2 and "no such notebook" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = check(str(tmp_path / "broken.ipynb"), "--faults", "x")
    assert r.returncode == 2 and "--faults: needs a whole number, like --faults 3 (got 'x')" in r.stderr
    r = check(str(tmp_path / "broken.ipynb"), "--faults", "0")  # it said "identical after each of 0 faults", exit 0
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == ["colab-resilience check: argument --faults: needs at least 1: a check with no "
                                             "fault compares nothing; see `colab-resilience check --help`"], r.stderr


@pytest.mark.parametrize("command", [[], ["run"], ["check"], ["demo"]])
def test_each_commands_help_names_the_magics_as_users_write_them(command, capsys):
    """argparse formats an option's help with %, not a description: `%%%%resilient` written
    there for escaping was shown as typed."""
    from colab_resilience.cli import main

    assert main([*command, "--help"]) == 0
    shown = capsys.readouterr().out
    assert "%%%" not in shown and "colab-resilience" in shown
    if command == ["check"]:
        assert "out-of-memory errors in %%resilient cells" in " ".join(shown.split())


def test_an_injected_oom_never_lands_where_only_clean_up_runs(ip, tmp_path):
    """check's out-of-memory error fires at a line of the cell's code, but not at a `with`
    statement's exit (Python reports the call of `__exit__` at the `with` line; an error raised
    there by the trace function skipped `torch.no_grad()`'s exit and left gradients off for the
    retry, so the tutorial's retry failed with "does not require grad"), nor in what `__exit__`
    calls, nor in a `finally` block: it lands at the next line instead, after the clean-up ran."""
    import torch

    from colab_resilience import execution, faults, oom

    body = ("def evaluate():\n"
            "    with torch.no_grad():\n"
            "        time.sleep(0.3)\n"          # the deadline passes while this sleeps
            "    return 1\n"
            "evaluate()\n")
    ip.user_ns.update(torch=torch, time=__import__("time"))
    codes = execution.compile_body(ip, "%%resilient", body)
    mark = tmp_path / "mark"
    mark.write_text("armed\n")
    faults._oom_after(0.1, str(mark))
    try:
        failure = execution.run_body(ip, codes)
    finally:
        grad_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
    assert failure is not None and "injected by colab-resilience check" in str(failure.exc)
    # said as what it is: not "CUDA out of memory" on a machine without a GPU
    assert oom.classify(failure.exc).label == "out of memory, injected by colab-resilience check"
    assert faults.take_injected()
    assert grad_enabled, "the injected error skipped torch.no_grad()'s exit"
    fired_at = mark.read_text().split("fired ", 1)[1].strip()
    assert fired_at.endswith(":5"), fired_at  # `return 1` (the header is line 1)
    assert faults.cleanup_lines(fired_at.rsplit(":", 1)[0]) == {3}


@pytest.mark.one_stack("colab")
def test_a_fault_that_never_fires_is_aimed_again_not_called_a_difference():
    """resume_planned.ipynb with a planned restart every 2 epochs (%restart_after 2): the kernel
    leaves at safe point 3 of 6 (the end of epoch 2) and a second kernel takes the run over,
    counting on from 4 (the timeline numbers each safe point once, whichever kernel reached it).
    With seed 9, the OOM is first aimed just after safe point 3, where the kernel leaves, so it
    never fires, whatever the timing. It is aimed at another moment (safe point 2, or else 1),
    which fires, and the run is called identical."""
    r = check(str(harness.FILES / "resume_planned.ipynb"), "-p", "plan", "2", "--faults", "2", "--seed", "9")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ": 6 safe points, uninterrupted in " in r.stdout.splitlines()[0], r.stdout
    assert re.search(r"fault 2/2: an out-of-memory error [0-9.]+ s after safe point 3 of 6: never fired \(the run went "
                     r"another way, e\.g\. a planned restart at that safe point\); aimed at another moment", r.stdout), r.stdout
    faults = [line for line in r.stdout.splitlines() if line.startswith("  fault ") and "aimed at" not in line]
    assert len(faults) == 2 and all(": identical (" in line for line in faults), r.stdout
    assert "an out-of-memory error" in faults[1] and "after safe point 3 of 6" not in faults[1], r.stdout
    assert r.stdout.splitlines()[-1].endswith("identical after each of 2 faults (seed 9)")


@pytest.mark.one_stack("colab")
def test_runs_no_fault_struck_that_still_ended_otherwise_are_not_summed_up_as_identical(tmp_path):
    """A notebook with its own resume (it loads the file its loop wrote, and starts after that
    file's epoch): every run after the first finds the file and trains nothing, so no fault ever
    fires, and those runs end otherwise. Each was said ("the fault never fired ... DIFFERS"), the
    exit status was 1, and the last line said "identical after its fault" (found by a probe). It
    now says what happened: the fault never fired, and the runs differ without one."""
    train = ("%%resilient --save model,opt,history\nfor epoch in resume_range(start_epoch, 6):\n"
             "    loss = ((model(X) - Y) ** 2).mean()\n    opt.zero_grad(); loss.backward(); opt.step()\n"
             "    history.append(loss.item())\n"
             "    torch.save({'model': model.state_dict(), 'opt': opt.state_dict(), 'epoch': epoch, "
             "'history': history}, 'own.pt')\n    time.sleep(0.1)")
    r = check_cells(tmp_path / "own.ipynb", ["%load_ext colab_resilience",
                                             "%%replay\nimport time\n" + harness.OWN_CHECKPOINT_SETUP, train,
                                             "print(history)"], "--faults", "1", "--seed", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the fault never fired (the run went another way), so this run proves nothing: DIFFERS" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1].endswith(
        ": 1 of 1 faults never fired, even aimed again, and 1 of those runs ended otherwise without one: the "
        "notebook does not run the same twice (see above) (seed 2)"), r.stdout
    assert "the runs wrote own.pt in " in r.stdout, r.stdout


@pytest.mark.one_stack("colab")
def test_an_oom_the_notebook_catches_itself_proves_nothing_and_is_said_so(tmp_path):
    """The loop's work runs inside `try: ... except Exception`, as library code often does: an
    injected out-of-memory error lands there, is swallowed, and the run goes on one step short. That
    run says nothing about this package (a real CUDA OOM in such code is caught the same way, with
    or without it): check says the error never reached colab_resilience, aims it again, and in the
    end counts it as proving nothing (exit 1), not as a difference. (The work inside the try takes
    0.25 s an iteration, so that an aim lands there however long a safe point takes on a busy
    machine: at 0.05 s, one landed on the loop's own line once.)"""
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": harness.KERNEL_NAME, "language": "python",
                                                           "display_name": "tests"}})
    nb.cells = [nbformat.v4.new_code_cell("%load_ext colab_resilience"),
                nbformat.v4.new_code_cell("%%replay\nimport time\ntotal = 0\n\n"
                                          "def work():\n"
                                          "    try:\n"
                                          "        started = time.perf_counter()\n"
                                          "        while time.perf_counter() - started < 0.25:\n"
                                          "            pass\n"
                                          "        return 1\n"
                                          "    except Exception:\n"
                                          "        return 0"),
                nbformat.v4.new_code_cell("%%resilient --save total\nfor i in resume_range(6):\n    total += work()"),
                nbformat.v4.new_code_cell("print('total', total)")]
    path = tmp_path / "swallows.ipynb"
    nbformat.write(nb, path)
    r = check(str(path), "--faults", "2", "--seed", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    faults = [line for line in r.stdout.splitlines() if line.startswith("  fault 2/2")]
    assert len(faults) == 3, r.stdout  # aimed twice again
    assert all("was caught there (by the notebook's code or a library's) and never reached colab_resilience; aimed "
               "at another moment" in line for line in faults[:2]), r.stdout
    assert "the error was caught where it was raised (by the notebook's code or a library's), never reaching " \
           "colab_resilience, so this run proves nothing" in faults[2], r.stdout
    assert r.stdout.splitlines()[-1].endswith(
        "1 of 2 out-of-memory errors were caught where they were raised (by the notebook's code or a library's), even "
        "aimed again (try another --seed) (seed 0)"), r.stdout


def test_a_warning_whose_location_names_the_kernels_folder_is_the_same_output_in_every_kernel(tmp_path):
    """A warning raised by a cell after the training prints where it was raised: a file in the
    folder ipykernel compiles cells into, named by the kernel's process (/tmp/ipykernel_4242/...),
    which differs in the kernel that took over. That is no difference in what the cell printed:
    check compares the lines with the folder as ipykernel_PID, and calls the run identical (it
    said the cell's output differed, every variable the same)."""
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": harness.KERNEL_NAME, "language": "python",
                                                           "display_name": "tests"}})
    nb.cells = [nbformat.v4.new_code_cell("%load_ext colab_resilience"),
                nbformat.v4.new_code_cell("%%replay\nimport sys, time, warnings\nwarnings.simplefilter('always')\n"
                                          "total = 0"),
                nbformat.v4.new_code_cell("%%resilient --save total\nfor i in resume_range(4):\n    total += i\n"
                                          "    time.sleep(0.05)"),
                nbformat.v4.new_code_cell("warnings.warn(f'total is {total}')\nsys.stderr.flush()")]
    path = tmp_path / "warns.ipynb"
    nbformat.write(nb, path)
    r = check(str(path), "--faults", "1", "--seed", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SIGKILL" in r.stdout and ": identical (1 kernel restart" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1].endswith("warns.ipynb: identical after its fault (seed 0)"), r.stdout  # not "each of 1 faults"


def test_two_dicts_that_are_equal_are_one_value_whatever_the_order_of_their_keys(ip):
    """``for g in opt.param_groups: g["lr"] *= 0.5`` leaves ``g`` bound to a param group; a resumed
    run's optimizer, loaded from a state dict, has ``params`` last in it, the uninterrupted one's
    first: check called the run different ("g differs"; found by a probe). Dicts, and those in
    lists, are digested in the order of their keys; a value that differs still differs."""
    import torch

    from colab_resilience.kernelapi import state_digest

    w = torch.nn.Parameter(torch.ones(2))
    fresh = torch.optim.Adam([w], lr=0.01)
    loaded = torch.optim.Adam([w], lr=0.01)
    loaded.load_state_dict(fresh.state_dict())
    assert list(fresh.param_groups[0]) != list(loaded.param_groups[0])  # the order of their keys
    ip.user_ns.update(a=fresh.param_groups[0], b=loaded.param_groups[0], c={"x": [{"p": 1, "q": 2}]},
                      d={"x": [{"q": 2, "p": 1}]})
    digests = state_digest()
    assert digests["a"] == digests["b"] and digests["c"] == digests["d"]
    loaded.param_groups[0]["lr"] = 0.005
    assert state_digest()["b"] != digests["b"]


def test_a_progress_bar_and_a_display_handle_are_compared_by_their_type(ip):
    """``shown = display(..., display_id=True)`` in the training cell: its display id is drawn
    afresh in every run, and check called every faulted run different ("shown differs"; found by
    a probe); a progress bar holds its start time. What they hold is no result: two of a type are
    one value, and what else the notebook holds is compared as before."""
    import logging

    from IPython.display import DisplayHandle
    from tqdm.auto import tqdm

    from colab_resilience.kernelapi import state_digest

    first, second = tqdm(total=3, disable=True), tqdm(total=5, disable=True)
    second.update(2)
    ip.user_ns.update(a=DisplayHandle(), b=DisplayHandle(), c=first, d=second, e=logging.getLogger("x"),
                      f=logging.getLogger("y"), g=[1, 2], h=[1, 3])
    digests = state_digest()
    assert ip.user_ns["a"].display_id != ip.user_ns["b"].display_id
    assert digests["a"] == digests["b"] and digests["a"][0].endswith(".DisplayHandle")
    assert digests["c"] == digests["d"] and digests["e"] == digests["f"]
    assert digests["g"] != digests["h"]


def test_a_plot_drawn_as_the_training_goes_is_compared_by_its_type(ip):
    """A training cell that draws its loss each epoch (``fig, axes = plt.subplots(1, 2)``, ``lines =
    axes[0].plot(history)``): check called every faulted run different ("ax differs; fig differs";
    found by a probe of a live plot): pyplot numbers each figure the process makes, and a resumed
    run makes fewer. A figure, its axes (an array of them) and the lines drawn are digested by
    their type, as a progress bar is; the numbers they draw are compared where the training keeps
    them, and a list of numbers is compared as before."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from colab_resilience.kernelapi import state_digest

    history = [1.0, 0.5, 0.25]
    made = [plt.subplots(1, 2) for _ in range(2)]
    try:
        made[1][0].set_size_inches(3, 2)
        for fig, axes in made:
            axes[0].plot(history)
        ip.user_ns.update(a=made[0][0], b=made[1][0], c=made[0][1], d=made[1][1], e=made[0][1][0].lines[:],
                          f=made[1][1][0].plot(history[:2]), g=history, h=history[:2])
        digests = state_digest()
    finally:
        plt.close("all")
    assert made[0][0].number != made[1][0].number
    assert digests["a"] == digests["b"] and digests["a"][0].endswith(".Figure"), digests["a"]
    assert digests["c"] == digests["d"] and digests["e"] == digests["f"]
    assert digests["g"] != digests["h"]


def test_a_python_random_generator_is_compared_by_its_state(ip):
    """A random.Random in the notebook is digested by its state: one that drew more is another
    value (it was digested by its __dict__, which holds none of its state: check called a run
    that drew differently identical). Two with the same state digest the same."""
    import random

    from colab_resilience.kernelapi import state_digest

    ip.user_ns.update(a=random.Random(0), b=random.Random(0))
    first = state_digest()
    assert first["a"] == first["b"]
    ip.user_ns["a"].random()
    assert state_digest()["a"] != first["a"]



def test_a_dataframe_is_compared_by_what_it_holds_and_a_shared_tuple_is_no_difference(ip):
    """A pandas DataFrame logging each epoch (``log.loc[len(log)] = [epoch, loss]``) was digested
    by its attributes: caches and a block layout, which differ in a frame unpickled from a
    checkpoint (check said "log differs" after every fault, every value the same) and hold none of
    its values (a frame with another loss digested the same). It is digested by its labels, dtypes
    and values. An optimizer whose param group shares the ``betas`` tuple of its defaults (a new
    one) and one loaded from a state dict (a tuple of its own) hold the same: check said "opts
    differs" for a list of optimizers restored exactly."""
    import pickle

    import torch

    pd = pytest.importorskip("pandas")
    from colab_resilience.kernelapi import state_digest

    log = pd.DataFrame(columns=["epoch", "loss"])
    for epoch in range(3):
        log.loc[len(log)] = [epoch, 0.5 / (epoch + 1)]
    other = log.copy()
    other.iloc[1, 1] = 0.3
    def adam():
        torch.manual_seed(0)
        return torch.optim.Adam(torch.nn.Linear(2, 1).parameters(), lr=0.1)

    opt, loaded = adam(), adam()
    loaded.load_state_dict(pickle.loads(pickle.dumps(opt.state_dict())))  # as from a checkpoint
    assert opt.param_groups[0]["betas"] is opt.defaults["betas"] is not loaded.param_groups[0]["betas"]
    ip.user_ns.update(a=log, b=pickle.loads(pickle.dumps(log)), c=other, d=log["loss"],
                      e=pickle.loads(pickle.dumps(log["loss"])), f=other["loss"], g=[opt], h=[loaded])
    digest = state_digest()
    assert digest["a"] == digest["b"] != digest["c"]
    assert digest["d"] == digest["e"] != digest["f"]
    assert digest["g"] == digest["h"]



def test_a_module_is_compared_with_its_modes_and_plain_attributes(ip):
    """Two modules with the same weights are the same value only with the same train/eval modes,
    requires_grad flags and plain attributes (a call counter): a module was digested by its
    state_dict alone, and check called a run whose module had lost its counter identical."""
    import torch

    from colab_resilience.kernelapi import state_digest

    def net(calls=0, training=True, frozen=False):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
        m.calls = calls
        m.train(training)
        m[0].weight.requires_grad_(not frozen)
        return m

    ip.user_ns.update(a=net(), b=net(), c=net(calls=1), d=net(training=False), e=net(frozen=True))
    digest = state_digest()
    assert digest["a"] == digest["b"]
    assert len({digest[k][0] for k in "acde"}) == 4


def test_a_time_a_trainer_measured_is_not_a_difference_and_the_rest_of_its_metrics_are(ip):
    """What Hugging Face's `trainer.train()` and `evaluate()` return holds the run's wall-clock
    time and rates (`train_runtime`, `train_samples_per_second`): they differ between any two
    runs, and `out = trainer.train()` made every check of such a notebook say "out differs".
    Numbers a dict names as a time or a rate are digested as "a time"; its loss is compared."""
    from colab_resilience.kernelapi import state_digest

    def metrics(runtime, loss):
        return {"train_runtime": runtime, "train_samples_per_second": 40 / runtime, "train_steps_per_second": 10 / runtime,
                "total_flos": 1234.0, "train_loss": loss, "epoch": 3.0}

    ip.user_ns.update(a=(30, 0.5, metrics(1.5, 0.5)), b=(30, 0.5, metrics(2.7, 0.5)), c=(30, 0.5, metrics(1.5, 0.6)),
                      d=metrics(1.5, 0.5), e=metrics(2.7, 0.5), f=metrics(2.7, 0.6))
    digest = state_digest()
    assert digest["a"] == digest["b"] != digest["c"]
    assert digest["d"] == digest["e"] != digest["f"]


def test_a_line_the_fault_cut_short_is_not_a_difference_and_a_changed_line_is():
    """An out-of-memory error raised while a line was printed (``0`` of ``0 2.31``): the retry's
    message follows on that line, and the retried iteration prints the whole line again. That is
    the same output; a line that is no beginning of the uninterrupted one is a difference."""
    from colab_resilience.check import _output_difference

    reference = ["0 2.31", "1 2.20", "2 2.11"]
    oom = "colab_resilience: OOM (CUDA out of memory) — freed 4.5 MiB; retry 1/2"
    assert _output_difference(reference, ["0 2.31", "1" + oom, "1 2.20", "2 2.11"]) is None
    assert _output_difference(reference, ["0 2.31", oom, "1 2.20", "2 2.11"]) is None
    assert _output_difference(reference, ["0 2.31", "7" + oom, "1 2.20", "2 2.11"]) == "first at '7'"
    assert _output_difference(reference, ["0 2.31", "1" + oom, "1 2.21", "2 2.11"]) == "first at '1 2.21'"
    assert _output_difference(reference, ["0 2.31", "1 2.2"]) == "first at '1 2.2'"  # no fault: cut is a difference


def test_a_warning_a_retry_does_not_show_again_is_not_a_difference():
    """Python shows a warning once per place in a process: an out-of-memory retry in the same
    kernel does not show again what the failed attempt showed (found by a probe: a Lightning fit
    retried at its start "differed" by a deprecation warning). A part after a recovery may lack
    them; a part that lacks another line, or a run without a recovery that lacks one, differs."""
    from colab_resilience.check import _output_difference

    warned = "/venv/lib/python3.11/site-packages/lightning/pytorch/utilities/_pytree.py:21: `LeafSpec` is deprecated"
    shown = "/venv/lib/python3.11/site-packages/torch/nn/modules/loss.py:610: UserWarning: Using a target size"
    source = "  return F.mse_loss(input, target, reduction=self.reduction)"
    reference = ["GPU available: False", warned, shown, source, "epoch 0 1.5", "stopped"]
    oom = "colab_resilience: OOM (out of memory) — freed 66.0 MiB; retry 1/2"
    retried = ["GPU available: False", warned, shown, source, oom, "GPU available: False", "epoch 0 1.5", "stopped"]
    assert _output_difference(reference, retried) is None
    assert _output_difference(reference, retried[:-2] + ["stopped"]) == "first at 'stopped'"
    assert _output_difference(reference, [line for line in reference if line != warned]).startswith("first at ")


def test_a_line_logged_among_printed_ones_in_another_place_is_not_a_difference():
    """stdout and stderr reach the notebook apart: a line written to stderr (the Hugging Face
    Trainer's "mtime may not be reliable" as it saves) can come before or after a line printed
    to stdout at the same time, in any run (found by a probe: check said a run differed, before
    the fault's part). Without a recovery and before it, such lines may move; a printed line that
    moves, or a logged line that is missing, is a difference."""
    from colab_resilience.check import _output_difference

    mtime = "[transformers] mtime may not be reliable on this filesystem, falling back to numerical ordering"
    reference = ["{'loss': '3.91'}", mtime, "{'loss': '3.83'}", "{'eval_loss': '3.92'}", "end"]
    moved = ["{'loss': '3.91'}", "{'loss': '3.83'}", "{'eval_loss': '3.92'}", mtime, "end"]
    died = "colab_resilience: the kernel died (killed by SIGKILL); restarted it and resumed at step 3 in 2.1 s"
    assert _output_difference(reference, moved, {mtime}) is None
    assert _output_difference(reference, moved[:4] + [died, "end"], {mtime}) is None
    assert _output_difference(reference, moved, set()) == "first at \"{'loss': '3.83'}\""  # not logged: compared
    swapped = ["{'loss': '3.83'}", mtime, "{'loss': '3.91'}", "{'eval_loss': '3.92'}", "end"]
    assert _output_difference(reference, swapped, {mtime}) == "first at \"{'loss': '3.83'}\""
    assert _output_difference(reference, [line for line in moved if line != mtime], {mtime}) is not None


def test_what_a_resumed_part_logs_otherwise_is_not_a_difference_and_what_it_prints_is():
    """After a recovery, what the cell wrote to stderr may differ: a library's log line of how it
    found its files (the Hugging Face Trainer's "mtime may not be reliable", said only where its
    checkpoints were written within one second: not so where a kernel died between them; found by
    a probe), or its warning of a folder the resumed run finds written. Lines written to stderr in
    either run are left out of the parts after a recovery; a line printed to stdout is compared."""
    from colab_resilience.check import _output_difference, _quote

    mtime = "[transformers] mtime may not be reliable on this filesystem, falling back to numerical ordering"
    keys = "[transformers] There were missing keys in the checkpoint model loaded: ['lm_head.weight']."
    reference = ["[transformers] loss_type=None", "step 10", mtime, keys, "done 0.51"]
    died = "colab_resilience: the kernel died (killed by SIGKILL); switched to the standby kernel"
    resumed = ["[transformers] loss_type=None", died, "[transformers] loss_type=None", keys, "done 0.51"]
    logged = {"[transformers] loss_type=None", mtime, keys}
    assert _output_difference(reference, resumed, logged) is None
    assert _output_difference(reference, resumed) == f"first at {_quote(keys)}"  # were they printed: a difference
    assert _output_difference(reference, resumed[:-1] + ["done 0.52"], logged) == "first at 'done 0.52'"
    assert _output_difference(reference, resumed[:-1], logged) == f"it ends otherwise, at {_quote(keys)}"



def test_printed_times_and_rates_are_not_a_difference_and_the_rest_of_the_line_is():
    """The metrics a Hugging Face Trainer prints at its end: its runtime and rates differ between
    any two runs; its loss does not."""
    from colab_resilience.check import _output_difference, _untimed

    ran = ["{'train_runtime': '2.707', 'train_samples_per_second': '70.92', 'train_loss': '0.6931', 'epoch': '3.0'}"]
    again = ["{'train_runtime': '1.184', 'train_samples_per_second': '162.2', 'train_loss': '0.6931', 'epoch': '3.0'}"]
    other = ["{'train_runtime': '1.184', 'train_samples_per_second': '162.2', 'train_loss': '0.7012', 'epoch': '3.0'}"]
    assert _output_difference(_untimed(ran), _untimed(again)) is None
    assert _output_difference(_untimed(ran), _untimed(other)).startswith("first at ")
    assert _untimed(["epoch_time=3.2s loss=0.5", "timer 3"]) == ["epoch_time=<time>s loss=0.5", "timer 3"]

def test_what_time_magics_print_after_a_cell_is_not_a_difference_and_what_the_cell_prints_is():
    """``%%time`` on the training cell (found by a probe: check called a notebook that resumed bit
    for bit different, at 'CPU times: user 266 ms, ...'): its times differ between any two runs,
    in any unit (``1min 3s``), and its compile and parse times are printed only where they were
    long. The cell's own lines are compared as before."""
    from colab_resilience.check import _output_difference, _untimed

    ran = ["0 2.31", "1 2.20", "CPU times: user 266 ms, sys: 24.8 ms, total: 291 ms", "Wall time: 158 ms"]
    again = ["0 2.31", "1 2.20", "CPU times: user 1min 3s, sys: 2.1 s, total: 1min 5s", "Wall time: 1min 9s",
             "Compiler : 112 ms", "Parser   : 104 ms"]
    assert _output_difference(_untimed(ran), _untimed(again)) is None
    assert _output_difference(_untimed(ran), _untimed(["0 2.31", "1 2.21"] + again[2:])) == "first at '1 2.21'"
    assert _untimed(["CPU times: total: 3 s", "Wall time is up", "Compiler : ok"]) == [
        "CPU times: <time>", "Wall time is up", "Compiler : ok"]


def test_a_training_cell_under_time_magics_resumes_identical(tmp_path):
    """The same in real runs: the training cell under ``%%time`` (its line, then ``%%resilient``),
    a later cell under ``%time``; a SIGKILL and an out-of-memory error: identical."""
    r = check_cells(tmp_path / "timed.ipynb", ["%load_ext colab_resilience", "%%replay\nimport time\ntotal = 0",
                                               "%%time\n%%resilient --save total\nfor i in resume_range(4):\n"
                                               "    total += i\n    print(i, total)\n    time.sleep(0.05)",
                                               "%time print('total', total)"], "--faults", "2", "--seed", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SIGKILL" in r.stdout and "an out-of-memory error" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1].endswith("timed.ipynb: identical after each of 2 faults (seed 3)"), r.stdout


def test_a_kill_is_taken_over_by_a_standby_kernel_and_an_out_of_memory_error_by_none(tmp_path):
    """A kill fault's run keeps a standby kernel, as `colab-resilience run` does; an out-of-memory
    error's run keeps none: it is retried in the kernel, and a standby would import the notebook's
    modules beside it for nothing (5 s of CPU with torch's). With --retries 0 the error restarts
    the kernel all the same: a cold restart, and the run is identical."""
    r = check_cells(tmp_path / "r0.ipynb", ["%load_ext colab_resilience", "%%replay\nimport time\ntotal = 0",
                                            "%%resilient --retries 0 --save total\nfor i in resume_range(4):\n"
                                            "    total += i\n    print(i, total)\n    time.sleep(0.05)",
                                            "print('total', total)"],
                    "--faults", "2", "--seed", "3", "--keep", str(tmp_path / "kept"))
    assert r.returncode == 0, r.stdout + r.stderr
    killed, oom = (_printed(tmp_path / "kept" / f"fault-{i}.ipynb") for i in (1, 2))
    assert "the kernel died (killed by SIGKILL); switched to the standby kernel" in killed, killed
    assert ("the kernel restarted itself (OOM (out of memory, injected by colab-resilience check) after 1 attempt); "
            "restarted it, replayed 1 cell") in oom, oom
    assert "(1 kernel restart, " in r.stdout.splitlines()[2], r.stdout


def test_a_faulted_run_refused_in_one_line_is_said_as_stopped_not_as_a_difference(tmp_path):
    """A set-up value a plain cell changed (``data`` made in a %%replay cell, scaled in the next,
    plain one): after the kill the new kernel's replay makes it as the %%replay cell does, and the
    resume stops in one line, as it must; after the OOM (retried in the kernel) the run is
    identical. The refusal is the loud half of "the same result, or a loud refusal": said as the
    run's stop, with its line, not as "DIFFERS: the run did not finish", and counted apart in the
    last line; exit status 1 all the same (the notebook as it is does not get through the kill)."""
    r = check_cells(tmp_path / "plain.ipynb", ["%load_ext colab_resilience",
                                               "%%replay\nimport time\ndata = list(range(8))\ntotal = 0",
                                               "data = [x * 10 for x in data]",
                                               "%%resilient --save total\nfor i in resume_range(4):\n"
                                               "    total += data[i]\n    print(i, total)\n    time.sleep(0.05)",
                                               "print('total', total)"], "--faults", "2", "--seed", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    killed = next(line for line in lines if line.startswith("  fault 1/2: SIGKILL"))
    assert ": STOPPED instead of going on: colab-resilience: cell 3 stopped: colab_resilience: run " in killed
    assert "data is not what the run began with: a cell that is not replayed had changed it" in killed, killed
    assert "the same `colab-resilience run` command runs every cell again and goes on with the run" in killed, killed
    assert "DIFFERS" not in r.stdout, r.stdout
    assert "\n    it said: colab_resilience: the kernel died (killed by SIGKILL); " in r.stdout, r.stdout
    assert re.search(r"fault 2/2: an out-of-memory error .*: identical \(0 kernel restarts", r.stdout), r.stdout
    assert lines[-1].endswith("plain.ipynb: 1 of 2 faulted runs stopped instead of going on (see above why) (seed 3)")


def test_what_a_cell_that_clears_its_output_showed_when_it_died_is_not_a_difference_and_its_end_is():
    """A loop that redraws its progress with ``clear_output(wait=True)``: the uninterrupted run
    keeps its last view ('epoch 5 ...'); a run killed in epoch 1 kept the view it died with, then
    the resumed attempt's last view (found by a probe: check called such a run different, first
    at 'epoch 1 ...', every variable the same). Only the last view is compared, with the end."""
    from colab_resilience.check import _output_difference

    reference = ["epoch 5 [0, 1, 4, 9, 16, 25]"]
    died = "colab_resilience: the kernel died (killed by SIGKILL); switched to the standby kernel"
    said = ["colab_resilience: said in this cell before it cleared its output:",
            "colab_resilience: resumed run 697fe419: restored hist in 0.0 s; continuing at 1"]
    faulted = ["epoch 1 [0, 1]", died, "epoch 5 [0, 1, 4, 9, 16, 25]", *said]
    assert _output_difference(reference, faulted, cleared=True) is None
    assert _output_difference(reference, faulted) == "first at 'epoch 1 [0, 1]'"  # a cell that does not clear
    assert _output_difference(reference, ["epoch 1 [0, 1]", died, "epoch 5 [0, 1, 4, 9, 16]", *said],
                              cleared=True) == "first at 'epoch 5 [0, 1, 4, 9, 16]'"
    assert _output_difference(reference, ["epoch 1 [0, 1]", died, "epoch 4 [0, 1, 4, 9, 16]"],
                              cleared=True) is not None
    assert _output_difference(reference, ["epoch 5 [0, 1, 4, 9, 16]"], cleared=True) is not None  # no recovery


def test_a_training_cell_that_clears_its_output_resumes_identical(tmp_path):
    """The same in real runs, a kill among the faults: identical."""
    r = check_cells(tmp_path / "cleared.ipynb", [
        "%load_ext colab_resilience", "%%replay\nimport time\nfrom IPython.display import clear_output\nhist = []",
        "%%resilient --save hist\nfor e in resume_range(6):\n    hist.append(e * e)\n"
        "    clear_output(wait=True)\n    print('epoch', e, hist)\n    time.sleep(0.1)",
        "print(hist)"], "--faults", "3", "--seed", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SIGKILL" in r.stdout and "(1 kernel restart" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1].endswith("cleared.ipynb: identical after each of 3 faults (seed 1)"), r.stdout


def test_a_progress_bar_drawn_in_place_is_compared_as_the_notebook_shows_it():
    """Keras's ``fit`` draws its bar again in place (carriage returns, backspaces, colours), how
    often depends on the time, and its times per step differ in every run; a fault strikes while
    it is drawn (found by a probe: check called every faulted run of a ``verbose=1`` fit different,
    at the first bar). Lines are compared as a notebook shows them, the bar's times left out; the
    bar the fault cut is no line; a loss that differs still differs."""
    from colab_resilience.check import _output_difference, _rendered, _untimed

    def bar(step: int, seconds: str, per_step: str, loss: str) -> str:
        done = "━" * (20 * step // 8)
        return (f"\r\x1b[1m{step}/8\x1b[0m \x1b[32m{done}\x1b[0m\x1b[37m{'━' * (20 - len(done))}\x1b[0m "
                f"\x1b[1m{seconds}\x1b[0m {per_step}/step - loss: {loss}")

    def epoch(n: int, *draws: str) -> str:
        return f"Epoch {n}/3\n" + ("\b" * 50).join(draws) + "  \n"

    ran = epoch(1, bar(1, "1s", "243ms", "8.4384"), bar(8, "0s", "3ms", "7.8491")) + \
        epoch(2, bar(8, "0s", "3ms", "7.4004")) + epoch(3, bar(3, "0s", "9ms", "7.1"), bar(8, "0s", "3ms", "6.9703"))
    reference = _untimed(_rendered(ran))
    assert reference[:2] == ["Epoch 1/3", "8/8 ━━━━━━━━━━━━━━━━━━━━ <time> <time>/step - loss: 7.8491"], reference
    died = "colab_resilience: the kernel died (killed by SIGKILL); switched to the standby kernel\n"
    faulted = (epoch(1, bar(1, "2s", "412ms", "8.4384"), bar(8, "1s", "5ms", "7.8491")) + "Epoch 2/3\n" +
               bar(5, "0s", "4ms", "7.51") + died + epoch(2, bar(8, "0s", "2ms", "7.4004")) +
               epoch(3, bar(8, "0s", "3ms", "6.9703")))
    assert _output_difference(reference, _untimed(_rendered(faulted))) is None
    other = faulted.replace("6.9703", "6.9704")
    assert _output_difference(reference, _untimed(_rendered(other))) == \
        "first at '8/8 ━━━━━━━━━━━━━━━━━━━━ <time> <time>/step - loss: 6.9704'"
    assert _untimed(["1/8 [==>....] - ETA: 1s - loss: 8.4384", "8/8 - 0s - 3ms/step - loss: 7.8491",
                     "12/100 ━━ 1:05 30ms/step - loss: 2", "see 3ms/step"]) == [
        "1/8 [==>....] - <time> - loss: 8.4384", "8/8 - <time> - <time>/step - loss: 7.8491",
        "12/100 ━━ <time> <time>/step - loss: 2", "see 3ms/step"]


def test_a_global_a_set_up_cells_function_changes_is_not_excused_as_recomputed():
    """``steps = 0`` in a set-up cell, changed by ``tick()`` (``global steps``) that the training
    calls: a difference in it after a restart is the training's, not the replayed cell's, and is
    compared (before, it was left out as a value the set-up cell recomputed in the new kernel)."""
    from colab_resilience.check import set_up_names

    nb = harness.notebook("%load_ext colab_resilience",
                          "%%replay\nsteps, size = 0, 4\ndef tick():\n    global steps\n    steps += 1",
                          "%%resilient\nfor i in resume_range(3):\n    tick()")
    assert set_up_names(nb) == {"size", "tick"}


@pytest.mark.one_stack("colab")
def test_a_set_up_drawn_without_a_seed_is_named_as_why_no_two_runs_agree(tmp_path):
    """A split drawn without a seed in the %%replay cell: every kernel draws another, the
    uninterrupted run's included, so every faulted run differs, the kill's and the OOM's alike
    (its kernel began from another split before any fault). check says why under each (from the
    fingerprints each run's journal recorded when it began: the names the set-up binds and the
    training reads), and its last line says what to do; the model, which only the training
    changes, is not among the names."""
    nb = harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport torch\nperm = torch.randperm(64)\ntrain_idx = perm[:48]\ntorch.manual_seed(0)\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)\nmodel = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)",
        "%%resilient --save model,opt\nfor epoch in resume_range(6):\n    for i in range(0, 48, 16):\n"
        "        idx = train_idx[i:i + 16]\n        loss = ((model(X[idx]) - Y[idx]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()",
        "print(model.weight.sum().item())")
    path = tmp_path / "unseeded.ipynb"
    nbformat.write(nb, path)
    r = check(str(path), "--faults", "2", "--seed", "5")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert ("    the set-up cells made train_idx otherwise in this run's kernel than in the uninterrupted run's, before "
            "any fault (drawn without a seed, a set's order of strings): no two runs of this notebook agree") in \
        r.stdout, r.stdout
    assert "    the set-up cells made train_idx otherwise in this run's kernel too, before any fault (see above)" in lines
    assert lines[-1] == (f"colab-resilience check: {path}: 2 of 2 faulted runs differ; the set-up cells make train_idx "
                         "otherwise in each kernel: seed them, then check again (seed 5)"), r.stdout
