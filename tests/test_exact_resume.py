"""The same result, or a loud refusal: exact resume the way people really train.

Each interrupted run is compared bit for bit with its uninterrupted twin (the RESULT line: loss
history and fingerprints of the weights and the optimizer state), supervised and interactively
where both apply. Each case once ended "done" with another result and no warning.

The cases that prove what a checkpoint holds and puts back, which no Jupyter stack changes, each
run on one of the two stacks CI runs (``one_stack``, tests/conftest.py); those of restarts and
budgets, and of a kernel Jupyter restarted, on both (tests/test_restart.py proves the way back
after a death in a notebook on each).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from IPython.core.error import UsageError

import harness
from harness import faulted_and_twin

pytestmark = pytest.mark.kernel

twin = harness.twin_result  # the RESULT of a golden notebook run uninterrupted, once in the session


def retried(ip, tmp_path, replay: str, cell: str) -> None:
    """Run the %%replay cell ``replay``, then the %%resilient ``cell``, which raises its one OOM
    (:func:`oom_once`) and must end well after the retry."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\n" + replay)
    r = ip.run_cell(cell)
    assert r.success, r.error_in_exec
    assert ip.user_ns["fired"] == [True]


def oom_once(indent: str, when: str) -> str:
    """Cell lines that raise a CUDA out-of-memory error once, where ``when`` holds (``fired``: a
    list the set-up cell makes)."""
    return (f"{indent}if {when} and not fired[0]:\n{indent}    fired[0] = True\n"
            f"{indent}    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n")


def cell_out(nb, cell_id: str) -> str:
    return harness.cell_text(nb.cells[harness.index(nb, cell_id)])


def interactive_result(kernel, nb) -> str:
    return harness.result(kernel.ok(harness.user_cell(nb, "result")).stdout)


# -- resuming inside an iteration: nested resume_range, a DataLoader ---------------------------------


@pytest.mark.parametrize("use_loader", [False, True], ids=["permutation", "dataloader"])
@pytest.mark.one_stack("newest")
def test_a_kill_inside_an_epoch_resumes_at_the_next_minibatch(tmp_path, tmp_path_factory, use_loader):
    """Killed after minibatch 3 of epoch 1, supervised: the new kernel starts epoch 1 again with the
    random state it began with (the same shuffle, the same DataLoader order), skips minibatches
    0-3, gets the saved running loss back and ends bit-identical. (It used to resume the outer loop
    at the inner index: epochs went missing, and a DataLoader could not be resumed at all.)"""
    reference = twin(tmp_path_factory, "resume_nested.ipynb", use_loader=use_loader)
    # staging off: the checkpoint of the safe point just before the kill is on disk when it comes
    # (in the background it may still be written: tests/test_background_saves.py)
    nb = harness.load("resume_nested.ipynb", tmp_path, use_loader=use_loader, fault="sigkill", staging="off")
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0, run.message
    assert [r.iteration for r in run.restarts] == ["1, item 3"]
    text = cell_out(nb, "train")
    assert "resumed at iteration 1, item 3" in text and "continuing at 1, item 3" in text
    assert harness.result(nb) == reference


@pytest.mark.parametrize("use_loader", [False, True], ids=["permutation", "dataloader"])
@pytest.mark.one_stack("newest")
def test_an_oom_inside_an_epoch_rolls_back_to_the_last_minibatch_interactively(kernel, tmp_path, tmp_path_factory,
                                                                              use_loader):
    """The same in a kernel driven as a front end drives it, with an in-process OOM retry."""
    reference = twin(tmp_path_factory, "resume_nested.ipynb", use_loader=use_loader)
    nb = harness.load("resume_nested.ipynb", tmp_path, use_loader=use_loader, fault="oom-error")
    replies = harness.run_interactive(kernel, nb)
    assert "rolled back to the last safe point; continuing at 1, item 3" in replies["train"].stdout
    assert harness.result(replies["result"].stdout) == reference


@pytest.mark.one_stack("newest")
def test_a_kill_inside_an_epoch_resumes_exactly_interactively(kernel, tmp_path, tmp_path_factory):
    """A kernel killed mid-epoch, brought back as a Jupyter server does; the user runs the cell
    again: it replays the set-up, restores, and resumes at the next minibatch, bit-identical."""
    reference = twin(tmp_path_factory, "resume_nested.ipynb")
    nb = harness.load("resume_nested.ipynb", tmp_path, fault="sigkill", staging="off")
    out = harness.killed_and_rerun(kernel, nb)
    assert "continuing at 1, item 3" in out, out
    assert interactive_result(kernel, nb) == reference


# -- a rollback leaves nothing behind: gradients, modes -----------------------------------------------


@pytest.mark.one_stack("newest")
def test_an_oom_inside_backward_while_accumulating_gradients_retries_exactly(tmp_path, tmp_path_factory):
    """An OOM raised inside backward(), half-way through an accumulation window (some gradients
    already added): the retry starts the epoch with no gradient left over, as the uninterrupted
    run did, and ends bit-identical. (The retried epoch used to add its gradients to the failed
    attempt's.)"""
    reference = twin(tmp_path_factory, "resume_accumulation.ipynb")
    nb = harness.load("resume_accumulation.ipynb", tmp_path, fault="oom-in-backward")
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0, run.message
    assert "retry 1/2" in cell_out(nb, "train") and not run.restarts
    assert harness.result(nb) == reference


@pytest.mark.one_stack("newest")
def test_an_oom_inside_backward_while_accumulating_gradients_retries_exactly_interactively(kernel, tmp_path,
                                                                                          tmp_path_factory):
    reference = twin(tmp_path_factory, "resume_accumulation.ipynb")
    nb = harness.load("resume_accumulation.ipynb", tmp_path, fault="oom-in-backward")
    replies = harness.run_interactive(kernel, nb)
    assert "retry 1/2" in replies["train"].stdout
    assert harness.result(replies["result"].stdout) == reference


def test_a_rollback_clears_gradients_and_puts_modes_back(ip, tmp_path):
    """In process: the safe point had the model in train mode, one layer frozen, no gradients;
    the failed attempt switched to eval, unfroze the layer and left gradients: the retry starts
    from the safe point's state of all three."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))\n"
                "model[0].requires_grad_(False)\nseen = []\nfail = [True]")
    r = ip.run_cell(
        "%%resilient --save model\n"
        "for epoch in resume_range(2):\n"
        "    seen.append((epoch, model.training, model[0].weight.requires_grad, model[1].weight.grad is None))\n"
        "    model.eval(); model[0].requires_grad_(True)\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "    if epoch == 1 and fail:\n"
        "        fail.clear(); raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n"
        "    model.train(); model[0].requires_grad_(False); model.zero_grad(set_to_none=True)\n")
    assert r.success, r.error_in_exec
    assert ip.user_ns["seen"] == [(0, True, False, True), (1, True, False, True), (1, True, False, True)]



_TRAINER = ("import torch\nfrom payloads import Opaque\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
            "trainer = Opaque(model)\ntrainer.opt, trainer.params, trainer.steps = opt, list(model.parameters()), 0\n"
            "x = torch.randn(8, 4)\nfail = [True]")
_TRAIN_THROUGH_IT = ("for epoch in resume_range(4):\n"
                     "    trainer.opt.zero_grad(); trainer.v(x).pow(2).mean().backward(); trainer.opt.step()\n"
                     "    trainer.steps += 1\n"
                     "    if epoch == 2 and fail:\n"
                     "        fail.clear(); raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n")


def test_a_pickled_object_that_holds_the_model_holds_it_again_after_a_rollback(ip, tmp_path, capsys):
    """A trainer object (pickled) that holds the model, its optimizer and its parameters, saved
    with them, trains through them; an OOM in epoch 2 rolls back to the safe point. The restored
    trainer holds the restored model and optimizer, not copies: the run ends bit for bit as its
    uninterrupted twin (before, the retry trained a copy, and `model` stayed where the rollback
    left it: it said done with other weights). Saved without them, the first save says, in one
    line, that the trainer would come back holding copies."""
    import torch

    from payloads import raw

    twin: dict = {}
    exec(_TRAINER, twin)
    exec(_TRAIN_THROUGH_IT.replace("resume_range", "range").replace("fail", "[]"), twin)
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\n" + _TRAINER)
    r = ip.run_cell("%%resilient --save trainer,model,opt\n" + _TRAIN_THROUGH_IT)
    assert r.success, r.error_in_exec
    ns = ip.user_ns
    assert "retry" in capsys.readouterr().out
    assert ns["trainer"].v is ns["model"] and ns["trainer"].opt is ns["opt"]
    assert ns["trainer"].params[0] is ns["model"].weight and ns["trainer"].steps == 4
    assert raw(ns["model"].weight) == raw(twin["model"].weight) and raw(ns["model"].bias) == raw(twin["model"].bias)
    assert all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
               for a, b in zip(ns["opt"].state.values(), twin["opt"].state.values()))
    out = said_at_first_run(ip, tmp_path, capsys, _TRAINER,
                            "%%resilient --save trainer\n" + _TRAIN_THROUGH_IT.replace("fail", "[]"))
    assert ("colab_resilience: 'trainer' holds model and opt, which are not in --save: after a restore it would "
            "hold copies of them, cut off from model and opt") in out, out
    assert "add model and opt to --save" in out, out


def test_two_pickled_objects_that_hold_each_other_are_refused_at_the_first_safe_point(ip, tmp_path):
    """Two saved objects, each pickled, that hold each other: neither could be unpickled first,
    and restoring them as two copies would cut them apart. The first safe point stops the cell
    with one line that says what to save instead; nothing is written."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\nfrom payloads import Opaque\na = Opaque(None)\nb = Opaque(a)\na.v = b")
    r = ip.run_cell("%%resilient --save a,b\nfor i in resume_range(2):\n    pass\n")
    message = str(r.error_in_exec)
    assert not r.success and "\n" not in message, message
    assert message.startswith("colab_resilience: cannot save 'b': it and 'a' hold each other"), message
    assert "save only one of them" in message, message




def test_an_oom_retry_draws_what_the_first_attempt_drew_above_the_loop_and_for_a_shuffling_loader(ip, tmp_path):
    """A permutation drawn once above the loop, and a shuffling DataLoader iterated by the top
    level resume_range (one pass): an OOM at the third batch is retried in the kernel. The retry
    runs the cell from its first line: it must draw the same permutation and the same batch order
    as the first attempt did, from the random state the cell began with. It drew on from where the
    failed attempt had left the state, and said only "continuing at item 2": other batches, mixed
    from two permutations. Bit for bit as the uninterrupted twin."""
    import torch

    set_up = ("import torch\ntorch.manual_seed(0)\nfired = [False]\n"
              "loader = torch.utils.data.DataLoader(list(range(16)), batch_size=4, shuffle=True)")
    twin: dict = {}
    exec(set_up + "\nperm = torch.randperm(100)\nseen = [b.tolist() for b in loader]\n"
         "order = [int(perm[i]) for i in range(4)]", twin)
    retried(ip, tmp_path, set_up, "%%resilient --save order,seen\n"
            "order, seen = [], []\n"
            "perm = torch.randperm(100)\n"
            "for xb in resume_range(loader):\n"
            "    order.append(int(perm[len(seen)])); seen.append(xb.tolist())\n"
            + oom_once("    ", "len(seen) == 3"))
    assert ip.user_ns["seen"] == twin["seen"] and ip.user_ns["order"] == twin["order"]
    assert torch.equal(ip.user_ns["perm"], twin["perm"])


def _generator_notebook(where: str, mark):
    """A model trained on the batches of a generator that a %%replay cell makes (it cannot be
    made again in the same kernel), iterated as resume_range(enumerate(gen)); a
    torch.OutOfMemoryError, once, inside the generator or in the loop's body (``where``)."""
    oom = ("open(MARK, 'w').close(); raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')")
    return harness.notebook(
        "%load_ext colab_resilience",
        f"%%replay\nimport os, torch\nMARK, WHERE = {str(mark)!r}, {where!r}\n"
        "def batches():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    for i in range(6):\n"
        "        if WHERE == 'generator' and i == 3 and not os.path.exists(MARK):\n"
        f"            {oom}\n"
        "        yield torch.randn(4, 3, generator=g)\n"
        "gen = batches()\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(3, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nseen = []",
        "%%resilient --save model,opt,seen\n"
        "for i, x in resume_range(enumerate(gen)):\n"
        "    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step(); seen.append(i)\n"
        "    if WHERE == 'loop' and i == 2 and not os.path.exists(MARK):\n"
        f"        {oom}\n",
        "print('RESULT', seen, model.weight.detach().numpy().tobytes().hex(), model.bias.item().hex())",
    )


@pytest.mark.parametrize("where", ["generator", "loop"])
@pytest.mark.one_stack("newest")
def test_an_oom_with_a_generator_from_a_set_up_cell_goes_on_in_a_restarted_kernel(tmp_path, where):
    """A generator made by a %%replay cell, drawn by the loop: an OOM in it (which ends it) or in
    the loop's body. A retry in the same kernel would go on over the generator the failed attempt
    drew from: the first ended the loop early, the second skipped batches, and both said done
    with other weights. The run goes on in a restarted kernel instead, where the %%replay cell
    makes the generator afresh, and ends bit for bit as its uninterrupted twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _generator_notebook(where, mark))
    text = harness.cell_text(nb.cells[2])
    assert "(the retry cannot draw again from a generator made outside the cell)" in text, text
    assert len(run.restarts) == 1, text
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT [0, 1, 2, 3, 4, 5] ")


def _setup(mark) -> str:
    """The start of a %%replay cell for :data:`_FAULTS`: its imports, the mark, a seed."""
    return f"%%replay\nimport os, signal, torch\nMARK = {str(mark)!r}\ntorch.manual_seed(0)\n"


# the line that strikes: a SIGKILL of the kernel, or a CUDA out-of-memory error
_FAULTS = {"kill": "os.kill(os.getpid(), signal.SIGKILL)",
           "oom": "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')"}


def _handed_on_notebook(fault: str, mark):
    """Training from scratch: a weight tensor and a bias made by hand, stepped by an Adam the
    %%replay cell gives them; a history list a logger object holds; an average the loop binds anew
    each epoch, whose first value another name keeps (ema0). One fault (``fault``: a SIGKILL or an
    out-of-memory error) in epoch 3, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "w = torch.randn(4, 1, requires_grad=True); b = torch.zeros(1, requires_grad=True)\n"
        "opt = torch.optim.Adam([w, b], lr=0.05)\nX, Y = torch.randn(64, 4), torch.randn(64, 1)\n"
        "class Logger:\n    def __init__(self, h): self.h = h\n    def log(self, v): self.h.append(v)\n"
        "history = []\nlogger = Logger(history)\nema = torch.zeros(4, 1)\nema0 = ema\n"
        "scale = torch.ones(1)\nscale0 = scale\ndef halve():\n    global scale\n    scale = scale / 2",
        "%%resilient --save w,b,opt,history,ema,scale\n"
        "for epoch in resume_range(6):\n"
        "    for i in range(0, 64, 16):\n"
        "        loss = ((X[i:i+16] @ w + b - Y[i:i+16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    logger.log(loss.item())\n"
        "    ema = 0.9 * ema + 0.1 * w.detach()\n"
        "    halve()\n"
        "    if epoch == 3 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', len(history), logger.h is history, history[-1].hex(), w.detach().numpy().tobytes().hex(),"
        " b.item().hex(), ema.numpy().tobytes().hex(), scale.item(), ema0.abs().sum().item() + scale0.item())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_objects_the_set_up_cells_handed_on_see_the_restored_values(tmp_path, fault):
    """A weight tensor made by hand that the optimizer steps, a history list a logger appends to:
    after a kill (replayed set-up cells) or an OOM (a rollback in the kernel), the restore puts the
    saved values into those objects, and the run ends bit for bit as its uninterrupted twin. Bound
    to new objects, as before, the optimizer stepped a weight the loop no longer read (the weights
    stayed at the safe point) and the logger appended to a list nobody printed, and the run said
    done. The average the loop binds anew each epoch, and a scale a set-up cell's function binds
    anew (``global``), are bound to their saved values, and the names that kept their first values
    keep them."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _handed_on_notebook(fault, mark),
                                     shared="handed_on")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT 6 True ") and harness.result(nb).endswith(" 0.015625 1.0")



def _ensemble_notebook(fault: str, mark):
    """An ensemble: three models in a list, an Adam for each in another, both saved as lists; the
    loop binds each pair by turns (``for model, opt in zip(models, opts)``), and a dict of the
    generator and discriminator of a GAN-like pair, with their optimizers. One fault in epoch 3."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "models = [torch.nn.Linear(4, 1) for _ in range(3)]\n"
        "opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in models]\n"
        "nets = {'g': torch.nn.Linear(4, 4), 'd': torch.nn.Linear(4, 1)}\n"
        "net_opts = {k: torch.optim.SGD(n.parameters(), lr=0.05, momentum=0.9) for k, n in nets.items()}\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)",
        "%%resilient --save models,opts,nets,net_opts\n"
        "for epoch in resume_range(6):\n"
        "    for model, opt in zip(models, opts):\n"
        "        loss = ((model(X) - Y) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    loss = ((nets['d'](nets['g'](X)) - Y) ** 2).mean()\n"
        "    for o in net_opts.values(): o.zero_grad()\n"
        "    loss.backward()\n"
        "    for o in net_opts.values(): o.step()\n"
        "    if epoch == 3 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', [m.weight.detach().numpy().tobytes().hex() for m in models],"
        " nets['g'].weight.detach().numpy().tobytes().hex(), nets['d'].bias.item().hex(),"
        " all(o.param_groups[0]['params'][0] is m.weight for m, o in zip(models, opts)))",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_models_and_optimizers_saved_in_lists_and_dicts_stay_joined(tmp_path, fault):
    """Models and their optimizers saved in lists and dicts (an ensemble, a GAN): each was pickled
    on its own, so a restore made copies of the models' tensors for the models and others for the
    optimizers, which then stepped tensors no model held; after a kill and after an OOM the run said
    done with the models of the safe point (check: models and opts differ, no line said so). Now the
    restore loads the saved state into the models and optimizers the lists hold (rebuilt by the
    set-up cell after a kill, the same ones after an OOM), and the run ends bit for bit as its twin,
    without the first run's line that the lists hold `model` and `opt` cut off from them."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _ensemble_notebook(fault, mark),
                                     shared="ensemble")
    train = harness.cell_text(nb.cells[2])
    assert len(run.restarts) == (fault == "kill"), train
    assert "cut off" not in train, train
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).endswith(" True")



def _unfreezing_notebook(fault: str, epoch: int, mark, anew: bool = False):
    """Transfer learning's gradual unfreezing: the head trains alone for two epochs, then the loop
    unfreezes the backbone and gives it to the optimizer in a group of its own
    (``opt.add_param_group``, with its own rate), or (``anew``) makes the optimizer anew over the
    whole model with a lower rate. One fault in epoch ``epoch``, once."""
    unfreeze = ("        opt = torch.optim.Adam(model.parameters(), lr=0.01)\n" if anew else
                "        opt.add_param_group({'params': list(backbone.parameters()), 'lr': 0.01})\n")
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +  # saves in the foreground: the kill in epoch 3 finds epoch 2's checkpoint on disk
        "%config ResilienceMagics.staging_memory = 'off'\nX, Y = torch.randn(64, 8), torch.randn(64, 1)\n"
        "backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())\nhead = torch.nn.Linear(16, 1)\n"
        "model = torch.nn.Sequential(backbone, head)\n"
        "for p in backbone.parameters():\n    p.requires_grad = False\n"
        "opt = torch.optim.Adam(head.parameters(), lr=0.05)\nhistory = []",
        "%%resilient --save model,opt,history\n"
        "for epoch in resume_range(5):\n"
        "    if epoch == 2:\n"
        "        for p in backbone.parameters():\n            p.requires_grad = True\n"
        + unfreeze +
        "    for i in range(0, 64, 16):\n"
        "        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    history.append(loss.item())\n"
        f"    if epoch == {epoch} and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', [h.hex() for h in history], model[0][0].weight.detach().numpy().tobytes().hex(),"
        " head.weight.detach().numpy().tobytes().hex(), [g['lr'] for g in opt.param_groups],"
        " [p.requires_grad for p in backbone.parameters()])",
    )


@pytest.mark.parametrize("fault, epoch", [("kill", 3), ("oom", 2)])
@pytest.mark.one_stack("newest")
def test_a_parameter_group_the_loop_added_is_added_again_or_taken_out(tmp_path, fault, epoch):
    """The loop adds the unfrozen backbone to the optimizer in epoch 2. Killed in epoch 3, the new
    kernel's set-up cells build the optimizer with the head's group only; rolled back from an OOM
    in epoch 2 to the safe point before, the optimizer holds the group that epoch added. Either
    way the run stopped: "opt steps the parameters of model in another order now ... (a cell that
    makes the model run again ...?)", wrong, and a transfer-learning run could not go on. The
    optimizer is given the groups it had at the safe point (the backbone's added with the tensors
    the checkpoint names, or the failed attempt's taken out, and added again by the loop), and the
    run ends bit for bit as its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _unfreezing_notebook(fault, epoch, mark),
                                     shared="unfreezing")
    train = harness.cell_text(nb.cells[2])
    assert len(run.restarts) == (fault == "kill") and f"continuing at {epoch}" in train, train
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).endswith(" [0.05, 0.01] [True, True]"), harness.result(nb)


