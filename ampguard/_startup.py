"""Activation without editing the script: ``AMPGUARD=1`` and ``python -m ampguard``."""

from __future__ import annotations

import sys

from . import _guard, _options
from ._errors import ConfigError

# How the active guard was installed, when not by the program itself: "AMPGUARD=1" or
# "python -m ampguard". Read by the exit report.
activated_by: str | None = None


def activate_from_env(source: str = "AMPGUARD=1") -> _guard.Guard | None:
    """Install with the ``AMPGUARD_*`` options; on a bad value, say so in one line and run without."""
    global activated_by
    try:
        if source == "AMPGUARD=1" and not _options.env_flag("AMPGUARD", False):
            return None
        _options.from_environ()  # validate every variable before touching anything
        g = _guard.install()
    except ConfigError as exc:
        print(f"{exc} -- running without ampguard", file=sys.stderr)
        return None
    activated_by = activated_by or source
    return g
