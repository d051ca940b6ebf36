"""ampguard's cost on the workloads users run, side by side in one process.

Each workload runs its configurations interleaved (rep 1 of every configuration, then rep 2,
...) and prints the median time per step and its ratio to plain PyTorch. It also times one
replay (the failure path) on the GPT-2-style model.

    python benchmarks/overhead.py                      # every workload, CPU (or CUDA if present)
    python benchmarks/overhead.py --only tiny,lightning --reps 9
    python benchmarks/overhead.py --only sgd           # the plain fp32 loop: no GradScaler
    python benchmarks/overhead.py --only rollout       # inference: two small no_grad module calls a step
    python benchmarks/overhead.py --quick              # seconds: a smoke run for the tests
    python benchmarks/overhead.py --only gpt2-small    # GPU: GPT-2-small size, fp16 autocast + GradScaler
    python benchmarks/overhead.py --only mlp,conv      # the parameter-heavy workloads
    python benchmarks/overhead.py --only scaling       # ms per step against parameters, us per module call and tensor
    python benchmarks/overhead.py --only memory        # peak memory of a step whose logits the user drops
    python benchmarks/overhead.py --only tiny,lightning --options   # what each feature or option costs a step

Timings use one torch thread on CPU (``--threads``), as the figures in the README do: with
several, the machine's other load decides more of the spread than ampguard does.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

import ampguard

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# detect_anomaly warns at every entry, and each configuration is entered once per rep and workload
warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled", category=UserWarning)


@contextlib.contextmanager
def installed(**options):
    """ampguard as a training script runs it: ``install(**options)`` (what ``AMPGUARD=1`` does at start-up), and
    ``uninstall()`` after. The configurations this file times, and those of the benchmarks that time whole steps or
    count them, run this way. A ``guard()`` block, as tests use it, costs a thread-local read more at each hook (some
    14 a small step); the memory and replay measurements here, in_place.py and added_ops.py use one, which changes
    nothing they measure."""
    ampguard.install(**options)
    try:
        yield
    finally:
        ampguard.uninstall()


CONFIGS = {
    "plain": contextlib.nullcontext,
    "nonfinite='off'": lambda: installed(nonfinite="off"),
    "trace='off' (sinks only)": lambda: installed(trace="off"),
    "install() (default)": installed,
    "nonfinite='skip'": lambda: installed(nonfinite="skip"),
    "detect_anomaly(check_nan=True)": lambda: torch.autograd.detect_anomaly(check_nan=True),
}
# --options: the default with each feature or option switched off alone, and with every feature off (the patches that
# stay: their wrappers return at once), so that each row's difference from the default is what that one costs a step.
OPTIONS = {
    "plain": CONFIGS["plain"],
    "install() (default)": CONFIGS["install() (default)"],
    "lint=False": lambda: installed(lint=False),
    "schedulers=False": lambda: installed(schedulers=False),
    "closures=False": lambda: installed(closures=False),
    "distributed=False": lambda: installed(distributed=False),
    "trace='off'": CONFIGS["trace='off' (sinks only)"],
    "nonfinite='off'": CONFIGS["nonfinite='off'"],
    # (GradScaler's tracking stays on for max_consecutive_skips and check_unscaled_after unless they are None too)
    "every feature off": lambda: installed(nonfinite="off", lint=False, schedulers=False, closures=False,
                                           max_consecutive_skips=None, check_unscaled_after=None),
}


def _options_run(names) -> bool:
    """Whether ``names`` are --options' configurations (rotated, and shown against the default)."""
    return set(names) == set(OPTIONS)
# On a GPU: plain with one host-device sync after each step, what ampguard's one read a step costs by itself (the
# host can no longer run ahead of the GPU), apart from ampguard's own host time. Not a guard: measure() syncs.
PLAIN_SYNCED = "plain + one sync a step"
# The same read, pipelined: each step waits for the previous step's event (the GPU still has this step queued). What a
# read one step late would cost; ampguard reads before the step is applied, so it is not what ampguard does.
PLAIN_LATE = "plain + one read a step late"


