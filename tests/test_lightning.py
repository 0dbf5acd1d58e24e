"""Lightning's ``Trainer.fit`` with ``ResilienceCallback``: every epoch a safe point (and every 5
steps, on request); Lightning's own checkpoint dictionary (module, optimizer, scheduler, loops, the
state of ``EarlyStopping``, ``ModelCheckpoint`` and a stateful callback of the notebook's), the
random states, the module's modes and the epoch's gathered metrics go with each checkpoint, and
Lightning restores them into the module and optimizer the replayed set-up cell rebuilt; a run
killed or out of memory goes on where it was, bit-identical to its uninterrupted twin: weights,
optimizer state, every step's loss, the metrics, the callbacks' state.

Skipped where torch or Lightning is not installed; CI's trainers stack (``.ci/run``) has them.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("lightning", reason="lightning is not installed (CI's trainers stack has it)")

import harness
import nbformat

pytestmark = pytest.mark.kernel


def load(tmp_path, **parameters):
    return harness.load("train_lightning.ipynb", tmp_path, root_dir=str(tmp_path / "out"), **parameters)


def twin(tmp_path_factory, workers: int = 0, **parameters) -> str:
    """The uninterrupted run (with DataLoader workers, the samples' noise is drawn in them: another
    run); with ``parameters``, that run of the notebook."""
    made = harness.twin_result(tmp_path_factory, "train_lightning.ipynb", load, workers=workers, **parameters)
    assert parameters or "step=30 epoch=3" in made, made
    return made


trained_steps = harness.by_kernel  # (kernel, step) for each step begun


@pytest.mark.parametrize("fault,fault_step,retries,workers,every_steps,at,first", [
    ("sigkill", 15, 2, 0, None, "epoch 1", 11), ("sigkill", 10, 2, 0, None, "epoch 0", 1),
    ("oom-error", 15, 2, 0, None, "epoch 1", 11), ("oom-error", 15, 0, 0, None, "epoch 1", 11),
    ("sigkill", 25, 2, 2, None, "epoch 2", 21), ("sigkill", "end", 2, 0, None, None, None),
    ("sigkill", 17, 2, 0, 5, "step 16 of epoch 1", 16), ("oom-error", 17, 2, 0, 5, "step 16 of epoch 1", 16),
    ("sigkill", 17, 2, 2, 5, "step 16 of epoch 1", 16), ("sigkill", 27, 2, 0, 5, "step 26 of epoch 2", 26),
    ("oom-error", "validation 1", 2, 0, None, "epoch 1", 11),
], ids=["killed-mid-epoch", "killed-at-an-epoch-end", "out-of-memory", "out-of-memory-past-the-retries",
        "killed-with-dataloader-workers", "killed-after-fit-returned", "killed-with-safe-points-every-5-steps",
        "out-of-memory-with-safe-points-every-5-steps", "killed-with-workers-and-safe-points-every-5-steps",
        "killed-in-the-last-epoch-with-safe-points-every-5-steps", "out-of-memory-in-validation"])
def test_a_fit_killed_or_out_of_memory_goes_on_where_it_was_bit_identical(
        tmp_path, tmp_path_factory, fault, fault_step, retries, workers, every_steps, at, first):
    """Supervised, with the standby kernel. The fault strikes after optimizer step 15 (epoch 1's
    fifth of 10): the last safe point is epoch 0's end (taken when epoch 1 began, after its
    validation, EarlyStopping, ModelCheckpoint and the scheduler's step), so the new kernel's fit
    goes on at epoch 1, step 11, drawing epoch 1's order from the random state of that moment.
    After step 10 (epoch 0's last, its safe point not yet taken) it goes on at epoch 0. An OOM is
    retried in the kernel from the same safe point, or past the retries in a new one. With two
    DataLoader workers (forked by the kernel: the run's lock must not stay with them), the same.
    Killed after fit returned (its last safe point saved), the cell run again trains nothing and
    the metrics are those fit ended with. With every_steps=5, killed (or out of memory) after step
    17, the fit goes on at step 16 within epoch 1: the epoch's order drawn again, its first five
    batches (each loaded with a noise drawn from torch's random state, in the kernel or in the
    workers) taken and dropped, the random state put back as it was before batch 16 was loaded.
    After step 27, in the last epoch, the same, and the epoch's train_loss_epoch (the mean
    self.log(on_epoch=True) gathers over the epoch, which no Lightning checkpoint holds) counts the
    batches before the safe point too.
    Out of memory in epoch 1's validation, the module in eval mode: the retry trains in train mode
    (Lightning does not set it back; the modes go with each checkpoint)."""
    reference = twin(tmp_path_factory, workers)
    nb = load(tmp_path, fault=fault, fault_step=fault_step, retries=retries, workers=workers, every_steps=every_steps)
    # a standby only where the kernel is restarted: beside a retry in the kernel it would import
    # torch and Lightning for nothing
    run, out = harness.run_ok(nb, tmp_path, standby=fault == "sigkill" or retries == 0)
    if fault == "sigkill" or retries == 0:
        assert len(run.restarts) == 1, out
        assert "restored the Lightning module, its optimizers, schedulers, loops and callbacks in " in out, out
    else:
        assert not run.restarts and "OOM (CUDA out of memory)" in out and "retry 1/2" in out, out
    assert "resuming from a checkpoint that ended before the epoch" not in out  # Lightning's warning: not here
    steps = [s for _, s in trained_steps(tmp_path / "events.log")]
    if at is None:  # fit had returned: the new kernel trains nothing
        assert "the loop had finished" in out and steps == list(range(1, 31)), out
    else:  # the steps since the safe point are trained again, and none before it
        assert f"continuing at {at}" in out, out
        struck = fault_step if isinstance(fault_step, int) else 20  # the last step begun before the fault
        assert steps == list(range(1, struck + 1)) + list(range(first, 31))
    assert harness.result(nb) == reference


def _parts(result: str) -> dict[str, str]:
    """The fields of a RESULT line (a dict or a list as one field)."""
    return dict(re.findall(r"(\w+)=(\{.*?\}|\[.*?\]|\S+)", result))


@pytest.mark.parametrize("fault_step,every_steps,kill_step,at", [
    (15, None, None, "epoch 1"), (17, 5, None, "step 16 of epoch 1"), (15, None, 25, "epoch 1"),
], ids=["out-of-memory", "out-of-memory-within-an-epoch", "out-of-memory-then-killed"])
def test_shrinking_the_batch_keeps_the_effective_batch(tmp_path, tmp_path_factory, fault_step, every_steps, kill_step,
                                                       at):
    """--shrink batch_size (the DataLoader made in the training cell): an OOM after step 15 halves
    the batch (4 → 2), and the callback doubles accumulate_grad_batches (1 → 2), so an optimizer
    step still takes the same 4 samples. Back at epoch 0's end, or within epoch 1 at step 16 (its 5
    finished batches of 4 counted as 10 of 2: the loops' counts, which accumulation and the epoch's
    end go by, and the batches dropped), the run ends as its twin: the same steps, epochs, learning
    rate and EarlyStopping count, and, without dropout or noise (whose draws depend on the shapes),
    its losses up to float rounding. Killed after step 25 as well, the kernel that takes over starts
    from the journal's shrunk batch and raises the accumulation again."""
    want = _parts(twin(tmp_path_factory, dropout=0.0, noise=0.0))
    nb = load(tmp_path, fault="oom-error", fault_step=fault_step, every_steps=every_steps, kill_step=kill_step,
              dropout=0.0, noise=0.0, shrink="--shrink batch_size")
    run, out = harness.run_ok(nb, tmp_path, standby=kill_step is not None)
    assert "batch_size 4 → 2; retry 1/2" in out and f"continuing at {at} with batch_size 2" in out, out
    kept = "colab_resilience: the fit's batch is 2 now; accumulate_grad_batches 1 → 2 keeps the effective batch 4"
    assert out.count(kept) == (2 if kill_step else 1), out
    assert len(run.restarts) == (1 if kill_step else 0), out
    got = _parts(harness.result(nb))
    for name in ("step", "epoch", "lr"):
        assert got[name] == want[name], (name, got, want)
    assert got["early_stopping"].split(",")[0] == want["early_stopping"].split(",")[0]
    metrics, expected = ast.literal_eval(got["metrics"]), ast.literal_eval(want["metrics"])
    for name in ("train_loss_epoch", "val_loss"):
        assert abs(metrics[name] - expected[name]) <= 1e-4, (name, metrics, expected)


