"""Origins through the shapes recurrent and padding code has: a module's output nested in tuples or named tuples (an
LSTM's ``(PackedSequence, (h, c))``), and a buffer filled through views of it (``out[:, :n] = x``), as padding,
packing and caches fill one."""

import dataclasses
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import ampguard


def lstm_with_an_inf_weight():
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, batch_first=True)
    with torch.no_grad():
        lstm.weight_hh_l0[0, 0] = float("inf")  # inf x the zero first state: NaN from the first time step
    return lstm


def packed_batch():
    x = torch.randn(4, 7, 8, generator=torch.Generator().manual_seed(1))
    return nn.utils.rnn.pack_padded_sequence(x, torch.tensor([7, 5, 3, 2]), batch_first=True, enforce_sorted=False)


def test_an_lstm_called_on_a_packed_sequence_is_named_not_the_unpacking_that_follows():
    """The LSTM's output is a PackedSequence; the loss code unpacks it. The NaN entered through the LSTM's weight:
    the unpacking's buffer (filled through views) is not where it was created."""
    lstm = lstm_with_an_inf_weight()
    opt = torch.optim.SGD(lstm.parameters(), lr=0.1)
    with ampguard.guard():
        out, _ = lstm(packed_batch())
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        padded.pow(2).mean().backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    err = info.value
    assert "parameter 'weight_hh_l0'" in str(err) and "module 'LSTM'" in str(err), str(err)
    assert err.op is None or "pad_packed" not in err.op, str(err)


def test_an_lstm_state_nested_in_its_output_is_known_as_the_lstm_output():
    """``out, (h, c) = lstm(x)``: the classifier reads ``h``, two levels down in the LSTM's output."""
    lstm = lstm_with_an_inf_weight()
    head = nn.Linear(16, 3)
    opt = torch.optim.SGD([*lstm.parameters(), *head.parameters()], lr=0.1)
    with ampguard.guard():
        _, (h, _) = lstm(torch.randn(4, 7, 8))
        torch.nn.functional.cross_entropy(head(h[-1]), torch.tensor([0, 1, 2, 0])).backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    message = str(info.value)
    assert "parameter 'weight_hh_l0'" in message and "module 'LSTM'" in message, message
    assert "made by code ampguard did not record" not in message, message


class TwoPartPadding(nn.Module):
    """Writes two branches into one zero buffer through views, and returns a view of the buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x):
        out = x.new_zeros(x.shape[0], 10, 4)
        out[:, :3] = self.first(x)  # aten.copy_ into a slice
        out[:, 5:8] = self.second(x)
        return out.transpose(1, 2)


@pytest.mark.parametrize("bad", ["first", "second"])
def test_a_nan_written_into_a_buffer_through_a_view_is_traced_to_the_write_that_brought_it(bad):
    """Whichever write brought the NaN (the last one, or one before it), the reader of the buffer did not make it."""
    model = TwoPartPadding()
    with torch.no_grad():
        getattr(model, bad).bias[0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard():
        model(torch.randn(2, 3, 4)).pow(2).mean().backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    message = str(info.value)
    assert f"parameter '{bad}.bias'" in message, message
    assert "transpose" not in (info.value.op or ""), message


class FillsAPreallocatedBuffer(nn.Module):
    """A buffer whose every column is written below: what it held before is no value's origin. torch.empty's memory
    may hold the NaN bits of a freed tensor; a NaN sentinel holds them on purpose, and is what this uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(4, 8)

    def forward(self, x):
        out = torch.full((x.shape[0], 16), float("nan"))
        out[:, :8] = self.first(x)
        out[:, 8:] = self.second(x)
        return out


def test_what_a_write_overwrote_is_not_the_origin_of_what_it_wrote():
    model = FillsAPreallocatedBuffer()
    with torch.no_grad():
        model.second.bias[3] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard():
        model(torch.randn(5, 4)).pow(2).mean().backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    message = str(info.value)
    assert "parameter 'second.bias', an input of aten.addmm inside torch.linear in module 'second'" in message, message


