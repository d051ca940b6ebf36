"""Every example runs on CPU and shows what it claims."""

import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_scheduler_skip_example(python):
    proc = python(None, str(EXAMPLES / "scheduler_skip.py"))
    assert proc.returncode == 0, proc.stderr
    assert "plain torch warned: Detected call of `lr_scheduler.step()`" in proc.stdout
    assert "2 steps skipped, 2 scheduler steps held; no warning." in proc.stdout


def test_scheduler_skip_example_starts_with_its_own_output_where_numpy_is_missing(python):
    # set-up 1 installs torch and ampguard only: no numpy, and torch warns about it at import
    proc = python("import runpy, sys\nsys.modules['numpy'] = None\n"
                  f"runpy.run_path({str(EXAMPLES / 'scheduler_skip.py')!r}, run_name='__main__')")
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("iter  skipped")


def test_lightning_warmup_example(python):
    pytest.importorskip("lightning.pytorch")
    proc = python(None, str(EXAMPLES / "lightning_warmup.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training_step ran 40 times for 40 optimizer steps" in proc.stdout
    assert "closures injected by ampguard: 40" in proc.stdout
    assert "optimizer.step(closure=optimizer_closure)" in proc.stderr


def test_find_nan_example(python):
    proc = python(None, str(EXAMPLES / "find_nan.py"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    source = (EXAMPLES / "find_nan.py").read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(source) if "hand-written BCE" in text)
    assert "trained on without an error; a parameter sum is now nan" in out
    installed, env = out.split("== AMPGUARD=1")
    assert "It was created by torch.log (inputs finite, output -Inf) at" in installed
    assert f"find_nan.py:{line} in train" in installed and "It became NaN, -Inf in Tensor.mul" in installed
    assert f"err.op = 'torch.log', err.kind = 'nan', err.origin[-1].lineno = {line}" in installed
    assert "exit code 1" in env and "ampguard.NonFiniteError: ampguard: NaN reached the loss." in env
    assert f"find_nan.py:{line} in train" in env and "non-finite values detected: 1" in env
