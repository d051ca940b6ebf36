"""Where ampguard's time goes on a small step: wall time in context, by component, from py-spy samples.

``instructions.py`` counts what ampguard executes; the aims are in wall time, and a step's time
is not its instructions (torch's C++ runs at another pace than the interpreter, and code that
ampguard runs can slow torch's own). This runs the workload plain and under ampguard, in
alternating processes (``--rounds`` of each, ``--seconds`` in all per configuration), while
py-spy samples each from outside. py-spy reads the Python stack, so time in a C call counts to
the Python frame that made it. Samples outside the measured steps are dropped. Per step, it prints:

- ampguard's own frames (the innermost Python frame is ampguard's), by component;
- the time added in torch's, Lightning's and the loop's own frames (the same frames, plain against
  ampguard): torch's dispatch to the loss-code recorder, its module-hook path, wrapt's binding
  (counted to the caller's frame), and torch running slower after ampguard's code. The loss
  code's torch calls run inside the recorder's frame under ampguard and in the loop's plain, so
  they are counted here, on both sides;

each as a share of the plain step.

    python benchmarks/where_time_goes.py                        # the tiny AMP loop, 40 s per configuration
    python benchmarks/where_time_goes.py --workload lightning --config off
    python benchmarks/where_time_goes.py --dry-run              # print the commands (no py-spy needed)

Needs ``py-spy`` on PATH (``pip install py-spy``; not a dependency of ampguard), and permission to
read another process's memory (it starts the process itself, which suffices where ptrace is allowed
for one's own children). py-spy takes a core of its own: on a 2-core machine the step times under
it are slower than in ``overhead.py``, but each configuration pays that alike.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

CONFIGS = {"plain": None, "off": {"nonfinite": "off"}, "trace-off": {"trace": "off"}, "default": {}}
WORKLOADS = {"tiny": "step (overhead.py", "lightning": "_AutomaticOptimization.run ("}
FRAME = re.compile(r"(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")

# Entry points: the ampguard frame that torch, wrapt or the user called, and the component it belongs to.
LOSS_RECORD = "loss-code record"
RECORDED_OPS = "the recorded torch calls themselves (plain: in the loop's frames)"
MODULE_CALLS = "outermost module calls (capture, outputs)"
SINKS = "sinks, backward and the shared read"
SCHEDULERS = "scheduler holding, skip counting"
LINTS = "lints"
OTHER = "guard lookups and wrappers"


def child(workload: str, config: str, seconds: float) -> None:
    """Run steps for ``seconds``; print how many. The parent's py-spy samples this process."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead
    import torch

    torch.set_num_threads(1)
    options = CONFIGS[config]
    with contextlib.nullcontext() if options is None else overhead.installed(**options):
        if workload == "tiny":
            run, per_run = overhead.tiny(), 1
            for _ in range(50):
                run()
        else:
            fit = overhead.lightning_fit()
            fit(8)
            per_run = 50

            def run():
                fit(per_run)
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            run()
            runs += 1
    print(f"steps {runs * per_run}")


def command(workload: str, config: str, seconds: float, rate: int, out: str) -> list[str]:
    return ["py-spy", "record", "--rate", str(rate), "--format", "raw", "--output", out, "--",
            sys.executable, os.path.abspath(__file__), "--child", workload, config, str(seconds)]


def sample(workload: str, config: str, seconds: float, rate: int) -> tuple[collections.Counter, int]:
    """(samples by stack, steps) of one configuration."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.txt")
        run = subprocess.run(command(workload, config, seconds, rate, out), capture_output=True, text=True,
                             check=False)
        found = re.search(r"^steps (\d+)$", run.stdout, re.MULTILINE)
        if run.returncode != 0 or found is None or not os.path.exists(out):
            raise SystemExit(f"{workload}/{config}: py-spy failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
        stacks: collections.Counter = collections.Counter()
        with open(out) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                stacks[stack] += int(count)
    return stacks, int(found.group(1))


def _parse(frame: str) -> tuple[str, str]:
    m = FRAME.match(frame)
    return (m["func"], m["file"]) if m else (frame, "")


def _ours(file: str) -> bool:
    return "ampguard/" in file.replace(os.sep, "/") or file.endswith("_ampguard_startup.py")


def _call_line() -> str:
    """Where the recorder calls the recorded torch function: time there is the user's op, not ampguard's. (A C
    function is called one frame further in, through a frame bearing the user's file: not ampguard's either.)"""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ampguard", "nonfinite",
                        "sinks.py")
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if text.strip().startswith("out = func(*args, **kwargs)"):
                return str(number)
    return ""


CALL_LINE = _call_line()


def component(frames: list[str]) -> str | None:
    """The component of a sample whose innermost frame is ampguard's, else None."""
    m = FRAME.match(frames[-1])
    if m and m["func"].endswith("__torch_function__") and m["line"] == CALL_LINE and _ours(m["file"]):
        return RECORDED_OPS
    run = []
    for frame in reversed(frames):  # innermost first
        func, file = _parse(frame)
        if not _ours(file):
            break
        run.append((func, file.replace(os.sep, "/")))
    if not run:
        return None
    run.reverse()  # the entry point first
    entry = next(((f, p) for f, p in run if not f.startswith("fail_safe.")), run[-1])
    func, path = entry
    innermost = run[-1][1]
    if "nonfinite/" in path or "nonfinite/" in innermost:
        if func.endswith("__torch_function__"):
            return LOSS_RECORD
        if path.endswith(("nonfinite/outermost.py", "nonfinite/__init__.py")):
            return MODULE_CALLS
        return SINKS
    if path.endswith("schedulers.py") or innermost.endswith("schedulers.py"):
        return SCHEDULERS
    if path.endswith("lints.py") or innermost.endswith("lints.py"):
        return LINTS
    return OTHER


