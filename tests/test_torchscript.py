"""TorchScript: a script runs its ops below every Python frame, so a NaN made there is named by the script's source."""

import contextlib

import pytest
import torch
from loops import AroundAnOp, line_of

import ampguard


class Net(AroundAnOp):
    def forward(self, x):
        h = self.a(x)
        h = torch.sqrt(h - 100.0)  # SQRT LINE
        return self.b(h)


def bias_log(bias, y):
    x = bias + y
    return x * torch.log(x)  # SCRIPTED LOG LINE


def focal(logits, target):
    p = torch.sigmoid(logits)
    return -(target * torch.log(p - 0.9)).mean()  # FOCAL LOG LINE


def two_logs(x):
    a = torch.log(x - 1)  # FIRST LOG LINE
    return a + torch.log(x - 2)  # SECOND LOG LINE


def noisy_log(x):
    noise = torch.rand_like(x) * 0.0
    return torch.log(x - 2 + noise)  # NOISY LOG LINE


def root_of_zero(x):
    return torch.sqrt(x * 0.0)  # ROOT LINE (finite forward; its backward is inf * 0)


scripted_bias_log, scripted_focal, scripted_two_logs, scripted_noisy_log, scripted_root_of_zero = map(
    torch.jit.script, (bias_log, focal, two_logs, noisy_log, root_of_zero))


class CallsScript(AroundAnOp):
    """A Python model whose forward calls a script function (a fused activation, as Megatron's and older timm's are)."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        h = self.a(x) - 10
        h = scripted_bias_log(self.bias, h)  # CALL LINE
        return self.b(h)


class Applies(torch.nn.Module):
    """A Python model that applies a script (or traced) function to its input, then a Linear."""

    def __init__(self, script):
        super().__init__()
        torch.manual_seed(0)
        self.script = script
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.script(x))


def focal_loss_code(out):
    return scripted_focal(out, torch.ones(2, 1)) + out.mean() * 0.1  # LOSS LINE


def _raised(model, trace, loss_code=lambda out: out.mean(), x=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        with ampguard.guard(trace=trace):
            loss = loss_code(model(torch.rand(2, 4) if x is None else x))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return info.value, str(info.value)


def _at(func, marker):
    return f"{__file__}:{line_of(func, marker)}"


@pytest.mark.parametrize("trace", ["replay", "eager"])
def test_a_nan_inside_a_scripted_model_is_named_at_its_line_in_the_script(trace):
    err, message = _raised(torch.jit.script(Net()), trace)
    assert err.op == "aten.sqrt" and err.module == "Net"  # (torch names the scripted class RecursiveScriptModule)
    assert "created by aten.sqrt inside TorchScript module 'Net'" in message
    assert f"which runs no Python frame. In its source, the op is at\n    {_at(Net.forward, 'SQRT LINE')}\n" \
        "      h = torch.sqrt(h - 100.0)" in message
    assert "RecursiveScriptModule" not in message


def test_a_nan_in_the_output_of_a_scripted_model_under_no_grad_names_the_model_and_the_line():
    model = torch.jit.script(Net()).eval()
    with pytest.raises(ampguard.NonFiniteError) as info, ampguard.guard(), torch.no_grad():
        model(torch.rand(2, 4))
    message = str(info.value)
    assert "NaN reached the output of module 'Net'" in message
    assert f"In its source, the op is at\n    {_at(Net.forward, 'SQRT LINE')}" in message


def test_a_nan_inside_a_script_function_that_a_model_calls_is_named_at_its_line_in_the_script():
    err, message = _raised(CallsScript(), "replay")
    assert err.op == "aten.log" and err.module == "CallsScript"
    assert "created by aten.log inside TorchScript function 'bias_log' (inputs finite, output NaN) in module " \
        f"'CallsScript' at\n    {_at(CallsScript.forward, 'CALL LINE')} in forward" in message
    assert "That line runs TorchScript function 'bias_log', which runs no Python frame. In its source, the op is " \
        f"at\n    {_at(bias_log, 'SCRIPTED LOG LINE')}\n      return x * torch.log(x)" in message


def test_trace_eager_names_the_op_inside_a_script_function_that_made_a_nan_where_the_model_calls_it():
    err, message = _raised(CallsScript(), "eager")
    assert err.op == "aten.log" and err.module == "CallsScript"
    assert "aten.log inside TorchScript function 'bias_log' created NaN from inputs without NaN in module " \
        f"'CallsScript' at\n    {_at(CallsScript.forward, 'CALL LINE')}" in message
    assert f"In its source, the op is at\n    {_at(bias_log, 'SCRIPTED LOG LINE')}" in message
    assert "Found by replaying" not in message  # (found as it ran; the script alone was run again)


@pytest.mark.parametrize("trace", ["replay", "eager"])
def test_a_script_function_in_the_loss_code_is_recorded_and_its_nan_named(trace):
    """Before, the record saw nothing of the call: its output came from nowhere it knew, and the message said that an
    input of the loss code was freed before the check, though the loop held everything. trace='eager' checks the
    call's output as it is made, and runs the script again to name the op inside."""
    err, message = _raised(torch.nn.Linear(4, 1), trace, focal_loss_code)
    assert err.op == "aten.log"
    made = {"replay": "created by aten.log inside TorchScript function 'focal' (inputs finite, output NaN) at",
            "eager": "aten.log inside TorchScript function 'focal' created NaN from inputs without NaN at"}[trace]
    assert f"{made}\n    {_at(focal_loss_code, 'LOSS LINE')}" in message
    assert f"In its source, the op is at\n    {_at(focal, 'FOCAL LOG LINE')}" in message
    if trace == "replay":
        assert "freed before the check" not in message
        assert "path to the sink: aten.log inside TorchScript function 'focal' -> " in message


