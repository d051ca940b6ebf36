"""NaN/Inf detection: sinks where a non-finite value is an error, and the op that created it.

Sinks (where a NaN/Inf is an error):

1. the loss: the tensor given to ``GradScaler.scale()`` or used as a root of
   ``torch.autograd.backward`` (``Tensor.backward`` goes through it); NaN or +-Inf;
2. the output of the outermost module call; NaN only (log-probabilities may be -inf);
3. gradients at an optimizer step not driven by a GradScaler; checked before the step;
4. parameters after an optimizer step.

Intermediate values are never errors by themselves (``masked_fill(-inf)`` then softmax is normal).

With ``trace="deferred"`` a TorchFunctionMode is pushed at the outermost module call and popped
at the loss (backward) or the optimizer step, so backward and ``optimizer.step()`` are never
traced. Each op records an on-device float32 sum of each floating output (NaN, +Inf and -Inf
survive a sum), its first user frames, the module running, and which recorded ops produced its
inputs. The sink statuses wait in ``_sync``'s shared read: the optimizer pre-step hook asks for
it, and GradScaler.update() already does one. Only when a sink fails are the op records read and
walked back to the origin. An op whose input entered the traced ops already non-finite (data, a
parameter, an untraced compiled function's output) is never blamed: the input is reported.

The tracer starts inside DDP/DataParallel/FSDP wrappers, and steps aside while dynamo traces
(``torch.compiler.is_compiling()``): a ``torch.compile``d module is recorded as one op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import warnings
import weakref
from typing import Any

from .. import _guard, _sync
from .._errors import AmpGuardWarning, NonFiniteError
from .._frames import user_frames, warn_at_user
from .._guard import DEPTH, fail_safe, internal_failure
from .._patching import REGISTRY, Switch, Target
from ..lints import eps_message
from . import _report

FEATURE = "nonfinite"
MAX_RECORDS = 200_000  # a step that records more stops tracing (and says so) instead of growing
class OpRecord:
    __slots__ = ("dtype", "frames", "func", "inputs", "module", "outside", "ref", "shape", "status", "value")

    def __init__(self, func: Any, frames: tuple, module: Any, inputs: tuple, status: Any, ref: Any,
                 shape: Any = None, dtype: Any = None, outside: tuple = ()) -> None:
        # floating inputs no recorded op produced, as (weakref, status, shape, dtype): parameters and
        # buffers are still alive at the check and keep status None; anything else (data, the output
        # of a compiled function) may be freed by then, so its status is taken when first used
        self.outside = outside
        self.shape = shape
        self.dtype = dtype
        self.func = func
        self.frames = frames
        self.module = module
        self.inputs = inputs
        self.status = status
        self.ref = ref
        self.value: float | None = None  # known in eager mode


@dataclasses.dataclass
class _Pending:
    sink: str
    nan_only: bool
    status: Any  # 0-d float32 tensor
    tensor: Any  # the sink tensor: strong for the small loss, a weakref otherwise, None for params
    record: int | None
    params: list | None = None  # for gradient/parameter sinks: the parameters checked
    optimizer: Any = None  # a weakref to the optimizer that stepped them (parameter sinks)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.mode: Any = None
        self.depth = 0
        self.stack: list = []
        self.root: Any = None
        self.records: list[OpRecord] = []
        self.producer: dict[int, tuple[Any, int]] = {}
        self.outside: dict[int, tuple] = {}  # id -> OpRecord.outside entry, for untraced inputs this step
        self.pending: list[_Pending] = []
        self.scaled: weakref.WeakSet = weakref.WeakSet()
        self.backward_since_check = False
        self.full = False
        # Tensor.backward reaches _backward from inside the mode's own handler, where torch has taken
        # the mode off its stack: it cannot be popped there, so recording pauses until it can be.
        self.paused = False


T = _ThreadState()


def _watched(g: _guard.Guard, tensor: Any) -> bool:
    devices = g.options.devices
    return devices is None or tensor.device.type in devices


_torch: Any = None  # torch, bound when the hooks switch on (every path below runs after that)


def _status(tensor: Any) -> Any:
    return _torch.sum(tensor.detach(), dtype=_torch.float32)


_WRAPPERS = (("torch.nn.parallel.distributed", "DistributedDataParallel"),
             ("torch.nn.parallel.data_parallel", "DataParallel"),
             ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"))
_kinds: dict[type, str | None] = {}


def _kind(module: Any) -> str | None:
    """'wrapper' for DDP/DataParallel/FSDP, whose forward is plumbing around the user's module;
    'compiled' for a torch.compile'd module (dynamo's OptimizedModule), one opaque region to the
    tracer; None for the rest. Decided once per class."""
    cls = type(module)
    if cls in _kinds:
        return _kinds[cls]
    wrappers = tuple(getattr(sys.modules[m], name) for m, name in _WRAPPERS if m in sys.modules)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    kind = "wrapper" if wrappers and issubclass(cls, wrappers) else \
        "compiled" if eval_frame is not None and issubclass(cls, eval_frame.OptimizedModule) else None
    _kinds[cls] = kind
    return kind


def _record_compiled_region(g: _guard.Guard, module: Any, args: Any, output: Any) -> None:
    """Record a compiled module's call as one op, then trace the user's code after it again."""
    T.paused = False
    if g.options.trace != "off":
        inner = type(getattr(module, "_orig_mod", module)).__name__
        with _torch._C.DisableTorchFunction():  # the tracer may still be on the stack: ampguard's ops are not traced
            _record(g, f"the torch.compile'd module '{inner}'", tuple(args), None, output,
                    frames=user_frames(sys._getframe(2), budget=64))
        _push_mode(g)


def _in_worker() -> bool:
    worker = sys.modules.get("torch.utils.data._utils.worker")
    return worker is not None and worker._worker_info is not None


# -- the tracer ----------------------------------------------------------------------------
def _make_mode() -> Any:
    import torch

    skip_names = {"__get__", "__set__", "size", "dim", "numel", "item", "tolist", "__repr__", "__format__",
                  "__bool__", "__len__", "backward", "register_hook", "requires_grad_", "data_ptr", "stride",
                  "is_floating_point", "element_size", "is_contiguous", "storage_offset", "__hash__", "__eq__"}

    is_compiling = torch.compiler.is_compiling

    class Tracer(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            __tracebackhide__ = True
            if is_compiling():  # dynamo folds this to True: a compiled graph sees a plain call, no graph break
                return func(*args, **(kwargs or {}))
            out = func(*args, **(kwargs or {}))
            if getattr(func, "__name__", "") in skip_names:
                return out
            g = _guard.current(FEATURE)
            if g is None or T.full or T.paused:
                return out
            try:
                _record(g, func, args, kwargs, out)
            except (NonFiniteError, AmpGuardWarning):  # intended: an error, or a warning the user made one
                raise
            except Exception as exc:
                internal_failure(FEATURE, exc)
            return out

    return Tracer


_Tracer: Any = None


def _tensors(value: Any) -> list:
    """The tensors in an op's or a module's output: a tensor, a tuple/list of them, or a dict's values."""
    tensor = _torch.Tensor
    if isinstance(value, tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [o for o in value if isinstance(o, tensor)]
    if isinstance(value, dict):
        return [o for o in value.values() if isinstance(o, tensor)]
    return []


def _record(g: _guard.Guard, func: Any, args: tuple, kwargs: dict | None, out: Any,
            frames: tuple | None = None) -> None:
    outputs = [o for o in _tensors(out) if o.is_floating_point() and o.numel() and _watched(g, o)]
    if not outputs:
        return
    tensor = _torch.Tensor
    producer = T.producer
    eager = g.options.trace == "eager"
    inputs = []
    outside = []  # floating inputs no recorded op produced: data, parameters, a compiled function's output
    for a in (*args, *(kwargs.values() if kwargs else ())):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, tensor):
                entry = producer.get(id(t))
                if entry is not None and entry[0]() is t:
                    inputs.append(entry[1])
                elif t.is_floating_point():
                    outside.append(t)
    records = T.records
    if frames is None:
        frames = user_frames(sys._getframe(2))
    module = T.stack[-1] if T.stack else None
    outside_refs = tuple(_outside_entry(t) for t in outside)
    for o in outputs:
        index = len(records)
        status = _status(o)
        ref = weakref.ref(o)
        record = OpRecord(func, frames, module, tuple(inputs), status, ref, o.shape, o.dtype, outside_refs)
        records.append(record)
        producer[id(o)] = (ref, index)
        if eager:
            _eager_check(g, record, index, outside)
    if len(records) > MAX_RECORDS:
        T.full = True
        warn_at_user(f"ampguard: more than {MAX_RECORDS} ops recorded without a sink check; origin tracing is "
                     "paused until the next optimizer step")