@pytest.mark.one_stack("newest")
def test_an_optimizer_the_loop_made_anew_over_other_tensors_steps_them_after_a_restart(tmp_path):
    """The loop makes the optimizer anew at epoch 2, over the whole model (the head's alone
    before); killed in epoch 3, the new kernel's set-up cells build the head's. The run stopped,
    "opt steps the parameters of model in another order now" (it was other tensors). The
    optimizer, of the same kind, is given the tensors the checkpoint names, and the run ends bit
    for bit as its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _unfreezing_notebook("kill", 3, mark, anew=True))
    train = harness.cell_text(nb.cells[2])
    assert len(run.restarts) == 1 and "continuing at 3" in train, train
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).endswith(" [0.01] [True, True]"), harness.result(nb)


def test_an_optimizer_built_with_other_groups_is_said_by_its_groups_not_as_another_order():
    from colab_resilience import carried

    then = {"opt": [[["model", "0.weight"]], [["model", "1.weight"]]]}
    now = {"opt": [[["model", "0.weight"], ["model", "1.weight"]]]}
    said = carried.joins_changed(then, now)
    assert said == ("opt steps the parameters of model in 1 parameter group now, where at the safe point it stepped "
                    "the parameters of model in 2 parameter groups (the optimizer built with other parameter groups "
                    "than the run's?)"), said
    swapped = {"opt": [[["model", "1.weight"]], [["model", "0.weight"]]]}
    assert "of model in another order now" in carried.joins_changed(then, swapped)
    # with a tensor no saved model holds, not put right (regroup): other tensors of the model
    held, other = {"opt": [[["model", "0.weight"], None]]}, {"opt": [[["model", "1.weight"], None]]}
    assert carried.joins_changed(held, other).startswith(
        "opt steps other parameters of model and tensors no saved model holds now, where at the safe point it stepped "
        "the parameters of model and tensors no saved model holds ("), carried.joins_changed(held, other)


@pytest.mark.one_stack("newest")
def test_a_model_a_plain_cell_changed_the_dtype_of_stops_the_resume_in_one_line(tmp_path):
    """`model.double()` in a plain cell (not %%replay), the loop casting its batches: killed in
    epoch 2, the new kernel's set-up cell builds the model in float32, and load_state_dict put the
    float64 weights into it, converted: the run went on in float32 and said done, with other
    losses than the uninterrupted run's (found by a probe). The resume stops in one line that
    names the dtypes and says to make the change in a %%replay cell."""
    nb = harness.notebook(
        "%load_ext colab_resilience",
        _setup(tmp_path / "m") + "%config ResilienceMagics.staging_memory = 'off'\n"
        "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "X, Y = torch.randn(32, 4), torch.randn(32, 1)\nlosses = []",
        "model.double()",
        "%%resilient --save model,opt,losses\nfor epoch in resume_range(4):\n"
        "    loss = ((model(X.double()) - Y.double()) ** 2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n    losses.append(loss.item())\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS['kill']}\n",
        "print('RESULT', losses)")
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status != 0 and run.failed_cell == 3, run.message
    assert ("cannot restore 'model' in place: the Linear it holds now is not the one saved (other dtypes: weight "
            "float64 saved, float32 now, bias float64 saved, float32 now): the set-up cells build another "
            "architecture, or a cell that is not %%replay changed its dtype after they built it (model.double(), "
            ".half(), .to(torch.bfloat16)) or the default dtype they built it in (torch.set_default_dtype): make "
            "that change in a %%replay cell") in run.message, run.message
    assert "RESULT" not in harness.cell_text(nb.cells[4])


def _settings_notebook(fault: str, mark):
    """torch's process-wide settings changed in a plain cell after the set-up cell (as Lightning's
    hint has people call ``torch.set_float32_matmul_precision``): the default dtype, the threads,
    deterministic algorithms, the matmul precision, cuDNN's benchmark. The loop draws noise in
    the default dtype. One fault in epoch 2, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) + "%config ResilienceMagics.staging_memory = 'off'\n"
        "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "X, Y = torch.randn(32, 4), torch.randn(32, 1)\nlosses = []",
        "torch.set_default_dtype(torch.float64)\ntorch.set_num_threads(1)\n"
        "torch.use_deterministic_algorithms(True, warn_only=True)\ntorch.set_float32_matmul_precision('medium')\n"
        "torch.backends.cudnn.benchmark = True",
        "%%resilient --save model,opt,losses\nfor epoch in resume_range(4):\n"
        "    noise = torch.randn(32, 4)\n"
        "    loss = ((model((X + noise.float() * 1e-3)) - Y) ** 2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n    losses.append((loss.item(), noise.dtype))\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', losses, model.weight.detach().numpy().tobytes().hex(), torch.get_default_dtype(),"
        " torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),"
        " torch.backends.cudnn.benchmark)")


@pytest.mark.one_stack("newest")
def test_torchs_settings_a_plain_cell_changed_go_with_the_run(tmp_path):
    """Killed in epoch 2, the new kernel had torch's defaults: the loop drew float32 noise where
    the uninterrupted run drew float64 (found by a probe), and the run said done with other
    losses. Each checkpoint holds torch's settings with the random states, and a resume puts
    them back: bit for bit its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _settings_notebook("kill", mark))
    train = harness.cell_text(nb.cells[3])
    assert len(run.restarts) == 1 and "continuing at 2" in train, train
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).endswith(" torch.float64 1 True medium True"), harness.result(nb)
    assert "torch.float64), (" in harness.result(nb)


def _attention_notebook(mark):
    """A model of one attention (torch's ``scaled_dot_product_attention``, as a transformer's) with
    its flash kernel switched off in a plain cell after the set-up cell, with cuDNN's TF32 and
    bfloat16's reduced-precision reductions (as one does where flash attention fails on a GPU);
    killed once in epoch 2."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) + "%config ResilienceMagics.staging_memory = 'off'\n"
        "proj = torch.nn.Linear(16, 16)\nopt = torch.optim.SGD(proj.parameters(), lr=0.1)\n"
        "X = torch.randn(2, 4, 64, 16)\nlosses = []",
        "torch.backends.cuda.enable_flash_sdp(False)\ntorch.backends.cudnn.allow_tf32 = False\n"
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False",
        "%%resilient --save proj,opt,losses\nfor epoch in resume_range(4):\n"
        "    q = proj(X)\n    loss = torch.nn.functional.scaled_dot_product_attention(q, X, X).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n    losses.append(loss.item())\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS['kill']}\n",
        "b = torch.backends\nprint('RESULT', losses, proj.weight.detach().numpy().tobytes().hex(), b.cuda.flash_sdp_enabled(),"
        " b.cudnn.allow_tf32, b.cuda.matmul.allow_bf16_reduced_precision_reduction)")


@pytest.mark.one_stack("newest")
def test_the_attention_kernels_a_plain_cell_chose_go_with_the_run(tmp_path):
    """Flash attention switched off in a plain cell: killed in epoch 2, the new kernel had it on
    again (torch's default) and its attention gave other numbers, on the CPU too, "done" (found by a
    probe). torch's attention kernels, cuDNN's TF32 and the reduced-precision reductions go with
    each checkpoint now: bit for bit its twin, and the settings as the plain cell left them."""
    run, nb, twin = faulted_and_twin(tmp_path, _attention_notebook)
    assert len(run.restarts) == 1 and "continuing at 2" in harness.cell_text(nb.cells[3])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).endswith(" False False False"), harness.result(nb)


def _counting_module_notebook(fault: str, mark):
    """A module of the notebook's own that counts its calls in ``forward`` (a plain attribute and
    a buffer) and keeps each batch's size in a list; one fault in epoch 3."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 1)\n"
        "        self.register_buffer('seen', torch.zeros((), dtype=torch.long))\n"
        "        self.calls, self.sizes, self.temperature = 0, [], 1.0\n"
        "    def forward(self, x):\n"
        "        self.seen += x.shape[0]; self.calls += 1; self.sizes.append(x.shape[0])\n"
        "        return self.lin(x) / self.temperature\n"
        "model = Net()\nsizes = model.sizes\nopt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)",
        "%%resilient --save model,opt\n"
        "for epoch in resume_range(6):\n"
        "    for i in range(0, 64, 16):\n"
        "        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    model.temperature *= 1.1\n"
        "    if epoch == 3 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', model.calls, len(sizes), sizes is model.sizes, model.seen.item(), model.temperature.hex(),"
        " model.lin.weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_a_modules_own_plain_attributes_come_back_with_it(tmp_path, fault):
    """A module's state_dict holds its parameters and buffers, not the counter its forward keeps
    (``self.calls += 1``), the list it appends to or a temperature the loop anneals: after a kill
    they were the replayed module's (20 calls for 24), after an OOM the rolled-back step's call
    stayed counted (25), and the run said done. They go beside the checkpoint with the module's
    modes and are put back (the list into the one the module and the notebook hold)."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _counting_module_notebook(fault, mark),
                                     shared="counting_module")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT 24 24 True 384 ")



def _decay_above_inner_notebook(fault: str, mark):
    """Epochs of minibatches, both resume_range loops: at the top of each epoch, above the inner
    loop, the learning rate is decayed in the optimizer (``g['lr'] *= 0.5``) and a running count
    of the module is reset. One fault after minibatch 2 of epoch 2, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "model = torch.nn.Linear(4, 1)\nmodel.seen = 0\nopt = torch.optim.SGD(model.parameters(), lr=0.4)\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)",
        "%%resilient --save model,opt\n"
        "for epoch in resume_range(4):\n"
        "    for g in opt.param_groups:\n"
        "        g['lr'] *= 0.5\n"
        "    model.seen = 0\n"
        "    for i in resume_range(0, 64, 16):\n"
        "        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "        model.seen += 16\n"
        "        if epoch == 2 and i == 32 and not os.path.exists(MARK):\n"
        f"            open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', opt.param_groups[0]['lr'], model.seen, model.weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_an_object_the_code_above_an_inner_loop_changes_is_back_at_the_inner_safe_point(tmp_path, fault):
    """A resume inside an epoch runs the code above the inner loop again on the restored objects:
    the learning rate was halved a second time in the optimizer (0.025 for 0.05 from there on) and
    the module's count reset, and the run said done. At the inner loop the saved modules and
    optimizers get the inner safe point's state again (as lists and tensors did), and the run ends
    bit for bit as its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _decay_above_inner_notebook(fault, mark),
                                     shared="decay_above_inner")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT 0.025 64 ")


def _generator_above_inner_notebook(fault: str, mark):
    """Epochs of minibatches, both resume_range loops, and a saved torch.Generator that draws twice
    in each epoch: a permutation of the features above the inner loop, and the order of the
    DataLoader the inner loop iterates (``generator=g``). One fault after minibatch 2 of epoch 2."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "g = torch.Generator().manual_seed(1)\n"
        "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16, shuffle=True,"
        " generator=g)\n"
        "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.05)\nperms, steps = [], []",
        "%%resilient --save model,opt,g,perms,steps\n"
        "for epoch in resume_range(4):\n"
        "    perm = torch.randperm(4, generator=g)\n"
        "    perms.append(perm.tolist())\n"
        "    for x, y in resume_range(loader):\n"
        "        loss = ((model(x[:, perm]) - y) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "        steps.append(round(loss.item(), 6))\n"
        "        if len(steps) == 11 and not os.path.exists(MARK):\n"
        f"            open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', perms, steps, torch.rand(1, generator=g).item(), model.weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_a_saved_generator_the_code_above_an_inner_loop_draws_from_draws_what_it_drew(tmp_path, fault):
    """A resume inside an epoch runs the code above the inner loop again: the permutation and the
    DataLoader's order were drawn from the inner safe point's generator (after the epoch's draws),
    not from the one the epoch began with, and the run said done with other weights (an OOM), or
    was named at the first run. The saved generators' states when the outer iteration began go
    with the checkpoint, as the global random states do; the run ends bit for bit as its twin, and
    the first run names nothing."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _generator_above_inner_notebook(fault, mark),
                                     shared="generator_above_inner")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert "colab_resilience:" not in harness.cell_text(twin.cells[2]), harness.cell_text(twin.cells[2])
    assert harness.result(nb) == harness.result(twin)


def _read_after_inner_loop_notebook(fault: str, mark):
    """Epochs of minibatches (both resume_range loops); below the inner loop, the last minibatch's
    loss (``loss``, a tensor) and a count the inner loop sets (``seen``) are read, neither in
    --save. One fault below the inner loop of epoch 2, once: the last safe point is the inner
    loop's end."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +  # checkpoints written as they are taken: the inner loop's last is on disk at the fault
        "%config ResilienceMagics.staging_memory = 'off'\n"
        "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)\nhistory = []",
        "%%resilient --save model,opt,history\n"
        "for epoch in resume_range(4):\n"
        "    for i in resume_range(0, 64, 16):\n"
        "        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "        seen = i + 16\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n"
        "    history.append((epoch, seen, loss.item()))\n",
        "print('RESULT', history, model.weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_a_value_the_inner_loop_sets_and_the_code_below_it_reads_is_kept(tmp_path, fault):
    """``history.append(loss.item())`` below the inner loop, ``loss`` not in --save: a run killed
    there resumed at the inner loop's end in a new kernel, where ``loss`` did not exist
    (NameError), after a line at the first run. A small value (a loss tensor, a count) set in a
    loop and read after it goes with each checkpoint unasked, and the run ends as its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _read_after_inner_loop_notebook(fault, mark),
                                     shared="read_after_inner_loop")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    said = harness.cell_text(nb.cells[2])
    if fault == "kill":
        assert "resumed at iteration 2 (its inner loop done)" in said, said
    # (the outer loop had not finished: it went on with iteration 2's code below the inner loop)
    assert "continuing at 2, its inner loop done" in said and "the loop had finished" not in said, said
    assert "colab_resilience:" not in harness.cell_text(twin.cells[2]), harness.cell_text(twin.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT [(0, 64, ")


def test_a_value_set_in_the_loop_and_read_after_it_too_large_to_keep_unasked_is_named_once(ip, tmp_path, capsys):
    """A 1.5 MiB tensor set in the loop and read after it is not kept unasked with each checkpoint:
    one line, at the first safe point that finds it, says so and what to do; a small one is kept
    and named nowhere."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    capsys.readouterr()
    r = ip.run_cell("%%resilient\nimport torch\nfor step in resume_range(3):\n"
                    "    big = torch.zeros(3 * 2**17)\n    small = torch.ones(2)\nprint(big.shape, small.sum())\n")
    assert r.success, r.error_in_exec
    lines = [line for line in capsys.readouterr().out.splitlines() if "read after it" in line]
    assert lines == ["colab_resilience: big (a Tensor of 1.5 MiB) is set inside a resume_range loop and read after it, "
                     "and too large or not plain enough to keep with each checkpoint without --save: a run resumed "
                     "after the loop's last safe point would not have it; add it to --save"], lines


def _best_copy_notebook(fault: str, mark):
    """Early stopping's best model, a ``copy.deepcopy(model)`` the loop makes when the validation
    loss improves, in --save with the best loss. One fault in epoch 3, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "import copy\nmodel = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.01)\nX, Y = torch.randn(64, 4), torch.randn(64, 1)\n"
        "best_val = float('inf')",
        "%%resilient --save model,opt,best_val,best_model\n"
        "for epoch in resume_range(6):\n"
        "    for i in range(0, 64, 16):\n"
        "        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    val = ((model(X) - Y) ** 2).mean().item()\n"
        "    if val < best_val:\n"
        "        best_val, best_model = val, copy.deepcopy(model)\n"
        "    if epoch == 3 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', best_val, best_model.training, best_model[0].weight is model[0].weight,\n"
        "      best_model[0].weight.detach().numpy().tobytes().hex(), model[0].weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_a_model_copy_the_loop_makes_comes_back_whole(tmp_path, fault):
    """``best_model = copy.deepcopy(model)`` in the loop, in --save as the first run asks: saved by
    its state dict, it could not be restored after a restart (no set-up cell makes an object of that
    name to load it into), and the run stopped. A module the loop binds anew, whose parameters no
    saved optimizer steps, is saved whole and bound again; the run ends bit for bit as its twin,
    the copy apart from the model."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _best_copy_notebook(fault, mark),
                                     shared="best_copy")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert " True False " in harness.result(nb), harness.result(nb)


def _non_persistent_buffer_notebook(fault: str, mark):
    """A module whose forward keeps a running mean of its inputs in a non-persistent buffer
    (``register_buffer(..., persistent=False)``: not in its state dict) and a running spread in a
    tensor attribute it rebinds (not registered: not in its state dict either), and scales them
    with both, in a submodule; --save model,opt. One fault in epoch 3, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "class Centred(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 1)\n"
        "        self.register_buffer('mu', torch.zeros(4), persistent=False)\n"
        "        self.scale = torch.ones(4)\n"
        "    def forward(self, x):\n"
        "        if self.training:\n"
        "            with torch.no_grad():\n"
        "                self.mu.mul_(0.9).add_(0.1 * x.mean(0))\n"
        "            self.scale = 0.9 * self.scale + 0.1 * x.detach().std(0)\n"
        "        return self.lin((x - self.mu) / self.scale)\n"
        "model = torch.nn.Sequential(Centred(), torch.nn.Tanh())\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)\nX, Y = torch.randn(64, 4), torch.randn(64, 1)",
        "%%resilient --save model,opt\n"
        "for epoch in resume_range(6):\n"
        "    for i in range(0, 64, 16):\n"
        "        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    if epoch == 3 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', 'mu' in model.state_dict(), model[0].mu.numpy().tobytes().hex(), model[0].scale.numpy().tobytes().hex(),\n"
        "      model[0].lin.weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_a_modules_tensors_no_state_dict_holds_come_back_with_it(tmp_path, fault):
    """A buffer registered with ``persistent=False`` and a tensor attribute are left out of
    ``state_dict()``: after a kill they came back as the set-up cell made them, after an
    out-of-memory error they kept the failed attempt's updates, and the run said done with other
    weights. They go with the checkpoint and are copied back into the module; the run ends bit for
    bit as its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _non_persistent_buffer_notebook(fault, mark),
                                     shared="non_persistent_buffer")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT False "), harness.result(nb)


def _channels_last_notebook(fault: str, mark, device: str = "cpu"):
    """A convolutional model in ``channels_last`` that starts with a BatchNorm, stepped by Adam; a
    bank of earlier batches (channels_last slices, in --save) trained on again each step. One
    fault in epoch 2, once. On a GPU (``device``), with deterministic algorithms, and a flattening
    head instead of the pooling (whose backward on CUDA has no deterministic kernel)."""
    head = ("torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 1)" if device == "cpu" else
            "torch.nn.Flatten(), torch.nn.Linear(512, 1)")
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) + "cl = torch.channels_last\n" +
        ("" if device == "cpu" else "torch.use_deterministic_algorithms(True)\n") +
        "model = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),\n"
        f"                            {head}).to({device!r}, memory_format=cl)\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.01)\n"
        f"X = torch.randn(64, 3, 8, 8).to({device!r}, memory_format=cl); Y = torch.randn(64, 1).to({device!r})\nbank = []",
        "%%resilient --save model,opt,bank\n"
        "for epoch in resume_range(5):\n"
        "    for i in range(0, 64, 16):\n"
        "        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()\n"
        "        if bank:\n"
        "            loss = loss + ((model(bank[0][0]) - bank[0][1]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    bank.append((X[:8] * (epoch + 1) / 7, Y[:8]))\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', bank[0][0].stride(), opt.state[model[1].weight]['exp_avg'].stride(),\n"
        "      b''.join(p.detach().cpu().numpy().tobytes() for p in model.parameters()).hex(), bank[0][0].device)",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_tensors_come_back_laid_out_in_memory_as_they_were(tmp_path, fault):
    """Saved tensors came back row-major: a bank of channels_last batches fed to a BatchNorm, which
    reduces in memory order, gave other bits after a kill or an out-of-memory error, and the
    optimizer's moments lost the parameters' layout. They come back with their strides; the run
    ends bit for bit as its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _channels_last_notebook(fault, mark),
                                     shared="channels_last")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT (192, 1, 24, 3) (27, 1, 9, 3) "), harness.result(nb)


def _lbfgs_notebook(fault: str, mark):
    """L-BFGS over minibatches (a closure; its state: the search direction, the last gradient and
    the history of steps, kept in lists); --save model,opt,losses. One fault in epoch 2, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) + "X = torch.randn(96, 5); Y = torch.sin(X.sum(1, keepdim=True))\n"
        "model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))\n"
        "opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)\nlosses = []",
        "%%resilient --save model,opt,losses\n"
        "for epoch in resume_range(5):\n"
        "    for i in range(0, 96, 32):\n"
        "        x, y = X[i:i+32], Y[i:i+32]\n"
        "        def closure():\n"
        "            opt.zero_grad(); loss = ((model(x) - y) ** 2).mean(); loss.backward(); return loss\n"
        "        losses.append(opt.step(closure).item())\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', losses, b''.join(p.detach().numpy().tobytes() for p in model.parameters()).hex())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_an_optimizer_state_that_is_summed_comes_back_summed_in_the_same_order(tmp_path, fault):
    """Tensors came back as views into the checkpoint's memory, at offsets aligned only to their
    items, and BLAS peels an unaligned start off a dot product: L-BFGS, which takes dot products of
    its saved history, summed in another order after a kill or an out-of-memory error, and the run
    ended in other last bits. Each comes back in memory of its own; the run ends bit for bit as
    its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _lbfgs_notebook(fault, mark),
                                     shared="lbfgs")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)



