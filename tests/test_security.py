"""Security and robustness: fuzzed magic options, fuzzed and tampered checkpoints and journals,
foreign and unsigned pickles (in a real kernel too), concurrent runs, file permissions.

Everything runs for real: real files in real run directories, real torch tensors and modules,
real kernels where a kernel matters. Hypothesis drives the fuzzing with a bounded number of
examples; a hang fails the test through its pytest timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from colab_resilience import fsutil, lock, restart, signing
from colab_resilience import journal as jmod
from colab_resilience.run import run_id_for
from colab_resilience.session import session_of
from colab_resilience.checkpoints import CheckpointStore, CheckpointWarning
from colab_resilience.errors import (
    CheckpointError,
    NoCheckpointError,
    UntrustedCheckpointError,
)
from colab_resilience.fsutil import canonical_json
from colab_resilience.journal import Journal, JournalError
from harness import child_env
from payloads import EvilPayload, Opaque

KEY = bytes(range(32))
FOREIGN_KEY = b"\x07" * 32

FUZZ = dict(
    deadline=None,  # a loaded 2-core machine must not make a slow fsync a failure; hangs hit the timeout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def one_line(text: str) -> bool:
    return bool(text.strip()) and "\n" not in text.strip()


def recorded(fn):
    """Call ``fn`` with every warning recorded (the pytest config turns warnings into errors)."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        value = fn()
    for w in rec:
        assert issubclass(w.category, CheckpointWarning), f"{w.category.__name__}: {w.message}"
        assert one_line(str(w.message)), str(w.message)
    return value, [str(w.message) for w in rec]


# =============================================================================================
# 1a. the magics' option parsers, fuzzed through a real in-process shell
# =============================================================================================


def usage_or_ok(call) -> str:
    """Only success or a clean one-line UsageError; any other exception fails the test."""
    try:
        call()
    except UsageError as e:
        assert one_line(str(e)), repr(str(e))
        return "usage"
    return "ok"


def _mutate(text: str, edits: list[tuple[str, int, str]]) -> str:
    chars = list(text)
    for op, pos, ch in edits:
        pos = min(pos, len(chars))
        if op == "insert":
            chars.insert(pos, ch)
        elif chars and op == "delete":
            del chars[min(pos, len(chars) - 1)]
        elif chars:
            chars[min(pos, len(chars) - 1)] = ch
    return "".join(chars)


def mutated(seeds: list[str]):
    edit = st.tuples(st.sampled_from(["insert", "delete", "replace"]), st.integers(0, 80), st.characters())
    return st.builds(_mutate, st.sampled_from(seeds), st.lists(edit, max_size=5))


def option_lines(words: list[str], seeds: list[str]):
    tokens = st.one_of(st.sampled_from(words), st.text(max_size=10))
    return st.one_of(
        st.lists(tokens, max_size=7).map(" ".join),
        mutated(seeds),
        st.text(max_size=40),
    )


RESILIENT_WORDS = [
    "--save", "--retries", "--shrink", "--max-restarts", "--every", "--save=bs", "--retries=1",
    "--every=5min", "--sav", "--max", "-s", "--", "-", "--help", "-h", "bs", "hist", "bs,hist",
    "hist,bs,hist", "fuzz_x", "ghost", "bs=0.5", "bs=0.999", "bs=1", "bs=0", "bs=-1", "bs=nan",
    "bs=inf", "bs=1e-400", "bs=", "=0.5", "hist=0.5", "0", "1", "2", "-1", "+3", "1.5", "5min",
    "90s", "1h", "0s", "0min", "2.5m", "1e999min", "99999999999999999999999", "nan", "inf",
    "x,,y", ",", "=", "'", '"', "'bs'", "'a b'", "\\", "\x00", "ü", "3x", "a.b", "None", "#",
    "$bs", "%", "!ls",
]
RESILIENT_SEEDS = [
    "--save bs,hist --retries 1",
    "--shrink bs=0.5 --max-restarts 2",
    "--every 5min --save hist",
    "--save fuzz_x --every 3 --shrink bs",
    "",
]