def _outside_entry(tensor: Any) -> tuple:
    """(weakref, status or None, shape, dtype) for an input no recorded op produced; one status per tensor per step."""
    entry = T.outside.get(id(tensor))
    if entry is not None and entry[0]() is tensor:
        return entry
    state = isinstance(tensor, _torch.nn.Parameter) or id(tensor) in _module_tensors(T.root)
    entry = T.outside[id(tensor)] = (weakref.ref(tensor), None if state else _status(tensor), tensor.shape,
                                     tensor.dtype)
    return entry


_module_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _module_tensors(root: Any) -> frozenset:
    """The ids of the root module's parameters and buffers, collected once per root module."""
    if root is None:
        return frozenset()
    ids = _module_state.get(root)
    if ids is None:
        ids = _module_state[root] = frozenset(id(t) for t in (*root.parameters(), *root.buffers()))
    return ids


def _eager_check(g: _guard.Guard, record: OpRecord, index: int, unrecorded: list) -> None:
    import torch

    record.value = value = float(record.status)
    if value == value:
        return  # Infs are reported only if they reach a sink
    records = T.records
    if any(records[i].value != records[i].value for i in record.inputs):
        return
    if any(bool(torch.isnan(t).any()) for t in unrecorded):
        return
    values = [r.value if r.value is not None else 0.0 for r in records]
    _fail(g, _Pending("the output of this op", True, record.status, record.ref(), index), values)


