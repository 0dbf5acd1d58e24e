"""A loaded checkpoint, and putting its values back into a namespace.

Every blob of a :class:`Checkpoint` was verified when it was loaded; a value is decoded afresh at
each restore (a second rollback from the same checkpoint gets the saved bytes again, whatever the
training did to the first). ``state_dict`` values are loaded **in place** into the object of that
name that exists at restore time (rebuilt by the set-up cells): a module copies them into its own
parameters, an optimizer keeps the tensors it is given. Tensors go back to the device they were
saved on (the CPU, with a warning, where that device is gone), as Parameters or with
``requires_grad`` where they were; views of one storage stay views of one storage. A Keras
model, layer, optimizer or metric gets its saved variables assigned (:mod:`.keras_state`). ``pytree``
values (a flax ``TrainState``, optax states, ``nnx`` objects) are restored into the object of that
name the set-up cells rebuilt (:mod:`.pytree`). A random number generator (torch's, NumPy's,
Python's ``random.Random``) gets its saved state set where the name holds one of its kind (a
``DataLoader`` given it draws from it). Other names are bound to their saved values, or, where
the caller names them ``in_place``, put into the objects they hold where those can take them
(:func:`into`: a list the set-up cells handed to a logger, a tensor they handed to an optimizer).
Pickles are unpickled only here, after the manifest's signature and the blob's hash were checked.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import sys
import warnings
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Collection, MutableMapping, Sequence

from .. import words
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointWarning
from . import blobs, codec, hashing, keras_state, pytree, tensorfile
from .manifest import Entry, Manifest
from .rng import generator_state, is_generator, restore_rng, set_generator_state
from .values import KERAS, REF, first_line, holds_state, type_name


class LoadedBlob:
    """One verified blob of a checkpoint, decoded lazily into fresh values at each restore."""

    def __init__(self, folder: Path, entry: Entry):
        self.folder = folder
        self.entry = entry
        self.name = entry.name
        self.kind = entry.kind
        self.type_name = entry.type_name
        self.format = entry.format
        self._buf = None
        self._decoded: tuple | None = None

    def read(self, pool: Executor) -> LoadedBlob:
        """Read and verify the blob (CheckpointCorruptError if it is damaged)."""
        e = self.entry
        self.fill(blobs.read(self.folder, e.hash, e.size, pool, map_file=e.format == "st"))
        return self

    def fill(self, buf) -> None:
        """Check ``buf`` decodes (a damaged structure means a damaged checkpoint)."""
        try:
            if self.format == "st":
                tree, descs, ranges = tensorfile.parse(buf)
                leaves = tensorfile.leaves_over(buf, descs, ranges)
                codec.decode(tree, leaves)
                self._decoded = (tree, descs, leaves)
            elif self.format == "json":
                self._decoded = (json.loads(bytes(buf)), [], [])
                codec.decode(self._decoded[0], [])
        except codec.MALFORMED as e:
            raise CheckpointCorruptError(f"{self.name!r} does not decode: {first_line(e)}") from None
        self._buf = buf

    def take(self, *, private: bool = True) -> tuple:
        """(tree, descs, leaves) or the pickle bytes; the buffer is handed out once, then re-read.

        A mapped blob (see :func:`.blobs.read`) is copied into private memory first, unless
        ``private`` is false: the caller copies the leaves itself (``Module.load_state_dict``
        copies into the parameters) and nothing keeps the file mapped afterwards.
        """
        if self._buf is None:  # handed out before: the caller may have changed those tensors
            self.read(hashing.pool())
        buf, decoded = self._buf, self._decoded
        self._buf = self._decoded = None
        if self.format == "pickle":
            return (bytes(buf),)
        if not private:
            return decoded
        tree, descs, leaves = decoded
        # each leaf in memory of its own, nothing left over the file's mapping or the blob
        return tree, descs, tensorfile.own_copies(leaves, descs, everything=blobs.is_mapped(buf))


class Checkpoint:
    """A verified checkpoint in memory; :meth:`restore` puts it into a namespace."""

    def __init__(self, store: Any, manifest: Manifest, entries: dict[str, LoadedBlob], rng: LoadedBlob, meta: Any):
        self.store = store
        self.manifest = manifest
        self.checkpoint_id = manifest.checkpoint_id
        self.names: list[str] = list(entries)
        self.meta: dict = meta if isinstance(meta, dict) else {}
        self.created: float = manifest.created
        self.versions: dict = manifest.versions
        self.skipped: dict = manifest.skipped
        self.kinds: dict[str, str] = {n: e.kind for n, e in entries.items()}
        self._entries = entries
        self._rng = rng

    def __repr__(self) -> str:
        return f"<Checkpoint {self.checkpoint_id}: {', '.join(self.names)}>"

    def restore(
        self,
        namespace: MutableMapping[str, Any],
        names: Sequence[str] | None = None,
        *,
        rng: bool = True,
        strict: bool = True,
        in_place: Collection[str] = (),
    ) -> list[str]:
        """Restore ``names`` (default: all) into ``namespace``; return the names restored.

        Objects saved by ``state_dict()`` are loaded in place into the object of that name in
        ``namespace``. If one is missing or of another type, or a name is not in this checkpoint,
        nothing is restored and :class:`CheckpointError` says so in one line (with
        ``strict=False``: a :class:`CheckpointWarning` each, and the rest is restored).

        The names in ``in_place`` keep the objects they hold now where those can take the saved
        contents (:func:`into`): what else holds them (a logger given the history list, an
        optimizer given a tensor) sees the restored values. Pass the names the code that goes on
        changes only in place; a name it binds again is better bound to the saved value.
        """
        wanted = self.names if names is None else list(dict.fromkeys([names] if isinstance(names, str) else names))
        problems = {n: p for n in wanted if (p := self._problem(n, namespace)) is not None}
        if problems and strict:
            raise CheckpointError(next(iter(problems.values())) + (
                f"; {', '.join(list(problems)[1:])} cannot be restored either" if len(problems) > 1 else ""
            ))
        for message in problems.values():
            warnings.warn(message, CheckpointWarning, stacklevel=2)
        restoring = _Restoring(self, namespace, [n for n in wanted if n not in problems], in_place)
        restored = []
        for n in wanted:
            if n in problems:
                continue
            try:
                restoring.restore(n)
            except CheckpointError as err:
                if strict:
                    raise
                warnings.warn(str(err), CheckpointWarning, stacklevel=2)
                continue
            restored.append(n)
        if rng:
            restore_rng(self._value(self._rng, place=False))
        return restored

    def put_back_in_place(self, namespace: MutableMapping[str, Any], names: Sequence[str]) -> list[str]:
        """Set the saved contents into the objects ``names`` hold now, where they can take them and
        stay the same objects (see :func:`into`); others are left as they are. Returns the names
        put back."""
        done = []
        for n in names:
            e = self._entries.get(n)
            if e is None or e.kind in ("state_dict", "pytree") or n not in namespace:
                continue
            target = namespace[n]
            keras: list[keras_state.Saved] = []
            value = self._value(e, place=True, restoring=_Restoring(self, namespace, []), keras=keras)
            if into(target, value, keras=bool(keras)) is target:
                _all_placed(keras)
                done.append(n)
        return done

    def _problem(self, n: str, namespace: MutableMapping[str, Any]) -> str | None:
        """Why ``n`` cannot be restored into ``namespace`` (one line), or None."""
        e = self._entries.get(n)
        if e is None:
            hint = words.did_you_mean(n, self.names)
            return (
                f"colab_resilience: {n!r} is not in checkpoint {self.checkpoint_id}{hint}; "
                f"it holds: {', '.join(self.names) or 'nothing'}"
            )
        if e.kind not in ("state_dict", "pytree"):
            return None
        short = e.type_name.rsplit(".", 1)[-1]
        pytree = e.kind == "pytree"  # leaves go into the rebuilt object; a state dict is loaded into it
        if n not in namespace:
            return (
                f"colab_resilience: cannot restore {n!r}: its leaves are saved, and they go into the {short} "
                f"the set-up cells build, but no variable {n!r} exists now; build it in a %%replay cell"
            ) if pytree else (
                f"colab_resilience: cannot restore {n!r} in place: no variable {n!r} exists "
                f"now (it was {words.a(short)}); run the cell that builds it first (a %%replay cell is run again "
                "after a restart)"
            )
        if not pytree and not callable(getattr(namespace[n], "load_state_dict", None)) \
                and keras_state.kind(namespace[n]) is None:
            return (
                f"colab_resilience: cannot restore {n!r} in place: it now holds "
                f"{words.a(type(namespace[n]).__name__)}, which has no load_state_dict (it was {words.a(short)})"
            )
        if type_name(namespace[n]) != e.type_name:
            return (
                f"colab_resilience: cannot restore {n!r} {'into what it holds now' if pytree else 'in place'}: it "
                f"was saved from {words.a(e.type_name)} and now holds {words.a(type_name(namespace[n]))}"
            )
        return None

    def _value(self, e: LoadedBlob, place: bool, *, private: bool = True, restoring: _Restoring | None = None,
               keras: list | None = None) -> Any:
        """The value of ``e``; the Keras objects its pickle holds (:class:`.keras_state.Saved`) are
        appended to ``keras``."""
        got = e.take(private=private)
        if e.format == "pickle":
            try:
                unpickler = _Unpickler(io.BytesIO(got[0]), e.name, restoring)
                value = unpickler.load()
                if keras is not None:
                    keras.extend(unpickler.keras)
                return value
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(
                    f"colab_resilience: cannot restore {e.name!r}: unpickling failed ({first_line(err)}); "
                    "define its class (in a %%replay cell) before restoring"
                ) from None
        tree, descs, leaves = got
        if place and leaves:
            leaves = _place_leaves(e.name, descs, leaves)
        return codec.decode(tree, leaves)

    def _restore_one(self, e: LoadedBlob, namespace: MutableMapping[str, Any], restoring: _Restoring) -> None:
        if e.kind == "state_dict" and keras_state.kind(namespace[e.name]) is not None:
            keras_state.load(e.name, namespace[e.name], self._value(e, place=False, restoring=restoring), namespace,
                             restore_layers=lambda: restoring.restore_keras_layers(e.name))
            return
        if e.kind == "state_dict":
            target = namespace[e.name]
            torch = sys.modules.get("torch")
            # a module copies what it is given into its own tensors; an optimizer keeps them
            copies = torch is not None and isinstance(target, torch.nn.Module)
            value = self._value(e, place=False, private=not copies, restoring=restoring)
            if copies and not _loads_its_own_way(torch, target):
                from .. import carried

                refused = carried.refusal(repr(e.name), target, value)
                if refused:
                    raise CheckpointError(refused)
            try:
                if copies:  # its metrics' states (kept as given), the tensors its state dict leaves out
                    from .. import carried

                    value = carried.put_module_states(target, value)
                result = target.load_state_dict(value)
            except CheckpointError:  # an object of this package's (a trainer's state) that says why itself
                raise
            except Exception as err:
                raise CheckpointError(
                    f"colab_resilience: cannot restore {e.name!r} in place: load_state_dict failed "
                    f"({_load_failure(err)})"
                ) from None
            missing = getattr(result, "missing_keys", None)
            if missing or getattr(result, "unexpected_keys", None):
                warnings.warn(
                    f"colab_resilience: {e.name!r} restored with missing keys {missing} and "
                    f"unexpected keys {result.unexpected_keys}",
                    CheckpointWarning,
                    stacklevel=3,
                )
            return
        if e.kind == "pytree":
            namespace[e.name] = pytree.restore_into(e.name, namespace[e.name], self._value(e, place=True))
            return
        keras: list[keras_state.Saved] = []
        value = self._value(e, place=True, restoring=restoring, keras=keras)
        if keras and e.name in namespace:  # its Keras objects' variables go into those in their places
            value = into(namespace[e.name], value, keras=True)
        elif e.name in restoring.in_place and e.name in namespace:
            value = into(namespace[e.name], value)
        elif _generator_state_put_back(namespace.get(e.name), value):
            return
        _all_placed(keras)
        namespace[e.name] = value


def _loads_its_own_way(torch, module: Any) -> bool:
    """Whether a submodule of ``module`` renames or adds keys as it loads (a load pre-hook: a lazy
    module's, an old-style spectral norm's): its state dict need not match its keys beforehand."""
    base = torch.nn.Module._load_from_state_dict
    norm = getattr(getattr(torch.nn.modules, "batchnorm", None), "_NormBase", None)
    for m in module.modules():
        if getattr(m, "_load_state_dict_pre_hooks", None):
            return True
        own = type(m)._load_from_state_dict
        if own is not base and not (norm is not None and own is norm._load_from_state_dict):
            return True
    return False


def _load_failure(err: BaseException, most: int = 300) -> str:
    """``err`` of a ``load_state_dict`` in one line: torch's puts what failed on the lines below
    its first (``Error(s) in loading state_dict for Sequential:``, then the missing and unexpected
    keys, the shapes that differ), which are what says why."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    if len(lines) < 2 or not lines[0].startswith("Error(s) in loading state_dict"):
        return first_line(err)
    text = f"{type(err).__name__}: {lines[0]} " + "; ".join(ln.rstrip(". ") for ln in lines[1:])
    return text if len(text) <= most else text[:most - 3] + "..."


