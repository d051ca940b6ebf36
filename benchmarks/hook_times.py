"""Where ampguard's time goes on a small step, measured in place: each entry point's own time.

``where_time_goes.py`` samples from outside and needs py-spy; ``instructions.py`` counts what runs
but not what it costs there. This wraps every ampguard entry point (each patch's wrapper, the module
and optimizer hooks, the closure proxy) in a timer and subtracts the time of what it calls of the
user's, torch's or Lightning's (the wrapped method, the closure). So each row is ampguard's own time
in that entry point per step, on a real step, with its cold caches: on these steps an op or a Python
call that ampguard adds costs two to four times what it costs in a tight loop.

What the rows do not hold is the rest of what ampguard adds: torch's dispatch to the loss-code
recorder, the module-hook path of the outermost call, wrapt's binding; ``overhead.py`` measures the
whole. The timers cost some 0.5 us a call; that is measured and taken off each row. The plain and
instrumented step times are one run each, for orientation only.

    python benchmarks/hook_times.py                          # the tiny AMP loop, the default
    python benchmarks/hook_times.py --workload lightning --config off
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # (the workloads)
import torch

from ampguard import _patching, lints, schedulers
from ampguard.nonfinite import outermost, sinks

CONFIGS = {"default": {}, "off": {"nonfinite": "off"}, "trace-off": {"trace": "off"}}

# The entry points that are not a patch's wrapper: torch calls them as hooks (registered when a feature
# switches on, so replacing the module attribute first is enough), or the user's optimizer calls the proxy.
HOOKS = [(outermost, "_global_pre"), (outermost, "_instance_pre"), (outermost, "_instance_post"),
         (sinks, "optimizer_pre_step"), (sinks, "optimizer_post_step"), (schedulers, "_optimizer_post_step"),
         (lints, "_first_step"), (sinks._CheckedClosure, "__call__"),
         (sinks, "_record")]  # the loss-code record of one op, called by the recorder's __torch_function__

_own: collections.Counter = collections.Counter()  # entry point -> ns of its own
_calls: collections.Counter = collections.Counter()
_stack: list[int] = []  # per open timed call: ns spent in timed calls below it
_clock = time.perf_counter_ns


def _timed(name: str | None, fn: Any, args: tuple, kwargs: dict) -> Any:
    """Call ``fn``; charge its time less what ran below it to ``name`` (None: the user's, charged to nobody)."""
    _stack.append(0)
    start = _clock()
    try:
        return fn(*args, **kwargs)
    finally:
        spent = _clock() - start
        below = _stack.pop()
        if _stack:
            _stack[-1] += spent
        if name is not None:
            _own[name] += spent - below
            _calls[name] += 1


def _user(fn: Any) -> Any:
    """What an entry point calls of the user's (or torch's): excluded from the entry point's time."""
    return functools.wraps(fn)(lambda *args, **kwargs: _timed(None, fn, args, kwargs))


def _entry(name: str, fn: Any, wrapper: bool = False) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        if wrapper:  # wrapt's signature: (wrapped, instance, args, kwargs); wrapped is torch's method
            args = (_user(args[0]), *args[1:])
        return _timed(name, fn, args, kwargs)

    return functools.wraps(fn)(timed)


def instrument() -> None:
    """Before any install: the registry wraps with ``Target.wrapper``, the switches register these names."""
    for i, target in enumerate(_patching.REGISTRY._targets):
        if target.owner == "warnings":
            continue  # (its stacklevel correction counts frames: a timer's would move the warning's line)
        name = f"{target.owner.rpartition(':')[2] or target.owner}.{target.name} ({target.wrapper.__module__})"
        _patching.REGISTRY._targets[i] = dataclasses.replace(target, wrapper=_entry(name, target.wrapper, wrapper=True))
    for owner, attr in HOOKS:
        setattr(owner, attr, _entry(f"{getattr(owner, '__name__', owner)}.{attr}", getattr(owner, attr)))
    closure_init = sinks._CheckedClosure.__init__

    def init(self: Any, g: Any, optimizer: Any, closure: Any) -> None:
        closure_init(self, g, optimizer, _user(closure))  # the user's closure: forward and backward

    sinks._CheckedClosure.__init__ = init


def _timer_cost() -> float:
    """ns one timed call adds around its entry point (taken off each row, per call)."""
    noop = _entry("calibration", lambda: None)
    for _ in range(1000):
        noop()
    start = _clock()
    for _ in range(20000):
        noop()
    total = (_clock() - start) / 20000
    start = _clock()
    for _ in range(20000):
        (lambda: None)()
    _own.pop("calibration", None)
    _calls.pop("calibration", None)
    return max(total - (_clock() - start) / 20000, 0.0)


def run(workload: str, options: dict | None, steps: int) -> tuple[float, int]:
    """The median step in us, plain (``options`` None) or under install(**options), and the steps the rows count."""
    scope = overhead.installed(**options) if options is not None else contextlib.nullcontext()
    if workload == "lightning":
        fit = overhead.lightning_fit()
        with scope:
            fit(8)
            _own.clear()
            _calls.clear()
            return fit(steps + 5) * 1e6, steps + 5  # (its clock skips the first 5; the rows count them)
    step = overhead.tiny()
    with scope:
        for _ in range(20):
            step()
        _own.clear()
        _calls.clear()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("tiny", "lightning"), default="tiny")
    parser.add_argument("--config", choices=tuple(CONFIGS), default="default")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_call = _timer_cost()
    plain, _ = run(args.workload, None, args.steps)
    instrument()
    guarded, steps = run(args.workload, CONFIGS[args.config], args.steps)
    print(f"{args.workload}, {args.config}: {steps} steps; median step {plain:.1f} us plain, {guarded:.1f} us "
          f"instrumented (timers: {per_call:.0f} ns a call, taken off below)")
    total = 0.0
    rows = sorted(_own, key=lambda k: -_own[k])
    for name in rows:
        us = max(_own[name] - per_call * _calls[name], 0.0) / steps / 1e3
        total += us
        print(f"  {us:7.2f} us/step  {_calls[name] / steps:5.2f} calls/step  {name}")
    print(f"ampguard's entry points: {total:.1f} us a step in all. Not in the rows: torch's dispatch to the "
          "loss-code recorder, the outermost call's hook path, wrapt's binding (overhead.py measures the whole)")


if __name__ == "__main__":
    main()
