"""Keras ``fit`` with ``ResilienceCallback``: every epoch a safe point; the model's and the
optimizer's variables (the dropout seed state among them), Keras's global seed generator, the
epochs' logs and TensorFlow's random state are saved with each checkpoint and put back into the
model the replayed set-up cell rebuilt; a fit killed or out of memory mid-epoch goes on at that
epoch, without training the finished ones again, bit-identical to its uninterrupted twin, in a
kernel that never imports torch. Where a resume cannot be identical (no seed set, a tf.data
pipeline that reshuffles each epoch), the callback says so in one line before training starts.

Skipped where TensorFlow/Keras 3 is not installed; CI's framework stack (``.ci/run``) has them and
no torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (CI's framework stack has it)")
keras = pytest.importorskip("keras", minversion="3", reason="Keras 3 is not installed (CI's framework stack has it)")

import harness
import nbformat
import numpy as np

from colab_resilience.checkpoints import CheckpointStore
from colab_resilience.errors import CheckpointError
from colab_resilience.integrations.keras import STATE, FitState

FIT_EPOCHS = "fit.log"


def build(width: int = 8):
    """What a set-up cell builds (the same every time)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.5), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def values(variables) -> list[bytes]:
    return [v.numpy().tobytes() for v in variables]


def test_a_fits_state_is_saved_and_assigned_into_the_rebuilt_model_and_optimizer(tmp_path):
    x, y = np.random.default_rng(0).normal(size=(2, 32, 4)).astype("float32")
    model = build()
    model.fit(x, y[:, :1], epochs=2, batch_size=8, verbose=0)
    state = FitState(model)
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({STATE: state}, [STATE], strict=True)

    fresh = build()
    weights, optimizer = fresh.variables, fresh.optimizer
    assert values(fresh.variables) != values(model.variables)  # it did train
    into = FitState(fresh)
    store.load().restore({STATE: into}, [STATE])
    assert fresh.optimizer is optimizer and all(a is b for a, b in zip(fresh.variables, weights))  # in place
    assert values(fresh.variables) == values(model.variables)  # weights, BatchNormalization's statistics, seed state
    assert values(fresh.optimizer.variables) == values(model.optimizer.variables)  # step, moments
    assert into.epochs == [0, 1] and into.logs == model.history.history and len(into.logs["loss"]) == 2
    # the restored model trains on exactly as the saved one does (Dropout draws the same mask)
    model.fit(x, y[:, :1], epochs=1, batch_size=8, verbose=0, shuffle=False)
    fresh.fit(x, y[:, :1], epochs=1, batch_size=8, verbose=0, shuffle=False)
    assert values(fresh.variables) == values(model.variables)


