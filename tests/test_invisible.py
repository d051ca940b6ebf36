"""Invisible when nothing is wrong: warnings keep their place, counters say what they mean."""

import contextlib
import warnings

import pytest
import torch
from loops import Overflow, data, line_of, model

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
warnings.filterwarnings("error", category=UserWarning, module="__main__")  # -W error::UserWarning:__main__
try:
    torch.optim.lr_scheduler.StepLR(torch.optim.SGD(m.parameters(), lr=0.1), 1).step()
except UserWarning:
    print("caught by a filter on __main__")
"""


def test_a_torch_warning_inside_a_wrapped_call_keeps_its_file_and_line(python, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WARNS)
    plain = python(None, "-W", "always", str(script), "plain")
    guarded = python(None, "-W", "always", str(script), "guarded")
    line = [x for x in plain.stderr.splitlines() if "Detected call of `lr_scheduler.step()`" in x]
    # (torch 2.4 and 2.6 give this warning no stacklevel: there it names torch's own line, with or without ampguard)
    at_user = bool(line) and line[0].startswith(f"{script}:9: UserWarning: Detected call")
    assert at_user or (line and "/torch/optim/lr_scheduler.py:" in line[0]), plain.stderr
    assert [x for x in guarded.stderr.splitlines() if "Detected call" in x] == line, guarded.stderr
    # so a filter on the user's module still catches it, as without ampguard
    caught = "caught by a filter on __main__"
    assert (caught in plain.stdout) == at_user and (caught in guarded.stdout) == at_user, guarded.stdout


C_WARNS = """
import sys, warnings, torch
if sys.argv[1] == "guarded":
    import ampguard
    ampguard.install()
torch.manual_seed(0)
m = torch.nn.Linear(4, 1)
out = m(torch.randn(1, 4))
spread = out.std().nan_to_num()  # STD LINE: of one element, so torch warns from C (TORCH_WARN)
warnings.filterwarnings("error", category=UserWarning, module="__main__")  # -W error::UserWarning:__main__
out = m(torch.randn(1, 4))
try:
    spread = out.std().nan_to_num()
except UserWarning:
    print("caught by a filter on __main__")
