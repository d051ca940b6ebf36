"""The Guard: the one object every patch reports to, and the install/uninstall state.

Data flows one way: patches observe events (an optimizer step, a scale update, a scheduler
step) and report them here; the Guard holds the per-object state and the counters. Per-object
state lives in identity-keyed weak maps owned by the Guard, never on the torch objects, so
``state_dict()`` and pickling are unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

from . import _fallback, _options, _sync
from ._errors import AmpGuardError
from ._patching import REGISTRY, Target

log = logging.getLogger("ampguard")

V = TypeVar("V")

_FEATURES = ("schedulers", "closures", "nonfinite", "lint")  # the options that switch a feature on or off
# Not an option: GradScaler's bookkeeping (its skips counted from found_inf, the one read at update() that the
# non-finite checks ride on, max_consecutive_skips, check_unscaled_after). On where any of those, or the scheduler
# hold that follows its counts, is wanted: schedulers=False alone must not switch off the collapse check.
GRADSCALER = "GradScaler tracking"


@dataclasses.dataclass
class Stats:
    """Counters users can read at any time; names follow what users see."""

    optimizer_steps_applied: int = 0  # every optimizer step that changed the parameters, scaler or not
    optimizer_steps_skipped: int = 0  # steps not taken: GradScaler's (inf/NaN gradients) and nonfinite='skip''s
    nonfinite_steps_skipped: int = 0  # of those, the ones nonfinite='skip' skipped (non-finite loss or gradients)
    scheduler_steps_held: int = 0
    loss_scale: float | None = None  # the scale after the latest GradScaler.update(), as get_scale() returns it
    loss_scale_min: float | None = None
    loss_scale_max: float | None = None
    closures_injected: int = 0
    nonfinite_detected: int = 0
    # losses made non-finite by a gradient penalty of scaled gradients, at steps GradScaler skipped (its overflow)
    penalty_overflows: int = 0

    def anything_happened(self) -> bool:
        """Whether a run needs the exit report: something was skipped, held, injected or detected."""
        return bool(self.optimizer_steps_skipped or self.scheduler_steps_held or self.closures_injected
                    or self.nonfinite_detected)

    def note_scale(self, scale: float) -> None:
        if scale == self.loss_scale:
            return  # (the usual update: min and max move only when the scale does)
        self.loss_scale = scale
        self.loss_scale_min = scale if self.loss_scale_min is None else min(self.loss_scale_min, scale)
        self.loss_scale_max = scale if self.loss_scale_max is None else max(self.loss_scale_max, scale)


class ObjectState(Generic[V]):
    """Per-object state keyed by identity, dropped when the object is garbage-collected.

    Identity, not ``__eq__``/``__hash__``: a user's optimizer subclass may define either.
    """

    def __init__(self, factory: Callable[[Any], V]) -> None:
        self._factory = factory
        self._data: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, obj: Any) -> V | None:
        entry = self._data.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return None

    def by_id(self, key: int) -> Any:
        """The live object whose ``id()`` is ``key``, if this state has one."""
        entry = self._data.get(key)
        return entry[0]() if entry is not None else None

    def of(self, obj: Any) -> V:
        entry = self._data.get(id(obj))  # (get() written out: several hooks ask at every step)
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return self.set(obj, self._factory(obj))

    def set(self, obj: Any, value: V) -> V:
        key = id(obj)
        data = self._data

        def drop(ref: weakref.ref, key: int = key) -> None:
            entry = data.get(key)
            if entry is not None and entry[0] is ref:
                del data[key]

        data[key] = (weakref.ref(obj, drop), value)
        return value

    def items(self) -> list[tuple[Any, V]]:
        """The (object, value) pairs whose object is still alive."""
        return [(obj, value) for ref, value in list(self._data.values()) if (obj := ref()) is not None]

    def pop(self, obj: Any) -> V | None:
        value = self.get(obj)
        if value is not None:
            del self._data[id(obj)]
        return value


_STATE_FACTORIES: dict[str, Callable[[], Any]] = {}


def declare_state(key: str, factory: Callable[[], Any]) -> str:
    """Declare the state a feature keeps per Guard (its weak maps, its warned-once sets), and return its key.

    ``g.states[key]`` makes it at the first read and every read after is one dict subscript, no call: several hooks
    ask at every step, and a method call there cost more than the lookup.
    """
    _STATE_FACTORIES[key] = factory  # (a module reloaded declares its keys again: the latest factory makes them)
    return key


class _States(dict):
    """A Guard's feature states by key, each made on first read by the factory declared for its key."""

    __slots__ = ()

    def __missing__(self, key: str) -> Any:
        value = self[key] = _STATE_FACTORIES[key]()
        return value


