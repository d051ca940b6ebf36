"""Staying out of torch.compile's way: a compiled function sees exactly what it sees without ampguard.

Dynamo traces every Python function that a compiled function calls, and it compiles, as frames of their own,
the Python functions that run at its graph breaks. Without care, ampguard's code would be both:

- A module hook or a patched function called inside a compiled function is traced into the user's graph. A
  graph break there splits the graph, a split graph is fused differently, and the run's numbers change (by an
  ulp: enough to make a run differ from the same run without ampguard). A patched ``clip_grad_norm_`` even
  crashed dynamo: a wrapt proxy passes for a function but fails the guards dynamo puts on functions.
- ampguard's wrappers that run at a graph break (``backward()``) would be compiled as frames of their own,
  with ampguard's checks folded away as if tracing.

So:

- Every patched module function is a ``_patching.Wrapper``, whose ``_torchdynamo_inline`` (dynamo's own protocol
  for wrappers) names the original: dynamo traces the original, as without ampguard, and puts no guard of a
  function's on the proxy.
- The module hooks return at once while dynamo traces: nothing of ampguard's enters a graph.
- ampguard's code is never compiled as frames of its own (``skip_code`` on each of its code objects, once, when
  ampguard is installed in a process that imports ``torch._dynamo``); it is still inlined where a traced
  function calls it, where the early returns above are seen. The marks stay after uninstall: they concern
  ampguard's own code alone. That includes the loss-code record's calls of C ops, made at run time under the
  user's file and line (``_frames.from_caller``): each is marked when it is made.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from . import _frames
from ._patching import REGISTRY, Switch

log = logging.getLogger("ampguard")


def keep_out_of_graphs() -> Callable[[], None]:
    """Dynamo: never compile a frame of ampguard's own code (it is still inlined where a traced function calls
    it). Once per process, for every code object of ampguard's modules: the mark stays (see above)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    skip = getattr(eval_frame, "skip_code", None)
    if skip is None:
        # Another torch: the hooks still return at once while tracing and the patched functions are still traced
        # as the originals; only frames of ampguard's own may then be compiled.
        log.debug("ampguard: torch._dynamo.eval_frame.skip_code was not found; ampguard's frames are not marked")
        return _stays
    global _marked
    if not _marked:  # (once: every module that runs under a guard is imported by then, and marks stay)
        for code in _codes():
            skip(code)
        _marked = True
    for made, _ in list(_frames.CALLERS.values()):  # the record's calls made so far (later ones mark themselves)
        if made is not None:
            skip(made)
    return _stays


_marked = False  # ampguard's code objects are marked


def _codes() -> Iterator[types.CodeType]:
    """Every code object of ampguard's imported modules: functions, methods, properties, and the functions,
    lambdas and classes defined inside them (constants of their code)."""
    seen: set[int] = set()
    stack: list[Any] = [m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType) and _ours(m)]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.CodeType):
            yield obj
            stack.extend(c for c in obj.co_consts if isinstance(c, types.CodeType))
        elif isinstance(obj, types.ModuleType):
            stack.extend(v for v in vars(obj).values() if _ours(v))
        elif isinstance(obj, type):
            stack.extend(vars(obj).values())
        elif isinstance(obj, (staticmethod, classmethod)):
            stack.append(obj.__func__)
        elif isinstance(obj, property):
            stack.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, types.FunctionType):
            stack.append(obj.__code__)


def _ours(value: Any) -> bool:
    module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    return isinstance(module, str) and module.partition(".")[0] == "ampguard"


def _stays() -> None:
    """The mark stays (see the module's docstring)."""


REGISTRY.add_switch(Switch("torch._dynamo", None, keep_out_of_graphs,
                           "torch.compile: ampguard's code is inlined where called, never compiled as frames"))
