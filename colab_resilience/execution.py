"""Run a cell magic's body as if it were the cell itself.

``compile_body`` compiles the body the way IPython compiles a cell (input transforms, AST
transformers, display of the last expression) with line numbers that match the notebook (the
``%%magic`` header is line 1); ``run_body`` runs it in the user's namespace and returns a
:class:`Failure` (the user's exception and the part of its traceback that belongs to the user's
code) or None.

``reraise(shell, exc, tb)`` raises the user's exception out of the magic so that IPython reports
it exactly as it would without the magic: the same exception type and message in the
``execute_reply`` (so queued cells are aborted), and a traceback that starts in the cell, without
the frames of IPython's magic machinery and of this package. The traceback is rendered once,
before any frame locals are cleared, and handed to IPython through its ``_render_traceback_``
protocol; :func:`forget_rendered` removes that hook again after the cell.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import TracebackType

#: exceptions whose ``_render_traceback_`` hook this module set; emptied after each cell
_RENDERED: list[BaseException] = []


@dataclass
class Failure:
    """The body raised ``exc``; ``tb`` is its traceback from the first user frame on."""

    exc: BaseException
    tb: TracebackType | None


def _split_last_expr(tree: ast.Module):
    """Like IPython's ``last_expr`` interactivity: the final expression is displayed."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Interactive(body=[tree.body.pop()])
        return tree, last
    return tree, None


def compile_body(shell, header: str | None, body: str):
    """Compile ``body`` (the lines under the ``%%magic`` line ``header``, or a whole cell when
    ``header`` is None) into code objects named like the cell."""
    transformed = shell.transform_cell(body)
    # Cache the whole cell (header included) under the name IPython gives this execution, so a
    # traceback shows "Cell In[7], line 3" with the line the user sees in the notebook.
    offset = 0 if header is None else 1
    name = shell.compile.cache(transformed if header is None else header + "\n" + transformed,
                               shell.execution_count)
    try:
        tree = ast.parse(transformed, filename=name)
    except SyntaxError as e:
        if e.lineno is not None:
            e.lineno += offset
        e.filename = name
        raise
    ast.increment_lineno(tree, offset)
    tree = shell.transform_ast(tree)
    tree, last = _split_last_expr(tree)
    flags = getattr(shell.compile, "flags", 0)
    try:
        codes = [compile(tree, name, "exec", flags=flags, dont_inherit=True)]
        if last is not None:
            codes.append(compile(last, name, "single", flags=flags, dont_inherit=True))
    except SyntaxError as e:
        if header is not None and "outside" in str(e.msg) and ("'await'" in e.msg or "'async " in e.msg):
            # a cell runs top-level await in IPython's event loop; a cell magic's body cannot
            e.msg = f"{e.msg} (the code under a {header.split()[0]} line runs as plain Python, without top-level await)"
        raise
    return codes


def parse_first(shell, names: tuple[str, ...]):
    """An IPython input transformer (``input_transformers_post``) for the cell magics ``names``:
    a cell under one of them whose body does not compile raises its SyntaxError while the cell is
    transformed, as a plain cell's does, so that IPython shows the line and its caret alone, and
    runs nothing. Raised from inside the magic, the error came with every frame between the cell
    and the parser (IPython shows a SyntaxError raised while code runs with its whole stack)."""

    def check(lines: list[str]) -> list[str]:
        source = "".join(lines)
        if not source.startswith("get_ipython().run_cell_magic("):
            return lines
        try:
            call = ast.parse(source).body
            name, line, body = (ast.literal_eval(a) for a in call[0].value.args)  # type: ignore[attr-defined]
        except (SyntaxError, ValueError, TypeError, AttributeError, IndexError):
            return lines
        if len(call) != 1 or name not in names or not isinstance(body, str):
            return lines
        try:
            compile_body(shell, f"%%{name} {line}".rstrip(), body)
        except SyntaxError:
            raise  # the cell's
        except Exception:  # an AST transformer of the user's that fails: as the magic runs, as before
            pass
        return lines

    return check


def run_body(shell, codes) -> Failure | None:
    """Execute compiled body code in the user's namespace; what it raised, if anything."""
    try:
        for code in codes:
            exec(code, shell.user_global_ns, shell.user_ns)
    except BaseException as exc:
        tb = exc.__traceback__
        # the first entry is this frame's exec(); the user's code starts after it
        if tb is not None and tb.tb_frame.f_code is run_body.__code__:
            tb = tb.tb_next
        return Failure(exc, tb)
    return None


def render(shell, exc: BaseException, tb: TracebackType | None) -> list[str]:
    """The structured traceback IPython would show for ``exc`` raised from the cell itself."""
    return shell.InteractiveTB.structured_traceback(type(exc), exc, tb, tb_offset=0)


def reraise(shell, exc: BaseException, tb: TracebackType | None, stb: list[str] | None = None):
    """Raise ``exc`` out of the magic, shown with ``stb`` (rendered now from ``tb`` if None)."""
    if isinstance(exc, SystemExit) or hasattr(exc, "_render_traceback_"):  # IPython shows SystemExit alone
        raise exc.with_traceback(tb)
    if stb is None:
        stb = render(shell, exc, tb)
    try:
        exc._render_traceback_ = lambda: stb  # type: ignore[attr-defined]
        _RENDERED.append(exc)
    except (AttributeError, TypeError):  # an exception type that refuses attributes
        pass
    raise exc.with_traceback(tb)


def forget_rendered() -> None:
    """Remove the rendering hooks set by :func:`reraise` (call after the cell has finished)."""
    while _RENDERED:
        exc = _RENDERED.pop()
        try:
            del exc._render_traceback_  # type: ignore[attr-defined]
        except AttributeError:
            pass

