"""An ampguard bug must never harm the user's run: log it, warn once, fall back to PyTorch's behaviour.

This sits below the registry and the shared read (both report failures here), so imports only
point down: the Guard registers how to find the active guard (``active_guard``), and a feature
that failed is marked in that guard's ``_disabled`` set, which its hooks consult.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ._errors import AmpGuardError, AmpGuardWarning
from ._frames import warn_at_user

log = logging.getLogger("ampguard")

active_guard: Callable[[], Any] = lambda: None  # noqa: E731  (set by _guard when it is imported)
_warned: set[str] = set()  # features that failed while no guard was active


def internal_failure(feature: str, exc: BaseException) -> None:
    """An ampguard bug: log it, warn once, and switch the feature off so PyTorch's behaviour is used."""
    log.error("ampguard: internal error in %s; falling back to PyTorch's own behaviour", feature, exc_info=exc)
    g = active_guard()
    warned = g._disabled if g is not None else _warned  # one warning per feature and guard
    first = feature not in warned
    warned.add(feature)
    if g is not None:
        # Only mark it: this may run inside one of torch's hook loops, which must not change size
        # under it. The feature's hooks return at once from now on.
        g._refresh()
    if first:
        warn_at_user(
            f"ampguard: internal error in {feature} ({type(exc).__name__}: {exc}); {feature} is switched off "
            "for the rest of this run and PyTorch's own behaviour is used. The 'ampguard' logger has the "
            "traceback; please report it.")


def fall_back(feature: str, exc: BaseException, original: Callable[[], Any]) -> Any:
    """ampguard's part of a wrapped call failed with ``exc``: run PyTorch's ``original``. Where PyTorch refuses the
    call too (an argument neither accepts: ``norm_type="fro"``, ``update(new_scale=[1.0])``), its own error is the
    user's answer, and ampguard's failure says nothing of ampguard: no warning, nothing switched off. Otherwise it was
    an ampguard bug (internal_failure), and the original's result stands."""
    result = original()
    internal_failure(feature, exc)
    return result


def fail_safe(feature: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A torch hook that never breaks the user's run: intended errors and warnings-as-errors pass,
    an ampguard bug switches ``feature`` off and PyTorch's behaviour goes on (the hook returns None)."""

    def decorate(hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def safe(*args: Any) -> Any:
            __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
            try:
                return hook(*args)
            except (AmpGuardError, AmpGuardWarning) as intended:
                raise intended.with_traceback(None) from None  # the traceback starts here: no ampguard frame below
            except Exception as exc:
                internal_failure(feature, exc)
                return None

        return safe

    return decorate


