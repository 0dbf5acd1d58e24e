"""What a ``%%resilient`` cell's code tells before it runs.

:func:`check_options` refuses options that do not fit the notebook (:class:`OptionError`, shown
as a usage error): a ``--save`` name that nothing defines, a ``--shrink`` variable that is not a
positive integer, that the cell assigns itself, or that ``--save`` also restores (a rollback would
undo the shrink).

:func:`warnings` gives one line for each thing in the code that would make a resumed run differ
from an uninterrupted one, said when the cell first runs in a kernel:

- names the cell reads that neither ``--save`` nor a ``%%replay`` cell would bring back after a
  restart;
- names a ``resume_range`` loop carries from one iteration to the next (``running += loss``,
  ``seen.append(x)``, or a name an iteration reads before it sets it on every path: a best loss
  set under an ``if``) without ``--save``: after a rollback they would not have the values of the
  safe point;
- an iterator made before a ``resume_range`` loop that the loop draws from with ``next()``: no
  checkpoint holds its position;
- in a cell that trains through a framework's loop (a ``ResilienceCallback``), names that its
  callbacks (functions and lambdas defined in the cell) change in place without ``--save``;
- ``--save`` names the code above an inner ``resume_range`` loop reads and the inner loop changes
  (a JAX key): a resume inside the iteration runs that code with the inner safe point's value;
- gradients accumulated across ``resume_range`` iterations (``zero_grad`` called in only some of
  them): a checkpoint does not hold gradients, and a rollback clears them;
- objects a ``resume_range`` loop uses without ``--save`` that hold state a method changes in
  place (a scheduler, an averaged model, a generator): after a rollback they would not be as
  they were at the safe point (those the cell makes above the loop: :func:`at_loop_start`);
- a file a ``resume_range`` loop appends to (a resume writes the rows of the iterations since the
  last safe point again), and the code above the loop that writes it anew (it runs again);
- a ``resume_range`` loop inside a plain ``for`` or ``while`` loop, or wrapped in a call with a
  state of its own (``enumerate(resume_range(loader))``): those start over when the cell runs
  again, while ``resume_range`` goes on at its saved step. (A loop wrapped in a progress bar,
  ``tqdm(resume_range(n))``, is a ``resume_range`` loop for the checks above.)

And one line where the cell trains in a loop with no safe point inside it (:func:`no_safe_point`:
``for epoch in range(n)``, a Keras ``fit`` without ``ResilienceCallback``): nothing differs, but
a restart trains every iteration again, which is not what wrapping the loop in ``%%resilient``
was for; the line says how to write it.

The analysis reads the code (the AST), not the values: it can miss what a helper function does.
``colab-resilience check`` runs the notebook with faults and compares, for what reading cannot see.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import io
import sys
import textwrap
import types
from collections.abc import Collection

from . import replay, words
from .checkpoints import keras_state
from .checkpoints.restore import notebook_object
from .checkpoints.rng import is_generator
from .checkpoints.values import holds_state, saved_by_state
from .errors import OptionError
from .recovery import set_shrink_value, shrink_value

_NONE = object()  # what a --shrink path that leads nowhere reads as
_NOT_STATE = frozenset({"tqdm", "logging", "wandb", "tensorboard", "tensorboardX", "IPython", "ipywidgets",
                        # a plot: a figure, its axes, the lines drawn (the numbers they draw are the result, kept
                        # where the training put them; a figure is numbered and sized by the process)
                        "matplotlib", "seaborn", "plotly", "bokeh", "altair"})
_MUTATORS = frozenset({
    "append", "extend", "insert", "update", "add", "pop", "popitem", "remove", "discard", "clear",
    "setdefault", "sort", "reverse", "appendleft", "extendleft", "rotate",
})


def _parse(shell, source: str) -> ast.AST | None:
    try:
        return ast.parse(shell.transform_cell(source))
    except SyntaxError:
        return None


def bound_names(tree: ast.AST | None, *, arguments: bool = False) -> set[str]:
    """Names a piece of code binds anywhere: assignments, deletions, definitions, imports (and,
    with ``arguments``, function parameters)."""
    names: set[str] = set()
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
        elif arguments and isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def kept_objects(shell, body: str, names: list[str], setup_sources: list[str] | tuple = ()) -> list[str]:
    """The saved ``names`` a rollback or a resume restores into the objects they hold then
    (:func:`.checkpoints.restore.into`), rather than binding new ones: those the cell's
    ``resume_range`` loops do not bind again (``x += ...`` changes a list, an array or a tensor in
    place) and no function of the cell or of its set-up cells (``setup_sources``) declares
    ``global``. What else holds such an object (a logger given the history list, an optimizer
    given a weight tensor made by hand) must see the restored values, as it saw the trained ones;
    a name a loop binds anew may have left its old object with another name (``w0 = w`` above the
    loop), which keeps it."""
    tree = _parse(shell, body)
    if tree is None:
        return []
    codes = [body] + [s.partition("\n")[2] if s.lstrip().startswith("%%") else s for s in setup_sources]
    again = declared_global([_parse(shell, code) for code in codes] + called_functions(shell, tree))
    for loop in _resume_loops(tree):
        augmented = {id(node.target) for node in ast.walk(loop) if isinstance(node, ast.AugAssign)}
        again |= {node.id for node in ast.walk(loop) if isinstance(node, ast.Name) and id(node) not in augmented
                  and isinstance(node.ctx, (ast.Store, ast.Del))}
        again |= bound_names(ast.Module(body=[s for s in ast.walk(loop) if isinstance(
            s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))], type_ignores=[]))
    return [n for n in names if n not in again]


def declared_global(codes: list[ast.AST | None]) -> set[str]:
    """The names the functions in ``codes`` declare ``global``: they bind them in the notebook."""
    return {g for code in codes if code is not None for node in ast.walk(code)
            if isinstance(node, ast.Global) for g in node.names}


def _bound_in(stmts: list[ast.stmt]) -> set[str]:
    """The names ``stmts`` bind (see :func:`bound_names`)."""
    return bound_names(ast.Module(body=stmts, type_ignores=[]))


def _user_variables(shell) -> list[str]:
    """The user's own names (not IPython's ``open``/``In``/``Out``, not ours), for suggestions."""
    hidden = shell.user_ns_hidden
    return [k for k in shell.user_ns if not k.startswith("_") and k not in hidden]


def check_options(shell, names: list[str], shrink, body: str, restorable: Collection[str] = ()) -> None:
    """:class:`OptionError` for a ``--save`` name that nothing defines (nor the checkpoint a
    resume restores, ``restorable``: a list made by a cell that is not replayed comes back from
    it), or a ``--shrink`` variable that is missing, not a positive integer, assigned by the cell
    itself, or also saved."""
    ns = shell.user_ns
    tree = _parse(shell, body)
    assigned = bound_names(tree) | (declared_global(called_functions(shell, tree)) if tree is not None else set())
    for name in names:
        if name not in ns and name not in assigned and name not in restorable:
            raise OptionError(
                f"%%resilient: --save {name}: no variable {name!r} exists and the cell does not "
                f"assign it{words.did_you_mean(name, _user_variables(shell))}; create it in a %%replay cell or in this cell"
            )
    for s in shrink:
        root, _, path = s.name.partition(".")
        if root not in ns:
            ints = [k for k in _user_variables(shell) if type(ns[k]) is int]
            raise OptionError(
                f"%%resilient: --shrink {s.name}: no variable {root!r} exists{words.did_you_mean(root, ints)}; "
                + (f"set it in an earlier cell, e.g. {s.name} = 256" if not path else "make it in a %%replay cell")
            )
        value = shrink_value(ns, s.name, _NONE)
        if value is _NONE:
            raise OptionError(
                f"%%resilient: --shrink {s.name}: {root} ({type(ns[root]).__name__}) has no attribute path {path!r}; "
                "name the attribute that holds the batch size"
            )
        if not isinstance(value, int) or isinstance(value, bool):
            raise OptionError(
                f"%%resilient: --shrink {s.name}: {s.name} is {words.a(type(value).__name__)} "
                f"({value!r:.40}), but --shrink needs an integer such as a batch size"
            )
        if value < 1:
            raise OptionError(f"%%resilient: --shrink {s.name}: {s.name} is {value}; it must be at least 1")
        if path:  # an attribute that refuses to be set (a DataLoader's batch_size) would fail the retry
            try:
                set_shrink_value(ns, s.name, value)  # the value it has: nothing changes
            except Exception as e:
                raise OptionError(
                    f"%%resilient: --shrink {s.name}: it cannot be set ({type(e).__name__}: "
                    f"{' '.join(str(e).split())}); shrink the variable it is made from instead"
                ) from None
        if root in assigned:
            raise OptionError(
                f"%%resilient: --shrink {s.name}: the cell assigns {root}, so every retry "
                f"would undo the shrink; set {root} in an earlier cell instead"
            )
        if root in names:
            raise OptionError(
                f"%%resilient: --shrink {s.name}: --save {root} too would restore the value that ran out "
                f"of memory at every rollback; leave {root} out of --save (the shrunk value is kept anyway)"
            )


def warnings(shell, body: str, saved: list[str], replay_sources: list[str], later: list[str] | None = None,
             shrink: Collection[str] = ()) -> list[str]:
    """One line for each thing in ``body`` that would make a resumed run differ (see above), and
    one where its training has no safe point to resume at (:func:`no_safe_point`; not with
    ``shrink``, the cell's ``--shrink`` names). With ``later``, the names the loop carries that do
    not exist yet go there instead, for :func:`at_loop_start`: the cell makes them above its loop,
    and only then can their values tell a progress bar (``pbar.update(1)``) from a state
    (``seen.append(x)``)."""
    tree = _parse(shell, body)
    if tree is None:
        return []
    lines = []
    lost = names_lost_on_restart(shell, body, saved, replay_sources)
    if lost:
        # an import in the notebook's first cell (`from ... import ResilienceCallback`) is code: it
        # cannot go in --save (a class there is refused)
        code = [n for n in lost if _is_code(shell.user_ns.get(n))]
        values = [n for n in lost if n not in code]
        todo = []
        if code:
            todo.append(f"import or define {', '.join(code)} in a %%replay cell (--save holds values, not code)")
        if values:
            them = _one(values, "it", "them")
            todo.append(f"add {', '.join(values) if code else them} to --save or define {them} in a %%replay cell")
        lines.append(
            f"colab_resilience: this cell reads {', '.join(lost)}, which neither --save nor a "
            f"%%replay cell would bring back after a restart; {'; '.join(todo)}"
        )
    no_safe = None if shrink else no_safe_point(shell, tree, saved)
    if no_safe:
        lines.append(no_safe)
    unbuilt = built_by_no_replay_cell(shell, tree, saved, replay_sources)
    if unbuilt:
        them = _one(unbuilt, "it", "them")
        lines.append(
            f"colab_resilience: --save {', '.join(unbuilt)}: a checkpoint holds the state of "
            f"{', '.join(f'{n} ({words.a(type(shell.user_ns[n]).__name__)})' for n in unbuilt)}, which a resume after a "
            f"restart loads into what a %%replay cell builds, but no %%replay cell builds {them} (a cell that is not "
            f"%%replay did): make {them} in a %%replay cell, or a resume after a restart stops until "
            f"{_one(unbuilt, 'it is', 'they are')} built again"
        )
    methods = called_methods(shell, tree)  # trainer.fit(6): (trainer, fit's code)
    # the cell's code, a train() it calls, a method of the notebook's classes it calls
    codes = [tree] + called_functions(shell, tree) + [definition for _, definition in methods]
    carried = list(dict.fromkeys(n for code in codes for n in carried_names(code, saved, shell.user_ns)))
    parts = saved_parts(tree, saved, shell.user_ns)
    carried = [n for n in carried if n not in parts]
    drawn = set().union(*(drawn_with_next(code) for code in codes))
    iterators = [n for n in carried if n in drawn]
    classes = [n for n in carried if isinstance(shell.user_ns.get(n), type)]
    carried = [n for n in carried if n not in iterators and n not in classes]
    if later is not None:
        later += [n for n in carried if n not in shell.user_ns]
        carried = [n for n in carried if n in shell.user_ns]
    if classes:
        lines.append(
            f"colab_resilience: the resume_range loop changes attributes of the class{_one(classes, '', 'es')} "
            f"{', '.join(classes)}: a checkpoint saves a class by its name, not its "
            f"attributes, so after a rollback or a restart they would not be back at the safe point, and the result "
            f"would differ; keep them in an object of the class ({classes[0].lower()} = {classes[0]}()) and add "
            "that to --save"
        )
    kept_state = [f for code in codes for loop in _resume_loops(code) for f in state_in_functions(loop, shell.user_ns)]
    if kept_state:
        lines.append(
            f"colab_resilience: the resume_range loop calls {', '.join(dict.fromkeys(kept_state))}: no checkpoint "
            "holds what a function keeps between calls, so after a rollback or a restart it would not be back at "
            "the safe point, and the result would differ; keep it in a global the function declares global, and "
            "add that to --save"
        )
    method_names = {definition.name: receiver for receiver, definition in methods}
    for function, local in (pair for code in codes for pair in carried_locals(code)):
        receiver = method_names.get(function)
        advice = (f"keep {_one(local, 'it', 'them')} on the object (self.{local[0]} = ...) and add {receiver} to "
                  "--save" if receiver else
                  f"declare {_one(local, 'it', 'them')} global in {function}() and add {_one(local, 'it', 'them')} "
                  "to --save")
        lines.append(
            f"colab_resilience: the resume_range loop in {function}() carries {', '.join(local)}, "
            f"{_one(local, 'a local', 'locals')} of {function}(), from one iteration to the next: no checkpoint "
            f"can hold a function's locals, so after a rollback or a restart {_one(local, 'it', 'they')} would "
            f"start again from {_one(local, 'its', 'their')} first value{_one(local, '', 's')}, and the result "
            f"would differ; {advice}, or run the loop in the cell"
        )
    for receiver, definition in methods:
        me = definition.args.args[0].arg if definition.args.args else None
        if receiver not in saved and me and any(me in names for _, names in _carried(definition)):
            lines.append(
                f"colab_resilience: the resume_range loop in {definition.name}() changes attributes of {receiver} "
                f"({me}) without --save: after a rollback or a restart they would not be back at the safe point, and "
                f"the result would differ; add {receiver} to --save (it is restored into itself)"
            )
    if iterators:
        lines.append(
            f"colab_resilience: the resume_range loop draws from {', '.join(iterators)} with next(), made before "
            "it: no checkpoint can hold an iterator's position, so after a rollback or a restart it would not be "
            "where it was at the safe point, and the result would differ; iterate with resume_range instead "
            "(for batch in resume_range(loader)), or make the iterator inside the loop"
        )
    if carried:
        lines.append(_carried_line(carried))
    above = read_above_inner(tree, saved, shell.user_ns)
    if above:
        lines.append(
            f"colab_resilience: the code above an inner resume_range loop reads {', '.join(above)}, which the inner "
            f"loop changes: a resume inside the iteration runs that code again with the inner safe point's "
            f"{_one(above, 'value', 'values')}, not the {_one(above, 'one', 'ones')} the iteration began with, and "
            "the result would differ; derive what it draws there from the epoch (jax.random.fold_in(key, epoch)), "
            "or move it into the inner loop"
        )
    by_callbacks = changed_by_callbacks(tree, saved, shell.user_ns)
    if by_callbacks:
        lines.append(
            f"colab_resilience: code the fit calls (a callback) changes {', '.join(by_callbacks)} without --save: "
            f"after a rollback or a restart the fit goes on from its safe point, but {_one(by_callbacks, 'it', 'they')} "
            f"would not be back at it, and the result would differ; add {_one(by_callbacks, 'it', 'them')} to --save"
        )
    stateful = [f for f in unsaved_state_objects(tree, saved, shell.user_ns)
                if f.split(" ", 1)[0] not in carried]  # named above already
    if stateful:
        lines.append(_state_objects_line(stateful))
    reshuffled = reshuffled_datasets(tree, shell.user_ns)
    if reshuffled:
        lines.append(_reshuffled_line(reshuffled))
    persistent = persistent_loaders(tree, shell.user_ns)
    if persistent:
        lines.append(_persistent_line(persistent))
    generators = [f for f in loader_generators(tree, saved, shell.user_ns)
                  if f[1] is None or not any(o.split(" ", 1)[0] == f[1] for o in stateful)]
    if generators:
        lines.append(_loader_generators_line(generators))
    if in_plain_loops(tree):
        lines.append(
            "colab_resilience: a resume_range loop runs inside a plain for or while loop: after a rollback or a "
            "restart the plain loop starts over while resume_range goes on at its saved step, so the result would "
            "differ; make the outer loop a resume_range too (for epoch in resume_range(n))"
        )
    for name in wrapped_resume_ranges(tree):
        lines.append(
            f"colab_resilience: {name}(resume_range(...)) starts over after a rollback or a restart while "
            f"resume_range goes on at its saved step, so what {name} gives would differ; put it inside: "
            f"resume_range({name}(...))"
        )
    for cls, paths in callback_appends(shell, tree):
        lines.append(
            f"colab_resilience: {cls}, which the training calls, appends to {', '.join(paths)}: a checkpoint does not "
            "hold files, so where a fault strikes after it wrote and before the next safe point is on disk, the "
            "resumed training writes those lines again; keep the rows in the callback (its state goes with the "
            "checkpoint) and write the file when the fit ends, or read it knowing rows may repeat"
        )
    appended, written = file_writes(codes, tree)
    if appended:
        lines.append(
            f"colab_resilience: the resume_range loop appends to {', '.join(appended)}: a checkpoint does "
            "not hold files, so a resume writes the lines of the iterations since the last safe point again; "
            "build the rows in a list in --save and write the file after the loop (or read it knowing rows may repeat)"
        )
    if written:
        lines.append(
            f"colab_resilience: the code above the first resume_range loop writes {', '.join(written)}, which the "
            "loop appends to: it runs again on resume, over what the iterations before the fault wrote; write "
            "it in a %%replay cell, or the whole file after the loop"
        )
    for name in accelerate_accumulation(tree, shell.user_ns):
        steps = shell.user_ns[name].gradient_accumulation_steps
        lines.append(
            f"colab_resilience: each resume_range iteration is a micro-batch of {name}.accumulate() "
            f"(gradient_accumulation_steps={steps}): the optimizer steps every {steps} iterations, and the gradients "
            f"and {name}'s count in between cross the safe points; a checkpoint holds neither, so the result would "
            "differ; make each iteration a whole optimizer step: resume_range over the epochs, the loader in a "
            "plain loop"
        )
    if accumulates_gradients(tree):
        lines.append(
            "colab_resilience: gradients accumulate across resume_range iterations (zero_grad is called in "
            "only some of them); a checkpoint does not hold gradients and a rollback clears them, so the "
            "result would differ; make each iteration a whole optimizer step (the micro-batches in an inner "
            "plain loop)"
        )
    return lines


_PROGRESS_BARS = frozenset({"tqdm", "tqdm_notebook", "track"})  # a loop wrapped in one is drawn as it goes
# a framework's fit that resumes at its own safe points with this package's callback, by the module
# its trainer's class comes from: what the line calls it, the call, how to add the callback, where it is
_KERAS = ("Keras", "fit", "add ResilienceCallback() to the fit's callbacks=[...]", "keras")
_LIGHTNING = ("Lightning", "fit", "make the Trainer with callbacks=[ResilienceCallback()]", "lightning")
_FRAMEWORK_FITS = {
    "keras": _KERAS, "tf_keras": _KERAS, "lightning": _LIGHTNING, "pytorch_lightning": _LIGHTNING,
    "transformers": ("Hugging Face", "train", "call {name}.add_callback(ResilienceCallback()) before it",
                     "transformers"),
}


def no_safe_point(shell, tree: ast.AST, saved: list[str]) -> str | None:
    """One line where a ``%%resilient`` cell trains in a loop that has no safe point inside it: a
    plain ``for epoch in range(n)`` of its own or of a notebook function it calls (``fit(10)``), or
    a framework's fit without this package's ``ResilienceCallback``. A restart, and a retry after an
    out-of-memory error, then run the whole cell again from its start: nothing is lost that the
    result needs, but every iteration trains again, which the person who wrapped the loop in
    ``%%resilient`` would not expect. (Not said of a cell with ``--shrink``, by :func:`warnings`: run
    whole again with the smaller batch, its result is that of a run that had it from its start,
    which a plain loop may be there for: the quickstart's.)"""
    from .setup_state import reached_names

    if _uses_a_trainer(tree) or "resume_range" in reached_names(shell, tree):
        return None
    loop = _outer_loop(tree)
    where = ""
    if loop is None:
        for name, definition in _called_definitions(shell, tree):
            loop = _outer_loop(definition)
            if loop is not None:
                where = f" in {name}()"
                break
    if loop is not None and not any(_is_resume_range(n) for n in ast.walk(loop)):
        if isinstance(loop, ast.While):
            header = f"while {ast.unparse(loop.test)}"
            advice = f"write it as a for loop over resume_range{where} (for epoch in resume_range(n))"
        else:
            target = ", ".join(map(ast.unparse, loop.target.elts)) if isinstance(loop.target, ast.Tuple) else (
                ast.unparse(loop.target))  # for x, y in ...: as it is written
            header = f"for {target} in {ast.unparse(loop.iter)}"
            advice = f"loop over resume_range{where}: for {target} in {_resumed(loop.iter)}"
        if not saved:  # resume_range alone keeps no progress: nothing is saved at its safe points
            advice += ", and --save what it trains (the model, the optimizer)"
        return (f"colab_resilience: the loop{where} ({header}) has no safe point inside it: after a restart or an "
                "out-of-memory error the cell runs again from its start, and every iteration runs again; to go on "
                f"after the last finished one, {advice}")
    for name, (framework, call, advice, module) in _fits_without_callback(shell, tree):
        return (f"colab_resilience: {name}.{call}() ({framework}) has no safe point inside it: after a restart or an "
                f"out-of-memory error it trains again from its first epoch; to go on after the last finished one, "
                f"{advice.format(name=name)} (from colab_resilience.integrations.{module} import ResilienceCallback)")
    return None


def _outer_loop(code: ast.AST) -> ast.For | ast.While | None:
    """The largest loop of the code's own (not inside another loop, nor a function or a class it
    defines): the cell's training loop, where another loop sets something up."""
    loops, todo = [], list(ast.iter_child_nodes(code))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            loops.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return max(loops, key=lambda loop: sum(1 for _ in ast.walk(loop)), default=None)


def _resumed(iterable: ast.expr) -> str:
    """``iterable`` written with ``resume_range``: ``range(a, b)`` as ``resume_range(a, b)``, a
    progress bar around it inside it (``tqdm(resume_range(n))``), anything else as its argument."""
    if isinstance(iterable, ast.Call):
        name = iterable.func.attr if isinstance(iterable.func, ast.Attribute) else getattr(iterable.func, "id", "")
        if name == "range":
            return f"resume_range({', '.join(ast.unparse(a) for a in iterable.args)})"
        if name == "trange":
            return f"tqdm(resume_range({', '.join(ast.unparse(a) for a in iterable.args)}))"
        if name in _PROGRESS_BARS and iterable.args:
            rest = [ast.unparse(a) for a in iterable.args[1:]] + [ast.unparse(k) for k in iterable.keywords]
            return f"{ast.unparse(iterable.func)}({', '.join([_resumed(iterable.args[0]), *rest])})"
    return f"resume_range({ast.unparse(iterable)})"


def _called_definitions(shell, tree: ast.AST):
    """``(name, code)`` of the notebook's functions the cell calls by name, and of the methods of
    the notebook's classes it calls on an object it holds (``trainer.fit(6)``)."""
    for receiver, name, function in _cell_calls(shell, tree):
        definition = _definition(function) if function.__module__ == "__main__" else None
        if definition is not None:
            yield (f"{receiver}.{name}" if receiver else name), definition


def _fits_without_callback(shell, tree: ast.AST):
    """``(name, (framework, call, advice, module))`` for each ``name.fit(...)`` / ``name.train()``
    the cell makes on a Keras model, a Hugging Face ``Trainer`` or a Lightning ``Trainer`` (one the
    namespace holds, or one the cell makes: ``trainer = L.Trainer(...)``) that gets no
    ``ResilienceCallback``: in the fit's ``callbacks=``, the trainer's, its ``add_callback(...)``.
    A callback the code names by an expression this cannot read (a name the cell binds) is taken
    to be one: no line rather than a wrong one."""
    ns = shell.user_ns
    made, added = {}, {}  # what the cell makes each name with; what it adds to a trainer's callbacks
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            made.update((t.id, node.value) for t in node.targets if isinstance(t, ast.Name))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_callback"
              and isinstance(node.func.value, ast.Name)):
            added.setdefault(node.func.value.id, []).extend(node.args)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)):
            continue
        name = node.func.value.id
        if name in made:  # made by the cell: its class, and the callbacks it is made with
            cls, callbacks, given = _dotted(made[name].func, ns), [], _keyword(made[name], "callbacks")
        else:
            obj = ns.get(name, _NONE)
            cls, given = type(obj), []
            handler = getattr(obj, "callback_handler", None)  # a Hugging Face Trainer's; a Lightning one's list
            callbacks = list(getattr(handler, "callbacks", None) or getattr(obj, "callbacks", None) or ())
        known = next((_FRAMEWORK_FITS[k.__module__.split(".", 1)[0]] for k in getattr(cls, "__mro__", ())
                      if k.__module__.split(".", 1)[0] in _FRAMEWORK_FITS), None)
        if known is None or known[1] != node.func.attr:
            continue
        given = given + _keyword(node, "callbacks") + added.get(name, [])
        named = [_value_of(element, ns) for element in given]
        if _NONE in named:
            continue
        callbacks += [c for value in named for c in (value if isinstance(value, (list, tuple)) else [value])]
        if not any(type(c).__name__ == "ResilienceCallback" for c in callbacks):
            yield name, known


