"""Property: whatever overflows, every scheduler has stepped exactly once per applied step (or epoch)."""

import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loops import Overflow, data, model, scaled_loop
from torch.optim import lr_scheduler as S

import ampguard

BATCHES_PER_EPOCH = 3

SCHEDULERS = {
    "LambdaLR": lambda opt, n: S.LambdaLR(opt, lambda s: 1.0 / (s + 1)),
    "StepLR per epoch": lambda opt, n: S.StepLR(opt, step_size=1, gamma=0.5),
    "OneCycleLR": lambda opt, n: S.OneCycleLR(opt, max_lr=0.1, total_steps=n + 1),
    "SequentialLR": lambda opt, n: S.SequentialLR(
        opt, [S.LinearLR(opt, 0.1, total_iters=3), S.ExponentialLR(opt, 0.9)], milestones=[3]),
    "CosineAnnealingWarmRestarts": lambda opt, n: S.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2),
}
OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


@st.composite
def runs(draw):
    iterations = draw(st.integers(min_value=BATCHES_PER_EPOCH, max_value=4 * BATCHES_PER_EPOCH))
    n_optimizers = draw(st.integers(min_value=1, max_value=2))
    overflow = [draw(st.sets(st.integers(0, iterations - 1))) for _ in range(n_optimizers)]
    return {
        "iterations": iterations,
        "overflow": overflow,
        "scheduler": draw(st.sampled_from(sorted(SCHEDULERS))),
        "optimizers": [draw(st.sampled_from(sorted(OPTIMIZERS))) for _ in range(n_optimizers)],
    }


def expected_last_epoch(run, j):
    """What a loop that only steps the scheduler after applied steps would have counted."""
    applied = [i not in run["overflow"][j] for i in range(run["iterations"])]
    if run["scheduler"] == "StepLR per epoch":
        epochs = [applied[k:k + BATCHES_PER_EPOCH] for k in range(0, len(applied), BATCHES_PER_EPOCH)]
        return sum(any(epoch) for epoch in epochs if len(epoch) == BATCHES_PER_EPOCH)
    return sum(applied)


def train(run, **options):
    """Train ``run`` under a guard; return the schedulers, the guard and PyTorch's scheduler warnings."""
    per_epoch = run["scheduler"] == "StepLR per epoch"
    with ampguard.guard(**options) as g, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models = [model(seed=j) for j in range(len(run["optimizers"]))]
        opts = [OPTIMIZERS[kind](m.parameters()) for kind, m in zip(run["optimizers"], models, strict=True)]
        scheds = [SCHEDULERS[run["scheduler"]](opt, run["iterations"]) for opt in opts]
        scaler = torch.amp.GradScaler("cpu")
        hooks = [Overflow(m[0].weight, pattern) for m, pattern in zip(models, run["overflow"], strict=True)]
        for i in range(run["iterations"]):
            for hook in hooks:
                hook.i = i
            x, y = data(i)
            loss = sum(torch.nn.functional.mse_loss(m(x), y) for m in models)
            scaler.scale(loss).backward()
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            if not per_epoch or (i + 1) % BATCHES_PER_EPOCH == 0:
                for sched in scheds:
                    sched.step()
            for opt in opts:
                opt.zero_grad()
    warned = [str(w.message) for w in caught if "lr_scheduler" in str(w.message) or "Tried to step" in str(w.message)]
    return scheds, g, warned


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(runs())
def test_schedulers_follow_applied_steps_for_any_overflow_pattern(run):
    scheds, g, warned = train(run)
    for j, sched in enumerate(scheds):
        assert sched.last_epoch == expected_last_epoch(run, j), (j, run)
        for inner in getattr(sched, "_schedulers", []):
            assert inner.last_epoch <= sched.last_epoch
    assert warned == []
    skips = sum(len(p) for p in run["overflow"])
    assert g.stats.optimizer_steps_skipped == skips
    assert g.stats.optimizer_steps_applied == len(scheds) * run["iterations"] - skips


def test_the_property_fails_without_holding():
    run = {"iterations": 6, "overflow": [{0, 4}], "scheduler": "LambdaLR", "optimizers": ["SGD"]}
    scheds, _, warned = train(run, schedulers=False)
    assert scheds[0].last_epoch == 6 != expected_last_epoch(run, 0) == 4
    assert any("before `optimizer.step()`" in w for w in warned)


@st.composite
def scale_runs(draw):
    iterations = draw(st.integers(min_value=2, max_value=14))
    return {
        "iterations": iterations,
        "growth_interval": draw(st.integers(min_value=1, max_value=3)),
        "optimizers": draw(st.lists(st.sampled_from(sorted(OPTIMIZERS)), min_size=1, max_size=2)),
        "overflow": draw(st.sets(st.integers(0, iterations - 1))),
        # per iteration: a plain update(), update(new_scale=float), update(new_scale=tensor), or a
        # load_state_dict() of an earlier state before the iteration
        "events": draw(st.lists(st.sampled_from(["", "", "", "float", "tensor", "load"]),
                                min_size=iterations, max_size=iterations)),
        "nonfinite": draw(st.sampled_from(["off", "raise"])),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(scale_runs())
def test_the_loss_scale_ampguard_reports_is_the_scalers_whatever_happens(run):
    """ampguard knows the scale after update() without reading it while nothing else changed it:
    growth, backoff, new_scale and load_state_dict() must all keep it exactly the scaler's."""
    with ampguard.guard(nonfinite=run["nonfinite"]) as g:
        models = [model(seed=j) for j in range(len(run["optimizers"]))]
        opts = [OPTIMIZERS[kind](m.parameters()) for kind, m in zip(run["optimizers"], models, strict=True)]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=run["growth_interval"])
        hook = Overflow(models[0][0].weight, run["overflow"])
        saved = scaler.state_dict()
        skips = 0
        for i in range(run["iterations"]):
            hook.i = i
            if run["events"][i] == "load":
                scaler.load_state_dict(saved)
            x, y = data(i)
            loss = sum(torch.nn.functional.mse_loss(m(x), y) for m in models)
            scaler.scale(loss).backward()
            for opt in opts:
                scaler.step(opt)
            skips += i in run["overflow"]  # the overflow is in the first model's gradients only
            event = run["events"][i]
            if event == "float":
                scaler.update(new_scale=float(2 ** (i % 5 + 3)))
            elif event == "tensor":
                scaler.update(new_scale=torch.tensor(float(2 ** (i % 4 + 2))))
            else:
                scaler.update()
            assert g.stats.loss_scale == scaler.get_scale(), (i, run)
            if i == 1:
                saved = scaler.state_dict()
            for opt in opts:
                opt.zero_grad()
        assert g.stats.optimizer_steps_skipped == skips


def test_a_clean_non_fused_step_reads_nothing_of_the_scalers():
    """The scaler's decision for a non-fused optimizer is whether its step() ran: no read of found_inf,
    scale or tracker (ampguard's only sync on such a loop is the non-finite check's, when it is on)."""
    from ampguard import _sync

    reads = []
    original = _sync.read

    def spy(own, device=None):
        reads.append(len(own))
        return original(own, device)

    with ampguard.guard(nonfinite="off") as g:
        _sync.read = spy
        try:
            _, _, sched, _ = scaled_loop(lambda opt: S.LambdaLR(opt, lambda s: 1.0), 6, {3},
                                         scaler=torch.amp.GradScaler("cpu", growth_interval=2))
        finally:
            _sync.read = original
    assert reads[0] > 0  # the first update reads the scale once
    assert reads[1:] == [0] * 5, reads
    assert g.stats.optimizer_steps_skipped == 1 and sched.last_epoch == 5
