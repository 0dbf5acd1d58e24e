"""What the set-up cells made, fingerprinted when a run begins and compared when a new kernel
resumes it (:mod:`colab_resilience.setup_state`): which names, and what counts as the same.
The resumed runs themselves are in test_exact_resume (real kernels, a SIGKILL)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colab_resilience import setup_state
from colab_resilience.errors import JournalError
from colab_resilience.journal import Journal

SETUP = """%%replay
import torch
X = torch.randn(8, 2)
split = torch.randperm(8)
lr = 0.1
started = 0.0
def helper():
    inner = 1
    return scale * 2
scale = 3.0
model = torch.nn.Linear(2, 1)
for unused_loop_name in range(2):
    pass
squares = [k * k for k in range(3)]
t0 = __import__("time").time()
"""


def test_the_names_watched_are_the_set_up_cells_top_level_ones_the_training_reads_not_saved(ip):
    """Bound at the top level of a set-up cell (not inside a function, not an import), read by the
    cell or by a function of the notebook it calls (``scale``, through ``helper``), not in --save
    (``lr``), and a value it knows or code of the notebook's (``helper``; not a model the training
    trains)."""
    ip.run_cell(SETUP.partition("\n")[2])
    body = "for epoch in resume_range(2):\n    loss = (model(X[split]) * lr * helper()).sum()\n"
    assert setup_state.watched(ip, body, [SETUP], ["lr"]) == ["X", "helper", "scale", "split"]
    bound = setup_state.setup_names(ip, [SETUP])
    assert {"X", "squares", "unused_loop_name", "helper"} <= bound and not bound & {"inner", "torch", "k", "t0"}


def test_what_the_cell_reads_before_it_binds_it_is_carried_in(ip):
    """In the order Python evaluates the code: an assignment's value before its targets, a loop's
    iterable before its target, a comprehension's and a lambda's own names apart; not what the set-up
    cells bind, nor --save names."""
    ip.user_ns.update(scale=2.0, total=0, loss=1.0, data=[1], offset=3, seen=set(), x=9)
    body = ("loss = 0\nfor x in data:\n    total = total + x * scale\n    loss = loss + x\n"
            "ys = [y * 2 for y in data if y]\nf = lambda z: z + offset\nseen |= {1}\n")
    assert setup_state.carried_in(ip, body, [], []) == ["data", "offset", "scale", "seen", "total"]
    assert setup_state.carried_in(ip, body, ["%%replay\ndata = [1]"], ["total"]) == ["offset", "scale", "seen"]


def test_equal_values_fingerprint_alike_and_any_change_the_training_would_see_otherwise():
    """A frozen module (a teacher) by its weights; one the training trains is left out (its
    checkpoint's, or a framework callback's, which restores it)."""
    a = {"x": torch.arange(6.0).reshape(2, 3), "idx": np.arange(5), "words": ["a", "b"], "n": 3,
         "m": torch.nn.Linear(2, 1).requires_grad_(False), "g": torch.Generator().manual_seed(1)}
    b = {"x": torch.arange(6.0).reshape(2, 3), "idx": np.arange(5), "words": ["a", "b"], "n": 3,
         "m": torch.nn.Linear(2, 1).requires_grad_(False), "g": torch.Generator().manual_seed(1)}
    b["m"].load_state_dict(a["m"].state_dict())
    assert setup_state.fingerprint(a, a) == setup_state.fingerprint(b, b) and "m" in setup_state.fingerprint(a, a)
    assert setup_state.fingerprint({"t": torch.nn.Linear(2, 1)}, ["t"]) == {}
    for name, other in [("x", torch.arange(6.0).reshape(3, 2)), ("idx", np.arange(5)[::-1].copy()),
                        ("words", ["b", "a"]), ("n", 4), ("g", torch.Generator().manual_seed(2))]:
        assert setup_state.differing(setup_state.fingerprint(a, a), {**a, name: other}) == [name]
    with torch.no_grad():
        b["m"].weight.add_(1)
    assert setup_state.differing(setup_state.fingerprint(a, a), b) == ["m"]


def test_a_set_is_the_same_in_whatever_order_it_iterates():
    """Equal sets (their order differs from process to process for strings; here two ints that
    collide iterate in the order they were added) fingerprint alike; the list made from one in its
    order does not."""
    one, two = {8, 16}, {16, 8}
    assert list(one) != list(two)
    assert setup_state.fingerprint({"s": one}, ["s"]) == setup_state.fingerprint({"s": two}, ["s"])
    assert setup_state.fingerprint({"s": list(one)}, ["s"]) != setup_state.fingerprint({"s": list(two)}, ["s"])


def _one_changed(value, change) -> bool:
    """Whether ``change`` (made to a copy of ``value``) changes its fingerprint."""
    import copy

    other = copy.deepcopy(value)
    change(other)
    return setup_state.fingerprint({"v": value}, ["v"]) != setup_state.fingerprint({"v": other}, ["v"])


def test_one_element_of_a_large_tensor_or_array_changed_is_seen():
    """Every byte counts, however large (a strided sample missed a plain cell's ``X[7, 5] = 100``
    on a 1.5 MiB tensor, and the resumed run said nothing): a contiguous tensor, a transposed one
    (hashed in the order it lies), every other row of one (copied a bounded slice at a time),
    bfloat16, complex, bool, a NumPy array and views of one; an equal copy fingerprints alike."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 1024, generator=g)  # 4 MiB
    cases = [big, big.t(), big[::2], big.to(torch.bfloat16), torch.randn(512, 512, dtype=torch.complex64, generator=g),
             big > 0, big.numpy(), big.numpy().T, big.numpy()[::2]]
    for value in cases:
        if isinstance(value, torch.Tensor):  # laid out alike (the strides are in the fingerprint)
            same = value.clone() if value.is_contiguous() or value.stride(0) == 1 else value._base.clone()[::2]
        else:
            same = np.asarray(value.copy(), order="F") if value.flags.f_contiguous else (
                value.copy() if value.flags.c_contiguous else value.base.copy()[::2])
        assert setup_state.fingerprint({"v": value}, ["v"]) == setup_state.fingerprint({"v": same}, ["v"]), type(value)

        def poke(v):
            v[317, 301] = ~v[317, 301] if v.dtype in (torch.bool, np.bool_) else v[317, 301] + 1

        assert _one_changed(value, poke), (type(value), value.dtype)


