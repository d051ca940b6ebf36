"""NaN/Inf detection: cheap sinks on the normal path, a replay on failure to find the origin.

- ``sinks``: what runs every step. Three sinks (the loss, outermost module outputs no loss covers,
  gradients before a step without a GradScaler), each a status riding a reduction the loop makes
  anyway or one 2-norm pass, read in the one shared host-device read per step. Per outermost
  module call, O(1) Python state for a replay and no tensor held; between the model's output and
  ``backward()``, a record of the loss code's torch calls.
- ``outermost``: finds the outermost module call with one global pre-hook that steps aside
  during the call, so nested module calls stay on torch's fast path.
- ``replay``: on a failed sink, re-run the window of calls and loss code op by op (aten ops,
  inside functionals and compiled modules), leaving buffers, RNG state and parameters as they were.
- ``failure`` and ``report``: walk back to the origin and write the error.

``trace="replay"`` (the default; ``"deferred"`` is the same) replays on failure, ``"eager"``
checks every op as it runs (slow, for debugging), ``"off"`` only checks the sinks.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from .. import _guard, _sync
from .._fallback import internal_failure
from .._patching import REGISTRY, Switch, Target, wrap_on_class
from . import failure, outermost, report, sinks, torchscript
from .sinks import FEATURE, T, check

sinks._failure = failure  # the failure path is loaded with the package, never imported lazily mid-run

__all__ = ["FEATURE", "T", "check", "report"]

def _switch_hooks() -> Any:
    import torch
    from torch.optim import optimizer as optim_module

    sinks._torch = torch
    sinks._Tensor = torch.Tensor
    sinks._is_compiling = outermost._compiling = torch.compiler.is_compiling
    sinks._transformed = torch._C._are_functorch_transforms_active
    sinks._tracing = torch._C._get_tracing_state
    sinks._graph_task_id = torch._C._current_graph_task_id
    sinks._any_autocast = torch._C._is_any_autocast_enabled
    sinks._autocast_devices = sinks.known_autocast_devices()
    sinks._FLOAT8 = sinks.float8_dtypes(torch)
    sinks._READ_AS_FLOATS = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))
    handles: list = []
    modules_off: Any = None
    leave: Any = None

    def off() -> None:  # idempotent: an interrupted uninstall runs it again
        for h in handles:
            h.remove()
        if modules_off is not None:
            modules_off()
        if leave is not None:
            leave()  # (after a guard's exit or uninstall() read what was pending: switches go off after that)
        sinks.end_tape()
        sinks.forget_calls()  # the calls open now are not seen closing; pending checks stay with their guard

    try:  # an interrupt anywhere here undoes what was done (the registry never saw this switch on)
        # the shared read, while the feature is on
        leave = _sync.participate(FEATURE, sinks._collect, sinks._consume, sinks._total)
        modules_off = outermost.switch_on(sinks.enter, sinks.exit, sinks.nested, sinks.nested_end)
        handles.append(optim_module.register_optimizer_step_pre_hook(sinks.optimizer_pre_step))
        handles.append(optim_module.register_optimizer_step_post_hook(sinks.optimizer_post_step))
    except BaseException:
        off()
        raise
    return off


def _module_compile(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        outermost.see_compiled_in_place(instance)
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return result


def _switch_module_compile() -> Any:
    """``nn.Module.compile`` wrapped on the class itself (see ``wrap_on_class``). A subclass that overrides
    ``compile()`` (none of torch's or Lightning's does) is not seen."""
    from torch.nn.modules.module import Module

    return wrap_on_class(Module, "compile", _module_compile)


def _switch_excepthook() -> Any:
    """An error that ends the program, or a thread, while a check waits for its read (torch's own check of a NaN that
    reached a distribution's parameters first, say) carries that check's origin when ``sys.excepthook`` or
    ``threading.excepthook`` prints it (see failure.explain); a ``guard()`` block's error does so as it leaves the
    block. threading calls its hook in the thread that raised, so the thread's own checks are read (an RL actor's, a
    request's). Each is put back at uninstall if it is still the hook; one set on top of it later keeps calling it,
    and it then calls the hook it found."""
    previous, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(kind: Any, error: Any, traceback: Any) -> Any:
        _explain(error)
        return previous(kind, error, traceback)

    def thread_excepthook(args: Any) -> Any:
        _explain(args.exc_value)
        return previous_thread(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook

    def off() -> None:
        if sys.excepthook is excepthook:
            sys.excepthook = previous
        if threading.excepthook is thread_excepthook:
            threading.excepthook = previous_thread

    return off


def _explain(error: Any) -> None:
    """The program's, the thread's or the Lightning stage's error as it ends it (it leaves as it came, whatever
    happens here)."""
    try:
        g = _guard.active()
        if g is not None and error is not None:
            failure.explain(g, error)
    except Exception as exc:
        internal_failure(FEATURE, exc)


def _lightning_interrupt(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Lightning's error path (``trainer.call._interrupt``): a stage raised, and its callbacks' ``on_exception`` and
    the strategy's teardown come next, then the error leaves ``fit()``. It carries the origin from here, under any
    guard: ``AMPGUARD=1`` without ``AmpGuardCallback``, in a notebook or a test, where no ``sys.excepthook`` ever
    prints it. Before the callbacks see it, and before teardown moves the model (a replay runs it where it ran)."""
    _explain(args[1] if len(args) > 1 else kwargs.get("exception"))
    return wrapped(*args, **kwargs)


