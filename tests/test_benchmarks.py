"""Every benchmark runs (briefly): a benchmark that rots unnoticed quotes figures nobody can reproduce."""

import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(("script", "args", "last_row"), [
    ("core_overhead.py", ["--reps", "1", "--steps", "3"], "installed:"),
    ("overhead.py", ["--quick"], "one replay on failure"),
    ("overhead.py", ["--quick", "--only", "memory"], "guard"),
    ("overhead.py", ["--quick", "--only", "scaling"], "10 "),  # the parameter tensors row
    ("floor.py", ["--quick"], "floor:"),
    ("in_place.py", ["--quick"], "value MLP"),
    ("added_ops.py", ["--workload", "tiny", "--steps", "3"], "device-to-host copies and syncs:"),
    ("distributed_overhead.py", ["--reps", "1", "--steps", "2", "--width", "8"], "all_reduce of the 2x1 table"),
    ("hook_times.py", ["--steps", "20"], "ampguard's entry points:"),
    ("hook_times.py", ["--workload", "lightning", "--config", "off", "--steps", "10"], "ampguard's entry points:"),
])
def test_benchmark_runs_and_prints_its_table(python, script, args, last_row):
    proc = python(None, str(BENCHMARKS / script), *args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].strip().startswith(last_row)


def test_the_overhead_benchmark_prices_each_option_against_the_default(python):
    """--options times the default with each feature or option off alone: every row says how far it is from the
    default, which reads 0 against itself."""
    proc = python(None, str(BENCHMARKS / "overhead.py"), "--quick", "--only", "tiny", "--options", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("  ")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("  ")}
    names = ["plain", "install() (default)", "lint=False", "schedulers=False", "closures=False", "distributed=False",
             "trace='off'", "nonfinite='off'", "every feature off"]
    assert list(rows) == names, proc.stdout
    assert all(row.endswith(" us vs default") for row in rows.values()), proc.stdout
    assert rows["install() (default)"].endswith(" +0.0 us vs default"), proc.stdout


