"""The normal path costs the same whatever the model's size: no pass of ampguard's own over
parameters or outputs a loss covers, no tensor kept alive, nested module calls on torch's fast path."""

import contextlib
import copy
import gc
import math
import sys
import warnings
import weakref

import pytest
import torch
from loops import CountSyncs, TokenLM, added_syncs, line_of

import ampguard
from ampguard import _sync, nonfinite
from ampguard.nonfinite import sinks


@pytest.fixture(params=["host", "device"])
def read_path(request, monkeypatch):
    """CPU statuses are read one by one where they are; a device's ride one stacked read. On a CPU, the
    second path runs with the first turned off."""
    monkeypatch.setattr(_sync, "HOST_READS", request.param == "host")
    return request.param


def our_hooks():
    return [h for h in torch.nn.modules.module._global_forward_pre_hooks.values()
            if getattr(h, "__module__", "").startswith("ampguard")]


class Probe(torch.nn.Module):
    """Records, inside a nested call, whether any global module hook was in place."""

    def __init__(self, fail=None):
        super().__init__()
        self.seen = []
        self.fail = fail

    def forward(self, x):
        module = torch.nn.modules.module
        self.seen.append(bool(module._global_forward_pre_hooks or module._global_forward_hooks))
        if self.fail is not None:
            raise self.fail
        return x


class Net(torch.nn.Module):
    def __init__(self, fail=None):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.probe = Probe(fail)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.probe(self.fc(x)))


def test_nested_module_calls_see_no_global_hook_and_the_hook_is_back_after_the_call():
    ampguard.install()
    model = Net()
    assert len(our_hooks()) == 1
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
    assert model.probe.seen == [False, False, False]  # torch's fast path inside the outermost call
    assert len(our_hooks()) == 1 and model._forward_hooks == {} and model._forward_pre_hooks == {}
    ampguard.uninstall()
    assert our_hooks() == []


def test_a_forward_that_raises_puts_the_hook_back():
    ampguard.install()
    model = Net(fail=ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(4, 8))
    assert len(our_hooks()) == 1 and model._forward_hooks == {}
    healthy = Net()
    healthy(torch.randn(4, 8)).sum().backward()
    assert healthy.probe.seen == [False]


@pytest.mark.parametrize("next_call", ["same module", "other module", "backward"])
def test_a_keyboard_interrupt_inside_the_forward_is_recovered(next_call):
    ampguard.install()
    model = Net(fail=KeyboardInterrupt())  # torch runs no always-call hook for it
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(4, 8))
    assert our_hooks() == []  # still taken off: nobody saw the call end
    model.probe.fail = None
    if next_call == "same module":
        out = model(torch.randn(4, 8))  # its instance pre-hook sees the stale call and starts a new one
    elif next_call == "other module":
        out = Net()(torch.randn(4, 8))
        torch.nn.Linear(2, 2)(torch.randn(1, 2)).sum().backward()  # the backward recovers
        out = Net()(torch.randn(4, 8))
    else:
        torch.nn.Linear(2, 2)(torch.randn(1, 2)).sum().backward()
        out = model(torch.randn(4, 8))
    out.sum().backward()
    assert len(our_hooks()) == 1 and model._forward_hooks == {}
    assert sinks.T.window == [] or sinks.T.window[0].module is not None
    ampguard.uninstall()
    assert our_hooks() == [] and model._forward_hooks == {}


def test_a_model_saved_whole_or_copied_after_a_keyboard_interrupt_has_none_of_ampguards_hooks(tmp_path, python):
    """A notebook interrupted in its training cell, whose next cell saves the model whole or copies it. torch runs
    no always-call hook for a KeyboardInterrupt, so the module kept ampguard's instance hooks until the next hook:
    torch.save wrote them into the file, which failed to load without ampguard, and the copy kept them for good."""
    original = vars(torch.nn.Module)["__getstate__"]
    ampguard.install()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def ctrl_c(module, args):
        raise KeyboardInterrupt

    handle = model[1].register_forward_pre_hook(ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(4, 8))
    handle.remove()
    assert model._forward_pre_hooks != {}  # (ampguard's, still there: nothing has seen the call end)
    path = tmp_path / "interrupted.pt"
    torch.save(model, path)
    copied = copy.deepcopy(model)
    assert model._forward_pre_hooks == {} and model._forward_hooks == {}  # the interrupted call is closed, too
    assert copied._forward_pre_hooks == {} and copied._forward_hooks == {}
    assert copied._forward_hooks_always_called == {} and copied._forward_hooks_with_kwargs == {}
    proc = python(f"""
        import sys
        sys.modules["ampguard"] = None  # where ampguard is not installed
        import torch
        m = torch.load({str(path)!r}, weights_only=False)
        print(tuple(m(torch.randn(3, 8)).shape), len(m._forward_pre_hooks), len(m._forward_hooks))
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "(3, 2) 0 0"
    ampguard.uninstall()
    assert vars(torch.nn.Module)["__getstate__"] is original


def test_a_module_that_copies_itself_inside_its_call_gives_a_copy_without_ampguards_hooks():
    """An EMA or a snapshot taken in the forward (``copy.deepcopy(self)``), or by another thread while the call
    runs: the copy has none of the hooks that end the call, and the call itself still ends as it should."""
    ampguard.install()

    class SelfCopying(Net):
        def forward(self, x):
            self.snapshot = copy.deepcopy(self)
            return super().forward(x)

    model = SelfCopying()
    model.snapshot = None
    model(torch.randn(4, 8)).sum().backward()
    snap = model.snapshot
    assert snap._forward_pre_hooks == {} and snap._forward_hooks == {} and snap._forward_hooks_always_called == {}
    assert model._forward_pre_hooks == {} and model._forward_hooks == {}  # the call ended and took its hooks off
    assert len(our_hooks()) == 1
    assert torch.equal(snap.fc.weight, model.fc.weight)


@pytest.mark.parametrize("interrupted", [False, True])
def test_trace_eager_keeps_a_global_forward_hook_on_only_while_its_call_is_open(interrupted):
    module = torch.nn.modules.module
    before = len(module._global_forward_hooks)
    ampguard.install(trace="eager")
    model = Net(fail=KeyboardInterrupt() if interrupted else None)
    if interrupted:
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(4, 8))
        assert len(module._global_forward_hooks) == before + 1  # nobody saw the call end
        model.probe.fail = None
    during = []
    model.probe.forward = lambda x: during.append(len(module._global_forward_hooks)) or x
    model(torch.randn(4, 8)).sum().backward()  # (after an interrupt: its pre-hook sees the stale call, a new one)
    assert during == [before + 1]  # every nested call's end is seen, to name each op's module
    assert len(module._global_forward_hooks) == before and model._forward_hooks == {}
    del model.probe.forward
    ampguard.install(trace="replay")
    model(torch.randn(4, 8)).sum().backward()
    assert model.probe.seen[-1] is False and len(module._global_forward_hooks) == before
    ampguard.uninstall()
    assert len(module._global_forward_hooks) == before and our_hooks() == []


def test_a_module_calling_itself_is_one_outermost_call():
    class Recursive(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, depth=2):
            return self.fc(x) if depth == 0 else self(self.fc(x), depth - 1)

    ampguard.install()
    model = Recursive()
    out = model(torch.randn(2, 4))
    calls = [e for e in sinks.T.window if type(e) is sinks.Call]
    assert len(calls) == 1 and calls[0].module is model
    out.sum().backward()
    assert len(our_hooks()) == 1 and model._forward_hooks == {}


def test_a_dropped_output_is_freed_before_backward():
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = []

    def keep_ref(module, args, output):
        refs.append(weakref.ref(output))

    model.register_forward_hook(keep_ref)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1]))
    gc.collect()
    assert refs[0]() is None  # the logits: only autograd's saved copy (if any) remains, as without ampguard
    loss.backward()
    opt.step()


@pytest.mark.parametrize("detached", [lambda t: t.detach(), lambda t: t.data])
def test_a_detached_output_that_a_metric_of_the_loss_code_used_is_freed_before_backward(detached):
    """A confidence logged from logits.detach() (or .data): what it returns has no history, and the record kept such an
    argument as data until the read, with the logits' memory, through backward."""
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logits = model(torch.randn(4, 8))
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 0, 1]))
    probs = detached(logits)
    confidence = probs.softmax(-1).amax(-1).mean()
    ref = weakref.ref(probs)
    del logits, probs
    gc.collect()
    assert ref() is None
    loss.backward()
    opt.step()
    assert torch.isfinite(confidence)


