"""NaN/Inf sinks and origin tracing on real models on CPU (fp16/bf16 through autocast)."""

import contextlib
import math
import textwrap
import threading
import warnings
import weakref

import pytest
import torch
from loops import Overflow, TokenLM, line_of

import ampguard
from ampguard import nonfinite


def hand_written_bce(p, y):
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # LOG LINE


class Saturating(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x):
        return torch.sigmoid(self.fc(x) * 100)


def test_fp16_log_of_a_saturated_sigmoid_names_the_log_line_and_the_nan_transition():
    ampguard.install()
    m = Saturating()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), (torch.arange(16) % 2).float().unsqueeze(1)
    with torch.autocast("cpu", dtype=torch.float16):
        p = m(x).half()
        loss = hand_written_bce(p, y)
    loss.backward()
    before = [q.detach().clone() for q in m.parameters()]
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    err = info.value
    assert err.kind == "nan" and err.sink == "loss" and err.op == "torch.log"
    assert err.origin[-1].filename == __file__
    assert err.origin[-1].lineno == line_of(hand_written_bce, "LOG LINE")
    assert "It became NaN, -Inf in Tensor.mul" in str(err)
    assert err.chain[0] == "torch.log" and "Tensor.mul" in err.chain
    assert "torch.float16" in str(err)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=False))  # raised before the step
    assert ampguard.active().stats.nonfinite_detected == 1
    assert isinstance(err, FloatingPointError)


class CausalAttention(torch.nn.Module):
    def __init__(self, bad_sqrt=False):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)
        self.bad_sqrt = bad_sqrt

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(mask, float("-inf"))  # intentional -inf
        h = self.out(torch.softmax(scores, dim=-1) @ v)
        if self.bad_sqrt:
            h = torch.sqrt(h - 10.0)  # SQRT LINE
        return h


def train_attention(model, steps=5):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(i))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_causal_masked_fill_minus_inf_trains_without_error():
    g = ampguard.install()
    train_attention(CausalAttention())
    assert g.stats.nonfinite_detected == 0


def test_sqrt_of_a_negative_value_is_the_origin_not_the_mask():
    ampguard.install()
    with pytest.raises(ampguard.NonFiniteError) as info:
        train_attention(CausalAttention(bad_sqrt=True))
    err = info.value
    assert err.op == "torch.sqrt" and err.kind == "nan"
    assert err.sink == "loss"  # in training the loss sink covers the model's output: no output is read
    assert err.origin[-1].lineno == line_of(CausalAttention.forward, "SQRT LINE")
    assert err.module == "CausalAttention"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_encoder_with_padding_mask_has_no_false_positive(dtype):
    g = ampguard.install()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, dropout=0.0)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-3)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2, 1:] = True
    for _ in range(3):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = enc(torch.randn(3, 7, 16), src_key_padding_mask=pad)
            loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert g.stats.nonfinite_detected == 0


class Inner(torch.nn.Module):
    def forward(self, x):
        return x / (x - x)  # 0/0


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(Inner()))

    def forward(self, x):
        return self.block(x)


def test_nan_in_a_nested_submodule_names_its_dotted_path():
    ampguard.install()
    with pytest.raises(ampguard.NonFiniteError) as info:
        Outer()(torch.randn(2, 4)).sum().backward()
        torch.optim.SGD(Outer().parameters()).step()
    assert info.value.module == "block.1.0"
    assert info.value.op == "Tensor.div"


