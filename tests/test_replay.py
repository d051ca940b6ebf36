"""Origins found by replay, on the shapes real training code has (issue 10's ten cases and the replay's rules)."""

import collections
import contextlib
import dataclasses
import gc
import random
import warnings

import numpy
import pytest
import torch
import torch.utils.checkpoint
from loops import AroundAnOp, OutOfMemory, RaisingTeacher, line_of

import ampguard
from ampguard import nonfinite


# 1. attention masks --------------------------------------------------------------------------
class CausalBlock(torch.nn.Module):
    def __init__(self, finite_mask):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(6)
        if finite_mask:
            mask = mask.masked_fill(mask.isinf(), torch.finfo(torch.float32).min)
        self.register_buffer("causal_mask", mask)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.proj(x)
        a, _ = self.attn(h, h, h, attn_mask=self.causal_mask)  # ATTN LINE
        return self.head(a)


@pytest.mark.parametrize("finite_mask", [False, True], ids=["-inf mask", "finfo.min mask"])
def test_attention_logits_overflowing_in_fp16_are_named_not_the_mask(finite_mask):
    ampguard.install()
    model = CausalBlock(finite_mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(2, 6, 16) * 300)
        torch.nn.functional.cross_entropy(out.float().flatten(0, 1), torch.zeros(12, dtype=torch.long)).backward()
        opt.step()
    err = info.value
    assert err.op == "aten.baddbmm" and err.module == "attn"
    message = str(err)
    assert "created by aten.baddbmm inside torch.nn.functional.multi_head_attention_forward" in message
    assert "It became NaN in aten._softmax inside torch.nn.functional.multi_head_attention_forward in module " \
        "'attn' at" in message  # (the module of the op where it became NaN, as the origin's)
    assert "entered already non-finite" not in message and "buffer 'causal_mask'" not in message
    assert err.origin[-1].lineno == line_of(CausalBlock.forward, "ATTN LINE")


def test_a_healthy_masked_attention_trains_without_error():
    g = ampguard.install()
    model = CausalBlock(finite_mask=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(2, 6, 16))
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert g.stats.nonfinite_detected == 0


class PaddedCausalAttention(torch.nn.Module):
    """Hand-written attention as GPT-style code has it: a causal mask of -inf built in forward, and padding masked
    with -inf too (where finfo.min would keep a fully padded sequence finite)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 20)

    def forward(self, ids, attn):
        t = ids.shape[1]
        causal = torch.full((t, t), float("-inf")).triu(1)
        pad = torch.zeros_like(attn).masked_fill(attn == 0, float("-inf"))[:, None, :]
        mask = causal + pad  # MASK LINE
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / 4.0 + mask
        return self.head(scores.softmax(-1) @ v)  # SOFTMAX LINE


def padded_lm_step(model, opt, ids, attn):
    logits = model(ids, attn)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_a_fully_padded_sequence_is_named_at_the_softmax_not_at_the_causal_mask():
    """The causal mask's -inf is on purpose, and every step has it; what makes NaN is a row that the masks cover
    everywhere (a sequence that is all padding). The walk went from the softmax through the masked scores to the
    causal mask, and named ``torch.full(..., -inf)`` as where the NaN was created."""
    model = PaddedCausalAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(3, 6)
    attn[1, 4:] = 0  # padded at the end: every row keeps an unmasked key
    with ampguard.guard() as g:
        assert all(loss == loss for loss in [padded_lm_step(model, opt, ids, attn) for _ in range(2)])
        assert g.stats.nonfinite_detected == 0
        attn[2] = 0  # a sequence that is all padding
        with pytest.raises(ampguard.NonFiniteError) as info:
            padded_lm_step(model, opt, ids, attn)
    err = info.value
    message = str(err)
    assert err.op == "Tensor.softmax" and err.origin[-1].lineno == line_of(PaddedCausalAttention.forward,
                                                                            "SOFTMAX LINE"), message
    assert "It was created by Tensor.softmax (inputs finite but for a mask, output NaN)" in message, message
    assert "torch.full" not in message and "It became" not in message, message
    assert "was not counted as a cause: the mask made by Tensor.add at " \
        f"{__file__}:{line_of(PaddedCausalAttention.forward, 'MASK LINE')}." in message, message
    assert "has no finite value for a softmax to normalize" in message and "torch.finfo(dtype).min" in message


def test_a_fully_masked_row_written_with_masked_fill_is_named_at_the_softmax_as_an_added_mask_is():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    pad[1] = True  # the second sequence is all padding
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        h = model(torch.randn(2, 4)).view(2, 3, 2)
        scores = (h @ h.transpose(1, 2)).masked_fill(pad[:, None, :], float("-inf"))  # PAD MASK
        (scores.softmax(-1) @ h).pow(2).mean().backward()
        opt.step()
    message = str(info.value)
    line = line_of(test_a_fully_masked_row_written_with_masked_fill_is_named_at_the_softmax_as_an_added_mask_is,
                   "PAD MASK")
    assert info.value.op == "Tensor.softmax" and "(inputs finite but for a mask, output NaN)" in message, message
    assert f"was not counted as a cause: the mask made by Tensor.masked_fill at {__file__}:{line}." in message, message
    assert "has no finite value for a softmax to normalize" in message


def test_a_target_whose_class_is_masked_is_named_at_the_mask_that_reached_the_loss():
    """+Inf, not NaN: the mask's -Inf itself reached the loss (negated by the NLL), so the mask is the origin."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[:, 2] = True
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        scores = model(torch.randn(4, 4)).masked_fill(mask, float("-inf"))  # MASKED CLASS
        torch.nn.functional.cross_entropy(scores, torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
    message = str(info.value)
    assert info.value.kind == "inf" and info.value.op == "Tensor.masked_fill", message
    line = line_of(test_a_target_whose_class_is_masked_is_named_at_the_mask_that_reached_the_loss, "MASKED CLASS")
    assert f"{__file__}:{line}" in message and "It became +Inf in aten.nll_loss_forward" in message, message


class MissingMarked(torch.nn.Module):
    """A forecaster that marks positions it has no prediction for with NaN, on purpose (a nanmean skips them)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, valid):
        return self.head(x).squeeze(-1).masked_fill(~valid, float("nan"))  # MARKER LINE


def test_a_nan_marker_written_on_purpose_passes_in_training_and_its_evaluation_error_says_how_to_allow_it():
    model = MissingMarked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    valid = torch.tensor([True] * 5 + [False] * 3)
    x, y = torch.randn(8, 4), torch.randn(8)
    with ampguard.guard() as g:
        loss = (model(x, valid) - y).pow(2).nanmean()  # the loss skips the marker: finite
        loss.backward()
        opt.step()
        assert g.stats.nonfinite_detected == 0
        with torch.no_grad(), ampguard.guard(nonfinite="off"):  # the way the message names
            assert (model(x, valid) - y).pow(2).nanmean().isfinite()
            assert (model(x, valid) - y).pow(2).nanmean().isfinite()
        with torch.no_grad(), pytest.raises(ampguard.NonFiniteError) as info:
            model(x, valid)
            model(x, valid)  # (the read of the first call's output)
    message = str(info.value)
    assert info.value.sink == "output of module 'MissingMarked'" and info.value.op == "Tensor.masked_fill", message
    assert "it was given the Python number nan" in message
    assert "Your code wrote this NaN itself. If it is on purpose" in message and \
        'run those calls under `with ampguard.guard(nonfinite="off"):`' in message, message


# 2. teacher under no_grad ----------------------------------------------------------------------
class Student(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.log(self.out(self.body(x)))  # STUDENT LOG


@pytest.mark.parametrize("teacher_first", [True, False])
def test_distillation_blames_the_student_whatever_the_teacher_did(teacher_first):
    ampguard.install()
    student = Student()
    torch.manual_seed(2)
    teacher = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with pytest.raises(ampguard.NonFiniteError) as info:
        if teacher_first:
            with torch.no_grad():
                soft = teacher(x).softmax(-1)
            log_p = student(x)
        else:
            log_p = student(x)
            with torch.no_grad():
                soft = teacher(x).softmax(-1)
        torch.nn.functional.kl_div(log_p, soft, reduction="batchmean").backward()
        opt.step()
    err = info.value
    assert err.op == "torch.log" and err.module == "Student" and err.sink == "loss"
    assert err.origin[-1].lineno == line_of(Student.forward, "STUDENT LOG")


# 3. a loss written as a module ------------------------------------------------------------------
class Deep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                          for _ in range(3))
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_criterion_module_does_not_become_the_naming_root():
    ampguard.install()
    model = Deep()
    criterion = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.blocks[1][0].weight.mul_(1e4)  # the fp16 matmul of block 1 overflows
    with pytest.raises(ampguard.NonFiniteError) as info:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(torch.randn(4, 8) * 100)
        criterion(logits.float(), torch.tensor([0, 1, 2, 3])).backward()
        opt.step()
    err = info.value
    assert err.module in ("blocks.1.0", "blocks.2.0", "head"), str(err)  # a dotted path in the model
    assert err.module.startswith("blocks.1.0"), str(err)
    assert "parameter" not in str(err) or "#" not in str(err)


def test_parameter_names_come_from_the_model_even_when_a_criterion_ran_last():
    ampguard.install(lint=False)
    model = Deep().half()
    criterion = torch.nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    criterion(model(torch.randn(4, 8).half()).float(), torch.tensor([0, 1, 2, 3])).backward()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # 0 / (0 + eps rounded to 0) = NaN
    with pytest.raises(ampguard.NonFiniteError) as info:
        criterion(model(torch.randn(4, 8).half()).float(), torch.tensor([0, 1, 2, 3])).backward()
        nonfinite.check()  # no step follows here: read now
    assert "It entered already non-finite (NaN): parameter 'blocks.0.0.weight'" in str(info.value)


# 4. gradient checkpointing ------------------------------------------------------------------------
class Checkpointed(torch.nn.Module):
    def __init__(self, bad_backward=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.bad_backward = bad_backward

    def block(self, i, x):
        h = self.blocks[i](x)
        if i == 1 and self.bad_backward:
            h = h + torch.sqrt(h * 0)  # SQRT AT ZERO
        return torch.tanh(h)

    def forward(self, x):
        for i in range(3):
            x = torch.utils.checkpoint.checkpoint(self.block, i, x, use_reentrant=False)
        return x


def test_checkpoint_re_runs_do_not_become_roots_and_names_stay_dotted():
    ampguard.install()
    model = Checkpointed(bad_backward=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    err = info.value
    assert err.sink == "gradient of parameter 'blocks.0.weight'"
    assert "The backward of torch.sqrt (SqrtBackward0) turned finite gradients into" in str(err)
    assert err.op == "torch.sqrt" and err.module == "Checkpointed"  # the method runs in the model's own call
    assert err.origin[-1].lineno == line_of(Checkpointed.block, "SQRT AT ZERO")



def _triplet_step(embed, how="sqrt"):
    """A triplet loss whose first 4 positives are their anchors: a distance of a point to itself, sqrt(0)."""
    torch.manual_seed(0)
    a = torch.randn(16, 8)
    p = torch.cat([a[:4], torch.randn(12, 8)])
    ea, ep, en = embed(a), embed(p), embed(torch.randn(16, 8))
    if how == "log under where":
        sq = (ea - ep).pow(2).sum(-1)
        loss = torch.where(sq > 0, sq.log(), torch.zeros_like(sq)).mean()  # GUARDED LOG
    else:
        sq = (ea - ep).pow(2).sum(-1)
        d_ap = sq.sqrt() if how == "sqrt" else sq.pow(0.5)  # DISTANCE
        loss = torch.relu(d_ap - (ea - en).pow(2).sum(-1).sqrt() + 1.0).mean()
    loss.backward()
    torch.optim.SGD(embed.parameters(), lr=0.1).step()


@pytest.mark.parametrize("how", ["sqrt", "pow 0.5", "log under where"])
def test_a_singularity_met_in_backward_says_how_many_inputs_were_0_and_the_fix_for_that_op(how):
    """The message named the op and said "look for ops with unbounded gradients (sqrt or pow at 0, ...)". The replay
    can measure the values the op saved: the distance was 0 for the 4 anchors that are their own positives."""
    embed = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        _triplet_step(embed, how)
    err, message = info.value, str(info.value)
    if how == "log under where":
        assert err.op == "torch.log" and err.origin[-1].lineno == line_of(_triplet_step, "GUARDED LOG"), message
        assert "  In the replay its input was 0 at 4 of 16 elements. The gradient of torch.log is 1 / x, unbounded " \
            "at 0. Clamp the input (min=eps) before the log" in message, message
        return
    assert err.origin[-1].lineno == line_of(_triplet_step, "DISTANCE"), message
    if how == "pow 0.5":
        assert err.op == "torch.pow", message
        assert "  In the replay its input was 0 at 4 of 16 elements. The gradient of torch.pow is a x^(a-1) for " \
            "x ** a, unbounded at 0 for a power a below 1." in message, message
        return
    assert err.op == "torch.sqrt", message
    assert "  In the replay its output was 0 at 4 of 16 elements. The gradient of torch.sqrt is 1 / (2 sqrt(x)), " \
        "+Inf at 0." in message, message
    assert "take torch.linalg.vector_norm or torch.cdist, whose gradient at 0 is 0" in message, message
    # and the fix it names trains: vector_norm's gradient at a zero vector is 0
    embed.zero_grad()
    torch.linalg.vector_norm(embed(torch.zeros(2, 8)) - embed(torch.zeros(2, 8)), dim=-1).sum().backward()
    assert all(bool(torch.isfinite(q.grad).all()) for q in embed.parameters())


def test_a_square_of_a_zero_difference_is_not_called_a_singularity():
    """x ** 2 at 0 has a gradient of 0: a pow whose base held zeros is judged only for a power below 1."""
    from ampguard.nonfinite.replay import _saved_zeros

    x = torch.zeros(3, requires_grad=True)
    assert _saved_zeros(x.pow(2).grad_fn) == [] and _saved_zeros(x.pow(torch.tensor(0.5)).grad_fn) == []
    assert _saved_zeros(x.pow(0.5).grad_fn) == [("self", 3, 3)]
    assert _saved_zeros(x.sqrt().grad_fn) == [("result", 3, 3)]


def _guarded_mean(out, double_where=False):
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0]]).expand(out.shape[0], -1)  # some counts are 0
    divisor = torch.where(counts == 0, torch.ones_like(counts), counts) if double_where else counts
    return torch.where(counts > 0, out / divisor, torch.zeros_like(out)).pow(2).mean()  # GUARDED DIV


def test_a_division_that_a_where_guards_in_the_forward_only_names_its_zero_divisors_and_the_double_where():
    """torch.where(counts > 0, x / counts, 0) is finite, and its gradient NaN: the where sends a zero gradient through
    x / 0. The message said "look for ops with unbounded gradients"; the replay counts the divisor's zeros."""
    err, message = _error_of_a_step(_guarded_mean)
    assert err.op == "torch.div" and err.origin[-1].lineno == line_of(_guarded_mean, "GUARDED DIV"), message
    assert "  In the replay its divisor was 0 at 4 of 8 elements. The gradient of torch.div is 1 / y for x / y" \
        in message, message
    assert "divide by torch.where(y == 0, 1, y) inside the where as well (the double where)" in message, message
    torch.manual_seed(0)  # the double where it names trains
    model = torch.nn.Linear(4, 4)
    with ampguard.guard():
        _guarded_mean(model(torch.rand(2, 4)), double_where=True).backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


class SqrtBlock(torch.nn.Module):
    def __init__(self, bad=False):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.bad = bad

    def forward(self, x):
        h = self.fc(x)
        return h + torch.sqrt(h * 0) if self.bad else torch.tanh(h)  # ONE LINE FOR EVERY BLOCK


@pytest.mark.parametrize("trace", ["replay", "eager"])
def test_a_nan_made_only_in_backward_names_the_module_call_not_the_line(trace):
    """Every block runs the same line: the module comes from the replayed call that made the autograd node.
    trace='eager' checks the forward's ops; the backward's are found by the same replay. Before, eager mode read the
    loss at backward(), and that read ended the window the replay needed: no origin was known."""
    ampguard.install(trace=trace)
    torch.manual_seed(0)
    model = torch.nn.Sequential(SqrtBlock(), SqrtBlock(bad=True), SqrtBlock())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    err = info.value
    assert err.sink.startswith("gradient of parameter ") and err.op == "torch.sqrt" and err.module == "1", str(err)
    assert "Its forward op is in module '1' at" in str(err)
    assert err.origin[-1].lineno == line_of(SqrtBlock.forward, "ONE LINE FOR EVERY BLOCK")


class CausalLMWithItsOwnLoss(torch.nn.Module):
    """A model that computes its loss inside forward, as Hugging Face models do when given labels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 5)

    def forward(self, x, labels):
        logits = self.lm_head(torch.tanh(self.body(x)))
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)  # LIBRARY LOSS LINE


def test_an_op_inside_a_torch_python_function_is_placed_at_the_line_that_called_that_function():
    """Every label of a batch ignored: the mean over no token is NaN, made inside F.cross_entropy's body in
    torch's functional.py. The place to name is the line that called F.cross_entropy."""
    ampguard.install()
    model = CausalLMWithItsOwnLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.full((4,), -100)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(4, 8), labels).backward()
        opt.step()
    err = info.value
    assert err.op == "aten.nll_loss_forward" and err.module == "CausalLMWithItsOwnLoss", str(err)
    assert "inside torch.nn.functional.cross_entropy" in str(err)
    assert err.origin[-1].lineno == line_of(CausalLMWithItsOwnLoss.forward, "LIBRARY LOSS LINE")
    assert "functional.py" not in str(err).split("\n")[3]  # the line under "It was created by ..."


