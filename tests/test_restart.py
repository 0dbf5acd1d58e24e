"""Restart and resume in real kernels; jupyter_client stands in for the Jupyter server's restarter.

tests/files/train.ipynb (a training loop with shuffling and dropout), run cell by cell as a user
runs it in Jupyter, is interrupted by a SIGKILL, by an OOM beyond the retries, and by planned
restarts; each time the RESULT line (history, weights, optimizer state) must be the reference's,
bit for bit, and its log, written at the end of every epoch, must show that each epoch after the
last safe point ran exactly once. tests/files/budget.ipynb dies in every kernel.
"""

from __future__ import annotations

import json
import time

import pytest

from harness import Kernel, epochs, load, result, run_interactive, user_cell, user_cells

pytestmark = pytest.mark.kernel

# what a kernel prints when the interrupted cell, run again, replays train.ipynb's set-up cells
REPLAYED = [
    "colab_resilience: replayed epochs = 4            # epochs to train (8 minibatches each)",  # parameters
    # the injected parameters, by their values (the line ends in "..." past 100 characters)
    "colab_resilience: replayed # Parameters: fault = '{fault}'; fault_epoch = 2; retries = 1; max_restarts = 3;",
    "colab_resilience: replayed # Set-up: replayed in every new kernel before the training resumes.",
]


@pytest.fixture
def env(tmp_path):
    """A private run directory and IPython profile per test (startup files stay in it)."""
    return {
        "COLAB_RESILIENCE_RUN_DIR": str(tmp_path / "runs"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
    }


@pytest.mark.parametrize("fault", ["sigkill", "oom"])
def test_interrupted_run_resumes_bit_identical(tmp_path, env, reference, fault):
    """A SIGKILL, or a real OOM in every attempt of the first kernel, mid-epoch 2: the user runs the
    interrupted cell again in the restarted kernel, and nothing else; the startup file loaded the
    extension, the run replays the set-up cells, restores the last safe point and finishes
    bit-identical, each epoch once; then the startup file is gone."""
    # staging off: a kill soon after a safe point finds its checkpoint on disk ("continuing at 2")
    nb = load("train.ipynb", tmp_path, fault=fault, fault_epoch=2, retries=1, max_restarts=3, staging="off")
    k = Kernel(env)
    try:
        run_interactive(k, nb, stop="train")
        source = user_cell(nb, "train")
        out, code = k.execute_until_exit(source)
        first_pid = k.pid
        if fault == "oom":
            assert code == 75
            assert "retry 1/1" in out
            assert "restarting the kernel; restart 1/3" in out
            assert "JupyterLab drops the cells queued after this one (Run all): run them again too." in out
        else:
            assert code == -9
        k.restart()
        assert k.pid != first_pid
        # before the cell runs again, status already tells what became of the run's kernel
        status = k.ok("%resilience status").stdout
        assert "planned restarts not set in this kernel" in status
        if fault == "oom":
            assert "    its kernel restarted (" in status, status
        else:
            assert (f"    its kernel (PID {first_pid}) died without warning (killed or crashed; the OS recorded "
                    "no out-of-memory kill); not counted yet: run its cell again (or Run all) to continue from "
                    "checkpoint ") in status, status
            assert "restarts 0/3" in status
        # As a user would: run the interrupted cell again, nothing else. The startup file
        # loaded the extension; the run replays the set-up cells and restores the state.
        r = k.ok(source)
        replayed = [line for line in r.stdout.splitlines() if "colab_resilience: replayed" in line]
        assert [replayed[0], replayed[2]] == [REPLAYED[0], REPLAYED[2]] and len(replayed) == 3, replayed
        assert replayed[1].startswith(REPLAYED[1].replace("{fault}", fault)), replayed
        assert len(replayed[1]) == len("colab_resilience: replayed ") + 100 and replayed[1].endswith("..."), replayed
        assert "colab_resilience: resumed run" in r.stdout
        assert "restart 1/3" in r.stdout and "continuing at 2" in r.stdout
        assert "code changed" not in r.stdout
        assert result(k.ok(user_cell(nb, "result")).stdout) == reference.result
        assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]  # each epoch exactly once
        # nor did its recovery import nbformat (seconds where JupyterLab installed jsonschema's checkers)
        assert k.value("'nbformat' in __import__('sys').modules") is False
        runs = list((tmp_path / "runs").glob("run-*/journal.json"))
        journal = json.loads(runs[0].read_text())
        assert journal["status"] == "done" and journal["restarts_used"] == 1
        # the run is over: the startup file is gone
        assert not list((tmp_path / "ipython").glob("profile_default/startup/*colab_resilience*"))
    finally:
        k.shutdown()


# a training cell that dies once in epoch 2 (its mark made), then goes on; {n}, {step}: its code
EDITED = ("%%resilient --save history\nfor epoch in resume_range({n}):\n    history.append({step})\n"
          "    if epoch == 2 and not os.path.exists(MARK):\n        open(MARK, 'w').close(); os.kill(os.getpid(), 9)\n")