class _Restoring:
    """One restore: the names it puts back, each once, in the order their pickles need (a pickle
    that refers to another saved name gets the object restored under that name: see
    :class:`.values.Shared`)."""

    def __init__(self, ckpt: Checkpoint, namespace: MutableMapping[str, Any], names: Sequence[str],
                 in_place: Collection[str] = ()):
        self.ckpt, self.namespace = ckpt, namespace
        self.in_place = frozenset(in_place)  # names whose objects take the saved contents (into)
        self.pending = dict.fromkeys(names)
        self.busy: set[str] = set()
        self._tensors: dict[str, dict] = {}  # name -> its module's state_dict(keep_vars=True), once

    def restore(self, name: str) -> None:
        if name not in self.pending:
            return  # restored already, for a pickle that refers to it
        self.busy.add(name)
        try:
            self.ckpt._restore_one(self.ckpt._entries[name], self.namespace, self)
        finally:
            self.busy.discard(name)
        del self.pending[name]

    def restore_keras_layers(self, but: str) -> None:
        """Restore the Keras models and layers of this restore now, ahead of the optimizer ``but``
        (built for their variables: an unbuilt model is built by its restore)."""
        for n in list(self.pending):
            if n != but and n not in self.busy and n in self.namespace \
                    and keras_state.layers_of({n: self.namespace[n]}):
                self.restore(n)

    def referred(self, holder: str, name: str, key: Sequence[str]) -> Any:
        """The object ``holder``'s pickle refers to: what ``name`` holds once restored (a tensor
        ``key`` of its state dict)."""
        entry = self.ckpt._entries.get(name)
        if entry is None:
            raise CheckpointError(
                f"colab_resilience: cannot restore {holder!r}: it holds {name!r}, which is not in checkpoint "
                f"{self.ckpt.checkpoint_id}; restore it from the checkpoint it was saved in")
        if name in self.busy and entry.kind == "pickle":
            raise CheckpointError(f"colab_resilience: cannot restore {holder!r}: it and {name!r} hold each other")
        if name in self.pending and name not in self.busy:
            self.restore(name)
        if name not in self.namespace:
            raise CheckpointError(
                f"colab_resilience: cannot restore {holder!r}: it holds {name!r}, and no variable {name!r} "
                f"exists now; restore {name!r} with it, or build it in a %%replay cell")
        obj = self.namespace[name]
        for k in key:
            try:
                if name not in self._tensors:
                    self._tensors[name] = obj.state_dict(keep_vars=True)
                obj = self._tensors[name][k]
            except Exception:
                raise CheckpointError(
                    f"colab_resilience: cannot restore {holder!r}: it holds the tensor {k!r} of {name!r}, which "
                    f"{name!r} has no more (it holds {words.a(type(self.namespace[name]).__name__)} now)") from None
        return obj