def test_grad_scaler_backward_overflow_is_not_an_error():
    g = ampguard.install()
    m = Saturating()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    Overflow(m.fc.weight, {0}).i = 0
    scaler.scale(m(torch.randn(4, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert g.stats.optimizer_steps_skipped == 1 and g.stats.nonfinite_detected == 0


def test_forward_nan_loss_under_grad_scaler_raises_at_update():
    ampguard.install()
    m = Saturating()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    loss = torch.log(m(torch.randn(4, 4)) * 0).sum()  # -inf loss
    scaler.scale(loss).backward()
    scaler.step(opt)
    with pytest.raises(ampguard.NonFiniteError) as info:
        scaler.update()
    assert info.value.sink == "loss" and info.value.kind == "-inf" and info.value.op == "torch.log"


def test_bf16_infinite_loss_raises_and_parameters_are_unchanged():
    ampguard.install()
    m = Saturating()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    before = [q.detach().clone() for q in m.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(torch.randn(4, 4))
        loss = (out * 1e38).exp().sum()  # +inf
    loss.backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    assert info.value.kind == "inf" and info.value.sink == "loss"
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=False))


def test_fp16_parameters_with_adam_and_a_zero_gradient_mention_eps():
    ampguard.install(lint=False)  # the lint would warn at the first step; this is about the error's hint
    m = torch.nn.Linear(4, 1).half()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-8)
    x = torch.ones(2, 4, dtype=torch.half)
    m(x).float().sum().backward()
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # 0 / (0 + eps rounded to 0) = NaN; no pass over the parameters after a step
    with pytest.raises(ampguard.NonFiniteError) as info:
        m(x).float().sum().backward()  # the next forward reads them: its loss is NaN
        opt.step()
    err = info.value
    message = str(err)
    assert err.sink == "loss" and err.op is None
    assert "It entered already non-finite (NaN): parameter 'weight'" in message or \
        "It entered already non-finite (NaN): parameter 'bias'" in message, message
    assert "The optimizer step of Adam#0 made it: its gradients were finite at that step" in message
    assert "and eps rounds to 0 (below)." in message
    assert "eps=1e-08 rounds to 0 in float16" in message


def test_eager_mode_raises_at_the_line_itself():
    ampguard.install(trace="eager")
    m = CausalAttention(bad_sqrt=True)
    with pytest.raises(ampguard.NonFiniteError) as info:
        m(torch.randn(2, 6, 8))
    assert info.value.op == "torch.sqrt"
    assert info.value.origin[-1].lineno == line_of(CausalAttention.forward, "SQRT LINE")
    frames = [f for f in __import__("traceback").extract_tb(info.value.__traceback__) if f.filename == __file__]
    assert frames[-1].lineno == line_of(CausalAttention.forward, "SQRT LINE")


def test_eager_mode_checks_every_op_of_a_forward_longer_than_the_window():
    """The ops inside an outermost call are checked as they run and not kept (a replay runs the call whole): before,
    they filled the window, and from its 4,096th op on the forward's ops went unchecked."""
    from ampguard.nonfinite.sinks import MAX_WINDOW

    class Long(torch.nn.Module):
        def forward(self, x):
            for _ in range(MAX_WINDOW):
                x = x * 1.0
            return torch.sqrt(x - 100.0)  # LATE NAN

    ampguard.install(trace="eager")
    with pytest.raises(ampguard.NonFiniteError) as info:
        Long()(torch.ones(3))
    assert info.value.op == "torch.sqrt" and info.value.sink == "the output of this op"
    assert info.value.origin[-1].lineno == line_of(Long.forward, "LATE NAN")


def test_warn_mode_warns_once_per_origin_and_continues():
    g = ampguard.install(nonfinite="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_attention(CausalAttention(bad_sqrt=True), steps=3)
    ours = [str(w.message) for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]
    assert "torch.sqrt" in ours[0]
    # training went on (the NaN reached the parameters, read at the next forward's loss, the same
    # sink): three steps of the same failure warn no more than once
    assert len(ours) == 1
    assert g.stats.nonfinite_detected >= 3


def test_trace_off_still_checks_sinks_without_origin_and_nonfinite_off_checks_nothing():
    ampguard.install(trace="off")
    with pytest.raises(ampguard.NonFiniteError) as info:
        train_attention(CausalAttention(bad_sqrt=True), steps=1)
    assert info.value.op is None and "No origin is known (tracing is off" in str(info.value)
    ampguard.uninstall()
    g = ampguard.install(nonfinite="off")
    train_attention(CausalAttention(bad_sqrt=True), steps=2)
    assert g.stats.nonfinite_detected == 0


def test_dataloader_workers_do_not_hang_or_grow():
    ampguard.install()
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            assert len(nonfinite.T.window) == 0 and not nonfinite.T.pending[:-1]  # freed at each step
    assert ampguard.active().stats.nonfinite_detected == 0


def test_the_window_stays_flat_over_200_steps():
    ampguard.install()
    model = CausalAttention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    peak = 0
    for _i in range(200):
        loss = model(torch.randn(2, 6, 8)).pow(2).mean()
        peak = max(peak, len(nonfinite.T.window))
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert len(nonfinite.T.window) == 0 and len(nonfinite.T.pending) == 0  # nothing waits after a step
    assert peak == 3  # the model call and the loss code's pow and mean: nothing per op of the model


def test_compiled_model_still_trains():
    g = ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0]
    assert g.stats.nonfinite_detected == 0


def test_devices_option_limits_which_tensors_are_watched():
    g = ampguard.install(devices=("cuda",))
    train_attention(CausalAttention(bad_sqrt=True), steps=1)  # CPU tensors: not watched
    assert g.stats.nonfinite_detected == 0
    ampguard.uninstall()
    ampguard.install(devices="cpu")
    with pytest.raises(ampguard.NonFiniteError):
        train_attention(CausalAttention(bad_sqrt=True), steps=1)


def test_devices_option_also_limits_the_loss_given_to_a_grad_scaler():
    g = ampguard.install(devices=("cuda",))
    m = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        scaler.scale(m(x).sum() * (float("nan") if i == 1 else 1.0)).backward()  # a CPU loss: not watched
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert g.stats.nonfinite_detected == 0
    assert not nonfinite.T.window  # each update() still ends the window: no batch is held past its step
    assert g.stats.optimizer_steps_skipped == 1  # GradScaler's own decision, counted as ever


def test_only_the_loss_code_is_recorded_and_nothing_after_backward():
    # Tensor.backward reaches ampguard from inside the tape's own handler; recording must stop there.
    ampguard.install()
    model = CausalAttention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = model(torch.randn(2, 6, 8)).pow(2).mean()
    kinds = [type(e).__name__ for e in nonfinite.T.window]
    names = [nonfinite.report.op_name(e.func) for e in nonfinite.T.window[1:]]
    assert kinds == ["Call", "TapeOp", "TapeOp"] and names == ["Tensor.pow", "Tensor.mean"]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    (loss.detach() * 2).exp()
    assert len(nonfinite.T.window) == 3
    opt.step()
    assert len(nonfinite.T.window) == 0


def test_gradient_accumulation_finds_the_origin_in_the_second_micro_batch():
    ampguard.install()
    model = CausalAttention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model(torch.randn(2, 6, 8)).pow(2).mean().backward()  # micro-batch 1: fine
    model.bad_sqrt = True
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(2, 6, 8)).pow(2).mean().backward()  # micro-batch 2: NaN
        opt.step()
    assert info.value.op == "torch.sqrt"
    assert info.value.origin[-1].lineno == line_of(CausalAttention.forward, "SQRT LINE")


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu() * 2  # FIRST OP LINE


