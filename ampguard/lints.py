"""AMP lints: mistakes that never crash but quietly make mixed-precision training worse.

Each lint is one ``AmpGuardWarning`` per Guard, attributed to the user's line and naming the
fix (option ``lint``, default on). Patch targets, each undone by the registry:

- ``GradScaler.scale`` (stacked on the non-finite wrapper): note that this scaler's gradients
  are scaled in the current iteration, and warn if every autocast region entered with grad
  enabled on the scaler's device since the previous ``scale()`` was bf16 (a bf16 region nested in an
  fp16 one, for one part of the model, still needs the scaler for the rest). The iteration is
  identified by the scaler's ``_per_optimizer_states`` object, which every ``update()``
  replaces, so no wrapper on ``update()`` is needed.
- ``clip_grad_norm_`` / ``clip_grad_value_`` in ``torch.nn.utils.clip_grad`` and the
  ``torch.nn.utils`` re-export: warn when a parameter with a gradient belongs to an optimizer the
  scaler stepped in an earlier iteration and to none it has unscaled, while its iteration is open
  (another model's parameters, trained without the scaler, are left alone). Which optimizers are
  unscaled is the scaler's own record (each one's ``stage`` in ``_per_optimizer_states``), and
  which it steps the keys of that record in past iterations, so ``unscale_()`` needs no wrapper
  (and where every optimizer it steps is unscaled, no parameter is looked at):
  it runs inside every ``GradScaler.step()``, and a wrapper cost every step some 6,000
  instructions. Lightning unscales before it clips, so its ``gradient_clip_val`` never warns; under manual
  optimization it unscales inside ``opt.step()``, and the warning names the hook to clip in instead.
- ``autocast.__enter__``: remember, per thread, the dtypes of the enabled autocast regions
  entered with grad enabled, for each device type (evaluation under no_grad is ignored).
- A global optimizer step pre-hook (on only while ``lint`` is): at an optimizer's first step,
  warn when float16 parameters have an ``eps`` that rounds to 0 in float16.

Not a lint on purpose: ``scheduler.step()`` before any optimizer step with no scaler involved.
PyTorch already warns about it, and ampguard's scheduler holding never touches such a
scheduler, so the user sees PyTorch's one warning and not a second.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
import threading
from typing import Any

from . import _guard
from ._errors import AmpGuardWarning
from ._fallback import fail_safe, internal_failure
from ._frames import warn_at_user
from ._guard import ObjectState
from ._patching import REGISTRY, Switch, Target, clip_arguments

FEATURE = "lint"


def eps_rounds_to_zero(eps: Any) -> bool:
    """Whether a positive ``eps`` becomes exactly 0 in float16 (anything below 2**-25)."""
    return isinstance(eps, float) and eps > 0 and struct.unpack("e", struct.pack("e", eps))[0] == 0.0


@dataclasses.dataclass
class _Iteration:
    token: Any = None  # the scaler's _per_optimizer_states when scale() was called
    # ids of the optimizers this scaler unscaled or stepped in its past iterations (the keys of each token): whose
    # gradients it scales. Another model's, trained without the scaler in the same iteration, are not its business.
    optimizers: set = dataclasses.field(default_factory=set)


class _State:
    def __init__(self) -> None:
        self.iterations: ObjectState[_Iteration] = ObjectState(lambda _: _Iteration())  # per GradScaler
        self.stepped: ObjectState[bool] = ObjectState(lambda _: True)  # optimizers by id: who owns a parameter
        self.warned: set[str] = set()


STATE = _guard.declare_state(FEATURE, _State)  # g.states[STATE]


class _Autocast(threading.local):
    def __init__(self) -> None:
        # device type -> (guard, dtype, whether all regions had that dtype) of the autocast regions entered with
        # grad enabled since the previous GradScaler.scale() on this thread
        self.latest: dict[str, Any] = {}


_AUTOCAST = _Autocast()


def _warn_once(g: _guard.Guard, lint: str, message: str) -> None:
    warned = g.states[STATE].warned
    if lint not in warned:
        warned.add(lint)
        warn_at_user(message)


# -- GradScaler.scale / unscale_ -------------------------------------------------------------
def _scaler_scale(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    g = _guard.current(FEATURE)
    if g is None or not getattr(instance, "_enabled", False):
        return out
    try:
        iteration = g.states[STATE].iterations.of(instance)
        states = instance._per_optimizer_states
        previous = iteration.token
        if previous is not states:  # a new iteration (update() replaced the dict): learn the last one's optimizers
            if previous:
                iteration.optimizers.update(previous)
            iteration.token = states
        latest = _AUTOCAST.latest
        if latest:  # each scale() judges the autocast regions since the last one
            _AUTOCAST.latest = {}
            device = getattr(instance, "_device", "cuda")
            if latest.get(device) == (g, sys.modules["torch"].bfloat16, True):
                _warn_once(g, "bf16", (
                    f"ampguard: a GradScaler({device!r}) scales a loss computed under bfloat16 autocast. bfloat16 "
                    "has float32's exponent range, so its gradients do not underflow and loss scaling only adds a "
                    "host-device sync and skipped steps. Fix: drop the GradScaler (call loss.backward() and "
                    "optimizer.step()), or GradScaler(enabled=False)."))
    except AmpGuardWarning:
        raise
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return out


# -- clip_grad_norm_ / clip_grad_value_ ------------------------------------------------------
def _clip(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    g = _guard.current(FEATURE)
    if g is None:
        return wrapped(*args, **kwargs)
    try:
        args, kwargs, params = clip_arguments(args, kwargs)
        _check_clip(g, params, wrapped.__name__)
    except AmpGuardWarning:
        raise
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return wrapped(*args, **kwargs)


def _check_clip(g: _guard.Guard, params: list, name: str) -> None:
    state = g.states[STATE]
    if "clip" in state.warned:
        return
    ready = sys.modules["torch.amp.grad_scaler"].OptState.READY
    for scaler, record in state.iterations.items():
        states = scaler._per_optimizer_states
        if record.token is not states or not scaler._enabled:
            continue  # no loss scaled by this scaler since its last update()
        # The optimizers it steps (learnt from its earlier iterations) not unscaled yet in this one. None in the
        # usual recipe (unscale_(), then clip): no parameter is looked at. (`in` first: the dict makes missing keys.)
        still_scaled = [key for key in record.optimizers if key not in states or states[key]["stage"] is ready]
        if not still_scaled:
            continue
        ids = _params_of(state, still_scaled)
        if any(p.grad is not None and id(p) in ids for p in params):
            called, fix = f"torch.nn.utils.{name}", "call scaler.unscale_(optimizer) right before clipping."
            manual = _lightning_manual_clip()
            if manual is not None:
                called, fix = f"Lightning's {manual}.clip_gradients ({called})", _LIGHTNING_FIX
            _warn_once(g, "clip", (
                f"ampguard: {called} was called on gradients that a GradScaler has scaled and not yet "
                f"unscaled in this iteration, so the threshold is compared with gradients multiplied by the loss "
                f"scale ({scaler.get_scale():g}) and clipping is far too strong, or never happens. Fix: {fix}"))
            return


# Lightning's manual optimization unscales inside opt.step() (its precision plugin's optimizer_step), after a
# clip_gradients in training_step; and a second unscale_() of the user's makes that one raise.
_LIGHTNING_FIX = ("under manual optimization Lightning unscales the gradients inside opt.step(), after this call and "
                  "before it calls the on_before_optimizer_step hook. Clip there: def on_before_optimizer_step(self, "
                  "optimizer): self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm=...). "
                  "(An unscale_() of your own before this call makes Lightning's own unscale_() in opt.step() raise.)")
_LIGHTNING_MODULE_FILES = ("lightning/pytorch/core/module.py", "pytorch_lightning/core/module.py")


def _lightning_manual_clip() -> str | None:
    """The class name of the LightningModule whose ``clip_gradients`` made this clip call under manual
    optimization, or None. (The warning path only: a walk over the caller's frames.)"""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "clip_gradients" and code.co_filename.replace("\\", "/").endswith(_LIGHTNING_MODULE_FILES):
            module = frame.f_locals.get("self")
            if getattr(module, "automatic_optimization", True) is False:
                return type(module).__name__
            return None
        frame = frame.f_back
    return None


def _params_of(state: _State, optimizers: list) -> set[int]:
    """The ids of the parameters of the optimizers of these ids that are still alive. GradScaler keys its
    per-optimizer state by ``id(optimizer)``; the optimizer is found among those that took a step under this guard
    (the first-step hook records each)."""
    ids: set[int] = set()
    for key in optimizers:
        optimizer = state.stepped.by_id(key)
        if optimizer is not None:
            ids.update(id(p) for group in optimizer.param_groups for p in group["params"])
    return ids


# -- autocast.__enter__ -------------------------------------------------------------------
def _autocast_enter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    g = _guard.current(FEATURE)
    if g is not None and getattr(instance, "_enabled", False):
        try:
            # (torch is imported: this is its autocast; sys.modules, not an import statement, at every step)
            if sys.modules["torch"].is_grad_enabled():  # a training forward; evaluation under no_grad says nothing
                device, dtype = getattr(instance, "device", "cuda"), getattr(instance, "fast_dtype", None)
                seen = _AUTOCAST.latest.get(device)
                alike = seen is None or seen[0] is not g or (seen[1] == dtype and seen[2])  # (another guard's: stale)
                _AUTOCAST.latest[device] = (g, dtype, alike)
        except Exception as exc:
            internal_failure(FEATURE, exc)
    return out


# -- the first optimizer step ------------------------------------------------------------
@fail_safe(FEATURE)
def _first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    g = _guard.current(FEATURE)
    if g is None:
        return
    stepped = g.states[STATE].stepped
    if stepped.get(optimizer):
        return
    stepped.of(optimizer)
    message = eps_message(optimizer)
    if message:
        _warn_once(g, "eps", f"ampguard: {g.name_of(optimizer)}: {message}")


def eps_message(optimizer: Any) -> str:
    """Why and how to fix an optimizer whose float16 parameters meet an ``eps`` that rounds to 0."""
    import torch

    for group in optimizer.param_groups:
        eps = group.get("eps")
        if group.get("fused"):
            continue  # the fused kernels compute in float32 ("opmath"): eps does not round there
        if eps_rounds_to_zero(eps) and any(p.dtype == torch.float16 for p in group["params"]):
            return (f"the parameters are float16 and {type(optimizer).__name__}'s eps={eps:g} rounds to 0 in float16, "
                    "so wherever a second moment is 0 the update divides by 0: the parameter becomes ±Inf, or NaN "
                    f"where its gradient was 0 too.{_underflow_words(group)} Fix: eps=1e-4 or larger, or keep float32 "
                    "master weights (model.float()) and train under torch.autocast.")
    return ""


def _underflow_words(group: dict) -> str:
    """Below which gradient an Adam-like group's first second moment is 0 in float16: (1 - beta2) * g^2 under half
    of float16's smallest subnormal (2**-24) rounds to 0. With beta2 = 0.999 that is |g| < 5.5e-3, common at a first
    step."""
    betas = group.get("betas")
    try:
        beta2 = float(betas[1])
    except (TypeError, IndexError, ValueError):
        return ""
    if not 0.0 <= beta2 < 1.0:
        return ""
    return (" A second moment is 0 where every gradient so far was 0, and at the first step wherever |gradient| is "
            f"below {(2.0**-25 / (1.0 - beta2)) ** 0.5:.2g}: its square times 1 - beta2 ({1.0 - beta2:g}) underflows "
            "float16.")


def _switch_first_step() -> Any:
    from torch.optim import optimizer as optim_module

    return optim_module.register_optimizer_step_pre_hook(_first_step).remove


for _owner, _name, _wrapper, _why in (
    ("torch.amp.grad_scaler:GradScaler", "scale", _scaler_scale, "open the scaler's iteration; bf16 autocast lint"),
    ("torch.nn.utils.clip_grad", "clip_grad_norm_", _clip, "warn when clipping still-scaled gradients"),
    ("torch.nn.utils.clip_grad", "clip_grad_value_", _clip, "warn when clipping still-scaled gradients"),
    ("torch.nn.utils", "clip_grad_norm_", _clip, "the same, for the torch.nn.utils re-export"),
    ("torch.nn.utils", "clip_grad_value_", _clip, "the same, for the torch.nn.utils re-export"),
    ("torch.amp.autocast_mode:autocast", "__enter__", _autocast_enter, "remember the autocast dtype per device"),
):
    REGISTRY.add(Target("torch", _owner, _name, _wrapper, _why, feature=FEATURE))
REGISTRY.add_switch(Switch("torch", FEATURE, _switch_first_step, "first optimizer step: the fp16 eps lint"))
