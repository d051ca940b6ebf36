"""ampguard's cost on small steps in Python bytecodes, per function: deterministic, and in seconds.

On small steps ampguard's cost is Python interpreter work (see the README's Performance section), so
the count of bytecodes it runs per step, and where, says what a change to its code moves. This counts
every bytecode executed inside the measured steps with ``sys.monitoring`` (Python 3.12 or later) and
attributes each to its function. Counts repeat exactly between runs; counting slows the steps some
hundredfold, so time nothing here. ``instructions.py`` (valgrind) counts machine instructions instead,
torch's C++ included.

    python benchmarks/bytecodes.py                          # tiny loop: plain, nonfinite='off', default
    python benchmarks/bytecodes.py --workload lightning --top 30
    python benchmarks/bytecodes.py --workload lightning-log     # training_step logs the loss and the LR
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS: dict[str, dict[str, Any] | None] = {"plain": None, "nonfinite='off'": {"nonfinite": "off"},
                                             "install() (default)": {}}
TOOL = 5  # a sys.monitoring tool id that debuggers, profilers and coverage do not take


class Counter:
    """Bytecodes and calls per code object, while on."""

    def __init__(self) -> None:
        self.bytecodes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        mon = sys.monitoring
        mon.use_tool_id(TOOL, "ampguard-bytecodes")
        mon.register_callback(TOOL, mon.events.INSTRUCTION, self._instruction)
        mon.register_callback(TOOL, mon.events.PY_START, self._start)

    def _instruction(self, code: Any, offset: int) -> None:
        self.bytecodes[code] += 1

    def _start(self, code: Any, offset: int) -> None:
        self.calls[code] += 1

    def on(self) -> None:
        sys.monitoring.set_events(TOOL, sys.monitoring.events.INSTRUCTION | sys.monitoring.events.PY_START)

    def off(self) -> None:
        sys.monitoring.set_events(TOOL, 0)

    def close(self) -> None:
        self.off()
        sys.monitoring.free_tool_id(TOOL)


def count(workload: str, options: dict[str, Any] | None, steps: int) -> Counter:
    import overhead

    counter = Counter()
    block = contextlib.nullcontext() if options is None else overhead.installed(**options)
    try:
        with block:
            if workload in ("tiny", "rollout"):
                step = overhead.tiny() if workload == "tiny" else overhead.rollout()
                for _ in range(20):
                    step()
                counter.on()
                for _ in range(steps):
                    step()
                counter.off()
            else:
                import lightning.pytorch as pl

                class Probe(pl.Callback):  # counts between the batch hooks, as overhead.py times
                    def __init__(self) -> None:
                        self.batches = 0

                    def on_train_batch_start(self, *args: Any) -> None:
                        self.batches += 1
                        if self.batches > 10:
                            counter.on()

                    def on_train_batch_end(self, *args: Any) -> None:
                        counter.off()

                overhead.lightning_fit(log=workload == "lightning-log", callbacks=[Probe()])(steps + 10)
    finally:
        counter.close()
    return counter


def _where(code: Any) -> str:
    path = code.co_filename
    for marker in ("/ampguard/", "/site-packages/", "/benchmarks/"):
        if marker in path:
            path = path[path.index(marker) + 1:].removeprefix("site-packages/")
            break
    return f"{path}:{code.co_firstlineno} {code.co_qualname}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("tiny", "lightning", "lightning-log", "rollout"), default="tiny")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=15, help="ampguard's functions to list per configuration")
    args = parser.parse_args()
    if sys.version_info < (3, 12):
        raise SystemExit("bytecodes.py needs Python 3.12 or later (sys.monitoring)")
    import torch

    torch.set_num_threads(1)
    plain = None
    for name, options in CONFIGS.items():
        counter = count(args.workload, options, args.steps)
        total = sum(counter.bytecodes.values()) / args.steps
        own = {code: n for code, n in counter.bytecodes.items() if "/ampguard/" in code.co_filename}
        if plain is None:
            plain = total
        print(f"\n{args.workload}, {name}: {total:,.0f} bytecodes a step ({total - plain:+,.0f} over plain), "
              f"{sum(counter.calls.values()) / args.steps:,.0f} Python calls; ampguard's own: "
              f"{sum(own.values()) / args.steps:,.0f}")
        for code, n in sorted(own.items(), key=lambda item: -item[1])[:args.top]:
            print(f"  {n / args.steps:7.1f} {counter.calls[code] / args.steps:5.1f} calls  {_where(code)}")
    print(f"counted {args.steps} steps per configuration")


if __name__ == "__main__":
    main()
