"""What a training step carries between safe points that a ``state_dict`` does not.

A rollback or a restore must leave nothing behind that the last safe point did not have. Restoring
a module's or optimizer's ``state_dict`` in place brings back their tensors, but not:

- **gradients** (``param.grad``): a retry after an OOM in ``backward()``, or in the middle of a
  gradient accumulation, would add its gradients to the failed attempt's (and hold their memory
  through the retry). They are cleared (set to ``None``) for every parameter of a restored module
  and of a restored optimizer's param groups: at a safe point, a loop that zeroes its gradients
  has none that matter, and one that accumulates across safe points cannot resume exactly anyway;
- **train/eval modes** (``module.training``) and **``requires_grad`` flags** of parameters: saved
  beside the checkpoint (:func:`snapshot`) and put back (:func:`apply`);
- **a module's own plain attributes** (a call counter ``self.calls += 1`` in ``forward``, an
  annealed ``self.temperature``, a list it appends to): the public ones in each submodule's
  ``__dict__`` that are plain values (numbers, strings, flags, lists and dicts of them), saved
  and put back the same way (a list or dict into the one the module holds);
- **whether an optimizer's ``step`` was called** since a learning-rate scheduler wrapped it (the
  flag the scheduler's first ``step()`` looks at to warn that it came first): saved and put back
  with the modes, for the optimizer and the one an accelerate wrapper holds;
- **a GradScaler's per-step record** (whether ``unscale_``/``step`` were called since the last
  ``update()``): reset, so a retried step may call them again;
- **the states of torchmetrics metrics** (``MeanMetric``'s running sum, ``Accuracy``'s counts):
  a ``Metric`` registers them as non-persistent, so its ``state_dict()`` is empty and a restored
  metric came back reset (a mean over the run read ``nan``; a rolled-back one kept the failed
  attempt's updates). They go into the saved state dict under the keys torchmetrics itself uses
  for persistent states (:func:`with_module_states`), are put back as copies on the metric's
  device (:func:`put_module_states`), and the count of updates goes with the modes;
- **tensors no state dict holds**: non-persistent buffers (``register_buffer(...,
  persistent=False)``: a running mean the forward keeps) and public attributes that hold a tensor
  without registering it (``self.running = torch.zeros(4)``). Left out of ``state_dict()``, they
  came back as the set-up cells made them after a restart and kept the failed attempt's updates
  after a rollback. They go into the saved state dict under their own keys and are copied back
  into the module's tensors (:func:`unsaved_tensors`);
- **an accelerate loader's count of epochs** (``DataLoaderShard.iteration``, one more each time it
  is iterated to its end): a seedable sampler draws each epoch's order from it, and the
  ``Accelerator`` that prepared the loader holds it. A new kernel counted from 0 again, and the
  resumed epochs drew the first epochs' orders. The count of each loader bound to a name goes with
  every checkpoint (:func:`loader_epochs`) and is put back (:func:`put_loader_epochs`).

Only objects already restored are touched; nothing here imports torch.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping


def _torch():
    return sys.modules.get("torch")


def snapshot(namespace: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The modes and ``requires_grad`` flags of the modules among ``names`` (plain JSON)."""
    torch = _torch()
    facts: dict[str, Any] = {}
    if torch is None:
        return facts
    for name in names:
        value = namespace.get(name)
        if isinstance(value, torch.nn.Module):
            facts[name] = {
                "training": [m.training for m in value.modules()],
                "requires_grad": [p.requires_grad for p in value.parameters()],
                "attributes": [plain_attributes(m) for m in value.modules()],
            }
            if metrics_of(value):  # how many updates each metric has had (compute() warns at none)
                facts[name]["updates"] = [getattr(m, "_update_count", None) if _is_metric(m) else None
                                          for m in value.modules()]
        elif isinstance(value, torch.optim.Optimizer):
            called = [vars(o).get(_STEP_CALLED) for o in _optimizers(torch, value)]
            if any(flag is not None for flag in called):
                facts[name] = {"step_called": called}
    return facts


# what a learning-rate scheduler's wrapper of ``optimizer.step`` sets on the optimizer when it is
# called (the scheduler's first step warns where it is not set); a new kernel's has not been called
_STEP_CALLED = "_opt_called"