def test_a_cell_edited_after_its_kernel_died_goes_on_with_its_new_code_and_says_how_it_changed(tmp_path, env):
    """JupyterLab and Colab send the cell's id, so the cell run again after its kernel died
    continues the cell's run whatever its code is now. Edited in between (more epochs, another
    step), it goes on from the last checkpoint with the new code, and one line says how the code
    changed (its first changed line, old and new), that what ran before ran the old code, and how
    to start over. Before, it went on silently: a history half old, half new, and "done"."""
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(f"%%replay\nimport os\nhistory = []\nMARK = {str(tmp_path / 'm')!r}", metadata={"cellId": "set-up"})
        _, code = k.execute_until_exit(EDITED.format(n=4, step="epoch"), metadata={"cellId": "train"})
        assert code == -9
        k.restart()
        r = k.ok(EDITED.format(n=6, step="10 * epoch"), metadata={"cellId": "train"})
        said = [line for line in r.stdout.splitlines() if "code changed" in line]
        run_id = next((tmp_path / "runs").glob("run-*")).name.removeprefix("run-")
        assert said == [
            f"colab_resilience: the cell's code changed since run {run_id} began (line 2 was 'for epoch in "
            "resume_range(4):', is 'for epoch in resume_range(6):'; 2 lines differ): it goes on from its last "
            "checkpoint with the code as it is now, so what it did before ran the old code and the result is not that "
            f"of either run uninterrupted; to start over with this code, %resilience reset {run_id} and run the cell "
            "again"], r.stdout
        assert "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 20, 30, 40, 50]
    finally:
        k.shutdown()


def test_a_saved_list_made_by_a_cell_that_is_not_replayed_comes_back_from_the_checkpoint(tmp_path, env):
    """``history = []`` in a plain cell (not ``%%replay``) and ``--save history``: after a death the
    replay does not make it, and the training cell run again was refused ("no variable 'history'
    exists"), again and again, though its checkpoint holds it; the user, told to make it in this
    cell, then trained from zero. A --save name the checkpoint holds comes back from it: the cell
    goes on where it stopped and ends as uninterrupted."""
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(f"%%replay\nimport os\nMARK = {str(tmp_path / 'm')!r}", metadata={"cellId": "set-up"})
        k.ok("history = []", metadata={"cellId": "plain"})
        _, code = k.execute_until_exit(EDITED.format(n=4, step="epoch"), metadata={"cellId": "train"})
        assert code == -9
        k.restart()
        r = k.ok(EDITED.format(n=4, step="epoch"), metadata={"cellId": "train"})
        assert "restored history" in r.stdout and "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 2, 3]
    finally:
        k.shutdown()


def _killed_then_refused_for_a_misspelt_option(k: Kernel, tmp_path, epochs: int) -> str:
    """In ``k``: a training cell of ``epochs`` epochs SIGKILLed in epoch 2, the kernel restarted, the
    cell run again with a --save name misspelt, refused in one line with nothing said of resuming.
    Returns the training cell as it was."""
    k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
    k.ok(f"%%replay\nimport os\nhistory = []\nMARK = {str(tmp_path / 'm')!r}", metadata={"cellId": "set-up"})
    train = EDITED.format(n=epochs, step="epoch")
    _, code = k.execute_until_exit(train, metadata={"cellId": "train"})
    assert code == -9
    k.restart()
    r = k.execute(train.replace("--save history", "--save history,histroy"), metadata={"cellId": "train"})
    assert r.status == "error" and "--save histroy: no variable 'histroy' exists" in r.evalue, r.evalue
    assert "code changed" not in r.stdout and "continuing" not in r.stdout, r.stdout
    return train


def test_an_option_put_right_after_a_death_goes_on_from_the_checkpoint(tmp_path, env):
    """After a death, the training cell run again with a mistake in its options (a --save name
    misspelt) was refused in one line, and the run it had taken over was failed: put right, the
    cell trained from zero, silently, the epochs before the death lost. The refused cell leaves
    the run pending, its checkpoints kept: put right, it goes on where the dead kernel stopped,
    and says nothing of a code change (the misspelt line never ran)."""
    k = Kernel(env)
    try:
        train = _killed_then_refused_for_a_misspelt_option(k, tmp_path, epochs=4)
        r = k.ok(train, metadata={"cellId": "train"})
        assert "continuing at 2" in r.stdout and "code changed" not in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 2, 3]
        journal = json.loads(next((tmp_path / "runs").glob("run-*/journal.json")).read_text())
        assert journal["status"] == "done" and journal["restarts_used"] == 1, journal
    finally:
        k.shutdown()


def test_a_kernel_restarted_from_the_front_end_with_a_run_pending_is_no_death(tmp_path, env):
    """A run left pending in a kernel (a cell refused for its options after a death), then the
    kernel restarted from the front end (a shutdown request, a clean exit): the next kernel
    counted a death without warning against the run's budget and said "killed or crashed". It
    replays and resumes, says the kernel was shut down, and the budget holds only the real death
    (a kill runs no exit handler: counted, as the other tests show)."""
    k = Kernel(env)
    try:
        train = _killed_then_refused_for_a_misspelt_option(k, tmp_path, epochs=6)
        k.km.restart_kernel(now=False)  # JupyterLab's Restart Kernel: a shutdown request first
        k.kc.wait_for_ready(timeout=60)
        r = k.ok(train, metadata={"cellId": "train"})
        said = [line for line in r.stdout.splitlines() if "resumed run" in line]
        assert len(said) == 1 and "after kernel restart (the kernel was shut down or restarted while the run was " \
            "pending (not a crash); not counted): replayed 1 cell" in said[0], r.stdout
        assert "continuing at 2" in said[0], said
        assert k.value("history") == [0, 1, 2, 3, 4, 5]
        journal = json.loads(next((tmp_path / "runs").glob("run-*/journal.json")).read_text())
        assert journal["restarts_used"] == 1, journal["restarts"]
        assert [r["planned"] for r in journal["restarts"]] == [False, True], journal["restarts"]
    finally:
        k.shutdown()