def _keyword(call: ast.Call, name: str) -> list[ast.expr]:
    """The elements of a call's keyword argument (``callbacks=[a, b]``: a and b; ``callbacks=cbs``: cbs)."""
    value = next((k.value for k in call.keywords if k.arg == name), None)
    if value is None:
        return []
    return list(value.elts) if isinstance(value, (ast.List, ast.Tuple)) else [value]


def _dotted(node: ast.expr, namespace, default=None):
    """What a name or a dotted name (``L.Trainer``) is in the namespace, or ``default``."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id, default)
    if isinstance(node, ast.Attribute):
        outer = _dotted(node.value, namespace, _NONE)
        return default if outer is _NONE else getattr(outer, node.attr, default)
    return default


def _value_of(node: ast.expr, namespace):
    """The value a callback expression stands for: a name the namespace holds; a call the cell makes
    (``EarlyStopping(...)``, not a ``ResilienceCallback``, which the cell would then name) as None;
    ``_NONE`` for what cannot be known before the cell runs."""
    if isinstance(node, ast.Call):
        return None
    return _dotted(node, namespace, _NONE)


def _is_resume_range(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "resume_range"


def _resume_loops(tree: ast.AST) -> list[ast.For]:
    """The loops over ``resume_range(...)``, also where a call wraps it (``tqdm(resume_range(n))``,
    ``enumerate(resume_range(loader))``)."""
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.For) and any(_is_resume_range(c) for c in ast.walk(n.iter))]


_PROGRESS_BARS = {"tqdm", "trange", "tqdm_notebook"}  # wrappers that only show the iterations


def wrapped_resume_ranges(tree: ast.AST) -> list[str]:
    """The calls that wrap ``resume_range`` in a loop's header with a state of their own, which
    starts over when the cell runs again after a rollback or a restart while ``resume_range`` goes
    on at its saved step (``enumerate`` counts from 0 again, ``zip`` draws its other iterable from
    its start); progress bars only show the iterations, and are left out."""
    found: list[str] = []
    for loop in _resume_loops(tree):
        if _is_resume_range(loop.iter) or not isinstance(loop.iter, ast.Call):
            continue
        name = ast.unparse(loop.iter.func)
        if name.rpartition(".")[2] not in _PROGRESS_BARS and name not in found:
            found.append(name)
    return found


def in_plain_loops(tree: ast.AST) -> bool:
    """Whether a ``resume_range`` loop runs inside a plain ``for`` or ``while`` loop (in the same
    function): after a rollback or a restart the plain loop starts over from its first iteration,
    and the position saved holds nothing of it."""
    loops = set(_resume_loops(tree))
    for outer in ast.walk(tree):
        if not isinstance(outer, (ast.For, ast.AsyncFor, ast.While)) or outer in loops:
            continue
        todo = [*outer.body, *outer.orelse]
        while todo:
            node = todo.pop()
            if node in loops:
                return True
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo.extend(ast.iter_child_nodes(node))
    return False


def _walk_body(loop: ast.For):
    for stmt in loop.body:
        yield from ast.walk(stmt)


def _is_code(value: object) -> bool:
    """A module, class or function: what a cell imports or defines, not a value to save."""
    return inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value)


def _one(names: list, one: str, many: str) -> str:
    """``one`` for a single name, else ``many`` (it, them)."""
    return one if len(names) == 1 else many


def _carried_line(carried: list[str]) -> str:
    return (
        f"colab_resilience: the resume_range loop carries {', '.join(carried)} from one iteration to the "
        f"next without --save: after a rollback or a restart "
        f"{_one(carried, 'it would not have its value', 'they would not have their values')} "
        f"at the safe point, and the result would differ; add {_one(carried, 'it', 'them')} to --save"
    )


def _state_objects_line(stateful: list[str]) -> str:
    return (
        f"colab_resilience: the resume_range loop uses {', '.join(stateful)} without --save: a state it "
        "changes in place (a step count, averaged weights, a generator's) would not be back at the safe point "
        f"after a rollback or a restart, and the result would differ; add {_one(stateful, 'it', 'them')}"
        " to --save (or ignore this for one the loop only reads)"
    )


def at_loop_start(shell, body: str, saved: list[str], known: set[str], later: list[str] = ()) -> list[str]:
    """What :func:`warnings` can tell only once the cell's code above its first loop has run: the
    objects with a state that the cell made there (``sched = OneCycleLR(...)``; not one of
    ``known``, the names there were when the cell began) and the loop uses without ``--save``.
    The cell makes them afresh after a restart, at their first step, while the model and the
    optimizer come back at the safe point's. And of the names the loop carries that did not exist
    when the cell began (``later``), those that are training state: not a progress bar, a
    display handle, a logger (what :func:`_is_state` says) made above the loop."""
    tree = _parse(shell, body)
    if tree is None:
        return []
    ns = shell.user_ns
    carried = [n for n in later if n not in ns or _is_state(ns[n])]
    stateful = [f for f in unsaved_state_objects(tree, saved, ns) if f.split(" ", 1)[0] not in known]
    reshuffled = [n for n in reshuffled_datasets(tree, ns) if n not in known]
    persistent = [n for n in persistent_loaders(tree, ns) if n not in known]
    return (([_carried_line(carried)] if carried else []) + ([_state_objects_line(stateful)] if stateful else [])
            + ([_reshuffled_line(reshuffled)] if reshuffled else []) + ([_persistent_line(persistent)] if persistent else []))


def _is_state(value) -> bool:
    """Whether a value can be training state (not a module, a file, a progress bar or a logger,
    nor a tuple of functions: an optax transformation, whose ``update`` changes nothing)."""
    if isinstance(value, (types.ModuleType, io.IOBase)):
        return False
    if isinstance(value, tuple) and value and all(callable(v) for v in value):
        return False
    return not shows_only(value)


def shows_only(value) -> bool:
    """Whether a value is a progress bar, a display handle, a widget, a logger or an experiment
    tracker's, a plot: something that shows or records the training, and no part of its result. So
    is a list, a tuple or a NumPy array of such (``fig, axes = plt.subplots(1, 2)``; the lines
    ``ax.plot`` returns)."""
    if type(value).__module__.split(".")[0] in _NOT_STATE:
        return True
    np = sys.modules.get("numpy")
    if isinstance(value, (list, tuple)) or (np is not None and isinstance(value, np.ndarray) and value.dtype == object):
        items = list(value.flat) if not isinstance(value, (list, tuple)) else value
        return 0 < len(items) <= 1000 and all(type(v).__module__.split(".")[0] in _NOT_STATE for v in items)
    return False


def _carried(tree: ast.AST):
    """For each ``resume_range`` loop: the function it runs in (None: the cell's own code), and the
    names it changes from one iteration to the next (augmented or self-referencing assignments,
    in-place container methods and functions, item and attribute assignments, ``next()``) that its
    iterations do not bind afresh, or reads before it sets them for sure."""
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for loop in _resume_loops(tree):
        function = parents.get(id(loop))
        while function is not None and not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = parents.get(id(function))
        fresh = bound_names(loop.target)
        changed: list[str] = []
        for node in _walk_body(loop):
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                changed.append(node.target.id)
            elif isinstance(node, ast.AugAssign) and _root(node.target):  # stats["train"]["steps"] += 1
                changed.append(_root(node.target))
            elif isinstance(node, ast.Assign):
                reads = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        (changed.append if target.id in reads else fresh.add)(target.id)
                    elif isinstance(target, (ast.Subscript, ast.Attribute)) and _root(target):  # df.loc[i] = ...
                        changed.append(_root(target))
                    else:
                        fresh |= bound_names(target)
            elif isinstance(node, (ast.For, ast.With, ast.comprehension)) and node is not loop:
                for t in ([node.target] if isinstance(node, (ast.For, ast.comprehension))
                          else [i.optional_vars for i in node.items if i.optional_vars is not None]):
                    fresh |= bound_names(t)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and _changes_in_place(node.func.attr) and _root(_receiver(node.func))):
                changed.append(_root(_receiver(node.func)))  # log["lr"].append(lr), meter.vals.append(v)
            elif _next_of(node):
                changed.append(_next_of(node))
            elif _changed_argument(node):
                changed.append(_changed_argument(node))
        # read in an iteration before it is set for sure in it (best = loss under an if, after
        # `if loss < best`): the value read is the last iteration's
        early = _read_before_set(loop.body, _bound_in(loop.body),
                                 bound_names(loop.target))
        yield function, [n for n in dict.fromkeys(changed + early) if n not in fresh or n in early]


def _root(node: ast.AST) -> str | None:
    """The name a chain of attributes and items starts at (``stats`` in ``stats["a"]["b"]``,
    ``df`` in ``df.loc[i]``), or the name itself."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _locals_of(function: ast.AST | None) -> set[str]:
    """The local names of ``function`` (its parameters and what it binds, but what it declares
    ``global``); none for the cell's own code."""
    if function is None:
        return set()
    declared = {g for node in ast.walk(function) if isinstance(node, ast.Global) for g in node.names}
    return (bound_names(ast.Module(body=function.body, type_ignores=[]))
            | {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}) - declared


def _notebook_calls(loop: ast.For, namespace):
    """``(name, function, code)`` for each call in the loop's body of a function, by its name,
    that the notebook defined (a cell's ``def``), whose source can be read."""
    for node in _walk_body(loop):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        function = namespace.get(node.func.id)
        if not isinstance(function, types.FunctionType) or function.__globals__ is not namespace:
            continue
        definition = _definition(function)
        if definition is not None:
            yield node.func.id, function, definition


def _changed_by_helpers(loop: ast.For, namespace) -> list[str]:
    """The names of the notebook that the functions the loop calls by name, defined in the
    notebook, change: what they declare ``global`` and bind (``global step; step += 1``), and what
    they change in place that is not their own (``history.append(loss)``)."""
    found: list[str] = []
    for _, _, definition in _notebook_calls(loop, namespace):
        own = _locals_of(definition)
        declared = declared_global([definition])
        for inner in ast.walk(definition):
            if isinstance(inner, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                names = [_root(t) for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))]
                names += [n for t in targets for n in bound_names(t) if n in declared]
            elif isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) \
                    and _changes_in_place(inner.func.attr):
                names = [_root(_receiver(inner.func))]
            else:
                names = [_changed_argument(inner) or _next_of(inner)]
            found += [n for n in names if n and n not in own and n in namespace and n not in found]
    return found