def failing_step(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(x).sum().backward()
        opt.step()
    return info.value


def test_nan_in_the_data_is_not_blamed_on_the_first_op():
    ampguard.install()
    x = torch.ones(2, 4)
    x[1, 2] = float("nan")
    err = failing_step(Plain(), x)
    message = str(err)
    assert "It entered already non-finite (NaN): argument 0 of the call of 'Plain' (the data" in message
    assert "an input of aten.addmm inside torch.linear in module 'fc'" in message
    assert "input: shape (2, 4), torch.float32; 1 NaN" in message
    assert "It was created by" not in message and err.op is None
    assert err.origin[-1].lineno == line_of(Plain.forward, "FIRST OP LINE")


def test_a_nan_parameter_is_named():
    ampguard.install()
    model = Plain()
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    err = failing_step(model, torch.ones(2, 4))
    assert "It entered already non-finite (NaN): parameter 'fc.weight', an input of" in str(err)
    assert "input: shape (4, 4), torch.float32; 1 NaN" in str(err)


def test_warn_mode_under_warnings_as_errors_raises_the_warning_not_an_internal_error():
    g = ampguard.install(nonfinite="warn", trace="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ampguard.AmpGuardWarning)
        with pytest.raises(ampguard.AmpGuardWarning, match=r"torch\.sqrt"):
            CausalAttention(bad_sqrt=True)(torch.randn(2, 6, 8))
    assert "nonfinite" not in g._disabled


class Recommender(torch.nn.Module):
    """A recommender's shape: a sparse item embedding (SparseAdam) beside a dense head (Adam)."""

    def __init__(self, bad_sqrt=False):
        super().__init__()
        torch.manual_seed(0)
        self.items = torch.nn.EmbeddingBag(1000, 16, mode="mean", sparse=True)
        self.head = torch.nn.Linear(16, 1)
        self.bad_sqrt = bad_sqrt

    def forward(self, baskets, offsets):
        v = self.items(baskets, offsets)
        if self.bad_sqrt:
            v = torch.sqrt(v * 0)  # finite (0); its gradient is NaN  # SPARSE SQRT LINE
        return self.head(v).squeeze(1)


def train_recommender(model, steps=4):
    sparse = torch.optim.SparseAdam(list(model.items.parameters()), lr=0.01)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        baskets = torch.randint(0, 1000, (64,), generator=g)
        offsets = torch.arange(0, 64, 4)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(baskets, offsets), torch.randint(0, 2, (16,), generator=g).float())
        loss.backward()
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()
        losses.append(loss.item())
    return losses


def test_sparse_embedding_gradients_are_checked_and_train_as_without_ampguard():
    plain = train_recommender(Recommender())
    g = ampguard.install()
    assert train_recommender(Recommender()) == plain  # no internal failure, no switch-off, the same run
    assert "nonfinite" not in g._disabled and g.stats.nonfinite_detected == 0


def test_a_nan_in_a_sparse_gradient_is_named_with_its_backward_op():
    ampguard.install()
    model = Recommender(bad_sqrt=True)
    before = model.items.weight.detach().clone()
    with pytest.raises(ampguard.NonFiniteError) as info:
        train_recommender(model, steps=1)
    err = info.value
    assert err.sink == "gradient of parameter 'items.weight'" and err.kind == "nan"
    assert "shape (1000, 16), torch.float32, sparse_coo; 1024 NaN, 0 +Inf, 0 -Inf of 1024 stored elements" in str(err)
    assert err.op == "torch.sqrt"
    assert err.origin[-1].lineno == line_of(Recommender.forward, "SPARSE SQRT LINE")
    assert torch.equal(model.items.weight, before)  # read before the update


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)  # CE LINE


