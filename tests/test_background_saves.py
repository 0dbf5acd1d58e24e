"""Checkpoints written while training goes on: a snapshot at the safe point, the persist on a
thread of its own (issue 18).

What must hold: what is written is the state at the safe point, though training writes its
tensors meanwhile (also `tests/test_reliability.py`, the kill-writes trial in the background);
the journal and `LATEST` name only checkpoints on disk, so a kill during a persist resumes from
the one before, identically; whatever needs the checkpoint waits for it (an in-process retry,
the end of the cell, a restart); the staging memory is bounded, and a state that does not fit is
written while training waits, said once; a safe point that finds the previous persist still
writing waits for it or, if asked, is not saved, and `%resilience status` says which.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import harness
from colab_resilience.checkpoints import CheckpointStore
from colab_resilience.checkpoints.staging import Budget, parse_budget
from colab_resilience.run import restore_latest
from colab_resilience.signing import load_or_create_key

STATE = "import torch\nw = torch.zeros(1 << 24)  # 64 MiB, changed in place by every iteration\nhistory = []\n"


def last_checkpoint(runs: Path) -> dict:
    """The values of the newest checkpoint of the only run under ``runs``, loaded from disk."""
    [run_dir] = runs.glob("run-*")
    store = CheckpointStore(run_dir / "checkpoints", key=load_or_create_key(), run_id=run_dir.name[4:])
    out: dict = {}
    restore_latest(store, out, ["w", "history"], rng=False)
    return out


def status(ip, capsys) -> str:
    capsys.readouterr()
    ip.run_line_magic("resilience", "status")
    return capsys.readouterr().out


@pytest.mark.parametrize("error, saves", [
    ('torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")', "in the background"),
    ("MemoryError()", "synchronous (host memory ran out)"),
], ids=["gpu-oom", "host-oom"])
def test_an_oom_retry_rolls_back_to_the_checkpoint_being_written(ip, tmp_path, capsys, error, saves):
    """An out-of-memory error right after a safe point, while its 64 MiB checkpoint is still
    being written: the retry waits for it and goes on from that safe point, not the one before.
    After host memory ran out the staging memory is given back and the run saves synchronously
    (staging must not make a second OOM likelier); after a GPU's, the host staging stays."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell(STATE + "struck = []\n")
    ip.run_cell_magic("resilient", "--save w,history", (
        "for i in resume_range(4):\n"
        "    if i == 2 and not struck:\n"
        "        struck.append(i)\n"
        f"        raise {error}\n"
        "    w.add_(1.0)\n"
        "    history.append(float(w[0]))\n"
    ))
    out = capsys.readouterr().out
    assert "rolled back to the last safe point; continuing at 2" in out, out
    assert ip.user_ns["history"] == [1.0, 2.0, 3.0, 4.0]
    saved = last_checkpoint(tmp_path / "runs")
    assert saved["history"] == [1.0, 2.0, 3.0, 4.0] and bool((saved["w"] == 4.0).all())
    assert f"saves {saves}" in status(ip, capsys)


LIMITED = """
import resource, sys, threading
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "colab_resilience")
ip.run_line_magic("resilience", "dir " + sys.argv[1])
ip.run_cell("%%replay\\nimport torch\\nw = torch.zeros(1 << 18)\\nhistory = []")
limit, field = getattr(resource, sys.argv[2]), sys.argv[3]
with open("/proc/self/status") as f:
    held = next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
resource.setrlimit(limit, (held + (256 << 20), resource.getrlimit(limit)[1]))
r = ip.run_cell("%%resilient --save w,history --retries 0\\nfor i in resume_range(4):\\n"
                "    big = torch.ones(150 << 18)  # 150 MiB, touched\\n"
                "    w.add_(big[:1 << 18]); history.append(float(w[0])); del big")
print("RESULT", "ok" if r.success else type(r.error_in_exec).__name__, ip.user_ns["history"])
print("THREADS", sorted(t.name for t in threading.enumerate() if t.name.startswith("colab_resilience")))
ip.run_line_magic("resilience", "status")
"""


