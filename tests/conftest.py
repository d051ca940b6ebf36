import os
import subprocess
import sys
import textwrap

import pytest

import ampguard


@pytest.fixture(autouse=True)
def _no_guard_leaks():
    ampguard.uninstall()
    yield
    ampguard.uninstall()


def run_python(code: str | None, *argv: str, env: dict | None = None, timeout: float = 180,
               cwd=None) -> subprocess.CompletedProcess:
    """Run ``python -c code argv...`` (or ``python argv...`` when code is None) in a fresh interpreter."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    full_env.update(env or {})
    cmd = [sys.executable, *argv] if code is None else [sys.executable, "-c", textwrap.dedent(code), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


@pytest.fixture
def python():
    return run_python