def test_a_batch_of_padding_only_is_named_at_the_users_cross_entropy_line_not_inside_torch():
    ampguard.install()
    model = TokenLM()
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 50, (4, 8))
    lm_loss(model(ids), ids).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(ampguard.NonFiniteError) as info:
        lm_loss(model(ids), torch.full_like(ids, -100)).backward()  # every target ignored: a mean over none is NaN
        opt.step()
    message = str(info.value)
    line = line_of(lm_loss, "CE LINE")
    # The op's own line is the user's call: not the line where cross_entropy hands itself to ampguard's recorder.
    own = f"inside torch.nn.functional.cross_entropy (inputs finite, output NaN) at\n    {__file__}:{line} in lm_loss"
    assert own in message
    assert "functional.py" not in message and "called from your code" not in message
    assert info.value.origin[-1].lineno == line


class SpectralFilter(torch.nn.Module):
    """An FFT model's shape: a learned complex filter between rfft and irfft (audio, operator learning)."""

    def __init__(self, bad_sqrt=False):
        super().__init__()
        torch.manual_seed(0)
        self.filter = torch.nn.Parameter(torch.randn(9, dtype=torch.cfloat))
        self.head = torch.nn.Linear(16, 1)
        self.bad_sqrt = bad_sqrt

    def forward(self, x):
        w = self.filter
        if self.bad_sqrt:
            w = w * torch.sqrt(w.abs() * 0).sum().add(1)  # finite (w * 1); the gradient of w is NaN  # CPLX SQRT LINE
        return self.head(torch.fft.irfft(torch.fft.rfft(x, dim=-1) * w, n=16, dim=-1))


def train_spectral(model, steps=3):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_complex_parameters_train_as_without_ampguard_and_their_nan_gradients_are_named():
    plain = train_spectral(SpectralFilter())
    g = ampguard.install()
    assert train_spectral(SpectralFilter()) == plain
    model = SpectralFilter(bad_sqrt=True)
    before = model.filter.detach().clone()
    with pytest.raises(ampguard.NonFiniteError) as info:
        train_spectral(model, steps=1)
    err = info.value
    assert err.sink == "gradient of parameter 'filter'" and err.kind == "nan"
    assert "shape (9,), torch.complex64; 18 NaN, 0 +Inf, 0 -Inf of 18 real and imaginary parts" in str(err)
    assert err.op == "torch.sqrt" and err.origin[-1].lineno == line_of(SpectralFilter.forward, "CPLX SQRT LINE")
    assert torch.equal(model.filter, before)  # read before the update: the step was not taken
    assert g.stats.nonfinite_detected == 1


def test_a_nan_complex_parameter_is_named_as_the_input_it_is():
    ampguard.install()
    model = SpectralFilter()
    with torch.no_grad():
        model.filter[3] = complex(float("nan"), 0.0)
    with pytest.raises(ampguard.NonFiniteError) as info:
        train_spectral(model, steps=1)
    assert "It entered already non-finite (NaN): parameter 'filter', an input of Tensor.mul" in str(info.value)


def wgan_gp_critic_step(critic, opt, real, fake, poison=False):
    """A WGAN-GP critic step: the critic called on interpolates, fake and real data before one backward()."""
    eps = torch.rand(real.shape[0], 1, generator=torch.Generator().manual_seed(3))
    interp = (eps * real + (1 - eps) * fake).requires_grad_(True)
    grads, = torch.autograd.grad(critic(interp).sum(), interp, create_graph=True)
    norm = grads.norm(2, dim=1) * (0 if poison else 1)
    penalty = ((torch.sqrt(norm) - 1) ** 2).mean()  # sqrt at 0: finite, its gradient is not  # GP LINE
    loss = critic(fake).mean() - critic(real).mean() + 10 * penalty
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_a_gradient_penalty_over_three_critic_calls_is_replayed_whole_and_names_its_line():
    def run(poison_at=None):
        torch.manual_seed(0)
        critic = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        return [wgan_gp_critic_step(critic, opt, torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g),
                                    poison=i == poison_at) for i in range(3)]

    plain = run()
    ampguard.install()
    assert run() == plain
    with pytest.raises(ampguard.NonFiniteError) as info:
        run(poison_at=1)
    err = info.value
    assert err.sink == "gradient of parameter '0.weight'" and err.op == "torch.sqrt"
    assert err.origin[-1].lineno == line_of(wgan_gp_critic_step, "GP LINE")
    assert "did not reproduce" not in str(err)


def maml_step(net, meta_opt, x, y, inner_lr):
    """One meta-learning step: fast weights from an inner step, the outer loss through functional_call."""
    from torch.func import functional_call

    params = dict(net.named_parameters())
    inner = torch.nn.functional.mse_loss(functional_call(net, params, (x,)), y)
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {k: v - inner_lr * g for (k, v), g in zip(params.items(), grads, strict=True)}  # FAST WEIGHTS
    outer = torch.nn.functional.mse_loss(functional_call(net, fast, (x,)), y)
    outer.backward()
    meta_opt.step()
    meta_opt.zero_grad()
    return outer.item()


