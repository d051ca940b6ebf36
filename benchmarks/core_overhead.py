"""Overhead of ampguard's core patches on a tiny GradScaler training loop (CPU).

Plain and installed runs are interleaved in one process; the figure that matters is the ratio
of the medians. Run: python benchmarks/core_overhead.py [--reps N] [--steps N]
"""

import statistics
import time

import torch

import ampguard


def loop(steps: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 32)
    start = time.perf_counter()
    for _ in range(steps):
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / steps


def main(reps: int = 15, steps: int = 200) -> None:
    torch.set_num_threads(1)
    loop(50)  # warm-up
    plain, guarded = [], []
    for _ in range(reps):
        plain.append(loop(steps))
        with ampguard.guard(nonfinite="off"):
            guarded.append(loop(steps))
    p, g = statistics.median(plain), statistics.median(guarded)
    print(f"tiny loop, {steps} steps x {reps} interleaved reps, 1 thread")
    print(f"  plain:     {p * 1e6:8.1f} us/step")
    print(f"  installed: {g * 1e6:8.1f} us/step   ratio {g / p:.3f}x")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    main(args.reps, args.steps)