def test_a_kill_in_a_cell_after_the_fit_finds_the_trained_module(tmp_path, tmp_path_factory):
    """Killed in the result cell, after the training cell ended (its run done): the new kernel
    replays the set-up cells, which build an untrained module, and runs the training cell again
    silently: a new Trainer whose fit loads the run's final state into the module and trains
    nothing. The result cell, run again, sees the trained module, the optimizer and scheduler,
    the metrics and the callbacks' state (ModelCheckpoint's best file, EarlyStopping's count), and
    the random state the fit left (that fit, though it trained nothing, had drawn from it: the
    numbers the result cell draws differed, as would a later fit's shuffle)."""
    reference = twin(tmp_path_factory)
    nb = load(tmp_path, fault="sigkill", fault_step="result")
    harness.run_killed_after_training(nb, tmp_path, "the Lightning module, its optimizers, schedulers, loops and callbacks")
    assert [s for _, s in trained_steps(tmp_path / "events.log")] == list(range(1, 31))  # none again
    assert harness.result(nb) == reference


@pytest.mark.parametrize("fault_step", ["end", "result"], ids=["killed-after-fit-returned", "killed-in-the-next-cell"])
def test_a_fit_that_early_stopping_ended_trains_nothing_more_after_a_kill(tmp_path, tmp_path_factory, fault_step):
    """EarlyStopping (patience 1) ends the fit after its second epoch of 8, at step 20: it sets the Trainer's
    should_stop, a flag no checkpoint of Lightning's holds. Killed when fit has returned, or in the
    next cell, the new kernel's fit loads the run's final state and trains nothing, and the result
    is the uninterrupted one's (the flag lost, it went on for another epoch, until EarlyStopping
    stopped it again, and the run said done: step 30 against 20)."""
    reference = twin(tmp_path_factory, epochs=8, patience=1)
    assert "step=20 epoch=2" in reference, reference
    nb = load(tmp_path, fault="sigkill", fault_step=fault_step, epochs=8, patience=1)
    if fault_step == "result":
        harness.run_killed_after_training(nb, tmp_path, "the Lightning module, its optimizers, schedulers, loops and "
                                          "callbacks")
    else:
        run, out = harness.run_ok(nb, tmp_path)
        assert len(run.restarts) == 1 and "the loop had finished" in out, out
    assert [s for _, s in trained_steps(tmp_path / "events.log")] == list(range(1, 21))  # none again
    assert harness.result(nb) == reference