@pytest.mark.parametrize("trained", [True, False])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_model_evaluated_and_dropped_is_freed_when_the_user_drops_it(read_path, trained, mode):
    """A script that evaluates checkpoints one after another (or trains, evaluates and loads the next model) drops
    each model before it loads the next. The calls without grad stay in the window until the next read, and held
    their module: the dropped model lived on beside the next one, twice the memory of the run without ampguard."""
    ampguard.install()
    model = Net()
    if trained:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        del opt
    model.eval()
    with getattr(torch, mode)():
        for _ in range(2):
            model(torch.randn(4, 8))
    assert any(type(e) is sinks.Call for e in sinks.T.window)  # (the calls are still there, until the next read)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_nan_output_read_after_its_model_was_dropped_says_so(read_path):
    """On a device an inference output's status is read later, at the next call of the model or at the guard's end.
    If the model is gone by then, the NaN is still reported, as the output of that module, and the message says why
    the call was not replayed and how to have it replayed."""
    model = Net()
    with torch.no_grad():
        model.head.bias[0] = float("nan")
        x = torch.randn(4, 8)
        with pytest.raises(ampguard.NonFiniteError) as info:
            with ampguard.guard():
                model(x)
                if read_path == "device":
                    ref = weakref.ref(model)
                    del model
                    gc.collect()
                    assert ref() is None
    message = str(info.value)
    assert info.value.sink == "output of module 'Net'"
    if read_path == "device":
        assert "module 'Net', called without grad, was freed before the check" in message, message
        assert "keep it referenced until the check" in message
    else:  # known NaN at once on the CPU: the call holds its module and data until the read, and names the origin
        assert "parameter 'head.bias'" in message, message


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_an_error_the_loop_catches_holds_nothing_of_the_failed_step_after_its_except_block(read_path, where):
    """A loop that skips a bad batch itself (``except FloatingPointError: continue``). The error's traceback holds
    the failed step's frames, and with them its batch, its loss and whatever else they reference. Python drops the
    error at the end of the except block; ampguard kept the latest one, so all of that lived on until the next
    error."""
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs, hooks = [], []

    def step(bad):
        batch = torch.randn(64, 8)
        loss = model(batch).pow(2).mean()
        refs.append((weakref.ref(batch), weakref.ref(loss)))
        if bad and where == "loss":
            loss = loss * float("nan")
        elif bad:
            hooks.append(model.head.weight.register_hook(lambda grad: grad * float("nan")))
        loss.backward()
        opt.step()
        opt.zero_grad()

    caught = 0
    for i in range(3):
        try:
            step(i == 1)
        except FloatingPointError:  # (NonFiniteError is one)
            caught += 1
            opt.zero_grad()
            for hook in hooks:
                hook.remove()
    assert caught == 1
    gc.collect()
    assert [(batch() is None, loss() is None) for batch, loss in refs] == [(True, True)] * 3