def loop_build():
    """What the set-up cell of a custom training loop builds: a Sequential without an Input (built
    by its first call), an Adam (built by its first step), a metric."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    return model, keras.optimizers.Adam(1e-2), keras.metrics.Mean()


def loop_step(model, opt, metric, x, y) -> None:
    with tf.GradientTape() as tape:
        loss = keras.ops.mean((model(x, training=True) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    metric.update_state(loss)


def test_a_keras_model_optimizer_and_metric_in_save_are_restored_into_the_rebuilt_ones(tmp_path, ip):
    """`--save opt,model,loss_mean` with a custom GradientTape loop: their variables are saved and
    assigned into the objects the replayed set-up cell rebuilt, built first (the model from its
    build config, the optimizer for the model's variables, whichever of the two comes first):
    the same objects, the saved values, and a next step bit for bit as the saved ones' (Dropout
    draws the same mask). Pickled, they came back as new objects, the optimizer without its
    variables; then they were refused. check compares them by what their variables hold."""
    from colab_resilience.kernelapi import state_digest

    x, y = np.random.default_rng(0).normal(size=(2, 16, 4)).astype("float32")
    model, opt, metric = loop_build()
    for _ in range(3):
        loop_step(model, opt, metric, x, y[:, :1])
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({"opt": opt, "model": model, "loss_mean": metric}, ["opt", "model", "loss_mean"], strict=True)

    fresh = loop_build()
    assert not fresh[0].built and not fresh[1].built
    ns = dict(zip(["model", "opt", "loss_mean"], fresh))
    store.load().restore(ns, ["opt", "model", "loss_mean"])
    assert all(ns[k] is v for k, v in zip(["model", "opt", "loss_mean"], fresh))  # in place
    for a, b in zip((model, opt, metric), fresh):
        assert values(b.variables) == values(a.variables)  # weights, statistics, seed state, moments, step
    loop_step(model, opt, metric, x, y[:, :1])
    loop_step(*fresh, x, y[:, :1])
    for a, b in zip((model, opt, metric), fresh):
        assert values(b.variables) == values(a.variables)
    ip.user_ns.update(a=loop_build()[0], b=loop_build()[0], c=model)
    for m in (ip.user_ns["a"], ip.user_ns["b"]):
        m.build((None, 4))
    digest = state_digest()
    assert digest["a"] == digest["b"] != digest["c"]



def test_keras_models_and_optimizers_in_a_dict_or_list_are_restored_into_the_rebuilt_ones(tmp_path):
    """`nets = {"a": ..., "b": ...}` and `opts` as a dict or list over them (unbuilt: built by their
    first step), saved: each Keras object is saved by its variables in the pickle's place of it and
    assigned into the object in that place at the restore, built first (the optimizer for the
    variables of the models in the dict): the same dicts, the same objects, the saved values, and a
    next step bit for bit as the saved ones'. Pickled whole, they came back new objects (a traced
    step trained the old ones) and the optimizers without their moments and step counts."""
    x, y = np.random.default_rng(0).normal(size=(2, 16, 4)).astype("float32")

    def built():  # as a new kernel's set-up cell builds them: the same names, so the same variable paths
        keras.backend.clear_session()
        (ma, oa, _), (mb, ob, _) = loop_build(), loop_build()
        return {"a": ma, "b": mb}, [oa, ob], keras.metrics.Mean()

    nets, opts, metric = built()
    for _ in range(3):
        loop_step(nets["a"], opts[0], metric, x, y[:, :1])
        loop_step(nets["b"], opts[1], metric, x * 2, y[:, :1])
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({"opts": opts, "nets": nets}, ["opts", "nets"], strict=True)

    fresh = built()
    assert not fresh[0]["a"].built and not fresh[1][0].built
    ns = {"opts": fresh[1], "nets": fresh[0]}
    objects = [fresh[0]["a"], fresh[0]["b"], *fresh[1]]
    store.load().restore(ns, ["opts", "nets"])
    assert ns["nets"] is fresh[0] and ns["opts"] is fresh[1]
    assert [ns["nets"]["a"], ns["nets"]["b"], *ns["opts"]] == objects  # the same objects: a tf.function sees them
    for a, b in zip([nets["a"], nets["b"], *opts], objects):
        assert values(b.variables) == values(a.variables)  # weights, statistics, seed states, moments, steps
    loop_step(nets["a"], opts[0], metric, x, y[:, :1])
    loop_step(fresh[0]["a"], fresh[1][0], fresh[2], x, y[:, :1])
    assert values(fresh[0]["a"].variables + fresh[1][0].variables) == values(nets["a"].variables + opts[0].variables)


def test_a_keras_model_of_a_saved_dict_with_nothing_in_its_place_stops_the_restore_in_one_line(tmp_path):
    """The dict restored where the name now holds one without that key (or nothing): one line that
    says which Keras object found no place and what to do; never a placeholder bound."""
    keras.backend.clear_session()
    model, _, _ = loop_build()
    model.build((None, 4))
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({"nets": {"a": model}}, ["nets"], strict=True)
    for ns in ({"nets": {}}, {}):
        with pytest.raises(CheckpointError) as e:
            store.load().restore(ns, ["nets"])
        message = str(e.value)
        assert message == ("colab_resilience: cannot restore 'nets': it holds a Keras model or layer (sequential), "
                           "saved by its variables, and no Keras model or layer is in its place now to take them; "
                           "build 'nets' in a %%replay cell as it was built, and change it in the loop in place "
                           "rather than binding it anew"), message
        assert "nets" not in ns or ns["nets"] == {}


@pytest.mark.parametrize("chunk", [None, 4096], ids=["whole", "a-slice-at-a-time"])
def test_a_frozen_keras_layers_weights_are_fingerprinted_by_every_value(monkeypatch, chunk):
    """A frozen Keras layer the set-up cells make (a pretrained embedding): one weight changed in
    a plain cell counts (a strided sample of a variable over 1 MiB missed it), also where the
    variable is copied to the host a slice at a time (over 64 MiB, or on a GPU: here, 4 KiB)."""
    from colab_resilience import setup_state

    if chunk:
        monkeypatch.setattr(setup_state, "CHUNK", chunk)

    def embedding():
        keras.utils.set_random_seed(0)
        layer = keras.layers.Embedding(1024, 512, trainable=False, name="emb")  # a new kernel names it alike
        layer.build((None,))
        return layer

    a, b = embedding(), embedding()
    before = setup_state.fingerprint({"emb": a}, ["emb"])
    assert set(before) == {"emb"} and setup_state.differing(before, {"emb": b}) == []
    weights = b.embeddings.numpy()
    weights[317, 301] = 0.0
    b.embeddings.assign(weights)
    assert setup_state.differing(before, {"emb": b}) == ["emb"]


def test_keras_global_seed_generator_goes_with_the_random_states_and_is_never_rolled_back_unmade():
    """`keras.random` without a seed draws from Keras's global seed generator: its state goes with
    the random states, and a restore puts it back (a custom loop drew anew after a kill). Made
    after the safe point (from Python's random state then, and captured by a traced step), no
    saved state unmakes it: restoring a state captured before it was made raises BuiltSinceError,
    on which a retry in the kernel gives way to a restarted one."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    from colab_resilience.checkpoints.rng import capture_rng, restore_rng
    from colab_resilience.errors import BuiltSinceError

    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    before = capture_rng()
    assert before["keras"] is None
    keras.random.uniform(())
    with pytest.raises(BuiltSinceError, match="global seed generator .* was made after the safe point"):
        restore_rng(before)
    state = capture_rng()
    first = [float(keras.random.uniform(())) for _ in range(3)]
    restore_rng(state)
    assert [float(keras.random.uniform(())) for _ in range(3)] == first


def test_a_keras_variable_of_another_shape_stops_the_restore_in_one_line_and_assigns_nothing(tmp_path):
    model, opt, metric = loop_build()
    model.build((None, 4))
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({"model": model}, ["model"], strict=True)
    keras.utils.set_random_seed(1)
    other = keras.Sequential([keras.layers.Dense(16), keras.layers.Dense(1)])
    other.build((None, 4))
    before = values(other.variables)
    with pytest.raises(CheckpointError) as e:
        store.load().restore({"model": other}, ["model"])
    message = str(e.value)
    assert "\n" not in message and message.startswith("colab_resilience: cannot restore 'model': the Keras layer was "
                                                      "saved with 9 variables and has 4 now; build it in a %%replay cell"), message
    assert values(other.variables) == before


# the line that strikes once: a SIGKILL of the kernel, or TensorFlow's out-of-memory error
_STRIKE = {"kill": "os.kill(os.getpid(), signal.SIGKILL)",
           "oom": "raise tf.errors.ResourceExhaustedError(None, None, 'OOM when allocating tensor with shape[8192,8192]')"}


def _setup(mark) -> str:
    """The start of a %%replay cell for :data:`_STRIKE`: TensorFlow quiet, seeded and
    deterministic, the mark, the data (``X``, ``Y``)."""
    return ("%%replay\nimport os, signal\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n"
            "import numpy as np, tensorflow as tf, keras\n"
            f"MARK = {str(mark)!r}\n"
            "keras.utils.set_random_seed(0)\ntf.config.experimental.enable_op_determinism()\n"
            "X = np.random.default_rng(0).normal(size=(64, 4)).astype('float32')\nY = X @ np.ones((4, 1), 'float32')\n")


def custom_loop_notebook(fault: str, mark, epoch: int = 2, built: bool = False) -> "nbformat.NotebookNode":
    """A custom training loop as TensorFlow's guide writes it: a Sequential without an Input, Adam,
    a `keras.metrics.Mean`, a `tf.function` train step over a `tf.data` pipeline (batched, not
    shuffled) that also counts its steps in a `tf.Variable`, Dropout, `keras.random` without a seed;
    `--save model,opt,loss_mean,steps,history`. One fault (`fault`: a SIGKILL, TensorFlow's
    ResourceExhaustedError) at the end of ``epoch``, once. ``built``: the model has an Input and
    the optimizer is built in the set-up cell."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)\n"
        f"model = keras.Sequential([{'keras.Input((4,)), ' if built else ''}keras.layers.Dense(16, activation='relu'),"
        " keras.layers.Dropout(0.3), keras.layers.Dense(1)])\n"
        "opt = keras.optimizers.Adam(1e-2)\nloss_mean = keras.metrics.Mean()\nhistory = []\n"
        + ("opt.build(model.trainable_variables)\n" if built else "") +
        "steps = tf.Variable(0, dtype=tf.int64, trainable=False)\n"
        "@tf.function\ndef train_step(x, y):\n"
        "    with tf.GradientTape() as tape:\n"
        "        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)\n"
        "    grads = tape.gradient(loss, model.trainable_variables)\n"
        "    opt.apply_gradients(zip(grads, model.trainable_variables))\n"
        "    loss_mean.update_state(loss)\n"
        "    steps.assign_add(1)",
        "%%resilient --save model,opt,loss_mean,steps,history\n"
        "for epoch in resume_range(5):\n"
        "    loss_mean.reset_state()\n"
        "    for x, y in ds:\n"
        "        train_step(x, y)\n"
        "    history.append((float(loss_mean.result()), float(keras.random.uniform(()))))\n"
        f"    if epoch == {epoch} and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_STRIKE[fault]}\n",
        "import hashlib\nprint('RESULT', history, int(opt.iterations.numpy()), int(steps.numpy()), hashlib.sha256(b''.join("
        "v.numpy().tobytes() for v in model.variables + opt.variables)).hexdigest())",
    )


@pytest.mark.kernel
@pytest.mark.parametrize("fault,epoch,built", [("kill", 2, False), ("oom", 2, False), ("oom", 0, False), ("oom", 0, True)],
                         ids=["killed", "out-of-memory", "out-of-memory-in-the-first-epoch",
                              "out-of-memory-in-the-first-epoch-model-built"])
def test_a_custom_training_loop_killed_or_out_of_memory_resumes_bit_identical(tmp_path, fault, epoch, built):
    """The model, optimizer, metric and step variable of a custom loop in --save: after a SIGKILL
    the new kernel replays the set-up cell (an unbuilt model and optimizer), the restore builds them
    and assigns the saved variables, and the loop goes on at its last checkpoint; after an
    out-of-memory error the same objects get the safe point's variables (the step variable the
    traced step increments among them: bound to a copy, it counted on) and the epoch is retried.
    In the first epoch the safe point is the loop's start, before the model's first call: a retry
    in the kernel cannot unbuild the model, so the run goes on in a restarted kernel, and says so;
    with the model and optimizer built in the set-up cell, before Keras's global seed generator
    was made (by the epoch's keras.random call): a retry cannot unmake it either (it drew the
    epoch's numbers from the failed attempt's generator, and the run said done).
    Each ends bit for bit as the uninterrupted run (weights, moments, step counts, the metric's
    means, keras.random's draws), and the first run says nothing of them (they were refused before)."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: custom_loop_notebook(fault, mark, epoch, built),
                                              shared=f"keras custom loop built={built}")
    train = harness.cell_text(nb.cells[2])
    restarted = fault == "kill" or epoch == 0
    assert len(run.restarts) == restarted, train
    said = "restored model, opt, loss_mean, steps, history" if restarted else "rolled back to the last safe point"
    assert said in train, train
    if epoch == 0:
        assert "what the failed attempt made cannot be unmade in this kernel" in train, train
    assert "colab_resilience: the resume_range loop" not in harness.cell_text(twin.cells[2])
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT [(") and " 20 20 " in harness.result(nb)



def models_dict_notebook(fault: str, mark) -> "nbformat.NotebookNode":
    """Two Keras models in a dict and their Adams in a dict (built in the set-up cell), one
    ``tf.function`` step training both, Dropout; ``--save nets,opts,hist``. One fault (``fault``)
    at the end of epoch 2, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "nets = {k: keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation='relu'),"
        " keras.layers.Dropout(0.3), keras.layers.Dense(1)]) for k in 'ab'}\n"
        "opts = {k: keras.optimizers.Adam(1e-2) for k in nets}\n"
        "for k in nets: opts[k].build(nets[k].trainable_variables)\n"
        "@tf.function\ndef step(x, y):\n"
        "    for k in ('a', 'b'):\n"
        "        with tf.GradientTape() as tape:\n"
        "            loss = tf.reduce_mean((nets[k](x, training=True) - y) ** 2)\n"
        "        grads = tape.gradient(loss, nets[k].trainable_variables)\n"
        "        opts[k].apply_gradients(zip(grads, nets[k].trainable_variables))\n"
        "hist = []",
        "%%resilient --save nets,opts,hist\n"
        "for epoch in resume_range(4):\n"
        "    for i in range(0, 64, 16):\n"
        "        step(X[i:i+16], Y[i:i+16])\n"
        "    hist.append(float(np.sum(nets['a'].layers[0].kernel.numpy())))\n"
        "    if epoch == 2 and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_STRIKE[fault]}\n",
        "import hashlib\nprint('RESULT', hist, [int(o.iterations.numpy()) for o in opts.values()], hashlib.sha256(b''.join("
        "v.numpy().tobytes() for k in nets for v in nets[k].variables + opts[k].variables)).hexdigest())",
    )


@pytest.mark.kernel
@pytest.mark.parametrize("fault", ["kill", "oom"], ids=["killed", "out-of-memory"])
def test_keras_models_and_optimizers_in_dicts_resume_bit_identical(tmp_path, fault):
    """Models and optimizers saved in dicts, trained by a traced step that reads them from the
    dicts: pickled whole, they came back new objects: after an out-of-memory rollback the traced
    step went on training the old models while the dict held copies that no longer trained, and
    after a kill the optimizers had lost their moments and step counts, each run saying done with
    another result. Each Keras object is now saved by its variables and assigned into the one in
    its place; the run ends bit for bit as its twin."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: models_dict_notebook(fault, mark),
                                              shared="keras models dict")
    train = harness.cell_text(nb.cells[2])
    assert len(run.restarts) == (fault == "kill"), train
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT [") and "[16, 16]" in harness.result(nb), harness.result(nb)

def fit_per_epoch_notebook(fault: str, mark, epoch: int = 2) -> "nbformat.NotebookNode":
    """``model.fit(..., epochs=1)`` once per ``resume_range`` iteration on a model compiled with
    Adam (its optimizer only the model holds), shuffled, with Dropout; ``--save model,hist``. One
    fault (``fault``) at the end of ``epoch``, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation='relu'),"
        " keras.layers.Dropout(0.3), keras.layers.Dense(1)])\n"
        "model.compile(optimizer=keras.optimizers.Adam(1e-2), loss='mse')\nhist = []",
        "%%resilient --save model,hist\n"
        "for epoch in resume_range(4):\n"
        "    h = model.fit(X, Y, batch_size=16, epochs=1, shuffle=True, verbose=0)\n"
        "    hist.append(h.history['loss'][0])\n"
        f"    if epoch == {epoch} and not os.path.exists(MARK):\n"
        f"        open(MARK, 'w').close(); {_STRIKE[fault]}\n",
        "import hashlib\nprint('RESULT', hist, int(model.optimizer.iterations.numpy()), hashlib.sha256(b''.join("
        "v.numpy().tobytes() for v in model.variables + model.optimizer.variables)).hexdigest())",
    )


@pytest.mark.kernel
@pytest.mark.parametrize("fault,epoch", [("kill", 2), ("oom", 2), ("oom", 0)],
                         ids=["killed", "out-of-memory", "out-of-memory-in-the-first-epoch"])
def test_a_compiled_model_fit_one_epoch_at_a_time_resumes_with_its_optimizer(tmp_path, fault, epoch):
    """A model compiled with Adam and fitted one epoch per resume_range iteration, saved by its name:
    its optimizer (moments, step count) is the model's alone, and was not saved: after a kill the
    new kernel's fit went on with a fresh Adam (12 steps for 16) and the run said done. The
    optimizer's variables go with the model's, and are assigned into the rebuilt model's optimizer
    (built for it first). An OOM in the first epoch, where the safe point had it unbuilt, goes on in
    a restarted kernel. Each ends bit for bit as its twin."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: fit_per_epoch_notebook(fault, mark, epoch),
                                              shared="keras fit per epoch")
    train = harness.cell_text(nb.cells[2])
    assert len(run.restarts) == (fault == "kill" or epoch == 0), train
    assert harness.result(nb) == harness.result(twin)
    assert harness.result(nb).startswith("RESULT [") and "] 16 " in harness.result(nb), harness.result(nb)


def subclassed_fit_notebook(fault: str, mark, epoch: int) -> "nbformat.NotebookNode":
    """A subclassed model without an Input (Keras's TensorFlow backend builds it when it traces the
    first step) with its own ``train_step``, a ``Mean`` it lists in ``metrics`` and a ``Sum`` of the
    samples seen that it does not (fit never resets it: it counts across epochs), Dropout; fit with
    a ``CSVLogger(append=True)`` and a callback that opens a file of its own when fit starts
    (``None`` before). One fault (``fault``) after batch 2 of ``epoch``, once."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        # each save done before the next epoch: the resume is from the last epoch's end, whose rows
        # the files hold already (a kill before it was written, under load, appended a row twice)
        "%config ResilienceMagics.staging_memory = 'off'\n"
        "class Net(keras.Model):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.d1, self.drop, self.d2 = keras.layers.Dense(16, activation='relu'), keras.layers.Dropout(0.3), keras.layers.Dense(1)\n"
        "        self.tracker, self.seen = keras.metrics.Mean(name='loss'), keras.metrics.Sum(name='seen')\n"
        "    def call(self, x, training=False):\n"
        "        return self.d2(self.drop(self.d1(x), training=training))\n"
        "    def train_step(self, data):\n"
        "        x, y = data\n"
        "        with tf.GradientTape() as tape:\n"
        "            loss = tf.reduce_mean((self(x, training=True) - y) ** 2)\n"
        "        grads = tape.gradient(loss, self.trainable_variables)\n"
        "        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))\n"
        "        self.tracker.update_state(loss); self.seen.update_state(tf.cast(tf.shape(x)[0], 'float32'))\n"
        "        return {'loss': self.tracker.result(), 'seen': self.seen.result()}\n"
        "    @property\n"
        "    def metrics(self):\n"
        "        return [self.tracker]\n"
        "class Strike(keras.callbacks.Callback):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.out = None\n"
        "    def on_train_begin(self, logs=None):\n"
        "        self.out = open('epochs.txt', 'a')\n"
        "    def on_epoch_begin(self, epoch, logs=None):\n"
        "        self.epoch = epoch\n"
        "    def on_epoch_end(self, epoch, logs=None):\n"
        "        print(epoch, file=self.out, flush=True)\n"
        "    def on_train_batch_end(self, batch, logs=None):\n"
        f"        if (self.epoch, batch) == ({epoch}, 2) and not os.path.exists(MARK):\n"
        f"            open(MARK, 'w').close(); {_STRIKE[fault]}\n"
        "model = Net()\nmodel.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))",
        "%%resilient\nfrom colab_resilience.integrations.keras import ResilienceCallback\n"
        "history = model.fit(X, Y, batch_size=8, epochs=4, verbose=0, callbacks=[\n"
        "    ResilienceCallback(), keras.callbacks.CSVLogger('fit.csv', append=True), Strike()])",
        "import hashlib\nprint('RESULT', history.history, float(model.seen.result()), open('fit.csv').read().replace('\\n', '|'), "
        "open('epochs.txt').read().split(), "
        "int(model.optimizer.iterations.numpy()), hashlib.sha256(b''.join("
        "v.numpy().tobytes() for v in model.variables + model.optimizer.variables)).hexdigest())",
    )


@pytest.mark.kernel
@pytest.mark.parametrize("fault,epoch", [("kill", 2), ("oom", 2), ("oom", 0)],
                         ids=["killed", "out-of-memory", "out-of-memory-in-the-first-epoch"])
def test_a_subclassed_model_built_by_its_first_step_resumes_with_its_own_metrics_and_csv_log(tmp_path, fault, epoch):
    """Found by probes. The callback's first safe point built the optimizer on the unbuilt model's
    no variables, and the first step failed ("Unknown variable"); the model is built first now, from
    the data's shapes, as Keras's other backends build it. A metric the model does not list in
    ``metrics`` (fit never resets it) was in no checkpoint: after a kill its count started again
    (the logs said 128 where 384 was due), and the run said done; it goes with the model's
    variables now. After an OOM at the first epoch, the CSVLogger's file was put back as the first
    safe point found it (None) over the one its on_train_begin had opened, and the retry failed
    (so was a notebook's callback's); with a kill the header went in again mid-file. Each ends bit for bit as its twin: the logs, the
    count, the CSV file, the weights and the optimizer's variables. The first run says one thing:
    that the notebook's callback appends to a file of its own (where a fault strikes after it wrote
    and before the next safe point is on disk, the lines are written again); not CSVLogger's."""
    run, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: subclassed_fit_notebook(fault, mark, epoch),
                                              shared="keras subclassed fit")
    assert len(run.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    said = [line for line in harness.cell_text(twin.cells[2]).splitlines() if "colab_resilience:" in line]
    assert said == ["colab_resilience: Strike, which the training calls, appends to 'epochs.txt': a checkpoint does "
                    "not hold files, so where a fault strikes after it wrote and before the next safe point is on "
                    "disk, the resumed training writes those lines again; keep the rows in the callback (its state "
                    "goes with the checkpoint) and write the file when the fit ends, or read it knowing rows may "
                    "repeat"], said
    assert harness.result(nb) == harness.result(twin)
    assert " 256.0 epoch,loss,seen,val_loss,val_seen|0," in harness.result(nb), harness.result(nb)
    assert "| ['0', '1', '2', '3'] " in harness.result(nb), harness.result(nb)


def test_a_compiled_model_restored_into_one_not_compiled_is_refused_in_one_line(tmp_path):
    """Saved compiled (with its optimizer), restored into the same architecture left uncompiled: one
    line saying what to do, and nothing assigned."""
    from colab_resilience.checkpoints import keras_state

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"), verbose=0)
    state = keras_state.state_dict(model)
    assert len(state["optimizer"]["values"]) == len(model.optimizer.variables)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    before = values(other.variables)
    with pytest.raises(CheckpointError) as e:
        keras_state.load("model", other, state, {}, restore_layers=lambda: None)
    assert str(e.value) == ("colab_resilience: cannot restore 'model': the Keras model was saved compiled, with its "
                            "optimizer, and is not compiled now; compile it in a %%replay cell as it was compiled")
    assert values(other.variables) == before


def test_the_first_run_names_an_unsaved_keras_optimizer_and_a_dataset_that_reshuffles(ip):
    """An optimizer the loop steps without --save, and a tf.data pipeline that shuffles anew each
    epoch (each epoch's order follows from the iterations before it, which no checkpoint holds):
    each is named in one line at the first run. The saved model's layers are not named, nor a
    pipeline that shuffles once (reshuffle_each_iteration=False)."""
    from colab_resilience import lint

    model, opt, _ = loop_build()
    data = tf.data.Dataset.range(8)
    ip.user_ns.update(model=model, opt=opt, dense=model.layers[0], ds=data.shuffle(8, seed=1).batch(4),
                      fixed=data.shuffle(8, seed=1, reshuffle_each_iteration=False).batch(4))
    body = ("for epoch in resume_range(3):\n    for x in ds:\n        step(model, opt, dense, x)\n"
            "    for x in fixed:\n        step(model, opt, dense, x)\n")
    lines = lint.warnings(ip, body, ["model"], [])
    assert [line for line in lines if "opt (Adam)" in line and "dense" not in line], lines
    reshuffled = [line for line in lines if "tf.data" in line]
    assert len(reshuffled) == 1 and "iterates ds, a tf.data dataset that shuffles anew" in reshuffled[0], lines
    assert "fixed" not in reshuffled[0] and "ds.shuffle(n, seed=epoch)" in reshuffled[0], lines


def test_the_first_run_names_a_fit_without_the_callback(ip):
    """``model.fit(...)`` in a %%resilient cell without a ResilienceCallback has no safe point
    inside it: a restart runs it again from its first epoch, and nothing said so. One line at the
    first run names the fit and says how to add the callback; not where the cell makes one, and not
    where its callbacks are a name the cell binds (what they hold is not known before it runs)."""
    from colab_resilience import lint

    model, _, _ = loop_build()
    model.compile(optimizer="adam", loss="mse")
    ip.user_ns.update(model=model, early=[keras.callbacks.EarlyStopping(monitor="loss")])
    line = ("colab_resilience: model.fit() (Keras) has no safe point inside it: after a restart or an out-of-memory "
            "error it trains again from its first epoch; to go on after the last finished one, add "
            "ResilienceCallback() to the fit's callbacks=[...] (from colab_resilience.integrations.keras import "
            "ResilienceCallback)")

    def said(body):
        return [w for w in lint.warnings(ip, body, [], []) if "no safe point" in w]

    assert said("h = model.fit(x, y, epochs=4)") == [line]
    assert said("h = model.fit(x, y, epochs=4, callbacks=[keras.callbacks.EarlyStopping()])") == [line]
    assert said("h = model.fit(x, y, epochs=4, callbacks=early)") == [line]
    assert said("from colab_resilience.integrations.keras import ResilienceCallback\n"
                "h = model.fit(x, y, epochs=4, callbacks=[ResilienceCallback()])") == []
    assert said("cbs = make_callbacks()\nh = model.fit(x, y, epochs=4, callbacks=cbs)") == []
    assert said("h = model.predict(x)") == []


def csv_logger_notebook(fault: str, mark, epoch: int, cut: bool = False) -> "nbformat.NotebookNode":
    """A fit of 4 epochs with a ``CSVLogger('fit.csv', append=True)``, then a callback that strikes
    as ``epoch`` ends, once: after the logger wrote the epoch's row, before the next epoch's safe
    point (``cut``: it first appends half a row, as a kill in the middle of a write leaves)."""
    return harness.notebook(
        "%load_ext colab_resilience",
        _setup(mark) +
        "%config ResilienceMagics.staging_memory = 'off'\n"
        "class Strike(keras.callbacks.Callback):\n"
        "    def on_epoch_end(self, epoch, logs=None):\n"
        f"        if epoch == {epoch} and not os.path.exists(MARK):\n"
        "            open(MARK, 'w').close()\n" +
        ("            with open('fit.csv', 'a') as f: f.write('9,0.12')\n" if cut else "") +
        f"            {_STRIKE[fault]}\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation='relu'), keras.layers.Dropout(0.2),\n"
        "                          keras.layers.Dense(1)])\n"
        "model.compile(optimizer=keras.optimizers.Adam(0.01), loss='mse')",
        "%%resilient\nfrom colab_resilience.integrations.keras import ResilienceCallback\n"
        "history = model.fit(X, Y, batch_size=16, epochs=4, verbose=0, callbacks=[\n"
        "    ResilienceCallback(), keras.callbacks.CSVLogger('fit.csv', append=True), Strike()])",
        "import hashlib\nprint('RESULT', '|'.join(open('fit.csv').read().splitlines(True)).replace('\\n', ''), history.history, "
        "hashlib.sha256(b''.join(v.numpy().tobytes() for v in model.variables + model.optimizer.variables)).hexdigest())",
    )


@pytest.mark.kernel
@pytest.mark.parametrize("fault,epoch", [("kill", 1), ("kill", 0), ("oom", 0)],
                         ids=["killed-as-epoch-1-ended", "killed-as-epoch-0-ended", "out-of-memory-as-epoch-0-ended"])
def test_a_csv_logger_that_appends_does_not_write_the_epochs_trained_again_twice(tmp_path, fault, epoch):
    """Struck after the CSVLogger wrote the epoch's row and before the next safe point: the fit
    goes on from the checkpoint taken as that epoch began (for epoch 0, as fit began, before the
    file had its header) and trains it again, and the logger appended its row again: the file
    held it twice, and the run said done. The logger now skips the rows its file holds from after
    the checkpoint; the file is the uninterrupted fit's, byte for byte, as is the model."""
    faulted, nb, twin = harness.faulted_and_twin(tmp_path, lambda mark: csv_logger_notebook(fault, mark, epoch),
                                                   shared="keras csv logger")
    assert len(faulted.restarts) == (fault == "kill"), harness.cell_text(nb.cells[2])
    assert harness.result(nb) == harness.result(twin)
    rows = harness.result(twin).split(" ", 2)[1].split("|")
    assert rows[0] == "epoch,loss,val_loss" and [r.split(",")[0] for r in rows[1:]] == ["0", "1", "2", "3"], rows


@pytest.mark.kernel
def test_a_csv_row_the_fault_cut_short_is_said_and_the_file_is_not_truncated(tmp_path):
    """A kill that leaves half a row at the end of the file: nothing here truncates a user's file,
    so the resumed fit appends after it, and says so in one line; the whole rows before it,
    written after the checkpoint, are still not written twice."""
    nb = csv_logger_notebook("kill", tmp_path / "m", 1, cut=True)
    run = harness.run(nb, tmp_path, standby=False)
    out = harness.cell_text(nb.cells[2])
    assert run.status == 0 and len(run.restarts) == 1, out
    assert out.count("colab_resilience: fit.csv ends in a row that the fault cut short, after the checkpoint this "
                     "fit resumes from; the resumed fit appends its rows after it (nothing here truncates your "
                     "file): mend that line by hand") == 1, out
    rows = harness.result(nb).split(" ", 2)[1].split("|")
    assert [r.split(",")[0] for r in rows] == ["epoch", "0", "1", "9", "3"], rows  # '9,0.12' + epoch 2's row
    assert rows[3].startswith("9,0.122,"), rows


def test_the_first_run_names_a_csv_logger_that_writes_its_file_anew(tmp_path):
    """A ``CSVLogger`` with ``append=False`` (its default) empties its file each time fit starts,
    and a resume starts fit again: the file would hold only the epochs from the resume on. Named
    in the lines a fit's first run says; with ``append=True`` (a resumed fit appends the epochs it
    trains, as the uninterrupted one did), not."""
    from colab_resilience.integrations.keras import _inexact

    x = np.zeros((8, 4), "float32")
    keras.utils.set_random_seed(0)
    anew = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    lines = _inexact({"x": x, "callbacks": keras.callbacks.CallbackList([anew])})
    assert lines == [f"colab_resilience: CSVLogger writes {tmp_path / 'log.csv'} anew each time fit starts "
                     "(append=False): a resume after an out-of-memory error or a restart starts fit again, and the "
                     "file would hold only the epochs from there on; pass append=True (a checkpoint holds no file, "
                     "and nothing here truncates yours)"], lines
    appends = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"), append=True)
    assert _inexact({"x": x, "callbacks": keras.callbacks.CallbackList([appends])}) == []


def test_a_model_built_otherwise_is_refused_in_one_line_and_left_as_it_was(tmp_path):
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({STATE: FitState(build())}, [STATE], strict=True)
    other = build(width=16)
    before = values(other.variables)
    with pytest.raises(CheckpointError) as e:
        store.load().restore({STATE: FitState(other)}, [STATE])
    message = str(e.value)
    # the layers' names count the models built in the process before (none, in a fresh test worker): shown, not compared
    assert "\n" not in message and re.fullmatch(
        r"colab_resilience: cannot restore model.fit's state: "
        r"variable sequential(_\d+)?/dense(_\d+)?/kernel of the model was saved as float32\[4, 8\] and is float32\[4, 16\] now; "
        r"build and compile it as it was, or `%resilience reset`", message), message
    assert values(other.variables) == before


def test_a_model_built_under_another_dtype_policy_is_refused_in_one_line_and_left_as_it_was(tmp_path):
    """keras.mixed_precision.set_global_policy("mixed_bfloat16") in a plain cell: the layers compute
    in bfloat16 on float32 variables. A new kernel's replay built the model under float32, its
    variables like the saved ones, and the fit went on computing in float32, with other losses,
    "done" (found by a probe; check said DIFFERS). Both ways a model is saved (a fit's state, a
    model in --save) now stop in one line that names the policy, and assign nothing; a model built
    under the saved policy takes the state."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        mixed, mixed_again = build(), build()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    store = CheckpointStore(tmp_path / "fit", run_id="keras", key=b"k" * 32)
    store.save({STATE: FitState(mixed), "model": mixed}, [STATE, "model"], strict=True)
    fit_into, model_into = build(), build()
    before = values(fit_into.variables)
    with pytest.raises(CheckpointError) as e:
        store.load().restore({STATE: FitState(fit_into)}, [STATE])
    message = str(e.value)
    assert message == (
        "colab_resilience: cannot restore model.fit's state: the model computes with Keras's dtype policy float32 now "
        "and was saved computing with mixed_bfloat16, on variables alike: a policy set in a plain cell "
        "(keras.mixed_precision.set_global_policy) is not set again in a new kernel; set it in a %%replay cell before "
        "the model is built"), message
    assert values(fit_into.variables) == before
    with pytest.raises(CheckpointError) as e:
        store.load().restore({"model": model_into}, ["model"])
    assert str(e.value).startswith("colab_resilience: cannot restore 'model': the Keras layer computes with Keras's "
                                   "dtype policy float32 now and was saved computing with mixed_bfloat16"), str(e.value)
    assert values(model_into.variables) == before
    store.load().restore({STATE: FitState(mixed_again), "model": mixed_again}, [STATE, "model"])
    assert values(mixed_again.variables) == values(mixed.variables)


def test_a_model_built_in_another_default_float_type_is_refused_naming_set_floatx(tmp_path):
    """keras.config.set_floatx("float64") in a plain cell: a new kernel's replay built the model in
    float32, and the restore was refused with "build it as it was", not saying why. Both ways a
    model is saved now name the setting as the likely cause, and where to make it."""
    keras.config.set_floatx("float64")
    try:
        wide = build()
    finally:
        keras.config.set_floatx("float32")
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({STATE: FitState(wide), "model": wide}, [STATE, "model"], strict=True)
    cause = ("(Keras's default float type is float32 now: keras.config.set_floatx('float64') in a cell that is not "
             "%%replay is not run again in a new kernel; call it in a %%replay cell before the model is built)")
    for name, value in ((STATE, FitState(build())), ("model", build())):
        with pytest.raises(CheckpointError) as e:
            store.load().restore({name: value}, [name])
        message = str(e.value)
        assert "\n" not in message and re.search(r"was saved as float64\[[0-9, ]*\] and is float32\[", message), message
        assert cause in message, message


def test_a_model_compiled_otherwise_is_refused_in_one_line_and_left_as_it_was(tmp_path):
    """model.compile(loss="mae") in a plain cell after the %%replay cell compiled it with "mse": a
    new kernel's replay compiled it with "mse" again, the variables alike, and the fit went on
    with the other loss, "done" (found by a probe). Both ways a model is saved (a fit's state, a
    model in --save) now keep what it was compiled with and stop in one line that names what
    differs; its rate (a variable that goes with the optimizer, which a callback may lower) is not
    compared, a schedule is."""
    mae = build()
    mae.compile(optimizer=mae.optimizer, loss="mae", metrics=["mse"])
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({STATE: FitState(mae), "model": mae}, [STATE, "model"], strict=True)
    differs = ('compiled otherwise than it was saved (loss "mse" now, "mae" saved; metrics null now, ["mse"] saved): '
               "a model.compile(...) in a cell that is not %%replay is not run again in a new kernel; compile it in a "
               "%%replay cell as the run began with it")
    for name, value in ((STATE, FitState(build())), ("model", build())):
        target = value.model if name == STATE else value
        before = values(target.variables)
        with pytest.raises(CheckpointError) as e:
            store.load().restore({name: value}, [name])
        assert str(e.value) == ("colab_resilience: cannot restore model.fit's state: the model is " + differs
                                if name == STATE else
                                "colab_resilience: cannot restore 'model': the Keras layer is " + differs), str(e.value)
        assert values(target.variables) == before
    again = build()
    again.compile(optimizer=keras.optimizers.Adam(0.5), loss="mae", metrics=["mse"])  # another rate: restored
    store.load().restore({STATE: FitState(again), "model": again}, [STATE, "model"])
    assert values(again.variables) == values(mae.variables)
    assert float(again.optimizer.learning_rate.numpy()) == float(mae.optimizer.learning_rate.numpy())
    scheduled = build()
    scheduled.compile(optimizer=keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 10, 0.9)),
                      loss="mse")
    store = CheckpointStore(tmp_path / "scheduled", run_id="keras", key=b"k" * 32)
    store.save({"model": scheduled}, ["model"], strict=True)
    with pytest.raises(CheckpointError, match=r'compiled otherwise than it was saved \(optimizer.learning_rate a rate '
                                              r'now, \{"class_name": "ExponentialDecay"'):
        store.load().restore({"model": build()}, ["model"])


def test_a_model_frozen_otherwise_is_refused_in_one_line_naming_the_variables(tmp_path):
    """model.layers[0].trainable = False (and compiled again) in a plain cell: a new kernel's replay
    built it all trainable, and the restore was refused for its optimizer's variables ("variable
    adam/..._momentum ... was saved as float32[16, 1] and is float32[8, 16] now"), not saying why.
    Which variables fit trains goes with its state, and the line names them and the cause."""
    frozen = build()
    frozen.layers[0].trainable = False
    frozen.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    store = CheckpointStore(tmp_path, run_id="keras", key=b"k" * 32)
    store.save({STATE: FitState(frozen)}, [STATE], strict=True)
    other = build()
    before = values(other.variables)
    with pytest.raises(CheckpointError) as e:
        store.load().restore({STATE: FitState(other)}, [STATE])
    assert "\n" not in str(e.value) and re.fullmatch(
        r"colab_resilience: cannot restore model.fit's state: the model's variables are not trainable as they were "
        r"saved \(sequential(_\d+)?/dense(_\d+)?/kernel frozen when saved, trainable now; "
        r"sequential(_\d+)?/dense(_\d+)?/bias frozen when saved, trainable now\): layer.trainable set in a cell that "
        r"is not %%replay is not set again in a new kernel, and fit would train other variables; set it in a "
        r"%%replay cell, before model.compile", str(e.value)), str(e.value)
    assert values(other.variables) == before
    again = build()
    again.layers[0].trainable = False
    again.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    store.load().restore({STATE: FitState(again)}, [STATE])
    assert values(again.variables) == values(frozen.variables)


def _compiled_notebook(where: str, mark):
    """A model compiled with "mse" in the %%replay cell, compiled again with "mae" in a plain cell
    after it ("plain-cell") or at that cell's end ("replay-cell"); the fit killed once after its
    epoch 1."""
    again = "model.compile(optimizer=model.optimizer, loss='mae')"
    return harness.notebook("%load_ext colab_resilience",
                            "%%replay\n" + _FIT_IMPORTS + _FIT_BUILD + ("\n" + again if where == "replay-cell" else ""),
                            again if where == "plain-cell" else "pass", _killed_fit(mark),
                            "print('RESULT', history.history['loss'], model.loss)")


@pytest.mark.kernel
@pytest.mark.parametrize("where", ["plain-cell", "replay-cell"])
def test_a_model_a_plain_cell_compiled_again_is_not_trained_on_with_the_old_loss_after_a_kill(tmp_path, where):
    """Compiled again with another loss in a plain cell, killed in the fit: the run stops with the
    line that names the loss. Compiled so in the %%replay cell, it resumes bit for bit as its twin."""
    refused = ('the model is compiled otherwise than it was saved (loss "mse" now, "mae" saved)'
               if where == "plain-cell" else None)
    _, nb, twin = harness.refused_or_twin(tmp_path, lambda mark: _compiled_notebook(where, mark), refused)
    assert harness.result(twin).endswith(" mae"), harness.result(twin)


def test_tensorflows_global_seed_state_goes_with_the_random_states():
    """An eager random op without a seed of its own draws its op seed from the state
    tf.random.set_seed made: captured, it comes back, and the op draws the same numbers again."""
    from colab_resilience.checkpoints import capture_rng, restore_rng

    tf.random.set_seed(5)
    tf.random.uniform((3,))
    state = capture_rng()
    first = tf.random.uniform((4,)).numpy()
    tf.random.uniform((4,))
    restore_rng(state)
    assert tf.random.uniform((4,)).numpy().tobytes() == first.tobytes()
    assert state["tensorflow"]["seed"] == 5


def test_tensorflows_settings_go_with_the_random_states():
    """Op determinism and TensorFloat-32, set otherwise after the capture, are as they were once the
    state is restored (a new kernel has TensorFlow's defaults: determinism off, TF32 on)."""
    from tensorflow.python.framework import config

    from colab_resilience.checkpoints import capture_rng, restore_rng

    before = config.is_op_determinism_enabled(), config.tensor_float_32_execution_enabled()
    try:
        for determinism, tf32 in ((True, False), (False, True)):
            (config.enable_op_determinism if determinism else config.disable_op_determinism)()
            config.enable_tensor_float_32_execution(tf32)
            state = capture_rng()
            (config.disable_op_determinism if determinism else config.enable_op_determinism)()
            config.enable_tensor_float_32_execution(not tf32)
            restore_rng(state)
            assert (config.is_op_determinism_enabled(), config.tensor_float_32_execution_enabled()) == (determinism, tf32)
    finally:
        (config.enable_op_determinism if before[0] else config.disable_op_determinism)()
        config.enable_tensor_float_32_execution(before[1])


def uninterrupted(tmp_path_factory, **parameters) -> str:
    """The RESULT of train_keras.ipynb run uninterrupted with ``parameters``, once in the session."""
    return harness.twin_result(tmp_path_factory, "train_keras.ipynb", **parameters)


def twin(tmp_path_factory) -> str:
    made = uninterrupted(tmp_path_factory)
    assert "epochs=[0, 1, 2, 3]" in made and "torch_imported=False" in made
    return made


trained_epochs = harness.by_kernel  # (kernel, epoch) for each epoch begun


@pytest.mark.kernel
@pytest.mark.parametrize("fault,retries", [("sigkill", 2), ("oom-error", 2), ("oom-error", 0)],
                         ids=["killed", "out-of-memory", "out-of-memory-past-the-retries"])
def test_a_keras_fit_killed_or_out_of_memory_mid_epoch_goes_on_at_that_epoch_bit_identical(
        tmp_path, tmp_path_factory, fault, retries):
    """Supervised, with the standby kernel: a SIGKILL after minibatch 2 of epoch 1 (the new kernel
    replays the set-up cell, which builds and compiles a fresh model, assigns the saved variables
    into it, and fit starts at epoch 1), TensorFlow's ResourceExhaustedError there (retried in the
    kernel, from the end of epoch 0), or that error with no retries left (the kernel is restarted).
    Epoch 0 is trained once; History holds all four epochs."""
    reference = twin(tmp_path_factory)
    nb = harness.load("train_keras.ipynb", tmp_path, fault=fault, retries=retries)
    # a standby only where the kernel is restarted: beside a retry in the kernel it would import
    # TensorFlow for nothing (here and below)
    run, out = harness.run_ok(nb, tmp_path, standby=fault == "sigkill" or retries == 0)
    if fault == "sigkill" or retries == 0:
        assert len(run.restarts) == 1, out
        assert "restored epochs_seen, the Keras model, its optimizer, the epochs' logs and the state of Fault in " in out, out
        assert trained_epochs(tmp_path / "events.log") == [(0, 0), (0, 1), (1, 1), (1, 2), (1, 3)]
    else:
        assert not run.restarts and "OOM (TensorFlow resources exhausted)" in out and "retry 1/2" in out, out
        assert trained_epochs(tmp_path / "events.log") == [(0, 0), (0, 1), (0, 1), (0, 2), (0, 3)]
    assert "continuing at epoch 2/4" in out, out
    assert "not identical" not in out
    assert harness.result(nb) == reference


def plain_twin(tmp_path_factory, **parameters) -> str:
    """The uninterrupted run of the notebook with ``parameters`` (a model without Dropout and
    BatchNormalization unless they say otherwise), made once per set of parameters."""
    return uninterrupted(tmp_path_factory, **{"dropout": 0.0, "batch_norm": False, **parameters})


def history_losses(result: str) -> list[float]:
    return [float(x) for x in re.search(r" loss=\[(.*?)\] ", result).group(1).split(", ")]


@pytest.mark.kernel
@pytest.mark.parametrize("kill_epoch,every_steps", [(None, None), (2, None), (None, 2)],
                         ids=["out-of-memory", "out-of-memory-then-killed", "out-of-memory-within-an-epoch"])
def test_shrinking_fits_batch_keeps_its_effective_batch(tmp_path, tmp_path_factory, kill_epoch, every_steps):
    """--shrink batch_size with fit's batch from that variable: the OOM in epoch 1 halves it (16 →
    8), and the callback raises the optimizer's gradient accumulation (1 → 2, accumulators added
    to the optimizer already built), so a step still learns from the same 16 rows (fit shuffles by
    the same permutation, whatever the batch): the run ends after 40 steps as its twin does, with
    the twin's losses up to float rounding (a step's gradient is summed in two parts). Without
    Dropout and BatchNormalization, whose outcome depends on the batch itself. Killed in epoch 2 as
    well, the kernel that takes over starts from the shrunk batch (the journal's) and raises the
    accumulation again before it loads the optimizer's state (its accumulators among it). With
    every_steps=2 the retry goes on within epoch 1, after the 2 batches of 16 rows trained before
    the fault's safe point: at its 5th batch of 8 rows, and the next cuts fall every 4 of them."""
    reference = plain_twin(tmp_path_factory)
    nb = harness.load("train_keras.ipynb", tmp_path, fault="oom-error", shrink="--shrink batch_size", dropout=0.0,
                      batch_norm=False, kill_epoch=kill_epoch, every_steps=every_steps)
    run, out = harness.run_ok(nb, tmp_path, standby=kill_epoch is not None)
    where = "epoch 2/4, batch 5/20" if every_steps else "epoch 2/4"
    assert "batch_size 16 → 8; retry 1/2" in out and f"continuing at {where} with batch_size 8" in out, out
    if every_steps:  # epoch 0 in 10 batches; epoch 1: 3 batches, the fault, then its batches 4..19 of 8 rows
        assert trained_batches(tmp_path) == [(0, b) for b in range(10)] + [(0, 100), (0, 101), (0, 102)] + [
            (0, 100 + b) for b in range(4, 20)] + [(0, e * 100 + b) for e in (2, 3) for b in range(20)]
    kept = ("colab_resilience: fit's batch is 8 now, 16 when the run began; the optimizer's gradient accumulation "
            "1 → 2 keeps the effective batch 16")
    assert out.count(kept) == (2 if kill_epoch else 1), out
    assert len(run.restarts) == (1 if kill_epoch else 0), out
    result = harness.result(nb)
    assert "epochs=[0, 1, 2, 3]" in result and " steps=40 " in result and " steps=40 " in reference, (result, reference)
    got, want = history_losses(result), history_losses(reference)
    assert len(got) == len(want) == 4 and got[0] == want[0], (got, want)  # epoch 0 ran before the shrink
    assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)


@pytest.mark.kernel
def test_a_shrunk_batch_with_a_learning_rate_schedule_is_said_not_to_keep_the_effective_batch(tmp_path):
    """With a learning-rate schedule, which Keras evaluates at every batch rather than every step
    once it accumulates gradients, the callback does not raise the accumulation: it says so in
    one line, and the epochs after the shrink take steps of 8 rows (20 an epoch: 70 in all)."""
    nb = harness.load("train_keras.ipynb", tmp_path, fault="oom-error", shrink="--shrink batch_size", schedule=True)
    run, out = harness.run_ok(nb, tmp_path, standby=False)
    assert "batch_size 16 → 8; retry 1/2" in out and "continuing at epoch 2/4 with batch_size 8" in out, out
    assert out.count("colab_resilience: fit's batch is 8 now, 16 when the run began; the optimizer's learning rate is "
                     "a schedule, which Keras advances at every batch, not every step, when it accumulates gradients, "
                     "so the epochs from here on take batches of 8 (the effective batch 16 is not kept)") == 1, out
    result = harness.result(nb)
    assert "epochs=[0, 1, 2, 3]" in result and " steps=70 " in result, result


@pytest.mark.kernel
def test_an_optimizers_own_gradient_accumulation_resumes_within_a_step_bit_identical(tmp_path, tmp_path_factory):
    """Adam(gradient_accumulation_steps=3) over epochs of 10 batches: a step spans two epochs, so
    at an epoch's end the accumulators hold the gradients of the batches since the last step.
    They go with the checkpoint (apart from the optimizer's other variables) and come back: killed
    in epoch 1, the run ends bit-identical to its twin."""
    reference = plain_twin(tmp_path_factory, dropout=0.25, batch_norm=True, accumulation=3)
    nb = harness.load("train_keras.ipynb", tmp_path, fault="sigkill", accumulation=3)
    run, out = harness.run_ok(nb, tmp_path)
    assert len(run.restarts) == 1 and "continuing at epoch 2/4" in out, out
    assert "gradient accumulation" not in out, out
    assert " steps=13 " in reference  # 40 batches: 13 steps and one batch summed
    assert harness.result(nb) == reference


def trained_batches(workdir) -> list[tuple[int, int]]:
    """(kernel, 100 * epoch + batch) for each batch begun."""
    return harness.by_kernel(workdir / "events.log.batches")


@pytest.mark.kernel
@pytest.mark.parametrize("fault,retries", [("sigkill", 2), ("oom-error", 2)], ids=["killed", "out-of-memory"])
def test_every_steps_resumes_a_fit_within_its_epoch_bit_identical(tmp_path, tmp_path_factory, fault, retries):
    """ResilienceCallback(every_steps=2): a safe point after every second batch too. Killed (or
    out of memory) after batch 2 of epoch 1, the fit goes on at batch 2 of epoch 1, where the last
    safe point was: the batches before it are drawn from the epoch's data but not trained again,
    the batches after it are numbered as in an uninterrupted epoch, and the epoch's running loss
    goes on from the safe point's. The result is bit-identical to the twin without every_steps
    (saves change nothing), History's epoch-1 loss included."""
    reference = twin(tmp_path_factory)
    nb = harness.load("train_keras.ipynb", tmp_path, fault=fault, retries=retries, every_steps=2)
    run, out = harness.run_ok(nb, tmp_path, standby=fault == "sigkill")
    assert "continuing at epoch 2/4, batch 3/10" in out, out
    assert len(run.restarts) == (1 if fault == "sigkill" else 0), out
    epoch_0, epoch_1 = [(0, b) for b in range(10)], [(0, 100), (0, 101), (0, 102)]
    again = 1 if fault == "sigkill" else 0  # the kernel that trains on
    rest = [(again, 100 + b) for b in range(2, 10)] + [(again, e * 100 + b) for e in (2, 3) for b in range(10)]
    assert trained_batches(tmp_path) == epoch_0 + epoch_1 + rest
    assert harness.result(nb) == reference


@pytest.mark.kernel
@pytest.mark.parametrize("every_steps,lr_scheduler,fault_epoch", [(2, True, 1), (2, "first", 1), (None, "first", 1),
                                                                  (None, "first", 0)],
                         ids=["within-an-epoch", "within-an-epoch-scheduler-first", "at-an-epochs-start-scheduler-first",
                              "at-the-fits-start-scheduler-first"])
@pytest.mark.parametrize("fault,retries", [("sigkill", 2), ("oom-error", 2)], ids=["killed", "out-of-memory"])
def test_a_resumed_fit_begins_its_epoch_once_with_its_compiled_metrics(tmp_path, tmp_path_factory, fault, retries,
                                                                      every_steps, lr_scheduler, fault_epoch):
    """A resumed fit runs its epoch's on_epoch_begin hooks again after the state was loaded, and
    a LearningRateScheduler scaled the optimizer's rate by 0.8 once more (the rest of the run
    trained at 0.8 of the uninterrupted rate, and the run said done: found by a probe): within an
    epoch (every_steps=2, the fault after batch 2 of epoch 1), where the safe point was taken after
    all the hooks, as a batch began; and at an epoch's start where the scheduler comes before
    ResilienceCallback in the fit's list (the safe point, taken in ResilienceCallback's hook, holds
    its scaling; not where the fault strikes in the first epoch, and the fit goes back to its
    start, taken before any epoch began). The notebook's own callback, after ResilienceCallback,
    counted the epoch twice within it. What the safe point holds comes back after those hooks. And a model compiled with
    metrics=["mae"] has no variables for them in a new kernel until its first step: the epoch's
    running loss and MAE, saved with them, were not put back, and History's epoch-1 loss and MAE
    counted from the resume on. Bit for bit as the twin: rate, count, losses and MAEs."""
    twin_parameters = dict(lr_scheduler=lr_scheduler, metrics=["mae"])
    reference = plain_twin(tmp_path_factory, dropout=0.25, batch_norm=True, every_steps=every_steps, **twin_parameters)
    nb = harness.load("train_keras.ipynb", tmp_path, fault=fault, retries=retries, every_steps=every_steps,
                      fault_epoch=fault_epoch, **twin_parameters)
    run, out = harness.run_ok(nb, tmp_path, standby=fault == "sigkill")
    where = f"epoch {fault_epoch + 1}/4, batch 3/10" if every_steps else f"epoch {fault_epoch + 1}/4"
    assert fault_epoch == 0 or f"continuing at {where}" in out, out
    assert len(run.restarts) == (1 if fault == "sigkill" else 0), out
    assert harness.result(nb) == reference
    assert re.search(r" rate=0\.0040\d* ", reference) and "],4,1 seen=" in reference and " mae=[" in reference, reference


@pytest.mark.kernel
@pytest.mark.parametrize("fault,first", [("sigkill", False), ("sigkill", True), ("oom-error", True)],
                         ids=["killed-listed-after", "killed-listed-before", "out-of-memory-listed-before"])
def test_a_fit_resumed_from_its_first_checkpoint_gives_the_callbacks_their_state_where_it_was_taken(
        tmp_path, tmp_path_factory, fault, first):
    """A fault in epoch 0 (a kill, or an OOM past the retries) goes back to the checkpoint taken as
    fit began, in ResilienceCallback's on_train_begin: the state of a callback listed before it
    holds its own on_train_begin, that of one listed after it does not yet. The state was given
    back as the first epoch began: that undid the epoch a callback listed before had just counted
    (it said 3 epochs of 4) and the fit a callback listed after had begun (0 fits). It goes back
    where it was taken; the fit ends bit for bit as its twin, counts included."""
    reference = twin(tmp_path_factory)
    nb = harness.load("train_keras.ipynb", tmp_path, fault=fault, fault_epoch=0, fault_step=3, retries=0,
                      fault_first=first)
    run, out = harness.run_ok(nb, tmp_path)
    assert len(run.restarts) == 1 and "continuing at epoch 1/4" in out, out
    assert harness.result(nb) == reference
    assert "],4,1 seen=[0, 1, 2, 3]" in reference, reference


@pytest.mark.kernel
@pytest.mark.parametrize("fault,retries", [("sigkill", 2), ("oom-error", 2)], ids=["killed", "out-of-memory"])
def test_a_fit_with_steps_per_epoch_resumes_where_its_data_had_got_to(tmp_path, tmp_path_factory, fault, retries):
    """With steps_per_epoch, Keras keeps the data's iterator from epoch to epoch: each epoch of 7
    batches goes on where the one before it stopped in a repeated dataset of 10. A fit resumed at
    epoch 2 drew from the data's beginning, trained on other batches, and said done. The 14
    batches epochs 0 and 1 drew are drawn again (not trained), as one line says; bit for bit as
    the twin."""
    reference = plain_twin(tmp_path_factory, dropout=0.25, batch_norm=True, data="repeated")
    nb = harness.load("train_keras.ipynb", tmp_path, fault=fault, retries=retries, data="repeated", fault_epoch=2)
    run, out = harness.run_ok(nb, tmp_path, standby=fault == "sigkill")
    assert len(run.restarts) == (1 if fault == "sigkill" else 0), out
    assert "continuing at epoch 3/4" in out, out
    assert "the 14 batches of epochs 1 to 2 were drawn again, not trained" in out, out
    assert "callback=[(0, 7), (1, 7), (2, 7), (3, 7)]" in reference and "steps=28 " in reference, reference
    assert harness.result(nb) == reference


@pytest.mark.kernel
@pytest.mark.parametrize("stop_epoch,kill", [(1, "end"), (3, "end"), (3, "result")],
                         ids=["in-an-early-epoch", "in-the-last-epoch", "in-the-last-epoch-killed-after-the-cell"])
def test_a_fit_a_callback_stopped_within_an_epoch_stays_stopped(tmp_path, tmp_path_factory, stop_epoch, kill):
    """With every_steps=2, a callback stops the fit after batch 4 of an epoch (as TerminateOnNaN
    does): the fit ends there. Killed as training ends (after the fit's last safe point), or in
    the result cell, the new kernel runs the training cell again: it loads the fit's final state
    and trains no batch, and the result is its twin's. In the last epoch too: the batches after
    the stop are not a stretch left to train."""
    reference = plain_twin(tmp_path_factory, dropout=0.25, batch_norm=True, every_steps=2, stop_at=(stop_epoch, 4))
    assert f"epochs={list(range(stop_epoch + 1))}" in reference, reference
    nb = harness.load("train_keras.ipynb", tmp_path, fault="sigkill", fault_step=kill, every_steps=2,
                      stop_at=(stop_epoch, 4))
    run, out = harness.run_ok(nb, tmp_path)
    assert len(run.restarts) == 1, out
    assert [k for k, _ in trained_batches(tmp_path)] == [0] * (stop_epoch * 10 + 5)  # none in the new kernel
    assert harness.result(nb) == reference


@pytest.mark.kernel
def test_every_steps_that_cannot_resume_within_an_epoch_says_why_and_keeps_to_epochs(tmp_path, tmp_path_factory):
    """With two batches a step (steps_per_execution=2), the callback cannot draw the batches of an
    epoch one by one: it says so in one line before training, and a kill in epoch 1 goes back to
    the start of epoch 1 (every batch of it is trained again)."""
    nb = harness.load("train_keras.ipynb", tmp_path, fault="sigkill", fault_step=3, every_steps=2,
                      steps_per_execution=2)  # its batches end in twos: 1, 3, ...
    run, out = harness.run_ok(nb, tmp_path)
    assert out.count("colab_resilience: ResilienceCallback(every_steps=2) resumes a fit within an epoch only with "
                     "one batch per step, and this model was compiled with steps_per_execution: every epoch is a "
                     "safe point, and a fault goes back to the start of its epoch") == 2, out  # once in each kernel
    assert len(run.restarts) == 1 and "continuing at epoch 2/4" in out and "batch 3/10" not in out, out
    assert [(k, n) for k, n in trained_batches(tmp_path) if k == 1][0] == (1, 100)


@pytest.mark.kernel
def test_a_kill_in_a_cell_after_the_fit_finds_the_trained_model(tmp_path, tmp_path_factory):
    """Killed in the result cell, after the training cell ended (its run done): the new kernel
    replays the set-up cell, which builds and compiles a fresh model, and runs the training cell
    again silently: its fit assigns the run's final variables into that model and trains no
    epoch, and returns the History of all four. The result cell, run again, sees them."""
    reference = twin(tmp_path_factory)
    nb = harness.load("train_keras.ipynb", tmp_path, fault="sigkill", fault_step="result")
    harness.run_killed_after_training(nb, tmp_path, "the Keras model, its optimizer, the epochs' logs and the state of Fault")
    assert trained_epochs(tmp_path / "events.log") == [(0, 0), (0, 1), (0, 2), (0, 3)]  # none again
    assert harness.result(nb) == reference


@pytest.mark.kernel
def test_a_finished_fit_whose_cell_reads_what_a_plain_cell_made_says_to_make_it_in_a_replay_cell(tmp_path):
    """The training cell makes its callback with a function a plain cell (not %%replay) defines,
    as an import in a notebook's first cell would be. Its first run says so; killed in the result
    cell, the new kernel cannot run the finished fit's cell again (NameError), and the run stops
    in one line that says to import or define the name in a %%replay cell (it said "make them
    build what the training had", the advice for a model built otherwise). Not "add it to
    --save": a function or class there is refused."""
    nb = harness.load("train_keras.ipynb", tmp_path, fault="sigkill", fault_step="result")
    train = nb.cells[harness.index(nb, "train")]
    train.source = train.source.replace("fault_callback = Fault()", "fault_callback = make_fault()")
    harness.insert(nb, "train", "def make_fault():\n    return Fault()", "plain")
    run = harness.run(nb, tmp_path)
    first = harness.cell_text(train).split("colab_resilience: the kernel died")[0]
    assert ("colab_resilience: this cell reads make_fault, which neither --save nor a %%replay cell would bring back "
            "after a restart; import or define make_fault in a %%replay cell (--save holds values, not code)") in first
    assert run.status == 1 and run.failed_cell == harness.index(nb, "result"), run.message
    assert run.message.endswith(
        "(NameError: name 'make_fault' is not defined), and the cells after its training would see what the set-up "
        "cells rebuilt, untrained; its cell, run again to put it back, reads a name no set-up cell makes: import or "
        "define it in a %%replay cell, and run the notebook again"), run.message


@pytest.mark.kernel
@pytest.mark.parametrize("fault_epoch,fault_step", [(3, 2), (3, "end")], ids=["in-epoch-3", "after-it-stopped"])
def test_early_stoppings_count_and_best_weights_go_with_the_checkpoint(tmp_path, tmp_path_factory, fault_epoch,
                                                                       fault_step):
    """EarlyStopping (patience 2, min_delta 0.5, best weights restored) stops the uninterrupted fit
    of 8 epochs after epoch 3, with epoch 1's weights. Killed in epoch 3, when it has counted one
    epoch without progress, the resumed fit stops at the same place (a fresh EarlyStopping would
    have trained on: its count was reset by its on_train_begin, and it had turned min_delta
    negative for a loss, which must stay so); killed when training ended, after the callback's
    last safe point and before the cell ended, the resumed fit trains no more epochs. Both end
    with the uninterrupted weights."""
    early = uninterrupted(tmp_path_factory, early_stop=True, epochs=8)
    assert "epochs=[0, 1, 2, 3]" in early  # it stopped early
    nb = harness.load("train_keras.ipynb", tmp_path, early_stop=True, epochs=8, fault="sigkill",
                      fault_epoch=fault_epoch, fault_step=fault_step)
    run, out = harness.run_ok(nb, tmp_path)
    assert len(run.restarts) == 1, out
    assert "the state of EarlyStopping, Fault in " in out, out
    assert ("the loop had finished" if fault_step == "end" else "continuing at epoch 4/8") in out, out
    assert harness.result(nb) == early
    assert max(e for _, e in trained_epochs(tmp_path / "events.log")) == 3


@pytest.mark.kernel
def test_a_cell_run_again_after_a_death_gets_back_the_fit_that_finished_before_it(kernel, tmp_path):
    """Interactive, as in Jupyter: a fit finished; the next training cell, which reads the model,
    is killed; the user runs that cell again alone. The new kernel had the model the set-up cell
    compiles, untrained, and no ``history`` (found by a probe: a driver ran the finished fit's
    cell again for its state, an interactive kernel did not). Now it does, silently, before the
    cell goes on: the fit loads its final state and trains nothing, and the cell's result is bit
    for bit the uninterrupted one."""
    kill = (f"    if epoch == 1 and not os.path.exists({str(tmp_path / 'm')!r}):\n"
            f"        open({str(tmp_path / 'm')!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")
    cells = [
        "%load_ext colab_resilience",
        "%%replay\nimport os, signal\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\nimport numpy as np, keras\n"
        "keras.utils.set_random_seed(0)\nX = np.random.rand(64, 4).astype('float32'); Y = X[:, :1] * 2\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation='relu'), keras.layers.Dense(1)])\n"
        "model.compile(optimizer=keras.optimizers.Adam(0.01), loss='mse')\npreds = []",
        "%%resilient\nfrom colab_resilience.integrations.keras import ResilienceCallback\n"
        "history = model.fit(X, Y, epochs=3, batch_size=16, verbose=0, callbacks=[ResilienceCallback()])",
        "%%resilient --save preds\nfor epoch in resume_range(3):\n" + kill
        + "    preds.append(float(model(X).numpy().sum()))",
        "print('RESULT', preds, history.history['loss'])",
    ]
    twin = harness.notebook(*[c.replace(str(tmp_path / "m"), str(tmp_path / "twin" / "m")) for c in cells])
    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "m").touch()
    harness.uninterrupted_ok(harness.run(twin, tmp_path / "twin", standby=False))
    for source in cells[:3]:
        kernel.ok(source)
    _, code = kernel.execute_until_exit(cells[3])
    assert code == -9
    kernel.restart()
    out = kernel.ok(cells[3]).stdout
    assert "put back the Keras model, its optimizer and the epochs' logs from the training that had finished" in out, out
    assert harness.result(kernel.ok(cells[4]).stdout) == harness.result(twin)