@pytest.fixture
def sandbox(ip, tmp_path, monkeypatch):
    """The loaded extension's magics, writing only under ``tmp_path`` (runs, cwd, HOME)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    magics = ip.magics_manager.registry["ResilienceMagics"]
    root = tmp_path / "runs"
    magics.run_dir = str(root)
    ip.user_ns.update(bs=64, hist=[1, 2])
    return magics, root


@pytest.mark.timeout(120)
@settings(max_examples=250, **FUZZ)
@given(line=option_lines(RESILIENT_WORDS, RESILIENT_SEEDS))
@example(line="--save '")
@example(line='--shrink "bs')
@example(line="--save bs --retries 99999999999999999999999 --every 1e999min")
def test_resilient_options_fuzzed(sandbox, ip, line):
    """Any %%resilient line is either run or refused with a UsageError: no other exception, no run
    left locked, a shrink variable never below 1."""
    magics, root = sandbox
    magics.run_dir = str(root)
    ip.user_ns.update(bs=64, hist=[1, 2])
    usage_or_ok(lambda: ip.run_cell_magic("resilient", line, "fuzz_x = 1\n"))
    assert not lock._held, "a run directory stayed locked after the cell"
    assert ip.user_ns["bs"] >= 1


RESTART_WORDS = [
    "--memory", "--memory=", "off", "OFF", "0", "1", "3", "-1", "90%", "90", "100", "100.0001",
    "0%", "%", "%%", "=", "1e5", "nan", "inf", "-inf", "1e-400", "99999999999999999999999",
    "--every", "x", "\x00", "ü",
]
RESTART_SEEDS = ["--memory 90%", "--memory=85", "5", "off", ""]


@pytest.mark.timeout(60)
@settings(max_examples=250, **FUZZ)
@given(line=option_lines(RESTART_WORDS, RESTART_SEEDS))
@example(line="--memory nan")
@example(line='--memory --memory 0"')  # an option with no value, then an unclosed quote
def test_restart_after_options_fuzzed(sandbox, ip, line):
    """Any %restart_after line is refused with a UsageError or sets a valid policy."""
    magics, _ = sandbox
    session_of(ip).policy = None
    if usage_or_ok(lambda: ip.run_line_magic("restart_after", line)) == "ok":
        p = session_of(ip).policy
        assert p.every is None or (isinstance(p.every, int) and p.every >= 0)
        assert p.memory_percent is None or 0 < p.memory_percent <= 100


RESILIENCE_WORDS = [
    "status", "resume", "reset", "dir", "STATUS", "--trust", "zzz", "run-", "run-zzz", "sub",
    "sub/inner", "a_file", "\x00", "~cr_no_such_user/x", "/proc/cr_fuzz", "", "dir dir",
]
SAFE_DIR_ARGS = {"sub", "sub/inner", "a_file", "\x00", "~cr_no_such_user/x", "/proc/cr_fuzz", "zzz",
                 "run-", "run-zzz", "status", "resume", "reset", "dir", "STATUS", "--trust"}


@pytest.mark.timeout(120)
@settings(max_examples=200, **FUZZ)
@given(line=option_lines(RESILIENCE_WORDS, ["status", "resume", "reset", "dir sub", "resume run-"]))
@example(line="dir \x00")
@example(line="dir ~cr_no_such_user/x")
@example(line="dir a_file")
@example(line="resume")
def test_resilience_commands_fuzzed(sandbox, ip, tmp_path, line):
    """Any %resilience command is refused with a UsageError or done, without leaving a run locked or
    the run folder moved outside the sandbox."""
    from hypothesis import assume

    magics, root = sandbox
    words = line.split()
    # `%resilience dir PATH` creates PATH: only paths inside the sandbox (or known-bad ones)
    assume(not (words and words[0] == "dir" and len(words) == 2 and words[1] not in SAFE_DIR_ARGS))
    (tmp_path / "a_file").write_text("not a folder")
    magics.run_dir = str(root)
    if not list(root.glob("run-*/journal.json")):  # something to resume and reset
        ip.run_cell_magic("replay", "", "bs = 64\n")
        ip.run_cell_magic("resilient", "--save hist", "hist.append(len(hist))\n")
    _, messages = recorded(lambda: usage_or_ok(lambda: ip.run_line_magic("resilience", line)))
    assert not lock._held
    assert Path(magics.run_dir).resolve().is_relative_to(tmp_path.resolve()) or magics.run_dir == str(root)


# =============================================================================================
# 1b. the readers of manifests and journals, fed random bytes and mutated real files
# =============================================================================================


def build_values(scale: float):
    torch.manual_seed(int(scale))
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {
        "model": model,
        "opt": opt,
        "t": torch.arange(6.0) * scale,
        "a": np.arange(4) * int(scale),
        "v": {"k": scale, "l": [1, (2, 3)]},
        "tree": {"w": torch.ones(3) * scale, "n": scale},
        "p": Opaque(scale),
    }


NAMES = ["model", "opt", "t", "a", "v", "tree", "p"]


def fresh_namespace():
    model = torch.nn.Linear(3, 2)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def assert_restored(ns, expected):
    for k, v in expected["model"].state_dict().items():
        assert torch.equal(ns["model"].state_dict()[k], v)
    assert ns["opt"].state_dict()["state"].keys() == expected["opt"].state_dict()["state"].keys()
    for i, s in expected["opt"].state_dict()["state"].items():
        assert torch.equal(ns["opt"].state_dict()["state"][i]["momentum_buffer"], s["momentum_buffer"])
    assert torch.equal(ns["t"], expected["t"]) and np.array_equal(ns["a"], expected["a"])
    assert ns["v"] == expected["v"] and ns["p"].v == expected["p"].v
    assert torch.equal(ns["tree"]["w"], expected["tree"]["w"]) and ns["tree"]["n"] == expected["tree"]["n"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A real store with two checkpoints whose blobs all differ (so damage to #2 spares #1)."""
    root = tmp_path_factory.mktemp("template")
    store = CheckpointStore(root / "ckpts", key=KEY)
    first, second = build_values(1.0), build_values(2.0)
    store.save(first, NAMES)
    torch.rand(3)
    store.save(second, NAMES)
    assert store.checkpoint_ids() == ["ckpt-000002", "ckpt-000001"]
    return root / "ckpts", first, second


