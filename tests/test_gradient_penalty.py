"""A gradient penalty under GradScaler, as PyTorch's AMP examples write it: the gradients of a scaled value, taken
with ``create_graph=True``, overflow fp16 while the scale calibrates, and so does the loss made from them.
GradScaler skips those steps and trains on; ampguard must too, and still name a NaN the penalty did not make."""

import pytest
import torch
from loops import line_of

import ampguard
from ampguard import _guard


def critic(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LeakyReLU(0.2), torch.nn.Linear(64, 1))


def wgan_gp_steps(steps, *, init_scale, of="inputs", total=None, penalty=None, log_zero_at=None, nan_weight_at=None):
    """WGAN-GP's critic under fp16 autocast: the penalty on the gradients at interpolated inputs (``of="inputs"``),
    or on the parameters' gradients, as the AMP examples' "Gradient penalty" does (``of="params"``). The LR holds
    where GradScaler skipped, as ampguard holds it (one optimizer: the scale comparison is right here). Returns the
    parameters, the LR and the scale. ``log_zero_at``: a log of 0 in the loss at that step; ``nan_weight_at``: a NaN
    in the per-sample weights of the real scores (data, not the penalty's). ``total``: the gradients are those of
    the outputs' "sum", or of their "mean" times the batch size (the same, from values the batch size smaller: a
    last layer's bias has gradient scale x batch size of a sum); by default a sum for inputs, a mean for params."""
    total = total or ("sum" if of == "inputs" else "mean")
    D = critic()
    opt = torch.optim.Adam(D.parameters(), 1e-3, betas=(0.5, 0.9))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9 ** i)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    gen = torch.Generator().manual_seed(1)
    guard = ampguard.active()
    for i in range(steps):
        real, fake = torch.randn(32, 16, generator=gen), 2 * torch.randn(32, 16, generator=gen)
        eps = torch.rand(32, 1, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            x = (eps * real + (1 - eps) * fake).requires_grad_(of == "inputs")
            out = D(x)
        inputs = x if of == "inputs" else list(D.parameters())
        grads = torch.autograd.grad(scaler.scale(out.sum() if total == "sum" else out.mean()), inputs,
                                    create_graph=True)
        inv_scale = (1.0 if total == "sum" else len(x)) / scaler.get_scale()
        grads = [g * inv_scale for g in grads]
        with torch.autocast("cpu", dtype=torch.float16):
            if penalty is not None:
                gp = penalty(grads)
            elif of == "inputs":
                gp = ((grads[0].norm(2, dim=1) - 1) ** 2).mean()
            else:
                gp = sum(g.pow(2).sum() for g in grads).sqrt()
            weights = torch.ones(32, 1)
            if i == nan_weight_at:
                weights[5] = float("nan")
            loss = D(fake).mean() - (D(real) * weights).mean() + 10 * gp
            if i == log_zero_at:
                loss = loss + torch.log(D(real).mean() * 0)  # log of 0
        opt.zero_grad()
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if (guard is not None and guard.options.schedulers) or scaler.get_scale() >= before:
            schedule.step()
    return torch.cat([p.detach().flatten() for p in D.parameters()]), schedule.get_last_lr()[0], scaler.get_scale()


@pytest.mark.parametrize("of", ["inputs", "params"])
@pytest.mark.parametrize("init_scale", [2.0 ** 16, 2.0 ** 20])  # 2**20: 5 skips in a row, past check_unscaled_after
@pytest.mark.parametrize("mode", ["raise", "warn", "skip"])
def test_a_gradient_penalty_that_overflows_while_the_scale_calibrates_trains_as_without_ampguard(of, init_scale,
                                                                                                mode, recwarn):
    plain = wgan_gp_steps(12, init_scale=init_scale, of=of)
    with ampguard.guard(nonfinite=mode) as g:
        guarded = wgan_gp_steps(12, init_scale=init_scale, of=of)
    assert torch.equal(guarded[0], plain[0]) and guarded[1:] == plain[1:]
    assert g.stats.penalty_overflows >= 1  # the loss was inf/NaN at those steps: left to GradScaler
    assert g.stats.nonfinite_detected == 0 and g.stats.nonfinite_steps_skipped == 0
    assert g.stats.scheduler_steps_held == g.stats.optimizer_steps_skipped > 0
    assert f"left to GradScaler: {g.stats.penalty_overflows}" in g.report()
    assert not [w for w in recwarn if issubclass(w.category, ampguard.AmpGuardWarning)]


def test_without_the_scheduler_hold_the_overflow_is_still_left_to_gradscaler():
    plain = wgan_gp_steps(12, init_scale=2.0 ** 20)
    with ampguard.guard(schedulers=False) as g:
        guarded = wgan_gp_steps(12, init_scale=2.0 ** 20)
    assert torch.equal(guarded[0], plain[0]) and guarded[1:] == plain[1:]
    assert g.stats.penalty_overflows == 5 and g.stats.nonfinite_detected == 0
    assert g.stats.scheduler_steps_held == 0 and g.stats.optimizer_steps_skipped == 7


def test_after_a_fault_in_gradscaler_tracking_the_overflow_is_read_after_update_and_still_left_to_gradscaler(
        monkeypatch):
    # (no read rides on update(): the loss is read at the next model call, once the scaler's iteration has ended)
    plain = wgan_gp_steps(12, init_scale=2.0 ** 20)
    monkeypatch.setattr("ampguard.schedulers._remember_step", lambda *args: 1 / 0)
    # (schedulers=False: the loop holds its LR itself, as the plain run does)
    with ampguard.guard(schedulers=False) as g, \
            pytest.warns(ampguard.AmpGuardWarning, match="internal error in GradScaler tracking"):
        guarded = wgan_gp_steps(12, init_scale=2.0 ** 20)
    assert g._disabled == {_guard.GRADSCALER}
    assert torch.equal(guarded[0], plain[0]) and guarded[1:] == plain[1:]
    assert g.stats.penalty_overflows == 5 and g.stats.nonfinite_detected == 0


def test_a_nan_in_the_loss_that_the_penalty_did_not_make_is_raised_at_its_step_naming_its_op():
    with ampguard.guard() as g, pytest.raises(ampguard.NonFiniteError) as info:
        wgan_gp_steps(12, init_scale=2.0 ** 20, log_zero_at=8)
    assert info.value.op == "torch.log" and info.value.kind == "-inf"
    assert info.value.origin[-1].lineno == line_of(wgan_gp_steps, "# log of 0")
    assert g.stats.optimizer_steps_applied + g.stats.optimizer_steps_skipped == 9  # stopped at that step (i == 8)


def test_a_nan_the_data_brings_into_a_penalty_steps_loss_is_still_named():
    with ampguard.guard() as g, pytest.raises(ampguard.NonFiniteError) as info:
        wgan_gp_steps(12, init_scale=2.0 ** 20, nan_weight_at=8)
    assert "It entered already non-finite (NaN)" in str(info.value) and "shape (32, 1)" in str(info.value)
    assert g.stats.optimizer_steps_applied + g.stats.optimizer_steps_skipped == 9


def test_a_penalty_non_finite_at_every_scale_stops_at_the_skip_limit_and_the_collapse_says_why():
    def penalty(grads):
        return 1 / (grads[0] * 0).norm()  # +Inf whatever the scale

    with ampguard.guard(max_consecutive_skips=6) as g, pytest.raises(ampguard.LossScaleCollapseError) as info:
        wgan_gp_steps(12, init_scale=2.0 ** 10, penalty=penalty)
    message = str(info.value)
    assert "at 6 of these steps the loss was inf/NaN through a gradient penalty" in message
    assert "the loss was finite at every one of these steps" not in message
    assert g.stats.penalty_overflows == 6 and g.stats.nonfinite_detected == 0


def test_a_penalty_inf_at_a_step_gradscaler_applied_is_raised_saying_that_it_stopped_training():
    # The parameters' penalty of a sum: the last bias's gradient, scale x 32, passes 65504 from scale 2048 on, and
    # holds no graph, so the step's gradients stay finite. Without ampguard the scale settles at 2048 and the
    # penalty is inf at every step from then on.
    plain = wgan_gp_steps(12, init_scale=2.0 ** 16, of="params", total="sum")
    assert plain[2] == 2048.0
    with ampguard.guard() as g, pytest.raises(ampguard.NonFiniteError) as info:
        wgan_gp_steps(12, init_scale=2.0 ** 16, of="params", total="sum")
    message = str(info.value)
    assert "A gradient penalty made it" in message and "At scale 2048 they overflow" in message
    assert "GradScaler applied the step and does not back off" in message
    assert g.stats.penalty_overflows == 5 and g.stats.optimizer_steps_skipped == 5  # 65536 .. 4096: left to it