def saved_parts(tree: ast.AST, saved: list[str], namespace) -> set[str]:
    """The names the cell binds, above its loops, to an item of a saved dict or list, or to an
    attribute of a saved object of the notebook's classes (``losses = metrics["loss"]``), where
    neither name is bound again in a ``resume_range`` loop: a restore puts the saved contents into
    that dict, list or object and what it holds (:func:`.checkpoints.restore.into`), so the name
    holds the restored part, and changing it changes a saved value."""
    loops = _resume_loops(tree)
    again = {n.id for loop in loops for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    inside = {id(n) for loop in loops for n in ast.walk(loop)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and id(node) not in inside and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, (ast.Subscript, ast.Attribute))):
            continue
        root = _root(node.value)
        chain, plain = node.value, True
        while isinstance(chain, (ast.Subscript, ast.Attribute)):
            plain = plain and (isinstance(chain, ast.Attribute) or isinstance(chain.slice, ast.Constant))
            chain = chain.value
        value = namespace.get(root)
        if (plain and root in saved and root not in again and node.targets[0].id not in again
                and (isinstance(value, (dict, list)) or notebook_object(value))):
            found.add(node.targets[0].id)
    return found


def state_in_functions(loop: ast.For, namespace) -> list[str]:
    """``name() keeps x (...)`` for each function of the notebook the loop calls by name that
    keeps a state of its own between calls: a variable of the function that made it, which it
    rebinds (``nonlocal n; n += 1``: a counter made by a factory), or a default argument that it
    changes in place (``def log(v, hist=[]): hist.append(v)``)."""
    found: list[str] = []
    for name, function, definition in _notebook_calls(loop, namespace):
        kept = [f"{n} (nonlocal)" for inner in ast.walk(definition) if isinstance(inner, ast.Nonlocal)
                for n in inner.names]
        args = definition.args
        positional = args.posonlyargs + args.args
        defaults = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]],
                            function.__defaults__ or ()))
        defaults.update(function.__kwdefaults__ or {})
        mutable = {n for n, v in defaults.items() if isinstance(v, (list, dict, set, bytearray))
                   or type(v).__module__.split(".")[0] in ("collections", "numpy", "torch")}
        for inner in sorted(ast.walk(definition), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            changed = None
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and _changes_in_place(inner.func.attr):
                changed = _root(_receiver(inner.func))
            elif isinstance(inner, (ast.Assign, ast.AugAssign)):
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                changed = next((_root(t) for t in targets if isinstance(t, (ast.Subscript, ast.Attribute))), None)
                if changed is None and isinstance(inner, ast.AugAssign) and isinstance(inner.target, ast.Name):
                    changed = inner.target.id  # hist += [v] extends the default list in place
            if changed in mutable:
                kept.append(f"{changed} (a default argument it changes)")
        if kept:
            text = f"{name}(), which keeps {', '.join(dict.fromkeys(kept))}"
            if text not in found:
                found.append(text)
    return found


def carried_names(tree: ast.AST, saved: list[str], namespace=None) -> list[str]:
    """The names of the notebook a ``resume_range`` loop carries from one iteration to the next
    (:func:`_carried`; not a function's locals), also through the functions of the notebook it
    calls (:func:`_changed_by_helpers`), that ``--save`` does not save. With ``namespace``, names
    bound to something that is not training state are left out."""
    found: list[str] = []
    helpers = [] if namespace is None else [n for loop in _resume_loops(tree)
                                            for n in _changed_by_helpers(loop, namespace)]
    for function, names in [*_carried(tree), (None, helpers)]:
        local = _locals_of(function)
        for name in names:
            if name in local or name in saved or name in found:
                continue
            if namespace is not None and name in namespace and not _is_state(namespace[name]):
                continue
            found.append(name)
    return found


def carried_locals(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """``(function, names)`` for each ``resume_range`` loop inside a function that carries the
    function's own locals from one iteration to the next: no checkpoint can hold them."""
    found = []
    for function, names in _carried(tree):
        # a parameter holds what the caller passed (self, a history list): saved, if at all, by its name there
        passed = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)} if function is not None else set()
        local = [n for n in names if n in _locals_of(function) and n not in passed]
        if local:
            found.append((function.name, local))
    return found


