"""Whether the replayed set-up cells made again what the training reads: a fingerprint.

A resume in a new kernel replays the set-up cells and restores the ``--save`` names; every other
name the set-up cells bind is what the replay made. Where the replay made it otherwise than the
kernel that began the run had it, the resumed run trains on other data and ends otherwise: a
split drawn without a seed (``torch.randperm(n)``, ``train_test_split`` without
``random_state``), a vocabulary in a set's order (``list(set(text))``: strings hash otherwise in
each process), a value a later cell that is not replayed changed (``lr = 3e-4`` typed in a
scratch cell). Nothing of that is in a checkpoint, and nothing said so.

When a run begins, :func:`fingerprint` records what those names hold, in the run's journal:
the names the set-up cells bind at their top level that the cell (or a function of the notebook
it calls, or a method of an object of the notebook's classes it uses) reads, not in ``--save``.
A kernel that resumes the run compares, after its replay, and :func:`differing` names those that
differ, for one line (:func:`message`). The run goes on: the line says what to fix. A change
made after the set-up cells ran is found sooner, when the run begins: each ``%%replay`` cell
fingerprints what the set-up cells bind once it has run (:meth:`.replay.ReplayLog.ran`), and the
run names what differs from that (:func:`changed_message`).

The ``--save`` values are fingerprinted too as a run begins (``fingerprint(..., saved=True)``):
until the run's first checkpoint, nothing else holds them. A kernel that resumes the run before
that checkpoint, and a retry in the kernel of an attempt that failed before it, compare
(:meth:`.run.Run._start_state`, :meth:`.run.Run.retry_not_exact`).

A fingerprint takes every byte of a tensor or array (BLAKE3, on all cores: faster than a copy of
it; a change to one element is seen), copying none where it lies in host memory and a bounded
chunk at a time where it does not (GPU memory, a view that is not contiguous); a container by
its length and its first 100,000 items (all of them where they are numbers or strings, or rows
of them: a text dataset's ``(text, label)`` pairs or records), a set by its items in any order,
a frozen module (a teacher, a pretrained backbone: no parameter that requires a gradient) by its
state dict, a torch ``DataLoader`` by its batching and its dataset (``random_split``'s subsets
by their indices, a ``TensorDataset`` by its tensors), a Hugging Face ``datasets.Dataset`` by
its Arrow table and the index a ``shuffle`` or ``select`` made of it (one in a plain cell is seen),
its features and format, a pandas frame by its index and columns,
an object of the notebook's classes by its attributes, to a depth of 6. A tensor or a long
container seen twice in one moment (:func:`one_moment`: the two walks of a ``%%replay`` cell's
run) is hashed once. A function or a class of the notebook by its code (its bytecode, constants,
names and defaults, not the file name or lines a kernel compiled it under; a decorated function
with what it wraps), so that one a plain cell defines again (a fix to ``train_step``) is seen.
Left out: a model the training trains (it is its checkpoint's, through ``--save`` or a
framework's callback, which restores it; one that is neither is named at the first run), modules
and other libraries' code, other libraries' objects (a tokenizer, a summary writer), numbers a
dict names as a time, and a name bound to a clock's reading or a process's id
(``t0 = time.time()``): they differ in any two runs.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import types
from typing import Any, Iterable, Mapping

from . import lint, restart

CHUNK = 1 << 26  # bytes copied at a time to hash what is not hashed where it lies (GPU memory, a view)
KEPT = 1 << 20  # bytes of a tensor or array whose digest one_moment keeps
ITEMS = 100_000  # items of a container walked (a longer one of numbers or strings is taken whole)
DEPTH = 6
SCHEME = "2:"  # what a fingerprint begins with: how it was taken (before 2026-11-28: none, sampled)
_PLAIN = frozenset({bool, int, float, complex, str, bytes, type(None)})

# the digests of the tensors and arrays hashed in this moment (see one_moment), by where they lie
_memo: dict | None = None


@contextlib.contextmanager
def one_moment():
    """Fingerprints taken together, with nothing run between them: a tensor or array hashed by one
    is not hashed again by the next (its digest is kept by its address, layout and type)."""
    global _memo
    outer = _memo
    _memo = {} if outer is None else outer
    try:
        yield
    finally:
        _memo = outer


def setup_names(shell, sources: Iterable[str]) -> set[str]:
    """The names the set-up cells ``sources`` bind at their top level (not inside a function, a
    class or a comprehension, not by an import), and the functions and classes they define there
    (``def step(...)``: a cell that is not replayed may define it again otherwise)."""
    names: set[str] = set()
    for source in sources:
        code = source.partition("\n")[2] if source.lstrip().startswith("%%") else source
        tree = lint._parse(shell, code)
        if tree is not None:
            names |= _top_level_bound(tree)
            names |= {s.name for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return names


def all_bound(shell, source: str) -> set[str]:
    """Every name the set-up cell ``source`` binds at its top level: as :func:`setup_names`, and
    the imports too."""
    code = source.partition("\n")[2] if source.lstrip().startswith("%%") else source
    tree = lint._parse(shell, code)
    return set().union(*(_statement_binds(s) for s in getattr(tree, "body", [])))


def _statement_binds(statement: ast.stmt) -> set[str]:
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).partition(".")[0] for a in statement.names if a.name != "*"}
    return _top_level_bound(ast.Module(body=[statement], type_ignores=[]))


def binding_statement(shell, source: str, name: str) -> str | None:
    """The code of the top-level statement of the set-up cell ``source`` that first binds ``name``
    (the whole of a ``def``), or None."""
    found = _binding(shell, source, name)
    return found[1] if found else None


def same_definition(shell, source: str, other: str, name: str) -> bool:
    """Whether both set-up cells bind ``name`` by the same ``import``, ``def`` or ``class``
    statement, or the same assignment of a literal (``lr = 1e-3``, ``history = []``), which makes
    the same thing whatever else the cells hold (another assignment's value may depend on what the
    rest of the cell set, so it is not the same by its code alone)."""
    a, b = _binding(shell, source, name), _binding(shell, other, name)
    return bool(a and b and a[0] and b[0] and a[1] == b[1])


def _literal_assignment(statement: ast.stmt) -> bool:
    value = getattr(statement, "value", None) if isinstance(statement, (ast.Assign, ast.AnnAssign)) else None
    return value is not None and all(isinstance(node, (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict,
                                                       ast.UnaryOp, ast.USub, ast.UAdd, ast.Load))
                                     for node in ast.walk(value))


def _binding(shell, source: str, name: str) -> tuple[bool, str] | None:
    """(whether it is an import, def or class; its code) of the statement that binds ``name``."""
    code = source.partition("\n")[2] if source.lstrip().startswith("%%") else source
    tree = lint._parse(shell, code)
    for statement in getattr(tree, "body", []):
        if name in _statement_binds(statement):
            definition = isinstance(statement, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.ClassDef)) or _literal_assignment(statement)
            return definition, ast.get_source_segment(code, statement, padded=False) or ""
    return None


def binding_line(shell, source: str, name: str) -> str:
    """The first line of :func:`binding_statement` (quoted, cut at 50 characters), for a message;
    the cell's first line where none is found."""
    from .journal import first_line

    statement = binding_statement(shell, source, name)
    if statement is None:
        return first_line(source)
    line = statement.strip().splitlines()[0].strip() if statement.strip() else ""
    return repr(line[:50] + ("..." if len(line) > 50 else ""))


