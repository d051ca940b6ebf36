"""CUDA checks: skipped without a GPU; benchmarks/gpu_check.sh runs them with the GPU benchmark."""

import warnings

import pytest
import torch
from loops import Overflow, gan_class, one_scaler_two_optimizers

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
            loss = model(torch.randn(8, 16, device="cuda")).float().mean() * 1e-3  # no overflow of its own
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    assert g.stats.optimizer_steps_skipped == 1 and g.stats.scheduler_steps_held == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**3)


def _syncs_per_step(guarded: bool, micro_batches: int = 1) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(32, 64, device="cuda")

    def step():
        for _ in range(micro_batches):  # gradient accumulation: one step for them all
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x.clone()).float().pow(2).mean() / micro_batches
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

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
    return len(syncs) / 5


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_at_most_one_host_device_sync_per_step_is_added(micro_batches):
    plain, guarded = _syncs_per_step(False, micro_batches), _syncs_per_step(True, micro_batches)
    assert guarded - plain <= 1, (plain, guarded)


# -- real training shapes on CUDA -----------------------------------------------------------------
DEV = "cuda"
BATCHES = 4


def _lightning(name="lightning.pytorch"):
    return pytest.importorskip(name)


def _fit(L, model, steps=None, **kwargs):
    """A real 16-mixed Trainer.fit on the GPU (Lightning makes its own GradScaler)."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(BATCHES * 8, 4, generator=g)), batch_size=8)
    if DEV == "cuda":
        kwargs.update(accelerator="gpu", precision="16-mixed")
    else:  # a dry run of these tests on CPU: the same plugin Lightning builds for 16-mixed on a GPU
        import importlib

        precision = importlib.import_module(f"{L.__name__}.plugins.precision")
        kwargs.update(accelerator="cpu", plugins=[precision.MixedPrecision("16-mixed", "cpu",
                                                                           scaler=torch.amp.GradScaler("cpu"))])
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, devices=1, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    return trainer, [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]


def _module(L, optimizer_step=None, overflow=(), poison_at=None):
    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.steps = 0
            if overflow:
                self.layer.weight.register_hook(
                    lambda grad: grad * float("inf") if self.steps - 1 in overflow else None)

        def training_step(self, batch, batch_idx):
            self.steps += 1
            out = self.layer(batch[0])
            loss = out.float().pow(2).mean() * 1e-3  # no fp16 overflow of its own at the initial scale
            if batch_idx == poison_at:
                loss = loss + torch.log(torch.sigmoid(out * 1e4) - 1).mean()  # CUDA POISON
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.1, fused=DEV == "cuda")
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        if optimizer_step is not None:
            locals()["optimizer_step"] = optimizer_step

    return Model


def _closure_then_step(self, epoch, batch_idx, optimizer, optimizer_closure):
    optimizer_closure()
    optimizer.step()


def _correct_step(self, epoch, batch_idx, optimizer, optimizer_closure):
    optimizer.step(closure=optimizer_closure)


def test_lightning_16_mixed_closure_then_step_trains_exactly_as_the_correct_override():
    L = _lightning()
    before = _module(L)().layer.weight.detach().clone()
    plain = _module(L, _closure_then_step)()
    _fit(L, plain)
    assert torch.equal(before, plain.layer.weight.cpu())  # the silent failure, on a real 16-mixed GPU run

    ampguard.install()  # the reference is the correct override, its fp16 calibration skips held alike
    reference = _module(L, _correct_step)()
    _fit(L, reference)
    ampguard.uninstall()
    g = ampguard.install()
    model = _module(L, _closure_then_step)()
    _, ours = _fit(L, model)
    assert g.stats.closures_injected == BATCHES
    assert len(ours) == 1 and "called optimizer_closure() and then optimizer.step()" in str(ours[0].message)
    assert torch.equal(model.layer.weight, reference.layer.weight)
    assert not torch.equal(before, model.layer.weight.cpu())


def test_lightning_16_mixed_overflow_holds_the_per_step_scheduler():
    L = _lightning()
    g = ampguard.install()
    trainer, _ = _fit(L, _module(L, overflow={1, 2})())
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert g.stats.optimizer_steps_skipped == 2 and g.stats.scheduler_steps_held == 2
    assert scheduler.last_epoch == BATCHES - 2


def test_lightning_16_mixed_nan_in_training_step_is_named_before_the_step():
    L = _lightning()
    ampguard.install()
    model = _module(L, poison_at=1)()
    with pytest.raises(ampguard.NonFiniteError) as info:
        _fit(L, model)
    err = info.value
    assert err.sink == "loss" and err.op == "torch.log", str(err)
    assert err.origin[-1].line.endswith("# CUDA POISON")
    assert model.steps == 2 and torch.isfinite(model.layer.weight).all()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_16_mixed_fit_adds_at_most_one_sync_per_step(accumulate):
    L = _lightning()

    def syncs(guarded):
        ctx = ampguard.guard() if guarded else torch.autograd.set_grad_enabled(True)
        with ctx, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if DEV == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                _fit(L, _module(L)(), accumulate_grad_batches=accumulate)
            finally:
                if DEV == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    syncs(False)  # warm: the first fit initialises CUDA and Lightning's lazy state
    plain, guarded = syncs(False), syncs(True)
    assert guarded - plain <= BATCHES // accumulate, (plain, guarded)  # one per optimizer step


def test_lightning_16_mixed_manual_optimization_gan_is_bit_identical_holds_the_critics_schedule_and_syncs_once_a_step():
    """Manual optimization on a real 16-mixed GPU run: two optimizers, each stepped through Lightning's own GradScaler
    in the user's training_step, and two per-step schedulers."""
    L = _lightning()

    def run(guarded, overflow_at=()):
        ctx = ampguard.guard() if guarded else torch.autograd.set_grad_enabled(True)
        model = gan_class(L, overflow_at=overflow_at)()
        with ctx, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if DEV == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                _fit(L, model)
            finally:
                if DEV == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        return model, sum("synchroniz" in str(w.message) for w in caught)

    run(False)  # warm: the first fit initialises CUDA and Lightning's lazy state
    plain, plain_syncs = run(False)
    guarded, guarded_syncs = run(True)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), guarded.parameters(), strict=True))
    assert guarded_syncs - plain_syncs <= 2 * BATCHES, (plain_syncs, guarded_syncs)  # two optimizer steps a batch
    skipped, _ = run(True, overflow_at=(1,))
    sched_g, sched_d = skipped.lr_schedulers()
    assert (sched_g.last_epoch, sched_d.last_epoch) == (BATCHES, BATCHES - 1)


