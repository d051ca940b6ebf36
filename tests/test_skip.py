"""nonfinite='skip': a step whose loss or gradients are non-finite is not taken, as if its batch never came."""

import contextlib
import warnings

import pytest
import torch
from loops import scaled_loop
from test_distributed import run_ranks
from test_replay import SqrtAtZero, line_of

import ampguard
from ampguard import _sync


def make(seed=0):
    """BatchNorm (buffers the forward changes), AdamW (state every step changes) and a decaying schedule."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def batches(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def train(data, model=None):
    model, opt, sched = make() if model is None else model
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)  # LOSS LINE
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def identical(a, b):
    (ma, oa, sa), (mb, ob, sb) = a, b
    assert all(torch.equal(p, q) for p, q in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True))
    state_a, state_b = oa.state_dict()["state"], ob.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k][n], state_b[k][n]) for k in state_a for n in state_a[k])
    assert sa.get_last_lr() == sb.get_last_lr() and sa.last_epoch == sb.last_epoch


def corrupt(data, k):
    out = [(x.clone(), y) for x, y in data]
    out[k][0][1, 3] = float("nan")
    return out


def ours(caught):
    return [str(w.message) for w in caught if issubclass(w.category, ampguard.AmpGuardWarning)]


def test_a_corrupt_batch_is_skipped_bit_identically_to_a_run_that_never_saw_it(caplog):
    data = batches()
    with warnings.catch_warnings(record=True) as caught, ampguard.guard(nonfinite="skip") as g, \
            caplog.at_level("WARNING", logger="ampguard"):
        warnings.simplefilter("always")
        skipped = train(corrupt(data, 2))
    assert [r.getMessage() for r in caplog.records] == [
        "ampguard: nonfinite='skip' skipped a step of AdamW#0 (non-finite loss); 1 skipped so far, 1 in a row"]
    identical(skipped, train(data[:2] + data[3:]))  # parameters, BatchNorm's running statistics, AdamW, LR
    assert g.stats.nonfinite_steps_skipped == g.stats.optimizer_steps_skipped == 1
    assert g.stats.optimizer_steps_applied == 5 and g.stats.scheduler_steps_held == 1
    found = ours(caught)
    assert len(found) == 1
    assert "nonfinite='skip': the optimizer step this reached is skipped" in found[0]
    assert "It entered already non-finite (NaN): argument 0 of the call of 'Sequential'" in found[0]
    assert "skipped by nonfinite='skip'" in g.report()
    # and the plain run, without ampguard, is lost: NaN everywhere
    lost, _, _ = train(corrupt(data, 2))
    assert torch.isnan(lost[0].weight).all()


def test_with_schedulers_false_a_skipped_step_does_not_hold_the_scheduler_and_the_warning_says_so():
    """The warning said "LR schedulers held" whatever the schedulers option; with schedulers=False they step."""
    data = batches()
    with warnings.catch_warnings(record=True) as caught, ampguard.guard(nonfinite="skip", schedulers=False) as g:
        warnings.simplefilter("always")
        _, _, sched = train(corrupt(data, 2))
    found = ours(caught)
    assert len(found) == 1 and "buffers as before the batch, LR schedulers not held: schedulers=False)" in found[0]
    assert sched.last_epoch == len(data) and g.stats.scheduler_steps_held == 0


def test_a_step_that_makes_nan_gradients_is_skipped_and_the_op_named_once():
    model = SqrtAtZero()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught, ampguard.guard(nonfinite="skip") as g:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert g.stats.nonfinite_steps_skipped == 3
    found = ours(caught)
    assert len(found) == 1  # once per origin, while every step is skipped
    assert "The backward of torch.sqrt (SqrtBackward0)" in found[0]
    assert f"test_replay.py:{line_of(SqrtAtZero.forward, 'BACKWARD NAN')}" in found[0]


def test_consecutive_skips_raise_after_max_consecutive_skips_with_the_latest_origin():
    data = [(torch.full((4, 8), float("nan")), torch.zeros(4, 1))] * 5
    model = make()
    first = [p.detach().clone() for p in model[0].parameters()]
    with warnings.catch_warnings(), ampguard.guard(nonfinite="skip", max_consecutive_skips=3) as g, \
            pytest.raises(ampguard.NonFiniteError) as info:
        warnings.simplefilter("ignore")
        train(data, model)
    assert "nonfinite='skip' skipped 3 optimizer steps in a row (max_consecutive_skips=3)" in str(info.value)
    assert "argument 0 of the call of 'Sequential'" in str(info.value)  # the latest origin, in full
    assert info.value.sink == "loss"
    assert g.stats.nonfinite_steps_skipped == 2  # the third raised before it was taken
    assert all(torch.equal(a, b) for a, b in zip(first, model[0].parameters(), strict=True))


def test_an_applied_step_resets_the_count_of_skips_in_a_row():
    data = batches(8)
    for k in (1, 3, 5, 7):
        data = corrupt(data, k)
    with warnings.catch_warnings(), ampguard.guard(nonfinite="skip", max_consecutive_skips=2) as g:
        warnings.simplefilter("ignore")
        train(data)
    assert g.stats.nonfinite_steps_skipped == 4


def test_under_a_grad_scaler_skip_mode_changes_nothing_gradscaler_does():
    def run(**options):
        with ampguard.guard(**options) as g:
            _, model, sched, scaler = scaled_loop(lambda opt: torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: 1.0 / (s + 1)), 5, {1, 3})
        return model[0].weight.detach().clone(), sched.get_last_lr(), scaler.get_scale(), g.stats

    w, lr, scale, stats = run(nonfinite="skip")
    w_ref, lr_ref, scale_ref, stats_ref = run()
    assert torch.equal(w, w_ref) and lr == lr_ref and scale == scale_ref
    assert stats.optimizer_steps_skipped == stats_ref.optimizer_steps_skipped == 2
    assert stats.nonfinite_steps_skipped == 0


@pytest.mark.parametrize("schedulers", [True, False], ids=["schedulers", "schedulers=False"])
def test_under_a_grad_scaler_a_nan_loss_skips_only_the_step_gradscaler_skips(schedulers):
    """A NaN batch under a GradScaler: GradScaler skips its step, and skip mode must skip no other. With
    schedulers=False no read rode on update(): the NaN loss was read at the next batch's call, and skip mode took
    that healthy batch's step too."""
    def run(guarded):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        with ampguard.guard(nonfinite="skip", schedulers=schedulers) if guarded else contextlib.nullcontext() as g, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for x, y in corrupt(batches(8), 3):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale(), g

    plain, guarded = run(False), run(True)
    assert all(torch.equal(p, q) for p, q in zip(plain[0], guarded[0], strict=True)) and plain[1] == guarded[1]
    stats = guarded[2].stats
    assert stats.optimizer_steps_skipped == 1 and stats.nonfinite_steps_skipped == 0, stats


