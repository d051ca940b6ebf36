"""Faults, threads, long runs, checkpoints and bad input: ampguard never harms the user's run."""

import contextlib
import copy
import gc
import io
import logging
import resource
import threading
import tracemalloc
import warnings

import pytest
import torch
from loops import Overflow, data, model, reference_loop, scaled_loop
from torch.optim import lr_scheduler as S

import ampguard
from ampguard import _guard, _options, _sync, nonfinite
from ampguard._patching import REGISTRY


def ours(caught):
    return [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]


def unscale_and_clip(m, opt, scaler):
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)


def amp_loop(overflow=(0, 3), iterations=6):
    """GradScaler + a warm-up scheduler + clipping after unscale_: every feature has work to do."""
    lrs, m, _, _ = scaled_loop(lambda opt: S.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)), iterations, overflow,
                               make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2), before_step=unscale_and_clip)
    return lrs, [p.detach().clone() for p in m.parameters()]


def plain_run():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own scheduler warning
        return amp_loop()


def raise_injected(*args, **kwargs):
    raise RuntimeError("injected fault")


# (the internal function made to fail, the features that use it)
FAULTS = [
    ("ampguard.schedulers._should_hold", {"schedulers"}),
    # GradScaler's bookkeeping: the scheduler hold follows its counts, so it goes off with it (unwarned: not its fault)
    ("ampguard.schedulers._remember_step", {_guard.GRADSCALER}),
    # the shared read: both features that read fall back (the device's path: on the CPU the non-finite checks take
    # their values at once, and a step whose gradients are finite leaves nothing for the read)
    ("ampguard._sync.read", {_guard.GRADSCALER, "nonfinite"}),
    ("ampguard.nonfinite.sinks._record", {"nonfinite"}),
    ("ampguard.nonfinite.sinks.add_loss", {"nonfinite"}),  # the loss sink (a scalar: no _norms pass here)
    # the outermost call's start and end: the sinks' enter() and exit(), as outermost's hooks hold them
    ("ampguard.nonfinite.outermost.H.enter", {"nonfinite"}),
    ("ampguard.nonfinite.outermost.H.exit", {"nonfinite"}),
    ("ampguard.nonfinite.sinks._consume", {"nonfinite"}),
    ("ampguard.lints._check_clip", {"lint"}),
    ("ampguard.lints.eps_message", {"lint"}),  # the first optimizer step's lint
    ("ampguard._guard._STATE_FACTORIES['lint']", {"lint"}),  # its state, made at the first scale() under a guard
]