def test_a_nan_through_functional_call_fast_weights_is_replayed_with_them():
    """MAML: the module's call runs with the tensors functional_call put in. The replay put the module's own
    parameters back, got a finite loss, and blamed "a nondeterministic kernel"."""

    def run(guarded, lrs, net):
        meta_opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        ctx = ampguard.guard() if guarded else contextlib.nullcontext()
        with ctx:
            return [maml_step(net, meta_opt, torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g), lr)
                    for lr in lrs]

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    plain_net, guarded_net, poisoned_net = net(), net(), net()
    assert run(True, [0.1, 0.1], guarded_net) == run(False, [0.1, 0.1], plain_net)
    assert all(torch.equal(a, b) for a, b in zip(plain_net.parameters(), guarded_net.parameters(), strict=True))
    own = dict(poisoned_net.named_parameters())
    with pytest.raises(ampguard.NonFiniteError) as info:
        run(True, [0.1, float("inf")], poisoned_net)
    err = info.value
    assert err.op == "Tensor.mul" and "given the Python number inf" in str(err), str(err)
    assert err.origin[-1].lineno == line_of(maml_step, "FAST WEIGHTS")
    assert "did not reproduce" not in str(err)
    assert dict(poisoned_net.named_parameters()) == own  # the replay's swap was undone: the module's own, by identity


def test_a_nan_inside_a_functional_call_is_named_and_not_bundled_with_the_modules_own_parameters(tmp_path):
    from torch.func import functional_call

    class ShiftedSqrt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.sqrt(self.fc(x))  # FUNCTIONAL SQRT

    torch.manual_seed(0)
    model = ShiftedSqrt()
    shifted = {"fc.weight": model.fc.weight, "fc.bias": model.fc.bias - 100.0}
    ampguard.install(repro_dir=str(tmp_path))
    with pytest.raises(ampguard.NonFiniteError) as info:
        functional_call(model, shifted, (torch.randn(2, 4),)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    err = info.value
    assert err.op == "torch.sqrt" and err.module == "ShiftedSqrt", str(err)  # only with the bias it was given
    assert "no reproducer written: the call ran under torch.func.functional_call" in str(err)


def test_torch_func_ensembles_and_per_sample_gradients_run_as_without_ampguard():
    """torch.func's own tutorials: a model ensemble under vmap (with and without grad) and per-sample gradients.
    Module calls inside a transform see batched tensors, whose statuses cannot be read outside it."""
    import copy

    from torch.func import functional_call, grad, stack_module_state, vmap

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)) for _ in range(4)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(5, 8)

    def ensemble(p, b, x):
        return functional_call(base, (p, b), (x,))

    def per_sample_loss(p, xi):
        return functional_call(models[0], p, (xi.unsqueeze(0),)).pow(2).sum()

    def run():
        out = vmap(ensemble, in_dims=(0, 0, None))(params, buffers, x)
        with torch.no_grad():
            evaluated = vmap(ensemble, in_dims=(0, 0, None))(params, buffers, x)
        detached = {k: v.detach() for k, v in models[0].named_parameters()}
        grads = vmap(grad(per_sample_loss), in_dims=(None, 0))(detached, x)
        out.sum().backward()
        return out.tolist(), evaluated.tolist(), {k: v.tolist() for k, v in grads.items()}, params["0.weight"].grad

    plain = run()
    for p in params.values():
        p.grad = None
    g = ampguard.install()
    guarded = run()
    assert guarded[:3] == plain[:3] and torch.equal(guarded[3], plain[3])
    ampguard.uninstall()  # reads what is pending: nothing batched is left to read
    assert "nonfinite" not in g._disabled


