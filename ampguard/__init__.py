"""ampguard: make PyTorch mixed-precision training safe by default.

``ampguard.install()`` (or ``AMPGUARD=1``) patches torch, and Lightning when the program
imports it, so that an LR scheduler never advances on a step GradScaler skipped, a Lightning
``optimizer_step`` that forgot its closure still trains, and a NaN/Inf names the op and line
that created it.

Importing the package is nearly free: the public names load on first use (PEP 562), so the
pytest plugin and ``from ampguard import AmpGuardWarning`` never pay for wrapt or the patches.

PYTEST_DONT_REWRITE: under ``AMPGUARD=1`` this package is imported before pytest starts, and pytest
would warn that its plugin's package cannot be rewritten (an error under ``filterwarnings = error``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AmpGuardError": "_errors",
    "AmpGuardWarning": "_errors",
    "ConfigError": "_errors",
    "LossScaleCollapseError": "_errors",
    "NonFiniteError": "_errors",
    "Guard": "_features",  # _features imports every feature, then re-exports these from _guard
    "Stats": "_features",
    "active": "_features",
    "guard": "_features",
    "install": "_features",
    "replaying": "_guard",
    "uninstall": "_features",
}
_SUBMODULES = ("lightning", "lints", "nonfinite", "schedulers")

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
    "replaying",
    "uninstall",
]

if TYPE_CHECKING:
    from ._errors import AmpGuardError, AmpGuardWarning, ConfigError, LossScaleCollapseError, NonFiniteError
    from ._features import Guard, Stats, active, guard, install, uninstall
    from ._guard import replaying


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*_EXPORTS, *_SUBMODULES, "__version__"})
