"""Properties.

- Whatever overflows, every scheduler has stepped exactly once per applied step (or epoch), and the loss scale
  ampguard reports is the scaler's.
- The sinks' shortcuts on the CPU (a few values read as Python floats, small gradients summed a buffer at a time,
  sums instead of norms, a clip's total norm) raise exactly where a value is non-finite, whatever the dtypes, sizes
  and counts, and never for large finite values.
- A failure names the op, module and line that made the NaN, whatever the model and the loop around it.
- A run in which nothing goes wrong is bit-identical with and without ampguard.
"""

import contextlib
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loops import Overflow, backward_and_step, data, line_of, model, reference_loop, scaled_loop
from torch.optim import lr_scheduler as S

import ampguard

BATCHES_PER_EPOCH = 3

SCHEDULERS = {
    "LambdaLR": lambda opt, n: S.LambdaLR(opt, lambda s: 1.0 / (s + 1)),
    "StepLR per epoch": lambda opt, n: S.StepLR(opt, step_size=1, gamma=0.5),
    "OneCycleLR": lambda opt, n: S.OneCycleLR(opt, max_lr=0.1, total_steps=n + 1),
    "SequentialLR": lambda opt, n: S.SequentialLR(
        opt, [S.LinearLR(opt, 0.1, total_iters=3), S.ExponentialLR(opt, 0.9)], milestones=[3]),
    "CosineAnnealingWarmRestarts": lambda opt, n: S.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2),
}
OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    "SGD fused momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
}


@st.composite
def runs(draw):
    iterations = draw(st.integers(min_value=BATCHES_PER_EPOCH, max_value=4 * BATCHES_PER_EPOCH))
    n_optimizers = draw(st.integers(min_value=1, max_value=2))
    overflow = [draw(st.sets(st.integers(0, iterations - 1))) for _ in range(n_optimizers)]
    return {
        "iterations": iterations,
        "overflow": overflow,
        "scheduler": draw(st.sampled_from(sorted(SCHEDULERS))),
        "optimizers": [draw(st.sampled_from(sorted(OPTIMIZERS))) for _ in range(n_optimizers)],
    }


def expected_last_epoch(run, j):
    """What a loop that only steps the scheduler after applied steps would have counted."""
    applied = [i not in run["overflow"][j] for i in range(run["iterations"])]
    if run["scheduler"] == "StepLR per epoch":
        epochs = [applied[k:k + BATCHES_PER_EPOCH] for k in range(0, len(applied), BATCHES_PER_EPOCH)]
        return sum(any(epoch) for epoch in epochs if len(epoch) == BATCHES_PER_EPOCH)
    return sum(applied)


def train(run, **options):
    """Train ``run`` under a guard; return the schedulers, the guard and PyTorch's scheduler warnings."""
    per_epoch = run["scheduler"] == "StepLR per epoch"
    with ampguard.guard(**options) as g, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models = [model(seed=j) for j in range(len(run["optimizers"]))]
        opts = [OPTIMIZERS[kind](m.parameters()) for kind, m in zip(run["optimizers"], models, strict=True)]
        scheds = [SCHEDULERS[run["scheduler"]](opt, run["iterations"]) for opt in opts]
        scaler = torch.amp.GradScaler("cpu")
        hooks = [Overflow(m[0].weight, pattern) for m, pattern in zip(models, run["overflow"], strict=True)]
        for i in range(run["iterations"]):
            for hook in hooks:
                hook.i = i
            x, y = data(i)
            loss = sum(torch.nn.functional.mse_loss(m(x), y) for m in models)
            scaler.scale(loss).backward()
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            if not per_epoch or (i + 1) % BATCHES_PER_EPOCH == 0:
                for sched in scheds:
                    sched.step()
            for opt in opts:
                opt.zero_grad()
    warned = [str(w.message) for w in caught if "lr_scheduler" in str(w.message) or "Tried to step" in str(w.message)]
    return scheds, g, warned, models


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(runs())
def test_schedulers_follow_applied_steps_for_any_overflow_pattern(run):
    """Each scheduler counts its optimizer's applied steps, and (for per-step schedulers) each model ends as it would
    had its skipped iterations never happened: a skipped step changes neither the schedule nor the optimizer's state
    (a fused SGD's first step included)."""
    scheds, g, warned, models = train(run)
    for j, sched in enumerate(scheds):
        assert sched.last_epoch == expected_last_epoch(run, j), (j, run)
        for inner in getattr(sched, "_schedulers", []):
            assert inner.last_epoch <= sched.last_epoch
        if run["scheduler"] != "StepLR per epoch":
            # model j trained alone on the iterations its optimizer applied
            _, reference, _ = reference_loop(lambda opt: SCHEDULERS[run["scheduler"]](opt, run["iterations"]),
                                             run["iterations"], run["overflow"][j],
                                             make_opt=OPTIMIZERS[run["optimizers"][j]], seed=j)
            for p, q in zip(models[j].parameters(), reference.parameters(), strict=True):
                assert torch.equal(p, q), (j, run)
    assert warned == []
    skips = sum(len(p) for p in run["overflow"])
    assert g.stats.optimizer_steps_skipped == skips
    assert g.stats.optimizer_steps_applied == len(scheds) * run["iterations"] - skips