class SqrtHead(torch.nn.Module):
    """sqrt of a squared error: its gradient is infinite where the error is exactly 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)


def test_a_nan_made_under_a_torch_func_transform_says_so_instead_of_blaming_compile():
    """An ensemble's loss under vmap, then per-sample gradients under vmap(grad): the calls are batched, so no origin
    is known, and the message says why. It blamed torch.compile (torch.func imports dynamo), and for the gradients
    it said "the loss was finite: the backward pass made it" of a loss it never saw."""
    import copy

    from torch.func import functional_call, grad, stack_module_state, vmap

    models = [SqrtHead() for _ in range(3)]
    for m in models:
        with torch.no_grad():
            m.body[2].bias.fill_(float("-inf"))  # every output -inf
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(5, 4)
    with ampguard.guard():
        out = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)
        with pytest.raises(ampguard.NonFiniteError) as info:
            out.exp().sum().log().backward()  # (log of 0: the loss is -inf)
            torch.optim.SGD(params.values(), lr=0.1).step()
    message = str(info.value)
    assert "under a torch.func transform" in message and "torch.compile'd" not in message, message

    model = SqrtHead()
    detached = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(6, 4)
    y = model(x).detach()
    y[1:] += 1.0  # sample 0's error is exactly 0: sqrt's gradient there is infinite

    def loss(p, xi, yi):
        return (functional_call(model, p, (xi,)) - yi).pow(2).sqrt()

    with ampguard.guard():
        grads = vmap(grad(loss), in_dims=(None, 0, 0))(detached, x, y)
        for name, p in model.named_parameters():
            p.grad = grads[name].mean(0)
        with pytest.raises(ampguard.NonFiniteError) as info:
            torch.optim.SGD(model.parameters(), lr=0.1).step()
    message = str(info.value)
    assert "NaN in the gradient" in message and "under a torch.func transform" in message, message
    assert "The loss was finite" not in message, message


class FeatureDistance:
    """A torchmetrics metric with a network inside (as FID's Inception, LPIPS's net): the mean log-distance of
    features, -inf by design for identical inputs."""

    @staticmethod
    def make(torchmetrics):
        class Metric(torchmetrics.Metric):
            def __init__(self):
                super().__init__()
                self.features = torch.nn.Linear(4, 4)
                self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

            def update(self, a, b):
                with torch.no_grad():
                    self.total += torch.log((self.features(a) - self.features(b)).abs()).mean()

            def compute(self):
                return self.total

        return Metric()


@pytest.mark.parametrize("trace", ["replay", "eager"])
def test_a_torchmetrics_metric_is_no_sink_and_its_calls_are_not_the_models(trace):
    """A metric's call measures: its value is no sink (a Pearson correlation of constant predictions is NaN by design;
    a feature distance of identical inputs -inf), module calls inside it are the metric's, and its torch calls are
    no loss code. A real NaN is still named, and the replay leaves the metric's state as the run left it."""
    torchmetrics = pytest.importorskip("torchmetrics")

    def run(poison, keep=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        torch.nn.init.zeros_(model[2].weight)  # predictions all 0 at the first step
        torch.nn.init.zeros_(model[2].bias)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        pearson, distance = torchmetrics.PearsonCorrCoef(), FeatureDistance.make(torchmetrics)
        if keep is not None:
            keep.append(pearson)
        x = torch.randn(16, 4)
        seen = []
        for step in range(3):
            pred = model(x).squeeze(-1)
            seen.append(pearson(pred.detach(), x.sum(-1)).item())  # in the loss code, between the call and the loss
            seen.append(distance(x, x).item())
            loss = (pred - x.sum(-1)).pow(2).mean()
            if poison and step == 2:
                loss = loss * torch.log(pred.detach().abs().sum() * 0)  # log(0): -inf into the loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        return seen, [p.detach().clone() for p in model.parameters()], pearson

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*variance of predictions or target is close to zero")
        plain = run(False)
        with ampguard.guard(trace=trace):
            guarded = run(False)
        assert [repr(v) for v in plain[0]] == [repr(v) for v in guarded[0]]  # (NaN and -inf included)
        assert math.isnan(plain[0][0]) and plain[0][1] == -math.inf
        assert all(torch.equal(a, b) for a, b in zip(plain[1], guarded[1], strict=True))

        after_plain = run(True)[2].compute()
        kept: list = []
        with ampguard.guard(trace=trace), pytest.raises(ampguard.NonFiniteError) as info:
            run(True, kept)
    message = str(info.value)
    assert info.value.op == "torch.log" and "log(0): -inf into the loss" in message, message
    assert "PearsonCorrCoef" not in message and "Metric" not in message, message
    assert torch.equal(kept[0].compute(), after_plain)  # the replay did not feed the batch to the metric again


@pytest.mark.parametrize("schedulers", [False, True])
def test_a_non_finite_optimizer_state_is_named_as_what_the_step_made_the_parameter_from(schedulers):
    """A step with finite gradients made a parameter NaN because the optimizer's own state for it was not finite: a
    corrupt checkpoint's, or, with the schedulers option off, the uninitialised momentum that torch's fused SGD keeps
    from a first step GradScaler skipped. The message names that state, and for a fused SGD the way out."""
    ampguard.install(schedulers=schedulers)
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)
    x = torch.randn(8, 4)
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    opt.state[m.weight]["momentum_buffer"][0, 1] = float("nan")  # as a checkpoint (or that skipped step) left it
    m(x).pow(2).mean().backward()
    opt.step()
    with pytest.raises(ampguard.NonFiniteError) as info:
        m(x).pow(2).mean().backward()  # the next forward reads it: its loss is NaN, read before the next step
        opt.step()
    message = str(info.value)
    assert "It entered already non-finite (NaN): parameter 'weight'" in message, message
    assert "The optimizer step of SGD#0 made it: its gradients were finite at that step" in message
    assert "and its state 'momentum_buffer' for this parameter is not finite (NaN)." in message
    assert "torch's fused SGD" in message and "fused=True" in message


