"""Invisible when nothing is wrong: warnings keep their place, counters say what they mean."""

import warnings

import torch
from loops import Overflow, data, model

import ampguard

WARNS = """
import sys, warnings, torch
if sys.argv[1] == "guarded":
    import ampguard
    ampguard.install()
m = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 1)
sched.step()  # a real mistake, no scaler involved: PyTorch's own warning
"""


def test_a_torch_warning_inside_a_wrapped_call_keeps_its_file_and_line(python, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WARNS)
    plain = python(None, "-W", "always", str(script), "plain")
    guarded = python(None, "-W", "always", str(script), "guarded")
    line = [x for x in plain.stderr.splitlines() if "Detected call of `lr_scheduler.step()`" in x]
    assert line and line[0].startswith(f"{script}:9: UserWarning: Detected call"), plain.stderr
    assert [x for x in guarded.stderr.splitlines() if "Detected call" in x] == line, guarded.stderr
    # so a filter on the user's module still catches it
    strict = python(None, "-W", "error::UserWarning:__main__", str(script), "guarded")
    assert strict.returncode == 1 and "UserWarning: Detected call" in strict.stderr


def test_uninstall_restores_warnings_warn_by_identity():
    original = warnings.warn
    ampguard.install()
    assert warnings.warn is not original and warnings.warn.__wrapped__ is original
    ampguard.uninstall()
    assert warnings.warn is original


def test_optimizer_steps_applied_counts_steps_without_a_scaler():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(5):
        x, y = data(i)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert g.stats.optimizer_steps_applied == 5 and g.stats.optimizer_steps_skipped == 0
    assert "optimizer steps: 5 applied, 0 skipped" in g.report()


def test_loss_scale_is_the_scale_after_each_update():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    hook = Overflow(m[0].weight, {1, 2})
    for i in range(7):  # grows every 2 clean steps, backs off at each overflow
        hook.i = i
        x, y = data(i)
        scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert g.stats.loss_scale == scaler.get_scale(), i
    assert g.stats.optimizer_steps_applied == 5 and g.stats.optimizer_steps_skipped == 2
    assert g.stats.loss_scale_min == 256.0


def test_loss_scale_follows_update_with_a_new_scale():
    g = ampguard.install()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data(0)
    scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
    scaler.step(opt)
    scaler.update(new_scale=123.0)
    assert g.stats.loss_scale == scaler.get_scale() == 123.0