@pytest.mark.kernel
def test_a_keras_fit_killed_in_a_kernel_goes_on_when_its_cell_runs_again(kernel, tmp_path, tmp_path_factory):
    """Interactive, as in Jupyter: the kernel dies in epoch 1, the server brings one back, the user
    runs the training cell again: the set-up cell is replayed, the model restored into, fit goes on
    at epoch 1, bit-identical."""
    reference = twin(tmp_path_factory)
    nb = harness.load("train_keras.ipynb", tmp_path, fault="sigkill")
    out = harness.killed_and_rerun(kernel, nb)
    assert "replayed 3 cells, restored epochs_seen, the Keras model, its optimizer, the epochs' logs and the state of Fault in " \
           in out, out
    assert "continuing at epoch 2/4" in out
    assert harness.result(kernel.ok(harness.user_cell(nb, "result")).stdout) == reference
    assert [e for _, e in trained_epochs(tmp_path / "events.log")] == [0, 1, 1, 2, 3]


@pytest.mark.kernel
def test_a_stopped_fits_cell_run_again_on_the_model_it_trained_is_refused(kernel, tmp_path, tmp_path_factory):
    """A fit stopped by an error in epoch 1 (the stop button does the same), its cell run again
    without the set-up cells: the fit began at epoch 0 on the model the stopped fit had trained (no
    --save names it: the callback keeps it), dropped the checkpoint, and ended "done" with 4 epochs
    too many. Refused in one line naming the model; the set-up cells run first, the fit starts
    over and ends as the uninterrupted twin, bit for bit."""
    reference = twin(tmp_path_factory)
    nb = harness.load("train_keras.ipynb", tmp_path, fault="error")
    r = harness.stopped_and_run_again(kernel, nb)
    assert r.status == "error" and "epochs_seen, model hold what its training left, not what the set-up cells made" \
        in r.evalue, (r.evalue, r.stdout)
    harness.run_interactive(kernel, nb, start="setup", stop="train")
    out = kernel.ok(harness.user_cell(nb, "train")).stdout
    assert "it starts again from its beginning now and that checkpoint is dropped" in out, out
    # the model built again in this kernel has other variable paths (dense_1/...), which the RESULT
    # line's fingerprints hash: the rest of the line is compared, and every value with a twin fit
    # on the set-up cell run once more
    without_paths = re.compile(r" (model|optimizer)=[0-9a-f]+")
    assert without_paths.sub("", harness.result(kernel.ok(harness.user_cell(nb, "result")).stdout)) == \
        without_paths.sub("", reference)
    kernel.ok("resumed = [v.numpy() for v in [*model.variables, *model.optimizer.variables]]")
    harness.run_interactive(kernel, nb, start="setup", stop="train")
    kernel.ok("model.fit(**train, epochs=epochs, verbose=0)")
    assert kernel.value("[np.array_equal(a, v.numpy()) for a, v in zip(resumed, [*model.variables, *model.optimizer.variables])]") \
        == [True] * kernel.value("len(resumed)")


