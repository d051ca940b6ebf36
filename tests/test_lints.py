"""Each AMP lint fires once in the bad case, at the user's line, and stays silent in the correct one."""

import importlib
import re
import warnings

import pytest
import torch
from loops import data, line_of, model

import ampguard


def ours(caught):
    return [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]


def lint_warnings(*iterations, **options):
    """Install with ``options``, run each ``iteration(model, optimizer, scaler)`` on one set; ampguard's warnings."""
    ampguard.install(**options)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for iteration in iterations:
            iteration(m, opt, scaler)
    return ours(caught)


def scaled_iteration(m, opt, scaler, *, unscale: bool, clip=None, params=None):
    scaler.scale(m(data(0)[0]).pow(2).mean()).backward()
    if unscale:
        scaler.unscale_(opt)
    clip = clip or torch.nn.utils.clip_grad_norm_  # looked up now: a name bound before install() is not wrapped
    clip(m.parameters() if params is None else params, 1.0)  # CLIP LINE
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize("clip", [torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_],
                         ids=["clip_grad_norm_", "clip_grad_value_"])
def test_clipping_still_scaled_gradients_warns_once_at_the_call(clip):
    def iteration(m, opt, scaler):
        scaled_iteration(m, opt, scaler, unscale=False, clip=getattr(torch.nn.utils, clip.__name__))

    found = lint_warnings(iteration, iteration, iteration)
    assert len(found) == 1
    message = str(found[0].message)
    assert f"torch.nn.utils.{clip.__name__} was called on gradients that a GradScaler has scaled" in message
    assert "scaler.unscale_(optimizer)" in message and "65536" in message
    assert found[0].filename == __file__


def test_clipping_after_unscale_is_silent_and_clips_the_same():
    ampguard.install()
    m, ref = model(), model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for net in (m, ref):
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            scaled_iteration(net, opt, torch.amp.GradScaler("cpu"), unscale=True,
                             params=(p for p in net.parameters()))  # a generator: read once, still clipped
            ampguard.uninstall()
    assert ours(caught) == []
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters(), strict=True))


def test_clipping_without_a_scaler_or_after_update_is_silent():
    def unscaled_after_update(m, opt, scaler):
        m(data(1)[0]).sum().backward()  # an unscaled backward after update(): the iteration is over
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)

    assert lint_warnings(lambda *a: scaled_iteration(*a, unscale=True), unscaled_after_update) == []


