"""An fp16 log(0) in a hand-written loss, found three ways (CPU, a few seconds).

The classifier's logits are computed under float16 autocast. A sigmoid of a logit below about
-17 rounds to exactly 0 in float16 (and above about 8 to exactly 1), so ``torch.log(p)`` is
``log(0) = -inf``, and ``0 * -inf`` for a label of 0 turns the loss into NaN. Plain PyTorch
trains on silently with NaN parameters. With ampguard, ``NonFiniteError`` names ``torch.log``,
the loss line, and where -inf became NaN, before the optimizer step, so the parameters are still
the last finite ones:

1. ``ampguard.install()`` in the script;
2. ``AMPGUARD=1`` on a run of the same script that never imports ampguard (a child process).
"""

import os
import subprocess
import sys

import torch


def train(steps: int = 20) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 8) * 30  # unnormalised inputs: logits from -34 to 6
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            p = torch.sigmoid(model(x))  # float16: saturates to exactly 0 (or 1)
        loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # hand-written BCE: log(0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(model[0].weight.detach().sum())


def main() -> None:
    if "--child" in sys.argv:  # the run under AMPGUARD=1: this process never imports ampguard
        train()
        return

    print("== plain PyTorch")
    print(f"trained on without an error; a parameter sum is now {train()}\n")

    print("== ampguard.install()")
    import ampguard

    ampguard.install()
    try:
        train()
    except ampguard.NonFiniteError as err:
        print(err)
        print(f"\nerr.op = {err.op!r}, err.kind = {err.kind!r}, err.origin[-1].lineno = {err.origin[-1].lineno}\n")
    ampguard.uninstall()

    print("== AMPGUARD=1 python examples/find_nan.py --child (the script does not import ampguard)")
    env = {**os.environ, "AMPGUARD": "1"}
    child = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
    lines = child.stderr.rstrip().splitlines()
    start = next(i for i, line in enumerate(lines) if "NonFiniteError:" in line)
    report = next(i for i, line in enumerate(lines) if line.startswith("ampguard report"))
    print(f"exit code {child.returncode}; its stderr ends with the error and the exit report:")
    print("\n".join([*lines[start:start + 4], "  ...", *lines[report:]]))


if __name__ == "__main__":
    main()
