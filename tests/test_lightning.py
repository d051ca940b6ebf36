"""Real Trainer.fit on CPU, tiny models, in both Lightning namespaces."""

import contextlib
import importlib
import math
import sys
import textwrap
import warnings

import pytest
import torch
from loops import gan_class, line_of
from torch.utils.data import DataLoader, TensorDataset

import ampguard

NAMESPACES = [pytest.param(ns, id=ns) for ns in ("lightning.pytorch", "pytorch_lightning")]
BATCHES = 4


@pytest.fixture(params=NAMESPACES)
def L(request):
    return pytest.importorskip(request.param)


def loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(BATCHES * 8, 4, generator=g)), batch_size=8)


def module_class(L, optimizer_step=None, opt="sgd", sched=False, overflow=()):
    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.training_steps = 0
            if overflow:
                self.layer.weight.register_hook(
                    lambda grad: grad * float("inf") if self.training_steps - 1 in overflow else None)

        def training_step(self, batch, batch_idx):
            self.training_steps += 1
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            if opt == "lbfgs":
                return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            if not sched:
                return optimizer
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        if optimizer_step is not None:  # in the class body, as users write it
            locals()["optimizer_step"] = optimizer_step

    return Model


def poisoned(L, at: int, as_dict: bool = False):
    """A module whose training_step adds log(-1) to the loss of batch ``at`` (the line ends with "# POISON")."""

    class Poisoned(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            out = self.layer(batch[0])
            loss = out.pow(2).mean()
            if batch_idx == at:
                loss = loss + torch.log(out - out - 1).mean()  # POISON
            return {"loss": loss, "size": len(batch[0])} if as_dict else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Poisoned


def warmup_step(self, epoch, batch_idx, optimizer, optimizer_closure):
    """The seed report: LR warm-up, then optimizer.step() without the closure."""
    for group in optimizer.param_groups:
        group["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 10)
    optimizer.step()


def closure_then_step(self, epoch, batch_idx, optimizer, optimizer_closure):
    optimizer_closure()
    optimizer.step()


def correct_step(self, epoch, batch_idx, optimizer, optimizer_closure):
    optimizer.step(closure=optimizer_closure)


def nothing_step(self, epoch, batch_idx, optimizer, optimizer_closure):
    pass


def fit(L, model, callbacks=(), plugins=None, logger=False, **kwargs):
    trainer = L.Trainer(max_epochs=1, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=list(callbacks),
                        plugins=plugins, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    ours = [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]
    return trainer, ours


def scaler_plugin(L, init_scale=2.0**16):
    precision = importlib.import_module(f"{L.__name__}.plugins.precision")
    return precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def test_a_calibration_streaks_replay_of_training_step_leaves_its_metrics_and_the_users_log_as_they_were(L):
    """check_unscaled_after replays training_step at a GradScaler streak's 3rd skip, in a fit that goes on: the
    metrics it updates count each batch once, and code that logs can tell the replay (ampguard.replaying())."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Measured(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.mean, self.mse = torchmetrics.MeanMetric(), torchmetrics.MeanSquaredError()
            self.held = {"mae": torchmetrics.MeanAbsoluteError()}  # a plain dict: no submodule, called all the same
            self.seen = []  # (the replay's append is undone: a replay puts the module's lists back)

        def training_step(self, batch, batch_idx):
            out = self.layer(batch[0])
            self.mean.update(out.detach().mean())  # update()
            self.mse(out.detach(), torch.zeros_like(out))  # forward
            self.held["mae"](out.detach(), torch.zeros_like(out))
            if ampguard.replaying():
                replays.append(batch_idx)  # (outside the module: what replaying() is for, a logger's effects)
            else:
                self.seen.append(batch_idx)
            return out.pow(2).mean() * 1e3

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    replays = []

    def run(guarded):
        model = Measured()
        with ampguard.guard() if guarded else contextlib.nullcontext() as g:
            fit(L, model, plugins=[scaler_plugin(L, init_scale=2.0**40)])
        values = [float(m.compute()) for m in (model.mean, model.mse, model.held["mae"])]
        return (values, model.seen), list(replays), g

    plain, _, _ = run(False)
    guarded, replays, g = run(True)
    assert g.stats.optimizer_steps_skipped >= 3 and replays
    assert guarded == plain


def test_seed_warmup_override_without_closure_trains(L):
    Model = module_class(L, warmup_step)  # defined before install()
    g = ampguard.install()
    model = Model()
    before = model.layer.weight.detach().clone()
    _, ours = fit(L, model)
    assert model.training_steps == BATCHES
    assert not torch.equal(before, model.layer.weight)
    assert g.stats.closures_injected == BATCHES
    assert len(ours) == 1
    message = str(ours[0].message)
    assert "Model.optimizer_step called optimizer.step() without the closure" in message
    assert "optimizer.step(closure=optimizer_closure)" in message
    assert ours[0].filename == __file__ and ours[0].lineno == warmup_step.__code__.co_firstlineno + 4


def test_seed_override_crashes_without_ampguard(L):
    model = module_class(L, warmup_step)()
    with pytest.raises(Exception, match="closure hasn't been executed"):
        fit(L, model)


def test_closure_then_step_under_a_grad_scaler_applies_the_step(L):
    Model = module_class(L, closure_then_step)
    plain = Model()
    before = plain.layer.weight.detach().clone()
    fit(L, plain, plugins=[scaler_plugin(L)])
    assert torch.equal(before, plain.layer.weight)  # the silent failure this fixes

    g = ampguard.install()
    model = Model()
    _, ours = fit(L, model, plugins=[scaler_plugin(L)])
    assert model.training_steps == BATCHES
    assert not torch.equal(before, model.layer.weight)
    assert g.stats.closures_injected == BATCHES
    # every step went through the scaler; the first ones may be its normal fp16 calibration skips
    assert g.stats.optimizer_steps_applied + g.stats.optimizer_steps_skipped == BATCHES
    assert g.stats.optimizer_steps_applied >= 1
    assert len(ours) == 1 and "called optimizer_closure() and then optimizer.step()" in str(ours[0].message)


@pytest.mark.parametrize("options", [dict(accumulate_grad_batches=2), dict(gradient_clip_val=0.5),
                                     dict(accumulate_grad_batches=2, gradient_clip_val=0.5)],
                         ids=["accumulate", "clip", "accumulate-clip"])
def test_closure_then_step_with_accumulation_and_clipping_trains_exactly_as_the_correct_override(L, options):
    """Under accumulation Lightning calls optimizer_step only at each boundary: the injection happens there, and
    the run is the correct override's, bit for bit, skips of the fp16 calibration included."""
    ampguard.install()
    reference = module_class(L, correct_step, sched=True)()
    fit(L, reference, plugins=[scaler_plugin(L, init_scale=16.0)], **options)
    ampguard.uninstall()
    g = ampguard.install()
    model = module_class(L, closure_then_step, sched=True)()
    _, ours = fit(L, model, plugins=[scaler_plugin(L, init_scale=16.0)], **options)
    boundaries = BATCHES // options.get("accumulate_grad_batches", 1)
    assert g.stats.closures_injected == boundaries and model.training_steps == BATCHES
    assert len(ours) == 1
    assert torch.equal(model.layer.weight, reference.layer.weight)


def test_correct_override_is_unchanged_and_silent(L):
    g = ampguard.install()
    model = module_class(L, correct_step)()
    reference = module_class(L, correct_step)()
    _, ours = fit(L, model)
    ampguard.uninstall()
    fit(L, reference)
    assert ours == [] and g.stats.closures_injected == 0
    assert model.training_steps == BATCHES
    assert torch.equal(model.layer.weight, reference.layer.weight)


def test_lbfgs_still_re_evaluates_the_closure(L):
    g = ampguard.install()
    model = module_class(L, correct_step, opt="lbfgs")()
    _, ours = fit(L, model)
    assert model.training_steps > BATCHES  # LBFGS called the closure several times per step
    assert ours == [] and g.stats.closures_injected == 0


def test_no_step_and_no_closure_still_fails_with_lightnings_own_error(L):
    g = ampguard.install()
    model = module_class(L, nothing_step)()
    with pytest.raises(Exception, match="closure hasn't been executed") as info:
        fit(L, model)
    assert type(info.value).__name__ == "MisconfigurationException"
    assert g.stats.closures_injected == 0  # never turned into a warning


class DropsTheClosure(torch.optim.SGD):
    def step(self, closure=None):
        return super().step()  # the closure is lost: stale gradients


def test_an_optimizer_that_drops_the_closure_still_fails_with_lightnings_own_error(L):
    class Model(module_class(L, warmup_step)):
        def configure_optimizers(self):
            return DropsTheClosure(self.parameters(), lr=0.1)

    g = ampguard.install()
    with pytest.raises(Exception, match="closure hasn't been executed"):
        fit(L, Model())
    assert g.stats.closures_injected == 0


def test_the_override_receives_lightnings_own_closure_class(L):
    from importlib import import_module

    Closure = import_module(f"{L.__name__}.loops.optimization.automatic").Closure
    seen = []

    def checking_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        seen.append(isinstance(optimizer_closure, Closure))
        optimizer.step(closure=optimizer_closure)

    ampguard.install()
    fit(L, module_class(L, checking_step)())
    assert seen == [True] * BATCHES


def test_a_module_that_keeps_lightnings_own_optimizer_step_gets_no_proxies(L):
    """Lightning's own hook always passes the closure: nothing to inject, so the step sees Lightning's
    objects themselves (the proxies cost two objects per step), and training is unchanged."""
    Closure = importlib.import_module(f"{L.__name__}.loops.optimization.automatic").Closure
    seen = []

    class Spy(importlib.import_module(f"{L.__name__}.plugins.precision").Precision):
        def optimizer_step(self, optimizer, model, closure, **kwargs):
            seen.append(type(closure))
            return super().optimizer_step(optimizer, model, closure, **kwargs)

    g = ampguard.install()
    model, reference = module_class(L)(), module_class(L)()
    _, ours = fit(L, model, plugins=[Spy()])
    assert seen == [Closure] * BATCHES and ours == [] and g.stats.closures_injected == 0
    seen.clear()
    fit(L, module_class(L, correct_step)(), plugins=[Spy()])
    assert seen and all(t is not Closure for t in seen)  # an override still gets the proxy
    ampguard.uninstall()
    fit(L, reference)
    assert torch.equal(model.layer.weight, reference.layer.weight)


def renamed_step(self, epoch, batch_idx, optimizer, closure):
    closure()
    optimizer.step()


def super_step(self, epoch, batch_idx, optimizer, optimizer_closure):
    super(type(self), self).optimizer_step(epoch, batch_idx, optimizer)  # SUPER LINE: the closure is lost


def test_warnings_use_the_users_name_for_the_closure_and_the_users_line(L):
    ampguard.install()
    _, ours = fit(L, module_class(L, renamed_step)())
    message = str(ours[0].message)
    assert "called closure() and then optimizer.step()" in message
    assert message.endswith("Fix: pass the closure: optimizer.step(closure=closure).")
    assert "test_lightning.py:" not in message  # the location is the warning's own, not repeated
    ampguard.uninstall()
    g = ampguard.install()
    model = module_class(L, super_step)()
    _, ours = fit(L, model)
    assert model.training_steps == BATCHES and g.stats.closures_injected == BATCHES
    assert ours[0].filename == __file__ and ours[0].lineno == super_step.__code__.co_firstlineno + 1


def test_class_defined_after_install_and_option_off(L):
    ampguard.install()
    Model = module_class(L, warmup_step)
    model = Model()
    _, ours = fit(L, model)
    assert model.training_steps == BATCHES and len(ours) == 1
    ampguard.uninstall()
    ampguard.install(closures=False)
    with pytest.raises(Exception, match="closure hasn't been executed"):
        fit(L, Model())


def test_uninstall_restores_every_optimizer_step_by_identity(L):
    Before = module_class(L, warmup_step)
    original_base = vars(L.LightningModule)["optimizer_step"]
    original_sub = vars(Before)["optimizer_step"]
    ampguard.install()
    After = module_class(L, closure_then_step)
    original_after = vars(After)["optimizer_step"].__wrapped__
    assert vars(Before)["optimizer_step"].__wrapped__ is original_sub
    ampguard.uninstall()
    assert vars(L.LightningModule)["optimizer_step"] is original_base
    assert vars(Before)["optimizer_step"] is original_sub
    assert vars(After)["optimizer_step"] is original_after
    assert "__init_subclass__" not in vars(L.LightningModule)


def test_lightning_1x_signature_is_left_untouched_with_the_reason(L):
    ampguard.install()
    with pytest.warns(ampguard.AmpGuardWarning, match="Lightning 1.x's") as caught:
        class Old(L.LightningModule):
            def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_idx, optimizer_closure, on_tpu,
                               using_native_amp, using_lbfgs):
                optimizer.step(closure=optimizer_closure)
    assert not hasattr(vars(Old)["optimizer_step"], "__wrapped__")
    ours = [w for w in caught if "Lightning 1.x's" in str(w.message)]
    code = vars(Old)["optimizer_step"].__code__
    assert (ours[0].filename, ours[0].lineno) == (code.co_filename, code.co_firstlineno)  # the method itself


def test_every_1x_class_is_warned_about_even_when_it_reuses_a_freed_classs_id(L):
    """Classes defined in a loop (a notebook cell run again, a test's parametrisation) are freed and their ids
    reused: the warning once keyed by id() was given for the first class only."""
    import gc

    ampguard.install()
    warned = 0
    for _ in range(10):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            class Old(L.LightningModule):
                def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_idx, optimizer_closure, on_tpu,
                                   using_native_amp, using_lbfgs):
                    optimizer.step(closure=optimizer_closure)

        warned += any("Lightning 1.x's" in str(w.message) for w in caught)
        del Old
        gc.collect()
    assert warned == 10


def test_a_1x_class_defined_before_lightning_was_patched_is_warned_about_at_its_method(python, tmp_path):
    other = tmp_path / "old_model.py"
    other.write_text(
        "import lightning.pytorch as pl\n\n"
        "class Old(pl.LightningModule):\n"
        "    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_idx, optimizer_closure, on_tpu,\n"
        "                       using_native_amp, using_lbfgs):\n"
        "        optimizer.step(closure=optimizer_closure)\n")
    proc = python("import old_model, ampguard, warnings\nwarnings.simplefilter('always')\nampguard.install()\n",
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "Lightning 1.x's" in x]
    assert len(lines) == 1 and lines[0].startswith(f"{other}:4: AmpGuardWarning"), proc.stderr


def test_keyword_closure_and_kwargs_signatures_are_adapted(L):
    def kw_step(self, epoch, batch_idx, optimizer, optimizer_closure=None, **kwargs):
        optimizer.step()

    g = ampguard.install()
    model = module_class(L, kw_step)()
    fit(L, model)
    assert model.training_steps == BATCHES and g.stats.closures_injected == BATCHES


def test_fp16_scaler_overflow_holds_the_per_step_scheduler(L):
    g = ampguard.install()
    model = module_class(L, sched=True, overflow={0, 2})()
    trainer, _ = fit(L, model, plugins=[scaler_plugin(L, init_scale=16.0)])  # no natural fp16 overflow
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert g.stats.optimizer_steps_skipped == 2 and g.stats.scheduler_steps_held == 2
    assert scheduler.last_epoch == BATCHES - 2
    assert trainer.global_step == BATCHES  # Lightning counts skipped steps; ampguard leaves it alone


def test_callback_installs_logs_and_restores(L, tmp_path):
    from ampguard.lightning import AmpGuardCallback

    callback = AmpGuardCallback(max_consecutive_skips=100)
    assert isinstance(callback, L.Callback)
    model = module_class(L, sched=True, overflow={1})()
    logger = importlib.import_module(f"{L.__name__}.loggers").CSVLogger(tmp_path)
    trainer, _ = fit(L, model, callbacks=[callback], plugins=[scaler_plugin(L, init_scale=16.0)], logger=logger)
    metrics = trainer.callback_metrics
    assert metrics["ampguard/optimizer_steps_skipped"].item() == 1
    assert metrics["ampguard/scheduler_steps_held"].item() == 1
    assert metrics["ampguard/loss_scale"].item() == 8.0
    assert ampguard.active() is None  # it installed the guard, so it removed it


def test_callback_without_a_logger_warns_nothing_and_still_fills_callback_metrics(L):
    from ampguard.lightning import AmpGuardCallback

    model = module_class(L)()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = fit(L, model, callbacks=[AmpGuardCallback()])  # fit() passes logger=False
    assert not [w for w in caught if "no logger configured" in str(w.message)]
    assert trainer.callback_metrics["ampguard/optimizer_steps_skipped"] == 0.0


def test_callback_keeps_an_existing_guard(L):
    from ampguard.lightning import AmpGuardCallback

    g = ampguard.install()
    fit(L, module_class(L)(), callbacks=[AmpGuardCallback()])
    assert ampguard.active() is g


def _patched_update():
    from torch.amp.grad_scaler import GradScaler

    return vars(GradScaler)["update"]


@pytest.mark.parametrize("failure", ["nan", "user error", "user error over a pending nan"])
def test_callback_removes_its_guard_when_the_fit_raises_and_the_fits_own_error_wins(L, failure):
    """Lightning calls on_exception, not always teardown, when a stage raises: the guard the callback installed
    stayed, and the next fit (a sweep, a notebook cell) ran under it without the callback owning it."""
    from ampguard.lightning import AmpGuardCallback

    original = _patched_update()

    class Failing(module_class(L)):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss + torch.log(-loss.detach().abs() - 1) if "nan" in failure else loss

    class UserError(L.Callback):
        def on_before_optimizer_step(self, *args):  # after backward(): the step's checks are still pending
            raise RuntimeError("a user's callback failed")

    model = Failing()
    callbacks = [AmpGuardCallback()] + ([UserError()] if "user error" in failure else [])
    expected = ampguard.NonFiniteError if failure == "nan" else RuntimeError
    with pytest.raises(expected):
        fit(L, model, callbacks=callbacks)
    assert ampguard.active() is None and _patched_update() is original


def test_callback_lets_a_manual_optimization_error_win_over_the_nan_it_left_pending(L):
    """manual_backward() of a NaN loss, then the user's own error before the step: removing the guard read the
    pending NaN and raised it in place of the user's error."""
    from ampguard.lightning import AmpGuardCallback

    class Manual(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            self.manual_backward(self.layer(batch[0]).log().mean())  # NaN where the output is negative
            raise RuntimeError("the user's own error, before the step")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(RuntimeError, match="the user's own error") as info:
        fit(L, Manual(), callbacks=[AmpGuardCallback()])
    assert ampguard.active() is None
    # (the error carries the origin of the NaN it left pending: a note from Python 3.11, its cause before)
    carried = "\n".join(getattr(info.value, "__notes__", ())) + str(info.value.__cause__ or "")
    assert "The error above came after a value ampguard was about to check" in carried or sys.version_info < (3, 11)
    assert "NaN reached the loss" in carried and "created by Tensor.log (inputs finite, output NaN)" in carried, \
        carried


@pytest.mark.parametrize("how", ["AmpGuardCallback", "install() alone"])
def test_a_nan_that_torch_s_own_check_meets_in_training_step_is_named_by_replaying_it(L, how):
    """Under automatic optimization training_step is the outermost call: it raised before it returned a loss, nothing
    was pending, and torch's ValueError left without the line that made the NaN. Without the callback (AMPGUARD=1 on a
    script, a notebook, a test) Lightning's own error path carries it: no sys.excepthook prints an error caught here."""
    from ampguard.lightning import AmpGuardCallback

    seen = []

    class Probe(L.Callback):
        def on_exception(self, trainer, pl_module, exception):
            seen.append(list(getattr(exception, "__notes__", ())))  # (another callback sees the error with its note)

    class Gaussian(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            mu, var = self.layer(batch[0]).unbind(-1)
            std = (var - 10.0).sqrt()  # SQRT LINE (a negative variance: NaN)
            return -torch.distributions.Normal(mu, std, validate_args=True).log_prob(batch[0][:, 0]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if how == "install() alone":
        ampguard.install()
    with pytest.raises(ValueError, match="Expected parameter scale") as info:
        fit(L, Gaussian(), callbacks=[Probe()] + ([AmpGuardCallback()] if how == "AmpGuardCallback" else []))
    carried = "\n".join(getattr(info.value, "__notes__", ())) + str(info.value.__cause__ or "")
    assert "NaN was made in the call of 'Gaussian.training_step' before it raised." in carried, carried
    if hasattr(info.value, "add_note"):
        assert len(info.value.__notes__) == 1 and seen == [info.value.__notes__]  # (once, before on_exception)
    assert "created by Tensor.sqrt (inputs finite, output NaN) in module 'Gaussian'" in carried, carried
    assert f"test_lightning.py:{line_of(Gaussian.training_step, 'SQRT LINE')}" in carried, carried


def test_callback_options_apply_for_the_fit_over_a_guard_already_installed(L):
    """Under AMPGUARD=1 (or the script's own install()) the options given to the callback were dropped silently."""
    from ampguard.lightning import AmpGuardCallback

    g = ampguard.install(max_consecutive_skips=40)
    seen = []

    class Probe(L.Callback):
        def on_train_batch_start(self, *args):
            seen.append(ampguard.active().options.max_consecutive_skips)

    fit(L, module_class(L)(), callbacks=[AmpGuardCallback(max_consecutive_skips=100), Probe()])
    assert seen and set(seen) == {100}
    assert ampguard.active() is g and g.options.max_consecutive_skips == 40


def test_callback_rejects_bad_options():
    from ampguard.lightning import AmpGuardCallback

    with pytest.raises(ampguard.ConfigError, match="closures"):
        AmpGuardCallback(closures="sometimes")


def test_ampguard_env_with_a_lightning_script_that_never_imports_ampguard(python, tmp_path):
    script = tmp_path / "train_lightning.py"
    script.write_text(textwrap.dedent("""
        import torch, lightning.pytorch as L
        from torch.utils.data import DataLoader, TensorDataset
        class Model(L.LightningModule):
            def __init__(self):
                super().__init__(); self.layer = torch.nn.Linear(4, 1); self.n = 0
            def training_step(self, batch, i):
                self.n += 1; return self.layer(batch[0]).pow(2).mean()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
            def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
                optimizer.step()
        m = Model()
        L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, accelerator="cpu").fit(
            m, DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=8))
        print("training steps", m.n)
    """))
    proc = python(None, str(script), env={"AMPGUARD": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "training steps 3" in proc.stdout
    assert "optimizer.step(closure=optimizer_closure)" in proc.stderr
    plain = python(None, str(script))
    assert plain.returncode != 0 and "closure hasn't been executed" in plain.stderr


def test_training_step_is_one_outermost_call_with_its_module_calls_on_torchs_fast_path_and_nothing_recorded(L):
    """Under automatic optimization training_step is the outermost call, as under a strategy: captured once, its
    module calls find no global hook (torch's fast path), its loss code is not recorded (a replay runs training_step
    again), and nothing of Lightning's after it is either (its division of the loss by 1 is the loss itself)."""
    from torch.nn.modules import module as nn_module

    from ampguard import nonfinite

    hooks_inside, seen = [], []

    class Model(module_class(L)):
        def training_step(self, batch, batch_idx):
            hooks_inside.append(len(nn_module._global_forward_pre_hooks))
            return super().training_step(batch, batch_idx)

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            hooks_inside.append(len(nn_module._global_forward_pre_hooks))

        def on_before_backward(self, trainer, pl_module, loss):
            seen.append((nonfinite.T.tape, [(type(e).__name__, getattr(e, "module", None) is pl_module,
                                             getattr(e, "method", None)) for e in nonfinite.T.window]))

    ampguard.install()
    fit(L, Model(), callbacks=[Probe()])
    assert hooks_inside == [1, 0] * BATCHES  # ampguard's global pre-hook, taken off while training_step runs
    assert seen == [(None, [("Call", True, "training_step")])] * BATCHES


def realistic_class(L):
    class Realistic(L.LightningModule):
        """The shapes real training steps have: a checkpointed block, an attention mask filled with -inf, a teacher
        under no_grad, a loss written as an nn.Module, self.log, and a dict with the logits beside the loss."""

        def __init__(self, poison_at=None):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Linear(8, 16)
            self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Dropout(0.1))
            self.head = torch.nn.Linear(16, 3)
            self.teacher = torch.nn.Linear(8, 3).requires_grad_(False)
            self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
            self.poison_at = poison_at

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = torch.utils.checkpoint.checkpoint(self.block, self.embed(x), use_reentrant=False)
            mask = torch.ones(len(x), len(x), dtype=torch.bool).triu(1)
            attention = (h @ h.T / 4).masked_fill(mask, float("-inf")).softmax(-1)
            logits = self.head(attention @ h)
            with torch.no_grad():
                soft = self.teacher(x).softmax(-1)
            loss = self.criterion(logits, y) + torch.nn.functional.kl_div(logits.log_softmax(-1), soft,
                                                                          reduction="batchmean")
            if batch_idx == self.poison_at:
                loss = loss * torch.log(soft - 1).mean()  # REALISTIC POISON
            self.log("train_loss", loss)
            return {"loss": loss, "logits": logits.detach()}

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Realistic


def realistic_fit(L, model, callbacks=()):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, callbacks=list(callbacks))
    torch.manual_seed(1)  # (dropout)
    trainer.fit(model, DataLoader(data, batch_size=8))


def test_a_realistic_training_step_trains_bit_identically_and_a_nan_in_it_is_named_before_its_step(L):
    """training_step as the outermost call, with what real steps hold: a checkpointed block (its re-run in backward
    is no call), an attention mask of -inf (no sink: the loss is), a no_grad teacher, a loss module, dropout (the
    replay runs with the step's RNG state)."""
    plain = realistic_class(L)()
    realistic_fit(L, plain)
    ampguard.install()
    guarded = realistic_class(L)()
    realistic_fit(L, guarded)
    for p, q in zip(plain.parameters(), guarded.parameters(), strict=True):
        assert torch.equal(p, q)

    steps = []

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append(pl_module.head.weight.detach().clone())

    poisoned = realistic_class(L)(poison_at=2)
    with pytest.raises(ampguard.NonFiniteError) as info:
        realistic_fit(L, poisoned, callbacks=[Probe()])
    err = info.value
    assert err.sink == "loss" and err.op == "torch.log", str(err)
    assert err.origin[-1].line.endswith("# REALISTIC POISON"), str(err)
    assert len(steps) == 2 and torch.equal(poisoned.head.weight, steps[-1])  # the third step was not applied


def test_training_step_called_outside_a_trainer_keeps_its_module_calls_as_the_outermost_calls(L):
    """Without a Trainer (Fabric, a test, a loop of the user's own) nothing says that backward() and the step come
    after training_step returns: a NaN read at a step inside it must find the module calls before it recorded."""
    class SelfStepping(module_class(L)):
        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).log().mean()  # NaN where the layer's output is negative  # SELF STEPPING
            loss.backward()
            self.opt.step()
            return loss

    model = SelfStepping()
    model.opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampguard.install()
    with pytest.raises(ampguard.NonFiniteError) as info:
        model.training_step((torch.randn(8, 4),), 0)
    assert info.value.op == "Tensor.log" and info.value.origin[-1].line.endswith("# SELF STEPPING"), str(info.value)


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_self_log_in_training_step_is_not_recorded_as_loss_code_and_a_nan_after_it_is_named(L, automatic):
    """Under manual optimization the loss code in training_step is recorded, and self.log()'s torch calls are not
    (the record resumes after it); under automatic optimization nothing is recorded, and the replay of training_step
    logs nothing. Either way a NaN made after the logging is named with its op and line."""
    from ampguard import nonfinite

    seen = []

    class Logged(L.LightningModule):
        def __init__(self, poison=False):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.poison = poison
            self.automatic_optimization = automatic

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train_loss", loss, prog_bar=True)  # Lightning copies, converts and moves each value
            self.log_dict({"lr": 0.1, "twice": loss * 2})
            if self.poison:
                loss = loss + torch.log(loss - loss - 1)  # NaN in the loss code after the logging  # AFTER LOG
            if not automatic:
                seen.append([getattr(e, "func", None) for e in nonfinite.T.window])
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Probe(L.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            if automatic:
                seen.append([getattr(e, "func", None) for e in nonfinite.T.window])

    ampguard.install()
    trainer, _ = fit(L, Logged(), callbacks=[Probe()])
    assert len(seen) == BATCHES and trainer.callback_metrics["train_loss"] > 0
    # manual: the layer's call, its pow and mean, and the user's `loss * 2`: nothing of Lightning's logging
    assert seen[0] == ([None] if automatic else [None, torch.Tensor.pow, torch.Tensor.mean, torch.Tensor.mul])
    with pytest.raises(ampguard.NonFiniteError) as info:
        fit(L, Logged(poison=True))
    assert info.value.op == "torch.log"
    assert info.value.origin[-1].line.endswith("# AFTER LOG")


def test_accumulate_grad_batches_on_a_device_reads_once_per_step_and_still_stops_an_earlier_micro_batchs_nan(
        L, monkeypatch):
    """On a device (statuses not read on the host) the step's micro-batches are read together at the step;
    a NaN in the first of two is caught before the optimizer step, and the message says how to have it replayed."""
    from ampguard import _sync

    monkeypatch.setattr(_sync, "HOST_READS", False)

    ampguard.install()
    model = poisoned(L, at=2)()  # the first micro-batch of the second step
    steps = []

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            steps.append(pl_module.layer.weight.detach().clone())

    with pytest.raises(ampguard.NonFiniteError) as info:
        fit(L, model, accumulate_grad_batches=2, callbacks=[Probe()])
    assert info.value.sink == "loss"
    assert len(steps) == 2 and torch.equal(model.layer.weight, steps[-1])  # the second step was never applied
    assert "run without accumulation (accumulate_grad_batches=1)" in str(info.value)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_nan_in_training_step_is_named_through_lightnings_division_of_the_loss(L, accumulate):
    """Lightning divides training_step's loss by accumulate_grad_batches (by 1 too) before backward(): the loss
    the sink sees is that quotient, made after training_step returned."""
    from ampguard import nonfinite

    ampguard.install()
    divisions = []

    class Probe(L.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            divisions.append(sum(getattr(e, "func", None) is torch.div for e in nonfinite.T.window))

    with pytest.raises(ampguard.NonFiniteError) as info:
        fit(L, poisoned(L, at=1, as_dict=True)(), accumulate_grad_batches=accumulate, callbacks=[Probe()])
    assert divisions[0] == (accumulate > 1)  # a division by 1 is the loss itself: nothing to record
    assert info.value.sink == "loss" and info.value.op == "torch.log"
    assert info.value.origin[-1].line.endswith("# POISON")


# manual optimization: the user's training_step calls manual_backward() and step() itself --------------------------
def test_manual_optimization_gan_under_16_mixed_trains_bit_identically_and_holds_only_the_skipped_schedule(L):
    plain = gan_class(L)()
    fit(L, plain, plugins=[scaler_plugin(L, init_scale=2.0**8)])
    ampguard.install()
    guarded = gan_class(L)()
    _, warned = fit(L, guarded, plugins=[scaler_plugin(L, init_scale=2.0**8)])
    assert not warned
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), guarded.parameters(), strict=True))
    assert [s.last_epoch for s in guarded.lr_schedulers()] == [BATCHES, BATCHES]

    skipped = gan_class(L, overflow_at=(1,))()
    fit(L, skipped, plugins=[scaler_plugin(L, init_scale=2.0**8)])
    sched_g, sched_d = skipped.lr_schedulers()
    assert sched_g.last_epoch == BATCHES  # the generator's steps were all applied
    assert sched_d.last_epoch == BATCHES - 1  # the critic's skipped step held its schedule only
    assert sched_d.get_last_lr() == [1e-2 * 0.5 ** (BATCHES - 1)]


def test_manual_optimization_nan_is_named_by_its_path_in_the_lightning_module(L):
    """training_step calls self.D(x): the module is 'D.1' (the LightningModule's own name for it), not '1'."""
    ampguard.install()
    with pytest.raises(ampguard.NonFiniteError) as info:
        fit(L, gan_class(L, nan_in_critic_at=2)())
    assert info.value.sink == "loss" and info.value.op == "Tensor.mul" and info.value.module == "D.1"
    assert "lambda m, a, out: out * float(\"nan\")" in info.value.origin[-1].line


# -- Fabric: its module wrapper is plumbing around the user's module, as a strategy's is -------------------------
class FabricNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x))).log_softmax(-1)  # FABRIC NET