@pytest.mark.parametrize(("target", "features"), FAULTS, ids=[t for t, _ in FAULTS])
def test_an_internal_fault_falls_back_to_pytorch_with_one_warning_and_a_log_record(monkeypatch, caplog, target,
                                                                                      features):
    plain_lrs, plain_params = plain_run()
    with ampguard.guard():
        guarded_lrs, guarded_params = amp_loop()
    module, _, name = target.rpartition(".")
    g = ampguard.install()
    if target.endswith("['lint']"):
        monkeypatch.setitem(_guard._STATE_FACTORIES, "lint", raise_injected)
    else:
        monkeypatch.setattr(f"{module}.{name}", raise_injected)
    if target == "ampguard._sync.read":
        monkeypatch.setattr(_sync, "HOST_READS", False)
    if target == "ampguard.nonfinite.sinks._consume":  # the shared read holds its own reference
        monkeypatch.setattr(_sync, "_participants", [(f, c, raise_injected if f == "nonfinite" else s, total)
                                                     for f, c, s, total in _sync._participants])
    with caplog.at_level(logging.ERROR, logger="ampguard"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrs, params = amp_loop()
    found = ours(caught)
    assert len(found) == len(features), [str(w.message) for w in found]  # one warning per feature
    for feature, warning in zip(sorted(features), sorted(found, key=lambda w: str(w.message)), strict=True):
        assert f"internal error in {feature} (RuntimeError: injected fault)" in str(warning.message)
        assert f"{feature} is switched off for the rest of this run" in str(warning.message)
    assert any("injected fault" in r.exc_text for r in caplog.records if r.exc_text)
    off = features | ({"schedulers"} if _guard.GRADSCALER in features else set())
    assert g._disabled == features and g._on == {"schedulers", "nonfinite", "lint", "closures", _guard.GRADSCALER} - off
    # every hook's first question answers the same at once: off for these features, the guard for the others
    assert all(_guard.current(f) is (None if f in off else g) for f in ("schedulers", "nonfinite", "lint",
                                                                         _guard.GRADSCALER))
    if "schedulers" in off:
        # the scheduler stepped on skipped steps, as PyTorch does: the plain run exactly
        assert lrs == plain_lrs and all(torch.equal(p, q) for p, q in zip(params, plain_params, strict=True))
    else:
        # the other features go on: the guarded run exactly
        assert lrs == guarded_lrs and all(torch.equal(p, q) for p, q in zip(params, guarded_params, strict=True))
        assert g.stats.scheduler_steps_held == 2


def _misuse_setup():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, opt, torch.amp.GradScaler("cpu"), S.StepLR(opt, 2)


def _backward(m):
    m(torch.randn(2, 4)).sum().backward()


MISUSES = {  # calls of the patched APIs that torch itself refuses
    "clip_grad_norm_(norm_type='fro')": lambda m, o, s, sch: (
        _backward(m), torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type="fro")),
    "clip_grad_norm_(max_norm='x')": lambda m, o, s, sch: (
        _backward(m), torch.nn.utils.clip_grad_norm_(m.parameters(), "x")),
    "clip_grad_value_(clip_value=None)": lambda m, o, s, sch: (
        _backward(m), torch.nn.utils.clip_grad_value_(m.parameters(), None)),
    "GradScaler.step('opt')": lambda m, o, s, sch: (s.scale(m(torch.randn(2, 4)).sum()).backward(), s.step("opt")),
    "GradScaler.step() before backward": lambda m, o, s, sch: s.step(o),
    "GradScaler.update(new_scale=[1.0])": lambda m, o, s, sch: (
        s.scale(m(torch.randn(2, 4)).sum()).backward(), s.step(o), s.update([1.0])),
    "LRScheduler.step('x')": lambda m, o, s, sch: sch.step("x"),
    "backward(gradient='x')": lambda m, o, s, sch: m(torch.randn(2, 4)).sum().backward(gradient="x"),
    "backward twice": lambda m, o, s, sch: (lambda loss: (loss.backward(), loss.backward()))(
        m(torch.randn(2, 4)).sum()),
    "autograd.grad of an unused input": lambda m, o, s, sch: torch.autograd.grad(
        m(torch.randn(2, 4)).sum(), [torch.zeros(1, requires_grad=True)]),
    "optimizer.step(closure=123)": lambda m, o, s, sch: o.step(closure=123),
    "module call of the wrong shape": lambda m, o, s, sch: m(torch.randn(2, 5)),
}


def _misused(call):
    try:
        call(*_misuse_setup())
    except Exception as exc:  # (each case's error is compared as it is)
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize("case", MISUSES)
def test_a_call_torch_refuses_gets_torchs_own_error_and_switches_nothing_off(case):
    """norm_type='fro' failed in the gradient sink's float() before torch saw it: an "internal error ... please
    report it" warning, and the non-finite checks switched off for the rest of the run."""
    plain = _misused(MISUSES[case])
    g = ampguard.install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded = _misused(MISUSES[case])
    assert plain is not None and guarded == plain
    assert ours(caught) == [] and g._disabled == set()


def test_a_fault_in_the_lightning_patch_falls_back(monkeypatch):
    L = pytest.importorskip("lightning.pytorch")
    from test_lightning import BATCHES, correct_step, fit, module_class

    reference = module_class(L, correct_step)()
    fit(L, reference)
    g = ampguard.install()
    monkeypatch.setattr("ampguard.lightning._slot", raise_injected)
    model = module_class(L, correct_step)()
    _, found = fit(L, model)
    assert model.training_steps == BATCHES
    assert torch.equal(model.layer.weight, reference.layer.weight)
    assert len(found) == 1 and "internal error in closures" in str(found[0].message) and "closures" in g._disabled