def test_clipping_a_model_trained_without_the_scaler_in_the_same_iteration_is_silent():
    """An actor in fp32 with its own optimizer and clipping, a critic under the scaler: the actor's gradients were
    never scaled, and the lint said to unscale them."""
    ampguard.install()
    critic, actor = model(1), model(2)
    opt_c, opt_a = torch.optim.SGD(critic.parameters(), lr=0.1), torch.optim.SGD(actor.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            x = data(i)[0]
            scaler.scale(critic(x).pow(2).mean()).backward()  # the scaler's iteration is open from here
            actor(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(actor.parameters(), 0.5)  # never scaled
            opt_a.step()
            opt_a.zero_grad()
            scaler.unscale_(opt_c)
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            scaler.step(opt_c)
            scaler.update()
            opt_c.zero_grad()
    assert ours(caught) == []


def test_two_optimizers_on_one_scaler_clipping_the_one_not_unscaled_warns_at_its_line():
    """A GAN-style pair: the discriminator is unscaled, the generator's gradients are clipped still scaled.
    The scaler's own per-optimizer stage says which is which; the first iteration gives no verdict
    (no optimizer has stepped yet to say whose parameters are whose), the second warns, once."""
    ampguard.install()
    gen, disc = model(1), model(2)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def iteration(clip_gen: bool):
        x = data(0)[0]
        scaler.scale(gen(x).pow(2).mean() + disc(x).pow(2).mean()).backward()
        scaler.unscale_(opt_d)
        torch.nn.utils.clip_grad_norm_(disc.parameters(), 1.0)  # unscaled: never warns
        if clip_gen:
            torch.nn.utils.clip_grad_norm_(gen.parameters(), 1.0)  # GEN CLIP
        scaler.step(opt_g)
        scaler.step(opt_d)
        scaler.update()
        opt_g.zero_grad()
        opt_d.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iteration(False)
        iteration(False)
        assert ours(caught) == []  # the discriminator's clip, after its unscale_, is silent
        for _ in range(3):
            iteration(True)
    found = ours(caught)
    assert len(found) == 1 and "clip_grad_norm_ was called on gradients that a GradScaler has scaled" in \
        str(found[0].message)
    assert found[0].filename == __file__
    with open(__file__) as f:
        assert "# GEN CLIP" in f.read().splitlines()[found[0].lineno - 1]


def test_lightning_gradient_clip_val_under_16_mixed_does_not_warn():
    L = pytest.importorskip("lightning.pytorch")
    from test_lightning import fit, module_class

    ampguard.install()
    precision = importlib.import_module("lightning.pytorch.plugins.precision")
    plugin = precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    _, found = fit(L, module_class(L)(), plugins=[plugin], gradient_clip_val=0.5)
    assert found == []
    # and the lint is live in that process: a hand-written loop without unscale_ warns (at its second iteration:
    # the first tells which optimizers the scaler steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = model()
        opt, scaler = torch.optim.SGD(m.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
        for _ in range(2):
            scaled_iteration(m, opt, scaler, unscale=False)
    assert len(ours(caught)) == 1



def manual_clipper(L, where: str):
    """Manual optimization with clip_gradients in training_step (Lightning's documented example, which clips the
    still scaled gradients under 16-mixed) or in on_before_optimizer_step (after Lightning's unscale_)."""

    class ManualClip(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.layer(batch[0]).pow(2).mean())
            if where == "training_step":
                self.clip_gradients(opt, gradient_clip_val=0.5)  # MANUAL CLIP
            opt.step()

        def on_before_optimizer_step(self, optimizer):
            if where == "hook":
                self.clip_gradients(optimizer, gradient_clip_val=0.5)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return ManualClip()


@pytest.mark.parametrize("where", ["training_step", "hook"])
def test_lightning_manual_clip_gradients_names_lightning_and_the_hook_where_the_gradients_are_unscaled(where):
    """Lightning unscales inside opt.step() under manual optimization, so a clip_gradients in training_step clips
    scaled gradients. The fix said "call scaler.unscale_(optimizer)", which makes Lightning's own unscale_() raise;
    clipping in on_before_optimizer_step, which the message now names, is silent."""
    L = pytest.importorskip("lightning.pytorch")
    from test_lightning import fit, scaler_plugin

    ampguard.install()
    _, found = fit(L, manual_clipper(L, where), plugins=[scaler_plugin(L)])
    if where == "hook":
        assert found == []
        return
    assert len(found) == 1, [str(w.message) for w in found]
    message = str(found[0].message)
    assert "Lightning's ManualClip.clip_gradients (torch.nn.utils.clip_grad_norm_) was called on gradients that a " \
        "GradScaler has scaled" in message, message
    assert "Clip there: def on_before_optimizer_step(self, optimizer): self.clip_gradients(" in message, message
    assert "scaler.unscale_(optimizer) right before" not in message, message
    assert found[0].filename == __file__ and found[0].lineno == line_of(manual_clipper, "MANUAL CLIP")


def fp16_adam_step(eps, dtype=torch.float16):
    m = torch.nn.Linear(4, 1).to(dtype)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=eps)
    for _ in range(2):
        m(torch.ones(2, 4, dtype=dtype)).sum().backward()
        opt.step()  # STEP LINE
        opt.zero_grad()


def test_fp16_parameters_with_an_eps_that_rounds_to_zero_warn_at_the_first_step():
    ampguard.install(nonfinite="off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16_adam_step(1e-8)
    found = ours(caught)
    assert len(found) == 1
    message = str(found[0].message)
    assert "Adam#0: the parameters are float16 and Adam's eps=1e-08 rounds to 0 in float16" in message
    assert "eps=1e-4 or larger" in message and "float32 master weights" in message
    assert found[0].filename == __file__


@pytest.mark.parametrize(("eps", "dtype"), [(1e-4, torch.float16), (1e-8, torch.float32), (1e-8, torch.bfloat16)])
def test_a_safe_eps_or_dtype_does_not_warn(eps, dtype):
    ampguard.install(nonfinite="off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16_adam_step(eps, dtype)
    assert ours(caught) == []


def test_a_fused_adam_on_float16_parameters_does_not_warn_about_eps_and_does_make_no_nan():
    """The fused kernels compute in float32: Adam's 1e-8 does not round to 0 there, and the lint said the
    parameters would become NaN."""
    ampguard.install(nonfinite="off")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Flatten(), torch.nn.Linear(16, 1)).half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-8, fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            m(torch.randint(0, 5, (4, 2))).float().pow(2).mean().backward()  # rows 5-9: second moments of 0
            opt.step()
            opt.zero_grad()
    assert ours(caught) == []
    assert all(torch.isfinite(p).all() for p in m.parameters())



@pytest.mark.parametrize("beta2", [0.999, 0.95])
def test_the_eps_message_says_what_the_step_makes_below_the_gradient_it_names(beta2):
    """The message said the update "divides 0 by 0 and the parameters become NaN". At the first step the second
    moment is 0 wherever (1 - beta2) * g^2 underflows float16, and the parameter becomes ±Inf there: NaN only where
    the gradient is 0 itself. A Lightning precision="16-true" fit with AdamW showed 528 ±Inf and no NaN."""
    from ampguard.lints import eps_message

    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = torch.optim.Adam([param], lr=1e-3, betas=(0.9, beta2))
    message = eps_message(opt)
    assert "the update divides by 0: the parameter becomes ±Inf, or NaN where its gradient was 0 too" in message
    below = float(re.search(r"wherever \|gradient\| is below ([0-9.e+-]+):", message).group(1))
    assert f"times 1 - beta2 ({1 - beta2:g}) underflows float16" in message, message
    param.grad = torch.tensor([0.0, 0.9 * below, 1.1 * below], dtype=torch.float16)
    opt.step()
    assert param[0].isnan() and param[1].isinf() and param[2].isfinite(), param


def test_eps_rounding_is_decided_exactly():
    from ampguard.lints import eps_rounds_to_zero

    assert eps_rounds_to_zero(1e-8) and eps_rounds_to_zero(2.0**-25)
    assert not eps_rounds_to_zero(2.0**-24) and not eps_rounds_to_zero(1e-6) and not eps_rounds_to_zero(0.0)
    assert float(torch.tensor(2.0**-25, dtype=torch.float16)) == 0.0
    assert float(torch.tensor(2.0**-24, dtype=torch.float16)) > 0.0


def autocast_iteration(m, opt, scaler, dtype):
    with torch.autocast("cpu", dtype=dtype):
        loss = m(data(0)[0]).float().pow(2).mean()
    scaler.scale(loss).backward()  # SCALE LINE
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_grad_scaler_with_bf16_autocast_warns_once():
    def bf16(*a):
        autocast_iteration(*a, torch.bfloat16)

    found = lint_warnings(bf16, bf16, bf16)
    assert len(found) == 1
    assert "GradScaler('cpu') scales a loss computed under bfloat16 autocast" in str(found[0].message)
    assert "drop the GradScaler" in str(found[0].message)
    assert found[0].filename == __file__


def test_grad_scaler_with_fp16_autocast_or_after_bf16_evaluation_is_silent():
    def bf16_evaluation_then_fp32_step(m, opt, scaler):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            m(data(1)[0])
        scaler.scale(m(data(2)[0]).sum()).backward()
        scaler.step(opt)
        scaler.update()

    assert lint_warnings(lambda *a: autocast_iteration(*a, torch.float16), bf16_evaluation_then_fp32_step) == []


def test_a_bf16_region_nested_in_an_fp16_forward_does_not_say_drop_the_scaler():
    """The fp16 region's gradients still need the scaler; judged by the latest region entered alone, the lint told
    the user to drop it."""
    def mixed(m, opt, scaler):
        with torch.autocast("cpu", dtype=torch.float16):
            h = m(data(0)[0])
            with torch.autocast("cpu", dtype=torch.bfloat16):  # one part of the model in bf16
                h = torch.tanh(h.float())
            loss = h.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    def bf16_twice(m, opt, scaler):  # two bf16 regions and nothing else: still a bf16 loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = m(data(0)[0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = h.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    assert lint_warnings(mixed, mixed) == []
    found = lint_warnings(bf16_twice)
    assert len(found) == 1 and "scales a loss computed under bfloat16 autocast" in str(found[0].message)


def test_an_autocast_region_left_by_an_earlier_guard_does_not_hide_the_bf16_lint():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ampguard.guard(), torch.autocast("cpu", dtype=torch.float16):
        m(data(0)[0]).sum()  # an fp16 region that no scale() judged, in a block now gone
    with ampguard.guard(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autocast_iteration(m, opt, torch.amp.GradScaler("cpu"), torch.bfloat16)
    assert len(ours(caught)) == 1


def test_scheduler_step_before_any_optimizer_step_keeps_pytorchs_one_warning():
    ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
        opt.step()
    assert [w.category for w in caught] == [UserWarning]
    assert "before `optimizer.step()`" in str(caught[0].message)


def test_lint_off_silences_every_lint():
    assert lint_warnings(lambda *a: scaled_iteration(*a, unscale=False),
                         lambda *a: autocast_iteration(*a, torch.bfloat16),
                         lambda *a: fp16_adam_step(1e-8), lint=False, nonfinite="off") == []


def test_lints_under_warnings_as_errors_raise_at_the_user_line():
    ampguard.install(nonfinite="off")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ampguard.AmpGuardWarning)
        with pytest.raises(ampguard.AmpGuardWarning, match="rounds to 0"):
            fp16_adam_step(1e-8)
    assert ampguard.active().options.lint  # an error the user asked for is not an internal failure
    assert "lint" not in ampguard.active()._disabled