def copy_store(template_dir: Path) -> tuple[Path, CheckpointStore]:
    tmp = Path(tempfile.mkdtemp(prefix="cr-fuzz-"))
    shutil.copytree(template_dir, tmp / "ckpts")
    return tmp, CheckpointStore(tmp / "ckpts", key=KEY)


def byte_mutations(original: bytes):
    """Random bytes, or the original with flips, overwrites, insertions, deletions, truncation."""
    op = st.one_of(
        st.tuples(st.just("flip"), st.integers(0, len(original) - 1), st.integers(1, 255)),
        st.tuples(st.just("set"), st.integers(0, len(original) - 1), st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("insert"), st.integers(0, len(original)), st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), st.integers(0, len(original) - 1), st.integers(1, 16)),
        st.tuples(st.just("truncate"), st.integers(0, len(original)), st.just(0)),
    )

    def apply(ops):
        data = bytearray(original)
        for kind, pos, arg in ops:
            pos = min(pos, max(len(data) - 1, 0))
            if kind == "flip" and data:
                data[pos] ^= arg
            elif kind == "set":
                data[pos : pos + len(arg)] = arg
            elif kind == "insert":
                data[pos:pos] = arg
            elif kind == "delete":
                del data[pos : pos + arg]
            elif kind == "truncate":
                del data[pos:]
        return bytes(data)

    return st.one_of(st.binary(max_size=300), st.lists(op, min_size=1, max_size=6).map(apply))


JSON_JUNK = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8), st.sampled_from(["ckpt-000001", "st", "json", "pickle", "state_dict", "0" * 64]),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)


def json_paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from json_paths(v, prefix + (i,))


def structural_mutations(original_doc):
    """The real document with one value (anywhere) replaced, deleted, or nested very deep."""
    paths = [p for p in json_paths(original_doc) if p]

    def apply(path, how, junk):
        doc = json.loads(json.dumps(original_doc))
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        if how == "delete":
            del parent[last]
        elif how == "deep":
            parent[last] = DEEP
        else:
            parent[last] = junk
        return doc

    return st.builds(apply, st.sampled_from(paths), st.sampled_from(["replace", "replace", "delete", "deep"]), JSON_JUNK)


class _Deep:
    """Stands for a value nested far deeper than any parser's recursion limit."""


DEEP = _Deep()


def dumps_any(doc) -> bytes:
    """JSON text of ``doc``, NaN and Infinity included; DEEP becomes 100,000 nested lists."""
    text = json.dumps(doc, indent=1, default=lambda o: "\x00DEEP\x00")
    return text.replace('"\\u0000DEEP\\u0000"', "[" * 100_000 + "]" * 100_000).encode()