# what differs in every process, by design: a name bound to one of these calls is not watched
_CLOCKS = frozenset({"time", "perf_counter", "monotonic", "process_time", "time_ns", "perf_counter_ns", "now",
                     "today", "utcnow", "getpid", "uuid1", "uuid4", "mkdtemp", "gettempdir"})


def _top_level_bound(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.Import,
                             ast.ImportFrom, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue  # their names are their own
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call) \
                and _called(node.value) in _CLOCKS:
            continue  # started = time.time(): a clock's reading, another in every kernel
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def read_names(shell, body: str, *, loop_starts: bool = True) -> set[str]:
    """The names the cell's code reads, and those the functions of the notebook it reaches read
    (the functions it calls, those they call, the methods of the notebook's objects it uses).
    Without ``loop_starts``, not a name read only as the start of a ``resume_range(start, stop)``:
    a resumed loop over other numbers goes on by them, exactly, or stops the run
    (:meth:`.loops.Loops._resumed_index`)."""
    tree = lint._parse(shell, body)
    return set() if tree is None else reached_names(shell, tree, loop_starts=loop_starts)


def reached_names(shell, tree: ast.AST, *, loop_starts: bool = True) -> set[str]:
    """:func:`read_names` of a parsed cell."""
    ns = shell.user_ns
    starts = set() if loop_starts else {
        id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        and n.func.id == "resume_range" and len(n.args) >= 2 and isinstance(n.args[0], ast.Name)}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and id(n) not in starts}
    todo, seen = list(read), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        value = ns.get(name)
        for code in _code_of(value):
            for n in code.co_names:
                if n in ns and n not in read:
                    read.add(n)
                    todo.append(n)
    return read


def _code_of(value: Any) -> list[types.CodeType]:
    """The code a name's value runs that reads the notebook's names: a function the notebook
    defined, or the methods of the class of an object of the notebook's classes."""
    if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
        return _codes(value.__code__)
    cls = value if isinstance(value, type) else type(value)
    if getattr(cls, "__module__", None) != "__main__":
        return []
    codes = []
    for attr in vars(cls).values():
        function = getattr(attr, "__func__", attr)
        if isinstance(function, types.FunctionType):
            codes.extend(_codes(function.__code__))
    return codes