def test_a_loss_code_call_frame_that_cannot_be_made_calls_the_op_as_before(monkeypatch, caplog):
    """The loss-code record calls a C op through a frame bearing the user's line (its C warnings name that line);
    where that frame cannot be made, the op runs from ampguard's frame, with the same result and no warning."""
    from ampguard import _frames

    monkeypatch.setattr(_frames, "CALLERS", {})
    monkeypatch.setattr(_frames, "_CALL", None)  # (no code to copy: the copy fails)
    caplog.set_level("DEBUG", logger="ampguard")
    m = torch.nn.Linear(4, 1)
    x = torch.randn(3, 4)
    expected = m(x).pow(2).mean()
    with ampguard.guard() as g, warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = m(x).pow(2).mean()
        loss.backward()
    assert torch.equal(loss, expected) and not g._disabled
    assert _frames.CALLERS and all(made is None for made, _ in _frames.CALLERS.values())
    assert "no call frame for" in caplog.text


def test_intended_errors_are_not_swallowed_while_another_feature_is_faulty(monkeypatch):
    ampguard.install(max_consecutive_skips=3)
    monkeypatch.setattr("ampguard.lints._check_clip", raise_injected)
    with warnings.catch_warnings(), pytest.raises(ampguard.LossScaleCollapseError):
        warnings.simplefilter("ignore")
        amp_loop(overflow=range(10), iterations=10)
    ampguard.uninstall()
    ampguard.install()
    monkeypatch.setattr("ampguard.schedulers._should_hold", raise_injected)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings(), pytest.raises(ampguard.NonFiniteError):
        warnings.simplefilter("ignore")
        torch.log(m(torch.ones(2, 4)) * 0 - 1).sum().backward()
        opt.step()


def test_a_fault_while_patching_an_import_never_breaks_the_import(python):
    proc = python("""
        import warnings, ampguard
        from ampguard import _patching
        def broken(self, target):
            raise RuntimeError("injected fault")
        _patching.Registry._apply = broken
        ampguard.install()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch  # the post-import hook fails inside this import
        print("imported", torch.ones(1).item(), len(caught),
              "internal error in patching torch" in str(caught[0].message))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["imported", "1.0", "1", "True"]


# -- threads -------------------------------------------------------------------------------
def test_two_threads_train_concurrently_under_one_guard_without_leaking_decisions():
    g = ampguard.install()
    patterns = {"a": {0, 2}, "b": {1, 3, 4}}
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def train(name):
        try:
            m = model(seed=len(name))
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            sched = S.LambdaLR(opt, lambda s: 1.0 / (s + 1))
            scaler = torch.amp.GradScaler("cpu")
            hook = Overflow(m[0].weight, patterns[name])
            for i in range(6):
                barrier.wait()  # interleave the two loops step by step
                hook.i = i
                scaler.scale(m(data(i)[0]).pow(2).mean()).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad()
            results[name] = sched.last_epoch
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=train, args=(n,)) for n in patterns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == {"a": 4, "b": 3}  # each scheduler followed its own thread's applied steps
    assert g.stats.optimizer_steps_skipped == 5 and g.stats.scheduler_steps_held == 5


def test_a_failure_while_another_thread_imports_dynamo_is_still_explained(python):
    """Inference threads of one model, two of them failing at once. torch imports dynamo on first use, here inside
    one thread's replay; the other thread's failure path found the module half made in sys.modules and its replay
    failed ("partially initialized module 'torch._dynamo' has no attribute 'disable'"), so its message lost the
    origin. The failure path runs outside torch.compile through an import that waits for the module instead."""
    proc = python("""
        import sys, threading, time, torch
        from ampguard.nonfinite import sinks
        assert "torch._dynamo" not in sys.modules
        importer = threading.Thread(target=lambda: __import__("torch._dynamo"))
        importer.start()
        while "torch._dynamo" not in sys.modules:  # (the other thread's import has begun, and is far from done)
            time.sleep(0)
        run = sinks.outside_compile(lambda: 42)
        importer.join()
        print(run(), type(run).__name__, hasattr(run, "_torchdynamo_orig_callable"))
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["42", "function", "True"]  # dynamo's disable wrapper, made once the import is done


def test_install_and_uninstall_from_many_threads_leave_a_consistent_state():
    from torch.amp.grad_scaler import GradScaler
    from torch.optim.lr_scheduler import LRScheduler, SequentialLR

    originals = {(c, n): vars(c)[n] for c, n in ((LRScheduler, "step"), (SequentialLR, "step"),
                                                 (GradScaler, "update"), (GradScaler, "step"))}
    hooks_before = len(torch.nn.modules.module._global_forward_pre_hooks)
    errors = []

    def churn(k):
        try:
            for i in range(100):
                if (i + k) % 3 == 0:
                    with ampguard.guard(trace="off"):
                        pass
                else:
                    ampguard.install()
                    ampguard.uninstall()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ampguard.install()
    for (cls, name), original in originals.items():
        assert vars(cls)[name].__wrapped__ is original  # wrapped exactly once
    ampguard.uninstall()
    for (cls, name), original in originals.items():
        assert vars(cls)[name] is original
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == hooks_before
    assert ampguard.active() is None and REGISTRY._records == {}


# -- long runs -----------------------------------------------------------------------------
def global_hook_counts():
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (len(module._global_forward_pre_hooks), len(module._global_forward_hooks),
            len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks))


