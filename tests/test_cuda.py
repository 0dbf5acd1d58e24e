"""CUDA for real, where the machine has a GPU (skipped elsewhere; CI has none).

A real CUDA out-of-memory error from torch's caching allocator is caught, what it held is given back
to the device and the cell is retried smaller; CUDA tensors, modules, optimizers and the CUDA random
state saved in one process come back on the GPU in another, byte for byte; a supervised run on the
GPU, killed or out of memory mid-epoch, resumes bit-identical, and its standby kernel never opened
the GPU; GPU memory in use triggers a planned restart. With `%resilience isolate`, a worker that dies on the
GPU is replaced within the same execution, and the notebook's kernel never opens the GPU.

The supervised runs are tests/files/train.ipynb with device="cuda", compared with this module's
`gpu_reference` (the same notebook on the GPU, uninterrupted: CUDA computes other bits than the CPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from harness import Kernel, cell_text, child_env, faulted_and_twin, index, insert, load, result, run_interactive
from test_isolation import holds_torch, recovered, running, standby_pid, worker_pid
from test_standby import SIBLINGS, WAIT_WARM, line, resumed, run


pytestmark = [
    pytest.mark.kernel,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

def test_a_real_cuda_oom_is_freed_and_retried_smaller(kernel):
    """The allocator is capped at 2.5 GiB; 1 GiB held in the failing frame must be given back to the
    device before the retry, or the retry (1 GiB held + 1 GiB of work) fails as well."""
    kernel.ok("import torch\n%load_ext colab_resilience")
    kernel.ok(
        "torch.cuda.set_per_process_memory_fraction(2.5 * 2**30 / torch.cuda.get_device_properties(0).total_memory)\n"
        "batch_size = 8192\nstarts = []\nbase = torch.cuda.memory_allocated()"
    )
    r = kernel.ok(
        "%%resilient --retries 3 --shrink batch_size\n"
        "def step(n):\n"
        "    starts.append(torch.cuda.memory_allocated())\n"
        "    held = torch.ones(1 << 28, device='cuda')      # 1 GiB, alive in this frame when the OOM comes\n"
        "    work = torch.ones(n, 1 << 16, device='cuda')   # n x 256 KiB: 2 GiB does not fit, 1 GiB does\n"
        "    return float(held[0]) + work.shape[0]\n"
        "result = step(batch_size)\n"
    )
    [line] = [l for l in r.stdout.splitlines() if "; retry " in l]
    assert re.fullmatch(
        r"colab_resilience: OOM \(CUDA out of memory\) — unbound step \(new since the last safe point\) and "
        r"freed [\d.]+ GiB; batch_size 8192 → 4096; retry 1/3", line
    ), line
    base, starts, after, result, reserved = kernel.value(
        "(base, starts, torch.cuda.memory_allocated(), result, torch.cuda.memory_reserved())")
    assert result == 1 + 4096
    assert starts == [base, base]  # the retry started with nothing of the failed attempt left on the GPU
    assert after == base
    assert reserved <= 1.25 * 2**30 + (1 << 30)  # the cache was emptied, not kept at the failed peak


SAVE = """
import sys, hashlib, torch
from colab_resilience.checkpoints import CheckpointStore
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
opt = torch.optim.AdamW(m.parameters(), lr=0.01)
for _ in range(3):
    opt.zero_grad(); m(torch.randn(8, 64, device='cuda')).pow(2).mean().backward(); opt.step()
base = torch.randn(6, 8, device='cuda').to(torch.bfloat16)
conv = torch.nn.Conv2d(3, 8, 3).cuda().to(memory_format=torch.channels_last)
copt = torch.optim.Adam(conv.parameters())
conv(torch.randn(2, 3, 6, 6, device='cuda').to(memory_format=torch.channels_last)).sum().backward(); copt.step()
ns = dict(m=m, opt=opt, views=(base.t(), base[2:4]), half=torch.randn(5, device='cuda').half(), step=3,
          conv=conv, copt=copt, cl=torch.randn(2, 3, 4, 5, device='cuda').to(memory_format=torch.channels_last),
          tt=torch.randn(8, 6, device='cuda').t())
