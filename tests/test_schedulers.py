import pickle
import warnings

import pytest
import torch
from loops import (
    Overflow,
    added_syncs,
    backward_and_step,
    data,
    lr,
    model,
    one_scaler_two_optimizers,
    reference_loop,
    scaled_loop,
)
from torch.optim import lr_scheduler as S

import ampguard
from ampguard import _sync

SKIPS = (0, 3, 4, 9)


def one_cycle(opt):
    return S.OneCycleLR(opt, max_lr=0.5, total_steps=12)


def lambda_warmup(opt):
    return S.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))


def sequential(opt):
    return S.SequentialLR(opt, [S.LinearLR(opt, 0.1, total_iters=3), S.ExponentialLR(opt, 0.9)], milestones=[3])


def chained(opt):
    return S.ChainedScheduler([S.LinearLR(opt, 0.1, total_iters=4), S.ExponentialLR(opt, 0.9)])


def warm_restarts(opt):
    return S.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2)


def epochs(sched):
    inner = [s.last_epoch for s in getattr(sched, "_schedulers", [])]
    return [getattr(sched, "last_epoch", None), *inner]


def assert_same_run(make_sched, skips, iterations=16, make_opt=None):
    ampguard.install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrs, m, sched, _ = scaled_loop(make_sched, iterations, skips, make_opt=make_opt)
    ref_lrs, ref_m, ref_sched = reference_loop(make_sched, iterations, skips, make_opt=make_opt)
    assert lrs == ref_lrs
    assert epochs(sched) == epochs(ref_sched)  # inner schedulers of composites never drift
    for p, q in zip(m.parameters(), ref_m.parameters(), strict=False):
        assert torch.equal(p, q)
    scheduler_warnings = [w for w in caught if "lr_scheduler" in str(w.message) or "Tried to step" in str(w.message)]
    assert scheduler_warnings == []
    stats = ampguard.active().stats
    assert stats.optimizer_steps_skipped == len(skips)
    assert stats.scheduler_steps_held == len(skips)
    return sched


def test_seed_first_iteration_skipped_one_cycle():
    sched = assert_same_run(one_cycle, skips=(0,), iterations=12)
    assert sched.last_epoch == 11


def test_without_ampguard_the_seed_problem_is_real():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrs, *_ = scaled_loop(one_cycle, 12, (0,))
    assert any("before `optimizer.step()`" in str(w.message) for w in caught)
    assert lrs != reference_loop(one_cycle, 12, (0,))[0]


@pytest.mark.parametrize("make_sched", [one_cycle, lambda_warmup, sequential, chained, warm_restarts],
                         ids=["OneCycleLR", "LambdaLR", "SequentialLR", "ChainedScheduler", "WarmRestarts"])
def test_skips_at_later_iterations_follow_applied_steps(make_sched):
    assert_same_run(make_sched, SKIPS, iterations=15)


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_fused_and_foreach_adamw(kind):
    make_opt = lambda p: torch.optim.AdamW(p, lr=0.01, **{kind: True})  # noqa: E731
    assert_same_run(lambda_warmup, SKIPS, make_opt=make_opt)


def test_fused_adamw_steps_even_when_skipping_so_scale_comparison_is_not_used():
    # The fused optimizer's step() runs on a skipped iteration; only found_inf tells the truth.
    ampguard.install()
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, fused=True)
    called = []
    opt.register_step_post_hook(lambda *a: called.append(1))
    sched = lambda_warmup(opt)
    scaler = torch.amp.GradScaler("cpu")
    Overflow(m[0].weight, {0}).i = 0
    scaler.scale(m(data(0)[0]).sum()).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    assert called == [1]
    assert sched.last_epoch == 0
    assert ampguard.active().stats.scheduler_steps_held == 1