"""


def test_a_warning_torch_raises_from_c_in_the_loss_code_keeps_its_file_and_line(python, tmp_path):
    """The loss-code record calls each op for the user, and a warning raised in C names the Python frame that is
    running: it named ampguard's sinks.py, and a filter on the user's module no longer caught it."""
    script = tmp_path / "train.py"
    script.write_text(C_WARNS)
    plain = python(None, "-W", "always", str(script), "plain")
    guarded = python(None, "-W", "always", str(script), "guarded")
    line = [x for x in plain.stderr.splitlines() if "degrees of freedom" in x]
    assert line and line[0].startswith(f"{script}:9: UserWarning: std(): degrees of freedom"), plain.stderr
    assert plain.returncode == guarded.returncode == 0, guarded.stderr
    assert [x for x in guarded.stderr.splitlines() if "degrees of freedom" in x] == line, guarded.stderr
    assert "ampguard" not in guarded.stderr, guarded.stderr
    assert "caught by a filter on __main__" in plain.stdout and "caught by a filter on __main__" in guarded.stdout, \
        guarded.stdout + guarded.stderr


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


def test_guards_in_two_threads_do_not_see_each_other_and_restore_in_any_order():
    import threading

    step, warn = vars(torch.optim.lr_scheduler.LRScheduler)["step"], warnings.warn
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def thread_a():
        try:
            with ampguard.guard(max_consecutive_skips=5) as g:
                a_in.set()
                b_in.wait(30)
                seen["a still its own"] = ampguard.active() is g
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            a_out.set()

    def thread_b():
        try:
            a_in.wait(30)
            with ampguard.guard(nonfinite="off") as g:
                seen["b options"] = (g.options.max_consecutive_skips, g.options.nonfinite)
                b_in.set()
                a_out.wait(30)  # A exits first: B keeps its guard and the patches
                patched = vars(torch.optim.lr_scheduler.LRScheduler)["step"] is not step
                seen["b after a"] = ampguard.active() is g and patched
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert seen == {"a still its own": True, "b options": (32, "off"), "b after a": True}
    assert ampguard.active() is None  # this thread never saw either guard
    assert vars(torch.optim.lr_scheduler.LRScheduler)["step"] is step and warnings.warn is warn


def test_a_thread_without_a_guard_is_untouched_by_another_threads_guard():
    import threading

    from loops import scaled_loop

    entered, release = threading.Event(), threading.Event()

    def guarded():
        with ampguard.guard():
            entered.set()
            release.wait(60)

    t = threading.Thread(target=guarded)
    t.start()
    try:
        entered.wait(30)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, _, sched, _ = scaled_loop(lambda o: torch.optim.lr_scheduler.StepLR(o, 1), 4, overflow={0})
        assert sched.last_epoch == 4  # PyTorch's own behaviour: not held in this thread
        m = torch.nn.Linear(2, 2)
        (m(torch.ones(1, 2)) * float("nan")).sum().backward()  # no NonFiniteError from the other thread's guard
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    finally:
        release.set()
        t.join(60)
    assert ampguard.active() is None


def test_patched_functions_pickle_and_copy_as_functions_do(python, tmp_path):
    """A checkpoint written under AMPGUARD=1 may hold a patched function (hyperparameters with
    ``functools.partial(clip_grad_norm_, max_norm=1.0)``): it pickles by reference, and a process without ampguard
    (an inference server) loads torch's own function. wrapt's proxies refuse to be pickled or copied."""
    path = tmp_path / "ckpt.pt"
    proc = python("""
        import copy, functools, sys, warnings, torch
        import ampguard
        assert ampguard.active()
        clip = torch.nn.utils.clip_grad_norm_
        assert type(clip).__name__ == "Wrapper"  # (patched: else this test would prove nothing)
        for f in (clip, torch.autograd.backward, warnings.warn):
            assert copy.deepcopy(f) is f and copy.copy(f) is f
        torch.save({"clip": functools.partial(clip, max_norm=1.0), "backward": torch.autograd.backward},
                   sys.argv[1])
        print("saved")
    """, str(path), env={"AMPGUARD": "1"})
    assert proc.returncode == 0 and "saved" in proc.stdout, proc.stderr[-3000:]
    proc = python("""
        import sys, torch
        loaded = torch.load(sys.argv[1], weights_only=False)
        assert loaded["clip"].func is torch.nn.utils.clip_grad.clip_grad_norm_, loaded["clip"].func
        assert type(loaded["clip"].func).__name__ == "function"
        assert loaded["backward"] is torch.autograd.backward
        print("loaded")
    """, str(path))
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]


# -- torch's function-mode stack: the loss-code recorder is one of its modes while it records ---------------------
def _modes():
    return [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]


class CountCalls(torch.overrides.TorchFunctionMode):
    """A user's own mode (a FLOP or call counter): what it sees must not depend on ampguard."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def _mode_around_the_forward(make_mode, guarded, nan_at=None):
    """``with mode: out = model(x)``, then the loss code and the step outside the mode: the user leaves the mode
    while ampguard records the loss code."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, stacks, modes = [], [], []
    with ampguard.guard() if guarded else contextlib.nullcontext():
        for step in range(3):
            with make_mode() as mode:
                out = model(torch.randn(4, 8))
            modes.append(mode)
            stacks.append(_modes())  # the user's mode is gone
            log = out.log() if step == nan_at else out  # LOSS CODE LOG
            loss = log.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            stacks.append(_modes())
    return losses, stacks, modes, model


def test_a_device_context_the_user_leaves_after_the_forward_is_left_as_without_ampguard():
    """torch.device's exit pops the top mode: with the recorder on top, it popped the recorder instead, and the
    user's device stayed the default for the rest of the run."""
    plain = _mode_around_the_forward(lambda: torch.device("cpu"), guarded=False)
    guarded = _mode_around_the_forward(lambda: torch.device("cpu"), guarded=True)
    assert guarded[0] == plain[0]
    assert torch.equal(guarded[3][0].weight, plain[3][0].weight)
    assert all("DeviceContext" not in stack for stack in guarded[1]), guarded[1]
    assert _modes() == []


def test_a_meta_device_probe_before_the_step_does_not_move_the_run_to_meta():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard():
        for _ in range(2):
            with torch.device("meta"):  # a shape probe on the meta device, as tools that plan memory run one
                probe = torch.nn.Linear(8, 2)(torch.empty(4, 8))
            assert probe.is_meta
            x = torch.randn(4, 8)
            assert x.device.type == "cpu"
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert _modes() == []


def test_a_users_own_mode_around_the_forward_sees_the_same_calls_and_leaves_with_its_exit():
    plain = _mode_around_the_forward(CountCalls, guarded=False)
    guarded = _mode_around_the_forward(CountCalls, guarded=True)
    assert guarded[0] == plain[0]
    for seen, reference in zip((m.calls for m in guarded[2]), (m.calls for m in plain[2]), strict=True):
        # every call it saw without ampguard, in order (it also sees ampguard's metadata reads of the output at the
        # end of the call, such as numel(): they run inside the user's mode)
        rest = iter(seen)
        assert all(call in rest for call in reference), (seen, reference)
    assert all("CountCalls" not in stack for stack in guarded[1]), guarded[1]


def test_the_loss_code_after_a_mode_the_user_left_is_still_recorded():
    with pytest.raises(ampguard.NonFiniteError) as info:
        _mode_around_the_forward(lambda: torch.device("cpu"), guarded=True, nan_at=1)
    err = info.value
    assert err.op == "Tensor.log", str(err)
    assert err.origin[-1].lineno == line_of(_mode_around_the_forward, "LOSS CODE LOG"), str(err)
    assert _modes() == []
