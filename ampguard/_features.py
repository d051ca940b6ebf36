"""Every feature, on the top floor: the one module that imports them all.

``_guard`` owns installation and knows no feature; each feature module declares its patch
targets in the registry when it is imported. The public entry points (the package's ``install``,
``guard``, ``uninstall`` and ``active``, the start-up hook, the CLI, the pytest plugin and the
Lightning callback) come through this module, so every feature is declared before anything is
installed, and no module below imports one above it.
"""

from __future__ import annotations

from . import _compiling, lightning, lints, nonfinite, schedulers, warning_sites  # noqa: F401  (each declares its targets)
from ._guard import Guard, Stats, active, guard, install, uninstall

__all__ = ["Guard", "Stats", "active", "guard", "install", "uninstall"]