@pytest.mark.kernel
@pytest.mark.parametrize("parameters,said", [
    ({"seed": None}, ("colab_resilience: no random seed is set, so Keras initialises, shuffles and drops out "
                      "differently in every kernel, and a resumed fit is not identical to an uninterrupted one; "
                      "call keras.utils.set_random_seed(...) in a %%replay cell for an exact resume")),
    ({"data": "dataset"}, ("colab_resilience: fit's tf.data.Dataset shuffles anew each epoch "
                           "(reshuffle_each_iteration=True), and a resumed fit cannot draw the order of the epoch it "
                           "goes on with, so it is not identical to an uninterrupted one; pass arrays, or a dataset "
                           "that shuffles with reshuffle_each_iteration=False, for an exact resume")),
], ids=["no-seed", "reshuffling-dataset"])
def test_where_a_resume_cannot_be_identical_the_callback_says_so_once_before_training(tmp_path, parameters, said):
    """The line comes before the first epoch, once in the kernel (not again at each epoch); the
    fit still resumes after a kill (at epoch 1, with its epochs' logs)."""
    nb = harness.load("train_keras.ipynb", tmp_path, fault="sigkill", **parameters)
    run, out = harness.run_ok(nb, tmp_path)
    lines = out.splitlines()
    assert lines.count(said) == 2, out  # the first kernel's fit, and the resumed one's
    died = next(i for i, line in enumerate(lines) if line.startswith("colab_resilience: the kernel died"))
    assert lines.index(said) < died, out  # before the fault in epoch 1: when training started
    assert "continuing at epoch 2/4" in out and "epochs=[0, 1, 2, 3]" in harness.result(nb)