def test_two_thousand_install_uninstall_cycles_do_not_grow():
    import torch.optim.lr_scheduler  # noqa: F401  (patched classes exist)

    for _ in range(200):  # warm caches
        ampguard.install()
        ampguard.uninstall()
    gc.collect()
    hooks, filters, participants = global_hook_counts(), len(warnings.filters), len(_sync._participants)
    objects = len(gc.get_objects())
    tracemalloc.start()
    growths = []
    for _ in range(2):  # two windows of 1,000 cycles: a leak grows in both, pymalloc's settling in one
        before = tracemalloc.take_snapshot()
        for _ in range(1_000):
            ampguard.install()
            ampguard.uninstall()
        gc.collect()
        after = tracemalloc.take_snapshot()
        growths.append(sum(s.size_diff for s in after.compare_to(before, "filename")))
        del before, after
    tracemalloc.stop()
    gc.collect()
    more = len(gc.get_objects()) - objects
    print(f"2 x 1,000 install/uninstall cycles: Python memory grew by {growths} bytes, {more} more gc objects")
    # pymalloc moves by tens of KiB, once (in a suite with Lightning and torchmetrics loaded, up to ~100 in one
    # window, nothing in the next); 40 bytes kept per cycle would be 40 KiB in each window
    assert more < 100 and min(growths) < 40 * 1024
    assert REGISTRY._records == {} and len(REGISTRY._import_hooks) < 10
    assert global_hook_counts() == hooks and len(warnings.filters) == filters
    assert len(_sync._participants) == participants


def test_six_hundred_guarded_training_steps_do_not_grow():
    ampguard.install()
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def steps(n):
        peak = 0
        for _ in range(n):
            loss = torch.nn.functional.mse_loss(m(x), y)
            peak = max(peak, len(nonfinite.T.window))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return peak

    def live():
        gc.collect()
        objects = gc.get_objects()
        return len(objects), sum(issubclass(type(o), torch.Tensor) for o in objects)

    tracemalloc.start()
    steps(300)  # warm-up: pymalloc arenas, torch's and ampguard's per-code caches fill once
    objects, tensors = live()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before = tracemalloc.take_snapshot()
    peak = steps(600)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    del before, after  # the snapshots are gc objects too
    objects_after, tensors_after = live()
    print(f"600 guarded steps: Python memory grew by {growth} bytes, peak RSS by {rss_growth} KiB, "
          f"{objects_after - objects} more gc objects, {tensors_after - tensors} more tensors, "
          f"at most {peak} calls and loss-code ops kept")
    assert tensors_after <= tensors and objects_after - objects < 100  # an earlier test's garbage may go meanwhile
    # an object kept per step would be +600 above; pymalloc's own arenas move by tens of KiB
    assert growth < 192 * 1024 and rss_growth < 16 * 1024
    assert peak == 2 and len(nonfinite.T.window) == 0  # the model call and mse_loss, never per op
    assert len(nonfinite.T.pending) == 0