CheckpointStore(sys.argv[1]).save(ns, list(ns))
"""
LOAD = """
import sys, hashlib, torch
from colab_resilience.checkpoints import CheckpointStore
m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
opt = torch.optim.AdamW(m.parameters(), lr=0.01)
conv = torch.nn.Conv2d(3, 8, 3).cuda().to(memory_format=torch.channels_last)
copt = torch.optim.Adam(conv.parameters())
params = [id(p) for p in m.parameters()]
ns = dict(m=m, opt=opt, conv=conv, copt=copt)
CheckpointStore(sys.argv[1]).load().restore(ns)
assert [id(p) for p in ns['m'].parameters()] == params and ns['opt'] is opt  # in place
t, rows = ns['views']
assert not t.is_contiguous() and t.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
"""
REPORT = """
def raw(x):
    return x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
print('devices', sorted({str(x.device) for x in [*m.parameters(), *[s for s in state if s.dim()], t, rows, ns['half']]}))
print('dtypes', t.dtype, rows.dtype, ns['half'].dtype, ns['step'])
cstate = copt.state[conv.weight]
print('layouts', conv.weight.stride(), cstate['exp_avg'].stride(), cstate['exp_avg'].device,
      ns['cl'].stride(), ns['cl'].device, ns['tt'].stride(), ns['tt'].device)
print('bytes', hashlib.sha256(b''.join(raw(x) for x in [*m.state_dict().values(), *state, t, rows, ns['half'],
      *conv.state_dict().values(), cstate['exp_avg'], cstate['exp_avg_sq'], ns['cl'], ns['tt']])).hexdigest())
print('next draws', torch.rand(3, device='cuda').tolist(), torch.rand(2).tolist())
"""


def test_cuda_state_comes_back_on_the_gpu_in_another_process(tmp_path):
    """Modules and AdamW in place, a bf16 transposed view and a slice sharing its storage, fp16, the
    CUDA and CPU random states, a channels_last convolution with its Adam moments, a channels_last
    tensor and a transpose of their own (on the GPU with their strides): what the saving process
    has is what a fresh process restores."""
    env = child_env(COLAB_RESILIENCE_HOME=str(tmp_path / "home"))
    run = str(tmp_path / "run")
    saved = subprocess.run([sys.executable, "-c", SAVE + "t, rows = ns['views']\n" + REPORT, run],
                           env=env, capture_output=True, text=True, check=False)
    assert saved.returncode == 0, saved.stderr
    loaded = subprocess.run([sys.executable, "-c", LOAD + REPORT, run], env=env, capture_output=True, text=True, check=False)
    assert loaded.returncode == 0, loaded.stderr
    assert "devices ['cuda:0']" in saved.stdout
    assert "layouts (27, 1, 9, 3) (27, 1, 9, 3) cuda:0 (60, 1, 15, 3) cuda:0 (1, 6) cuda:0" in saved.stdout
    assert loaded.stdout == saved.stdout


# In a kernel: whether a process has the GPU open (a CUDA context holds /dev/nvidia* open).
GPU_OPEN = textwrap.dedent("""\
    def gpu_open(pid):
        found = False
        for fd in os.listdir(f'/proc/{pid}/fd'):
            try:
                found = found or os.readlink(f'/proc/{pid}/fd/{fd}').startswith('/dev/nvidia')
            except OSError:
                pass
        return found
""")

_probe = {"os": os}
exec(GPU_OPEN, _probe)
gpu_open = _probe["gpu_open"]  # the same, in this process


@pytest.fixture
def deterministic_cublas(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # asked for by use_deterministic_algorithms


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory):
    """train.ipynb on the GPU, uninterrupted: the RESULT line of this module's interrupted runs."""
    tmp = tmp_path_factory.mktemp("gpu-reference")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    try:
        nb = load("train.ipynb", tmp, device="cuda")
        assert run(nb, tmp, standby=False).status == 0
    finally:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    return line(nb, "RESULT")


