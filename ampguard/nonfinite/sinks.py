"""The normal path: sinks, and the little a replay needs if one fails.

Nothing here looks inside the model. Per outermost module call it keeps O(1) Python state (a
:class:`Call`: the module, references to its inputs, the RNG state, autocast and grad mode),
and between the model's output and ``backward()`` it records the loss code's top-level torch
calls (a :class:`TapeOp` each, no on-device work), so that the criterion stays attributable.

Sinks (where a NaN/Inf is an error), each one on-device status riding the shared read of
``_sync`` (GradScaler's read under AMP, otherwise one read at the optimizer step):

1. the loss given to ``GradScaler.scale()`` or ``torch.autograd.backward``; NaN or +-Inf;
2. the output of each outermost module call; NaN only (log-probabilities may be -inf);
3. gradients at an optimizer step not driven by a GradScaler, before the step;
4. parameters after an optimizer step.

A status is the largest magnitude (an inf-norm): it is finite exactly when every element is,
and unlike a sum it cannot overflow for finite values in any dtype.

A check is read at a step, and at the latest at the next outermost call of the same module (or
of any module after a ``backward()``), at ``guard()`` exit, at ``uninstall()`` and, under
``AMPGUARD=1``, at interpreter exit. A check queued before a ``backward()`` or a closure that
raised is dropped: the user's exception wins. A check belongs to its guard.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from typing import Any

from .. import _guard, _sync
from .._errors import AmpGuardError, AmpGuardWarning, NonFiniteError
from .._fallback import fail_safe, internal_failure
from .._frames import user_frames
from .._guard import DEPTH

FEATURE = "nonfinite"
MAX_WINDOW = 4096  # calls and loss-code ops kept between two reads; past that the tape stops

_torch: Any = None  # bound when the hooks switch on; every path below runs after that
_failure: Any = None  # the failure path (ampguard.nonfinite.failure), bound by the package: no lazy import
_is_compiling: Any = None
_graph_task_id: Any = None
_any_autocast: Any = None
_SKIP_NAMES = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "item", "tolist", "__repr__", "__format__", "__bool__",
    "__len__", "backward", "register_hook", "requires_grad_", "data_ptr", "stride", "is_floating_point",
    "element_size", "is_contiguous", "storage_offset", "__hash__", "__eq__", "detach", "clone", "cpu", "numpy",
})
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


class Call:
    """One outermost module call, as a replay needs it."""

    __slots__ = ("args", "autocast", "grad", "inference", "kwargs", "module", "outputs", "rng", "site", "steps")

    def __init__(self, module: Any, args: tuple, kwargs: dict, entry: tuple, outputs: list) -> None:
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.rng, self.autocast, self.grad, self.inference, self.site, self.steps = entry
        self.outputs = outputs  # [(weakref, position)] of the floating output tensors


class TapeOp:
    """One top-level torch call of the loss code, between the model's output and backward()."""

    __slots__ = ("args", "autocast", "frames", "func", "grad", "kwargs", "outputs")

    def __init__(self, func: Any, args: tuple, kwargs: dict, outputs: list, frames: tuple, autocast: Any,
                 grad: bool) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs  # [(weakref, position)]
        self.frames = frames
        self.autocast = autocast
        self.grad = grad


class Pending:
    """A sink status waiting for the next shared read."""

    __slots__ = ("call", "guard", "key", "nan_only", "optimizer", "params", "sink", "tensor", "tensors")

    def __init__(self, guard: Any, sink: str, nan_only: bool, tensors: list, tensor: Any = None, call: Any = None,
                 params: list | None = None, optimizer: Any = None, key: Any = None) -> None:
        self.key = key  # which output of the call (a position or a dict key)
        self.guard = guard
        self.sink = sink
        self.nan_only = nan_only
        self.tensors = tensors  # whose statuses the read takes, all pending sinks in one kernel
        self.tensor = tensor  # the sink tensor (the loss, or an output), for the error message
        self.call = call  # the Call whose output this is
        self.params = params  # gradient and parameter sinks: the parameters checked
        self.optimizer = optimizer  # a weakref to the optimizer