def _logits_step(guarded):
    torch.manual_seed(0)
    head = torch.nn.Linear(256, 50000, device=DEV)
    opt = torch.optim.SGD(head.parameters(), lr=1e-3)
    x = torch.randn(2048, 256, device=DEV)
    y = torch.randint(0, 50000, (2048,), device=DEV)
    ctx = ampguard.guard() if guarded else torch.autograd.set_grad_enabled(True)
    with ctx:
        for _ in range(2):
            torch.nn.functional.cross_entropy(head(x), y).backward()  # the logits are dropped at once
            opt.step()
            opt.zero_grad(set_to_none=True)
        if DEV == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        import weakref

        logits = head(x)
        ref = weakref.ref(logits)
        loss = torch.nn.functional.cross_entropy(logits, y)
        del logits
        freed = ref() is None  # before backward(): autograd keeps what it needs, ampguard nothing more
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated() if DEV == "cuda" else 0
    return freed, peak


def test_a_dropped_output_is_freed_and_the_peak_memory_is_plains():
    plain_freed, plain_peak = _logits_step(False)
    freed, peak = _logits_step(True)
    assert plain_freed and freed
    assert peak <= plain_peak * 1.02, (plain_peak, peak)


def test_two_optimizers_fused_and_foreach_on_one_cuda_scaler_hold_only_the_skipped_schedule():
    g = ampguard.install()
    torch.manual_seed(0)
    m1, m2 = torch.nn.Linear(16, 4, device=DEV), torch.nn.Linear(16, 4, device=DEV)
    o1 = torch.optim.AdamW(m1.parameters(), lr=0.1, fused=DEV == "cuda")
    o2 = torch.optim.Adam(m2.parameters(), lr=0.1, foreach=True)
    s1 = torch.optim.lr_scheduler.LambdaLR(o1, lambda s: 1.0 / (s + 1))
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda s: 1.0 / (s + 1))
    one_scaler_two_optimizers(m1, m2, o1, o2, s1, s2, torch.amp.GradScaler(DEV), Overflow(m1.weight, {1, 2}),
                              [torch.randn(8, 16, device=DEV) for _ in range(5)], autocast=DEV)
    assert (s1.last_epoch, s2.last_epoch) == (3, 5)
    assert g.stats.optimizer_steps_skipped == 2 and g.stats.optimizer_steps_applied == 8