def _compiled_notebook(fault: str, mark):
    """A model bound to its name, then bound again to ``torch.compile(model)`` (the default backend,
    inductor: C++ code generated and built for the CPU), AdamW, minibatches drawn by a randperm;
    --save model,opt,losses. One fault in epoch 2, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) + "X = torch.randn(256, 8); Y = X.sum(1, keepdim=True).sin()\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))\n"
        "model = torch.compile(model)\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-2)\nlosses = []",
        "%%resilient --save model,opt,losses\n"
        "for epoch in resume_range(5):\n"
        "    perm = torch.randperm(256)\n"
        "    for i in range(0, 256, 64):\n"
        "        idx = perm[i:i+64]\n"
        "        loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    losses.append(loss.item())\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS[fault]}\n",
        "print('RESULT', type(model).__name__, losses, b''.join(p.detach().numpy().tobytes() for p in model.parameters()).hex())",
    )


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile's default backend builds C++ for the CPU: no C++ compiler here")
@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_a_model_bound_again_to_torch_compile_of_itself_resumes_bit_for_bit(tmp_path, fault):
    """``model = torch.compile(model)``, the way notebooks compile: the name holds the compiled
    wrapper, whose state dict names every tensor under ``_orig_mod.``, and the replay compiles a
    new one. After a kill (the new kernel compiles again) or an out-of-memory error (rolled back in
    the same kernel, under the code compiled before), the run ends bit for bit as its twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _compiled_notebook(fault, mark), shared="compiled")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert "RESULT OptimizedModule [" in harness.cell_text(nb.cells[3])
    assert harness.result(nb) == harness.result(twin)


def _setup_draws_notebook(mark, *, seeded: bool):
    """A vocabulary in a set's order (``list(set(text))``) and a train split drawn in the %%replay
    cell before its seed (``seeded``: after it), read by the training; the model and optimizer in
    --save; a time the training never reads. A SIGKILL in epoch 2, once."""
    draws = ("text = 'the quick brown fox jumps over the lazy dog ' * 2\n"
             "chars = list(set(text))\n"
             "stoi = {c: i for i, c in enumerate(chars)}\n"
             "data = torch.tensor([stoi[c] for c in text])\n"
             "perm = torch.randperm(len(data) - 1)\n"
             "train_idx = perm[:64]\n")
    seed = "torch.manual_seed(0)\n"
    return harness.notebook(
        "%load_ext colab_resilience",
        f"%%replay\nimport os, signal, torch\nMARK = {str(mark)!r}\n" + (seed + draws if seeded else draws + seed) +
        "model = torch.nn.Sequential(torch.nn.Embedding(len(chars), 8), torch.nn.Linear(8, len(chars)))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.01)\nstarted = __import__('time').time()",
        "%%resilient --save model,opt\n"
        "for epoch in resume_range(4):\n"
        "    for i in range(0, 64, 16):\n"
        "        idx = train_idx[i:i+16]\n"
        "        loss = torch.nn.functional.cross_entropy(model(data[idx]), data[idx + 1])\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_FAULTS['kill']}\n",
        "print('RESULT', ''.join(chars), model[1].weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.one_stack("newest")
def test_what_the_replayed_set_up_cells_made_otherwise_is_named_when_the_run_resumes(tmp_path):
    """A train split drawn before the seed is drawn otherwise by the new kernel's replay: the
    resumed run trained on other data, and said nothing. The kernel that began the run fingerprints
    what the set-up cells made and the training reads (not the time it never reads, not the saved
    model); the new kernel says, in one line, which of them its replay made otherwise. The
    vocabulary made in a set's order is not among them: the supervisor's kernels hash strings
    alike."""
    nb = _setup_draws_notebook(tmp_path / "m", seeded=False)
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0 and len(run.restarts) == 1, run.message
    train = harness.cell_text(nb.cells[2])
    lines = [line for line in train.splitlines() if "replayed set-up cells" in line]
    assert lines == [
        "colab_resilience: the replayed set-up cells made train_idx otherwise than the kernel that began this "
        "run had them, and the training reads them (drawn without a seed, a set's order of strings, which differs "
        "from process to process, or changed since by a cell that is not replayed): the resumed run will not end as "
        "the uninterrupted one; seed the draws in the %%replay cell (torch.manual_seed(0), random_state=0), sort "
        "sets (sorted(set(...))), make the change in the %%replay cell, or --save them"], train



SET_UP_CELLS = {
    "model": "%%replay\nimport os, signal, torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(2, 1)\nlosses = []",
    "opt": "%%replay\nopt = torch.optim.SGD(model.parameters(), lr=0.1)",
    "sched": "%%replay\nsched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)",
}


def _set_up_out_of_order_then_killed(kernel, tmp_path, cells: list[str], saves: str, step: str):
    """The set-up cells ``cells`` (of :data:`SET_UP_CELLS`) run in that order, one of them again;
    the training cell (``--save saves``, ``step`` after the optimizer's) killed in epoch 2 and run
    again in the restarted kernel, which replays each set-up cell once, in the order they first
    ran. Returns its reply, which must be an error, the run id and the training cell."""
    kernel.ok(f"%load_ext colab_resilience\n%resilience dir {tmp_path / 'runs'}")
    for cell in cells:
        kernel.ok(SET_UP_CELLS[cell], metadata={"cellId": cell})
    train = (f"%%resilient --save {saves}\nfor epoch in resume_range(4):\n"
             f"    opt.zero_grad(); loss = model(torch.ones(1, 2)).sum(); loss.backward(); opt.step(){step}\n"
             "    losses.append(loss.item())\n    if epoch == 2:\n" + _kill(tmp_path / "m", "        "))
    _, code = kernel.execute_until_exit(train, metadata={"cellId": "train"})
    assert code == -9
    kernel.restart()
    r = kernel.execute(train, metadata={"cellId": "train"})
    assert r.status == "error", r.stdout
    return r, r.evalue.split()[2].rstrip(":"), train


@pytest.mark.one_stack("newest")
def test_an_optimizer_the_replay_joins_to_other_tensors_stops_the_run_before_anything_is_restored(kernel, tmp_path):
    """The model's set-up cell run again after the optimizer's (as one does, to start over): the
    optimizer steps the first model's tensors, and the model the training reads does not learn.
    The new kernel's replay runs each cell once, in the order they first ran, and joined the
    optimizer to the model: the resumed run trained it, and ended done with other losses than the
    uninterrupted run's, saying nothing. Each checkpoint keeps which tensors each saved optimizer
    steps (by the saved models' parameter names); the resumed run stops in one line before it
    restores anything, and `%resilience reset` starts it afresh."""
    r, run_id, train = _set_up_out_of_order_then_killed(kernel, tmp_path, ["model", "opt", "model"],
                                                        "model,opt,losses", "")
    assert r.evalue == (
        f"colab_resilience: run {run_id}: opt steps the parameters of model now, where at the safe point it stepped "
        "tensors no saved model holds (a cell that makes the model run again after the one that makes the "
        "optimizer?), so the run cannot go on as it was; to start it afresh with them as they are now: "
        f"`%resilience reset {run_id}`, then run this cell"), r.evalue
    assert kernel.value("losses") == []  # nothing was restored
    # status repeats the refusal, not "run its cell again to continue", which would only stop it again
    status = kernel.ok("%resilience status").stdout.splitlines()
    refusal = r.evalue.split(f"run {run_id}: ", 1)[1]
    assert status[2] == f"colab_resilience:     stopped in this kernel: {refusal}", status
    kernel.ok(f"%resilience reset {run_id}")
    kernel.ok(train, metadata={"cellId": "train"})
    losses = kernel.value("losses")
    assert len(losses) == 4 and len(set(losses)) == 4, losses  # a run afresh, in which the model learns


@pytest.mark.one_stack("newest")
def test_a_scheduler_the_replay_joins_to_another_optimizer_stops_the_run_before_anything_is_restored(kernel, tmp_path):
    """The optimizer's set-up cell run again after the scheduler's: the scheduler decays the first
    optimizer's learning rate, and the optimizer that trains keeps its own. The new kernel's replay
    runs each cell once, in the order they first ran, and joined the scheduler to the optimizer
    that trains: the resumed run decayed its rate, and ended done with other losses than the
    uninterrupted run's (found by a probe: epochs 3 and 4 moved by 0.15 and 0.075, not 0.3),
    saying nothing. Each checkpoint keeps which saved optimizer each saved scheduler drives; the
    resumed run stops in one line before it restores anything."""
    r, run_id, _ = _set_up_out_of_order_then_killed(kernel, tmp_path, ["model", "opt", "sched", "opt"],
                                                    "model,opt,sched,losses", "; sched.step()")
    assert r.evalue == (
        f"colab_resilience: run {run_id}: sched drives opt now, where at the safe point it drove an optimizer no "
        "saved name holds (a cell that makes the optimizer run again after the one that makes the scheduler?), so "
        f"the run cannot go on as it was; to start it afresh with them as they are now: `%resilience reset {run_id}`, "
        "then run this cell"), r.evalue
    assert kernel.value("losses") == []  # nothing was restored


def _killed_after_a_plain_cells_change(kernel, tmp_path, notebook, said: str):
    """``notebook(mark)`` (the extension, a %%replay cell, a plain cell that changes what it made,
    the training cell killed once, a result cell): its twin run uninterrupted, whose training cell
    must have ``said`` the change as the run began; then its cells in ``kernel`` up to the kill,
    the kernel restarted and the training cell run alone. Returns the twin, the cells' sources and
    that reply."""
    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "m").touch()
    twin = notebook(tmp_path / "twin" / "m")
    harness.uninterrupted_ok(harness.run(twin, tmp_path / "twin", standby=False))
    assert said in harness.cell_text(twin.cells[3])
    cells = [c.source for c in notebook(tmp_path / "m").cells]
    kernel.ok(cells[0])
    kernel.ok(f"%resilience dir {tmp_path / 'runs'}")
    kernel.ok(cells[1])
    kernel.ok(cells[2])
    assert kernel.execute_until_exit(cells[3])[1] == -9
    kernel.restart()
    return twin, cells, kernel.execute(cells[3])


@pytest.mark.one_stack("newest")
def test_one_element_a_plain_cell_changed_in_a_large_tensor_stops_a_resume_until_that_cell_runs_again(kernel,
                                                                                                      tmp_path):
    """A plain cell (not replayed) sets one element of a 1.5 MiB train set the training reads; a
    kill in epoch 2. The replay made the set without it and the run ended done with other losses,
    saying nothing: the fingerprint took a strided sample of a tensor that large, and missed the
    element (found by a probe). Every byte counts now, and the run names the change when it
    begins. Resumed with what the replay made, the run ended done with other losses all the same,
    having said it would (``x_train = x_train / 255`` in a plain cell, trained on unscaled; found
    by a probe): a change the run named as it began that the replay does not make stops the
    resume, pending, in one line; the plain cell run again (Run All), it resumes bit for bit."""
    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience",
            "%%replay\nimport os, signal, torch\ntorch.manual_seed(0)\nX = torch.randn(4096, 96); Y = X[:, :1] * 2\n"
            "model = torch.nn.Linear(96, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\nlosses = []",
            "X[7, 5] = 100.0",
            "%%resilient --save model,opt,losses\nfor epoch in resume_range(3):\n"
            "    loss = ((model(X) - Y) ** 2).mean(); opt.zero_grad(); loss.backward(); opt.step()\n"
            "    losses.append(loss.item())\n    if epoch == 1:\n" + _kill(mark, "        "),
            "print('RESULT', losses)")

    twin, cells, r = _killed_after_a_plain_cells_change(
        kernel, tmp_path, notebook, "colab_resilience: X changed since the %%replay cells ran")
    # the training cell alone: the replay makes X without the change
    assert r.status == "error" and r.evalue.startswith("colab_resilience: run ") and (
        ": X is not what the run began with: a cell that is not replayed had changed it since the %%replay cells "
        "ran (said as the run began), and the replay made it as the %%replay cells do, so the resumed run would "
        "train on other values; run that cell again, then this one (Run All does)") in r.evalue, r.evalue
    assert kernel.value("losses") == []  # nothing was restored
    assert "stopped in this kernel: X is not what the run began with" in kernel.ok("%resilience status").stdout
    kernel.ok(cells[2])
    out = kernel.ok(cells[3]).stdout  # from its last checkpoint (the loop's start, or epoch 0's end)
    assert "otherwise than the kernel that began" not in out and "is not what the run began with" not in out, out
    assert ": done;" in kernel.ok("%resilience status").stdout
    assert harness.result(kernel.ok(cells[4]).stdout) == harness.result(twin)


@pytest.mark.one_stack("newest")
def test_a_function_and_a_class_a_plain_cell_defined_again_stop_a_resume_until_that_cell_runs_again(kernel,
                                                                                                   tmp_path):
    """The %%replay cell defines the loss's scaling and a warm-up schedule; a plain cell below it
    defines both again (a fix: half the loss, a longer warm-up), and the training uses those; a
    kill in epoch 2. The replay brought the first versions back, and the run ended done with other
    weights, saying nothing: code was left out of the fingerprints. The run names both as it
    begins, and a resume whose replay made them otherwise stops, pending, in one line; the plain
    cell run again (Run All), it resumes bit for bit as its twin."""
    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience",
            "%%replay\nimport os, signal, torch\ntorch.manual_seed(0)\nX = torch.randn(256, 8); Y = X[:, :1] * 2\n"
            "model = torch.nn.Linear(8, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.05)\nlosses = []\n"
            "def scaled(loss):\n    return loss\n"
            "class Warmup:\n    steps = 2\n    def factor(self, epoch):\n        return min(1.0, (epoch + 1) / self.steps)",
            "def scaled(loss):\n    return loss * 0.5\n"
            "class Warmup:\n    steps = 4\n    def factor(self, epoch):\n        return min(1.0, (epoch + 1) / self.steps)",
            "%%resilient --save model,opt,losses\nwarmup = Warmup()\nfor epoch in resume_range(4):\n"
            "    for g in opt.param_groups:\n        g['lr'] = 0.05 * warmup.factor(epoch)\n"
            "    loss = scaled(((model(X) - Y) ** 2).mean()); opt.zero_grad(); loss.backward(); opt.step()\n"
            "    losses.append(loss.item())\n    if epoch == 2:\n" + _kill(mark, "        "),
            "print('RESULT', losses, model.weight.detach().numpy().tobytes().hex())")

    twin, cells, r = _killed_after_a_plain_cells_change(kernel, tmp_path, notebook, (
        "colab_resilience: Warmup, scaled changed since the %%replay cells ran (in a cell that is not replayed, or "
        "in an earlier run), and the training reads them: a new kernel's replay does not make that change, and a "
        "resume after a restart stops until the cell that made it runs again; define Warmup, scaled as you want "
        "them in a %%replay cell and run it"))
    # the training cell alone: the replay defines the first versions
    assert r.status == "error" and (
        ": Warmup, scaled are not what the run began with: a cell that is not replayed had changed them since the "
        "%%replay cells ran (said as the run began), and the replay made them as the %%replay cells do, so the "
        "resumed run would train on other code; run that cell again, then this one (Run All does), or define "
        "Warmup, scaled as you want them in a %%replay cell and run it") in r.evalue, r.evalue
    assert kernel.value("losses") == []  # nothing was restored
    kernel.ok(cells[2])
    out = kernel.ok(cells[3]).stdout
    assert "continuing at " in out and "is not what the run began with" not in out, out
    assert harness.result(kernel.ok(cells[4]).stdout) == harness.result(twin)


@pytest.mark.one_stack("newest")
@pytest.mark.parametrize("edited,where", [(False, "replay-cell"), (True, "replay-cell"), (True, "training-cell")],
                         ids=["unchanged", "edited-while-the-kernel-was-dead", "imported-by-the-training-cell"])
def test_a_module_file_of_the_notebook_edited_since_the_run_began_is_named_as_it_resumes(tmp_path, edited, where):
    """The %%replay cell imports the loss's scaling from ``steps_mod.py`` beside the notebook (a
    module of its own: the fingerprints of the notebook's code do not see it), or the training
    cell does. Edited while the kernel was dead (a fix: half the loss), the new code was imported
    and the resumed run ended done with losses of neither run, saying nothing: the resume names
    the file in one line. Unchanged, nothing is said and the run ends as its twin bit for bit."""
    def notebook(folder):
        module, mark = folder / "steps_mod.py", folder / "m"
        module.write_text("def scaled(loss):\n    return loss\n")
        edit = f"        open({str(module)!r}, 'w').write('def scaled(loss):\\n    return loss * 0.5\\n')\n"
        imports = "from steps_mod import scaled\n"
        return harness.notebook(
            "%load_ext colab_resilience",
            "%%replay\nimport os, signal, torch\n" + (imports if where == "replay-cell" else "") + "torch.manual_seed(0)\n"
            "X = torch.randn(256, 8); Y = X[:, :1] * 2\nmodel = torch.nn.Linear(8, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.05)\nlosses = []",
            "%%resilient --save model,opt,losses\n" + (imports if where == "training-cell" else "")
            + "for epoch in resume_range(4):\n"
            "    loss = scaled(((model(X) - Y) ** 2).mean()); opt.zero_grad(); loss.backward(); opt.step()\n"
            f"    losses.append(loss.item())\n    if epoch == 1 and not os.path.exists({str(mark)!r}):\n"
            + (edit if edited else "") + f"        open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n",
            "print('RESULT', losses)")

    (tmp_path / "twin").mkdir()
    twin = notebook(tmp_path / "twin")
    (tmp_path / "twin" / "m").touch()  # the fault has struck already: none
    harness.uninterrupted_ok(harness.run(twin, tmp_path / "twin", standby=False))
    nb = notebook(tmp_path)
    faulted = harness.run(nb, tmp_path, standby=False)
    assert faulted.status == 0 and len(faulted.restarts) == 1, faulted.message
    out, said = harness.cell_text(nb.cells[2]), "colab_resilience: steps_mod.py changed on disk since run "
    assert said not in harness.cell_text(twin.cells[2])
    if edited:
        assert said in out and (" began: the resumed run goes on with the code now in it, so what it did before ran "
                                "on the old code and the result is not that of either run uninterrupted; to start "
                                "over, `colab-resilience reset ") in out, out  # (a supervised run's notebook: its words)
        assert out.split(said)[1].split("\n")[0].endswith(f" --run-dir {tmp_path / 'runs'}` and run the command again"), out
        assert harness.result(nb) != harness.result(twin)
    else:
        assert said not in out, out
        assert harness.result(nb) == harness.result(twin)


