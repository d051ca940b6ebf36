"""Install, uninstall and import in every order, each in a fresh interpreter (ddtrace's discipline)."""

import itertools
import json
import sys

import pytest

import ampguard

# Prints, as JSON, every patched (class, name) and whether it is wrapped, plus what was restored.
PROBE = """
import json, sys, gc
import ampguard, wrapt
from ampguard._patching import REGISTRY

def snapshot():
    import torch
    from torch.optim.lr_scheduler import LRScheduler
    from torch.amp.grad_scaler import GradScaler
    out = {}
    for base, name in ((LRScheduler, "step"), (GradScaler, "step"), (GradScaler, "update")):
        stack = [base]
        while stack:
            cls = stack.pop(); stack.extend(cls.__subclasses__())
            if name in vars(cls):
                obj = vars(cls)[name]
                depth = 0
                while isinstance(obj, wrapt.FunctionWrapper):
                    depth += 1; obj = obj.__wrapped__
                out[f"{cls.__module__}.{cls.__qualname__}.{name}"] = [depth, id(obj)]
    out["init_subclass_added"] = "__init_subclass__" in vars(LRScheduler) or "__init_subclass__" in vars(GradScaler)
    return out

steps = sys.argv[1].split(",")
seen = {}
for step in steps:
    if step == "import":
        import torch, torch.optim.lr_scheduler
        if not seen.get("originals"):
            seen["originals"] = snapshot()
    elif step == "install":
        ampguard.install()
    elif step == "uninstall":
        ampguard.uninstall()
    seen.setdefault("lightning_imported", False)
    seen["lightning_imported"] |= "lightning" in sys.modules or "pytorch_lightning" in sys.modules
seen["final"] = snapshot()
seen["installed"] = ampguard.active() is not None
print(json.dumps(seen))
"""

# Every order of up to three steps with one import, and the four-step orders that re-install.
ORDERS = sorted({",".join(p) for n in (2, 3) for p in itertools.product(["import", "install", "uninstall"], repeat=n)
                 if p.count("import") == 1}
                | {"install,import,uninstall,install", "import,install,install,uninstall",
                   "install,uninstall,import,install", "install,install,import,uninstall"})


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_of_import_install_uninstall(python, order):
    proc = python(PROBE, order)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    last_state = [s for s in order.split(",") if s != "import"]
    installed = bool(last_state) and last_state[-1] == "install"
    assert seen["installed"] is installed
    assert seen["lightning_imported"] is False
    final, originals = seen["final"], seen["originals"]
    assert final.pop("init_subclass_added") is installed
    originals.pop("init_subclass_added")
    assert len(final) >= 7  # LRScheduler.step and its 4 overrides, GradScaler.step and .update
    for key, (depth, original_id) in final.items():
        assert depth == (1 if installed else 0), key  # wrapped exactly once, or not at all
        if key in originals:
            # identity: with depth 0, vars(cls)[name] is the very function object that was there before
            assert original_id == originals[key][1], key


def test_uninstall_restores_the_exact_objects():
    import torch
    from torch.amp.grad_scaler import GradScaler
    from torch.optim.lr_scheduler import LRScheduler, SequentialLR

    before = {(cls, n): vars(cls)[n] for cls, n in ((LRScheduler, "step"), (SequentialLR, "step"),
                                                   (GradScaler, "step"), (GradScaler, "update"))}
    sharded = pytest.importorskip("torch.distributed.fsdp.sharded_grad_scaler").ShardedGradScaler
    before[(sharded, "update")] = vars(sharded)["update"]
    ampguard.install()
    ampguard.install()
    for (cls, name), original in before.items():
        assert vars(cls)[name] is not original
        assert vars(cls)[name].__wrapped__ is original  # once, not twice
    assert torch.optim.lr_scheduler.LRScheduler is LRScheduler
    ampguard.uninstall()
    ampguard.uninstall()
    for (cls, name), original in before.items():
        assert vars(cls)[name] is original
    assert "__init_subclass__" not in vars(LRScheduler)
    assert "__init_subclass__" not in vars(GradScaler)


def test_classes_defined_while_installed_are_restored_too():
    from torch.optim.lr_scheduler import LambdaLR

    ampguard.install()

    class Mine(LambdaLR):
        def step(self, epoch=None):
            return super().step(epoch)

    original = vars(Mine)["step"].__wrapped__
    ampguard.uninstall()
    assert vars(Mine)["step"] is original


def test_install_applies_new_options_to_the_active_guard():
    g = ampguard.install(max_consecutive_skips=10)
    assert ampguard.install(schedulers=False) is g
    assert g.options.max_consecutive_skips == 10 and g.options.schedulers is False
    assert ampguard.active() is g


def test_guard_context_restores_the_state_before_entry():
    with ampguard.guard(max_consecutive_skips=3) as g:
        assert ampguard.active() is g
        assert g.options.max_consecutive_skips == 3
    assert ampguard.active() is None
    outer = ampguard.install(max_consecutive_skips=7)
    with ampguard.guard(schedulers=False) as inner:
        assert ampguard.active() is inner
        assert inner.options.max_consecutive_skips == 7 and inner.options.schedulers is False
    assert ampguard.active() is outer and outer.options.schedulers is True


def test_import_ampguard_and_install_import_neither_torch_nor_lightning(python):
    proc = python("""
        import sys, ampguard
        ampguard.install()
        print(sorted(m for m in ("torch", "lightning", "pytorch_lightning") if m in sys.modules))
        import torch
        print(sorted(m for m in ("lightning", "pytorch_lightning") if m in sys.modules))
        print(type(vars(torch.amp.GradScaler)["update"]).__name__)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["[]", "[]", "FunctionWrapper"]


@pytest.mark.parametrize(("options", "fragment"), [
    ({"bogus": 1}, "unknown option 'bogus'; accepted options: check_unscaled_after, closures, devices, distributed"),
    ({"trace": "lazy"}, "option 'trace' got 'lazy'; accepted values: 'replay', 'eager' or 'off' "
                          "('deferred' is accepted as 'replay')"),
    ({"nonfinite": True}, "option 'nonfinite' got True; accepted values: 'raise', 'warn', 'skip' or 'off'"),
    ({"devices": ("cuda:0",)}, "option 'devices' got ('cuda:0',); accepted values: None (every device)"),
    ({"schedulers": "yes"}, "option 'schedulers' got 'yes'; accepted values: True or False"),
    ({"max_consecutive_skips": 0}, "option 'max_consecutive_skips' got 0; accepted values: a positive integer"),
    ({"max_consecutive_skips": 2.5}, "got 2.5"),
    ({"max_consecutive_skips": True}, "got True"),
])
def test_bad_options_raise_config_error_naming_option_and_accepted_values(options, fragment):
    with pytest.raises(ampguard.ConfigError) as info:
        ampguard.install(**options)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    assert ampguard.active() is None


def test_options_table_and_dataclass_agree():
    import dataclasses

    from ampguard import _options

    fields = {f.name: f.default for f in dataclasses.fields(_options.Options)}
    assert fields == {name: spec.default for name, spec in _options.SPECS.items()}


def test_python_version_supported():
    assert sys.version_info >= (3, 10)