class _Unpickler(pickle.Unpickler):
    """Unpickles a saved value; its references to other saved names resolve to what the restore
    puts back under them."""

    def __init__(self, f, name: str, restoring: _Restoring | None):
        super().__init__(f)
        self.name, self.restoring = name, restoring
        self.keras: list[keras_state.Saved] = []  # the Keras objects it held, to be put in their places

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == KERAS and isinstance(pid[1], dict):
            restoring, name = self.restoring, self.name
            saved = keras_state.Saved(pid[1], name, restoring.namespace if restoring is not None else {},
                                      (lambda: restoring.restore_keras_layers(name)) if restoring is not None
                                      else (lambda: None))
            self.keras.append(saved)
            return saved
        if not (isinstance(pid, tuple) and len(pid) >= 2 and pid[0] == REF and self.restoring is not None):
            raise pickle.UnpicklingError(f"a reference this restore cannot resolve: {pid!r}")
        return self.restoring.referred(self.name, pid[1], pid[2:])


_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None)})  # nothing to keep: bound as saved
_CONTAINERS = (list, dict, set, collections.OrderedDict, collections.defaultdict, collections.Counter,
               collections.deque)


def into(target: Any, saved: Any, _seen: dict[int, Any] | None = None, *, keras: bool = False) -> Any:
    """What a name that holds ``target`` holds once ``saved`` is restored into it: ``target``
    itself, with the saved contents, where it is of the saved one's kind and can take them; else
    ``saved``. Kept objects are a list, dict or set and their kin (their items; a dict's values and
    an equally long list's items are put into what they hold in turn), a torch tensor that is a
    leaf of the same shape, dtype and device, a writable NumPy array of the same shape and dtype
    (``copy_``, ``[...] =``), a TensorFlow variable of the same shape and dtype (``assign``), a
    random number generator (its state), an object of a class the
    notebook defines (its attributes, put into its own in turn), an object with a state dict of the
    saved one's type (a module, an optimizer, a scheduler in a list: the saved one's state loaded
    into it, as ``load_state_dict`` does; where that fails, ``saved``). A tuple of the same length stays
    the same tuple where every item did. Whatever else holds ``target`` (a logger given the
    history list, an optimizer given a hand-made weight tensor) then sees the restored values, as
    it did at the safe point. A Keras object saved by its variables (:class:`.keras_state.Saved`)
    has them assigned into the Keras object of its kind in its place; with ``keras`` (``saved``
    holds such objects), where none is in its place, :class:`CheckpointError` says so, before the
    container that would hold it is changed."""
    if isinstance(saved, keras_state.Saved):  # its variables, into the Keras object in its place
        if saved.put(target):
            return target
        raise CheckpointError(saved.unplaced())
    if target is saved or type(saved) in _ATOMS:
        return saved
    seen = {} if _seen is None else _seen
    if id(target) in seen:
        return seen[id(target)]

    def fresh(value: Any) -> Any:  # bound as saved: nothing of the notebook's takes a Keras object in it
        if keras and (found := _saved_in(value, set())) is not None:
            raise CheckpointError(found.unplaced())
        return value

    kind = type(saved)
    if type(target) is not kind:
        return fresh(saved)
    if kind in _CONTAINERS:
        if kind is collections.deque and target.maxlen != saved.maxlen:
            return fresh(saved)
        seen[id(target)] = target
        if kind is collections.deque:
            target.clear()
            target.extend(fresh(saved))
        elif isinstance(target, list):
            items = ([into(t, v, seen, keras=keras) for t, v in zip(target, saved)] if len(target) == len(saved)
                     else fresh(saved))
            target[:] = items
        elif isinstance(target, dict):
            items = {k: into(target[k], v, seen, keras=keras) if k in target else fresh(v) for k, v in saved.items()}
            target.clear()
            target.update(items)
            if kind is collections.defaultdict:
                target.default_factory = saved.default_factory
        else:
            target.clear()
            target.update(fresh(saved))
        return target
    if kind is tuple and len(target) == len(saved):
        items = tuple(into(t, v, seen, keras=keras) for t, v in zip(target, saved))
        return target if all(a is b for a, b in zip(items, target)) else items
    if (_tensor_into(target, saved) or _array_into(target, saved) or _variable_into(target, saved)
            or _generator_state_put_back(target, saved)):
        return target
    if notebook_object(saved):
        seen[id(target)] = target
        attributes = {k: into(target.__dict__[k], v, seen, keras=keras) if k in target.__dict__ else fresh(v)
                      for k, v in vars(saved).items()}
        target.__dict__.clear()
        target.__dict__.update(attributes)
        return target
    if _state_loaded(target, saved):
        return target
    return fresh(saved)


