"""A hand-written loop on Hugging Face accelerate (``Accelerator.prepare``, ``accelerator.backward``,
``accelerator.accumulate``): the prepared model and optimizer restored into the ones the replayed
set-up cell prepared, bit-identical to the uninterrupted run, in the form the first run asks for;
a loader's own count of epochs (which a seedable sampler seeds each epoch's order with) carried
with the checkpoints; and what would make a resume differ named at the first run (micro-batch
safe points inside an accumulation window).

Skipped where accelerate is not installed; CI's trainers stack (``.ci/run``) has it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed (CI's trainers stack has it)")

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import harness

_FAULTS = {"kill": "os.kill(os.getpid(), signal.SIGKILL)",
           "oom": "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')"}

SETUP = ("from accelerate import Accelerator, DataLoaderConfiguration\n"
         "from torch.utils.data import DataLoader, TensorDataset\n"
         "ds = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))\n"
         "accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,\n"
         "                          dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))\n"
         "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))\n"
         "opt = torch.optim.AdamW(model.parameters(), lr=0.01)\n"
         "sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)\n"
         "loader = DataLoader(ds, batch_size=8, shuffle=True)\n"
         "model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)\nlosses = []")


def accelerate_notebook(fault: str, mark):
    """Epochs (a resume_range loop) of micro-batches in a plain loop, two to an optimizer step
    (``accumulate``), a seedable sampler whose epoch the loop sets, a scheduler stepped per
    epoch, dropout. One fault in epoch 2, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        f"%%replay\nimport os, signal, torch\nMARK = {str(mark)!r}\ntorch.manual_seed(0)\n" + SETUP,
        "%%resilient --save model,opt,sched,losses\n"
        "for epoch in resume_range(5):\n"
        "    loader.set_epoch(epoch)\n"
        "    model.train()\n"
        "    for x, y in loader:\n"
        "        with accelerator.accumulate(model):\n"
        "            loss = ((model(x) - y) ** 2).mean()\n"
        "            accelerator.backward(loss); opt.step(); opt.zero_grad()\n"
        "    sched.step()\n"
        "    losses.append(round(loss.item(), 7))\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', losses, sched.get_last_lr(), model[0].weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.kernel