def test_the_property_fails_without_holding():
    run = {"iterations": 6, "overflow": [{0, 4}], "scheduler": "LambdaLR", "optimizers": ["SGD"]}
    scheds, _, warned, _ = train(run, schedulers=False)
    assert scheds[0].last_epoch == 6 != expected_last_epoch(run, 0) == 4
    assert any("before `optimizer.step()`" in w for w in warned)


@st.composite
def scale_runs(draw):
    iterations = draw(st.integers(min_value=2, max_value=14))
    return {
        "iterations": iterations,
        "growth_interval": draw(st.integers(min_value=1, max_value=3)),
        "optimizers": draw(st.lists(st.sampled_from(sorted(OPTIMIZERS)), min_size=1, max_size=2)),
        "overflow": draw(st.sets(st.integers(0, iterations - 1))),
        # per iteration: a plain update(), update(new_scale=float), update(new_scale=tensor), or a
        # load_state_dict() of an earlier state before the iteration
        "events": draw(st.lists(st.sampled_from(["", "", "", "float", "tensor", "load"]),
                                min_size=iterations, max_size=iterations)),
        "nonfinite": draw(st.sampled_from(["off", "raise"])),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(scale_runs())
def test_the_loss_scale_ampguard_reports_is_the_scalers_whatever_happens(run):
    """ampguard knows the scale after update() without reading it while nothing else changed it:
    growth, backoff, new_scale and load_state_dict() must all keep it exactly the scaler's."""
    with ampguard.guard(nonfinite=run["nonfinite"]) as g, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ampguard: GradScaler skipped the first step", ampguard.AmpGuardWarning)
        models = [model(seed=j) for j in range(len(run["optimizers"]))]
        opts = [OPTIMIZERS[kind](m.parameters()) for kind, m in zip(run["optimizers"], models, strict=True)]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=run["growth_interval"])
        hook = Overflow(models[0][0].weight, run["overflow"])
        saved = scaler.state_dict()
        skips = 0
        for i in range(run["iterations"]):
            hook.i = i
            if run["events"][i] == "load":
                scaler.load_state_dict(saved)
            x, y = data(i)
            loss = sum(torch.nn.functional.mse_loss(m(x), y) for m in models)
            scaler.scale(loss).backward()
            for opt in opts:
                scaler.step(opt)
            skips += i in run["overflow"]  # the overflow is in the first model's gradients only
            event = run["events"][i]
            if event == "float":
                scaler.update(new_scale=float(2 ** (i % 5 + 3)))
            elif event == "tensor":
                scaler.update(new_scale=torch.tensor(float(2 ** (i % 4 + 2))))
            else:
                scaler.update()
            assert g.stats.loss_scale == scaler.get_scale(), (i, run)
            if i == 1:
                saved = scaler.state_dict()
            for opt in opts:
                opt.zero_grad()
        assert g.stats.optimizer_steps_skipped == skips


