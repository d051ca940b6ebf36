"""Reproducer bundles: written on a NaN in one process, replayed by ``python -m ampguard repro`` in another."""

import io
import os
import pathlib

import pytest
import torch

import ampguard
from ampguard.nonfinite import repro as repro_module

MODELS = '''
import torch


class MLP(torch.nn.Module):
    def __init__(self, d, bad=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.bad = bad

    def forward(self, x):
        h = self.fc1(x)
        if self.bad:
            h = torch.log(h - 10.0)  # FORWARD ORIGIN
        return self.fc2(torch.relu(h))


class Block(torch.nn.Module):
    def __init__(self, d, bad=False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.mlp = MLP(d, bad)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(torch.nn.Module):
    """A small language model: the embedding and the head are most of its size."""

    def __init__(self, vocab=5000, d=64, n=4, bad_block=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([Block(d, i == bad_block) for i in range(n)])
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SqrtAtZero(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h + torch.sqrt(h * 0)  # BACKWARD ORIGIN
'''

TRAIN = '''
import sys, torch, ampguard
from nanmodels import Model
ampguard.install()
torch.manual_seed(0)
model = Model(bad_block=int(sys.argv[1]))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
idx = torch.randint(0, 5000, (2, 8))
try:
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 5000), idx.view(-1))
    loss.backward()
    opt.step()
except ampguard.NonFiniteError as err:
    print("REPRO", err.repro)
    print("SIZE", sum(p.numel() * p.element_size() for p in model.parameters()))
'''


@pytest.fixture
def code(tmp_path):
    (tmp_path / "nanmodels.py").write_text(MODELS)
    return tmp_path


def line(marker):
    return next(i for i, text in enumerate(MODELS.splitlines(), 1) if marker in text)


def repro(python, path, cwd, *args):
    return python(None, "-m", "ampguard", "repro", str(path), *args, cwd=cwd)


def nan_step(code, monkeypatch, bad_block, **options):
    """One training step of the test model, NaN in blocks[bad_block].mlp, in this process: the error."""
    monkeypatch.syspath_prepend(str(code))
    from nanmodels import Model

    torch.manual_seed(0)
    model = Model(bad_block=bad_block)
    with ampguard.guard(repro_dir=str(code / "b"), **options), pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randint(0, 5000, (2, 8))).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    return info.value