@pytest.mark.one_stack("newest")
@pytest.mark.parametrize("where", ["plain-cell", "replay-cell"])
def test_an_environment_variable_a_plain_cell_set_is_named_as_the_run_resumes(tmp_path, monkeypatch, where):
    """``%env CUBLAS_WORKSPACE_CONFIG=:4096:8`` and ``os.environ["XLA_FLAGS"] = ...`` (what torch's
    deterministic algorithms on a GPU and JAX's deterministic ops need) in a plain cell: a new
    kernel starts with the environment the first one started with, and the resumed run went on
    without them, saying nothing (on a GPU: other numbers, or torch's error at the first matmul).
    The resume names them in one line; a variable the kernel started with (``OMP_NUM_THREADS``,
    given to the command), one of logging (``TF_CPP_MIN_LOG_LEVEL``), one this package does not
    compare (``WANDB_MODE``) and those set in the %%replay cell are not named."""
    setting = ("%env CUBLAS_WORKSPACE_CONFIG=:4096:8\nos.environ['XLA_FLAGS'] = '--xla_gpu_deterministic_ops=true'\n"
               "os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'; os.environ['WANDB_MODE'] = 'offline'\n")

    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience",
            "%%replay\nimport os, signal, torch\n" + (setting if where == "replay-cell" else "") +
            "torch.manual_seed(0)\nX = torch.randn(64, 8); Y = X[:, :1] * 2\nmodel = torch.nn.Linear(8, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.05)\nlosses = []",
            setting if where == "plain-cell" else "pass",
            "%%resilient --save model,opt,losses\nfor epoch in resume_range(3):\n"
            "    loss = ((model(X) - Y) ** 2).mean(); opt.zero_grad(); loss.backward(); opt.step()\n"
            "    losses.append(loss.item())\n    if epoch == 1:\n" + _kill(mark, "        "),
            "print('RESULT', losses, os.environ.get('OMP_NUM_THREADS'))")

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the command's environment, which every kernel it starts has
    _, nb, twin = harness.refused_or_twin(tmp_path, notebook, None)
    out = harness.cell_text(nb.cells[3])
    said = [line for line in out.splitlines() if "the environment variable" in line]
    if where == "plain-cell":
        assert len(said) == 1, out
        assert said[0].startswith("colab_resilience: the environment variables CUBLAS_WORKSPACE_CONFIG, XLA_FLAGS were "
                                  "set otherwise as run "), said
        assert said[0].endswith(" began, by a cell that is not replayed (os.environ, %env), and this kernel has them as "
                                "a new kernel starts: the resumed run goes on without that setting, and where it "
                                "changes what the training computes, the result is not that of the run uninterrupted; "
                                "set them in a %%replay cell above the imports, and `colab-resilience reset "
                                + said[0].split(" as run ")[1].split(" ")[0] + f" --run-dir {tmp_path / 'runs'}` to "
                                "start over"), said  # (a supervised run's notebook: the command's words)
    else:
        assert said == [], out
    assert harness.result(nb).endswith(" 1"), harness.result(nb)  # the command's, as every kernel started


@pytest.mark.one_stack("newest")
def test_a_run_an_earlier_version_began_resumes_without_comparing_its_fingerprints(kernel, tmp_path):
    """A run pending across an upgrade (a kill, ``pip install -U``, a new kernel): the journal's
    fingerprints were taken by an earlier version, which sampled large tensors; compared with
    this version's, every one differed, and the resume named a change nobody made (the train set
    "made otherwise"; before the first checkpoint, a refusal). Fingerprints carry how they were
    taken: those of an earlier version are not compared, and one line says which; the run ends bit
    for bit as its twin."""
    from colab_resilience.journal import Journal, find_runs

    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience",
            "%%replay\nimport os, signal, torch\ntorch.manual_seed(0)\nX = torch.randn(4096, 96); Y = X[:, :1] * 2\n"
            "model = torch.nn.Linear(96, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\nlosses = []",
            "%%resilient --save model,opt,losses\nfor epoch in resume_range(3):\n"
            "    loss = ((model(X) - Y) ** 2).mean(); opt.zero_grad(); loss.backward(); opt.step()\n"
            "    losses.append(loss.item())\n    if epoch == 1:\n" + _kill(mark, "        "),
            "print('RESULT', losses)")

    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "m").touch()
    twin = notebook(tmp_path / "twin" / "m")
    harness.uninterrupted_ok(harness.run(twin, tmp_path / "twin", standby=False))
    cells = [c.source for c in notebook(tmp_path / "m").cells]
    kernel.ok(cells[0])
    kernel.ok(f"%resilience dir {tmp_path / 'runs'}")
    kernel.ok(cells[1])
    assert kernel.execute_until_exit(cells[2])[1] == -9
    [run] = find_runs(tmp_path / "runs")
    journal = Journal.load(run)
    assert set(journal.setup) == {"X", "Y"} and all(p.startswith("2:") for p in journal.setup.values())
    journal.setup = {n: p.partition(":")[2] for n, p in journal.setup.items()}  # as an earlier version wrote it
    journal.save()
    kernel.restart()
    out = kernel.ok(cells[2]).stdout
    assert "colab_resilience: run " in out and " began under an earlier version of colab_resilience, which " \
        "fingerprinted what the run reads otherwise: X, Y not compared on this resume" in out, out
    assert "otherwise than the kernel that began this run" not in out, out
    assert harness.result(kernel.ok(cells[3]).stdout) == harness.result(twin)


def test_a_vocabulary_in_a_sets_order_is_named_when_jupyter_restarts_the_kernel(kernel, tmp_path):
    """Interactively, the kernel Jupyter restarts hashes strings its own way (no supervisor gives
    it the first kernel's hash seed): the replayed ``list(set(text))`` makes another vocabulary, and
    the cell run again says so when it resumes (it said nothing before, and trained on)."""
    assert "PYTHONHASHSEED" not in os.environ  # else the restarted kernel would hash as the first
    cells = [c.source for c in _setup_draws_notebook(tmp_path / "m", seeded=True).cells]
    kernel.ok(cells[0])
    kernel.ok(f"%resilience dir {tmp_path / 'runs'}")
    kernel.ok(cells[1])
    _, code = kernel.execute_until_exit(cells[2])
    assert code == -9
    kernel.restart()
    out = kernel.ok(cells[2]).stdout
    assert "colab_resilience: the replayed set-up cells made data otherwise than the kernel that began this run" \
        in out, out

@pytest.mark.one_stack("newest")
def test_set_up_cells_that_make_the_same_again_resume_bit_identical_and_say_nothing(tmp_path):
    """The same notebook with the split drawn after the seed: the replay makes what the first kernel
    had (the vocabulary in its set's order too: the supervisor's kernels hash strings alike), nothing
    is said of it, and the run ends bit for bit as its twin (a kernel with the hash seed the
    supervisor gave the faulted run's kernels: without it, they hashed strings each their own way)."""
    from colab_resilience.driver import HASH_SEED, hash_seed

    nb = _setup_draws_notebook(tmp_path / "m", seeded=True)
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0 and len(run.restarts) == 1, run.message
    assert "replayed set-up cells" not in harness.cell_text(nb.cells[2])
    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "m").touch()  # the fault has struck already: none
    twin = _setup_draws_notebook(tmp_path / "twin" / "m", seeded=True)  # its kernel hashes as the faulted run's did
    harness.uninterrupted_ok(harness.run(twin, tmp_path / "twin", standby=False, env={HASH_SEED: hash_seed(tmp_path / "runs")}))
    assert harness.result(nb) == harness.result(twin)


def _train_function_notebook(fault: str, mark):
    """The loop in a function a %%replay cell defines (``train(epochs)``), which the %%resilient
    cell calls; early stopping whose state it declares global, saved. One fault (a SIGKILL or an
    out-of-memory error) in epoch 4, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)\n"
        "def train(epochs):\n"
        "    global best, bad\n"
        "    best, bad = float('inf'), 0\n"
        "    model.weight.data.mul_(0.5)  # above the loop: run once, before the restore\n"
        "    for epoch in resume_range(epochs):\n"
        "        loss = ((model(X) - Y) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "        if loss.item() < best - 0.01:\n"
        "            best, bad = loss.item(), 0\n"
        "        else:\n"
        "            bad += 1\n"
        "        if epoch == 4 and not os.path.exists(MARK):\n"
        f"            open(MARK, 'w').close(); {_FAULTS[fault]}\n"
        "        if bad >= 2:\n"
        "            return epoch\n"
        "    return None",
        "%%resilient --save model,opt,best,bad\nstopped = train(40)",
        "print('RESULT', stopped, best.hex(), model.weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_a_loop_in_a_function_the_cell_calls_resumes_where_it_stopped(tmp_path, fault):
    """``stopped = train(40)``, the resume_range loop inside train(), defined by a %%replay cell:
    after a kill or an OOM the loop goes on from its safe point, restored when the loop starts,
    and the run ends bit for bit as its uninterrupted twin. Before, the cell, whose own code holds
    no loop, was restored at its first line and run again: train() halved the restored weights
    and trained them from epoch 0, and the run said done."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: _train_function_notebook(fault, mark),
                                     shared="train_function")
    text = harness.cell_text(nb.cells[2])
    assert len(run.restarts) == (fault == "kill"), text
    assert harness.result(nb) == harness.result(twin)
    assert not harness.result(nb).startswith("RESULT None "), harness.result(nb)  # it stopped early


_TRAINER_CLASS = (
    "import os, signal, torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.05)\nX, Y = torch.randn(64, 4), torch.randn(64, 1)\n"
    "class Trainer:\n"
    "    def __init__(self, model, opt):\n        self.model, self.opt, self.history = model, opt, []\n"
    "    def fit(self, epochs):\n"
    "        for epoch in resume_range(epochs):\n"
    "            for i in range(0, 64, 16):\n"
    "                loss = ((self.model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()\n"
    "                self.opt.zero_grad(); loss.backward(); self.opt.step()\n"
    "            self.history.append(loss.item())\n"
    "            if epoch == 3 and not os.path.exists(MARK):\n"
    "                open(MARK, 'w').close(); FAULT\n"
    "        return self.history\n"
    "trainer = Trainer(model, opt)"
)


@pytest.mark.parametrize("fault", ["kill", "oom"])
@pytest.mark.one_stack("newest")
def test_a_trainer_object_whose_method_runs_the_loop_is_restored_into_itself(tmp_path, fault):
    """``hist = trainer.fit(6)``: the loop runs in a method of a class the notebook defines, and
    ``self`` is the object the cell called it on. Restored with ``--save trainer,model,opt``, the
    saved attributes go into that object: after a kill or an OOM its history goes on where it was
    and the run ends bit for bit as its uninterrupted twin. Bound to a new Trainer, as before, the
    running method went on appending to the old one's history (the retry's epochs twice, or the
    replayed, empty one), and the run said done."""
    def notebook(mark):
        code = _TRAINER_CLASS.replace("FAULT", _FAULTS[fault])
        return harness.notebook(
            "%load_ext colab_resilience", f"%%replay\nMARK = {str(mark)!r}\n{code}",
            "%%resilient --save trainer,model,opt\nhist = trainer.fit(6)",
            "print('RESULT', len(hist), hist is trainer.history, trainer.model is model, [h.hex() for h in hist],"
            " model.weight.detach().numpy().tobytes().hex())")

    run, nb, twin = faulted_and_twin(tmp_path, notebook, shared="trainer_class")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT 6 True True "), harness.result(nb)


def _two_phases_notebook():
    """Two loops in one cell, pre-training with SGD, then fine-tuning with an Adam the cell makes
    between them, saved, with a learning rate the first loop set (saved too)."""
    return harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)\nlog = []",
        "%%resilient --save model,opt,opt2,log,lr\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "for epoch in resume_range(3):\n"
        "    loss = ((model(X) - Y) ** 2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step(); log.append(loss.item())\n"
        "    lr = 0.01 / (epoch + 1)\n"
        "opt2 = torch.optim.Adam(model.parameters(), lr=lr)\n"
        "for epoch in resume_range(3):\n"
        "    loss = ((model(X) - Y) ** 2).mean()\n"
        "    opt2.zero_grad(); loss.backward(); opt2.step(); log.append(loss.item())",
        "print('RESULT', epoch, [v.hex() for v in log], model.weight.detach().numpy().tobytes().hex(),"
        " [s['exp_avg'].numpy().tobytes().hex() for s in opt2.state.values()])",
    )


@pytest.mark.parametrize("where", [(6, "after"), (8, "before"), (8, "after")],
                         ids=["in-the-second-loop", "before-the-end-save", "after-the-end-save"])
@pytest.mark.one_stack("newest")
def test_an_optimizer_the_cell_makes_between_two_loops_is_restored_once_it_is_made(tmp_path, where):
    """``opt2 = Adam(...)`` between the pre-training loop and the fine-tuning one, saved: a kill in
    the second loop, or just before or after the save at the cell's end (every loop had finished),
    resumes bit for bit as the uninterrupted twin: opt2's state is restored once the cell has made
    it again, where the resume arrives or at the cell's end. Before, the restore when the first
    loop started found no opt2 and stopped the run, telling the user to build it in a %%replay
    cell; and nothing said at the first run that opt2 was not at the first loop's safe points.
    The learning rate the first loop set, a plain value, is back before the code between the
    loops reads it.
    Resumed at the cell's end, the loop variable the cell left (epoch) is back too: it was unbound,
    and the next cell failed."""
    from colab_resilience import faults

    twin = _two_phases_notebook()
    (tmp_path / "twin").mkdir()
    harness.uninterrupted_ok(harness.run(twin, tmp_path / "twin", standby=False))
    assert "colab_resilience: " not in harness.cell_text(twin.cells[2])
    nb = _two_phases_notebook()
    point, phase = where
    fault = {"kind": "kill", "safe_point": point, "phase": phase, "delay": 0.0, "mark": str(tmp_path / "m")}
    run = harness.run(nb, tmp_path, standby=False, env={faults.FAULT_ENV: json.dumps(fault)})
    assert run.status == 0, run.message
    assert len(run.restarts) == 1, harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT 2 ")
    if where == (8, "after"):
        assert "; every loop had finished; loss, which the cell sets without --save, is not back: add it to " \
               "--save" in harness.cell_text(nb.cells[2]), harness.cell_text(nb.cells[2])


# -- the run's start: what a kill before its first checkpoint finds ----------------------------------------


def _model_setup(device: str = "cpu") -> str:
    return ("%%replay\nimport os, signal, torch\ntorch.manual_seed(0)\n"
            f"X = torch.randn(96, 6, device={device!r}); Y = X[:, :1] * 2\n"
            "model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))"
            f".to({device!r})\nopt = torch.optim.Adam(model.parameters(), lr=0.01)\nlosses = []")


_SETUP = _model_setup()
_TRAIN = ("    for i in range(0, 96, 16):\n"
          "        b = perm[i:i + 16]\n"
          "        loss = ((model(X[b]) - Y[b]) ** 2).mean(); opt.zero_grad(); loss.backward(); opt.step()\n"
          "    losses.append(loss.item())\n")


def _kill(mark, indent: str) -> str:
    return (f"{indent}if not os.path.exists({str(mark)!r}):\n"
            f"{indent}    open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")


def drawn_above_the_loop_notebook(where: str, mark, device: str = "cpu"):
    """A plain cell draws random numbers after the %%replay cell; the training cell draws a
    permutation above its loop, not saved, and is killed once above the loop or in it."""
    above, inside = ((_kill(mark, ""), "") if where == "above-the-loop" else
                     ("", "    if epoch == 1:\n" + _kill(mark, "        ")))
    return harness.notebook(
        "%load_ext colab_resilience", _model_setup(device), f"noise = torch.rand(3, device={device!r})",
        "%%resilient --save model,opt,losses\n" + above + "perm = torch.randperm(96, device=X.device)\n"
        "for epoch in resume_range(3):\n" + inside + _TRAIN,
        "print('RESULT', losses, model[0].weight.sum().item(), model[0].weight.device)")


@pytest.mark.parametrize("where", ["above-the-loop", "in-the-loop"])
@pytest.mark.one_stack("newest")
def test_the_code_above_the_first_loop_draws_again_what_the_run_began_with(tmp_path, where):
    """A plain cell (not replayed) drew random numbers after the %%replay cell; the training cell
    draws a permutation above its loop, not saved. Killed above the loop (no checkpoint yet), or in
    the loop (the permutation is drawn again above it): the new kernel's replay left the random
    state where the set-up cell leaves it, so the cell drew another permutation and said done with
    other weights (found by a probe). The run's start keeps its random state in the journal, and a
    kernel that resumes it sets it before the cell runs again: bit for bit as the twin."""
    run, nb, twin = faulted_and_twin(tmp_path, lambda mark: drawn_above_the_loop_notebook(where, mark))
    out = harness.cell_text(nb.cells[3])
    assert len(run.restarts) == 1, out
    assert ("no checkpoint yet" in out) == (where == "above-the-loop"), out
    assert harness.result(nb) == harness.result(twin)


def _changed_before_the_first_checkpoint(mark):
    """A finished run, a plain cell that lowers the optimizer's rate, a second run killed above its
    loop (before its first checkpoint)."""
    return harness.notebook(
        "%load_ext colab_resilience", _SETUP,
        "%%resilient --save model,opt,losses\nperm = torch.arange(96)\nfor epoch in resume_range(3):\n" + _TRAIN,
        "for group in opt.param_groups:\n    group['lr'] = 0.003",
        "%%resilient --save model,opt,losses\n" + _kill(mark, "") + "perm = torch.arange(96)\n"
        "for epoch in resume_range(3, 6):\n" + _TRAIN,
        "print('RESULT', losses, opt.param_groups[0]['lr'], model[0].weight.sum().item())")


REFUSED = "is not what the run began with, and the kernel died before the run's first checkpoint held it"


@pytest.mark.one_stack("colab")
def test_a_saved_value_a_plain_cell_changed_is_not_lost_silently_before_the_first_checkpoint(tmp_path):
    """Killed above its loop, the second run found no checkpoint and trained from what the set-up
    cell and the first run make: without the rate the plain cell set, and said done with other
    weights (found by a probe). No checkpoint holds that change; the run stops, pending, with the
    line that names the optimizer (the model, restored from the first run, is as it began)."""
    run, nb, _ = harness.refused_or_twin(tmp_path, _changed_before_the_first_checkpoint, f"opt {REFUSED}")
    assert "model" not in run.message.split("run began")[0], run.message
    assert "RESULT" not in "".join(harness.cell_text(c) for c in nb.cells)


@pytest.mark.one_stack("colab")
def test_a_model_the_replay_initialised_otherwise_is_said_and_the_run_goes_on(tmp_path):
    """A model the %%replay cell initialises without a seed, nothing changed since: killed above
    the loop, the replay makes it otherwise. Nothing a re-run would give back was lost, so the run
    is not refused (Run All would make it otherwise again): one line says the result will differ,
    and the run ends."""
    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience",
            _SETUP.replace("torch.manual_seed(0)\nX = torch.randn(96, 6", "X = torch.ones(96, 6"),
            "%%resilient --save model,opt,losses\n" + _kill(mark, "") + "perm = torch.arange(96)\n"
            "for epoch in resume_range(3):\n" + _TRAIN,
            "print('RESULT', losses)")

    run = harness.run(nb := notebook(tmp_path / "m"), tmp_path, standby=False)
    out = harness.cell_text(nb.cells[2])
    assert run.status == 0 and len(run.restarts) == 1, run.message
    assert ("the replayed set-up cells made model otherwise than the kernel that began this run had them "
            "(drawn without a seed), and the kernel died before the run's first checkpoint held it") in out, out
    assert "opt" not in out.split("made model")[1].split("otherwise")[0]


@pytest.mark.one_stack("colab")
def test_an_oom_above_the_loop_after_an_otherwise_initialised_model_is_retried_in_the_kernel(tmp_path):
    """Killed above the loop, the run goes on with the model the replay initialised otherwise (no
    seed); out of memory there next, before the run's first checkpoint, the failed attempt changed
    nothing: the retry stays in the kernel (it compares with what this kernel's attempt began with,
    not the first kernel's, which would restart the kernel at every such OOM)."""
    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience",
            _SETUP.replace("torch.manual_seed(0)\nX = torch.randn(96, 6", "X = torch.ones(96, 6"),
            "%%resilient --save model,opt,losses\n" + _kill(mark, "")
            + f"if not os.path.exists({str(mark) + '2'!r}):\n    open({str(mark) + '2'!r}, 'w').close()\n"
            f"    {harness.HOST_OOM}\nperm = torch.arange(96)\nfor epoch in resume_range(3):\n" + _TRAIN,
            "print('RESULT', losses)")

    run = harness.run(nb := notebook(tmp_path / "m"), tmp_path, standby=False)
    out = harness.cell_text(nb.cells[2])
    assert run.status == 0 and len(run.restarts) == 1, out
    assert "made model otherwise" in out and "retry 1/2" in out, out


def _twin_then_killed(kernel, tmp_path, notebook, train: int):
    """``notebook(mark)`` run uninterrupted, supervised (the twin); then its cells run one by one in
    ``kernel``, as a user would, until the cell ``train`` kills it. Returns the twin and the cells."""
    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "m").touch()
    twin = notebook(tmp_path / "twin" / "m")
    harness.uninterrupted_ok(harness.run(twin, tmp_path / "twin", standby=False))
    cells = [c.source for c in notebook(tmp_path / "m").cells]
    for source in cells[:train]:
        kernel.ok(source)
    _, code = kernel.execute_until_exit(cells[train])
    assert code == -9
    return twin, cells


