"""Step time of a small transformer training step under each non-finite configuration.

All configurations run interleaved in one process; the table gives the median step time and
its ratio to plain PyTorch. CPU by default; with CUDA available it uses fp16 autocast and a
GradScaler. Run: python benchmarks/nonfinite_overhead.py [--steps N] [--reps N]
"""

import argparse
import contextlib
import statistics
import time

import torch

import ampguard

CONFIGS = {
    "plain": lambda: contextlib.nullcontext(),
    "install(trace='off')": lambda: ampguard.guard(trace="off"),
    "install() (deferred)": lambda: ampguard.guard(),
    "trace='eager'": lambda: ampguard.guard(trace="eager"),
    "detect_anomaly(check_nan=True)": lambda: torch.autograd.detect_anomaly(check_nan=True),
}


def make(device):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, dim_feedforward=256, batch_first=True, dropout=0.0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(128, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device) if device == "cuda" else None
    x = torch.randn(16, 32, 128, device=device)
    y = torch.randn(16, 32, 1, device=device)
    return model, opt, scaler, x, y


def step(model, opt, scaler, x, y, device):
    with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
        loss = torch.nn.functional.mse_loss(model(x), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)


def measure(ctx, parts, device, steps):
    with ctx():
        step(*parts, device)  # warm this configuration
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step(*parts, device)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parts = make(device)
    for _ in range(3):
        step(*parts, device)
    times = {name: [] for name in CONFIGS}
    for _ in range(args.reps):
        for name, ctx in CONFIGS.items():
            times[name].append(measure(ctx, parts, device, args.steps))
    plain = statistics.median(times["plain"])
    print(f"small transformer (2 layers, d=128, batch 16x32) on {device}, torch {torch.__version__}, "
          f"{args.reps} interleaved reps x {args.steps} steps")
    print(f"{'configuration':34s} {'ms/step':>9s} {'vs plain':>9s}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:34s} {median * 1e3:9.2f} {median / plain:8.2f}x")


if __name__ == "__main__":
    main()
