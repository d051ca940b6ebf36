"""CUDA checks: skipped without a GPU; benchmarks/gpu_check.sh runs them with the GPU benchmark."""

import pytest
import torch

import ampguard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class LogOfSaturated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 1)

    def forward(self, x):
        p = torch.sigmoid(self.fc(x) * 100)
        return torch.log(p)  # CUDA LOG


def test_fp16_nan_on_cuda_names_its_origin():
    ampguard.install()
    model = LogOfSaturated().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    with pytest.raises(ampguard.NonFiniteError) as info:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = (model(torch.randn(64, 16, device="cuda")) * 0).sum()  # -inf * 0 = NaN
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert info.value.op == "torch.log" and info.value.module == "LogOfSaturated"


def test_scheduler_is_held_with_a_cuda_grad_scaler_and_fused_adamw():
    g = ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cuda")
    overflow = {"i": -1}
    model.weight.register_hook(lambda grad: grad * float("inf") if overflow["i"] == 1 else None)  # as fp16 does
    for i in range(4):
        overflow["i"] = i
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(8, 16, device="cuda")).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    assert g.stats.optimizer_steps_skipped == 1 and g.stats.scheduler_steps_held == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**3)


def _syncs_per_step(guarded: bool) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(32, 64, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    import warnings

    ctx = ampguard.guard() if guarded else torch.autograd.set_grad_enabled(True)
    with ctx:
        step()
        step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(5):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs) // 5


def test_at_most_one_host_device_sync_per_step_is_added():
    plain, guarded = _syncs_per_step(False), _syncs_per_step(True)
    assert guarded - plain <= 1, (plain, guarded)