def _push_mode(g: _guard.Guard) -> None:
    global _Tracer
    if T.mode is not None or g.options.trace == "off" or _in_worker():
        return
    if _Tracer is None:
        _Tracer = _make_mode()
    mode = _Tracer()
    mode.__enter__()
    T.mode = mode


def _pop_mode() -> bool:
    """Pop the tracer if it is on top of torch's mode stack; whether it is off the stack now."""
    import torch

    mode = T.mode
    if mode is None:
        return True
    n = torch._C._len_torch_function_stack()
    if n and torch._C._get_function_stack_at(n - 1) is mode:
        mode.__exit__(None, None, None)
        T.mode = None
        T.paused = False
        return True
    return False


def _clear_records() -> None:
    T.records = []
    T.producer = {}
    T.outside = {}
    T.full = False


def _norm_status(tensors: list) -> Any:
    """One on-device value that is non-finite iff any element of ``tensors`` is."""
    import torch

    norms = torch._foreach_norm([t.detach() for t in tensors])
    return torch.stack([n.float() for n in norms]).sum()


# -- sinks -----------------------------------------------------------------------------
def _add_tensor_sink(g: _guard.Guard, sink: str, tensor: Any, nan_only: bool, keep: bool) -> None:
    entry = T.producer.get(id(tensor))
    record = entry[1] if entry is not None and entry[0]() is tensor else None
    with _torch._C.DisableTorchFunction():  # the tracer may be active: ampguard's own ops are not the user's
        status = _status(tensor)
    T.pending.append(_Pending(sink, nan_only, status, tensor if keep else weakref.ref(tensor), record))


@fail_safe(FEATURE)
def _forward_pre(module: Any, args: Any) -> None:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    if _torch.compiler.is_compiling():
        return  # inside a compiled graph: the compiled region is recorded as one op at its boundary
    g = _guard.current(FEATURE)
    if g is None or _in_worker():
        return
    kind = _kind(module)
    if T.depth == 0:
        if T.pending and T.backward_since_check:
            check()  # a backward without an optimizer step since: check its loss now
        T.root = getattr(module, "_orig_mod", module)
        T.paused = False  # a new forward (gradient accumulation) records again
        if kind is None:
            _push_mode(g)
    elif T.depth == 1 and T.mode is None and kind is None and _kind(T.root) == "wrapper":
        T.root = module  # DDP's own forward is not the user's: trace from the module it wraps
        _push_mode(g)
    if kind == "compiled":
        T.paused = not _pop_mode()  # the tracer stays out of the compiled region; its call is one op
    T.stack.append(module)
    T.depth += 1