def test_two_optimizers_on_one_scaler_with_inf_in_only_one():
    g = ampguard.install()
    m1, m2 = model(1), model(2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.AdamW(m2.parameters(), lr=0.1)
    s1, s2 = lambda_warmup(o1), lambda_warmup(o2)
    scaler = torch.amp.GradScaler("cpu")
    one_scaler_two_optimizers(m1, m2, o1, o2, s1, s2, scaler, Overflow(m1[0].weight, {1, 2}),
                              [data(i)[0] for i in range(5)])
    assert s1.last_epoch == 3  # two of its five steps were skipped
    assert s2.last_epoch == 5  # its own steps all applied, although the shared scale backed off
    assert g.stats.optimizer_steps_skipped == 2
    assert g.stats.optimizer_steps_applied == 8


def test_growth_steps_and_new_scale_are_not_skips():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = lambda_warmup(opt)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    hook = Overflow(m[0].weight, {4})
    for i in range(8):
        hook.i = i
        scaler.scale(m(data(i)[0]).sum()).backward()
        scaler.step(opt)
        if i == 2:
            scaler.update(new_scale=1024.0)  # a lower scale, set by hand: not a skip
        elif i == 3:
            scaler.update(new_scale=torch.tensor(4096.0))
        elif i == 4:
            scaler.update(new_scale=8.0)  # a skipped iteration with a hand-set scale is still a skip
        else:
            scaler.update()  # grows every iteration
        sched.step()
        opt.zero_grad()
    assert scaler.get_scale() == 8.0 * 2**3
    assert g.stats.optimizer_steps_skipped == 1
    assert sched.last_epoch == 7
    assert g.stats.loss_scale_max == 65536.0 * 4


def test_per_epoch_step_lr_whose_last_batch_overflowed_still_steps():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = S.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, {3, 8, 9, 10, 11})  # epoch 0 ends on an overflow; epoch 2 is all overflow
    for epoch in range(4):
        for b in range(4):
            hook.i = epoch * 4 + b
            scaler.scale(m(data(hook.i)[0]).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        sched.step()
    assert sched.last_epoch == 3  # epoch 2 applied no step at all: held once
    assert g.stats.scheduler_steps_held == 1
    assert lr(opt) == 0.125


def test_reduce_lr_on_plateau_is_never_held():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = S.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, range(4))
    for i in range(4):
        hook.i = i
        scaler.scale(m(data(i)[0]).sum()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step(1.0)
    assert lr(opt) == 0.125
    assert g.stats.scheduler_steps_held == 0


def test_warm_restarts_with_explicit_epoch_is_never_held():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = warm_restarts(opt)
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, range(3))
    for i in range(3):
        hook.i = i
        scaler.scale(m(data(i)[0]).sum()).backward()
        scaler.step(opt)
        scaler.update()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's epoch deprecation warning
            sched.step(epoch=i + 0.5)
    assert sched.last_epoch == 2
    assert g.stats.scheduler_steps_held == 0
    assert g.stats.optimizer_steps_skipped == 3


def test_one_cycle_with_skips_never_steps_past_total_steps():
    ampguard.install()
    # 12 total steps, 11 applied iterations after the constructor's step, plus 4 skips.
    _lrs, _, sched, _ = scaled_loop(one_cycle, 11 + len(SKIPS), SKIPS)
    assert sched.last_epoch == 11
    with pytest.raises(ValueError, match="Tried to step"):
        scaled_loop(one_cycle, 11 + len(SKIPS), ())  # without skips the same loop overruns


def test_scheduler_step_before_scaler_update_is_decided_from_the_same_step():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = lambda_warmup(opt)
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, {0, 2})
    for i in range(4):
        hook.i = i
        scaler.scale(m(data(i)[0]).sum()).backward()
        scaler.step(opt)
        sched.step()
        scaler.update()
        opt.zero_grad()
    assert sched.last_epoch == 2
    assert g.stats.optimizer_steps_skipped == 2


def test_schedulers_without_a_scaler_are_untouched():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = lambda_warmup(opt)
    for i in range(3):
        m(data(i)[0]).sum().backward()
        opt.step()
        sched.step()
    assert sched.last_epoch == 3
    assert g.stats.optimizer_steps_applied == 3 and g.stats.scheduler_steps_held == 0  # counted, never held


class _SlotsOptimizer:
    """An optimizer-like object without a __dict__ (GradScaler needs only param_groups, state and step)."""

    __slots__ = ("__weakref__", "inner")

    def __init__(self, inner):
        self.inner = inner

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, *args, **kwargs):
        return self.inner.step(*args, **kwargs)


