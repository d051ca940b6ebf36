"""``python -m ampguard [script.py | -m module | -c code | doctor] [args]``, as ``python`` takes them.

Runs the program with the guard installed. ``sys.argv``, ``__name__ == "__main__"`` and the
exit code behave as under plain ``python``; the exit report follows the program's output. The
user asked for the guard explicitly, so an invalid ``AMPGUARD_*`` value stops here with exit
code 2 and one line, before the program runs (the ``AMPGUARD=1`` start-up hook instead runs the
program without the guard: it must never break start-up). ``doctor`` prints what ampguard would
do here (run a script called ``doctor`` as ``./doctor``).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = """\
usage: python -m ampguard script.py [args ...]
       python -m ampguard -m package.module [args ...]
       python -m ampguard -c "code" [args ...]
       python -m ampguard doctor
       python -m ampguard --version | --help

Runs a Python program with ampguard installed, or (doctor) prints the versions, the start-up
hook, the options and the patch targets of this environment; exit code 1 if something is wrong.
Options come from AMPGUARD_* environment variables, for example AMPGUARD_MAX_CONSECUTIVE_SKIPS=50
or AMPGUARD_TRACE=eager; an invalid value stops with exit code 2 before the program runs."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    first = argv[0]
    if first in ("-h", "--help"):
        print(USAGE)
        return 0
    if first in ("-V", "--version"):
        from . import __version__

        print(f"ampguard {__version__}")
        return 0
    if first == "doctor":
        from ._doctor import run

        return run()
    if first in ("-m", "-c") and len(argv) < 2:
        print(f"ampguard: argument expected for the {first} option\n{USAGE}", file=sys.stderr)
        return 2
    if first.startswith("-") and first not in ("-m", "-c"):
        print(f"ampguard: unknown option {first}\n{USAGE}", file=sys.stderr)
        return 2
    if first not in ("-m", "-c") and not os.path.exists(first):
        print(f"ampguard: can't open file {os.path.abspath(first)!r}: no such file", file=sys.stderr)
        return 1

    from ._errors import ConfigError
    from ._startup import activate_from_env

    try:
        activate_from_env(source="python -m ampguard")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if first == "-m":
        import importlib.util

        try:
            found = importlib.util.find_spec(argv[1])
        except (ImportError, ValueError):
            found = None
        if found is None:
            print(f"ampguard: no module named {argv[1]!r}", file=sys.stderr)
            return 1
        sys.argv = [found.origin or argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif first == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        code = compile(argv[1], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(first))
        runpy.run_path(first, run_name="__main__")
    return 0


def _quiet_broken_pipe() -> None:
    """``python -m ampguard doctor | head``: a closed pipe ends the output silently, as cat's does."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_broken_pipe()
        code = 1
    sys.exit(code)