class PerThread(threading.local):
    """``.state``: one plain object per thread, made by ``factory`` at the thread's first use.

    Every attribute read on a threading.local costs about five plain ones (45 ns against 9 ns), so a
    hook that reads its thread's state often takes ``.state`` once and works on that object.
    """

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.state = factory()


class Guard:
    """Options, statistics and per-object state of one installation.

    Get the active one from :func:`ampguard.install`, :func:`ampguard.guard` or
    :func:`ampguard.active`; do not construct it yourself.
    """

    def __init__(self, options: _options.Options) -> None:
        self._disabled: set[str] = set()  # features switched off after an internal failure
        self.options = options  # (see __setattr__)
        self.stats = Stats()
        self.states: dict[str, Any] = _States()  # by declare_state()'s key
        self._names: ObjectState[str] = ObjectState(self._name_for)
        self._name_counts: dict[str, int] = {}
        self.reproducers: list[str] = []  # the reproducer bundles written under this guard (repro_dir)

    options: _options.Options  # read at every step: a plain attribute (a property is a call), kept in step here

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "options":
            self._refresh()
            if REGISTRY.installed:
                _update_switches()  # global hooks follow the enabled features

    def _refresh(self) -> None:
        # The per-op check in current() is one set lookup.
        options = self.options
        on = {f for f in _FEATURES if getattr(options, f) not in (False, "off")}
        if "schedulers" in on or "nonfinite" in on or options.max_consecutive_skips is not None or \
                options.check_unscaled_after is not None:
            on.add(GRADSCALER)
        on -= self._disabled
        if GRADSCALER not in on:
            on.discard("schedulers")  # (the hold follows the skips the tracking counts)
        self._on = frozenset(on)
        if self is _installed:
            _installed_changed()

    def name_of(self, obj: Any) -> str:
        """A stable, readable name for an object in messages: ``AdamW#0``."""
        return self._names.of(obj)

    def _name_for(self, obj: Any) -> str:
        kind = type(obj).__name__
        n = self._name_counts.get(kind, 0)
        self._name_counts[kind] = n + 1
        return f"{kind}#{n}"

    def report(self) -> str:
        """What happened under this guard, in a few lines: steps applied and skipped, scheduler steps held,
        the loss scale, closures injected, non-finite values detected, and any feature switched off."""
        s = self.stats
        lines = ["ampguard report" + _rank_label()]
        by_scaler = s.optimizer_steps_skipped - s.nonfinite_steps_skipped
        lines.append(f"  optimizer steps: {s.optimizer_steps_applied} applied, "
                     f"{by_scaler} skipped by GradScaler (inf/NaN gradients)"
                     + (f", {s.nonfinite_steps_skipped} skipped by nonfinite='skip' (non-finite loss or gradients)"
                        if s.nonfinite_steps_skipped else ""))
        lines.append(f"  scheduler steps held: {s.scheduler_steps_held}")
        if s.loss_scale is not None:
            lines.append(f"  loss scale: last {s.loss_scale:g} (range {s.loss_scale_min:g} .. {s.loss_scale_max:g})")
        lines.append(f"  closures injected: {s.closures_injected}")
        lines.append(f"  non-finite values detected: {s.nonfinite_detected}")
        if s.penalty_overflows:
            lines.append(f"  gradient-penalty losses that overflowed with the scaled gradients, left to GradScaler: "
                         f"{s.penalty_overflows}")
        if self.reproducers:
            lines.append(f"  reproducers: {len(self.reproducers)} written to "
                         f"{os.path.dirname(self.reproducers[0])}; replay one with: python -m ampguard repro "
                         f"{self.reproducers[-1]}")
        elif self.options.repro_dir is not None and s.nonfinite_detected:
            lines.append(f"  reproducers: none written to {self.options.repro_dir} (each message says why)")
        if self._disabled:
            lines.append(f"  disabled after an internal error: {', '.join(sorted(self._disabled))} "
                         "(see the 'ampguard' log)")
        lines.append("  docs: the README's section 'What ampguard does'; an installed copy is the package description, "
                     "importlib.metadata.metadata('ampguard')['Description']")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<ampguard.Guard {self.options}>"