@pytest.mark.timeout(120)
@settings(max_examples=150, **FUZZ)
@given(data=st.data())
@example(data=None)
def test_mutated_manifest_loads_the_same_checkpoint_or_falls_back(template, data):
    """Random or mutated bytes in the newest manifest: it verifies unchanged, or the previous
    checkpoint is used with one-line warnings; never another exception (NaN, deep nesting...)."""
    template_dir, first, second = template
    original = (template_dir / "ckpt-000002" / "manifest.json").read_bytes()
    if data is None:  # explicit: NaN in the body, and a manifest nested far too deep
        candidates = [original.replace(b'"created": ', b'"created": NaN, "x": ', 1), b"[" * 200_000]
    else:
        candidates = [data.draw(byte_mutations(original))]
    for damaged in candidates:
        tmp, store = copy_store(template_dir)
        try:
            (store.run_dir / "ckpt-000002" / "manifest.json").write_bytes(damaged)
            ckpt, messages = recorded(store.load)
            ns = fresh_namespace()
            ckpt.restore(ns, rng=False)
            if ckpt.checkpoint_id == "ckpt-000002":  # the change did not touch what is signed
                assert json.loads(damaged)["body"] == json.loads(original)["body"]
                assert_restored(ns, second)
            else:
                assert ckpt.checkpoint_id == "ckpt-000001" and messages
                assert_restored(ns, first)
        finally:
            shutil.rmtree(tmp)


@pytest.mark.timeout(120)
@settings(max_examples=80, **FUZZ)
@given(data=st.data())
def test_validly_signed_but_malformed_manifest_is_refused_clearly(template, data):
    """A manifest signed with the key but malformed anywhere (as a writer bug would make it):
    load gives a checkpoint, falls back, or says there is none; restore raises only CheckpointError."""
    template_dir, first, second = template
    doc = json.loads((template_dir / "ckpt-000002" / "manifest.json").read_bytes())
    body = data.draw(structural_mutations(doc["body"]))
    tmp, store = copy_store(template_dir)
    try:
        try:
            sig = signing.sign(KEY, canonical_json(body))
        except (ValueError, TypeError):
            sig = "0" * 64  # NaN or too deep to sign: written unsigned
        manifest = dumps_any({"body": body, "hmac": sig})
        (store.run_dir / "ckpt-000002" / "manifest.json").write_bytes(manifest)
        try:
            ckpt, _ = recorded(store.load)
        except NoCheckpointError as e:  # a lying size sets the shared blob aside: no checkpoint left
            assert one_line(str(e))
            return
        if ckpt.checkpoint_id == "ckpt-000001":
            recorded(lambda: ckpt.restore(fresh_namespace(), rng=False))
            return
        try:
            recorded(lambda: ckpt.restore(fresh_namespace(), rng=False, strict=False))
        except CheckpointError as e:
            assert one_line(str(e))
    finally:
        shutil.rmtree(tmp)


@pytest.mark.timeout(60)
@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_random_latest_pointer_never_breaks_loading(template, data):
    """Whatever LATEST holds, loading gives one of the real checkpoints, and the next save never
    overwrites one."""
    template_dir, first, second = template
    latest = data.draw(st.one_of(st.binary(max_size=40), st.sampled_from([b"ckpt-000001\n", b"ckpt-999999", b"../x", b"ckpt-000002/.."])))
    tmp, store = copy_store(template_dir)
    try:
        (store.run_dir / "LATEST").write_bytes(latest)
        ckpt, _ = recorded(store.load)
        assert ckpt.checkpoint_id in ("ckpt-000001", "ckpt-000002")
        assert store._next_id() not in store.checkpoint_ids()  # the next save never overwrites one
    finally:
        shutil.rmtree(tmp)


@pytest.fixture(scope="module")
def journal_template(tmp_path_factory):
    run = tmp_path_factory.mktemp("journal") / "run-r1"
    j = Journal.create(run, "r1", max_restarts=4,
                       names=["model", "opt"], shrink={"bs": 32}, policy=jmod.RestartPolicy(None, 90.0))
    j.add_replay_cell("c1", "%%replay\nimport torch")
    j.set_checkpoint("ckpt-000003")
    j.record_restart("CUDA out of memory")
    return run, j.path.read_bytes()


def check_journal_readers(ip, run: Path, original: bytes, key: bytes):
    """Journal.load with and without the key, and `%resilience status`: clean errors only."""
    try:
        j = Journal.load(run, key=key)
    except JournalError as e:
        assert one_line(str(e))
    else:
        signed = json.loads(original)
        signed.pop("signature")
        assert j.to_dict() == signed  # the signature verified: nothing signed changed
        assert j.run_id == "r1" and j.replay_cells == [jmod.ReplayCell("c1", "%%replay\nimport torch")]
    try:
        j = Journal.load(run)
    except JournalError as e:
        assert one_line(str(e))
    else:
        assert isinstance(j.restarts_left, int) and j.status in jmod.STATUSES
    usage_or_ok(lambda: ip.run_line_magic("resilience", "status"))