def test_a_finished_fit_that_does_not_fit_the_rebuilt_module_stops_the_run(tmp_path):
    """As above, but the set-up cells of the new kernel build a module of another width: the fit
    run again cannot load the run's final state into it, so the notebook stops there (exit 1) and
    says why in one line, rather than run the result cell on an untrained module."""
    nb = load(tmp_path, fault="sigkill", fault_step="result")
    harness.insert(nb, "result", "%%replay\nif os.path.exists(mark):  # only in a kernel that replaces the killed one\n"
                   "    model.net[0] = torch.nn.Linear(8, 16)", "narrower")
    run = harness.run(nb, tmp_path)
    assert run.status == 1 and run.failed_cell == harness.index(nb, "result"), run.message
    assert run.message.startswith("colab-resilience: cell ") and "after the kernel died, the finished run " in run.message
    assert "\n" not in run.message, run.message
    assert "could not put back the Lightning module, its optimizers, schedulers, loops and callbacks (" in run.message
    # named before anything is loaded (Lightning's load_state_dict copies what fits before it raises)
    assert "other shapes: net.0.weight [32, 8] saved, [16, 8] now" in run.message, run.message
    marker = harness.cell_text(nb.cells[harness.index(nb, "result")])
    assert "putting back the finished run " in marker and "RESULT" not in marker, marker


@pytest.mark.parametrize("fault,restarts", [("sigkill", 1), ("oom-error", 0)])
def test_a_checkpoint_file_saved_after_the_safe_point_is_saved_again_under_its_name(tmp_path, tmp_path_factory,
                                                                                    fault, restarts):
    """Killed (or out of memory, retried in the kernel) as epoch 1 begins, after ModelCheckpoint
    saved epoch=0-step=10.ckpt and before epoch 0's safe point: the fit goes on from its start and
    trains epoch 0 again, and Lightning, finding that file there, would save
    epoch=0-step=10-v1.ckpt. The file was not there at the safe point (its checkpoint holds the
    folder's names), so the fit saves it again under its name, and says so in one line before
    training: the folder and the best checkpoint's name are the uninterrupted fit's. A file another
    run left there (there at the safe point, not in the callback's state) is named in its own line,
    and left alone. In the kernel, the callbacks go back to their state as the fit began: the
    failed attempt's losses, EarlyStopping's count, ModelCheckpoint's best and last save (which
    kept it from saving at step 10 again: the best was epoch 1's) were in them."""
    reference = twin(tmp_path_factory)
    nb = load(tmp_path, fault=fault, fault_step="epoch 1 start")
    folder = tmp_path / "out" / "best"
    folder.mkdir(parents=True)
    (folder / "another-run.ckpt").write_bytes(b"not this fit's")
    run, out = harness.run_ok(nb, tmp_path)
    assert len(run.restarts) == restarts, out
    assert out.count(f"colab_resilience: ModelCheckpoint's folder {folder} holds epoch=0-step=10.ckpt, saved after "
                     "the safe point the fit goes on from; the fit saves it again under its name when it gets there, "
                     "as an uninterrupted fit did (not as -v1)") == 1, out
    assert f"colab_resilience: ModelCheckpoint's folder {folder} holds another-run.ckpt, which this fit did not save " \
           "(another run did); a checkpoint saved again under a name there gets another name (-v1)" in out, out
    assert sorted(p.name for p in folder.iterdir()) == ["another-run.ckpt", "epoch=0-step=10.ckpt"]
    assert (folder / "another-run.ckpt").read_bytes() == b"not this fit's"
    assert harness.result(nb) == reference
    assert "best=epoch=0-step=10.ckpt" in reference


def test_a_fit_killed_in_a_kernel_goes_on_when_its_cell_runs_again(kernel, tmp_path, tmp_path_factory):
    """Interactive, as in Jupyter, with a safe point every 5 steps: the kernel dies after step 17,
    the user runs the training cell again: the set-up cell is replayed (a new module, data and
    callbacks), and fit goes on at step 16, within epoch 1."""
    reference = twin(tmp_path_factory)
    nb = load(tmp_path, fault="sigkill", fault_step=17, every_steps=5)
    out = harness.killed_and_rerun(kernel, nb)
    assert "replayed 3 cells, restored the Lightning module, its optimizers, schedulers, loops and callbacks in " \
        in out, out
    assert "continuing at step 16 of epoch 1" in out
    assert harness.result(kernel.ok(harness.user_cell(nb, "result")).stdout) == reference