@pytest.mark.one_stack("colab")
def test_a_refused_run_goes_on_as_it_began_after_run_all(kernel, tmp_path):
    """Interactively, the user runs the training cell again after the kernel died: the first run's
    model and losses come back (it had finished in the kernel that died), the rate the plain cell
    set does not: no checkpoint holds it, and the run trained at the old rate (said done with other
    weights). It is refused, naming the optimizer; the user does as the line says, Run All (the
    first training cell trains again, the plain cell sets the rate): the run goes on as it began,
    bit for bit as the uninterrupted twin."""
    twin, cells = _twin_then_killed(kernel, tmp_path, _changed_before_the_first_checkpoint, 4)
    kernel.restart()
    kernel.ok(cells[0])
    refused = kernel.execute(cells[4])
    assert refused.status == "error"
    assert f"opt {REFUSED}" in refused.evalue, refused.evalue
    assert "run the cells above this one again (Run All does)" in refused.evalue
    for source in cells[1:4]:
        kernel.ok(source)
    out = kernel.ok(cells[4]).stdout
    assert "no checkpoint yet" in out, out
    assert harness.result(kernel.ok(cells[5]).stdout) == harness.result(twin)


_FROZEN_SETUP = _SETUP + "\nhead = torch.nn.Linear(1, 1); opt2 = torch.optim.SGD(head.parameters(), lr=0.05); losses2 = []"
_TRAIN_THE_MODEL = "%%resilient --save model,opt,losses\nperm = torch.arange(96)\nfor epoch in resume_range(3):\n" + _TRAIN


def _head_on_a_frozen_model(mark, saved: str = "head,opt2,losses2", features: str = "model(X)") -> str:
    """A training cell that fits a head on what ``model`` computes, reading the model, not
    training it (nor saving it), killed once at the start of its third epoch."""
    return (f"%%resilient --save {saved}\nfor epoch in resume_range(4):\n"
            + "    if epoch == 2:\n" + _kill(mark, "        ")
            + f"    with torch.no_grad():\n        f = {features}\n"
            "    loss = ((head(f) - Y) ** 2).mean(); opt2.zero_grad(); loss.backward(); opt2.step()\n"
            "    losses2.append(loss.item())")


def _frozen_model_notebook(mark):
    return harness.notebook("%load_ext colab_resilience", _FROZEN_SETUP, _TRAIN_THE_MODEL,
                            _head_on_a_frozen_model(mark), "print('RESULT', losses2, head.weight.sum().item())")


@pytest.mark.parametrize("by_hand", [False, True], ids=["the-cell-alone", "after-the-set-up-cells"])
@pytest.mark.one_stack("colab")
def test_a_cell_run_again_after_a_death_gets_back_what_the_training_before_it_finished(kernel, tmp_path, by_hand):
    """Interactively: a finished run trains the model; the next cell fits a head on that model
    (read, not saved) and the kernel dies in its third epoch. The user runs that cell again (alone,
    or after the %load_ext and %%replay cells by hand): the new kernel had the model the set-up
    cell makes, untrained, and the head went on training on it, said done with other losses (found
    by a probe; a driver puts finished runs back, an interactive kernel did not). It now puts back
    what the runs that had finished in the kernel that died saved, and only theirs: another
    notebook's kernel in the same run directory finished a run that saves a model too (zeros),
    which stays out. Bit for bit as the uninterrupted twin."""
    twin, cells = _twin_then_killed(kernel, tmp_path, _frozen_model_notebook, 3)
    dead = kernel.pid  # (until it is restarted)
    other = harness.Kernel()  # another notebook, the same run directory, a run finished since
    try:
        other.ok(cells[0])
        other.ok(cells[1])
        zeros = "%%resilient --save model\nfor _ in resume_range(1):\n    with torch.no_grad():\n" \
                "        model[0].weight.zero_()"
        other.ok(zeros)
    finally:
        other.shutdown()
    # and its kernel had the PID of the one that died (a PID is reused: in a fresh Colab VM, often)
    from colab_resilience.journal import Journal, find_runs
    from colab_resilience.signing import load_or_create_key

    key = load_or_create_key()
    theirs = [j for j in (Journal.load(d, key=key) for d in find_runs(os.environ["COLAB_RESILIENCE_RUN_DIR"]))
              if (j.interrupted_cell or "").strip() == zeros]
    assert len(theirs) == 1 and theirs[0].status == "done"
    theirs[0].kernel_pid = dead
    theirs[0].save()
    kernel.restart()
    if by_hand:
        kernel.ok(cells[0])
        kernel.ok(cells[1])
    out = kernel.ok(cells[3]).stdout
    assert "put back model, opt, losses, epoch, i from the training that had finished in the kernel that died" in out, out
    assert harness.result(kernel.ok(cells[4]).stdout) == harness.result(twin)


@pytest.mark.one_stack("colab")
def test_a_run_directory_given_again_puts_back_none_of_an_earlier_runs_runs(tmp_path):
    """A notebook run twice in one run directory (`colab-resilience run --run-dir D`), the second
    time killed in its first training cell: the driver put back every run finished in D, the
    second training cell's too, which the first `run` had finished (found by a probe): its head,
    trained, and that cell then trained it again from there, said done with other losses. The
    driver now puts back the runs of its own kernels only: bit for bit as the first time."""
    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience", _FROZEN_SETUP,
            "%%resilient --save model,opt,losses\nperm = torch.arange(96)\nfor epoch in resume_range(3):\n"
            "    if epoch == 1:\n" + _kill(mark, "        ") + _TRAIN,
            _head_on_a_frozen_model(tmp_path / "never"), "print('RESULT', losses2, head.weight.sum().item())")

    (tmp_path / "never").touch()
    (tmp_path / "m").touch()
    first = notebook(tmp_path / "m")
    assert harness.run(first, tmp_path, standby=False).status == 0
    (tmp_path / "m").unlink()
    again = notebook(tmp_path / "m")
    run = harness.run(again, tmp_path, standby=False)
    assert run.status == 0 and len(run.restarts) == 1, run.message
    assert "restored" not in harness.cell_text(again.cells[2]).split("resumed")[0], harness.cell_text(again.cells[2])
    assert harness.result(again) == harness.result(first)


@pytest.mark.one_stack("colab")
def test_a_value_a_finished_run_saved_and_a_plain_cell_changed_is_not_put_back_as_it_was(kernel, tmp_path):
    """A finished run saves a scale; a plain cell halves it; the next training cell reads it (not
    saved) and is killed. Run again alone, the finished run's state came back, the scale as that
    run ended, not halved: the head trained on other features, said done (found by a probe; before
    the finished runs came back interactively it was a NameError). What the cell reads before it
    binds it and the set-up cells do not make is now held with the run's start: refused in one
    line naming the scale; Run All then goes on bit for bit as the twin."""
    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience", _FROZEN_SETUP,
            _TRAIN_THE_MODEL.replace("--save model,opt,losses\n", "--save model,opt,losses,scale\nscale = 2.0\n"),
            "scale = scale * 0.5", _head_on_a_frozen_model(mark, features="model(X) * scale"),
            "print('RESULT', losses2, head.weight.sum().item())")

    twin, cells = _twin_then_killed(kernel, tmp_path, notebook, 4)
    kernel.restart()
    refused = kernel.execute(cells[4])
    assert refused.status == "error"
    assert "scale is not what the run began with, and no checkpoint of the run holds it" in refused.evalue, \
        refused.evalue
    for source in cells[:5]:
        kernel.ok(source)
    assert harness.result(kernel.ok(cells[5]).stdout) == harness.result(twin)


@pytest.mark.one_stack("colab")
def test_a_shrunk_value_a_plain_cell_set_is_not_refused_after_a_restart(tmp_path):
    """``batch_size = 32`` in a plain cell, ``--shrink batch_size``: an OOM halves it, then a kill.
    The journal gives the new kernel 16, not what the run began with, by design: not refused (the
    first version of the run's start check of what the cell reads refused it: colab-resilience
    check on notebooks/quickstart.ipynb)."""
    mark = tmp_path / "m"
    nb = harness.notebook(
        "%load_ext colab_resilience", _SETUP, "batch_size = 32",
        "%%resilient --save model,opt,losses --shrink batch_size\nperm = torch.arange(96)\n"
        "for epoch in resume_range(3):\n    if batch_size == 32:\n"
        "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n"
        "    if epoch == 1:\n" + _kill(mark, "        ") + _TRAIN,
        "print('RESULT', batch_size, losses)")
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0 and len(run.restarts) == 1, run.message
    assert harness.result(nb).startswith("RESULT 16 ")


@pytest.mark.parametrize("saved", ["head,opt2,losses2", "head,opt2,losses2,model"], ids=["not-saved", "saved"])
@pytest.mark.one_stack("colab")
def test_a_model_a_plain_cell_changed_that_no_checkpoint_holds_is_not_lost_silently(tmp_path, saved):
    """A plain cell (not replayed) scales the weights of the model the training reads and does not
    save; killed in its third epoch, past its first checkpoint: the replay made the model without
    that change, and the head went on training on it, said done with other losses (found by a
    probe: the run's start was compared only before its first checkpoint, and no checkpoint ever
    holds a value the cell does not save). Refused now, naming the model; saved, it comes back from
    the checkpoint: bit for bit as the twin."""
    def notebook(mark):
        return harness.notebook("%load_ext colab_resilience", _FROZEN_SETUP,
                                "with torch.no_grad():\n    model[0].weight.mul_(0.5)",
                                _head_on_a_frozen_model(mark, saved), "print('RESULT', losses2, head.weight.sum().item())")

    refused = None if "model" in saved else "model is not what the run began with, and no checkpoint of the run holds it"
    run, _, _ = harness.refused_or_twin(tmp_path, notebook, refused)
    if refused:
        assert "make that change in a %%replay cell or add it to --save" in run.message, run.message


@pytest.mark.parametrize("changed", [True, False], ids=["changed-in-place", "unchanged"])
@pytest.mark.one_stack("colab")
def test_an_oom_above_the_first_loop_after_an_in_place_change_resumes_in_a_new_kernel(tmp_path, changed):
    """The cell halves the optimizer's rate and scales the weights in place above its loop, then
    runs out of host memory (a real failure of torch's allocator) before the loop's first
    checkpoint. The retry in the kernel ran that code again on the changed values: a quarter of
    the rate, and said done with other weights (found by a probe). Nothing holds what they were,
    so the run goes on in a restarted kernel, whose replay makes them again: bit for bit as the
    twin. Where the failed attempt changed nothing yet (out of memory before the change), the
    retry stays in the kernel."""
    change = ("for g in opt.param_groups:\n    g['lr'] *= 0.5\n"
              "with torch.no_grad():\n    model[0].weight.mul_(0.9)\n")

    def notebook(mark):
        oom = (f"if not os.path.exists({str(mark)!r}):\n"
               f"    open({str(mark)!r}, 'w').close()\n    {harness.HOST_OOM}\n")
        return harness.notebook(
            "%load_ext colab_resilience", _SETUP,
            "%%resilient --save model,opt,losses\n" + (change + oom if changed else oom + change)
            + "perm = torch.arange(96)\nfor epoch in resume_range(3):\n" + _TRAIN,
            "print('RESULT', losses, opt.param_groups[0]['lr'], model[0].weight.sum().item())")

    run, nb, twin = faulted_and_twin(tmp_path, notebook)
    out = harness.cell_text(nb.cells[2])
    if changed:
        assert len(run.restarts) == 1, out
        assert "out of memory, and the failed attempt had changed model, opt before the run's first checkpoint" in out
    else:
        assert not run.restarts and "retry 1/2" in out, out
    assert harness.result(nb) == harness.result(twin)
    assert " 0.005 " in harness.result(twin)


# -- checkpoint() ------------------------------------------------------------------------------------


@pytest.mark.one_stack("newest")
def test_checkpoint_in_the_middle_of_an_iteration_saves_at_its_end(tmp_path, tmp_path_factory):
    """checkpoint() half-way through each epoch (with --every 3), killed after it: the run does
    not redo the epoch on top of its own half-done update; it ends bit-identical. (The checkpoint
    used to be taken there, recording the epoch in progress as the next one.)"""
    reference = twin(tmp_path_factory, "resume_checkpoint.ipynb")
    nb = harness.load("resume_checkpoint.ipynb", tmp_path, fault="sigkill", staging="off")
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0, run.message
    assert [r.iteration for r in run.restarts] == ["2"]  # the end of epoch 1, saved on request
    assert harness.result(nb) == reference


@pytest.mark.one_stack("colab")
def test_checkpoint_in_the_middle_of_an_iteration_saves_at_its_end_interactively(kernel, tmp_path, tmp_path_factory):
    reference = twin(tmp_path_factory, "resume_checkpoint.ipynb")
    nb = harness.load("resume_checkpoint.ipynb", tmp_path, fault="sigkill", staging="off")
    assert "continuing at 2" in harness.killed_and_rerun(kernel, nb)
    assert interactive_result(kernel, nb) == reference


def test_checkpoint_where_no_exact_resume_is_possible_is_refused_when_called(ip, tmp_path):
    """In a cell without resume_range (it would run again from its first line on top of the state
    saved in its middle): refused at the call, in one line that says what to write instead, before
    the code after it runs."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.user_ns.update(state={"step": 0})
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("resilient", "--save state", "state['step'] += 1\ncheckpoint()\nstate['step'] += 100\n")
    message = str(info.value)
    assert message.startswith("colab_resilience: checkpoint() outside a resume_range iteration cannot resume exactly")
    assert "call it inside a `for ... in resume_range(...)` loop" in message and "\n" not in message
    assert ip.user_ns["state"] == {"step": 1}
    journal = json.loads(next((tmp_path / "runs").glob("run-*/journal.json")).read_text())
    assert journal["status"] == "failed"


# -- a value that cannot be saved stops the cell -------------------------------------------------------


def test_a_save_name_that_cannot_be_saved_stops_the_cell_at_its_first_safe_point(ip, tmp_path):
    """An object holding a lambda (as a flax TrainState holds optax's closures): the cell stops at
    the loop start, before any epoch runs and before anything is written, naming the value, its
    type and what to do. (It used to print a line and train on; after a restart resume_range
    skipped the epochs although their state had never been saved.)"""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("class TrainState:\n    def __init__(self):\n        self.step = 0\n        self.tx = lambda g: g\n"
                "state = TrainState()\nepochs_run = []")
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("resilient", "--save state",
                          "for epoch in resume_range(3):\n    epochs_run.append(epoch)\n    state.step += 1\n")
    message = str(info.value)
    assert message.startswith("colab_resilience: cannot save 'state': TrainState objects cannot be checkpointed (pickle failed")
    assert "recreate it in a %%replay cell and save what it holds instead" in message and "\n" not in message
    assert ip.user_ns["epochs_run"] == []
    run_dir = next((tmp_path / "runs").glob("run-*"))
    assert json.loads((run_dir / "journal.json").read_text())["status"] == "failed"
    assert not list((run_dir / "checkpoints").glob("ckpt-*"))


@pytest.mark.one_stack("newest")
def test_a_save_name_that_cannot_be_saved_fails_a_supervised_run(tmp_path):
    """Supervised, the same refusal fails the cell (exit status 1) instead of a run that ends
    "done" with a different result."""
    from colab_resilience import driver

    nb = harness.load("resume_nested.ipynb", tmp_path)
    harness.insert(nb, "train", (
        "class Stepper:  # a training-state wrapper holding its schedule as a lambda\n"
        "    def __init__(self, opt):\n        self.opt, self.schedule = opt, lambda step: 1.0\n"
        "    def zero_grad(self):\n        self.opt.zero_grad()\n"
        "    def step(self):\n        self.opt.step()\n"
        "opt = Stepper(opt)"), "unsaveable")
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == driver.EXIT_CELL_FAILED
    assert "cannot save 'opt': Stepper objects cannot be checkpointed (pickle failed" in run.message


# -- --shrink, line magics, budgets ----------------------------------------------------------------------


@pytest.mark.one_stack("newest")
def test_a_shrink_is_kept_when_the_kernel_is_killed_before_the_next_safe_point(tmp_path, tmp_path_factory):
    """In a cell without resume_range: an OOM halves the batch, then the kernel is killed. The new
    kernel starts from the halved batch (the journal has it from the moment of the shrink), not
    from the size that ran out of memory."""
    nb = harness.load("resume_shrink.ipynb", tmp_path, fault="sigkill")
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0, run.message
    text = cell_out(nb, "train")
    after = text.split("colab_resilience: the kernel died", 1)[1]
    assert "attempt with batch_size 32" in after and "attempt with batch_size 64" not in after
    assert "OOM" not in after
    assert harness.result(nb) == twin(tmp_path_factory, "resume_shrink.ipynb", batch_size=32)


@pytest.mark.one_stack("newest")
def test_a_kill_after_the_final_save_of_a_cell_without_resume_range_does_not_train_again(tmp_path,
                                                                                        tmp_path_factory):
    """A cell without resume_range, killed just after its end-of-cell checkpoint was written and
    before its run was marked done (as `colab-resilience check` found, a kill 0.015 s into that
    save): the new kernel puts the final state back and does not run the cell again, which trained
    a second time on top of its own result. Bit-identical to the uninterrupted twin."""
    from colab_resilience import faults

    nb = harness.load("resume_shrink.ipynb", tmp_path)
    fault = json.dumps({"kind": "kill", "safe_point": 2, "phase": "after", "delay": 0, "mark": str(tmp_path / "m")})
    run = harness.run(nb, tmp_path, standby=False, env={faults.FAULT_ENV: fault})
    assert run.status == 0, run.message
    assert faults.fired(tmp_path / "m") and len(run.restarts) == 1
    text = cell_out(nb, "train")
    after = text.split("colab_resilience: the kernel died", 1)[1]
    assert "the cell had finished, it is not run again" in after and "attempt with batch_size" not in after
    assert harness.result(nb) == twin(tmp_path_factory, "resume_shrink.ipynb", batch_size=32)


@pytest.mark.one_stack("newest")
def test_a_shrink_is_kept_when_the_kernel_is_killed_before_the_next_safe_point_interactively(kernel, tmp_path,
                                                                                              tmp_path_factory):
    nb = harness.load("resume_shrink.ipynb", tmp_path, fault="sigkill")
    out = harness.killed_and_rerun(kernel, nb)
    assert "attempt with batch_size 32" in out and "attempt with batch_size 64" not in out and "OOM" not in out
    assert interactive_result(kernel, nb) == twin(tmp_path_factory, "resume_shrink.ipynb", batch_size=32)


def test_restart_after_inside_the_cell_applies_to_its_run_interactively(kernel, tmp_path, tmp_path_factory):
    """Interactively the planned restart leaves the kernel (exit 75); the cell run again goes on."""
    reference = twin(tmp_path_factory, "resume_planned.ipynb")
    nb = harness.load("resume_planned.ipynb", tmp_path, plan="2")
    assert "continuing at 2" in harness.killed_and_rerun(kernel, nb, expect_code=75)
    assert interactive_result(kernel, nb) == reference


def test_restart_after_inside_the_cell_applies_to_its_run(tmp_path, tmp_path_factory):
    """`%restart_after 2` on the first line of the training cell restarts that run after 2 safe
    points (it used to print that it would, and never did); the result is that of no restart."""
    reference = twin(tmp_path_factory, "resume_planned.ipynb")
    nb = harness.load("resume_planned.ipynb", tmp_path, plan="2")
    run = harness.run(nb, tmp_path, standby=False)
    assert run.status == 0, run.message
    assert [(r.planned, r.iteration) for r in run.restarts] == [(True, "2")]
    assert harness.result(nb) == reference


def test_the_planned_restart_is_reported_once_as_planned(tmp_path):
    """One marker, saying planned (not "the kernel died"), with the iteration in the restart log."""
    nb = harness.load("resume_planned.ipynb", tmp_path, plan="2")
    run = harness.run(nb, tmp_path, standby=False)
    text = cell_out(nb, "train")
    assert text.count("planned restart after 2 safe points") == 1, text
    assert "colab_resilience: planned restart after 2 safe points; restarted it, replayed 3 cells and resumed at iteration 2" in text
    assert "the kernel died" not in text and "restarting the kernel" not in text
    log = nb.metadata["colab_resilience"]["restarts"]
    assert [(r["planned"], r["iteration"], r["reason"]) for r in log] == [(True, "2", "planned restart after 2 safe points")]
    assert run.status == 0


def test_a_cells_max_restarts_governs_its_run_under_the_driver(tmp_path, tmp_path_factory):
    """Two kills in a run whose cell allows 2 restarts, under a driver allowing 1 for the notebook:
    the cell's budget governs (it used to be the driver's), and the run ends bit-identical."""
    from colab_resilience import driver

    reference = twin(tmp_path_factory, "resume_nested.ipynb")
    nb = harness.load("resume_nested.ipynb", tmp_path, fault="sigkill", fault_epoch=[0, 1], max_restarts=2)
    run = harness.run(nb, tmp_path, standby=False, max_restarts=1)
    assert run.status == driver.EXIT_OK, run.message
    assert len(run.restarts) == 2
    assert harness.result(nb) == reference


def test_a_spent_run_budget_names_the_run_and_how_to_raise_it(tmp_path):
    """The same two kills with --max-restarts 1: exit status 3, and the message is the run's
    budget report (which restarts, and --max-restarts to raise it), written when the second death
    is counted, before any new kernel is started for it."""
    from colab_resilience import driver

    nb = harness.load("resume_nested.ipynb", tmp_path, fault="sigkill", fault_epoch=[0, 1], max_restarts=1)
    run = harness.run(nb, tmp_path, standby=False, max_restarts=5)
    assert run.status == driver.EXIT_BUDGET
    assert "failed: restart budget spent (1/1 restarts) and the kernel died again (killed by SIGKILL)" in run.message
    assert "raise --max-restarts" in run.message
    assert len(run.restarts) == 1


def test_a_death_outside_any_run_spends_the_notebooks_budget_and_says_so(tmp_path):
    """A kill in a plain cell after the training: the notebook's budget (0 here) applies, and the
    message says that it was the notebook's, and how to raise it."""
    from colab_resilience import driver

    nb = harness.load("train.ipynb", tmp_path, fault="sigkill", fault_epoch="result")
    run = harness.run(nb, tmp_path, standby=False, max_restarts=0)
    assert run.status == driver.EXIT_BUDGET
    assert run.message.startswith("colab-resilience: restart budget of the notebook spent (0/0 restarts of a kernel "
                                  "outside any %%resilient run; raise it with --max-restarts)")


