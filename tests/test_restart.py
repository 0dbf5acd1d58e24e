"""Restart and resume in real kernels; jupyter_client stands in for the Jupyter server's restarter.

A training loop with shuffling and dropout is interrupted by a SIGKILL, by an OOM beyond the
retries, and by planned restarts; each time the final weights must be bit-identical to those of an
uninterrupted run, and a log written at the end of every epoch proves that each epoch after the
last safe point ran exactly once.
"""

from __future__ import annotations

import json
import time

import pytest

from kernels import HOST_OOM, Kernel

pytestmark = pytest.mark.kernel

REPLAY = """%%replay
import os, signal, torch
torch.manual_seed(0)
torch.set_num_threads(1)
X = torch.randn(256, 16)
Y = (X.sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
"""

TRAIN = """%%resilient --save model,opt,history --retries 1 --max-restarts {max_restarts}
history = []
for epoch in resume_range(4):
    perm = torch.randperm(len(X))
    for b in range(0, len(X), 64):
        idx = perm[b:b + 64]
        loss = torch.nn.functional.cross_entropy(model(X[idx]), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if epoch == 2 and b == 128 and (not os.path.exists({mark!r}) or open({mark!r}).read() == str(os.getpid())):
            open({mark!r}, 'w').write(str(os.getpid()))
            {fault}
    history.append(round(loss.item(), 6))
    with open({log!r}, 'a') as f:
        f.write(f'{{epoch}}\\n')
"""

FAULTS = {
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)",
    "oom": HOST_OOM,  # a real allocator failure, every attempt in this kernel
    "none": "pass",
}

DIGEST = (
    "(__import__('hashlib').sha256(b''.join(t.numpy().tobytes() for t in model.state_dict().values()))"
    ".hexdigest(), history)"
)


@pytest.fixture
def env(tmp_path):
    """A private run directory and IPython profile per test (startup files stay in it)."""
    return {
        "COLAB_RESILIENCE_RUN_DIR": str(tmp_path / "runs"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
    }


def train_source(tmp_path, fault: str, max_restarts: int = 3) -> str:
    return TRAIN.format(
        mark=str(tmp_path / "fault-mark"), log=str(tmp_path / "epochs.log"),
        fault=FAULTS[fault], max_restarts=max_restarts,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: same cells, no fault."""
    tmp = tmp_path_factory.mktemp("reference")
    k = Kernel({"COLAB_RESILIENCE_RUN_DIR": str(tmp / "runs"), "IPYTHONDIR": str(tmp / "ipython")})
    try:
        k.ok("%load_ext colab_resilience")
        k.ok(REPLAY)
        k.ok(train_source(tmp, "none"))
        return k.value(DIGEST)
    finally:
        k.shutdown()


def epochs_logged(tmp_path) -> list[int]:
    return [int(x) for x in (tmp_path / "epochs.log").read_text().split()]


@pytest.mark.parametrize("fault", ["sigkill", "oom"])
def test_interrupted_run_resumes_bit_identical(tmp_path, env, reference, fault):
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience")
        k.ok(REPLAY)
        source = train_source(tmp_path, fault)
        out, code = k.execute_until_exit(source)
        first_pid = k.pid
        if fault == "oom":
            assert code == 75
            assert "retry 1/1" in out
            assert "restarting the kernel; restart 1/3" in out
        else:
            assert code == -9
        k.restart()
        assert k.pid != first_pid
        # As a user would: run the interrupted cell again, nothing else. The startup file
        # loaded the extension; the run replays the set-up cell and restores the state.
        r = k.ok(source)
        assert "colab_resilience: replayed import os, signal, torch" in r.stdout
        assert "colab_resilience: resumed run" in r.stdout
        assert "restart 1/3" in r.stdout and "continuing at 2" in r.stdout
        assert k.value(DIGEST) == reference
        assert epochs_logged(tmp_path) == [0, 1, 2, 3]  # each epoch exactly once
        runs = list((tmp_path / "runs").glob("run-*/journal.json"))
        journal = json.loads(runs[0].read_text())
        assert journal["status"] == "done" and journal["restarts_used"] == 1
        # the run is over: the startup file is gone
        assert not list((tmp_path / "ipython").glob("profile_default/startup/*colab_resilience*"))
    finally:
        k.shutdown()


def test_planned_restarts_do_not_spend_the_budget(tmp_path, env, reference):
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience")
        k.ok(REPLAY)
        k.ok("%restart_after 2")
        source = train_source(tmp_path, "none", max_restarts=0)
        out, code = k.execute_until_exit(source)
        assert code == 75
        assert "planned restart after 2 safe points in" not in out  # at a safe point, not mid-epoch
        assert "planned restart after 2 safe points: restarting the kernel." in out
        k.restart()
        # "Run all": the set-up cell runs again by itself, so the run does not replay it twice
        k.ok("%load_ext colab_resilience")
        k.ok(REPLAY)
        r = k.ok(source)  # epochs 2 and 3; no restart after the last epoch
        assert "continuing at 2" in r.stdout
        assert "replayed" not in r.stdout
        assert k.value(DIGEST) == reference
        assert epochs_logged(tmp_path) == [0, 1, 2, 3]
    finally:
        k.shutdown()


def test_always_oom_stops_at_its_budget_with_a_report(tmp_path, env):
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience")
        k.ok("%%replay\nimport torch")
        cell = f"%%resilient --retries 0 --max-restarts 2\n{HOST_OOM}\n"
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
    k = Kernel(env)
    try:
        k.ok("%load_ext colab_resilience")
        k.ok(REPLAY)
        k.ok("%restart_after --memory 1%")  # any machine uses more than 1% of its RAM
        source = train_source(tmp_path, "none", max_restarts=0)
        out, code = k.execute_until_exit(source)
        assert code == 75
        assert "planned restart: host RAM in use at" in out and "(threshold 1%)" in out
        k.restart()
        k.ok("%restart_after off")  # set in the new kernel: wins over the journal's policy
        r = k.ok(source)
        assert "continuing at 1" in r.stdout
        assert k.value(DIGEST) == reference
        assert epochs_logged(tmp_path) == [0, 1, 2, 3]
    finally:
        k.shutdown()


def test_supervised_kernel_exits_with_the_documented_code_and_no_startup_file(tmp_path, env):
    k = Kernel({**env, "COLAB_RESILIENCE_SUPERVISED": "1"})
    try:
        k.ok("%load_ext colab_resilience")
        k.ok("%%replay\nimport torch")
        out, code = k.execute_until_exit(f"%%resilient --retries 0\n{HOST_OOM}\n")
        assert code == 75
        assert "restarting the kernel; restart 1/3" in out
        assert not list((tmp_path / "ipython").glob("profile_default/startup/*colab_resilience*"))
        journal = json.loads(next((tmp_path / "runs").glob("run-*/journal.json")).read_text())
        assert journal["status"] == "pending" and journal["restart_requested"] is True
        assert journal["interrupted_cell"].startswith("%%resilient --retries 0")
        assert [c["source"].strip() for c in journal["replay_cells"]] == ["%%replay\nimport torch"]
    finally:
        k.shutdown()


def test_a_second_kernel_on_the_same_run_is_refused(tmp_path, env):
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