def test_a_clean_non_fused_step_reads_nothing_of_the_scalers():
    """The scaler's decision for a non-fused optimizer is whether its step() ran: no read of found_inf,
    scale or tracker (ampguard's only sync on such a loop is the non-finite check's, when it is on)."""
    from ampguard import _sync

    reads = []
    original = _sync.read

    def spy(own, device=None, gathered=None):
        reads.append(len(own))
        return original(own, device, gathered)

    with ampguard.guard(nonfinite="off") as g:
        _sync.read = spy
        try:
            _, _, sched, _ = scaled_loop(lambda opt: S.LambdaLR(opt, lambda s: 1.0), 6, {3},
                                         scaler=torch.amp.GradScaler("cpu", growth_interval=2))
        finally:
            _sync.read = original
    assert reads[0] > 0  # the first update reads the scale once
    assert reads[1:] == [0] * 5, reads
    assert g.stats.optimizer_steps_skipped == 1 and sched.last_epoch == 5


# -- the sinks tell the truth ------------------------------------------------------------------------
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# around each threshold of the shortcuts: a scalar, a few values (FEW_ELEMENTS=64, up to 2-D), a 3-D few, a buffered
# small one (SMALL=4096) and one summed alone
SHAPES = [(), (1,), (8,), (64,), (65,), (8, 8), (9, 8), (300,), (2, 3, 5), (5000,)]
POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


def filled(dtype, shape, values, seed):
    """A tensor of ``values``: 'normal' ones, or 'largest' (each 0.9 of the dtype's largest finite value, of either
    sign: its sums overflow, its elements do not)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, dtype=torch.float64, generator=generator)
    if values == "largest":
        x = torch.where(x < 0, -1.0, 1.0).double() * (torch.finfo(dtype).max * 0.9)  # (where() makes float32)
    return x.to(dtype)


def poisoned(x, at, kind):
    """``x`` with element ``at`` (modulo its size) made ``kind``; 'inf and -inf': the next one -Inf too, whose sum
    with +Inf is NaN."""
    flat = x.view(-1)
    i = at % flat.numel()
    flat[i] = POISONS["inf" if kind == "inf and -inf" else kind]
    if kind == "inf and -inf" and flat.numel() > 1:
        flat[(i + 1) % flat.numel()] = -float("inf")
    return x


@st.composite
def gradient_sets(draw):
    n = draw(st.sampled_from([1, 2, 3, 15, 16, 17, 40]))  # (FEW=16 small gradients make a buffer)
    dtype = draw(st.sampled_from(DTYPES))
    mixed = draw(st.booleans())
    return {
        "tensors": [(draw(st.sampled_from(DTYPES)) if mixed else dtype, draw(st.sampled_from(SHAPES)))
                    for _ in range(n)],
        "values": draw(st.sampled_from(["normal", "largest"])),
        "poison": draw(st.none() | st.tuples(st.integers(0, n - 1), st.integers(0, 10**6),
                                              st.sampled_from([*POISONS, "inf and -inf"]))),
        "clip": draw(st.booleans()),
    }


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gradient_sets())
def test_the_gradient_sink_raises_exactly_where_a_gradient_is_non_finite(run):
    """Gradients as a backward() makes them (a hook hands each parameter its values), read at a plain optimizer step
    on the CPU, after clip_grad_norm_ where the loop clips (its total norm is the sink then)."""
    params = []
    for i, (dtype, shape) in enumerate(run["tensors"]):
        grad = filled(dtype, shape, run["values"], i)
        if run["poison"] is not None and run["poison"][0] == i:
            grad = poisoned(grad, *run["poison"][1:])
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.register_hook(lambda _, grad=grad: grad.clone())
        params.append(p)
    opt = torch.optim.SGD(params, lr=0.0)
    error, total = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with ampguard.guard() as g:
                sum((p.float() * 0).sum() for p in params).backward()  # a finite loss: the gradients are the sink
                if run["clip"]:
                    total = torch.nn.utils.clip_grad_norm_(params, max_norm=1e30)
                opt.step()
        except ampguard.NonFiniteError as exc:
            error = exc
    said = [w for w in caught if "clip_grad_norm_ returned an Inf total norm" in str(w.message)]
    if run["poison"] is None:
        assert error is None, (run, str(error))
        assert g.stats.optimizer_steps_applied == 1
        # large finite gradients whose norm overflowed: the clip zeroed them, and that alone is said
        assert len(said) == (1 if total is not None and bool(total.isinf()) else 0), (run, total, said)
        return
    assert said == [], run
    assert error is not None, run
    index, _, kind = run["poison"]
    if run["clip"]:
        # (torch's clip multiplies every gradient by max_norm / total: by 0 for an infinite total, by NaN for a NaN
        # one, and the error describes the gradients the step would have taken)
        assert error.kind == "nan" and error.sink.startswith("gradient of parameter '#"), (run, str(error))
    else:
        assert error.kind == ("inf" if kind == "inf and -inf" else kind), (run, str(error))
        assert error.sink == f"gradient of parameter '#{index}'", (run, str(error))
    assert g.stats.optimizer_steps_applied == 0


class _Echo(torch.nn.Module):
    """A model whose output is given: a tensor, or a list of a finite one and it (an encoder's several outputs)."""

    def __init__(self, value, several):
        super().__init__()
        self.value, self.several = value, several

    def forward(self, x):
        out = self.value + x * 0
        return [torch.zeros(3, dtype=out.dtype) + x * 0, out] if self.several else out


@st.composite
def inference_outputs(draw):
    return {
        "dtype": draw(st.sampled_from(DTYPES)),
        "shape": draw(st.sampled_from(SHAPES)),
        "values": draw(st.sampled_from(["normal", "largest"])),
        "poison": draw(st.none() | st.tuples(st.integers(0, 10**6), st.sampled_from([*POISONS, "inf and -inf"]))),
        "several": draw(st.booleans()),
    }


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inference_outputs())
def test_an_inference_output_raises_exactly_where_it_holds_a_nan(run):
    """An output under no_grad is read when made (a few values as floats, else a sum): NaN raises; +-Inf does not
    (log-probabilities, a mask's -inf), nor do +Inf and -Inf together, whose sum is NaN, nor large finite values."""
    value = filled(run["dtype"], run["shape"], run["values"], 0)
    if run["poison"] is not None:
        value = poisoned(value, *run["poison"])
    model = _Echo(value, run["several"])
    x = torch.zeros((), dtype=run["dtype"])
    error = None
    try:
        with ampguard.guard(), torch.no_grad():
            model(x)
            model(x)  # (the next call of the module reads the previous one's check at the latest)
    except ampguard.NonFiniteError as exc:
        error = exc
    if run["poison"] is None or run["poison"][1] != "nan":
        assert error is None, (run, str(error))
        return
    assert error is not None and error.kind == "nan", run
    assert error.sink == "output of module '_Echo'" + (" (output 1)" if run["several"] else ""), (run, error.sink)