def test_a_loss_code_op_is_replayed_with_its_keyword_arguments():
    """Every label of the batch is the one ignored: the mean over no label is NaN. The record holds the call's keyword
    arguments as given (numbers, strings and None are held without a copy); replayed with the default
    ``ignore_index=-100`` the loss would be finite, and no op would be found."""
    ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ampguard.NonFiniteError) as info:
        torch.nn.functional.cross_entropy(model(torch.randn(4, 8)), labels, ignore_index=0).backward()  # IGNORED
        opt.step()  # (the loss is gone: the replay computes it again)
    err = info.value
    assert err.op == "aten.nll_loss_forward" and err.sink == "loss", str(err)
    assert "inside torch.nn.functional.cross_entropy" in str(err)
    assert err.origin[-1].lineno == line_of(test_a_loss_code_op_is_replayed_with_its_keyword_arguments, "IGNORED")


def normalise_gradient(grad):
    return grad / grad.norm()  # a parameter no gradient reaches: 0 / 0


def test_a_nan_made_by_a_gradient_hook_names_the_hook_not_a_nondeterministic_kernel():
    """Every op's backward is finite; a hook registered on the parameter divides its zero gradient by its norm."""
    ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].bias.register_hook(normalise_gradient)
    with torch.no_grad():
        model[1].weight.zero_()  # nothing flows back to layer 0: its bias's gradient is all zero
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    err = info.value
    assert err.sink == "gradient of parameter '0.bias'" and err.op == "hook normalise_gradient", str(err)
    assert "became NaN in a hook registered on it with Tensor.register_hook" in str(err)
    assert err.origin[-1].lineno == normalise_gradient.__code__.co_firstlineno
    assert "did not reproduce" not in str(err) and "the hook made it" in str(err)


# 5. evaluation with grad enabled and no step ------------------------------------------------------
def test_eval_with_grad_and_no_step_keeps_memory_flat_over_300_forwards():
    ampguard.install()
    model = Deep().eval()
    counts = []
    for i in range(300):
        model(torch.randn(4, 8)).softmax(-1).argmax(-1)
        assert len(nonfinite.T.window) <= 3 and len(nonfinite.T.pending) <= 1
        if i in (99, 299):
            gc.collect()
            counts.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    assert counts[1] <= counts[0] + 2


# 6. a NaN made only in backward ----------------------------------------------------------------------
class SqrtAtZero(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h + torch.sqrt(h * 0)  # BACKWARD NAN


def test_a_nan_made_only_in_backward_names_the_forward_op_and_line():
    ampguard.install()
    model = SqrtAtZero()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(3, 4)).pow(2).mean()
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step()
    err = info.value
    assert err.sink == "gradient of parameter 'fc.weight'" and err.op == "torch.sqrt" and err.module == "SqrtAtZero"
    assert "The backward of torch.sqrt (SqrtBackward0) turned finite gradients into +Inf" in str(err)
    assert "Its forward op is in module 'SqrtAtZero' at" in str(err)
    assert err.origin[-1].filename == __file__
    assert err.origin[-1].lineno == line_of(SqrtAtZero.forward, "BACKWARD NAN")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is not None for p in model.parameters())  # the replay left .grad as it was


# 7. finite values never look non-finite -------------------------------------------------------------
@pytest.mark.parametrize("dtype,value", [(torch.float16, 1024.0), (torch.float16, 60000.0), (torch.float32, 1e20),
                                         (torch.float32, 3e38)])
def test_large_finite_gradients_and_parameters_are_not_errors(dtype, value):
    g = ampguard.install()
    model = torch.nn.Linear(300, 300).to(dtype)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.full_like(p, value)
        opt.step()
    nonfinite.check()
    assert g.stats.nonfinite_detected == 0


# 8. checks nobody consumed, and checks an exception made stale --------------------------------------
def test_a_backward_that_raised_under_detect_anomaly_leaves_no_check_behind():
    g = ampguard.install()
    model = SqrtAtZero()
    with pytest.raises(RuntimeError, match="returned nan values"), torch.autograd.detect_anomaly(check_nan=True):
        model(torch.randn(3, 4)).sum().backward()
    assert nonfinite.T.pending == [] and nonfinite.T.window == []
    healthy = Deep()
    opt = torch.optim.SGD(healthy.parameters(), lr=0.1)
    for _ in range(2):
        healthy(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert g.stats.nonfinite_detected == 0


def test_forward_and_backward_without_a_step_report_at_the_next_forward():
    ampguard.install()
    model = Student()
    model(torch.randn(2, 8)).sum().backward()  # NaN: log of negative values; no step
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(2, 8))
    assert info.value.op == "torch.log"


def test_a_check_nobody_consumed_is_read_at_guard_exit():
    with pytest.raises(ampguard.NonFiniteError) as info, ampguard.guard():
        _held = Student()(torch.randn(2, 8))  # no loss follows: the output is read while it is held
    assert info.value.op == "torch.log"


def test_a_check_belongs_to_its_guard():
    outer = ampguard.install()
    model = Student()
    _held = model(torch.randn(2, 8))  # NaN, pending in the outer guard while the output is held
    with ampguard.guard(nonfinite="off"):
        _held2 = model(torch.randn(2, 8))
    assert outer.stats.nonfinite_detected == 0  # the inner guard neither read nor raised it
    with pytest.raises(ampguard.NonFiniteError):
        ampguard.uninstall()


# 9. compiled modules --------------------------------------------------------------------------------
class SqrtNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.sqrt(self.fc(x) - 10.0)  # COMPILED SQRT


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_nan_inside_a_compiled_module_names_the_op_inside_it(backend):
    ampguard.install()
    torch._dynamo.reset()
    model = SqrtNet()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        compiled(torch.randn(4, 8)).sum().backward()
        opt.step()
    err = info.value
    assert err.op == "torch.sqrt" and err.module == "SqrtNet"
    assert err.origin[-1].lineno == line_of(SqrtNet.forward, "COMPILED SQRT")


# 10. the eager message ----------------------------------------------------------------------------------
def test_the_eager_message_reads_well():
    ampguard.install(trace="eager")
    with pytest.raises(ampguard.NonFiniteError) as info:
        SqrtNet()(torch.randn(2, 8))
    message = str(info.value)
    assert message.startswith("ampguard: torch.sqrt created NaN from inputs without NaN in module 'SqrtNet' at")
    assert "the the" not in message