@pytest.mark.kernel
def test_a_list_a_lambda_callback_changes_without_save_is_named_at_the_first_run(tmp_path, tmp_path_factory):
    """The training cell's LambdaCallback appends each finished epoch to a list the set-up cell
    made. The fit goes on from its safe point after a kill, but that list came back as the
    replayed set-up cell made it (empty: `seen=[1, 2, 3]`, not `[0, 1, 2, 3]`), and the run said
    done. Without --save for it, the cell's first run names it, in one line, before training; with
    it (the notebook's default, in every other test here), a killed fit ends with the twin's list."""
    nb = harness.load("train_keras.ipynb", tmp_path, save="")
    run, out = harness.run_ok(nb, tmp_path)
    assert ("colab_resilience: code the fit calls (a callback) changes epochs_seen without --save: after a rollback "
            "or a restart the fit goes on from its safe point, but it would not be back at it, and the result would "
            "differ; add it to --save") in out.splitlines(), out
    (tmp_path / "saved").mkdir()
    nb = harness.load("train_keras.ipynb", tmp_path / "saved", fault="sigkill")
    run, out = harness.run_ok(nb, tmp_path / "saved")
    assert "code the fit calls" not in out and "seen=[0, 1, 2, 3]" in harness.result(nb), out
    assert harness.result(nb) == twin(tmp_path_factory)