@st.composite
def loss_values(draw):
    return {
        "dtype": draw(st.sampled_from(DTYPES)),
        "value": draw(st.sampled_from(["normal", "largest", *POISONS])),
        "how": draw(st.sampled_from(["backward()", "backward(gradient)", "GradScaler"])),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loss_values())
def test_the_loss_sink_raises_exactly_where_the_loss_is_non_finite(run):
    """A scalar loss read at once on the CPU, a loss of several elements backward() gets a gradient for (read at the
    step while held), and a loss that a GradScaler scales: each of a value, large finite ones included."""
    dtype = run["dtype"]
    value = POISONS.get(run["value"]) or (torch.finfo(dtype).max * 0.9 if run["value"] == "largest" else 1.5)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.0)
    error = None
    try:
        with ampguard.guard():
            if run["how"] == "backward(gradient)":
                loss = (p * 0).to(dtype) + torch.tensor(value, dtype=dtype)
                loss.backward(torch.ones_like(loss))
                opt.step()
            else:
                loss = (p * 0).sum().to(dtype) + torch.tensor(value, dtype=dtype)
                # (under a GradScaler, a large fp16 loss's scaled gradients overflow: it skips the step)
                backward_and_step(loss, opt, torch.amp.GradScaler("cpu") if run["how"] == "GradScaler" else None)
    except ampguard.NonFiniteError as exc:
        error = exc
    if run["value"] not in POISONS:
        assert error is None, (run, str(error))
        return
    assert error is not None and error.kind == run["value"] and error.sink == "loss", (run, str(error))