def test_a_nan_output_of_an_inference_call_warns():
    model = torch.nn.Linear(4, 2).eval()
    with warnings.catch_warnings(record=True) as caught, ampguard.guard(nonfinite="skip") as g:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = model(torch.full((1, 4), float("nan")))
        ampguard.nonfinite.check()
    assert torch.isnan(out).all() and g.stats.nonfinite_detected == 1 and g.stats.nonfinite_steps_skipped == 0
    found = ours(caught)
    assert len(found) == 1 and "NaN reached the output of module 'Linear'" in found[0]
    assert "step this reached is skipped" not in found[0]


def test_a_closure_step_is_skipped_too():
    data = corrupt(batches(3), 1)
    model, opt, sched = make()
    with warnings.catch_warnings(), ampguard.guard(nonfinite="skip") as g:
        warnings.simplefilter("ignore")
        for x, y in data:
            def closure(x=x, y=y):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
            sched.step()
    identical((model, opt, sched), train([data[0], data[2]]))
    assert g.stats.nonfinite_steps_skipped == 1


SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    x = torch.randn(8, 4)
    if i == 1:
        x[0, 0] = float("nan")
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("finite", bool(torch.isfinite(model.weight).all()))
"""


def test_ampguard_nonfinite_skip_in_a_subprocess(python):
    proc = python(SCRIPT, env={"AMPGUARD": "1", "AMPGUARD_NONFINITE": "skip"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finite True" in proc.stdout
    assert "nonfinite='skip': the optimizer step this reached is skipped" in proc.stderr
    assert "3 applied, 0 skipped by GradScaler (inf/NaN gradients), 1 skipped by nonfinite='skip'" in proc.stderr
    plain = python(SCRIPT)
    assert "finite False" in plain.stdout  # without it the run is lost


@pytest.mark.parametrize("scenario", ["skip_ddp", "skip_replicas"])
def test_every_rank_skips_together(python, scenario):
    r0, r1 = run_ranks(python, scenario)
    assert r0["weight"] == r1["weight"] and r0["lr"] == r1["lr"]
    assert r0["skipped"] == r1["skipped"] == 1 and r0["applied"] == r1["applied"] == 4
    assert any("argument 0 of the call of 'Linear'" in w for w in r1["warnings"])  # the corrupt rank: its origin
    assert len(r1["bundles"]) == 1 and r1["bundles"][0].endswith("-rank1.pt")  # each rank's file, named by rank
    if scenario == "skip_replicas":  # no gradient all-reduce: rank 0 skips because rank 1 did
        assert r0["warnings"] and "another rank's loss or gradients were non-finite" in r0["warnings"][0]
    else:
        assert "DDP/FSDP all-reduce gradients, so another rank's non-finite gradients" in r0["warnings"][0]


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_fit_skips_the_step_and_holds_the_per_step_scheduler(namespace):
    L = pytest.importorskip(namespace)
    from test_lightning import BATCHES, fit, module_class

    model = module_class(L, sched=True, overflow=(1,))()  # batch 1's gradients are inf; no GradScaler
    with ampguard.guard(nonfinite="skip") as g:
        trainer, ours = fit(L, model)
    assert model.training_steps == BATCHES
    assert torch.isfinite(model.layer.weight).all()
    assert g.stats.nonfinite_steps_skipped == 1 and g.stats.optimizer_steps_applied == BATCHES - 1
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == BATCHES - 1
    assert len(ours) == 1 and "the optimizer step this reached is skipped" in str(ours[0].message)


def test_a_nan_found_at_guard_exit_does_not_skip_a_later_step():
    model, opt, sched = make()
    with warnings.catch_warnings(), ampguard.guard(nonfinite="skip"):
        warnings.simplefilter("ignore")
        torch.nn.functional.mse_loss(model(torch.full((4, 8), float("nan"))), torch.zeros(4, 1)).backward()
        opt.zero_grad()  # no step: the NaN is found as the block ends
    with ampguard.guard(nonfinite="skip") as g:
        train(batches(1), (model, opt, sched))
    assert g.stats.nonfinite_steps_skipped == 0 and g.stats.optimizer_steps_applied == 1


def train_skipping_itself(data, set_to_none):
    """fairseq's recipe: backward, clip; a batch whose total norm is non-finite is skipped by the loop itself."""
    model, opt, sched = make()
    skipped = 0
    for x, y in data:
        torch.nn.functional.mse_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(norm):
            opt.zero_grad(set_to_none=set_to_none)
            skipped += 1
            continue
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=set_to_none)
    return (model, opt, sched), skipped