@pytest.mark.parametrize("limit, field, why", [
    ("RLIMIT_DATA", "VmData", "the data size is limited (ulimit -d)"),
    ("RLIMIT_AS", "VmSize", "the address space is limited (ulimit -v)"),
])
def test_under_a_memory_limit_saves_take_none_of_what_the_training_may_allocate(tmp_path, limit, field, why):
    """`ulimit -d` (RLIMIT_DATA: how the demo makes its real OOM) or `ulimit -v` (RLIMIT_AS), 256 MiB
    above what the process holds, and iterations that each need 150 MiB. Linux counts every
    private writable mapping against the data limit, and every mapping against the address-space
    one: the staging memory (a 64 MiB arena), the persisting thread's stack, and under `ulimit -v`
    each hashing thread's stack and malloc arena (two threads: 144 MiB) came out of what the
    training may allocate, and the first iteration failed with a real out-of-memory error. (Found
    by the demo's check, which shrank the batch once more than its twin in one CI run in fifteen;
    and by a probe under `ulimit -v`, where iterations of 150 MiB failed.) Saves are synchronous
    from the start, status says so and why (its first line said "written in the background"),
    and the hashing is done on the kernel's own thread: no thread of this package is started. A
    real process, a real limit. 150 MiB leaves 106 MiB for what else the process maps meanwhile:
    with 200 MiB (56 left) the Colab stack's run failed once in a suite, with no thread of ours;
    one thread's first malloc takes 72 MiB of address space (its stack and arena, measured), and
    our two hashing threads took 144."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", LIMITED, str(tmp_path / "runs"), limit, field], capture_output=True,
                       text=True, env=harness.child_env(), timeout=180)
    assert "RESULT ok [1.0, 2.0, 3.0, 4.0]" in r.stdout, r.stdout + r.stderr
    assert "THREADS []" in r.stdout, r.stdout
    assert f"saves synchronous ({why})" in r.stdout, r.stdout
    assert f"; checkpoints written while training waits ({why}, which would count" in r.stdout, r.stdout
    saved = last_checkpoint(tmp_path / "runs")
    assert saved["history"] == [1.0, 2.0, 3.0, 4.0] and bool((saved["w"] == 4.0).all())


def test_a_state_larger_than_the_staging_memory_is_written_while_training_waits(ip, tmp_path, capsys):
    """staging_memory 1 MiB, a 64 MiB tensor: it is written during the stall (said once, with
    what the stall cost), and every checkpoint holds the state of its safe point."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_line_magic("config", "ResilienceMagics.staging_memory = '1MiB'")
    ip.run_cell(STATE)
    ip.run_cell_magic("resilient", "--save w,history", (
        "for i in resume_range(4):\n"
        "    w.add_(1.0)\n"
        "    history.append(float(w[0]))\n"
    ))
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "did not fit in the staging memory (1.0 MiB)" in line]
    assert len(said) == 1, out
    assert said[0].startswith("colab_resilience: 64.0 MiB of the state did not fit")
    assert "raise ResilienceMagics.staging_memory" in said[0]
    saved = last_checkpoint(tmp_path / "runs")
    assert saved["history"] == [1.0, 2.0, 3.0, 4.0] and bool((saved["w"] == 4.0).all())