def fabric_run(fabric_ns, precision, guarded, bad_at=None):
    fabric = importlib.import_module(fabric_ns).Fabric(accelerator="cpu", devices=1, precision=precision)
    net = FabricNet()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    losses = []
    with ampguard.guard() if guarded else contextlib.nullcontext():
        for i in range(3):
            x, y = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
            if i == bad_at:
                x[0, 0] = float("inf")  # saturated by the tanh: the loss stays finite, the gradients do not
            loss = torch.nn.functional.nll_loss(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("fabric_ns", ["lightning.fabric", "lightning_fabric"])
def test_fabric_trains_bit_identically_and_names_the_users_modules(fabric_ns, precision):
    """_FabricModule was taken for the user's model: names came out as '_forward_module.body.weight' (tied: also
    '_original_module.body.weight'), and under bf16-mixed the replayed backward met Fabric's own output hook and
    failed ("requires you to call `fabric.backward(loss)`"), so no origin was named."""
    pytest.importorskip(fabric_ns)
    plain, plain_model = fabric_run(fabric_ns, precision, guarded=False)
    guarded, guarded_model = fabric_run(fabric_ns, precision, guarded=True)
    assert guarded == plain
    assert all(torch.equal(p, q) for p, q in zip(plain_model.parameters(), guarded_model.parameters(), strict=True))
    with pytest.raises(ampguard.NonFiniteError) as info:
        fabric_run(fabric_ns, precision, guarded=True, bad_at=1)
    err, message = info.value, str(info.value)
    assert err.sink == "gradient of parameter 'body.weight'", message
    assert "in module 'body'" in message and "_forward_module" not in message and "_original_module" not in message
    assert "argument 0 of the call of 'FabricNet'" in message and "could not replay" not in message, message


# -- the learning-rate finder: a loss that diverges is its answer ------------------------------------------------
def lr_find_run(L, guarded, nan_after=False):
    tuner = importlib.import_module(f"{L.__name__}.tuner")

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.lr = 1e-3

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.layer(x)
            if nan_after and self.lr != 1e-3 and batch_idx == 2:
                out = out.log()  # LR FIND THEN NAN
            return torch.nn.functional.mse_loss(out, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(-1, keepdim=True)), batch_size=8)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = Regression()
    with ampguard.guard() if guarded else contextlib.nullcontext() as active:
        # up to lr 1e4 the loss overflows to Inf, then NaN: the finder reads that as divergence
        found = tuner.Tuner(trainer).lr_find(model, train_dataloaders=data, min_lr=1e-4, max_lr=1e4,
                                             num_training=60, early_stop_threshold=None, update_attr=True)
        losses = found.results["loss"]
        L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_train_batches=4).fit(model, data)
    return found.suggestion(), losses, model, active


