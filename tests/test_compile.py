"""torch.compile under ampguard: no graph breaks of ampguard's making, and every feature keeps working."""

import contextlib
import gc
import inspect
import logging
import re
import warnings
import weakref

import pytest
import torch
from loops import OutOfMemory, Overflow, RaisingTeacher, data, line_of

import ampguard
from ampguard import nonfinite


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def train(compiled, params, steps=6):
    opt = torch.optim.SGD(params, lr=0.05)
    x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)), torch.randn(32, 1)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def test_compiled_model_trains_as_one_graph_and_is_one_traced_op():
    g = ampguard.install()
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    compiled(torch.randn(32, 8))  # the shape train() uses: another shape would be a second (dynamic) graph
    assert [type(e).__name__ for e in nonfinite.T.window] == ["Call"]  # one outermost call, nothing inside
    assert nonfinite.T.window[0].module is compiled
    losses = train(compiled, model.parameters())
    assert losses[-1] < losses[0]
    counters = torch._dynamo.utils.counters
    assert dict(counters["graph_break"]) == {}  # the tracer and the hooks step aside while dynamo traces
    assert counters["stats"]["unique_graphs"] == 1
    assert g.stats.nonfinite_detected == 0


def test_compiled_model_gives_the_same_losses_as_without_ampguard_under_warnings_as_errors():
    model = mlp()
    reference = train(torch.compile(model, backend="eager"), model.parameters())
    torch._dynamo.reset()
    original = torch.nn.modules.module._has_any_global_hook
    ampguard.install()
    model = mlp()
    filters = len(warnings.filters)
    with warnings.catch_warnings():
        # a filter put in front after install(), as pytest's `filterwarnings = error` puts one at every test: torch's
        # warning of global hooks at every compiled call would fail the run. ampguard's hooks are made for that call.
        # (UserWarning, that warning's category: torch 2.13 on Python 3.13.0 warns once that its guards may run slower)
        warnings.simplefilter("error", UserWarning)
        guarded = train(torch.compile(model, backend="eager"), model.parameters())
    assert guarded == reference
    assert len(warnings.filters) == filters  # no filter of ampguard's hides the warning
    ampguard.uninstall()
    assert torch.nn.modules.module._has_any_global_hook is original


def test_a_global_hook_of_the_users_still_gets_torchs_warning_at_a_compiled_call():
    ampguard.install()
    compiled = torch.compile(mlp(), backend="eager")
    x = torch.randn(4, 8)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        with pytest.warns(UserWarning, match="when there are global hooks on modules"):
            compiled(x)
    finally:
        handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        compiled(x)  # ampguard's own hook alone again


def test_inductor_compiled_tiny_model_trains():
    g = ampguard.install()
    model = mlp()
    losses = train(torch.compile(model), model.parameters(), steps=4)
    assert losses[-1] < losses[0]
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert g.stats.nonfinite_detected == 0