def test_a_tensor_hashed_a_slice_at_a_time_fingerprints_alike_whatever_the_slices(monkeypatch):
    """The bytes go into the hash in the elements' order whatever the slices (a GPU tensor and a
    view with gaps are copied to the host a bounded slice at a time): small slices change nothing."""
    view = torch.arange(8192.0).reshape(64, 128)[:, ::2]
    whole = setup_state.fingerprint({"v": view}, ["v"])
    monkeypatch.setattr(setup_state, "CHUNK", 1000)
    assert setup_state.fingerprint({"v": view}, ["v"]) == whole


def test_a_long_container_of_numbers_or_strings_is_taken_whole_and_a_frame_by_every_value():
    """Past the first 100,000 items: a list or dict of numbers and strings, a set of them (in any
    order), a list of rows of them (tuples, records), a pandas frame of any size (its numbers and
    its strings)."""
    import pandas as pd

    n = 250_000
    words = [f"w{i}" for i in range(n)]
    assert _one_changed(words, lambda v: v.__setitem__(200_000, "changed"))
    assert _one_changed(list(range(n)), lambda v: v.__setitem__(-1, -1))
    assert _one_changed({w: i for i, w in enumerate(words)}, lambda v: v.__setitem__("w249999", 0))
    assert _one_changed(set(words), lambda v: (v.discard("w123456"), v.add("x")))
    pairs = [(w, i % 2) for i, w in enumerate(words)]  # a text dataset: (text, label) pairs, records
    assert _one_changed(pairs, lambda v: v.__setitem__(200_000, ("w200000", 7)))
    assert _one_changed([{"text": w, "label": n} for w, n in pairs], lambda v: v[-1].__setitem__("label", 7))
    assert setup_state.fingerprint({"s": set(words)}, ["s"]) == setup_state.fingerprint({"s": set(reversed(words))}, ["s"])
    frame = pd.DataFrame({"x": np.arange(n, dtype=np.float64), "label": [w[-1] for w in words]})
    assert _one_changed(frame, lambda v: v.__setitem__("x", v["x"].where(v.index != 200_001, -1.0)))
    assert _one_changed(frame, lambda v: v.loc.__setitem__((199_999, "label"), "changed"))
    assert _one_changed(frame["x"], lambda v: v.__setitem__(7, 0.5))