# -- an error that leaves while a check waits for its read --------------------------------------------------
class GaussianPolicy(torch.nn.Module):
    """A policy network whose mean goes NaN: its distribution's own parameter check raises before any step reads it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 8)
        self.mu = torch.nn.Linear(8, 2)
        self.log_std = torch.nn.Parameter(torch.zeros(2))

    def forward(self, obs):
        h = torch.tanh(self.body(obs))
        return self.mu(torch.log(h)), self.log_std.exp()  # LOG LINE (tanh < 0: NaN)


def _carried(error: BaseException) -> str:
    """The origin an error carries: its notes (Python 3.11 on), or its cause (3.10)."""
    notes = "\n".join(getattr(error, "__notes__", ()))
    cause = error.__cause__
    return notes + (str(cause) if isinstance(cause, ampguard.NonFiniteError) else "")


def _origin_of_the_policy(text: str) -> bool:
    return "NaN reached the output of module 'GaussianPolicy' (output 0)" in text and \
        "created by torch.log (inputs finite, output NaN) in module 'GaussianPolicy'" in text and \
        f"test_nonfinite.py:{line_of(GaussianPolicy.forward, 'LOG LINE')}" in text


@pytest.mark.parametrize("rejecter", ["Normal", "multinomial"])
def test_torch_s_own_error_at_a_nan_carries_the_origin_of_the_check_that_was_waiting(rejecter):
    policy = GaussianPolicy()
    error = ValueError if rejecter == "Normal" else RuntimeError
    with pytest.raises(error) as info, ampguard.guard():
        mu, std = policy(torch.randn(16, 4))
        if rejecter == "Normal":  # (NaN is not Real. Explicit: dynamo, once used, turns the default off)
            torch.distributions.Normal(mu, std, validate_args=True)
        else:
            torch.multinomial(torch.softmax(mu, -1), 1)  # (probabilities with NaN)
    assert type(info.value) is error  # (the error leaves as it came)
    assert _origin_of_the_policy(_carried(info.value)), _carried(info.value)
    if hasattr(info.value, "add_note"):
        assert info.value.__notes__[0].startswith("\nThe error above came after a value ampguard was about to check")


def test_an_error_after_finite_outputs_carries_nothing_and_leaves_no_check():
    policy = GaussianPolicy()
    with pytest.raises(ValueError) as info, ampguard.guard() as g:
        policy(torch.rand(16, 4) + 1)  # (finite: tanh > 0)
        raise ValueError("the user's own")
    assert not _carried(info.value) and g.stats.nonfinite_detected == 0
    assert not nonfinite.T.pending


@pytest.mark.parametrize("leaving", [KeyboardInterrupt, torch.OutOfMemoryError])
def test_an_interrupt_or_an_out_of_memory_error_leaves_without_a_read(leaving):
    policy, held = GaussianPolicy(), []
    with pytest.raises(leaving) as info, ampguard.guard() as g:
        held.append(policy(torch.randn(16, 4)))  # (held: a read would find its NaN)
        raise leaving("CUDA out of memory")
    assert not _carried(info.value) and g.stats.nonfinite_detected == 0  # (no replay ran)
    assert not nonfinite.T.pending


def test_warn_mode_reads_nothing_as_an_error_leaves():
    policy = GaussianPolicy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a warning here would take the place of the user's error)
        with pytest.raises(ValueError) as info, ampguard.guard(nonfinite="warn") as g:
            mu, std = policy(torch.randn(16, 4))
            torch.distributions.Normal(mu, std, validate_args=True)
    assert not _carried(info.value) and g.stats.nonfinite_detected == 0


def test_an_error_that_ends_an_installed_program_is_printed_with_the_origin(python, tmp_path):
    script = tmp_path / "policy.py"
    script.write_text(textwrap.dedent("""
        import torch, ampguard
        ampguard.install()
        torch.manual_seed(0)
        body, head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        h = torch.tanh(body(torch.randn(16, 4)))
        mu = head(torch.log(h))  # LOG LINE
        torch.distributions.Normal(mu, torch.ones(2))
    """))
    proc = python(None, str(script))
    assert proc.returncode == 1, proc.stderr
    assert "ValueError: Expected parameter loc" in proc.stderr, proc.stderr
    assert "created by torch.log (inputs finite, output NaN) at" in proc.stderr, proc.stderr
    assert f"{script}:7 in <module>\n      mu = head(torch.log(h))  # LOG LINE" in proc.stderr, proc.stderr
    assert "Error in sys.excepthook" not in proc.stderr


class VAE(torch.nn.Module):
    """A VAE whose forward builds its posterior: torch's own check of the scale raises inside the call, before the call
    has an output that a check could read."""

    def __init__(self, offset=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.enc = torch.nn.Linear(8, 8)
        self.mu, self.var = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        self.dec = torch.nn.Linear(4, 8)
        self.offset = offset  # (a large one: every variance positive, no NaN)

    def forward(self, x):
        h = torch.relu(self.enc(x))
        std = torch.sqrt(self.var(h) + self.offset)  # SQRT LINE (a negative variance: NaN)
        q = torch.distributions.Normal(self.mu(h), std, validate_args=True)
        return self.dec(q.rsample()), q


def test_a_nan_that_torch_s_own_check_meets_inside_the_forward_is_named_by_replaying_that_call():
    """The forward raised before it returned: no output was a sink, nothing was pending, and the ValueError of torch's
    parameter check left as it came, without the line that made the NaN."""
    model = VAE()
    with pytest.raises(ValueError, match="Expected parameter scale") as info, ampguard.guard() as g:
        model(torch.randn(16, 8))
    assert type(info.value) is ValueError  # (the error leaves as it came, the origin carried)
    carried = _carried(info.value)
    assert "NaN was made in the call of 'VAE' before it raised." in carried, carried
    assert "created by torch.sqrt (inputs finite, output NaN) in module 'VAE'" in carried, carried
    assert f"test_nonfinite.py:{line_of(VAE.forward, 'SQRT LINE')}" in carried, carried
    if hasattr(info.value, "add_note"):
        assert info.value.__notes__[0].startswith("\nampguard replayed the call that raised the error above:")
    assert g.stats.nonfinite_detected == 0  # (the user's error, not a NonFiniteError)
    assert nonfinite.T.raised is None


def test_a_call_that_raises_on_an_output_of_an_earlier_call_is_replayed_after_it():
    """The raising call's input is the window's own output (an encoder's features): the replay runs the encoder first
    and hands its replayed output on."""
    torch.manual_seed(0)
    encoder, vae = torch.nn.Linear(8, 8), VAE()
    with pytest.raises(ValueError) as info, ampguard.guard():
        vae(encoder(torch.randn(16, 8)))
    carried = _carried(info.value)
    assert "created by torch.sqrt (inputs finite, output NaN) in module 'VAE'" in carried, carried


@pytest.mark.parametrize("raise_", ["no NaN", "trace off", "warn mode", "another error after it"])
def test_an_error_out_of_a_forward_carries_nothing_where_no_nan_was_made_or_no_replay_is_wanted(raise_):
    model = VAE(offset=100.0 if raise_ == "no NaN" else 0.0)
    options = {"trace": "off"} if raise_ == "trace off" else {"nonfinite": "warn"} if raise_ == "warn mode" else {}
    x = torch.randn(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a warning would take the place of the user's error)
        with pytest.raises(ValueError) as info, ampguard.guard(**options):
            if raise_ == "another error after it":
                try:
                    model(x)
                except ValueError:
                    pass  # (the user handled it; the error that leaves is another)
                raise ValueError("the user's own")
            model(x)
            raise ValueError("the user's own, after a forward that made no NaN")
    assert not _carried(info.value), _carried(info.value)


@pytest.mark.parametrize("actor", ["a check waits", "the call raised"])
def test_an_error_that_ends_a_thread_carries_the_origin_that_thread_s_checks_find(actor, monkeypatch):
    """An RL actor or a request handler in a thread of its own: threading.excepthook prints its error, in that thread,
    with the origin of its checks (sys.excepthook never sees it). Put back exactly at uninstall."""
    seen = []
    hook = seen.append
    monkeypatch.setattr(threading, "excepthook", hook)  # (the hook ampguard finds at install and calls)
    policy, vae = GaussianPolicy(), VAE()

    def act():
        if actor == "a check waits":
            mu, std = policy(torch.randn(16, 4))
            torch.distributions.Normal(mu, std, validate_args=True)
        else:
            vae(torch.randn(16, 8))

    ampguard.install()
    try:
        thread = threading.Thread(target=act)
        thread.start()
        thread.join()
    finally:
        ampguard.uninstall()
    assert threading.excepthook is hook
    [args] = seen
    assert type(args.exc_value) is ValueError and args.thread is thread
    carried = _carried(args.exc_value)
    if actor == "a check waits":
        assert _origin_of_the_policy(carried), carried
    else:
        assert "created by torch.sqrt (inputs finite, output NaN) in module 'VAE'" in carried, carried


def test_a_call_that_raised_holds_none_of_its_inputs():
    model, x = VAE(), torch.randn(16, 8)
    held = weakref.ref(x)
    with ampguard.guard():
        try:
            model(x)
        except ValueError:
            pass
        del x
        assert held() is None  # (freed as without ampguard, with the guard still open)


def test_an_error_that_cannot_be_printed_still_leaves_as_it_came():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("its __str__ fails")

    policy, held = GaussianPolicy(), []
    with pytest.raises(Unprintable), ampguard.guard():
        held.append(policy(torch.randn(16, 4)))
        raise Unprintable