class ScalesInPlaceAfterTakingAView(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        h = self.proj(x)
        first = h[:, :4]  # a view, taken before the write
        h.mul_(self.scale)  # the write, into the view's buffer
        return first.sum(-1)


def test_a_view_read_after_an_in_place_write_into_its_buffer_reads_that_write():
    model = ScalesInPlaceAfterTakingAView()
    with torch.no_grad():
        model.scale[1] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard():
        model(torch.randn(3, 4)).pow(2).mean().backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    message = str(info.value)
    assert "parameter 'scale', an input of Tensor.mul_" in message, message


def test_a_packed_sequence_passed_under_no_grad_is_not_held():
    """Arguments of a call without grad are held weakly; a PackedSequence is a named tuple of them, not one object
    to keep whole (its data is the batch, the size of an activation)."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, batch_first=True)
    with ampguard.guard(), torch.no_grad():
        packed = packed_batch()
        data = weakref.ref(packed.data)
        out = lstm(packed)
        del packed, out
        gc.collect()
        assert data() is None


@dataclasses.dataclass
class Output:
    """A model's own output class, as many codebases define one."""

    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "a field that is no tensor"


class ReturnsADataclass(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        hidden = self.body(x)
        return Output(self.head(hidden), hidden)


def test_a_dataclass_output_is_the_calls_output_in_training():
    model = ReturnsADataclass()
    with torch.no_grad():
        model.body.bias[0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard():
        model(torch.randn(3, 4)).logits.pow(2).mean().backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    message = str(info.value)
    assert "parameter 'body.bias'" in message, message
    assert "made by code ampguard did not record" not in message, message


def test_a_nan_in_a_dataclass_output_of_an_evaluation_is_reported():
    model = ReturnsADataclass()
    with torch.no_grad():
        model.head.bias[1] = float("nan")
    x = torch.randn(3, 4)
    with ampguard.guard(), torch.no_grad():
        with pytest.raises(ampguard.NonFiniteError) as info:
            model(x)  # (on the CPU an evaluation's NaN output is known, and raised, by the call that made it)
    assert "output of module 'ReturnsADataclass' (output 'logits')" in str(info.value), str(info.value)
    assert "parameter 'head.bias'" in str(info.value), str(info.value)


class RaggedEncoder(nn.Module):
    """Encodes each sequence of a ragged batch on its own and returns them as one nested tensor, as variable-length
    encoders do."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.proj = nn.Linear(4, 4)

    def forward(self, sequences):
        return torch.nested.nested_tensor([self.proj(s) for s in sequences], layout=self.layout)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_a_nested_tensor_output_is_checked_and_its_origin_named(layout):
    """torch's norms take no nested tensor: the output's status is its buffer's. Before, the first such output
    switched the non-finite checks off for the rest of the run (an internal failure), and the replay could not
    describe a nested tensor (its strided layout has no shape; the jagged one makes meta tensors)."""
    encoder = RaggedEncoder(layout)
    batch = [torch.randn(2, 4), torch.randn(3, 4)]
    with ampguard.guard(), torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error", ampguard.AmpGuardWarning)
            for _ in range(3):
                encoder(batch)
        encoder.proj.bias[1] = float("nan")
        with pytest.raises(ampguard.NonFiniteError) as info:
            encoder(batch)  # (on the CPU an evaluation's NaN output is known, and raised, by the call that made it)
    message = str(info.value)
    assert "NaN reached the output of module 'RaggedEncoder'" in message, message
    assert "parameter 'proj.bias'" in message and "could not replay" not in message, message


class Projected(nn.Module):
    """A projection whose output is returned in the form under test."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.form(self.proj(x))


class Float8Cache(Projected):
    """Returns its activation cast to float8, as an fp8 KV cache or a quantized activation is kept."""

    def __init__(self, dtype):
        super().__init__(lambda h: h.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_a_float8_output_is_checked_and_its_origin_named(dtype):
    """torch's norms and isfinite take no float8 tensor: before, the first float8 output switched the non-finite
    checks off for the rest of the run. Its status is taken in bfloat16, which holds every float8 value."""
    cache, x = Float8Cache(dtype), torch.randn(3, 4)
    with ampguard.guard(), torch.no_grad():
        for _ in range(3):
            cache(x)
        cache.proj.bias[2] = float("nan")
        with pytest.raises(ampguard.NonFiniteError) as info:
            cache(x)
    message = str(info.value)
    assert "NaN reached the output of module 'Float8Cache'" in message and "parameter 'proj.bias'" in message, message


class TwoHeads(Projected):
    """Returns its activation twice: as a plain tensor, and in the form under test."""

    def forward(self, x):
        h = self.proj(x)
        return h, self.form(h)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_a_onednn_output_is_checked():
    """A oneDNN (mkldnn) tensor, of a model converted for CPU inference, has no values() as a sparse one has."""
    model, x = TwoHeads(lambda h: (h * 2).to_mkldnn()), torch.randn(3, 4)
    with ampguard.guard(), torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error", ampguard.AmpGuardWarning)
            model(x)
        model.proj.bias[0] = float("nan")
        with pytest.raises(ampguard.NonFiniteError) as info:
            model(x)
    assert "parameter 'proj.bias'" in str(info.value), str(info.value)


@pytest.mark.filterwarnings("ignore:The PyTorch API of MaskedTensors is in prototype stage")
def test_an_output_whose_status_torch_cannot_compute_is_left_unchecked_with_one_warning():
    """torch's norm answers NotImplemented for a MaskedTensor. That output is not a sink, with one warning per class
    and guard; the call's other outputs are still checked. Before, the failure switched every check off."""
    from torch.masked import masked_tensor

    model, x = TwoHeads(lambda h: masked_tensor(h, h > 0)), torch.randn(3, 4)
    with ampguard.guard(), torch.no_grad():
        with pytest.warns(ampguard.AmpGuardWarning, match="MaskedTensor, whose status torch cannot compute") as seen:
            for _ in range(3):
                model(x)
        assert len([w for w in seen if issubclass(w.category, ampguard.AmpGuardWarning)]) == 1
        model.proj.bias[0] = float("nan")
        with pytest.raises(ampguard.NonFiniteError) as info:
            model(x)
    assert "output of module 'TwoHeads'" in str(info.value) and "parameter 'proj.bias'" in str(info.value)


class HandsBackItsTargets(nn.Module):
    """Multi-task regression with missing labels (NaN): the model returns its predictions with the batch's targets
    (a dict, as trainers' collate code hands it over), and a statistic computed without grad."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 2)

    def forward(self, batch):
        pred = self.head(batch["x"])
        out = {"pred": pred, "target": batch["y"], "mask": batch["y"].isnan().unsqueeze(0).float(),
               "target_t": batch["y"].T}
        if self.training:
            with torch.no_grad():
                out["spread"] = (pred - batch["y"]).std(0)  # NaN where a column misses a label: logged, not trained on
        return out


def batch_with_missing_labels(i, x_nan=False):
    g = torch.Generator().manual_seed(i)
    y = torch.randn(8, 2, generator=g)
    y[::3, 1] = float("nan")
    x = torch.randn(8, 4, generator=g)
    if x_nan:
        x[0, 0] = float("nan")
    return {"x": x, "y": y}


def masked_loss(out):
    valid = ~out["target"].isnan()
    return (out["pred"] - out["target"].nan_to_num())[valid].pow(2).mean()


def test_targets_with_missing_labels_that_a_model_hands_back_are_no_sink_in_training_or_evaluation():
    """They raised NonFiniteError ("no origin is known") in training and in evaluation, and plain PyTorch trains on.
    In training an output without grad was read at once rather than left to the loss; in evaluation an output the
    call was given (or a view of it) was a sink, though the call made nothing of it."""
    reference = HandsBackItsTargets()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i in range(3):
        masked_loss(reference(batch_with_missing_labels(i))).backward()
        opt.step()
        opt.zero_grad()
    model = HandsBackItsTargets()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard() as g:
        for i in range(3):
            masked_loss(model(batch_with_missing_labels(i))).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for i in range(3):
                out = model(batch_with_missing_labels(i))
                assert masked_loss(out).isfinite() and out["target"].isnan().any()
        assert g.stats.nonfinite_detected == 0
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))


class Reshapes(nn.Module):
    """Hands back its input, or a view of it, as its one tensor output: a flatten or a reshape at a model's entry."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        return x if self.how == "itself" else x.flatten(1) if self.how == "view" else x * 1.0


@pytest.mark.parametrize("how", ["itself", "view"])
def test_one_tensor_output_that_the_call_was_given_is_no_sink(how):
    """One plain tensor output takes a shorter path than a container's (exit() skips the walk over containers): an
    inference call that hands back the NaN data it was given, or a view of it, made nothing. Plain PyTorch goes on;
    so does the guarded loop. A call that makes a new tensor of the same data makes a sink."""
    data = torch.randn(4, 2, 3)
    data[1, 0, 2] = float("nan")
    with ampguard.guard() as g:
        with torch.no_grad():
            for _ in range(3):
                assert Reshapes(how)(data).isnan().any()
        ampguard.nonfinite.check()
        assert g.stats.nonfinite_detected == 0
        with torch.no_grad(), pytest.raises(ampguard.NonFiniteError) as info:
            Reshapes("copy")(data)
            ampguard.nonfinite.check()
    assert info.value.sink == "output of module 'Reshapes'", str(info.value)


def test_a_prediction_that_nan_data_made_in_an_evaluation_is_still_reported():
    model = HandsBackItsTargets().eval()
    batch = batch_with_missing_labels(0, x_nan=True)
    with ampguard.guard(), torch.no_grad(), pytest.raises(ampguard.NonFiniteError) as info:
        model(batch)
        model(batch_with_missing_labels(1))  # (the read of the first call's outputs)
    message = str(info.value)
    assert info.value.sink == "output of module 'HandsBackItsTargets' (output 'pred')", message
    assert "It entered already non-finite (NaN)" in message, message


class CachesAStatistic(nn.Module):
    """Computes a statistic at its first call and returns the cached value from then on, with a buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 2)
        self.register_buffer("stats", torch.zeros(2))
        self.cache = None

    def forward(self, x):
        y = self.head(x)
        if self.cache is None:
            self.cache = y.detach().mean(0).log()  # NaN where the mean is negative
        return y, self.cache, self.stats


@pytest.mark.parametrize("held", ["cache", "stats"])
def test_an_output_that_the_module_holds_is_named_when_the_replay_cannot_remake_it(held):
    """The replay runs the call with the module as it is now, and a tensor the module holds comes back as it is: the
    message said only "No origin is known"."""
    model = CachesAStatistic().eval()
    if held == "stats":
        model.cache = torch.zeros(2)
        model.stats.fill_(float("nan"))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    with ampguard.guard(), torch.no_grad(), pytest.raises(ampguard.NonFiniteError) as info:
        for _ in range(3):
            model(x)
    message = str(info.value)
    assert f"The call returned '{held}', a tensor that module 'CachesAStatistic' holds, as it is" in message, message