@pytest.mark.parametrize("fault", ["sigkill", "cuda-oom"])
def test_a_supervised_gpu_run_resumes_bit_identical_and_the_standby_never_opened_the_gpu(
        tmp_path, gpu_reference, deterministic_cublas, fault):
    """A SIGKILL, or a real CUDA OOM in every attempt of the first kernel (past its one retry),
    mid-epoch 2 of a training on the GPU (the CUDA random state drives the shuffles and dropout):
    the standby takes over and the run ends bit-identical; the working kernel had the GPU open,
    the warm standby (torch imported) never did."""
    nb = load("train.ipynb", tmp_path, device="cuda", fault=fault, fault_epoch=2, fault_step=4, retries=1,
              staging="off")  # the checkpoint of epoch 1 on disk when the kill comes: "continuing at 2"
    insert(nb, "train", SIBLINGS + GPU_OPEN + WAIT_WARM + "\nprint('GPU', gpu_open(os.getpid()), gpu_open(spare))",
           "gpu-probe")
    result = run(nb, tmp_path)
    assert result.status == 0, result.message
    assert line(nb, "RESULT") == gpu_reference
    assert "device=cuda:0" in gpu_reference
    # the working kernel has the GPU open; the warm standby (torch imported) has not
    assert line(nb, "GPU").split() == ["GPU", "True", "False"]
    [restart] = result.restarts
    assert restart.standby
    assert restart.exit_code == (-9 if fault == "sigkill" else 75)
    text = cell_text(nb.cells[index(nb, "train")])
    if fault == "cuda-oom":
        assert "OOM (CUDA out of memory) — freed" in text and "retry 1/1" in text
    assert resumed("switched to the standby kernel", cells=3, iteration=2) in text
    assert "continuing at 2" in text


@pytest.mark.parametrize("fault", ["kill", "oom"])
def test_a_channels_last_model_on_the_gpu_resumes_bit_identical(tmp_path, deterministic_cublas, fault):
    """A BatchNorm-first convolutional model in channels_last on the GPU, with a bank of
    channels_last batches in --save (snapshotted through pinned memory, in their memory order):
    after a SIGKILL or an OOM the run ends bit for bit as its twin, the bank and Adam's moments
    with their layout on the GPU."""
    from test_exact_resume import _channels_last_notebook

    faulted, nb, twin = faulted_and_twin(tmp_path, lambda mark: _channels_last_notebook(fault, mark, "cuda"))
    assert len(faulted.restarts) == (fault == "kill"), cell_text(nb.cells[2])
    assert result(nb) == result(twin)
    assert result(nb).startswith("RESULT (192, 1, 24, 3) (27, 1, 9, 3) "), result(nb)
    assert result(nb).endswith(" cuda:0"), result(nb)


def test_the_code_above_the_first_loop_draws_on_the_gpu_what_the_run_began_with(tmp_path, deterministic_cublas):
    """The run's random state kept in its journal holds the GPU's: a plain cell drew on the GPU
    after the %%replay cell, the training cell draws a permutation on the GPU above its loop and is
    killed there; the new kernel sets the GPU's random state the run began with, bit for bit as
    the twin."""
    from test_exact_resume import drawn_above_the_loop_notebook

    faulted, nb, twin = faulted_and_twin(
        tmp_path, lambda mark: drawn_above_the_loop_notebook("above-the-loop", mark, "cuda"))
    assert len(faulted.restarts) == 1 and "no checkpoint yet" in cell_text(nb.cells[3]), cell_text(nb.cells[3])
    assert result(nb) == result(twin) and result(nb).endswith(" cuda:0"), result(nb)


def test_gpu_memory_in_use_triggers_a_planned_restart(tmp_path):
    """`%restart_after --memory 80%`: 90% of the GPU's memory in use at a safe point makes the
    kernel leave for a planned restart."""
    k = Kernel({"COLAB_RESILIENCE_RUN_DIR": str(tmp_path / "runs"), "IPYTHONDIR": str(tmp_path / "ipython")})
    try:
        k.ok("%load_ext colab_resilience")
        k.ok("%%replay\nimport torch")
        k.ok("%restart_after --memory 80%")
        out, code = k.execute_until_exit(
            "%%resilient --max-restarts 0\n"
            "for i in resume_range(3):\n"
            "    if i == 0:\n"
            "        free, total = torch.cuda.mem_get_info()\n"
            "        big = torch.empty(free - total // 10, dtype=torch.uint8, device='cuda')  # 90% in use\n"
        )
        assert code == 75, out
        assert re.search(r"planned restart: GPU memory in use at 9\d% \(threshold 80%\)", out), out
    finally:
        k.shutdown()