def _codes(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and the code nested in it (comprehensions, inner functions)."""
    found, stack = [], [code]
    while stack:
        c = stack.pop()
        found.append(c)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return found


def loop_starts_only(shell, body: str) -> set[str]:
    """The names the cell reads only as the start of a ``resume_range(start, stop)`` loop: after a
    restart that loop goes on by its numbers, exactly, or stops the run in one line
    (:meth:`.loops.Loops._resumed_index`), so the replay making one otherwise (a start read from a
    checkpoint file of the notebook's own) is no difference to name. (Changed by a plain cell
    before the run began, it is named then, as any value.)"""
    return read_names(shell, body) - read_names(shell, body, loop_starts=False)


def watched(shell, body: str, sources: Iterable[str], saved: Iterable[str]) -> list[str]:
    """The names to fingerprint: bound by the set-up cells, read by the cell, not saved."""
    ns, hidden = shell.user_ns, getattr(shell, "user_ns_hidden", {})
    names = setup_names(shell, sources) & read_names(shell, body)
    return sorted(n for n in names - set(saved)
                  if n in ns and not n.startswith("_") and n not in hidden and _kind(ns[n]) is not None)


def fingerprint(ns: Mapping[str, Any], names: Iterable[str], *, saved: bool = False) -> dict[str, str]:
    """``name -> fingerprint`` (hex) for those of ``names`` whose values it knows; a value whose
    fingerprint fails is left out (it is a guard: it never stops a run). With ``saved``, of the
    ``--save`` values as a run begins: trained models and optimizers too (every byte of their
    tensors, as of any). Until the run's first checkpoint holds them, a kernel that resumes it
    has them from the set-up cells and the finished runs before it, which is what they held only
    if no other cell changed them since (an optimizer's rate set in a plain cell, weights loaded)."""
    import blake3

    out: dict[str, str] = {}
    for name in names:
        if name not in ns:
            continue
        h = blake3.blake3()
        try:
            if not (_feed_saved(ns[name], h) if saved else _feed(ns[name], h, set(), 0)):
                continue
        except Exception as e:
            from .oom import is_oom

            if is_oom(e):
                raise
            continue
        out[name] = SCHEME + h.hexdigest()[:32]
    return out


def trained(shell, body: str, sources: Iterable[str], saved: Iterable[str]) -> list[str]:
    """The names the set-up cells bind and the cell reads that :func:`watched` leaves to the run's
    checkpoints, not in ``--save``: a model the training trains and its optimizer (a Keras model a
    ``fit`` trains, a torch model a Trainer's callback keeps). Fingerprinted as the run begins with
    the ``--save`` values (until the first checkpoint nothing holds them either)."""
    ns, hidden = shell.user_ns, getattr(shell, "user_ns_hidden", {})
    names = setup_names(shell, sources) & read_names(shell, body)
    return sorted(n for n in names - set(saved)
                  if n in ns and not n.startswith("_") and n not in hidden and _kind(ns[n]) is None
                  and trainable(ns[n]))


def carried_in(shell, body: str, sources: Iterable[str], saved: Iterable[str]) -> list[str]:
    """The names the cell reads before it binds them (and those the notebook's functions it calls
    read) that the set-up cells do not bind and ``--save`` does not name: what a cell that is not
    replayed left, a finished run's saved value, or one a plain cell set or changed since (a scale
    halved after the run that saved it). Fingerprinted as the run begins with its --save values:
    after a restart nothing gives them back but the finished runs, as those runs ended."""
    tree = lint._parse(shell, body)
    if tree is None:
        return []
    ns, hidden = shell.user_ns, getattr(shell, "user_ns_hidden", {})
    loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    free = _read_before_bound(tree) | (read_names(shell, body) - loads)  # what the functions read
    # not the notebook's code: a function a plain cell defined is named at the first run (a restart
    # loses it), and one edited after a death goes on with the new code, said as the cell's own edits are
    return sorted(n for n in free - setup_names(shell, sources) - set(saved)
                  if n in ns and not n.startswith("_") and n not in hidden and not is_code(ns[n]))


def _read_before_bound(tree: ast.AST) -> set[str]:
    """The names read in ``tree`` before it binds them, in the order Python evaluates it (an
    assignment's value before its targets, a loop's iterable before its target; a binding under a
    condition counts as made)."""
    bound: set[str] = set()
    free: set[str] = set()

    def read(name: str) -> None:
        if name not in bound:
            free.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                read(node.id)
            else:
                bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for child in [*node.decorator_list, *getattr(getattr(node, "args", None), "defaults", []), *getattr(node, "bases", [])]:
                visit(child)
            bound.add(node.name)
            # its body runs when called: what it reads that is not its own is read then
            own = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
            own |= {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
            for n in ast.walk(node):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in own:
                    read(n.id)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
            if node.value is not None:
                visit(node.value)
            for target in getattr(node, "targets", None) or [node.target]:
                visit(target)
        elif isinstance(node, ast.AugAssign):
            visit(node.value)
            if isinstance(node.target, ast.Name):
                read(node.target.id)
            visit(node.target)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            visit(node.iter)
            visit(node.target)
            for child in [*node.body, *node.orelse]:
                visit(child)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = set()
            for gen in node.generators:
                visit(gen.iter)
                inner |= {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
            elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for n in ast.walk(ast.Module(body=[ast.Expr(e) for e in elts] + [ast.Expr(c) for g in node.generators
                                                                                for c in g.ifs], type_ignores=[])):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in inner:
                    read(n.id)
        elif isinstance(node, ast.Lambda):
            args = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
            for n in ast.walk(node.body):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in args:
                    read(n.id)
        else:
            for child in ast.iter_child_nodes(node):
                visit(child)

    visit(tree)
    return free


def _held_module(value: Any) -> Any:
    """The torch model a trainer holds and trains (the Hugging Face ``Trainer``'s ``model``), or None."""
    torch = sys.modules.get("torch")
    if torch is None or isinstance(value, torch.nn.Module):
        return None
    try:
        model = getattr(value, "model", None)
    except Exception:  # a property that raises
        return None
    return model if isinstance(model, torch.nn.Module) else None


def trainable(value: Any) -> bool:
    """A model or optimizer (torch, Keras), or a trainer by the torch model it holds: what a training
    changes in place."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        return True
    if _held_module(value) is not None:
        return True
    from .checkpoints import keras_state

    return keras_state.kind(value) in ("layer", "optimizer")


def _feed_saved(value: Any, h) -> bool:
    torch = sys.modules.get("torch")
    h.update(f"<{type(value).__qualname__}>".encode())
    module = value if torch is not None and isinstance(value, torch.nn.Module) else _held_module(value)
    if module is not None:  # a model, or a trainer by the model it trains
        for k, t in module.state_dict(keep_vars=True).items():
            h.update(k.encode())
            _feed(t, h, set(), 1)
        return True
    from .checkpoints import keras_state

    if keras_state.kind(value) is not None and hasattr(value, "variables"):
        # a compiled model with its optimizer's (a rate assigned in a plain cell)
        optimizer = getattr(value, "optimizer", None) if keras_state.kind(value) == "layer" else None
        for v in [*value.variables, *getattr(optimizer, "variables", ())]:
            h.update(v.path.encode())
            _variable(v, h)
        return True
    from .checkpoints import pytree

    flat = pytree.flatten(value)  # a flax TrainState, an optax state, an nnx module or optimizer
    if flat is not None:
        for path, leaf in zip(flat["paths"], flat["leaves"]):
            h.update(path.encode())
            _feed(leaf, h, set(), 1)
        return True
    if _kind(value) is None and callable(getattr(value, "state_dict", None)):
        # an optimizer (its rates and moments), a scheduler, a GradScaler: what a checkpoint takes
        return _feed(value.state_dict(), h, set(), 1)
    return _feed(value, h, set(), 0)


def older(recorded: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``recorded`` (a journal's fingerprints) split into those this version takes as it does,
    and the names of those an earlier version took otherwise (it sampled large tensors: compared,
    every one would differ). A pending run begun before an upgrade is resumed by the new version."""
    kept = {n: p for n, p in recorded.items() if p.startswith(SCHEME)}
    return kept, sorted(n for n in recorded if n not in kept)


def older_message(run_id: str, names: list[str]) -> str:
    """The line a resume says of the fingerprints it cannot compare."""
    return (f"colab_resilience: run {run_id} began under an earlier version of colab_resilience, which "
            f"fingerprinted what the run reads otherwise: {_shown(names)} not compared on this resume (a change "
            "a cell that is not replayed made to them since is not seen); Run All compares them again")


def differing(recorded: Mapping[str, str], ns: Mapping[str, Any], *, saved: bool = False) -> list[str]:
    """The recorded names whose values in ``ns`` fingerprint otherwise now (those gone, or no
    longer fingerprinted, are not counted: nothing says the training reads them, or the cell
    makes them)."""
    now = fingerprint(ns, [n for n in recorded if n in ns], saved=saved)
    return [n for n in recorded if n in now and now[n] != recorded[n]]


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _advice(names: list[str], code: Iterable[str], values_advice: str) -> str:
    """What to do about ``names`` changed outside the %%replay cells: ``values_advice`` where none
    is ``code`` (a function or a class of the notebook, defined again: no --save holds code)."""
    code = [n for n in names if n in set(code)]
    values = [n for n in names if n not in code]
    if not code:
        return values_advice
    advice = f"define {', '.join(code)} as you want {'it' if len(code) == 1 else 'them'} in a %%replay cell and run it"
    if values:
        advice += (f" (--save holds values, not code); make the change to {', '.join(values)} there too, or --save "
                   f"{'it' if len(values) == 1 else 'them'}")
    return advice


def changed_message(names: list[str], code: Iterable[str] = ()) -> str:
    """The line a run that begins says of what changed since the set-up cells ran; ``code``: the
    names of them that are the notebook's functions and classes (defined again)."""
    return (f"colab_resilience: {_shown(names)} changed since the %%replay cells ran (in a cell that is not "
            "replayed, or in an earlier run), and the training reads them: a new kernel's replay does not make that "
            "change, and a resume after a restart stops until the cell that made it runs again; "
            + _advice(names, code, "make the change in a %%replay cell and run it, or --save them"))


def lost_message(run_id: str, names: list[str], code: Iterable[str] = ()) -> str:
    """The line that stops a resume whose replay did not make what a cell that is not replayed
    had changed as the run began (said then, :func:`changed_message`)."""
    one = len(names) == 1
    it = "it" if one else "them"
    values = "code" if set(names) <= set(code) else "values"
    return (f"colab_resilience: run {run_id}: {_shown(names)} {'is' if one else 'are'} not what the run began with: a "
            f"cell that is not replayed had changed {it} since the %%replay cells ran (said as the run began), and the "
            f"replay made {it} as the %%replay cells do, so the resumed run would train on other {values}; "
            + restart.run_again("that cell again, then this one",
                                _advice(names, code, f"make the change in a %%replay cell or --save {it}")))


def message(names: list[str]) -> str:
    """The line a resumed run says of what its replay made otherwise."""
    shown = _shown(names)
    return (f"colab_resilience: the replayed set-up cells made {shown} otherwise than the kernel that began this "
            "run had them, and the training reads them (drawn without a seed, a set's order of strings, which "
            "differs from process to process, or changed since by a cell that is not replayed): the resumed run "
            "will not end as the uninterrupted one; seed the draws in the %%replay cell (torch.manual_seed(0), "
            "random_state=0), sort sets (sorted(set(...))), make the change in the %%replay cell, or --save them")


# ------------------------------------------------------------------------------------ the walk


def plain_data(value: Any) -> bool:
    """Whether ``value`` is data that fingerprints the same for the same values, whenever it is
    taken: a list, tuple, dict or set (of tensors, arrays, numbers and strings), or a
    ``TensorDataset``, a ``Subset`` or a ``ConcatDataset`` of those, or a Hugging Face
    ``datasets.Dataset`` (its Arrow table does not change as it is read); not an object of a class
    that may fill a cache as it is read."""
    return _kind(value) in ("container", "dataset", "arrow")


def _kind(value: Any) -> str | None:
    """What the fingerprint takes ``value`` for, or None where it leaves it out."""
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
        return "plain"
    if isinstance(value, (list, tuple, dict, set, frozenset, range)):
        return "container"
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        return "tensor"
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return "array"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(value, jax.Array):
        return "jax"
    # a model the training trains is its checkpoint's (--save, or a framework's callback that
    # restores it): only a frozen one (a teacher, a pretrained backbone) is the set-up cells' alone
    if torch is not None and isinstance(value, torch.nn.Module):
        return None if any(p.requires_grad for p in value.parameters()) else "module"
    from .checkpoints import keras_state
    from .checkpoints.rng import is_generator

    if keras_state.kind(value) is not None:
        return "keras" if keras_state.kind(value) == "layer" and not value.trainable_variables else None
    if is_generator(value):
        return "generator"
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(value, (pd.DataFrame, pd.Series)):
        return "pandas"
    data = sys.modules.get("torch.utils.data")
    if data is not None:
        if isinstance(value, data.DataLoader):
            return "loader"
        if isinstance(value, (data.Subset, data.TensorDataset, data.ConcatDataset)):
            return "dataset"
    arrow = sys.modules.get("datasets.arrow_dataset")  # Hugging Face datasets' (a DatasetDict is a dict of them)
    if arrow is not None and isinstance(value, getattr(arrow, "Dataset", ())):
        return "arrow"
    if is_code(value):
        return "code"
    if isinstance(value, (types.FunctionType, types.ModuleType, type, types.BuiltinFunctionType)):
        return None
    from .checkpoints.restore import notebook_object

    if notebook_object(value):
        return "object"
    return None


def _feed(value: Any, h, seen: set[int], depth: int) -> bool:
    """Feed ``h`` with what ``value`` holds; False where it is left out (see :func:`_kind`)."""
    kind = _kind(value)
    if kind is None or depth > DEPTH:
        return False
    h.update(f"<{type(value).__qualname__}>".encode())
    if kind == "plain":
        h.update(repr(value).encode())
        return True
    if id(value) in seen:
        h.update(b"<seen>")
        return True
    seen.add(id(value))
    if kind == "container":
        if isinstance(value, range):
            h.update(repr(value).encode())
        elif len(value) > ITEMS:
            h.update(_long(value, depth))
        else:
            _feed_items(value, h, seen, depth)
        return True
    if kind == "tensor":
        _tensor(value, h)
    elif kind == "array":
        _array(value, h)
    elif kind == "jax":
        _jax(value, h)
    elif kind == "module":
        for k, t in value.state_dict(keep_vars=True).items():
            h.update(k.encode())
            _feed(t, h, seen, depth + 1)
    elif kind == "keras":
        for v in value.variables:
            h.update(v.path.encode())
            _variable(v, h)
    elif kind == "generator":
        from .checkpoints.rng import generator_state

        _feed(generator_state(value), h, seen, depth + 1)
    elif kind == "pandas":
        _pandas(value, h)
    elif kind == "code":
        _code(value, h, seen, depth)
    elif kind == "loader":  # the data it yields, and how it batches them
        h.update(f"{value.batch_size} {value.drop_last} {type(value.sampler).__qualname__}".encode())
        if not _feed(value.dataset, h, seen, depth + 1):
            h.update(b"<left out>")
    elif kind == "arrow":
        _arrow_dataset(value, h, seen, depth)
    elif kind == "dataset":  # random_split's subsets: their indices; tensors; the parts of a concatenation
        parts = ([value.indices, value.dataset] if hasattr(value, "indices") else
                 list(value.tensors) if hasattr(value, "tensors") else list(value.datasets))
        for part in parts:
            if not _feed(part, h, seen, depth + 1):
                h.update(b"<left out>")
    else:  # an object of the notebook's classes: its attributes
        for k, v in vars(value).items():
            h.update(k.encode())
            if not _feed(v, h, seen, depth + 1):
                h.update(b"<left out>")
    return True


def _time_named(key: Any, value: Any) -> bool:
    from .kernelapi import _is_a_time

    return isinstance(key, str) and _is_a_time(key, value)


def _feed_items(value, h, seen: set[int], depth: int) -> None:
    """A list, tuple, dict or set: its length and its items (at most :data:`ITEMS` of them)."""
    h.update(str(len(value)).encode())
    if isinstance(value, dict):
        for i, (k, v) in enumerate(value.items()):
            if i >= ITEMS:
                break
            _feed(k, h, seen, depth + 1)
            if _time_named(k, v) or not _feed(v, h, seen, depth + 1):
                h.update(b"<left out>")
    elif isinstance(value, (set, frozenset)):  # equal sets, in whatever order they iterate
        import blake3

        items = []
        for i, v in enumerate(value):
            if i >= ITEMS:
                break
            g = blake3.blake3()
            _feed(v, g, seen, depth + 1)
            items.append(g.digest())
        h.update(b"".join(sorted(items)))
    else:
        for i, v in enumerate(value):
            if i >= ITEMS:
                break
            if not _feed(v, h, seen, depth + 1):
                h.update(b"<left out>")


def is_code(value: Any) -> bool:
    """Whether ``value`` is a function or a class the notebook defined (``def``/``class`` in a cell;
    a decorated function by what it wraps): fingerprinted by its code."""
    if isinstance(value, type):
        return value.__module__ == "__main__"
    return isinstance(value, types.FunctionType) and value.__module__ == "__main__"


def _code(value: Any, h, seen: set[int], depth: int) -> None:
    """A function of the notebook: its code (what Python compiled, not where the cell was: the
    file name a kernel gives a cell differs from kernel to kernel), and its defaults; a decorated
    one (``@torch.no_grad()``) with what it wraps. A class of the notebook: its bases and its
    methods' code, and its public attributes of plain data (``steps = 4``; not a cache a library
    keeps on it, ``_something``)."""
    if isinstance(value, type):
        h.update(" ".join(f"{b.__module__}.{b.__qualname__}" for b in value.__bases__).encode())
        for name, attr in sorted(vars(value).items()):
            function = getattr(attr, "__func__", attr)  # a staticmethod's, a classmethod's
            functions = [getattr(attr, k) for k in ("fget", "fset", "fdel")] if isinstance(attr, property) \
                else [function]
            if any(isinstance(f, types.FunctionType) for f in functions):
                h.update(f"{name}:{type(attr).__name__}".encode())
                for f in functions:
                    if isinstance(f, types.FunctionType):
                        _code(f, h, seen, depth + 1)
            elif not name.startswith("_") and _kind(attr) in ("plain", "container"):  # a library's cache is private
                h.update(name.encode())
                _feed(attr, h, seen, depth + 1)
        return
    for _ in range(8):  # the decorators' wrappers down to the notebook's function
        h.update(_code_digest(value.__code__).encode())
        h.update(_closure(value, 3).encode())  # what a decorator's wrapper closes over (no_grad or enable_grad)
        for defaults in (value.__defaults__, value.__kwdefaults__):
            if defaults and not _feed(defaults, h, seen, depth + 1):
                h.update(b"<left out>")
        wrapped = getattr(value, "__wrapped__", None)
        if not isinstance(wrapped, types.FunctionType):
            return
        value = wrapped


def _closure(function: types.FunctionType, depth: int) -> str:
    """What ``function`` closes over, by kind: plain values by their repr, functions by their name
    and what they close over, anything else by its type (an address would differ in every kernel)."""
    def kind(value) -> str:
        if type(value) in _PLAIN:
            return repr(value)
        if isinstance(value, types.FunctionType):
            return f"{value.__module__}.{value.__qualname__}" + (_closure(value, depth - 1) if depth > 0 else "")
        if isinstance(value, type):
            return f"class {value.__module__}.{value.__qualname__}"
        if isinstance(value, types.MethodType):  # torch's no_grad(): its instance's clone
            return f"{kind(value.__func__)} of {kind(value.__self__)}"
        return f"{type(value).__module__}.{type(value).__qualname__}"

    cells = []
    for cell in function.__closure__ or ():
        try:
            cells.append(kind(cell.cell_contents))
        except ValueError:  # a cell not yet filled
            cells.append("<empty>")
    return "[" + ",".join(cells) + "]"


def _code_digest(code: types.CodeType) -> str:
    """What a code object does, not where it was compiled (no file name, no line numbers): its
    bytecode, its constants (nested code, an inner function's or a comprehension's, alike), the
    names it reads and its arguments."""
    def const(k) -> str:
        if isinstance(k, types.CodeType):
            return _code_digest(k)
        if isinstance(k, tuple):
            return "(" + ",".join(map(const, k)) + ")"
        if isinstance(k, frozenset):  # `x in {"a", "b"}`: in an order that depends on the hash seed
            return "{" + ",".join(sorted(map(const, k))) + "}"
        return repr(k) if type(k) in _PLAIN or k is Ellipsis else type(k).__name__

    return repr((code.co_code, [const(k) for k in code.co_consts], code.co_names, code.co_varnames,
                 code.co_freevars, code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                 code.co_kwonlyargcount, code.co_flags & 0xFFFF))  # not the __future__ flags a cell compiled under


def _long(value, depth: int) -> bytes:
    """The digest of a container of more than :data:`ITEMS` items: all of them, at C speed,
    where they are numbers and strings, or rows of them (tuples; dicts whose keys name no time:
    a text dataset's ``(text, label)`` pairs or records); else its length and its first
    :data:`ITEMS` items. Walked on its own (what was seen before it does not count), so that
    :func:`one_moment` keeps it with the container."""
    import blake3

    key = ("container", id(value))
    if _memo is not None and key in _memo:
        return _memo[key][0]
    g = blake3.blake3()
    g.update(str(len(value)).encode())
    if isinstance(value, dict):
        if _plain(value.keys()) and _plain(value.values()):
            _feed_reprs(g, [(k, v) for k, v in value.items() if not _time_named(k, v)])
        else:
            _feed_items(value, g, {id(value)}, depth)
    elif isinstance(value, (set, frozenset)):
        if _plain(value) or _plain_rows(value):  # in any order
            g.update("\n".join(sorted(map(repr, value))).encode())
        else:
            _feed_items(value, g, {id(value)}, depth)
    elif _plain(value) or _plain_rows(value):
        _feed_reprs(g, value)
    else:
        _feed_items(value, g, {id(value)}, depth)
    digest = g.digest()
    if _memo is not None:
        _memo[key] = (digest, value)
    return digest


def _plain_rows(items) -> bool:
    """Whether every item is a tuple of numbers and strings, or every one a dict of them whose
    keys name no time."""
    kinds = set(map(type, items))
    if kinds == {tuple}:
        return all(set(map(type, x)) <= _PLAIN for x in items)
    if kinds == {dict} and all(_plain(x.keys()) and _plain(x.values()) for x in items):
        from .kernelapi import _TIME

        return not any(isinstance(k, str) and _TIME.search(k) for k in set().union(*items))
    return False


def _plain(items) -> bool:
    """Whether every item is a number, a string, bytes or None (C speed)."""
    return set(map(type, items)) <= _PLAIN


def _feed_reprs(h, items) -> None:
    """A long sequence of numbers and strings (or pairs of them), by their reprs, a slice at a time."""
    for i in range(0, len(items), ITEMS):
        h.update(repr(items[i:i + ITEMS]).encode())


def _digest(chunks, of=None, key=None) -> bytes:
    """The BLAKE3 digest of the bytes of the contiguous NumPy arrays ``chunks()`` yields, on all
    cores. Where :func:`one_moment` holds, that of a large tensor or array ``of`` is kept under
    ``key`` (where it lies, its layout and type) with ``of`` itself, whose address no other
    value can then take in the moment."""
    import blake3

    kept = _memo is not None and key is not None and of.nbytes > KEPT
    if kept and key in _memo:
        return _memo[key][0]
    np = sys.modules["numpy"]
    g = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for chunk in chunks():
        g.update(memoryview(chunk.reshape(-1).view(np.uint8)))
    digest = g.digest()
    if kept:
        _memo[key] = (digest, of)
    return digest


def _tensor(t, h) -> None:
    """A torch tensor: its type, shape and layout, and every byte of it."""
    torch = sys.modules["torch"]
    strided = t.layout == torch.strided
    h.update(f"{t.dtype}{tuple(t.shape)}{t.layout}{t.stride() if strided else ''}".encode())
    if not strided or t.is_meta or t.numel() == 0:
        return
    t = t.detach()
    key = ("torch", str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())
    h.update(_digest(lambda: _tensor_chunks(t), t, key))


def _tensor_chunks(t):
    """Its bytes: where they lie, in that order, when it is a host tensor that fills its memory (a
    contiguous one, a transposed one); else in its elements' order, copied to the host a bounded
    slice of its first dimension at a time."""
    torch = sys.modules["torch"]
    t = t.resolve_conj().resolve_neg()
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dim() == 0:
        t = t.reshape(1)
    if not t.is_contiguous():  # a transpose, channels_last: in the order it lies (its strides are in the header)
        lying = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
        t = lying if lying.is_contiguous() else t
    if t.is_contiguous() and t.device.type == "cpu":
        yield t.reshape(-1).view(torch.uint8).numpy()
        return
    for part in _slices(t, t.element_size()):
        yield part.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def _variable(v, h) -> None:
    """A Keras variable: every byte of it, copied to the host a bounded slice at a time."""
    np = sys.modules["numpy"]
    try:
        size, itemsize = int(np.prod(v.shape)), np.dtype(v.dtype).itemsize
    except TypeError:  # a dtype NumPy does not know (bfloat16): whole
        size, itemsize = 0, 0
    if size * itemsize <= CHUNK:
        _array(v.numpy(), h, kept=False)
        return
    ops = sys.modules["keras"].ops
    h.update(f"{v.dtype}{tuple(v.shape)}".encode())
    value = v.value
    h.update(_digest(lambda: (np.ascontiguousarray(ops.convert_to_numpy(part)) for part in _slices(value, itemsize))))


def _jax(a, h) -> None:
    """A JAX array: every byte of it (a large one copied to the host a bounded slice at a time); a
    PRNG key by its data."""
    jax, np = sys.modules["jax"], sys.modules["numpy"]
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    if a.size * a.dtype.itemsize <= CHUNK:
        _array(np.asarray(a), h, kept=False)
        return
    h.update(f"{a.dtype}{a.shape}".encode())
    h.update(_digest(lambda: (np.ascontiguousarray(np.asarray(part)) for part in _slices(a, a.dtype.itemsize))))


def _slices(a, itemsize: int):
    """``a`` (a torch tensor, a NumPy, JAX or Keras array of at least one dimension) a slice of its
    first dimension of at most :data:`CHUNK` bytes at a time (one row where a row is larger), in
    order: no copy of the whole of it is made, on the device or the host."""
    row = itemsize
    for n in a.shape[1:]:
        row *= int(n)
    step = max(1, CHUNK // max(1, row))
    for i in range(0, int(a.shape[0]), step):
        yield a[i:i + step]


def _array(a, h, kept: bool = True) -> None:
    """A NumPy array: its type, shape and layout, and every byte of it (an array of objects: the
    reprs of its first 100,000). ``kept``: a value of the namespace's, not a copy made here."""
    np = sys.modules["numpy"]
    a = np.asarray(a)
    h.update(f"{a.dtype}{a.shape}{a.strides}".encode())
    if a.dtype.hasobject:
        for v in a.reshape(-1)[:ITEMS] if a.flags.c_contiguous else ():
            h.update(repr(v).encode())
        return
    if a.size:
        key = ("numpy", a.__array_interface__["data"][0], a.dtype.str, a.shape, a.strides) if kept else None
        h.update(_digest(lambda: _array_chunks(a), a, key))


def _array_chunks(a):
    np = sys.modules["numpy"]
    if a.ndim == 0:
        a = a.reshape(1)
    if not a.flags.c_contiguous and all(s > 0 for s in a.strides):  # a transpose: in the order it lies
        lying = a.transpose(sorted(range(a.ndim), key=lambda d: -a.strides[d]))
        a = lying if lying.flags.c_contiguous else a
    if a.flags.c_contiguous:
        yield a
        return
    for part in _slices(a, a.itemsize):
        yield np.ascontiguousarray(part)


def _arrow_dataset(value, h, seen: set[int], depth: int) -> None:
    """A Hugging Face ``datasets.Dataset``: its length, features and format (a ``with_transform``'s
    function by its code), and what its rows are made of: every byte of its Arrow table and of the
    index a ``shuffle``, a ``select`` or a split made of it (the rows the training reads are the
    table's, in the index's order), a bounded slice at a time in Arrow's IPC form, which holds only
    the rows a slice shows. Kept by :func:`one_moment` as a long container is."""
    import blake3

    h.update(f"{value.num_rows} {value.features!r}".encode())
    if not _feed(value.format, h, seen, depth + 1):
        h.update(b"<left out>")
    key = ("arrow", id(value))
    if _memo is not None and key in _memo:
        h.update(_memo[key][0])
        return
    g = blake3.blake3(max_threads=blake3.blake3.AUTO)
    indices = value._indices  # (datasets' own; None where no index was made)
    for table in (value.data, indices):
        g.update(b"<none>" if table is None else _arrow_table(table.table))
    digest = g.digest()
    if _memo is not None:
        _memo[key] = (digest, value)
    h.update(digest)


def _arrow_table(table) -> bytes:
    """The BLAKE3 digest of a pyarrow ``Table``: its schema, then its record batches in IPC form, at
    most :data:`CHUNK` bytes of rows at a time (a slice of a table is written without what it does
    not show)."""
    import blake3

    g = blake3.blake3(max_threads=blake3.blake3.AUTO)
    g.update(f"{table.num_rows}".encode())
    g.update(memoryview(table.schema.serialize()))
    step = max(1, CHUNK // max(1, table.nbytes // max(1, table.num_rows)))
    for start in range(0, table.num_rows, step):
        for batch in table.slice(start, step).to_batches():
            g.update(memoryview(batch.serialize()))
    return g.digest()


def _pandas(value, h) -> None:
    """A pandas frame or series: its shape, columns and dtypes, its index, and each column (a
    column of numbers by its bytes, any other by pandas' hash of each value)."""
    np, pd = sys.modules["numpy"], sys.modules["pandas"]
    frame = value.to_frame() if isinstance(value, pd.Series) else value
    h.update(f"{value.shape}{list(frame.columns)!r}{[str(d) for d in frame.dtypes]}".encode())
    index = pd.util.hash_pandas_object(frame.index).to_numpy()
    h.update(_digest(lambda: [np.ascontiguousarray(index)]))
    for i in range(frame.shape[1]):
        column = frame.iloc[:, i]
        numbers = isinstance(column.dtype, np.dtype) and column.dtype.kind in "biufc"
        data = column.to_numpy() if numbers else pd.util.hash_pandas_object(column, index=False).to_numpy()
        h.update(_digest(lambda: [np.ascontiguousarray(data)]))