# -- checkpoints ---------------------------------------------------------------------------
def checkpoint(make_sched, iterations):
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = make_sched(opt)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(iterations):
        scaler.scale(torch.nn.functional.mse_loss(m(data(i)[0]), data(i)[1])).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    out = []
    for state in (m.state_dict(), opt.state_dict(), scaler.state_dict(), sched.state_dict()):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        out.append(buffer.getvalue())
    return out


def one_cycle(opt):
    return S.OneCycleLR(opt, max_lr=0.05, total_steps=20)


def test_checkpoints_are_byte_identical_with_and_without_ampguard():
    plain = checkpoint(one_cycle, 8)
    assert checkpoint(one_cycle, 8) == plain  # torch.save is deterministic here
    ampguard.install()
    assert checkpoint(one_cycle, 8) == plain


def test_resume_from_a_checkpoint_keeps_holding_correctly():
    ampguard.install()
    skipped = (2, 7, 9)

    def run(iterations, start=0, state=None):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = one_cycle(opt)
        scaler = torch.amp.GradScaler("cpu")
        if state is not None:
            for obj, sd in zip((m, opt, scaler, sched), state, strict=True):
                obj.load_state_dict(sd)
        hook = Overflow(m[0].weight, skipped)
        lrs = []
        for i in range(start, iterations):
            hook.i = i
            scaler.scale(torch.nn.functional.mse_loss(m(data(i)[0]), data(i)[1])).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
            if i not in skipped:
                lrs.append(opt.param_groups[0]["lr"])
        return lrs, [obj.state_dict() for obj in (m, opt, scaler, sched)], m

    first, state, _ = run(8)  # the checkpoint is taken after a held step (iteration 7 overflowed)
    second, _, resumed = run(14, start=8, state=state)
    ref_lrs, ref_model, _ = reference_loop(one_cycle, 14, skipped)
    assert first + second == ref_lrs
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), ref_model.parameters(), strict=True))


# -- bad input -----------------------------------------------------------------------------
BAD_VALUES = {
    "schedulers": ["yes", 1, None, 0.0],
    "max_consecutive_skips": [0, -3, 2.5, "8", True],
    "check_unscaled_after": [0, -1, 1.5, "3", False],
    "distributed": ["no", 0, None],
    "closures": ["on", 1.0, []],
    "lint": ["off", None],
    "nonfinite": ["RAISE", True, None, "", "crash"],
    "trace": ["lazy", 1, None],
    "devices": [(), ["cuda:0"], ("cdua",), (1,), 3, ""],
    "repro_dir": [3, "", "   ", True, __file__],  # an existing file is no folder
    "repro_max_mb": [0, -1, "8", True, float("nan"), None],
}


def test_every_option_has_bad_values_listed():
    assert set(BAD_VALUES) == set(_options.SPECS)


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in BAD_VALUES.items() for v in vs])
def test_every_bad_option_value_names_the_option_and_the_accepted_values(name, value):
    accepted = _options.SPECS[name].accepted
    for call in (ampguard.install, lambda **o: ampguard.guard(**o).__enter__()):
        with pytest.raises(ampguard.ConfigError) as info:
            call(**{name: value})
        assert str(info.value) == f"ampguard: option '{name}' got {value!r}; accepted values: {accepted}"
        assert ampguard.active() is None
    g = ampguard.install()
    with pytest.raises(ampguard.ConfigError):
        ampguard.install(**{name: value})  # on an active guard: refused, the guard keeps its options
    assert g.options == _options.Options() and ampguard.active() is g


GARBAGE = ["garbage", "-1", "2.5", "on,off", "nan"]