class _Thread(threading.local):
    def __init__(self) -> None:
        self.root: Any = None  # the open outermost user module call (inside DDP/FSDP/Lightning wrappers)
        self.root_nesting = 0  # calls of that same module inside it
        self.entry: tuple | None = None  # what the open outermost call captured on entry
        self.pending: list[Pending] = []
        self.window: list = []  # Calls and TapeOps since the last read, in order
        self.losses: list = []  # loss tensors given to backward since the last read
        self.scaled: dict[int, tuple] = {}  # id(scaled loss) -> (weakref, loss): its backward is that loss's sink
        self.backward_since_read = False
        self.tape: Any = None  # the loss-code recorder, while it is on torch's mode stack
        self.taping = False  # record into the window (off while paused or full)
        self.steps = 0  # optimizer steps taken in this thread, to tell a replay that parameters moved
        self.replaying = 0  # >0 while a replay runs: the normal path stands aside
        self.replay_stack: list = []  # modules open during a replay, for names
        self.eager = False  # trace='eager': every recorded op is checked as it runs
        self.eager_stack: list = []  # modules open during an eager-mode forward, for names


T = _Thread()


def status(tensor: Any) -> Any:
    """0-d on-device value, finite exactly when every element is; never overflows for finite values."""
    t = tensor.detach()
    return _torch.linalg.vector_norm(t, float("inf"), dtype=t.dtype if t.dtype == _torch.float64 else _torch.float32)


def _statuses(tensors: list) -> Any:
    """One 1-D tensor: the inf-norm of each of ``tensors``, in one foreach kernel (float64 if any is)."""
    torch = _torch
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    norms = torch._foreach_norm([t.detach() for t in tensors], float("inf"), dtype=wide)
    device = norms[0].device
    if any(n.device != device for n in norms):
        norms = [n.to(device) for n in norms]
    return torch.stack(norms)


def watched(g: _guard.Guard, tensor: Any) -> bool:
    devices = g.options.devices
    return devices is None or tensor.device.type in devices


def floating(value: Any) -> list:
    """(tensor, position) for the floating tensors in an output: a tensor, a tuple/list, a dict's values."""
    tensor = _torch.Tensor
    if isinstance(value, tensor):
        items: Any = ((0, value),)
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return []
    return [(v, k) for k, v in items if isinstance(v, tensor) and v.is_floating_point() and v.numel()]


# -- module kinds ----------------------------------------------------------------------------
_WRAPPERS = (("torch.nn.parallel.distributed", "DistributedDataParallel"),
             ("torch.nn.parallel.data_parallel", "DataParallel"),
             ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
             ("lightning.pytorch.overrides.base", "_LightningModuleWrapperBase"),
             ("pytorch_lightning.overrides.base", "_LightningModuleWrapperBase"))
_kinds: dict[type, str | None] = {}


def kind(module: Any) -> str | None:
    """'wrapper' for DDP/DataParallel/FSDP and Lightning's strategy wrapper, whose forward is plumbing
    around the user's module; 'compiled' for a torch.compile'd module; None otherwise. Once per class."""
    cls = type(module)
    if cls in _kinds:
        return _kinds[cls]
    wrappers = tuple(getattr(sys.modules[m], name) for m, name in _WRAPPERS if m in sys.modules)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    result = "wrapper" if wrappers and issubclass(cls, wrappers) else \
        "compiled" if eval_frame is not None and issubclass(cls, eval_frame.OptimizedModule) else None
    _kinds[cls] = result
    return result


def _in_worker() -> bool:
    worker = sys.modules.get("torch.utils.data._utils.worker")
    return worker is not None and worker._worker_info is not None


def _outside_normal_path() -> bool:
    """Inside a backward (a checkpoint's re-run) or a DataLoader worker; compiling and replays are checked first."""
    return _graph_task_id() != -1 or _in_worker()


# -- capture ---------------------------------------------------------------------------------
def _autocast_state() -> tuple | None:
    if not _any_autocast():
        return None
    torch = _torch
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if _autocast_on(d))


def _autocast_on(device: str) -> bool:
    try:
        return _torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type this build does not know
        return False


