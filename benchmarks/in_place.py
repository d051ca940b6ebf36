"""What a piece of ampguard's normal path costs in place: variants timed call by call inside real steps.

On a small step an op or a Python call costs several times its tight-loop time (the step's own work
has just evicted it from the caches), and the machine's noise is larger than a change of a few
percent to a whole step. So this times one ampguard function's call itself, inside the real step,
and alternates the variants step by step: each sees the same steps, the same caches and the same
moment of the machine's drift. Where a step makes the call several times (an RL step calls two
networks), each call of the step is its own row. Each figure is the median over all calls (the
first 50 dropped, or half of a short run's).

Two experiments, each a status that ampguard reads at once on the CPU:

- a gradient sink at an optimizer step (``sinks._add_grads``: the gradients found, their statuses taken and
  read on the CPU), with the statuses taken as ampguard takes them (a small gradient's few values read as
  Python floats, a sum of each other one, the small ones a buffer at a time), as sums alone (before the few
  values), and as the foreach 2-norm (before the sums; with the buffers' 2-norm). Workloads: the Lightning
  fit of overhead.py (two small gradients), and plain SGD loops of Linear layers;
- an inference output's status, as the whole end of its outermost call (``sinks.exit``): its few
  values read as Python floats, its sum, and its 2-norm, on overhead.py's RL rollout (a policy and a
  value MLP per step).

    python benchmarks/in_place.py
    python benchmarks/in_place.py --quick       # seconds: a smoke run for the tests
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # (the Lightning workload)
import torch

import ampguard
from ampguard import _sync
from ampguard.nonfinite import outermost, sinks

SKIP = 50  # calls dropped at the start of each run (warming up)


def two_norm_statuses(grads: list) -> tuple[list, list]:
    """The gradient statuses as ampguard took them before: the foreach 2-norm, small tensors buffered by 16s (taken
    here, where the read took them then, so that the call timed holds them as it holds the others)."""
    if not grads[0].is_cpu or not _sync.HOST_READS:
        return [], grads
    if len(grads) < sinks.FEW:
        return sinks._norms(grads), []
    tensor, dtype = torch.Tensor, grads[0].dtype
    buffers, chunk, size, rest = [], [], 0, []
    for g in grads:
        n = g.numel()
        if n <= sinks.SMALL and g.dtype is dtype and type(g) is tensor and g.is_cpu:
            chunk.append(g)
            size += n
            if size >= sinks.CHUNK:
                buffers.append(chunk)
                chunk, size = [], 0
        else:
            rest.append(g)
    if len(chunk) >= sinks.FEW:
        buffers.append(chunk)
    else:
        rest.extend(chunk)
    flatten = torch._C._nn.flatten_dense_tensors
    return [sinks.norm(flatten(b)) for b in buffers] + (sinks._norms(rest) if rest else []), []


AMPGUARD = sinks._gradient_statuses
GRADIENTS = {
    "values and sums (ampguard)": {"_gradient_statuses": AMPGUARD, "FEW_ELEMENTS": sinks.FEW_ELEMENTS},
    "sums (before)": {"_gradient_statuses": AMPGUARD, "FEW_ELEMENTS": 0},
    "foreach 2-norm (earlier)": {"_gradient_statuses": two_norm_statuses, "FEW_ELEMENTS": 0},
}
OUTPUTS = {
    "values (ampguard)": {"sum_status": sinks.sum_status, "FEW_ELEMENTS": sinks.FEW_ELEMENTS},
    "sum (before)": {"sum_status": sinks.sum_status, "FEW_ELEMENTS": 0},
    "2-norm (earlier)": {"sum_status": sinks.norm, "FEW_ELEMENTS": 0},
}


def alternated(run: Any, owner: Any, name: str, variants: dict, per_step: int) -> dict:
    """ns per call of ``owner.name`` while ``run()`` trains under a guard, with the attributes of ``sinks`` that each
    of ``variants`` names set to its values in turn, changed every ``per_step`` calls (a step); keyed (variant,
    which call of the step)."""
    times: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    names, calls, clock = list(variants), itertools.count(), time.perf_counter_ns
    chosen = {attribute: getattr(sinks, attribute) for settings in variants.values() for attribute in settings}
    with ampguard.guard():  # (first: the outermost call's exit is bound to its hooks as they switch on)
        function = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            n = next(calls)
            variant = names[n // per_step % len(names)]
            for attribute, value in variants[variant].items():
                setattr(sinks, attribute, value)
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                times[variant, n % per_step].append(clock() - start)

        setattr(owner, name, timed)
        try:
            run()
        finally:
            setattr(owner, name, function)
            for attribute, value in chosen.items():
                setattr(sinks, attribute, value)
    return times


def gradient_statuses(run: Any) -> dict:
    return alternated(run, sinks, "_add_grads", GRADIENTS, 1)


def output_statuses(steps: int) -> dict:
    """The rollout's two calls a step; ``exit`` is what the outermost call's hook calls."""
    step = overhead.rollout()

    def run() -> None:
        for _ in range(steps):
            step()

    return alternated(run, outermost.H, "exit", OUTPUTS, 2)


def median_us(values: list[int]) -> float:
    return statistics.median(values[min(SKIP, len(values) // 2):]) / 1e3


def linear_loop(layers: int, width: int, steps: int) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(8, width)

    def run() -> None:
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = 0.02 if args.quick else 1.0
    fit = overhead.lightning_fit()
    runs = [("Lightning fit, one Linear(8, 1): 2 tensors", lambda: fit(max(60, int(3000 * scale))))]
    for layers, width, steps in [(10, 128, 400), (100, 8, 400), (6, 1024, 60), (3, 2048, 60)]:
        runs.append((f"{layers} x Linear({width}, {width}): {2 * layers} tensors",
                     linear_loop(layers, width, max(8, int(steps * scale)))))
    print(f"ampguard {ampguard.__version__}, torch {torch.__version__}, 1 torch thread; median us a call, variants "
          "alternated step by step")
    print("\na gradient sink at the step: its statuses and their reads (sinks._add_grads)")
    print(f"  {'workload':44s}" + "".join(f"{name:>28s}" for name in GRADIENTS))
    for title, run in runs:
        times = gradient_statuses(run)
        print(f"  {title:44s}" + "".join(f"{median_us(times[name, 0]):>25.1f} us" for name in GRADIENTS))
    print("\nan inference output's status: the end of its outermost call (sinks.exit), RL rollout")
    print(f"  {'call':44s}" + "".join(f"{name:>28s}" for name in OUTPUTS))
    times = output_statuses(max(60, int(8000 * scale)))
    for which, title in enumerate(("policy MLP 8-64-64-4", "value MLP 8-64-1")):
        print(f"  {title:44s}" + "".join(f"{median_us(times[name, which]):>25.1f} us" for name in OUTPUTS))


if __name__ == "__main__":
    main()
