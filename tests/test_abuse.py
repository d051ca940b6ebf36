"""Failure and abuse leave nothing behind: pickled errors, rejected options, usage errors that end in
the user's frame, a disabled GradScaler, and a CLI that is a drop-in for python."""

import contextlib
import gc
import multiprocessing
import pickle
import traceback
import warnings

import pytest
import torch
from test_replay import SqrtAtZero, line_of  # sqrt at 0: +Inf gradients at every loss scale

import ampguard
from ampguard._patching import REGISTRY


def diverging_trial(i):
    """A sweep's trial in a worker process: trial 1 makes a NaN loss."""
    with ampguard.guard():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(2, 4)
        loss = model(x).sum() * (float("nan") if i == 1 else 1.0)
        loss.backward()
        opt.step()
    return i


def test_errors_round_trip_through_pickle_with_their_attributes():
    nonfinite = ampguard.NonFiniteError("msg", kind="nan", sink="loss", op="torch.log", module="fc",
                                        chain=["torch.log", "Tensor.sum"],
                                        origin=traceback.StackSummary.from_list([("f.py", 3, "fn", "x = 1")]))
    collapse = ampguard.LossScaleCollapseError("collapse", optimizers=["SGD#0"], scale_history=[2.0, 1.0])
    for error in (nonfinite, collapse, ampguard.ConfigError("bad")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert {k: v for k, v in vars(copy).items() if k != "origin"} == \
            {k: v for k, v in vars(error).items() if k != "origin"}
    copy = pickle.loads(pickle.dumps(nonfinite))
    assert copy.origin[0].lineno == 3 and copy.origin[0].filename == "f.py"


def test_a_pool_sweep_with_a_diverging_trial_reports_it_instead_of_hanging():
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        result = pool.map_async(diverging_trial, [0, 1])
        with pytest.raises(ampguard.NonFiniteError) as info:
            result.get(timeout=120)
    assert info.value.sink == "loss" and info.value.kind == "nan"


def _patched_now():
    from torch.amp.grad_scaler import GradScaler
    from torch.optim.lr_scheduler import LRScheduler

    return {"update": vars(GradScaler)["update"], "step": vars(LRScheduler)["step"],
            "backward": torch.autograd.backward, "clip": torch.nn.utils.clip_grad_norm_, "warn": warnings.warn}


@pytest.mark.parametrize("entry", ["install", "guard"])
def test_a_rejected_option_changes_nothing(entry):
    before = _patched_now()
    with pytest.raises(ampguard.ConfigError, match="trace"):
        if entry == "install":
            ampguard.install(trace="bogus")
        else:
            with ampguard.guard(trace="bogus"):
                pass
    assert _patched_now() == before and not REGISTRY.installed and ampguard.active() is None


def test_a_usage_error_ends_in_the_callers_frame_and_a_misspelt_keyword_gets_did_you_mean():
    with pytest.raises(ampguard.ConfigError) as info:
        ampguard.install(max_consecutive_skip=3)
    assert "did you mean 'max_consecutive_skips'?" in str(info.value)
    frames = traceback.extract_tb(info.value.__traceback__)
    internal = [f for f in frames if "/ampguard/" in f.filename]
    assert [f.name for f in internal] == ["install"]  # the public entry point itself, nothing below it


def test_a_numpy_integer_is_an_integer():
    np = pytest.importorskip("numpy")
    g = ampguard.install(max_consecutive_skips=np.int64(5))
    assert g.options.max_consecutive_skips == 5 and type(g.options.max_consecutive_skips) is int


def test_install_inside_a_guard_block_returns_the_active_guard():
    with ampguard.guard(max_consecutive_skips=7) as block:
        assert ampguard.install() is block is ampguard.active()
    assert ampguard.install() is ampguard.active() is not block


def test_a_disabled_grad_scaler_is_no_grad_scaler():
    ampguard.install()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # the GradScaler(enabled=use_amp) idiom
    model.weight.register_hook(lambda grad: grad * float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ampguard.NonFiniteError) as info:
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert info.value.sink == "gradient of parameter 'weight'"  # before the step, not one step later
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- the CLI is a drop-in for python -----------------------------------------------------------------
def test_python_m_ampguard_guards_the_processes_the_program_starts(python, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys\n"
        "child = 'import ampguard, os; print(ampguard.active() is not None, os.environ.get(\"AMPGUARD_TRACE\"))'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())\n")
    proc = python(None, "-m", "ampguard", str(script), env={"AMPGUARD_TRACE": "off"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True off"  # guarded, with the same options


def test_python_m_ampguard_dash_m_of_a_package_without_main_is_one_line(python, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    proc = python(None, "-m", "ampguard", "-m", "pkg", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("ampguard: no module named pkg.__main__; 'pkg' is a package and cannot be "
                                   "directly executed")


def test_python_m_ampguard_gives_an_absolute_file_and_passes_interpreter_flags_on(python, tmp_path):
    script = tmp_path / "flags.py"
    script.write_text("import os, sys\n"
                      "print(os.path.isabs(__file__), sys.argv[0], sys.stdout.write_through, sys.flags.dev_mode, "
                      "sys.flags.optimize, sys.warnoptions)\n")
    proc = python(None, "-m", "ampguard", "-u", "-X", "dev", "-O", "-W", "error::DeprecationWarning", "flags.py",
                  cwd=tmp_path)  # -X dev adds 'default' to the warning options, as under plain python
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True flags.py True True 1 ['default', 'error::DeprecationWarning']"
    proc = python(None, "-m", "ampguard", "-W", cwd=tmp_path)
    assert proc.returncode == 2 and "argument expected for the -W option" in proc.stderr


# -- NaNs that GradScaler would swallow ---------------------------------------------------------------
def fp16_scaled_steps(model, steps, **scaler_kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    x = torch.randn(3, 4)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return scaler


def test_a_backward_nan_that_no_loss_scale_fixes_is_named_after_four_skips_not_at_the_collapse():
    g = ampguard.install()
    model = SqrtAtZero()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ampguard.NonFiniteError) as info:
        fp16_scaled_steps(model, 10)
    err = info.value
    assert err.op == "torch.sqrt" and err.sink == "gradients at every loss scale"
    assert err.origin[-1].lineno == line_of(SqrtAtZero.forward, "BACKWARD NAN")
    assert "GradScaler skipped 4 optimizer steps in a row" in str(err)  # the replays at the 3rd and 4th agree
    assert g.stats.optimizer_steps_skipped == 4 and g.stats.scheduler_steps_held == 3  # the 4th raised first
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_genuine_overflow_streak_only_skips():
    g = ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    scaler = fp16_scaled_steps(model, 30, init_scale=2.0 ** 40)  # fp16 backward overflows until it backs off
    assert g.stats.optimizer_steps_skipped >= 3 and g.stats.nonfinite_detected == 0
    assert scaler.get_scale() < 2.0 ** 20


def test_hooks_with_side_effects_can_tell_the_replay_of_a_genuine_overflow_streak_and_skip_it():
    # The replay at check_unscaled_after runs the model's hooks as the call did, in a run that goes on: a hook that
    # logs sees one more call. ampguard.replaying() tells it.
    def hooked_run(guarded):
        calls = {"forward": 0, "backward": 0, "seen by a replay": 0}

        def forward_hook(module, args, out):
            if ampguard.replaying():
                calls["seen by a replay"] += 1
                return
            calls["forward"] += 1

        def backward_hook(module, grad_in, grad_out):
            if not ampguard.replaying():
                calls["backward"] += 1

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        model[2].register_forward_hook(forward_hook)
        model[2].register_full_backward_hook(backward_hook)
        with ampguard.guard() if guarded else contextlib.nullcontext() as g:
            scaler = fp16_scaled_steps(model, 12, init_scale=2.0 ** 40)
        assert not ampguard.replaying()
        return calls, scaler.get_scale(), g

    plain, scale, _ = hooked_run(False)
    guarded, guarded_scale, g = hooked_run(True)
    assert g.stats.optimizer_steps_skipped >= 3 and g.stats.nonfinite_detected == 0 and guarded_scale == scale
    assert guarded["forward"] == plain["forward"] == 12 and guarded["backward"] == plain["backward"] == 12
    assert guarded["seen by a replay"] >= 1 and plain["seen by a replay"] == 0


def weighted_fp16_steps(steps, weight_at, **scaler_kwargs):
    """An fp16 loop whose model output is weighted by ``weight_at(step)``: weighted far enough up, its fp16 gradients
    overflow even unscaled, and GradScaler must back off below scale 1. Returns the scale and the parameters after
    ``steps``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    for i in range(steps):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float() * weight_at(i), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler.get_scale(), [p.detach().clone() for p in model.parameters()]


def test_gradients_that_overflow_fp16_even_unscaled_only_skip_while_gradscaler_backs_off_below_1():
    """Non-finite at scale 1 is not "at every scale": the addmm backward's fp16 gradients exceed 65504 unscaled, and
    GradScaler trains at 0.25. The second replay, at the lowest scale it tries before the streak is stopped, is
    finite, so the run goes on exactly as without ampguard."""
    plain_scale, plain = weighted_fp16_steps(30, lambda i: 1e3, init_scale=2.0 ** 10)
    assert plain_scale < 1.0  # (the premise: GradScaler settles below 1 and steps there)
    g = ampguard.install()
    scale, params = weighted_fp16_steps(30, lambda i: 1e3, init_scale=2.0 ** 10)
    assert g.stats.nonfinite_detected == 0 and g.stats.optimizer_steps_applied > 0
    assert scale == plain_scale and all(torch.equal(a, b) for a, b in zip(plain, params, strict=True))


def test_a_collapse_after_gradients_finite_only_below_scale_1_says_so():
    """The check's replay found the gradients finite below 1 (so it did not raise), and the loss kept growing faster
    than GradScaler backs off: the collapse error says where the replays found them finite."""
    ampguard.install(max_consecutive_skips=20)
    with pytest.raises(ampguard.LossScaleCollapseError) as info:
        weighted_fp16_steps(30, lambda i: 1e3 * 4.0 ** i, init_scale=2.0 ** 10)
    message = str(info.value)
    assert "the gradients overflowed even at scale 1, and were finite at scale 0.0" in message, message
    assert "replayed at scale 1 after 3 skips, the gradients were finite" not in message


def outliers(*at):
    """Batches ``at`` weighted so far up that their fp16 gradients overflow at scale 1 and at every scale a streak
    that starts calibrating from 2**40 can reach: one bad batch, or a few in a row."""
    return lambda i: 1e4 if i in at else 1.0


def test_one_batch_non_finite_at_every_scale_inside_a_streak_only_skips_as_without_ampguard():
    """The third skip of a calibration streak falls on one bad batch (an outlier whose gradients overflow fp16 at
    any scale the streak reaches). Without ampguard GradScaler skips it and trains on; the scale-1 replay of that
    one batch is no evidence that backing off cannot fix the streak. It once stopped the run there."""
    plain = weighted_fp16_steps(30, outliers(2), init_scale=2.0 ** 40)
    assert plain[0] < 2.0 ** 20  # (the premise: GradScaler calibrated down and applied steps)
    g = ampguard.install()
    installed = weighted_fp16_steps(30, outliers(2), init_scale=2.0 ** 40)
    assert g.stats.nonfinite_detected == 0 and g.stats.optimizer_steps_applied > 0
    assert installed[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], installed[1], strict=True))


def test_two_skipped_batches_in_a_row_non_finite_at_every_scale_stop_the_streak():
    """The next skipped step agrees (two batches in a row): the streak is stopped at the fourth skip, naming the op."""
    g = ampguard.install()
    with pytest.raises(ampguard.NonFiniteError) as info:
        weighted_fp16_steps(30, outliers(2, 3), init_scale=2.0 ** 40)
    err, message = info.value, str(info.value)
    assert err.sink == "gradients at every loss scale" and err.op == "aten._to_copy", message  # (.float())
    assert "The backward of aten._to_copy (ToCopyBackward0)" in message, message
    assert "more than float16 holds (6.55e+04): they overflowed float16 here, at no singularity." in message, message
    assert "The loss was finite: the backward pass overflowed float16 even unscaled (above)." in message, message
    assert "sqrt or pow at 0" not in message, message
    assert "GradScaler skipped 4 optimizer steps in a row" in message, message
    assert "The skipped step before this one was non-finite at every scale too" in message, message
    assert g.stats.optimizer_steps_skipped == 4 and g.stats.optimizer_steps_applied == 0


def test_a_collapse_before_a_second_replay_could_agree_says_what_the_first_found():
    """max_consecutive_skips=3 stops the streak at the replay's own skip: the first replay found the gradients
    non-finite at every scale and waits for the next skip to agree, so the collapse error says what it found."""
    ampguard.install(max_consecutive_skips=3)
    with pytest.raises(ampguard.LossScaleCollapseError) as info:
        fp16_scaled_steps(SqrtAtZero(), 10)
    message = str(info.value)
    assert "replayed after 3 skips, the gradients were inf/NaN at every scale tried" in message, message
    assert "gave no verdict" not in message, message


@pytest.mark.parametrize("mode", ["warn", "skip"])
def test_a_collapse_after_the_check_warned_points_to_the_warning_not_to_a_check_that_is_off(mode):
    """nonfinite='warn' (and 'skip', which a GradScaler's skips leave to it) named the op in a warning and went on:
    the collapse said "ampguard's non-finite check is off"."""
    ampguard.install(nonfinite=mode, max_consecutive_skips=8)
    with pytest.warns(ampguard.AmpGuardWarning, match="GradScaler skipped 4 optimizer steps in a row"), \
            pytest.raises(ampguard.LossScaleCollapseError) as info:
        fp16_scaled_steps(SqrtAtZero(), 12)
    message = str(info.value)
    assert f"found 1 non-finite value(s) in this run and went on (nonfinite='{mode}'): its warnings name the op" \
        in message, message
    assert "check is off" not in message, message


def test_the_unscaled_check_can_be_switched_off():
    g = ampguard.install(check_unscaled_after=None, max_consecutive_skips=5)
    with pytest.raises(ampguard.LossScaleCollapseError):
        fp16_scaled_steps(SqrtAtZero(), 10)
    assert g.stats.nonfinite_detected == 0




# -- the collapse error says only what fits --------------------------------------------------------------
def test_a_collapse_with_a_checked_finite_loss_does_not_blame_the_forward_pass():
    ampguard.install(check_unscaled_after=None, max_consecutive_skips=5)
    with pytest.raises(ampguard.LossScaleCollapseError) as info:
        fp16_scaled_steps(SqrtAtZero(), 10)
    message = str(info.value)
    assert "the loss was finite at every one of these steps" in message
    assert "the forward pass may already overflow" not in message
    assert "check_unscaled_after (off or not reached here) replays the step at scale 1" in message


def test_a_collapse_while_the_scale_is_still_calibrating_says_so():
    ampguard.install(max_consecutive_skips=4)  # the scale-1 check after 3 skips finds the gradients finite
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with pytest.raises(ampguard.LossScaleCollapseError) as info:
        fp16_scaled_steps(model, 10, init_scale=2.0 ** 60)
    message = str(info.value)
    assert "every update since the first skipped (4 of them): the scale may still be calibrating down from" in message
    assert "replayed at scale 1 after 3 skips, the gradients were finite" in message
    assert "learning rate" not in message and "the forward pass may already overflow" not in message


def test_a_collapse_without_the_nonfinite_check_names_the_forward_pass_as_possible():
    ampguard.install(nonfinite="off", max_consecutive_skips=5)
    with pytest.raises(ampguard.LossScaleCollapseError) as info:
        fp16_scaled_steps(SqrtAtZero(), 10)
    assert "the forward pass may already overflow fp16" in str(info.value)


# -- interrupts ----------------------------------------------------------------------------------------
def _state():
    from torch.amp.grad_scaler import GradScaler
    from torch.nn.modules import module
    from torch.optim import optimizer
    from torch.optim.lr_scheduler import LRScheduler

    return (vars(GradScaler)["update"], vars(GradScaler)["scale"], vars(LRScheduler)["step"],
            torch.autograd.backward, torch.nn.utils.clip_grad_norm_, warnings.warn,
            len(module._global_forward_pre_hooks), len(module._global_forward_hooks),
            len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks),
            REGISTRY.dirty, ampguard.active())


def _interrupted(n, action):
    """Run ``action`` with a KeyboardInterrupt raised at the n-th call of an ampguard function (every
    function of ampguard's own, wherever torch calls it from). Returns None where the action made fewer than ``n``
    calls (it ran to its end); "raised" where the interrupt came out of it; "swallowed" where Python ignored it, as
    it ignores a real Ctrl-C that lands in a weakref callback (ampguard's per-object tables drop their entries
    there). Calls of torch's own code are not places: torch itself does not survive an interrupt inside, say, the
    __exit__ of its grad-mode context."""
    import os
    import sys

    count = 0
    root = os.path.dirname(ampguard.__file__) + os.sep
    # On Python 3.10 an exception that a trace function raises as a generator resumes ends the generator without its
    # finally blocks (CPython leaves the frame before it unwinds), which no Ctrl-C can do: a signal is raised at an
    # instruction inside the frame, and unwinds it. Counted there, the resume of guard()'s block as it exits left that
    # block open for good (seen once, where the stride below met it). A resume (f_lasti >= 0) is no place there.
    resumes = sys.version_info < (3, 11)
    swallowed = []

    def tracer(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(root) and not (resumes and frame.f_lasti >= 0):
            count += 1
            if count == n:
                raise KeyboardInterrupt
        return None

    other = sys.unraisablehook

    def unraisable(info):
        if isinstance(info.exc_value, KeyboardInterrupt):
            swallowed.append(info)  # (ours: not one for pytest to report)
        else:
            other(info)

    sys.unraisablehook = unraisable
    sys.settrace(tracer)
    try:
        action()
    except KeyboardInterrupt:
        return "raised"
    finally:
        sys.settrace(None)
        sys.unraisablehook = other
    return "swallowed" if swallowed else None


def _guarded_step():
    with ampguard.guard():
        model = torch.nn.Linear(2, 1)
        torch.optim.SGD(model.parameters(), lr=0.1).step()


class _Dropped:
    """A model that an installed guard called, still held until the action drops it: the action's first calls of
    ampguard's are then the weakref callbacks its freeing runs, where Python swallows an interrupt."""

    def __init__(self):
        self.held = []

    def setup(self):
        ampguard.install()
        model = torch.nn.Linear(2, 1)
        model(torch.ones(1, 2)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        ampguard.uninstall()
        self.held.append(model)

    def action(self):
        self.held.clear()
        _guarded_step()


@pytest.mark.parametrize("entry", ["install", "guard", "uninstall", "guard, freeing a model a guard knew"])
def test_a_keyboard_interrupt_at_any_call_of_install_guard_or_uninstall_leaves_nothing_uninstall_cannot_remove(
        entry):
    dropped = _Dropped()
    setup, action = {"install": (None, ampguard.install), "guard": (None, _guarded_step),
                     "uninstall": (ampguard.install, ampguard.uninstall),
                     "guard, freeing a model a guard knew": (dropped.setup, dropped.action)}[entry]
    # Every first-time import happens here, not in the sweep: an import interrupted half-way breaks
    # that module for the rest of the process, with or without ampguard.
    _guarded_step()
    if setup is not None:
        setup()
    ampguard.install()
    action()
    ampguard.uninstall()
    clean = _state()
    n, interrupted, swallowed = 1, 0, 0
    # A garbage collection inside the traced region would run ampguard's weakref callbacks for objects of
    # the steps above (a module's entry in the roots table). Collect now and hold collection off during the
    # sweep, so that every counted call is the action's own, the same at every n. (Objects that the action frees
    # run such callbacks inside it; the sweep goes on past an interrupt that Python swallows there.)
    gc.collect()
    gc.disable()
    try:
        while n < 20000:
            if setup is not None:
                setup()
            how = _interrupted(n, action)
            if how is None:
                break  # the action ran to its end: every call of it was a place of interrupt
            interrupted += 1
            swallowed += how == "swallowed"
            ampguard.uninstall()
            assert _state() == clean, f"interrupted at call {n} ({how})"
            n += 1 if n < 200 else 37  # every call at first, then a deterministic stride
    finally:
        gc.enable()
    ampguard.uninstall()
    assert interrupted > 20 and _state() == clean
    if setup is dropped.setup:
        assert swallowed  # the freed model's callbacks were places too
    g = ampguard.install()  # and everything still works afterwards
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert g.stats.optimizer_steps_applied == 1 and g.stats.nonfinite_detected == 0


def test_an_interactive_interrupt_drops_the_abandoned_steps_checks():
    import sys

    g = ampguard.install()
    model = torch.nn.Linear(4, 2)
    x = torch.ones(2, 4)
    with torch.no_grad():
        model.bias[0] = float("nan")
    out = model(x)  # a NaN output, held (a notebook keeps `out`): its check is pending  # noqa: F841
    sys.last_value = KeyboardInterrupt()  # what a REPL or notebook sets when it shows the Ctrl-C
    try:
        with torch.no_grad():
            model.bias[0] = 0.0
        model(x).sum().backward()  # the next, healthy step: the old call's check is not read
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    finally:
        del sys.last_value
    assert g.stats.nonfinite_detected == 0


# -- backward origins name the user's lines ------------------------------------------------------------
def test_a_backward_nan_made_in_the_loss_code_is_named_at_the_loss_line_not_at_the_step():
    ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(torch.randn(3, 4))
    loss = torch.sqrt(out * 0).sum()  # LOSS CODE SQRT
    loss.backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()  # STEP LINE
    err = info.value
    assert err.op == "torch.sqrt"
    me = test_a_backward_nan_made_in_the_loss_code_is_named_at_the_loss_line_not_at_the_step
    assert err.origin[-1].lineno == line_of(me, "LOSS CODE SQRT")
    assert "ampguard" not in str(err).split("Its forward op is at")[1].split("\n")[1]
    assert all(f.lineno != line_of(me, "STEP LINE") for f in err.origin)


def test_a_backward_nan_made_in_the_model_ends_its_stack_at_the_model_call_not_at_the_step():
    ampguard.install()
    model = SqrtAtZero()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    me = test_a_backward_nan_made_in_the_model_ends_its_stack_at_the_model_call_not_at_the_step
    loss = model(torch.randn(3, 4)).pow(2).mean()  # MODEL CALL
    loss.backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()  # STEP LINE
    origin = info.value.origin
    assert origin[-1].lineno == line_of(SqrtAtZero.forward, "BACKWARD NAN")
    assert origin[0].lineno == line_of(me, "MODEL CALL")  # the outermost of your frames: the model call
    assert all(f.lineno != line_of(me, "STEP LINE") for f in origin)


class MySqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad / (2 * y)  # CUSTOM BACKWARD: inf at 0


class WithCustomOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return MySqrt.apply(self.fc(x) * 0)  # APPLIED HERE


def test_a_custom_autograd_function_is_named_by_its_class_with_its_backward_line():
    ampguard.install()
    model = WithCustomOp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    message = str(info.value)
    assert info.value.op == "MySqrt.apply" and "torch.mySqrt" not in message
    assert f"test_abuse.py:{line_of(MySqrt.backward, 'def backward')}" in message
    assert f"test_abuse.py:{line_of(WithCustomOp.forward, 'APPLIED HERE')}" in message
    assert "autograd/function.py" not in message


class HookedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(4, 4)
        self.inner.register_forward_hook(lambda m, a, out: torch.log(out))  # HOOK LOG: NaN where negative

    def forward(self, x):
        return self.inner(x) * 2


def test_code_in_a_modules_own_forward_hook_is_attributed_to_that_module():
    ampguard.install()
    with pytest.raises(ampguard.NonFiniteError) as info:
        HookedBlock()(torch.randn(8, 4)).sum().backward()
        ampguard.nonfinite.check()
    assert info.value.op == "torch.log" and info.value.module == "inner", str(info.value)


def test_one_element_reads_as_one_element():
    from ampguard.nonfinite import report

    assert report.describe_tensor(torch.tensor(float("nan"))).endswith("of 1 element")


# -- a NaN that comes from a Python number ----------------------------------------------------------------
def test_a_nan_python_number_is_named_as_such_by_the_replay_and_by_eager_mode():
    ampguard.install()
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        (model(torch.ones(2, 4)).sum() * float("nan")).backward()
        ampguard.nonfinite.check()
    assert "tensor inputs finite, but it was given the Python number nan" in str(info.value)
    ampguard.uninstall()
    ampguard.install(trace="eager")
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.ones(2, 4)).sum() * float("nan")
    assert "created NaN from the Python number nan it was given" in str(info.value)


def test_eager_mode_still_blames_only_ops_whose_inputs_had_no_nan():
    ampguard.install(trace="eager", nonfinite="warn")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logs = torch.log(model(torch.randn(3, 4)) - 10)  # the log makes NaN
        loss = logs.sum()  # the sum only carries it: its input already had NaN
        del loss, logs
    ours = [str(w.message) for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]
    assert len(ours) == 1 and "torch.log created NaN" in ours[0], ours


def test_a_nan_from_a_fused_fast_path_is_replayed_on_that_path_and_named():
    ampguard.install()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True  # a fully padded sequence: the fused kernel's softmax over nothing is NaN
    with torch.no_grad(), pytest.raises(ampguard.NonFiniteError) as info:
        encoder(x, src_key_padding_mask=pad)
        ampguard.nonfinite.check()
    err = info.value
    assert err.op == "aten._transformer_encoder_layer_fwd" and err.module == "layers.0", str(err)
    assert "did not reproduce" not in str(err) and "fused fast path ran in the original call" in str(err)


# -- tracebacks end in the user's frames -------------------------------------------------------------------
def _ampguard_frames(error):
    import os

    root = os.path.dirname(ampguard.__file__) + os.sep
    return [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(root)]


def test_a_nonfinite_error_carries_at_most_one_ampguard_frame():
    ampguard.install()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(torch.ones(2, 4)).sum() * float("nan")).backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    assert len(_ampguard_frames(info.value)) <= 1
    with pytest.raises(ampguard.NonFiniteError) as info, ampguard.guard():
        _held = model(torch.full((2, 4), float("nan")))
    assert len(_ampguard_frames(info.value)) <= 1
    with pytest.raises(ampguard.LossScaleCollapseError) as info:
        fp16_scaled_steps(SqrtAtZero(), 10) if ampguard.install(check_unscaled_after=None,
                                                                 max_consecutive_skips=3) else None
    assert len(_ampguard_frames(info.value)) <= 1


# -- layering -------------------------------------------------------------------------------------------
def test_the_guard_imports_no_feature_and_features_come_from_the_top_floor():
    import ast
    import pathlib

    package = pathlib.Path(ampguard.__file__).parent
    features = {"lightning", "lints", "nonfinite", "schedulers", "warning_sites", "_features"}
    for low in ("_guard.py", "_patching.py", "_fallback.py", "_sync.py", "_options.py", "_frames.py", "_errors.py"):
        tree = ast.parse((package / low).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.level == 1 for alias in node.names} | \
                   {(node.module or "").split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert not imported & features, (low, imported & features)
    assert ampguard.install.__module__ == "ampguard._guard"  # re-exported by ampguard._features