def test_a_run_stopped_by_a_kernel_restart_that_starts_afresh_says_so(tmp_path, env):
    """JupyterLab's Restart Kernel while a run trains: the interrupt that comes first stops it
    (failed, its checkpoints kept: the stop line says how to go on). The cell run again in the new
    kernel started the run afresh and dropped those checkpoints without a word; it says so."""
    log = tmp_path / "log"
    train = ("%%resilient --save history\nfor epoch in resume_range(6):\n    time.sleep(0.3)\n    history.append(epoch)\n"
             f"    open({str(log)!r}, 'a').write(f'{{epoch}}\\n')\n")
    set_up = "%%replay\nimport time\nhistory = []"
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(set_up, metadata={"cellId": "set-up"})
        k.submit(train, metadata={"cellId": "train"})
        deadline = time.monotonic() + 60
        while not (log.exists() and len(log.read_text().split()) >= 3):
            assert time.monotonic() < deadline, "the run never reached epoch 3"
            time.sleep(0.05)
        k.km.restart_kernel(now=False)
        k.kc.wait_for_ready(timeout=60)
        journal = json.loads(next((tmp_path / "runs").glob("run-*/journal.json")).read_text())
        assert journal["status"] == "failed" and journal["resume_at"], journal
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(set_up, metadata={"cellId": "set-up"})
        r = k.ok(train, metadata={"cellId": "train"})
        run_id = journal["run_id"]
        assert (f"colab_resilience: run {run_id} of this cell had stopped before its end, with a checkpoint to go on "
                f"at {journal['resume_at']}; it starts again from its beginning now and that checkpoint is dropped (to go "
                f"on from a stopped run's checkpoint, %resilience resume {run_id} before running its cell)") in r.stdout, \
            r.stdout
        assert k.value("history") == [0, 1, 2, 3, 4, 5]
    finally:
        k.shutdown()


def test_a_resume_refused_for_a_model_no_replay_cell_builds_stays_pending_until_it_is_built(tmp_path, env):
    """A model made by a cell that is not ``%%replay``, in --save: its state goes into the model a
    set-up cell builds, and after a death nothing builds it. Said when the cell first runs; after
    the death the resume is refused in one line ("run the cell that builds it first"), and that
    refusal failed the run: built again as told, the cell trained from zero, the epochs before the
    death lost. The run stays pending: built again, the cell goes on where it stopped and ends
    with the weights of an uninterrupted run."""
    train = ("%%resilient --save model,history\nfor epoch in resume_range(4):\n    with torch.no_grad():\n"
             "        model.weight.mul_(1.5).add_(epoch)\n    history.append(epoch)\n"
             "    if epoch == 2 and not os.path.exists(MARK):\n        open(MARK, 'w').close(); os.kill(os.getpid(), 9)\n")
    build = "torch.manual_seed(0)\nmodel = torch.nn.Linear(2, 2)"
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(f"%%replay\nimport os, torch\nhistory = []\nMARK = {str(tmp_path / 'm')!r}", metadata={"cellId": "set-up"})
        k.ok(build, metadata={"cellId": "model"})
        said, code = k.execute_until_exit(train, metadata={"cellId": "train"})
        assert code == -9
        assert "--save model: a checkpoint holds the state of model (a Linear), which a resume after a restart loads " \
               "into what a %%replay cell builds, but no %%replay cell builds it" in said, said
        k.restart()
        r = k.execute(train, metadata={"cellId": "train"})
        assert r.status == "error" and "cannot restore 'model' in place: no variable 'model' exists now" in r.evalue
        k.ok(build, metadata={"cellId": "model"})
        r = k.ok(train, metadata={"cellId": "train"})
        assert "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 2, 3]
        k.ok(build.replace("model", "twin") + "\nwith torch.no_grad():\n    for epoch in range(4):\n"
             "        twin.weight.mul_(1.5).add_(epoch)")
        assert k.value("torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)") is True
    finally:
        k.shutdown()


def test_the_stop_button_before_a_resumed_run_reaches_its_next_safe_point_leaves_it_pending(tmp_path, env):
    """The stop button pressed while a resumed run is still before its next safe point (a long
    first epoch, a slow restore) failed the run without a word: run again, the cell trained
    from zero on the restored state (a history with the first epochs twice). The run stays
    pending, and one line says so: run again, it goes on where it was."""
    train = ("%%resilient --save history\nfor epoch in resume_range(4):\n"
             "    while epoch == 2 and os.path.exists(SLOW):\n        open(SLOW + '.waiting', 'w').close(); time.sleep(0.05)\n"
             "    history.append(epoch)\n"
             "    if epoch == 2 and not os.path.exists(MARK):\n        open(MARK, 'w').close(); os.kill(os.getpid(), 9)\n")
    slow = tmp_path / "slow"
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(f"%%replay\nimport os, time\nhistory = []\nMARK = {str(tmp_path / 'm')!r}\nSLOW = {str(slow)!r}",
             metadata={"cellId": "set-up"})
        _, code = k.execute_until_exit(train, metadata={"cellId": "train"})
        assert code == -9
        k.restart()
        slow.touch()
        msg_id = k.submit(train, metadata={"cellId": "train"})
        deadline = time.monotonic() + 60
        while not (tmp_path / "slow.waiting").exists():
            assert time.monotonic() < deadline, "the resumed cell never reached epoch 2"
            time.sleep(0.05)
        k.km.interrupt_kernel()
        r = k.collect(msg_id)
        assert r.status == "error" and r.ename == "KeyboardInterrupt", (r.ename, r.stdout)
        run_id = next((tmp_path / "runs").glob("run-*")).name.removeprefix("run-")
        assert (f"colab_resilience: run {run_id} stopped by KeyboardInterrupt before its next safe point; it stays "
                "pending: run this cell again to go on from where it was") in r.stdout, r.stdout
        slow.unlink()
        r = k.ok(train, metadata={"cellId": "train"})
        assert "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 2, 3]
    finally:
        k.shutdown()