# the replay's own rules ------------------------------------------------------------------------------------
class NanOnFirstCall(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.fc(x)
        return h * float("nan") if self.calls == 1 else h


def test_a_value_that_does_not_reproduce_is_reported_as_such():
    ampguard.install()
    model = NanOnFirstCall()
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(2, 4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    message = str(info.value)
    assert "stayed finite: the value did not reproduce" in message
    assert info.value.op is None


def test_a_gradient_changed_after_backward_is_not_blamed_on_the_backward_pass():
    """Code between backward() and the step wrote the inf (gradient surgery, noise, a manual rescale): the
    replayed backward is finite, so the message names that cause first and does not claim the backward made it."""
    ampguard.install()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(2, 4)).pow(2).mean().backward()
        model[0].weight.grad.fill_(float("inf"))
        opt.step()
    message = str(info.value)
    assert info.value.sink == "gradient of parameter '0.weight'" and info.value.op is None
    assert "the replayed backward stayed finite" in message
    assert "Causes: code that changed the gradient after backward() and before the step" in message
    assert "the backward pass made it" not in message


class PaddedEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, ids, pad):
        h = self.emb(ids)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)  # PADDED ATTENTION
        return self.out(a).squeeze(-1)


def test_a_nan_the_forward_made_and_the_loss_dropped_is_named_in_the_forward_not_blamed_on_the_backward():
    """A sequence that is all padding: its attention row is softmax over nothing but -inf, NaN. The loss leaves the
    padded positions out, so it is finite, but the output layer's backward multiplies their zero gradients by the
    NaN activations it saved: NaN gradients, which no backward op made."""
    ampguard.install()
    model = PaddedEncoder()
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[2] = True
    with pytest.raises(ampguard.NonFiniteError) as info:
        out = model(ids, pad)
        out[~pad].pow(2).mean().backward()  # DROPS THE PADDING
        opt.step()
    message = str(info.value)
    here = test_a_nan_the_forward_made_and_the_loss_dropped_is_named_in_the_forward_not_blamed_on_the_backward
    dropped = line_of(here, "DROPS THE PADDING")
    assert f"  Tensor.__getitem__ at {__file__}:{dropped} took that value and returned finite values, so the loss " \
        "stayed finite; the backward of MmBackward0" in message, message
    assert info.value.sink.startswith("gradient of parameter ") and info.value.module == "attn"
    # The key padding mask's -Inf is all the -Inf the scores hold: the softmax of a fully masked row made the NaN
    assert "The forward made it: aten._softmax inside torch.nn.functional.multi_head_attention_forward created NaN " \
        "(inputs finite but for a mask) in module 'attn'" in message, message
    assert "was not counted as a cause: the mask made by torch.nn.functional.multi_head_attention_forward at " \
        f"{__file__}:{line_of(PaddedEncoder.forward, 'PADDED ATTENTION')}." in message, message
    assert "-Inf that masks put there (depending on no parameter, as attention masks do)" in message, message
    assert "the backward of MmBackward0 met NaN among the values the forward saved, and finite gradients times it " \
        "gave NaN (anything times NaN is NaN)" in message
    assert "the backward pass made it" not in message
    assert info.value.origin[-1].line.endswith("# PADDED ATTENTION")


class Saturating(torch.nn.Module):
    """A feature that is Inf in the data (log(0) in preprocessing) through a tanh: the loss stays finite, the
    backward multiplies the tanh's zero gradient by the Inf the first layer saved: NaN gradients."""

    def __init__(self, pre=False):
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(6, 6) if pre else torch.nn.Identity()
        self.body = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.pre(x))))  # SATURATED


def _saturated_step(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).pow(2).mean().backward()
    opt.step()


def test_an_inf_in_the_data_that_a_tanh_hides_from_the_loss_is_named_as_the_data_not_as_an_op_that_made_it():
    """It was reported as "aten.addmm ... created +Inf, -Inf (inputs finite)": the Inf was the data's."""
    model = Saturating()
    x = torch.randn(4, 6)
    x[1, 2] = float("inf")
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        _saturated_step(model, x)
    err, message = info.value, str(info.value)
    assert err.sink == "gradient of parameter 'body.weight'" and err.op is None, message
    assert "The forward met it: it entered already non-finite (+Inf): argument 0 of the call of 'Saturating'" \
        in message, message
    assert "an input of aten.addmm inside torch.linear in module 'body'" in message, message
    assert "(inputs finite)" not in message and "The forward made it" not in message
    assert "the backward of AddmmBackward0 met +Inf among the values the forward saved" in message
    assert f"  torch.tanh at {__file__}:{line_of(Saturating.forward, 'SATURATED')} took that value and returned " \
        "finite values" in message, message
    assert "torch.tanh hides it from the loss, not from the backward" in message, message
    assert "the backward pass made it" not in message
    assert "input: shape (4, 6), torch.float32; 0 NaN, 1 +Inf, 0 -Inf of 24 elements" in message, message


def test_a_nan_in_the_data_that_nan_to_num_hides_from_the_loss_names_the_nan_to_num_and_its_line():
    """A NaN feature (log of a negative in preprocessing, in a DataLoader worker, which ampguard leaves alone) and a
    loss that patches the output with nan_to_num: the loss is finite, the weight's gradient NaN. The message named
    a saturating op or a mask as the likely hider; the replay knows which op it was."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    x[1, 2] = float("nan")
    logged = []
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        out = model(x)
        logged.append(torch.where(torch.isnan(out), 0.0, out).detach().mean())  # (finite, from the NaN, off the path)
        out.nan_to_num().pow(2).mean().backward()  # PATCHED
        opt.step()
    message = str(info.value)
    patched = line_of(test_a_nan_in_the_data_that_nan_to_num_hides_from_the_loss_names_the_nan_to_num_and_its_line,
                      "PATCHED")
    assert "The forward met it: it entered already non-finite (NaN): argument 0 of the call of 'Sequential'" \
        in message, message
    assert f"  Tensor.nan_to_num at {__file__}:{patched} took that value and returned finite values, so the loss " \
        "stayed finite; the backward of AddmmBackward0 met NaN" in message, message
    assert "Tensor.nan_to_num hides it from the loss, not from the backward" in message, message
    assert "torch.where" not in message and "saturat" not in message, message


def test_an_inf_parameter_that_a_tanh_hides_from_the_loss_is_named_with_the_step_that_ran_on_it():
    model = Saturating(pre=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        for _ in range(2):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model.body.weight[0, 0] = float("inf")  # set by hand after the step
    err, message = info.value, str(info.value)
    assert err.sink == "gradient of parameter 'pre.weight'" and err.op is None, message
    assert "The forward met it: it entered already non-finite (+Inf): parameter 'body.weight', an input of " \
        "aten.t inside torch.linear in module 'body'" in message, message
    assert "The optimizer step of SGD#0 ran on it after its last check" in message, message


def test_an_inf_in_every_batch_that_a_tanh_hides_is_named_after_the_scalers_skips_as_an_input():
    """Under a GradScaler every step is skipped; the scale-1 replays find the same NaN. It is not an overflow, and
    the message says a non-finite input made it, not an op of the forward."""
    ampguard.install()
    model = Saturating()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 6)
    x[:, 2] = float("inf")  # (-Inf alone, from no parameter, is taken for an attention mask: see walk())
    with pytest.raises(ampguard.NonFiniteError) as info:
        for _ in range(10):
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    err, message = info.value, str(info.value)
    assert err.sink == "gradients at every loss scale", message
    assert "GradScaler skipped 4 optimizer steps in a row" in message
    assert "The forward met it: it entered already non-finite (+Inf): argument 0 of the call of 'Saturating'" \
        in message, message
    assert "The loss was finite: a non-finite input of the forward did (above)." in message, message


def test_a_nan_gradient_without_a_replay_is_still_described():
    """trace='off' (or no module call with gradients): the message says no origin is known and describes the
    gradient. It once failed on its own variable and said "ampguard could not replay it ... freed before the check"."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard(trace="off"), pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(2, 4)).sum().backward()
        model.weight.grad.fill_(float("nan"))
        opt.step()
    message = str(info.value)
    assert info.value.sink == "gradient of parameter 'weight'" and info.value.module is None
    assert "No origin is known (trace='off')." in message and "could not replay" not in message
    assert "4 NaN" in message


def test_two_models_that_share_parameter_names_are_told_apart_by_class_and_call_site():
    """A GAN's generator and critic, both Sequential: '0.weight' alone would not say whose gradient failed."""
    ampguard.install()
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    D = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt_d = torch.optim.SGD(D.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        fake = G(torch.randn(2, 4))
        score = D(fake.detach())  # THE CRITIC
        (score - score.detach()).abs().sqrt().sum().backward()  # sqrt at 0: an infinite gradient, NaN after
        opt_d.step()
    test = test_two_models_that_share_parameter_names_are_told_apart_by_class_and_call_site
    at = f"{__file__}:{line_of(test, 'THE CRITIC')}"
    assert info.value.sink == f"gradient of parameter '0.weight' of the Sequential called at {at}"
    assert info.value.op == "torch.sqrt"


class TiedLM(torch.nn.Module):
    """A language model whose output head shares the embedding's weight (GPT-2, T5)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.body(self.emb(idx))))


def test_a_tied_weight_is_named_by_every_name_it_has():
    model = TiedLM()
    with torch.no_grad():
        model.emb.weight[3, 0] = float("inf")  # a row no token of the batch looks up: it enters through the head
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard():
        logits = model(torch.tensor([[1, 2, 4]]))
        torch.nn.functional.cross_entropy(logits.view(-1, 10), torch.tensor([1, 2, 3])).backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    assert "parameter 'emb.weight' (tied: also 'head.weight'), an input of aten.t inside torch.linear in module " \
           "'head'" in str(info.value), str(info.value)


def test_a_submodule_called_on_its_own_is_named_by_its_path_in_the_model_that_holds_it():
    """A model's head called apart from its body (and the body by itself): a module in the head reads
    'head.1', as the model's own named_modules() gives it, not '1'."""
    ampguard.install()
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))

        def forward(self, x):
            return self.head(self.body(x))

    model = Model()
    model(torch.randn(2, 4))  # once whole: the model is known
    model.head[1].register_forward_hook(lambda m, a, out: out * float("nan"))
    with pytest.raises(ampguard.NonFiniteError) as info:
        features = model.body(torch.randn(2, 4))
        model.head(features).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert info.value.module == "head.1" and info.value.op == "Tensor.mul"


class DropoutBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return torch.log(self.drop(self.bn(self.fc(x))))  # NaN where negative


def _run_dropout_bn(guarded):
    torch.manual_seed(123)
    model = DropoutBatchNorm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = ampguard.guard(nonfinite="warn") if guarded else torch.autograd.set_grad_enabled(True)
        with ctx:
            for _ in range(3):  # no step: each check is read at the next forward, the last at guard exit
                model(torch.randn(16, 8)).sum().backward()
                model.zero_grad()
    ours = [w for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]
    return model.bn.running_mean.clone(), model.bn.num_batches_tracked.clone(), torch.rand(3), ours


def test_a_replay_leaves_rng_and_running_stats_as_they_would_have_been():
    plain_mean, plain_count, plain_rng, _ = _run_dropout_bn(guarded=False)
    mean, count, rng, warned = _run_dropout_bn(guarded=True)
    assert len(warned) == 1 and "created by torch.log" in str(warned[0].message)  # replayed once per site
    assert torch.equal(mean, plain_mean) and torch.equal(count, plain_count) and torch.equal(rng, plain_rng)