@pytest.mark.parametrize("nonfinite", ["raise", "warn"])
def test_a_script_run_once_per_trial_leaves_nothing_of_its_globals_behind(tmp_path, nonfinite):
    """A sweep that runs its training script once per trial (``runpy.run_path``), the model and data in the script's
    globals. Four caches kept every trial's globals alive, with the model in them: the loss-code record's functions
    bound to the calling frame's globals, the kind of each module class (a class holds its module's globals through
    its methods), in the last trial's evaluation call the class of a module held weakly, and in warn mode the
    classes already warned about."""
    import runpy

    script = tmp_path / "trial.py"
    script.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"  # (a class of the script's: its methods hold the script's globals)
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(8, 1)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
        "model = Net()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(2):\n"
        "    loss = model(torch.randn(4, 8)).pow(2).mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "with torch.no_grad():\n"
        "    if POISON:\n"
        "        model.fc.bias.fill_(float('nan'))\n"
        "    model.eval()(torch.randn(2, 8))\n"
        "    model.fc.bias.fill_(0.0)\n"
        "    model(torch.randn(2, 8))\n")  # (the read of the call before; finite: it holds nothing)
    ampguard.install(nonfinite=nonfinite)
    refs, warned = [], []
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            namespace = runpy.run_path(str(script), init_globals={"POISON": nonfinite == "warn"})
        warned.append(len(caught))  # (warn mode: once per sink and module class, and each trial has a class of its own)
        refs.append(weakref.ref(namespace["model"]))
        del namespace
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
    assert warned == ([1, 1, 1] if nonfinite == "warn" else [0, 0, 0])


class TakesMany(torch.nn.Module):
    """A model called with a batch, a mask in a list, a number, a parameter and another call's output."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x, extras, k, weight, h):
        mask, (bias,) = extras
        return self.fc(x * mask + bias) * weight * k + h


def test_a_recorded_call_holds_its_batch_as_it_is_and_every_tensor_with_history_weakly():
    ampguard.install()
    model, encoder = TakesMany(), torch.nn.Linear(4, 4)
    x, mask, bias = torch.randn(2, 4), torch.ones(2, 4), torch.zeros(4)
    h = encoder(x)  # an earlier call's output: known as "output 0 of event 0"
    model(x, [mask, (bias,)], 3, model.scale, h).sum().backward()
    first, call = [e for e in sinks.T.window if type(e) is sinks.Call]
    x_held, (mask_held, (bias_held,)), k_held, weight_held, h_held = call.args
    assert x_held is x and mask_held is mask and bias_held is bias  # data: kept as it is until the read
    assert type(call.args[1]) is list and type(call.args[1][1]) is tuple and k_held == 3
    assert type(weight_held) is sinks.Ref and weight_held.event == -1 and weight_held.ref() is model.scale
    assert type(h_held) is sinks.Ref and (h_held.event, h_held.key) == (first.index, 0) and h_held.ref() is h
    with torch.no_grad():
        feats = encoder(x)  # no history, and made by the window: its output, not data
    model(feats, [mask, (bias,)], 1, model.scale, h)
    held = [e for e in sinks.T.window if type(e) is sinks.Call][-1].args[0]
    assert type(held) is sinks.Ref and held.ref() is feats and held.event >= 0


def test_ampguard_holds_no_activation_output_or_loss_graph_between_steps():
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    loss = model(x).sum()
    loss.backward()
    held = [t for t in _held_tensors() if t.grad_fn is not None]
    assert held == []
    opt.step()
    assert sinks.T.pending == [] and sinks.T.window == []


def _held_tensors():
    held = []
    for p in sinks.T.pending:
        held.extend(t for t in p.parts if isinstance(t, torch.Tensor))
    for event in sinks.T.window:
        stack = [event.args, event.kwargs]
        while stack:
            v = stack.pop()
            if isinstance(v, torch.Tensor):
                held.append(v)
            elif isinstance(v, (tuple, list)):
                stack.extend(v)
            elif isinstance(v, dict):
                stack.extend(v.values())
    return held


def _gradient_reads(monkeypatch, model):
    """What each status of a gradient read covers, as (route, elements): 'sum' for one gradient's sum, 'buffer' for a
    buffer of small ones, 'values' for a few values read as Python floats, 'foreach' for the foreach norm's tensors
    (one entry per tensor)."""
    reads = []
    norms, status, values = sinks._norms, sinks.sum_status, sinks.few_values_sum

    def grads():
        return {id(p.grad) for p in model.parameters()}

    def counted_norms(tensors):
        reads.extend(("foreach", t.numel()) for t in tensors)
        return norms(tensors)

    def counted_status(tensor):
        reads.append(("sum" if id(tensor) in grads() else "buffer", tensor.numel()))
        return status(tensor)

    def counted_values(tensor):
        total = values(tensor)
        if total is not None:
            reads.append(("values", tensor.numel()))
        return total

    monkeypatch.setattr(sinks, "_norms", counted_norms)
    monkeypatch.setattr(sinks, "sum_status", counted_status)
    monkeypatch.setattr(sinks, "few_values_sum", counted_values)
    return reads


def _sum_ops(monkeypatch):
    """The elements of each tensor whose status is a sum op (any tensor: a gradient, a buffer, an output)."""
    sums = []
    real = sinks.sum_status

    def counted(tensor):
        sums.append(tensor.numel())
        return real(tensor)

    monkeypatch.setattr(sinks, "sum_status", counted)
    return sums


def test_no_pass_over_the_gradients_when_the_loop_clips(monkeypatch):
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reads = _gradient_reads(monkeypatch, model)
    model(torch.randn(4, 8)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    assert reads == []  # the loss and clip_grad_norm_'s total norm are scalars: no pass at all
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # no clip this time: one pass over the 4 gradients (the loss is its own status), a sum each
    # (fewer than sinks.FEW: no buffer; the few values of a small one are read as Python floats, no op)
    assert reads == [("values", p.numel()) for p in model.parameters()]


def test_a_finite_cpu_step_leaves_nothing_for_the_shared_read_and_a_nan_gradient_still_is_named(monkeypatch):
    """On the CPU the loss and the gradients are read where they are met (no sync there): a step whose values are
    all finite ends its window at the step without the shared read, with or without a clip; a NaN gradient waits for
    the read, which names it before the update."""
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reads = []
    real = _sync.read
    monkeypatch.setattr(_sync, "read", lambda *a, **k: reads.append(a) or real(*a, **k))
    for clip in (False, True, False):
        model(torch.randn(4, 8)).sum().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert sinks.T.pending == [] and sinks.T.window == []
    assert reads == []
    handle = model.fc.weight.register_hook(lambda grad: grad * float("nan"))
    before = model.fc.weight.detach().clone()
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    handle.remove()
    assert len(reads) == 1 and info.value.sink == "gradient of parameter 'fc.weight'"
    assert torch.equal(model.fc.weight, before)


class ManyTensors(torch.nn.Module):
    """A model's shape of gradients: many small ones (biases, small layers), a large one, and another dtype."""

    def __init__(self, layers=40):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                            for _ in range(layers)))
        self.wide = torch.nn.Linear(16, 512)  # 8,192 weights: past SMALL, its own norm
        self.head = torch.nn.Linear(512, 1).double()

    def forward(self, x):
        return self.head(self.wide(self.blocks(x)).double())