def test_fused_sgd_on_cuda_whose_first_fp16_step_is_skipped_trains_as_the_for_loop_sgd():
    """The CUDA kernel of torch's fused SGD, like the CPU one, never writes the momentum buffers of a first step it
    skips: they hold what the caching allocator last kept there (a report had inf in them: an overflowed gradient's
    memory). A later skip must leave the buffers as they are, on this kernel too."""
    ampguard.install()
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(DEV)
        kind = {"fused": True} if fused else {"foreach": False}
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, **kind)
        scaler = torch.amp.GradScaler(DEV)
        hook = Overflow(m[0].weight, {0, 4})
        g = torch.Generator(device=DEV).manual_seed(1)
        for i in range(8):
            hook.i = i
            x = torch.randn(32, 16, device=DEV, generator=g)
            with torch.autocast(DEV, dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if i == 4:
                before = [opt.state[p]["momentum_buffer"].clone() for p in m.parameters()]
            scaler.step(opt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ampguard.AmpGuardWarning)
                scaler.update()
            if i == 0:
                assert not opt.state  # the skipped first step left no buffer
            if i == 4:
                after = [opt.state[p]["momentum_buffer"] for p in m.parameters()]
                assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the later skip: as it was
            opt.zero_grad()
        runs.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b)


def test_fp16_parameters_with_adams_default_eps_warn_once_on_cuda():
    ampguard.install(nonfinite="off")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4, device=DEV).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8 is 0 in float16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(8, 16, device=DEV, dtype=torch.float16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    ours = [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]
    assert len(ours) == 1 and "eps=1e-08 rounds to 0 in float16" in str(ours[0].message)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.fc(x)))


class _CheckpointedNet(torch.nn.Module):
    def __init__(self, poison=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))
        self.head = torch.nn.Linear(32, 1)
        self.poison = poison

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        if self.poison:
            x = torch.log(x)  # CHECKPOINT LOG: dropout's zeros are log(0) = -inf
        return self.head(x)


def _checkpointed_steps(guarded, poison):
    model = _CheckpointedNet(poison).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=DEV == "cuda")
    scaler = torch.amp.GradScaler(DEV)
    torch.manual_seed(1)
    x = torch.randn(64, 32, device=DEV)
    ctx = ampguard.guard() if guarded else torch.autograd.set_grad_enabled(True)
    err = None
    with ctx:
        try:
            for _ in range(3):
                with torch.autocast(DEV, dtype=torch.float16):
                    loss = (model(x).float() * 0).sum() if poison else model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        except ampguard.NonFiniteError as e:
            err = e
    rng = torch.cuda.get_rng_state() if DEV == "cuda" else torch.get_rng_state()
    return [p.detach().clone() for p in model.parameters()], rng, err


def test_checkpointed_dropout_blocks_under_fp16_train_bit_identically_and_a_nan_replays():
    plain_params, plain_rng, _ = _checkpointed_steps(False, False)
    params, rng, err = _checkpointed_steps(True, False)
    assert err is None and all(torch.equal(a, b) for a, b in zip(plain_params, params, strict=True))
    assert torch.equal(rng, plain_rng)  # the capture of the CUDA RNG state changes nothing

    _, _, err = _checkpointed_steps(True, True)
    assert err is not None and err.op == "torch.log", str(err)
    assert "# CHECKPOINT LOG" in err.origin[-1].line and "did not reproduce" not in str(err)