class OwnNoise(torch.nn.Module):
    """Draws noise from a generator of its own, and from one it is given (``generator=``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 1)
        self.gen = torch.Generator().manual_seed(123)

    def forward(self, x, generator=None):
        h = torch.relu(self.l1(x)) + 0.1 * torch.randn(64, generator=self.gen)
        h = h * (1 + 0.01 * random.random()) * (1 + 0.01 * numpy.random.rand())  # Python's and NumPy's RNGs too
        return self.l2(h + 0.1 * torch.randn(h.shape, generator=generator))


def _noisy_fp16_run(guarded):
    model, given = OwnNoise(), torch.Generator().manual_seed(7)
    random.seed(0)
    numpy.random.seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)  # a calibration streak: replayed at its 3rd skip
    data = torch.Generator().manual_seed(1)
    with ampguard.guard() if guarded else contextlib.nullcontext() as g:
        for _ in range(30):
            x, y = torch.randn(8, 16, generator=data), torch.randn(8, 1, generator=data)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x, generator=given) - y) ** 2).mean() * 10
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, torch.randn(2, generator=model.gen), torch.randn(2, generator=given), g, random.random(), \
        numpy.random.rand()


def test_a_replay_in_a_run_that_goes_on_leaves_the_generators_a_call_draws_from_as_they_were():
    plain = _noisy_fp16_run(False)
    guarded = _noisy_fp16_run(True)
    assert guarded[3].stats.optimizer_steps_skipped >= 3 and guarded[3].stats.optimizer_steps_applied > 0
    assert all(torch.equal(a, b) for a, b in zip(plain[:3], guarded[:3], strict=True))
    assert plain[4:] == guarded[4:]


class CountsAndKeeps(torch.nn.Module):
    """Counts its calls and keeps what it computed, as a forward that logs attention maps does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)
        self.calls = 0
        self.maps = []  # attention maps kept for a plot
        self.seen = collections.Counter(rows=0)  # a curriculum's count
        self.recent = collections.deque(maxlen=2)
        self.shapes = set()

    def forward(self, x):
        self.calls += 1
        h = self.proj(x)
        self.last = h
        self.maps.append(h)
        self.seen["rows"] += len(x)
        self.recent.append(h)
        self.shapes.add(("replayed",) if ampguard.replaying() else tuple(x.shape))
        return h.log()  # NaN where h < 0


def test_a_replay_leaves_the_modules_attributes_as_the_users_forward_left_them():
    """Under nonfinite='warn' the run goes on after a replay: the replay's call is not counted, and the module keeps
    the user's tensor, not the replay's (with its graph). Its lists, dicts, deques and sets hold what the user's
    call put there: the replay's call appended and counted into them too."""
    model = CountsAndKeeps()
    with ampguard.guard(nonfinite="warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(torch.randn(3, 4))
        kept = model.last
        out.sum().backward()
        nonfinite.check()
    assert any("created by Tensor.log" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert model.calls == 1 and model.last is kept
    assert len(model.maps) == 1 and model.maps[0] is kept, model.maps
    assert model.seen == {"rows": 3} and list(model.recent) == [kept] and model.recent.maxlen == 2
    assert model.shapes == {(3, 4)}
    assert model._forward_hooks == {} and dict(model.proj.named_parameters()).keys() == {"weight", "bias"}


def _temperature_hook(module, inputs, output):
    return output.log()  # A HOOK ON THE MODEL ITSELF


def _scale_inputs_hook(module, inputs):
    return (inputs[0] * torch.tensor(float("inf")),)  # A PRE-HOOK ON THE MODEL ITSELF


@pytest.mark.parametrize("hook", ["forward", "pre"])
def test_the_hooks_of_the_model_itself_run_in_the_replay(hook):
    """A hook registered on the model (not on one of its layers) that post-processes its output or pre-processes its
    input is part of the call: the replay runs it, and names its line, rather than finding that the NaN 'did not
    reproduce'."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if hook == "forward":
        model.register_forward_hook(_temperature_hook)
        fn, marker = _temperature_hook, "A HOOK ON THE MODEL ITSELF"
    else:
        model.register_forward_pre_hook(_scale_inputs_hook)
        fn, marker = _scale_inputs_hook, "A PRE-HOOK ON THE MODEL ITSELF"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard():
        model(torch.randn(3, 4)).pow(2).mean().backward()
        with pytest.raises(ampguard.NonFiniteError) as info:
            opt.step()
    err = info.value
    assert "did not reproduce" not in str(err), str(err)
    assert err.origin is not None and err.origin[-1].lineno == line_of(fn, marker), str(err)


class NegatesInItsCall(torch.nn.Module):
    """Overrides ``__call__`` to transform its input before torch's call, as some codebases do."""

    def __call__(self, x):
        return super().__call__(-x)

    def forward(self, x):
        return torch.sqrt(x)  # NaN: the call negated a positive input


def test_a_call_the_class_overrides_is_not_applied_twice_in_the_replay():
    """ampguard records the arguments torch's call received, past the class's own ``__call__``: the replay runs
    torch's call with them, not the override again (which would undo the negation, and the NaN 'did not reproduce')."""
    model = NegatesInItsCall()
    with ampguard.guard():
        out = model(torch.rand(4) + 0.5)
        with pytest.raises(ampguard.NonFiniteError) as info:
            nonfinite.check()
    del out
    assert info.value.op == "torch.sqrt" and "did not reproduce" not in str(info.value), str(info.value)


def test_a_module_that_opts_out_is_not_replayed():
    ampguard.install()
    model = Student()
    model.ampguard_replay = False
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(2, 8)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert "opts out (ampguard_replay = False)" in str(info.value) and info.value.op is None


def test_lightning_style_closure_is_checked_before_the_update():
    ampguard.install()
    model = Student()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(2, 8)).sum()
        loss.backward()
        return loss

    with pytest.raises(ampguard.NonFiniteError) as info:
        opt.step(closure)
    assert info.value.op == "torch.log"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_loss_code_op_is_replayed_under_the_autocast_it_ran_under():
    """The record keeps each loss-code op's autocast state: replayed in float32, this matmul is finite."""
    ampguard.install()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prototypes = torch.full((8, 4), 1e5)  # float32 here; 1e5 is past float16's 65504

    def loss_code(out):
        scores = out @ prototypes  # AUTOCAST LINE: autocast casts the prototypes to float16: inf
        return scores.float().softmax(-1).log().mean()

    with pytest.raises(ampguard.NonFiniteError) as info:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_code(model(torch.randn(4, 8)))
        loss.backward()
        opt.step()
    err = info.value
    assert err.sink == "loss" and err.op == "aten._to_copy", str(err)  # the cast to float16
    assert "created by aten._to_copy inside Tensor.matmul" in str(err), str(err)
    assert err.origin[-1].lineno == line_of(loss_code, "AUTOCAST LINE"), str(err)


def test_a_loss_check_read_at_the_next_forward_says_so_and_one_read_at_the_step_does_not():
    ampguard.install()
    model = Student()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(2, 8)).sum()  # NaN: log of negative values
    loss.backward()
    if not torch.isfinite(loss):  # the loop skips the step itself
        opt.zero_grad()
    with pytest.raises(ampguard.NonFiniteError) as late:
        model(torch.randn(2, 8))  # the next batch's forward reads the skipped batch's check
    assert "Read at this module call: no optimizer step came between that loss's backward() and this forward" \
        in str(late.value)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(ampguard.NonFiniteError) as at_step:
        opt.step()
    assert late.value.op == at_step.value.op == "torch.log"
    assert "Read at this module call" not in str(at_step.value)


# a call that writes into its own input ------------------------------------------------------------------------
class FlipsItsInput(torch.nn.Module):
    """Writes into the caller's batch, as an in-place normalisation does: by the check the batch holds the written
    value, so a replay from it takes the other branch of the sign."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x):
        x.mul_(-1)  # FLIP LINE
        return self.fc(x.sqrt())


def test_a_call_that_writes_into_its_input_is_named_when_the_value_does_not_reproduce():
    ampguard.install()
    model = FlipsItsInput()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.rand(8, 4)).pow(2).mean().backward()  # flipped to negative: sqrt is NaN
        opt.step()
    message = str(info.value)
    assert "did not reproduce" in message, message
    assert "The call writes into its input in place: argument 0 of the call of 'FlipsItsInput' is changed by " \
        f"Tensor.mul_ at\n    {__file__}:{line_of(FlipsItsInput.forward, 'FLIP LINE')} in forward" in message, message
    assert "the likely reason it did not reproduce" in message, message


class NormalisesItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        x.sub_(0.5).div_(2.0)  # NORMALISE LINE
        h = self.fc(x)
        return self.head((h - h.min().detach()).log())  # LOG LINE: log(0) at the minimum


def test_a_call_that_writes_into_its_input_is_named_beside_an_origin_found_from_the_written_value():
    ampguard.install()
    model = NormalisesItsInput()
    with pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.rand(8, 4)).pow(2).mean().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    err = info.value
    assert err.op == "Tensor.log", str(err)
    assert "argument 0 of the call of 'NormalisesItsInput' is changed by Tensor.sub_ at" in str(err), str(err)
    assert "Tensor.div_" not in str(err)  # the first write names the input; one line per input
    assert "the origin above is where that value became non-finite" in str(err), str(err)


@dataclasses.dataclass
class TokenBatch:
    ids: torch.Tensor
    mask: torch.Tensor
    name: str = "batch"


class MasksItsBatch(torch.nn.Module):
    """Takes its batch as a dataclass, and scales the mask in place, as a collator's output is often reused."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, batch):
        batch.mask.mul_(2.0)  # WRITE LINE
        return self.head((self.emb(batch.ids) * batch.mask[..., None]).mean(1))


class Encoding(collections.UserDict):
    """A tokenizer's batch as Hugging Face's BatchEncoding is: a UserDict whose keys read as attributes too."""

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