@pytest.mark.parametrize("variable", [s.env for s in _options.SPECS.values()] + ["AMPGUARD", "AMPGUARD_REPORT"])
def test_every_ampguard_variable_with_garbage_prints_one_line_and_runs(python, variable):
    garbage = [__file__] if variable == "AMPGUARD_REPRO_DIR" else GARBAGE  # any other text is a folder to be made
    for text in garbage:
        try:
            if variable in ("AMPGUARD", "AMPGUARD_REPORT"):
                _options.env_flag(variable, False, {variable: text})
            else:
                _options.from_environ({variable: text})
            continue  # a valid value for this variable (e.g. an integer)
        except ampguard.ConfigError as exc:
            expected = str(exc)
        env = {"AMPGUARD": "1", variable: text} if variable != "AMPGUARD" else {"AMPGUARD": text}
        proc = python("print('the program ran')", env=env)
        assert proc.returncode == 0 and proc.stdout.strip() == "the program ran"
        assert proc.stderr.strip() == f"{expected} -- running without ampguard"
        assert f"environment variable {variable} got {text!r}; accepted values:" in proc.stderr
        break
    else:
        pytest.fail(f"no garbage value was refused for {variable}")


def rollback_loop(guarded: bool) -> tuple:
    """A GradScaler loop that rolls back to its last snapshot when a batch is non-finite: by hand without ampguard
    (before backward), by catching NonFiniteError with it (raised at the step's read, in update())."""
    torch.manual_seed(0)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = S.LambdaLR(opt, lambda s: 1 / (1 + s))
    scaler = torch.amp.GradScaler("cpu")
    parts = (m, opt, sched, scaler)
    block = ampguard.guard() if guarded else contextlib.nullcontext()
    rolled = 0
    with block:
        for i in range(8):
            if i % 3 == 0:
                snapshot = [copy.deepcopy(part.state_dict()) for part in parts]
            x, y = data(i)
            if i == 4:
                x[0, 0] = float("nan")  # a corrupt batch
            loss = torch.nn.functional.mse_loss(m(x), y)
            try:
                if not guarded and not torch.isfinite(loss):
                    raise FloatingPointError
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
            except FloatingPointError:  # (NonFiniteError is one)
                rolled += 1
                for part, state in zip(parts, snapshot, strict=True):
                    part.load_state_dict(state)
            opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()], sched.last_epoch, scaler.get_scale(), rolled


def test_a_loop_that_catches_the_error_under_a_grad_scaler_rolls_back_and_goes_on():
    """NonFiniteError under a GradScaler is raised in update(), where the read is. It was raised before the
    scaler's own update() ran, which left the scaler mid-iteration: the loop's next step() raised "step() has
    already been called since the last update()", and no load_state_dict() resets that."""
    plain, guarded = rollback_loop(False), rollback_loop(True)
    assert guarded[1:] == plain[1:] and guarded[3] == 1
    assert all(torch.equal(p, q) for p, q in zip(plain[0], guarded[0], strict=True))


# -- tensors with a shape and no data: a meta-device probe, a step under FakeTensorMode --------------------------
def _real_steps_after(probe):
    """``probe()`` runs first (no data anywhere in it), then real training steps, then a NaN: it must still be
    named, and nothing may have warned of an internal error."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampguard.guard() as g, pytest.raises(ampguard.NonFiniteError) as info:
            kept = probe()
            for _ in range(2):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            assert kept is not None
            model(torch.randn(4, 8)).sub(100).log().mean().backward()  # log of a negative: NaN
            opt.step()
    assert [str(w.message) for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)] == []
    assert "nonfinite" not in g._disabled
    assert info.value.sink == "loss" and info.value.op == "Tensor.log", str(info.value)


def test_a_meta_device_shape_probe_kept_alive_does_not_switch_the_checks_off():
    """Its output's status was read with the step's: 'Cannot copy out of meta tensor', an internal error."""
    meta = torch.nn.Linear(8, 2, device="meta")

    def probe():
        with torch.no_grad():  # (an output without grad has its status taken at once)
            shapes = meta(torch.empty(4, 8, device="meta"))
        return shapes, meta(torch.empty(4, 8, device="meta"))  # kept until the step's read

    _real_steps_after(probe)


def test_a_memory_estimate_under_fake_tensors_does_not_switch_the_checks_off():
    """A whole step under FakeTensorMode, as memory estimators run one before training: its loss's value was read
    ("DataDependentOutputException"), an internal error that switched the checks off for the run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def estimate():
        with FakeTensorMode():
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            for _ in range(2):
                out = model(torch.randn(4, 8))
                out.pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return out

    _real_steps_after(estimate)