def _optimizers(torch, value: Any) -> list:
    """``value`` and, for a wrapper of an optimizer (accelerate's ``AcceleratedOptimizer``), the
    optimizer it wraps, which the schedulers made before it hold."""
    inner = getattr(value, "optimizer", None)
    return [value, inner] if isinstance(inner, torch.optim.Optimizer) and inner is not value else [value]


def plain_attributes(module: Any) -> dict[str, Any]:
    """The public attributes in ``module.__dict__`` that are plain values, copied (its mode aside:
    ``training`` goes on its own)."""
    import copy

    from .integrations import is_plain

    return {k: copy.deepcopy(v) for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and is_plain(v)}


def apply(namespace: Mapping[str, Any], names: list[str], facts: Mapping[str, Any]) -> None:
    """Put back what :func:`snapshot` recorded, and clear what a step left behind, for the objects
    among ``names``."""
    torch = _torch()
    if torch is None:
        return
    for name in names:
        value = namespace.get(name)
        if isinstance(value, torch.nn.Module):
            fact = facts.get(name) if isinstance(facts, Mapping) else None
            if isinstance(fact, Mapping):
                modules, params = list(value.modules()), list(value.parameters())
                modes, flags = fact.get("training"), fact.get("requires_grad")
                attributes = fact.get("attributes")
                if isinstance(modes, list) and len(modes) == len(modules):
                    for m, mode in zip(modules, modes):
                        m.training = bool(mode)
                if isinstance(attributes, list) and len(attributes) == len(modules):
                    for m, saved in zip(modules, attributes):
                        _put_attributes(m, saved)
                if isinstance(flags, list) and len(flags) == len(params):
                    for p, flag in zip(params, flags):
                        p.requires_grad_(bool(flag))
                updates = fact.get("updates")
                if isinstance(updates, list) and len(updates) == len(modules):
                    for m, count in zip(modules, updates):
                        if _is_metric(m) and isinstance(count, int):
                            m._update_count, m._computed = count, None
            for p in value.parameters():
                p.grad = None
        elif isinstance(value, torch.optim.Optimizer):
            for group in value.param_groups:
                for p in group["params"]:
                    p.grad = None
            fact = facts.get(name) if isinstance(facts, Mapping) else None
            called = fact.get("step_called") if isinstance(fact, Mapping) else None
            optimizers = _optimizers(torch, value)
            if isinstance(called, list) and len(called) == len(optimizers):
                for o, flag in zip(optimizers, called):
                    if isinstance(flag, bool):
                        setattr(o, _STEP_CALLED, flag)
        elif _is_grad_scaler(torch, value):
            _reset_scaler(value)


def _put_attributes(module: Any, saved: Any) -> None:
    """The plain attributes :func:`plain_attributes` copied, back into ``module``: a list or dict
    into the one it holds (what else holds that sees them), an attribute it holds now as
    something else than a plain value left as it is."""
    from .checkpoints.restore import into
    from .integrations import is_plain

    if not isinstance(saved, Mapping):
        return
    own = vars(module)
    for k, v in saved.items():
        if k in own and not is_plain(own[k]):
            continue
        own[k] = into(own[k], v) if k in own else v


def _metric_type() -> Any:
    tm = sys.modules.get("torchmetrics")
    metric = getattr(tm, "Metric", None) if tm is not None else None
    return metric if isinstance(metric, type) else None


def _is_metric(value: Any) -> bool:
    metric = _metric_type()
    return metric is not None and isinstance(value, metric)


def metrics_of(module: Any) -> list[tuple[str, Any]]:
    """The torchmetrics ``Metric`` objects among ``module``'s submodules (itself included), each
    with the prefix of its keys in the module's state dict (``""`` for the module itself)."""
    metric = _metric_type()
    if metric is None:
        return []
    try:
        named = list(module.named_modules())
    except Exception:
        return []
    return [(f"{n}." if n else "", m) for n, m in named if isinstance(m, metric)]