def test_a_sigkill_is_not_blamed_on_the_oom_killer_without_evidence(tmp_path):
    """The OS counted no out-of-memory kill: the marker says "killed by SIGKILL", nothing more."""
    nb = harness.load("resume_nested.ipynb", tmp_path, fault="sigkill")
    run = harness.run(nb, tmp_path, standby=False)
    assert [r.reason for r in run.restarts] == ["killed by SIGKILL"]
    assert "out-of-memory killer" not in cell_out(nb, "train")


def test_the_oom_killer_is_named_only_with_the_oss_count():
    from colab_resilience.deaths import death_reason

    assert death_reason(-9) == "killed by SIGKILL"
    assert death_reason(-9, oom_killed=True) == "killed by SIGKILL (the OS out-of-memory killer)"
    assert death_reason(-15, oom_killed=True) == "killed by SIGTERM"
    assert death_reason(75) == "it asked for a restart"


# -- in a shell: line magics in the cell, ordinary errors, the lint ----------------------------------------


def test_resilience_commands_that_would_pull_the_run_away_are_refused_inside_its_cell(ip, tmp_path):
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    for command in ("reset", "resume", f"dir {tmp_path / 'other'}"):
        with pytest.raises(UsageError) as info:
            ip.run_cell_magic("resilient", "", f"%resilience {command}\n")
        assert "not while the %%resilient cell of run" in str(info.value), command
    assert not (tmp_path / "other").exists()
    assert list((tmp_path / "runs").glob("run-*/journal.json"))  # nothing was reset


def test_an_ordinary_error_raised_while_handling_an_oom_is_not_retried(ip, tmp_path):
    """`except OutOfMemoryError: raise ValueError(...)` is a ValueError: no retry, no shrink.
    (It used to be retried with a shrunk batch.)"""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("import torch\nbatch_size = 64\ntries = []")
    r = ip.run_cell("%%resilient --shrink batch_size\ntries.append(batch_size)\ntry:\n"
                    "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n"
                    "except torch.OutOfMemoryError:\n    raise ValueError('batch_size must be a power of two')\n")
    assert isinstance(r.error_in_exec, ValueError)
    assert ip.user_ns["tries"] == [64] and ip.user_ns["batch_size"] == 64


def test_the_first_run_of_a_cell_names_what_would_make_a_resume_differ(ip, tmp_path, capsys):
    """One line each: a name the loop carries without --save, a name set in the loop and read after
    it, gradients accumulated across iterations."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("import torch\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "total = 0.0")
    capsys.readouterr()
    r = ip.run_cell(
        "%%resilient --save model,opt\n"
        "for step in resume_range(4):\n"
        "    loss = model(torch.ones(1, 2)).sum()\n"
        "    loss.backward()\n"
        "    total += loss.item()\n"
        "    if step % 2 == 1:\n"
        "        opt.step(); opt.zero_grad()\n"
        "print(loss)\n")
    assert r.success, r.error_in_exec
    out = capsys.readouterr().out
    assert "the resume_range loop carries total from one iteration to the next without --save" in out
    assert "read after it" not in out  # a small loss is kept with each checkpoint
    assert "gradients accumulate across resume_range iterations" in out


def said_at_first_run(ip, tmp_path, capsys, replay: str, cell: str) -> str:
    """What a %%resilient ``cell`` prints at its first run, after the %%replay cell ``replay``."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\n" + replay)
    capsys.readouterr()
    r = ip.run_cell(cell)
    assert r.success, r.error_in_exec
    return capsys.readouterr().out


def says_nothing(ip, capsys, cell: str) -> None:
    """The %%resilient ``cell`` runs and this package says nothing of it."""
    r = ip.run_cell(cell)
    assert r.success, r.error_in_exec
    out = capsys.readouterr().out
    assert "colab_resilience: " not in out, out


def test_saved_tensors_that_keep_their_steps_graph_are_named_once(ip, tmp_path, capsys):
    """``history.append(loss)`` where ``loss.item()`` was meant: each loss keeps its step's
    activations alive (memory that grows every epoch: a common way for a notebook to run out of
    it), and a checkpoint cannot keep the graph (the tensors came back as leaves that require a
    gradient, and printed otherwise; found by a probe, nothing said so). The first safe point that
    finds one says so in one line; ``loss.item()`` is not named, nor a model's parameters."""
    out = said_at_first_run(
        ip, tmp_path, capsys,
        "import torch\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "history, best = [], {'loss': None}",
        "%%resilient --save model,opt,history,best\nfor epoch in resume_range(3):\n"
        "    loss = model(torch.ones(1, 2)).sum()\n    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    history.append(loss)\n    best['loss'] = loss.item()\n")
    line = ("colab_resilience: history holds tensors that keep the autograd graph of their step (history.append(loss) "
            "where loss.item() was meant): each keeps that step's activations in memory, which grows every step until "
            "it runs out, and no checkpoint holds a graph (a resumed run has it back without it); keep loss.item() or "
            "loss.detach() instead\n")
    assert out.count(line) == 1 and out.count("autograd graph") == 1, out
    ip.run_line_magic("resilience", "reset")
    ip.run_cell("%%replay\nhistory = []")
    capsys.readouterr()
    says_nothing(ip, capsys, "%%resilient --save model,opt,history\nfor epoch in resume_range(3):\n"
                 "    loss = model(torch.ones(1, 2)).sum()\n    opt.zero_grad(); loss.backward(); opt.step()\n"
                 "    history.append(loss.item())\n")


def test_a_progress_bar_and_a_display_handle_the_cell_makes_above_its_loop_are_not_named_as_carried(
        ip, tmp_path, capsys):
    """``pbar = tqdm(total=n)`` above the loop, ``pbar.update(1)`` in it (a display handle's
    ``update`` too): the first run named them as carried ('add them to --save'; a progress bar
    cannot be saved). Made by the cell, they did not exist when it began: they are judged by their
    values when the loop starts, as those made before the cell are. A list made there and appended
    to in the loop is still named, and only once."""
    out = said_at_first_run(
        ip, tmp_path, capsys, "from tqdm.auto import tqdm\nfrom IPython.display import display\nhist = []",
        "%%resilient --save hist\n"
        "pbar = tqdm(total=3, disable=True)\n"
        "shown = display('starting', display_id=True)\n"
        "seen = []\n"
        "for e in resume_range(3):\n"
        "    hist.append(e)\n"
        "    seen.append(e)\n"
        "    pbar.update(1)\n"
        "    shown.update(f'epoch {e}')\n")
    said = [line for line in out.splitlines() if line.startswith("colab_resilience: ")]
    assert said == [line for line in said if "carries" not in line] + [
        "colab_resilience: the resume_range loop carries seen from one iteration to the next without --save: after a "
        "rollback or a restart it would not have its value at the safe point, and the result would differ; add it "
        "to --save"], out


def test_the_first_run_names_a_list_shuffled_in_place_and_a_functions_carried_locals(ip, tmp_path, capsys):
    """``random.shuffle(data)`` and ``rng.shuffle(idx)`` change the list and the array each epoch,
    ``stats['train']['steps'] += 1`` and ``stats['seen']['ids'].append(epoch)`` a nested dict:
    carried, unsaved, they are named (before, nothing was said of any). A train() that a %%replay cell defines and the cell calls runs
    the loop: the early stopping's best and bad, locals of train(), are named as what no checkpoint
    can hold (before, nothing was said, and a resume started them afresh); declared global and
    saved, nothing is said."""
    replay = ("import random, numpy as np, torch\nmodel = torch.nn.Linear(2, 1)\n"
              "data, idx, rng = list(range(8)), np.arange(8), np.random.default_rng(0)\n"
              "def train(epochs):\n    best, bad = float('inf'), 0\n"
              "    for epoch in resume_range(epochs):\n"
              "        loss = model(torch.ones(1, 2)).sum().item() + epoch\n"
              "        if loss < best:\n            best, bad = loss, 0\n        else:\n            bad += 1\n"
              "    return best")
    out = said_at_first_run(ip, tmp_path, capsys, replay + "\nstats = {'train': {'steps': 0}, 'seen': {'ids': []}}",
                            "%%resilient --save model,rng\nfor epoch in resume_range(2):\n"
                            "    random.shuffle(data)\n    rng.shuffle(idx)\n"
                            "    stats['train']['steps'] += 1\n    stats['seen']['ids'].append(epoch)\n")
    assert ("colab_resilience: the resume_range loop carries data, idx, stats from one iteration to the next "
            "without --save") in out, out
    capsys.readouterr()
    r = ip.run_cell("%%resilient --save model\nout = train(3)")
    assert r.success, r.error_in_exec
    out = capsys.readouterr().out
    assert ("colab_resilience: the resume_range loop in train() carries bad, best, locals of train(), from one "
            "iteration to the next: no checkpoint can hold a function's locals") in out, out
    assert "declare them global in train() and add them to --save, or run the loop in the cell" in out, out
    ip.run_cell("%%replay\n" + replay.replace("def train(epochs):\n", "def train(epochs):\n    global best, bad\n"))
    capsys.readouterr()
    says_nothing(ip, capsys, "%%resilient --save model,best,bad\nout = train(3)")


def test_the_first_run_names_what_the_notebooks_functions_the_loop_calls_change(ip, tmp_path, capsys):
    """``tick()`` (``global steps; steps += 1``) and ``log(v)`` (``history.append(v)``), defined by a
    %%replay cell and called in the loop: they carry steps and history from one iteration to the
    next, and unsaved they are named (before, what a helper changed was not seen). Saved, nothing
    is said; a library's function the loop calls is not read."""
    replay = ("import torch\nmodel = torch.nn.Linear(2, 1)\nhistory, steps = [], 0\n"
              "def tick():\n    global steps\n    steps += 1\n"
              "def log(v):\n    seen = []\n    seen.append(v)\n    history.append(v)\n")
    loop = "for epoch in resume_range(2):\n    tick()\n    log(epoch)\n    torch.manual_seed(epoch)\n"
    out = said_at_first_run(ip, tmp_path, capsys, replay, "%%resilient --save model\n" + loop)
    assert ("colab_resilience: the resume_range loop carries steps, history from one iteration to the next "
            "without --save") in out, out
    says_nothing(ip, capsys, "%%resilient --save model,steps,history\n" + loop)



def test_the_first_run_names_state_kept_in_functions_and_class_attributes(ip, tmp_path, capsys):
    """A counter made by a factory (``nonlocal n; n += 1``), a default argument a function changes
    (``def record(v, hist=[]): hist.append(v)``) and a class's attributes the loop changes
    (``Cfg.step += 1``): no checkpoint holds any of them, a resume started them afresh, and
    nothing was said (the class was named as carried, to be added to --save, which saves a class
    by its name: it came back with its replayed attributes). Each is named, with what to do; a
    class in --save is refused in one line. A function with an immutable default, or its own
    list, is not named."""
    replay = ("import torch\nmodel = torch.nn.Linear(2, 1)\n"
              "def make_counter():\n    n = 0\n    def inc():\n        nonlocal n\n        n += 1\n"
              "        return n\n    return inc\ntick = make_counter()\n"
              "def record(v, hist=[], *, seen={}):\n    hist.append(v)\n    seen[v] = 1\n    return len(hist)\n"
              "def scale(v, by=2, out=None):\n    out = []\n    out.append(v * by)\n    return out\n"
              "class Cfg:\n    step = 0\n")
    loop = ("for epoch in resume_range(2):\n    tick()\n    record(epoch)\n    scale(epoch)\n"
            "    Cfg.step += 1\n")
    out = said_at_first_run(ip, tmp_path, capsys, replay, "%%resilient --save model\n" + loop)
    assert ("colab_resilience: the resume_range loop calls tick(), which keeps n (nonlocal), record(), which "
            "keeps hist (a default argument it changes), seen (a default argument it changes): no checkpoint holds "
            "what a function keeps between calls") in out, out
    assert "scale()" not in out, out
    assert ("colab_resilience: the resume_range loop changes attributes of the class Cfg: a checkpoint saves a "
            "class by its name, not its attributes") in out, out
    assert "keep them in an object of the class (cfg = Cfg()) and add that to --save" in out, out
    assert "carries Cfg" not in out, out
    r = ip.run_cell("%%resilient --save model,Cfg\n" + loop)
    message = str(r.error_in_exec)
    assert not r.success and "\n" not in message, message
    assert message.startswith("colab_resilience: cannot save 'Cfg': type objects cannot be checkpointed (a class "
                              "is saved by its name, not by its attributes"), message





def test_the_first_run_reads_the_loop_of_a_method_the_cell_calls(ip, tmp_path, capsys):
    """``stopped = trainer.fit(40)``, the loop in a method of the notebook's Trainer: its early
    stopping's locals (best, bad) and, with ``trainer`` not saved, what it changes on ``self``
    (a step count, a history) went unnamed (only functions called by name were read), and a kill
    or an OOM ended done another run (found by a probe: stopped 15 for 14). Each is named, with
    what to do; with ``trainer`` saved and the counters on ``self``, nothing is said."""
    replay = ("import torch\nmodel = torch.nn.Linear(2, 1)\n"
              "class Trainer:\n    def __init__(self):\n        self.steps, self.history = 0, []\n"
              "    def fit(self, epochs):\n        best, bad = float('inf'), 0\n"
              "        for epoch in resume_range(epochs):\n            loss = model(torch.ones(1, 2)).sum().item()\n"
              "            self.steps += 1\n            self.history.append(loss)\n"
              "            if loss < best:\n                best, bad = loss, 0\n            else:\n                bad += 1\n"
              "        return bad\n"
              "    def fit2(self, epochs):\n        for epoch in resume_range(epochs):\n            self.steps += 1\n"
              "trainer = Trainer()")
    out = said_at_first_run(ip, tmp_path, capsys, replay, "%%resilient --save model\nstopped = trainer.fit(2)")
    assert ("colab_resilience: the resume_range loop in fit() carries bad, best, locals of fit(), from one iteration "
            "to the next") in out, out
    assert "keep them on the object (self.bad = ...) and add trainer to --save" in out, out
    assert ("colab_resilience: the resume_range loop in fit() changes attributes of trainer (self) without --save"
            in out), out
    from colab_resilience import lint

    # (not run here: a class of this test shell's namespace is not one pickle finds in __main__)
    assert lint.warnings(ip, "trainer.fit2(2)", ["model", "trainer"], [replay]) == []


def test_the_first_run_names_a_saved_model_and_optimizer_no_set_up_cell_builds(ip):
    """A model and its optimizer in --save, made by a cell that is not %%replay: their state goes
    into what a set-up cell builds after a restart, and nothing would build them (the resume
    stops until they are built again: test_restart). Named at the first run; built by a set-up
    cell, or by the cell itself, nothing is said."""
    import torch

    from colab_resilience import lint

    model = torch.nn.Linear(2, 1)
    ip.user_ns.update(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1), history=[])
    body = "for epoch in resume_range(2):\n    opt.step()\n    history.append(epoch)\n"
    lines = [line for line in lint.warnings(ip, body, ["model", "opt", "history"], []) if "--save model" in line]
    assert lines == [
        "colab_resilience: --save model, opt: a checkpoint holds the state of model (a Linear), opt (an SGD), which a "
        "resume after a restart loads into what a %%replay cell builds, but no %%replay cell builds them (a cell that "
        "is not %%replay did): make them in a %%replay cell, or a resume after a restart stops until they are built "
        "again"]
    setup = "%%replay\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)"
    assert not [line for line in lint.warnings(ip, body, ["model", "opt"], [setup]) if "holds the state of" in line]
    built = "model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + body
    assert not [line for line in lint.warnings(ip, built, ["model", "opt"], []) if "holds the state of" in line]


def test_the_first_run_names_a_data_loader_whose_workers_persist(ip, tmp_path, capsys):
    """A DataLoader with ``persistent_workers=True`` keeps its worker processes, and their random
    state (a dataset's augmentation), from epoch to epoch: after a kill the new kernel's workers
    were seeded anew, after an OOM the workers went on from the failed attempt's draws, and the
    run said done with other weights (found by a probe). Named at the first run, made in a set-up
    cell or in the cell; one whose workers end with each epoch is not."""
    replay = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
              "ds = TensorDataset(torch.randn(8, 2))\nmodel = torch.nn.Linear(2, 1)\n"
              "kept = DataLoader(ds, batch_size=4, num_workers=1, persistent_workers=True)\n"
              "plain = DataLoader(ds, batch_size=4, num_workers=1)")
    body = "for epoch in resume_range(1):\n    for (x,) in LOADER:\n        model(x)\n"
    out = said_at_first_run(ip, tmp_path, capsys, replay, "%%resilient --save model\n" + body.replace("LOADER", "kept"))
    assert ("colab_resilience: the resume_range loop draws from kept, a DataLoader with persistent_workers=True: its "
            "worker processes keep their random state from epoch to epoch") in out, out
    says_nothing(ip, capsys, "%%resilient --save model\n" + body.replace("LOADER", "plain"))
    r = ip.run_cell("%%resilient --save model\nmine = DataLoader(ds, batch_size=4, num_workers=1, persistent_workers=True)\n"
                    + body.replace("LOADER", "resume_range(mine)").replace("for (x,) in resume_range(mine)", "for (x,) in mine"))
    assert r.success, r.error_in_exec
    assert "draws from mine, a DataLoader with persistent_workers=True" in capsys.readouterr().out


def test_the_first_run_names_a_data_loader_that_draws_its_order_from_an_unsaved_generator(ip, tmp_path, capsys):
    """``DataLoader(..., shuffle=True, generator=g)``: each epoch's order is drawn from ``g``, which
    goes on from epoch to epoch; without ``g`` in --save an OOM's rollback drew the next order
    from the failed attempt's generator and the run said done with other weights (found by a
    probe). Named at the first run (and a generator no variable holds, with how to name it); with
    ``g`` saved, or drawn from the global generator, nothing is said."""
    replay = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
              "ds = TensorDataset(torch.randn(8, 2))\nmodel = torch.nn.Linear(2, 1)\n"
              "g = torch.Generator().manual_seed(1)\n"
              "own = DataLoader(ds, batch_size=4, shuffle=True, generator=g)\n"
              "anon = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))\n"
              "plain = DataLoader(ds, batch_size=4, shuffle=True)")
    body = "for epoch in resume_range(1):\n    for (x,) in LOADER:\n        model(x)\n"
    out = said_at_first_run(ip, tmp_path, capsys, replay, "%%resilient --save model\n" + body.replace("LOADER", "own"))
    assert ("colab_resilience: the resume_range loop iterates own (its order drawn from g), a generator --save leaves "
            "out: each epoch's order follows from the epochs before it") in out and out.rstrip().endswith(
            "add g to --save"), out
    r = ip.run_cell("%%resilient --save model\n" + body.replace("LOADER", "anon"))
    assert r.success, r.error_in_exec
    out = capsys.readouterr().out
    assert "iterates anon (its order drawn from a Generator no variable holds)" in out, out
    assert "bind the generator to a name (g = torch.Generator().manual_seed(0)" in out, out
    says_nothing(ip, capsys, "%%resilient --save model,g\n" + body.replace("LOADER", "own"))
    says_nothing(ip, capsys, "%%resilient --save model\n" + body.replace("LOADER", "plain"))