def test_a_function_is_timed_in_place_against_its_code_at_a_commit(python):
    """against.py alternates the two versions step by step: each gets half the calls. A function it cannot time is
    named with the reason, not timed as something else."""
    script = str(BENCHMARKS / "against.py")
    proc = python(None, script, "HEAD", "ampguard.nonfinite.sinks:exit", "--steps", "6", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("difference:") and all("(3 calls)" in line for line in lines[1:3]), proc.stdout
    proc = python(None, script, "HEAD", "ampguard.nonfinite.sinks:no_such_function", timeout=240)
    assert proc.returncode != 0 and "against.py: no function 'ampguard.nonfinite.sinks:no_such_function'" in \
        proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_the_overhead_benchmark_refuses_a_workload_it_does_not_have(python):
    """A misspelt --only printed a header and no table, as if the run had measured something."""
    proc = python(None, str(BENCHMARKS / "overhead.py"), "--only", "tiny,wide", timeout=60)
    assert proc.returncode == 2
    assert "--only: unknown wide; the workloads are tiny, sgd, lightning, lightning-log, rollout, mlp" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("workload", ["tiny", "lightning"])
def test_the_instruction_count_benchmark_runs_its_steps_and_builds_its_valgrind_commands(python, workload):
    """The measured steps run as callgrind would run them (valgrind itself is not needed here)."""
    script = str(BENCHMARKS / "instructions.py")
    proc = python(None, script, "--child", workload, "install() (default)", "6", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = python(None, script, "--dry-run", "--only", workload, "--configs", "plain,default", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    commands = proc.stdout.strip().splitlines()
    assert len(commands) == 2 and all(c.startswith("valgrind --tool=callgrind") and workload in c for c in commands)
    proc = python(None, script, "--only", "tiny", "--configs", "default", timeout=60)
    assert proc.returncode == 2 and "must include plain" in proc.stderr
    proc = python(None, script, "--only", "tiny", "--configs", "plain,fast", timeout=60)
    assert proc.returncode == 2 and "unknown fast;" in proc.stderr


def test_the_time_attribution_benchmark_runs_its_steps_and_attributes_each_stack(python):
    """The child runs as py-spy would sample it; stacks are attributed as the README's table says (py-spy
    itself is not needed here)."""
    script = str(BENCHMARKS / "where_time_goes.py")
    proc = python(None, script, "--child", "tiny", "default", "0.5", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1].split()[1]) > 0
    proc = python(None, script, "--dry-run", "--workload", "lightning", "--config", "off", timeout=60)
    commands = proc.stdout.strip().splitlines()
    assert len(commands) == 2 and all(c.startswith("py-spy record") for c in commands)
    assert commands[0].endswith("lightning plain 40.0") and commands[1].endswith("lightning off 40.0")

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import where_time_goes as w
    finally:
        sys.path.remove(str(BENCHMARKS))
    loop = "tiny.<locals>.step (benchmarks/overhead.py:64)"
    amp = "site-packages/ampguard"

    def stack(*frames):
        return [loop, *frames]

    assert w.CALL_LINE  # the recorder's call of the recorded function was found in sinks.py
    tape = f"_make_tape.<locals>.Tape.__torch_function__ ({amp}/nonfinite/sinks.py:{{}})"
    assert w.component(stack(tape.format(w.CALL_LINE))) == w.RECORDED_OPS
    assert w.component(stack(tape.format(1), f"_record ({amp}/nonfinite/sinks.py:2)")) == w.LOSS_RECORD
    assert w.component(stack("_call_impl (torch/nn/modules/module.py:1)",
                             f"fail_safe.<locals>.decorate.<locals>.safe ({amp}/_fallback.py:51)",
                             f"_global_pre ({amp}/nonfinite/outermost.py:3)",
                             f"_rng_state ({amp}/nonfinite/sinks.py:335)")) == w.MODULE_CALLS
    read = [f"_scaler_update ({amp}/schedulers.py:1)", f"_resolve ({amp}/schedulers.py:2)",
            f"read ({amp}/_sync.py:3)"]
    assert w.component(stack(*read)) == w.SCHEDULERS
    assert w.component(stack(*read, f"_statuses ({amp}/nonfinite/sinks.py:4)")) == w.SINKS
    assert w.component(stack(f"_scaler_scale ({amp}/lints.py:1)", f"current ({amp}/_guard.py:2)")) == w.LINTS
    assert w.component(stack(f"_backward_owner ({amp}/_guard.py:1)")) == w.OTHER
    assert w.component(stack(f"_backward_owner ({amp}/_guard.py:1)", "backward (torch/autograd/__init__.py:9)")) \
        is None  # torch's frame innermost: torch's time, even below an ampguard wrapper
    total, ours, others = w.attribute({";".join(stack(tape.format(1))): 3, "elsewhere (x.py:1)": 5,
                                       ";".join(stack("backward (torch/autograd/__init__.py:9)")): 2}, "step (")
    assert total == 5 and ours == {w.LOSS_RECORD: 3} and others == {("backward", "torch/autograd/__init__.py"): 2}


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring counts bytecodes from Python 3.12")
@pytest.mark.parametrize("workload", ["tiny", "lightning"])
def test_the_bytecode_count_benchmark_attributes_the_steps_bytecodes_to_ampguards_functions(python, workload):
    proc = python(None, str(BENCHMARKS / "bytecodes.py"), "--workload", workload, "--steps", "3", "--top", "3",
                  timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    totals = [line for line in proc.stdout.splitlines() if " bytecodes a step " in line]
    assert len(totals) == 3 and totals[0].endswith("ampguard's own: 0"), proc.stdout
    own = int(totals[2].rpartition(": ")[2].replace(",", ""))
    assert own > 100 and "ampguard/nonfinite/sinks.py" in proc.stdout


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the refusal is for Pythons without sys.monitoring")
def test_the_bytecode_count_benchmark_says_which_python_it_needs(python):
    proc = python(None, str(BENCHMARKS / "bytecodes.py"), "--steps", "1", timeout=60)
    assert proc.returncode == 1 and "needs Python 3.12 or later" in proc.stderr and proc.stdout == ""