def _saved_in(value: Any, seen: set[int]) -> keras_state.Saved | None:
    """A Keras object saved by its variables (:class:`.keras_state.Saved`) that ``value`` holds, in
    its containers or the attributes of the notebook's objects, or None."""
    if isinstance(value, keras_state.Saved):
        return value
    if id(value) in seen:
        return None
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        items = list(value)
    elif notebook_object(value):
        items = list(vars(value).values())
    else:
        return None
    for item in items:
        if (found := _saved_in(item, seen)) is not None:
            return found
    return None


def _all_placed(keras: list) -> None:
    """CheckpointError where a Keras object of a restored pickle found no object to take its
    variables (:class:`.keras_state.Saved`): bound, it would be a placeholder, not a model."""
    for saved in keras:
        if not saved.placed:
            raise CheckpointError(saved.unplaced())


def goes_into(value: Any) -> bool:
    """Whether a restore :func:`into` ``value`` keeps the objects it holds (what it holds is put
    into them in turn): a list, dict, set or tuple, or an object of a class the notebook defines."""
    return type(value) in _CONTAINERS or type(value) is tuple or notebook_object(value)


def _state_loaded(target: Any, saved: Any) -> bool:
    """Load the state of ``saved`` into ``target`` (of its type) where both have a state dict:
    ``models = [nn.Linear(...) for _ in range(3)]`` and ``opts`` over their parameters, saved as
    lists, were unpickled as copies of one another's tensors, so that the optimizers stepped
    tensors no model held; loaded into the objects the set-up cells rebuilt, they stay joined.
    False (nothing to keep) where loading fails: the name is then bound to the saved object."""
    if not holds_state(target) or is_generator(target):
        return False
    torch = sys.modules.get("torch")
    try:
        if torch is not None and isinstance(target, torch.nn.Module) and isinstance(saved, torch.nn.Module):
            from .. import carried  # its metrics' states, modes and plain attributes too

            carried.load_module(target, saved)
        else:
            target.load_state_dict(saved.state_dict())
    except Exception:
        return False
    return True


