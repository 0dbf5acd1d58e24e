"""Shortened reliability trials, through the same code as ``benchmarks/reliability.py``.

- kill-writes: a checkpoint writer SIGKILLed at random moments of its saves, the store folder
  reused across trials: every load is the newest committed generation or the one before, byte
  for byte, or "no checkpoint yet"; one clean save removes what the kills left behind.
- chaos: a supervised training run (tests/files/train.ipynb at the trial's size) whose kernel is
  SIGKILLed from outside by PID during a checkpoint write, during start-up and during the replay
  ends bit-identical to the uninterrupted run.
- a kill in the cell after the training: that cell sees the trained state (the `reference`).
- crash loops: a kernel that dies at every start-up or during every replay (supervised), at the
  start of every attempt or during every replay (interactive, jupyter_client standing in for the
  Jupyter server's restarter) stops at its budget with a report, in bounded time.
- full disk at a safe point (a real kernel): one line, the previous checkpoint stays, the run
  goes on and saves again at the next safe point.

(The full-size trials: ``python benchmarks/reliability.py kill-writes|chaos|crash-loops``.)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import reliability  # noqa: E402

# train.ipynb at the size of the chaos trials: 13 MB checkpoints (weights and AdamW state), whose
# writes last long enough for a kill from outside to land in one; epochs that outlast the restarts
CHAOS = {"epochs": 5, "width": 1024}


def test_the_generation_check_is_exact():
    """The kill trials' verifier catches one changed element and a value of another generation."""
    size = 1 << 20
    ns = reliability.make_namespace(size, 3)
    assert reliability.check_namespace(ns, size, 3) is None
    assert "weights" in reliability.check_namespace(ns, size, 4)
    ns["weights"][12345] += 1
    assert "weights" in reliability.check_namespace(ns, size, 3)
    ns = reliability.make_namespace(size, 3)
    ns["blob"] = reliability.make_namespace(size, 4)["blob"]
    assert "blob" in reliability.check_namespace(ns, size, 3)
    reliability.advance(ns, size, 7)  # advancing in place gives exactly what building gives
    assert reliability.check_namespace(ns, size, 7) is None


@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "background"])
@pytest.mark.one_stack("newest")
def test_sigkill_during_checkpoint_writes_never_loses_the_last_checkpoint(background):
    """A checkpoint writer SIGKILLed at random moments of its saves: every load is the newest
    committed generation or the one before, byte for byte, or none before the first commit. In
    the background, the writer makes the next generation in place while the persist runs: what
    is loaded is still one generation, whole."""
    trials, summary = reliability.kill_trials(10, 48, seed=1, background=background)
    assert summary["data_lost"] == 0, summary["failures"]
    assert summary["faults_survived"] == 10
    assert {t.outcome for t in trials} <= {"latest", "latest (in flight)", "previous", "none yet"}
    # nothing committed is ever lost to a kill: "none yet" only before the first commit
    assert all(t.acknowledged is None for t in trials if t.outcome == "none yet")
    # what the kills left behind (temporary blobs and folders, trash) goes with one clean save
    assert summary["leftovers_after_clean_save"] == []


@pytest.fixture(scope="module")
def chaos_reference(tmp_path_factory) -> harness.Reference:
    """train.ipynb at the chaos trials' size, uninterrupted: what every chaos run must end with (the
    session's `reference` is the small default size, whose checkpoint writes take milliseconds)."""
    work = tmp_path_factory.mktemp("chaos-reference")
    nb = harness.load("train.ipynb", work, **CHAOS)
    run = harness.run(nb, work, standby=False)
    assert run.status == 0, run.message
    return harness.Reference(harness.result(nb), work / "events.log")


@pytest.mark.kernel
@pytest.mark.parametrize("standby, schedule", [
    (False, ["checkpoint write", "start-up", "set-up/replay"]),  # start-up: a restarted kernel
    (True, ["checkpoint write", "start-up", "training", "set-up/replay"]),  # start-up: the standby
], ids=["cold-restarts", "standby"])
def test_chaos_run_with_kills_from_outside_is_bit_identical(standby, schedule, chaos_reference):
    """Kills from outside by PID in the phases of ``schedule``: the run survives every one (a
    standby's death costs no restart) and ends with the uninterrupted run's RESULT line: its
    weights, optimizer state and history."""
    out = reliability.chaos_runs(1, len(schedule), parameters=CHAOS, reference=chaos_reference, seed=3, spread=0,
                                 schedule=schedule, standby=standby)
    run = out["runs"][0]
    assert run["killer_error"] is None
    assert run["status"] == 0, run["message"]
    assert run["kills"] == len(schedule), run
    assert run["standby_kills"] == (1 if standby else 0), run
    assert run["restarts"] == run["kills"] - run["standby_kills"], run  # a standby's death costs no restart
    assert run["identical"], (run["result"], chaos_reference.result)
    assert re.fullmatch(r"RESULT device=cpu history=\[.+\] weights=[0-9a-f]{64} optimizer=[0-9a-f]{64}", run["result"])


@pytest.mark.kernel
def test_a_kill_in_a_cell_after_training_keeps_the_trained_state(reference):
    """A SIGKILL in the plain cell after the finished training: after the restart that cell sees
    the trained state (restored from the finished run, said in its output), not the replayed,
    untrained model, and the training does not run again."""
    with reliability.workspace() as root:
        r = reliability.kill_in_a_later_cell(root, reference.result)
    assert r["restarts"] == 1 and r["trained"]
    assert r["identical"], r
    assert r["marker"] and r["status"] == 0, r