def test_when_busy_skip_leaves_out_safe_points_and_says_so(ip, tmp_path, capsys):
    """Iterations much shorter than the write of a 256 MiB checkpoint, when_busy='skip': safe
    points that come while the previous checkpoint is being written are not saved (one line, and
    a count in %resilience status); the end of the cell still saves, and waits for it."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_line_magic("config", "ResilienceMagics.when_busy = 'skip'")
    ip.run_cell("import torch\nw = torch.zeros(1 << 26)\nhistory = []\n")
    ip.run_cell_magic("resilient", "--save w,history", (
        "for i in resume_range(6):\n"
        "    w[i] = 1.0\n"
        "    history.append(i)\n"
    ))
    out = capsys.readouterr().out
    assert out.count("so it was not saved (when_busy='skip')") == 1, out
    said = status(ip, capsys)
    assert re.search(r"(1 safe point|[2-9] safe points) not saved \(the previous write was still going\)", said), said
    saved = last_checkpoint(tmp_path / "runs")
    assert saved["history"] == list(range(6)) and int(saved["w"].sum()) == 6


@pytest.mark.one_stack("newest")
def test_a_kill_while_a_checkpoint_is_written_resumes_from_the_last_one_on_disk(tmp_path, tmp_path_factory):
    """Supervised, a SIGKILL just after the first minibatch of epoch 2, while the checkpoint of
    the end of epoch 1 (a model of width 1024 and its AdamW state, 13 MiB) may still be being
    written: the run resumes from the last checkpoint on disk (epoch 2, or epoch 1 if the kill
    came first), the driver's marker and the kernel agree on where, and the result is the
    uninterrupted run's, bit for bit."""
    work = tmp_path_factory.mktemp("twin")
    nb = harness.load("train.ipynb", work, width=1024)
    assert harness.run(nb, work, standby=False).status == 0
    reference = harness.result(nb)
    nb = harness.load("train.ipynb", tmp_path, width=1024, fault="sigkill", fault_epoch=2, fault_step=0)
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0, run.message
    [restart] = run.restarts
    assert restart.iteration in ("1", "2")
    text = harness.cell_text(nb.cells[harness.index(nb, "train")])
    assert f"resumed at iteration {restart.iteration} in" in text and f"continuing at {restart.iteration}" in text
    assert harness.result(nb) == reference


def test_the_staging_budget_is_checked_when_it_is_set(ip):
    """A budget that is not a share, a size or off is refused in one line; the old one stays."""
    with pytest.raises(ValueError, match=r"^a percentage \(25%\), a size \(2GiB, 512MB\) or off \(got 'lots'\)$"):
        parse_budget("lots")
    assert parse_budget("25%") == Budget(0.25, None)
    assert parse_budget("2GiB") == Budget(None, 2 << 30)
    assert parse_budget("off").off
    ip.run_line_magic("config", "ResilienceMagics.staging_memory = '2GiB'")
    ip.run_line_magic("config", "ResilienceMagics.staging_memory = 'lots'")
    from colab_resilience.session import session_of

    assert session_of(ip).saving() == (Budget(None, 2 << 30), "wait")


@pytest.mark.kernel
def test_a_checkpoint_that_cannot_be_written_in_the_background_is_said_and_the_run_goes_on(tmp_path):
    """Every write past 1 MiB fails (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) while the
    cell runs: each save's failure, found by the persisting thread, is said in one line at the
    next safe point, and training goes on to the end; there, the final state that could not be
    saved stops the cell in one line (the run stays pending: see test_restart)."""
    k = harness.Kernel({"COLAB_RESILIENCE_RUN_DIR": str(tmp_path / "runs"), "IPYTHONDIR": str(tmp_path / "ipython")})
    try:
        k.ok("%load_ext colab_resilience")
        k.ok("import resource, torch\nHARD = resource.getrlimit(resource.RLIMIT_FSIZE)[1]\nbig = torch.zeros(1 << 20)")
        r = k.execute(
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, HARD))\n"
            "try:\n"
            "    get_ipython().run_cell_magic('resilient', '--save big,step', "
            "'for step in resume_range(3):\\n    big += 1\\n')\n"
            "finally:\n"
            "    resource.setrlimit(resource.RLIMIT_FSIZE, (HARD, HARD))\n"
        )
        failed = [line for line in r.stdout.splitlines() if "checkpoint not written" in line]
        assert len(failed) == 4, r.stdout  # the loop's start, 3 iterations
        assert all("File too large" in line and "there is no earlier checkpoint" in line for line in failed)
        assert r.ename == "UsageError" and "finished its training, but its final state could not be saved (File too " \
            "large)" in r.evalue and r.evalue.endswith("it goes on from the start"), r.evalue
        assert k.value("(step, float(big[0]))") == (2, 3.0)
    finally:
        k.shutdown()