@pytest.mark.parametrize("kind", ["dataclass", "UserDict"])
def test_a_nan_in_a_batch_object_is_named_by_its_field_and_the_replay_writes_into_none_of_its_tensors(kind):
    """A field of a dataclass argument (an item of a BatchEncoding) was named "a tensor made outside the replayed
    calls", and the replay ran the forward on the user's own tensors: its in-place write scaled the user's mask a
    second time."""
    model = MasksItsBatch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.ones(3, 5)
    mask[1, 2] = float("nan")
    ids = torch.randint(0, 20, (3, 5))
    batch = TokenBatch(ids, mask) if kind == "dataclass" else Encoding(ids=ids, mask=mask, name="batch")
    with ampguard.guard(nonfinite="warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(batch).pow(2).mean().backward()
        opt.step()
    message = next(str(w.message) for w in caught if issubclass(w.category, ampguard.AmpGuardWarning))
    field = "field 'mask'" if kind == "dataclass" else "item 'mask'"
    assert f"It entered already non-finite (NaN): argument 0 of the call of 'MasksItsBatch', {field} (the data" \
        in message, message
    assert f"The call writes into its input in place: argument 0 of the call of 'MasksItsBatch', {field} is " \
        f"changed by Tensor.mul_ at\n    {__file__}:{line_of(MasksItsBatch.forward, 'WRITE LINE')}" in message, message
    assert batch.mask is mask and mask[0, 0] == 2.0 and batch.name == "batch"  # written once, by the user's call


def test_loss_code_that_writes_into_its_target_is_named():
    ampguard.install()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_code(out, target):
        target.mul_(-1)  # TARGET LINE
        return (out - target.sqrt()).pow(2).mean()

    target = torch.rand(8, 1)  # the data, made before the model call: an input of the loss code
    with pytest.raises(ampguard.NonFiniteError) as info:
        loss_code(model(torch.randn(8, 4)), target).backward()
        opt.step()
    message = str(info.value)
    assert "did not reproduce" in message, message
    assert f"an input of the loss code is changed by Tensor.mul_ at\n    {__file__}:" \
        f"{line_of(loss_code, 'TARGET LINE')} in loss_code" in message, message


def test_a_call_that_writes_only_into_its_own_tensors_names_no_input():
    """x = x * 2; x.add_(1): the write is into a tensor the call made, not into its input."""
    ampguard.install()

    class Own(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            y.add_(1)
            return (y - 3).log()

    x = torch.rand(4, 4, requires_grad=True)
    with pytest.raises(ampguard.NonFiniteError) as info:
        Own()(x).sum().backward()
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()
    assert info.value.op == "Tensor.log" and "writes into its input" not in str(info.value), str(info.value)


# a loop that computes its gradients with torch.autograd.grad and sets .grad itself ---------------------------------
def _grad_step(model, opt, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()


def test_a_loop_of_autograd_grad_trains_as_without_ampguard():
    runs = []
    for guarded in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with ampguard.guard() if guarded else warnings.catch_warnings():
            for i in range(4):
                x = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
                _grad_step(model, opt, model(x).pow(2).mean())
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_backward_nan_in_a_loop_of_autograd_grad_names_the_forward_op():
    """No backward() runs: the replay found no loss, fell back to the model's outputs, and crashed on the graph the
    replayed torch.autograd.grad had freed ("could not replay it: ... backward through the graph a second time")."""
    ampguard.install()
    model = SqrtAtZero()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ampguard.NonFiniteError) as info:
        _grad_step(model, opt, model(torch.randn(3, 4)).pow(2).mean())
    err = info.value
    assert err.sink == "gradient of parameter 'fc.weight'" and err.op == "torch.sqrt", str(err)
    assert "could not replay" not in str(err) and "loss code was not recorded" not in str(err), str(err)
    assert err.origin[-1].lineno == line_of(SqrtAtZero.forward, "BACKWARD NAN")


def test_a_forward_nan_in_a_loop_of_autograd_grad_reaches_the_loss_sink():
    """The loss torch.autograd.grad differentiates is a loss sink, as backward()'s is: the forward NaN is named as
    one, not as gradients whose loss 'stayed finite'."""
    ampguard.install()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_code(out):
        return (out - out.max().detach() - 1).log().mean()  # LOG LINE: log of negative values

    with pytest.raises(ampguard.NonFiniteError) as info:
        _grad_step(model, opt, loss_code(model(torch.randn(6, 4))))
    err = info.value
    assert err.sink == "loss" and err.op == "Tensor.log", str(err)
    assert err.origin[-1].lineno == line_of(loss_code, "LOG LINE")
    assert "stayed finite" not in str(err)


def test_torch_autograd_grad_on_fake_tensors_is_left_alone():
    """Tracing code calls torch.autograd.grad on fake tensors (AOTAutograd does, and torch 2.6 does not say it is
    compiling then): their value cannot be read, so they are no loss sink, and the feature stays on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = ampguard.install()
    with FakeTensorMode():
        w = torch.randn(3, requires_grad=True)
        (grad,) = torch.autograd.grad((w * 2).sum(), [w])
    assert grad.shape == (3,)
    assert "nonfinite" in g._on


# the loss code's tensor properties and copies ----------------------------------------------------------
class Clip(torch.nn.Module):
    """CLIP's two encoders and learnable temperature; the loss is the symmetric cross-entropy of its pseudo-code."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(8, 4)
        self.text = torch.nn.Linear(8, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))  # log(1 / 0.07)


def clip_step(model, opt, images, texts, hotter=1.0):
    a = torch.nn.functional.normalize(model.image(images), dim=-1)
    b = torch.nn.functional.normalize(model.text(texts), dim=-1)
    logits = (model.logit_scale * hotter).exp() * a @ b.T  # EXP LINE
    target = torch.arange(len(images))
    loss = (torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(logits.T, target)) / 2
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_a_contrastive_loss_on_logits_T_trains_as_without_ampguard_and_its_nan_is_replayed():
    """``logits.T`` is read through a property, which the loss code's record skipped: the transposed logits, which
    the user never holds, were freed before the check, and the NaN could not be replayed ("an input of the loss
    code was freed")."""
    images, texts = torch.randn(6, 8), torch.randn(6, 8)
    plain = Clip()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    reference = [clip_step(plain, opt, images, texts) for _ in range(3)]
    guarded = Clip()
    opt = torch.optim.SGD(guarded.parameters(), lr=0.1)
    with ampguard.guard():
        assert [clip_step(guarded, opt, images, texts) for _ in range(3)] == reference
        with pytest.raises(ampguard.NonFiniteError) as info:
            clip_step(guarded, opt, images, texts, hotter=100.0)  # exp(266) overflows float32
    message = str(info.value)
    assert "It was created by Tensor.exp (inputs finite, output +Inf) at\n" \
        f"    {__file__}:{line_of(clip_step, 'EXP LINE')} in clip_step" in message, message
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), guarded.parameters(), strict=True))


def test_a_loss_on_a_clone_of_the_output_is_replayed():
    """``clone`` was skipped by the loss code's record as a copy: an op on the clone had an input the record did not
    know, freed before the check."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_code(out, y):
        return torch.nn.functional.mse_loss(out.clone().log(), y)  # LOG LINE

    torch.manual_seed(0)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        loss_code(model(torch.randn(16, 4)), torch.randn(16, 1)).backward()  # negative outputs: log makes NaN
        opt.step()
    message = str(info.value)
    assert f"It was created by Tensor.log (inputs finite, output NaN) at\n    {__file__}:" \
        f"{line_of(loss_code, 'LOG LINE')} in loss_code" in message, message


def masked_step(model, opt, x, y, mask):
    scores = model(x)
    scores[mask] = float("-inf")  # MASK LINE
    loss = torch.nn.functional.cross_entropy(scores, y)  # LOSS LINE
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_a_masked_assignment_in_the_loss_code_is_replayed_and_a_fully_masked_row_is_named():
    """``scores[mask] = -inf`` returns nothing, and the loss code's record kept only calls that return a tensor: the
    replay ran the loss without the write and reported that the NaN "did not reproduce" (a nondeterministic kernel,
    a hardware fault), which was false."""
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 4, 0, 1])
    mask = torch.zeros(6, 5, dtype=torch.bool)
    mask[:, 3] = True  # class 3 is never allowed
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 5)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    reference = [masked_step(plain, opt, x, y, mask) for _ in range(3)]
    torch.manual_seed(0)
    guarded = torch.nn.Linear(8, 5)
    opt = torch.optim.SGD(guarded.parameters(), lr=0.1)
    with ampguard.guard():
        assert [masked_step(guarded, opt, x, y, mask) for _ in range(3)] == reference
        mask[0] = True  # a row with every class masked: log_softmax of -inf everywhere is NaN
        with pytest.raises(ampguard.NonFiniteError) as info:
            masked_step(guarded, opt, x, y, mask)
    message = str(info.value)
    assert "did not reproduce" not in message, message
    # the row the mask covers everywhere is where the NaN is made; the mask is named with its line
    assert "It was created by aten._log_softmax inside torch.nn.functional.cross_entropy (inputs finite but for a " \
        f"mask, output NaN, -Inf) at\n    {__file__}:{line_of(masked_step, 'LOSS LINE')} in masked_step" \
        in message, message
    assert f"the mask made by Tensor.__setitem__ at {__file__}:{line_of(masked_step, 'MASK LINE')}." in message, message
    assert torch.equal(plain.weight, guarded.weight)  # the failed step applied nothing


def test_a_nan_constant_in_the_loss_code_is_called_a_constant():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_code(out):
        return out.pow(2).mean() + torch.tensor(float("nan"))  # CONSTANT LINE

    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        loss_code(model(torch.randn(8, 4))).backward()
        opt.step()
    message = str(info.value)
    assert "It entered already non-finite (NaN): a constant in your code (a Python number or a tensor literal), " \
        f"given to torch.tensor at\n    {__file__}:{line_of(loss_code, 'CONSTANT LINE')} in loss_code" in message, \
        message
    assert "No replayed op produced that input" not in message


# a module's own forward pre-hooks: the replay calls the module with its hooks, so it starts from the arguments
# as the call was made, not from what the hooks returned (they would run twice) ------------------------------
class Rooted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, shift=None):
        if shift is not None:
            x = x + shift
        return self.lin(x.sqrt())  # ROOTED SQRT


def _hooked_run(hook, with_kwargs, steps, guarded):
    model = Rooted()
    model.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    batches = [torch.rand(4, 8) + 0.5 for _ in range(steps)]
    losses = []
    with ampguard.guard() if guarded else contextlib.nullcontext():
        for x in batches:
            loss = model(x, shift=torch.zeros(8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, model


def _scaled(module, args):
    return (args[0] * 0.5,)


def _hook_sqrt(module, args):
    return (args[0] - 1.0).sqrt(),  # HOOK SQRT


def _negated(module, args):
    return (-args[0],)


def _negated_shift(module, args, kwargs):
    return args, {**kwargs, "shift": -2.0 - kwargs["shift"]}  # (twice would give the shift back)


def test_a_root_whose_pre_hook_rescales_its_input_trains_bit_identically():
    plain, plain_model = _hooked_run(_scaled, False, 3, guarded=False)
    guarded, guarded_model = _hooked_run(_scaled, False, 3, guarded=True)
    assert guarded == plain
    assert torch.equal(plain_model.lin.weight, guarded_model.lin.weight)


@pytest.mark.parametrize(("hook", "with_kwargs", "func", "marker"), [
    (_hook_sqrt, False, _hook_sqrt, "HOOK SQRT"),  # the hook itself makes the NaN from a finite input
    (_negated, False, Rooted.forward, "ROOTED SQRT"),  # the forward makes it from what the hook returned
    (_negated_shift, True, Rooted.forward, "ROOTED SQRT"),  # ... from a keyword argument the hook changed
], ids=["nan made in the pre-hook", "pre-hook negates the input", "kwargs pre-hook changes an argument"])
def test_a_nan_after_a_roots_own_pre_hook_is_named_where_it_was_made(hook, with_kwargs, func, marker):
    with pytest.raises(ampguard.NonFiniteError) as info:
        _hooked_run(hook, with_kwargs, 1, guarded=True)
    err, message = info.value, str(info.value)
    assert err.op == "Tensor.sqrt", message
    assert "It was created by Tensor.sqrt (inputs finite, output NaN)" in message, message
    assert err.origin[-1].lineno == line_of(func, marker), message
    assert "did not reproduce" not in message and "entered already non-finite" not in message, message


# a metric module called in the loss code ----------------------------------------------------------------------
def _metric_loop(bad_at):
    torchmetrics = pytest.importorskip("torchmetrics")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    running = torchmetrics.MeanMetric()  # drops NaN values by default, with a warning
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        logits = model(x)
        accuracy(logits, y)
        if i == bad_at:
            logits = logits + torch.log(torch.zeros(1) - 1)  # METRIC LOOP NAN
        loss = torch.nn.functional.cross_entropy(logits, y)
        running(loss.detach())  # a running mean of the loss, before backward
        opt.zero_grad()
        loss.backward()
        opt.step()
    return running.compute().item(), accuracy.compute().item(), model


def test_a_nan_loss_that_a_running_mean_metric_also_sees_is_named_where_the_loss_code_made_it():
    """MeanMetric drops the NaN and divides 0 by 0 for the batch: its output is NaN as well, and it was read first
    (its sink came first): the message named MeanMetric's division, "inputs finite", not the loss code's log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torchmetrics warns of the NaN it drops)
        reference = _metric_loop(bad_at=None)
        with ampguard.guard():
            guarded = _metric_loop(bad_at=None)
            with pytest.raises(ampguard.NonFiniteError) as info:
                _metric_loop(bad_at=1)
    assert guarded[:2] == reference[:2]
    assert all(torch.equal(p, q) for p, q in zip(reference[2].parameters(), guarded[2].parameters(), strict=True))
    err, message = info.value, str(info.value)
    assert err.sink == "loss" and err.op == "torch.log", message
    assert err.origin[-1].lineno == line_of(_metric_loop, "METRIC LOOP NAN"), message
    assert "MeanMetric" not in message, message


class NaNTeacher(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x).sqrt()  # TEACHER SQRT


def test_a_teacher_whose_output_is_nan_before_the_loss_is_made_is_the_sink_reported():
    """The loss it reaches fails too, but the loss code got the teacher's output through code not recorded (its
    softmax ran before the student's call): the teacher's own output, made first, is what names the origin."""
    student, teacher = Student(), NaNTeacher()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        with torch.no_grad():
            soft = teacher(x).softmax(-1)
        log_p = student(x).clamp_min(-10).nan_to_num(0.0)  # the student is fine
        torch.nn.functional.kl_div(log_p, soft, reduction="batchmean").backward()
        opt.step()
    err, message = info.value, str(info.value)
    assert err.sink == "output of module 'NaNTeacher'" and err.op == "Tensor.sqrt", message
    assert err.origin[-1].lineno == line_of(NaNTeacher.forward, "TEACHER SQRT"), message


