"""Install, uninstall and import in every order, each in a fresh interpreter (ddtrace's discipline)."""

import itertools
import json
import sys
import warnings

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


def test_a_feature_no_guard_has_on_wraps_nothing_until_one_does_and_uninstall_restores_it_all():
    """install(nonfinite="off", lint=False) leaves GradScaler.scale and autograd.backward unwrapped (a wrapped call
    costs wrapt's binding even when the wrapper returns at once: backward's thread-owner wrapper is a guard() block's
    alone), and the shared read calls nothing of the non-finite checks'; a guard() with the features on wraps them
    for its block, and they keep working; uninstall() restores every original."""
    import torch
    from loops import data, model
    from torch.amp.autocast_mode import autocast
    from torch.amp.grad_scaler import GradScaler

    from ampguard import _sync
    from ampguard._guard import _backward_owner
    from ampguard.nonfinite.sinks import _backward

    def reading():  # the features whose checks ride on the shared read
        return [feature for feature, *_ in _sync._participants]

    originals = {(GradScaler, "scale"): vars(GradScaler)["scale"], (autocast, "__enter__"): vars(autocast)["__enter__"],
                 (GradScaler, "update"): vars(GradScaler)["update"]}
    backward = torch.autograd.backward
    ampguard.install(nonfinite="off", lint=False)
    assert vars(GradScaler)["scale"] is originals[(GradScaler, "scale")]
    assert vars(autocast)["__enter__"] is originals[(autocast, "__enter__")]
    assert vars(GradScaler)["update"].__wrapped__ is originals[(GradScaler, "update")]  # schedulers: on
    assert torch.autograd.backward is backward  # neither the sink's wrapper nor a block's (threads): no block is open
    assert reading() == []

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with ampguard.guard(nonfinite="raise"):
        assert vars(GradScaler)["scale"].__wrapped__ is originals[(GradScaler, "scale")]
        outer = torch.autograd.backward
        assert outer.__wrapped__.__wrapped__ is backward
        assert {outer._self_wrapper, outer.__wrapped__._self_wrapper} == {_backward_owner, _backward}  # (either order)
        assert reading() == ["nonfinite"]
        head = m(data(0)[0])
        with pytest.raises(ampguard.NonFiniteError, match="loss"):
            scaler.scale(torch.log(head.sum() * 0 - 1)).backward()  # NaN loss: the sink's wrapper is live
            scaler.step(opt)
            scaler.update()  # the read under a GradScaler
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampguard.guard(lint=True):
            scaler = torch.amp.GradScaler("cpu")  # (the one above stopped inside update(): mid-iteration)
            scaler.scale(m(data(0)[0]).pow(2).mean()).backward()  # one iteration: the scaler steps opt
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scaler.scale(m(data(0)[0]).pow(2).mean()).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # still scaled: the lint, now wrapped, warns
    assert [w for w in caught if "was called on gradients that a GradScaler has scaled" in str(w.message)]
    assert vars(GradScaler)["scale"] is not originals[(GradScaler, "scale")]  # applied, kept while installed
    assert reading() == []  # (the block with the checks on is gone)
    ampguard.uninstall()
    for (cls, name), original in originals.items():
        assert vars(cls)[name] is original
    assert torch.autograd.backward is backward
    assert reading() == []


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


def _nan_training(steps=3):
    import torch
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        yield ampguard.active()
        model(torch.randn(2, 3)).log().sum().backward()  # a NaN: log of negatives
        opt.step()
        opt.zero_grad()


def test_guard_as_a_decorator_guards_each_call_and_is_reusable():
    @ampguard.guard(max_consecutive_skips=5)
    def step():
        g = ampguard.active()
        assert g is not None and g.options.max_consecutive_skips == 5
        return g

    first, second = step(), step()
    assert first is not second  # a fresh block, with fresh counters, per call
    assert ampguard.active() is None


def test_guard_as_a_decorator_guards_a_generator_function_while_it_runs():
    """ContextDecorator alone ends the block when the call returns the generator: the loop ran unguarded and its
    NaN went unseen."""
    seen = []
    loop = ampguard.guard(max_consecutive_skips=4)(_nan_training)
    with pytest.raises(ampguard.NonFiniteError) as info:
        for g in loop():
            seen.append(g)
            assert ampguard.active() is g  # between yields too: the block lasts until the generator ends
    assert seen and seen[0] is not None and seen[0].options.max_consecutive_skips == 4
    assert info.value.op == "Tensor.log"
    assert ampguard.active() is None
    healthy = ampguard.guard()(lambda: (yield from range(3)))  # (a lambda with yield is a generator function)
    assert list(healthy()) == [0, 1, 2] and ampguard.active() is None


def test_an_unfinished_guarded_generator_leaves_its_block_when_closed():
    gen = ampguard.guard()(_nan_training)()
    assert next(gen) is not None and ampguard.active() is not None
    gen.close()
    assert ampguard.active() is None


def test_one_guard_object_entered_in_two_threads_at_once_gives_each_thread_its_own_block():
    import threading

    block = ampguard.guard(max_consecutive_skips=9)
    entered, results = threading.Barrier(2), {}

    def worker(k):
        with block as g:
            entered.wait(timeout=30)  # both inside at once; the first to enter leaves first
            results[k] = ampguard.active() is g and g.options.max_consecutive_skips == 9
        results[f"{k} after"] = ampguard.active()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {0: True, 1: True, "0 after": None, "1 after": None}
    with block as outer:
        with block as inner:
            assert ampguard.active() is inner is not outer
        assert ampguard.active() is outer
    assert ampguard.active() is None


def test_guard_decorates_bare_and_refuses_an_option_given_by_position():
    @ampguard.guard
    def step():
        return ampguard.active()

    @ampguard.guard
    def steps():
        yield ampguard.active()

    assert step() is not None and [g is not None for g in steps()] == [True]
    assert ampguard.active() is None
    with pytest.raises(TypeError, match=r"takes its options as keywords \(guard\(nonfinite='skip'\)\).*'skip'"):
        ampguard.guard("skip")


def test_guard_refuses_to_decorate_an_async_function():
    async def train():
        return None

    with pytest.raises(TypeError, match=r"cannot decorate the async function .*train.*event loop"):
        ampguard.guard()(train)


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


@pytest.mark.parametrize("hooks", ["sys", "threading"])
def test_the_excepthook_is_put_back_exactly_and_one_set_on_top_of_it_is_kept(hooks):
    import threading

    import torch  # noqa: F401 (the hook comes with torch's import, as the patches do)

    where = sys if hooks == "sys" else threading
    original = where.excepthook
    ampguard.install()
    ampguard.install()
    ours = where.excepthook
    assert ours is not original
    ampguard.uninstall()
    assert where.excepthook is original  # (installed twice, hooked once)
    ampguard.install()
    theirs = lambda *args: None  # noqa: E731 (a traceback library's, set after ours)
    where.excepthook = theirs
    try:
        ampguard.uninstall()
        assert where.excepthook is theirs  # (theirs stays: it may call ours, which calls the hook it found)
    finally:
        where.excepthook = original