def _rng_state() -> tuple:
    torch = _torch
    cuda = None
    if torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        cuda = (index, torch.cuda.default_generators[index].get_state())
    return torch.default_generator.get_state(), cuda


def _entry(frame: Any) -> tuple:
    site = user_frames(frame, limit=1, budget=8)
    return (_rng_state(), _autocast_state(), _torch.is_grad_enabled(), _torch.is_inference_mode_enabled(),
            site[0] if site else None, T.steps)


# -- module hooks ----------------------------------------------------------------------------
# Every module call reaches these hooks; inside an outermost call they return at once.
@fail_safe(FEATURE)
def forward_pre(module: Any, args: Any) -> None:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    if _is_compiling():
        return  # inside a compiled graph (dynamo folds this): the compiled module's own call is the outermost
    if T.replaying:
        T.replay_stack.append(module)
        return
    root = T.root
    if root is not None:
        if module is root:
            T.root_nesting += 1  # the outermost module calling itself
        if T.eager:
            T.eager_stack.append(module)
        return
    g = _guard.current(FEATURE)
    if g is None or _outside_normal_path() or kind(module) == "wrapper":
        return  # DDP/FSDP/Lightning's wrapper: the module it calls is the outermost user call
    _root_enter(g, module)


def _root_enter(g: _guard.Guard, module: Any) -> None:
    __tracebackhide__ = True
    if T.pending and (T.backward_since_read or any(type(c) is Call and c.module is module for c in T.window)):
        check()  # the previous call's checks: no step consumed them
    end_tape()
    T.root = module
    T.root_nesting = 0
    T.entry = _entry(sys._getframe(3))
    T.eager = g.options.trace == "eager"
    if T.eager:
        T.eager_stack = [module]
        start_tape(g)  # every op of the forward is recorded and checked as it runs


@fail_safe(FEATURE)
def forward_post(module: Any, args: Any, *rest: Any) -> None:
    # (kwargs, output) normally; (output,) when the forward raised: torch then calls always-call hooks
    # without kwargs, and the call only has to be unwound.
    if _is_compiling():
        return
    if T.replaying:
        if T.replay_stack and T.replay_stack[-1] is module:
            T.replay_stack.pop()
        return
    if module is not T.root:
        if T.eager_stack and T.eager_stack[-1] is module:
            T.eager_stack.pop()
        return
    if T.root_nesting:
        T.root_nesting -= 1
        return
    T.root = None
    T.eager_stack = []
    entry, T.entry = T.entry, None
    g = _guard.current(FEATURE)
    if g is None or entry is None or len(rest) != 2:
        return
    kwargs, output = rest
    outputs = [(o, k) for o, k in floating(output) if watched(g, o)]
    call = Call(module, args, kwargs or {}, entry, [(weakref.ref(o), k) for o, k in outputs])
    if len(T.window) < MAX_WINDOW:
        T.window.append(call)
    name = type(module._orig_mod if kind(module) == "compiled" else module).__name__  # no failing __getattr__
    for o, k in outputs:
        # held until the read: its status is taken there, in one kernel with the others
        where = f"output of module '{name}'" + (f" (output {k!r})" if len(outputs) > 1 else "")
        T.pending.append(Pending(g, where, True, [o], o, call, key=k))
    known = roots(g)
    key = id(module)
    if key not in known:
        known[key] = weakref.ref(module, lambda _: known.pop(key, None))
    if g.options.trace != "off" and entry[2]:
        start_tape(g)  # the loss code follows: record it until backward()
    elif T.eager:
        end_tape()


def roots(g: _guard.Guard) -> dict:
    """id -> weakref of every module this guard saw called outermost: where parameter names come from."""
    return g.feature_state("nonfinite_roots", dict)


# -- the loss-code tape ------------------------------------------------------------------------
_Tape: Any = None