def test_a_kernel_shut_down_after_its_runs_folder_was_removed_does_not_make_it_again(tmp_path, env):
    """At a clean exit the kernel marks the runs it holds pending as shut down (not dead); it took
    each run's lock for that, and the lock made the run's folder where it was not: a runs folder
    removed in the notebook (`!rm -rf runs`; in Colab, a Drive folder unmounted, where a folder
    made under the mount point then blocks the next mount) came back at the kernel's shutdown,
    with the folders above it. A run that starts makes its folder; nothing else does."""
    runs = tmp_path / "deep" / "runs"
    k = Kernel({**env, "COLAB_RESILIENCE_RUN_DIR": str(runs)})
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok("%%replay\nhistory = []", metadata={"cellId": "set-up"})
        k.ok("%%resilient --save history\nfor epoch in resume_range(2):\n    history.append(epoch)",
             metadata={"cellId": "done"})
        r = k.execute("%%resilient --save history\nfor epoch in resume_range(4):\n    history.append(epoch)\n"
                      "    if epoch == 1:\n        raise ValueError('a bug')", metadata={"cellId": "stopped"})
        assert r.status == "error" and r.ename == "ValueError", r.stdout
        assert len(list(runs.glob("run-*/journal.json"))) == 2
        k.ok(f"import shutil\nshutil.rmtree({str(tmp_path / 'deep')!r})")
        k.km.shutdown_kernel(now=False)  # a shutdown request: the kernel exits cleanly, its exit handlers run
        assert not k.km.is_alive()
        assert not (tmp_path / "deep").exists(), sorted(map(str, (tmp_path / "deep").rglob("*")))
    finally:
        k.shutdown()


def test_an_edited_cell_whose_set_up_failed_to_replay_says_its_change_when_it_goes_on(tmp_path, env):
    """The cell edited after a death, run while a set-up cell cannot replay (a file it reads is
    gone): the run stays pending, and once the file is back, the cell run again replays from that
    set-up cell on (it did not: the set-up cell had to be run by hand, else a NameError), goes on,
    and says that its code changed since the run began: the journal keeps the code the checkpoint
    was made with until the new code runs (it took the edited code at the failed attempt, and the
    change went unsaid)."""
    data = tmp_path / "data.txt"
    data.write_text("1")
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        setup = f"%%replay\nimport os\nhistory = []\nMARK = {str(tmp_path / 'm')!r}\nscale = int(open({str(data)!r}).read())"
        k.ok(setup, metadata={"cellId": "set-up"})
        _, code = k.execute_until_exit(EDITED.format(n=4, step="epoch * scale"), metadata={"cellId": "train"})
        assert code == -9
        k.restart()
        data.rename(tmp_path / "away.txt")
        edited = EDITED.format(n=4, step="10 * epoch * scale")
        r = k.execute(edited, metadata={"cellId": "train"})
        assert r.status == "error" and r.ename == "FileNotFoundError", (r.ename, r.stdout)
        assert "replaying a set-up cell failed (import os); put right what it needs (or run it yourself), then run " \
            "this cell again: the replay goes on from that cell" in r.stdout, r.stdout
        assert "code changed" not in r.stdout, r.stdout
        (tmp_path / "away.txt").rename(data)
        r = k.ok(edited, metadata={"cellId": "train"})
        assert "colab_resilience: replayed import os" in r.stdout, r.stdout
        assert "the cell's code changed since run" in r.stdout and "is 'history.append(10 * epoch * scale)'" \
            in r.stdout, r.stdout
        assert "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 20, 30]
    finally:
        k.shutdown()


def test_a_set_up_cell_edited_and_run_again_after_a_death_is_said_when_the_run_goes_on(tmp_path, env):
    """The same of a set-up cell edited and run again before the training cell (a function the
    training calls, which no fingerprint of the set-up's values sees): one line names the cell and
    its first changed line, and the run goes on with what it makes now."""
    setup = "%%replay\nimport os\nhistory = []\nMARK = {mark!r}\ndef step(epoch):\n    return {step}"
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup.format(mark=str(tmp_path / "m"), step="epoch"), metadata={"cellId": "set-up"})
        _, code = k.execute_until_exit(EDITED.format(n=4, step="step(epoch)"), metadata={"cellId": "train"})
        assert code == -9
        k.restart()
        k.ok(setup.format(mark=str(tmp_path / "m"), step="100 * epoch"), metadata={"cellId": "set-up"})
        r = k.ok(EDITED.format(n=4, step="step(epoch)"), metadata={"cellId": "train"})
        run_id = next((tmp_path / "runs").glob("run-*")).name.removeprefix("run-")
        said = [line for line in r.stdout.splitlines() if "changed since" in line]
        assert said == [
            f"colab_resilience: set-up cell 'import os' changed since run {run_id} began (line 6 was 'return epoch', "
            "is 'return 100 * epoch'): the run goes on with what it makes now, so what it did before ran on the old "
            f"set-up and the result is not that of either run uninterrupted; to start over, %resilience reset {run_id} "
            "and run this cell again"], r.stdout
        assert "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 200, 300]
    finally:
        k.shutdown()