def unsaved_tensors(module: Any) -> list[tuple[str, Any, str]]:
    """The tensors of ``module`` and its submodules that ``state_dict()`` leaves out: their
    non-persistent buffers, and their public attributes that hold a tensor (``self.running =
    torch.zeros(4)``, not registered; a torchmetrics metric's states aside, which go on their own).
    Each as (its key in a state dict, its module, its name there)."""
    torch = _torch()
    try:
        named = list(module.named_modules(remove_duplicate=False))
    except Exception:
        return []
    found, seen = [], set()
    for n, m in named:
        names = set(getattr(m, "_non_persistent_buffers_set", None) or ())
        buffers = getattr(m, "_buffers", None)
        names = {b for b in names if isinstance(buffers, dict) and buffers.get(b) is not None}
        if torch is not None and not _is_metric(m):
            names |= {k for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, torch.Tensor)}
        for b in sorted(names):
            if (id(m), b) not in seen:
                seen.add((id(m), b))
                found.append((f"{n}.{b}" if n else b, m, b))
    return found


def _tensor_of(module: Any, name: str) -> Any:
    buffers = getattr(module, "_buffers", None)
    if isinstance(buffers, dict) and name in buffers:
        return buffers[name]
    return vars(module).get(name)


def with_module_states(module: Any, sd: Any) -> Any:
    """``sd``, the state dict of ``module``, with what it leaves out added where it lacks them
    (detached, not copied: the save copies): the states of the torchmetrics metrics among its
    submodules, and its tensors no state dict holds (:func:`unsaved_tensors`)."""
    for prefix, m in metrics_of(module):
        for key in getattr(m, "_defaults", {}):
            if prefix + key not in sd:
                sd[prefix + key] = _detached(getattr(m, key, None))
    for key, m, b in unsaved_tensors(module):
        if key not in sd:
            sd[key] = _tensor_of(m, b).detach()
    return sd


def mismatch(module: Any, sd: Any, most: int = 4) -> str | None:
    """How ``sd`` (a state dict :func:`with_module_states` made) cannot go into ``module``: the keys
    it has that the module has not, those it lacks, the tensors of another shape; None where they
    fit. Checked before anything is loaded: torch's ``load_state_dict`` copies every tensor that
    fits before it raises for those that do not, leaving a model half restored."""
    torch = _torch()
    if torch is None or not isinstance(sd, Mapping):
        return None
    try:
        own = module.state_dict()
    except Exception:
        return None
    expected = {*own, *(key for key, _, _ in unsaved_tensors(module)),
                *(prefix + key for prefix, m in metrics_of(module) for key in getattr(m, "_defaults", {}))}
    extra = [k for k in sd if k not in expected]
    lacking = [k for k in own if k not in sd]  # (a tensor no state dict holds, not saved, is left as it is)
    lazy = getattr(torch.nn.parameter, "is_lazy", lambda t: False)
    # (one no state dict holds is replaced where its shape changed: a cache that grew)
    shapes = [f"{k} {list(sd[k].shape)} saved, {list(t.shape)} now" for k, t in own.items()
              if k in sd and isinstance(t, torch.Tensor) and isinstance(sd[k], torch.Tensor)
              and not lazy(t) and sd[k].shape != t.shape]
    # load_state_dict would convert them, and the run would go on in the other precision
    dtypes = [f"{k} {_dtype(sd[k])} saved, {_dtype(t)} now" for k, t in own.items()
              if k in sd and isinstance(t, torch.Tensor) and isinstance(sd[k], torch.Tensor)
              and not lazy(t) and sd[k].dtype != t.dtype]

    def listed(keys: list[str]) -> str:
        return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")

    parts = ([f"saved, not in it: {listed(extra)}"] if extra else []) + \
        ([f"in it, not saved: {listed(lacking)}"] if lacking else []) + \
        ([f"other shapes: {listed(shapes)}"] if shapes else []) + \
        ([f"{OTHER_DTYPES}: {listed(dtypes)}"] if dtypes else [])
    return "; ".join(parts) or None


OTHER_DTYPES = "other dtypes"


def dtypes(module: Any) -> dict[str, str]:
    """The dtype of each tensor of ``module``'s state dict, by its key."""
    torch = _torch()
    return {k: _dtype(t) for k, t in module.state_dict().items() if isinstance(t, torch.Tensor)}