def test_what_the_callback_refuses_where_it_warns_and_where_it_does_nothing(kernel, tmp_path):
    """Without it, the first run of a %%resilient fit says how to add it. Outside a %%resilient
    cell it says so once and the fit trains as usual; inside one, fit(ckpt_path=...) is refused in one line (the run resumes from its own checkpoints), and so
    is a callback made outside the cell (the cell would not be run as a loop of epochs). Data
    whose order the callback cannot put back is named in one line before training starts, and so
    is an attribute of a callback without a state_dict, or of the module, that is not a plain value."""
    nb = load(tmp_path, epochs=1)
    harness.run_interactive(kernel, nb, stop="train")
    kernel.ok("from colab_resilience.integrations.lightning import ResilienceCallback\n"
              "def make(**kw):\n"
              "    return L.Trainer(max_epochs=1, accelerator='cpu', logger=False, enable_progress_bar=False,\n"
              "                     enable_checkpointing=False, enable_model_summary=False, **kw)\n")
    # without it, the fit has no safe point inside: a restart would train from epoch 0; said once
    reply = kernel.ok("%%resilient\ntrainer = L.Trainer(max_epochs=1, accelerator='cpu', logger=False, "
                      "enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)\n"
                      "trainer.fit(model, train_data)")
    assert reply.stdout.count(
        "colab_resilience: trainer.fit() (Lightning) has no safe point inside it: after a restart or an out-of-memory "
        "error it trains again from its first epoch; to go on after the last finished one, make the Trainer with "
        "callbacks=[ResilienceCallback()] (from colab_resilience.integrations.lightning import "
        "ResilienceCallback)") == 1, reply.stdout
    reply = kernel.ok("make(callbacks=[ResilienceCallback()]).fit(model, train_data)")
    assert reply.stderr.count("colab_resilience: ResilienceCallback outside a %%resilient cell: nothing is "
                              "checkpointed") == 1, reply.stderr
    reply = kernel.execute("%%resilient\nmake(callbacks=[ResilienceCallback()]).fit(model, train_data, "
                           "ckpt_path='out/last.ckpt')")
    assert reply.status == "error" and reply.evalue == (
        "colab_resilience: a fit with ResilienceCallback resumes from the run's own checkpoints; call "
        "trainer.fit() without ckpt_path"), reply.evalue
    reply = kernel.execute("ResilienceCallback(every_steps=0)")
    assert reply.status == "error" and reply.evalue == (
        "colab_resilience: every_steps must be a whole number of steps, 1 or more; got 0"), reply.evalue
    kernel.ok("outside = ResilienceCallback()")
    reply = kernel.execute("%%resilient\nmake(callbacks=[outside]).fit(model, train_data)")
    assert reply.status == "error" and reply.evalue.startswith(
        "colab_resilience: ResilienceCallback was made outside the %%resilient cell that trains"), reply.evalue
    reply = kernel.ok("%%resilient\n"
                      "class Stream(torch.utils.data.IterableDataset):\n"
                      "    def __iter__(self):\n"
                      "        return iter(list(zip(x[:8], y[:8])))\n"
                      "make(callbacks=[ResilienceCallback()]).fit(model, torch.utils.data.DataLoader(Stream(), "
                      "batch_size=4))")
    assert reply.stdout.count("colab_resilience: fit reads its training data from an iterable whose order the "
                              "callback cannot put back") == 1, reply.stdout
    reply = kernel.ok("%%resilient\n"
                      "import threading\n"
                      "class Best(L.Callback):  # no state_dict: its plain attributes and tensors are saved, not the lock\n"
                      "    def __init__(self):\n"
                      "        self.count, self.best, self.lock = 0, torch.zeros(1), threading.Lock()\n"
                      "make(callbacks=[Best(), ResilienceCallback()]).fit(model, train_data)")
    assert reply.stdout.count(
        "colab_resilience: the state of the fit's callbacks without a state_dict goes with each checkpoint, but not "
        "Best.lock (not plain values or tensors): after a resume they hold what the callback has in this kernel") == 1, reply.stdout
    reply = kernel.ok("%%resilient\nmodel.guard = threading.Lock()  # no checkpoint holds a lock\n"
                      "make(callbacks=[ResilienceCallback()]).fit(model, train_data)")
    assert reply.stdout.count(
        "colab_resilience: the plain attributes of the Model module go with each checkpoint, but not guard (not plain "
        "values or tensors): after a resume they hold what the module has in this kernel") == 1, reply.stdout


