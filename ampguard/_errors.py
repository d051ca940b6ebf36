"""Every exception and warning ampguard raises, in one place so users can catch them by name."""

from __future__ import annotations


class AmpGuardError(Exception):
    """Base class of every error ampguard raises on purpose."""


class ConfigError(AmpGuardError, ValueError):
    """An option or ``AMPGUARD_*`` variable has a value ampguard does not accept."""


class LossScaleCollapseError(AmpGuardError):
    """The GradScaler's loss scale kept shrinking: training can no longer make progress.

    Raised *before* the scale reaches a value at which gradients silently turn into NaN,
    so the parameters are still the last finite ones.
    """

    def __init__(self, message: str, *, optimizers: list[str], scale_history: list[float]) -> None:
        super().__init__(message)
        self.optimizers = optimizers
        self.scale_history = scale_history

    def __reduce__(self) -> tuple:
        # A worker's error crosses a process boundary (multiprocessing.Pool); the keyword-only
        # arguments are not in self.args, so the default reduction could not rebuild it.
        return _rebuild, (type(self), self.args, self.__dict__)


class AmpGuardWarning(UserWarning):
    """Category of every warning ampguard issues (``-W error::ampguard.AmpGuardWarning`` works)."""


class NonFiniteError(AmpGuardError, FloatingPointError):
    """A NaN/Inf reached a sink (the loss, a module output, a gradient, a parameter).

    ``origin`` is the user's stack at the op that first produced the value; ``chain`` the ops
    from there to the sink. ``str(err)`` is the whole story, written to be read at 2 a.m.
    """

    def __init__(self, message: str, *, kind: str, sink: str, op: str | None = None, module: str | None = None,
                 origin=None, chain: list[str] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.sink = sink
        self.op = op
        self.module = module
        self.origin = origin
        self.chain = chain or []
        self.repro: str | None = None  # the reproducer bundle written for it (repro_dir), for python -m ampguard repro

    def add_line(self, line: str) -> None:
        """Append ``line`` to the message: what the failure path learns once the error is built (where it was
        read, where its reproducer went)."""
        self.args = (f"{self.args[0]}\n{line}", *self.args[1:])

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> BaseException:
    """Unpickle an error with keyword-only arguments: the message, then every attribute as it was."""
    error = Exception.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


# Tracebacks and pickles name the public path (ampguard.NonFiniteError), where users import them from.
for _cls in (AmpGuardError, ConfigError, LossScaleCollapseError, AmpGuardWarning, NonFiniteError):
    _cls.__module__ = "ampguard"
