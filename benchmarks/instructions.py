"""ampguard's cost on small steps in machine instructions: deterministic where wall time is not.

On a shared 2-core machine a 0.5 ms step's time moves by 20% between runs, so ratios of times
need many reps and still spread. Valgrind's callgrind counts the instructions a step executes:
the same count every run. Each configuration runs in its own process under callgrind, which
counts only inside the measured steps (``--toggle-collect`` on the one builtin that runs them).

    python benchmarks/instructions.py                     # tiny and Lightning, every configuration
    python benchmarks/instructions.py --only tiny --configs plain,default
    python benchmarks/instructions.py --only rollout      # two no_grad inference calls a step
    python benchmarks/instructions.py --dry-run           # print the commands (no valgrind needed)

Needs ``valgrind`` on PATH; about two minutes per configuration (torch's import under valgrind),
run in parallel on every core. Counts exclude cache and branch effects, so a time ratio is usually
somewhat higher than the instruction ratio; the instruction ratio is what a change to ampguard's
own code moves.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile

CONFIGS = {
    "plain": None,
    "nonfinite='off'": {"nonfinite": "off"},
    "install() (default)": {},
    "nonfinite='skip'": {"nonfinite": "skip"},
}
SHORT = {"plain": "plain", "off": "nonfinite='off'", "default": "install() (default)", "skip": "nonfinite='skip'"}
WORKLOADS = ("tiny", "lightning", "rollout")


def child(workload: str, config: str, steps: int) -> None:
    """Run ``steps`` steps inside sorted(): callgrind collects there and nowhere else."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead
    import torch

    torch.set_num_threads(1)
    options = CONFIGS[config]
    block = contextlib.nullcontext() if options is None else overhead.installed(**options)
    with block:
        if workload in ("tiny", "rollout"):
            step = overhead.tiny() if workload == "tiny" else overhead.rollout()
            for _ in range(20):
                step()
            _settle_garbage()
            sorted(range(steps), key=lambda _: step() or 0)  # (keys compare: 0, not None)
        else:
            fit = overhead.lightning_fit()
            fit(8)  # warm: the classes are patched, the first steps are done
            _settle_garbage()
            sorted([0], key=lambda _: fit(steps))


def _settle_garbage() -> None:
    """Everything made so far is collected once and then left alone: whether a full collection of the
    warm-up's objects lands inside the measured steps would otherwise move a count by percents."""
    gc.collect()
    gc.freeze()


def command(workload: str, config: str, steps: int, out: str) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=builtin_sorted",
            f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__), "--child",
            workload, config, str(steps)]


def count(workload: str, config: str, steps: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(command(workload, config, steps, os.path.join(tmp, "out")), capture_output=True,
                             text=True, check=False)
    found = re.search(r"Collected\s*:\s*(\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"{workload}/{config}: valgrind failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    return int(found.group(1))


def per_step(workload: str, config: str, steps: int) -> float:
    """Instructions per step. A Lightning fit also sets a trainer up: the difference of two fits."""
    if workload != "lightning":
        return count(workload, config, steps) / steps
    return (count(workload, config, steps + 10) - count(workload, config, 10)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(WORKLOADS), help="tiny,lightning,rollout")
    parser.add_argument("--configs", default=",".join(SHORT), help="plain,off,default,skip")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "CONFIG", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    workloads = [w for w in args.only.split(",") if w]
    configs = [SHORT.get(c, c) for c in args.configs.split(",") if c]
    bad = [w for w in workloads if w not in WORKLOADS] + [c for c in configs if c not in CONFIGS]
    if bad:
        parser.error(f"unknown {', '.join(bad)}; workloads are {', '.join(WORKLOADS)}, configs {', '.join(SHORT)}")
    if "plain" not in configs:
        parser.error("--configs must include plain: every figure is a ratio to it")
    if args.dry_run:
        for w in workloads:
            for c in configs:
                print(" ".join(command(w, c, args.steps, "OUT")))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("benchmarks/instructions.py needs valgrind on PATH (or use --dry-run)")
    jobs = {(w, c): None for w in workloads for c in configs}
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {key: pool.submit(per_step, *key, args.steps) for key in jobs}
        results = {key: f.result() for key, f in futures.items()}
    print(f"instructions per step under callgrind, {args.steps} steps, one torch thread")
    for w in workloads:
        plain = results[(w, "plain")]
        print(f"\n{w}")
        for c in configs:
            value = results[(w, c)]
            print(f"  {c:24s} {value / 1e6:8.3f} M/step   {value / plain:5.3f}x   (+{(value - plain) / 1e3:.0f} k)")


if __name__ == "__main__":
    main()