def _cell_calls(shell, tree: ast.AST):
    """``(receiver, name, function)`` for each call the cell makes, once each: of a function by its
    name (not one the cell binds; ``receiver`` None), and of a method of a class the notebook
    defines on an object it holds (``trainer.fit(6)``: ``receiver`` "trainer", ``name`` "fit")."""
    mine, seen = bound_names(tree), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id not in mine:
            key = (None, node.func.id)
            function = shell.user_ns.get(node.func.id)
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            key = (node.func.value.id, node.func.attr)
            obj = shell.user_ns.get(node.func.value.id)
            function = getattr(type(obj), node.func.attr, None) if notebook_object(obj) else None
        else:
            continue
        if key not in seen and isinstance(function, types.FunctionType):
            seen.add(key)
            yield (*key, function)


def called_functions(shell, tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The code of the functions the cell calls by name that earlier cells defined and that run a
    ``resume_range`` loop: their loops' safe points are the cell's (``train(model, epochs)``)."""
    return [d for receiver, _, f in _cell_calls(shell, tree) if receiver is None
            and "resume_range" in f.__code__.co_names and (d := _definition(f)) is not None]


def called_methods(shell, tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """``(name, code)`` for each method of a class the notebook defines that the cell calls on an
    object it holds (``trainer.fit(6)``) and that runs a ``resume_range`` loop."""
    return [(receiver, d) for receiver, _, f in _cell_calls(shell, tree) if receiver is not None
            and "resume_range" in f.__code__.co_names and (d := _definition(f)) is not None]


def callback_appends(shell, tree: ast.AST) -> list[tuple[str, list[str]]]:
    """In a cell that trains through a framework's loop: the notebook's own classes (a callback)
    whose objects the cell makes or names, with the files their methods append to, as the code
    names them (``open("epochs.txt", "a")``). The fit calls them at each epoch or step."""
    if not _uses_a_trainer(tree):
        return []
    ns = shell.user_ns
    classes: list[type] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ns:
            value = ns[node.id]
            cls = value if isinstance(value, type) else type(value)
            if cls.__module__ == "__main__" and cls not in classes:
                classes.append(cls)
    found = []
    for cls in classes:
        paths: list[str] = []
        for klass in cls.__mro__:
            if klass.__module__ != "__main__":
                continue
            for function in vars(klass).values():
                definition = _definition(function) if isinstance(function, types.FunctionType) else None
                for node in ast.walk(definition) if definition is not None else ():
                    if _file_write(node) == "a" and _shown_path(node) not in paths:
                        paths.append(_shown_path(node))
        if paths:
            found.append((cls.__name__, paths))
    return found


def _definition(function) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The parsed ``def`` of a function (from its source, which IPython keeps for a cell's), or None."""
    try:
        code = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    first = code.body[0] if code.body else None
    return first if isinstance(first, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _uses_a_trainer(tree: ast.AST) -> bool:
    """Whether the cell trains through a framework's loop that resumes at its own safe points: it
    names a ``ResilienceCallback`` (Keras, Hugging Face, Lightning)."""
    return any((isinstance(n, ast.Name) and n.id == "ResilienceCallback")
               or (isinstance(n, ast.Attribute) and n.attr == "ResilienceCallback")
               or (isinstance(n, ast.alias) and n.name == "ResilienceCallback") for n in ast.walk(tree))


def changed_by_callbacks(tree: ast.AST, saved: list[str], namespace=None) -> list[str]:
    """Names that functions and lambdas defined in a cell that trains through a framework's loop
    change in place (``lambda epoch, logs: losses.append(logs["loss"])``, a callback's method),
    that are not theirs (nor a function's around them) and that ``--save`` does not save. The
    framework calls them at each epoch or step and goes on from its own safe point after a
    rollback or a restart; what they changed outside it is not put back."""
    if not _uses_a_trainer(tree):
        return []
    found: set[str] = set()
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

    def scope(node: ast.AST):  # the nodes of a function's own code, not of functions inside it
        for child in ast.iter_child_nodes(node):
            yield child
            if not isinstance(child, (*functions, ast.ClassDef)):
                yield from scope(child)

    def visit(node: ast.AST, outer: set[str]) -> None:
        for fn in scope(node):
            if isinstance(fn, ast.ClassDef):
                visit(fn, outer)
            if not isinstance(fn, functions):
                continue
            body = fn.body if isinstance(fn.body, list) else [ast.Expr(fn.body)]
            nodes = list(scope(fn))
            declared = {n for x in nodes if isinstance(x, (ast.Global, ast.Nonlocal)) for n in x.names}
            own = (outer | bound_names(fn.args, arguments=True) | _bound_in(body)) - declared
            for x in nodes:
                for name in _changed_in_place(x, declared):
                    if name not in own and name not in saved and not (
                            namespace is not None and name in namespace and not _is_state(namespace[name])):
                        found.add(name)
            visit(fn, own)

    visit(tree, set())
    return sorted(found)


def _changed_in_place(node: ast.AST, declared: set[str]) -> list[str]:
    """The names ``node`` changes in place (a container method, an item or an attribute set), or
    rebinds where they are declared ``global`` or ``nonlocal``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
            and isinstance(node.func.value, ast.Name)):
        return [node.func.value.id]
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [t.value.id if isinstance(t, (ast.Subscript, ast.Attribute)) else t.id for t in targets
                if (isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name))
                or (isinstance(t, ast.Name) and t.id in declared)]
    return []


def read_above_inner(tree: ast.AST, saved: list[str], namespace=None) -> list[str]:
    """``--save`` names that the code of an outer ``resume_range`` iteration reads above its inner
    ``resume_range`` loop, and that the inner loop changes (rebinds or changes in place: a JAX key
    split there). A resume inside the iteration runs that code again with the inner safe point's
    value, not the one the iteration began with. Changing such a name in place there
    (``log["lr"].append(lr)``) is no read: the safe point's contents are put back when the inner
    loop resumes; nor is drawing from a saved random number generator: its state when the
    iteration began goes with the checkpoint, as the global random states do."""
    found: list[str] = []
    loops = set(_resume_loops(tree))
    for outer in loops:
        for k, stmt in enumerate(outer.body):
            inner = [n for n in ast.walk(stmt) if n in loops]
            if not inner:
                continue
            changed = _bound_in(inner[0].body) | {
                name for node in _walk_body(inner[0]) for name in _changed_in_place(node, set())} | {
                n.id for node in _walk_body(inner[0]) if isinstance(node, ast.Call) and _changes_in_place(
                    getattr(node.func, "attr", "")) for n in [_receiver(node.func)] if isinstance(n, ast.Name)}
            for above in outer.body[:k]:
                for name in _reads_not_changing(above, namespace):
                    if name in saved and name in changed and name not in found and not (
                            namespace is not None and is_generator(namespace.get(name))):
                        found.append(name)
            break
    return found


def _reads_not_changing(stmt: ast.stmt, namespace=None) -> list[str]:
    """The names ``stmt`` reads, but for the receiver of a statement that only changes it in place
    (``log["lr"].append(lr)``, ``counts[k] += 1``), or only calls a method of it (a metric's
    ``mse.reset()``, ``model.quality.reset()``, ``metrics["mae"].reset()``): a resume inside the
    iteration puts the saved objects back whole after that code ran (the modules, optimizers and
    metrics by their state, containers and notebook objects into themselves). Not a random number
    generator's method: its every call draws."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute):
        receiver = stmt.value.func.value
        while isinstance(receiver, (ast.Subscript, ast.Attribute)):
            receiver = receiver.value
        # a method of an object of the notebook (not of a generator: it draws), or one changing it
        of_object = (isinstance(receiver, ast.Name) and namespace is not None and receiver.id in namespace
                     and not is_generator(namespace[receiver.id]))
        if isinstance(receiver, ast.Name) and (of_object or _changes_in_place(stmt.value.func.attr)):
            return [n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                    and n is not receiver]
    return [n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]


def _changes_in_place(method: str) -> bool:
    """A container's method that changes it (``append``), or a tensor's in-place one (``mul_``)."""
    return method in _MUTATORS or (method.endswith("_") and not method.startswith("_"))


def _receiver(func: ast.Attribute) -> ast.AST:
    """What a chain of calls of in-place methods changes: ``smooth`` in ``smooth.mul_(0.9).add_(x)``."""
    node = func.value
    while (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
           and _changes_in_place(node.func.attr)):
        node = node.func.value
    return node


_CHANGE_FIRST_ARGUMENT = frozenset({
    "shuffle", "heapify", "heappush", "heappop", "heappushpop", "heapreplace", "insort", "insort_left",
    "insort_right", "copyto",
})


def _changed_argument(node: ast.AST) -> str | None:
    """The name a function call changes in place as its first argument: ``random.shuffle(data)``,
    ``rng.shuffle(idx)``, ``heapq.heappush(queue, x)``, ``np.copyto(a, b)``, an in-place function
    such as ``torch.nn.init.zeros_(w)``."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in _CHANGE_FIRST_ARGUMENT or (name.endswith("_") and not name.startswith("_") and name != "clip_grad_norm_"
                                          and name != "clip_grad_value_"):
        return node.args[0].id
    return None


def _next_of(node: ast.AST) -> str | None:
    """The name ``next(name)`` or ``next(name, default)`` draws from."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next"
            and node.args and isinstance(node.args[0], ast.Name)):
        return node.args[0].id
    return None


def drawn_with_next(tree: ast.AST) -> set[str]:
    """Names a ``resume_range`` loop calls ``next()`` on: iterators, whose position no checkpoint
    can hold."""
    return {name for loop in _resume_loops(tree) for node in _walk_body(loop) if (name := _next_of(node))}


def unsaved_state_objects(tree: ast.AST, saved: list[str], namespace) -> list[str]:
    """``name (type)`` for each object a ``resume_range`` loop's body uses (not one its iterations
    bind afresh, not one ``--save`` saves) that holds training state a method may change in place:
    one with a ``state_dict`` (a scheduler, a second model, a ``GradScaler``; a module without
    parameters or buffers, as a loss function, has none), or a random number generator."""
    found: list[str] = []
    # a part of a saved model (its backbone, a Keras model's layers) is saved with it, and so is what a
    # saved list, tuple or dict holds (models = {"main": model}; restored in place: `model` sees it)
    parts = _saved_parts([namespace[n] for n in saved if n in namespace])
    kept = frozenset(id(namespace[n]) for n in saved if n in namespace)  # a history list a logger appends to
    for loop in _resume_loops(tree):
        fresh = bound_names(loop.target) | _bound_in(loop.body)
        for node in _walk_body(loop):
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)):
                continue
            name = node.id
            if (name in fresh or name in saved or name not in namespace or id(namespace[name]) in parts
                    or any(f.startswith(name + " ") for f in found)):
                continue
            if holds_state(namespace[name]) or changes_itself(namespace[name], kept):
                found.append(f"{name} ({type(namespace[name]).__name__})")
    return found