_last_rank = ""  # the label while the process group was last up (see _remember_rank)


def _live_rank_label() -> str:
    """`` (rank 1 of 2)`` while a process group of more than one rank is up, else ""."""
    try:
        if _sync.distributed():
            dist = _sync.process_group()
            return f" (rank {dist.get_rank()} of {dist.get_world_size()})"
    except Exception:
        pass
    return ""


def _rank_label() -> str:
    """`` (rank 1 of 2)`` in a distributed run, so the reports of several processes can be told apart."""
    label = _live_rank_label() or _last_rank
    if label:
        return label
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")  # (Lightning's ddp sets no RANK)
    return f" (rank {rank} of {world})" if rank is not None and world not in (None, "1") else ""


def _remember_rank(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A program destroys its process group just before it exits, as PyTorch asks: keep the rank for the
    exit report, which runs after."""
    global _last_rank
    _last_rank = _live_rank_label() or _last_rank  # (it never raises: never in the way of the user's teardown)
    return wrapped(*args, **kwargs)


for _module in ("torch.distributed", "torch.distributed.distributed_c10d"):  # the name users call, and its home
    REGISTRY.add(Target("torch", _module, "destroy_process_group", _remember_rank,
                        "keep the rank for the exit report: the process group is usually gone by then"))


# -- installation state ------------------------------------------------------------------
# install() is process-wide; a guard() block belongs to the thread that entered it. The patches
# stay in place while any guard anywhere needs them, and each hook asks current() for the guard
# of the thread it runs in.
_lock = threading.RLock()
_installed: Guard | None = None  # install()'s guard, for every thread without a block of its own
_blocks: dict[int, list[Guard]] = {}  # thread id -> the guard() blocks open in it, innermost last
_backward_guard: Guard | None = None  # a guarded thread's backward: autograd's worker threads use its guard


class _Local(threading.local):
    guard: Guard | None = None  # this thread's innermost guard() block


_LOCAL = _Local()
# install()'s guard's features while no guard() block is open in any thread, else empty: current()'s one lookup there.
# Kept by _installed_changed() wherever _installed, _blocks or that guard's features change; emptied before a block
# opens. Stale only where it is harmless: cleared as _installed goes, current() returns _installed, which is None then.
_installed_on: frozenset[str] = frozenset()


def _installed_changed() -> None:
    global _installed_on
    _installed_on = _installed._on if _installed is not None and not _blocks else frozenset()


_replays = [0]  # replays running now, in any thread (a replay's backward runs hooks in autograd's device threads)
_replays_lock = threading.Lock()  # (two threads' replays at once: a lost update would leave replaying() true)


def replay_counted(delta: int) -> None:
    """A replay begins (+1) or ends (-1)."""
    with _replays_lock:
        _replays[0] += delta


def replaying() -> bool:
    """Whether ampguard is replaying a call now. A replay runs your module hooks as the call did (a pre-hook that
    normalizes the input must), and runs where no error follows too: check_unscaled_after's replay of a GradScaler
    skip streak, and a gradient penalty's overflow. A hook with effects outside its module (one that logs, or
    appends to a list) can return early where this is true. In any thread: on a GPU, a replay's backward runs
    backward hooks in autograd's device threads."""
    return _replays[0] > 0


def active() -> Guard | None:
    """The Guard in force in this thread: its innermost ``guard()`` block's, else the installed one, or None."""
    g = _LOCAL.guard if _blocks else None  # (no block open in any thread: no read of this thread's, see current())
    if g is None:
        g = _backward_guard if _backward_guard is not None and _in_backward() else _installed
    return g