@pytest.mark.parametrize("fault", ["kill", "oom"])
def test_an_accelerate_loop_killed_or_out_of_memory_resumes_bit_identical(tmp_path, fault):
    """The prepared model, optimizer and scheduler are restored into those the replayed cell
    prepared (accelerate's wrappers around them), the loader's epoch is the loop's, and the run
    ends bit for bit as its twin: every epoch's loss, the learning rate, the weights. The first
    run says nothing of the loop (written the way the lines below ask)."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: accelerate_notebook(fault, mark))
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert "colab_resilience:" not in harness.cell_text(twin.cells[2]), harness.cell_text(twin.cells[2])
    assert harness.result(nb) == harness.result(twin)


def counted_epochs_notebook(fault: str, mark, seedable: bool, after: bool = False):
    """Epochs over an accelerate loader the loop never sets the epoch of: with a seedable sampler
    each epoch's order is drawn from the loader's own count of its epochs; without one, from the
    global random state (the count still goes up). One fault in the middle of epoch 2's batches,
    or (``after``) a kill in the cell after the training, once."""
    config = "dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)" if seedable else ""
    return harness.notebook(
        "%load_ext colab_resilience",
        f"%%replay\nimport os, signal, torch\nMARK = {str(mark)!r}\ntorch.manual_seed(0)\n"
        "from accelerate import Accelerator, DataLoaderConfiguration\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "ds = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))\n"
        f"accelerator = Accelerator(cpu=True, {config})\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=0.01)\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)\n"
        "loader = DataLoader(ds, batch_size=16, shuffle=True)\n"
        "model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)\nlosses = []",
        "%%resilient --save model,opt,sched,losses\n"
        "for epoch in resume_range(5):\n"
        "    for i, (x, y) in enumerate(loader):\n"
        f"        if epoch == 2 and i == 3 and not {after} and not os.path.exists(MARK):\n"
        f"            open(MARK, 'w').close(); {_FAULTS[fault]}\n"
        "        loss = ((model(x) - y) ** 2).mean()\n"
        "        opt.zero_grad(); accelerator.backward(loss); opt.step()\n"
        "    sched.step()\n"
        "    losses.append(round(loss.item(), 7))\n",
        (f"if not os.path.exists(MARK):\n    open(MARK, 'w').close(); {_FAULTS['kill']}\n" if after else "") +
        "print('RESULT', losses, loader.iteration, accelerator._dataloaders[0].iteration, accelerator.gradient_state.in_dataloader, len(accelerator.gradient_state.dataloader_references),\n"
        "      vars(loader).get('end_of_dataloader'), vars(loader).get('remainder'),\n"
        "      model[0].weight.detach().numpy().tobytes().hex(), sched.get_last_lr(),\n"
        "      vars(opt.optimizer).get('_opt_called'))",  # the scheduler's record of a step called
    )


@pytest.mark.kernel
@pytest.mark.parametrize("seedable,fault,after", [(True, "kill", False), (False, "kill", False), (True, "oom", False),
                                                  (False, "oom", False), (False, "kill", True)],
                         ids=["seedable-sampler-kill", "shuffled-kill", "seedable-sampler-oom", "shuffled-oom",
                              "kill-after-the-training"])
def test_a_loaders_own_count_of_epochs_comes_back_with_the_checkpoint(tmp_path, fault, seedable, after):
    """accelerate's loader counts the epochs it was iterated, and a seedable sampler draws each
    epoch's order from that count. A new kernel counted from 0 again: the resumed epochs drew the
    first epochs' orders and the run said done (found by a probe; before, the first run only named
    it). The count goes with each checkpoint and is put back into the loader the replayed set-up
    prepared: the run ends bit for bit as its twin, the loader's count (and its Accelerator's,
    which holds the same loader) as uninterrupted, with nothing said at the first run. A kill after
    the training finds the loader as its last epoch left it (it had reached its end: an accelerate
    loader says so, and the Accelerator's state differed, found by a probe), and its optimizer as
    having been stepped (the flag a scheduler's wrapper of ``step`` sets, which the Accelerator
    holds too: a new kernel's had not been stepped, and check said the Accelerator differs)."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: counted_epochs_notebook(fault, mark, seedable, after))
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert "colab_resilience:" not in harness.cell_text(twin.cells[2]), harness.cell_text(twin.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(twin).split()[6:8] == ["5", "5"], harness.result(twin)
    assert harness.result(twin).split()[10:12] == ["True", "0"], harness.result(twin)
    assert harness.result(twin).endswith(" True"), harness.result(twin)


def test_the_first_run_names_micro_batch_safe_points_inside_an_accumulation(ip):
    """Micro-batch safe points (``resume_range(loader)``) inside ``accumulate`` with 2 steps to a
    window: named; with 1, not. A loop over a loader that seeds its order with its own count of
    epochs is not named (the count goes with the checkpoints), nor is the loader as a state to save
    (its ``state_dict`` raises: saving it fails)."""
    from colab_resilience import lint

    # one Accelerator per process: accelerate shares its state between them
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    model, opt, loader = acc.prepare(torch.nn.Linear(4, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1),
                                     DataLoader(data, batch_size=4, shuffle=True))
    ip.user_ns.update(accelerator=acc, model=model, opt=opt, loader=loader, plain=DataLoader(data, batch_size=4))
    replayed = ["accelerator = model = opt = loader = plain = ..."]
    epochs = ("for epoch in resume_range(3):\n    for x, y in loader:\n"
              "        with accelerator.accumulate(model):\n            model(x)\n")
    assert lint.warnings(ip, epochs, ["model", "opt"], replayed) == []
    micro = ("for epoch in resume_range(3):\n    for x, y in resume_range(plain):\n"
             "        with accelerator.accumulate(model):\n            model(x)\n")
    lines = lint.warnings(ip, micro, ["model", "opt"], replayed)
    assert len(lines) == 1 and lines[0].startswith(
        "colab_resilience: each resume_range iteration is a micro-batch of accelerator.accumulate() "
        "(gradient_accumulation_steps=2): the optimizer steps every 2 iterations"), lines
    acc.gradient_accumulation_steps = 1
    assert lint.warnings(ip, micro, ["model", "opt"], replayed) == []
