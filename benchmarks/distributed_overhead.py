"""Cost of ampguard's rank agreement: one tiny all-reduce per GradScaler.update(), 2 gloo ranks (CPU).

Every configuration runs interleaved in the same two processes; the table gives rank 0's median
step time and its ratio to plain PyTorch, plus the all-reduce of the (world x optimizers) table
alone (each optimizer's found_inf sum, which also carries whether the rank's non-finite checks may fail).
Run: python benchmarks/distributed_overhead.py [--steps N] [--reps N]
"""

import argparse
import contextlib
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from overhead import installed  # (this folder: install() and uninstall() around each configuration)

CONFIGS = {
    "plain": lambda: contextlib.nullcontext(),
    "install(distributed=False)": lambda: installed(distributed=False),
    "install() (rank agreement)": lambda: installed(),
    "nonfinite='off', distributed=False": lambda: installed(nonfinite="off", distributed=False),
    "nonfinite='off' (rank agreement)": lambda: installed(nonfinite="off"),
}


def loop(model, opt, scaler, x, steps):
    start = time.perf_counter()
    for _ in range(steps):
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def worker(rank, port, steps, reps, width):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(32, width)
    loop(model, opt, scaler, x, 20)
    times = {name: [] for name in CONFIGS}
    for _ in range(reps):
        for name, ctx in CONFIGS.items():
            with ctx():
                times[name].append(loop(model, opt, scaler, x, steps))
    table = torch.zeros(2, 1)
    reduce_times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            dist.all_reduce(table)
        reduce_times.append((time.perf_counter() - start) / steps)
    if rank == 0:
        plain = statistics.median(times["plain"])
        print(f"DDP MLP {width}-{width}-1, batch 32, GradScaler, 2 gloo ranks on CPU, torch {torch.__version__}, "
              f"{reps} interleaved reps x {steps} steps (rank 0)")
        print(f"{'configuration':36s} {'us/step':>9s} {'vs plain':>9s}")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:36s} {median * 1e6:9.1f} {median / plain:8.3f}x")
        print(f"{'all_reduce of the 2x1 table alone':36s} {statistics.median(reduce_times) * 1e6:9.1f}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, args.steps, args.reps, args.width), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