def test_the_first_run_names_a_file_the_loop_appends_to_and_the_header_written_above_it(ip, tmp_path, capsys):
    """A CSV log: its header written above the loop (``open(p, 'w')``), a row appended each epoch.
    After a kill the cell ran again from its first line, emptied the file, and the resumed epochs
    wrote the only rows in it; a resume also writes the rows of the iterations since the last safe
    point again (found by a probe). Both named at the first run; a file the loop writes anew each
    epoch (its last state is the uninterrupted one), or a config written above the loop that the
    loop does not append to, is not."""
    log, cfg = str(tmp_path / "log.csv"), str(tmp_path / "cfg.json")
    out = said_at_first_run(ip, tmp_path, capsys, "import torch\nmodel = torch.nn.Linear(2, 1)",
                            "%%resilient --save model\n"
                            f"with open({log!r}, 'w') as f:\n    f.write('epoch,loss\\n')\n"
                            f"open({cfg!r}, 'w').write('{{}}')\n"
                            "for epoch in resume_range(2):\n"
                            f"    with open({log!r}, 'a') as f:\n        f.write(f'{{epoch}}\\n')\n"
                            f"    torch.save(model.state_dict(), {str(tmp_path / 'last.pt')!r})\n"
                            f"    open({str(tmp_path / 'last.txt')!r}, 'w').write(str(epoch))\n")
    lines = [line for line in out.splitlines() if "file" in line]
    assert len(lines) == 2, out
    assert lines[0].startswith("colab_resilience: the resume_range loop appends to '.../log.csv': a checkpoint does "
                               "not hold files"), out
    assert lines[1].startswith("colab_resilience: the code above the first resume_range loop writes '.../log.csv', "
                               "which the loop appends to: it runs again on resume"), out
    assert "cfg.json" not in out and "last.txt" not in out, out


def test_an_alias_of_a_part_of_a_saved_dict_is_not_named_as_carried(ip, tmp_path, capsys):
    """``losses = metrics["loss"]`` above the loop, ``losses.append(...)`` in it, ``metrics`` saved:
    the restore puts the saved lists into the dict's own lists, so the alias holds the restored
    one (the run is exact: test_objects_the_set_up_cells_handed_on...), and the first run named
    it as carried without --save, a false alarm. Not named now; with ``metrics`` not saved, or an
    item picked by a variable, it still is."""
    replay = "import torch\nmodel = torch.nn.Linear(2, 1)\nmetrics = {'loss': [], 'epoch': []}\nkey = 'loss'"
    loop = ("for epoch in resume_range(2):\n    losses.append(model(torch.ones(1, 2)).sum().item())\n"
            "    metrics['epoch'].append(epoch)\n")
    said_at_first_run(ip, tmp_path, capsys, replay, "%%resilient --save model\nfor i in resume_range(1):\n    pass\n")
    says_nothing(ip, capsys, "%%resilient --save model,metrics\nlosses = metrics['loss']\n" + loop)
    for cell in ("%%resilient --save model\nlosses = metrics['loss']\n", "%%resilient --save model,metrics\nlosses = metrics[key]\n"):
        r = ip.run_cell(cell + loop)
        assert r.success, r.error_in_exec
        out = capsys.readouterr().out
        assert "the resume_range loop carries losses" in out, out


def test_the_first_run_names_an_object_of_the_notebooks_class_that_changes_itself(ip, tmp_path, capsys):
    """An EarlyStopping of the notebook's own, called each epoch, changes its best and its counter:
    unsaved, a resume started them afresh and stopped at another epoch, and nothing was said. It is
    named. A logger whose only change is to append to a history list saved under its own name is
    not: the list is restored into itself, and the logger sees it."""
    replay = ("import torch\nmodel = torch.nn.Linear(2, 1)\nhistory = []\n"
              "class EarlyStopping:\n    def __init__(self):\n        self.best, self.counter = None, 0\n"
              "    def __call__(self, val):\n        if self.best is None or val < self.best:\n"
              "            self.best, self.counter = val, 0\n        else:\n            self.counter += 1\n"
              "class Logger:\n    def __init__(self, h):\n        self.h = h\n"
              "    def log(self, v):\n        self.h.append(v)\n"
              "early_stop, logger = EarlyStopping(), Logger(history)")
    out = said_at_first_run(ip, tmp_path, capsys, replay,
                            "%%resilient --save model,history\nfor epoch in resume_range(2):\n"
                            "    early_stop(float(epoch))\n    logger.log(epoch)\n")
    assert ("colab_resilience: the resume_range loop uses early_stop (EarlyStopping) without --save: a state it "
            "changes in place") in out, out
    assert "logger" not in out, out


def test_the_first_run_names_what_early_stopping_carries_though_it_is_set_in_the_loop(ip, tmp_path, capsys):
    """Early stopping as it is written by hand: the best loss and the count of epochs without a
    better one are set inside the loop, but only under an if, and read before: their values come
    from the iteration before (a resume without them stopped at another epoch, and said done).
    They are named at the first run; a name the iteration sets before it reads it on every path
    (the loss of the epoch's last batch, a comprehension's own variable) is not."""
    out = said_at_first_run(ip, tmp_path, capsys,
                            "losses = [5.0, 4.0, 4.5, 4.2, 4.1, 3.0]\nbatches = [[1.0, 2.0], [3.0]]",
                            "%%resilient --save losses\n"
                    "best, bad = float('inf'), 0\n"
                    "for epoch in resume_range(len(losses)):\n"
                    "    for batch in batches:\n"
                    "        last = sum(b * 2 for b in batch)\n"
                    "    scaled = [v * last for v in batch]\n"
                    "    if losses[epoch] < best:\n"
                    "        best, bad = losses[epoch], 0\n"
                    "    else:\n"
                    "        bad += 1\n"
                    "        if bad >= 2:\n"
                    "            break\n")
    assert ("colab_resilience: the resume_range loop carries bad, best from one iteration to the next without "
            "--save") in out, out
    assert "last" not in out and " v," not in out, out


def test_the_first_run_names_the_objects_with_a_state_that_the_loop_uses_without_saving_them(ip, tmp_path, capsys):
    """A scheduler, a torch.Generator and a NumPy Generator the loop uses and --save does not save
    (their step count, their state went on after the safe point: a rollback or a restart gave the
    run other learning rates and other draws, and it said done): named in one line at the first
    run. The saved model, a loss function (no parameters, no state), a name the loop binds itself
    are not; with them in --save, nothing is said of them."""
    cell = ("%%resilient --save model,opt\n"
            "for step in resume_range(3):\n"
            "    x = torch.randn(4, 2, generator=g) * float(rng.random())\n"
            "    loss = loss_fn(model(x), torch.zeros(4, 1))\n"
            "    opt.zero_grad(); loss.backward(); opt.step(); sched.step()\n")
    out = said_at_first_run(ip, tmp_path, capsys, "import numpy as np, torch\nmodel = torch.nn.Linear(2, 1)\n"
                            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                            "sched = torch.optim.lr_scheduler.StepLR(opt, 1)\nloss_fn = torch.nn.MSELoss()\n"
                            "g = torch.Generator().manual_seed(0)\nrng = np.random.default_rng(0)", cell)
    lines = [line for line in out.splitlines() if "without --save: a state it changes in place" in line]
    assert len(lines) == 1, out
    assert lines[0].startswith("colab_resilience: the resume_range loop uses g (Generator), rng (Generator), "
                               "sched (StepLR) without --save"), lines[0]
    r = ip.run_cell(cell.replace("--save model,opt", "--save model,opt,sched,g,rng"))
    assert r.success, r.error_in_exec
    assert "a state it changes in place" not in capsys.readouterr().out


def test_a_model_and_optimizer_saved_in_a_dict_are_not_named_as_unsaved(ip, tmp_path, capsys):
    """``models = {"main": model}`` and ``[opt]`` in --save, the loop using ``model`` and ``opt``: they
    are saved (restored in place, the loop's names see it), and the first run said "the loop uses
    model (Linear) without --save ... the result would differ". A scheduler the containers do not
    hold is still named."""
    cell = ("%%resilient --save models,opts\n"
            "for step in resume_range(3):\n"
            "    loss = model(torch.ones(4, 2)).sum()\n"
            "    opt.zero_grad(); loss.backward(); opt.step(); sched.step()\n")
    out = said_at_first_run(ip, tmp_path, capsys, "import torch\nmodel = torch.nn.Linear(2, 1)\n"
                            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                            "sched = torch.optim.lr_scheduler.StepLR(opt, 1)\n"
                            "models = {'main': model}\nopts = [opt]", cell)
    lines = [line for line in out.splitlines() if "without --save: a state it changes in place" in line]
    assert len(lines) == 1 and lines[0].startswith("colab_resilience: the resume_range loop uses sched (StepLR) "
                                                   "without --save"), out


def own_checkpoint_notebook(mark, after_own_save: bool):
    """A notebook with its own resume: the loop writes ``own.pt`` each epoch, the set-up cell
    loads it where it exists and starts the loop after its epoch. Killed in epoch 4, before it
    wrote the file (which says 3, as the run's checkpoint does) or after (the file says 4, the
    run's checkpoint 3: its safe point is the iteration's end)."""
    kill = ("    if epoch == 4 and not os.path.exists(MARK):\n"
            "        open(MARK, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")
    save = ("    torch.save({'model': model.state_dict(), 'opt': opt.state_dict(), 'epoch': epoch, "
            "'history': history}, 'own.pt')\n")
    return harness.notebook(
        "%load_ext colab_resilience",
        f"%%replay\nMARK = {str(mark)!r}\n" + harness.OWN_CHECKPOINT_SETUP,
        "%%resilient --save model,opt,history\nfor epoch in resume_range(start_epoch, 6):\n"
        "    for i in range(0, 64, 16):\n        loss = ((model(X[i:i + 16]) - Y[i:i + 16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    history.append(loss.item())\n" + (save + kill if after_own_save else kill + save),
        "print('RESULT', history, model.weight.detach().numpy().tobytes().hex())")


@pytest.mark.parametrize("after_own_save", [False, True], ids=["before-its-own-save", "after-its-own-save"])
@pytest.mark.one_stack("colab")
def test_a_loop_whose_start_the_set_up_reads_from_the_notebooks_own_checkpoint_goes_on_by_its_numbers(
        tmp_path, after_own_save):
    """The notebook resumes by itself too: its set-up cell loads the file its loop wrote and starts
    ``resume_range(start_epoch, 6)`` after that file's epoch. Killed in epoch 4, the new kernel's
    loop was resume_range(4, 6) or (5, 6) and the position counted 4 iterations: past its end,
    "the loop had finished", and the run ended "done" with 4 epochs of 6 trained, or 5 with one
    skipped (found by a probe). The range a checkpoint was taken in goes with it, and a resumed
    loop goes on by its numbers: at 4, the one the run went on with, bit for bit the twin's, and
    with no line that the start the replay read differs (a position holds it). Where the file is
    ahead of the run's checkpoint (no 4 in resume_range(5, 6)), the run stops, pending, in one
    line that says why and what to do."""
    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "m").touch()
    twin = own_checkpoint_notebook(tmp_path / "twin" / "m", after_own_save)
    harness.uninterrupted_ok(harness.run(twin, tmp_path / "twin", standby=False))
    assert len(json.loads(harness.result(twin).split(" ", 1)[1].rsplit(" ", 1)[0])) == 6
    nb = own_checkpoint_notebook(tmp_path / "m", after_own_save)
    run = harness.run(nb, tmp_path, standby=False)
    text = harness.cell_text(nb.cells[2])
    if not after_own_save:
        assert run.status == 0, run.message
        assert "continuing at 4" in text and "start_epoch" not in text, text
        assert harness.result(nb) == harness.result(twin)
        return
    assert run.status != 0, harness.result(nb)
    line = ("its checkpoint was taken in resume_range(0, 6) after 0 to 3 had run (4 next), but the loop is now "
            "resume_range(5, 6), which has no 4: going on would skip iterations that never ran, or run some twice. "
            "Its bounds come from something else now (a start the set-up cells read from a checkpoint file of the "
            "notebook's own, written after the run's last checkpoint: resume_range resumes by itself); make it the "
            "loop the run began with, or run `colab-resilience reset ")  # (a supervised run: the command's words)
    assert line in run.message, run.message
    assert run.message.endswith(f" --run-dir {tmp_path / 'runs'}` to start the run afresh"), run.message
    assert "stays pending" in text, text


def test_a_loops_start_a_plain_cell_changed_is_named_when_the_run_begins(ip, tmp_path, capsys):
    """A start read only as a loop's start is not compared after a restart (the loop goes on by its
    numbers, or stops the run); changed by a plain cell after the %%replay cells ran, it is still
    named when the run begins: a resume after a restart would have the replay's."""
    cell = "%%resilient --save done\nfor e in resume_range(first, 4):\n    done.append(e)\n"
    out = said_at_first_run(ip, tmp_path, capsys, "first = 0\ndone = []", cell)
    assert "changed since the %%replay cells ran" not in out, out
    ip.run_cell("first = 1")  # a plain cell
    capsys.readouterr()
    r = ip.run_cell(cell)
    assert r.success, r.error_in_exec
    assert ("colab_resilience: first changed since the %%replay cells ran (in a cell that is not replayed, or in an "
            "earlier run), and the training reads them") in capsys.readouterr().out


def test_a_retry_whose_loop_goes_over_other_numbers_goes_on_by_them_or_stops(ip, tmp_path, capsys):
    """In the kernel too: the failed attempt changed the start its loop reads (not saved). Over
    1 to 3 where the checkpoint was taken after 0, 1 (2 next), the retry goes on at 2 and ends as
    uninterrupted; over 3 alone it would skip 2: it stops, pending, its saved history as at the
    safe point, also in a cell with --shrink. A loop over ``range(0, n, batch_size)`` with
    --shrink changes its step with the batch on purpose: it goes on at its iteration, and says
    what ran before ran with the old one."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\nimport torch\nfired = [False]\noffset = 0\nhist = []\nbs = 4\nrows = []")
    cell = ("%%resilient --save hist\nfor epoch in resume_range(offset, 4):\n    hist.append(epoch)\n"
            "    if epoch == 2 and not fired[0]:\n        fired[0] = True\n        offset = {offset}\n"
            "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n")
    r = ip.run_cell(cell.format(offset=1))
    assert r.success, r.error_in_exec
    assert ip.user_ns["hist"] == [0, 1, 2, 3]
    ip.user_ns.update(fired=[False], offset=0, hist=[])
    r = ip.run_cell(cell.format(offset=3))
    assert not r.success and ("its checkpoint was taken in resume_range(0, 4) after 0, 1 had run (2 next), but the "
                              "loop is now resume_range(3, 4), which has no 2: going on would skip iterations that "
                              "never ran, or run some twice") in str(r.error_in_exec), r.error_in_exec
    assert ip.user_ns["hist"] == [0, 1]
    ip.run_line_magic("resilience", "reset")
    ip.user_ns.update(fired=[False], offset=0, hist=[])  # with --shrink too: its start is not its batch
    r = ip.run_cell(cell.replace("--save hist", "--save hist --shrink bs").format(offset=3))
    assert not r.success and "but the loop is now resume_range(3, 4), which has no 2" in str(r.error_in_exec)
    ip.run_line_magic("resilience", "reset")
    ip.user_ns.update(fired=[False], bs=4)
    capsys.readouterr()
    r = ip.run_cell("%%resilient --save rows --shrink bs\nfor i in resume_range(0, 16, bs):\n    rows.append((i, bs))\n"
                    "    if i == 8 and not fired[0]:\n        fired[0] = True\n"
                    "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n")
    assert r.success, r.error_in_exec
    assert "continuing at 4 with bs 2 (what ran before it ran with bs 4)" in capsys.readouterr().out
    assert ip.user_ns["rows"][:2] == [(0, 4), (4, 4)]


def test_an_outer_loop_over_other_numbers_goes_on_with_its_iteration_in_progress(ip, tmp_path):
    """Nested resume_range loops, the outer one's start changed by the failed attempt (not saved):
    the checkpoint was taken in epoch 1 (0 done), at step 2; over 1 to 3 the retry goes on in
    epoch 1 at step 2, as uninterrupted; over 2 to 3 it would skip what is left of epoch 1, and
    the run stops."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\nimport torch\nfired = [False]\nfirst = 0\nseen = []")
    cell = ("%%resilient --save seen\nfor epoch in resume_range(first, 3):\n    for step in resume_range(4):\n"
            "        seen.append((epoch, step))\n"
            "        if (epoch, step) == (1, 2) and not fired[0]:\n            fired[0] = True\n            first = {first}\n"
            "            raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n")
    r = ip.run_cell(cell.format(first=1))
    assert r.success, r.error_in_exec
    assert ip.user_ns["seen"] == [(e, s) for e in range(3) for s in range(4)]
    ip.run_line_magic("resilience", "reset")
    ip.user_ns.update(fired=[False], first=0, seen=[])
    r = ip.run_cell(cell.format(first=2))
    assert not r.success and ("its checkpoint was taken in resume_range(0, 3) after 0 had run (1 in progress), but "
                              "the loop is now resume_range(2, 3), which has no 1") in str(r.error_in_exec), r.error_in_exec