@pytest.mark.parametrize(("set_to_none", "reads"), [(True, "host"), (False, "host"), (True, "device")],
                         ids=["grads None", "grads zeroed", "grads None, device reads"])
def test_a_batch_the_loop_skipped_itself_does_not_cost_the_next_batch_its_step(set_to_none, reads, monkeypatch):
    """The loop cleared the bad batch's gradients and went on: the check is read at the next batch's call, and
    no gradient of the bad batch is left. Skip mode skipped the next, clean batch's step. On a device the next
    call was taken for the next micro-batch of an accumulated step (no read), unless the gradients are None."""
    monkeypatch.setattr(_sync, "HOST_READS", reads == "host")  # "device": each read is a sync, as on a GPU
    data = batches()
    data[2][1][0, 0] = float("nan")  # a bad target: the loss is NaN, the model's buffers are not
    plain, plain_skipped = train_skipping_itself(data, set_to_none)
    with warnings.catch_warnings(record=True) as caught, ampguard.guard(nonfinite="skip") as g:
        warnings.simplefilter("always")
        guarded, guarded_skipped = train_skipping_itself(data, set_to_none)
    assert plain_skipped == guarded_skipped == 1
    identical(guarded, plain)
    assert g.stats.nonfinite_steps_skipped == 0 and g.stats.optimizer_steps_applied == 5
    found = ours(caught)
    assert len(found) == 1 and "no step took what it made, so none is skipped" in found[0], found
    assert "the optimizer step this reached is skipped" not in found[0]


@pytest.mark.parametrize("reads", ["host", "device"])
def test_a_nan_micro_batch_of_an_accumulated_step_still_skips_that_step(reads, monkeypatch):
    """Gradient accumulation keeps the bad micro-batch's gradients for the step: that step is skipped."""
    monkeypatch.setattr(_sync, "HOST_READS", reads == "host")
    model, opt, _ = make()
    data = corrupt(batches(4), 1)
    with warnings.catch_warnings(), ampguard.guard(nonfinite="skip") as g:
        warnings.simplefilter("ignore")
        for i in range(0, 4, 2):
            for x, y in data[i:i + 2]:
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert g.stats.nonfinite_steps_skipped == 1 and g.stats.optimizer_steps_applied == 1
    assert torch.isfinite(model[0].weight).all()
