"""Activation without editing the script: ``AMPGUARD=1`` and ``python -m ampguard``.

A guard installed this way prints ``Guard.report()`` to stderr at interpreter exit when
anything happened (a skipped step, a held scheduler step, an injected closure, a detection),
because nobody edited the script to print it. ``AMPGUARD_REPORT=0`` silences it.
"""

from __future__ import annotations

import atexit
import sys

from . import _features, _guard, _options
from ._errors import ConfigError


def activate_from_env(source: str = "AMPGUARD=1") -> _guard.Guard | None:
    """Install with the ``AMPGUARD_*`` options. On a bad value the start-up hook says so in one line
    and the program runs without the guard; ``python -m ampguard``, which asked for the guard, raises."""
    try:
        if source == "AMPGUARD=1" and not _options.env_flag("AMPGUARD", False):
            return None
        _options.from_environ()  # validate every variable before touching anything
        report = _options.env_flag("AMPGUARD_REPORT", True)
        g = _features.install()
    except ConfigError as exc:
        if source != "AMPGUARD=1":
            raise
        print(f"{exc} -- running without ampguard", file=sys.stderr)
        return None
    if report:
        atexit.register(report_at_exit, g)
    atexit.register(settle_at_exit, g)  # runs first (atexit is last-in, first-out)
    return g


def settle_at_exit(g: _guard.Guard) -> None:
    """Read the checks that no step consumed (a script that ends after a forward), and say what failed."""
    try:
        if _guard.active() is g:
            _guard._settle(g, error=sys.exc_info()[0] is not None)
    except Exception as exc:  # at exit a traceback helps nobody; the message is the story
        print(str(exc), file=sys.stderr, flush=True)


def report_at_exit(g: _guard.Guard) -> None:
    """Print the report of the guard the environment installed, if there is anything to report."""
    try:
        if g.stats.anything_happened():
            print(g.report(), file=sys.stderr, flush=True)
    except Exception:  # interpreter shutdown: never turn a clean exit into a traceback
        pass