def test_a_tensor_both_walks_of_one_moment_see_is_hashed_once_and_a_passing_one_is_not_mistaken(monkeypatch):
    """Within one moment (a %%replay cell's two walks) a large tensor's digest is kept with the
    tensor, so that no other can take its address meanwhile: two generators, whose states are
    tensors made for the walk and freed after it, still fingerprint apart."""
    big = torch.randn(1 << 19)  # 2 MiB
    hashed = []
    real = setup_state._tensor_chunks
    monkeypatch.setattr(setup_state, "_tensor_chunks", lambda t: (hashed.append(t.numel()), *real(t))[1:])
    with setup_state.one_moment():
        setup_state.fingerprint({"X": big}, ["X"])
        setup_state.fingerprint({"X": big}, ["X"], saved=True)
    assert hashed.count(big.numel()) == 1
    setup_state.fingerprint({"X": big}, ["X"])
    assert hashed.count(big.numel()) == 2  # outside a moment: each time
    with setup_state.one_moment():
        a = setup_state.fingerprint({"g": torch.Generator().manual_seed(1)}, ["g"])
        b = setup_state.fingerprint({"g": torch.Generator().manual_seed(2)}, ["g"])
    assert a != b


def test_what_it_does_not_know_or_a_time_is_left_out():
    """Another library's object, a function, a module: no fingerprint (nothing says what in them
    the training reads); a number a dict names as a time: left out of the dict's."""
    import json

    ns = {"decoder": json.JSONDecoder(), "f": lambda: 1, "json": json,
          "stats": {"loss": 1.0, "train_runtime": 12.5}}
    got = setup_state.fingerprint(ns, ns)
    assert set(got) == {"stats"}
    assert got == setup_state.fingerprint({"stats": {"loss": 1.0, "train_runtime": 99.0}}, ["stats"])
    assert got != setup_state.fingerprint({"stats": {"loss": 2.0, "train_runtime": 12.5}}, ["stats"])


def test_a_notebook_object_is_fingerprinted_by_its_attributes(ip):
    ip.run_cell("class Vocab:\n    def __init__(self, chars):\n        self.itos = list(chars)\n")
    Vocab = ip.user_ns["Vocab"]
    a, b, c = Vocab("ab"), Vocab("ab"), Vocab("ba")
    assert setup_state.fingerprint({"v": a}, ["v"]) == setup_state.fingerprint({"v": b}, ["v"])
    assert setup_state.fingerprint({"v": a}, ["v"]) != setup_state.fingerprint({"v": c}, ["v"])


def test_the_journal_keeps_the_fingerprints_and_refuses_others(tmp_path):
    j = Journal.create(tmp_path / "run-x", "x", max_restarts=3, save=False)
    j.setup = {"split": "ab" * 16}
    j.save()
    assert Journal.load(tmp_path / "run-x").setup == {"split": "ab" * 16}
    j.setup = {"split": 3}
    with pytest.raises(JournalError, match="the set-up cells' fingerprints are not strings"):
        j.save()


