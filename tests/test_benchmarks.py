"""Every benchmark runs (briefly): a benchmark that rots unnoticed quotes figures nobody can reproduce."""

import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(("script", "args", "last_row"), [
    ("core_overhead.py", ["--reps", "1", "--steps", "3"], "installed:"),
    ("overhead.py", ["--quick"], "one replay on failure"),
    ("distributed_overhead.py", ["--reps", "1", "--steps", "2", "--width", "8"], "all_reduce of the 2x1 table"),
])
def test_benchmark_runs_and_prints_its_table(python, script, args, last_row):
    proc = python(None, str(BENCHMARKS / script), *args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].strip().startswith(last_row)


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