def test_a_bundle_from_one_process_replays_in_another_naming_the_op_and_the_line(python, code):
    proc = python(TRAIN, "2", env={"AMPGUARD_REPRO_DIR": str(code / "bundles")}, cwd=code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = pathlib.Path(proc.stdout.split("REPRO ")[1].split()[0])
    model_size = int(proc.stdout.split("SIZE ")[1].split()[0])
    assert path.parent == code / "bundles" and path.exists()
    # only blocks.2.mlp and its input: far under the model (embedding and head are most of it)
    assert path.stat().st_size < model_size / 8, (path.stat().st_size, model_size)
    out = repro(python, path, code)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "bundled: module 'blocks.2.mlp' (nanmodels.MLP) of Model, forward pass" in out.stdout
    assert "It was created by torch.log (inputs finite, output NaN)" in out.stdout
    assert f"nanmodels.py:{line('FORWARD ORIGIN')} in forward" in out.stdout
    assert "weights_only cannot rebuild" in out.stdout  # why the module part is unpickled
    assert out.stdout.rstrip().endswith("ampguard repro: reproduced.")
    assert "Traceback" not in out.stderr


def test_the_error_carries_the_bundle_and_says_where(code, monkeypatch):
    error = nan_step(code, monkeypatch, 0)
    assert error.repro is not None and os.path.exists(error.repro)
    assert f"reproducer: {error.repro}\n    python -m ampguard repro {error.repro}" in str(error)
    meta = torch.load(error.repro, weights_only=True)  # the outer layer needs no code to read
    assert meta["module_path"] == "blocks.0.mlp" and meta["kind"] == "module" and meta["rank"] is None
    assert meta["versions"]["torch"] == str(torch.__version__) and meta["options"]["repro_dir"]


def test_a_backward_origin_bundles_the_call_and_replays_its_backward(python, code, monkeypatch):
    monkeypatch.syspath_prepend(str(code))
    from nanmodels import SqrtAtZero

    model = SqrtAtZero()
    with ampguard.guard(repro_dir=str(code / "b")), pytest.raises(ampguard.NonFiniteError) as info:
        model(torch.randn(2, 4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    out = repro(python, info.value.repro, code)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "backward pass" in out.stdout
    assert "The backward of torch.sqrt (SqrtBackward0)" in out.stdout
    assert f"nanmodels.py:{line('BACKWARD ORIGIN')}" in out.stdout


def test_a_loss_code_op_is_bundled_as_the_op_and_loads_weights_only(python, tmp_path):
    model = torch.nn.Linear(4, 2)
    with ampguard.guard(repro_dir=str(tmp_path)), pytest.raises(ampguard.NonFiniteError) as info:
        probs = torch.softmax(model(torch.randn(3, 4)), -1) * 0
        loss = -torch.log(probs).mean()  # -inf in the loss code
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert info.value.op == "torch.log"
    out = repro(python, info.value.repro, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the loss-code op, outside any module" in out.stdout
    assert "loaded with weights_only=True" in out.stdout
    assert "created by torch.log" in out.stdout


def test_a_loss_code_op_called_through_torch_ops_is_bundled_by_its_aten_name(python, tmp_path):
    """``torch.ops.aten.log.default(x)`` is named 'aten.log'; a bundle resolves that name through torch.ops. (It was
    named 'torch._ops.aten.log.default', which no import finds: the bundle was written and failed to load.)"""
    model = torch.nn.Linear(4, 2)
    with ampguard.guard(repro_dir=str(tmp_path)), pytest.raises(ampguard.NonFiniteError) as info:
        loss = torch.ops.aten.log.default(model(torch.rand(3, 4)) - 10).mean()
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert info.value.op == "aten.log" and info.value.repro is not None, str(info.value)
    out = repro(python, info.value.repro, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "created by aten.log" in out.stdout, out.stdout


@pytest.mark.parametrize("where", ["loss code", "submodule"])
def test_a_nan_in_lightnings_training_step_is_bundled_as_its_op_or_its_submodule(python, code, monkeypatch, where):
    """Under automatic optimization training_step is the outermost call. A NaN in its own code (its loss code) is
    bundled as that op and its inputs, as the loss code of a plain loop is; one in a submodule, as that module."""
    L = pytest.importorskip("lightning.pytorch")
    monkeypatch.syspath_prepend(str(code))
    from nanmodels import MLP

    class Poisoned(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = MLP(4, bad=where == "submodule")

        def training_step(self, batch, batch_idx):
            out = self.body(batch[0])
            if where == "loss code":
                out = torch.log(out - out - 1)  # LIGHTNING LOSS CODE
            return out.pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=8)
    with ampguard.guard(repro_dir=str(code / "b")), pytest.raises(ampguard.NonFiniteError) as info:
        trainer.fit(Poisoned(), data)
    assert info.value.repro is not None, str(info.value)
    out = repro(python, info.value.repro, code)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "created by torch.log (inputs finite, output NaN)" in out.stdout
    if where == "loss code":
        assert "the loss-code op, outside any module" in out.stdout and "loaded with weights_only=True" in out.stdout
    else:
        assert "bundled: module 'body' (nanmodels.MLP) of " in out.stdout and "Poisoned, forward pass" in out.stdout
        assert f"nanmodels.py:{line('FORWARD ORIGIN')} in forward" in out.stdout


def test_a_value_that_does_not_reproduce_exits_0_and_says_so(python, code, monkeypatch):
    error = nan_step(code, monkeypatch, 1)
    # rewrite the bundle as a transient fault would leave it: the same call, now finite
    meta = torch.load(error.repro, weights_only=True)
    body = torch.load(__import__("io").BytesIO(repro_module._as_bytes(meta["payload"])), weights_only=False)
    body["module"].bad = False
    buffer = __import__("io").BytesIO()
    torch.save(body, buffer)
    meta["payload"] = repro_module._as_tensor(buffer.getvalue())
    torch.save(meta, error.repro)
    out = repro(python, error.repro, code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "did not reproduce" in out.stdout and "transient fault" in out.stdout


def test_the_payload_is_a_tensor_and_a_bundle_whose_payload_is_bytes_still_loads(python, code, monkeypatch):
    """The payload is a uint8 tensor: torch before 2.5 loads no bytes with weights_only=True. A bundle written
    before that, with the payload as bytes, loads as it did (on a torch that loads bytes)."""
    error = nan_step(code, monkeypatch, 1)
    meta = torch.load(error.repro, weights_only=True)
    assert isinstance(meta["payload"], torch.Tensor) and meta["payload"].dtype == torch.uint8
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5):
        return  # (this torch cannot load the older format's outer layer with weights_only=True)
    meta["payload"] = repro_module._as_bytes(meta["payload"])
    torch.save(meta, error.repro)
    out = repro(python, error.repro, code)
    assert out.returncode == 1 and "created by" in out.stdout, out.stdout + out.stderr


def test_broken_bundles_get_one_line_not_a_traceback(python, code, tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a bundle at all")
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(2)}, other)
    for path, words in ((garbage, "is not a readable ampguard bundle"),
                        (other, "is not an ampguard reproducer bundle")):
        out = repro(python, path, tmp_path)
        assert out.returncode == 2 and words in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    # a path that is not there: said at once, before torch's import (seconds)
    out = python(None, "-c", "import sys\nfrom ampguard.__main__ import main\n"
                 "code = main(['repro', 'missing.pt'])\nprint(code, 'torch' in sys.modules)", cwd=tmp_path)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert out.stderr.strip() == "ampguard repro: no such file: missing.pt", out.stderr
    # an op that is not torch's (a bundle written before the writer refused them: a script function, a custom op)
    for name in ("TorchScript function 'focal'", "mylib.shifted_log"):
        payload = io.BytesIO()
        torch.save({"func": name, "args": (torch.ones(2),), "kwargs": {}}, payload)
        foreign = tmp_path / "foreign.pt"
        torch.save({"format": repro_module.FORMAT, "kind": "op", "payload": payload.getvalue()}, foreign)
        out = repro(python, foreign, tmp_path)
        assert out.returncode == 2 and f"the op {name} does not exist in torch" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    # a class that cannot be imported where the command runs
    proc = python(TRAIN, "2", env={"AMPGUARD_REPRO_DIR": str(code / "bundles")}, cwd=code)
    path = proc.stdout.split("REPRO ")[1].split()[0]
    out = repro(python, path, tmp_path / "..")
    assert out.returncode == 2 and "nanmodels.MLP cannot be imported here" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    out = repro(python, path, code, "--device", "cuda")
    if not torch.cuda.is_available():
        assert out.returncode == 2 and "--device cpu" in out.stderr


def test_a_bundle_over_the_size_cap_is_not_written_and_the_message_says_why(code, monkeypatch):
    error = nan_step(code, monkeypatch, 2, repro_max_mb=0.01)
    assert error.repro is None and not (code / "b").exists()
    assert "no reproducer written: the bundle would be 0.1 MB, over repro_max_mb=0.01" in str(error)


def test_skip_mode_writes_one_bundle_per_origin(code, monkeypatch):
    import warnings

    monkeypatch.syspath_prepend(str(code))
    from nanmodels import Model

    torch.manual_seed(0)
    model = Model(bad_block=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught, \
            ampguard.guard(nonfinite="skip", repro_dir=str(code / "b")) as g:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randint(0, 5000, (2, 8))).float().mean().backward()
            opt.step()
            opt.zero_grad()
    assert g.stats.nonfinite_steps_skipped == 3
    assert len(list((code / "b").iterdir())) == 1
    assert sum("python -m ampguard repro" in str(w.message) for w in caught) == 1


def test_no_bundle_is_written_on_the_normal_path(code, monkeypatch):
    monkeypatch.syspath_prepend(str(code))
    from nanmodels import Model

    model = Model(bad_block=-1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampguard.guard(repro_dir=str(code / "b")):
        for _ in range(2):
            model(torch.randint(0, 5000, (2, 8))).mean().backward()
            opt.step()
            opt.zero_grad()
    assert not (code / "b").exists()


def test_repro_usage_errors(python, tmp_path):
    out = python(None, "-m", "ampguard", "repro", cwd=tmp_path)
    assert out.returncode == 2 and "expected one bundle path" in out.stderr
    out = python(None, "-m", "ampguard", "repro", "x.pt", "--device", "tpu", cwd=tmp_path)
    assert out.returncode == 2 and "--device cpu or --device cuda" in out.stderr
    out = python(None, "-m", "ampguard", "repro", "x.pt", "--device", cwd=tmp_path)
    assert out.returncode == 2 and "--device needs a value: cpu or cuda" in out.stderr
    for where in (["repro"], ["repro", "x.pt"], ["doctor"]):
        out = python(None, "-m", "ampguard", *where, "--help", cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.startswith("usage: python -m ampguard"), out.stderr
    out = python(None, "-m", "ampguard", "doctor", "--verbose", cwd=tmp_path)
    assert out.returncode == 2 and "ampguard doctor: takes no arguments (got --verbose)" in out.stderr




SKIP_RUN = '''
import torch
from nanmodels import Model
torch.manual_seed(0)
model = Model(bad_block=2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    model(torch.randint(0, 5000, (2, 8))).float().mean().backward()
    opt.step()
    opt.zero_grad()
'''


def test_under_ampguard_1_the_exit_report_says_where_bundles_went(python, code):
    proc = python(SKIP_RUN, env={"AMPGUARD": "1", "AMPGUARD_NONFINITE": "skip", "AMPGUARD_REPRO_DIR": "bundles"},
                  cwd=code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (bundle,) = (code / "bundles").iterdir()
    assert f"reproducers: 1 written to {code / 'bundles'}; replay one with: python -m ampguard repro {bundle}" \
        in proc.stderr
    assert "3 skipped by nonfinite='skip'" in proc.stderr


@pytest.mark.parametrize("write", ["masked assignment", "in-place op", "constant"])
def test_a_loss_code_op_that_writes_in_place_or_holds_a_constant_is_replayed_from_its_bundle(python, tmp_path, write):
    """An in-place op's bundle crashed the repro command ("a leaf Variable that requires grad is being used in an
    in-place operation": the bundled tensor is such a leaf), and a constant's +Inf, an output whose status was
    taken when it was made, was dismissed as a sum of squares that overflowed: "did not reproduce"."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    target = torch.tensor([0, 1, 2, 0])
    with ampguard.guard(repro_dir=str(tmp_path)), pytest.raises(ampguard.NonFiniteError) as info:
        scores = model(torch.randn(4, 4))
        if write == "masked assignment":
            mask = torch.zeros(4, 3, dtype=torch.bool)
            mask[0] = True  # a fully masked row
            scores[mask] = float("-inf")
        elif write == "in-place op":
            scores = scores.clone().mul_(0.0).log_()  # log of 0, in place
        else:
            scores = scores + torch.tensor(float("inf"))
        torch.nn.functional.cross_entropy(scores, target).backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    out = repro(python, info.value.repro, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the loss-code op, outside any module" in out.stdout and "ampguard repro: reproduced." in out.stdout
    given = {"masked assignment": "an input of aten._log_softmax inside torch.nn.functional.cross_entropy",
             "in-place op": "created by Tensor.log_",
             "constant": "given to torch.tensor"}[write]
    assert given in out.stdout, out.stdout