def test_the_journal_keeps_the_runs_start_and_reads_its_random_state_back_executing_nothing(tmp_path):
    """The random state a run began with goes into its journal as tagged JSON with its tensors and
    arrays as bytes, and comes back equal; the saved values' fingerprints, with trained weights
    and an optimizer's rate, tell a change apart."""
    import random

    import numpy as np

    from colab_resilience.checkpoints.rng import capture_rng, from_json, restore_rng, to_json

    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    j = Journal.create(tmp_path / "run-x", "x", max_restarts=3, save=False)
    j.start_rng = to_json(capture_rng())
    j.start_saved = setup_state.fingerprint({"model": model, "opt": opt}, ["model", "opt"], saved=True)
    j.save()
    drawn = (torch.rand(4), np.random.rand(2), random.random())
    loaded = Journal.load(tmp_path / "run-x")
    restore_rng(from_json(loaded.start_rng))
    again = (torch.rand(4), np.random.rand(2), random.random())
    assert torch.equal(drawn[0], again[0]) and (drawn[1] == again[1]).all() and drawn[2] == again[2]
    ns = {"model": model, "opt": opt}
    assert setup_state.differing(loaded.start_saved, ns, saved=True) == []
    opt.param_groups[0]["lr"] = 0.05
    with torch.no_grad():
        model.weight[0, 0] += 1
    assert setup_state.differing(loaded.start_saved, ns, saved=True) == ["model", "opt"]
    j.start_rng = {"value": {}}
    with pytest.raises(JournalError, match="the random state of the run's start is not"):
        j.save()


def test_a_loader_over_a_random_split_is_fingerprinted_by_the_indices_it_draws_from():
    """``random_split`` without a generator draws its subsets from the global state; the loader the
    training reads is what the set-up cell binds: it is fingerprinted by its batching and its
    dataset, the subset by its indices, the dataset under it by its tensors."""
    from torch.utils.data import DataLoader, TensorDataset, random_split

    data = TensorDataset(torch.arange(20.0).reshape(10, 2), torch.arange(10))

    def loader(seed, batch_size=4):
        train, _ = random_split(data, [8, 2], generator=torch.Generator().manual_seed(seed))
        return DataLoader(train, batch_size=batch_size)

    same = setup_state.fingerprint({"l": loader(0)}, ["l"])
    assert same == setup_state.fingerprint({"l": loader(0)}, ["l"]) and set(same) == {"l"}
    assert same != setup_state.fingerprint({"l": loader(1)}, ["l"])
    assert same != setup_state.fingerprint({"l": loader(0, batch_size=2)}, ["l"])


def test_a_run_that_begins_names_what_changed_since_the_set_up_cells_ran(ip, tmp_path, capsys):
    """A learning rate typed in a scratch cell after the %%replay cell: a resume after a restart
    would train with the %%replay cell's. The run says so when it begins (before any fault), once
    per run; a change a later %%replay cell makes (X scaled in place) is what a replay makes too,
    and is not named; nor is what the cell saves."""
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs'}")
    ip.run_cell("%%replay\nimport torch\ntorch.manual_seed(0)\nlr = 0.1\nX = torch.randn(8, 2)\n"
                "w = torch.zeros(2, requires_grad=True)\n")
    ip.run_cell("%%replay\nX *= 2\n")
    train = "%%resilient --save w\nfor epoch in resume_range(2):\n    loss = (X @ w * lr).sum()\n"
    capsys.readouterr()
    assert ip.run_cell(train).success
    assert "changed since the %%replay cells ran" not in capsys.readouterr().out
    ip.run_cell("lr = 0.5")
    assert ip.run_cell(train).success
    lines = [line for line in capsys.readouterr().out.splitlines() if "changed since" in line]
    assert lines == ["colab_resilience: lr changed since the %%replay cells ran (in a cell that is not replayed, or "
                     "in an earlier run), and the training reads them: a new kernel's replay does not make that "
                     "change, and a resume after a restart stops until the cell that made it runs again; make the "
                     "change in a %%replay cell and run it, or --save them"]