def attribute(stacks: collections.Counter, marker: str) -> tuple[float, collections.Counter, collections.Counter]:
    """(samples in steps, ampguard's samples by component, other samples by innermost function)."""
    total, ours, others = 0, collections.Counter(), collections.Counter()
    for stack, count in stacks.items():
        frames = stack.split(";")
        if not any(marker in f for f in frames):
            continue
        total += count
        part = component(frames)
        if part is not None:
            ours[part] += count
        else:
            func, file = _parse(frames[-1])
            others[(func, file.rpartition("site-packages/")[2] or file)] += count
    return total, ours, others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tiny", choices=sorted(WORKLOADS))
    parser.add_argument("--config", default="default", choices=[c for c in CONFIGS if c != "plain"])
    parser.add_argument("--seconds", type=float, default=40.0, help="per configuration")
    parser.add_argument("--rate", type=int, default=500, help="samples per second")
    parser.add_argument("--rounds", type=int, default=4, help="alternating runs per configuration")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "CONFIG", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], float(args.child[2]))
        return
    if args.dry_run:
        for config in ("plain", args.config):
            print(" ".join(command(args.workload, config, args.seconds, args.rate, "OUT")))
        return
    if shutil.which("py-spy") is None:
        raise SystemExit("benchmarks/where_time_goes.py needs py-spy on PATH (pip install py-spy), or use --dry-run")
    marker = WORKLOADS[args.workload]
    sampled = {config: (collections.Counter(), [0]) for config in ("plain", args.config)}
    for _ in range(args.rounds):  # alternating: the machine's drift falls on both alike
        for config, (stacks, steps) in sampled.items():
            more, n = sample(args.workload, config, args.seconds / args.rounds, args.rate)
            stacks.update(more)
            steps[0] += n
    results = {}
    for config, (stacks, (steps,)) in sampled.items():
        total, ours, others = attribute(stacks, marker)
        results[config] = (total / steps, {k: v / steps for k, v in ours.items()},
                           {k: v / steps for k, v in others.items()}, steps)
    plain, _, plain_others, plain_steps = results["plain"]
    guarded, ours, others, steps = results[args.config]
    if not plain:
        raise SystemExit("no samples inside the measured steps: is py-spy allowed to read the process?")
    added_elsewhere = sum(others.values()) - sum(plain_others.values())
    print(f"{args.workload}, {args.config} against plain: py-spy at {args.rate} Hz, {args.seconds:g} s each in "
          f"{args.rounds} alternating runs ({plain_steps} and {steps} steps); shares of the plain step")
    print(f"  step time under ampguard            {guarded / plain:6.3f}x")
    moved = ours.pop(RECORDED_OPS, 0.0)
    print(f"  ampguard's own frames               {sum(ours.values()) / plain:6.3f}")
    for part, value in sorted(ours.items(), key=lambda kv: -kv[1]):
        print(f"    {part:42s} {value / plain:6.3f}")
    print(f"  added in torch's and the loop's     {(added_elsewhere + moved) / plain:6.3f}  (with the loss code's "
          f"torch calls, {moved / plain:.3f}, which run inside the recorder)")
    keys = set(others) | set(plain_others)
    grown = sorted(keys, key=lambda k: plain_others.get(k, 0) - others.get(k, 0))[:8]
    for func, file in grown:
        delta = others.get((func, file), 0) - plain_others.get((func, file), 0)
        print(f"    {delta / plain:+6.3f}  {func} ({file})")


if __name__ == "__main__":
    main()