def current(feature: str) -> Guard | None:
    """The Guard in force in this thread if ``feature`` is on there; the cheap check every patch starts with. Where no
    guard() block is open in any thread (install(), AMPGUARD=1), a feature install()'s guard has on is one set lookup
    (_installed_on): some 14 times a small step, the full lookup was 20 bytecodes a call."""
    if feature in _installed_on:
        return _installed
    g = _LOCAL.guard if _blocks else None
    if g is None:
        g = _backward_guard if _backward_guard is not None and _in_backward() else _installed
    return g if g is not None and feature in g._on else None


def _in_backward() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch._C._current_graph_task_id() != -1


_fallback.active_guard = active  # the fallback sits below the registry and asks up through this


def _live() -> list[Guard]:
    return ([_installed] if _installed is not None else []) + [g for stack in _blocks.values() for g in stack]


# Not an option: "on" while a guard() block is open in some thread. Only a block's guard needs _backward_owner, so
# install() and AMPGUARD=1 runs pay no wrapper on every backward() for it.
BLOCKS = "guard() blocks"


def _update_switches() -> None:
    """Global hooks follow the features some live guard has on (each hook then asks current())."""
    _installed_changed()
    on = frozenset().union(*(g._on for g in _live()))
    REGISTRY.set_features(on | {BLOCKS} if _blocks else on)


def _ensure_installed() -> None:
    if not REGISTRY.installed:
        REGISTRY.install()  # the features declared themselves: ampguard._features imported them


def _uninstall_if_unused() -> None:
    if not _live():
        REGISTRY.uninstall()
    _update_switches()


def _backward_owner(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A backward started in a thread with a guard() block: hooks on autograd's worker threads use that guard."""
    global _backward_guard
    g = _LOCAL.guard if _blocks else None  # (see current())
    if g is None:
        return wrapped(*args, **kwargs)
    outer, _backward_guard = _backward_guard, g
    try:
        return wrapped(*args, **kwargs)
    finally:
        _backward_guard = outer


REGISTRY.add(Target("torch", "torch.autograd", "backward", _backward_owner,
                    "hooks that run on autograd's worker threads belong to the guard of the thread that started it",
                    feature=BLOCKS))


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


UNSET: Any = _Unset()  # an option not passed (None is a value: max_consecutive_skips=None, devices=None)

_OPTION_DOCS = """
    Options (each also an ``AMPGUARD_<OPTION>`` variable; a keyword wins over the variable):

    - ``schedulers`` (bool, True): hold an LR scheduler's step() for steps GradScaler skipped.
    - ``max_consecutive_skips`` (positive int or None, 32): raise LossScaleCollapseError after
      this many skipping updates in a row (None: never by count; the scale may never reach 0).
    - ``check_unscaled_after`` (positive int or None, 3): after this many skips in a row, replay
      the backward at scale 1 (and, where an op is NaN/Inf there, at the lowest scale GradScaler tries before the
      streak is stopped) and raise NonFiniteError if an op makes NaN/Inf gradients at every scale it tries, on
      that skipped step and the next (one bad batch only skips, as without ampguard).
    - ``distributed`` (bool, True): every rank takes the same skip decision (one all-reduce).
    - ``closures`` (bool, True): give a Lightning optimizer_step that forgot its closure the closure.
    - ``lint`` (bool, True): warn once about AMP mistakes that do not crash.
    - ``nonfinite`` ('raise', 'warn', 'skip' or 'off'): what a NaN/Inf at a sink does; 'skip' skips
      the optimizer step whose loss or gradients it reached (schedulers held) and warns once per origin.
    - ``trace`` ('replay', 'eager' or 'off'): how its origin is found ('deferred' = 'replay').
    - ``devices`` (None or device types such as ('cuda',)): which tensors are watched.
    - ``repro_dir`` (None or a folder): write a reproducer bundle there on a NaN/Inf, for
      ``python -m ampguard repro``; ``repro_max_mb`` (256): the largest bundle written.

    A wrong name or value raises ConfigError naming the option and the accepted values.
"""


def _given(options: dict[str, Any], unknown: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in options.items() if v is not UNSET}, **unknown}