class Retried(torch.nn.Module):
    """Runs out of memory above four rows, as a model does on a batch too large for the device."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
        self.bad = False

    def forward(self, x):
        if x.shape[0] > 4:
            raise OutOfMemory("too large a batch")
        h = self.a(x)
        return self.b(h.sqrt() if self.bad else torch.relu(h))  # RETRIED SQRT


def _retry_on_oom(guarded, bad_at=None, steps=4):
    """The loop that retries half the batch after an out-of-memory error; each step's first call raises."""
    model = Retried()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses, modes = [], []
    with ampguard.guard() if guarded else contextlib.nullcontext():
        for i in range(steps):
            model.bad = i == bad_at
            x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
            try:
                out = model(x)
            except OutOfMemory:
                modes.append(len(torch.overrides._get_current_function_mode_stack()))
                x, y = x[:4], y[:4]
                out = model(x)  # RETRY CALL
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], modes


def test_a_call_that_raised_and_was_retried_trains_exactly_as_without_ampguard_and_leaves_no_recorder_on():
    plain, guarded = _retry_on_oom(False), _retry_on_oom(True)
    assert guarded[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], guarded[1], strict=True))
    # no loss code follows a call that made nothing: the loss-code recorder is not on in the user's handler
    assert guarded[2] == plain[2] == [0, 0, 0, 0]


def test_a_nan_in_the_retried_call_is_named_not_the_call_that_raised_replayed():
    """The call that raised is not in the replay's window: replayed, it raised again, and the report said only
    that the replay failed."""
    with pytest.raises(ampguard.NonFiniteError) as info:
        _retry_on_oom(True, bad_at=2)
    err, message = info.value, str(info.value)
    assert "could not replay" not in message and "OutOfMemory" not in message, message
    assert err.op == "Tensor.sqrt", message
    assert err.origin[-1].lineno == line_of(Retried.forward, "RETRIED SQRT"), message
    assert any(f.lineno == line_of(_retry_on_oom, "RETRY CALL") for f in err.origin), message


def test_a_teacher_call_that_raised_inside_the_loss_code_leaves_the_loss_code_recorded():
    torch.manual_seed(1)
    student, teacher = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LogSoftmax(-1)), RaisingTeacher()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        log_p = student(x)
        with torch.no_grad():
            try:
                soft = teacher(x).softmax(-1)
            except OutOfMemory:
                soft = torch.full((4, 4), 0.25)
        loss = torch.nn.functional.kl_div(log_p, soft, reduction="batchmean") + (log_p - 1).sqrt().mean()  # AFTER
        loss.backward()
        opt.step()
    err, message = info.value, str(info.value)
    assert err.op == "Tensor.sqrt", message
    assert err.origin[-1].lineno == line_of(
        test_a_teacher_call_that_raised_inside_the_loss_code_leaves_the_loss_code_recorded, "# AFTER"), message


# 11. custom ops ---------------------------------------------------------------------------------------------
@torch.library.custom_op("ampguard_test::shifted_log", mutates_args=())
def shifted_log(x: torch.Tensor) -> torch.Tensor:
    """A custom op (torch.library), as a kernel library's fused op is: the replay sees it as one op."""
    return torch.log(x - 1)


@shifted_log.register_fake
def _(x):
    return torch.empty_like(x)


def _shifted_log_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad / (x - 1)


shifted_log.register_autograd(_shifted_log_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(
    inputs[0]))


class CallsCustomOp(AroundAnOp):
    def forward(self, x):
        h = self.a(x).sigmoid()
        return self.b(shifted_log(h))  # CUSTOM OP LINE


@pytest.mark.parametrize("trace", ["replay", "eager"])
def test_a_custom_op_that_made_a_nan_is_named_by_its_library_name_at_the_user_s_line(trace):
    """Before, the op read 'torch._ops.ampguard_test.shifted_log.default', placed in torch's custom-op plumbing
    (torch/_library/custom_ops.py under trace='eager', torch/_library/autograd.py in a replay)."""
    model = CallsCustomOp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard(trace=trace), pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.rand(2, 4)).mean().backward()
        opt.step()
    err, message = info.value, str(info.value)
    assert err.op == "ampguard_test.shifted_log" and err.module == "CallsCustomOp", message
    line = f"{__file__}:{line_of(CallsCustomOp.forward, 'CUSTOM OP LINE')} in forward"
    made = {"replay": "It was created by ampguard_test.shifted_log (inputs finite, output NaN)",
            "eager": "ampguard: ampguard_test.shifted_log created NaN from inputs without NaN"}[trace]
    assert f"{made} in module 'CallsCustomOp' at\n    {line}" in message, message
    assert "torch/_library" not in message and "torch._ops" not in message, message


# 12. ops non-finite by their definition ----------------------------------------------------------------------
@pytest.mark.parametrize("as_module", [False, True], ids=["F.ctc_loss", "nn.CTCLoss"])
def test_an_infinite_ctc_loss_names_the_target_that_cannot_be_aligned_and_zero_infinity(as_module):
    torch.manual_seed(0)
    rnn, head = torch.nn.GRU(8, 16), torch.nn.Linear(16, 5)
    opt = torch.optim.Adam([*rnn.parameters(), *head.parameters()])
    criterion = torch.nn.CTCLoss() if as_module else torch.nn.functional.ctc_loss
    targets = torch.randint(1, 5, (2, 4))
    target_lengths = torch.tensor([4, 4])

    def step(frames):
        out, _ = rnn(torch.randn(frames, 2, 8))
        loss = criterion(head(out).log_softmax(-1), targets, torch.full((2,), frames), target_lengths)
        opt.zero_grad()
        loss.backward()
        opt.step()

    with ampguard.guard():
        step(12)  # (4 labels in 12 frames: feasible, a finite loss)
        with pytest.raises(ampguard.NonFiniteError) as info:
            step(3)  # (4 labels in 3 frames: no alignment, +Inf)
    message = str(info.value)
    assert "+Inf reached the loss" in message and "ctc_loss" in info.value.op, message
    assert "ctc_loss is +Inf for a sample whose target cannot be aligned to its input" in message, message
    assert "zero_infinity=True" in message, message


class BatchStandardized(AroundAnOp):
    """Standardizes over the batch, as hand-written normalizations and contrastive losses do."""

    def forward(self, x):
        h = self.a(x)
        return self.b((h - h.mean(0)) / h.std(0))  # STD LINE


@pytest.mark.parametrize("trace", ["replay", "eager"])
def test_a_std_over_a_batch_of_one_names_the_correction(trace):
    model = BatchStandardized()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard(trace=trace), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own: degrees of freedom <= 0)
        model(torch.rand(8, 4)).mean().backward()  # (a batch of 8: finite)
        opt.step()
        with pytest.raises(ampguard.NonFiniteError) as info:
            model(torch.rand(1, 4)).mean().backward()  # (the last batch of an epoch, of one sample)
            opt.step()
    err, message = info.value, str(info.value)
    assert err.op == "Tensor.std" and err.origin[-1].lineno == line_of(BatchStandardized.forward, "STD LINE"), message
    assert "over a single element (a batch of one, a dimension of size 1) that is 0/0. Pass correction=0" in message


@pytest.mark.parametrize(("trace", "as_module"), [("replay", False), ("eager", False), ("replay", True)],
                         ids=["F.cross_entropy", "F.cross_entropy, eager", "nn.CrossEntropyLoss"])
def test_a_cross_entropy_whose_targets_are_all_ignored_names_the_empty_mean(trace, as_module):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss(ignore_index=0) if as_module else \
        lambda logits, targets: torch.nn.functional.cross_entropy(logits, targets, ignore_index=0)
    with ampguard.guard(trace=trace):
        criterion(model(torch.rand(3, 4)), torch.tensor([1, 0, 2])).backward()  # (one target padded: finite)
        opt.step()
        with pytest.raises(ampguard.NonFiniteError) as info:
            criterion(model(torch.rand(3, 4)), torch.zeros(3, dtype=torch.long)).backward()  # (all padding)
            opt.step()
    err, message = info.value, str(info.value)
    assert err.op in ("aten.nll_loss_forward", "torch.nn.functional.cross_entropy"), message
    assert "created by aten.nll_loss_forward inside torch.nn.functional.cross_entropy (inputs finite, output NaN)" \
        in message if trace == "replay" else "cross_entropy created NaN from inputs without NaN" in message, message
    assert "a batch whose targets are all ignored (all padding), or whose classes all weigh 0, is 0/0" in message


class MaskedPolicy(torch.nn.Module):
    """An RL policy with action masking: invalid actions' logits are -inf."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pi = torch.nn.Linear(6, 5)

    def forward(self, obs, valid):
        return self.pi(obs).masked_fill(~valid, float("-inf"))


def test_an_entropy_over_masked_logits_names_the_product_of_0_and_minus_inf_and_a_fix_with_finite_gradients():
    """PPO's entropy bonus written by hand, -(p * log p).sum(-1), over masked logits: p is 0 and log p -Inf at a masked
    action, and 0 x -Inf is NaN. Categorical.entropy() clamps the logits; the hand-written one does not."""
    policy = MaskedPolicy()
    opt = torch.optim.Adam(policy.parameters())
    valid = torch.ones(4, 5, dtype=torch.bool)
    with ampguard.guard():
        for step in range(2):
            valid[1, 3] = step == 0  # (the second step masks one action)
            logits = policy(torch.randn(4, 6), valid)
            entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()  # ENTROPY
            with pytest.raises(ampguard.NonFiniteError) if step else contextlib.nullcontext() as info:
                (-0.01 * entropy).backward()
                opt.step()
                opt.zero_grad()
    err, message = info.value, str(info.value)
    here = test_an_entropy_over_masked_logits_names_the_product_of_0_and_minus_inf_and_a_fix_with_finite_gradients
    assert err.op == "Tensor.mul" and err.origin[-1].lineno == line_of(here, "ENTROPY"), message
    assert "It was created by Tensor.mul (inputs finite but for a mask, output NaN)" in message, message
    assert "A product is NaN only as 0 x ±Inf" in message and "Categorical(logits=...).entropy()" in message, message
    assert "(torch.special.xlogy(p, p) and entr(p) are 0 there too, but their gradients are NaN.)" in message, message
    assert "was not counted as a cause: the mask made by Tensor.masked_fill at " in message, message
    # (the policy's logits depend on its parameters: the mask is the -inf written into them, not a parameter-free one)
    assert "-Inf that masks put there (written as -inf on purpose, as a masked_fill of logits is)" in message, message



def test_a_root_that_a_where_hid_says_how_far_below_0_its_input_was():
    """torch.where(x > 0, torch.sqrt(x), 0) of a linear layer's output: the forward's NaN is hidden, the gradient's is
    not. The measured range of the sqrt's input is in this message too, as in the one for a NaN the loss saw: a
    clamp, the usual fix for rounding, would hide a quantity of the wrong sign."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        x = model(torch.randn(16, 8))
        torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x)).pow(2).mean().backward()
        opt.step()
    message = str(info.value)
    assert "The forward made it: torch.sqrt created NaN (inputs finite)" in message, message
    assert "  Its input was as low as -" in message and "a value far below that is a quantity of the wrong sign" \
        in message, message


_ENTROPIES = {  # an entropy over masked logits, as the product advice above words each
    "Categorical": lambda logits, valid: torch.distributions.Categorical(logits=logits).entropy(),
    "finfo.min": lambda logits, valid: -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1),
    "xlogy": lambda logits, valid: -torch.special.xlogy(logits.softmax(-1), logits.softmax(-1)).sum(-1),
    "entr": lambda logits, valid: torch.special.entr(logits.softmax(-1)).sum(-1),
}