@pytest.mark.parametrize("chunk", [sinks.CHUNK, 600])
def test_many_small_cpu_gradients_are_read_in_few_buffers_and_a_nan_in_any_is_named(monkeypatch, read_path, chunk):
    """On the CPU a kernel per tensor costs some microseconds however small the tensor: the small gradients of one
    dtype are copied into buffers of at most CHUNK elements and summed once each (a last few left over are summed
    one by one). Every gradient is still read: a NaN in a small tensor inside a buffer, in the last small one, in
    the large one, or in another dtype's is named."""
    monkeypatch.setattr(sinks, "CHUNK", chunk)
    g = ampguard.install()
    model = ManyTensors()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reads = _gradient_reads(monkeypatch, model)
    x = torch.randn(4, 16)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    total = sum(p.numel() for p in model.parameters())
    assert sum(n for _, n in reads) == total  # every gradient read once
    buffers = [n for route, n in reads if route == "buffer"]
    if read_path == "host":
        assert all(n < chunk + sinks.SMALL for n in buffers)
        if chunk > total:
            assert buffers == [40 * (16 * 16 + 16) + 512]  # the blocks' 80 tensors and the wide bias, float32
            # the wide weight (past SMALL) and the float64 head's weight; its one-element bias is read as a value
            assert sorted(n for route, n in reads if route == "sum") == [512, 16 * 512]
            assert [n for route, n in reads if route == "values"] == [1]
        else:
            assert len(buffers) > 1
        assert not any(route == "foreach" for route, _ in reads)
    else:  # a device's path: one foreach kernel for all
        assert {route for route, _ in reads} == {"foreach"}
    for name in ("blocks.20.0.weight", "blocks.39.0.bias", "wide.weight", "head.bias"):
        param = model.get_parameter(name)
        handle = param.register_hook(lambda grad: grad * float("nan"))
        before = param.detach().clone()
        model(x).sum().backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
        assert info.value.sink == f"gradient of parameter '{name}'", name
        assert torch.equal(param, before)  # read before the update
        handle.remove()
        opt.zero_grad()
    assert g.stats.nonfinite_detected == 4


@pytest.mark.parametrize(("dtype", "value"), [(torch.float32, 3e38), (torch.float16, 60000.0), (torch.bfloat16, 3e38)])
def test_large_finite_gradients_read_in_a_buffer_never_raise(monkeypatch, dtype, value):
    """A buffer's sum overflows where its values are large and finite: re-checked exactly, it raises nothing."""
    g = ampguard.install()
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(12))).to(dtype)  # 24 small gradients
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    reads = _gradient_reads(monkeypatch, model)
    model(torch.zeros(2, 4, dtype=dtype)).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.fill_(value)
    opt.step()
    assert reads == [("buffer", 12 * (16 + 4))] and g.stats.nonfinite_detected == 0


@pytest.mark.parametrize(("dtype", "value"), [(torch.float32, 3e38), (torch.float16, 60000.0),
                                              (torch.bfloat16, 3e38), (torch.float64, 1e308)])
def test_a_few_values_are_read_as_floats_and_large_finite_ones_never_raise(monkeypatch, dtype, value):
    """A CPU tensor of at most FEW_ELEMENTS elements (a small layer's gradients, an RL policy's logits at every call)
    is read as Python floats, with no torch op. Summed in double, large finite values of any dtype but float64 do
    not overflow; float64 ones that do are re-checked exactly. None raises, and a NaN among them is named."""
    g = ampguard.install()
    model = torch.nn.Linear(4, 4).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    reads = _gradient_reads(monkeypatch, model)
    sums = _sum_ops(monkeypatch)
    model(torch.zeros(2, 4, dtype=dtype)).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.fill_(value)
    opt.step()
    assert reads == [("values", 16), ("values", 4)] and g.stats.nonfinite_detected == 0
    with torch.no_grad():
        model.weight.zero_()
        model.bias.fill_(value)
        for _ in range(2):
            model(torch.zeros(2, 4, dtype=dtype))  # 8 outputs, each `value`
        nonfinite.check()
    assert g.stats.nonfinite_detected == 0
    assert sums == ([8, 8] if dtype == torch.float64 else [])  # (only a double sum that overflowed takes an op)
    with torch.no_grad():
        model.bias.zero_()
    model(torch.zeros(2, 4, dtype=dtype)).sum().backward()
    model.weight.grad[1, 2] = float("nan")
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    assert info.value.sink == "gradient of parameter 'weight'"
    with torch.no_grad():
        model.bias[3] = float("nan")
        with pytest.raises(ampguard.NonFiniteError) as info:
            model(torch.zeros(2, 4, dtype=dtype))
            nonfinite.check()
    assert info.value.sink == "output of module 'Linear'"