def _make_tape() -> Any:
    torch = _torch
    tensor = torch.Tensor

    class Tape(torch.overrides.TorchFunctionMode):
        """Records the loss code's top-level torch calls; no on-device work, no reads."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            __tracebackhide__ = True
            kwargs = kwargs or {}
            if _is_compiling():  # dynamo folds this: a compiled graph sees a plain call, no graph break
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            if not T.taping or T.replaying or getattr(func, "__name__", "") in _SKIP_NAMES:
                return out
            try:
                if isinstance(out, tensor):
                    outs = [(out, 0)] if out.is_floating_point() else []
                else:
                    outs = floating(out)
                if outs:
                    _record(func, args, kwargs, outs, sys._getframe(1))
            except (NonFiniteError, AmpGuardWarning):
                raise
            except Exception as exc:
                internal_failure(FEATURE, exc)
            return out

    return Tape


def _record(func: Any, args: tuple, kwargs: dict, outs: list, frame: Any) -> None:
    frames = []
    while frame is not None and len(frames) < 6:
        frames.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    if len(T.window) >= MAX_WINDOW:
        T.taping = False
        return
    T.window.append(TapeOp(func, args, kwargs, [(weakref.ref(o), k) for o, k in outs], tuple(frames),
                           _autocast_state(), _torch.is_grad_enabled()))
    if T.eager:
        _failure.check_eager(T.window[-1], outs)


def start_tape(g: _guard.Guard) -> None:
    global _Tape
    if T.tape is not None:
        T.taping = True
        return
    if _Tape is None:
        _Tape = _make_tape()
    mode = _Tape()
    mode.__enter__()
    T.tape = mode
    T.taping = True


def end_tape() -> None:
    """Take the tape off torch's mode stack if it is on top; otherwise stop recording until it can be."""
    T.taping = False
    mode = T.tape
    if mode is None:
        return
    torch = _torch
    n = torch._C._len_torch_function_stack()
    if n and torch._C._get_function_stack_at(n - 1) is mode:
        mode.__exit__(None, None, None)
        T.tape = None


# -- loss sinks and backward -------------------------------------------------------------------
def add_loss(g: _guard.Guard, loss: Any) -> None:
    T.pending.append(Pending(g, "loss", False, [loss], loss))


def _backward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g = _guard.current(FEATURE)
    if g is None or T.replaying:
        return wrapped(*args, **kwargs)
    try:
        end_tape()  # under Tensor.backward the mode is ours to pop only at the next hook
        roots = args[0] if args else kwargs.get("tensors")
        roots = [roots] if isinstance(roots, _torch.Tensor) else list(roots or ())
        for r in roots:
            if r.is_floating_point() and watched(g, r) and scaled_loss(r) is None:
                T.losses.append(r)
                add_loss(g, r)
        T.backward_since_read = True
        if g.options.trace == "eager":
            check()
    except (AmpGuardError, AmpGuardWarning):
        raise
    except Exception as exc:
        internal_failure(FEATURE, exc)
    try:
        return wrapped(*args, **kwargs)
    except BaseException:
        drop(g)  # the user's exception wins over checks queued before it
        raise


def _training_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Lightning: the loss code is in training_step; what runs after it until backward() is Lightning's."""
    result = wrapped(*args, **kwargs)
    if T.tape is not None and _guard.current(FEATURE) is not None and not T.eager:
        end_tape()
    return result


