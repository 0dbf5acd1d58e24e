"""The Hugging Face ``Trainer`` with ``ResilienceCallback``: every optimizer step a safe point;
the model, optimizer, scheduler, ``TrainerState``, the Trainer's logging accumulators and the
random states go with each checkpoint, into the Trainer the replayed set-up cell rebuilt; a run
killed or out of memory goes on at its step (the Trainer skipping the finished epochs and batches),
bit-identical to its uninterrupted twin: weights, optimizer state, every logged loss and
``training_loss`` (the Trainer's own resume logs other losses: it restarts its accumulators).

Skipped where torch or transformers is not installed; CI's trainers stack (``.ci/run``) has them.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed (CI's trainers stack has it)")

import harness

pytestmark = pytest.mark.kernel


def load(tmp_path, **parameters):
    return harness.load("train_hf.ipynb", tmp_path, output_dir=str(tmp_path / "out"), **parameters)


def uninterrupted(tmp_path_factory, **parameters) -> str:
    """The RESULT of train_hf.ipynb run uninterrupted with ``parameters``, once in the session."""
    return harness.twin_result(tmp_path_factory, "train_hf.ipynb", load, **parameters)


def twin(tmp_path_factory) -> str:
    made = uninterrupted(tmp_path_factory)
    assert "step=30" in made
    return made


trained_steps = harness.by_kernel  # (kernel, step) for each step begun


@pytest.mark.parametrize("fault,fault_step,retries,every_steps,resume,optimizer", [
    ("sigkill", 12, 2, 1, 12, "trainer"), ("sigkill", 11, 2, 1, 11, "trainer"), ("oom-error", 12, 2, 1, 12, "trainer"),
    ("oom-error", 12, 0, 1, 12, "trainer"), ("sigkill", 12, 2, None, 11, "trainer"),
    ("sigkill", "end", 2, 1, None, "trainer"), ("sigkill", 1, 2, 1, 1, "trainer"),
    ("oom-error", 3, 2, None, 1, "trainer"), ("oom-error", 3, 2, None, 1, "given"),
], ids=["killed-mid-epoch", "killed-at-an-epoch-start", "out-of-memory", "out-of-memory-past-the-retries",
        "killed-saving-at-epochs-only", "killed-after-train-returned", "killed-before-the-first-steps-safe-point",
        "out-of-memory-before-the-first-epochs-end", "out-of-memory-before-the-first-epochs-end-optimizer-given"])
def test_a_trainer_killed_or_out_of_memory_goes_on_at_its_step_bit_identical(
        tmp_path, tmp_path_factory, fault, fault_step, retries, every_steps, resume, optimizer):
    """Supervised, with the standby kernel. The fault strikes after optimizer step 12 (epoch 2's
    second of 10) or 11 (its first): the last safe point is step 11 (taken when step 12 began,
    the Trainer having logged step 11) or 10, so the new kernel's Trainer goes on at step 12 or
    11: mid-epoch it skips the epoch's finished batches and takes the random state of the safe
    point, at an epoch's start the random state when that epoch began (which draws its order).
    An OOM is retried in the kernel from the same safe point, or past the retries in a new one.
    Without every_steps the safe points are the epochs' ends only: the run goes on at step 11.
    Killed after train() returned (its last safe point saved), the cell run again trains nothing
    and train() returns the training_loss it returned. Killed after step 1, before the safe point
    step 2 begins with, the run goes on from the one train() began with: the other callbacks get
    its state before they begin (given at the first epoch's start, it undid the epoch they had just
    counted, and the run said done with a count of 2 epochs of 3; found by check). An OOM after
    step 3 with safe points at the epochs' ends only is retried in the kernel from the checkpoint
    train() began with: train() keeps an optimizer it finds, and the failed attempt's AdamW, stepped
    3 times, trained the retry on with its moments, and its operations count went into total_flos
    (the run said done with other weights); now the optimizer goes back as it was then: none, so that
    train() makes it anew, or, given by Trainer(optimizers=...), its saved state."""
    reference = twin(tmp_path_factory) if optimizer == "trainer" else uninterrupted(tmp_path_factory, optimizer=optimizer)
    nb = load(tmp_path, fault=fault, fault_step=fault_step, retries=retries, every_steps=every_steps,
              optimizer=optimizer)
    # a standby only where the kernel is restarted: beside a retry in the kernel it would import
    # torch and transformers for nothing
    run, out = harness.run_ok(nb, tmp_path, standby=fault == "sigkill" or retries == 0)
    if fault == "sigkill" or retries == 0:
        assert len(run.restarts) == 1, out
        assert "restored the Trainer's model, optimizer, scheduler and state in " in out, out
    else:
        assert not run.restarts and "OOM (CUDA out of memory)" in out and "retry 1/2" in out, out
        assert "You are adding a" not in out  # the retry's new callback is the only one
    steps = [s for _, s in trained_steps(tmp_path / "events.log")]
    if resume is None:  # train() had returned: the new kernel trains nothing, and returns what it returned
        assert "the loop had finished" in out and steps == list(range(1, 31)), out
    else:  # the steps from the safe point to the fault are trained again, and none before them
        if run.restarts or resume > 1:  # (a retry from train()'s start says its retry only)
            assert f"continuing at step {resume}" in out, out
        assert steps == list(range(1, fault_step + 1)) + list(range(resume, 31))
    assert harness.result(nb) == reference


def losses(result: str) -> list[tuple[int, float]]:
    return ast.literal_eval(re.search(r" losses=(\[.*?\]) ", result).group(1))


@pytest.mark.parametrize("kill_step", [None, 20], ids=["out-of-memory", "out-of-memory-then-killed"])
def test_shrinking_the_trainers_batch_keeps_its_effective_batch(tmp_path, tmp_path_factory, kill_step):
    """--shrink trainer.args.per_device_train_batch_size: an OOM after step 12 halves the batch per
    device (4 → 2), and the callback doubles the gradient accumulation (1 → 2), so an optimizer
    step still takes the same 4 sequences: the run ends at step 30 as its twin does, and, without
    dropout (whose masks depend on the shapes drawn), with the twin's logged losses up to float
    rounding (each step's sums are made in two parts). Killed after step 20 as well, the kernel
    that takes over starts from the shrunk batch (the journal's) and raises the accumulation again."""
    reference = uninterrupted(tmp_path_factory, dropout=0.0)
    nb = load(tmp_path, fault="oom-error", fault_step=12, kill_step=kill_step, dropout=0.0,
              shrink="--shrink trainer.args.per_device_train_batch_size")
    run, out = harness.run_ok(nb, tmp_path, standby=kill_step is not None)
    assert "trainer.args.per_device_train_batch_size 4 → 2; retry 1/2" in out, out
    assert ("continuing at step 12 with trainer.args.per_device_train_batch_size 2 (what ran before it ran with "
            "trainer.args.per_device_train_batch_size 4)") in out, out
    assert "do not match the ones in the `trainer_state.json`" not in out, out
    kept = "colab_resilience: the Trainer's batch is 2 per device now; gradient accumulation 1 → 2 keeps the effective batch 4"
    assert out.count(kept) == (2 if kill_step else 1), out
    assert len(run.restarts) == (1 if kill_step else 0), out
    result = harness.result(nb)
    assert "step=30 " in result and "step=30 " in reference
    got, want = losses(result), losses(reference)
    assert [step for step, _ in got] == [step for step, _ in want] == [5, 10, 15, 20, 25, 30]
    assert all(abs(a - b) <= 2e-4 for (_, a), (_, b) in zip(got, want)), (got, want)


def test_a_kill_in_a_cell_after_the_training_finds_the_trained_trainer(tmp_path, tmp_path_factory):
    """Killed in the result cell, after the training cell ended (its run done): the new kernel
    replays the set-up cells, which build an untrained Trainer, and runs the training cell again
    silently, which loads the run's final state into it and trains nothing; the result cell, run
    again, sees the trained Trainer (its optimizer and training_loss too)."""
    reference = twin(tmp_path_factory)
    nb = load(tmp_path, fault="sigkill", fault_step="result")
    harness.run_killed_after_training(nb, tmp_path, "the Trainer's model, optimizer, scheduler and state")
    assert [s for _, s in trained_steps(tmp_path / "events.log")] == list(range(1, 31))  # none again
    assert harness.result(nb) == reference



def _classifier_notebook(mark):
    """A BERT sequence classifier built from a config (its first forward sets the config's
    ``problem_type``), trained by a Trainer with its printer (which takes ``total_flos`` out of the
    metrics ``train()`` returns) and evaluated at each epoch's end (which leaves it in eval mode);
    the result cell is killed once, after the training cell ended."""
    return harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport os, signal, torch, transformers\n"
        f"MARK = {str(mark)!r}\n"
        "from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments\n"
        "transformers.logging.set_verbosity_error()\ntorch.manual_seed(0)\n"
        "model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,\n"
        "    num_attention_heads=2, intermediate_size=32, num_labels=2))\n"
        "g = torch.Generator().manual_seed(1)\n"
        "data = [{'input_ids': x, 'labels': y} for x, y in zip(torch.randint(0, 50, (32, 8), generator=g),\n"
        "                                                      torch.randint(0, 2, (32,), generator=g))]\n"
        f"args = TrainingArguments(output_dir={str(mark) + '-out'!r}, num_train_epochs=2, per_device_train_batch_size=8,\n"
        "    save_strategy='no', eval_strategy='epoch', report_to=[], disable_tqdm=True, use_cpu=True, seed=0)\n"
        "trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8])",
        "%%resilient\nfrom colab_resilience.integrations.transformers import ResilienceCallback\n"
        "trainer.add_callback(ResilienceCallback())\nout = trainer.train()",
        "if not os.path.exists(MARK):\n    open(MARK, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "print('RESULT', model.config.problem_type, model.config.use_cache, sorted(out.metrics), out.training_loss,\n"
        "      'training' if model.training else 'eval')",
    )


def test_a_finished_train_brought_back_returns_what_it_returned_and_leaves_the_config_as_it_was(tmp_path):
    """Killed in the result cell: the training cell, run again silently, trains nothing and returns
    what train() returned (its metrics as its printer left them: without ``total_flos``, which only
    its log holds), the model's config is as the training left it (``problem_type``, set by the
    first forward, which the replayed set-up cell's model has not had), and so is its mode (the
    last evaluation's eval mode: the resumed train() had put it in train mode): before, all
    three differed."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, _classifier_notebook)
    assert len(run.restarts) == 1
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT single_label_classification False ['epoch', 'train_loss', "), \
        harness.result(nb)
    assert harness.result(nb).endswith(" eval"), harness.result(nb)


def _replay_start(mark, name: str, value, imports: str, staging_off: bool = False) -> str:
    """The start of a twin notebook's %%replay cell: ``MARK`` and ``name`` (its fault) bound, the
    Trainer and ``imports`` of transformers imported, its logging quiet, one thread, seeded; with
    ``staging_off``, each save done before the next step (where a fault resumes is known)."""
    return ("%%replay\nimport os, signal, torch\n" +
            ("%config ResilienceMagics.staging_memory = 'off'\n" if staging_off else "") +
            f"MARK, {name} = {str(mark)!r}, {value!r}\n"
            f"from transformers import {imports}, Trainer, TrainerCallback, TrainingArguments, set_seed\n"
            "import transformers\ntransformers.logging.set_verbosity_error()\ntorch.set_num_threads(1)\nset_seed(0)\n")


def _unfreezing_notebook(mark, kill_step: int):
    """A GPT-2 whose token embedding a callback freezes as training begins and unfreezes as the
    second epoch begins, by its own count of the epochs begun (as a notebook's "unfreeze after N
    epochs" callback does); 4 epochs of 10 steps, a safe point every 3 steps; a SIGKILL after
    ``kill_step``, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _replay_start(mark, "KILL_STEP", kill_step, "GPT2Config, GPT2LMHeadModel", staging_off=True) +
        "g = torch.Generator().manual_seed(1)\n"
        "data = [{'input_ids': t, 'labels': t} for t in torch.randint(0, 64, (40, 16), generator=g)]\n"
        "model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))\n"
        "class Unfreeze(TrainerCallback):\n"
        "    def __init__(self):\n        self.begun = 0\n"
        "    def on_train_begin(self, args, state, control, model=None, **kwargs):\n"
        "        model.transformer.wte.weight.requires_grad_(False)\n"
        "    def on_epoch_begin(self, args, state, control, model=None, **kwargs):\n"
        "        self.begun += 1\n"
        "        if self.begun == 2:\n            model.transformer.wte.weight.requires_grad_(True)\n"
        "        print('epoch', self.begun, 'begins')\n"
        "class Kill(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        "        if state.global_step == KILL_STEP and not os.path.exists(MARK):\n"
        "            open(MARK, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n"
        f"args = TrainingArguments(output_dir={str(mark) + '-out'!r}, per_device_train_batch_size=4, num_train_epochs=4,\n"
        "    learning_rate=3e-3, save_strategy='no', report_to=[], disable_tqdm=True, use_cpu=True, seed=0)\n"
        "unfreeze = Unfreeze()\ntrainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[unfreeze, Kill()])",
        "%%resilient\nfrom colab_resilience.integrations.transformers import ResilienceCallback\n"
        "trainer.add_callback(ResilienceCallback(every_steps=3))\nout = trainer.train()",
        "import hashlib\n"
        "print('RESULT', unfreeze.begun, trainer.state.global_step, out.training_loss,\n"
        "      hashlib.sha256(b''.join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:16])",
    )


@pytest.mark.parametrize("kill_step", [25, 21], ids=["within-an-epoch", "at-an-epochs-start"])
def test_a_callback_that_acts_as_an_epoch_begins_acts_as_in_the_uninterrupted_run(tmp_path, kill_step):
    """The resumed train() begins its epoch again, and the notebook's callbacks' on_epoch_begin
    ran again, with the state a new kernel gives them (a count of 0: the embedding frozen again
    for the rest of the run; the run said done with other weights, found by a probe), and then
    counted that epoch twice. Their on_train_begin froze the embedding again, too. Every safe point is taken as a step begins, after its epoch's
    hooks: what they did is in the checkpoint, and the epoch the run goes on with is not begun
    again for them (its line is not printed twice); what the other hooks before the first step
    change (the model's requires_grad flags, the optimizer and scheduler, the callbacks' state)
    goes back to the safe point's as it begins. Killed after step 25 the run goes on within the
    third epoch (at step 25), after step 21 at that epoch's start."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: _unfreezing_notebook(mark, kill_step))
    assert len(run.restarts) == 1
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(twin).startswith("RESULT 4 40 "), harness.result(twin)
    after = harness.cell_text(nb.cells[2]).split("resumed run", 1)[1]
    assert f"continuing at step {kill_step}" in after, after
    assert re.findall(r"epoch \d begins", after) == ["epoch 4 begins"], after


def _changed_notebook(change: str, where: str, mark, data: str = "list"):
    """A GPT-2 and its Trainer (2 epochs of 4 steps) built in a %%replay cell, ``change`` made in a
    plain cell after it ("plain-cell") or at that cell's end ("replay-cell"); killed once after
    step 3. ``data``: the Trainer's, a list of examples, or a Hugging Face ``datasets.Dataset``
    ("hf"; "hf-read": the training cell hands ``data`` to the Trainer again before ``train``)."""
    examples = ("data = [{'input_ids': t, 'labels': t} for t in torch.randint(0, 64, (16, 8), generator=g)]\n"
                if data == "list" else
                "import datasets\nt = torch.randint(0, 64, (16, 8), generator=g).tolist()\n"
                "data = datasets.Dataset.from_dict({'input_ids': t, 'labels': t})\n")
    return harness.notebook(
        "%load_ext colab_resilience",
        _replay_start(mark, "KILL_STEP", 3, "GPT2Config, GPT2LMHeadModel", staging_off=True) +
        "g = torch.Generator().manual_seed(1)\n" + examples +
        "model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2))\n"
        "class Kill(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        "        if state.global_step == KILL_STEP and not os.path.exists(MARK):\n"
        "            open(MARK, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n"
        f"args = TrainingArguments(output_dir={str(mark) + '-out'!r}, per_device_train_batch_size=4, num_train_epochs=2,\n"
        "    learning_rate=3e-3, save_strategy='no', report_to=[], disable_tqdm=True, use_cpu=True, seed=0)\n"
        "trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Kill()])\n"
        + (change + "\n" if where == "replay-cell" else ""),
        change if where == "plain-cell" else "pass",
        "%%resilient\nfrom colab_resilience.integrations.transformers import ResilienceCallback\n"
        + ("trainer.train_dataset = data\n" if data == "hf-read" else "") +
        "trainer.add_callback(ResilienceCallback())\nout = trainer.train()",
        "import hashlib\n"
        "print('RESULT', trainer.state.global_step, out.training_loss, next(model.parameters()).dtype,\n"
        "      hashlib.sha256(b''.join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:16])",
    )


@pytest.mark.parametrize("where", ["plain-cell", "replay-cell"])
def test_a_model_a_plain_cell_made_float64_is_not_trained_on_in_float32_after_a_kill(tmp_path, where):
    """``model.double()`` in a plain cell: killed in train(), the new kernel's replay built the model
    in float32, the Trainer's state went in converted (load_state_dict converts), and training went
    on in float32, "done" with other weights (found by a probe; check said DIFFERS). The run stops
    with the line that names the dtypes and where to change them; made in the %%replay cell, the
    run resumes bit for bit as its twin, in float64."""
    refused = ("cannot restore the Trainer's model in place: the GPT2LMHeadModel it holds now is "
               "not the one saved (other dtypes: transformer.wte.weight float64 saved, float32 now"
               if where == "plain-cell" else None)
    _, nb, twin = harness.refused_or_twin(tmp_path, lambda mark: _changed_notebook("_ = model.double()", where, mark),
                                          refused)
    assert harness.result(twin).startswith("RESULT 8 ") and " torch.float64 " in harness.result(twin)


_SHUFFLED = "trainer.train_dataset = trainer.train_dataset.shuffle(seed=1)"


@pytest.mark.parametrize("change,where,refused,steps,data", [
    ("trainer.args.num_train_epochs = 3", "plain-cell", "(args.num_train_epochs 2 now, 3 saved)", 12, "list"),
    ("trainer.args.per_device_train_batch_size = 8", "plain-cell", "(args.per_device_train_batch_size 4 now, 8 saved)",
     4, "list"),
    ("trainer.train_dataset = data[:12]", "plain-cell",
     "(len(train_dataset) 16 now, 12 saved; what train_dataset holds differs)", 6, "list"),
    ("trainer.args.num_train_epochs = 3", "replay-cell", None, 12, "list"),
    (_SHUFFLED, "plain-cell", "(what train_dataset holds differs)", 8, "hf"),
    (_SHUFFLED, "replay-cell", None, 8, "hf"),
    ("data = data.shuffle(seed=1)", "plain-cell", "data is not what the run began with: a cell that is not replayed "
     "had changed it since the %%replay cells ran (said as the run began)", 8, "hf-read"),
], ids=["epochs-in-a-plain-cell", "batch-in-a-plain-cell", "data-in-a-plain-cell", "epochs-in-the-replay-cell",
        "hf-dataset-shuffled-in-a-plain-cell", "hf-dataset-shuffled-in-the-replay-cell",
        "hf-dataset-the-cell-reads-shuffled-in-a-plain-cell"])
def test_a_trainer_a_plain_cell_set_up_otherwise_is_not_lost_silently_by_a_kill(tmp_path, change, where, refused,
                                                                               steps, data):
    """``trainer.args.num_train_epochs = 3`` in a plain cell: killed in train(), the new kernel's
    Trainer had the %%replay cell's 2 epochs, and train() stopped there, "done" with 8 steps of 12
    (found by a probe); a per-device batch set so was taken for a --shrink, its accumulation
    raised; a subset of the data set so was trained on whole. The arguments, the data's length and
    a digest of what it holds (data in another order, of the same length, was trained on as the
    %%replay cell made it) go with the Trainer's state, and a resume with others stops in one line
    that names them; set in the %%replay cell, the run resumes bit for bit as its twin. A Hugging
    Face ``datasets.Dataset`` shuffled in a plain cell (the Trainer's, or one the training cell
    hands it) was compared by its length alone, and trained on unshuffled, "done" (found by a
    probe); it is compared by every row in its order now, the same in two kernels."""
    if data != "list":
        pytest.importorskip("datasets", reason="datasets is not installed (CI's trainers stack has it)")
    if refused is not None and refused.startswith("("):
        refused = "cannot resume the Trainer's run: the Trainer is not set up as the run began with it " + refused
    _, nb, twin = harness.refused_or_twin(tmp_path, lambda mark: _changed_notebook(change, where, mark, data),
                                          refused)
    assert harness.result(twin).startswith(f"RESULT {steps} "), harness.result(twin)


def _neftune_notebook(mark, fault: str):
    """A GPT-2 trained with NEFTune (noise added to its embeddings' output by a forward hook the
    Trainer adds as train() begins and removes as it ends); 3 epochs of 10 steps, a safe point
    every 3 steps; an out-of-memory error after step 7 (``fault = "oom"``), or a SIGKILL in the
    result cell once the training cell has ended (``"kill-after"``), once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _replay_start(mark, "FAULT", fault, "GPT2Config, GPT2LMHeadModel") +
        "g = torch.Generator().manual_seed(1)\n"
        "data = [{'input_ids': t, 'labels': t} for t in torch.randint(0, 64, (40, 16), generator=g)]\n"
        "model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))\n"
        "class Oom(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        "        if FAULT == 'oom' and state.global_step == 7 and not os.path.exists(MARK):\n"
        "            open(MARK, 'w').close(); raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        f"args = TrainingArguments(output_dir={str(mark) + '-out'!r}, per_device_train_batch_size=4, num_train_epochs=3,\n"
        "    learning_rate=3e-3, save_strategy='no', report_to=[], disable_tqdm=True, use_cpu=True, seed=0,\n"
        "    neftune_noise_alpha=5.0)\n"
        "trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Oom()])",
        "%%resilient\nfrom colab_resilience.integrations.transformers import ResilienceCallback\n"
        "trainer.add_callback(ResilienceCallback(every_steps=3))\nout = trainer.train()",
        "import hashlib\n"
        "if FAULT == 'kill-after' and not os.path.exists(MARK):\n"
        "    open(MARK, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "wte = model.transformer.wte\n"
        "print('RESULT', len(wte._forward_hooks), hasattr(wte, 'neftune_noise_alpha'), trainer.state.global_step, out.training_loss,\n"
        "      hashlib.sha256(b''.join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:16])",
    )


@pytest.mark.parametrize("fault", ["oom", "kill-after"])
def test_neftunes_noise_is_added_once_and_gone_when_training_ends(tmp_path, fault):
    """NEFTune's hook, added as train() begins, was left on the embedding by a train() an
    out-of-memory error ended, and the retry added a second: the noise was added twice and the
    run said done with other weights (found by a probe). Now the hook goes with the call that
    added it; bit for bit as the twin, without hook or setting at the end. Killed after the
    training, the finished train() brought back (which removes the hook its set-up added, and
    puts the model's plain attributes back) ends so too."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: _neftune_notebook(mark, fault), shared="hf neftune")
    assert len(run.restarts) == (fault == "kill-after"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(twin).startswith("RESULT 0 False 30 "), harness.result(twin)


def _grouped_notebook(mark, fault: str):
    """A GPT-2 trained on sequences of 4 to 15 tokens in batches of like length
    (``train_sampling_strategy="group_by_length"``: LengthGroupedSampler draws each epoch's order
    from torch's global random state as the epoch's data loader starts); 3 epochs of 10 steps, a
    safe point every 3 steps; after step 14 (within the second epoch) a SIGKILL or an
    out-of-memory error, once (``"kill-twice"``: a SIGKILL after step 17 as well, in the faulted run
    only: the twin that the cases share is uninterrupted whichever case makes it)."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _replay_start(mark, "FAULT", fault, "GPT2Config, GPT2LMHeadModel", staging_off=True) +
        "g = torch.Generator().manual_seed(1)\n"
        "data = [{'input_ids': torch.randint(0, 64, (int(n),), generator=g).tolist()} for n in torch.randint(4, 16, (40,), generator=g)]\n"
        "def pad(batch):\n"
        "    n = max(len(b['input_ids']) for b in batch)\n"
        "    ids = torch.tensor([b['input_ids'] + [0] * (n - len(b['input_ids'])) for b in batch])\n"
        "    mask = torch.tensor([[1] * len(b['input_ids']) + [0] * (n - len(b['input_ids'])) for b in batch])\n"
        "    return {'input_ids': ids, 'attention_mask': mask, 'labels': ids.masked_fill(mask == 0, -100)}\n"
        "model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))\n"
        "class Fault(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        "        for step, record in ((14, MARK), (17, MARK + '.2')):\n"
        "            # the second after the first struck in this run (its record holds the step; a twin's MARK, made\n"
        "            # beforehand, is empty)\n"
        "            second = FAULT == 'kill-twice' and os.path.exists(MARK) and os.path.getsize(MARK) > 0\n"
        "            if state.global_step == step and (step == 14 or second) and not os.path.exists(record):\n"
        "                open(record, 'w').write(str(step))\n"
        "                if FAULT == 'oom':\n"
        "                    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        "                os.kill(os.getpid(), signal.SIGKILL)\n"
        f"args = TrainingArguments(output_dir={str(mark) + '-out'!r}, per_device_train_batch_size=4, num_train_epochs=3,\n"
        "    learning_rate=3e-3, save_strategy='no', report_to=[], disable_tqdm=True, use_cpu=True, seed=0,\n"
        "    train_sampling_strategy='group_by_length', remove_unused_columns=False)\n"
        "trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=pad, callbacks=[Fault()])",
        "%%resilient\nfrom colab_resilience.integrations.transformers import ResilienceCallback\n"
        "trainer.add_callback(ResilienceCallback(every_steps=3))\nout = trainer.train()",
        "import hashlib\n"
        "print('RESULT', trainer.state.global_step, out.training_loss,\n"
        "      hashlib.sha256(b''.join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:16])",
    )


@pytest.mark.parametrize("fault", ["kill", "oom", "kill-twice"])
def test_an_epochs_order_drawn_from_the_global_random_state_is_drawn_again_within_it(tmp_path, fault):
    """LengthGroupedSampler draws each epoch's order from torch's global random state as the
    epoch's data loader starts. A run resumed within an epoch drew it from the state the resumed
    train() had there (the Trainer puts the safe point's state back only after skipping the
    epoch's finished batches): other batches, and the run said done with other weights (found by
    a probe). The state the epoch began with goes back before its order is drawn; and the
    checkpoints the resumed epoch takes keep that state as its beginning (a second kill in it
    drew the order from the resumed kernel's). Bit for bit as the twin."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: _grouped_notebook(mark, fault), shared="hf grouped")
    assert len(run.restarts) == {"kill": 1, "oom": 0, "kill-twice": 2}[fault], harness.cell_text(nb.cells[2])
    assert "continuing at step 13" in harness.cell_text(nb.cells[2]), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(twin).startswith("RESULT 30 "), harness.result(twin)


def test_a_trainer_killed_in_a_kernel_goes_on_when_its_cell_runs_again(kernel, tmp_path, tmp_path_factory):
    """Interactive, as in Jupyter: the kernel dies after step 12, the user runs the training cell
    again: the set-up cell is replayed (a new Trainer), and train() goes on at step 12."""
    reference = twin(tmp_path_factory)
    nb = load(tmp_path, fault="sigkill")
    out = harness.killed_and_rerun(kernel, nb)
    assert "replayed 3 cells, restored the Trainer's model, optimizer, scheduler and state in " in out, out
    assert "continuing at step 12" in out
    assert harness.result(kernel.ok(harness.user_cell(nb, "result")).stdout) == reference


def test_a_stopped_trainers_cell_run_again_on_the_model_it_trained_is_refused(kernel, tmp_path, tmp_path_factory):
    """train() stopped by an error after step 12 (the stop button does the same), its cell run
    again without the set-up cell: it began at step 0 on the model the stopped train() had trained
    (the Trainer holds it; no --save names it), dropped the checkpoint and ended "done" with 42
    steps trained. Refused in one line naming the Trainer; `%resilience resume` (which says the
    Trainer's state comes back as the training begins), then the cell: it goes on at step 12 and
    ends as the uninterrupted twin, bit for bit."""
    reference = twin(tmp_path_factory)
    nb = load(tmp_path, fault="error")
    r = harness.stopped_and_run_again(kernel, nb)
    assert r.status == "error" and "stopped at step 12, and trainer holds what its training left, not what the set-up " \
        "cells made" in r.evalue, (r.evalue, r.stdout)
    out = kernel.ok("%resilience resume").stdout
    assert "restored nothing (the Trainer's model, optimizer, scheduler and state come back as the training begins)" \
        in out, out
    out = kernel.ok(harness.user_cell(nb, "train")).stdout
    assert "continuing at step 12" in out, out
    assert harness.result(kernel.ok(harness.user_cell(nb, "result")).stdout) == reference


def test_what_the_callback_refuses_and_where_it_does_nothing(kernel, tmp_path):
    """Without it, the first run of a %%resilient train() says how to add it. Outside a
    %%resilient cell it says so once and the Trainer trains as usual; inside one,
    train(resume_from_checkpoint=...) is refused in one line (the run resumes from its own
    checkpoints), and so is a callback added outside the cell (the cell would not be run as a
    loop of steps, and a resume would train from step 0)."""
    nb = load(tmp_path, epochs=1)
    harness.run_interactive(kernel, nb, stop="train")
    # without it, train() has no safe point inside: a restart would train from step 0; said once
    reply = kernel.ok("%%resilient\ntrainer.train()")
    assert reply.stdout.count(
        "colab_resilience: trainer.train() (Hugging Face) has no safe point inside it: after a restart or an "
        "out-of-memory error it trains again from its first epoch; to go on after the last finished one, call "
        "trainer.add_callback(ResilienceCallback()) before it (from colab_resilience.integrations.transformers "
        "import ResilienceCallback)") == 1, reply.stdout
    body = harness.user_cell(nb, "train").split("\n", 1)[1]  # without %%resilient
    reply = kernel.ok(body)
    assert reply.stderr.count("colab_resilience: ResilienceCallback outside a %%resilient cell: nothing is "
                              "checkpointed") == 1, reply.stderr
    reply = kernel.execute("%%resilient\ntrainer.add_callback(ResilienceCallback())\n"
                           "trainer.train(resume_from_checkpoint='out/checkpoint-5')")
    assert reply.status == "error" and reply.evalue == (
        "colab_resilience: a Trainer with ResilienceCallback resumes from the run's own checkpoints; call "
        "trainer.train() without resume_from_checkpoint"), reply.evalue
    kernel.ok("trainer.add_callback(ResilienceCallback())")
    reply = kernel.execute("%%resilient\ntrainer.train()")
    assert reply.status == "error" and reply.evalue.startswith(
        "colab_resilience: ResilienceCallback was made outside the %%resilient cell that trains"), reply.evalue


def test_a_callbacks_state_that_cannot_be_saved_is_said_once_before_training(kernel, tmp_path):
    """The Trainer's other callbacks' plain attributes and tensors go with each checkpoint
    (train_hf.ipynb's `seen`, compared in every twin test); one holding something else (a lock) is
    named in one line before training starts, once, and training goes on."""
    nb = load(tmp_path, epochs=1)
    harness.run_interactive(kernel, nb, stop="train")
    kernel.ok("import threading\n"
              "class Best(TrainerCallback):\n"
              "    def __init__(self):\n"
              "        self.patience, self.best, self.lock = 3, torch.tensor(0.0), threading.Lock()\n"
              "trainer.add_callback(Best())")
    reply = kernel.ok("%%resilient\nfrom colab_resilience.integrations.transformers import ResilienceCallback\n"
                      "trainer.add_callback(ResilienceCallback())\nprint(trainer.train().global_step)")
    line = ("colab_resilience: the state of the Trainer's callbacks goes with each checkpoint, but not Best.lock (not "
            "plain values or tensors): after a resume they hold what the callback has in this kernel")
    assert (reply.stdout + reply.stderr).count(line) == 1, reply.stdout + reply.stderr
    assert reply.stdout.strip().endswith("10"), reply.stdout


def test_a_data_collator_that_draws_random_numbers_is_said_once_where_a_resume_within_an_epoch_would_differ(
        kernel, tmp_path):
    """A collator that masks tokens at random (as DataCollatorForLanguageModeling does) makes a
    step's batches before its safe point; its batches are made again on resume from the random
    states kept for them (test_a_masking_collators_batches_are_made_again_from_the_same_random_states).
    Where they cannot be (``ignore_data_skip``: the resumed epoch makes its batches from its first
    again), with every_steps its first batch says so, once; not without every_steps (resumes at
    epochs' starts, which are exact), not where they can, and not for a collator that draws
    nothing. Made in worker processes, its batches are not seen here: unless it is one of the
    Trainer's collators that draw nothing, that is said as training begins. The collator is the
    notebook's again after train(), for evaluation too."""
    nb = load(tmp_path, epochs=1)
    harness.run_interactive(kernel, nb, stop="train")
    kernel.ok("def masking(features):\n"
              "    ids = torch.stack([f['input_ids'] for f in features])\n"
              "    return {'input_ids': ids, 'labels': ids.masked_fill(torch.rand(ids.shape) > 0.3, -100)}\n"
              "plain = trainer.data_collator")
    line = ("colab_resilience: the Trainer's data collator (masking) draws random numbers as it makes each batch, and "
            "the Trainer's ignore_data_skip makes an epoch's batches from its first again: a resume within an epoch "
            "makes them again from other random numbers")
    in_workers = ("colab_resilience: the Trainer's data collator (masking) runs in the data loader's 2 worker "
                  "processes, whose random states cannot be kept: if it draws random numbers as it makes each batch")
    for every, collator, skip, workers, said in [
            (3, "masking", True, 0, line), (None, "masking", True, 0, None), (3, "masking", False, 0, None),
            (3, "plain", True, 0, None), (3, "masking", False, 2, in_workers), (3, "plain", False, 2, None)]:
        reply = kernel.ok(f"%%resilient\nfrom colab_resilience.integrations.transformers import ResilienceCallback\n"
                          f"trainer.data_collator = {collator}; trainer.args.ignore_data_skip = {skip}\n"
                          f"trainer.args.dataloader_num_workers = {workers}\n"
                          f"trainer.add_callback(ResilienceCallback(every_steps={every}))\nprint(trainer.train().global_step)")
        out = reply.stdout + reply.stderr
        assert out.count("the Trainer's data collator") == (said is not None) and (said is None or said in out), out
        assert reply.stdout.strip().endswith("10"), out
        assert kernel.value(f"trainer.data_collator is {collator} and 'get_train_dataloader' not in vars(trainer)")


def _masking_notebook(mark, fault: str, seed, every):
    """A BERT trained for masked language modelling by DataCollatorForLanguageModeling (15% of the
    tokens masked at random, from torch's global random state, or with ``seed`` from a generator of
    the collator's own): 3 epochs of 6 optimizer steps of 2 batches of 4 (the Trainer makes a
    step's 2 batches and, with accelerate, the next one before the step's safe point); with
    ``every``, a safe point every that many steps. After step 9 (within the second epoch, past
    its second step) a SIGKILL or an out-of-memory error, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _replay_start(mark, "FAULT", fault, "BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, "
                      "PreTrainedTokenizerFast", staging_off=True) +
        "from tokenizers import Tokenizer, models\n"
        "vocab = {t: i for i, t in enumerate(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + [f'w{i}' for i in range(59)])}\n"
        "tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token='[UNK]')), pad_token='[PAD]',\n"
        "                              unk_token='[UNK]', cls_token='[CLS]', sep_token='[SEP]', mask_token='[MASK]')\n"
        "g = torch.Generator().manual_seed(1)\n"
        "data = [{'input_ids': t} for t in torch.randint(5, 64, (48, 12), generator=g).tolist()]\n"
        "model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,\n"
        "                                   intermediate_size=64, max_position_embeddings=16))\n"
        "class Fault(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        "        if state.global_step == 9 and not os.path.exists(MARK):\n"
        "            open(MARK, 'w').close()\n"
        "            if FAULT == 'oom':\n"
        "                raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        f"args = TrainingArguments(output_dir={str(mark) + '-out'!r}, per_device_train_batch_size=4, num_train_epochs=3,\n"
        "    gradient_accumulation_steps=2, learning_rate=3e-3, save_strategy='no', report_to=[], disable_tqdm=True,\n"
        "    use_cpu=True, seed=0)\n"
        f"collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed={seed!r})\n"
        "trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator, callbacks=[Fault()])",
        "%%resilient\nfrom colab_resilience.integrations.transformers import ResilienceCallback\n"
        f"trainer.add_callback(ResilienceCallback(every_steps={every!r}))\nout = trainer.train()",
        "import hashlib\n"
        "print('RESULT', trainer.state.global_step, out.training_loss, [l['loss'] for l in trainer.state.log_history if 'loss' in l],\n"
        "      hashlib.sha256(b''.join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:16])",
    )


@pytest.mark.parametrize("fault,seed,every", [("kill", None, 2), ("oom", None, 2), ("kill", 7, 2), ("oom", 7, 2),
                                              ("kill", 7, None)],
                         ids=["killed", "out-of-memory", "own-generator-killed", "own-generator-out-of-memory",
                              "own-generator-killed-at-epochs"])
def test_a_masking_collators_batches_are_made_again_from_the_same_random_states(tmp_path, fault, seed, every):
    """DataCollatorForLanguageModeling masks each batch at random as it makes it, and the Trainer
    makes a step's batches (and the next one) before the step's safe point: a resume within an
    epoch made them again from other random numbers (said in one line, before), and with a seed of
    its own the collator's generator, made anew by the set-up cell, drew every batch after a
    resume otherwise, at an epoch's start too, with nothing said (found by a probe). The random
    states each batch was made from go with the checkpoint, and a resume makes them again from
    them: bit for bit as the twin, and nothing said."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: _masking_notebook(mark, fault, seed, every),
                                              shared=f"hf masking {seed!r} {every!r}")
    out = harness.cell_text(nb.cells[2])
    assert len(run.restarts) == (fault == "kill"), out
    assert ("continuing at step 9" if every else "continuing at step 7") in out, out
    assert "draws random numbers" not in out, out
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(twin).startswith("RESULT 18 "), harness.result(twin)


@pytest.mark.parametrize("chunk", [None, 64], ids=["whole", "a-row-at-a-time"])
def test_a_hugging_face_dataset_is_fingerprinted_by_every_row_in_its_order(monkeypatch, chunk):
    """The same rows built twice fingerprint the same; one token changed in the last row, a shuffle,
    a shuffle by another seed, a contiguous select (a slice of the same table) or another format do
    not; a ``DatasetDict`` by its splits. With a small slice of rows, the last slice counts too."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (CI's trainers stack has it)")
    import numpy as np

    from colab_resilience import setup_state

    if chunk is not None:
        monkeypatch.setattr(setup_state, "CHUNK", chunk)

    def fp(value):
        return setup_state.fingerprint({"v": value}, ["v"])["v"]

    def built(rows):
        return datasets.Dataset.from_dict({"input_ids": rows, "text": [str(r) for r in rows], "labels": list(range(100))})

    rows = np.random.default_rng(0).integers(0, 64, (100, 8)).tolist()
    edited = [list(r) for r in rows]
    edited[99][7] += 1
    data = built(rows)
    assert fp(data) == fp(built(rows)) and setup_state.plain_data(data)
    assert fp(data.shuffle(seed=1)) == fp(built(rows).shuffle(seed=1))
    others = [built(edited), data.shuffle(seed=1), data.shuffle(seed=2), data.select(range(99)),
              data.with_format("torch")]
    assert len({fp(data), *map(fp, others)}) == 1 + len(others)
    assert fp(datasets.DatasetDict(train=data)) == fp(datasets.DatasetDict(train=built(rows))) != \
        fp(datasets.DatasetDict(train=built(edited)))


def test_colab_resilience_check_passes_the_trainer_notebook(tmp_path):
    """Kills between safe points, during a save and before one, and an out-of-memory error raised
    in the Trainer's own code (below the wrapped train(), which the injected error used to treat
    as this package's and never fired in)."""
    r = subprocess.run(
        [sys.executable, "-m", "colab_resilience", "check", str(harness.FILES / "train_hf.ipynb"), "--faults", "4",
         "--seed", "1", "--kernel", harness.KERNEL_NAME, "-p", "mark", str(tmp_path / "mark"),
         "-p", "output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=400, check=False, env=harness.child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "an out-of-memory error" in r.stdout and "never fired" not in r.stdout, r.stdout
    assert "identical after each of 4 faults" in r.stdout, r.stdout


def test_colab_resilience_check_passes_the_shipped_trainer_notebook(tmp_path):
    """notebooks/trainer.ipynb, the Colab-ready fine-tune (a small BERT built from its config,
    offline): identical after each fault. Run from a copy: its runs write the Trainer's output
    folder beside it. Seed 0 aims a kill at the last stretch, which on a slow machine lands after
    the training cell has ended (the supervisor runs that cell again to put the Trainer back)."""
    (tmp_path / "trainer.ipynb").write_bytes((Path(harness.REPO) / "notebooks" / "trainer.ipynb").read_bytes())
    r = subprocess.run(
        [sys.executable, "-m", "colab_resilience", "check", str(tmp_path / "trainer.ipynb"), "--faults", "3",
         "--seed", "0", "--kernel", harness.KERNEL_NAME],
        capture_output=True, text=True, timeout=400, check=False, env=harness.child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical after each of 3 faults" in r.stdout, r.stdout