def test_trace_eager_runs_a_script_function_again_with_the_run_s_random_state_left_as_it_was():
    model = Applies(scripted_noisy_log)
    x = torch.ones(2, 4)
    torch.manual_seed(1)
    torch.rand_like(x)  # (what the forward draws)
    expected = torch.get_rng_state()
    torch.manual_seed(1)
    err, message = _raised(model, "eager", x=x)
    assert err.op == "aten.log" and f"In its source, the op is at\n    {_at(noisy_log, 'NOISY LOG LINE')}" in message
    assert torch.equal(torch.get_rng_state(), expected)


def test_an_op_the_script_has_at_several_places_lists_each_of_them():
    err, message = _raised(Applies(scripted_two_logs), "replay", x=torch.full((2, 4), 1.5))  # (the second log's NaN)
    assert err.op == "aten.log"
    assert "Its source has aten::log at 2 places:\n" \
        f"    {_at(two_logs, 'FIRST LOG LINE')}\n      a = torch.log(x - 1)  # FIRST LOG LINE\n" \
        f"    {_at(two_logs, 'SECOND LOG LINE')}\n" in message


def test_a_nan_made_only_in_the_backward_of_a_script_names_the_script_and_its_unbounded_ops():
    class Residual(AroundAnOp):
        def forward(self, x):
            h = self.a(x)
            return self.b(scripted_root_of_zero(h) + h)  # RESIDUAL LINE

    err, message = _raised(Residual(), "replay")
    assert err.op == "TorchScript function 'root_of_zero'" and err.module == "Residual"
    assert "The backward of TorchScript function 'root_of_zero' (torch's DifferentiableGraphBackward, the backward " \
        "of several of the script's ops at once) turned finite gradients into NaN. The script was called in module " \
        f"'Residual' at\n    {_at(Residual.forward, 'RESIDUAL LINE')}" in message
    assert "Its ops whose gradient is unbounded near some input (sqrt or pow at 0, log near 0, division by a small " \
        f"value):\n    aten::sqrt at {_at(root_of_zero, 'ROOT LINE')}" in message


def test_a_traced_function_is_named_at_the_line_it_traced():
    def act(x):
        return torch.log(x - 1.5)  # TRACED LINE

    traced = torch.jit.trace(act, torch.rand(2, 4) + 2)
    err, message = _raised(Applies(traced), "replay", x=torch.ones(2, 4))
    assert err.op == "aten.log"
    assert "inside TorchScript function 'act'" in message
    assert f"In its source, the op is at\n    {__file__}:{line_of(act, 'TRACED LINE')} in act" in message


@pytest.mark.parametrize("trace", ["replay", "eager"])
def test_a_healthy_loop_with_scripts_in_the_model_and_the_loss_code_trains_as_without_ampguard(trace):
    def train(guarded):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU())),
                                    Applies(scripted_two_logs), torch.nn.Linear(1, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        losses = []
        with ampguard.guard(trace=trace) if guarded else contextlib.nullcontext():
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    features = model[0](torch.rand(3, 4))[:, :4].float() + 3  # (GELU > -0.2: every log finite)
                    out = model[2](model[1](features))
                loss = scripted_bias_log(torch.ones(1), out.float().abs() + 1).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    plain, guarded = train(False), train(True)
    assert plain[0] == guarded[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], guarded[1], strict=True))


def test_the_script_function_call_is_restored_exactly():
    original = vars(torch.jit.ScriptFunction)["__call__"]
    ampguard.install()
    ampguard.install()
    assert vars(torch.jit.ScriptFunction)["__call__"].__wrapped__ is original  # once, not twice
    assert isinstance(scripted_bias_log, torch.jit.ScriptFunction)
    ampguard.uninstall()
    assert vars(torch.jit.ScriptFunction)["__call__"] is original


class FocalLoss(torch.nn.Module):
    def forward(self, logits, target):
        return self.compute(logits, target)

    @torch.jit.export
    def compute(self, logits, target):
        return focal(logits, target)


def test_a_script_module_s_method_in_the_loss_code_is_said_to_be_unseen_not_freed_by_the_user():
    """A script module's method (not its call) runs below the record too, and is not wrapped: its output came from
    nowhere the record knew. The message said the user had freed an input and should keep the batch referenced."""
    criterion = torch.jit.script(FocalLoss())
    model = torch.nn.Linear(4, 1)

    def loss_code(out):
        return criterion.compute(out, torch.ones(2, 1)) * 2  # METHOD LINE

    err, message = _raised(model, "replay", loss_code)
    assert err.op is None
    assert f"an input of the loss code (given to Tensor.mul at {_at(loss_code, 'METHOD LINE')}) was made, from " \
        "tensors with grad, by code that ampguard's record did not see, and freed before the check (code below the " \
        "record: a TorchScript module's method" in message, message
    assert "keep the batch referenced" not in message


def test_a_reproducer_is_not_written_for_a_script_function_and_the_message_says_why(tmp_path):
    """A bundle names its op by its path in torch, which a script function's call has not: written, the bundle failed
    to load with a traceback."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info, ampguard.guard(repro_dir=str(tmp_path)):
        focal_loss_code(model(torch.rand(2, 4))).backward()
        opt.step()
    assert "no reproducer written: the op TorchScript function 'focal' is not one of torch's" in str(info.value)
    assert list(tmp_path.iterdir()) == []