def _scaler_scale(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    g = _guard.current(FEATURE)
    if g is not None and not T.replaying:
        end_tape()  # the loss code ends here: the scaler's own ops are not the user's, and cost nothing then
    out = wrapped(*args, **kwargs)
    if g is None or T.replaying or not getattr(instance, "_enabled", False):
        return out
    try:
        loss = args[0] if args else kwargs.get("outputs")
        if isinstance(loss, _torch.Tensor) and isinstance(out, _torch.Tensor) and loss.is_floating_point():
            add_loss(g, loss)
            T.losses.append(loss)
            T.scaled[id(out)] = (weakref.ref(out), loss)  # backward() of it is this sink, not a second one
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return out


def scaled_loss(tensor: Any) -> Any:
    entry = T.scaled.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else None


# -- optimizer hooks ---------------------------------------------------------------------------
def params_of(optimizer: Any) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _add_grads(g: _guard.Guard, optimizer: Any) -> None:
    params = [p for p in params_of(optimizer)
              if p.grad is not None and p.grad.is_floating_point() and p.grad.numel() and watched(g, p.grad)]
    if params:
        T.pending.append(Pending(g, f"gradients of {g.name_of(optimizer)}", False, [p.grad for p in params],
                                 params=params, optimizer=weakref.ref(optimizer)))


@fail_safe(FEATURE)
def optimizer_pre_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g = _guard.current(FEATURE)
    if g is None or T.replaying:
        return None
    end_tape()
    if DEPTH.counts.get("scaler.step"):
        return None  # under a GradScaler non-finite gradients are its business; read at update()
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
    if closure is None:
        _add_grads(g, optimizer)
        check()
        return None
    # The closure runs the forward and backward inside step(): read after it, before the update.
    checked = _CheckedClosure(g, optimizer, closure)
    if len(args) > 1:
        return (args[0], checked, *args[2:]), kwargs
    return args, {**kwargs, "closure": checked}


class _CheckedClosure:
    __slots__ = ("closure", "guard", "optimizer")

    def __init__(self, g: _guard.Guard, optimizer: Any, closure: Any) -> None:
        self.guard, self.optimizer, self.closure = g, optimizer, closure

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            result = self.closure(*args, **kwargs)
        except BaseException:
            drop(self.guard)
            raise
        if _guard.current(FEATURE) is self.guard:
            end_tape()
            _add_grads(self.guard, self.optimizer)
            check()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.closure, name)


@fail_safe(FEATURE)
def optimizer_post_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    g = _guard.current(FEATURE)
    if g is None or T.replaying:
        return
    T.steps += 1
    params = [p for p in params_of(optimizer) if p.is_floating_point() and p.numel() and watched(g, p)]
    if params:
        # Parameters do not move before the next read (a step's pre-hook, its closure, update(), the
        # next forward), so their statuses are taken there, in the read's one kernel.
        T.pending.append(Pending(g, f"parameters of {g.name_of(optimizer)}", False, params, params=params,
                                 optimizer=weakref.ref(optimizer)))
        if g.options.trace == "eager":
            check()


# -- reading -----------------------------------------------------------------------------------
def _collect() -> list:
    """This guard's pending sinks as one tensor of statuses; another guard's are dropped, never judged here."""
    g = _guard.current(FEATURE)
    if g is None or not T.pending:
        return []
    if any(p.guard is not g for p in T.pending):
        T.pending = [p for p in T.pending if p.guard is g]
    return [_statuses([t for p in T.pending for t in p.tensors])]


def _consume(values: list[float]) -> None:
    """Judge the pending sinks in the order they were added; raise or warn for the first bad one."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g = _guard.current(FEATURE)
    pending, T.pending = T.pending, []
    at = 0
    failed = None
    for p in pending:
        mine = values[at:at + len(p.tensors)]
        at += len(mine)
        if failed is None and any(v != v or (v == math.inf and not p.nan_only) for v in mine):
            failed = p
    if failed is None:
        _clear_window()
        return
    _failure.fail(g, failed)


def _clear_window() -> None:
    end_tape()
    T.window = []
    T.losses = []
    T.backward_since_read = False
    T.scaled = {}


_sync.participate(FEATURE, _collect, _consume)


def check() -> None:
    """Read every pending sink now (one sync, shared with anything else waiting)."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    if T.pending:
        _sync.read([])[1]()
    elif T.window:
        _clear_window()


def forget_calls() -> None:
    """The module calls open in this thread, as the hooks go off (their closing will not be seen)."""
    T.root = None
    T.root_nesting = 0
    T.entry = None
    T.eager = False
    T.eager_stack = []


def drop(g: Any = None) -> None:
    """Forget the pending checks (of ``g``, or all) and the window: an exception is on its way."""
    T.pending = [p for p in T.pending if g is not None and p.guard is not g]
    _clear_window()


def settle(g: _guard.Guard, exiting_with_error: bool) -> None:
    """At guard() exit or uninstall(): read what is still pending, unless an exception is leaving."""
    __tracebackhide__ = True
    if exiting_with_error or _torch is None:
        drop(g)
        return
    if any(p.guard is g for p in T.pending) and _guard.current(FEATURE) is g:
        check()
    drop(g)