def reshuffles(dataset) -> bool:
    """Whether a ``tf.data`` pipeline holds a shuffle that reshuffles on each iteration."""
    seen, todo = set(), [dataset]
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        if type(d).__name__.lstrip("_") == "ShuffleDataset" and getattr(d, "_reshuffle_each_iteration", True):
            return True
        try:
            todo.extend(d._inputs())
        except (AttributeError, NotImplementedError, TypeError):  # not a tf.data dataset of its own
            continue
    return False


def reshuffled_datasets(tree: ast.AST, namespace) -> list[str]:
    """The ``tf.data`` datasets a ``resume_range`` loop's body uses that shuffle anew each time
    they are iterated: each epoch's order follows from how many times it was iterated before, which
    no checkpoint holds, so a resumed run draws the first epoch's order again."""
    data = sys.modules.get("tensorflow.python.data.ops.dataset_ops")
    if data is None:
        return []
    return [n for n in _used_by_loops(tree) if isinstance(namespace.get(n), data.DatasetV2) and reshuffles(namespace[n])]


def persistent_loaders(tree: ast.AST, namespace) -> list[str]:
    """The torch ``DataLoader``s a ``resume_range`` loop's body uses whose worker processes outlive
    an epoch (``persistent_workers=True``): each worker's random state (an augmentation's) goes on
    from epoch to epoch in its process, where no checkpoint reaches it."""
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return []
    return [n for n in _used_by_loops(tree) if isinstance(namespace.get(n), data.DataLoader)
            and getattr(namespace[n], "persistent_workers", False) and getattr(namespace[n], "num_workers", 0) > 0]


