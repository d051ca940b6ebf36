"""``python -m ampguard [script.py | -m module | -c code | doctor] [args]``, as ``python`` takes them.

Runs the program with the guard installed. ``sys.argv``, ``__name__ == "__main__"``, ``__file__``
(absolute) and the exit code behave as under plain ``python``; interpreter flags before the
program (``-u``, ``-W arg``, ``-X arg``, ``-O``, ``-B`` ...) are passed on to a fresh interpreter. The
processes the program starts (subprocesses, spawn workers, launcher-started ranks) are guarded
too, with the same options, exactly as under ``AMPGUARD=1``; the exit report follows the program's output. The
user asked for the guard explicitly, so an invalid ``AMPGUARD_*`` value stops here with exit
code 2 and one line, before the program runs (the ``AMPGUARD=1`` start-up hook instead runs the
program without the guard: it must never break start-up). ``doctor`` prints what ampguard would
do here (run a script called ``doctor`` as ``./doctor``).
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

USAGE = """\
usage: python -m ampguard [python flags: -u -W arg -X arg -O -B ...] script.py [args ...]
       python -m ampguard -m package.module [args ...]
       python -m ampguard -c "code" [args ...]
       python -m ampguard doctor
       python -m ampguard repro BUNDLE.pt [--device cpu|cuda]
       python -m ampguard --version | --help

Runs a Python program with ampguard installed, or (doctor) prints the versions, the start-up
hook, the options and the patch targets of this environment; exit code 1 if something is wrong.
repro replays a reproducer bundle (written where repro_dir / AMPGUARD_REPRO_DIR says) and prints
the origin report: exit code 1 when the NaN/Inf reproduces, 0 when it does not, 2 for a bad bundle.
Options come from AMPGUARD_* environment variables, for example AMPGUARD_MAX_CONSECUTIVE_SKIPS=50
or AMPGUARD_TRACE=eager; an invalid value stops with exit code 2 before the program runs."""


# Interpreter flags accepted before the program, as python takes them; the ones with an argument.
_FLAGS = frozenset({"-u", "-O", "-OO", "-B", "-b", "-bb", "-E", "-s", "-S", "-I", "-q", "-v", "-d", "-P"})
_FLAGS_WITH_ARG = ("-W", "-X")


def _interpreter_flags(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """(the leading interpreter flags, the rest), or None if a flag lacks its argument."""
    flags, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in _FLAGS:
            flags.append(arg)
        elif arg in _FLAGS_WITH_ARG:
            if i + 1 >= len(argv):
                return None
            flags.extend(argv[i:i + 2])
            i += 1
        elif arg[:2] in _FLAGS_WITH_ARG and len(arg) > 2:  # -Werror, -Xdev
            flags.append(arg)
        else:
            break
        i += 1
    return flags, argv[i:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    split = _interpreter_flags(argv)
    if split is None:
        print(f"ampguard: argument expected for the {argv[-1]} option\n{USAGE}", file=sys.stderr)
        return 2
    flags, rest = split
    if flags:
        if not rest:
            print(USAGE, file=sys.stderr)
            return 2
        sys.stdout.flush()
        sys.stderr.flush()
        # The flags act on the interpreter itself: start one that has them, running the same command.
        os.execv(sys.executable, [sys.executable, *flags, "-m", "ampguard", *rest])
    first = argv[0]
    if first in ("-h", "--help"):
        print(USAGE)
        return 0
    if first in ("-V", "--version"):
        from . import __version__

        print(f"ampguard {__version__}")
        return 0
    if first == "doctor":
        if argv[1:] and argv[1] in ("-h", "--help"):
            print(USAGE)
            return 0
        if argv[1:]:
            print(f"ampguard doctor: takes no arguments (got {' '.join(argv[1:])})\n{USAGE}", file=sys.stderr)
            return 2
        from ._doctor import run

        return run()
    if first == "repro":
        return _repro(argv[1:])
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
    # Processes the program starts run the start-up hook with the same AMPGUARD_* options.
    os.environ["AMPGUARD"] = "1"
    if first == "-m":
        import importlib.util

        try:
            found = importlib.util.find_spec(argv[1])
        except (ImportError, ValueError):
            found = None
        if found is None:
            print(f"ampguard: no module named {argv[1]!r}", file=sys.stderr)
            return 1
        if found.submodule_search_locations is not None:  # a package: it runs its __main__
            try:
                main_found = importlib.util.find_spec(f"{argv[1]}.__main__")
            except (ImportError, ValueError):
                main_found = None
            if main_found is None:
                print(f"ampguard: no module named {argv[1]}.__main__; {argv[1]!r} is a package and cannot be "
                      "directly executed", file=sys.stderr)
                return 1
            found = main_found
        sys.argv = [found.origin or argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif first == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        code = compile(argv[1], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        path = os.path.abspath(first)
        sys.path[0] = os.path.dirname(path)
        if os.path.isfile(path) and not _zipfile(path):
            _run_script(path)
        else:  # a directory or zip archive with a __main__.py
            runpy.run_path(path, run_name="__main__")
    return 0


def _repro(args: list[str]) -> int:
    """``repro BUNDLE [--device cpu|cuda[:N]]``: in this process, with the current folder importable."""
    device = None
    paths = []
    i = 0
    while i < len(args):
        if args[i] in ("-h", "--help"):
            print(USAGE)
            return 0
        if args[i] == "--device":
            if i + 1 == len(args):
                print(f"ampguard repro: --device needs a value: cpu or cuda (cuda:N)\n{USAGE}", file=sys.stderr)
                return 2
            device = args[i + 1]
            i += 2
            continue
        if args[i].startswith("--device="):
            device = args[i].partition("=")[2]
        elif args[i].startswith("-"):
            print(f"ampguard repro: unknown option {args[i]}\n{USAGE}", file=sys.stderr)
            return 2
        else:
            paths.append(args[i])
        i += 1
    if len(paths) != 1 or (device is not None and device.split(":")[0] not in ("cpu", "cuda")):
        print(f"ampguard repro: expected one bundle path and optionally --device cpu or --device cuda\n{USAGE}",
              file=sys.stderr)
        return 2
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's code, where the bundle's classes come from
    from .nonfinite.repro import run

    return run(paths[0], device)


def _zipfile(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def _run_script(path: str) -> None:
    """Run a script as python does: the real __main__ module (multiprocessing's spawn re-imports it from
    there), ``__file__`` absolute, ``sys.argv[0]`` as typed. runpy.run_path would make argv[0] the path."""
    import types

    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")  # bytes: the file's coding cookie is honoured
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__cached__ = None
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


def _quiet_broken_pipe() -> None:
    """``python -m ampguard doctor | head``: a closed pipe ends the output silently, as cat's does."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass


def _program_traceback(tb: Any) -> Any:
    """``tb`` from the program's own first frame on: the launcher's frames (this module's, runpy's) are not the
    program's, and ``python script.py`` shows none of them."""
    launcher = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code.co_filename.startswith("<frozen runpy>")
            or os.path.abspath(tb.tb_frame.f_code.co_filename) in launcher):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_broken_pipe()
        code = 1
    except Exception as exc:
        # The program's uncaught error, shown as python shows it (through sys.excepthook, which the program may
        # have set), with exit code 1. KeyboardInterrupt and SystemExit go on as they are: python's own handling
        # gives the interrupted exit status.
        tb = _program_traceback(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # (python's own hook prints the error's own)
        code = 1
    sys.exit(code)