# -- workloads: each returns step() ------------------------------------------------------------
def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler(DEVICE)
    x = torch.randn(16, 32, device=DEVICE)

    def step():
        with torch.autocast(DEVICE, dtype=torch.float16, enabled=DEVICE == "cuda"):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()

    return step


def sgd():
    """The plain fp32 loop: no GradScaler, so the loss and the gradients get statuses of their own where an AMP loop
    rides on found_inf. The default's costliest small step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32, device=DEVICE), torch.randn(16, 1, device=DEVICE)

    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def rollout(width=64):
    """An RL rollout step on the CPU: a policy and a value MLP, each called on one observation under no_grad,
    and an action sampled from the policy. Two outermost module calls of inference a step, nothing else."""
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                 torch.nn.Tanh(), torch.nn.Linear(width, 4)).to(DEVICE)
    value = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)).to(DEVICE)
    obs = torch.randn(1, 8, device=DEVICE)

    def step():
        with torch.no_grad():
            logits, _ = policy(obs), value(obs)
            int(torch.distributions.Categorical(logits=logits).sample())  # the action goes to the environment

    return step


def encoder(batch=8, seq=64):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, dim_feedforward=256, batch_first=True, dropout=0.0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(128, 1)).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, seq, 128, device=DEVICE)
    y = torch.randn(batch, seq, 1, device=DEVICE)

    def step():
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """GPT-2 style: token and position embeddings, pre-LN blocks, tied head."""

    def __init__(self, layers, d, heads, vocab=8192, seq=128):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def gpt(layers=4, d=256, heads=4, batch=8, seq=128, vocab=8192, amp=False):
    torch.manual_seed(0)
    model = GPT(layers, d, heads, vocab, seq).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")
    scaler = torch.amp.GradScaler(DEVICE, enabled=amp)
    idx = torch.randint(0, vocab, (batch, seq), device=DEVICE)

    def step():
        with torch.autocast(DEVICE, dtype=torch.float16, enabled=amp):
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    step.model = model
    step.idx = idx
    return step


def wide_mlp(width=2048, batch=8):
    """Parameter-heavy, little compute per parameter: 3 x Linear(2048, 2048), SGD with momentum (12.6M)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, width)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, width, device=DEVICE)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def conv_net(width=384, batch=8, size=32):
    """ResNet-like: conv-BN-ReLU stages, about 8M parameters at width 384, 32x32 inputs."""
    torch.manual_seed(0)
    nn = torch.nn

    def stage(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    w = width
    model = nn.Sequential(nn.Conv2d(3, w // 4, 3, 1, 1), stage(w // 4, w // 2, 2), stage(w // 2, w, 2),
                          stage(w, w, 2), stage(w, w, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(w, 10)).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)

    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.params = sum(p.numel() for p in model.parameters())
    return step


def lightning_fit(log=False, callbacks=()):
    """Trainer.fit of one Linear, batch 2: the time per step between Lightning's batch hooks. With ``log``,
    training_step logs the loss (to the progress bar) and the learning rate, as most real ones do. ``callbacks``:
    more Lightning callbacks (another benchmark's probes)."""
    import logging

    import lightning.pytorch as pl

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            if log:
                self.log("train_loss", loss, prog_bar=True)
                self.log("lr", 0.01)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(400, 8), torch.randn(400, 1))

    class Clock(pl.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self.start)

    def fit(steps):
        clock = Clock()
        # Lightning runs fit under set_detect_anomaly(its own flag): anomaly mode is the Trainer's option there
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             detect_anomaly=torch.is_anomaly_enabled(), callbacks=[clock, *callbacks])
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
        return statistics.median(clock.times[5:])

    return fit


