"""``python -m ampguard script.py [args]``, ``-m package.module [args]``, and ``doctor``.

Runs the program with the guard installed. ``sys.argv``, ``__name__ == "__main__"`` and the
exit code behave as under plain ``python``; the exit report follows the program's output.
``doctor`` prints what ampguard would do here (run a script called ``doctor`` as ``./doctor``).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = """\
usage: python -m ampguard script.py [args ...]
       python -m ampguard -m package.module [args ...]
       python -m ampguard doctor

Runs a Python program with ampguard installed, or (doctor) prints the versions, the start-up
hook, the options and the patch targets of this environment; exit code 1 if something is wrong.
Options come from AMPGUARD_* environment variables (see README.md), for example
AMPGUARD_MAX_CONSECUTIVE_SKIPS=50."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "doctor":
        from ._doctor import run

        return run()
    if argv[0] == "-m" and len(argv) < 2:
        print("ampguard: -m needs a module name\n" + USAGE, file=sys.stderr)
        return 2

    from ._startup import activate_from_env

    activate_from_env(source="python -m ampguard")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not os.path.exists(script):
            print(f"ampguard: can't open file {script!r}: no such file", file=sys.stderr)
            return 2
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
