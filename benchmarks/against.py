"""One of ampguard's functions against its code at an earlier commit, timed in place inside real steps.

A change of a few microseconds a step is below what whole steps separate on a busy machine (their spread between
interleaved runs is a few percent). Timed around the function itself, inside the steps, with the two versions
alternated step by step in one process, it is not: both versions run with the same cold caches, on the same
arguments, under the same load. The function's code object is swapped, so every caller (torch's hook dicts, the
patches' wrappers, ampguard's own calls) runs the version of that step; the earlier code runs with this tree's
module globals, so it must still fit them (a function that calls one since renamed cannot be timed this way).

    python benchmarks/against.py b59db44 ampguard.nonfinite.sinks:exit --workload lightning
    python benchmarks/against.py HEAD~3 ampguard.nonfinite.sinks:_add_grads --workload lightning --steps 5000
    python benchmarks/against.py HEAD ampguard.schedulers:_resolve --option nonfinite=off

``--per-step``: the calls of the function a step (the tiny loop's loss code records 3 ops: ``_record`` is called 3
times), so that the versions alternate by step, and each gets a step's first, coldest call as often. Times are
ampguard's own for that function and whatever it calls, the user's and torch's included (a wrapper's wrapped call).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import pathlib
import statistics
import subprocess
import sys
import time
import types
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # (the workloads)
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKLOADS = ("tiny", "sgd", "rollout", "lightning", "lightning-log")
_NAME = "_against_alternate"  # the timer, in the timed function's globals while it runs


def base_code(commit: str, module: Any, qualname: str) -> types.CodeType:
    """The code object of ``qualname`` in ``module``'s source at ``commit``."""
    try:
        path = pathlib.Path(module.__file__).resolve().relative_to(ROOT)
    except ValueError:
        raise SystemExit(f"against.py: {module.__name__} is imported from {module.__file__}, not from this checkout: "
                         "install it editable (pip install -e .) to time its code against a commit") from None
    source = subprocess.run(["git", "show", f"{commit}:{path.as_posix()}"], cwd=ROOT, capture_output=True,
                            text=True)
    if source.returncode != 0:
        raise SystemExit(f"against.py: git cannot show {path} at {commit}: {source.stderr.strip()}")
    pending = [compile(source.stdout, str(path), "exec")]
    while pending:
        code = pending.pop()
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                # (Python 3.10 has no co_qualname: there a name matches its last part)
                if getattr(const, "co_qualname", None) == qualname or \
                        (not hasattr(const, "co_qualname") and const.co_name == qualname.rpartition(".")[2]):
                    return const
                pending.append(const)
    raise SystemExit(f"against.py: no function {qualname} in {path} at {commit}")


def target(spec: str) -> tuple[Any, types.FunctionType, str]:
    """(module, function, qualname) of ``module:qualname``; a fail-safe hook's own function, not its wrapper."""
    name, _, qualname = spec.partition(":")
    try:
        module = importlib.import_module(name)
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"against.py: no function {spec!r} in this tree ({exc}); give module:qualname, e.g. "
                         "ampguard.nonfinite.sinks:exit") from None
    fn = getattr(obj, "__wrapped__", obj)
    if not isinstance(fn, types.FunctionType):
        raise SystemExit(f"against.py: {spec} is not a Python function")
    return module, fn, qualname


def timed_steps(fn: types.FunctionType, old: types.CodeType, per_step: int, run: Any) -> dict[str, list[int]]:
    """ns per call of ``fn`` while ``run()`` trains, its code and ``old`` alternated every ``per_step`` calls."""
    if fn.__code__.co_freevars or old.co_freevars:
        raise SystemExit(f"against.py: {fn.__qualname__} is a closure; only a function without one can be timed")
    versions = {name: types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
                for name, code in (("base", old), ("this tree", fn.__code__))}
    for copy in versions.values():
        copy.__kwdefaults__ = fn.__kwdefaults__
    times: dict[str, list[int]] = collections.defaultdict(list)
    calls, inside, clock, names = [0], [None], time.perf_counter_ns, list(versions)

    def alternate(*args: Any, **kwargs: Any) -> Any:
        if inside[0] is not None:  # a call of itself (weak() through _weak_one): the outer call's version, untimed
            return versions[inside[0]](*args, **kwargs)
        name = inside[0] = names[calls[0] // per_step % 2]
        calls[0] += 1
        start = clock()
        try:
            return versions[name](*args, **kwargs)
        finally:
            times[name].append(clock() - start)
            inside[0] = None

    # A trampoline as the function's code: every holder of the function object calls alternate(), found in the
    # function's module globals (where its code looks names up) while the run lasts.
    scope: dict = {}
    exec(f"def _trampoline(*args, **kwargs):\n    return {_NAME}(*args, **kwargs)", scope)
    own = fn.__code__
    fn.__globals__[_NAME] = alternate
    fn.__code__ = scope["_trampoline"].__code__
    try:
        run(lambda: times.clear())
    finally:
        fn.__code__ = own
        del fn.__globals__[_NAME]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the commit whose code the function is timed against (HEAD, a hash)")
    parser.add_argument("function", help="module:qualname, e.g. ampguard.nonfinite.sinks:exit")
    parser.add_argument("--workload", default="tiny", choices=WORKLOADS)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--per-step", type=int, default=1, help="calls of the function a step (default 1)")
    parser.add_argument("--option", action="append", default=[], help="an install() option, name=value")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    options = dict(item.split("=", 1) for item in args.option)
    torch.set_num_threads(args.threads)
    module, fn, qualname = target(args.function)
    old = base_code(args.base, module, qualname)
    warnings.simplefilter("ignore")

    def run(reset: Any) -> None:
        with overhead.installed(**options):
            if args.workload.startswith("lightning"):
                fit = overhead.lightning_fit(log=args.workload == "lightning-log")
                fit(20)
                reset()
                fit(args.steps)
            else:
                step = getattr(overhead, args.workload)()
                for _ in range(20):
                    step()
                reset()
                for _ in range(args.steps):
                    step()

    times = timed_steps(fn, old, args.per_step, run)
    print(f"{args.function} on {args.workload}, {args.steps} steps, versions alternated every {args.per_step} "
          f"call(s) ({torch.__version__}, {overhead.DEVICE}):")
    medians = {}
    for name in ("base", "this tree"):
        ts = times.get(name)
        if not ts:
            raise SystemExit(f"against.py: {args.function} was not called on {args.workload}")
        medians[name] = statistics.median(ts) / 1e3
        print(f"  {name:10s} median {medians[name]:8.2f} us  mean {statistics.mean(ts) / 1e3:8.2f} us  "
              f"({len(ts)} calls)")
    print(f"difference: {medians['this tree'] - medians['base']:+.2f} us a call (this tree - {args.base})")


if __name__ == "__main__":
    main()