def _switch_module_state() -> Any:
    """``nn.Module.__getstate__`` wrapped on the class itself (see ``wrap_on_class``); a subclass's own override that
    calls it is covered through that call."""
    from torch.nn.modules.module import Module

    return wrap_on_class(Module, "__getstate__", outermost.module_state)


def _switch_tensor_backward() -> Any:
    """``Tensor.backward`` wrapped on the class itself (see ``wrap_on_class``). A subclass that overrides
    ``backward()`` keeps the record on through its dispatch, as before, and ``torch.autograd.backward``'s wrapper
    ends it there."""
    from torch import Tensor

    return wrap_on_class(Tensor, "backward", sinks.tensor_backward)


REGISTRY.add_switch(Switch("torch", FEATURE, _switch_hooks,
                           "module and optimizer hooks: record outermost calls, check the sinks at the step"))
REGISTRY.add_switch(Switch("torch", FEATURE, _switch_module_compile,
                           "a model compiled in place runs its hooks compiled: its call is made an outermost call "
                           "around the compiled code"))
REGISTRY.add_switch(Switch("torch", FEATURE, _switch_module_state,
                           "a module saved or copied while it has ampguard's instance hooks (its call open, or "
                           "interrupted by Ctrl-C) is saved or copied without them"))
REGISTRY.add_switch(Switch("torch", FEATURE, _switch_excepthook,
                           "an error that ends the program or a thread carries the origin of a check still "
                           "waiting for its read"))
REGISTRY.add_switch(Switch("torch", FEATURE, _switch_tensor_backward,
                           "Tensor.backward: end the loss code's record before torch dispatches the call to it"))
REGISTRY.add(Target("torch", "torch.nn.modules.module", "_has_any_global_hook", outermost.global_hooks_but_ours,
                    "torch.compile(module)'s call warns of global hooks: ampguard's own are made for that call",
                    feature=FEATURE))
REGISTRY.add(Target("torch", "torch.autograd", "backward", sinks._backward,
                    "the loss sink; end the loss-code record; drop checks if backward raises", feature=FEATURE))
REGISTRY.add(Target("torch", "torch.jit:ScriptFunction", "__call__", torchscript.script_function_call,
                    "a TorchScript function's ops run below the loss-code record: the call itself is recorded",
                    feature=FEATURE))
REGISTRY.add(Target("torch", "torch.autograd", "grad", sinks._autograd_grad,
                    "the loss sink of a loop that sets .grad from torch.autograd.grad", feature=FEATURE))
REGISTRY.add(Target("torch", "torch.amp.grad_scaler:GradScaler", "scale", sinks._scaler_scale,
                    "the loss sink under AMP", feature=FEATURE))
for _module in ("torch.nn.utils.clip_grad", "torch.nn.utils"):
    REGISTRY.add(Target("torch", _module, "clip_grad_norm_", sinks._clip_grad_norm,
                        "the gradient sink rides the total norm the loop computes anyway", feature=FEATURE))
for _fetcher in ("_MapDatasetFetcher", "_IterableDatasetFetcher"):
    REGISTRY.add(Target("torch", f"torch.utils.data._utils.fetch:{_fetcher}", "fetch", sinks._dataset_fetch,
                        "a DataLoader's batch fetched in this process: its transforms' module calls are data "
                        "preparation, not outermost calls", feature=FEATURE))
for _owner in ("torchmetrics.metric:Metric", "torchmetrics.collections:MetricCollection"):
    REGISTRY.add(Target("torchmetrics", _owner, "forward", sinks._metric_forward,
                        "a metric measures: its call is no outermost call and no sink, its torch calls no loss code",
                        sinks.lightnings_own_metric, feature=FEATURE))
REGISTRY.add(Target("torchmetrics", "torchmetrics.metric:Metric", "_wrap_update", sinks._metric_wrap_update,
                    "a metric binds update() when it is built: its torch calls are no loss code either",
                    feature=FEATURE))
for _namespace in ("lightning.pytorch", "pytorch_lightning"):
    REGISTRY.add(Target(_namespace, f"{_namespace}.core.module:LightningModule", "training_step",
                        sinks._training_step, "end the loss-code record where training_step returns", feature=FEATURE))
    REGISTRY.add(Target(_namespace, f"{_namespace}.loops.optimization.automatic:ClosureResult",
                        "from_training_step_output", sinks._closure_result,
                        "the loss backward() gets is training_step's divided by accumulate_grad_batches: record it",
                        feature=FEATURE))
    REGISTRY.add(Target(_namespace, f"{_namespace}.callbacks.lr_finder:LearningRateFinder", "lr_find",
                        sinks._lr_range_test, "an LR range test reads the loss diverging (NaN/Inf) as its answer: its "
                        "run has no non-finite checks", feature=FEATURE))
    REGISTRY.add(Target(_namespace, f"{_namespace}.trainer.call", "_interrupt", _lightning_interrupt,
                        "a stage's error carries the origin of its checks before on_exception and teardown",
                        feature=FEATURE))
    for _method in ("log", "log_dict"):
        REGISTRY.add(Target(_namespace, f"{_namespace}.core.module:LightningModule", _method, sinks._lightning_log,
                            "self.log() is not loss code: its torch calls skip the loss-code record", feature=FEATURE))