@fail_safe(FEATURE)
def _forward_post(module: Any, args: Any, output: Any) -> None:
    if _torch.compiler.is_compiling():
        return
    g = _guard.current(FEATURE)
    if g is None or not T.stack or T.stack[-1] is not module:
        return
    T.stack.pop()
    T.depth -= 1
    if _kind(module) == "compiled":
        _record_compiled_region(g, module, args, output)
    if T.depth:
        return
    outputs = _tensors(output)
    for o in outputs:
        if o.is_floating_point() and o.numel() and _watched(g, o):
            _add_tensor_sink(g, f"output of module '{type(module).__name__}'", o, nan_only=True, keep=False)
    if outputs and not _torch.is_grad_enabled():
        check()  # no backward will come (inference): check now


def _backward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    import torch

    g = _guard.current(FEATURE)
    if g is None:
        return wrapped(*args, **kwargs)
    try:
        roots = args[0] if args else kwargs.get("tensors")
        roots = [roots] if isinstance(roots, torch.Tensor) else list(roots or ())
        T.paused = not _pop_mode()  # under Tensor.backward the mode is ours to pop only at the next hook
        for r in roots:
            if r in T.scaled:
                continue  # the scaled loss; the loss itself was checked at GradScaler.scale()
            if r.is_floating_point() and _watched(g, r):
                _add_tensor_sink(g, "loss", r, nan_only=False, keep=True)
        T.backward_since_check = True
        if g.options.trace == "eager":
            check()
    except (NonFiniteError, AmpGuardWarning):  # intended: an error, or a warning the user made one
        raise
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return wrapped(*args, **kwargs)