@pytest.mark.timeout(120)
@settings(max_examples=150, **FUZZ)
@given(data=st.data())
@example(data=None)
def test_mutated_journal_is_refused_clearly(sandbox, ip, journal_template, data):
    """A journal with random byte changes, or a pathological one, is loaded the same or refused in
    one line by every reader."""
    magics, _ = sandbox
    template_run, original = journal_template
    key = signing.load_or_create_key()
    if data is None:
        candidates = [original.replace(b'"created": ', b'"created": Infinity, "x": ', 1), b"{" + b'"a":{' * 100_000]
    else:
        candidates = [data.draw(byte_mutations(original))]
    for damaged in candidates:
        tmp = Path(tempfile.mkdtemp(prefix="cr-journal-"))
        try:
            run = tmp / "run-r1"
            shutil.copytree(template_run, run)
            (run / "journal.json").write_bytes(damaged)
            magics.run_dir = str(tmp)
            check_journal_readers(ip, run, original, key)
        finally:
            shutil.rmtree(tmp)


@pytest.mark.timeout(120)
@settings(max_examples=80, **FUZZ)
@given(data=st.data())
def test_validly_signed_but_malformed_journal_is_refused_clearly(sandbox, ip, journal_template, data):
    """Signed with the key but malformed anywhere: JournalError, never a KeyError or TypeError,
    and `%resilience status` (which reads journals without the key) never crashes."""
    magics, _ = sandbox
    template_run, original = journal_template
    key = signing.load_or_create_key()
    doc = json.loads(original)
    doc.pop("signature")
    body = data.draw(structural_mutations(doc))
    try:
        body["signature"] = signing.sign(key, fsutil.canonical_json(body)) if isinstance(body, dict) else None
    except (ValueError, TypeError):
        pass  # NaN or too deep to sign: written unsigned
    tmp = Path(tempfile.mkdtemp(prefix="cr-journal-"))
    try:
        run = tmp / "run-r1"
        shutil.copytree(template_run, run)
        (run / "journal.json").write_bytes(dumps_any(body))
        magics.run_dir = str(tmp)
        try:
            j = Journal.load(run, key=key)
        except JournalError as e:
            assert one_line(str(e))
        else:
            assert j.status in jmod.STATUSES and j.restarts_used >= 0
        usage_or_ok(lambda: ip.run_line_magic("resilience", "status"))
    finally:
        shutil.rmtree(tmp)


# =============================================================================================
# 2. tampering: flipped bytes in every kind of blob, swapped manifests, unsigned pickles
# =============================================================================================


@pytest.mark.timeout(120)
@settings(max_examples=80, **FUZZ)
@given(name=st.sampled_from(NAMES + ["__rng__"]), where=st.floats(0, 1, exclude_max=True), xor=st.integers(1, 255))
def test_one_flipped_byte_anywhere_in_any_kind_of_blob_falls_back(template, name, where, xor):
    """Module and optimizer state (state_dict), trees, tensors, arrays, values, pickles, RNG:
    one flipped byte at any offset (headers included) makes the checkpoint fall back; the module
    and optimizer are restored in place from the previous one, and nothing of #2 leaks in."""
    template_dir, first, _ = template
    tmp, store = copy_store(template_dir)
    try:
        body = json.loads((store.run_dir / "ckpt-000002" / "manifest.json").read_bytes())["body"]
        e = next(x for x in body["entries"] + [body["rng"]] if x["name"] == name)
        path = store.blob_dir / e["hash"]
        data = bytearray(path.read_bytes())
        data[int(where * len(data))] ^= xor
        path.write_bytes(bytes(data))
        ckpt, messages = recorded(store.load)
        assert ckpt.checkpoint_id == "ckpt-000001"
        assert any("ckpt-000002 is damaged" in m and "does not match its hash" in m for m in messages)
        ns = fresh_namespace()
        model, opt = ns["model"], ns["opt"]
        ckpt.restore(ns, rng=False)
        assert ns["model"] is model and ns["opt"] is opt  # in place
        assert_restored(ns, first)
    finally:
        shutil.rmtree(tmp)