def test_a_retry_runs_the_code_above_the_first_loop_on_the_saved_values_the_cell_began_with(ip, tmp_path, capsys):
    """The code above the first loop reads a saved history: a scale derived from its length, the
    loop's start (``resume_range(len(history), 5)``). A retry in the kernel ran that code on the
    history the failed attempt had grown (a scale of 1/8, the loop over 3 to 4), then restored the
    safe point's at the loop: the run said "continuing at 2" and ended "done" with
    [0, 1, 0.25, 0.375, 0.5] for [0, 1, 2, 3, 4] (found by a probe). The small saved values (plain
    data, numbers, small tensors) are put back as the first attempt began with them, in the same
    objects, as the random state is: the uninterrupted result; a shrunk --shrink value stays shrunk."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\nimport torch\nfired = [False]\nhistory = []\nlog = {'seen': []}\nbs = 8")
    logger = ip.user_ns["log"]
    r = ip.run_cell("%%resilient --save history,log --shrink bs\n"
                    "scale = 0.5 ** len(history)\n"
                    "for epoch in resume_range(len(log['seen']), 5):\n"
                    "    history.append(epoch * scale)\n"
                    "    log['seen'].append((epoch, bs))\n"
                    "    if epoch == 2 and not fired[0]:\n"
                    "        fired[0] = True\n"
                    "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')\n")
    assert r.success, r.error_in_exec
    assert "continuing at 2 with bs 4" in capsys.readouterr().out
    assert ip.user_ns["history"] == [0, 1, 2, 3, 4]
    assert ip.user_ns["log"] is logger and logger["seen"] == [(0, 8), (1, 8), (2, 4), (3, 4), (4, 4)]


def test_the_first_run_names_a_training_loop_with_no_safe_point_inside_it(ip, tmp_path, capsys):
    """The first %%resilient cell people write wraps the loop they had: ``for epoch in range(n)``.
    It has no safe point inside, so a restart (or an OOM retry) runs the whole cell again and every
    epoch trains again, and nothing said so (found by a probe: killed in epoch 5 of 6, it trained
    all 6 again, identical, without a word). One line at the first run names the loop and writes it
    with resume_range: the cell's own (its largest, not one that sets something up), one in a
    progress bar, a while loop, one in a notebook function the cell calls; without --save it says
    to save the model too. Nothing where the cell's loop, or one a function it calls runs two calls
    deep, or a method a notebook class inherits, is a resume_range, nor with --shrink (run whole
    again with a smaller batch: the quickstart's shape), nor for a cell without a loop."""
    from colab_resilience import lint

    out = said_at_first_run(
        ip, tmp_path, capsys,
        "import torch\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "def fit(epochs):\n    for epoch in range(epochs):\n        opt.step()\n"
        "def epoch_loop(n):\n    for e in resume_range(n):\n        opt.step()\n"
        "def main():\n    epoch_loop(2)\n"
        "class Base:\n    def fit(self, n):\n        for e in resume_range(n):\n            opt.step()\n"
        "class Trainer(Base):\n    pass\ntrainer = Trainer()\n"
        "def tqdm(iterable, **kw):\n    return iterable",
        "%%resilient --save model,opt\n"
        "for p in model.parameters():\n    p.requires_grad_(True)\n"
        "for epoch in range(2):\n    for i in range(3):\n        opt.step()\n")
    assert ("colab_resilience: the loop (for epoch in range(2)) has no safe point inside it: after a restart or an "
            "out-of-memory error the cell runs again from its start, and every iteration runs again; to go on after "
            "the last finished one, loop over resume_range: for epoch in resume_range(2)\n") in out, out

    def said(body, saved=("model", "opt"), shrink=()):
        return [line for line in lint.warnings(ip, body, list(saved), [], shrink=shrink) if "no safe point" in line]

    assert said("for epoch in tqdm(range(1, 9, 2), leave=False):\n    opt.step()") == [
        "colab_resilience: the loop (for epoch in tqdm(range(1, 9, 2), leave=False)) has no safe point inside it: "
        "after a restart or an out-of-memory error the cell runs again from its start, and every iteration runs "
        "again; to go on after the last finished one, loop over resume_range: "
        "for epoch in tqdm(resume_range(1, 9, 2), leave=False)"]
    [line] = said("for x, y in enumerate(batches):\n    opt.step()", saved=())
    assert line.endswith("loop over resume_range: for x, y in resume_range(enumerate(batches)), and --save what it "
                         "trains (the model, the optimizer)"), line
    [line] = said("epoch = 0\nwhile epoch < 3:\n    opt.step()\n    epoch += 1")
    assert line.startswith("colab_resilience: the loop (while epoch < 3) has no safe point inside it") and line.endswith(
        "write it as a for loop over resume_range (for epoch in resume_range(n))"), line
    assert said("fit(3)") == [
        "colab_resilience: the loop in fit() (for epoch in range(epochs)) has no safe point inside it: after a restart "
        "or an out-of-memory error the cell runs again from its start, and every iteration runs again; to go on "
        "after the last finished one, loop over resume_range in fit(): for epoch in resume_range(epochs)"]
    assert said("main()") == said("for epoch in resume_range(2):\n    opt.step()") == said("trainer.fit(2)") == []
    assert said("for epoch in range(2):\n    opt.step()", shrink=["batch_size"]) == []
    assert said("opt.step()") == said("loss = model(torch.ones(1, 2)).sum()") == []


@pytest.mark.one_stack("colab")
def test_a_plain_loop_killed_in_its_third_epoch_trains_every_epoch_again_as_its_first_line_said(tmp_path):
    """What the line of a loop with no safe point says, in a real kernel: killed in epoch 2 of 4, the
    new kernel runs the cell from its start (the first checkpoint's model and random state) and
    trains epochs 0 to 3 again; the result is bit for bit the uninterrupted one's. (What the dead
    kernel printed last may not have left it: its epochs are not counted.)"""
    def notebook(mark):
        return harness.notebook(
            "%load_ext colab_resilience",
            f"%%replay\nimport os, signal, torch\nMARK = {str(mark)!r}\ntorch.manual_seed(0)\n"
            "X, Y = torch.randn(64, 4), torch.randn(64, 1)\nmodel = torch.nn.Linear(4, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.05)",
            "%%resilient --save model,opt,losses\nlosses = []\nfor epoch in range(4):\n"
            "    for i in range(0, 64, 16):\n        noise = 0.01 * torch.randn(16, 1)\n"
            "        loss = ((model(X[i:i + 16]) - Y[i:i + 16] - noise) ** 2).mean()\n"
            "        opt.zero_grad(); loss.backward(); opt.step()\n"
            "    print('epoch', epoch)\n    losses.append(loss.item())\n"
            "    if epoch == 2 and not os.path.exists(MARK):\n"
            "        open(MARK, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)",
            "print('RESULT', losses, model.weight.detach().numpy().tobytes().hex())")

    run, nb, twin = harness.faulted_and_twin(tmp_path, notebook)
    assert len(run.restarts) == 1
    text = harness.cell_text(nb.cells[2])
    assert "colab_resilience: the loop (for epoch in range(4)) has no safe point inside it" in text, text
    after = text.split("; running the cell again\n", 1)[1]  # the kernel that took over (the mark: it died in epoch 2)
    assert [line for line in after.splitlines() if line.startswith("epoch")] == [f"epoch {e}" for e in range(4)], text
    assert harness.result(nb) == harness.result(twin)


def test_the_first_run_names_a_resume_range_loop_that_something_around_it_would_start_over(ip, tmp_path, capsys):
    """A resume_range loop inside a plain for loop (after a restart the epoch starts over at 0, the
    inner loop goes on at its saved step: the run went on in the wrong epoch and said done), or
    wrapped in enumerate (which counts from 0 again): one line each, said at the first run. A
    loop wrapped in enumerate or a progress bar is still a resume_range loop for the other checks
    (the names it carries); the forms that resume exactly say nothing."""
    out = said_at_first_run(ip, tmp_path, capsys,
                            "items = [1.0, 2.0, 3.0]\ntotal = 0.0\nsteps = 0\ndef tqdm(iterable):\n    return iterable",
                            "%%resilient --save items\n"
                            "for epoch in range(2):\n"
                            "    for i, x in enumerate(resume_range(items)):\n"
                            "        total += i * x\n")
    assert ("a resume_range loop runs inside a plain for or while loop: after a rollback or a restart the plain "
            "loop starts over while resume_range goes on at its saved step") in out, out
    assert "enumerate(resume_range(...)) starts over after a rollback or a restart" in out, out
    assert "put it inside: resume_range(enumerate(...))" in out, out
    assert "the resume_range loop carries total from one iteration to the next without --save" in out, out
    r = ip.run_cell("%%resilient --save items\nfor epoch in tqdm(resume_range(2)):\n    steps += 1\n")
    assert r.success, r.error_in_exec
    out = capsys.readouterr().out
    assert "the resume_range loop carries steps from one iteration to the next without --save" in out, out
    assert "starts over" not in out, out
    says_nothing(ip, capsys, "%%resilient --save items,total\n"
                 "for epoch in tqdm(resume_range(2)):\n"
                 "    for i, x in resume_range(enumerate(items)):\n"
                 "        total += i * x\n")


def test_the_first_run_names_an_iterator_made_before_the_loop_that_it_draws_from_with_next(ip, tmp_path, capsys):
    """`batches = iter(loader)` before the loop, `next(batches)` in it: no checkpoint holds an
    iterator's position (an OOM retry drew the batch after the failed one, a restart started the
    iterator over, and the run said done). Named at the first run, with what resumes exactly;
    an iterator the loop makes itself is not named."""
    out = said_at_first_run(ip, tmp_path, capsys, "data = [1.0, 2.0, 3.0, 4.0]\ntotal = [0.0]",
                            "%%resilient --save total\n"
                            "batches = iter(data)\n"
                            "for step in resume_range(2):\n"
                            "    total[0] += next(batches) + next(batches, 0.0)\n")
    lines = [line for line in out.splitlines() if "next()" in line]
    assert lines == ["colab_resilience: the resume_range loop draws from batches with next(), made before it: no "
                     "checkpoint can hold an iterator's position, so after a rollback or a restart it would not be "
                     "where it was at the safe point, and the result would differ; iterate with resume_range "
                     "instead (for batch in resume_range(loader)), or make the iterator inside the loop"], out
    assert "carries" not in out, out  # not told to --save what cannot be saved
    says_nothing(ip, capsys, "%%resilient --save total\n"
                 "for epoch in resume_range(2):\n"
                 "    batches = iter(data)\n"
                 "    total[0] += next(batches)\n")


def test_the_first_run_names_a_dicts_counter_a_tensor_changed_in_place_and_a_scheduler_the_cell_makes(
        ip, tmp_path, capsys):
    """A step counter kept in a dict (`stats["steps"] += 1`), a running mean kept in a tensor by
    its in-place methods (`smooth.mul_(0.9).add_(loss)`), and a OneCycleLR the cell itself makes
    above its loop, none saved: after a restart the cell makes them afresh while the model and the
    optimizer come back at the safe point's, and the run said done with other values and other
    learning rates. The first two are named at the first run, the scheduler once the code above
    the loop has made it (at the loop start). The saved model's own part (`backbone = model[0]`)
    is saved with it, and not named."""
    out = said_at_first_run(ip, tmp_path, capsys,
                            "import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))\n"
                            "backbone = model[0]\nopt = torch.optim.SGD(model.parameters(), lr=0.1)",
                            "%%resilient --save model,opt\n"
                            "stats, smooth = {'steps': 0}, torch.zeros(())\n"
                            "sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=3)\n"
                            "for step in resume_range(3):\n"
                            "    loss = model[1](backbone(torch.ones(1, 2))).sum()\n"
                            "    opt.zero_grad(); loss.backward(); opt.step(); sched.step()\n"
                            "    stats['steps'] += 1\n"
                            "    smooth.mul_(0.9).add_(loss.detach())\n")
    assert ("colab_resilience: the resume_range loop carries stats, smooth from one iteration to the next without "
            "--save") in out, out
    assert "colab_resilience: the resume_range loop uses sched (OneCycleLR) without --save" in out, out
    assert "backbone" not in out, out


def test_what_the_code_above_an_inner_loop_appended_is_not_doubled_by_a_rollback_inside_the_iteration(ip, tmp_path):
    """A saved log that each epoch appends to above its inner loop: an OOM in the inner loop of
    epoch 1 rolls back to its last step; the cell runs again, and the code above the inner loop
    appends epoch 1 a second time to the restored log (`epochs: [0, 1, 1, 2]`), and the run said
    done. Where the inner loop resumes, the lists, dicts and sets restored get the safe point's
    contents again, in the same objects."""
    retried(ip, tmp_path, "import torch\nlog = {'epochs': [], 'steps': []}\nfired = [False]",
            "%%resilient --save log\n"
            "for epoch in resume_range(3):\n"
            "    log['epochs'].append(epoch)\n"
            "    for i in resume_range(4):\n"
            "        log['steps'].append((epoch, i))\n"
            + oom_once("        ", "(epoch, i) == (1, 2)"))
    assert ip.user_ns["log"] == {"epochs": [0, 1, 2], "steps": [(e, i) for e in range(3) for i in range(4)]}


def test_the_first_run_names_a_saved_key_the_code_above_an_inner_loop_splits(ip, tmp_path, capsys):
    """A key split above the inner loop and in it: a resume inside the epoch runs the code above
    again with the inner safe point's key. Named at the first run, with the form that resumes
    exactly; a saved torch.Generator drawn from in both places is not named (its state when the
    iteration began goes with the checkpoint), nor is appending to a saved log there (its
    contents are put back)."""
    out = said_at_first_run(ip, tmp_path, capsys,
                            "import torch\ng = torch.Generator().manual_seed(0)\nkey = [0]\nlog = []",
                            "%%resilient --save g,key,log\n"
                            "for epoch in resume_range(2):\n"
                            "    perm = torch.randperm(4, generator=g)\n"
                            "    key, sub = key + [1], key\n"
                            "    log.append(epoch)\n"
                            "    for i in resume_range(perm.tolist()):\n"
                            "        noise = torch.randn(1, generator=g)\n"
                            "        key = key + [i]\n")
    assert ("colab_resilience: the code above an inner resume_range loop reads key, which the inner loop changes: "
            "a resume inside the iteration runs that code again with the inner safe point's value") in out, out
    assert "jax.random.fold_in(key, epoch)" in out, out


def test_a_method_called_on_a_saved_object_above_an_inner_loop_is_not_named_a_value_read_from_it_is(ip, tmp_path,
                                                                                                     capsys):
    """Above the inner loop: ``model.train()``, ``opts["head"].zero_grad()`` (a method of an
    object, or of one a saved dict holds) change only what a resume inside the epoch puts back whole when
    the inner loop resumes; ``start = model.seen`` keeps what the inner safe point's model holds,
    not what the epoch began with. Only the last is named."""
    out = said_at_first_run(ip, tmp_path, capsys,
                            "import torch\nmodel = torch.nn.Linear(2, 1)\nmodel.seen = 0\n"
                            "opts = {'head': torch.optim.SGD(model.parameters(), lr=0.1), 'steps': 0}\nstarts = []",
                            "%%resilient --save model,opts,starts\n"
                            "for epoch in resume_range(2):\n"
                            "    model.train()\n"
                            "    opts['head'].zero_grad()\n"
                            "    start = model.seen\n"
                            "    for i in resume_range(3):\n"
                            "        model.seen += 1\n"
                            "        opts['steps'] += 1\n"
                            "    starts.append(start)\n")
    lines = [line for line in out.splitlines() if "the code above an inner resume_range loop" in line]
    assert len(lines) == 1 and "reads model, which the inner loop changes" in lines[0], out


def test_a_retry_goes_on_with_the_optimizer_the_safe_point_had_not_the_one_the_cell_makes_again(ip, tmp_path):
    """The head's optimizer, made in the cell, gains the backbone's parameters at epoch 1; an OOM
    in epoch 2 is retried, and the retry's code above the loop makes a head-only optimizer again
    (one parameter group), which cannot take the saved one's two. That was a warning, and the
    retry trained on from epoch 2 with a fresh head-only optimizer, and said done; then the run
    stopped there, in one line. Now the name gets the optimizer it held at the safe point back
    (two groups), its state is loaded into it, and the run ends as its uninterrupted twin, bit for
    bit. (After a kill no such object is left, and the run stops in one line.)"""
    setup = ("%%replay\nimport torch\ntorch.manual_seed(0)\nhead, backbone = torch.nn.Linear(2, 1), torch.nn.Linear(2, 2)\n"
             "fired = [False]\nepochs = []\nx = torch.randn(8, 2)")
    train = ("%%resilient --save head,backbone,opt,epochs\n"
             "opt = torch.optim.SGD(head.parameters(), lr=0.1)\n"
             "for epoch in resume_range(3):\n"
             "    if epoch == 1:\n"
             "        opt.add_param_group({'params': backbone.parameters()})\n"
             + oom_once("    ", "epoch == 2") +
             "    loss = head(backbone(x)).pow(2).mean()\n"
             "    opt.zero_grad(); loss.backward(); opt.step()\n"
             "    epochs.append(epoch)\n")
    ip.run_line_magic("resilience", f"dir {tmp_path / 'twin'}")
    ip.run_cell(setup.replace("fired = [False]", "fired = [True]"))
    assert ip.run_cell(train).success
    twin = [t.detach().clone() for t in (*ip.user_ns["head"].parameters(), *ip.user_ns["backbone"].parameters())]
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell(setup)
    r = ip.run_cell(train)
    assert r.success, r.error_in_exec
    assert ip.user_ns["fired"] == [True] and ip.user_ns["epochs"] == [0, 1, 2]
    assert len(ip.user_ns["opt"].param_groups) == 2
    ran = [t.detach() for t in (*ip.user_ns["head"].parameters(), *ip.user_ns["backbone"].parameters())]
    assert all(a.equal(b) for a, b in zip(ran, twin))


def test_a_rollback_to_the_end_of_an_inner_loop_over_a_list_says_so(ip, tmp_path, capsys):
    """The last safe point was the inner loop's last item: the rollback goes on at its end, and
    says so (it said "item 2" of a list of two, then "0, the end")."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\nimport torch\nfired = [False]\nseen = []")
    capsys.readouterr()
    r = ip.run_cell("%%resilient --save seen\n"
                    "for epoch in resume_range(2):\n"
                    "    for x in resume_range([1, 2]):\n"
                    "        seen.append((epoch, x))\n"
                    + oom_once("    ", "True"))
    assert r.success, r.error_in_exec
    assert "rolled back to the last safe point; continuing at 0, its inner loop done" in capsys.readouterr().out
    assert ip.user_ns["seen"] == [(0, 1), (0, 2), (1, 1), (1, 2)]


def after_training_notebook(mark):
    """A loop that leaves its model in eval mode (its validation's), with the first layer frozen in
    the last epoch and a count of epochs in a plain attribute of that layer; a cell after the
    training that the kernel dies in, once, then evaluates the model (dropout: its mode shows)."""
    return harness.notebook(
        "%load_ext colab_resilience",
        f"%%replay\nimport os, signal, torch\nMARK = {str(mark)!r}\ntorch.manual_seed(0)\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))\n"
        "model[0].epochs = 0\nopt = torch.optim.Adam(model.parameters(), lr=0.01)",
        "%%resilient --save model,opt\nfor epoch in resume_range(4):\n    model.train()\n"
        "    for i in range(0, 64, 16):\n        loss = ((model(X[i:i + 16]) - Y[i:i + 16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    model[0].epochs += 1\n    model.eval()\n"
        "    for p in model[0].parameters():\n        p.requires_grad_(epoch < 3)",
        "if not os.path.exists(MARK):\n    open(MARK, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "print('RESULT', model.training, model[0].epochs, [p.requires_grad for p in model.parameters()],\n"
        "      model(X).detach().numpy().tobytes().hex())",
    )


@pytest.mark.one_stack("colab")
def test_a_kill_in_a_cell_after_the_training_finds_the_model_as_the_training_left_it(tmp_path):
    """The model of a finished run came back with its weights but as the set-up cell built it
    otherwise: in train mode (its validation had left it in eval mode: the next cell's dropout
    was on), its frozen layer trainable again, its plain attribute reset, and the run said done
    (found writing a probe). Its modes, flags and plain attributes go with the end-of-cell
    checkpoint and come back with it, as they do on a resume: the evaluation is the twin's."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, after_training_notebook)
    assert len(run.restarts) == 1 and "from the finished training" in harness.cell_text(nb.cells[3])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(twin).startswith("RESULT False 4 [False, False, True, True] "), harness.result(twin)


SWITCH = "        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)\n"
GROW = ("        model = torch.nn.Sequential(*model, torch.nn.Tanh(), torch.nn.Linear(1, 1))\n"
        "        opt = torch.optim.Adam(model.parameters(), lr=0.01)\n")


def switched_optimizer_notebook(fault: str, mark, after: bool = False, change: str = SWITCH):
    """Adam for three epochs, then the loop rebinds ``opt`` to an SGD (or, ``change=GROW``, the
    model to a bigger one and ``opt`` to an Adam of its parameters); ``--save model,opt``. One
    fault in epoch 3 after the change (``fault``: a kill or an OOM), or (``after``) a kill in the
    cell after the training."""
    strike = {"kill": "os.kill(os.getpid(), signal.SIGKILL)",
              "oom": "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')"}[fault]
    return harness.notebook(
        "%load_ext colab_resilience",
        f"%%replay\nimport os, signal, torch\nMARK = {str(mark)!r}\ntorch.manual_seed(0)\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.01)",
        "%%resilient --save model,opt\nfor epoch in resume_range(5):\n    if epoch == 3:\n"
        + change +
        "    for i in range(0, 64, 16):\n        loss = ((model(X[i:i + 16]) - Y[i:i + 16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        f"        if epoch == 3 and i == 16 and not {after} and not os.path.exists(MARK):\n"
        f"            open(MARK, 'w').close(); {strike}\n",
        (f"if not os.path.exists(MARK):\n    open(MARK, 'w').close(); {strike}\n" if after else "")
        + "print('RESULT', type(opt).__name__, model[0].weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.parametrize("change", [SWITCH, GROW], ids=["optimizer-of-another-kind", "model-rebuilt-bigger"])
@pytest.mark.one_stack("colab")
def test_a_retry_after_the_loop_rebound_a_model_or_optimizer_goes_back_to_the_first(tmp_path, change):
    """The failed attempt rebound ``opt`` to an SGD (or ``model`` to a bigger Sequential, ``opt``
    to an Adam of its parameters); the safe point's were an Adam (and the smaller model). The
    retry stopped ("saved from a torch.optim.adam.Adam and now holds a torch.optim.sgd.SGD", "the
    Sequential it holds now is not the one saved"; found by probes): each name gets the object it
    held at the safe point back, its state is loaded into it, and the retried epoch makes the
    change again, as uninterrupted. Bit for bit its twin."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: switched_optimizer_notebook("oom", mark,
                                                                                                 change=change))
    assert not run.restarts and "rolled back to the last safe point" in harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT SGD " if change == SWITCH else "RESULT Adam "), harness.result(nb)


@pytest.mark.one_stack("colab")
def test_a_finished_runs_name_that_cannot_be_put_back_is_said_in_the_marker(tmp_path):
    """After a kill in the cell after the training, the finished run's ``opt`` (an SGD the loop
    made) cannot go into the Adam the set-up cell builds: it was left out without a word, and the
    later cells ran on the fresh Adam (found by a probe). The marker says it, in one line; the
    model is back."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: switched_optimizer_notebook("kill", mark, True))
    marker = harness.cell_text(nb.cells[3])
    assert ("colab_resilience: cannot restore 'opt' in place: it was saved from a torch.optim.sgd.SGD and now holds "
            "a torch.optim.adam.Adam (run ") in marker, marker
    assert "it holds what the set-up cells made, and the cells after the training would run on that" in marker
    assert harness.result(nb).split()[2] == harness.result(twin).split()[2]  # the weights
    assert harness.result(nb).split()[1] == "Adam" and harness.result(twin).split()[1] == "SGD"
