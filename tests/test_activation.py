"""AMPGUARD=1 and python -m ampguard, end to end in real subprocesses."""

import pytest

# A training script that never imports ampguard. Its first iteration overflows.
SCRIPT = """
import sys, warnings
import torch
warnings.simplefilter("always")
m = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
scaler = torch.amp.GradScaler("cpu")
first = [True]
def overflow(g):
    if first[0]:
        first[0] = False
        return g * float("inf")
m.weight.register_hook(overflow)
for i in range(3):
    scaler.scale(m(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt); scaler.update(); sched.step(); opt.zero_grad()
print("epoch", sched.last_epoch, "ampguard" in sys.modules, __name__, sys.argv[1:])
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_plain_run_shows_the_problem(python, script):
    proc = python(None, str(script))
    assert "epoch 3 False __main__ []" in proc.stdout
    assert "before `optimizer.step()`" in proc.stderr


def test_ampguard_env_installs_in_a_script_that_never_imports_it(python, script):
    proc = python(None, str(script), "5", "x", env={"AMPGUARD": "1"})
    assert proc.returncode == 5
    assert "epoch 2 True __main__ ['5', 'x']" in proc.stdout
    assert "before `optimizer.step()`" not in proc.stderr


def test_ampguard_off_does_nothing(python, script):
    proc = python(None, str(script), env={"AMPGUARD": "0"})
    assert "epoch 3 False" in proc.stdout


@pytest.mark.parametrize("value", ["", "0", "off", "False", " no "])
def test_every_off_value_stops_the_start_up_hook_before_it_imports_anything(monkeypatch, value):
    import sys

    import _ampguard_startup

    monkeypatch.setenv("AMPGUARD", value)
    monkeypatch.setattr(_ampguard_startup, "_ran", False)
    monkeypatch.delitem(sys.modules, "ampguard._startup", raising=False)
    _ampguard_startup.run()
    assert not _ampguard_startup._ran and "ampguard._startup" not in sys.modules


def test_env_options_reach_the_guard(python):
    proc = python("import torch, ampguard; print(ampguard.active().options.max_consecutive_skips)",
                  env={"AMPGUARD": "1", "AMPGUARD_MAX_CONSECUTIVE_SKIPS": "50"})
    assert proc.stdout.strip() == "50", proc.stderr


@pytest.mark.parametrize(("env", "line"), [
    ({"AMPGUARD": "1", "AMPGUARD_SCHEDULERS": "maybe"},
     "ampguard: environment variable AMPGUARD_SCHEDULERS got 'maybe'; accepted values: 1/0, true/false, yes/no or "
     "on/off"),
    ({"AMPGUARD": "yes please"}, "ampguard: environment variable AMPGUARD got 'yes please'; accepted values: 1/0"),
])
def test_bad_env_value_prints_one_line_and_runs_without_the_guard(python, script, env, line):
    proc = python(None, str(script), "0", env=env)
    assert proc.returncode == 0
    assert "epoch 3" in proc.stdout  # the program ran, unguarded
    ours = [x for x in proc.stderr.splitlines() if x.startswith("ampguard:")]
    assert len(ours) == 1 and ours[0].startswith(line), proc.stderr
    assert ours[0].endswith("-- running without ampguard")


def test_an_unknown_variable_warns_with_the_closest_name_and_the_guard_still_runs(python, script):
    proc = python("import torch, ampguard; print(ampguard.active() is not None)",
                  env={"AMPGUARD": "1", "AMPGUARD_MAX_SKIPS": "3"})
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "unknown environment variable" in x]
    assert len(lines) == 1 and "AMPGUARD_MAX_SKIPS is ignored; did you mean AMPGUARD_MAX_CONSECUTIVE_SKIPS?" in lines[0]
    assert lines[0].startswith("<environment>:0: AmpGuardWarning"), lines[0]  # not a line of the start-up hook
    assert "_ampguard_startup" not in proc.stderr


def test_ampguard_env_works_under_a_pytest_configuration_that_turns_warnings_into_errors(python, tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    error\n")
    (tmp_path / "test_strict.py").write_text(
        "import ampguard\n\ndef test_guarded():\n    assert ampguard.active() is not None\n")
    proc = python(None, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=tmp_path, env={"AMPGUARD": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout


def test_a_keyword_wins_even_over_an_invalid_environment_value(monkeypatch):
    import ampguard

    monkeypatch.setenv("AMPGUARD_TRACE", "bogus")
    assert ampguard.install(trace="eager").options.trace == "eager"
    ampguard.uninstall()
    with pytest.raises(ampguard.ConfigError, match="AMPGUARD_TRACE got 'bogus'; accepted values: replay, eager or off"):
        ampguard.install()


def test_python_m_ampguard_runs_a_script_with_args_and_exit_code(python, script):
    proc = python(None, "-m", "ampguard", str(script), "7", "--flag")
    assert proc.returncode == 7
    assert "epoch 2 True __main__ ['7', '--flag']" in proc.stdout
    assert "before `optimizer.step()`" not in proc.stderr


def test_python_m_ampguard_runs_a_module(python, script):
    proc = python(None, "-m", "ampguard", "-m", "train", "3", cwd=script.parent)
    assert proc.returncode == 3, proc.stderr
    assert "epoch 2 True __main__ ['3']" in proc.stdout


def test_python_m_ampguard_usage_and_missing_file(python, tmp_path):
    assert python(None, "-m", "ampguard").returncode == 2
    proc = python(None, "-m", "ampguard", str(tmp_path / "nope.py"))
    assert proc.returncode == 1 and proc.stderr.strip().endswith("nope.py': no such file")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert python(None, "-m", "ampguard", "--help").returncode == 0


def test_python_m_ampguard_takes_dash_c_version_and_a_missing_module_as_python_does(python):
    proc = python(None, "-m", "ampguard", "-c", "import sys, ampguard; print(sys.argv, ampguard.active() is not None)",
                  "x")
    assert proc.returncode == 0 and proc.stdout.strip() == "['-c', 'x'] True", proc.stderr
    proc = python(None, "-m", "ampguard", "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("ampguard 0.")
    proc = python(None, "-m", "ampguard", "-m", "no_such_mod")
    assert proc.returncode == 1 and proc.stderr.strip() == "ampguard: no module named 'no_such_mod'"


def test_python_m_ampguard_shows_an_uncaught_error_as_python_does(python, tmp_path):
    """The traceback starts at the program's own frame, as ``python script.py`` shows it: no frame of the launcher
    (ampguard's __main__, runpy), which only pushed the program's frames down. Exit code 1; a hook the program set
    in sys.excepthook prints it."""
    (tmp_path / "fails.py").write_text("def load():\n    raise ValueError('no such shard')\n\nload()\n")
    plain = python(None, "fails.py", cwd=tmp_path)
    for argv in (["fails.py"], ["-m", "fails"], ["-c", "import fails"]):
        proc = python(None, "-m", "ampguard", *argv, cwd=tmp_path, env={"AMPGUARD_REPORT": "0"})
        assert proc.returncode == 1, proc.stderr
        assert "ValueError: no such shard" in proc.stderr and 'fails.py", line 2, in load' in proc.stderr
        assert "__main__.py" not in proc.stderr and "runpy" not in proc.stderr, proc.stderr
    proc = python(None, "-m", "ampguard", "fails.py", cwd=tmp_path, env={"AMPGUARD_REPORT": "0"})
    assert proc.stderr == plain.stderr
    proc = python(None, "-m", "ampguard", "-c", "import sys\nsys.excepthook = lambda t, e, tb: print('hook:', e)\n"
                  "raise RuntimeError('late')", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout.strip() == "hook: late", proc.stdout + proc.stderr


def test_python_m_ampguard_with_an_invalid_value_exits_2_without_running(python, tmp_path):
    path = tmp_path / "ran.py"
    path.write_text("print('the program ran')\n")
    proc = python(None, "-m", "ampguard", str(path), env={"AMPGUARD_MAX_CONSECUTIVE_SKIPS": "many"})
    assert proc.returncode == 2 and "the program ran" not in proc.stdout
    assert proc.stderr.strip() == ("ampguard: environment variable AMPGUARD_MAX_CONSECUTIVE_SKIPS got 'many'; "
                                   "accepted values: a positive integer or 'none'")


def test_doctor_in_a_closed_pipe_is_silent(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(f"'{sys.executable}' -m ampguard doctor | head -1", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith("ampguard doctor") and "BrokenPipeError" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_uncaught_exception_exits_1_with_traceback(python, tmp_path):
    path = tmp_path / "boom.py"
    path.write_text("raise RuntimeError('boom')\n")
    proc = python(None, "-m", "ampguard", str(path))
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr


def test_startup_hook_files_are_installed_and_safe_to_process_twice(python):
    proc = python("""
        import site, sysconfig, os, sys
        purelib = sysconfig.get_paths()["purelib"]
        names = set(os.listdir(purelib))
        print(all(n in names for n in ("ampguard.pth", "ampguard.start", "_ampguard_startup.py")))
        site.addsitedir(purelib)          # processes ampguard.pth a second time
        import _ampguard_startup; _ampguard_startup.run()
        import torch, wrapt
        update = vars(torch.amp.GradScaler)["update"]
        print(isinstance(update, wrapt.FunctionWrapper), isinstance(update.__wrapped__, wrapt.FunctionWrapper))
    """, env={"AMPGUARD": "1"})
    assert proc.stdout.split() == ["True", "True", "False"], proc.stderr


def test_startup_hook_costs_nothing_when_unset(python):
    proc = python("import sys; print(sorted(m for m in sys.modules if 'ampguard' in m or m == 'wrapt'))")
    assert proc.stdout.strip() == "[]"


def test_startup_hook_never_breaks_startup(python, tmp_path):
    # A broken ampguard on the path: the interpreter still starts and the program runs.
    (tmp_path / "ampguard").mkdir()
    (tmp_path / "ampguard" / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    proc = python("print('still running')", env={"AMPGUARD": "1", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0 and "still running" in proc.stdout
    assert "start-up hook failed" in proc.stderr


def test_exit_report_after_something_happened(python, script):
    proc = python(None, str(script), env={"AMPGUARD": "1"})
    assert proc.returncode == 0
    report = proc.stderr[proc.stderr.index("ampguard report"):].splitlines()
    assert report[1] == "  optimizer steps: 2 applied, 1 skipped by GradScaler (inf/NaN gradients)"
    assert report[2] == "  scheduler steps held: 1"
    assert report[3].startswith("  loss scale: last 32768 (range 32768 .. 32768)")
    assert len(report) <= 8


def test_exit_report_also_under_python_m_ampguard_and_silenced_by_ampguard_report_0(python, script):
    assert "ampguard report" in python(None, "-m", "ampguard", str(script)).stderr
    assert "ampguard report" not in python(None, str(script), env={"AMPGUARD": "1", "AMPGUARD_REPORT": "0"}).stderr
    bad = python(None, str(script), env={"AMPGUARD": "1", "AMPGUARD_REPORT": "loud"})
    assert "environment variable AMPGUARD_REPORT got 'loud'; accepted values: 1/0" in bad.stderr
    assert "epoch 3" in bad.stdout  # ran, unguarded


def test_no_exit_report_when_nothing_happened_or_when_installed_in_code(python, tmp_path):
    quiet = tmp_path / "quiet.py"
    quiet.write_text("import torch\nm = torch.nn.Linear(2, 1)\nm(torch.ones(1, 2)).sum().backward()\n")
    proc = python(None, str(quiet), env={"AMPGUARD": "1"})
    assert proc.returncode == 0 and proc.stderr == ""
    in_code = python("""
        import torch, ampguard
        g = ampguard.install()
        g.stats.optimizer_steps_skipped = 1  # something happened, but the script installed the guard itself
    """)
    assert in_code.returncode == 0 and "ampguard report" not in in_code.stderr


def test_doctor_reports_versions_hook_options_targets_and_devices(python):
    import torch
    proc = python(None, "-m", "ampguard", "doctor", env={"AMPGUARD_TRACE": "eager"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for fragment in ("ampguard           0.1.0", "torch              2.", "wrapt              2.",
                     "ampguard.pth: installed in", "AMPGUARD: not set",
                     "trace                  = 'eager'      (AMPGUARD_TRACE)",
                     "schedulers             = True         (default)",
                     f"CUDA available: {torch.cuda.is_available()}",  # (the GPU checks run this file too)
                     "torch.amp.grad_scaler.GradScaler.update: read found_inf",
                     "overridden by: torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
                     "torch.optim.lr_scheduler.ReduceLROnPlateau, torch.optim.lr_scheduler.SequentialLR",
                     "lightning.pytorch.core.module.LightningModule.optimizer_step: give an override",
                     "all is well"):
        assert fragment in out, fragment


def test_doctor_exits_1_with_the_reason_for_a_bad_variable(python):
    proc = python(None, "-m", "ampguard", "doctor",
                  env={"AMPGUARD": "1", "AMPGUARD_NONFINITE": "explode", "AMPGUARD_TRACE": "sideways"})
    assert proc.returncode == 1
    assert "2 problem(s)" in proc.stdout  # every bad variable, not the first only
    assert "the program would run WITHOUT the guard" in proc.stdout
    reason = ("  - ampguard: environment variable AMPGUARD_NONFINITE got 'explode'; accepted values: "
              "raise, warn, skip or off")
    assert reason in proc.stdout


def test_doctor_exits_1_where_ampguard_is_not_installed(tmp_path):
    # The base interpreter of this venv, with ampguard's source on the path but not installed:
    # no torch, and no start-up hook file in its site-packages.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMPGUARD", "PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = root
    # sys._base_executable is the venv's own python on Python 3.10; the base prefix's interpreter is the base one
    base = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    if not os.path.exists(base):
        base = sys._base_executable
    proc = subprocess.run([base, "-m", "ampguard", "doctor"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "torch is not installed; ampguard needs torch >= 2.4" in proc.stdout
    assert "ampguard.pth is not in any site-packages of this interpreter, so AMPGUARD=1 does nothing" in proc.stdout