@pytest.mark.kernel
def test_supervised_kernel_dying_at_every_start_up_stops_at_the_budget():
    """Every restarted kernel dies while starting: the driver stops at its budget, quickly, with a
    report of each attempt."""
    # tests/test_driver.py covers a death in the first cell of every kernel; here every restarted
    # kernel dies while starting, before it answers (the driver used to raise RuntimeError)
    with reliability.workspace() as root:
        r = reliability.crash_loop_driver_startup(root, max_restarts=2)
    assert r["status"] == 3, r["message"]
    assert r["restarts"] == 2 and not r["reached"]
    assert ("restart budget of the notebook spent (2/2 restarts of a kernel outside any %%resilient run; raise it "
            "with --max-restarts): the kernel died again in cell 0 (died while starting: killed by SIGKILL") in r["message"]
    assert "1. cell 0: killed by SIGKILL; then the new kernel died while starting" in r["message"]
    assert r["seconds"] < 60


@pytest.mark.kernel
def test_supervised_kernel_dying_during_every_replay_stops_at_the_budget():
    """Every new kernel dies replaying the set-up cell: the deaths while replaying for the run
    count against the run's --max-restarts (not the driver's larger budget), which stops it
    quickly with the run's report, naming the set-up cell as the cause."""
    with reliability.workspace() as root:
        r = reliability.crash_loop_driver_replay(root, max_restarts=2)
    assert r["status"] == 3, r["message"]
    assert r["restarts"] == 2 and not r["reached"]
    assert "failed: restart budget spent (2/2 restarts) and the kernel died again (killed by SIGKILL while replaying " \
           "the set-up cells)" in r["message"]
    assert "Fix the cause (the set-up cell that kills the kernel)" in r["message"]
    assert r["seconds"] < 60


@pytest.mark.kernel
@pytest.mark.parametrize("where", ["attempt", "replay"])
def test_interactive_crash_loop_stops_at_the_budget_and_the_kernel_stays(where):
    """Interactive kernels that die at every attempt, or in every replay: the run's budget stops
    the loop with an error reply naming the restarts, and that kernel stays up."""
    fn = {"attempt": reliability.crash_loop_interactive_attempt, "replay": reliability.crash_loop_interactive_replay}[where]
    with reliability.workspace() as root:
        r = fn(root, max_restarts=2)
    # the first death is counted by the second kernel, the second by the third; the fourth refuses
    assert r["status"] == "error", r
    assert r["kernels"] == 4 and r["deaths"] == 3 and r["exit_codes"] == [-9, -9, -9]
    assert "failed: restart budget spent (2/2 restarts) and the kernel died without warning" in r["report"]
    assert "Restarts: 1. " in r["report"] and "; 2. " in r["report"] and "; 3. " not in r["report"]
    if where == "replay":  # told apart from a death in the training (the OOM killer)
        assert "(2/2 restarts) and the kernel died without warning while replaying the set-up cells" in r["report"]
        assert r["report"].count("while replaying the set-up cells") == 2  # restart 2 and the refused one
    assert r["alive_after"] and r["same_kernel_after"]  # it reports instead of exiting again
    assert r["seconds"] < 60


@pytest.mark.kernel
def test_a_full_disk_at_a_safe_point_keeps_the_previous_checkpoint_and_the_run_goes_on(tmp_path):
    """The disk fills (RLIMIT_FSIZE: writes past 1 MiB fail with EFBIG, as ENOSPC would) for one
    safe point: one line says so, the run trains on, the next safe point saves again."""
    from harness import Kernel

    k = Kernel({"COLAB_RESILIENCE_RUN_DIR": str(tmp_path / "runs"), "IPYTHONDIR": str(tmp_path / "ipython")})
    try:
        k.ok("%load_ext colab_resilience")
        # synchronous saves: the limit set in iteration 1 must hit that safe point's save, not a
        # persist still running from the one before (the background case: tests/test_background_saves.py)
        k.ok("%config ResilienceMagics.staging_memory = 'off'")
        k.ok("import resource, torch\nHARD = resource.getrlimit(resource.RLIMIT_FSIZE)[1]\nbig = torch.zeros(1 << 20)\nstep = -1")
        r = k.ok(
            "%%resilient --save big,step\n"
            "for i in resume_range(4):\n"
            "    big += 1\n"
            "    step = i\n"
            "    full = i == 1\n"
            "    resource.setrlimit(resource.RLIMIT_FSIZE, ((1 << 20) if full else HARD, HARD))\n"
        )
        assert r.stdout.count("checkpoint not written") == 1, r.stdout
        line = next(l for l in r.stdout.splitlines() if "checkpoint not written" in l)
        assert "File too large" in line and "is intact" in line
        assert line.endswith("is intact; the run goes on and tries again at the next safe point"), line
        assert k.value("step") == 3
        k.ok("from colab_resilience.checkpoints import CheckpointStore\nimport glob\n"
             "ck = CheckpointStore(glob.glob(%r + '/run-*/checkpoints')[0]).load()\nback = {}\n"
             "ck.restore(back, rng=False)" % str(tmp_path / "runs"))
        assert k.value("(back['step'], float(back['big'][0]))") == (3, 4.0)
    finally:
        k.shutdown()


def test_hostile_trials_every_attack_refused_cleanly(ip):
    """The shortened `reliability.py hostile`: each kind of folder or link another user prepares
    (twice), and journals moved or rolled back (four of each): every cell refused in one line,
    its body not run, the other side's files untouched, the newest journal accepted again."""
    import os
    import shutil

    import hostile

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("acting as a second user needs root and setpriv (util-linux)")
    out = hostile.hostile(2 * len(hostile.ATTACKS), 8, seed=1)
    assert out["attacks"]["failures"] == [] and out["journals"]["failures"] == []
    assert all(clean == trials == 2 for trials, clean in out["attacks"]["per"].values())
    assert all(clean == trials == 4 for trials, clean in out["journals"]["per"].values())
