"""Where the user's code is: frames outside torch, Lightning, pytest, wrapt, the stdlib and ampguard.

Origin tracing records these frames for every op, and every warning ampguard issues points at
the first of them, so messages name the line the user wrote, not a line inside a library.
"""

from __future__ import annotations

import logging
import os
import sys
import types
import warnings
from typing import Any

from ._errors import AmpGuardWarning

_ROOTS: tuple[str, ...] = ()
# id(code) -> (whether it is internal, the code object). By id, not by the code object: a code
# object's hash is computed afresh at every lookup from its name, bytecode and constants (nested
# functions' code objects included), some thousands of machine instructions for torch's
# Module._call_impl. The entry holds the code object, so its id is never reused while cached.
_internal_code: dict[int, tuple[bool, Any]] = {}


def _internal_roots() -> tuple[str, ...]:
    global _ROOTS
    if not _ROOTS:
        import importlib.util
        import sysconfig

        roots = [os.path.dirname(os.path.abspath(__file__)), sysconfig.get_paths()["stdlib"]]
        for name in ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities",
                     "_pytest", "pluggy", "wrapt"):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations:
                roots.extend(spec.submodule_search_locations)
        _ROOTS = tuple(os.path.abspath(r) + os.sep for r in roots)
    return _ROOTS


def is_internal(code: Any) -> bool:
    known = _internal_code.get(id(code))
    if known is not None:
        return known[0]
    filename = code.co_filename
    internal = filename.startswith("<") or os.path.abspath(filename).startswith(_internal_roots()) or \
        os.path.basename(filename) == "_ampguard_startup.py"  # the start-up hook, beside site-packages' root
    _internal_code[id(code)] = (internal, code)
    return internal


def user_frames(frame: Any, limit: int = 4, budget: int = 24) -> tuple:
    """Up to ``limit`` (code, lineno) pairs of user frames, innermost first, looking ``budget`` frames up."""
    out = []
    while frame is not None and budget and len(out) < limit:
        code = frame.f_code
        if not is_internal(code):
            out.append((code, frame.f_lineno))
        frame = frame.f_back
        budget -= 1
    return tuple(out)


def first_user(frame: Any, budget: int) -> tuple | None:
    """The innermost user frame as (code, instruction offset), looking ``budget`` frames up: the
    per-call path's user_frames(limit=1), one cached dict lookup a frame. See :func:`line_at`."""
    return first_user_past(frame, budget, None)[0]


def first_user_past(frame: Any, budget: int, code: Any) -> tuple[tuple | None, bool]:
    """:func:`first_user`, and whether a frame of ``code`` was passed on the way up to it (torch's
    ``functional_call`` between a module call and the user's): one walk for both."""
    known = _internal_code
    passed = False
    while frame is not None and budget:
        here = frame.f_code
        if here is code:
            passed = True
        entry = known.get(id(here))
        if not (entry[0] if entry is not None else is_internal(here)):
            return (here, frame.f_lasti), passed
        frame = frame.f_back
        budget -= 1
    return None, passed


# A function that calls func(*args, **kwargs) on its one line. Copies of its code with a user frame's file and line,
# bound to that frame's globals, are the frame C warnings name (see from_caller). Named <ampguard>: a traceback, a
# profiler or a debugger shows ampguard's frame at the user's line, not a second frame of the user's function.
_CALL = compile("def call(func, args, kwargs): __tracebackhide__ = True; return func(*args, **kwargs)\n",
                "<ampguard>", "exec").co_consts[0]  # (pytest hides the frame, as it hides the record's own)
if sys.version_info >= (3, 11):
    # Every instruction on the one line, with no columns: a traceback through a copy shows the user's line without
    # carets under the template's columns. Location entries of code 13 (no columns) and line delta 0, 8 units each.
    _units = len(_CALL.co_code) // 2
    try:
        _CALL = _CALL.replace(co_linetable=bytes(b for k in range(0, _units, 8)
                                                 for b in (0x80 | 13 << 3 | min(8, _units - k) - 1, 0)))
    except Exception:  # pragma: no cover - (another line table format: the carets stay, nothing else differs)
        pass
