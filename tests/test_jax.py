"""JAX and flax: a ``TrainState`` (closures inside: it cannot be pickled), optax states, ``nnx``
modules and optimizers are saved by their leaves and restored into the objects the set-up cells
rebuilt; PRNG keys, bfloat16 and weakly typed arrays round-trip; a flax run killed or out of
memory mid-epoch resumes bit-identical to its uninterrupted twin, in a kernel that never imports
torch. (A ``TrainState`` used to be refused as unsaveable.)

Skipped where JAX, flax or optax is not installed; CI's framework stack (``.ci/run``) has them
and no torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (CI's framework stack has it)")
pytest.importorskip("flax", reason="flax is not installed (CI's framework stack has it)")
pytest.importorskip("optax", reason="optax is not installed (CI's framework stack has it)")

import flax.linen as nn
import harness
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from colab_resilience.checkpoints import CheckpointStore
from colab_resilience.checkpoints.staging import Budget, Staging
from colab_resilience.errors import CheckpointError


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)


def build(tx=None) -> dict:
    """What a set-up cell builds (the same every time)."""
    mlp = MLP()
    params = mlp.init(jax.random.key(0), jnp.ones((1, 4)))
    net = Net(nnx.Rngs(0))
    return {
        "state": train_state.TrainState.create(apply_fn=mlp.apply, params=params, tx=tx or optax.adamw(1e-2)),
        "net": net,
        "opt": nnx.Optimizer(net, optax.adam(1e-3), wrt=nnx.Param),
        "key": jax.random.key(7),
        "raw_key": jax.random.PRNGKey(3),
        "half": jnp.arange(5, dtype=jnp.bfloat16),
        "weak": jnp.asarray(2.0) * 1.5,
        "params": params,
    }


@jax.jit
def _step(state, x):
    grads = jax.grad(lambda p: (state.apply_fn(p, x) ** 2).sum())(state.params)
    return state.apply_gradients(grads=grads)


def trained() -> dict:
    ns = build()
    for i in range(3):
        ns["state"] = _step(ns["state"], jnp.ones((2, 4)) * i)  # its step becomes an array
    ns["key"], _ = jax.random.split(ns["key"])
    ns["net"].lin.kernel[...] = ns["net"].lin.kernel[...] + 1
    ns["net"].drop.rngs.count[...] += 5
    ns["opt"].step[...] += 2
    return ns


def leaves(value) -> list:
    tree = nnx.state(value) if isinstance(value, (nnx.Module, nnx.Optimizer)) else value
    return jax.tree_util.tree_leaves(tree)


def same_leaf(a, b) -> bool:
    if isinstance(a, jax.Array) != isinstance(b, jax.Array):
        return False
    if not isinstance(a, jax.Array):
        return type(a) is type(b) and a == b
    key = jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    if key:
        if not jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key) or jax.random.key_impl(a) != jax.random.key_impl(b):
            return False
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    return (a.dtype == b.dtype and a.shape == b.shape and a.weak_type == b.weak_type
            and np.asarray(a).tobytes() == np.asarray(b).tobytes())


@pytest.mark.parametrize("staged", [False, True], ids=["synchronous", "background"])
def test_flax_and_optax_state_is_saved_by_its_leaves_and_restored_into_the_rebuilt_objects(tmp_path, staged):
    ns = trained()
    store = CheckpointStore(tmp_path, run_id="jax", key=b"k" * 32)
    names = list(ns)
    store.persist(store.snapshot(ns, names, strict=True, staging=Staging(Budget()) if staged else None))
    ckpt = store.load()
    assert {n: ckpt.kinds[n] for n in ("state", "net", "opt")} == dict.fromkeys(("state", "net", "opt"), "pytree")
    fresh = build()
    net, opt = fresh["net"], fresh["opt"]
    assert not all(map(same_leaf, leaves(ns["state"]), leaves(fresh["state"])))  # it did train
    ckpt.restore(fresh)
    assert fresh["net"] is net and fresh["opt"] is opt  # nnx objects: updated in place
    assert fresh["state"].apply_fn is not None and fresh["state"].tx is not None  # the rebuilt static parts
    for n in names:
        a, b = leaves(ns[n]), leaves(fresh[n])
        assert len(a) == len(b) and all(map(same_leaf, a, b)), n
    assert jax.random.key_impl(fresh["key"]) == jax.random.key_impl(ns["key"])
    # the restored state trains on exactly as the saved one does
    assert all(map(same_leaf, leaves(_step(ns["state"], jnp.ones((2, 4)))), leaves(_step(fresh["state"], jnp.ones((2, 4))))))


def test_a_rebuilt_state_of_another_structure_is_refused_in_one_line_and_left_as_it_was(tmp_path):
    ns = trained()
    store = CheckpointStore(tmp_path, run_id="jax", key=b"k" * 32)
    store.save(ns, ["state", "net"], strict=True)
    ckpt = store.load()
    other = build(tx=optax.sgd(0.1))  # the set-up cell now builds another optimizer
    before = leaves(other["state"])
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(other, ["state"])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("colab_resilience: cannot restore 'state' into the TrainState the set-up cells built: "
                              "its tree differs (14 leaves saved, 5 now; leaf 5 was .opt_state[0].count")
    assert "`%resilience reset`" in message
    assert all(map(same_leaf, before, leaves(other["state"])))
    with pytest.raises(CheckpointError, match="no variable 'net' exists now; build it in a %%replay cell"):
        ckpt.restore({}, ["net"])


def test_a_64_bit_array_that_jax_would_make_32_bit_now_is_refused_in_one_line(tmp_path):
    """jax_enable_x64 set in a plain cell: a new kernel has it off, and the saved float64 arrays
    came back float32 (jnp.array converts them, saying nothing); the run went on in the other
    precision, "done" (found by a probe; check said DIFFERS). The restore now stops in one line
    that names the setting; with it on again, the arrays come back as they were."""
    jax.config.update("jax_enable_x64", True)
    try:
        params = {"w": jnp.arange(4.0) / 3, "b": jnp.zeros(())}
        assert params["w"].dtype == jnp.float64
        store = CheckpointStore(tmp_path, run_id="jax", key=b"k" * 32)
        store.save({"params": params}, ["params"], strict=True)
        jax.config.update("jax_enable_x64", False)
        ns = {"params": {"w": jnp.zeros(4), "b": jnp.zeros(())}}
        with pytest.raises(CheckpointError) as e:
            store.load().restore(ns, ["params"])
        message = str(e.value)
        assert "\n" not in message and message.startswith(
            "colab_resilience: cannot restore 'params': a JAX array of it was saved as float64 and JAX makes it "
            "float32 now: 64-bit types (jax.config.update('jax_enable_x64', True)) set in a cell that is not "
            "%%replay are off in a new kernel; set them in a %%replay cell before the arrays are made"), message
        assert ns["params"]["w"].dtype == jnp.float32 and not ns["params"]["w"].any()
        jax.config.update("jax_enable_x64", True)
        store.load().restore(ns, ["params"])
        assert ns["params"]["w"].dtype == jnp.float64 and np.array_equal(ns["params"]["w"], params["w"])
    finally:
        jax.config.update("jax_enable_x64", False)


def _x64_notebook(where: str, mark):
    """64-bit types on in a plain cell, or in the %%replay cell that makes the arrays; an optax
    loop killed once after its epoch 1."""
    x64 = "jax.config.update('jax_enable_x64', True)\n"
    kill = (f"    if epoch == 1 and not os.path.exists({str(mark)!r}):\n"
            f"        open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")
    return harness.set_in(
        where, x64, "import os, signal\nimport jax, jax.numpy as jnp, optax",
        "X = jax.random.normal(jax.random.key(0), (64, 8)); Y = X.sum(1)\n"
        "params = {'w': jnp.zeros(8), 'b': jnp.zeros(())}\ntx = optax.adam(1e-2); opt_state = tx.init(params)\n"
        "losses = []\n@jax.jit\ndef step(params, opt_state):\n"
        "    loss, g = jax.value_and_grad(lambda p: ((X @ p['w'] + p['b'] - Y) ** 2).mean())(params)\n"
        "    u, opt_state = tx.update(g, opt_state, params)\n    return optax.apply_updates(params, u), opt_state, loss",
        "%%resilient --save params,opt_state,losses\nfor epoch in resume_range(3):\n"
        "    for _ in range(5):\n        params, opt_state, loss = step(params, opt_state)\n"
        "    losses.append(float(loss))\n" + kill,
        "print('RESULT', losses, params['w'].dtype)")


@pytest.mark.kernel
@pytest.mark.parametrize("where", ["plain-cell", "replay-cell"])
def test_64_bit_types_a_plain_cell_turned_on_are_not_lost_silently_by_a_kill(tmp_path, where):
    """Killed after an epoch, the new kernel (64-bit types off) made the saved float64 parameters
    float32 and the loop went on in float32, "done": the run stops with the line that names the
    setting. Set in the %%replay cell, as the line says, it resumes bit for bit as its twin."""
    refused = "a JAX array of it was saved as float64 and JAX makes it float32 now" if where == "plain-cell" else None
    _, _, twin = harness.refused_or_twin(tmp_path, lambda mark: _x64_notebook(where, mark), refused)
    assert harness.result(twin).endswith(" float64")


def test_jaxs_random_and_precision_flags_go_with_the_random_states():
    """JAX's flags that change what a computation gives, set otherwise after the capture, are as
    they were once the state is restored (a new kernel has JAX's defaults), and a key drawn from
    gives the numbers it gave under them."""
    from colab_resilience.checkpoints import capture_rng, restore_rng

    names = ("jax_threefry_partitionable", "jax_random_seed_offset", "jax_default_matmul_precision",
             "jax_softmax_custom_jvp")
    before = {n: getattr(jax.config, n) for n in names}
    try:
        jax.config.update("jax_threefry_partitionable", not before["jax_threefry_partitionable"])
        jax.config.update("jax_random_seed_offset", 3)
        jax.config.update("jax_default_matmul_precision", "highest")
        jax.config.update("jax_softmax_custom_jvp", not before["jax_softmax_custom_jvp"])
        drawn = np.asarray(jax.random.normal(jax.random.key(0), (4,)))
        state = capture_rng()
        for n, v in before.items():
            jax.config.update(n, v)
        assert not np.array_equal(np.asarray(jax.random.normal(jax.random.key(0), (4,))), drawn)
        restore_rng(state)
        assert {n: getattr(jax.config, n) for n in names} == {
            "jax_threefry_partitionable": not before["jax_threefry_partitionable"], "jax_random_seed_offset": 3,
            "jax_default_matmul_precision": "highest", "jax_softmax_custom_jvp": not before["jax_softmax_custom_jvp"]}
        assert np.array_equal(np.asarray(jax.random.normal(jax.random.key(0), (4,))), drawn)
    finally:
        for n, v in before.items():
            jax.config.update(n, v)


def _flag_notebook(mark):
    """An optax loop that draws noise from a saved key every epoch, under JAX's old random bits
    (``jax_threefry_partitionable`` off, as JAX's changelog advises for the numbers of before 0.5)
    set in a plain cell after the %%replay cell; killed once after its epoch 1."""
    kill = (f"    if epoch == 1 and not os.path.exists({str(mark)!r}):\n"
            f"        open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")
    return harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport os, signal\nimport jax, jax.numpy as jnp, optax\n"
        "X = jax.random.normal(jax.random.key(0), (64, 8)); Y = X.sum(1); key = jax.random.key(1)\n"
        "params = {'w': jnp.zeros(8), 'b': jnp.zeros(())}\ntx = optax.adam(1e-2); opt_state = tx.init(params)\n"
        "losses = []\n@jax.jit\ndef step(params, opt_state, x):\n"
        "    loss, g = jax.value_and_grad(lambda p: ((x @ p['w'] + p['b'] - Y) ** 2).mean())(params)\n"
        "    u, opt_state = tx.update(g, opt_state, params)\n    return optax.apply_updates(params, u), opt_state, loss",
        "jax.config.update('jax_threefry_partitionable', False)",
        "%%resilient --save params,opt_state,losses,key\nfor epoch in resume_range(3):\n"
        "    key, sub = jax.random.split(key)\n    x = X + jax.random.normal(sub, X.shape)\n"
        "    for _ in range(5):\n        params, opt_state, loss = step(params, opt_state, x)\n"
        "    losses.append(float(loss))\n" + kill,
        "print('RESULT', losses, jax.config.jax_threefry_partitionable)")


@pytest.mark.kernel
def test_jaxs_random_bits_a_plain_cell_chose_are_chosen_again_after_a_kill(tmp_path):
    """``jax_threefry_partitionable`` off in a plain cell: killed after an epoch, the new kernel had
    it on (JAX's default) and the keys the loop split drew other noise from then on, "done". The
    flag comes back with the checkpoint, and the run ends as its twin."""
    _, _, twin = harness.refused_or_twin(tmp_path, _flag_notebook, None)
    assert harness.result(twin).endswith(" False"), harness.result(twin)


def twin(tmp_path_factory, api: str) -> str:
    """The RESULT of train_flax.ipynb run uninterrupted with ``api``, once in the session."""
    return harness.twin_result(tmp_path_factory, "train_flax.ipynb", api=api)


@pytest.mark.kernel
@pytest.mark.parametrize("fault,retries", [("sigkill", 2), ("oom-error", 2), ("oom-error", 0)],
                         ids=["sigkill", "oom-error", "oom-error-past-the-retries"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_flax_run_killed_or_out_of_memory_mid_epoch_resumes_bit_identical(tmp_path, tmp_path_factory, api, fault,
                                                                           retries):
    """Supervised, with the standby kernel: a SIGKILL after minibatch 2 of epoch 1 (the new kernel
    replays the set-up cell, which builds a fresh TrainState / nnx module, restores into it and goes
    on at the next minibatch), JAX's RESOURCE_EXHAUSTED error there (retried in the kernel), or
    that error with no retries left (the kernel is restarted, as after the kill)."""
    reference = twin(tmp_path_factory, api)
    assert "torch_imported=False" in reference  # the extension never imported torch for this run
    nb = harness.load("train_flax.ipynb", tmp_path, api=api, fault=fault, retries=retries)
    # a standby only where the kernel is restarted: beside a retry in the kernel it would import
    # JAX and flax for nothing
    run, out = harness.run_ok(nb, tmp_path, standby=fault == "sigkill" or retries == 0)
    if fault == "sigkill" or retries == 0:
        assert len(run.restarts) == 1 and "restored state, key, net, opt, history, running" in out, out
        if retries == 0:
            assert "OOM (RESOURCE_EXHAUSTED)" in out, out
    else:
        assert not run.restarts and "OOM (RESOURCE_EXHAUSTED)" in out and "retry 1/2" in out, out
    assert "continuing at 1, 2" in out, out
    assert harness.result(nb) == reference


@pytest.mark.kernel
def test_a_flax_run_killed_in_a_kernel_resumes_when_its_cell_runs_again(kernel, tmp_path, tmp_path_factory):
    """Interactive, as in Jupyter: the kernel dies, the server brings one back, the user runs the
    training cell again: the set-up cell is replayed, the TrainState restored into, bit-identical."""
    reference = twin(tmp_path_factory, "linen")
    nb = harness.load("train_flax.ipynb", tmp_path, fault="sigkill")
    out = harness.killed_and_rerun(kernel, nb)
    assert "replayed 3 cells, restored state, key, net, opt, history, running" in out, out
    assert "continuing at 1, 2" in out
    assert harness.result(kernel.ok(harness.user_cell(nb, "result")).stdout) == reference


@pytest.mark.kernel
def test_colab_resilience_check_passes_the_flax_notebook(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "colab_resilience", "check", str(harness.FILES / "train_flax.ipynb"), "--faults", "2",
         "--seed", "3", "--kernel", harness.KERNEL_NAME, "-p", "api", "nnx", "-p", "mark", str(tmp_path / "mark")],
        capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical after each of 2 faults" in r.stdout, r.stdout


def test_an_optax_transformation_the_loop_calls_update_on_is_not_named_as_carried(ip):
    """``updates, opt_state = tx.update(g, opt_state, params)``: ``update`` changes a dict in place,
    but an optax transformation is a tuple of functions whose update returns new state; the first
    run named ``tx`` as carried, to be saved (a false alarm, found by a probe). The key the loop
    splits without --save is still named."""
    from colab_resilience import lint

    ip.user_ns.update(tx=optax.adam(1e-2), params={"w": jnp.zeros(2)}, key=jax.random.key(0))
    ip.user_ns["opt_state"] = ip.user_ns["tx"].init(ip.user_ns["params"])
    body = ("for epoch in resume_range(2):\n    key, sub = jax.random.split(key)\n"
            "    updates, opt_state = tx.update(params, opt_state, params)\n"
            "    params = optax.apply_updates(params, updates)\n")
    lines = lint.warnings(ip, body, ["params", "opt_state"], [])
    carried = [line for line in lines if "carries" in line]
    assert len(carried) == 1 and "carries key from one iteration" in carried[0], lines


def _halved_notebook(where: str, mark):
    """A flax TrainState built by the %%replay cell; its parameters halved in a plain cell, or in
    the training cell above its loop; the training cell killed once above its loop (no checkpoint
    yet)."""
    kill = (f"if not os.path.exists({str(mark)!r}):\n"
            f"    open({str(mark)!r}, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n")
    change = "state = state.replace(params=jax.tree.map(lambda p: p * 0.5, state.params))\n"
    return harness.notebook(
        "%load_ext colab_resilience",
        "%%replay\nimport os, signal\nimport jax, optax\nimport flax.linen as nn\nfrom flax.training import train_state\n"
        "key = jax.random.key(0)\nX = jax.random.normal(key, (64, 4)); Y = X[:, :1] * 2\n"
        "class M(nn.Module):\n    @nn.compact\n    def __call__(self, x):\n        return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))\n"
        "m = M()\nstate = train_state.TrainState.create(apply_fn=m.apply, params=m.init(key, X)['params'], "
        "tx=optax.adam(0.01))\n"
        "@jax.jit\ndef step(state, x, y):\n"
        "    loss, g = jax.value_and_grad(lambda p: ((state.apply_fn({'params': p}, x) - y) ** 2).mean())(state.params)\n"
        "    return state.apply_gradients(grads=g), loss\nlosses = []",
        change if where == "plain-cell" else "pass",
        "%%resilient --save state,losses\n" + kill + (change if where == "training-cell" else "")
        + "for epoch in resume_range(3):\n    for i in range(0, 64, 16):\n"
        "        state, loss = step(state, X[i:i + 16], Y[i:i + 16])\n    losses.append(float(loss))",
        "print('RESULT', losses)")


@pytest.mark.parametrize("where", ["plain-cell", "training-cell"])
def test_a_train_state_a_plain_cell_changed_is_not_lost_silently_by_a_kill_above_the_loop(tmp_path, where):
    """Killed above its loop (before its first checkpoint), the run went on with the TrainState the
    replay built, not the one a plain cell changed, and said done with other losses: a pytree's
    leaves were not in the fingerprint the run began with. The run stops with the line that names
    it; the same change made in the training cell resumes bit for bit as its twin."""
    refused = "state is not what the run began with, and the kernel died before the run's first checkpoint"
    harness.refused_or_twin(tmp_path, lambda mark: _halved_notebook(where, mark),
                            refused if where == "plain-cell" else None)


@pytest.mark.parametrize("chunk", [None, 4096], ids=["whole", "a-slice-at-a-time"])
def test_jax_arrays_and_keys_are_fingerprinted_by_every_value(monkeypatch, chunk):
    """What the set-up cells bind as JAX arrays (a split, a key) was left out of the fingerprint a
    resumed run compares: a change went unnamed. One element of a large array counts (a strided
    sample missed it), also where the array is copied to the host a slice at a time (over 64 MiB,
    or on a GPU: here, with slices of 4 KiB)."""
    from colab_resilience import setup_state

    if chunk:
        monkeypatch.setattr(setup_state, "CHUNK", chunk)
    small, large, key = jnp.arange(8.0), jnp.ones((1024, 512)), jax.random.key(0)
    ns = {"small": small, "large": large, "key": key}
    before = setup_state.fingerprint(ns, ns)
    assert set(before) == {"small", "large", "key"}
    assert setup_state.differing(before, {k: jnp.array(v) if k != "key" else v for k, v in ns.items()}) == []
    changed = {"small": small.at[3].set(0.5), "large": large.at[317, 301].set(2.0), "key": jax.random.key(1)}
    assert setup_state.differing(before, changed) == ["small", "large", "key"]