def loader_generators(tree: ast.AST, saved: list[str], namespace) -> list[tuple[str, str | None, str]]:
    """The torch ``DataLoader``s a ``resume_range`` loop's body uses whose order is drawn from a
    generator of their own (``DataLoader(..., generator=g)``, a sampler's) that ``--save`` does not
    hold: ``(loader, the name holding the generator or None, its type)``. Each epoch's order follows
    from the epochs before it; after a rollback or a restart the generator is not where it was."""
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return []
    found = []
    for n in _used_by_loops(tree):
        loader = namespace.get(n)
        loader = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard wraps one
        if not isinstance(loader, data.DataLoader):
            continue
        sampler = getattr(loader, "sampler", None)
        inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        for gen in (getattr(loader, "generator", None), getattr(sampler, "generator", None),
                    getattr(inner, "generator", None)):
            if gen is None or not is_generator(gen):
                continue
            holders = [k for k, v in namespace.items() if v is gen and isinstance(k, str) and not k.startswith("_")]
            if not any(k in saved for k in holders):
                found.append((n, holders[0] if holders else None, type(gen).__name__))
            break
    return found


def accelerate_accumulation(tree: ast.AST, namespace) -> list[str]:
    """Accelerators whose ``accumulate()`` a ``resume_range`` loop enters in its own body (each
    iteration a micro-batch) with ``gradient_accumulation_steps`` above 1: its ``opt.step()`` and
    ``zero_grad()`` act only every that many iterations, the gradients of the others are carried
    across safe points, and so is the accelerator's count of micro-batches."""
    found = []
    for loop in _resume_loops(tree):
        for stmt in loop.body:
            for node in ast.walk(stmt):
                if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                    break  # a window within the iteration
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "accumulate" and isinstance(node.func.value, ast.Name):
                    acc = namespace.get(node.func.value.id)
                    steps = getattr(acc, "gradient_accumulation_steps", None)
                    if isinstance(steps, int) and steps > 1 and node.func.value.id not in found:
                        found.append(node.func.value.id)
    return found


