"""What the mechanisms ampguard is built from cost by themselves on the tiny loop: a floor for its aims.

ampguard sees a training step through what torch offers: a global module pre-hook (taken off for the
outermost call, whose instance hooks end it), a TorchFunctionMode over the loss code, wrapt wrappers on
``GradScaler.scale/step/update``, ``LRScheduler.step`` and ``torch.autograd.backward``, a copy of the RNG
state per outermost call and a host read of a CPU loss. This file does the same with the least Python
it can: one global state object, no fail-safe, no threads, no compile, no distributed, no Lightning, no
messages, no failure path. It is not a product and guards nothing; it is the cost that no design built on
these mechanisms goes below, timed in place beside plain torch and ampguard, interleaved in one process.

    python benchmarks/floor.py               # 7 reps
    python benchmarks/floor.py --quick       # seconds: a smoke run for the tests

Rows: ``floor: skip tracking`` stands for ``nonfinite="off"`` (the scheduler hold: wrappers on scale,
step, update, LRScheduler.step and backward; found_inf known from whether the step ran, as ampguard
knows it for a non-fused optimizer, so no read); ``floor: + sinks and tape`` stands for the default (also
the module hooks, the RNG copy, the loss-code record and the loss read).

The Lightning fit of overhead.py gets the same for the default: ``training_step`` wrapped and run as the
outermost call (the global pre-hook off while it runs, the RNG copy, its arguments held weakly), the loss read
at ``backward()``, and the closure that Lightning hands ``optimizer.step()`` wrapped by an optimizer pre-hook,
so that the gradients' statuses (their few values read as Python floats, as ampguard reads a small model's) are
taken before the update.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # (the workload, and how it is timed and shown)
import torch
import wrapt
from torch.amp.grad_scaler import GradScaler
from torch.nn.modules import module as nn_module
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

import ampguard


class _State:
    def __init__(self) -> None:
        self.sinks = False  # the default's stand-in, else nonfinite="off"'s
        self.window: list = []  # the step's calls and loss-code ops, dropped at update()
        self.produced: dict = {}  # id(tensor) -> weakref of what the window made
        self.entry: tuple = ()
        self.tape = False
        self.ran = False
        self.applied = self.skipped = 0
        self.snapshot = (0, 0)
        self.loss_at_backward = False  # the Lightning stand-in: no GradScaler reads the loss, backward() does
        self.checked = 0  # the Lightning stand-in's steps whose gradients it read


S = _State()
_IDS = (RemovableHandle.next_id, RemovableHandle.next_id + 1)
RemovableHandle.next_id += 2
_global: list = []  # the global pre-hook's handle while the floor is on


def _weak(v):
    if isinstance(v, torch.Tensor):
        made = S.produced.get(id(v))
        if made is not None:
            return made
        return v if v.grad_fn is None and not v.requires_grad else weakref.ref(v)
    return v


class _Tape(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            frame = sys._getframe(1)
            ref = S.produced[id(out)] = weakref.ref(out)
            S.window.append((func, tuple([_weak(a) for a in args]), kwargs, ref, frame.f_code, frame.f_lasti))
        return out


_TAPE = _Tape()


def _end_tape():
    if S.tape:
        _TAPE.__exit__(None, None, None)
        S.tape = False


def _global_pre(module, args):
    hooks = nn_module._global_forward_pre_hooks
    hooks.pop(_global[0].id)  # nested calls take torch's fast path
    frame = sys._getframe(3)
    S.entry = (torch.default_generator.get_state(), torch.is_autocast_enabled("cpu"), torch.is_grad_enabled(),
               frame.f_code, frame.f_lasti)
    module._forward_pre_hooks[_IDS[0]] = _instance_pre
    module._forward_hooks[_IDS[1]] = _instance_post
    module._forward_hooks_with_kwargs[_IDS[1]] = True
    module._forward_hooks_always_called[_IDS[1]] = True


def _instance_pre(module, args):
    return None


def _instance_post(module, args, kwargs, output):
    module._forward_pre_hooks.pop(_IDS[0], None)
    module._forward_hooks.pop(_IDS[1], None)
    module._forward_hooks_with_kwargs.pop(_IDS[1], None)
    module._forward_hooks_always_called.pop(_IDS[1], None)
    nn_module._global_forward_pre_hooks[_global[0].id] = _global_pre
    ref = S.produced[id(output)] = weakref.ref(output)
    S.window.append((module, tuple([_weak(a) for a in args]), kwargs, S.entry, ref))
    _TAPE.__enter__()
    S.tape = True


def _scale(wrapped, instance, args, kwargs):
    _end_tape()
    out = wrapped(*args, **kwargs)
    if S.sinks and not math.isfinite(args[0].item()):
        raise FloatingPointError("non-finite loss")
    return out


def _backward(wrapped, instance, args, kwargs):
    _end_tape()
    if S.loss_at_backward and not math.isfinite(args[0].item()):
        raise FloatingPointError("non-finite loss")
    return wrapped(*args, **kwargs)


# -- the Lightning stand-in ------------------------------------------------------------------------
def _training_step(wrapped, instance, args, kwargs):
    """training_step as the outermost call: nested calls find no global hook."""
    hooks = nn_module._global_forward_pre_hooks
    hooks.pop(_global[0].id)
    S.entry = (torch.default_generator.get_state(), torch.is_autocast_enabled("cpu"), torch.is_grad_enabled())
    try:
        out = wrapped(*args, **kwargs)
    finally:
        hooks[_global[0].id] = _global_pre
    batch, index = args
    S.window.append((instance, [_weak(b) for b in batch], index, S.entry, weakref.ref(out)))
    return out


def _gradients(optimizer):
    total = 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                values = p.grad.tolist()
                total += sum(values) if p.grad.dim() == 1 else sum(map(sum, values))
    if total - total != 0.0:
        raise FloatingPointError("non-finite gradients")
    S.checked += 1
    S.window, S.produced = [], {}


def _pre_step(optimizer, args, kwargs):
    closure = kwargs.get("closure")
    if closure is None:
        _gradients(optimizer)
        return None

    def checked():
        result = closure()
        _gradients(optimizer)
        return result

    return args, {**kwargs, "closure": checked}


@contextlib.contextmanager
def lightning_floor():
    """The Lightning stand-in's patches, on for the block."""
    from lightning.pytorch.strategies.strategy import Strategy  # (ampguard wraps each override of the module's
    # training_step as its class is made; the stand-in wraps the one call of it a step, the strategy's)

    S.loss_at_backward = True
    try:
        with _patched([(Strategy, "training_step", _training_step), (torch.autograd, "backward", _backward)],
                      pre_steps=[_pre_step], module_hook=True):
            yield
    finally:
        S.loss_at_backward = False