# -- measuring ----------------------------------------------------------------------------------
def _order(configs, rep):
    """The configurations of one rep. Under --options each rep starts one further along, so that no configuration
    always runs in one place (right after plain): the rows there are differences of a few us, and a place's effect, if
    any, falls on every one alike. (Measured on the tiny loop, 30 reps each way, the usual configurations read the
    same within the noise: nonfinite='off' 1.093x in their fixed order, 1.109x rotated.)"""
    configs = list(configs)
    if not _options_run(configs):
        return configs
    k = rep % len(configs)
    return configs[k:] + configs[:k]


def measure(step, configs, reps, steps):
    times = {name: [] for name in configs}
    for _ in range(3):
        step()
    for rep in range(reps):
        for name in _order(configs, rep):
            synced, late = name == PLAIN_SYNCED, name == PLAIN_LATE
            previous = None
            with CONFIGS.get(name, contextlib.nullcontext)():
                step()  # warm this configuration
                _sync()
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                    if synced:
                        _sync()
                    elif late:
                        event = torch.cuda.Event()
                        event.record()
                        if previous is not None:
                            previous.synchronize()
                        previous = event
                _sync()
                times[name].append((time.perf_counter() - start) / steps)
    return times


def measure_fit(fit, configs, reps, steps):
    times = {name: [] for name in configs}
    for rep in range(reps):
        for name in _order(configs, rep):
            with CONFIGS[name]():
                fit(12)  # warm this configuration: entering a guard patches classes, which costs the next steps
                times[name].append(fit(steps))
    return times


def ratios(times, name):
    """Each rep's time over the same rep's plain time: drift of the machine between reps cancels."""
    return sorted(t / p for t, p in zip(times[name], times["plain"], strict=True))