def test_the_lr_finder_reads_a_diverging_loss_as_it_does_without_ampguard(L):
    """Lightning's LR range test raises the learning rate until the loss diverges; under ampguard its first Inf
    loss raised NonFiniteError and the finder never answered."""
    plain = lr_find_run(L, guarded=False)
    guarded = lr_find_run(L, guarded=True)
    assert sum(not math.isfinite(v) for v in plain[1]) > 0  # the sweep did diverge
    assert guarded[0] == plain[0]
    assert [str(v) for v in guarded[1]] == [str(v) for v in plain[1]]
    assert torch.equal(guarded[2].layer.weight, plain[2].layer.weight)
    assert guarded[3].stats.nonfinite_detected == 0


def test_after_the_lr_finder_the_checks_are_back_for_the_run(L):
    with pytest.raises(ampguard.NonFiniteError) as info:
        lr_find_run(L, guarded=True, nan_after=True)
    assert info.value.op == "Tensor.log" and info.value.sink == "loss", str(info.value)


def test_a_metric_that_is_nan_by_design_is_logged_as_without_ampguard(L):
    """torchmetrics' Pearson correlation of constant predictions (a zero-initialised regression head, the first
    steps) is NaN, with torchmetrics' own warning. A metric's call measures and is no sink: the fit trains and logs
    exactly as without ampguard. It raised NonFiniteError at the first step."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            torch.nn.init.zeros_(self.body[2].weight)  # predictions all 0 at the first step
            torch.nn.init.zeros_(self.body[2].bias)
            self.pearson = torchmetrics.PearsonCorrCoef()
            self.seen = []

        def training_step(self, batch, batch_idx):
            (x,) = batch
            pred = self.body(x).squeeze(-1)
            r = self.pearson(pred, x.sum(-1))  # the metric between the model's call and the loss
            self.seen.append(r.item())
            self.log("pearson", r)
            return (pred - x.sum(-1)).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    def run():
        model = Regressor()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*variance of predictions or target is close to zero")
            fit(L, model)
        return model.seen, [p.detach().clone() for p in model.parameters()]

    plain = run()
    with ampguard.guard():
        guarded = run()
    assert math.isnan(plain[0][0]) and math.isnan(guarded[0][0])
    assert plain[0][1:] == guarded[0][1:] and all(torch.equal(a, b) for a, b in zip(plain[1], guarded[1], strict=True))


def test_a_nan_in_validation_is_named_with_its_batch_freed_and_the_modules_full_path(L):
    """Lightning's validation loop frees each batch before the next validation_step, where a NaN output under
    no_grad is read: on the CPU the call holds its batch once its output is known to be NaN, and the replay names
    the parameter. The module is named by its path in the LightningModule ('net.2'), as the parameter is: a
    LightningModule with as many parameters as its network named the module from the network ('2')."""

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).logsumexp(-1).mean()

        def on_validation_start(self):
            with torch.no_grad():
                self.net[2].bias[1] = float("nan")  # as a bad checkpoint would

        def validation_step(self, batch, batch_idx):
            (x,) = batch
            self.log("val", self.net(x).sum())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, num_sanity_val_steps=0)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        trainer.fit(Classifier(), loader(), loader())
    message = str(info.value)
    assert "parameter 'net.2.bias'" in message and "in module 'net.2' at" in message, message
    assert "was freed before the check" not in message, message


def test_lightnings_own_logging_metric_is_left_alone(L):
    """self.log() accumulates into Lightning's _ResultMetric, a torchmetrics Metric that Lightning's logging alone
    calls, and whose calls are no loss code already (self.log pauses the record): its forward and update stay
    Lightning's own, which saves some 180 bytecodes a step for two logs. Every other metric's are wrapped."""
    import wrapt
    from torchmetrics import Metric

    result = importlib.import_module(f"{L.__name__}.trainer.connectors.logger_connector.result")
    ampguard.install()
    assert isinstance(vars(Metric)["forward"], wrapt.FunctionWrapper)
    assert not isinstance(vars(result._ResultMetric)["forward"], wrapt.FunctionWrapper)
    logged = result._ResultMetric(result._Metadata("training_step", "loss"), is_tensor=True)
    other = importlib.import_module("torchmetrics").MeanMetric()
    assert "ampguard" not in logged.update.__code__.co_filename  # (torchmetrics' own function)
    assert "ampguard" in other.update.__code__.co_filename
