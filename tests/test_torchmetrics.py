"""torchmetrics metrics in a hand-written torch loop: a ``Metric`` keeps its states (a running
sum, counts, a list of outputs) out of its ``state_dict()`` (they are registered non-persistent),
so a restored metric came back reset (a mean over the run read ``nan``) and a rolled-back one kept
the failed attempt's updates, and the run said done. Their states go with the checkpoint, wherever
the metric is: saved by its name, inside a saved model, in a saved dict.

Skipped where torchmetrics is not installed; CI's trainers stack (``.ci/run``) has it (Lightning
depends on it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("torchmetrics", reason="torchmetrics is not installed (CI's trainers stack has it)")

import torch
import torchmetrics

import harness

_FAULTS = {"kill": "os.kill(os.getpid(), signal.SIGKILL)",
           "oom": "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 1 GiB')"}


def metrics_notebook(fault: str, mark):
    """Epochs of minibatches (both resume_range loops): a mean of every step's loss over the run
    (saved by its name), the first output of each step (a list state, ``CatMetric``), an MSE inside
    the saved model and an MAE in a saved dict, both reset at the top of each epoch, above the inner
    loop. One fault after minibatch 2 of epoch 2, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport os, signal, torch, torchmetrics\n"
        f"MARK = {str(mark)!r}\ntorch.manual_seed(0)\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))\n"
        "        self.quality = torchmetrics.MeanSquaredError()\n"
        "    def forward(self, x):\n"
        "        return self.body(x)\n"
        "model = Net()\nopt = torch.optim.Adam(model.parameters(), lr=0.01)\n"
        "run_mean, outs = torchmetrics.MeanMetric(), torchmetrics.CatMetric()\n"
        "metrics = {'mae': torchmetrics.MeanAbsoluteError()}\nhistory = []\n"
        "X, Y = torch.randn(64, 4), torch.randn(64, 1)",
        "%%resilient --save model,opt,run_mean,outs,metrics,history\n"
        "for epoch in resume_range(4):\n"
        "    model.quality.reset(); metrics['mae'].reset()\n"
        "    for i in resume_range(0, 64, 16):\n"
        "        out = model(X[i:i+16])\n"
        "        loss = ((out - Y[i:i+16]) ** 2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "        run_mean.update(loss.detach()); outs.update(out.detach()[0])\n"
        "        model.quality.update(out.detach(), Y[i:i+16]); metrics['mae'].update(out.detach(), Y[i:i+16])\n"
        "        if epoch == 2 and i == 32 and not os.path.exists(MARK):\n"
        f"            open(MARK, 'w').close(); {_FAULTS[fault]}\n"
        "    history.append((model.quality.compute().item(), metrics['mae'].compute().item()))",
        "print('RESULT', run_mean.compute().item(), run_mean.update_count, outs.compute().numpy().tobytes().hex(),\n"
        "      history, model.quality.update_count, model.body[0].weight.detach().numpy().tobytes().hex())",
    )


@pytest.mark.kernel
@pytest.mark.parametrize("fault", ["kill", "oom"])
def test_metrics_saved_by_name_in_a_model_or_in_a_dict_come_back_with_their_states(tmp_path, fault):
    """A kill inside epoch 2 resumes at its minibatch 3 in a new kernel, an OOM rolls back to it:
    the run's mean, the list of outputs, the epoch's MSE and MAE so far are the safe point's (they
    were reset, or kept the failed attempt's updates), and the run ends bit for bit as its twin:
    every number computed, the update counts, the weights. The first run says nothing of the
    metrics reset above the inner loop (the saved objects get the inner safe point's state again)."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: metrics_notebook(fault, mark))
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert "colab_resilience: the code above" not in harness.cell_text(twin.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert " 16 " in harness.result(nb) and "nan" not in harness.result(nb), harness.result(nb)


def test_a_restored_metric_holds_copies_on_its_device_its_update_count_and_no_stale_compute():
    """What goes into the state dict is the metric's states (the list state as a list); what comes
    back into another metric is copies (a restored state dict's tensors may lie in a buffer that is
    reused), the update count comes back with the module's modes, and the cached ``compute()`` of
    the metric it went into is dropped."""
    from colab_resilience import carried

    saved, target = torchmetrics.CatMetric(), torchmetrics.CatMetric()
    saved.update(torch.tensor([1.0, 2.0]))
    saved.update(torch.tensor([3.0]))
    target.update(torch.tensor([9.0]))
    assert target.compute().reshape(-1).tolist() == [9.0]  # cached now
    sd = carried.with_module_states(saved, saved.state_dict())
    assert set(sd) == {"value"} and isinstance(sd["value"], list) and len(sd["value"]) == 2
    facts = carried.snapshot({"m": saved}, ["m"])
    rest = carried.put_module_states(target, sd)
    carried.apply({"m": target}, ["m"], facts)
    assert rest == {} and "value" in sd  # the caller's dict is left whole
    assert target.compute().tolist() == [1.0, 2.0, 3.0] and target.update_count == 2
    sd["value"][0].fill_(0.0)  # the buffer it came from is reused
    assert target.compute().tolist() == [1.0, 2.0, 3.0]


def test_a_metric_the_loop_updates_without_save_is_named_once(ip):
    """A metric the loop updates but --save leaves out would come back reset after a restart (or
    keep a failed attempt's updates after a rollback): named at the first run, in one line."""
    from colab_resilience import lint

    ip.user_ns.update(model=torch.nn.Linear(2, 1), mean_loss=torchmetrics.MeanMetric())
    body = ("for epoch in resume_range(3):\n    loss = model(torch.ones(1, 2)).sum()\n"
            "    mean_loss.update(loss.detach())\n")
    replayed = "import torch, torchmetrics\nmodel = torch.nn.Linear(2, 1)\nmean_loss = torchmetrics.MeanMetric()"
    lines = lint.warnings(ip, body, ["model"], [replayed])
    named = [line for line in lines if "mean_loss" in line]
    assert len(named) == 1 and "carries mean_loss" in named[0] and "add it to --save" in named[0], lines