def _changed_between_runs_notebook(mark):
    """Two %%resilient cells training one model; between them a plain cell (not replayed) lowers
    the optimizer's rate. The second cell is killed in its first iteration, once."""
    kill = (f"        if not os.path.exists({str(mark)!r}):\n"
            f"            open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")
    train = ("    for i in range(0, 96, 16):\n"
             "        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean(); opt.zero_grad(); loss.backward(); opt.step()\n"
             "    losses.append(loss.item())\n")
    return harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport os, signal, torch\ntorch.manual_seed(0)\nX = torch.randn(96, 6); Y = X[:, :1] * 2\n"
        "model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.01)\nlosses = []",
        "%%resilient --save model,opt,losses\nfor epoch in resume_range(3):\n" + train,
        "for group in opt.param_groups:\n    group['lr'] = 0.003",
        "%%resilient --save model,opt,losses\nfor epoch in resume_range(3, 6):\n    if epoch == 3:\n" + kill + train,
        "print('RESULT', losses, opt.param_groups[0]['lr'], model[0].weight.sum().item())",
    )


@pytest.mark.one_stack("newest")
def test_a_runs_first_checkpoint_is_on_disk_before_its_training_goes_on(tmp_path):
    """Killed in the first iteration of a run, while its first checkpoint (the loop's start) was
    still being written: the run found no checkpoint and started again from what the set-up cell
    and the finished run before it make, without what the plain cell between them changed (the
    optimizer's rate), and said done with other weights (found by a probe). The first checkpoint
    of a run is written before its training goes on; the run resumes from it, bit for bit as its
    twin."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, _changed_between_runs_notebook)
    out = harness.cell_text(nb.cells[4])
    assert len(run.restarts) == 1 and "continuing at 3" in out and "no checkpoint yet" not in out, out
    assert harness.result(nb) == harness.result(twin)
    assert " 0.003 " in harness.result(twin), harness.result(twin)


def test_a_snapshot_holds_the_safe_points_values_while_training_writes_them_at_once(tmp_path):
    """A snapshot in staging memory (the first half of a background save), then every saved value
    written in place before the persist runs, as the next iteration does: the checkpoint holds
    the safe point's bytes. Large tensors are copied by the pool, small ones (a bias, AdamW's step
    count, a small array) by the snapshot itself; a view with gaps, a transposed tensor and NumPy
    arrays too. (tests/test_cuda.py: the same for CUDA tensors.)"""
    import numpy as np
    import torch

    from colab_resilience.checkpoints.staging import Staging

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 3))  # 256 KiB, 3 KiB, 12 B
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    big = torch.randn(512, 512)
    ns = {"model": model, "opt": opt, "view": big.t()[::2], "small": np.arange(10.0), "large": np.ones((300, 300))}
    expected = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": {k: v.clone() for k, v in opt.state[model[1].bias].items()},
        "view": ns["view"].clone(), "small": ns["small"].copy(), "large": ns["large"].copy(),
    }
    store = CheckpointStore(tmp_path / "c", key=b"k" * 32)
    snap = store.snapshot(ns, list(ns), staging=Staging(Budget()))
    assert snap.staged and not snap.written_through
    with torch.no_grad():  # the next iteration, before the persist has run
        for p in model.parameters():
            p.add_(1.0)
        opt.step()
        big.mul_(3.0)
    ns["small"] += 1
    ns["large"] *= 2
    store.persist(snap)
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 3))
    out = {"model": fresh, "opt": torch.optim.AdamW(fresh.parameters())}
    store.load().restore(out, list(ns))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected["model"].items())
    state = out["opt"].state[fresh[1].bias]
    assert state.keys() == expected["opt"].keys() and all(torch.equal(state[k], v) for k, v in expected["opt"].items())
    assert torch.equal(out["view"], expected["view"])
    assert np.array_equal(out["small"], expected["small"]) and np.array_equal(out["large"], expected["large"])