def _loader_generators_line(found: list[tuple[str, str | None, str]]) -> str:
    named = list(dict.fromkeys(g for _, g, _ in found if g))
    each = ", ".join(f"{n} (its order drawn from {g})" if g else f"{n} (its order drawn from {words.a(t)} no variable holds)"
                     for n, g, t in found)
    advice = [f"add {', '.join(named)} to --save"] if named else []
    if len(named) < len(found):
        advice.append("bind the generator to a name (g = torch.Generator().manual_seed(0); DataLoader(..., "
                      "generator=g)) and add it to --save")
    return (
        f"colab_resilience: the resume_range loop iterates {each}, a generator --save leaves out: each epoch's "
        "order follows from the epochs before it, and after a rollback or a restart the generator would not be "
        f"back at the safe point, so the order, and the result, would differ; {' and '.join(advice)}"
    )


def _persistent_line(names: list[str]) -> str:
    return (
        f"colab_resilience: the resume_range loop draws from {', '.join(names)}, "
        f"{_one(names, 'a DataLoader', 'DataLoaders')} with persistent_workers=True: {_one(names, 'its', 'their')} "
        "worker processes keep their random state from epoch to epoch, where no checkpoint reaches it, so after a "
        "rollback or a restart random augmentations in the dataset would draw other numbers, and the result would "
        "differ; pass persistent_workers=False (the workers are then seeded anew from the restored state each epoch)"
    )


def _used_by_loops(tree: ast.AST) -> list[str]:
    """The names the bodies of the ``resume_range`` loops read that their iterations do not bind."""
    found: list[str] = []
    for loop in _resume_loops(tree):
        fresh = bound_names(loop.target) | _bound_in(loop.body)
        for node in [*ast.walk(loop.iter), *_walk_body(loop)]:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in fresh \
                    and node.id not in found:
                found.append(node.id)
    return found


def _reshuffled_line(names: list[str]) -> str:
    return (
        f"colab_resilience: the resume_range loop iterates {', '.join(names)}, {_one(names, 'a tf.data dataset', 'tf.data datasets')} "
        f"that shuffle{_one(names, 's', '')} anew each time {_one(names, 'it is', 'they are')} iterated "
        "(reshuffle_each_iteration=True, the default): after a rollback or a restart the epoch it resumes would "
        "draw another order than it did (in a new kernel, the first epoch's), and the result would differ; shuffle "
        "with a seed from the epoch (for x, y in ds.shuffle(n, seed=epoch)), or pass reshuffle_each_iteration=False"
    )


def _saved_parts(values: list, budget: int = 10_000) -> set[int]:
    """The ids of ``values``, of the models' parts (:func:`_parts`), and of what the lists, tuples
    and dicts among them hold, through nested ones: at most ``budget`` objects are looked at (a
    saved history of a million floats is not walked to its end)."""
    ids: set[int] = set()
    todo = list(values)
    while todo and budget > 0:
        value = todo.pop()
        budget -= 1
        if id(value) in ids:
            continue
        ids.add(id(value))
        if isinstance(value, (list, tuple)):
            todo.extend(value)
        elif isinstance(value, dict):
            todo.extend(value.values())
        else:
            ids.update(id(m) for m in _parts(value))
    return ids


def _parts(value) -> list:
    """The modules of a torch module, the layers of a Keras model (itself among them), else none."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.nn.Module):
        return list(value.modules())
    flatten = getattr(value, "_flatten_layers", None) if keras_state.kind(value) == "layer" else None
    return list(flatten()) if callable(flatten) else []


def changes_itself(value, saved_objects: frozenset = frozenset()) -> bool:
    """Whether ``value`` is an object of a class the notebook defines whose methods, past
    ``__init__``, change its own attributes (``self.counter += 1``, ``self.best = val``,
    ``self.seen.append(x)``): an early stopping, a meter, a trainer of one's own. An attribute that
    holds one of ``saved_objects`` (ids: a list saved under its own name) and is only changed in
    place is saved with that name, and not counted."""
    cls = type(value)
    if cls.__module__ != "__main__" or not isinstance(getattr(value, "__dict__", None), dict):
        return False
    for klass in cls.__mro__[:-1]:
        for attr, method in vars(klass).items():
            if attr == "__init__" or not isinstance(method, types.FunctionType):
                continue
            function = _definition(method)
            if function is None or not function.args.args:
                continue
            for name, rebound in _attributes_changed(function, function.args.args[0].arg):
                if rebound or id(vars(value).get(name)) not in saved_objects:
                    return True
    return False


def _attributes_changed(function: ast.AST, me: str) -> list[tuple[str, bool]]:
    """The attributes of ``me`` (a method's ``self``) that ``function`` changes: ``(name, True)``
    where it sets ``me.name`` itself, ``(name, False)`` where it changes what ``me.name`` holds in
    place (``self.seen.append(x)``, ``self.stats["n"] += 1``)."""
    def attribute(node: ast.AST) -> tuple[str, bool] | None:
        chain = node
        while isinstance(chain, (ast.Attribute, ast.Subscript)):
            if isinstance(chain, ast.Attribute) and isinstance(chain.value, ast.Name) and chain.value.id == me:
                return chain.attr, chain is node
            chain = chain.value
        return None

    found = []
    for node in ast.walk(function):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                found += [a for t in ast.walk(target) if isinstance(t, (ast.Attribute, ast.Subscript))
                          and isinstance(t.ctx, ast.Store) and (a := attribute(t))]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _changes_in_place(node.func.attr):
            if (a := attribute(node.func.value)) is not None:
                found.append((a[0], False))
    return found


def _loads(node: ast.AST) -> list[str]:
    """The names ``node`` reads, not within a function, a lambda or a class it defines, nor a
    comprehension's own variables."""
    if isinstance(node, ast.Name):
        return [node.id] if isinstance(node.ctx, ast.Load) else []
    found = [name for child in ast.iter_child_nodes(node)
             if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
             for name in _loads(child)]
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        own = set().union(*(bound_names(g.target) for g in node.generators))
        found = [name for name in found if name not in own]
    return found


def _read_before_set(body: list[ast.stmt], assigned: set[str], definite: set[str]) -> list[str]:
    """The names of ``assigned`` that ``body`` may read before it has set them for sure (on every
    path: a name set in only one branch of an ``if`` is not; a loop's body is taken to run, and a
    ``try``'s to end), ``definite`` being set already."""
    found: list[str] = []

    def read(node, sure: set[str]) -> None:
        for name in _loads(node):
            if name in assigned and name not in sure and name not in found:
                found.append(name)

    def block(stmts: list[ast.stmt], sure: set[str]) -> set[str]:
        for stmt in stmts:
            sure = statement(stmt, sure)
        return sure

    def statement(stmt: ast.stmt, sure: set[str]) -> set[str]:
        """What is set for sure after ``stmt``, its reads checked against ``sure``."""
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in stmt.decorator_list:
                read(decorator, sure)
            return sure | {stmt.name}
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if stmt.value is not None:
                read(stmt.value, sure)
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                if isinstance(stmt, ast.AugAssign) and isinstance(target, ast.Name):  # x += 1 reads x
                    read(ast.Name(id=target.id, ctx=ast.Load()), sure)
                elif not isinstance(target, ast.Name):
                    read(target, sure)  # x[i] = ..., x.a = ...: x is read
            return sure | _bound_in([stmt])
        if isinstance(stmt, ast.If):
            read(stmt.test, sure)
            return block(stmt.body, sure) & block(stmt.orelse, sure)
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):  # taken to run once at least (a loader's batches)
            read(stmt.test if isinstance(stmt, ast.While) else stmt.iter, sure)
            after = block(stmt.body, sure if isinstance(stmt, ast.While) else sure | bound_names(stmt.target))
            block(stmt.orelse, after)
            return after
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                read(item.context_expr, sure)
                if item.optional_vars is not None:
                    sure = sure | bound_names(item.optional_vars)
            return block(stmt.body, sure)
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":  # taken to run whole
            after = block(stmt.body, sure)
            for handler in stmt.handlers:
                block(handler.body, after)
            block(stmt.orelse, after)
            return block(stmt.finalbody, after)
        read(stmt, sure)
        return sure | _bound_in([stmt])

    block(body, definite)
    return found


