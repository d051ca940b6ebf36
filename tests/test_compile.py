"""torch.compile under ampguard: no graph breaks of ampguard's making, and every feature keeps working."""

import inspect
import warnings

import pytest
import torch
from loops import Overflow, data

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


def test_compiled_model_gives_the_same_losses_as_without_ampguard():
    model = mlp()
    reference = train(torch.compile(model, backend="eager"), model.parameters())
    torch._dynamo.reset()
    ampguard.install()
    model = mlp()
    filters = len(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        guarded = train(torch.compile(model, backend="eager"), model.parameters())
    assert guarded == reference
    # ampguard's global hooks are why torch would warn at every compiled call; ampguard handles that call
    assert not [w for w in caught if "global hooks" in str(w.message)]
    ampguard.uninstall()
    assert len(warnings.filters) == filters - 1  # the one filter ampguard added is gone again


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


def test_nan_inside_a_compiled_submodule_of_an_eager_model():
    ampguard.install()

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.compile(Bad(), backend="eager")

        def forward(self, x):
            return self.inner(x) * 2

    model = Outer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert info.value.op == "torch.sqrt" and info.value.module == "inner"
    assert info.value.chain[-2:] == ["Tensor.mul", "Tensor.sum"]


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