def test_an_optimizer_like_object_without_a_dict_is_tracked():
    g = ampguard.install()
    m = model()
    opt = _SlotsOptimizer(torch.optim.SGD(m.parameters(), lr=1.0))
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, {1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an internal failure would warn and switch the feature off
        for i in range(3):
            hook.i = i
            scaler.scale(m(data(i)[0]).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.inner.zero_grad()
    assert g.stats.optimizer_steps_skipped == 1 and g.stats.optimizer_steps_applied == 2
    assert "schedulers" in g._on


@pytest.mark.parametrize(("with_scaler", "options", "added"), [
    (True, {"nonfinite": "off"}, 1), (False, {"nonfinite": "off"}, 0),  # gating alone: none without a scaler
    (True, {}, 1), (False, {}, 1),  # everything on: still one per step, the sinks share the read
])
def test_at_most_one_added_sync_per_iteration(with_scaler, options, added, monkeypatch):
    # On a CPU, ampguard reads CPU statuses one by one where they are (no device, no sync); the path a device
    # takes, one read of everything, is what is counted here.
    monkeypatch.setattr(_sync, "HOST_READS", False)
    def iteration(m, opt, scaler, sched):
        backward_and_step(m(data(0)[0]).sum(), opt, scaler)
        sched.step()

    def make():
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=0.01, fused=True)
        sched = lambda_warmup(opt)
        scaler = torch.amp.GradScaler("cpu") if with_scaler else None
        return lambda: iteration(m, opt, scaler, sched)

    assert added_syncs(make, **options) == added


def test_loss_scale_collapse_raises_before_any_parameter_is_non_finite():
    ampguard.install(max_consecutive_skips=5)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, range(100))
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ampguard.LossScaleCollapseError) as info:
        for i in range(100):
            hook.i = i
            scaler.scale(m(data(i)[0]).sum()).backward()
            scaler.step(opt)
            scaler.update()
    assert hook.i == 4
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before, strict=False))
    err = info.value
    assert err.optimizers == ["AdamW#0"]
    assert err.scale_history == [65536.0, 32768.0, 16384.0, 8192.0, 4096.0]
    assert "5 times in a row" in str(err) and "AdamW#0" in str(err) and "What ampguard saw" in str(err)


def test_loss_scale_never_reaches_zero_even_without_a_skip_limit():
    ampguard.install(max_consecutive_skips=None)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-120)
    hook = Overflow(m[0].weight, range(100))
    with pytest.raises(ampguard.LossScaleCollapseError, match="would become"):
        for i in range(100):
            hook.i = i
            scaler.scale(m(data(i)[0]).sum()).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() > 0
    assert all(torch.isfinite(p).all() for p in m.parameters())


def stepped_scaler() -> torch.amp.GradScaler:
    """Under install(): a GradScaler that has scaled, backpropagated and stepped once, its update() due."""
    ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(m(data(0)[0]).sum()).backward()
    scaler.step(opt)
    return scaler


def test_new_scale_zero_is_refused():
    scaler = stepped_scaler()
    with pytest.raises(ampguard.LossScaleCollapseError, match="update\\(new_scale"):
        scaler.update(new_scale=0.0)
    assert scaler.get_scale() == 65536.0


@pytest.mark.parametrize(("new_scale", "becomes"), [(1e39, "inf"), (1e-46, "0")])
def test_a_new_scale_float32_cannot_hold_is_judged_as_the_scaler_will_hold_it(new_scale, becomes):
    """fill_() writes a float new_scale into the float32 scale: 1e39 becomes inf and 1e-46 becomes 0 there,
    though both are finite and positive as Python floats."""
    scaler = stepped_scaler()
    with pytest.raises(ampguard.LossScaleCollapseError, match=f"would become {becomes} \\(set through update"):
        scaler.update(new_scale=new_scale)
    assert scaler.get_scale() == 65536.0


@pytest.mark.parametrize("new_scale", ["high", [1024.0]], ids=["a string", "a list"])
def test_a_new_scale_torch_refuses_gets_torchs_own_error_and_leaves_the_tracking_on(new_scale, recwarn):
    """update(new_scale=[1024.0]) failed in ampguard's float() first: an "internal error" warning, and GradScaler
    tracking switched off for the rest of the run. torch's update() takes a float or a tensor; its error says so."""
    g = ampguard.install()
    with pytest.raises(AttributeError, match="has no attribute 'device'"):
        stepped_scaler().update(new_scale=new_scale)
    assert not [w for w in recwarn if issubclass(w.category, ampguard.AmpGuardWarning)]
    assert g._disabled == set() and "schedulers" in g._on
    scaler = stepped_scaler()
    scaler.update(new_scale=1024.0)
    assert scaler.get_scale() == 1024.0 and g.stats.loss_scale == 1024.0  # (the tracking counted this update)