# -- the replay names the op that made the value -----------------------------------------------------
class _Poison(torch.nn.Module):
    """Makes NaN from finite values with one torch op: the origin each failure must name."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        if self.op == "sqrt":
            return torch.sqrt(-1 - x * x) + x  # the origin's line: POISON_LINES["sqrt"]
        if self.op == "log":
            return torch.log(-1 - x * x) + x
        return torch.div(x - x, x - x) + x


# op -> the line of _Poison.forward that makes its NaN
POISON_LINES = {op: line_of(_Poison.forward, f"torch.{op}(") for op in ("sqrt", "log", "div")}


class _Residual(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return x + self.norm(torch.nn.functional.gelu(self.lin(x)))


class _Attention(torch.nn.Module):
    """Self-attention over a padded batch: the last two keys of every sequence are masked (-inf scores)."""

    def __init__(self, d):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x):
        mask = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
        mask[:, -2:] = True
        return x + self.attn(x, x, x, key_padding_mask=mask, need_weights=False)[0]


class _Conv(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = torch.nn.Conv1d(d, d, 3, padding=1)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


BLOCKS = {"linear": lambda d: torch.nn.Linear(d, d), "residual": _Residual, "attention": _Attention, "conv": _Conv,
          "dropout": lambda d: torch.nn.Dropout(0.1), "relu": lambda d: torch.nn.ReLU()}


class _Net(torch.nn.Module):
    def __init__(self, d, body, checkpointed):
        super().__init__()
        self.inp, self.body, self.out = torch.nn.Linear(d, d), body, torch.nn.Linear(d, 1)
        self.checkpointed = checkpointed

    def forward(self, x):
        x = self.inp(x)
        if self.checkpointed:  # (activation checkpointing: the body runs again in backward)
            return self.out(torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False))
        return self.out(self.body(x))


HOWS = ["train", "bf16 autocast", "GradScaler", "no_grad", "checkpoint", "loss module", "teacher", "accumulate",
        "trace='eager'"]


@st.composite
def poisoned_models(draw):
    blocks = draw(st.lists(st.sampled_from(sorted(BLOCKS)), min_size=0, max_size=4))
    return {
        "blocks": blocks,
        "at": draw(st.integers(0, len(blocks))),
        "nested": draw(st.booleans()),  # the poison inside a Sequential of its own, after a Linear
        "op": draw(st.sampled_from(sorted(POISON_LINES))),
        "how": draw(st.sampled_from(HOWS)),
    }


def _train_step(model, opt, x, y, how):
    """One step as the loops of ``how`` write it."""
    mse = torch.nn.functional.mse_loss
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "bf16 autocast"):
        if how == "loss module":
            loss = torch.nn.MSELoss()(model(x).float(), y)  # (a loss that is a module: an outermost call itself)
        elif how == "teacher":
            with torch.no_grad():
                soft = torch.nn.Linear(x.shape[-1], 1)(x)  # a distillation teacher's call inside the loss code
            loss = mse(model(x), y) + mse(model(x), soft)
        elif how == "accumulate":  # two micro-batches, one step: the NaN is in both
            mse(model(x[:2]), y[:2]).backward()
            loss = mse(model(x[2:]), y[2:])
        else:
            loss = mse(model(x).float(), y)
    backward_and_step(loss, opt, torch.amp.GradScaler("cpu") if how == "GradScaler" else None)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(poisoned_models())
def test_the_failure_names_the_op_module_and_line_that_made_the_nan_in_any_model(run):
    """Whatever the blocks around it (attention with padding masks, dropout, convolutions, residual norms), the loop
    (autocast, a GradScaler, inference, checkpointing, a loss module, a teacher, gradient accumulation, the eager
    trace) and so the sink, the error names the op that made the NaN, the module it ran in by its path in the model,
    and its line."""
    torch.manual_seed(0)
    d = 16
    layers = [BLOCKS[kind](d) for kind in run["blocks"]]
    poison = _Poison(run["op"])
    layers.insert(run["at"], torch.nn.Sequential(torch.nn.Linear(d, d), poison) if run["nested"] else poison)
    model = _Net(d, torch.nn.Sequential(*layers), checkpointed=run["how"] == "checkpoint")
    expected = f"body.{run['at']}" + (".1" if run["nested"] else "")
    assert dict(model.named_modules())[expected] is poison
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 6, d), torch.randn(4, 6, 1)
    error = None
    try:
        with ampguard.guard(trace="eager" if run["how"] == "trace='eager'" else "replay"):
            if run["how"] == "no_grad":
                with torch.no_grad():
                    model.eval()
                    model(x)
                    model(x)  # (the next call reads the first one's output at the latest)
            else:
                _train_step(model, opt, x, y, run["how"])
    except ampguard.NonFiniteError as exc:
        error = exc
    assert error is not None, run
    assert error.kind == "nan", (run, str(error))
    assert error.op == f"torch.{run['op']}" and error.module == expected, (run, str(error))
    assert (error.origin[-1].name, error.origin[-1].lineno) == ("forward", POISON_LINES[run["op"]]), (run, str(error))
    if run["how"] == "no_grad":
        assert error.sink == "output of module '_Net'", (run, str(error))


# -- a run in which nothing goes wrong is unchanged ------------------------------------------------------
@st.composite
def clean_runs(draw):
    return {
        "seed": draw(st.integers(0, 999)),
        "blocks": draw(st.lists(st.sampled_from(sorted(BLOCKS)), min_size=0, max_size=3)),
        "batch_norm": draw(st.booleans()),
        "checkpoint": draw(st.booleans()),
        "optimizer": draw(st.sampled_from(["SGD", "AdamW"])),
        "scaler": draw(st.booleans()),
        "autocast": draw(st.booleans()),
        "accumulate": draw(st.sampled_from([1, 2])),
        "clip": draw(st.booleans()),
        "evaluate": draw(st.booleans()),  # a no_grad evaluation call every third step
        "options": draw(st.sampled_from([{}, {"nonfinite": "skip"}, {"trace": "eager"}, {"trace": "off"},
                                         {"nonfinite": "off"}])),
    }


def _clean_run(run, guarded):
    """Seven steps of ``run``: the parameters, buffers, learning rates and losses after them, and the next random
    number (ampguard must not draw from the RNG either)."""
    torch.manual_seed(run["seed"])
    d = 16
    blocks = [BLOCKS[kind](d) for kind in run["blocks"]] + ([torch.nn.BatchNorm1d(6)] if run["batch_norm"] else [])
    model = _Net(d, torch.nn.Sequential(*blocks), checkpointed=run["checkpoint"])
    opt = getattr(torch.optim, run["optimizer"])(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if run["scaler"] else None
    lrs, losses = [], []
    with ampguard.guard(**run["options"]) if guarded else contextlib.nullcontext(), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ampguard.AmpGuardWarning)
        for i in range(7):
            x, y = torch.randn(4, 6, d), torch.randn(4, 6, 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run["autocast"]):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y) / run["accumulate"]
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if (i + 1) % run["accumulate"] == 0:
                if run["clip"]:
                    if scaler is not None:
                        scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
            lrs.append(opt.param_groups[0]["lr"])
            if run["evaluate"] and i % 3 == 0:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
    lints = [str(w.message).split(" scales ")[0] for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]
    return [*model.parameters(), *model.buffers(), torch.rand(1)], lrs, losses, lints


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clean_runs())
def test_a_run_in_which_nothing_goes_wrong_is_bit_identical_under_ampguard(run):
    """Dropout's draws, batch norm's statistics, checkpointing's re-run, autocast, a GradScaler, clipping, gradient
    accumulation and evaluation calls between steps: every parameter, buffer, learning rate and loss is the same bit
    for bit with and without ampguard, under each option that changes what it does, and so is the next random
    number. ampguard warns of nothing but the one lint that applies."""
    plain_tensors, plain_lrs, plain_losses, _ = _clean_run(run, guarded=False)
    tensors, lrs, losses, lints = _clean_run(run, guarded=True)
    assert lrs == plain_lrs and losses == plain_losses, run
    assert all(torch.equal(a, b) for a, b in zip(tensors, plain_tensors, strict=True)), run
    # (the one word ampguard says: a GradScaler on a bf16 autocast loss needs no scaling, once)
    assert lints == (["ampguard: a GradScaler('cpu')"] if run["scaler"] and run["autocast"] else []), (run, lints)