def test_colab_resilience_check_passes_the_lightning_notebook(tmp_path):
    """Kills between safe points, during a save and before one, and an out-of-memory error raised
    in Lightning's own code; safe points every 5 steps, so resumes within epochs too. ModelCheckpoint
    keeps the best epoch's file, in a folder of each run's own (``{run}``: a run that found an
    earlier run's file would name its own -v1). The seed strikes twice at the last safe point
    (the fit had ended): the callback's last checked score, which its load_state_dict does not put
    back, and its last save, which its on_train_start (not run) had been given, were those of a fit
    begun afresh; and check compared a ModelCheckpoint in a list by its attributes, a clock reading
    among them, where one bound to a name is compared by its state_dict: 4 of 4 differed, the
    printed result identical."""
    r = subprocess.run(
        [sys.executable, "-m", "colab_resilience", "check", str(harness.FILES / "train_lightning.ipynb"),
         "--faults", "4", "--seed", "1", "--kernel", harness.KERNEL_NAME, "-p", "mark", str(tmp_path / "mark"),
         "-p", "root_dir", "{run}", "-p", "every_steps", "5"],
        capture_output=True, text=True, timeout=400, check=False, env=harness.child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical after each of 4 faults" in r.stdout, r.stdout


def test_an_oom_while_lightning_makes_the_data_leaves_no_data_loader_patched(kernel):
    """Lightning wraps DataLoader's and BatchSampler's __init__/__setattr__/__delattr__ while it
    asks for a fit's data, and puts them back only when that goes well. An out-of-memory error in
    a train_dataloader hook (retried in the kernel) must not leave them wrapped: a wrapped
    DataLoader records its arguments and attributes (__pl_saved_args, __pl_attrs_record) in every
    loader made or changed afterwards, the user's validation loader too. The retried fit ends
    where an uninterrupted one does, bit for bit. Found by colab-resilience check: an OOM that
    struck in there made val_data differ."""
    kernel.ok("%load_ext colab_resilience")
    kernel.ok(textwrap.dedent("""\
        import hashlib, logging, warnings
        import torch, lightning as L
        from torch.utils.data import DataLoader, TensorDataset
        torch.set_num_threads(1)
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="lightning")
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)
        fail = []

        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 1)
            def training_step(self, batch, i):
                return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            def validation_step(self, batch, i):
                self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-2)
            def train_dataloader(self):
                if fail:
                    fail.pop()
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                return DataLoader(TensorDataset(x[:40], y[:40]), batch_size=4, shuffle=True)

        def fingerprint(model):
            return hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest()
        """))
    fit = textwrap.dedent("""\
        %%resilient --retries 2
        from colab_resilience.integrations.lightning import ResilienceCallback
        L.seed_everything(0, verbose=False)
        model, val_data = Model(), DataLoader(TensorDataset(x[40:], y[40:]), batch_size=4)
        L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, enable_model_summary=False,
                  callbacks=[ResilienceCallback()]).fit(model, val_dataloaders=val_data)
        """)
    kernel.ok(fit)
    reference = kernel.value("fingerprint(model)")
    kernel.ok("fail.append(1)")
    out = kernel.ok(fit).stdout
    assert "OOM (CUDA out of memory)" in out and "retry 1/2" in out, out
    assert kernel.value("fail") == []  # the hook did fail once
    assert kernel.value("[f'{c.__name__}.{n}' for c in (DataLoader, torch.utils.data.BatchSampler) "
                        "for n in ('__init__', '__setattr__', '__delattr__') "
                        "if hasattr(getattr(c, n), '__wrapped__') or '__old' + n in vars(c)]") == []
    assert kernel.value("sorted(k for k in vars(val_data) if k.startswith('__pl'))") == []
    assert kernel.value("fingerprint(model)") == reference


_FIT_FAULTS = {"kill": "os.kill(os.getpid(), signal.SIGKILL)",
               "oom": "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')"}


def _fit_notebook(fault: str, mark, model: str, result: str, *, imports: str = "", callbacks: str = "",
                  epochs: int = 3, trainer: str = "", before: str = "", step: int = 13,
                  set_up: str = "") -> "nbformat.NotebookNode":
    """A seeded fit of ``model`` (the code of a ``LightningModule`` named ``Model``, and of what
    else the set-up cell makes; ``{strike}`` in it: its ``on_train_batch_end`` hook that strikes
    with ``fault`` after ``step``, once) over 12 batches an epoch, shuffled, for ``epochs`` epochs,
    a safe point every 5 steps, with ``before`` and ``callbacks`` before and after
    ``ResilienceCallback`` and ``trainer``'s arguments; ``set_up``: the set-up cell's first lines;
    ``result``: the result cell's code."""
    strike = textwrap.indent(textwrap.dedent(f"""\
        def on_train_batch_end(self, outputs, batch, i):
            if self.global_step == {step} and not os.path.exists(MARK):
                open(MARK, "w").close(); {_FIT_FAULTS[fault]}"""), "    ")
    return harness.notebook(
        "%load_ext colab_resilience",
        f"%%replay\n{set_up}import os, signal, torch, {imports}lightning as L\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        f"MARK = {str(mark)!r}\nL.seed_everything(0, verbose=False)\n\n"
        + textwrap.dedent(model).replace("{strike}", strike.strip()) +
        "\nloader = DataLoader(TensorDataset(torch.randn(96, 4), torch.randn(96, 1)), batch_size=8, shuffle=True)",
        "%%resilient\nfrom colab_resilience.integrations.lightning import ResilienceCallback\n"
        f"trainer = L.Trainer(max_epochs={epochs}, accelerator=\"cpu\", logger=False, enable_progress_bar=False,\n"
        "                    enable_checkpointing=False, enable_model_summary=False,\n"
        f"                    callbacks=[{before}ResilienceCallback(every_steps=5){callbacks}]{trainer})\n"
        "trainer.fit(model, loader)",
        result,
    )


def metrics_fit_notebook(fault: str, mark):
    """A LightningModule with two torchmetrics metrics: an MSE logged per epoch
    (``self.log("mse", self.mse, on_epoch=True)``) and a sum of every step's loss over the whole fit
    (``self.total``, not logged). One fault after step 13 (inside epoch 1), once."""
    return _fit_notebook(fault, mark, """\
        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
                self.mse, self.total = torchmetrics.MeanSquaredError(), torchmetrics.SumMetric()
            def training_step(self, batch, i):
                out = self.net(batch[0])
                loss = torch.nn.functional.mse_loss(out, batch[1])
                self.mse(out, batch[1])
                self.total.update(loss.detach())
                self.log("mse", self.mse, on_step=False, on_epoch=True)
                return loss
            {strike}
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=0.01)

        model = Model()""",
        "print('RESULT', model.total.compute().item(), model.total.update_count, trainer.callback_metrics['mse'].item(),\n"
        "      model.net[0].weight.detach().numpy().tobytes().hex())", imports="torchmetrics, ")


@pytest.mark.parametrize("fault", ["kill", "oom"])
def test_a_modules_torchmetrics_metrics_come_back_with_the_fit(tmp_path, fault):
    """A Lightning checkpoint holds the module's state_dict, which leaves its torchmetrics metrics'
    states out: a sum over the fit came back reset after a kill (or kept the failed attempt's steps
    after an OOM), and the fit said done. They go with each safe point, and the fit ends bit for bit
    as its twin: the sum and its count of updates, the epoch's MSE, the weights."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: metrics_fit_notebook(fault, mark),
                                              shared="lightning metrics fit")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT ") and " 36 " in harness.result(nb), harness.result(nb)


def ema_fit_notebook(fault: str, mark) -> "nbformat.NotebookNode":
    """A fit whose own callback (no state_dict) keeps an exponential moving average of the weights
    as a list of tensors and a count of its updates, and whose module keeps a running mean of its
    losses in a tensor attribute it rebinds; one fault after step 13, once."""
    return _fit_notebook(fault, mark, """\
        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
                self.smooth = torch.zeros(())
            def training_step(self, batch, i):
                loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
                self.smooth = 0.9 * self.smooth + 0.1 * loss.detach()
                return loss
            {strike}
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=0.01)

        class EMA(L.Callback):
            def __init__(self):
                self.shadow, self.updates = None, 0
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
                w = [p.detach().clone() for p in pl_module.parameters()]
                self.shadow = w if self.shadow is None else [0.9 * s + 0.1 * p for s, p in zip(self.shadow, w)]
                self.updates += 1

        model, ema = Model(), EMA()""",
        "print('RESULT', ema.updates, b''.join(s.numpy().tobytes() for s in ema.shadow).hex()[:64],\n"
        "      model.smooth.item(), model.net[0].weight.detach().numpy().tobytes().hex())", callbacks=", ema")


@pytest.mark.parametrize("fault", ["kill", "oom"])
def test_a_callbacks_tensors_and_a_modules_tensor_attribute_come_back_with_the_fit(tmp_path, fault):
    """A callback without a state_dict that keeps tensors (an EMA of the weights): only its plain
    attributes were saved, so after a kill its shadow weights came back as the replayed cell made
    them (None, then the next step's weights) while its count came back, and the fit said done. Its
    tensors go with each safe point now, as does the module's tensor attribute; the fit ends bit
    for bit as its twin."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: ema_fit_notebook(fault, mark),
                                              shared="lightning ema fit")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT 36 "), harness.result(nb)