def as_built(sd: Mapping[str, Any], built: Mapping[str, str], now: Mapping[str, str]) -> Mapping[str, Any]:
    """``sd`` (saved as a trainer's precision had converted its module: ``"bf16-true"``) for
    :func:`mismatch` against the module as a fit begins (before the trainer converts it): each
    tensor whose dtype ``now`` (:func:`dtypes` of the module) has not is one without storage in its
    dtype as ``built`` (:func:`dtypes` as the saved fit began). A new kernel's module is as built;
    a retry's in the kernel, as the failed attempt converted it."""
    torch = _torch()
    return {k: torch.empty(t.shape, dtype=getattr(torch, built[k]), device="meta")
            if isinstance(t, torch.Tensor) and k in built and now.get(k) != _dtype(t) else t for k, t in sd.items()}


def in_saved_dtypes(module: Any, sd: Mapping[str, Any]) -> None:
    """Make each parameter and buffer of ``module`` whose dtype its saved tensor in ``sd`` has not
    one of that dtype, its values converted: what a trainer's precision does after it has loaded a
    checkpoint into the module as built (Lightning's ``"64-true"``), done before, so that the load
    is exact (float64 weights loaded into float32 ones lose their low bits)."""
    torch = _torch()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        saved = sd.get(name)
        if isinstance(saved, torch.Tensor) and saved.dtype != t.dtype and saved.is_floating_point() \
                and t.is_floating_point():
            t.data = t.data.to(saved.dtype)


def refusal(what: str, module: Any, sd: Any) -> str | None:
    """The one line that stops a resume where ``sd`` (a module's saved state dict) cannot go
    into ``module`` as :func:`mismatch` finds; ``what`` names it (``'model'``, "the Trainer's
    model"). None where it fits."""
    differs = mismatch(module, sd)
    if not differs:
        return None
    cause = ("a cell that is not %%replay changed its dtype after they built it (model.double(), "
             ".half(), .to(torch.bfloat16)) or the default dtype they built it in "
             "(torch.set_default_dtype): make that change in a %%replay cell"
             if OTHER_DTYPES in differs else
             "the cell changed the model after they built it (pruning, a layer added in place)")
    return (f"colab_resilience: cannot restore {what} in place: the {type(module).__name__} it holds now is not the "
            f"one saved ({differs}): the set-up cells build another architecture, or {cause}")


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def put_module_states(module: Any, sd: Any) -> Any:
    """Put what :func:`with_module_states` added to ``sd`` back into ``module``; return ``sd``
    without it, for ``load_state_dict``. A metric's states are put in as copies on its device (a
    restored state dict's tensors may lie in a buffer that is reused or mapped), and its cached
    ``compute()`` result is dropped; a tensor no state dict holds is copied into the one the module
    holds (what else holds that sees the saved values), or replaces it where its shape, dtype or
    device differs."""
    metrics, tensors = metrics_of(module), unsaved_tensors(module)
    if not metrics and not tensors:
        return sd
    sd = sd.copy()
    for key, m, b in tensors:
        if key in sd:
            _put_tensor(m, b, sd.pop(key))
    for prefix, m in metrics:
        device = getattr(m, "device", None)
        for key in getattr(m, "_defaults", {}):
            if prefix + key in sd:
                setattr(m, key, _copied(sd.pop(prefix + key), device))
        m._computed = None
    return sd


def _put_tensor(module: Any, name: str, saved: Any) -> None:
    torch = _torch()
    if torch is None or not isinstance(saved, torch.Tensor):
        return
    own = _tensor_of(module, name)
    if isinstance(own, torch.Tensor) and own.shape == saved.shape and own.dtype == saved.dtype \
            and not own.is_inference():
        with torch.no_grad():
            own.copy_(saved)
        return
    device = own.device if isinstance(own, torch.Tensor) else saved.device
    if name in getattr(module, "_buffers", {}):
        module._buffers[name] = saved.to(device, copy=True)
    else:
        setattr(module, name, saved.to(device, copy=True))


def _detached(v: Any) -> Any:
    if isinstance(v, list):
        return [_detached(x) for x in v]
    detach = getattr(v, "detach", None)
    return detach() if callable(detach) else v


def _copied(v: Any, device: Any) -> Any:
    import copy

    if isinstance(v, list):
        return [_copied(x, device) for x in v]
    torch = _torch()
    if torch is not None and isinstance(v, torch.Tensor):
        return v.to(device, copy=True) if device is not None else v.clone()
    return copy.deepcopy(v)