def install(*, schedulers: bool = UNSET, max_consecutive_skips: int | None = UNSET,
            check_unscaled_after: int | None = UNSET, distributed: bool = UNSET,
            closures: bool = UNSET, lint: bool = UNSET, nonfinite: str = UNSET, trace: str = UNSET,
            devices: str | tuple[str, ...] | None = UNSET, repro_dir: str | None = UNSET,
            repro_max_mb: float = UNSET, **unknown: Any) -> Guard:
    """Patch torch (and Lightning when the program imports it) process-wide; return the active Guard.

    Call it first, before building the model. A second call while installed never wraps twice:
    it changes only the options it names, on the active guard, and keeps the others as they
    are (``install()`` with no argument changes nothing). ``uninstall()`` then ``install()``
    starts from the defaults and the environment again.
    """
    options = _given({"schedulers": schedulers, "max_consecutive_skips": max_consecutive_skips,
                      "check_unscaled_after": check_unscaled_after,
                      "distributed": distributed, "closures": closures, "lint": lint, "nonfinite": nonfinite,
                      "trace": trace, "devices": devices, "repro_dir": repro_dir,
                      "repro_max_mb": repro_max_mb}, unknown)
    global _installed
    try:
        with _lock:
            if _installed is None:
                resolved = _options.resolve(options)  # a rejected option changes nothing: checked before patching
                _ensure_installed()
                _installed = Guard(resolved)
            else:
                _installed.options = _installed.options.replace(**options)
            _update_switches()
            return _LOCAL.guard or _installed  # inside a guard() block of this thread, that block's guard
    except _options.ConfigError as error:
        raise error.with_traceback(None) from None  # a usage error: the traceback ends at your call


install.__doc__ = (install.__doc__ or "") + _OPTION_DOCS


def uninstall() -> None:
    """Read the checks still pending (raising NonFiniteError if one failed), then put back every
    patched attribute, identical (``is``) to the original. Safe to call when not installed."""
    global _installed
    with _lock:
        g = _installed
        if g is None and not REGISTRY.dirty:
            return  # (dirty: an interrupted install or uninstall left something to finish)
        try:
            if g is not None and active() is g:
                _settle(g, error=False)  # checks no step consumed are read before the guard goes
        except AmpGuardError as intended:
            raise intended.with_traceback(None) from None  # the traceback ends at your uninstall() call
        finally:
            _installed = None
            _uninstall_if_unused()