def _summing_to_nan(n=128):
    """Finite float32 values whose sum is NaN on this CPU: partial sums overflow to +Inf and -Inf (found, not
    assumed: the test that uses it asserts it)."""
    for pattern in ([3e38, -3e38], [3e38, 3e38, -3e38, -3e38], [3e38] * 8 + [-3e38] * 8, [3e38] * 16 + [-3e38] * 16):
        t = torch.tensor(pattern * (n // len(pattern)))
        if t.sum().isnan():
            return t
    return None


def test_a_finite_gradient_whose_sum_is_nan_never_raises(monkeypatch):
    """A CPU gradient's status is its sum: NaN where partial sums overflow both ways, with every value finite. Such
    a NaN is re-checked exactly, as an Inf is; a real NaN in the same gradient is still named."""
    values = _summing_to_nan()
    if values is None:
        pytest.skip("no pattern sums to NaN on this CPU's kernels")
    g = ampguard.install()
    model = torch.nn.Linear(values.numel(), 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    reads = _gradient_reads(monkeypatch, model)
    model(torch.zeros(2, values.numel())).sum().backward()
    model.weight.grad.copy_(values.reshape(1, -1))
    assert sinks.sum_status(model.weight.grad).isnan()
    opt.step()
    assert reads and g.stats.nonfinite_detected == 0
    model.weight.grad[0, 3] = float("nan")
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    assert info.value.sink == "gradient of parameter 'weight'"


def test_a_nan_gradient_is_caught_through_the_clip_norm_and_named():
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.head.weight.register_hook(lambda grad: grad * float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(4, 8)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    # clip_grad_norm_ scales every gradient by max_norm / NaN: all of them are NaN by the step
    assert info.value.sink.startswith("gradient of parameter")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_clip_before_the_latest_backward_is_not_used():
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # finite
    model.head.weight.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(ampguard.NonFiniteError):
        model(torch.randn(4, 8)).sum().backward()  # accumulates NaN after the clip
        opt.step()


def test_a_loop_that_skips_a_batch_on_clips_own_nonfinite_error_goes_on(read_path):
    """clip_grad_norm_(error_if_nonfinite=True) raised, and the loop caught it and skipped the batch: the user's
    exception wins, as when backward() raises. The next batch is not blamed for the skipped one."""
    g = ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    skipped = []
    for i in range(4):
        x = torch.randn(4, 8)
        if i == 1:
            x[0, 0] = float("nan")  # a corrupt batch
        model(x).sum().backward()
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        except RuntimeError:
            skipped.append(i)
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    assert skipped == [1] and g.stats.nonfinite_detected == 0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize(("dtype", "value"), [(torch.float32, 3e38), (torch.float16, 60000.0),
                                              (torch.float32, 1e20), (torch.bfloat16, 3e38)])
def test_large_finite_losses_outputs_and_gradients_never_raise(dtype, value, read_path):
    g = ampguard.install()
    model = torch.nn.Linear(64, 64).to(dtype)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.zeros(16, 64, dtype=dtype)
    for _ in range(2):
        out = model(x)  # every element `value`: its 2-norm overflows float32
        (out * 0 + value).max().backward()  # a finite loss of `value`
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            held = model(x)  # an output no loss covers, read at the next call
    del held
    nonfinite.check()
    assert g.stats.nonfinite_detected == 0



def _clipped_steps(dtype):
    """Three clipped SGD steps whose gradients are each finite and whose norm passes the dtype's largest value:
    65,536 gradients of 300 (a norm of 76,800) in float16, of 1e37 in float32. Plain PyTorch trains on zeros."""
    torch.manual_seed(0)
    model = torch.nn.Linear(65536, 1, bias=False).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with torch.no_grad():
        model.weight.zero_()
    x = torch.full((4, 65536), 75.0 if dtype == torch.float16 else 2.5e36, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()  # STEP ON ZEROS
    assert norm.isinf() and bool((model.weight.grad == 0).all())
    return model.weight.detach().clone(), [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_clip_norm_that_overflows_with_finite_gradients_is_said_once_and_changes_nothing(dtype, read_path):
    """The clip's Inf total norm was read, re-checked exactly, found finite gradients, and said nothing: a run whose
    clipping zeroed every gradient at every step went on silently, as plain PyTorch does."""
    plain, _ = _clipped_steps(dtype)
    g = ampguard.install()
    guarded, found = _clipped_steps(dtype)
    assert torch.equal(plain, guarded) and g.stats.nonfinite_detected == 0
    assert len(found) == 1, [str(w.message) for w in found]
    message = str(found[0].message)
    assert message.startswith("ampguard: clip_grad_norm_ returned an Inf total norm while every gradient was finite, "
                              "so it multiplied each gradient by max_norm / Inf = 0"), message
    if dtype == torch.float16:
        assert "computes the norm of float16 gradients in float16" in message and "torch.autocast" in message
    else:
        assert "Its sum of squares can pass float32's largest value (3.4e+38) once gradients reach about 2e+19: " \
            "gradients that large are a diverging run's" in message, message
    assert found[0].filename == __file__ and found[0].lineno == line_of(_clipped_steps, "STEP ON ZEROS")


def test_a_clip_norm_that_is_finite_says_nothing():
    ampguard.install()
    model = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            (model(torch.randn(4, 64)) * 1e15).sum().backward()  # large, finite gradients and norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)] == []


def test_a_nan_output_of_an_inference_call_is_reported_even_when_dropped_at_once(read_path):
    ampguard.install()
    model = Net()
    x = torch.randn(4, 8)  # under no_grad ampguard holds no input: a replay needs the user's
    with torch.no_grad():
        model.head.bias[0] = float("nan")
        if read_path == "host":
            with pytest.raises(ampguard.NonFiniteError) as info:
                model(x).argmax(-1)  # known when made, on the CPU: raised by this call
        else:
            model(x).argmax(-1)  # status taken when made; the output is not held
            with pytest.raises(ampguard.NonFiniteError) as info:
                model(x)  # the next call of the same module reads it
    assert info.value.sink == "output of module 'Net'"
    assert "parameter 'head.bias'" in str(info.value)


def test_an_evaluation_loop_raises_at_the_batch_whose_output_is_nan():
    """On the CPU a no_grad call's NaN output is known as the call returns: the call raises, so the loop's batch in
    a traceback or a post-mortem debugger is the bad one (before, the next batch's call raised, and showed that one)."""
    ampguard.install()
    model = Net().eval()
    batches = [torch.randn(4, 8) for _ in range(4)]
    batches[2][1, 3] = float("nan")
    seen = []
    with torch.no_grad(), pytest.raises(ampguard.NonFiniteError) as info:
        for i, batch in enumerate(batches):
            seen.append(i)
            model(batch)
    assert seen == [0, 1, 2]
    assert "argument 0 of the call of 'Net'" in str(info.value), str(info.value)


def test_a_thread_that_calls_the_model_once_raises_on_its_nan_output():
    """A thread per request (a web handler calling the model once and returning). Its check was read at that
    thread's next call of the model, which never came: the NaN was served. On the CPU the call raises."""
    import threading

    ampguard.install()
    model = Net().eval()
    results = []

    def handle(batch):
        try:
            with torch.inference_mode():
                results.append(model(batch).argmax(-1).tolist())
        except ampguard.NonFiniteError as exc:
            results.append(exc.sink)

    for poisoned in (False, True, False):
        batch = torch.randn(2, 8)
        if poisoned:
            batch[0, 0] = float("nan")
        worker = threading.Thread(target=handle, args=(batch,))
        worker.start()
        worker.join()
    assert [type(r) for r in results] == [list, str, list] and results[1] == "output of module 'Net'", results


def test_warn_mode_warns_once_for_a_teachers_nan_that_reaches_the_loss():
    """Warn mode reads a no_grad call's NaN with the step it belongs to: the teacher's output is named once, as the
    first value made of those that failed. Read as the teacher returned, the loss would then warn again, with its
    origin lost (the window gone)."""
    ampguard.install(nonfinite="warn")
    teacher, student = Net().eval(), Net()
    with torch.no_grad():
        teacher.head.bias[0] = float("nan")
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            target = teacher(x)
        torch.nn.functional.mse_loss(student(x), target).backward()
        opt.step()
    said = [str(w.message) for w in seen if issubclass(w.category, ampguard.AmpGuardWarning)]
    assert len(said) == 1 and "NaN reached the output of module 'Net'" in said[0], said
    assert "parameter 'head.bias'" in said[0], said[0]


class Scores(torch.nn.Module):
    """Attention-like scores with masked and overflowing entries: +Inf and -Inf, and a NaN where asked."""

    def __init__(self, nan=False):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.nan = nan

    def forward(self, x):
        scores = self.proj(x)
        scores[:, 0] = float("inf")
        scores[:, 1] = float("-inf")
        if self.nan:
            scores[:, 5] = float("nan")
        return scores


def test_an_inference_output_of_plus_and_minus_inf_is_no_nan(monkeypatch, read_path):
    """An output's status read at once on the CPU is its sum: +Inf and -Inf elements sum to NaN with no NaN element.
    Checked at once, it raises nothing (an output sink judges NaN only), and its status is the 2-norm's +Inf, which
    the repro command still judges; a NaN beside them is named."""
    g = ampguard.install()
    model = Scores()
    sums = _sum_ops(monkeypatch)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 8))
        nonfinite.check()
        assert sinks.T.pending == []
        assert g.stats.nonfinite_detected == 0
        assert sums == ([32, 32, 32] if read_path == "host" else [])  # (a device's: the 2-norm, read later)
        model(torch.randn(4, 8))
        pending = list(sinks.T.pending)
        assert [p.status.item() for p in pending] == [math.inf]  # the 2-norm's, as the repro command reads it
        model.nan = True
        with pytest.raises(ampguard.NonFiniteError) as info:
            model(torch.randn(4, 8))
            nonfinite.check()
    assert info.value.sink == "output of module 'Scores'"


def test_an_evaluation_loop_that_frees_each_batch_gets_the_origin_on_the_cpu(read_path):
    """An evaluation loop (Lightning's validation and predict loops) frees each batch before the next call, where a
    NaN output under no_grad is read. On the CPU the status is known at once, so the call with the NaN output
    holds its batch until that read, and the replay names the origin; on a device the read is a sync that the next
    call shares, and the batch, held by nobody, is gone: the message says so. A finite output holds nothing."""
    ampguard.install()
    model = Net()

    def batches():
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            yield torch.randn(4, 8, generator=g)

    with torch.no_grad():
        alive = []
        for x in batches():
            model(x)
            alive.append(weakref.ref(x))
        assert all(ref() is None for ref in alive[:-1])  # a finite output's batch is not held
        model.head.bias[0] = float("nan")
        with pytest.raises(ampguard.NonFiniteError) as info:
            for x in batches():
                model(x)
    message = str(info.value)
    if read_path == "host":
        assert "parameter 'head.bias'" in message and "was freed before the check" not in message, message
    else:
        assert "argument 0 of the call of 'Net' was freed before the check" in message, message


def test_a_nan_gradient_under_a_finite_loss_is_caught_by_either_read(read_path):
    g = ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    opt.step()  # a clean step: loss, output and gradient statuses read together
    opt.zero_grad()
    before = model.fc.weight.detach().clone()
    loss = model(x).sum() + torch.sqrt(model.fc.weight[0, 0] * 0)  # finite: sqrt(0) is 0; its gradient is not
    loss.backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    assert info.value.sink == "gradient of parameter 'fc.weight'"
    assert info.value.kind == "nan"
    assert torch.equal(model.fc.weight, before)  # read before the update
    assert g.stats.nonfinite_detected == 1


class ShiftedSqrt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.sqrt(self.fc(x) + 50.0)  # MICRO-BATCH SQRT: NaN only for an input far below the others


@pytest.mark.parametrize("keep", [True, False], ids=["micro-batches-held", "micro-batches-dropped"])
def test_a_nan_in_an_earlier_micro_batch_is_caught_at_the_step_on_a_device(monkeypatch, keep):
    """Read at the step with the others: named if the user still holds that micro-batch (a list of them, as
    transformers' Trainer keeps), and otherwise reported with why it was not replayed. Never applied."""
    monkeypatch.setattr(_sync, "HOST_READS", False)
    ampguard.install()
    model = ShiftedSqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    micro_batches = [torch.rand(4, 8, generator=g) * (-1000.0 if k == 1 else 1.0) for k in range(4)]
    held = []
    with pytest.raises(ampguard.NonFiniteError) as info:
        for k in range(4):
            x = micro_batches[k].clone()
            if keep:
                held.append(x)
            (model(x).sum() / 4).backward()
            del x
        opt.step()
    err = info.value
    assert err.sink == "loss" and all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    if keep:
        assert err.op == "torch.sqrt" and err.module == "ShiftedSqrt", str(err)
        assert err.origin[-1].lineno == ShiftedSqrt.forward.__code__.co_firstlineno + 1  # the MICRO-BATCH SQRT line
    else:
        assert err.op is None
        assert "was freed before the check: it is an earlier micro-batch of a step that accumulates" in str(err)
        assert "keep the micro-batches referenced until the step, or run without accumulation" in str(err)


def test_gradient_accumulation_reads_each_micro_batch_on_a_cpu_and_all_of_them_at_the_step_on_a_device(read_path):
    """On a CPU a finite loss is read at once, for free, and the next forward ends its window. On a device a read
    is a sync: the step's micro-batches are read together at the step, and the data of the earlier ones is held
    weakly from the next micro-batch on, so that memory is the user's."""
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CountSyncs() as mode:
        for k in range(3):  # gradient accumulation: forward and backward, no step
            x = torch.randn(4, 8)
            model(x).sum().backward()
            if read_path == "host":
                assert len(sinks.T.window) == 2  # this micro-batch's call and its loss code (the sum)
                assert not sinks.T.pending  # a finite CPU loss leaves no check
            else:
                assert len(sinks.T.window) == 2 * (k + 1) and len(sinks.T.pending) == k + 1
                held = [a for e in sinks.T.window[:-2] for a in e.args if isinstance(a, torch.Tensor)]
                assert held == []  # the earlier micro-batches' inputs: weak Refs now
        before = mode.syncs
        opt.step()
        assert not sinks.T.window and not sinks.T.pending
    if read_path == "device":
        assert before == 0 and mode.syncs == 1  # one read, at the step, for the three micro-batches


def test_a_read_whose_every_sink_was_dropped_still_ends_its_window(read_path):
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    out = model(torch.randn(4, 8))
    scaler.scale(out).backward(torch.ones_like(out))  # a loss of 8 elements: held weakly, read if still held
    del out
    scaler.step(opt)
    scaler.update()  # nothing left to read, and the step is over: no call or batch stays recorded
    assert not sinks.T.window and not sinks.T.pending


def test_a_nan_made_by_a_step_is_named_at_the_next_forward_with_the_step():
    ampguard.install()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=float("inf"))  # finite gradients, a step that overflows
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    with pytest.raises(ampguard.NonFiniteError) as info:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    message = str(info.value)
    assert "It entered already non-finite" in message and "parameter 'fc." in message
    assert "The optimizer step of SGD#0 made it: its gradients were finite at that step" in message
    assert "and its learning rate is inf." in message


def test_a_parameter_set_by_hand_after_a_step_is_not_blamed_on_the_step_alone():
    """Its gradients were finite and its settings are: the step may have made it, or code after it did."""
    ampguard.install()
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    with torch.no_grad():
        model.fc.weight[0, 0] = float("inf")  # a LoRA adapter or a weight patched by hand, say
    with pytest.raises(ampguard.NonFiniteError) as info:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    message = str(info.value)
    assert "The optimizer step of AdamW#0 ran on it after its last check" in message
    assert "or code outside the optimizer wrote it after the step (parameters set by hand" in message
    assert "made it:" not in message


MODES_AT_BACKWARD: list = []


class StackAtBackward(torch.autograd.Function):
    """Identity whose backward records how many torch function modes are on while autograd runs it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        MODES_AT_BACKWARD.append(torch._C._len_torch_function_stack())
        return grad


@pytest.mark.parametrize("call", ["loss.backward()", "Tensor.backward(loss)", "torch.autograd.backward(loss)"])
def test_loss_backward_takes_the_loss_code_record_off_before_torch_dispatches_the_call(call):
    """loss.backward() ends the loss code's record before torch looks for a function mode: torch no longer hands the
    call to the recorder, nor, after it, the torch calls until the next hook (the optimizer step's profiler op).
    The record still holds the loss code, and a NaN made there is still named at its line."""
    original = vars(torch.Tensor)["backward"]
    ampguard.install()
    assert vars(torch.Tensor)["backward"].__wrapped__ is original  # wrapped on the class itself, once
    model = torch.nn.Linear(4, 1)
    x = torch.randn(3, 4)
    MODES_AT_BACKWARD.clear()
    loss = StackAtBackward.apply(model(x)).pow(2).mean()
    assert torch._C._len_torch_function_stack() == 1  # the record is on for the loss code
    eval(call, {"loss": loss, "Tensor": torch.Tensor, "torch": torch})
    assert torch._C._len_torch_function_stack() == 0  # off, not put back after the call
    assert MODES_AT_BACKWARD == [0]
    assert model.weight.grad is not None
    torch.optim.SGD(model.parameters(), lr=0.1).step()

    nan = torch.log(model(x) - 10)  # NaN: the loss code's origin, recorded before backward() ends the record
    with pytest.raises(ampguard.NonFiniteError) as info:
        nan.mean().backward()
        nonfinite.check()
    assert info.value.op == "torch.log"
    assert "nan = torch.log(model(x) - 10)" in str(info.value)
    ampguard.uninstall()
    assert vars(torch.Tensor)["backward"] is original


def test_a_teacher_under_no_grad_after_the_student_keeps_the_loss_code_recorded():
    ampguard.install()
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    x = torch.randn(4, 8)
    log_p = torch.log(student(x))  # NaN where negative: the origin
    with torch.no_grad():
        soft = teacher(x).softmax(-1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        torch.nn.functional.kl_div(log_p, soft, reduction="batchmean").backward()
        nonfinite.check()
    assert info.value.op == "torch.log"


def test_recorded_instruction_offsets_give_the_line_numbers_frames_give():
    """The normal path records (code, f_lasti) and messages compute the line: the same line f_lineno gives,
    for user frames mid-expression and for torch's own long functions."""
    from ampguard._frames import line_at

    seen = []

    def hook(module, args, output):
        frame = sys._getframe()
        while frame is not None:
            seen.append((frame.f_code, frame.f_lasti, frame.f_lineno))
            frame = frame.f_back

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    handle = model[0].register_forward_hook(hook)
    try:
        out = (
            model(
                torch.ones(1, 2)
            )
        )
    finally:
        handle.remove()
    assert out.shape == (1, 2)
    assert len(seen) > 5 and any("torch" in code.co_filename for code, _, _ in seen)
    assert [line_at(code, lasti) for code, lasti, _ in seen] == [lineno for _, _, lineno in seen]
    assert line_at(hook.__code__, -1) == hook.__code__.co_firstlineno


class Unrolled(torch.nn.Module):
    """A recurrent cell unrolled over time: the same module called once per time step of one batch."""

    def __init__(self, poison_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.cell = torch.nn.GRUCell(8, 16)
        self.head = torch.nn.Linear(16, 1)
        self.poison_at = poison_at

    def run(self, x):
        h = torch.zeros(x.shape[1], 16)
        for t in range(x.shape[0]):
            h = self.cell(x[t] if t != self.poison_at else torch.log(x[t] - x[t].abs() - 1), h)  # POISON LINE
        return self.head(h).pow(2).mean()


def test_a_cell_unrolled_over_time_adds_one_read_a_step_not_one_a_time_step(monkeypatch):
    monkeypatch.setattr(_sync, "HOST_READS", False)  # the path a device takes: each read is a sync
    x = torch.randn(20, 4, 8)

    def make():
        model = Unrolled()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return lambda: (model.run(x).backward(), opt.step())

    assert added_syncs(make) == 1  # the step's read; no read at the 19 repeated calls of the cell


def test_a_nan_at_an_early_time_step_is_named_at_the_step_with_the_calls_before_it():
    ampguard.install()
    model = Unrolled(poison_at=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model.run(torch.randn(20, 4, 8)).backward()
        opt.step()
    err = info.value
    assert err.sink == "loss" and err.op == "torch.log"
    assert err.origin[-1].line.strip().startswith("h = self.cell(")


def test_a_preference_step_with_a_frozen_reference_adds_one_read_and_no_pass_over_the_logits(monkeypatch):
    """DPO's shape: the policy and a frozen reference (no_grad), each called on the chosen and the rejected
    answers. The reference's second call is part of the step: reading there would sync mid-step and take a
    pass over the policy's logits, which the loss covers."""
    monkeypatch.setattr(_sync, "HOST_READS", False)  # the path a device takes: each read is a sync

    def logp(logits, ids):
        return torch.gather(logits.log_softmax(-1), 2, ids.unsqueeze(-1)).squeeze(-1).sum(-1)

    def step(policy, ref, opt, chosen, rejected):
        pc, pr = logp(policy(chosen), chosen), logp(policy(rejected), rejected)
        with torch.no_grad():
            rc, rr = logp(ref(chosen), chosen), logp(ref(rejected), rejected)
        loss = -torch.nn.functional.logsigmoid(0.1 * ((pc - rc) - (pr - rr))).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    chosen, rejected = torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12))
    norms = []
    monkeypatch.setattr(sinks, "_norms", lambda ts, real=sinks._norms: norms.append(len(ts)) or real(ts))

    def make():
        policy, ref = TokenLM(), TokenLM().eval().requires_grad_(False)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        return lambda: step(policy, ref, opt, chosen, rejected)

    assert added_syncs(make) == 1
    assert norms == [3]  # the step's one foreach norm, over the policy's three gradients: none over logits


# -- a DataLoader without workers: the dataset's transforms run in this process ---------------------------------
class ModuleTransform(torch.nn.Module):
    """A per-sample transform written as a module, as torchvision's v2 transforms are."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.full((3, 1, 1), 0.5))

    def forward(self, image):
        return image - self.mean


class ImageSet(torch.utils.data.Dataset):
    def __init__(self, bad=None):
        g = torch.Generator().manual_seed(0)
        self.images, self.labels = torch.rand(32, 3, 4, 4, generator=g), torch.randint(0, 5, (32,), generator=g)
        self.transform, self.bad = ModuleTransform(), bad

    def __len__(self):
        return 32

    def __getitem__(self, i):
        image = self.images[i]
        if i == self.bad:
            image = torch.full_like(image, float("nan"))  # a corrupt sample
        return self.transform(image), self.labels[i]


def _loader_loop(guarded, bad=None, probe=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with ampguard.guard() if guarded else contextlib.nullcontext():
        for x, y in torch.utils.data.DataLoader(ImageSet(bad), batch_size=8, num_workers=0):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if probe is not None:
                probe.append([type(e).__name__ for e in nonfinite.T.window])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, model


def test_a_datasets_module_transforms_in_the_main_process_are_not_outermost_calls():
    """Each sample's transform was an outermost call: a status pass and the call's bookkeeping per sample (loading
    several times slower), and the batch's calls filled the window the model's call needs."""
    plain, plain_model = _loader_loop(guarded=False)
    windows = []
    guarded, guarded_model = _loader_loop(guarded=True, probe=windows)
    assert guarded == plain
    assert torch.equal(plain_model[1].weight, guarded_model[1].weight)
    # the model's call and the loss code's cross_entropy: nothing of the loader's
    assert windows == [["Call", "TapeOp"]] * 4, windows


def test_a_corrupt_sample_transformed_in_the_main_process_is_named_as_the_models_input():
    with pytest.raises(ampguard.NonFiniteError) as info:
        _loader_loop(guarded=True, bad=13)
    message = str(info.value)
    assert info.value.sink == "loss" and info.value.op is None, message
    assert "It entered already non-finite (NaN): argument 0 of the call of 'Sequential'" in message, message
    assert "input: shape (8, 3, 4, 4), torch.float32; 48 NaN" in message, message


def test_an_inference_loop_holds_one_batch_and_still_names_a_nan_output():
    """Each batch of a no_grad loop ends the one before (finite outputs are read as they are made, so no read is
    left to make), and a NaN output, known as it is made, is raised by that call and named by its replay."""
    ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(4, 8))
            assert [type(e) for e in sinks.T.window] == [sinks.Call] and sinks.T.pending == []
        model[2].bias[1] = float("nan")
        with pytest.raises(ampguard.NonFiniteError) as caught:
            model(torch.randn(4, 8))
        assert sinks.T.pending == [] and sinks.T.window == []  # nothing left for the next call to read
    message = str(caught.value)
    assert "parameter '2.bias'" in message and "inside torch.linear in module '2'" in message