def test_default_skip_limit_survives_a_normal_calibration():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, range(16))  # 65536 down to 1
    for i in range(20):
        hook.i = i
        scaler.scale(m(data(i)[0]).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert g.stats.optimizer_steps_skipped == 16
    assert g.options.max_consecutive_skips == 32


def _subclass_check(cls):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = cls(opt)
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(m[0].weight, {0, 1})
    for i in range(4):
        hook.i = i
        scaler.scale(m(data(i)[0]).sum()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return sched


class DefinedBeforeInstall(S.LambdaLR):
    def __init__(self, opt):
        self.calls = 0
        super().__init__(opt, lambda s: 1.0)

    def step(self, epoch=None):
        self.calls += 1
        super().step(epoch)


def test_user_subclass_overriding_step_defined_before_and_after_install():
    ampguard.install()

    class DefinedAfterInstall(S.LRScheduler):  # does not call super().step()
        def __init__(self, opt):
            self.calls = 0
            super().__init__(opt)

        def get_lr(self):
            return [g["lr"] for g in self.optimizer.param_groups]

        def step(self, epoch=None):
            self.calls += 1
            self.last_epoch += 1

    for cls in (DefinedBeforeInstall, DefinedAfterInstall):
        sched = _subclass_check(cls)
        assert sched.calls == 3  # constructor's step + 2 applied iterations
        assert sched.last_epoch == 2
    assert ampguard.active().stats.scheduler_steps_held == 4
    ampguard.uninstall()
    assert not hasattr(vars(DefinedAfterInstall)["step"], "__wrapped__")
    assert not hasattr(vars(DefinedBeforeInstall)["step"], "__wrapped__")


def test_state_dicts_and_pickling_are_unchanged():
    def states():
        _lrs, _m, sched, scaler = scaled_loop(lambda_warmup, 6, (2,))
        opt = sched.optimizer
        return sched.state_dict(), scaler.state_dict(), opt.state_dict(), pickle.dumps(scaler)

    plain = states()
    ampguard.install()
    guarded = states()
    sd_keys = lambda d: sorted(k for k in d if k != "lr_lambdas")  # noqa: E731
    assert sd_keys(plain[0]) == sd_keys(guarded[0])
    assert plain[1].keys() == guarded[1].keys()
    assert plain[2]["param_groups"][0].keys() == guarded[2]["param_groups"][0].keys()
    assert pickle.loads(guarded[3]).get_scale() == pickle.loads(plain[3]).get_scale()


def test_disabled_option_leaves_schedulers_alone():
    ampguard.install(schedulers=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaled_loop(one_cycle, 6, (0,))
    assert any("before `optimizer.step()`" in str(w.message) for w in caught)


def test_without_the_hold_gradscalers_skips_are_still_counted_and_a_collapse_still_raised():
    """schedulers=False switches off the hold alone. GradScaler's bookkeeping went off with it: a run that skipped
    every step went on past max_consecutive_skips without a word, and the stats counted no skip."""
    g = ampguard.install(schedulers=False, max_consecutive_skips=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own scheduler warning: not held
        with pytest.raises(ampguard.LossScaleCollapseError, match="4 times in a row"):
            scaled_loop(one_cycle, 10, range(10))  # (every iteration's gradients overflow)
    assert g.stats.optimizer_steps_skipped == 4 and g.stats.scheduler_steps_held == 0
    assert g.stats.loss_scale == 65536.0 / 16


def test_the_usual_update_taken_without_a_read_keeps_the_scalers_scale_and_the_schedule(monkeypatch):
    """The usual update() is counted without reading the scaler (its skips, scale and tracker known from the last
    update's prediction) and its scale predicted as every update's is. Through its growth, a NaN loss raised at its
    read, a skip after it and a step() that the user replaces on the optimizer halfway, ampguard's scale is the
    scaler's at every update, and the scheduler is held exactly at the two skipped steps."""
    from ampguard import schedulers

    taken = []
    known = schedulers._known

    def seen(*args):
        found = known(*args)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(schedulers, "_known", seen)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = S.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    hook = Overflow(m[0].weight, {9})
    errors = 0
    with ampguard.guard() as g:
        for i in range(16):
            hook.i = i
            if i == 12:
                opt.step = _own_step(opt)
            x, y = data(i)
            loss = torch.nn.functional.mse_loss(m(x), y) * (float("nan") if i == 6 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            try:
                scaler.update()
            except ampguard.NonFiniteError:
                errors += 1
            assert g.stats.loss_scale == scaler.get_scale(), i
            sched.step()
            opt.zero_grad()
    assert errors == 1
    assert True in taken and False in taken
    # the NaN loss made NaN gradients, so the scaler skipped that step as it skipped the overflow at 9
    assert g.stats.optimizer_steps_skipped == 2 and g.stats.scheduler_steps_held == 2
    assert sched.last_epoch == 16 - 2
    assert all(torch.isfinite(p).all() for p in m.parameters())


def _own_step(opt):
    step = type(opt).step.__get__(opt)

    def own_step(*args, **kwargs):
        return step(*args, **kwargs)

    return own_step


# -- torch's fused SGD on a skipped first step ------------------------------------------------------
def fused_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)


def one_step(m, opt, scaler, i=0, overflow=True):
    """One GradScaler iteration of ``m`` whose gradients overflow (or, without ``overflow``, one applied)."""
    hook = Overflow(m[0].weight, {i} if overflow else ())
    hook.i = i
    x, y = data(i)
    scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    hook.iterations = set()
    opt.zero_grad()


def test_without_ampguard_a_skipped_first_step_of_fused_sgd_stores_uninitialised_momentum():
    # torch makes the buffers with empty_like and its kernel returns before writing them when found_inf is set
    m = model()
    opt = fused_sgd(m.parameters())
    one_step(m, opt, torch.amp.GradScaler("cpu"))
    assert all(p.isfinite().all() for p in m.parameters())  # the step itself changed no weight...
    assert [set(opt.state[p]) for p in m.parameters()] == [{"momentum_buffer"}] * 4  # ...but kept its buffers


def test_fused_sgd_whose_first_steps_are_skipped_trains_as_if_they_never_happened():
    """An fp16 GradScaler skips its first steps while it calibrates. Each skipped first step of a fused SGD stored
    uninitialised memory as its momentum; the run now equals one without those iterations (ampguard undoes the
    buffers at update()), and says once what it did."""
    assert_same_run(lambda_warmup, (0, 1, 5), make_opt=fused_sgd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaled_loop(lambda_warmup, 3, (0, 1), make_opt=fused_sgd)  # (another optimizer: its own notice)
    said = [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]
    assert len(said) == 1  # two skipped first steps, one notice
    assert "of SGD#" in str(said[0].message) and "fused=True" in str(said[0].message)
    assert said[0].filename.endswith("loops.py")  # the line that calls update()


def test_momentum_buffers_a_fused_sgd_had_before_a_skipped_step_are_kept():
    """A checkpoint's buffers, loaded before the first step of this process: the kernel reads them, and a skip leaves
    them; so does ampguard (the property test covers skips after applied steps). A param group added after training
    began gets its first step skipped: only its own buffers are taken out."""
    ampguard.install()
    m = model()
    opt = fused_sgd(m.parameters())
    one_step(m, opt, torch.amp.GradScaler("cpu"), overflow=False)
    saved = opt.state_dict()

    resumed = fused_sgd(m.parameters())
    resumed.load_state_dict(saved)
    loaded = [resumed.state[p]["momentum_buffer"].clone() for p in m.parameters()]
    one_step(m, resumed, torch.amp.GradScaler("cpu"), i=1)
    assert all(torch.equal(resumed.state[p]["momentum_buffer"], b) for p, b in zip(m.parameters(), loaded, strict=True))

    head = torch.nn.Linear(2, 2)
    resumed.add_param_group({"params": list(head.parameters())})
    hook = Overflow(m[0].weight, {2})
    hook.i = 2
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(head(m(data(0)[0])).sum()).backward()
    scaler.step(resumed)
    with pytest.warns(ampguard.AmpGuardWarning, match="skipped the first step"):
        scaler.update()
    assert all(torch.equal(resumed.state[p]["momentum_buffer"], b) for p, b in zip(m.parameters(), loaded, strict=True))
    assert all(p not in resumed.state for p in head.parameters())
    assert ampguard.active().stats.optimizer_steps_skipped == 2


def test_the_fused_sgd_notice_turned_into_an_error_leaves_the_update_and_the_repair_done():
    ampguard.install()
    m = model()
    opt = fused_sgd(m.parameters())
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ampguard.AmpGuardWarning, match="fused=True"):
            one_step(m, opt, scaler)
    assert not opt.state
    assert scaler.get_scale() == 2.0**15  # update() backed the scale off before the warning came
    assert not ampguard.active()._disabled  # the user's error, not an internal failure
    opt.zero_grad()
    one_step(m, opt, scaler, i=1)  # said once: no warning (and no error) again