def _settle(g: Guard | None, error: bool, leaving: BaseException | None = None) -> None:
    """Read the checks still pending in ``g`` (raising if one failed), or drop them if an error is leaving; that
    error (``leaving``) carries the origin of one that fails."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    sinks = sys.modules.get("ampguard.nonfinite.sinks")
    if g is not None and sinks is not None:
        sinks.settle(g, error, leaving)


_F = TypeVar("_F", bound=Callable[..., Any])


@overload
def guard(function: _F, /) -> _F: ...


@overload
def guard(function: None = None, /, *, schedulers: bool = ..., max_consecutive_skips: int | None = ...,
          check_unscaled_after: int | None = ..., distributed: bool = ..., closures: bool = ..., lint: bool = ...,
          nonfinite: str = ..., trace: str = ..., devices: str | tuple[str, ...] | None = ...,
          repro_dir: str | None = ..., repro_max_mb: float = ..., **unknown: Any) -> GuardBlock: ...


def guard(function: Callable[..., Any] | None = None, /, *, schedulers: bool = UNSET,
          max_consecutive_skips: int | None = UNSET, check_unscaled_after: int | None = UNSET,
          distributed: bool = UNSET, closures: bool = UNSET, lint: bool = UNSET, nonfinite: str = UNSET,
          trace: str = UNSET, devices: str | tuple[str, ...] | None = UNSET, repro_dir: str | None = UNSET,
          repro_max_mb: float = UNSET, **unknown: Any) -> Any:
    """A block under a guard of its own: fresh counters, these options on top of the outer guard's
    (or of the environment and defaults), and exactly the state from before on exit.

    On a normal exit the checks still pending are read (a NaN the block made raises here); if an
    exception leaves the block, they are dropped and that exception is the one you see. As a
    decorator (``@ampguard.guard`` or ``@ampguard.guard(...)``) it guards each call; a generator
    function is guarded while it runs, to its end.
    """
    if function is not None and not callable(function):
        raise TypeError(f"ampguard.guard() takes its options as keywords (guard(nonfinite='skip')); it was given "
                        f"{function!r} as its one positional argument, which only a function to decorate can be")
    block = GuardBlock(_given({"schedulers": schedulers, "max_consecutive_skips": max_consecutive_skips,
                              "check_unscaled_after": check_unscaled_after, "distributed": distributed,
                              "closures": closures, "lint": lint, "nonfinite": nonfinite, "trace": trace,
                              "devices": devices, "repro_dir": repro_dir, "repro_max_mb": repro_max_mb}, unknown))
    return block if function is None else block(function)


class GuardBlock(contextlib.ContextDecorator):
    """What :func:`guard` returns: a ``with`` block, or a decorator. A plain decorator (ContextDecorator's) would
    leave a generator function unguarded: its call only makes the generator, and the body runs after the block
    has ended, so a training loop written as a generator ran without any check and said nothing."""

    def __init__(self, options: dict[str, Any]) -> None:
        self._options = options
        # thread id -> the blocks this object entered there and has not left (it may be entered again, in a thread
        # or in several: each thread leaves its own)
        self._open: dict[int, list[Any]] = {}

    def _recreate_cm(self) -> GuardBlock:
        return GuardBlock(self._options)

    def __enter__(self) -> Guard:
        block = _block(self._options)
        try:
            g = block.__enter__()
        except AmpGuardError as intended:
            raise intended.with_traceback(None) from None  # the traceback starts here: one frame of ampguard's
        self._open.setdefault(threading.get_ident(), []).append(block)
        return g

    def __exit__(self, *exc: Any) -> bool:
        ident = threading.get_ident()
        mine = self._open[ident]
        block = mine.pop()
        if not mine:
            del self._open[ident]
        try:
            return bool(block.__exit__(*exc))
        except AmpGuardError as intended:
            if intended is exc[1]:
                raise  # the block's own error, passing through
            raise intended.with_traceback(None) from None  # the block's exit is the one frame of ampguard's

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"ampguard.guard() cannot decorate the async function {getattr(func, '__qualname__', func)!r}: a "
                "guard belongs to a thread, and the event loop runs other tasks in it while this one awaits. Use "
                "`with ampguard.guard():` around the synchronous training code, or ampguard.install().")
        if inspect.isgeneratorfunction(func):
            @functools.wraps(func)
            def guarded(*args: Any, **kwargs: Any) -> Any:
                with self._recreate_cm():
                    return (yield from func(*args, **kwargs))

            return guarded
        return super().__call__(func)


@contextlib.contextmanager
def _block(options: dict[str, Any]) -> Iterator[Guard]:
    """One guard() block, entered and left once (a GuardBlock makes one per entry)."""
    ident = threading.get_ident()
    g: Guard | None = None
    error = True
    leaving: BaseException | None = None
    try:  # from the first step on: an interrupt anywhere in entering is undone by the finally below
        with _lock:
            outer = active()
            try:
                resolved = outer.options.replace(**options) if outer is not None else _options.resolve(options)
            except _options.ConfigError as exc:
                raise exc.with_traceback(None) from None  # checked before patching: nothing to undo
            _ensure_installed()
            g = Guard(resolved)
            global _installed_on
            _installed_on = frozenset()  # (before the block is open: from here on current() asks which guard)
            _blocks.setdefault(ident, []).append(g)
            _LOCAL.guard = g
            _update_switches()
        yield g
        error = False
    except Exception as exc:  # (re-raised as it came; a pending check's origin rides on it)
        leaving = exc
        raise
    finally:
        with _lock:
            stack = _blocks.get(ident, [])
            try:
                if g is not None and _LOCAL.guard is g:
                    _settle(g, error, leaving)
            except AmpGuardError as intended:
                raise intended.with_traceback(None) from None  # the block's exit is the one frame of ampguard's
            finally:
                if g in stack:
                    stack.remove(g)
                _LOCAL.guard = stack[-1] if stack else None
                if not stack:
                    _blocks.pop(ident, None)
                _uninstall_if_unused()


guard.__doc__ = (guard.__doc__ or "") + _OPTION_DOCS


class Depth(threading.local):
    """Per-thread nesting counters: a patched override that calls super() decides once, outermost."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def outermost(self, key: str, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Call ``wrapped`` marked as inside ``key``; nested calls see the mark and pass through."""
        counts = self.counts
        counts[key] = 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            counts[key] = 0


DEPTH = Depth()
