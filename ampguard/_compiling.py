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

- Every patched function is a ``_patching.Wrapper``, whose ``_torchdynamo_inline`` (dynamo's own protocol for
  wrappers) names the original: dynamo traces the original, as without ampguard.
- The module hooks return at once while dynamo traces: nothing of ampguard's enters a graph.
- ampguard's files are never compiled as frames of their own and are still inlined where a traced function
  calls them (where a hook's early return is seen): dynamo's rules for files, extended once, when ampguard is
  first installed in a process that imports ``torch._dynamo``. The rule stays after uninstall: it concerns
  ampguard's own files alone, and taking it out and putting it back at every install re-parses every skipped
  directory (interning and freeing their path parts: 7.7 MB of Python memory moved in 2,000 cycles).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from ._patching import REGISTRY, Switch

log = logging.getLogger("ampguard")

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def keep_out_of_graphs() -> Callable[[], None]:
    """Dynamo: skip ampguard's files as frames of their own, inline them where called (once per process)."""
    rules = sys.modules.get("torch._dynamo.trace_rules")
    if rules is None:
        import torch._dynamo.trace_rules as rules
    skip, inline = getattr(rules, "SKIP_DIRS", None), getattr(rules, "BUILTIN_INLINE_WHEN_CALLED", None)
    recompile = getattr(rules, "_recompile_re", None)
    if not isinstance(skip, list) or not isinstance(inline, set) or recompile is None:
        # Another torch: its rules are not these. Hooks still return at once while tracing, and the patched
        # functions are still traced as the originals; only frames of ampguard's own may then be compiled.
        log.debug("ampguard: torch._dynamo's file rules were not found; ampguard's frames are not marked")
        return _stays
    inline.add(_HERE)  # (first: a file both skipped and inlined-when-called is inlined where called)
    if _HERE not in skip:
        skip.append(_HERE)
        recompile()
    return _stays


def _stays() -> None:
    """The rule stays (see the module's docstring)."""


REGISTRY.add_switch(Switch("torch._dynamo", None, keep_out_of_graphs,
                           "torch.compile: ampguard's files are inlined where called, never compiled as frames"))