def epoch_start_fit_notebook(fault: str, mark, step: int) -> "nbformat.NotebookNode":
    """A fit whose callback, listed before ResilienceCallback, freezes the first layer as training
    starts, unfreezes it as the second epoch starts (by its own count of the epochs started) and
    scales the learning rate by 0.8 as each epoch starts; and whose module counts the epochs
    started and lowers the momentum as each starts. Saves are synchronous (where the fit resumes
    is known); one fault after ``step``, once."""
    return _fit_notebook(fault, mark, """\
        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
                self.started = 0
            def training_step(self, batch, i):
                return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            def on_train_epoch_start(self):
                self.started += 1
                for g in self.optimizers().optimizer.param_groups:
                    g["momentum"] *= 0.9
            {strike}
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        class Unfreeze(L.Callback):
            def __init__(self):
                self.started = 0
            def on_train_start(self, trainer, pl_module):
                pl_module.net[0].weight.requires_grad_(False)
            def on_train_epoch_start(self, trainer, pl_module):
                self.started += 1
                if self.started == 2:
                    pl_module.net[0].weight.requires_grad_(True)
                for g in trainer.optimizers[0].param_groups:
                    g["lr"] *= 0.8

        model, unfreeze = Model(), Unfreeze()""",
        "g = trainer.optimizers[0].param_groups[0]\n"
        "print('RESULT', unfreeze.started, model.started, g['lr'], g['momentum'], model.net[0].weight.requires_grad,\n"
        "      model.net[0].weight.detach().numpy().tobytes().hex())",
        before="unfreeze, ", step=step, set_up="%config ResilienceMagics.staging_memory = 'off'\n")


@pytest.mark.parametrize("fault,step", [("kill", 13), ("oom", 13), ("kill", 17), ("oom", 17)],
                         ids=["killed-resumed-as-an-epoch-starts", "out-of-memory-as-an-epoch-starts",
                              "killed-resumed-within-an-epoch", "out-of-memory-within-an-epoch"])