def show(title, times):
    """Median ms/step, and the median of the per-rep ratios to plain with its interquartile range; for --options'
    configurations, each one's difference from the default in microseconds a step (the median of the per-rep
    differences: the machine's drift between reps cancels)."""
    print(f"\n{title}")
    default = times["install() (default)"] if _options_run(times) else None
    for name, values in times.items():
        r = ratios(times, name)
        lo, hi = (r[len(r) // 4], r[(3 * len(r)) // 4]) if len(r) >= 4 else (r[0], r[-1])
        against = "" if default is None else \
            f"  {statistics.median(t - d for t, d in zip(values, default, strict=True)) * 1e6:+8.1f} us vs default"
        print(f"  {name:34s} {statistics.median(values) * 1e3:9.3f} ms/step {statistics.median(r):7.2f}x"
              f"  ({lo:.2f}-{hi:.2f}){against}")


def replay_time(step, reps=3):
    """Seconds from a NaN at the GPT-2-style model's output to the NonFiniteError: one replay."""
    model = step.model
    target = min(1, len(model.blocks) - 1)
    out = []
    for _ in range(reps):
        with ampguard.guard(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = model.blocks[target].mlp[1].register_forward_hook(lambda m, a, o: o * math.nan)
            try:
                logits = model(step.idx[:, :-1])
                _sync()
                start = time.perf_counter()
                try:
                    ampguard.nonfinite.check()
                except ampguard.NonFiniteError as err:
                    assert err.op == "Tensor.mul" and err.module.startswith(f"blocks.{target}.mlp"), err
                _sync()
                out.append(time.perf_counter() - start)
                del logits
            finally:
                handle.remove()
    return statistics.median(out)


# -- scaling ----------------------------------------------------------------------------------------
def scaling(reps, quick):
    """ms added per step as parameters grow; us added per module call as calls per step grow, and per parameter tensor
    as the tensors (small layers) grow."""
    print("\nscaling: default guard against plain, interleaved (median of reps)")
    print("  parameters   plain ms/step   added ms/step   ratio")
    widths = [(512, "1.1M"), (1024, "4.2M"), (2048, "16.8M"), (4096, "50.3M")] if not quick else [(64, "17k")]
    for width, label in widths:
        step = wide_mlp(width, batch=8)
        m = measure(step, ["plain", "install() (default)"], reps, 2 if quick else 5)
        plain = statistics.median(m["plain"])
        ratio = statistics.median(ratios(m, "install() (default)"))
        print(f"  {label:>10s}   {plain * 1e3:13.2f}   {(ratio - 1) * plain * 1e3:13.2f}   {ratio:5.2f}x")
    print("  module calls   plain us/call   added us/call   ratio")
    for calls in ([10, 100, 1000] if not quick else [10]):
        torch.manual_seed(0)
        # parameter-free modules (two levels deep) and one Linear: the count of calls varies, not of gradients
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), *(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh())
                                                             for _ in range((calls - 2) // 3)))
        n = sum(1 for _ in model.modules())  # every module is called once per forward
        plain, ratio = _per_unit(model, 4, reps, quick)
        print(f"  {n:12d}   {plain / n * 1e6:13.2f}   {(ratio - 1) * plain / n * 1e6:13.2f}   {ratio:5.2f}x")
    print("  parameter tensors   plain us/tensor   added us/tensor   ratio")
    for layers in ([5, 50, 250] if not quick else [5]):
        torch.manual_seed(0)
        # small layers: the count of gradients varies (a pass over them costs per tensor, not per byte, here)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(layers)))
        n = 2 * layers
        plain, ratio = _per_unit(model, 8, reps, quick)
        print(f"  {n:17d}   {plain / n * 1e6:15.2f}   {(ratio - 1) * plain / n * 1e6:15.2f}   {ratio:5.2f}x")


def _per_unit(model, width, reps, quick):
    """The plain step time and the default's ratio for a step of ``model`` on a batch of 2 (SGD, lr 0: time, not
    train)."""
    model = model.to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(2, width, device=DEVICE)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    m = measure(step, ["plain", "install() (default)"], reps, 3 if quick else 20)
    return statistics.median(m["plain"]), statistics.median(ratios(m, "install() (default)"))


# -- memory -----------------------------------------------------------------------------------------
_MEMORY_STEP = """
import resource, sys, contextlib, torch, ampguard
dev = sys.argv[4]
torch.manual_seed(0)
rows, vocab = int(sys.argv[2]), int(sys.argv[3])
head = torch.nn.Linear(256, vocab, device=dev)
opt = torch.optim.SGD(head.parameters(), lr=1e-3)
x = torch.randn(rows, 256, device=dev)
y = torch.randint(0, vocab, (rows,), device=dev)
with (ampguard.guard() if sys.argv[1] == "guard" else contextlib.nullcontext()):
    for _ in range(2):
        torch.nn.functional.cross_entropy(head(x), y).backward()  # the logits are dropped at once
        opt.step()
        opt.zero_grad(set_to_none=True)
if dev == "cuda":
    print(torch.cuda.max_memory_allocated() / 2**20)
else:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def memory(quick):
    """Peak memory of a step whose logits (rows x vocab) the user never keeps, plain and guarded."""
    rows, vocab = (64, 1000) if quick else (2048, 50000)
    what = "peak allocated CUDA memory" if DEVICE == "cuda" else "peak RSS"
    print(f"\nmemory: Linear(256, {vocab}) on {rows} rows, logits dropped at once "
          f"({rows * vocab * 4 / 2**20:.0f} MiB); {what} of a fresh process, median of 3")
    peaks = {}
    for _ in range(1 if quick else 3):
        for config in ("plain", "guard"):
            out = subprocess.run([sys.executable, "-c", _MEMORY_STEP, config, str(rows), str(vocab), DEVICE],
                                 capture_output=True, text=True, check=True, env={**os.environ, "AMPGUARD": "0"})
            peaks.setdefault(config, []).append(float(out.stdout.split()[-1]))
    plain, guarded = statistics.median(peaks["plain"]), statistics.median(peaks["guard"])
    print(f"  plain {plain:8.0f} MiB")
    print(f"  guard {guarded:8.0f} MiB {guarded / plain:7.3f}x")


WORKLOADS = ("tiny", "sgd", "lightning", "lightning-log", "rollout", "mlp", "conv", "encoder", "gpt2", "scaling",
             "memory", "gpt2-small")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--only", default="tiny,sgd,lightning,lightning-log,rollout,mlp,conv,encoder,gpt2",
                        help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, 1 rep")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    parser.add_argument("--options", action="store_true",
                        help="time the default with each feature or option switched off alone (and all features "
                             "off) in place of the usual configurations: what each one costs a step")
    args = parser.parse_args()
    only = {w.strip() for w in args.only.split(",") if w.strip()}
    if not only or only - set(WORKLOADS):
        parser.error(f"--only: unknown {', '.join(sorted(only - set(WORKLOADS))) or '(none given)'}; "
                     f"the workloads are {', '.join(WORKLOADS)}")
    reps = 1 if args.quick else args.reps
    q = args.quick
    if DEVICE == "cpu":
        torch.set_num_threads(args.threads)
    print(f"ampguard {ampguard.__version__}, torch {torch.__version__}, {DEVICE}, {reps} interleaved reps, "
          f"{torch.get_num_threads()} torch thread(s)")
    every = list(CONFIGS) + ([PLAIN_SYNCED] if DEVICE == "cuda" else [])
    if args.options:
        CONFIGS.update(OPTIONS)
        every = list(OPTIONS)
    fits = [name for name in every if name != PLAIN_SYNCED]  # (a fit's steps are Lightning's: no sync between them)
    if "tiny" in only:
        show("tiny AMP loop (Linear 32-32-1, GradScaler, LambdaLR)",
             measure(tiny(), every, reps, 20 if q else 200))
    if "sgd" in only:
        show("plain fp32 loop (Linear 32-32-1, MSE, SGD, loss.backward(); no GradScaler)",
             measure(sgd(), every, reps, 20 if q else 200))
    if "lightning" in only:
        show("Lightning Trainer.fit, one Linear, batch 2 (per step, between the batch hooks)",
             measure_fit(lightning_fit(), fits, reps,
                         12 if q else 120))
    if "lightning-log" in only:
        show("Lightning Trainer.fit, one Linear, batch 2, training_step logs the loss and the LR (self.log)",
             measure_fit(lightning_fit(log=True), fits, reps, 12 if q else 120))
    if "rollout" in only:
        show("RL rollout: policy MLP 8-64-64-4 and value MLP 8-64-1 under no_grad, an action sampled (per env step)",
             measure(rollout(), every, reps, 20 if q else 500))
    if "mlp" in only:
        show("wide MLP, 3 x Linear(2048, 2048), batch 8, SGD momentum (12.6M parameters)",
             measure(wide_mlp(64) if q else wide_mlp(), every, reps, 2 if q else 10))
    if "conv" in only:
        step = conv_net(16, 2, 16) if q else conv_net()
        show(f"ResNet-like conv net ({step.params / 1e6:.1f}M parameters), 32x32, batch 8",
             measure(step, every, reps, 2 if q else 5))
    if "encoder" in only:
        show("nn.TransformerEncoder 2 x d128, batch 8 x 64",
             measure(encoder(2, 16) if q else encoder(), every, reps, 2 if q else 10))
    if "gpt2" in only:
        step = gpt(layers=1, d=64, seq=32, vocab=256) if q else gpt()
        show("GPT-2 style, 4 layers, d=256, seq 128, batch 8", measure(step, every, reps, 1 if q else 3))
        print(f"  one replay on failure (NaN in blocks.1.mlp): {replay_time(step) * 1e3:.0f} ms")
    if "scaling" in only:
        scaling(reps, q)
    if "memory" in only:
        memory(q)
    if "gpt2-small" in only:
        step = gpt(layers=12, d=768, heads=12, batch=8, seq=1024, vocab=50304, amp=True)
        show("GPT-2 small (12 x 768, seq 1024, batch 8), fp16 autocast + GradScaler",
             measure(step, ["plain", PLAIN_SYNCED, PLAIN_LATE, "install() (default)"], reps, 10))
        print(f"  one replay on failure (NaN in blocks.1.mlp): {replay_time(step) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
