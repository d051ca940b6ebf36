"""Option definitions, validation and the ``AMPGUARD_*`` environment forms.

Precedence, as in ddtrace: keyword arguments, then ``AMPGUARD_<OPTION>`` variables, then
defaults. Every option is declared once in ``SPECS``; validation, environment parsing,
the README table and ``python -m ampguard doctor`` all read that one table.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ._errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    name: str
    default: Any
    accepted: str  # human-readable list of accepted values, used in every error message
    check: Callable[[Any], Any]  # validates a Python value, returns the normalised value
    parse_env: Callable[[str], Any]  # turns an env string into a Python value (then `check`)
    doc: str
    accepted_text: str = ""  # the accepted values as written in AMPGUARD_* and --ampguard-* (the form typed there)

    @property
    def env(self) -> str:
        return "AMPGUARD_" + self.name.upper()


class _Reject(Exception):
    """Raised by a checker; the spec turns it into a ConfigError naming the option."""


def _check_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _Reject


def _env_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _Reject


def _check_skips(value: Any) -> int | None:
    if value is None:
        return None
    # numbers.Integral: numpy's and torch's integers too (a value read from a config or a sweep)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise _Reject
    return int(value)


def _env_skips(text: str) -> int | None:
    low = text.strip().lower()
    if low in ("none", "off"):
        return None
    try:
        return int(low)
    except ValueError:
        raise _Reject from None


def _choice(*choices: str) -> tuple[Callable[[Any], str], Callable[[str], str]]:
    def check(value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise _Reject

    def parse(text: str) -> str:
        return text.strip().lower()

    return check, parse


# torch's device types; a typo ("cdua") would otherwise silently watch nothing
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "xla", "mtia", "maia", "ipu", "meta", "lazy", "vulkan",
                "privateuseone")


def _device_type_known(name: str) -> bool:
    if name in DEVICE_TYPES:
        return True
    torch = sys.modules.get("torch")  # a renamed PrivateUse1 backend, known once torch is imported
    try:
        return torch is not None and name == torch._C._get_privateuse1_backend_name()
    except Exception:
        return False


def _check_devices(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value:
        raise _Reject
    out = []
    for item in value:
        if not isinstance(item, str) or not _device_type_known(item.strip().lower()):
            raise _Reject
        out.append(item.strip().lower())
    return tuple(out)


def _env_devices(text: str) -> tuple[str, ...] | None:
    low = text.strip().lower()
    if low in ("", "all", "none"):
        return None
    return tuple(part.strip() for part in low.split(","))


SPECS: dict[str, OptionSpec] = {}


_BOOL_TEXT = "1/0, true/false, yes/no or on/off"
_TEXT = {"schedulers": _BOOL_TEXT, "distributed": _BOOL_TEXT, "closures": _BOOL_TEXT, "lint": _BOOL_TEXT,
         "max_consecutive_skips": "a positive integer or 'none'",
         "check_unscaled_after": "a positive integer or 'none'", "nonfinite": "raise, warn, skip or off",
         "trace": "replay, eager or off (deferred is accepted as replay)",
         "devices": "all, or device types separated by commas, such as cuda or cuda,cpu",
         "repro_dir": "a folder path (not an existing file), or 'none'",
         "repro_max_mb": "a positive number of megabytes"}


def _spec(name: str, default: Any, accepted: str, check: Callable, parse_env: Callable, doc: str) -> None:
    SPECS[name] = OptionSpec(name, default, accepted, check, parse_env, doc, _TEXT[name])


_spec(
    "schedulers",
    True,
    "True or False (env: 1/0, true/false, yes/no, on/off)",
    _check_bool,
    _env_bool,
    "Hold an LR scheduler's step() when GradScaler skipped every optimizer step since its last step.",
)
_spec(
    "max_consecutive_skips",
    32,
    "a positive integer, or None to disable the count (env: an integer or 'none')",
    _check_skips,
    _env_skips,
    "Raise LossScaleCollapseError after this many GradScaler updates in a row that skipped a step. "
    "The scale also may never reach 0, whatever this says.",
)
_spec(
    "check_unscaled_after",
    3,
    "a positive integer, or None to never check (env: an integer or 'none')",
    _check_skips,
    _env_skips,
    "After this many GradScaler skips in a row, replay the backward at scale 1, and where an op is NaN/Inf there at "
    "the lowest scale GradScaler tries before the streak is stopped (the failure path only), to tell an op whose "
    "gradients are NaN/Inf at every scale from an overflow, and raise NonFiniteError naming it where the next "
    "skipped step agrees (one bad batch only skips).",
)

_spec(
    "distributed",
    True,
    "True or False (env: 1/0, true/false, yes/no, on/off)",
    _check_bool,
    _env_bool,
    "In a distributed run (torch.distributed initialized, world size > 1), all-reduce GradScaler's skip "
    "decisions once per update() so every rank holds identically, and raise AmpGuardError where ranks disagree.",
)
_spec(
    "closures",
    True,
    "True or False (env: 1/0, true/false, yes/no, on/off)",
    _check_bool,
    _env_bool,
    "Give a Lightning optimizer_step override that forgot optimizer_closure the closure, and warn once.",
)

_spec(
    "lint",
    True,
    "True or False (env: 1/0, true/false, yes/no, on/off)",
    _check_bool,
    _env_bool,
    "Warn once about AMP mistakes that do not crash: clipping still-scaled gradients, an fp16 eps that rounds "
    "to 0, a GradScaler with bf16 autocast.",
)

_nonfinite_check, _nonfinite_env = _choice("raise", "warn", "skip", "off")
_spec(
    "nonfinite",
    "raise",
    "'raise', 'warn', 'skip' or 'off'",
    _nonfinite_check,
    _nonfinite_env,
    "What to do when a NaN/Inf reaches a sink: raise NonFiniteError, warn once per origin, skip the optimizer "
    "step whose loss or gradients it reached and warn once per origin, or not check.",
)
_trace_choice, _trace_env = _choice("replay", "deferred", "eager", "off")


def _trace_check(value: Any) -> str:
    value = _trace_choice(value)
    return "replay" if value == "deferred" else value  # "deferred" names the same design, kept for old configs


_spec(
    "trace",
    "replay",
    "'replay', 'eager' or 'off' ('deferred' is accepted as 'replay')",
    _trace_check,
    _trace_env,
    "How to find the op that created a non-finite value: re-run the failing call op by op when a sink fails "
    "(replay, free until then), check every op as it runs (eager, slow, for debugging), or only check the "
    "sinks (off).",
)
_spec(
    "devices",
    None,
    "None (every device) or device types such as ('cuda',) (env: 'cuda,cpu' or 'all'); device types: "
    + ", ".join(DEVICE_TYPES),
    _check_devices,
    _env_devices,
    "Device types whose tensors are watched.",
)


def _check_dir(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip() or os.path.isfile(value):
        raise _Reject
    return value


def _env_dir(text: str) -> str | None:
    return None if text.strip().lower() in ("", "none", "off") else text.strip()


def _check_mb(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0 or value != value:
        raise _Reject
    return float(value)


def _env_mb(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise _Reject from None


_spec(
    "repro_dir",
    None,
    "None (no reproducers) or a folder path, not an existing file (env: a path, or 'none')",
    _check_dir,
    _env_dir,
    "Where a NonFiniteError (or the first warning per origin) writes a reproducer bundle that "
    "python -m ampguard repro replays; made on the failure path only.",
)
_spec(
    "repro_max_mb",
    256.0,
    "a positive number of megabytes (env: a number)",
    _check_mb,
    _env_mb,
    "The largest reproducer bundle written; a larger one is not written, and the message says so.",
)


# Variables that are not Guard options but switch ampguard's activation on and off.
ENV_SWITCHES = {
    "AMPGUARD": "install the guard at interpreter start-up (1/0, true/false, yes/no, on/off)",
    "AMPGUARD_REPORT": "with AMPGUARD=1 or python -m ampguard, print the report at exit if anything happened "
                       "(default 1)",
}


@dataclasses.dataclass(frozen=True)
class Options:
    """The validated options of one Guard. Build it with :func:`resolve`."""

    schedulers: bool = True
    max_consecutive_skips: int | None = 32
    check_unscaled_after: int | None = 3
    distributed: bool = True
    closures: bool = True
    lint: bool = True
    nonfinite: str = "raise"
    trace: str = "replay"
    devices: tuple[str, ...] | None = None
    repro_dir: str | None = None
    repro_max_mb: float = 256.0

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **validate(changes))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _fail(spec: OptionSpec, value: Any, source: str) -> ConfigError:
    return ConfigError(f"ampguard: {source} got {value!r}; accepted values: {spec.accepted}")


def validate(options: Mapping[str, Any]) -> dict[str, Any]:
    """Check keyword options; raise ConfigError naming the option and the accepted values."""
    out = {}
    for name, value in options.items():
        spec = SPECS.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, sorted(SPECS), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"ampguard: unknown option {name!r}; {hint}accepted options: "
                              f"{', '.join(sorted(SPECS))}")
        try:
            out[name] = spec.check(value)
        except _Reject:
            raise _fail(spec, value, f"option {name!r}") from None
    return out


def from_environ(environ: Mapping[str, str] | None = None, skip: frozenset | set = frozenset()) -> dict[str, Any]:
    """Read every ``AMPGUARD_<OPTION>`` that is set, except the options in ``skip`` (given as keywords,
    which win even over an invalid value); ConfigError names the variable. An unknown ``AMPGUARD_*``
    variable gets one AmpGuardWarning naming the closest one, never an error."""
    environ = os.environ if environ is None else environ
    out = {}
    for spec in SPECS.values():
        text = environ.get(spec.env)
        if spec.name in skip or text is None or text.strip() == "":
            continue
        out[spec.name] = parse_text(spec.name, text, f"environment variable {spec.env}")
    for name in unknown_variables(environ):
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            from ._frames import warn_at_user

            warn_at_user(unknown_message(name), elsewhere="<environment>")  # at start-up no line of yours runs
    return out


_warned_unknown: set[str] = set()


def known_variables() -> set[str]:
    return {spec.env for spec in SPECS.values()} | set(ENV_SWITCHES)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    known = known_variables()
    return sorted(k for k in environ if k.startswith("AMPGUARD_") and k not in known)


def unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, sorted(known_variables()), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    known = ", ".join(sorted(known_variables()))
    return f"ampguard: unknown environment variable {name} is ignored; {hint}known: {known}"


def parse_text(name: str, text: str, source: str) -> Any:
    """An option written as text (an ``AMPGUARD_*`` value, a ``--ampguard-*`` flag); ConfigError names ``source``."""
    spec = SPECS[name]
    try:
        return spec.check(spec.parse_env(text))
    except _Reject:
        raise ConfigError(f"ampguard: {source} got {text!r}; accepted values: {spec.accepted_text}") from None


def resolve(kwargs: Mapping[str, Any], environ: Mapping[str, str] | None = None,
            base: Options | None = None) -> Options:
    """Keyword arguments over environment over ``base`` (or the defaults)."""
    checked = validate(kwargs)
    merged = from_environ(environ, skip=set(checked))
    merged.update(checked)
    return dataclasses.replace(base or Options(), **merged)


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean ``AMPGUARD``-family switch such as ``AMPGUARD`` or ``AMPGUARD_REPORT``."""
    environ = os.environ if environ is None else environ
    text = environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        return _env_bool(text)
    except _Reject:
        raise ConfigError(f"ampguard: environment variable {name} got {text!r}; accepted values: {_BOOL_TEXT}") \
            from None