def load_module(target: Any, saved: Any) -> None:
    """Load ``saved`` (an unpickled module of ``target``'s kind) into ``target``: its state dict,
    the states of its metrics, its tensors no state dict holds, its modes, flags and plain attributes."""
    facts = snapshot({"m": saved}, ["m"])
    target.load_state_dict(put_module_states(target, with_module_states(saved, saved.state_dict())))
    apply({"m": target}, ["m"], facts)


def _counts_epochs(value: Any) -> bool:
    """An accelerate loader (``DataLoaderShard``, ``DataLoaderDispatcher``): it wraps a loader
    (``base_dataloader``) and counts the epochs it was iterated (``iteration``, the epoch
    ``set_epoch`` sets)."""
    if not getattr(type(value), "__module__", "").startswith("accelerate"):
        return False  # (not every object's attributes are safe to ask for: a proxy's may raise)
    count = getattr(value, "iteration", None)
    return (type(count) is int and hasattr(value, "base_dataloader")
            and callable(getattr(value, "set_epoch", None)))


_LOADER_FLAGS = ("end_of_dataloader", "remainder")  # what an accelerate loader's last iteration left


def loader_epochs(namespace: Mapping[str, Any]) -> dict[str, dict]:
    """The count of epochs of each accelerate loader bound to a public name (see the module's
    documentation), with the flags its last iteration left (whether it reached its end, the size
    of its last batch's remainder)."""
    counts = {}
    for name, value in list(namespace.items()):
        if isinstance(name, str) and not name.startswith("_") and _counts_epochs(value):
            own = vars(value)
            counts[name] = {"iteration": value.iteration,
                            "flags": {k: own[k] for k in _LOADER_FLAGS if type(own.get(k)) in (bool, int)}}
    return counts


def put_loader_epochs(namespace: Mapping[str, Any], counts: Any) -> None:
    """Set each loader :func:`loader_epochs` found back to its count and flags (the name's loader
    now: the one the replayed set-up cells prepared); its ``__iter__`` hands the count to the
    sampler."""
    if not isinstance(counts, Mapping):
        return
    for name, saved in counts.items():
        value = namespace.get(name)
        if not isinstance(saved, Mapping) or type(saved.get("iteration")) is not int or not _counts_epochs(value):
            continue
        value.iteration = saved["iteration"]
        flags = saved.get("flags") if isinstance(saved.get("flags"), Mapping) else {}
        for k in _LOADER_FLAGS:
            if k in flags:
                setattr(value, k, flags[k])
            else:
                vars(value).pop(k, None)  # (not iterated yet at the safe point)


def _is_grad_scaler(torch, value: Any) -> bool:
    scalers = tuple(c for c in (getattr(getattr(torch, "amp", None), "GradScaler", None),
                                getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)) if isinstance(c, type))
    return bool(scalers) and isinstance(value, scalers)


def _reset_scaler(scaler: Any) -> None:
    # what update() does at the end of a step: forget which optimizers were unscaled or stepped
    states = getattr(scaler, "_per_optimizer_states", None)
    if hasattr(states, "clear"):
        states.clear()


def _members(name: str, value: Any) -> list[tuple[str, Any]]:
    """``value`` as ``[(name, value)]``, or the items of a list, tuple or dict it is, or the
    attributes of an object of a class the notebook defines, one level down (``models[0]``,
    ``opts['g']``, ``trainer.opt``)."""
    if type(value) in (list, tuple):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if type(value) is dict:
        return [(f"{name}[{k!r}]", v) for k, v in value.items()]
    if type(value).__module__ == "__main__" and isinstance(getattr(value, "__dict__", None), dict):
        return [(name, value)] + [(f"{name}.{k}", v) for k, v in list(vars(value).items())]
    return [(name, value)]


