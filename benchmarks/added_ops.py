"""Which torch ops, device kernels and host-device copies ampguard adds to a step, counted by torch's profiler.

``overhead.py`` gives the whole cost and ``hook_times.py`` ampguard's Python; on a GPU what ampguard
adds is also ops: each is a kernel launch on the host (several microseconds) and may be a wait on
the device. This profiles ``--steps`` steps of a workload plain and under ``ampguard.guard()`` and
prints, per step, the ops whose count differs, with their host time, and the totals of kernel
launches and device-to-host copies (a copy to the host is where a step waits for the device).

    python benchmarks/added_ops.py                 # the wide MLP and the tiny AMP loop, CUDA if present
    python benchmarks/added_ops.py --workload tiny --steps 50
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # the same workloads as the timings

import ampguard

WORKLOADS = {"mlp": overhead.wide_mlp, "tiny": overhead.tiny, "conv": overhead.conv_net, "gpt2": overhead.gpt}
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
TO_HOST = ("Memcpy DtoH", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def counts(make, guarded: bool, steps: int) -> tuple[dict, dict]:
    step = make()
    ctx = ampguard.guard() if guarded else contextlib.nullcontext()
    with ctx:
        for _ in range(5):  # warm: lazy state, the allocator, cuBLAS handles
            step()
        overhead._sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if overhead.DEVICE == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            overhead._sync()
    n, host_us = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        n[event.key] += event.count
        host_us[event.key] += event.self_cpu_time_total
    return n, host_us


def report(name: str, steps: int) -> None:
    plain, plain_us = counts(WORKLOADS[name], False, steps)
    guarded, guarded_us = counts(WORKLOADS[name], True, steps)
    print(f"\n{name} on {overhead.DEVICE}: per step, plain -> guarded (ops whose count differs)")
    print(f"  {'op':48s} {'plain':>7s} {'guarded':>8s} {'added host us':>14s}")
    keys = sorted(set(plain) | set(guarded), key=lambda k: -(guarded_us[k] - plain_us[k]))
    for key in keys:
        if plain[key] != guarded[key]:
            added = (guarded_us[key] - plain_us[key]) / steps
            print(f"  {key[:48]:48s} {plain[key] / steps:7.1f} {guarded[key] / steps:8.1f} {added:14.1f}")
    for label, names in (("kernel launches", LAUNCHES), ("device-to-host copies and syncs", TO_HOST)):
        p = sum(plain[k] for k in names) / steps
        g = sum(guarded[k] for k in names) / steps
        print(f"  {label}: {p:.1f} -> {g:.1f} a step")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="mlp,tiny", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    if not names or set(names) - set(WORKLOADS):
        parser.error(f"--workload: the workloads are {', '.join(WORKLOADS)}")
    if overhead.DEVICE == "cpu":
        torch.set_num_threads(1)
    print(f"ampguard {ampguard.__version__}, torch {torch.__version__}, {overhead.DEVICE}, {args.steps} steps")
    for name in names:
        report(name, args.steps)


if __name__ == "__main__":
    main()