def test_manifest_moved_to_another_checkpoint_slot_is_detected(tmp_path):
    """An old, validly signed manifest copied over the newest one (a silent rollback) is detected."""
    store = CheckpointStore(tmp_path / "ckpts", key=KEY)
    store.save({"w": torch.zeros(3)}, ["w"])
    store.save({"w": torch.ones(3)}, ["w"])
    shutil.copy(store.run_dir / "ckpt-000001" / "manifest.json", store.run_dir / "ckpt-000002" / "manifest.json")
    ckpt, messages = recorded(store.load)
    assert any("ckpt-000002 is damaged" in m for m in messages), messages
    assert ckpt.checkpoint_id == "ckpt-000001"


def resilient_run(ip, root: Path, value: float, tag: str) -> Path:
    """A finished %%resilient run saving ``w`` (two checkpoints: loop start and cell end)."""
    ip.user_ns["w"] = torch.full((4,), value)
    ip.run_cell_magic("resilient", "--save w", f"# run {tag}\nw += 1\n")
    found = [p for p in root.glob("run-*") if f"# run {tag}" in json.loads((p / "journal.json").read_text())["interrupted_cell"]]
    assert len(found) == 1
    return found[0]


def test_manifest_swapped_in_from_another_run_is_not_loaded(sandbox, ip):
    """Run A's validly signed manifest (and its blobs) copied into run B: B does not resume with
    A's state; the swapped checkpoint is skipped with one line and B's previous one restored."""
    magics, root = sandbox
    run_a = resilient_run(ip, root, 100.0, "A")
    run_b = resilient_run(ip, root, 0.0, "B")
    a_ckpts, b_ckpts = run_a / "checkpoints", run_b / "checkpoints"
    assert CheckpointStore(a_ckpts).latest_id() == CheckpointStore(b_ckpts).latest_id() == "ckpt-000002"
    # the manifest alone: its blobs are not in B's store, so it is already refused today
    shutil.copy(a_ckpts / "ckpt-000002" / "manifest.json", b_ckpts / "ckpt-000002" / "manifest.json")
    for blob in (a_ckpts / "blobs").iterdir():  # and with A's blobs beside it
        shutil.copy(blob, b_ckpts / "blobs" / blob.name)
    ip.user_ns.pop("w")
    out, messages = recorded(lambda: usage_or_ok(lambda: ip.run_line_magic("resilience", f"resume {run_b.name}")))
    assert not torch.equal(ip.user_ns["w"], torch.full((4,), 101.0)), "run B resumed with run A's state"
    assert torch.equal(ip.user_ns["w"], torch.full((4,), 0.0))  # B's first checkpoint (loop start)
    assert any("ckpt-000002" in m for m in messages)
    ip.run_line_magic("resilience", f"reset {run_b.name}")


@pytest.mark.parametrize("signature", ["absent", "null", "empty", "foreign", "list", "truncated"])
def test_unsigned_pickle_is_never_unpickled(tmp_path, signature):
    """A manifest naming a malicious pickle, signed by nobody or by another key, is refused: no
    canary file; with an own checkpoint beside it, that one is used instead."""
    canary = tmp_path / "canary"
    store = CheckpointStore(tmp_path / "ckpts", key=KEY)
    store.save({"p": Opaque("mine")}, ["p"])
    CheckpointStore(store.run_dir, key=FOREIGN_KEY).save({"p": EvilPayload(str(canary))}, ["p"])
    path = store.run_dir / "ckpt-000002" / "manifest.json"
    doc = json.loads(path.read_bytes())
    if signature == "absent":
        del doc["hmac"]
    elif signature == "truncated":
        doc["hmac"] = signing.sign(KEY, canonical_json(doc["body"]))[:-2]
    elif signature != "foreign":
        doc["hmac"] = {"null": None, "empty": "", "list": [doc["hmac"]]}[signature]
    path.write_text(json.dumps(doc))
    ckpt, messages = recorded(store.load)
    assert ckpt.checkpoint_id == "ckpt-000001" and any("not signed by this installation's key" in m for m in messages)
    ns: dict = {}
    recorded(lambda: ckpt.restore(ns))
    assert ns["p"].v == "mine" and not canary.exists()
    # alone in the run: refused outright, still nothing unpickled
    shutil.rmtree(store.run_dir / "ckpt-000001")
    with pytest.raises(UntrustedCheckpointError) as info:
        recorded(store.load)
    assert one_line(str(info.value)) and not canary.exists()