@pytest.mark.parametrize("how", list(_ENTROPIES))
def test_the_product_advice_is_true_the_fixes_it_names_train_and_the_ones_it_warns_of_do_not(how):
    """The advice once named torch.special.xlogy(p, p), which is 0 at p = 0 but whose gradient there is NaN: a user
    who took it met the same error one op later. Each entropy the advice names is trained on a masked action here."""
    policy = MaskedPolicy()
    if how == "finfo.min":  # (the same policy, masking with the dtype's lowest value instead of -inf)
        policy.forward = lambda obs, valid: policy.pi(obs).masked_fill(~valid, torch.finfo(torch.float32).min)
    opt = torch.optim.Adam(policy.parameters())
    valid = torch.ones(4, 5, dtype=torch.bool)
    valid[1, 3] = False
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) if how in ("xlogy", "entr") else \
            contextlib.nullcontext() as info:
        entropy = _ENTROPIES[how](policy(torch.randn(4, 6), valid), valid).mean()
        (-0.01 * entropy).backward()
        opt.step()
    if info is not None:
        assert "The backward of " in str(info.value) or "The forward made it" in str(info.value), str(info.value)
    else:
        assert all(bool(torch.isfinite(p).all()) for p in policy.parameters())


def test_the_where_trick_over_a_masked_probability_names_the_log_the_product_and_the_where():
    """torch.where(p > 0, p * log(p), 0): the where keeps the forward's NaN (0 x -Inf, at a masked action) from the
    loss, not from the backward, where the product's gradient meets the -Inf log(p) it saved. The message blamed the
    product's backward; the replay knows the forward made the -Inf, where it became NaN and what hid it."""
    policy = MaskedPolicy()
    opt = torch.optim.Adam(policy.parameters())
    valid = torch.ones(4, 5, dtype=torch.bool)
    valid[1, 3] = False
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        p = policy(torch.randn(4, 6), valid).softmax(-1)
        entropy = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1).mean()  # WHERE TRICK
        (-0.01 * entropy).backward()
        opt.step()
    message = str(info.value)
    here = test_the_where_trick_over_a_masked_probability_names_the_log_the_product_and_the_where
    at = f"{__file__}:{line_of(here, 'WHERE TRICK')}"
    assert info.value.sink == "gradient of parameter 'pi.weight'", message
    assert f"The forward made it: torch.log created -Inf (inputs finite) at\n    {at} in " in message, message
    assert f"It became NaN in Tensor.mul at\n    {at} in " in message, message
    # (the 0 is a masked action's probability, not one that underflowed: log_softmax, the underflow's fix, is -Inf too)
    assert "  Its input was the softmax of logits a mask set to -Inf: that probability is exactly 0" in message, message
    assert "Take log_softmax or logsigmoid instead" not in message, message
    assert f"  torch.where at {at} took that value and returned finite values, so the loss stayed finite; the " \
        "backward of MulBackward0 met -Inf among the values the forward saved, and finite gradients times it gave " \
        "NaN (0 x -Inf is NaN). Keep the value finite where it is made: torch.where hides it from the loss, not " \
        "from the backward." in message, message
    assert "The loss was finite" not in message, message


def test_a_layer_norm_without_eps_over_a_padding_row_names_the_zero_variance_and_eps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8, padding_idx=0), torch.nn.LayerNorm(8, eps=0.0),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(1, 10, (4, 5))
    with ampguard.guard():
        model(ids).pow(2).mean().backward()
        opt.step()
        ids[2, 3] = 0  # (the padding token: an embedding of zeros)
        with pytest.raises(ampguard.NonFiniteError) as info:
            model(ids).pow(2).mean().backward()
            opt.step()
    err, message = info.value, str(info.value)
    assert err.module == "1" and "layer_norm" in err.op, message
    assert "the values it normalizes together are all equal" in message and "its eps is 0: 0/0" in message, message


class HalfRMSNorm(torch.nn.Module):
    """An RMSNorm written by hand in float16, with an eps that float16 rounds to 0."""

    def forward(self, x):
        x = x.half()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12)).float()  # RSQRT LINE