def notebook_object(value: Any) -> bool:
    """An instance of a class the notebook defines (``class Trainer:`` in a cell), with its
    attributes in its ``__dict__`` only: its restore puts them into the object the name holds,
    whose method may be running (``trainer.fit()``, the loop inside it: ``self`` is that object)."""
    cls = type(value)
    return (cls.__module__ == "__main__" and isinstance(getattr(value, "__dict__", None), dict)
            and not any("__slots__" in vars(c) for c in cls.__mro__[:-1]))


def _tensor_into(target: Any, saved: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or type(saved) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if not (target.is_leaf and target.layout == saved.layout == torch.strided and target.shape == saved.shape
            and target.dtype == saved.dtype and target.device == saved.device
            and target.requires_grad == saved.requires_grad and not target.is_inference()):
        return False
    with torch.no_grad():
        target.copy_(saved)
    target.grad = None  # as a tensor made afresh has: a step's gradient is not a safe point's state
    return True


def _variable_into(target: Any, saved: Any) -> bool:
    """A TensorFlow variable of the saved one's shape and dtype takes its value (``assign``): a
    ``tf.function`` traced over it, or an object holding it, goes on with the restored value."""
    variables = sys.modules.get("tensorflow.python.ops.variables")
    if variables is None or not isinstance(target, variables.Variable):
        return False
    if tuple(target.shape) != tuple(saved.shape) or target.dtype != saved.dtype:
        return False
    target.assign(saved)
    return True


def _array_into(target: Any, saved: Any) -> bool:
    np = sys.modules.get("numpy")
    if np is None or type(saved) is not np.ndarray:
        return False
    if target.shape != saved.shape or target.dtype != saved.dtype or target.dtype.hasobject \
            or not target.flags.writeable:
        return False
    target[...] = saved
    return True


def _generator_state_put_back(target: Any, saved: Any) -> bool:
    """Where ``target`` (what the name holds now) is a random number generator of the saved one's
    kind, set its state to the saved one's and say so: a generator restored in place. The replayed
    set-up cells hand the generator they make to others (``DataLoader(..., generator=g)``, a
    sampler, a function's default), which would go on drawing from it, not from a copy bound to
    the name. Other values are bound to the name (False)."""
    if type(target) is not type(saved) or not is_generator(target):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(target, torch.Generator) and target.device != saved.device:
        return False
    if hasattr(target, "bit_generator") and type(target.bit_generator) is not type(saved.bit_generator):
        return False
    set_generator_state(target, generator_state(saved))
    return True


def _jax_leaf(d: dict, a: Any) -> Any:
    """A JAX array (on the default device) from the host bytes of a saved one: a PRNG key of its
    implementation, weakly typed where it was (a weak type decides later type promotions)."""
    import jax
    import jax.numpy as jnp

    x = jnp.array(a, copy=True)
    if d.get("key_impl"):
        x = jax.random.wrap_key_data(x, impl=d["key_impl"])
    elif d.get("weak"):
        try:  # JAX has no public way to make an array weakly typed
            from jax._src.lax.lax import _convert_element_type

            x = _convert_element_type(x, None, True)
        except (ImportError, TypeError):
            if x.ndim == 0 and jnp.asarray(x.item()).dtype == x.dtype:
                x = jnp.asarray(x.item())  # a Python number makes a weakly typed scalar
    return x


def _jax_dtypes_kept(name: str, descs: list[dict], leaves: list[Any]) -> None:
    """Stop the restore where JAX made a saved array in another dtype: saved with 64-bit types on
    (``jax_enable_x64``, set in a cell that is not ``%%replay``), a new kernel has JAX's 32-bit
    default and makes float64 float32, and the run would go on in the other precision."""
    for d, x in zip(descs, leaves):
        if d.get("lib") == "jax" and not d.get("key_impl") and str(x.dtype) != str(d.get("dtype")):
            raise CheckpointError(
                f"colab_resilience: cannot restore {name!r}: a JAX array of it was saved as {d.get('dtype')} and JAX "
                f"makes it {x.dtype} now: 64-bit types (jax.config.update('jax_enable_x64', True)) set in a cell "
                "that is not %%replay are off in a new kernel; set them in a %%replay cell before the arrays are made")


def _place_leaves(name: str, descs: list[dict], leaves: list[Any]) -> list[Any]:
    """Tensors back onto their device (CPU with a warning where it is gone); grads and Parameters;
    JAX arrays made again (:func:`_jax_leaf`)."""
    if any(d.get("lib") == "jax" for d in descs):
        leaves = [_jax_leaf(d, t) if d.get("lib") == "jax" else t for d, t in zip(descs, leaves)]
        _jax_dtypes_kept(name, descs, leaves)
    torch = sys.modules.get("torch")
    if torch is None:
        return leaves
    out = list(leaves)
    moved_spans: dict[tuple, Any] = {}
    gone: set[str] = set()
    for i, (d, t) in enumerate(zip(descs, leaves)):
        if d.get("lib") != "torch":
            continue
        device = d.get("device", "cpu")
        if device != "cpu":
            target = tensorfile.device_if_present(torch, device)
            if target is None:
                gone.add(device)
            elif "span" in d:
                # move the shared storage once, then take the views on the device
                key = (d["span"], device)
                if key not in moved_spans:
                    storage = t.untyped_storage()
                    whole = torch.empty(0, dtype=t.dtype)
                    whole.set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
                    moved_spans[key] = whole.to(target)
                t = moved_spans[key].as_strided(t.shape, t.stride(), t.storage_offset())
            else:
                t = t.to(target)
        if d.get("parameter"):
            t = torch.nn.Parameter(t, requires_grad=bool(d.get("requires_grad")))
        elif d.get("requires_grad") and (t.is_floating_point() or t.is_complex()):
            t = t.requires_grad_(True)
        out[i] = t
    if gone:
        warnings.warn(
            f"colab_resilience: {name!r} was saved on {', '.join(sorted(gone))}, which this machine "
            "does not have; restored on the CPU",
            CheckpointWarning,
            stacklevel=4,
        )
    return out
