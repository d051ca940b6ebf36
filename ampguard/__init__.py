"""ampguard: make PyTorch mixed-precision training safe by default.

``ampguard.install()`` (or ``AMPGUARD=1``) patches torch, and Lightning when the program
imports it, so that an LR scheduler never advances on a step GradScaler skipped, and a loss
scale that collapses stops the run before the parameters turn NaN.
"""

from __future__ import annotations

from . import lightning as _lightning  # noqa: F401  (declares its patch targets; imports no Lightning)
from . import nonfinite as _nonfinite  # noqa: F401  (declares its patch targets)
from . import schedulers as _schedulers  # noqa: F401  (declares its patch targets)
from ._errors import AmpGuardError, AmpGuardWarning, ConfigError, LossScaleCollapseError, NonFiniteError
from ._guard import Guard, Stats, active, guard, install, uninstall

__version__ = "0.1.0"

__all__ = [
    "AmpGuardError",
    "AmpGuardWarning",
    "ConfigError",
    "Guard",
    "LossScaleCollapseError",
    "NonFiniteError",
    "Stats",
    "__version__",
    "active",
    "guard",
    "install",
    "uninstall",
]
