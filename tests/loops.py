"""Small, real training loops and models shared by the tests: GradScaler on CPU, overflow from a backward hook,
counting the host reads ampguard adds."""

from __future__ import annotations

import inspect

import torch


def line_of(func, marker: str) -> int:
    """The line number of the first line of ``func``'s source that holds ``marker`` (a comment the test names)."""
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def backward_and_step(loss: torch.Tensor, opt: torch.optim.Optimizer, scaler=None) -> None:
    """``loss.backward()`` and ``opt.step()``, through ``scaler`` (scale, step, update) where one is given."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()


class OutOfMemory(Exception):
    """Stands in for torch.OutOfMemoryError, which a CPU cannot be made to raise on demand."""


class RaisingTeacher(torch.nn.Module):
    """A teacher whose every call runs out of memory: the loop catches it and goes on without its targets."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        raise OutOfMemory("the teacher does not fit")


class Overflow:
    """Turns a parameter's gradient into inf on chosen iterations, as a real fp16 overflow does."""

    def __init__(self, param: torch.Tensor, iterations=()) -> None:
        self.iterations = set(iterations)
        self.i = -1
        param.register_hook(self)

    def __call__(self, grad: torch.Tensor):
        return grad * float("inf") if self.i in self.iterations else None


def one_scaler_two_optimizers(m1, m2, o1, o2, s1, s2, scaler, overflow: Overflow, inputs, autocast=None) -> None:
    """A loop whose two models' losses share one GradScaler, each model with its own optimizer and scheduler;
    ``overflow`` (on a parameter of ``m1``) makes chosen iterations' gradients inf. ``autocast``: a device type
    to run the forwards under float16 autocast."""
    import contextlib

    for i, x in enumerate(inputs):
        overflow.i = i
        with torch.autocast(autocast, dtype=torch.float16) if autocast else contextlib.nullcontext():
            loss = m1(x).float().pow(2).mean() + m2(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(o1)
        scaler.step(o2)
        scaler.update()
        s1.step()
        s2.step()
        o1.zero_grad()
        o2.zero_grad()


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def lr(opt: torch.optim.Optimizer) -> float:
    return float(opt.param_groups[0]["lr"])


def scaled_loop(make_sched, iterations: int, overflow=(), *, make_opt=None, scaler=None, before_step=None):
    """Train with a GradScaler; return (lrs after each applied iteration, model, scheduler, scaler).

    ``before_step(model, optimizer, scaler)`` runs between backward and ``scaler.step`` (unscale, clip).
    """
    m = model()
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.1)))(m.parameters())
    sched = make_sched(opt)
    scaler = scaler or torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, overflow)
    lrs = []
    for i in range(iterations):
        hook.i = i
        x, y = data(i)
        loss = torch.nn.functional.mse_loss(m(x), y)
        scaler.scale(loss).backward()
        if before_step is not None:
            before_step(m, opt, scaler)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
        if i not in hook.iterations:
            lrs.append(lr(opt))
    return lrs, m, sched, scaler


def reference_loop(make_sched, iterations: int, skipped=(), *, make_opt=None, seed: int = 0):
    """The same run in which the skipped iterations never happened, without ampguard (``model(seed)``'s)."""
    m = model(seed)
    opt = (make_opt or (lambda p: torch.optim.SGD(p, lr=0.1)))(m.parameters())
    sched = make_sched(opt)
    scaler = torch.amp.GradScaler("cpu")
    lrs = []
    for i in range(iterations):
        if i in set(skipped):
            continue
        x, y = data(i)
        loss = torch.nn.functional.mse_loss(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
        lrs.append(lr(opt))
    return lrs, m, sched


class CountSyncs(torch.overrides.TorchFunctionMode):
    """Counts the host reads of tensor values (``item()``, ``tolist()``): on a device, each is a sync."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.item):
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def added_syncs(make, **options) -> int:
    """The host reads ampguard adds to one step: ``make()`` builds a model and returns its step, run once plain
    and once under ``ampguard.install(**options)``."""
    import ampguard

    counts = []
    for installed in (False, True):
        if installed:
            ampguard.install(**options)
        step = make()
        with CountSyncs() as mode:
            step()
        counts.append(mode.syncs)
    return counts[1] - counts[0]


class AroundAnOp(torch.nn.Module):
    """``a`` = Linear(4, 4), then the op a test is about, then ``b`` = Linear(4, 1), seeded: the smallest model with
    parameters before and after the op. Each test's subclass writes ``forward``, with the op's line marked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 1)


class TokenLM(torch.nn.Module):
    """A language model's shape, as small as it gets: token embedding, then logits over the vocabulary."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16)
        self.out = torch.nn.Linear(16, 50)

    def forward(self, ids):
        return self.out(self.emb(ids))


def gan_class(L, overflow_at=(), nan_in_critic_at=None):
    """A GAN trained the way Lightning documents it: two optimizers and two per-step schedulers, toggled by hand.
    ``overflow_at``: batches whose critic gradients overflow (a hook, as an fp16 overflow does); ``nan_in_critic_at``:
    a batch whose critic makes a NaN in its forward."""

    class GAN(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.G = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
            self.D = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            self.batch = -1
            self.D[0].weight.register_hook(lambda grad: grad * float("inf") if self.batch in overflow_at else None)
            self.D[1].register_forward_hook(
                lambda m, a, out: out * float("nan") if self.batch == nan_in_critic_at else None)

        def training_step(self, batch, batch_idx):
            self.batch = batch_idx
            opt_g, opt_d = self.optimizers()
            (x,) = batch
            fake = self.G(x)
            self.toggle_optimizer(opt_d)
            d_loss = (torch.nn.functional.softplus(-self.D(x).float()).mean()
                      + torch.nn.functional.softplus(self.D(fake.detach()).float()).mean()) * 1e-3  # (see g_loss)
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            self.untoggle_optimizer(opt_d)
            self.toggle_optimizer(opt_g)
            # (* 1e-3: no fp16 overflow at GradScaler's default initial scale; 16-mixed runs skip only the steps a
            # test makes overflow)
            g_loss = torch.nn.functional.softplus(-self.D(fake).float()).mean() * 1e-3
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            self.untoggle_optimizer(opt_g)
            for scheduler in self.lr_schedulers():
                scheduler.step()

        def configure_optimizers(self):
            opt_g = torch.optim.Adam(self.G.parameters(), lr=1e-2)
            opt_d = torch.optim.Adam(self.D.parameters(), lr=1e-2)
            return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.5),
                                    torch.optim.lr_scheduler.StepLR(opt_d, 1, 0.5)]

    return GAN
