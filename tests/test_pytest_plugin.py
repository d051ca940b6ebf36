"""The pytest plugin, through pytester: real inner pytest runs that load it from its entry point."""

import pytest
import torch  # noqa: F401  in-process pytester restores sys.modules after each run; torch must not be imported twice

import ampguard

TRAINING = """
import pytest, torch, warnings
import ampguard

def overflowing_iteration():
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    scaler = torch.amp.GradScaler("cpu")
    m.weight.register_hook(lambda g: g * float("inf"))
    scaler.scale(m(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt); scaler.update(); sched.step()
    return sched
"""


@pytest.fixture(autouse=True)
def _no_env_guard(monkeypatch):
    for name in ("AMPGUARD", "AMPGUARD_TRACE"):
        monkeypatch.delenv(name, raising=False)


def test_option_runs_every_test_under_a_fresh_guard_and_restores_it(pytester):
    pytester.makepyfile(TRAINING + """
seen = []

def test_one():
    g = ampguard.active()
    assert g is not None and g.options.trace == "eager"
    seen.append(g)
    assert overflowing_iteration().last_epoch == 0  # held
    assert g.stats.scheduler_steps_held == 1

def test_two():
    g = ampguard.active()
    assert g is not None and g is not seen[0]
    assert g.stats.scheduler_steps_held == 0  # fresh counters
""")
    result = pytester.runpytest("--ampguard", "--ampguard-trace=eager")
    result.assert_outcomes(passed=2)
    assert ampguard.active() is None


def test_without_the_option_nothing_is_installed(pytester):
    pytester.makepyfile(TRAINING + """
def test_plain():
    assert ampguard.active() is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert overflowing_iteration().last_epoch == 1  # PyTorch's own behaviour
    assert any("before `optimizer.step()`" in str(w.message) for w in caught)
""")
    pytester.runpytest().assert_outcomes(passed=1)


def test_fixture_yields_the_guard_and_restores_the_previous_state(pytester):
    pytester.makepyfile(TRAINING + """
def test_fixture(amp_guard):
    assert ampguard.active() is amp_guard
    overflowing_iteration()
    assert amp_guard.stats.optimizer_steps_skipped == 1

def test_after():
    assert ampguard.active() is None

@pytest.fixture
def outer():
    g = ampguard.install(max_consecutive_skips=7)
    yield g
    ampguard.uninstall()

def test_nested_in_an_installed_guard(outer, amp_guard):
    assert amp_guard is not outer and ampguard.active() is amp_guard
    assert amp_guard.options.max_consecutive_skips == 7

def test_outer_is_back(outer):
    assert ampguard.active() is outer
""")
    pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=4)


def test_marker_sets_options_for_one_test(pytester):
    pytester.makepyfile(TRAINING + """
@pytest.mark.ampguard(schedulers=False, nonfinite="warn")
def test_marked(amp_guard):
    assert ampguard.active() is amp_guard
    assert amp_guard.options.schedulers is False and amp_guard.options.nonfinite == "warn"
    assert amp_guard.options.trace == "off"  # from the command line, under the marker's options
    assert overflowing_iteration().last_epoch == 1  # schedulers=False: not held

def test_unmarked():
    assert ampguard.active() is None

@pytest.mark.ampguard(trace="sideways")
def test_bad_marker():
    pass
""")
    result = pytester.runpytest("--ampguard-trace=off", "--strict-markers")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ConfigError: ampguard: option 'trace' got 'sideways'; accepted values: "
                                 "'replay', 'eager' or 'off' ('deferred' is accepted as 'replay')*"])


def test_non_finite_error_fails_the_test_with_the_story_and_the_report(pytester):
    pytester.makepyfile("""
import torch

def test_nan():
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = torch.log(m(torch.ones(2, 4)) * 0 - 1).sum()  # log of a negative number
    loss.backward()
    opt.step()

def test_next_one_is_clean():
    import ampguard
    assert ampguard.active().stats.nonfinite_detected == 0
""")
    result = pytester.runpytest_subprocess("--ampguard")  # its own process, as a real run is
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([
        "*NonFiniteError: ampguard: NaN reached the loss.*",
        "*It was created by torch.log (inputs finite, output NaN) at*",
        "*test_non_finite_error_fails_the_test_with_the_story_and_the_report.py:6 in test_nan*",
        "*- ampguard -*",
        "*non-finite values detected: 1*",
    ])


@pytest.mark.parametrize(("args", "message"), [
    (["--ampguard-trace=sideways"], "--ampguard-trace got 'sideways'; accepted values: replay, eager or off "
                                   "(deferred is accepted as replay)"),
    (["--ampguard-max-consecutive-skips=-3"], "--ampguard-max-consecutive-skips got '-3'; accepted values: a positive"),
])
def test_bad_option_values_are_usage_errors_naming_the_flag(pytester, args, message):
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in "\n".join(result.stderr.lines)


def test_a_bad_environment_variable_is_one_usage_error(pytester, monkeypatch):
    monkeypatch.setenv("AMPGUARD_TRACE", "sideways")
    pytester.makepyfile("def test_x(): pass\ndef test_y(): pass")
    result = pytester.runpytest("--ampguard")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "environment variable AMPGUARD_TRACE got 'sideways'" in "\n".join(result.stderr.lines)
    result = pytester.runpytest("--ampguard", "--ampguard-trace=off")  # the flag wins over the variable
    result.assert_outcomes(passed=2)


def test_opt_out_with_p_no_ampguard(pytester):
    pytester.makepyfile("def test_x(amp_guard): pass")
    result = pytester.runpytest("-p", "no:ampguard")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'amp_guard' not found*"])
    assert pytester.runpytest("-p", "no:ampguard", "--ampguard").ret == pytest.ExitCode.USAGE_ERROR


def test_plugin_flags_match_the_options():
    from ampguard import _options, pytest_plugin

    assert pytest_plugin.OPTIONS == tuple(_options.SPECS)


def test_loading_the_plugin_imports_neither_torch_nor_lightning_nor_wrapt(pytester):
    pytester.makeconftest("""
import sys
def pytest_configure(config):
    names = ("torch", "lightning", "pytorch_lightning", "wrapt", "ampguard._guard")
    heavy = sorted(m for m in names if m in sys.modules)
    print("HEAVY", heavy, "ampguard.pytest_plugin" in sys.modules)
""")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["HEAVY [] True"])
    result.assert_outcomes(passed=1)