@pytest.mark.kernel
def test_outside_a_resilient_cell_the_callback_does_nothing_and_says_so(kernel, tmp_path):
    nb = harness.load("train_keras.ipynb", tmp_path, epochs=2)
    harness.run_interactive(kernel, nb, stop="train")
    cell = harness.user_cell(nb, "train").split("\n", 1)[1]  # without %%resilient
    reply = kernel.ok(cell + "\n" + cell.splitlines()[-1])  # two fits: said once
    assert reply.stderr.count("colab_resilience: ResilienceCallback outside a %%resilient cell: nothing is "
                              "checkpointed") == 1, reply.stderr
    assert "epochs=[0, 1]" in harness.result(kernel.ok(harness.user_cell(nb, "result")).stdout)


@pytest.mark.kernel
def test_colab_resilience_check_passes_the_keras_notebook(tmp_path):
    """With the progress bar ``fit`` draws by default (``verbose=1``): drawn again in place with
    carriage returns and backspaces, in colour, with its times per step; a fault strikes while it
    is drawn. check compares what the notebook shows (it called every faulted run different, at
    the first bar's times: found by a probe)."""
    r = subprocess.run(
        [sys.executable, "-m", "colab_resilience", "check", str(harness.FILES / "train_keras.ipynb"), "--faults", "3",
         "--seed", "1", "--kernel", harness.KERNEL_NAME, "-p", "mark", str(tmp_path / "mark"), "-p", "verbose", "1"],
        capture_output=True, text=True, timeout=300, check=False, env=harness.child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical after each of 3 faults" in r.stdout, r.stdout



STANDBY_DONE = """\
import os, time
def standby():  # the driver's live standby kernel: whether it has TensorFlow loaded; None when there is none
    for entry in os.listdir('/proc'):
        try:
            with open(f'/proc/{entry}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
            with open(f'/proc/{entry}/environ', 'rb') as f:
                env = f.read().split(b'\\0')
            if int(fields[1]) != os.getppid() or fields[0] == 'Z' or b'COLAB_RESILIENCE_STANDBY=1' not in env:
                continue
            with open(f'/proc/{entry}/maps') as f:
                return 'tensorflow' in f.read()
        except (OSError, ValueError):
            continue
    return None
state, since, deadline = 'none', None, time.monotonic() + 120
while time.monotonic() < deadline:
    loaded = standby()
    if loaded is None:
        state = 'gone'
        break
    since = since or (time.monotonic() if loaded else None)
    if since and time.monotonic() - since > 10:
        state = 'alive with tensorflow'
        break
    time.sleep(0.1)
print('STANDBY', state)
"""


@pytest.mark.parametrize("seeded_first", [True, False], ids=["seeded-before-the-import", "seeded-after"])
def test_a_standby_that_imported_tensorflow_ahead_takes_over_only_where_the_import_drew_unseeded(
        tmp_path, seeded_first):
    """TensorFlow draws from NumPy's (and Python's) global random state when imported. A notebook
    that seeds NumPy, then imports TensorFlow, then draws, gets numbers that depend on that import;
    a standby that imported TensorFlow ahead and replayed the set-up cells drew others (the data
    after the restart differed from the data before, and the run said done). The standby
    imports nothing more once such an import drew, the driver restarts cold instead of adopting it
    and says why, and the numbers are the same. A notebook that imports TensorFlow before it seeds
    (as most do) keeps the standby: the import drew from states nothing had seeded yet, there as in
    the standby, and the numbers are the same after the takeover too."""
    mark = tmp_path / "killed"
    setup = "%%replay\nimport os\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\nimport numpy as np"
    nb = harness.notebook(
        "%load_ext colab_resilience",
        setup + "\nnp.random.seed(0)" if seeded_first else setup,
        "%%replay\nimport tensorflow as tf" + ("" if seeded_first else "\nnp.random.seed(0)"),
        "%%replay\nx = float(np.random.rand())\nprint('X', x)",
        STANDBY_DONE,
        f"%%resilient --save total\nimport signal\ntotal = 0\nfor i in resume_range(3):\n    total += 1\n"
        f"    if i == 1 and not os.path.exists({str(mark)!r}):\n"
        f"        open({str(mark)!r}, 'w').close()\n        os.kill(os.getpid(), signal.SIGKILL)",
        "print('AFTER', x)",
    )
    result = harness.run(nb, tmp_path)
    assert result.status == 0, result.message
    text = [harness.cell_text(c) for c in nb.cells]
    assert "STANDBY alive with tensorflow" in text[4], text[4]  # imported ahead, before the kill
    before = text[3].split()[1]
    assert text[6].strip() == f"AFTER {before}", text
    [restart] = result.restarts
    assert restart.standby is not seeded_first
    if seeded_first:
        assert ("restarted it (not the standby kernel: importing tensorflow drew from Python's or NumPy's global "
                "random state, which a replay in a kernel that imported it ahead cannot draw again)") in text[5], text[5]
    else:
        assert re.search(r"switched to the standby kernel, replayed \d+ cells", text[5]), text[5]


_FIT_IMPORTS = "import os, signal\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\nimport numpy as np, keras\n"
_FIT_BUILD = ("keras.utils.set_random_seed(0)\nX = np.random.rand(64, 4).astype('float32'); Y = X[:, :1] * 2\n"
              "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation='relu'), "
              "keras.layers.Dense(1)])\nmodel.compile(optimizer=keras.optimizers.Adam(0.01), loss='mse')")


def _killed_fit(mark) -> str:
    """The training cell of :data:`_FIT_BUILD`'s model: 3 epochs, killed once after its epoch 1."""
    kill = (f"kill = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: epoch == 1 and not "
            f"os.path.exists({str(mark)!r}) and (open({str(mark)!r}, 'w').close(), os.kill(os.getpid(), signal.SIGKILL)))\n")
    return ("%%resilient\nfrom colab_resilience.integrations.keras import ResilienceCallback\n" + kill
            + "history = model.fit(X, Y, epochs=3, batch_size=16, verbose=0, callbacks=[ResilienceCallback(), kill])")


def _policy_notebook(where: str, mark):
    """keras.mixed_precision.set_global_policy("mixed_bfloat16") in a plain cell, or in the %%replay
    cell that builds the model; the fit killed once after its epoch 1."""
    policy = "keras.mixed_precision.set_global_policy('mixed_bfloat16')\n"
    return harness.set_in(where, policy, _FIT_IMPORTS, _FIT_BUILD, _killed_fit(mark),
                          "print('RESULT', history.history['loss'], model.layers[0].compute_dtype)")


@pytest.mark.kernel
@pytest.mark.parametrize("where", ["plain-cell", "replay-cell"])
def test_a_dtype_policy_a_plain_cell_set_is_not_lost_silently_by_a_kill(tmp_path, where):
    """The mixed-precision policy set in a plain cell: killed in the fit, the new kernel built the
    model under float32 and the fit went on computing otherwise, "done" (found by a probe): the run
    stops with the line that names the policy. Set in the %%replay cell, as the line says, the run
    resumes bit for bit as its twin, in bfloat16."""
    refused = ("the model computes with Keras's dtype policy float32 now and was saved computing with mixed_bfloat16"
               if where == "plain-cell" else None)
    _, nb, twin = harness.refused_or_twin(tmp_path, lambda mark: _policy_notebook(where, mark), refused)
    assert harness.result(twin).endswith(" bfloat16")


@pytest.mark.kernel
def test_tensorflows_op_determinism_a_plain_cell_set_is_on_again_after_a_kill(tmp_path):
    """``tf.config.experimental.enable_op_determinism()`` (and TF32 off) in a plain cell, as Keras's
    advice for reproducible training has it beside ``set_random_seed``: killed in the fit, the new
    kernel went on with TensorFlow's defaults, determinism off and TF32 on (on a GPU: other numbers,
    "done"). The settings come back with the checkpoint, and the run ends as its twin."""
    setting = ("import tensorflow as tf\ntf.config.experimental.enable_op_determinism()\n"
               "tf.config.experimental.enable_tensor_float_32_execution(False)\n")
    _, _, twin = harness.refused_or_twin(tmp_path, lambda mark: harness.set_in(
        "plain-cell", setting, _FIT_IMPORTS, _FIT_BUILD, _killed_fit(mark),
        "from tensorflow.python.framework import config as tfc\n"
        "print('RESULT', history.history['loss'], tfc.is_op_determinism_enabled(), tfc.tensor_float_32_execution_enabled())"),
        None)
    assert harness.result(twin).endswith(" True False"), harness.result(twin)


@pytest.mark.kernel
@pytest.mark.parametrize("where", ["plain-cell", "replay-cell"])
def test_tensorflows_thread_pool_a_plain_cell_set_is_not_lost_silently_by_a_kill(tmp_path, where):
    """``tf.config.threading.set_intra_op_parallelism_threads(1)`` in a plain cell (advice for
    reproducible training on a CPU): killed in the fit, the new kernel's replay ran TensorFlow's
    first op with its default pool, which TensorFlow then cannot change, and the fit went on
    splitting its sums otherwise and said "done" (a Dense fit of 4096 rows of 256 features here
    ends its first epoch with another loss with 1 thread than with 2). The run stops with the line that names the setting; set
    in the %%replay cell before TensorFlow's first op, as the line says, it resumes bit for bit as
    its twin, with 1 thread."""
    setting = "import tensorflow as tf\ntf.config.threading.set_intra_op_parallelism_threads(1)\n"
    refused = ("TensorFlow's intra-op thread pool had 1 thread as the run began and has TensorFlow's default (one "
               "per core) in this kernel, which cannot change it once TensorFlow ran an op: a cell that is not replayed "
               "set it (tf.config.threading.set_intra_op_parallelism_threads(1))" if where == "plain-cell" else None)
    faulted, _, twin = harness.refused_or_twin(tmp_path, lambda mark: harness.set_in(
        where, setting, _FIT_IMPORTS, _FIT_BUILD, _killed_fit(mark),
        "import tensorflow as tf\nprint('RESULT', history.history['loss'], tf.config.threading.get_intra_op_parallelism_threads())"),
        refused)
    assert harness.result(twin).endswith("] 1"), harness.result(twin)
    if refused:  # headless: the command run again, after the %%replay cell is changed
        assert "run the command again (the run goes on), or `colab-resilience reset " in faulted.message, faulted.message


def _rate_changed_notebook(where: str, mark):
    """A compiled model in the %%replay cell; its optimizer's rate lowered in a plain cell, or in
    the training cell before ``fit``; the training cell killed once before ``fit`` (no checkpoint
    yet)."""
    kill = (f"if not os.path.exists({str(mark)!r}):\n"
            f"    open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")
    change = "_ = model.optimizer.learning_rate.assign(0.003)\n"
    return harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport os, signal\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\nimport numpy as np, keras\n"
        "keras.utils.set_random_seed(0)\nX = np.random.rand(64, 4).astype('float32'); Y = X[:, :1] * 2\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation='relu'), keras.layers.Dense(1)])\n"
        "model.compile(optimizer=keras.optimizers.Adam(0.01), loss='mse')",
        change if where == "plain-cell" else "pass",
        "%%resilient\nfrom colab_resilience.integrations.keras import ResilienceCallback\n"
        + (change if where == "training-cell" else "") + kill
        + "history = model.fit(X, Y, epochs=3, batch_size=16, verbose=0, callbacks=[ResilienceCallback()])",
        "print('RESULT', history.history['loss'], float(model.optimizer.learning_rate))")


@pytest.mark.parametrize("where", ["plain-cell", "training-cell"])
def test_a_rate_a_plain_cell_set_is_not_lost_silently_by_a_kill_before_fit(tmp_path, where):
    """Killed before ``fit`` (its first checkpoint), the run went on with the model the replay
    compiled, at the rate the %%replay cell set, not the one a plain cell assigned, and said done
    with other losses (found by a probe): the run stops with the line that names the model. The
    same change made in the training cell before ``fit`` resumes bit for bit as its twin."""
    refused = "model is not what the run began with, and the kernel died before the run's first checkpoint"
    _, nb, twin = harness.refused_or_twin(tmp_path, lambda mark: _rate_changed_notebook(where, mark),
                                          refused if where == "plain-cell" else None)
    assert harness.result(twin).endswith(" 0.003000000026077032")
    if where == "training-cell":  # said as what it is, a fit (it said "the loop")
        out = harness.cell_text(nb.cells[3])
        assert "no checkpoint yet, the training starts from the beginning" in out, out