def test_a_set_up_cell_added_after_a_death_that_binds_again_what_the_run_was_set_up_with_is_said(tmp_path, env):
    """After the death, the set-up cell as it was, then a new %%replay cell that defines the
    training's ``step`` otherwise (as a supervised run's other -p values add a parameters cell
    that sets ``seed`` otherwise): one line names the new cell and what it binds again, new and
    old, and the run goes on with what it makes now. It said nothing of it (the set-up cell was
    not edited, and no fingerprint of values sees a function). A new cell that binds nothing the
    run's set-up bound (a helper, ``import os`` again) is not said."""
    setup = "%%replay\nimport os\nhistory = []\nMARK = {mark!r}\ndef step(epoch):\n    return epoch"
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup.format(mark=str(tmp_path / "m")), metadata={"cellId": "set-up"})
        _, code = k.execute_until_exit(EDITED.format(n=4, step="step(epoch)"), metadata={"cellId": "train"})
        assert code == -9
        k.restart()
        k.ok(setup.format(mark=str(tmp_path / "m")), metadata={"cellId": "set-up"})
        k.ok("%%replay\nimport os\ndef plot(h):\n    return h", metadata={"cellId": "helper"})
        k.ok("%%replay\ndef step(epoch):\n    return 100 * epoch", metadata={"cellId": "added"})
        r = k.ok(EDITED.format(n=4, step="step(epoch)"), metadata={"cellId": "train"})
        run_id = next((tmp_path / "runs").glob("run-*")).name.removeprefix("run-")
        said = [line for line in r.stdout.splitlines() if "since run" in line]
        assert said == [
            f"colab_resilience: set-up cell 'def step(epoch):' is new since run {run_id} began and binds again what its "
            "set-up cells bound ('def step(epoch): return 100 * epoch', was 'def step(epoch): return epoch'; a cell "
            "added, or other -p values): the run goes on with what it makes now, so what it did before ran on the old "
            f"set-up and the result is not that of either run uninterrupted; to start over, %resilience reset {run_id} "
            "and run this cell again"], r.stdout
        assert "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 200, 300]
    finally:
        k.shutdown()


# a training cell that multiplies by the set-up's lr, and dies once in epoch 2 (its mark made)
SCALED = EDITED.format(n=4, step="epoch * lr")


def test_a_copy_of_a_notebook_has_runs_of_its_own(tmp_path, env):
    """A notebook and its copy (JupyterLab's Duplicate, a copied file) in one folder: their cells
    have the same ids, so their training cells were one run. The copy, its lr changed, resumed
    the original's killed run from its checkpoint: a history half of each notebook. A Jupyter
    server tells each kernel its notebook ($JPY_SESSION_NAME, which these kernels get as the
    server gives it): each notebook's cell is a run of its own. The copy trains from its start;
    the original, run again, resumes its own run and ends as uninterrupted."""
    setup = "%%replay\nimport os\nhistory = []\nlr = {lr}\nMARK = " + repr(str(tmp_path / "m"))
    for name in ("train.ipynb", "train-Copy1.ipynb"):
        (tmp_path / name).write_text("{}")  # open in the page: there
    a = Kernel(dict(env, JPY_SESSION_NAME=str(tmp_path / "train.ipynb")))
    b = Kernel(dict(env, JPY_SESSION_NAME=str(tmp_path / "train-Copy1.ipynb")))
    try:
        for k in a, b:
            k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        a.ok(setup.format(lr=1), metadata={"cellId": "set-up"})
        _, code = a.execute_until_exit(SCALED, metadata={"cellId": "train"})
        assert code == -9
        a.restart()
        b.ok(setup.format(lr=100), metadata={"cellId": "set-up"})
        r = b.ok(SCALED, metadata={"cellId": "train"})
        assert "colab_resilience" not in r.stdout, r.stdout  # nothing resumed, nothing to say
        assert b.value("history") == [0, 100, 200, 300]
        r = a.ok(SCALED, metadata={"cellId": "train"})
        assert "continuing at 2" in r.stdout, r.stdout
        assert a.value("history") == [0, 1, 2, 3]
        runs = {json.loads((d / "journal.json").read_text())["notebook"]: d.name for d in (tmp_path / "runs").glob("run-*")}
        assert sorted(runs) == [str(tmp_path / "train-Copy1.ipynb"), str(tmp_path / "train.ipynb")], runs
        status = b.ok("%resilience status").stdout  # whose run each is
        for notebook, whose in [("train-Copy1.ipynb", "this notebook"), ("train.ipynb", "notebook train.ipynb")]:
            assert f"run {runs[str(tmp_path / notebook)].removeprefix('run-')} ({whose}): done;" in status, status
    finally:
        a.shutdown()
        b.shutdown()


def test_a_notebook_renamed_while_its_kernel_was_shut_down_says_where_its_pending_run_is(tmp_path, env):
    """The notebook is part of a run's id: renamed while its kernel was shut down, its cell begins
    a run of its own, and the run of its old name would stay pending unseen. One line names it
    and how to go on with it; followed, the cell goes on with the old run to its uninterrupted end."""
    setup = "%%replay\nimport os\nhistory = []\nlr = 1\nMARK = " + repr(str(tmp_path / "m"))
    (tmp_path / "Untitled.ipynb").write_text("{}")
    a = Kernel(dict(env, JPY_SESSION_NAME=str(tmp_path / "Untitled.ipynb")))
    try:
        a.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        a.ok(setup, metadata={"cellId": "set-up"})
        _, code = a.execute_until_exit(SCALED, metadata={"cellId": "train"})
        assert code == -9
    finally:
        a.shutdown()
    (tmp_path / "Untitled.ipynb").rename(tmp_path / "train.ipynb")
    old = next((tmp_path / "runs").glob("run-*")).name.removeprefix("run-")
    b = Kernel(dict(env, JPY_SESSION_NAME=str(tmp_path / "train.ipynb")))
    try:
        b.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        b.ok(setup, metadata={"cellId": "set-up"})
        r = b.execute(SCALED, metadata={"cellId": "train"})
        said = [line for line in r.stdout.splitlines() if "no longer there" in line]
        assert said == [
            f"colab_resilience: run {old} of this cell, begun in {tmp_path / 'Untitled.ipynb'}, which is no longer "
            "there (renamed or moved?), is pending (it continues at 2); this notebook's cell begins a "
            f"run of its own; to go on with that one instead, %resilience resume {old}, then run this cell"], r.stdout
        assert b.value("history") == [0, 1, 2, 3]  # from its start: a run of its own
        b.ok(setup, metadata={"cellId": "set-up"})
        b.ok(f"%resilience resume {old}")
        r = b.ok(SCALED, metadata={"cellId": "train"})
        assert "continuing at 2" in r.stdout and "no longer there" not in r.stdout, r.stdout
        assert b.value("history") == [0, 1, 2, 3]
    finally:
        b.shutdown()


