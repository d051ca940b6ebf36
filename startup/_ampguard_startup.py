"""ampguard's interpreter start-up hook (installed next to ``ampguard.pth`` / ``ampguard.start``).

It runs in every Python process of the environment, so it does nothing, and imports nothing,
unless ``AMPGUARD`` is set. When set, it only registers post-import hooks; torch and
Lightning are patched when the program itself imports them. It never raises.

PYTEST_DONT_REWRITE: pytest marks every top-level module of a plugin's distribution for assertion
rewriting and warns about one already imported, as this one always is; under ``filterwarnings =
error`` that warning would stop pytest at start-up.
"""

import os

_ran = False


def run() -> None:
    global _ran
    if _ran or os.environ.get("AMPGUARD", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    _ran = True  # a .pth can be processed twice in one start-up (site dirs added twice)
    try:
        from ampguard._startup import activate_from_env

        activate_from_env()
    except BaseException as exc:  # never break interpreter start-up
        import sys

        print(f"ampguard: start-up hook failed ({type(exc).__name__}: {exc}); running without ampguard",
              file=sys.stderr)
