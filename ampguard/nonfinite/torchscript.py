"""Ops inside TorchScript: which script ran them, and where in its source they are.

TorchScript (``torch.jit.script``, ``torch.jit.trace``) runs its ops in C++, below every Python frame and every
TorchFunctionMode. A replay's dispatch mode sees each of them, but at the Python line that called the script; and
the loss-code record sees nothing of a script function's call, whose output then came from nowhere it knows (see
:func:`script_function_call`). A script's graph keeps the source line of each op. The failure path reads it there,
at no cost to the normal path.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import os
import re
import types
from typing import Any

from .._frames import line_at
from . import sinks

_SCRIPTED = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')  # a scripted graph's source range
_TRACED = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<function>\S+)$")  # a traced graph's: the stack it traced


class Scripted(str):
    """How an op inside TorchScript reads where a torch function's name would (``aten.log inside TorchScript function
    'focal'``), with the script objects whose graphs hold its line. A ``str``, so that it goes wherever the name of
    the torch function an op ran inside goes (a replay's record, a message's label)."""

    objects: tuple


def script_types() -> tuple[type, ...]:
    jit = sinks._torch.jit
    return jit.ScriptModule, jit.ScriptFunction


def scripted(objects: list) -> Scripted | None:
    """The label of the TorchScript code in ``objects`` (script modules and functions), or None if there is none."""
    unique = list({id(o): o for o in objects}.values())
    if not unique:
        return None
    modules = [o for o in unique if isinstance(o, sinks._torch.jit.ScriptModule)]
    if len(unique) == 1 and not modules:
        label = Scripted(f"TorchScript function '{unique[0].name}'")
    elif len(unique) == 1:
        label = Scripted(f"TorchScript module '{class_name(unique[0])}'")
    else:
        label = Scripted("TorchScript (" + ", ".join(sorted(
            f"'{o.name}'" if o not in modules else f"'{class_name(o)}'" for o in unique)) + ")")
    label.objects = tuple(unique)
    return label


def class_name(module: Any) -> str:
    """A module's class as its user wrote it: torch names the class of every scripted or traced module
    RecursiveScriptModule (or TopLevelTracedModule), and keeps the original one's name beside it."""
    name = getattr(module, "original_name", None) if isinstance(module, sinks._torch.jit.ScriptModule) else None
    return name if isinstance(name, str) and name else type(module).__name__


def running(frame: Any, module: Any) -> Scripted | None:
    """The TorchScript an op runs inside, for an op that no Python-level torch function ran (a replay's, seen below
    every Python frame): ``module`` if it is a script module (its forward runs as TorchScript), else the script
    functions and modules the Python line running in ``frame`` names (``bias_gelu(b, y)``, ``self.fused(x)``). None
    where it finds none, or fails: the op is then placed at its Python line, as before. (``frame``: the innermost one
    running; a replayed loss-code op keeps its recorded frames for its place, but runs here.)"""
    try:
        if isinstance(module, sinks._torch.jit.ScriptModule):
            return scripted([module])
        torch_files = os.path.dirname(sinks._torch.__file__) + os.sep
        while frame is not None and frame.f_code.co_filename.startswith(torch_files):
            frame = frame.f_back  # (torch's own frames around the replay's dispatch: dynamo's disable wrapper)
        if frame is None:
            return None
        # ampguard's own frames around a script function's call: the wrapper's (its instance is the script), and the
        # recorded call's that a replay of the loss code runs
        if frame.f_code is script_function_call.__code__:
            return scripted([frame.f_locals["instance"]])
        if frame.f_code is ScriptCall.__call__.__code__:
            return scripted([frame.f_locals["self"].script])
        return scripted(_named_on_line(frame))
    except Exception:
        return None


_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_FAST_CHECK",
                    "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW",
                    "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
_ATTRIBUTES = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_instructions: dict = {}  # (code, line) -> the (opname, argval) of the line's loads (failure path only)


def _line_loads(code: Any, line: int | None) -> list:
    key = (code, line)
    loads = _instructions.get(key)
    if loads is None:
        loads, current = [], None
        for ins in dis.get_instructions(code):
            positions = getattr(ins, "positions", None)
            if positions is not None and positions.lineno is not None:
                current = positions.lineno
            elif isinstance(ins.starts_line, int) and not isinstance(ins.starts_line, bool):
                current = ins.starts_line  # (Python 3.10: no positions)
            if current == line and (ins.opname in _LOADS or ins.opname in _ATTRIBUTES):
                loads.append((ins.opname, ins.argval))
        if len(_instructions) > 256:
            _instructions.clear()
        _instructions[key] = loads
    return loads