@pytest.mark.kernel
@pytest.mark.timeout(180)
def test_foreign_pickles_and_journals_are_refused_in_a_real_kernel(tmp_path):
    """With the default settings, in a real kernel: `%resilience resume` of a run whose checkpoint
    is foreign-signed or unsigned restores nothing; a journal signed with another key (its replay
    cell would create a canary) is refused by `%resilience resume` and by the %%resilient cell."""
    from harness import Kernel

    root = tmp_path / "runs"
    canaries = [tmp_path / f"canary{i}" for i in range(3)]
    # runs 1 and 2: our own signed journal, a checkpoint with a malicious pickle not signed by us
    for i, run_id in enumerate(["f0reign1", "uns1gned"]):
        run = root / f"run-{run_id}"
        Journal.create(run, run_id, names=["p"], status="failed")
        CheckpointStore(run / "checkpoints", key=FOREIGN_KEY).save({"p": EvilPayload(str(canaries[i]))}, ["p"])
        if run_id == "uns1gned":
            manifest = run / "checkpoints" / "ckpt-000001" / "manifest.json"
            doc = json.loads(manifest.read_bytes())
            del doc["hmac"]
            manifest.write_text(json.dumps(doc))
    # run 3: a pending journal for the cell below, signed with another key, replaying evil code
    cell_id = "cell-evil"
    evil_id = run_id_for(cell_id)
    evil = Journal.create(root / f"run-{evil_id}", evil_id, save=False)
    evil.replay_cells = [jmod.ReplayCell("x", f"%%replay\nopen({str(canaries[2])!r}, 'w').close()")]
    data = evil.to_dict()
    data["signature"] = signing.sign(FOREIGN_KEY, fsutil.canonical_json(data))
    evil.path.write_text(json.dumps(data))

    k = Kernel({"COLAB_RESILIENCE_RUN_DIR": str(root), "IPYTHONDIR": str(tmp_path / "ipython")})
    try:
        k.ok("%load_ext colab_resilience")
        r = k.execute("%%resilient\nx = 1\n", metadata={"cellId": cell_id})  # the pending run's cell
        assert (r.status, r.ename) == ("error", "UsageError") and "not signed by this installation's key" in r.evalue
        assert one_line(r.evalue)
        r = k.execute(f"%resilience resume {evil_id}")
        assert (r.status, r.ename) == ("error", "UsageError") and "not signed by this installation's key" in r.evalue
        for run_id in ["f0reign1", "uns1gned"]:
            r = k.ok(f"%resilience resume {run_id}")
            assert "not signed by this installation's key" in r.stdout, r.stdout
            assert "restored nothing" in r.stdout
            assert k.value("'p' in dir()") is False
        # the next %%resilient cell continues the resumed run: its checkpoint is refused again
        r = k.execute("%%resilient --save p\np = 1\n")
        assert r.status == "error" and "not signed by this installation's key" in r.evalue and one_line(r.evalue)
        assert r.ename in ("UntrustedCheckpointError", "UsageError")
    finally:
        k.shutdown()
    assert not [c for c in canaries if c.exists()]


# =============================================================================================
# 3. concurrency
# =============================================================================================