def test_inductor_compiled_model_on_cuda_trains_bit_identically_and_names_a_nan_inside_it():
    torch._dynamo.reset()

    def losses(guarded):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(DEV)
        compiled = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(16, 32, device=DEV, generator=None)
        out = []
        ctx = ampguard.guard() if guarded else torch.autograd.set_grad_enabled(True)
        with ctx:
            for _ in range(3):
                loss = compiled(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
        return out

    torch.manual_seed(5)
    plain = losses(False)
    torch.manual_seed(5)
    assert losses(True) == plain

    ampguard.install()
    shifted_sqrt = torch.compile(lambda t: torch.sqrt(t - 100.0))

    class UsesCompiled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return shifted_sqrt(self.fc(x)) * 2

    model = UsesCompiled().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.ones(2, 4, device=DEV)).sum().backward()
        opt.step()
    assert info.value.op == "torch.sqrt" and info.value.module == "UsesCompiled"
    torch._dynamo.reset()


_ENV_SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to("{dev}")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("{dev}")
x = torch.randn(64, 8, device="{dev}") * 30
y = (x.sum(dim=1, keepdim=True) > 0).float()
for _ in range(5):
    with torch.autocast("{dev}", dtype=torch.float16):
        p = torch.sigmoid(model(x))
    loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # ENV LOG
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print("trained on")
"""


def test_ampguard_env_on_a_cuda_script_that_never_imports_it(python, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_ENV_SCRIPT.format(dev=DEV))
    out = python(None, str(script), env={"AMPGUARD": "1"})
    assert out.returncode != 0 and "trained on" not in out.stdout, out.stdout + out.stderr
    assert "ampguard.NonFiniteError" in out.stderr and "torch.log" in out.stderr and "# ENV LOG" in out.stderr
    plain = python(None, str(script))
    assert plain.returncode == 0 and "trained on" in plain.stdout


_NCCL_SCRIPT = """
import json, os, torch, torch.distributed as dist
import ampguard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("{backend}", rank=0, world_size=1)
dev = "{dev}"
g = ampguard.install()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1).to(dev))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev == "cuda")
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
scaler = torch.amp.GradScaler(dev)
i = -1
model.module.weight.register_hook(lambda grad: grad * float("inf") if i == 1 else None)
for i in range(4):
    with torch.autocast(dev, dtype=torch.float16):
        loss = model(torch.randn(8, 16, device=dev)).float().mean() * 1e-3  # no overflow of its own
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    opt.zero_grad()
result = dict(skipped=g.stats.optimizer_steps_skipped, held=g.stats.scheduler_steps_held, lr=sched.get_last_lr()[0])
try:
    with torch.autocast(dev, dtype=torch.float16):
        out = model(torch.randn(8, 16, device=dev))
        loss = torch.log(out - out - 1).mean()  # NCCL LOG
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
except ampguard.NonFiniteError as err:
    result.update(op=err.op, line=err.origin[-1].line)
dist.destroy_process_group()
print(json.dumps(result))
"""


def test_ddp_on_one_nccl_rank_holds_the_scheduler_and_names_a_nan(python, tmp_path):
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ddp.py"
    script.write_text(_NCCL_SCRIPT.format(port=port, dev=DEV, backend="nccl" if DEV == "cuda" else "gloo"))
    out = python(None, str(script))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["skipped"] == 1 and result["held"] == 1
    assert result["lr"] == pytest.approx(1e-3 * 0.5**3)
    assert result["op"] == "torch.log" and result["line"].endswith("# NCCL LOG")


def test_doctor_reports_the_gpu(python):
    out = python(None, "-m", "ampguard", "doctor")
    assert out.returncode == 0, out.stderr
    if DEV == "cuda":
        assert "CUDA available: True" in out.stdout and torch.cuda.get_device_name(0) in out.stdout
