"""``python -m ampguard doctor``: what ampguard would do in this environment, ready to paste into a bug report.

It reads versions through ``importlib.metadata`` first, so it still reports when torch or wrapt
is missing or broken. It imports torch and Lightning (if installed) to list the classes whose
methods ``install()`` would wrap. Exit code 0 when all is well, 1 with the reasons otherwise.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import site
import sys
from typing import Any, TextIO

_REQUIRED = {"torch": (2, 4), "wrapt": (2, 0)}
_HOOK_FILES = ("ampguard.pth", "ampguard.start", "_ampguard_startup.py")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user:
        dirs.append(user)
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


class _Doctor:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.problems: list[str] = []

    def say(self, line: str = "") -> None:
        print(line, file=self.out)

    def problem(self, reason: str) -> None:
        self.problems.append(reason)
        self.say(f"  PROBLEM: {reason}")

    def versions(self) -> None:
        self.say("versions")
        self.say(f"  python             {platform.python_version()} ({sys.executable})")
        for dist in ("ampguard", "torch", "lightning", "pytorch-lightning", "wrapt", "pytest"):
            version = _version(dist)
            self.say(f"  {dist:18s} {version or 'not installed'}")
            need = _REQUIRED.get(dist)
            if need and version is None:
                self.problem(f"{dist} is not installed; ampguard needs {dist} >= {'.'.join(map(str, need))}")
            elif need and _release(version) < need:
                self.problem(f"{dist} {version} is too old; ampguard needs {dist} >= {'.'.join(map(str, need))}")
        if _version("lightning") is None and _version("pytorch-lightning") is None:
            self.say("  (no Lightning: the Lightning patches stay dormant)")

    def startup_hook(self) -> None:
        self.say("start-up hook (AMPGUARD=1)")
        found = [d for d in _site_dirs() if os.path.exists(os.path.join(d, "ampguard.pth"))]
        if found:
            self.say(f"  ampguard.pth: installed in {found[0]}")
            missing = [f for f in _HOOK_FILES if not os.path.exists(os.path.join(found[0], f))]
            if missing:
                self.problem(f"{', '.join(missing)} missing next to ampguard.pth; reinstall ampguard")
        else:
            self.problem("ampguard.pth is not in any site-packages of this interpreter, so AMPGUARD=1 does nothing "
                         f"(looked in: {', '.join(_site_dirs()) or 'none'}); reinstall ampguard with pip into this "
                         "environment, or use python -m ampguard script.py")
        from . import _options
        from ._errors import ConfigError

        value = os.environ.get("AMPGUARD")
        try:
            on = _options.env_flag("AMPGUARD", False)
        except ConfigError as exc:
            self.problem(str(exc))
            on = False
        if value is None:
            self.say("  AMPGUARD: not set -> the guard is installed only by the program")
        elif not on:
            self.say(f"  AMPGUARD: {value!r} -> the guard is not installed at start-up")
        elif not found or self._bad_variables():
            why = "the hook file is missing" if not found else "an AMPGUARD_* value is invalid (below)"
            self.say(f"  AMPGUARD: {value!r} -> the program would run WITHOUT the guard: {why}")
        else:
            self.say(f"  AMPGUARD: {value!r} -> the guard is installed at start-up")
        try:
            report = _options.env_flag("AMPGUARD_REPORT", True)
            self.say(f"  exit report: {'on' if report else 'off (AMPGUARD_REPORT)'}")
        except ConfigError as exc:
            self.problem(str(exc))

    def options(self) -> None:
        from . import _options

        self.say("options install() would use (keyword arguments win over these)")
        bad = self._bad_variables()
        for reason in bad.values():
            self.problem(reason)
        for name in _options.unknown_variables(os.environ):
            self.problem(_options.unknown_message(name))
        for name, spec in _options.SPECS.items():
            text = os.environ.get(spec.env)
            if name in bad:
                self.say(f"  {name:22s} = (invalid)    ({spec.env})")
            elif text is None or not text.strip():
                self.say(f"  {name:22s} = {spec.default!r:12s} (default)")
            else:
                value = _options.parse_text(name, text, f"environment variable {spec.env}")
                self.say(f"  {name:22s} = {value!r:12s} ({spec.env})")

    def _bad_variables(self) -> dict[str, str]:
        """Every invalid AMPGUARD_<OPTION>, each with its own reason (not just the first)."""
        from . import _options
        from ._errors import ConfigError

        bad = {}
        for name, spec in _options.SPECS.items():
            text = os.environ.get(spec.env)
            if text is not None and text.strip():
                try:
                    _options.parse_text(name, text, f"environment variable {spec.env}")
                except ConfigError as exc:
                    bad[name] = str(exc)
        return bad

    def devices(self, torch: Any) -> None:
        self.say("devices")
        available = torch.cuda.is_available()
        self.say(f"  CUDA available: {available}" + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""))
        if available:
            for i in range(torch.cuda.device_count()):
                self.say(f"    cuda:{i} {torch.cuda.get_device_name(i)}, bf16 supported: "
                         f"{torch.cuda.is_bf16_supported()}")
        self.say(f"  torch.distributed available: {torch.distributed.is_available()}")

    def targets(self) -> None:
        from . import _features  # noqa: F401  (every feature declares its targets)
        from ._patching import REGISTRY, _walk

        self.say("what install() patches (method: classes that override it, wrapped as well)")
        for module in ("torch.distributed.fsdp.sharded_grad_scaler", "lightning.pytorch", "pytorch_lightning"):
            if importlib.util.find_spec(module.partition(".")[0]) is not None:
                try:
                    importlib.import_module(module)  # so that their subclasses are listed
                except Exception as exc:
                    self.problem(f"importing {module} failed ({type(exc).__name__}: {exc})")
        for target in REGISTRY._targets:
            module_name = target.owner.partition(":")[0]
            label = f"{target.owner.replace(':', '.')}.{target.name}"
            if module_name not in sys.modules:
                self.say(f"  {label}: dormant ({target.module} is not installed)")
                continue
            try:
                base = REGISTRY._resolve(target)
            except (AttributeError, ImportError, ValueError) as exc:
                self.problem(f"{label} cannot be found ({exc}); this torch/Lightning is not supported")
                continue
            if isinstance(base, type):
                if target.name not in vars(base):
                    self.problem(f"{label} does not exist in this version; that patch is not applied")
                    continue
                overrides = [f"{c.__module__}.{c.__qualname__}" for c in _walk(base)
                             if c is not base and target.name in vars(c)
                             and (target.accept is None or target.accept(c, vars(c)[target.name]) != "")]
            else:
                overrides = []
            self.say(f"  {label}: {target.why}" + (" (its overrides only)" if target.overrides_only else ""))
            if overrides:
                self.say(f"      overridden by: {', '.join(sorted(overrides))}")
        for switch in REGISTRY._switches:
            self.say(f"  global hook ({switch.feature}): {switch.why}")


def run(out: TextIO | None = None) -> int:
    doctor = _Doctor(out or sys.stdout)
    doctor.say("ampguard doctor (paste this into a bug report)")
    doctor.versions()
    doctor.startup_hook()
    doctor.options()
    torch = None
    if not any(p.startswith(("torch ", "wrapt ")) for p in doctor.problems):
        try:
            torch = importlib.import_module("torch")
        except Exception as exc:
            doctor.problem(f"import torch failed ({type(exc).__name__}: {exc})")
    if torch is not None:
        doctor.devices(torch)
        doctor.targets()
    if doctor.problems:
        doctor.say(f"\n{len(doctor.problems)} problem(s):")
        for reason in doctor.problems:
            doctor.say(f"  - {reason}")
        return 1
    doctor.say("\nall is well")
    return 0