def _lock_holder(run_dir: Path, ready: Path) -> subprocess.Popen:
    code = (
        "import pathlib, time\n"
        "from colab_resilience.lock import RunLock\n"
        f"lock = RunLock({str(run_dir)!r}, create=True).acquire()\n"
        f"pathlib.Path({str(ready)!r}).write_text('ok')\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=child_env())
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    return proc


def test_reset_and_resume_of_a_run_in_use_are_refused_naming_the_holder(sandbox, ip, tmp_path):
    """Another live process holds the run: `%resilience reset` must not delete it under that
    process, nor `resume` restore from it; one line each, naming the holder's PID."""
    magics, root = sandbox
    run = resilient_run(ip, root, 1.0, "held")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    proc = _lock_holder(run, tmp_path / "ready")
    try:
        for cmd in ("reset", "resume"):
            with pytest.raises(UsageError) as info:
                ip.run_line_magic("resilience", f"{cmd} {run.name}")
            assert one_line(str(info.value))
            assert f"is in use by process {proc.pid}" in str(info.value)
    finally:
        proc.kill()
        proc.wait()
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    ip.run_line_magic("resilience", f"reset {run.name}")  # free again once the holder is gone
    assert not run.exists()


@pytest.mark.kernel
@pytest.mark.timeout(240)
def test_two_supervised_runs_in_parallel_do_not_interfere(tmp_path, ip, capsys, reference):
    """Two `colab-resilience run` processes at once, same notebook (tests/files/train.ipynb, so the
    same run id), other parameters and run directories; one kernel is SIGKILLed mid-run. Both
    finish with their own exact results: no lock, checkpoint or journal of one leaks into the other."""
    from harness import FILES, KERNEL_NAME, load, result, run_in_shell

    jobs = {}
    for name, parameters, kill in [("a", {"fault": "sigkill", "fault_epoch": 2}, True), ("b", {"seed": 1}, False)]:
        work = tmp_path / name
        work.mkdir()
        shutil.copy(FILES / "train.ipynb", work / "train.ipynb")
        parameters = {"mark": str(work / "fault.mark"), "log": str(work / "events.log"), **parameters}
        cmd = [sys.executable, "-m", "colab_resilience", "run", str(work / "train.ipynb"), "-o", str(work / "out.ipynb"),
               "--kernel", KERNEL_NAME, "--run-dir", str(work / "runs"), "--no-progress"]
        for key, value in parameters.items():
            cmd += ["-p", key, str(value)]
        jobs[name] = (subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), kill)
    # b's own reference: seed 1, uninterrupted, in this process (tests/test_golden.py: the same bits as in a kernel)
    ip.run_line_magic("resilience", f"dir {tmp_path / 'runs-here'}")
    (tmp_path / "here").mkdir()
    run_in_shell(ip, load("train.ipynb", tmp_path / "here", seed=1))
    expected = {"a": reference.result, "b": result(capsys.readouterr().out)}
    assert expected["a"] != expected["b"]
    for name, (proc, kill) in jobs.items():
        out, _ = proc.communicate(timeout=200)
        assert proc.returncode == 0, out
        executed = nbformat.read(tmp_path / name / "out.ipynb", 4)
        assert result(executed) == expected[name], name
        restarts = executed.metadata["colab_resilience"]["restarts"]
        assert [r["exit_code"] for r in restarts] == ([-9] if kill else [])
        journals = list((tmp_path / name / "runs").glob("run-*/journal.json"))
        assert len(journals) == 1 and json.loads(journals[0].read_text())["status"] == "done"
    ids = {p.parent.name for name in jobs for p in (tmp_path / name / "runs").glob("run-*/journal.json")}
    assert len(ids) == 1  # the same run id in both directories, and still no interference


# =============================================================================================
# 4. permissions
# =============================================================================================


def test_everything_a_run_writes_is_private_even_with_umask_0(sandbox, ip, tmp_path, monkeypatch):
    """Under umask 0 (some containers): the key, run directories, journal, lock, manifests, blobs
    and LATEST are owner-only; the startup file, which IPython executes, is not writable by others."""
    magics, root = sandbox
    home = tmp_path / "keyhome"
    monkeypatch.setenv(signing.ENV_HOME, str(home))
    startup = restart.startup_path(ip)
    seen = {}
    ip.user_ns["seen"] = seen
    ip.user_ns["w"] = torch.zeros(3)
    body = (
        "import os, stat\n"
        f"seen['startup'] = stat.S_IMODE(os.stat({str(startup)!r}).st_mode)\n"
        f"for d, _, files in os.walk({str(root)!r}):\n"
        "    seen[d] = stat.S_IMODE(os.stat(d).st_mode)\n"
        "    for f in files:\n"
        "        seen[os.path.join(d, f)] = stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode)\n"
        "for step in resume_range(2):\n"
        "    w += 1\n"
    )
    old = os.umask(0)
    try:
        ip.run_cell_magic("resilient", "--save w", body)
    finally:
        os.umask(old)
    assert seen.pop("startup") & 0o022 == 0, "the startup file IPython executes is writable by others"
    for d, _, files in os.walk(root):
        seen[d] = stat.S_IMODE(os.stat(d).st_mode)
        for f in files:
            seen[os.path.join(d, f)] = stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode)
    seen[str(home)] = stat.S_IMODE(home.stat().st_mode)
    seen[str(home / "key")] = stat.S_IMODE((home / "key").stat().st_mode)
    names = {Path(p).name for p in seen}
    assert {"journal.json", "lock", "LATEST", "manifest.json", "key"} <= names
    assert any(Path(p).parent.name == "blobs" for p in seen)
    loose = {p: f"{m:04o}" for p, m in seen.items() if m & 0o077}
    assert not loose, loose