# (id(code), lasti) -> (the copy of _CALL at that line, or None where none could be made; the user's code, held so
# that its id is not reused while it is a key)
CALLERS: dict[tuple[int, int], tuple[Any, Any]] = {}
MAX_CALLERS = 4096  # distinct loss-code lines; past this the cache starts again
_NAME = "<ampguard>"


def from_caller(frame: Any) -> Any:
    """``call(func, args, kwargs)``, run from a frame that warnings take for ``frame``: the same file, line and
    globals (so its module and ``__warningregistry__``), named ``<ampguard>``.

    A warning torch raises from C (``TORCH_WARN``: ``std(): degrees of freedom is <= 0``) names the Python frame
    running when it is raised, whatever its ``stacklevel``. An op that ampguard's loss-code record calls for the
    user would name ampguard's frame, and ``-W error::UserWarning:__main__`` or a filter by module would no longer
    match it. Called through this, it names the user's line as without ampguard.

    The code is made once per line; the function around it at each call (some 0.1 us). It holds the frame's
    globals, and a cached one kept them alive after the code that made them was done: a script run by ``runpy`` or
    ``exec`` (a sweep that runs its training script once per trial), with the model and data in its globals."""
    known = CALLERS.get((id(frame.f_code), frame.f_lasti))
    made = (known if known is not None else _remember(frame))[0]
    return _call_here if made is None else types.FunctionType(made, frame.f_globals, _NAME)


def _remember(frame: Any) -> tuple[Any, Any]:
    code = frame.f_code
    try:
        made = _CALL.replace(co_filename=code.co_filename, co_firstlineno=line_at(code, frame.f_lasti), co_name=_NAME,
                             **({"co_qualname": _NAME} if sys.version_info >= (3, 11) else {}))
        _internal_code[id(made)] = (True, made)  # never a user frame to a walk that passes it
        skip = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
        if skip is not None:
            skip(made)  # ampguard's frame: never compiled as one of its own at a graph break (see _compiling)
    except Exception:  # (an interpreter whose code objects differ): the op is called as before, only the place differs
        logging.getLogger("ampguard").debug("ampguard: no call frame for %s", code.co_filename, exc_info=True)
        made = None
    if len(CALLERS) >= MAX_CALLERS:  # (loss code made anew at every step, by exec): start again, holding nothing
        for old, _ in CALLERS.values():
            if old is not None:
                _internal_code.pop(id(old), None)
        CALLERS.clear()
    known = CALLERS[(id(code), frame.f_lasti)] = (made, code)
    return known


def _call_here(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


def is_from_caller(code: Any) -> bool:
    """Whether ``code`` is one of :func:`from_caller`'s copies (ampguard's frame at the user's line)."""
    return code.co_consts is _CALL.co_consts  # (each copy shares the template's constants; no user code can)


def line_at(code: Any, lasti: int) -> int:
    """The line number ``frame.f_lineno`` gives for a frame of ``code`` stopped at ``frame.f_lasti``.

    The normal path records (code, f_lasti) and a message turns it into a line here: reading
    f_lineno scans the code's line table, some 2,000 machine instructions a read, and the tape
    records several frames an op.
    """
    if lasti >= 0:
        for start, end, line in code.co_lines():
            if start <= lasti < end:
                return line if line is not None else code.co_firstlineno
    return code.co_firstlineno


def warn_at_user(message: str, elsewhere: str | None = None) -> None:
    """Issue an AmpGuardWarning attributed to the innermost user frame (file:line the user can open),
    or to ``elsewhere`` (such as ``<environment>``) when no user code is on the stack."""
    frames = user_frames(sys._getframe(1), limit=1, budget=64)
    if not frames and elsewhere is not None:
        warnings.warn_explicit(message, AmpGuardWarning, elsewhere, 0, module="ampguard")
    elif frames:
        code, lineno = frames[0]
        module = code.co_filename.rpartition(os.sep)[2].removesuffix(".py")
        warnings.warn_explicit(message, AmpGuardWarning, code.co_filename, lineno, module=module)
    else:
        warnings.warn(message, AmpGuardWarning, stacklevel=3)
