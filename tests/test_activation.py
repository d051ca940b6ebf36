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


@pytest.mark.parametrize("value", ["0", "", "off"])
def test_ampguard_off_does_nothing(python, script, value):
    proc = python(None, str(script), env={"AMPGUARD": value})
    assert "epoch 3 False" in proc.stdout


def test_env_options_reach_the_guard(python):
    proc = python("import torch, ampguard; print(ampguard.active().options.max_consecutive_skips)",
                  env={"AMPGUARD": "1", "AMPGUARD_MAX_CONSECUTIVE_SKIPS": "50"})
    assert proc.stdout.strip() == "50", proc.stderr


@pytest.mark.parametrize(("env", "line"), [
    ({"AMPGUARD": "1", "AMPGUARD_MAX_CONSECUTIVE_SKIPS": "lots"},
     "ampguard: environment variable AMPGUARD_MAX_CONSECUTIVE_SKIPS got 'lots'; accepted values: a positive integer"),
    ({"AMPGUARD": "1", "AMPGUARD_SCHEDULERS": "maybe"},
     "ampguard: environment variable AMPGUARD_SCHEDULERS got 'maybe'; accepted values: True or False"),
    ({"AMPGUARD": "1", "AMPGUARD_MAX_SKIPS": "3"},
     "ampguard: unknown environment variable AMPGUARD_MAX_SKIPS; accepted variables: AMPGUARD_CLOSURES, "
     "AMPGUARD_DEVICES, AMPGUARD_LINT, AMPGUARD_MAX_CONSECUTIVE_SKIPS"),
    ({"AMPGUARD": "yes please"}, "ampguard: environment variable AMPGUARD got 'yes please'; accepted values: 1/0"),
])
def test_bad_env_value_prints_one_line_and_runs_without_the_guard(python, script, env, line):
    proc = python(None, str(script), "0", env=env)
    assert proc.returncode == 0
    assert "epoch 3" in proc.stdout  # the program ran, unguarded
    ours = [x for x in proc.stderr.splitlines() if x.startswith("ampguard:")]
    assert len(ours) == 1 and ours[0].startswith(line), proc.stderr
    assert ours[0].endswith("-- running without ampguard")


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
    assert proc.returncode == 2 and "no such file" in proc.stderr
    assert python(None, "-m", "ampguard", "--help").returncode == 0


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
