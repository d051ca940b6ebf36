"""What a piece of ampguard's normal path costs in place: variants timed call by call inside real steps.

On a small step an op or a Python call costs several times its tight-loop time (the step's own work
has just evicted it from the caches), and the machine's noise is larger than a change of a few
percent to a whole step. So this times one ampguard function's call itself, inside the real step,
and alternates the variants call by call: each sees the same step, the same caches and the same
moment of the machine's drift. Each figure is the median over all calls (the first 50 dropped,
or half of a short run's).

The one experiment here: a gradient sink's statuses on the CPU (``sinks._statuses``, their host
reads included), taken as ampguard takes them (a sum of each gradient, the small ones a buffer at a
time) against the foreach 2-norm it took before (with the buffers' 2-norm). Workloads: the
Lightning fit of overhead.py (two small gradients), and plain SGD loops of Linear layers.

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
from ampguard.nonfinite import sinks

SKIP = 50  # calls dropped at the start of each run (warming up)


def two_norm_statuses(grads: list) -> tuple[list, list]:
    """The gradient statuses as ampguard took them before: the foreach 2-norm, small tensors buffered by 16s."""
    if len(grads) < sinks.FEW or not grads[0].is_cpu or not _sync.HOST_READS:
        return [], grads
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
    return [sinks.norm(flatten(b)) for b in buffers], rest


VARIANTS = {"sums (ampguard)": sinks._gradient_statuses, "foreach 2-norm (before)": two_norm_statuses}


def timed_statuses(run: Any) -> dict[str, list[int]]:
    """ns per ``_statuses`` call under each variant, alternated call by call, while ``run()`` trains."""
    names = itertools.cycle(VARIANTS)
    times: dict[str, list[int]] = collections.defaultdict(list)
    statuses, chosen, clock = sinks._statuses, sinks._gradient_statuses, time.perf_counter_ns

    def timed(g: Any) -> Any:
        name = next(names)
        sinks._gradient_statuses = VARIANTS[name]
        start = clock()
        try:
            return statuses(g)
        finally:
            times[name].append(clock() - start)

    sinks._statuses = timed
    try:
        with ampguard.guard():
            run()
    finally:
        sinks._statuses, sinks._gradient_statuses = statuses, chosen
    return times


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
    print(f"ampguard {ampguard.__version__}, torch {torch.__version__}, 1 torch thread; median us per step's "
          f"statuses and reads, variants alternated call by call")
    print(f"  {'workload':44s}" + "".join(f"{name:>26s}" for name in VARIANTS))
    for title, run in runs:
        times = timed_statuses(run)
        cells = "".join(f"{statistics.median(times[name][min(SKIP, len(times[name]) // 2):]) / 1e3:>23.1f} us"
                        for name in VARIANTS)
        print(f"  {title:44s}{cells}")


if __name__ == "__main__":
    main()