def test_scheduler_holding_with_a_compiled_model():
    g = ampguard.install()
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    scaler = torch.amp.GradScaler("cpu")
    hook = Overflow(model[0].weight, {0, 3})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            hook.i = i
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
            scaler.scale(compiled(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
    assert g.stats.optimizer_steps_skipped == 2 and g.stats.scheduler_steps_held == 2
    assert sched.last_epoch == 4
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]


def test_lightning_closure_injection_with_a_compiled_layer():
    L = pytest.importorskip("lightning.pytorch")
    from test_lightning import BATCHES, fit, module_class, warmup_step

    g = ampguard.install()
    model = module_class(L, warmup_step)()
    model.layer = torch.compile(model.layer, backend="eager")
    before = model.layer.weight.detach().clone()
    fit(L, model)
    assert model.training_steps == BATCHES and g.stats.closures_injected == BATCHES
    assert not torch.equal(before, model.layer.weight)


class Bad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.sqrt(self.fc(x) - 100.0)


def test_nan_inside_a_compiled_module_names_the_op_inside_it():
    ampguard.install()
    compiled = torch.compile(Bad(), backend="eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        out = compiled(torch.ones(2, 4))  # COMPILED CALL
        out.sum().backward()
        opt.step()
    err = info.value
    assert err.op == "torch.sqrt" and err.kind == "nan" and err.module == "Bad"
    assert err.sink == "loss"
    lines, start = inspect.getsourcelines(test_nan_inside_a_compiled_module_names_the_op_inside_it)
    assert err.origin[-2].lineno == start + next(i for i, line in enumerate(lines) if "COMPILED CALL" in line)
    assert err.origin[-1].name == "forward" and "torch.sqrt" in err.origin[-1].line
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


class _CallsBad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Bad()

    def forward(self, x):
        return self.inner(x) * 2


def test_nan_inside_a_compiled_submodule_of_an_eager_model():
    ampguard.install()
    model = _CallsBad()
    model.inner = torch.compile(model.inner, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert info.value.op == "torch.sqrt" and info.value.module == "inner"
    assert info.value.chain[-2:] == ["Tensor.mul", "Tensor.sum"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("compiled", ["model", "submodule", "model in place", "submodule in place"])
def test_trace_eager_names_the_op_inside_a_compiled_module(backend, compiled):
    """trace='eager' checks each op as it runs, but the ops a compiled module runs are its graph's: at the graph's
    generated lines and in no module of the user's (the eager and aot_eager backends), or none at all (inductor).
    Its call is checked as under trace='replay', and the failure replays it eagerly, which names the op."""
    ampguard.install(trace="eager")
    model = _CallsBad()
    call = model
    if compiled.endswith("in place"):
        (model if compiled.startswith("model") else model.inner).compile(backend=backend)
    elif compiled == "model":
        call = torch.compile(model, backend=backend)
    else:
        model.inner = torch.compile(model.inner, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        call(torch.ones(2, 4)).sum().backward()
        opt.step()
    err = info.value
    assert err.op == "torch.sqrt" and err.kind == "nan" and err.module == "inner", str(err)
    assert err.origin[-1].name == "forward" and "torch.sqrt" in err.origin[-1].line, str(err)


def test_trace_eager_checks_the_loss_code_after_a_compiled_model_as_it_runs():
    ampguard.install(trace="eager")
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    out = compiled(torch.randn(2, 4))
    with pytest.raises(ampguard.NonFiniteError) as info:
        torch.log(-1 - out * out).mean()  # LOSS CODE NAN
    assert info.value.op == "torch.log" and info.value.sink == "the output of this op"
    this = test_trace_eager_checks_the_loss_code_after_a_compiled_model_as_it_runs
    assert info.value.origin[-1].lineno == line_of(this, "LOSS CODE NAN")


class _CheckpointedPoison(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        self.poisoned = False

    def block(self, x):
        h = self.a(x)
        return torch.log(h - h - 1) if self.poisoned else h

    def forward(self, x):
        return self.b(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))


def test_a_replay_inside_an_autocast_region_leaves_the_region_its_own_casts():
    """Warn mode reads an accumulating loop's first micro-batch at the second one's model call, inside that call's
    autocast region: the replay's casts of the weights stayed in the region's cache, the forward took them, and the
    compiled checkpoint's recomputation in backward, which casts, failed torch's check that it repeats the forward
    ("aten._to_copy.default encountered during backward but not found in storage")."""
    ampguard.install(nonfinite="warn")
    model = _CheckpointedPoison()
    model.poisoned = True
    compiled = torch.compile(model, backend="eager")
    with pytest.warns(ampguard.AmpGuardWarning, match="created by torch.log"):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(torch.ones(2, 4)).float().sum()
            loss.backward()
    assert model.a.weight.grad is not None


def test_a_grad_scaler_loop_on_a_compiled_model_reports_a_forward_nan():
    ampguard.install()
    compiled = torch.compile(Bad(), backend="eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(compiled(data(0)[0]).sum()).backward()
    scaler.step(opt)
    with pytest.raises(ampguard.NonFiniteError) as info:
        scaler.update()
    assert info.value.op == "torch.sqrt" and info.value.module == "Bad"


def test_nan_from_an_inductor_compiled_function_is_found_inside_it():
    ampguard.install()
    shifted_sqrt = torch.compile(lambda t: torch.sqrt(t - 100.0))  # inductor: replayed eagerly

    class UsesCompiledFunction(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return shifted_sqrt(self.fc(x)) * 2

    model = UsesCompiledFunction()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert info.value.op == "torch.sqrt" and info.value.module == "UsesCompiledFunction"
    assert "It was created by torch.sqrt (inputs finite, output NaN)" in str(info.value)


def test_eager_backend_compiled_function_runs_its_ops_through_the_tracer():
    ampguard.install()
    shifted_sqrt = torch.compile(lambda t: torch.sqrt(t - 100.0), backend="eager")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        (shifted_sqrt(model(torch.ones(2, 4))) * 2).sum().backward()
        opt.step()
    assert info.value.op == "torch.sqrt"
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


# a compiled function that calls the model (not a compiled module): module calls, the loss, clipping and the loss
# scaling are traced inside it ------------------------------------------------------------------------------------
def _compiled_steps(guarded, body, steps=4):
    """Four AdamW steps whose forward, loss and ``body`` run inside one inductor-compiled function; the parameters,
    the losses, and dynamo's graph breaks and graphs."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    step = torch.compile(lambda x: body(model, scaler, x), backend="inductor")
    losses = []
    with ampguard.guard() if guarded else torch.autograd.set_grad_enabled(True):
        for i in range(steps):
            loss = step(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)))
            losses.append(loss.item())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    breaks = {reason.split("\n")[0]: n for reason, n in counters["graph_break"].items()}
    return [p.detach().clone() for p in model.parameters()], losses, breaks, counters["stats"]["unique_graphs"]


def _forward_backward(model, scaler, x):
    loss = model(x).pow(2).mean()
    scaler.scale(loss).backward()
    return loss


def _forward_clip(model, scaler, x):
    loss = model(x).pow(2).mean()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e3)  # (the scaled gradients: the same in both runs)
    return loss


@pytest.mark.parametrize("body", [_forward_backward, _forward_clip], ids=["forward-scale-backward", "clip"])
def test_a_compiled_training_function_compiles_and_trains_exactly_as_without_ampguard(body):
    """ampguard once split such a graph (its module hook broke it: the run's numbers moved by an ulp), compiled its
    own wrappers as graphs (with dynamo's warnings pointing into ampguard), and crashed dynamo at a patched
    clip_grad_norm_ ("Guard failed on the same frame it was created")."""
    plain = _compiled_steps(False, body)
    ampguard.install()
    guarded = _compiled_steps(True, body)
    assert all(torch.equal(p, q) for p, q in zip(plain[0], guarded[0], strict=True))
    assert plain[1] == guarded[1]
    assert guarded[2:] == plain[2:]  # the same graph breaks (the backward's own), the same number of graphs


def _compiled_loss_code(guarded):
    """An eager model, and loss code compiled with a graph break on a torch op (``.item()``), which runs eagerly under
    the loss-code record and dynamo's frame callback; the losses and what dynamo compiled."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    @torch.compile(backend="aot_eager")
    def loss_code(out, y):
        loss = torch.nn.functional.mse_loss(out, y)
        scale = loss.item()  # (a graph break)
        return loss + 0.1 * out.std() / (1 + scale)

    losses = []
    with ampguard.guard() if guarded else contextlib.nullcontext():
        for i in range(3):
            x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), torch.randn(4, 1)
            loss = loss_code(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, dict(counters["frames"]), counters["stats"]["unique_graphs"]


def test_loss_code_compiled_with_a_graph_break_compiles_the_frames_it_compiles_without_ampguard():
    """The record calls a C op at a graph break through a frame bearing the user's file and line (so that its
    warnings name the user's line): dynamo took that frame for the user's and compiled it as one more frame."""
    plain = _compiled_loss_code(False)
    assert plain[1]["total"] >= 2  # (the function, and its resumption after the break)
    assert _compiled_loss_code(True) == plain


def test_a_nan_in_a_compiled_training_function_is_still_stopped_before_the_step():
    """The module call ran inside the compiled function, where ampguard records nothing: the loss is still
    checked at backward(), which runs outside the graph, and the step is not taken."""
    ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    before = model.weight.detach().clone()

    @torch.compile(backend="aot_eager")
    def step(x):
        loss = torch.log(model(x).pow(2).mean() - 1e9)  # NaN
        loss.backward()
        return loss

    with pytest.raises(ampguard.NonFiniteError) as info:
        loss = step(torch.randn(8, 4))
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    message = str(info.value)
    assert info.value.sink == "loss" and "NaN" in message.splitlines()[0]
    assert "the loss was made inside a torch.compile'd function" in message  # and what to do about it
    assert "torch.compile(model)" in message
    assert torch.equal(model.weight, before)
    del loss


class OwnMLP(torch.nn.Module):
    """A model of the user's own class: dynamo compiles its forward (torch's own modules are not compiled as top
    frames, so a compiled Sequential would compile nothing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class SqrtModel(OwnMLP):
    def forward(self, x):
        return self.b(torch.sqrt(self.a(x)))  # NaN WHERE a(x) < 0


def _in_place_run(guarded):
    """Train a model compiled in place; return the losses, the parameters and the size of each graph the backend was
    given."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    with ampguard.guard() if guarded else torch.enable_grad():
        model = OwnMLP()
        model.compile(backend=backend)
        losses = train(model, model.parameters())
    return losses, [p.detach().clone() for p in model.parameters()], graphs


def test_a_model_compiled_in_place_trains_as_without_ampguard():
    """``model.compile()`` runs the model's whole call compiled, hooks included; ampguard makes it an outermost call
    around the compiled code, which dynamo compiles to the same graphs as without ampguard."""
    plain, guarded = _in_place_run(False), _in_place_run(True)
    assert guarded[0] == plain[0] and all(torch.equal(p, q) for p, q in zip(plain[1], guarded[1], strict=True))
    assert guarded[2] == plain[2] and plain[2]  # (and something was compiled)


def test_a_nan_in_a_model_compiled_in_place_is_replayed_and_uninstall_gives_torch_its_call_back():
    g = ampguard.install()
    model = SqrtModel()
    model.compile(backend="eager")
    compiled = vars(model)["_compiled_call_impl"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.a.weight.detach().clone()
    model(torch.randn(3, 8)).pow(2).mean().backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    err = info.value
    assert err.op == "torch.sqrt" and err.origin[-1].lineno == line_of(SqrtModel.forward, "NaN WHERE"), str(err)
    assert torch.equal(model.a.weight, before)
    ampguard.uninstall()
    assert g is not None and vars(model)["_compiled_call_impl"] is compiled.compiled


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
def test_a_call_of_a_model_compiled_in_place_keeps_no_input_alive_once_the_user_drops_it(grad):
    """ampguard holds the call's frame while it runs. Held by a local of that frame too, it was a cycle once the call
    returned: it kept its callers' frames, and the input in them, alive until the garbage collector ran."""
    with ampguard.guard():
        model = OwnMLP()
        model.compile(backend="eager")
        model(torch.randn(3, 8))  # compiled here, before the collector is off
        gc.collect()
        gc.disable()
        try:
            x = torch.randn(3, 8)
            gone = weakref.ref(x)
            with torch.set_grad_enabled(grad):
                out = model(x)
            if grad:
                out.pow(2).mean().backward()  # (the autograd graph held it until here)
            del x, out
            assert gone() is None
        finally:
            gc.enable()


def test_a_teacher_compiled_in_place_that_raised_inside_the_loss_code_leaves_the_loss_code_recorded():
    """A call that raised made nothing, as torch's always-call hooks tell the uncompiled call's end: the loss code
    it interrupted goes on being recorded. Unseen, the loss code after it went unrecorded and a NaN there had no
    origin."""
    torch.manual_seed(1)
    student = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LogSoftmax(-1))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with ampguard.guard():
        teacher = RaisingTeacher()
        teacher.compile(backend="eager")
        log_p = student(torch.randn(4, 8))
        with torch.no_grad():
            try:
                soft = teacher(torch.randn(4, 8))
            except OutOfMemory:
                soft = torch.full((4, 4), 0.25)
        loss = torch.nn.functional.kl_div(log_p, soft, reduction="batchmean") + (log_p - 1).sqrt().mean()  # NAN
        loss.backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    err = info.value
    assert err.op == "Tensor.sqrt", str(err)
    assert err.origin[-1].lineno == line_of(
        test_a_teacher_compiled_in_place_that_raised_inside_the_loss_code_leaves_the_loss_code_recorded, "# NAN")


def test_a_model_compiled_in_place_before_the_guard_is_not_seen_and_the_message_says_what_works():
    model = SqrtModel()
    model.compile(backend="eager")  # before any guard: nothing of ampguard's saw it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard():
        model(torch.randn(3, 8)).pow(2).mean().backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    message = str(info.value)
    assert "compiled in place (model.compile()" in message and "model = torch.compile(model)" in message, message


def test_torch_export_works_under_ampguard_1(python):
    """torch.export deep-copies a config that holds ``warnings.warn`` (patched by ampguard to keep warnings at the
    user's line); a wrapt proxy refuses to be copied, so every export failed under AMPGUARD=1."""
    proc = python("""
        import copy, warnings, torch
        import ampguard
        assert ampguard.active()
        assert copy.deepcopy(warnings.warn) is warnings.warn and copy.copy(warnings.warn) is warnings.warn
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        x = torch.randn(3, 4)
        model(x).pow(2).mean().backward()  # a step under way: the loss-code record is on
        exported = torch.export.export(model, (x,))
        assert torch.equal(exported.module()(x), model(x))
        print("exported")
    """, env={"AMPGUARD": "1"}, timeout=240)
    assert proc.returncode == 0 and "exported" in proc.stdout, proc.stderr[-3000:]


def test_dynamo_loads_its_trace_rules_with_every_patch_applied(python):
    """Each patched module function shows dynamo's trace rules (``inspect.getattr_static``) an object of its own:
    one property shared by all of them made two patched functions with different rules (torch.autograd.grad,
    traced in graphs; destroy_process_group, skipped) fail ``import torch._dynamo`` ("Duplicate torch object")."""
    proc = python("""
        import inspect
        import torch, ampguard
        original = torch.autograd.grad
        ampguard.install()
        import torch._dynamo.trace_rules as rules
        rules.get_torch_obj_rule_map()
        inline = inspect.getattr_static(torch.autograd.grad, "_torchdynamo_inline")
        print("loaded", torch.autograd.grad is not original and inline.__func__ is original)
    """)
    assert proc.returncode == 0 and "loaded True" in proc.stdout, proc.stdout + proc.stderr


# -- torch.jit.trace: a model exported as TorchScript at the end of training --------------------------------------
def _traced_graph(guarded):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with ampguard.guard() if guarded else contextlib.nullcontext():
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        traced = torch.jit.trace(model, x)  # (its own check traces again and compares the two graphs)
        traced(x).pow(2).mean().backward()  # and the traced model trains on
        opt.step()
    # (a class traced again in one process gets a new mangled name: not part of the graph)
    return re.sub(r"___torch_mangle_\d+\.", "", str(traced.inlined_graph)), traced(x)


def test_torch_jit_trace_in_grad_mode_gives_the_graph_it_gives_without_ampguard():
    """ampguard's end of an outermost call held the output in a local variable, and the tracer names a value after
    the local variable that holds it: the graph differed from the check's re-trace, and trace() failed."""
    plain_graph, plain_out = _traced_graph(guarded=False)
    graph, out = _traced_graph(guarded=True)
    assert graph == plain_graph
    assert torch.equal(out, plain_out)


# -- an optimizer step compiled in its function (torch's "compile the optimizer" recipe) ----------------------------
def _compiled_step_run(guarded, bad_at=None, seen=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    @torch.compile(backend="eager")
    def opt_step():
        opt.step()

    g = torch.Generator().manual_seed(1)
    losses, before = [], None
    with ampguard.guard() if guarded else contextlib.nullcontext():
        for i in range(3):
            loss = model(torch.randn(5, 8, generator=g)).pow(2).mean()
            if i == bad_at:
                before = [p.detach().clone() for p in model.parameters()]
                if seen is not None:
                    seen.update(model=model, before=before)
                loss = loss * torch.tensor(float("nan"))  # COMPILED STEP NAN
            loss.backward()
            opt_step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, model, before


def test_a_compiled_optimizer_step_trains_as_without_ampguard_and_breaks_no_graph_noisily(caplog):
    """Dynamo traced the global pre-step hook, and its read broke the graph at Tensor.item() with a warning and a
    traceback through ampguard's frames at every compile."""
    torch._dynamo.reset()
    plain, plain_model, _ = _compiled_step_run(guarded=False)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        guarded, guarded_model, _ = _compiled_step_run(guarded=True)
    assert guarded == plain
    assert all(torch.equal(p, q) for p, q in zip(plain_model.parameters(), guarded_model.parameters(), strict=True))
    ours = [r.getMessage()[:300] for r in caplog.records if "ampguard" in r.getMessage()]
    assert ours == []


def test_a_nan_before_a_compiled_optimizer_step_is_named_and_the_step_not_applied():
    """The read ran in dynamo's frame, where the replay could not set its eager stance: the error said "ampguard
    could not replay it: attempted to set_stance in a torch.compile region"."""
    torch._dynamo.reset()
    seen = {}
    with pytest.raises(ampguard.NonFiniteError) as info:
        _compiled_step_run(guarded=True, bad_at=1, seen=seen)
    err, message = info.value, str(info.value)
    assert err.sink == "loss", message
    assert "It entered already non-finite (NaN): a constant in your code (a Python number or a tensor literal), " \
        "given to torch.tensor" in message, message
    assert err.origin[-1].lineno == line_of(_compiled_step_run, "COMPILED STEP NAN"), message
    assert "could not replay" not in message
    assert all(torch.equal(p, q) for p, q in zip(seen["model"].parameters(), seen["before"], strict=True))