def test_a_reciprocal_of_0_in_float16_names_an_eps_that_float16_rounds_to_0():
    model = torch.nn.Sequential(HalfRMSNorm(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    x[2] = 0  # (a padding row)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        model(x).pow(2).mean().backward()
        opt.step()
    err, message = info.value, str(info.value)
    assert err.op == "torch.rsqrt" and err.origin[-1].lineno == line_of(HalfRMSNorm.forward, "RSQRT LINE"), message
    assert "A division (or a reciprocal) of finite values is ±Inf where its divisor is 0" in message, message
    assert "This divisor is float16, where an eps below 3e-8 (1e-8, or 1e-12 as in a hand-written RMSNorm) rounds " \
        "to 0" in message, message


def _error_of_a_step(loss_of, trace="replay", width=4):
    """The NonFiniteError (and its message) of one SGD step of a Linear(4, width) on 2 rows, whose loss is
    ``loss_of(output)``, under ``guard(trace=trace)``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard(trace=trace), pytest.raises(ampguard.NonFiniteError) as info:
        loss_of(model(torch.rand(2, 4))).backward()
        opt.step()
    return info.value, str(info.value)


def _cosine_angle(a, b):
    return torch.acos((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)))  # (a rounding error can pass 1)


def _variance_root(a, b):
    return torch.sqrt((a * a).mean(-1) - a.mean(-1) ** 2 - 1)  # (as if rounding made E[x^2] - E[x]^2 negative)


def _log_of_difference(a, b):
    return torch.log(a.sum(-1) - b.sum(-1) - 100)


def _fractional_power(a, b):
    return (a - b - 100).pow(0.5)


@pytest.mark.parametrize(("made_by", "advice", "measured"), [
    (_cosine_angle, "acos and asin are NaN outside [-1, 1]", "Its input ranged from 1.00000012 to 1.00000012."),
    (_variance_root, "This op is NaN for a negative input", "Its input was as low as -0.8"),
    (_log_of_difference, "This op is NaN for a negative input", "Its input was as low as -10"),
    (_fractional_power, "pow: a negative base to a fractional power", "Its input was as low as -10"),
])
def test_an_op_that_is_nan_outside_its_domain_is_named_with_the_clamp_that_keeps_it_inside(made_by, advice, measured):
    """The message also says how far past the bound the input was (measured in the replay): rounding takes a value
    past it by some 1e-7 of its size in float32, where a clamp is the fix; far past it, the quantity has the wrong
    sign, and a clamp would hide that."""
    # (a vector whose cosine with itself is 1.0000001 in float32: the dot product and the norms round differently)
    same = torch.tensor([0.1919950693845749, 0.5427713394165039, -2.2187793254852295, 0.2589845359325409])
    if made_by is _cosine_angle:
        _, message = _error_of_a_step(lambda out: made_by(same + 0 * out, same.expand(2, 4)).mean())
    else:
        _, message = _error_of_a_step(lambda out: made_by(out, torch.rand(2, 4)).mean())
    assert "(inputs finite, output NaN)" in message and advice in message, message
    assert measured in message, message
    if made_by is not _cosine_angle:
        assert "A rounding error is some 1e-7 (float32) of the values it was computed from" in message, message


def _masked_mean(out, mask):
    return (out * mask).sum() / mask.sum()  # (a mask that selects nothing: 0/0)


def _mean_of_selection(out, mask):
    return out[mask.bool()].mean()  # (an empty selection)


@pytest.mark.parametrize("trace", ["replay", "eager"])
@pytest.mark.parametrize(("made_by", "op", "advice"), [
    (_masked_mean, "Tensor.div", "A division of finite values is NaN only as 0/0"),
    (_mean_of_selection, "Tensor.mean", "The mean of no elements is NaN (0/0)"),
], ids=["masked mean", "mean of an empty selection"])
def test_an_empty_mean_is_named_with_the_count_that_was_0(made_by, op, advice, trace):
    err, message = _error_of_a_step(lambda out: made_by(out, torch.zeros(2, 2)), trace, width=2)
    assert err.op == op and advice in message, message



def _standardized_targets(out):
    y = torch.randn(out.shape[0], 3)
    y[:, 1] = 3.0  # a constant target column
    z = (y - y.mean(0)) / y.std(0)  # STANDARDIZE
    return torch.nn.functional.mse_loss(out, z)


def test_a_0_over_0_division_names_its_divisor_and_how_many_of_its_values_were_0():
    """Standardizing by a std that is 0 (a constant column) is 0/0. The advice named counts and norms; the replay
    measured the divisor: which call made it, and how many of its values were 0."""
    err, message = _error_of_a_step(_standardized_targets, width=3)
    at = f"{__file__}:{line_of(_standardized_targets, 'STANDARDIZE')}"
    assert err.op == "Tensor.div" and err.origin[-1].lineno == line_of(_standardized_targets, "STANDARDIZE"), message
    assert f"  Its divisor, the output of Tensor.std at {at}, was 0 at 1 of 3 elements." in message, message
    assert "  Tensor.std is 0 over values that are all equal: a constant feature or target column" in message, message
    _, message = _error_of_a_step(lambda out: _masked_mean(out, torch.zeros(2, 2)), width=2)
    assert f"  Its divisor, the output of Tensor.sum at {__file__}:{line_of(_masked_mean, '0/0')}, was 0 at 1 of 1 " \
        "elements." in message, message
    assert "is 0 over values that are all equal" not in message, message



def _log_spectrum_loss(out):
    target = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0, -2.0]]).expand(out.shape[0], -1)  # zero-mean: its DC bin is 0
    return torch.nn.functional.l1_loss(torch.log(torch.fft.rfft(out).abs()),
                                       torch.log(torch.fft.rfft(target).abs()))  # LOG SPECTRUM


def test_a_log_of_a_zero_in_the_target_is_the_origin_not_a_mask():
    """A log-magnitude spectral loss of a zero-mean target: its DC bin is 0, and its log -Inf. The -Inf depends on
    no parameter, as a mask's does, and the message named the loss's subtraction, with "the mask made by torch.log"
    set aside. A log of data that held 0s among other values is no mask."""
    err, message = _error_of_a_step(_log_spectrum_loss, width=6)
    assert err.op == "torch.log" and "It was created by torch.log (inputs finite, output -Inf)" in message, message
    assert err.origin[-1].lineno == line_of(_log_spectrum_loss, "LOG SPECTRUM"), message
    assert "It became +Inf in aten.sub inside torch.nn.functional.l1_loss" in message, message
    assert "was not counted as a cause" not in message, message
    assert "  log(0) is -Inf: its input held 0. Where that 0 is in the data (a magnitude, a count, a target " \
        "probability), clamp it (min=eps) or add eps before the log." in message, message



def _float16_log_magnitude(out):
    mag = torch.relu(out).half()  # 0 where the relu cuts
    return (torch.log(mag + 1e-9).float() - 1.0).abs().mean()  # EPS 1e-9 IN FLOAT16


def test_a_float16_log_of_data_with_an_eps_too_small_for_float16_says_the_eps_rounds_to_0():
    """The advice said to add an eps before the log: this loss does, and 1e-9 rounds to 0 in float16."""
    err, message = _error_of_a_step(_float16_log_magnitude, width=6)
    assert err.op == "torch.log" and "log(0) is -Inf: its input held 0." in message, message
    assert "  This log ran in float16, where an eps below 3e-8 (1e-8, 1e-9) added to its input rounds to 0 and adds " \
        "nothing" in message, message
    _, message = _error_of_a_step(_log_spectrum_loss, width=6)  # (float32: no such line)
    assert "This log ran in float16" not in message, message


def _log_masked_scores(out):
    keep = torch.ones(out.shape[0], 3)
    keep[1] = 0.0  # a row with nothing to attend to
    scores = out[:, :3] + torch.log(keep)  # LOG OF A 0/1 MASK
    return scores.softmax(-1).sum()


def test_a_log_of_a_0_1_mask_is_still_a_mask():
    """Some code builds its additive mask as log(keep): its -Inf is on purpose, and the fully masked row's softmax is
    the origin, as with masked_fill(-inf)."""
    err, message = _error_of_a_step(_log_masked_scores, width=3)
    assert err.op == "Tensor.softmax" and "(inputs finite but for a mask, output NaN)" in message, message
    assert f"the mask made by torch.log at {__file__}:{line_of(_log_masked_scores, 'LOG OF A 0/1 MASK')}" in message, \
        message



def _smoothed_over_a_masked_vocabulary(out):
    banned = torch.zeros(out.shape[-1], dtype=torch.bool)
    banned[-2:] = True
    logits = out.masked_fill(banned, float("-inf"))  # VOCABULARY MASK
    return torch.nn.functional.cross_entropy(logits, torch.zeros(out.shape[0], dtype=torch.long), label_smoothing=0.1)


def test_a_masked_class_that_label_smoothing_weighs_says_the_loss_took_the_mask():
    """A vocabulary mask of -inf, and label smoothing, which weighs every class: the loss is +Inf. The message named
    the masked_fill and said nothing of why a mask, written on purpose, reached the loss."""
    err, message = _error_of_a_step(_smoothed_over_a_masked_vocabulary, width=5)
    assert err.op == "Tensor.masked_fill", message
    assert "It became +Inf in aten.neg inside torch.nn.functional.cross_entropy" in message, message
    assert "  That -Inf is a mask's, written into the logits on purpose, and the loss took it: a class's -Inf " \
        "log-probability enters cross_entropy where the target is that class, and where label_smoothing" in message, \
        message
    assert "A finfo.min mask does not help" in message, message
    lowest = torch.finfo(torch.float32).min  # (as the message says: the smoothing's sum overflows)
    assert torch.nn.functional.cross_entropy(torch.tensor([[0.0, lowest, lowest]]), torch.tensor([0]),
                                             label_smoothing=0.1).isinf()


def _hand_written_softmax(logits):
    e = torch.exp(logits)  # EXP LINE (overflows above 88.7 in float32)
    return e / e.sum(-1, keepdim=True)  # DIV LINE (Inf / Inf)


@pytest.mark.parametrize("trace", ["replay", "eager"])
def test_an_exp_that_overflows_is_named_and_the_division_it_fed_is_not_called_0_over_0(trace):
    err, message = _error_of_a_step(  # (Inf / Inf: NaN reaches the loss)
        lambda out: _hand_written_softmax(out + torch.tensor([100.0, 0.0, 0.0]))[:, 0].mean(), trace, width=3)
    assert "0/0" not in message, message  # (Inf / Inf: no count was 0)
    if trace == "replay":  # (the walk follows the +Inf back to the op that made it)
        assert err.op == "torch.exp" and "created by torch.exp (inputs finite, output +Inf)" in message, message
        assert "exp overflows to +Inf above 88.7 in float32" in message, message
        assert "so the result passed the largest float32 value (3.4e+38): it overflowed. Their largest |x|: the " \
            "output of Tensor.add 99.3" in message, message  # (100 plus the model's output)
        assert err.origin[-1].lineno == line_of(_hand_written_softmax, "EXP LINE"), message
    else:  # (eager mode stops at the first NaN, and says its inputs held Inf)
        assert err.op == "Tensor.div", message
        assert "Tensor.div created NaN from inputs that held Inf but no NaN" in message, message
        assert err.origin[-1].lineno == line_of(_hand_written_softmax, "DIV LINE"), message


def test_a_log_of_a_probability_that_underflowed_is_named_with_log_softmax():
    err, message = _error_of_a_step(  # (class 0's probability: e^-200 = 0)
        lambda out: -torch.log(torch.softmax(out + torch.tensor([0.0, 200.0, 0.0]), -1)[:, 0]).mean(), width=3)
    assert err.op == "torch.log" and "(inputs finite, output -Inf)" in message, message
    assert "log(0) is -Inf: a probability that underflowed to 0" in message and "log_softmax" in message, message


def test_a_backward_node_is_named_after_an_op_that_exists():
    """A backward origin's op is named from its autograd node. CamelCase made lowerCamel once: torch.toCopy for a
    .float(), torch.mseLoss, torch.gelu, none of which exists. Each name now resolves to a real torch or aten op."""
    from ampguard.nonfinite import failure

    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    made = {
        x.half().float(): "aten._to_copy",
        torch.nn.functional.log_softmax(x, -1): "torch.log_softmax",
        torch.nn.functional.layer_norm(x, (8,)): "torch.native_layer_norm",
        torch.nn.functional.max_pool2d(x, 2): "aten.max_pool2d_with_indices",
        torch.nn.functional.mse_loss(x, x.detach()): "aten.mse_loss",
        torch.nn.functional.gelu(x): "aten.gelu",
        torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear"): "aten.upsample_bilinear2d",
        torch.sqrt(x): "torch.sqrt",
        torch.linalg.vector_norm(x): "torch.linalg.vector_norm",
        torch.norm(x, dim=-1): "torch.linalg.vector_norm",  # (what torch.norm runs)
        torch.special.entr(x): "torch.special.entr",
    }
    for out, name in made.items():
        assert failure._forward_of(out.grad_fn.name()) == name, out.grad_fn.name()
        where, _, path = name.partition(".")
        op = torch if where == "torch" else torch.ops.aten
        for part in path.split("."):
            op = getattr(op, part)
        assert callable(op), name
    assert failure._forward_of("NotAnOpBackward0") == "NotAnOpBackward0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_run_that_diverges_until_a_matmul_overflows_says_how_large_its_inputs_grew(dtype):
    """SGD at a learning rate too high for unnormalized data: the weights grow each step until a linear's result
    passes 3.4e38. "Inputs finite, output -Inf" was all the message said of that op. Under bf16 autocast its inputs
    are the weights' bf16 copies, named by their parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(64, 4) * 10
    y = x.sum(1, keepdim=True) * 3
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        for _ in range(50):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    message, limit = str(info.value), "3.4e+38" if dtype is torch.float32 else "3.39e+38"
    assert "It was created by aten.addmm inside torch.linear (inputs finite, output " in message, message
    assert f"so the result passed the largest {str(dtype)[6:]} value ({limit}): it overflowed. Their largest |x|: " \
        "parameter '2.bias' " in message, message
    assert ", the output of torch.nn.functional.relu " in message and ", parameter '2.weight' " in message, message
    assert "a learning rate too high for the model" in message, message


def test_data_that_overflows_float16_under_autocast_says_how_large_it_was():
    """Unnormalized features cast to float16 by autocast pass 65504 at the model's first linear."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(8, 64) * 2e5)
        out.float().pow(2).mean().backward()
        opt.step()
    message = str(info.value)
    assert "It was created by aten._to_copy inside torch.linear (inputs finite, output +Inf, -Inf) in module '0'" \
        in message, message
    assert "so the result passed the largest float16 value (6.55e+04): it overflowed. Their largest |x|: argument " \
        "0 of the call of 'Sequential' (the data" in message, message
    assert "In float16 that is an activation above 65504" in message, message



class UnscaledAttention(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2)  # NO 1/sqrt(d)
        return self.o(scores.softmax(-1) @ v)


def test_an_attention_score_overflow_names_q_and_k_by_the_calls_that_made_them_not_by_matmuls_own_views():
    """A matmul of 3-D tensors runs bmm on views it makes of its inputs: the overflow line named "the output of
    aten.view inside Tensor.matmul" twice. It now names what the matmul was given: the chunk and the transpose."""
    model = UnscaledAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(2, 16, 64) * 100)
        out.float().pow(2).mean().backward()
        opt.step()
    message = str(info.value)
    assert info.value.origin[-1].lineno == line_of(UnscaledAttention.forward, "NO 1/sqrt(d)"), message
    assert "it overflowed. Their largest |x|: the output of aten.split inside Tensor.chunk 221, the output of " \
        "Tensor.transpose 188." in message, message
    assert "inside Tensor.matmul 2" not in message and "inside Tensor.matmul 1" not in message, message


def test_an_inf_at_a_singularity_is_not_called_an_overflow():
    """x / 0, log(0), 0 ** -1, the log-determinant or the inverse of a singular matrix make ±Inf from small finite
    inputs: no result passed a dtype's largest value. A division by 0 says so."""
    for loss_of, divided_by_0 in ((lambda out: (out / torch.zeros(())).mean(), True),
                                  (lambda out: (out / (out - out)).mean(), True),
                                  (lambda out: torch.log(out * 0).mean(), False),
                                  (lambda out: (out * 0).pow(-1).mean(), False),
                                  (lambda out: torch.logdet(out.T @ out * 0), False),
                                  (lambda out: torch.logdet(torch.stack([out[0, :2], out[0, :2]])), False),  # not 0
                                  (lambda out: torch.linalg.inv_ex(out[:1, :1] * 0).inverse.sum(), False)):
        _, message = _error_of_a_step(loss_of)
        assert "(inputs finite, output" in message and "overflowed" not in message, message
        assert ("of finite values is ±Inf where its divisor is 0" in message) == divided_by_0, message


def test_a_derivative_that_is_inf_at_0_inside_autograd_grad_is_called_so_not_a_division_of_the_users():
    """A physics-informed loss takes du/dx with torch.autograd.grad(create_graph=True): sqrt's derivative at x = 0 is a
    division by 0 inside it, which the user never wrote. The points are made in the loss code, after the first model
    call, and marked requires_grad_() there: the replay needs that too, or its autograd.grad fails."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def loss_of(out):
        x = torch.rand(8, 1)
        x[0] = 0.0
        x.requires_grad_(True)
        u = net(x) * torch.sqrt(x)  # a boundary term: a second model call on points made here
        du = torch.autograd.grad(u, x, grad_outputs=torch.ones_like(u), create_graph=True)[0]
        return out.pow(2).mean() + ((du - 1) ** 2).mean()

    _, message = _error_of_a_step(loss_of)
    assert "created by aten.div inside torch.autograd.grad (inputs finite, output " in message, message
    assert "Inside torch.autograd.grad this division is a derivative's" in message, message
    assert "divisor is 0" not in message, message


def test_a_square_or_a_quotient_that_passes_float32_is_called_an_overflow():
    """pow and div have a singularity at 0, but with no 0 among their inputs their Inf is an overflow (a hand-written
    squared error of a diverged prediction)."""
    for loss_of, op in ((lambda out: (out * 1e20).pow(2).mean(), "Tensor.pow"),
                        (lambda out: (out * 1e30 / 1e-10).mean(), "Tensor.div")):
        err, message = _error_of_a_step(loss_of)
        assert err.op == op and f"created by {op} (inputs finite, output +Inf" in message, message
        assert "it overflowed. Their largest |x|: the output of Tensor.mul " in message, message
        assert "a learning rate too high for the model" in message, message


def test_fp16_gradients_that_overflow_in_the_backward_are_called_an_overflow_not_an_unbounded_op():
    """fp16 parameters without a GradScaler, a loss weighted up: the fp32 gradient that .float()'s backward casts to
    float16 passes 65504. That is no singularity, and "look for sqrt or pow at 0" sent the user the wrong way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 64).half(), torch.randn(64, 1)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        (torch.nn.functional.mse_loss(model(x).float(), y) * 1e9).backward()
        opt.step()
    err, message = info.value, str(info.value)
    assert err.op == "aten._to_copy" and err.sink == "gradient of parameter '0.weight'", message
    assert "more than float16 holds (6.55e+04): they overflowed float16 here, at no singularity." in message, message
    assert "The loss was finite: the backward pass overflowed float16 (above). Make the loss smaller" in message
    assert "sqrt or pow at 0" not in message, message


def test_a_matmul_whose_fp16_backward_overflows_is_called_an_overflow():
    """The incoming gradients were below 65504, and the linear layer's backward multiplied them past it: the message
    said "look for ops with unbounded gradients (sqrt or pow at 0 ...)" of an addmm, which has none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampguard.guard(), pytest.raises(ampguard.NonFiniteError) as info:
        (model(torch.randn(64, 512, dtype=torch.float16)).float() * 1000).pow(2).mean().backward()
        opt.step()
    err, message = info.value, str(info.value)
    assert err.op == "torch.addmm" and err.sink == "gradient of parameter '2.weight'", message
    assert "and torch.addmm has no singularity: its backward multiplies them by values its forward saved, and the " \
        "products passed float16's largest value (6.55e+04). They overflowed float16 here." in message, message
    assert "The loss was finite: the backward pass overflowed float16 (above). Make the loss smaller" in message
    assert "sqrt or pow at 0" not in message, message