def test_the_hooks_a_resumed_fit_runs_again_leave_it_as_at_its_safe_point(tmp_path, fault, step):
    """Lightning restores the checkpoint before on_train_start and runs the epoch's
    on_train_epoch_start hooks again: a callback's on_train_start froze the layer that the second
    epoch had unfrozen (for the rest of the fit), and a callback listed before ResilienceCallback
    (as an epoch starts, the safe point is taken in its hook, after theirs) or the module's own
    hook (within an epoch, the safe point is taken after all of them) scaled the learning rate and
    the momentum once more: the fit said done with other weights (found by a probe). Once the fit
    is back where its safe point was taken, the module's flags, the optimizers, the schedulers and
    the callbacks' state are put back: bit for bit as its twin, the counts included."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: epoch_start_fit_notebook(fault, mark, step),
                                              shared="lightning epoch start fit")
    out = harness.cell_text(nb.cells[2])
    assert len(run.restarts) == (fault == "kill"), out
    assert ("continuing at epoch 1" if step == 13 else "continuing at step 16 of epoch 1") in out, out
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(twin).startswith("RESULT 3 3 "), harness.result(twin)
    assert " True " in harness.result(twin), harness.result(twin)


def plateau_fit_notebook(fault: str, mark) -> "nbformat.NotebookNode":
    """A fit whose learning rate a ReduceLROnPlateau halves when the epoch's training loss stops
    falling (interval "epoch", monitor "train_loss"); one fault after step 13 (resumed within an
    epoch), once."""
    return _fit_notebook(fault, mark, """\
        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
            def training_step(self, batch, i):
                loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
                self.log("train_loss", loss, on_step=False, on_epoch=True)
                return loss
            {strike}
            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
                plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss"}}

        model = Model()""",
        "plateau = trainer.lr_scheduler_configs[0].scheduler\n"
        "print('RESULT', plateau.last_epoch, plateau.num_bad_epochs, plateau.best, trainer.optimizers[0].param_groups[0]['lr'],\n"
        "      model.net[0].weight.detach().numpy().tobytes().hex())", epochs=5)


@pytest.mark.parametrize("fault", ["kill", "oom"])
def test_a_plateau_scheduler_steps_at_the_end_of_an_epoch_resumed_within(tmp_path, fault):
    """Lightning does not step a ReduceLROnPlateau at the end of an epoch it resumed within (its
    own checkpoints hold no metrics of the epoch): resumed from our safe point within an epoch,
    the scheduler missed that epoch's step (its count one behind, its learning rate halved later),
    and the fit said done. The epoch's metrics are in our checkpoint, complete: it steps, and the fit
    ends bit for bit as its twin."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: plateau_fit_notebook(fault, mark),
                                              shared="lightning plateau fit")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT 5 "), harness.result(nb)