def test_a_replay_that_would_undo_a_set_up_cell_this_kernel_ran_is_refused(tmp_path, env):
    """Where the front end sends no cell id (the terminal, a classic Notebook), a set-up cell
    edited and run again after a death is another cell to the run; run after it, the training
    cell replayed the run's old version, silently undoing the edit (lr back to 1), and trained
    on. (Another notebook's cell of the same code, where the kernel does not know its notebook,
    is the same case.) Now the cell stops with one line that names both versions and what to do,
    before anything is replayed or written; reset, the cell trains with what the kernel ran."""
    setup = "%%replay\nimport os\nhistory = []\nlr = {lr}\nMARK = " + repr(str(tmp_path / "m"))
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup.format(lr=1))
        _, code = k.execute_until_exit(SCALED)
        assert code == -9
        k.restart()
        run_dir = next((tmp_path / "runs").glob("run-*"))
        journal = (run_dir / "journal.json").read_bytes()
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup.format(lr=100))
        r = k.execute(SCALED)
        run_id = run_dir.name.removeprefix("run-")
        assert (r.status, r.ename, r.stdout) == ("error", "UsageError", ""), (r.status, r.stdout)
        assert r.evalue == (
            f"colab_resilience: run {run_id} would replay its set-up cell 'lr = 1' over lr, which this kernel's "
            "set-up cell 'lr = 100' made (a set-up cell edited where the front end sends no cell id, or another "
            "notebook's run of a cell with this code): nothing was replayed; to start the run over with this kernel's "
            f"set-up, %resilience reset {run_id} and run this cell again; to go on with the run's, run its set-up "
            "cell as it was"), r.evalue
        assert (k.value("lr"), k.value("history")) == (100, [])
        assert (run_dir / "journal.json").read_bytes() == journal  # nothing written: the death is not counted twice
        k.ok(f"%resilience reset {run_id}")
        r = k.ok(SCALED)
        assert "continuing" not in r.stdout, r.stdout
        assert k.value("history") == [0, 100, 200, 300]
    finally:
        k.shutdown()


def test_a_function_edited_in_a_set_up_cell_without_a_cell_id_is_not_undone_by_the_replay(tmp_path, env):
    """The same of a function the training calls, edited in its set-up cell (no cell id): the
    run's old `def step` replayed over the new one trained on with the old code, silently (no
    fingerprint watches code). The line names the function and the changed line."""
    setup = "%%replay\nimport os\nhistory = []\nMARK = " + repr(str(tmp_path / "m"))
    function = "%%replay\ndef step(epoch):\n    return {step}"
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup)
        k.ok(function.format(step="epoch"))
        _, code = k.execute_until_exit(EDITED.format(n=4, step="step(epoch)"))
        assert code == -9
        k.restart()
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup)
        k.ok(function.format(step="100 * epoch"))
        r = k.execute(EDITED.format(n=4, step="step(epoch)"))
        run_id = next((tmp_path / "runs").glob("run-*")).name.removeprefix("run-")
        assert r.evalue == (
            f"colab_resilience: run {run_id} would replay its version of the set-up cell 'def step(epoch):' over step, "
            "which this kernel's version made (line 2 was 'return epoch', is 'return 100 * epoch') (a set-up cell "
            "edited where the front end sends no cell id, or another notebook's run of a cell with this code): nothing "
            f"was replayed; to start the run over with this kernel's set-up, %resilience reset {run_id} and run this "
            "cell again; to go on with the run's, run its set-up cell as it was"), r.evalue
        assert k.value("step(3)") == 300
    finally:
        k.shutdown()


def test_a_set_up_cell_of_the_same_code_under_another_id_is_no_clash(tmp_path, env):
    """The set-up cell the kernel ran has another id than the run's (pasted, or a front end that
    numbers cells afresh) but the same code: replaying the run's makes what it made, so the run
    resumes as before, and ends as uninterrupted."""
    setup = "%%replay\nimport os\nhistory = []\nlr = 1\nMARK = " + repr(str(tmp_path / "m"))
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup, metadata={"cellId": "set-up"})
        _, code = k.execute_until_exit(SCALED, metadata={"cellId": "train"})
        assert code == -9
        k.restart()
        k.ok(setup, metadata={"cellId": "pasted"})
        r = k.ok(SCALED, metadata={"cellId": "train"})
        assert "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 2, 3]
    finally:
        k.shutdown()


def test_a_set_up_cell_edited_without_a_cell_id_where_replaying_it_undoes_nothing_is_no_clash(tmp_path, env):
    """Without cell ids, a set-up cell given one more import (and a comment) is another cell to
    the run, and the run's version is replayed after it: what both bind alike (the same import,
    the same literal) it makes again as it was, so the run resumes, and ends as uninterrupted."""
    setup = "%%replay\nimport os{more}\nhistory = []\nlr = 1\nMARK = " + repr(str(tmp_path / "m"))
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup.format(more=""))
        _, code = k.execute_until_exit(SCALED)
        assert code == -9
        k.restart()
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok(setup.format(more="\nimport math  # for the plots below"))
        r = k.ok(SCALED)
        assert "continuing at 2" in r.stdout, r.stdout
        assert k.value("history") == [0, 1, 2, 3]
    finally:
        k.shutdown()