CODE = '''
import torch
@torch.no_grad()
def evaluate(model, xs, kinds=("Tensor", "ndarray")):
    return [model(x) for x in xs if type(x).__name__ in {"Tensor", "ndarray", "list"}]
def step(x, lr=0.1, *, scale=2.0):
    def inner(y):
        return y * scale
    return inner(x) * lr
class Warmup:
    steps = 4
    def __init__(self, base):
        self.base = base
    def factor(self, epoch):
        return min(1.0, (epoch + 1) / self.steps)
    @property
    def rate(self):
        return self.base * self.factor(0)
'''


def _code_prints(sources: list[str], filename: str, seed: str) -> list[dict]:
    """The fingerprints of evaluate, step and Warmup in each of ``sources``, each compiled as a
    kernel compiles a cell (``filename``: ipykernel names each cell's file after the kernel's
    process) into a namespace of its own, in a Python of its own with the hash seed ``seed``,
    after ``step`` ran 200 times (Python specialises the bytecode it runs)."""
    import json
    import subprocess
    import sys

    import harness

    program = ("import json, sys\nfrom colab_resilience import setup_state\nprints = []\n"
               f"for source in {sources!r}:\n"
               f"    ns = {{'__name__': '__main__'}}\n    exec(compile(source, {filename!r}, 'exec'), ns)\n"
               "    for _ in range(200):\n        ns['step'](1.0)\n"
               "    prints.append(setup_state.fingerprint(ns, ['evaluate', 'step', 'Warmup']))\n"
               "print(json.dumps(prints))")
    out = subprocess.run([sys.executable, "-c", program], env=harness.child_env(PYTHONHASHSEED=seed),
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return json.loads(out)


def test_the_notebooks_functions_and_classes_are_fingerprinted_by_their_code_in_any_kernel():
    """A function redefined in a plain cell after the %%replay cell defined it (a fix to a step
    function) was not seen: code was left out, the replay brought the old one back, and a resumed
    run trained with it. A function or class of the notebook is fingerprinted by its code, alike
    in every kernel (another cell file name, another hash seed, bytecode specialised by running),
    otherwise for any change to what it does: its body, a default, an inner function, what a
    decorator wraps and which decorator, a method, a property, a class attribute."""
    changes = [("return inner(x) * lr", "return inner(x) * lr * 0.5", "step"),
               ("lr=0.1", "lr=0.2", "step"),
               ("return y * scale", "return y + scale", "step"),
               ('"ndarray", "list"}', '"ndarray"}', "evaluate"),
               ("@torch.no_grad()", "@torch.enable_grad()", "evaluate"),
               ("(epoch + 1) / self.steps", "epoch / self.steps", "Warmup"),
               ("steps = 4", "steps = 5", "Warmup"),
               ("self.base * self.factor(0)", "self.base", "Warmup")]
    assert all(old in CODE for old, _, _ in changes)
    first, *others = _code_prints([CODE] + [CODE.replace(old, new) for old, new, _ in changes],
                                  "/tmp/ipykernel_1201/1554816346.py", "1")
    assert set(first) == {"evaluate", "step", "Warmup"}
    assert _code_prints(["\n\n" + CODE], "/tmp/ipykernel_977/99.py", "2") == [first]
    for (old, new, changed), other in zip(changes, others):
        assert {n for n in first if first[n] != other[n]} == {changed}, (old, new)


def test_the_notebooks_own_module_files_are_recorded_and_a_changed_one_is_found(tmp_path, monkeypatch):
    """A module imported from a file beside the notebook is recorded by its real path and digest
    (not the standard library's, an installed package's or this package's); editing the file is
    found, a file gone is not (the replay's import says so), nor a FIFO in its place (read without
    blocking), and the journal keeps the record."""
    import importlib
    import json
    import os
    import sys

    from colab_resilience import module_files

    (tmp_path / "steps_mod_recorded.py").write_text("def scaled(loss):\n    return loss\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("steps_mod_recorded")
    try:
        found = module_files.local_modules()
    finally:
        del sys.modules["steps_mod_recorded"]
    mine = str((tmp_path / "steps_mod_recorded.py").resolve())
    assert mine in found and not any("colab_resilience" in p or p.startswith(sys.prefix) for p in found), found
    assert json.__file__ not in found and torch.__file__ not in found
    assert module_files.changed(found) == []
    (tmp_path / "steps_mod_recorded.py").write_text("def scaled(loss):\n    return loss * 0.5\n")
    assert module_files.changed(found) == [mine]
    monkeypatch.chdir(tmp_path)
    assert module_files.message("r1", [mine]).startswith(
        "colab_resilience: steps_mod_recorded.py changed on disk since run r1 began: the resumed run goes on with "
        "the code now in it, so what it did before ran on the old code")
    (tmp_path / "steps_mod_recorded.py").unlink()
    assert module_files.changed(found) == []
    os.mkfifo(tmp_path / "steps_mod_recorded.py")  # read without blocking, and not a module's file
    assert module_files.changed(found) == []

    j = Journal.create(tmp_path / "run-m", "m", save=False)
    j.modules = {mine: "ab" * 32}
    j.save()
    assert Journal.load(tmp_path / "run-m").modules == {mine: "ab" * 32}
    j.modules = {mine: 3}
    with pytest.raises(JournalError, match="the module files' digests are not strings"):
        j.save()


def test_the_environment_variables_a_cell_set_are_recorded_by_digest_and_compared(tmp_path, monkeypatch):
    """What a cell set since the process started, of the variables that change what training
    computes: by the digest of the value (a variable may hold a token; it is not written), None for
    one removed; those of logging and those not compared are left out; the journal keeps the record
    and refuses one that is not digests. In a process started with the variable, only a change
    counts (Linux keeps the environment a process started with apart)."""
    import json
    import os
    import subprocess
    import sys

    from colab_resilience import environment

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("WANDB_API_KEY", "secret")
    found = environment.set_since_start()
    assert set(found) == {"XLA_FLAGS"} and "deterministic" not in json.dumps(found), found
    assert environment.differing(found) == []
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert environment.differing(found) == ["XLA_FLAGS"]
    monkeypatch.delenv("XLA_FLAGS")
    assert environment.differing(found) == ["XLA_FLAGS"]
    assert environment.message("r1", ["XLA_FLAGS"]).startswith(
        "colab_resilience: the environment variable XLA_FLAGS was set otherwise as run r1 began, by a cell that is not "
        "replayed (os.environ, %env), and this kernel has it as a new kernel starts: ")

    child = ("import os, json; from colab_resilience import environment as e\n"
             "print(json.dumps(e.set_since_start())); os.environ['OMP_NUM_THREADS'] = '1'\n"
             "print(json.dumps(e.set_since_start())); del os.environ['OMP_NUM_THREADS']; os.environ['CUDA_X'] = 'a'\n"
             "print(json.dumps(e.set_since_start()))")
    out = subprocess.run([sys.executable, "-c", child], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert [json.loads(line) for line in out][:2] == [{}, {}], out  # as it started: no change
    last = json.loads(out[2])
    assert last["OMP_NUM_THREADS"] is None and set(last) == {"OMP_NUM_THREADS", "CUDA_X"}, last

    j = Journal.create(tmp_path / "run-e", "e", save=False)
    j.environment = {"XLA_FLAGS": "ab" * 16, "OMP_NUM_THREADS": None}
    j.save()
    assert Journal.load(tmp_path / "run-e").environment == {"XLA_FLAGS": "ab" * 16, "OMP_NUM_THREADS": None}
    j.environment = {"XLA_FLAGS": 3}
    with pytest.raises(JournalError, match="the environment variables' digests are not strings"):
        j.save()
