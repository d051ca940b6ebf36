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