def _scaler_scale(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    g = _guard.current(FEATURE)
    out = wrapped(*args, **kwargs)
    if g is None or not getattr(instance, "_enabled", False):
        return out
    try:
        loss = args[0] if args else kwargs.get("outputs")
        if isinstance(loss, torch.Tensor) and isinstance(out, torch.Tensor):
            _add_tensor_sink(g, "loss", loss, nan_only=False, keep=True)
            T.scaled.add(out)
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return out


def _params_of(optimizer: Any) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _param_names(params: list) -> dict[int, str]:
    root = T.root
    names = {}
    if root is not None:
        names = {id(p): n for n, p in root.named_parameters()}
    return {id(p): names.get(id(p), f"#{i}") for i, p in enumerate(params)}


@fail_safe(FEATURE)
def _optimizer_pre_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g = _guard.current(FEATURE)
    if g is None:
        return
    _pop_mode()
    if DEPTH.counts.get("scaler.step"):
        return  # under a GradScaler non-finite gradients are its business; checked at update()
    params = [p for p in _params_of(optimizer)
              if p.grad is not None and p.grad.is_floating_point() and _watched(g, p.grad)]
    if params:
        T.pending.append(_Pending(f"gradients of {g.name_of(optimizer)}", False,
                                  _norm_status([p.grad for p in params]), None, None, params=params))
    check()


@fail_safe(FEATURE)
def _optimizer_post_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    g = _guard.current(FEATURE)
    if g is None:
        return
    params = [p for p in _params_of(optimizer) if p.is_floating_point() and _watched(g, p)]
    if params:
        T.pending.append(_Pending(f"parameters of {g.name_of(optimizer)}", False, _norm_status(params), None,
                                  None, params=params, optimizer=weakref.ref(optimizer)))
        if g.options.trace == "eager":
            check()
    if not T.pending:
        _clear_records()


# -- checking ----------------------------------------------------------------------------
def _collect() -> list:
    """The sink statuses waiting for the next shared read."""
    return [p.status for p in T.pending] if _guard.current(FEATURE) else []


def _consume(values: list[float]) -> None:
    """Judge the pending sinks, in the order they were added; raise or warn for the first bad one."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g = _guard.current(FEATURE)
    pending, T.pending = T.pending[:len(values)], T.pending[len(values):]
    T.backward_since_check = False
    for p, value in zip(pending, values, strict=True):
        kind = _report.kind_of(value)
        if kind is None or (p.nan_only and kind != "nan"):
            continue
        _fail(g, p, None)
        return
    if not T.pending:
        _clear_records()


_sync.participate(FEATURE, _collect, _consume)


def check() -> None:
    """Read every pending sink now (one sync, shared with anything else waiting)."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    if T.pending:
        _sync.read([])[1]()


def _fail(g: _guard.Guard, p: _Pending, values: list[float] | None) -> None:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    import torch

    g.stats.nonfinite_detected += 1
    T.pending = []
    T.backward_since_check = False
    records = T.records
    try:
        if values is None and records:
            values = torch.stack([r.status for r in records]).tolist()  # the failure path's own sync
        error = _build_error(g, p, records, values or [])
    finally:
        _clear_records()
    if g.options.nonfinite == "warn":
        warned = g.feature_state("nonfinite_warned", set)
        key = (error.sink, tuple(error.origin[-1][:2]) if error.origin else None)
        if key not in warned:
            warned.add(key)
            warn_at_user(str(error))
        return
    raise error


def _sink_kind(p: _Pending, values: list[float]) -> str:
    if p.record is not None and p.record < len(values):
        return _report.kind_of(values[p.record]) or "nan"
    tensor = p.tensor() if isinstance(p.tensor, weakref.ref) else p.tensor
    if tensor is not None:
        return _report.kind_of(float(_status(tensor))) or "nan"
    return _report.kind_of(float(p.status)) or "nan"


def _outside_inputs(rec: OpRecord) -> tuple[str | None, int]:
    """(a description of the first untraced input of ``rec`` that is non-finite or None, how many were freed)."""
    freed = 0
    for ref, status, shape, dtype in rec.outside:
        tensor = ref()
        if status is None and tensor is None:
            freed += 1
            continue
        kind = _report.kind_of(float(status if status is not None else _status(tensor)))
        if kind is not None:
            what = _report.describe_tensor(tensor) if tensor is not None else \
                f"shape {tuple(shape)}, {dtype}, {kind}; freed before the check: no element counts"
            return f"{_tensor_name(tensor) if tensor is not None else 'a tensor'} ({what})", freed
    return None, freed


def _tensor_name(tensor: Any) -> str:
    root = T.root
    if root is not None:
        for name, t in (*root.named_parameters(), *root.named_buffers()):
            if t is tensor:
                return f"{'parameter' if isinstance(t, _torch.nn.Parameter) else 'buffer'} '{name}'"
    return "a tensor"


def _module_path(module: Any) -> str | None:
    root = T.root
    if module is None or root is None:
        return None
    if module is root:
        return type(root).__name__
    for name, m in root.named_modules():
        if m is module:
            return name
    return type(module).__name__


def _build_error(g: _guard.Guard, p: _Pending, records: list, values: list[float]) -> NonFiniteError:
    if p.params is not None:
        return _param_error(p)
    kind = _sink_kind(p, values)
    lines = [f"ampguard: {kind.upper() if kind == 'nan' else kind} reached the {p.sink}."]
    op = module = origin = None
    chain: list[str] = []
    if p.record is not None and values:
        start, transition, path = _report.walk(records, values, p.record)
        rec = records[start]
        op = _report.op_name(rec.func)
        module = _module_path(rec.module)
        origin = _report.stack_summary(rec.frames)
        chain = [_report.op_name(records[i].func) for i in path]
        origin_kind = _report.kind_of(values[start]) or kind
        entered, freed = _outside_inputs(rec)
        if entered is not None:
            # The walk ends at an op one of whose untraced inputs was already bad: do not blame the op.
            lines.append(f"  It entered the traced ops already non-finite: {entered}, an input of {op}"
                         + (f" in module '{module}'" if module else "") + f" at\n    {_report.site(rec)}")
            lines.append("  No traced op produced that input: it is the data, a parameter or buffer, or the output "
                         "of code ampguard does not trace (a torch.compile'd function, a custom autograd Function, "
                         "a C++ extension).")
            op = module = None
        else:
            lines.append(f"  It was created by {op} (output {origin_kind}, all inputs finite)"
                         + (f" in module '{module}'" if module else "") + f" at\n    {_report.site(rec)}")
            if freed:
                lines.append(f"  ({freed} input(s) of it that no traced op produced were freed before the check and "
                             "could not be examined.)")
        alive = rec.ref()
        lines.append(f"  value: {_report.describe_tensor(alive)}" if alive is not None else
                     f"  value: shape {tuple(rec.shape)}, {rec.dtype} (freed before the check: no element counts)")
        if transition is not None and transition != start:
            t_rec = records[transition]
            t_kind = _report.kind_of(values[transition])
            lines.append(f"  It became {t_kind} in {_report.op_name(t_rec.func)} at\n    {_report.site(t_rec)}")
        lines.append(f"  path to the sink: {' -> '.join(chain)}")
        if origin:
            lines.append("  user stack at the origin (innermost last):")
            lines.extend("    " + line.rstrip("\n") for line in origin.format())
    else:
        reason = "tracing is off" if g.options.trace == "off" else "the value was not produced by a recorded op"
        lines.append(f"  No origin is known ({reason}); run with trace='eager' (AMPGUARD_TRACE=eager) to stop at "
                     "the op that creates it.")
    tensor = p.tensor() if isinstance(p.tensor, weakref.ref) else p.tensor
    lines.append(f"  {p.sink}: {_report.describe_tensor(tensor)}")
    lines.append("  Common causes under AMP: log/div of 0 or of a value that saturated in fp16; an activation above "
                 "65504 in fp16; a collapsing loss scale; Adam's eps rounding to 0 in fp16.")
    return NonFiniteError("\n".join(lines), kind=kind, sink=p.sink, op=op, module=module, origin=origin, chain=chain)


def _param_error(p: _Pending) -> NonFiniteError:
    import torch

    names = _param_names(p.params)
    is_grad = p.sink.startswith("gradients")
    bad = None
    for param in p.params:
        t = param.grad if is_grad else param
        if t is not None and not bool(torch.isfinite(t).all()):
            bad = (names[id(param)], t)
            break
    name, tensor = bad if bad else ("?", None)
    sink = f"gradient of parameter '{name}'" if is_grad else f"parameter '{name}'"
    kind = _report.kind_of(float(_status(tensor))) or "nan" if tensor is not None else "nan"
    when = "before the optimizer step (the step was not taken, the parameters are unchanged)" if is_grad else \
        "after the optimizer step"
    lines = [f"ampguard: {kind} in the {sink} {when}.", f"  {sink}: {_report.describe_tensor(tensor)}"]
    optimizer = p.optimizer() if p.optimizer is not None else None
    hint = eps_message(optimizer) if optimizer is not None and not is_grad else ""
    if hint:
        lines.append("  " + hint[0].upper() + hint[1:])
    elif is_grad:
        lines.append("  The backward pass produced it; the loss was finite. Look for ops with unbounded gradients "
                     "(sqrt or pow at 0, log near 0, division by a small value).")
    return NonFiniteError("\n".join(lines), kind=kind, sink=sink)


# -- the patch targets -------------------------------------------------------------------
_COMPILED_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def _switch_hooks() -> Any:
    global _torch
    import torch
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    _torch = torch
    handles: list = []
    try:
        handles.append(nn_module.register_module_forward_pre_hook(_forward_pre))
        handles.append(nn_module.register_module_forward_hook(_forward_post, always_call=True))
        handles.append(optim_module.register_optimizer_step_pre_hook(_optimizer_pre_step))
        handles.append(optim_module.register_optimizer_step_post_hook(_optimizer_post_step))
    except BaseException:
        for h in handles:
            h.remove()
        raise

    # torch warns at every call of a compiled module while any global module hook exists, that the
    # hooks fire once more for the OptimizedModule: that call is the one ampguard records the
    # compiled region at, so the warning is about ampguard and says nothing to the user.
    warnings.filterwarnings("ignore", message=_COMPILED_HOOKS_WARNING, category=UserWarning)
    ignore = warnings.filters[0]

    def off() -> None:
        for h in handles:
            h.remove()
        _pop_mode()
        T.__init__()
        with contextlib.suppress(ValueError):  # a catch_warnings block may have dropped it already
            warnings.filters.remove(ignore)
            warnings._filters_mutated()

    return off


REGISTRY.add_switch(Switch("torch", FEATURE, _switch_hooks,
                           "module and optimizer hooks: scope the tracer, check the sinks"))
REGISTRY.add(Target("torch", "torch.autograd", "backward", _backward, "the loss sink; stop tracing at backward"))
REGISTRY.add(Target("torch", "torch.amp.grad_scaler:GradScaler", "scale", _scaler_scale, "the loss sink under AMP"))