def csv_fit_notebook(fault: str, mark, version, every_steps):
    """A fit that logs to a ``CSVLogger`` (``version`` given or not): a step's and an epoch's
    training loss, a validation loss, and a ``LearningRateMonitor`` (before ResilienceCallback: it
    logs as each epoch begins, before the safe point is taken) over 12 batches an epoch, 4 epochs,
    a ``StepLR``; ``every_steps`` safe points within epochs, or none. One fault after step 17 (in
    epoch 1), once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport os, signal, torch, lightning as L\n"
        "from lightning.pytorch.callbacks import LearningRateMonitor\nfrom lightning.pytorch.loggers import CSVLogger\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        f"MARK = {str(mark)!r}\nL.seed_everything(0, verbose=False)\n"
        "class Model(L.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))\n"
        "    def training_step(self, batch, i):\n"
        "        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])\n"
        "        self.log('train_loss', loss, on_step=True, on_epoch=True)\n"
        "        return loss\n"
        "    def validation_step(self, batch, i):\n"
        "        self.log('val_loss', torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))\n"
        "    def on_train_batch_end(self, outputs, batch, i):\n"
        "        if self.global_step == 17 and not os.path.exists(MARK):\n"
        f"            open(MARK, 'w').close(); {_FIT_FAULTS[fault]}\n"
        "    def configure_optimizers(self):\n"
        "        opt = torch.optim.SGD(self.parameters(), lr=0.05)\n"
        "        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]\n"
        "model = Model()\n"
        "g = torch.Generator().manual_seed(1)\n"
        "x, y = torch.randn(112, 4, generator=g), torch.randn(112, 1, generator=g)\n"
        "loader = DataLoader(TensorDataset(x[:96], y[:96]), batch_size=8, shuffle=True)\n"
        "val = DataLoader(TensorDataset(x[96:], y[96:]), batch_size=8)",
        "%%resilient\nfrom colab_resilience.integrations.lightning import ResilienceCallback\n"
        f"trainer = L.Trainer(max_epochs=4, accelerator='cpu', logger=CSVLogger('logs', name='run', version={version}),\n"
        "                    log_every_n_steps=2, enable_progress_bar=False, enable_checkpointing=False,\n"
        f"                    enable_model_summary=False, callbacks=[LearningRateMonitor(), ResilienceCallback({every_steps})])\n"
        "trainer.fit(model, loader, val)",
        "print('RESULT', os.path.relpath(trainer.logger.log_dir), sorted(os.listdir('logs/run')),\n"
        "      open(os.path.join(trainer.logger.log_dir, 'metrics.csv')).read().replace('\\n', '|'))",
    )


@pytest.mark.parametrize("fault,version,every_steps", [("kill", None, None), ("kill", 0, None), ("oom", None, None),
                                                       ("kill", None, 5), ("oom", 0, 5)],
                         ids=["killed", "killed-version-given", "out-of-memory", "killed-within-an-epoch",
                              "out-of-memory-within-an-epoch-version-given"])
def test_a_csv_loggers_file_holds_every_row_after_a_resume(tmp_path, fault, version, every_steps):
    """Lightning's CSVLogger writes its metrics.csv from the rows its writer holds: a resumed
    kernel's logged into the next version folder (or emptied the file, where a version was given)
    and wrote the steps from the resume on alone; a fit retried in the kernel made a new logger,
    which did the same (found by a probe; the first run now says nothing of it). Each checkpoint
    holds the logger's version and every row it logged, the resumed fit's logger gets them, and
    logs nothing until the fit is back where the safe point was taken (what the hooks before it log
    again, the learning rate as the epoch begins, is among them). The file is the twin's, line for
    line, in the twin's folder, and no other folder is made."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: csv_fit_notebook(fault, mark, version, every_steps),
                                              shared=f"lightning csv fit {version} {every_steps}")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert "colab_resilience:" not in harness.cell_text(twin.cells[2]), harness.cell_text(twin.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT logs/run/version_0 ['version_0'] epoch,lr-SGD,step,train_loss_epoch,"), \
        harness.result(nb)
    assert harness.result(nb).count("|") == 37, harness.result(nb)  # the header and 36 rows


@pytest.mark.parametrize("fault", ["kill", "oom"])
def test_safe_points_within_an_epoch_fall_between_accumulation_windows(tmp_path, fault):
    """With ``accumulate_grad_batches=3`` the first two batches leave ``global_step`` at 0, which
    ``every_steps=5`` divides: a safe point was taken after the first batch, in the middle of the
    window, whose gradient no checkpoint holds, and a fault after the second batch resumed there
    without it (found by a probe: the weights differed, the run said done). The next safe point
    within an epoch is due after an optimizer step: the fault goes back to the fit's start, and the
    run ends bit for bit as its twin."""
    model = """\
        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
            def training_step(self, batch, i):
                return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            def on_train_batch_end(self, outputs, batch, i):
                if (self.current_epoch, i) == (0, 1) and not os.path.exists(MARK):
                    open(MARK, "w").close(); {fault}
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        model = Model()""".replace("{fault}", _FIT_FAULTS[fault])
    result = ("print('RESULT', trainer.global_step, "
              "[t.detach().numpy().tobytes().hex() for t in model.state_dict().values()])")
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: _fit_notebook(
        fault, mark, model, result, trainer=", accumulate_grad_batches=3"), shared="lightning accumulating fit")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT 12 "), harness.result(nb)


def _precision_notebook(how: str, mark):
    """A fit whose module casts its batches to its own dtype, killed once after step 13 (a safe
    point after step 10): ``how`` is the Trainer's ``precision`` ("64-true", "bf16-true"), or where
    ``model.double()`` is made: "double-in-a-plain-cell" (after the %%replay cell that builds the
    module), "double-in-the-replay-cell"."""
    model = """\
        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            def training_step(self, batch, i):
                return torch.nn.functional.mse_loss(self.net(batch[0].to(self.dtype)), batch[1].to(self.dtype))
            {strike}
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=0.01)
        model = Model()""" + ("\n        model.double()" if how == "double-in-the-replay-cell" else "")
    nb = _fit_notebook("kill", mark, model, "print('RESULT', model.dtype, trainer.global_step, "
                       "[t.detach().float().numpy().tobytes().hex() for t in model.state_dict().values()])",
                       trainer=f", precision={how!r}" if how.endswith("-true") else "")
    if how == "double-in-a-plain-cell":
        nb.cells.insert(2, nbformat.v4.new_code_cell("_ = model.double()"))
    return nb


@pytest.mark.parametrize("how", ["64-true", "bf16-true", "double-in-a-plain-cell", "double-in-the-replay-cell"])
def test_a_module_in_another_precision_resumes_exactly_or_is_refused(tmp_path, how):
    """Lightning restores a checkpoint into the module as the set-up cells built it, before its
    precision converts it: with "64-true" the float64 weights went into float32 ones, lost their
    low bits, and the fit said done with other weights (found by a probe). They go into tensors of
    the saved dtype now, and the fit ends bit for bit as its twin (bfloat16's, into float32, lose
    nothing). ``model.double()`` in a plain cell: the new kernel's module was float32, the weights
    went in converted and the fit went on in float32, done; it is refused in one line now, and in
    the %%replay cell resumes bit for bit."""
    refused = ("cannot restore the Model module in place: the Model it holds now is not the one saved (other dtypes: "
               "net.0.weight float64 saved, float32 now" if how == "double-in-a-plain-cell" else None)
    _, nb, twin = harness.refused_or_twin(tmp_path, lambda mark: _precision_notebook(how, mark), refused)
    dtype = "torch.bfloat16" if how == "bf16-true" else "torch.float64"
    assert harness.result(twin).startswith(f"RESULT {dtype} 36 "), harness.result(twin)
