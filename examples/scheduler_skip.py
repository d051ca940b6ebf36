"""GradScaler + OneCycleLR, with two iterations whose gradients overflow (CPU, a few seconds).

Without ampguard the scheduler advances on the skipped steps: PyTorch warns "Detected call of
`lr_scheduler.step()` before `optimizer.step()`", warm-up ends early and the schedule ends two
steps short. With ampguard the held steps keep the schedule aligned with the applied steps.
"""

import warnings

# A venv with torch and ampguard only has no numpy, and torch says so at import; this example never uses it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

import ampguard  # noqa: E402

OVERFLOW_AT = {0, 5}  # iterations whose scaled gradients overflow
STEPS = 12


def train() -> list[tuple[int, bool, float]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + len(OVERFLOW_AT))
    scaler = torch.amp.GradScaler("cpu")
    it = 0

    def overflow(grad: torch.Tensor):  # what an fp16 overflow in the backward pass looks like
        return grad * float("inf") if it in OVERFLOW_AT else None

    model[0].weight.register_hook(overflow)
    rows = []
    for it in range(STEPS):
        x = torch.randn(32, 16)
        loss = model(x).pow(2).mean()
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
        rows.append((it, scaler.get_scale() < scale, sched.get_last_lr()[0]))
    return rows


def main() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = train()
    with ampguard.guard() as g:
        guarded = train()
    print("iter  skipped  lr (plain torch)  lr (ampguard)")
    for (i, skipped, lr_plain), (_, _, lr_guard) in zip(plain, guarded, strict=False):
        print(f"{i:4d}  {'yes' if skipped else '':7s}  {lr_plain:16.6f}  {lr_guard:13.6f}")
    for w in caught:
        if "lr_scheduler" in str(w.message):
            print(f"\nplain torch warned: {str(w.message)[:80]}...")
    print(f"\nampguard: {g.stats.optimizer_steps_skipped} steps skipped, "
          f"{g.stats.scheduler_steps_held} scheduler steps held; no warning.")


if __name__ == "__main__":
    main()