def joins(namespace: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """Which tensors each optimizer among ``names`` steps: for each of its parameter groups, its
    parameters as ``[module, parameter name]`` by the first module among ``names`` that holds each
    (``["model", "lin.weight"]``), None for a tensor none of them holds; and which of those
    optimizers each learning-rate scheduler among ``names`` drives (``{"drives": "opt"}``, None for
    one no name holds). A checkpoint keeps this beside it: the optimizer's state goes back by
    position into the optimizer the set-up cells build again, and the set-up cells, run again in a
    new kernel, can join it to other tensors than the run's (the model's cell run again after the
    optimizer's, the optimizer then stepping the tensors of a model no name holds), or join the
    scheduler to the optimizer that trains (the optimizer's cell run again after the scheduler's,
    which then decayed the learning rate of an optimizer that did not train)."""
    torch = _torch()
    if torch is None:
        return {}
    members = [m for n in names if n in namespace for m in _members(n, namespace[n])]
    optimizers = [(label, v) for label, v in members if isinstance(v, torch.optim.Optimizer)]
    found: dict[str, Any] = {}
    owner: dict[int, tuple[str, str]] = {}
    try:
        for label, value in members:
            if optimizers and isinstance(value, torch.nn.Module):
                for pname, p in value.named_parameters():
                    owner.setdefault(id(p), (label, pname))
        # lists of their own (the checkpoint's meta holds no object twice: one optimizer may have two names)
        found.update({label: [[list(owner[id(p)]) if id(p) in owner else None for p in group["params"]]
                              for group in opt.param_groups] for label, opt in optimizers})
    except Exception:  # a guard: a module or optimizer of a kind that will not list its tensors is not compared
        return {}
    schedulers = _scheduler_types(torch)
    for label, value in members:
        if schedulers and isinstance(value, schedulers):
            driven = getattr(value, "optimizer", None)
            found[label] = {"drives": next((o for o, opt in optimizers if opt is driven), None)}
    return found


def holds_a_graph(value: Any) -> bool:
    """Whether ``value`` (a ``--save`` value that is not a model) holds a tensor that keeps the
    autograd graph that made it: ``history.append(loss)`` where ``loss.item()`` was meant. Each
    keeps its step's activations alive (memory that grows every step, a classic way to run out of
    it), and no checkpoint holds a graph: it comes back a leaf that requires a gradient. Looked
    for in the value, and in the last few items of a list or tuple and the values of a dict, one
    level down too: the checks of every safe point stay cheap."""
    torch = _torch()
    if torch is None:
        return False

    def graph(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.grad_fn is not None

    def items(v: Any) -> list:
        if type(v) in (list, tuple):
            return list(v[-4:])
        if type(v) is dict:
            return list(v.values())[:32]
        return []

    return graph(value) or any(graph(v) or any(graph(w) for w in items(v)) for v in items(value))


def graph_line(names: list[str]) -> str:
    them = "it" if len(names) == 1 else "them"
    return (f"colab_resilience: {', '.join(names)} {'holds' if len(names) == 1 else 'hold'} tensors that keep the "
            "autograd graph of their step (history.append(loss) where loss.item() was meant): each keeps that step's "
            "activations in memory, which grows every step until it runs out, and no checkpoint holds a graph (a "
            f"resumed run has {them} back without it); keep loss.item() or loss.detach() instead")


def regroup(recorded: Any, namespace: Mapping[str, Any], names: list[str]) -> list[str]:
    """Give each optimizer among ``names`` the parameter groups it had at the safe point
    (``recorded``, :func:`joins`) where the loop changed them after the set-up cells built it:
    ``opt.add_param_group(...)`` (a backbone unfrozen at epoch 2), or an optimizer of the same kind
    made anew over other tensors (``opt = Adam(model.parameters(), lr=1e-4)`` at epoch 2). A group
    the optimizer lacks (the set-up cells, run again in a new kernel, build it without) is added
    with the tensors the record names, and a group that steps other tensors of the saved models is
    given the recorded ones, the groups' settings and state then coming from the checkpoint; a
    group added after the safe point (by the failed attempt that a retry rolls back) is taken out,
    with its state, and the loop adds it again. Where the optimizer steps a tensor no saved model
    holds (the model's cell run again after the optimizer's), or the record names one, nothing is
    changed, for :func:`joins_changed` to say. Returns the optimizers changed."""
    torch = _torch()
    if torch is None or not isinstance(recorded, Mapping):
        return []
    members = [m for n in names if n in namespace for m in _members(n, namespace[n])]
    modules = {label: v for label, v in members if isinstance(v, torch.nn.Module)}
    changed: list[str] = []
    done: set[int] = set()
    for label, opt in members:
        if not isinstance(opt, torch.optim.Optimizer) or id(opt) in done:
            continue
        done.add(id(opt))
        then, now = recorded.get(label), joins(namespace, names).get(label)
        if not isinstance(then, list) or not isinstance(now, list) or then == now:
            continue
        if len(now) > len(then) and now[:len(then)] == then:  # a group added since the safe point
            for group in opt.param_groups[len(then):]:
                for p in group["params"]:
                    opt.state.pop(p, None)
            del opt.param_groups[len(then):]
            changed.append(label)
            continue
        if any(entry is None for group in now for entry in group):
            continue
        try:
            wanted = [[modules[entry[0]].get_parameter(entry[1]) for entry in group] for group in then]
        except (TypeError, KeyError, IndexError, AttributeError):  # a tensor no saved model holds
            continue
        if len({id(t) for group in wanted for t in group}) != sum(map(len, wanted)):
            continue
        for p in [p for group in opt.param_groups for p in group["params"]]:
            opt.state.pop(p, None)
        kept = min(len(wanted), len(opt.param_groups))
        for group, tensors in zip(opt.param_groups[:kept], wanted):
            group["params"][:] = tensors  # in place: an L-BFGS keeps the list of its one group
        del opt.param_groups[len(wanted):]
        for tensors in wanted[kept:]:
            opt.add_param_group({"params": tensors})
        changed.append(label)
    return changed


def _scheduler_types(torch) -> tuple[type, ...]:
    module = getattr(torch.optim, "lr_scheduler", None)
    return tuple(c for c in (getattr(module, "LRScheduler", None), getattr(module, "_LRScheduler", None),
                             getattr(module, "ReduceLROnPlateau", None)) if isinstance(c, type))


def _entries(groups: list) -> list:
    return [entry for group in groups for entry in group]


def _stepped(groups: list) -> str:
    """What a :func:`joins` entry steps, in words."""
    found = _entries(groups)
    owners = sorted({str(entry[0]) for entry in found if entry})
    parts = [f"the parameters of {' and '.join(owners)}"] if owners else []
    if None in found:
        parts.append("tensors no saved model holds")
    return " and ".join(parts) or "no tensors"


def _groups(n: int) -> str:
    return f"{n} parameter group{'' if n == 1 else 's'}"


def _driven(optimizer: Any) -> str:
    """What a :func:`joins` scheduler entry drives, in words."""
    return str(optimizer) if optimizer else "an optimizer no saved name holds"


def joins_changed(recorded: Any, now: Mapping[str, Any]) -> str | None:
    """Where an optimizer steps other tensors now than it did when ``recorded`` (:func:`joins`) was
    taken, or a scheduler drives another optimizer, one clause that says so, and the likely cause
    (of the first such); else None."""
    if not isinstance(recorded, Mapping):
        return None  # a checkpoint of an earlier version: not recorded
    for label, entry in now.items():
        then = recorded.get(label)
        if isinstance(entry, Mapping):  # a scheduler
            if not isinstance(then, Mapping) or then.get("drives") == entry.get("drives"):
                continue
            return (f"{label} drives {_driven(entry.get('drives'))} now, where at the safe point it drove "
                    f"{_driven(then.get('drives'))} (a cell that makes the optimizer run again after the one that "
                    "makes the scheduler?)")
        if not isinstance(then, list) or then == entry:
            continue
        before, after = _stepped(then), _stepped(entry)
        cause = "a cell that makes the model run again after the one that makes the optimizer?"
        if before == after and len(then) != len(entry):  # not groups added at the end: regroup() puts those right
            before, after = f"{before} in {_groups(len(then))}", f"{after} in {_groups(len(entry))}"
            cause = "the optimizer built with other parameter groups than the run's?"
        elif before == after and sorted(map(repr, _entries(then))) != sorted(map(repr, _entries(entry))):
            after = "other " + after.removeprefix("the ")  # of the same models: some of theirs, or others
        elif before == after:
            after += " in another order"
        return f"{label} steps {after} now, where at the safe point it stepped {before} ({cause})"
    return None