def test_a_final_state_that_cannot_be_written_stops_the_cell_and_the_run_goes_on_once_it_can(tmp_path, env):
    """The training ends, but its final checkpoint cannot be written (past RLIMIT_FSIZE, which
    fails a write as a full disk does; the journal, smaller, still fits): the cell stops with one
    line and the run stays pending. Before, it ended "done" with a checkpoint from the middle of
    the training as its last, which a supervisor that brought back a later cell after a death put
    back as the training's result. Once writes fit again, the cell run again goes on from that
    checkpoint and ends as the uninterrupted run."""
    cell = ("%%resilient --save w,hist\nfor epoch in resume_range(4):\n    w = w + 1\n    hist.append(float(w.sum()))\n"
            "    if epoch == 1 and limit[0]:\n        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n")
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience\n%config ResilienceMagics.staging_memory = 'off'")
        k.ok("%%replay\nimport numpy as np, resource, signal\nw = np.zeros(1 << 18)\nhist = []\nlimit = [True]")
        r = k.execute(cell)
        run_dir = next((tmp_path / "runs").glob("run-*"))
        journal = json.loads((run_dir / "journal.json").read_text())
        assert journal["status"] == "pending" and journal["last_checkpoint"], journal["status"]
        assert (r.status, r.ename) == ("error", "UsageError"), r.stdout
        assert r.evalue == (
            f"colab_resilience: run {run_dir.name[4:]} finished its training, but its final state could not be saved "
            f"(File too large), so the cells after it would run on state no checkpoint holds: free space in "
            f"{tmp_path / 'runs'} (or choose another folder with %resilience dir), then run this cell again; it goes "
            f"on from checkpoint {journal['last_checkpoint']}"), r.evalue
        k.ok("resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)); limit[0] = False")
        r = k.ok(cell)
        assert "continuing at" in r.stdout, r.stdout
        assert k.value("hist") == [262144.0, 524288.0, 786432.0, 1048576.0]
        assert json.loads((run_dir / "journal.json").read_text())["status"] == "done"
    finally:
        k.shutdown()


def test_planned_restarts_do_not_spend_the_budget(tmp_path, env, reference):
    """`%restart_after 2`: the kernel leaves at the safe point after two epochs, even with a budget
    of 0 restarts; after "Run all" in the new kernel the run continues at epoch 2, without a
    replay (the set-up cells ran themselves), and ends bit-identical."""
    nb = load("train.ipynb", tmp_path, max_restarts=0)
    k = Kernel(env)
    try:
        run_interactive(k, nb, stop="train")
        k.ok("%restart_after 2")
        source = user_cell(nb, "train")
        out, code = k.execute_until_exit(source)
        assert code == 75
        assert "planned restart after 2 safe points in" not in out  # at a safe point, not mid-epoch
        assert "planned restart after 2 safe points: restarting the kernel." in out
        k.restart()
        # the new kernel has no policy of its own yet; the pending run keeps its planned restarts
        status = k.ok("%resilience status").stdout
        assert "planned restarts not set in this kernel" in status
        assert "; planned restarts every 2 safe points" in status, status
        assert "    its kernel restarted (planned restart after 2 safe points): run its cell again" in status, status
        # "Run all": the set-up cells run again by themselves, so the run does not replay them twice
        replies = run_interactive(k, nb)
        r = replies["train"]  # epochs 2 and 3; no restart after the last epoch
        assert "continuing at 2" in r.stdout
        assert "replayed" not in r.stdout
        assert result(replies["result"].stdout) == reference.result
        assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]
    finally:
        k.shutdown()


def test_always_oom_stops_at_its_budget_with_a_report(tmp_path, env):
    """A cell with a real OOM in every kernel (budget.ipynb) is restarted twice, then the third
    kernel refuses with an error that names both restarts, and stays up."""
    nb = load("budget.ipynb", death="oom", retries=0, max_restarts=2)
    k = Kernel(env)
    try:
        run_interactive(k, nb, stop="die")
        cell = user_cell(nb, "die")
        pids = {k.pid}
        for restart in (1, 2):
            out, code = k.execute_until_exit(cell)
            assert code == 75 and f"restart {restart}/2" in out
            k.restart()
            pids.add(k.pid)
        r = k.execute(cell)
        assert len(pids) == 3
        assert (r.status, r.ename) == ("error", "RuntimeError")
        assert "colab_resilience: run " in r.stdout
        assert "failed: restart budget spent (2/2 restarts)" in r.stdout
        assert "Restarts: 1. OOM (DefaultCPUAllocator: can't allocate memory) after 1 attempt; 2. OOM" in r.stdout
        assert "; 3. " not in r.stdout  # the refused third death is the reason, not a restart
        assert k.pid in pids  # no further restart
        assert k.execute("1 + 1").status == "ok"
    finally:
        k.shutdown()


def test_memory_threshold_triggers_a_planned_restart(tmp_path, env, reference):
    """`%restart_after --memory 1%`: memory in use past the threshold at a safe point makes the
    kernel leave; in the new kernel, with the policy turned off there, the interrupted cell alone
    continues at epoch 1 and ends bit-identical."""
    nb = load("train.ipynb", tmp_path, max_restarts=0)
    k = Kernel(env)
    try:
        run_interactive(k, nb, stop="train")
        k.ok("%restart_after --memory 1%")  # any machine uses more than 1% of its RAM
        source = user_cell(nb, "train")
        out, code = k.execute_until_exit(source)
        assert code == 75
        assert "planned restart: host RAM in use at" in out and "(threshold 1%)" in out
        k.restart()
        k.ok("%restart_after off")  # set in the new kernel: wins over the journal's policy
        r = k.ok(source)
        assert "continuing at 1" in r.stdout
        assert result(k.ok(user_cell(nb, "result")).stdout) == reference.result
        assert epochs(tmp_path / "events.log") == [0, 1, 2, 3]
    finally:
        k.shutdown()