def _step(wrapped, instance, args, kwargs):
    S.ran = False  # until the optimizer's step() runs (_ran): GradScaler skips it on inf/NaN gradients
    return wrapped(*args, **kwargs)


def _ran(optimizer, args, kwargs):
    S.ran = True


def _update(wrapped, instance, args, kwargs):
    if S.ran:
        S.applied += 1
    else:
        S.skipped += 1
    S.window, S.produced = [], {}
    return wrapped(*args, **kwargs)


def _scheduler_step(wrapped, instance, args, kwargs):
    if S.skipped > S.snapshot[1] and S.applied == S.snapshot[0]:
        return None
    S.snapshot = (S.applied, S.skipped)
    return wrapped(*args, **kwargs)


@contextlib.contextmanager
def floor(sinks: bool):
    """The floor's patches, on for the block."""
    S.sinks = sinks
    with _patched([(GradScaler, "scale", _scale), (GradScaler, "step", _step), (GradScaler, "update", _update),
                   (LRScheduler, "step", _scheduler_step), (torch.autograd, "backward", _backward)],
                  module_hook=sinks):
        yield


@contextlib.contextmanager
def _patched(wrappers, pre_steps=(), module_hook=False):
    """Each (owner, name, wrapper) of ``wrappers`` wrapped with wrapt, the optimizer pre-step hooks ``pre_steps`` and
    the post-step one that sees a step run, and (``module_hook``) the global module pre-hook, on for the block; every
    original back after it, and the window dropped."""
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in wrappers]
    for (owner, name, wrapper), (_, _, original) in zip(wrappers, saved, strict=True):
        setattr(owner, name, wrapt.FunctionWrapper(original, wrapper))
    handles = [*map(register_optimizer_step_pre_hook, pre_steps), register_optimizer_step_post_hook(_ran)]
    if module_hook:
        _global.append(nn_module.register_module_forward_pre_hook(_global_pre))
    try:
        yield
    finally:
        _end_tape()
        for handle in handles:
            handle.remove()
        if _global:
            _global.pop().remove()
        for owner, name, original in saved:
            setattr(owner, name, original)
        S.window, S.produced = [], {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 rep of a few steps")
    options = parser.parse_args()
    torch.set_num_threads(1)
    configs = {"plain": contextlib.nullcontext,
               "floor: skip tracking": lambda: floor(sinks=False),
               "nonfinite='off'": lambda: overhead.installed(nonfinite="off"),
               "floor: + sinks and tape": lambda: floor(sinks=True),
               "install() (default)": overhead.installed}
    overhead.CONFIGS.update(configs)
    print(f"ampguard {ampguard.__version__}, torch {torch.__version__}, {overhead.DEVICE}, "
          f"{options.reps} interleaved reps")
    step = overhead.tiny()
    times = overhead.measure(step, configs, 1 if options.quick else options.reps, 5 if options.quick else 300)
    overhead.show("tiny AMP loop (Linear 32-32-1, GradScaler, LambdaLR)", times)
    print(f"floor: {S.applied} steps counted applied, {S.skipped} skipped")
    lightning = {"plain": contextlib.nullcontext, "nonfinite='off'": configs["nonfinite='off'"],
                 "floor: + sinks": lightning_floor, "install() (default)": overhead.installed}
    overhead.CONFIGS.update(lightning)
    fit = overhead.lightning_fit()
    times = overhead.measure_fit(fit, lightning, 1 if options.quick else options.reps, 20 if options.quick else 200)
    overhead.show("Lightning Trainer.fit, one Linear, batch 2 (per step, between the batch hooks)", times)
    print(f"floor: {S.checked} Lightning steps' losses and gradients read")


if __name__ == "__main__":
    main()
