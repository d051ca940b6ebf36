"""Activation without editing the script: ``AMPGUARD=1`` and ``python -m ampguard``."""

from __future__ import annotations

import sys

from . import _guard, _options
from ._errors import ConfigError


def activate_from_env(source: str = "AMPGUARD=1") -> _guard.Guard | None:
    """Install with the ``AMPGUARD_*`` options; on a bad value, say so in one line and run without."""
    try:
        if source == "AMPGUARD=1" and not _options.env_flag("AMPGUARD", False):
            return None
        _options.from_environ()  # validate every variable before touching anything
        g = _guard.install()
    except ConfigError as exc:
        print(f"{exc} -- running without ampguard", file=sys.stderr)
        return None
    return g