def test_a_snapshot_of_cuda_tensors_holds_their_values_at_the_safe_point(tmp_path):
    """A snapshot copies CUDA tensors (a module, AdamW state, a non-contiguous view) to pinned
    memory, queued on the training's stream; training writes them on that stream at once, before
    the persist has run: the checkpoint holds the values of the safe point, byte for byte."""
    from colab_resilience.checkpoints import CheckpointStore
    from colab_resilience.checkpoints.staging import Budget, Staging

    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    opt.step()
    big = torch.randn(4096, 1024, device="cuda")
    ns = {"model": model, "opt": opt, "view": big.t()[::2]}
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    expected_view = ns["view"].cpu().clone()
    expected_avg = opt.state[model.weight]["exp_avg"].cpu().clone()
    store = CheckpointStore(tmp_path / "c", key=b"k" * 32)
    snap = store.snapshot(ns, ["model", "opt", "view"], staging=Staging(Budget()))
    with torch.no_grad():  # on the training's stream, right after the safe point
        model.weight.add_(1.0)
        big.mul_(3.0)
        opt.state[model.weight]["exp_avg"].add_(1.0)
    store.persist(snap)
    out = {}
    ckpt = store.load()
    ckpt.restore(out, ["view"])
    fresh = torch.nn.Linear(512, 512).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    ckpt.restore({"model": fresh, "opt": fresh_opt}, ["model", "opt"])
    assert all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in expected.items())
    assert torch.equal(out["view"].cpu(), expected_view)
    assert torch.equal(fresh_opt.state[fresh.weight]["exp_avg"].cpu(), expected_avg)


@pytest.mark.parametrize("fault", ["sigkill", "cuda-oom"])
def test_an_isolated_worker_that_dies_on_the_gpu_is_replaced_and_the_notebooks_kernel_never_opens_it(
        gpu_reference, deterministic_cublas, relay, tmp_path, fault):
    """`%resilience isolate` on a GPU (issue 19): the worker trains on the GPU and is killed
    (SIGKILL) or runs out of CUDA memory past its retries mid-epoch 2; the warm standby takes over
    inside the same execution of the training cell and the result is the uninterrupted run's on the
    GPU, bit for bit. The notebook's kernel never imported torch nor opened the GPU; the standby had
    imported torch ahead without opening it."""
    nb = load("train.ipynb", tmp_path, device="cuda", fault=fault, fault_epoch=2, fault_step=4, retries=0,
              staging="off")
    first, spare = worker_pid(relay), standby_pid(relay)
    assert spare is not None
    run_interactive(relay, nb, start="parameters", stop="train")  # the set-up: the worker's tensors on the GPU
    deadline = time.monotonic() + 60
    while not holds_torch(spare) and time.monotonic() < deadline:  # the standby imports torch ahead
        time.sleep(0.1)
    assert holds_torch(spare)
    assert gpu_open(first) and not gpu_open(spare)
    replies = run_interactive(relay, nb, start="train")
    train = replies["train"]
    assert train.status == "ok"
    why = ["killed by SIGKILL"] if fault == "sigkill" else ["the kernel restarted itself (", "CUDA out of memory"]
    assert all(w in train.stderr for w in why), train.stderr
    assert recovered(train.stderr, "switched to the standby kernel", cells=3, iteration=2), train.stderr
    assert result(replies["result"].stdout) == gpu_reference
    assert "device=cuda:0" in gpu_reference
    second = worker_pid(relay)
    assert second == spare and gpu_open(second)
    assert running(relay.pid) and not holds_torch(relay.pid) and not gpu_open(relay.pid)
