"""Failure and abuse leave nothing behind: pickled errors, rejected options, usage errors that end in
the user's frame, a disabled GradScaler, and a CLI that is a drop-in for python."""

import multiprocessing
import pickle
import traceback
import warnings

import pytest
import torch

import ampguard
from ampguard._patching import REGISTRY


def diverging_trial(i):
    """A sweep's trial in a worker process: trial 1 makes a NaN loss."""
    with ampguard.guard():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(2, 4)
        loss = model(x).sum() * (float("nan") if i == 1 else 1.0)
        loss.backward()
        opt.step()
    return i


def test_errors_round_trip_through_pickle_with_their_attributes():
    nonfinite = ampguard.NonFiniteError("msg", kind="nan", sink="loss", op="torch.log", module="fc",
                                        chain=["torch.log", "Tensor.sum"],
                                        origin=traceback.StackSummary.from_list([("f.py", 3, "fn", "x = 1")]))
    collapse = ampguard.LossScaleCollapseError("collapse", optimizers=["SGD#0"], scale_history=[2.0, 1.0])
    for error in (nonfinite, collapse, ampguard.ConfigError("bad")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert {k: v for k, v in vars(copy).items() if k != "origin"} == \
            {k: v for k, v in vars(error).items() if k != "origin"}
    copy = pickle.loads(pickle.dumps(nonfinite))
    assert copy.origin[0].lineno == 3 and copy.origin[0].filename == "f.py"


def test_a_pool_sweep_with_a_diverging_trial_reports_it_instead_of_hanging():
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        result = pool.map_async(diverging_trial, [0, 1])
        with pytest.raises(ampguard.NonFiniteError) as info:
            result.get(timeout=120)
    assert info.value.sink == "loss" and info.value.kind == "nan"


def _patched_now():
    from torch.amp.grad_scaler import GradScaler
    from torch.optim.lr_scheduler import LRScheduler

    return {"update": vars(GradScaler)["update"], "step": vars(LRScheduler)["step"],
            "backward": torch.autograd.backward, "clip": torch.nn.utils.clip_grad_norm_, "warn": warnings.warn}


@pytest.mark.parametrize("entry", ["install", "guard"])
def test_a_rejected_option_changes_nothing(entry):
    before = _patched_now()
    with pytest.raises(ampguard.ConfigError, match="trace"):
        if entry == "install":
            ampguard.install(trace="bogus")
        else:
            with ampguard.guard(trace="bogus"):
                pass
    assert _patched_now() == before and not REGISTRY.installed and ampguard.active() is None


def test_a_usage_error_ends_in_the_callers_frame_and_a_misspelt_keyword_gets_did_you_mean():
    with pytest.raises(ampguard.ConfigError) as info:
        ampguard.install(max_consecutive_skip=3)
    assert "did you mean 'max_consecutive_skips'?" in str(info.value)
    frames = traceback.extract_tb(info.value.__traceback__)
    internal = [f for f in frames if "/ampguard/" in f.filename]
    assert [f.name for f in internal] == ["install"]  # the public entry point itself, nothing below it


def test_a_numpy_integer_is_an_integer():
    np = pytest.importorskip("numpy")
    g = ampguard.install(max_consecutive_skips=np.int64(5))
    assert g.options.max_consecutive_skips == 5 and type(g.options.max_consecutive_skips) is int


def test_install_inside_a_guard_block_returns_the_active_guard():
    with ampguard.guard(max_consecutive_skips=7) as block:
        assert ampguard.install() is block is ampguard.active()
    assert ampguard.install() is ampguard.active() is not block


def test_a_disabled_grad_scaler_is_no_grad_scaler():
    ampguard.install()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # the GradScaler(enabled=use_amp) idiom
    model.weight.register_hook(lambda grad: grad * float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ampguard.NonFiniteError) as info:
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert info.value.sink == "gradient of parameter 'weight'"  # before the step, not one step later
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- the CLI is a drop-in for python -----------------------------------------------------------------
def test_python_m_ampguard_guards_the_processes_the_program_starts(python, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys\n"
        "child = 'import ampguard, os; print(ampguard.active() is not None, os.environ.get(\"AMPGUARD_TRACE\"))'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())\n")
    proc = python(None, "-m", "ampguard", str(script), env={"AMPGUARD_TRACE": "off"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True off"  # guarded, with the same options


def test_python_m_ampguard_dash_m_of_a_package_without_main_is_one_line(python, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    proc = python(None, "-m", "ampguard", "-m", "pkg", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("ampguard: no module named pkg.__main__; 'pkg' is a package and cannot be "
                                   "directly executed")


def test_python_m_ampguard_gives_an_absolute_file_and_passes_interpreter_flags_on(python, tmp_path):
    script = tmp_path / "flags.py"
    script.write_text("import os, sys\n"
                      "print(os.path.isabs(__file__), sys.argv[0], sys.stdout.write_through, sys.flags.dev_mode, "
                      "sys.flags.optimize, sys.warnoptions)\n")
    proc = python(None, "-m", "ampguard", "-u", "-X", "dev", "-O", "-W", "error::DeprecationWarning", "flags.py",
                  cwd=tmp_path)  # -X dev adds 'default' to the warning options, as under plain python
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True flags.py True True 1 ['default', 'error::DeprecationWarning']"
    proc = python(None, "-m", "ampguard", "-W", cwd=tmp_path)
    assert proc.returncode == 2 and "argument expected for the -W option" in proc.stderr