def _file_write(node: ast.AST) -> str | None:
    """``"a"`` where ``node`` opens a file to append to it (``open(p, "a")``, ``df.to_csv(p,
    mode="a")``), ``"w"`` where it writes one anew (``open(p, "w")``, ``df.to_csv(p)``,
    ``path.write_text(...)``), else None."""
    if not isinstance(node, ast.Call):
        return None
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    mode = next((k.value for k in node.keywords if k.arg == "mode"), None)
    if name == "open":
        if mode is None:
            at = 0 if isinstance(node.func, ast.Attribute) else 1  # Path.open(mode), open(path, mode)
            mode = node.args[at] if len(node.args) > at else None
        text = mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"
    elif name == "to_csv":
        text = mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "w"
    elif name in ("write_text", "write_bytes"):
        text = "w"
    else:
        return None
    return "a" if "a" in text else "w" if ("w" in text or "x" in text) else None


def _file_path(call: ast.Call) -> ast.AST | None:
    """The file a :func:`_file_write` call writes, as the code names it: ``open(p)``'s ``p``, the
    path of a ``Path.open()`` or ``write_text``, ``to_csv``'s first argument."""
    if isinstance(call.func, ast.Attribute) and call.func.attr in ("open", "write_text", "write_bytes") \
            and not (isinstance(call.func.value, ast.Name) and call.func.value.id in ("io", "os", "codecs")):
        return call.func.value
    return call.args[0] if call.args else None


def _shown_path(call: ast.Call) -> str:
    """:func:`_file_path` for people: a long literal path shortened to its file's name."""
    path = _file_path(call)
    if isinstance(path, ast.Constant) and isinstance(path.value, str) and len(path.value) > 40:
        return repr(".../" + path.value.replace("\\", "/").rsplit("/", 1)[-1])
    return ast.unparse(path) if path is not None else "a file"


def file_writes(codes: list[ast.AST], tree: ast.AST) -> tuple[list[str], list[str]]:
    """The files a ``resume_range`` loop (of the cell, or of a function it calls) appends to: a
    resume runs again the iterations since the last safe point, and writes their lines again; and
    those of them that the cell's code above its first loop writes (anew, or a header): that code
    runs again on resume, over what the iterations before the fault wrote."""
    appends = [n for code in codes for loop in _resume_loops(code) for n in _walk_body(loop) if _file_write(n) == "a"]
    paths = {ast.unparse(p) for p in map(_file_path, appends) if p is not None}
    above: list[str] = []
    for stmt in getattr(tree, "body", []):
        if any(isinstance(n, ast.For) and n in _resume_loops(stmt) for n in ast.walk(stmt)):
            break
        above += [_shown_path(n) for n in ast.walk(stmt) if _file_write(n) and _file_path(n) is not None
                  and ast.unparse(_file_path(n)) in paths and _shown_path(n) not in above]
    return list(dict.fromkeys(_shown_path(n) for n in appends)), above


def set_in_loops_read_after(shell, body: str, saved: list[str]) -> list[str]:
    """:func:`read_after_loop` of a cell's code (nothing where it does not parse)."""
    tree = _parse(shell, body)
    return read_after_loop(tree, saved) if tree is not None else []


def read_after_loop(tree: ast.AST, saved: list[str]) -> list[str]:
    """Names a ``resume_range`` loop's body binds that code after the loop (in the same block)
    reads before binding them again, and that ``--save`` does not save."""
    found: list[str] = []
    for block in (getattr(n, f, None) for n in ast.walk(tree) for f in ("body", "orelse", "finalbody")):
        if not isinstance(block, list):
            continue
        for i, stmt in enumerate(block):
            if stmt not in _resume_loops(stmt) or not isinstance(stmt, ast.For):
                continue
            inside = _bound_in(stmt.body) - set(saved)
            # in order: a second loop that sets loss before it reads it does not read the first's
            found += [n for n in _read_before_set(block[i + 1:], inside, set()) if n not in found]
    return found


def cell_sets(shell, body: str, *, definitions: bool = True) -> list[str]:
    """Names a cell sets in its own scope (not in a function, class or comprehension) and does not
    delete again: what it leaves in the namespace for the cells after it. Without
    ``definitions``, the names it imports or defines (``def``, ``class``) are left out."""
    tree = _parse(shell, body)
    stored: list[str] = []
    deleted: set[str] = set()
    todo = list(ast.iter_child_nodes(tree)) if tree is not None else []
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if definitions:
                stored.append(node.name)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            stored.append(node.id)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Del):
            deleted.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and definitions:
            stored += [(a.asname or a.name).split(".")[0] for a in node.names]
        todo.extend(ast.iter_child_nodes(node))
    return [n for n in dict.fromkeys(stored) if n not in deleted and not n.startswith("_")]


def _is_zero_grad(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "zero_grad"


def accumulates_gradients(tree: ast.AST) -> bool:
    """Whether a ``resume_range`` loop's iterations are micro-steps: ``zero_grad`` is called in
    its body only under an ``if`` (or a ``try``). Calls in an inner loop (accumulation within an
    iteration) or in an inner ``resume_range`` loop (that loop's business) do not count."""
    loops = _resume_loops(tree)

    def calls(stmts, conditional: bool):
        for stmt in stmts:
            if stmt in loops:
                continue
            if isinstance(stmt, (ast.If, ast.Try)):
                bodies = [stmt.body, stmt.orelse, getattr(stmt, "finalbody", [])]
                bodies += [h.body for h in getattr(stmt, "handlers", [])]
                for body in bodies:
                    yield from calls(body, True)
                continue
            if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):  # windows within the iteration
                yield from (False for n in ast.walk(stmt) if _is_zero_grad(n))
                continue
            if isinstance(stmt, (ast.With, ast.AsyncWith)):
                yield from calls(stmt.body, conditional)
                continue
            yield from (conditional for n in ast.walk(stmt) if _is_zero_grad(n))

    for loop in loops:
        found = list(calls(loop.body, False))
        if found and all(found):
            return True
    return False


def built_by_no_replay_cell(shell, tree: ast.AST, saved: list[str], replay_sources: list[str]) -> list[str]:
    """The ``--save`` names whose state a checkpoint holds (a model, an optimizer) that neither a
    set-up cell nor the cell (``tree``) builds: after a restart nothing makes the object the
    saved state goes into."""
    ns = shell.user_ns
    built = bound_names(tree)
    for src in replay_sources:
        built |= bound_names(_parse(shell, replay.split(src)[1]))
    return [n for n in saved if n in ns and n not in built and saved_by_state(ns[n])]


def names_lost_on_restart(shell, body: str, saved: list[str], replay_sources: list[str]) -> list[str]:
    """Names ``body`` reads from the namespace that nothing would bring back after a restart."""
    tree = _parse(shell, body)
    if tree is None:
        return []
    read = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in read:
            read.append(node.id)
    defined = bound_names(tree, arguments=True) | set(saved) | set(dir(builtins))
    defined |= {"resume_range", "checkpoint", "get_ipython"}
    for src in replay_sources:
        defined |= bound_names(_parse(shell, replay.split(src)[1]), arguments=True)
    ns = shell.user_ns
    return [n for n in read if n not in defined and n in ns and not n.startswith("_")]