def test_supervised_kernel_exits_with_the_documented_code_and_no_startup_file(tmp_path, env):
    """Under a supervisor (COLAB_RESILIENCE_SUPERVISED=1) an OOM beyond the retries makes the kernel
    exit 75 and leaves no startup file: the journal tells the driver what to replay and re-run, and
    why (the kernel prints no line of its own: the driver's marker is the one report)."""
    nb = load("budget.ipynb", death="oom", retries=0, max_restarts=3)
    k = Kernel({**env, "COLAB_RESILIENCE_SUPERVISED": "1"})
    try:
        run_interactive(k, nb, stop="die")
        out, code = k.execute_until_exit(user_cell(nb, "die"))
        assert code == 75
        assert "restarting the kernel" not in out
        assert not list((tmp_path / "ipython").glob("profile_default/startup/*colab_resilience*"))
        journal = json.loads(next((tmp_path / "runs").glob("run-*/journal.json")).read_text())
        assert journal["status"] == "pending" and journal["restart_requested"] is True
        assert journal["restarts_used"] == 1 and journal["counted_pid"] == journal["kernel_pid"] == k.pid
        assert journal["restarts"][-1]["reason"] == "OOM (DefaultCPUAllocator: can't allocate memory) after 1 attempt"
        assert journal["interrupted_cell"].strip() == user_cell(nb, "die") == "%%resilient --retries 0 --max-restarts 3\ndie()"
        setup = [source.strip() for cell_id, source in user_cells(nb) if cell_id in ("parameters", "injected-parameters", "setup")]
        assert [c["source"].strip() for c in journal["replay_cells"]] == setup
    finally:
        k.shutdown()


def test_a_supervised_kernel_keeps_its_run_directory_while_another_notebooks_run_is_pending(tmp_path, env):
    """An interactive notebook's run is pending (its kernel was killed): the startup file that
    brings the extension back into its next kernel is in the profile, with its run directory. A
    kernel the supervisor started with that profile loaded the extension from that file and took
    that directory for its own: its runs went where the driver does not look, and after a restart
    it put back the other notebook's finished runs (found by a failing test: names its notebook
    never had). It keeps the supervisor's."""
    import harness

    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience")
        _, code = k.execute_until_exit("%%resilient\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        assert code == -9
    finally:
        k.shutdown()
    assert list((tmp_path / "ipython").glob("profile_default/startup/*colab_resilience*"))
    nb = harness.notebook("%load_ext colab_resilience",
                          "from colab_resilience.session import session_of\nprint('ROOT', session_of().root())")
    (tmp_path / "supervised").mkdir()
    run = harness.run(nb, tmp_path / "supervised", env={"IPYTHONDIR": env["IPYTHONDIR"]}, standby=False)
    assert run.status == 0, run.message
    assert harness.cell_text(nb.cells[1]).split() == ["ROOT", str(tmp_path / "supervised" / "runs")]


def test_a_second_kernel_on_the_same_run_is_refused(tmp_path, env):
    """Two kernels, one run directory, the same cell: the second is refused while the first runs it
    (naming its PID), and may run it once the first is done."""
    a, b = Kernel(env), Kernel(env)
    try:
        cell = "%%resilient\nimport time\nfor _ in range(60):\n    time.sleep(0.05)\n"
        for k in (a, b):
            k.ok("%load_ext colab_resilience")
        busy = a.submit(cell)
        time.sleep(1.0)
        r = b.execute(cell)
        assert (r.status, r.ename) == ("error", "UsageError")
        assert f"is in use by process {a.pid}; stop that kernel or choose another run directory" in r.evalue
        assert a.collect(busy).status == "ok"
        assert b.execute(cell).status == "ok"  # free again once the first kernel's cell ended
    finally:
        a.shutdown()
        b.shutdown()


def test_status_repeats_the_refusal_that_stopped_a_pending_run_until_it_goes_on(tmp_path, env):
    """A run killed in epoch 1, then its cell run again with a --shrink name that does not exist:
    the run stays pending, refused in one line. `%resilience status` said "left pending in this
    kernel: run its cell again (or Run all) to continue", which only refuses again; it repeats the
    refusal, with what to do, and says so in the next kernel too. Once the cell, put right, goes on
    (and is killed again in epoch 3), the refusal is no longer said."""
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience")
        k.ok("%%replay\nimport os, signal, torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(2, 1)\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nlosses = []\nbatch = 4", metadata={"cellId": "setup"})

        def train(shrink):
            return (f"%%resilient --save model,opt,losses --shrink {shrink}\nfor epoch in resume_range(5):\n"
                    "    opt.zero_grad(); loss = model(torch.ones(batch, 2)).sum(); loss.backward(); opt.step()\n"
                    f"    losses.append(loss.item())\n    mark = {str(tmp_path)!r} + f'/killed-{{epoch}}'\n"
                    "    if epoch in (1, 3) and not os.path.exists(mark):\n"
                    "        open(mark, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)")

        assert k.execute_until_exit(train("batch"), metadata={"cellId": "train"})[1] == -9
        k.restart()
        r = k.execute(train("batchsize"), metadata={"cellId": "train"})
        assert r.evalue.startswith("%%resilient: --shrink batchsize: no variable 'batchsize' exists"), r.evalue
        status = k.ok("%resilience status").stdout.splitlines()
        assert status[2] == f"colab_resilience:     stopped in this kernel: {r.evalue}", status
        k.restart()
        status = k.ok("%resilience status").stdout.splitlines()
        assert status[2].endswith(f"; before that, its cell had stopped: {r.evalue}"), status
        went_on = k.pid
        assert k.execute_until_exit(train("batch"), metadata={"cellId": "train"})[1] == -9  # went on, to epoch 3
        k.restart()
        status = k.ok("%resilience status").stdout.splitlines()
        assert status[2].startswith(f"colab_resilience:     its kernel (PID {went_on}) died without warning"), status
        assert "stopped" not in "\n".join(status), status
        k.ok(train("batch"), metadata={"cellId": "train"})
        assert len(k.value("losses")) == 5
    finally:
        k.shutdown()