def _named_on_line(frame: Any) -> list:
    """The script objects that the names and attribute chains loaded on ``frame``'s running line resolve to, read
    without running any code of the user's (no property, no ``__getattr__``)."""
    kinds = script_types()
    code = frame.f_code
    found: list = []
    current: Any = None
    for opname, name in _line_loads(code, line_at(code, frame.f_lasti)):
        if opname in _ATTRIBUTES:
            current = _attribute(current, name) if current is not None else None
        else:
            if isinstance(name, tuple):  # (LOAD_FAST_LOAD_FAST: two locals; the second is on top)
                name = name[-1]
            current = _lookup(frame, opname, name)
        if isinstance(current, kinds):
            found.append(current)
    return found


_MISSING = object()


def _lookup(frame: Any, opname: str, name: Any) -> Any:
    if not isinstance(name, str):
        return None
    if opname in ("LOAD_GLOBAL", "LOAD_NAME"):
        value = frame.f_globals.get(name, _MISSING)
        if value is _MISSING:
            value = vars(builtins).get(name)
        return value
    try:
        return frame.f_locals.get(name)
    except Exception:
        return None


def _attribute(obj: Any, name: Any) -> Any:
    if not isinstance(name, str):
        return None
    if isinstance(obj, sinks._torch.nn.Module):
        found = obj.__dict__.get("_modules", {}).get(name)
        if found is not None:
            return found
    if isinstance(obj, types.ModuleType):
        return vars(obj).get(name)
    try:
        value = inspect.getattr_static(obj, name, None)
    except Exception:
        return None
    return value.__func__ if isinstance(value, staticmethod) else value


# -- where in the script ---------------------------------------------------------------------------------
def _nodes(graph: Any) -> Any:
    for node in graph.nodes():
        yield node
        for block in node.blocks():
            yield from _nodes(block)


def _site(source_range: str) -> tuple[str, int, str] | None:
    """(file, line, function) of a graph node's source range: a scripted graph's ``File "..", line n``, or the
    innermost frame of the stack a traced one keeps."""
    for text in source_range.splitlines():
        match = _SCRIPTED.search(text)
        if match:
            return match["file"], int(match["line"]), ""
        match = _TRACED.match(text.strip())
        if match:
            return match["file"], int(match["line"]), match["function"]
    return None


def sites(label: Scripted, op: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of each node of the aten op ``op`` ('aten.log') in the graphs of ``label``'s scripts."""
    kind = graph_kind(op)
    found: list = []
    for obj in label.objects:
        try:
            graph = obj.inlined_graph
            for node in _nodes(graph):
                if node.kind() == kind:
                    site = _site(node.sourceRange())
                    if site is not None and site not in found:
                        found.append(site)
        except Exception:  # (a graph this torch cannot show: the line stays the Python one, said below)
            continue
    return found


# aten ops whose gradient is unbounded near some input (where a script's backward may turn gradients non-finite)
UNBOUNDED = ("aten.sqrt", "aten.rsqrt", "aten.log", "aten.log2", "aten.log10", "aten.log1p", "aten.pow", "aten.div",
             "aten.reciprocal", "aten.acos", "aten.asin", "aten.atanh", "aten.norm", "aten.linalg_vector_norm")


def unbounded_sites(label: Scripted) -> list[tuple[str, tuple[str, int, str]]]:
    """(graph kind, site) of each op of ``label``'s scripts whose gradient is unbounded near some input, in source
    order: TorchScript's autodiff runs the backward of several ops as one node, so which of them turned the gradients
    non-finite is not known."""
    found = [(graph_kind(op), site) for op in UNBOUNDED for site in sites(label, op)]
    return sorted(found, key=lambda item: (item[1][0], item[1][1]))


def graph_kind(op: str) -> str:
    """The kind of a graph node of aten op ``op``: 'aten.log' -> 'aten::log'."""
    return op.replace(".", "::", 1)


# -- the loss-code record ---------------------------------------------------------------------------------
class ScriptCall:
    """A script function's call as the loss-code record keeps it: a callable that runs the script (past ampguard's
    wrapper), named as the script is."""

    __slots__ = ("call", "script")

    def __init__(self, call: Any, script: Any) -> None:
        self.call, self.script = call, script

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def label(self) -> Scripted | None:
        return scripted([self.script])


def script_function_call(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A TorchScript function's call (``@torch.jit.script``, ``torch.jit.trace``): the loss-code record, a
    TorchFunctionMode, sees none of its ops, and without this saw nothing of the call either: its output came from
    nowhere the record knew, so a NaN made there was reported as an input freed before the check. While the record
    runs, the call goes to it as a torch function's would, and a replay runs it again."""
    torch = sinks._torch
    if torch is None or sinks._here.state.tape is None or not torch._C._is_torch_function_mode_enabled():
        return wrapped(*args, **kwargs)
    return torch.overrides.handle_torch_function(ScriptCall(wrapped, instance), (), *args, **kwargs)
