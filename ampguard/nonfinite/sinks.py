"""The normal path: sinks, and the little a replay needs if one fails.

Nothing here looks inside the model, and nothing here keeps a tensor alive. Per outermost module
call it keeps O(1) Python state (a :class:`Call`: the module, weak references to its inputs, the
RNG state, autocast and grad mode), and between the model's output and ``backward()`` it records
the loss code's top-level torch calls (a :class:`TapeOp` each, weak references, no on-device
work), so that the criterion stays attributable. A tensor argument that an earlier call of the
window made is recorded as "output k of event i" (a :class:`Ref`), which the replay re-creates.

Sinks (where a NaN/Inf is an error), each an on-device status riding the shared read of
``_sync`` (GradScaler's read under AMP, otherwise one read at the optimizer step):

1. the loss given to ``GradScaler.scale()`` or ``torch.autograd.backward``; NaN or +-Inf. A scalar loss
   on the CPU is read at once (a CPU read is no device sync); only a non-finite one waits for the read;
2. the outputs of an outermost call that no loss covers (inference, evaluation, forwards
   without backward); NaN only (log-probabilities may be -inf). Under no_grad the status is taken
   when the output is made; with grad, at the read, if the user still holds the output;
3. gradients at an optimizer step not driven by a GradScaler, before the step: the total norm
   ``clip_grad_norm_`` returned when the loop clipped, else one foreach 2-norm over them (on the
   CPU, a sum of each, or of a buffer of small ones).

A status is a 2-norm: one bandwidth pass, NaN exactly when an element is NaN (squares are never
NaN), +Inf when an element is infinite *or* the sum of squares overflowed. A status read at once
on the CPU (a gradient's, an inference output's) is a sum instead, which costs less in place (see
:func:`sum_status`); a sum of finite values that overflows is +-Inf or NaN, and so is one of +Inf
and -Inf. An Inf status, and a gradient's NaN one, is re-checked exactly (``isfinite``) before
anything is reported, so large finite values never raise; an output's NaN sum is checked for a NaN
element at once. A scalar (a loss, a clip's total norm) is its own status, with no kernel at all.

Parameters are not checked after a step: a parameter a step made non-finite reaches the next
call's loss or output, which is read before another step is applied, and the replay names it.

A check is read at a step, and at the latest at the next outermost call of any module after a
``backward()``, or of the same module where that call starts a new batch (see :func:`_new_batch`), at
``guard()`` exit, at ``uninstall()`` and, under ``AMPGUARD=1``, at interpreter exit. A check queued
before a ``backward()`` or a closure that raised is dropped: the user's exception wins. A check belongs
to its guard.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .. import _guard, _sync, schedulers
from .._errors import AmpGuardError, AmpGuardWarning, NonFiniteError
from .._fallback import fail_safe, fall_back, internal_failure
from .._frames import first_user, first_user_past, from_caller, warn_at_user
from .._guard import DEPTH, ObjectState, PerThread
from .._patching import clip_arguments
from . import outermost

FEATURE = "nonfinite"
# What this feature keeps per Guard, read as g.states[KEY]:
ROOTS = _guard.declare_state("nonfinite_roots", dict)  # id -> weakref of each module seen called outermost: names
# what this guard has said once: each output class it cannot read, and _CLIP_OVERFLOW
SAID_ONCE = _guard.declare_state("nonfinite_said_once", set)
SKIPS_IN_ROW = _guard.declare_state("nonfinite_skips_in_row", lambda: [0])  # skip mode's steps skipped in a row
BUFFER_STASHES = _guard.declare_state("nonfinite_stash", lambda: ObjectState(lambda _: []))  # skip mode: per module

log = logging.getLogger("ampguard")
RELEASED = -2  # Ref.event of data released at a micro-batch boundary (see _next_micro_batch)
UNSEEN = -3  # Ref.event of a tensor with autograd history that the window did not make (see _weak_one)
MAX_WINDOW = 4096  # calls and loss-code ops kept between two reads; past that the tape stops
REPEATS = 64  # train-mode calls of one module with grad and no backward() that the window keeps (see _new_batch)

_torch: Any = None  # bound when the hooks switch on; every path below runs after that
_Tensor: Any = None
_failure: Any = None  # the failure path (ampguard.nonfinite.failure), bound by the package: no lazy import
_is_compiling: Any = None
_transformed: Any = None  # whether a torch.func transform (vmap, grad, jacrev) is running: its tensors are wrapped
_tracing: Any = None  # torch.jit.trace's state while it traces (None otherwise)
_graph_task_id: Any = None
_any_autocast: Any = None
_PY_FUNCTION = type(lambda: None)  # a torch function written in Python (F.cross_entropy): its own frames warn
_SKIP_NAMES = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "item", "tolist", "__repr__", "__format__", "__bool__",
    "__len__", "backward", "register_hook", "data_ptr", "stride", "is_floating_point",
    "element_size", "is_contiguous", "storage_offset", "__hash__", "__eq__", "numpy",
})
# (requires_grad_ is recorded: a tensor made in the loss code and differentiated there, x.requires_grad_() before a
# physics-informed loss's torch.autograd.grad(u, x), needs it in the replay too. So is detach(), and .data below: what
# they return has no history, and an argument without history that no record made is kept as data until the read. A
# metric taken of logits.detach() kept the logits alive through backward, some 400 MB on a 50k vocabulary.)
# The tensor properties (read through "__get__", as .shape and .grad are) that compute a tensor from the one they are
# read on, as an op does: CLIP's loss is cross_entropy(logits.T, target). The loss code's record keeps them, so that
# the replay re-creates what they return (the user keeps no reference to a `logits.T`: unrecorded, it is freed
# before the check and the loss cannot be replayed).
_VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})
# Ops that hand out memory without writing it (FSDP's all-gather buffers, a preallocated output): whatever bits it
# held, NaN among them, were made by no op. Neither trace='eager' nor a replay judges what they return.
UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted",
                           "resize_", "resize_as_"})
# In-place ops whose result does not depend on what their first argument held: what they write over (a slice of a
# buffer that `buffer[:, i] = x` fills, perhaps of torch.empty's bits) is not where a value they leave came from.
OVERWRITE = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                       "geometric_", "cauchy_", "log_normal_", "set_"})
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
_SYS = vars(sys)  # the sys module's namespace (where a REPL puts last_value), looked up once
_autocast_devices: tuple = ()  # those this torch build knows, found once when the hooks switch on


class Ref:
    """A tensor argument of a recorded call, held weakly: output ``key`` of window event ``event``
    (``event`` >= 0) when the window made it, so that the replay uses the replayed value; else the
    tensor itself, while the user still holds it."""

    __slots__ = ("event", "key", "ref")

    def __init__(self, ref: Any, event: int, key: Any) -> None:
        self.ref, self.event, self.key = ref, event, key


class Call:
    """One outermost module call, as a replay needs it."""

    __slots__ = ("_module", "args", "autocast", "grad", "index", "inference", "kwargs", "method", "outputs", "rng",
                 "site", "steps", "swapped")

    def __init__(self, module: Any, args: Any, kwargs: Any, entry: tuple, outputs: list) -> None:
        self._module = module  # or a _ModuleRef
        self.args = args  # weak: see weak()
        self.kwargs = kwargs
        self.rng, self.autocast, self.grad, self.inference, self.site, self.steps, self.method, self.swapped = entry
        self.outputs = outputs  # [(weakref, position)] of the floating output tensors
        self.index = -1  # its place in the window

    @property
    def module(self) -> Any:
        """The module called, or None once the user has dropped it (a call held weakly)."""
        module = self._module
        return module() if type(module) is _ModuleRef else module

    @property
    def module_name(self) -> str:
        """The name of the called module's class, also once the module is gone (for messages)."""
        module = self._module
        return module.name if type(module) is _ModuleRef else type(module).__name__


class _ModuleRef(weakref.ref):
    """How a call without grad (evaluation, inference) holds its module: weakly, as it holds its inputs. No step
    reads its window, which stays until the next read, and a script that evaluates a model, drops it and loads the
    next one had both in memory at once. A replay that needs a dropped module says so. It keeps the name of the
    module's class, not the class: a class holds its module's globals through its methods, and a script that runpy
    or exec runs once per trial has its model in them."""

    __slots__ = ("name",)

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        self.name = type(module).__name__


class TapeOp:
    """One top-level torch call of the loss code, between the model's output and backward()."""

    __slots__ = ("args", "autocast", "frames", "func", "grad", "index", "kwargs", "outputs")

    def __init__(self, func: Any, args: Any, kwargs: Any, outputs: list, frames: tuple, autocast: Any,
                 grad: bool, index: int) -> None:
        self.func = func
        self.args = args  # weak: see weak()
        self.kwargs = kwargs
        self.outputs = outputs  # [(weakref, position)]
        self.frames = frames
        self.autocast = autocast
        self.grad = grad
        self.index = index  # its place in the window


class Pending:
    """A sink waiting for the next shared read."""

    __slots__ = ("_sink", "call", "guard", "key", "nan_only", "optimizer", "params", "parts", "ref", "status",
                 "tensor")

    def __init__(self, guard: Any, sink: Any, nan_only: bool, parts: list, tensor: Any = None, call: Any = None,
                 params: list | None = None, optimizer: Any = None, key: Any = None, status: Any = None,
                 ref: Any = None) -> None:
        self.guard = guard
        self._sink = sink  # a string, a callable that makes it, or None for an output (only a failure needs the words)
        self.nan_only = nan_only
        self.parts = parts  # tensors (or weakrefs to them) whose 2-norms the read takes, in one kernel
        self.status = status  # a status taken when the tensor was made (outputs under no_grad)
        self.tensor = tensor  # the sink tensor or a weakref to it, for the error message (clip_grad_norm_'s total)
        self.call = call  # the Call whose output this is
        self.key = key  # which output of the call (a position or a dict key)
        self.params = params  # gradient sinks: the parameters checked
        self.optimizer = optimizer  # a weakref to the optimizer
        self.ref = ref  # a loss: the Ref through which the replay finds it

    def alive(self) -> list:
        """The parts, with each weakly held one resolved (None where the user dropped it)."""
        return [part if isinstance(part, _Tensor) else part() for part in self.parts]

    @property
    def sink(self) -> str:
        if self._sink is None:  # an output's
            self._sink = output_words(self.call, self.key)
        elif not isinstance(self._sink, str):
            self._sink = self._sink()
        return self._sink


class Found(Pending):
    """A NaN that trace='eager' found at the op that made it, in a run whose ranks read together: its ``error`` is
    raised by the read every rank makes (the step's), as a sink's would be, not by this rank alone as the op runs,
    which would leave the others waiting in their next collective (the backward's all-reduce)."""

    __slots__ = ("error",)

    def __init__(self, guard: Any, error: Any, tensor: Any, event: int) -> None:
        ref = weakref.ref(tensor)
        super().__init__(guard, error.sink, True, [], tensor=ref, status=math.nan, ref=Ref(ref, event, 0))
        self.error = error


class _Thread:
    """One thread's state, a plain object: each hook takes it once (``t = _here.state``), since the normal
    path reads some hundred of these attributes a step (see _guard.PerThread)."""

    def __init__(self) -> None:
        self.entry: tuple | None = None  # what the open outermost call captured on entry
        self.pending: list[Pending] = []
        self.reading: list[tuple[Pending, list[int]]] = []  # the pendings the read in progress took
        self.window: list = []  # Calls and TapeOps since the last read, in order
        self.produced: dict[int, Ref] = {}  # id(tensor) -> the Ref of a window output
        self.calls: dict[int, int] = {}  # id(module) -> its outermost calls in the window
        self.passing = False  # a DDP forward that hands its outputs back through _DDPSink ran since backward()
        # (grad_fn's sequence number, output_nr) of such outputs -> their Ref. Not id(grad_fn): a node's Python
        # object may die and be made anew at the next access (torch 2.11 does), so its id is no identity.
        self.through: dict[tuple[int, int], Ref] = {}
        self.stepping = False  # the window holds a train-mode call with grad: a step is under way (_new_batch)
        self.losses: list = []  # Refs of the losses given to backward since the last read
        self.scaled: dict[int, tuple] = {}  # id(scaled loss) -> (weakref, scaler): its backward is its loss's sink
        # (the GradScaler, keys of the gradients' nodes): this window's loss code took gradients of a value that
        # scaler scaled, with create_graph (a gradient penalty); its losses may carry the scale (failure.scale_overflow)
        self.penalty: tuple | None = None
        self.backward_since_read = False
        self.released = 0  # window events before this one hold their data weakly (a step's earlier micro-batches)
        self.late = False  # the read in progress is at a module call, not at a step (a failure says so)
        self.backwards = 0  # backward() calls in this thread: a clip before the latest one is stale
        self.clip: tuple | None = None  # (total norm, ids of the clipped parameters, backwards at the clip)
        self.tape: Any = None  # the loss-code recorder, while it is on torch's mode stack
        self.taping = False  # record into the window (off while paused or full)
        self.resume_tape = False  # a call under no_grad (a teacher) paused the loss code's record
        self.last_shown = id(None)  # id of the exception an interactive shell showed last (sys.last_value)
        self.fetching = 0  # >0 while a DataLoader without workers fetches a batch here (_dataset_fetch)
        self.transformed = False  # a module was called under a torch.func transform since the last read (unseen)
        self.measuring = 0  # >0 while a torchmetrics metric's forward runs here (_metric_forward)
        self.steps = 0  # optimizer steps taken in this thread, to tell a replay that parameters moved
        self.stepped: ObjectState[bool] = ObjectState(lambda _: True)  # the optimizers that stepped here
        self.replaying = 0  # >0 while a replay runs: the normal path stands aside
        self.replay_root: Any = None  # the module call a replay re-runs now, for names
        self.eager = False  # trace='eager': every recorded op is checked as it runs
        self.eager_stack: list = []  # modules open during an eager-mode forward, for names
        # nonfinite='skip'
        self.poisoned = False  # a loss or gradient sink failed since the last step: skip the next one
        self.cleared = False  # skip mode: the failed sink's gradients were cleared by the loop (_gradients_cleared)
        self.elsewhere = False  # ... on another rank only (the all-reduced flag)
        self.agree: Any = None  # torch.distributed while a step's read carries the all-reduced flag (last value)
        self.hidden: list = []  # (optimizer, [(param, grad)]): a skipped step runs without its gradients
        self.snapshots: dict[int, tuple] = {}  # id(root) -> (root, buffers, copies) before this step's forward
        self.last_error: Any = None  # the latest non-finite error, for the consecutive-skip error
        self.repro_origin: Any = None  # what the failure path found, for a reproducer bundle (repro.Origin)
        self.raised: Raised | None = None  # the latest outermost call that raised, until the next one (see Raised)


_here = PerThread(_Thread)


class _ThisThread:
    """``T.x`` reads and writes this thread's state: for the failure path, the replay and tests. The
    normal path takes the state itself once instead (``_here.state``)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(_here.state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(_here.state, name, value)


T: Any = _ThisThread()


def stored(tensor: Any) -> Any:
    """What ``tensor`` stores here, as a strided real tensor with the same non-finite elements: a DTensor's local
    shard; a sparse tensor's values (the gradient of an ``Embedding(sparse=True)``), whose implicit zeros are
    finite; a complex tensor's real and imaginary parts. torch's norms take none of them as they are."""
    torch = _torch
    if type(tensor) is not _Tensor and type(tensor).__name__ == "DTensor":
        # FSDP2's sharded parameters and gradients: this rank's shard. Reading the whole would be a collective,
        # which one rank alone (a failure path) must never start: the others would wait for it forever.
        tensor = tensor.to_local()
    if tensor.is_nested:  # (a nested tensor's buffer, both layouts: a view; torch's norms take no nested tensor)
        return stored(tensor.values())
    layout = tensor.layout
    if layout is not torch.strided:
        if layout is torch._mkldnn:  # (a oneDNN tensor, of a model converted for CPU inference: a dense copy)
            return stored(tensor.to_dense())
        tensor = tensor._values() if layout is torch.sparse_coo else tensor.values()  # (CSR, CSC, BSR, BSC)
    if tensor.is_complex():
        return torch.view_as_real(tensor.conj() if tensor.is_conj() else tensor)  # (a view: no copy)
    if tensor.dtype in _FLOAT8:
        return tensor.to(torch.bfloat16)  # (a copy: bfloat16 holds every float8 value, NaN and Inf included)
    return tensor


def float8_dtypes(torch: Any) -> frozenset:
    """The float8 dtypes of this torch build: its norms and isfinite take none of them (an fp8 KV cache, a quantized
    activation)."""
    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    return frozenset(getattr(torch, name) for name in names if hasattr(torch, name))


_FLOAT8: frozenset = frozenset()  # bound with _torch


def shape_of(tensor: Any) -> tuple:
    """``tensor``'s shape for a message. A nested tensor of the strided layout has none (its ``shape`` raises): the
    number of its tensors, then ``"ragged"``; the jagged layout's shape names its ragged dimension (``j1``)."""
    if tensor.is_nested and tensor.layout is _torch.strided:
        return (tensor.size(0), "ragged")
    return tuple(tensor.shape)


def norm(tensor: Any) -> Any:
    """The 2-norm status of one tensor, in float32 (float64 for float64): one bandwidth pass. (No detach() of a tensor
    without grad, and no dtype argument where the tensor has the status's dtype: on a small inference output, read
    at every call, the two made the status and its read take 17 us in place here instead of 12.)"""
    t = stored(tensor.detach() if tensor.requires_grad else tensor)
    torch = _torch
    dtype = t.dtype
    if dtype is torch.float32 or dtype is torch.float64:
        return torch.linalg.vector_norm(t, 2)
    return torch.linalg.vector_norm(t, 2, dtype=torch.float32)


def _norms(tensors: list) -> list:
    """The 2-norm of each of ``tensors`` in one foreach kernel (float64 if any is float64)."""
    torch = _torch
    wide = torch.float32
    for t in tensors:
        if t.dtype == torch.float64:
            wide = torch.float64
            break
    # Grad mode off: one switch, not a detach() per tensor (hundreds of them on a large model). Switched
    # directly: `with torch.no_grad()` is some ten Python calls, at every step without a GradScaler.
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=wide))
    finally:
        torch._C._set_grad_enabled(enabled)


# On the CPU torch's foreach norm runs one kernel per tensor, some 3 us each however small the tensor (biases and
# norm layers' weights are often half of a model's tensors). Copied into one buffer, the small ones of a dtype cost
# one reduction: about 1 us a tensor. Past SMALL elements the copy costs more than the kernel it saves; a buffer holds
# at most CHUNK elements (4 MB of float32), freed at once. Below FEW tensors the copy's op costs more than it saves (a
# step's first ops run cold): measured on whole steps, 16 small tensors cost the same either way, 32 and 100 less
# buffered.
SMALL = 4096
CHUNK = 1 << 20
FEW = 16


def sum_status(tensor: Any) -> Any:
    """A status read at once on the CPU (a gradient's, a buffer of them's, an inference output's): the tensor's sum,
    in float32 (float64 for float64). In place a sum kernel is warm on the CPU (the loss code's mean or sum, or a
    forward's, ran it) and a norm runs cold: a Lightning step's statuses of its two small gradients, with their
    reads, took 56 us against 74 us as 2-norms, and the end of an RL policy's inference call 56 us against 63 us
    (benchmarks/in_place.py). A sum is NaN or +-Inf when an element is, and finite values whose sum overflows make
    it +-Inf or NaN too (+Inf and -Inf elements: NaN): a gradient sink's non-finite status is re-checked exactly
    (see :func:`_failed`), an output's NaN one at once (see :func:`exit`)."""
    if tensor.requires_grad:  # (a gradient made with create_graph=True has history; its status needs none)
        tensor = tensor.detach()
    dtype = tensor.dtype
    if dtype is _torch.float32 or dtype is _torch.float64:
        return tensor.sum()
    return tensor.sum(dtype=_torch.float32)  # (an fp16 sum overflows at 65504: each such step a re-check)


# A CPU tensor of at most FEW_ELEMENTS elements is read as Python floats (tolist()), its status their sum: no torch op
# at all. An RL policy's logits and its value head's output, read at every call, and a small network's gradients are
# such tensors. In place each torch op costs 5-15 us cold, and a sum with its item() read cost some 16 us more per
# call than tolist() (benchmarks/in_place.py); in a tight loop tolist() is the cheaper up to some 120 elements.
FEW_ELEMENTS = 64
_READ_AS_FLOATS: frozenset = frozenset()  # the real floating dtypes (bound with _torch)


def few_values_sum(tensor: Any) -> float | None:
    """The sum of a small plain CPU tensor's elements, read as Python floats (see FEW_ELEMENTS), or None where the
    tensor is not one: larger, over 2-D, not of a real floating dtype, not strided, or nested. Summed in double,
    the finite values of every such dtype but float64 never overflow; like a sum op's, it is NaN or +-Inf where an
    element is, and NaN for +Inf and -Inf elements together."""
    dim = tensor.dim()
    if dim > 2 or tensor.numel() > FEW_ELEMENTS or tensor.dtype not in _READ_AS_FLOATS or \
            tensor.layout is not _torch.strided or tensor.is_nested:
        return None
    values = tensor.tolist()
    return values if dim == 0 else sum(values, 0.0) if dim == 1 else sum(map(sum, values), 0.0)


def _gradient_statuses(grads: list) -> tuple[list, list]:
    """The statuses of ``grads``' plain CPU tensors (see :func:`sum_status`; a Python float for a tensor of a few
    values, see FEW_ELEMENTS), the small ones of the first one's dtype a buffer of them at a time (see SMALL) where
    there are many, and the tensors left for the foreach norm: every one on a device,
    where the foreach norm is one kernel for all, and where tests take the device path on a CPU
    (_sync.HOST_READS). Only plain tensors are summed here: a DTensor's sum or cat would be a collective. One
    scalar (the clip's total norm, or one scalar parameter's gradient) is its own status, wherever it is: no pass."""
    one = grads[0]
    if len(grads) == 1 and not one.dim():
        return [one.detach() if one.requires_grad else one], []
    if not _sync.HOST_READS:
        return [], grads
    tensor, dtype = _Tensor, one.dtype
    bufferable = len(grads) >= FEW
    statuses, rest, buffers, chunk, size = [], [], [], [], 0
    for g in grads:
        n = g.numel()
        if type(g) is not tensor or not g.is_cpu:
            rest.append(g)
        elif bufferable and n <= SMALL and g.dtype is dtype:
            chunk.append(g)
            size += n
            if size >= CHUNK:
                buffers.append(chunk)
                chunk, size = [], 0
        else:
            value = few_values_sum(g) if n <= FEW_ELEMENTS else None
            # (float8 too: its float32 sum is the one reduction torch takes of it)
            statuses.append(value if value is not None else sum_status(g))
    if not chunk and not buffers:
        return statuses, rest  # (a small model's step: no buffer to make)
    if len(chunk) >= FEW:
        buffers.append(chunk)
    else:
        statuses.extend(sum_status(g) for g in chunk)
    flatten = _torch._C._nn.flatten_dense_tensors
    statuses.extend(sum_status(flatten(b)) for b in buffers)  # (each copy is freed once its status is taken)
    return statuses, rest


def finite(tensor: Any) -> bool:
    """The exact answer, for the failure path only (reads the device)."""
    with _torch._C.DisableTorchFunction():
        return bool(_torch.isfinite(stored(tensor.detach())).all())


# tensor subclass -> (None,) if a sink can take its status, else (why not,). Held weakly, as _kinds is.
_readable: _guard.ObjectState[tuple] = _guard.ObjectState(lambda cls: (None,))


def unreadable(tensor: Any) -> str | None:
    """Why a sink cannot take the status of ``tensor``, or None if it can. A plain tensor always can (:func:`stored`
    takes each layout). A tensor subclass can if torch's norm takes it, tried once per class: a ``MaskedTensor``
    answers NotImplemented. An output that cannot be read is not a sink, with one warning per class; before, it
    switched the non-finite checks off for the whole run."""
    cls = type(tensor)
    if cls is _Tensor:
        return None
    known = _readable.get(cls)
    if known is None:
        try:
            with _torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the class's own "not implemented" warning: ampguard's probe)
                norm(tensor)
            known = _readable.set(cls, (None,))
        except Exception as exc:
            known = _readable.set(cls, (f"{type(exc).__name__}: {str(exc).strip().splitlines()[0].rstrip(':')}",))
    return known[0]


def watched(g: _guard.Guard, tensor: Any) -> bool:
    """A tensor a sink reads: on a watched device, and one that holds data (see :func:`no_data`)."""
    devices = g.options.devices
    return (devices is None or tensor.device.type in devices) and \
        not (tensor.is_meta or (type(tensor) is not _Tensor and no_data(tensor)))  # (no call for a plain tensor)


def no_data(tensor: Any) -> bool:
    """A tensor with a shape and no data: on the meta device (a shape probe) or a FakeTensor (torch's
    FakeTensorMode, which memory estimators run a whole step under). It is never a sink: nothing can be read."""
    if tensor.is_meta:
        return True
    if type(tensor) is _Tensor:
        return False
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(tensor, fake.FakeTensor)


def floating_tensor(t: Any) -> bool:
    """A non-empty floating (or complex) tensor: what a sink, a record or a replay judges."""
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0


_DEPTH = 4  # levels of containers walked for the tensors a call made (an LSTM's (output, (h, c)) has two)


def output_leaves(value: Any) -> list:
    """(tensor, key, sink) for every floating tensor of an output, to _DEPTH levels: what the call made, so that
    code using one later (an LSTM's state, a field of a nested output) is known to use the call's output, and a
    replay hands it the replayed one. Key: 0 for a tensor; the index, dict key or dataclass field name of an item;
    a path tuple below. ``sink``: the tensors that are the output's sinks: the output itself, its items (a
    tuple/list's, a dict's values, a dataclass's fields), and the fields of a named tuple among those (an LSTM's
    PackedSequence, whose ``data`` is the output). Deeper ones are not: a KV cache of tuples in tuples would cost a
    pass over it at every decoding step."""
    if isinstance(value, _Tensor):
        return [(value, 0, True)] if floating_tensor(value) else []
    out: list = []
    _leaves_into(out, value, (), _DEPTH, True)
    return out


def made_within(value: Any) -> list:
    """(tensor, key) for every floating tensor of an output (see :func:`output_leaves`)."""
    return [(t, k) for t, k, _ in output_leaves(value)]


def _leaves_into(out: list, value: Any, path: tuple, depth: int, sinks: bool) -> None:
    items = _items(value)
    if items is None:
        return
    for k, v in items:
        key = (*path, k) if path else k
        if isinstance(v, _Tensor):
            if floating_tensor(v):
                out.append((v, key, sinks))
        elif depth > 1:  # (below the top, only a named tuple's fields are sinks)
            named = isinstance(v, tuple) and hasattr(type(v), "_fields")
            _leaves_into(out, v, (*path, k), depth - 1, sinks and not path and named)


def _items(value: Any) -> Any:
    """(key, item) of a container a module returns: a tuple or list, a dict (Hugging Face's ModelOutput is one),
    a dataclass instance (a model's own output class); None for anything else."""
    if isinstance(value, (tuple, list)):
        return enumerate(value)
    if isinstance(value, dict):
        return value.items()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]
    return None


def weak(value: Any, data: bool) -> Any:
    """``value`` with the tensors in its tuples, lists and dicts replaced by :class:`Ref` s.

    With ``data``, a tensor without autograd history that the window did not make (a batch, a
    target, a mask) is kept as it is, until the read: a replay needs it, its size is the batch's,
    and autograd usually holds it through backward anyway. Every other tensor is held weakly. A dict of numbers,
    strings and None only (most keyword arguments: ``reduction="mean"``) is held as it is, as any other object
    without a tensor is: no copy, no call per value.
    """
    kind = type(value)
    if kind is tuple or kind is list:
        if not value:
            return value
        produced = _here.state.produced
        out = []
        for v in value:  # (a loop, not a comprehension: this runs for every recorded call; no call for a number)
            out.append(v if type(v) in _ATOMS else _weak_one(v, data, produced))
        return tuple(out) if kind is tuple else out
    if kind is dict:
        for item in value.values():
            if type(item) not in _ATOMS:
                produced = _here.state.produced
                return {k: _weak_one(v, data, produced) for k, v in value.items()}
        return value
    return _weak_one(value, data, _here.state.produced)


_ATOMS = frozenset({type(None), bool, int, float, str})


def _weak_one(value: Any, data: bool, produced: dict) -> Any:
    if type(value) in _ATOMS:
        return value
    if isinstance(value, _Tensor):
        made = produced.get(id(value))
        if made is not None and made.ref() is value:
            return made  # the window made it: the same Ref for every use (Refs are never changed)
        if data and value.grad_fn is None and not value.requires_grad:
            return value
        node = value.grad_fn
        if node is None:
            return Ref(weakref.ref(value), -1, None)
        # made from tensors with grad by code that no record saw: a TorchScript method, a C++ extension's function,
        # code that ran before the step's first model call (see replay._map)
        return _passed_through(value, node, produced) or Ref(weakref.ref(value), UNSEEN, None)
    kind = type(value)
    if kind is tuple or kind is list or kind is dict:
        return weak(value, data)
    if isinstance(value, tuple) and hasattr(kind, "_fields"):  # a named tuple (a PackedSequence): held as its items
        return _remade(value, [_weak_one(v, data, produced) for v in value])
    return value


def _remade(named: tuple, items: list) -> tuple:
    """``named`` (a named tuple) with ``items`` in its fields, made as namedtuple's ``_make`` makes one (no
    ``__new__`` of the class's own runs on Refs); ``named`` itself where its class does not allow that."""
    try:
        return type(named)._make(items)
    except Exception:
        return named


def _passed_through(value: Any, node: Any, produced: dict) -> Ref | None:
    """DDP with ``find_unused_parameters=True`` hands its module's outputs back through an identity autograd
    Function (``_DDPSink``): such a tensor is known as the window output it passed (whose tensor DDP drops; its
    autograd node, which the new tensor's node keeps, identifies it), so that the replay uses that output's
    replayed value. Only tensors with history (``node``: their grad_fn) that the window did not make get here."""
    if type(node).__name__ != "_DDPSinkBackward":
        return None
    inner, nr = node.next_functions[value.output_nr]
    made = _here.state.through.get((_node_key(inner), nr)) if inner is not None else None
    return _known_as(produced, value, made) if made is not None else None


def _node_key(node: Any) -> int:
    """An autograd node's identity while its graph lives: its sequence number (per thread, as the window is).
    id() is none: the node's Python object may be dropped and made anew at the next access (torch 2.11)."""
    number = getattr(node, "_sequence_nr", None)
    return number() if number is not None else id(node)  # (right only where torch keeps the object alive)


def _known_as(produced: dict, tensor: Any, made: Ref) -> Ref:
    """``tensor`` holds what the window output ``made`` holds (DDP's pass-through, Lightning's loss / 1): from
    now on an argument naming it is that output, which a replay re-creates."""
    ref = produced[id(tensor)] = Ref(weakref.ref(tensor), made.event, made.key)
    return ref


# -- module kinds ----------------------------------------------------------------------------
_WRAPPERS = (("torch.nn.parallel.distributed", "DistributedDataParallel"),
             ("torch.nn.parallel.data_parallel", "DataParallel"),
             ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
             ("lightning.pytorch.overrides.base", "_LightningModuleWrapperBase"),
             ("pytorch_lightning.overrides.base", "_LightningModuleWrapperBase"),
             ("lightning.fabric.wrappers", "_FabricModule"),  # (its forward casts, autocasts, and hooks the output)
             ("lightning_fabric.wrappers", "_FabricModule"))
# torchmetrics' metrics are modules that measure, and do not train (see _metric_forward)
_METRICS = (("torchmetrics.metric", "Metric"), ("torchmetrics.collections", "MetricCollection"))
# Each kind and the classes that make it, in the order they are asked: a compiled wrapper is a wrapper
_KINDS = (("wrapper", _WRAPPERS), ("compiled", (("torch._dynamo.eval_frame", "OptimizedModule"),)),
          ("metric", _METRICS), ("graph", (("torch.fx.graph_module", "GraphModule"),)))
# module class -> (its kind,). Held weakly: a class defined by a script that runpy or exec runs once per trial holds,
# through its methods, that run's globals (its model, its data).
_kinds: _guard.ObjectState[tuple] = _guard.ObjectState(lambda cls: (None,))


def kind(module: Any) -> str | None:
    """'wrapper' for DDP/DataParallel/FSDP, Lightning's strategy wrapper and Fabric's module, whose forward is
    plumbing around the user's module; 'compiled' for a torch.compile'd module; 'metric' for a torchmetrics metric
    or collection of them; 'graph' for an fx GraphModule (see :func:`_compiled_graph_call`); None otherwise. Once per
    class, a GraphModule's aside: a class of a module imported later cannot be a subclass of that module's classes."""
    cls = type(module)
    known = _kinds.get(cls)
    if known is not None:
        return known[0]
    result, complete = None, True
    for what, classes in _KINDS:
        # (None: a module another thread is importing, half made: the answer is not kept)
        found = [getattr(sys.modules[m], name, None) for m, name in classes if m in sys.modules]
        complete = complete and None not in found
        if any(c is not None and issubclass(cls, c) for c in found):
            result = what
            break
    if complete and result != "graph":  # (fx makes a class per GraphModule: a compiled run's many would stay here)
        _kinds.set(cls, (result,))
    return result


def _dataset_fetch(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A DataLoader without workers fetches its batch in this process. The module calls of the dataset and the
    collate function (a transform written as a module, as torchvision's v2 transforms are) prepare data, as they
    do in a worker, and are no outermost calls: at one status pass and some 50 us per sample, they made loading
    several times slower, and their calls filled the window that the model's call needs. A NaN they make reaches
    the model's call as its input, which names the data. Nor is the fetch loss code: the record stops here."""
    t = _here.state
    t.fetching += 1
    try:
        if t.taping:
            end_tape(t)
        return wrapped(*args, **kwargs)
    finally:
        t.fetching -= 1


def _in_worker() -> bool:
    worker = sys.modules.get("torch.utils.data._utils.worker")
    return worker is not None and worker._worker_info is not None


# -- capture ---------------------------------------------------------------------------------
def _autocast_state() -> tuple | None:
    """(device, dtype) of each autocast region on: recorded per loss-code op under AMP, so one loop of
    C calls over the devices this build knows (a Python call per device cost twice as much)."""
    if not _any_autocast():
        return None
    torch = _torch
    on = []
    for d in _autocast_devices:
        if torch.is_autocast_enabled(d):
            on.append((d, torch.get_autocast_dtype(d)))
    return tuple(on)


def known_autocast_devices() -> tuple:
    """The device types of _AUTOCAST_DEVICES that this torch build's autocast accepts (a type it does not
    know raises RuntimeError)."""
    known = []
    for d in _AUTOCAST_DEVICES:
        try:
            _torch.is_autocast_enabled(d)
            _torch.get_autocast_dtype(d)
        except RuntimeError:
            continue
        known.append(d)
    return tuple(known)


def _rng_state() -> tuple:
    torch = _torch
    cuda = None
    if torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        cuda = (index, torch.cuda.default_generators[index].get_state())
    return torch.default_generator.get_state(), cuda


def redirected(module: Any) -> str | None:
    """The method a call of ``module`` runs instead of ``forward``, if any. Lightning's strategies (DDP, FSDP,
    DeepSpeed) call ``training_step`` through their wrapper's forward: for that one call they set the module's
    ``forward`` to a function that restores it and runs the method. A replay must run that method."""
    fn = vars(module).get("forward")
    if fn is None:
        return None  # (every other module: one dict lookup)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_name != "wrapped_forward" or "method_name" not in code.co_freevars:
        return None
    name = fn.__closure__[code.co_freevars.index("method_name")].cell_contents
    return name if isinstance(name, str) else None


_FUNCTIONAL_CALL: list = []  # the code object of torch's stateless._functional_call, once looked up


def call_site(module: Any, frame: Any) -> tuple[tuple | None, dict | None]:
    """Where the user called ``module`` (the innermost user frame as (code, instruction offset), looking 8 frames
    up from torch's call; None if none is), and the parameters and buffers a ``torch.func.functional_call`` put in
    the module for this call (MAML's fast weights, an ensemble member's state), held as a call's inputs are (None
    for any other call).

    The replay puts those back in for the call: the module's own parameters would give another value. The
    functional call is found on the frames between torch's call and the user's (three, usually), in the same walk
    (:func:`ampguard._frames.first_user_past`): no cost beyond it."""
    if not _FUNCTIONAL_CALL:
        from torch.nn.utils import stateless

        _FUNCTIONAL_CALL.append(getattr(getattr(stateless, "_functional_call", None), "__code__", None))
    site, functional = first_user_past(frame, 8, _FUNCTIONAL_CALL[0])
    if not functional:
        return site, None
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    return site, weak(state, False)


# -- outermost calls (found by ampguard.nonfinite.outermost) ---------------------------------
def enter(module: Any, frame: Any, method: str | None = None) -> int:
    """Whether this module call is an outermost user call; if it is, capture what a replay needs. (outermost's
    hooks call it, never while dynamo traces: they return at once there.) ``method``: the call runs that method of
    the module, not its forward (Lightning's training_step)."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    t = _here.state
    if t.replaying or _transformed() or _tracing() is not None:
        # inside a replay, or a torch.func transform (an ensemble under vmap, per-sample gradients): its tensors
        # are batched or traced, and a status of them cannot be read outside it. Under torch.jit.trace, what
        # ampguard does with the call's tensors would change the graph (its value names)
        if not t.replaying and _transformed():
            t.transformed = True  # (a failure's message says why no call is known)
        return outermost.NOT_OUTERMOST
    g = _guard.current(FEATURE)
    if g is None or _graph_task_id() != -1 or _in_worker() or t.fetching or t.measuring:
        # a checkpoint's re-run in backward, a DataLoader's fetch (see _in_worker), a module inside a metric
        return outermost.NOT_OUTERMOST
    what = kind(module)
    if what is not None:
        if what == "graph" and _compiled_graph_call(frame):
            return outermost.NOT_OUTERMOST
        if what == "wrapper":
            # DDP/FSDP/Lightning's wrapper, whose module is the outermost user call. DDP that looks for unused
            # parameters hands that call's outputs back through an identity Function (see _passed_through).
            if getattr(module, "find_unused_parameters", False) or getattr(module, "static_graph", False):
                t.passing = True  # until the next backward()
            return outermost.NOT_OUTERMOST
        if what == "metric":
            return outermost.NOT_OUTERMOST  # (see _metric_forward)
    torch = _torch
    grad = torch.is_grad_enabled()
    # A call without grad inside the loss code (a distillation teacher) pauses the record; any other ends it.
    resume = t.taping and not grad
    if t.tape is not None:  # (a call per step saved where no record is on; so at each hook below)
        end_tape(t)
    shown = id(_SYS.get("last_value"))  # not getattr: a missing attribute costs an exception, every call
    if shown != t.last_shown:  # a REPL or notebook showed an exception (a Ctrl-C): that step is abandoned
        t.last_shown = shown
        drop(g)
    if (t.pending or t.window) and (t.backward_since_read or _new_batch(t, module, grad)):
        if t.backward_since_read and grad and module.training and not _new_batch(t, module, grad) and \
                (_on_a_device(t.pending) or _read_by_every_rank(g)) and \
                not _gradients_set_to_none(t.window):
            # gradient accumulation on a device: read at the step, one sync for all. In a distributed run too: there
            # every rank reads together, where one that stopped here alone would leave the others waiting in the
            # backward's all-reduce
            _next_micro_batch(t)
        else:
            t.late = True
            try:
                check()  # the previous call's checks (or its window, if none is left): no step consumed them
            finally:
                t.late = False
    t.resume_tape = resume
    # (a method, training_step, is called by a Trainer's loop: no frame of the user's calls it)
    site, swapped = call_site(module, frame) if method is None else (None, None)
    t.raised = None  # (a call that raised before this one is no longer what an error leaving now came from)
    t.entry = (_rng_state(), _autocast_state(), grad,
               torch.is_inference_mode_enabled(), site, t.steps, method or redirected(module), swapped)
    options = g.options
    if options.nonfinite == "skip" and module.training and grad and id(module) not in t.snapshots:
        _snapshot_buffers(g, module)
    if options.trace == "eager":
        t.eager = True  # (and the loss code that follows is checked as it runs)
        if _runs_compiled(module):
            return outermost.OUTERMOST  # its ops are its graph's (see nested()): a replay runs it eagerly
        t.eager_stack = [module]
        start_tape(g)  # every op of the forward is checked as it runs
        return outermost.OUTERMOST_KEEP_HOOKS
    t.eager = False
    return outermost.OUTERMOST


def _read_by_every_rank(g: _guard.Guard) -> bool:
    """Whether checks are read where every rank reads together (a distributed run, the option on): a rank that
    stopped earlier alone would leave the others waiting in their next collective (the backward's all-reduce)."""
    return g.options.distributed and _sync.distributed()


def _compiled_graph_call(frame: Any) -> bool:
    """torch.compile's runtime running one of its graphs: an fx GraphModule (the aot_eager and eager backends run
    them as modules) called from torch's frames alone. It is not a user's call, and cannot be replayed: its
    inputs are a list that the runtime empties as it goes. A GraphModule the user's code calls is a user call."""
    return first_user(frame, 8) is None  # (the module is a GraphModule: see kind())


def _on_a_device(pending: list) -> bool:
    """Whether checks wait, and each on a device, where reading it now would cost a sync (a CPU status is read
    at once, for free)."""
    if not pending:
        return False
    if not _sync.HOST_READS:
        return True
    return not any(t is not None and t.is_cpu for p in pending for t in p.alive())


def _next_micro_batch(t: _Thread) -> None:
    """A train-mode call with grad after a backward() and before any step: the next micro-batch of a step that
    accumulates gradients. Its checks are not read here (on a device that would be a sync per micro-batch, where
    the step's read is one for all of them). The data the window holds for the micro-batches before (their
    inputs and targets) is held weakly from now on, as every other tensor is: memory stays the user's, and a
    micro-batch that the user still holds at the step (a list of them) can still be replayed."""
    for event in t.window[t.released:]:
        event.args = _weakened(event.args)
        if event.kwargs:
            event.kwargs = _weakened(event.kwargs)
    t.released = len(t.window)
    t.backward_since_read = False  # (this boundary is handled; the next backward() marks the next one)


def _weakened(value: Any) -> Any:
    if isinstance(value, _Tensor):
        return Ref(weakref.ref(value), RELEASED, None)
    kind = type(value)
    if kind is tuple or kind is list:
        out = [_weakened(v) for v in value]
        return tuple(out) if kind is tuple else out
    if kind is dict:
        return {k: _weakened(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return _remade(value, [_weakened(v) for v in value])
    return value  # a Ref, a number, or an object kept as it is until the read (see weak())


def _new_batch(t: _Thread, module: Any, grad: bool) -> bool:
    """Whether this call of a module the window has called already starts a new batch, so that the window is
    read first: in a loop of evaluation or inference forwards, which never reaches a step, it does.

    Before backward(), a train-mode call with grad is one more of the same step's calls: an RNN cell unrolled
    over time, a siamese or triplet network, a GAN's critic on real, fake and interpolated data. So is a call
    without grad while such a call is in the window: a reference model or a teacher, called per input of the
    step. Reading there would cost a device sync per call, and the replay would lose the step's earlier calls
    that its loss depends on. A train-mode loop that never calls backward() is read every REPEATS calls of a
    module, so that the batches the window holds stay few."""
    repeats = t.calls.get(id(module), 0)
    if not repeats:
        return False
    if repeats >= REPEATS:
        return True
    return not (module.training if grad else t.stepping)


def nested(module: Any) -> None:
    """A module call starts inside a trace='eager' call: the modules open name each op's module. A compiled module's
    ops are its graph's (at the graph's lines, in no module of the user's; none at all under inductor): the record
    pauses while it runs. The ops that use its output do not take a NaN there for theirs, and the failure found
    after it (at the loss, or at the outermost call's output) replays the call eagerly, which names the op."""
    t = _here.state
    if t.eager:
        t.eager_stack.append(module)
        if _runs_compiled(module):
            t.taping = False


def nested_end(module: Any) -> None:
    t = _here.state
    stack = t.eager_stack
    if stack and stack[-1] is module and len(stack) > 1:
        stack.pop()
        if t.tape is not None and _runs_compiled(module):
            t.taping = True


def _runs_compiled(module: Any) -> bool:
    return kind(module) == "compiled" or outermost.compiled_in_place(module)


def output_words(call: Call, key: Any) -> str:
    """An output sink's name in messages (made only when a failure needs it)."""
    module = call.module
    if module is None:  # (a call without grad whose module the user dropped before the read)
        name = call.module_name
    else:
        from .torchscript import class_name

        name = class_name(module._orig_mod if kind(module) == "compiled" else module)  # no failing __getattr__
    return f"output of module '{name}'" + (f" (output {key!r})" if len(call.outputs) > 1 else "")


def _made(t: _Thread, outputs: list, index: int) -> list:
    """(weakref, key) of each output; each is known from now on as made by window event ``index``
    (unless that is -1: a full window), so that later arguments naming it become its Ref."""
    refs = []
    produced = t.produced
    for o, k in outputs:
        ref = weakref.ref(o)
        refs.append((ref, k))
        if index >= 0:
            made = produced[id(o)] = Ref(ref, index, k)
            if t.passing and o.grad_fn is not None:  # DDP may hand it back as a new tensor (_passed_through)
                t.through[(_node_key(o.grad_fn), o.output_nr)] = made
    return refs


def exit(module: Any, args: tuple, kwargs: dict, output: Any, raised: bool = False, tape: bool = True) -> None:
    """The end of an outermost call: its outputs are sinks, and (``tape``) the loss code that follows is recorded."""
    __tracebackhide__ = True
    t = _here.state
    if t.eager_stack:
        t.eager_stack = []
    entry, t.entry = t.entry, None
    g = _guard.current(FEATURE)
    if g is None or entry is None:
        return
    if raised:
        # The call made nothing (an out-of-memory error that the loop catches, to retry a smaller batch): it is
        # not in the window, where a replay would run it again and fail on it, and no loss code follows it.
        _keep_raised(g, t, module, args, kwargs, entry)
        if t.eager:
            end_tape(t)
        elif t.resume_tape:
            start_tape(g)  # a teacher's call inside the loss code: the loss code goes on
        return
    skipped = None
    leaves = output_leaves(output)
    if type(output) is _Tensor:
        # One plain tensor, the usual output: its one leaf is a sink, and no subclass is there to judge. (With autograd
        # history, the call made it: _made_here keeps it without a look at the arguments.)
        outputs = [(output, 0)] if leaves and watched(g, output) else []
        if outputs and output.grad_fn is None and (args or kwargs):
            outputs = _made_here(outputs, args, kwargs)
    else:
        outputs = [(o, k) for o, k, sink in leaves if sink and watched(g, o)]
        if outputs and (args or kwargs):
            outputs = _made_here(outputs, args, kwargs)
        for o, _ in outputs:
            if type(o) is not _Tensor and unreadable(o) is not None:  # (a subclass whose norm torch does not take)
                skipped = [x for x in outputs if unreadable(x[0]) is not None]
                outputs = [x for x in outputs if unreadable(x[0]) is None]
                break
    training = entry[2] and not entry[3]
    window = t.window
    index = len(window) if len(window) < MAX_WINDOW else -1  # -1: the window is full, the call is not in it
    # Under no_grad nothing reads the inputs again and the next batch may already be made: hold none.
    call = Call(module if training else _ModuleRef(module), weak(args, training),
                weak(kwargs, training) if kwargs else kwargs, entry, _made(t, outputs, index))
    if index >= 0:
        call.index = index
        window.append(call)
        if len(leaves) > len(outputs):  # the call's other tensors (an LSTM's (h, c)) are still its outputs
            sunk = {id(o) for o, _ in outputs}
            _made(t, [(o, k) for o, k, _ in leaves if id(o) not in sunk], index)
    key = id(module)
    t.calls[key] = t.calls.get(key, 0) + 1
    if training and module.training:
        t.stepping = True
    pending = t.pending
    keep = False
    for (o, k), (ref, _) in zip(outputs, call.outputs):  # noqa: B905 (one each, by _made; strict= is a keyword call)
        if training:
            # A loss usually follows and covers it; if none does, it is read then, if still held. (An output without
            # grad too: a frozen part's features, a statistic. If the loss uses it, the loss is the sink.)
            pending.append(Pending(g, None, True, [ref], ref, call, None, None, k))  # (key=k, by position)
        else:
            # No loss can follow (no_grad, inference): the status now, one pass; the output is not held.
            host = type(o) is _Tensor and o.is_cpu and _sync.HOST_READS  # (read now: few values or a sum, below)
            if host:
                total = few_values_sum(o)
                if total is not None and total - total == 0.0:
                    continue  # finite: every element is (no torch op: see FEW_ELEMENTS)
            status = sum_status(stored(o)) if host else norm(o)
            value = status.item() if host else _sync.host_value(status)  # (a CPU read is no sync: known now)
            if value is not None and value - value == 0.0:
                continue  # finite: nothing left to read (an Inf is still judged at the read: the repro command does)
            if host and value != value and not bool(_torch.isnan(stored(o)).any()):
                status, value = norm(o), math.inf  # +Inf and -Inf elements summed: no NaN, as the 2-norm says
            keep = keep or (value is not None and value != value and not training)  # (a NaN, known now)
            pending.append(Pending(g, None, True, [], ref, call, key=k, status=status))
    if keep and index >= 0:
        # A NaN output on the CPU, known at once: hold this call's data until the read (below, or where warn and
        # skip modes and a distributed run read: the next call of the module at the latest), so that the replay can
        # run it. Evaluation loops free each batch before the next call; on a device the read is that next call's,
        # and the batch, not held, is gone (the message says so).
        call.args = weak(args, True)
        call.kwargs = weak(kwargs, True) if kwargs else kwargs
        call._module = module
    known_root(g, module)
    if tape and g.options.trace != "off" and (training or t.resume_tape):
        start_tape(g)  # the loss code follows: record it until backward()
    elif t.eager:
        end_tape(t)
    if skipped:
        _warn_unreadable(g, module, skipped)
    if keep and g.options.nonfinite == "raise" and not _read_by_every_rank(g):
        # Raised by the call that made it: the loop's batch in a post-mortem is the bad one, and a thread that calls
        # the model once and ends (a request) still raises. Warn and skip modes read it with the step it belongs to
        # (a teacher's NaN is then one warning, not one more for the loss it reaches), and a distributed run where
        # every rank reads together.
        check()


class Raised:
    """An outermost call that raised, kept until the next one opens so that failure.explain can replay it: torch's own
    check often meets a NaN inside the forward before any sink can (``Normal(loc, scale)`` built in a VAE's forward
    raises "found invalid values"). Everything is held weakly: the error's traceback holds the call's frames, and
    with them its inputs, while the error is on its way. The error is known by its id and the path its traceback had
    as the call ended, which stays the innermost part of its traceback as it goes up: an id alone is no identity
    (the next error made takes the freed one's memory at once). ``window``: the window as the call ended, which a
    read or a drop replaces, not empties; the call's inputs may be outputs of its events before ``call.index``."""

    __slots__ = ("call", "error_id", "path", "window")

    def __init__(self, call: Call, error: BaseException, window: list) -> None:
        self.call, self.error_id, self.window = call, id(error), window
        self.path = _traceback_path(error)

    def is_from(self, error: BaseException) -> bool:
        """Whether ``error`` is the one this call raised."""
        if id(error) != self.error_id:
            return False
        path = _traceback_path(error)
        return len(path) >= len(self.path) and path[len(path) - len(self.path):] == self.path


def _traceback_path(error: BaseException) -> list:
    path, tb = [], error.__traceback__
    while tb is not None:
        path.append((tb.tb_frame.f_code, tb.tb_lasti))
        tb = tb.tb_next
    return path


def _keep_raised(g: _guard.Guard, t: _Thread, module: Any, args: tuple, kwargs: dict, entry: tuple) -> None:
    """The call raised: kept for failure.explain (see Raised), where it could name what made a NaN. Not where a replay
    is not wanted (trace='off', warn and skip modes, an out-of-memory error: see failure.explain)."""
    error = sys.exc_info()[1]
    if error is None or g.options.trace == "off" or g.options.nonfinite != "raise" or _failure.not_explained(error):
        return
    call = Call(_ModuleRef(module), weak(args, False), weak(kwargs, False) if kwargs else kwargs, entry, [])
    call.index = len(t.window)  # (its place, were it in the window: a replay runs it after the events before it)
    t.raised = Raised(call, error, t.window)


def _made_here(outputs: list, args: tuple, kwargs: dict) -> list:
    """The outputs without those the call was given: a target that a model hands back with its predictions (NaN
    where a label is missing), or a view of one. The call did not make them; they are the data, not a sink. Looked
    at only where an output has no autograd history (every output of a no_grad call, few of a training call)."""
    if len(outputs) == 1 and len(args) == 1 and not kwargs and isinstance(args[0], _Tensor):
        o, given = outputs[0][0], args[0]  # (one tensor in, one out: an inference call's shape)
        return outputs if o.grad_fn is not None or (o is not given and o._base is not given) else []
    for o, _ in outputs:
        if o.grad_fn is None:
            break
    else:
        return outputs
    given = set()
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, _Tensor):
            given.add(id(value))
        else:
            items = _items(value)  # a batch of tensors: a dict, a tuple or list, a dataclass
            if items is not None:
                given.update(id(v) for _, v in items if isinstance(v, _Tensor))
    if not given:
        return outputs
    return [(o, k) for o, k in outputs
            if o.grad_fn is not None or (id(o) not in given and (o._base is None or id(o._base) not in given))]


def _warn_unreadable(g: _guard.Guard, module: Any, skipped: list) -> None:
    """Once per tensor class and guard: outputs of this class are not checked (the loss and gradients still are)."""
    warned = g.states[SAID_ONCE]
    for o, _ in skipped:
        cls = type(o)
        if cls in warned:
            continue
        warned.add(cls)
        warn_at_user(f"ampguard: an output of {type(module).__name__} is a {cls.__module__}.{cls.__qualname__}, "
                     f"whose status torch cannot compute ({unreadable(o)}): outputs of that class are not checked "
                     "for NaN. A loss computed from them and the gradients still are.")


def known_root(g: _guard.Guard, module: Any) -> None:
    """Name parameters from ``module`` (held weakly): an outermost call's, or the LightningModule whose
    training_step calls its parts one by one (``self.G(z)``, ``self.D(x)``), which gives them their full names."""
    known = g.states[ROOTS]
    key = id(module)
    if key not in known:
        known[key] = weakref.ref(module, lambda _: known.pop(key, None))


def _recover() -> None:
    """An outermost call that a KeyboardInterrupt left open: close it and drop its checks."""
    if outermost.OPEN.state.root is not None and outermost.recover():  # (no call where none is open)
        forget_calls()
        drop()


# -- the loss-code tape ------------------------------------------------------------------------
_tape: Any = None


def _make_tape() -> Any:
    torch = _torch
    tensor = torch.Tensor

    class Tape(torch.overrides.TorchFunctionMode):
        """Records the loss code's top-level torch calls; no on-device work, no reads."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            __tracebackhide__ = True
            if kwargs is None:
                kwargs = {}
            if _is_compiling():  # dynamo folds this: a compiled graph sees a plain call, no graph break
                return func(*args, **kwargs)
            caller = sys._getframe(1)
            if type(func) is _PY_FUNCTION:
                out = func(*args, **kwargs)
            else:  # a C function (Tensor.std) warns from the running frame: one that reads as the caller's
                out = from_caller(caller)(func, args, kwargs)
            t = _here.state
            if not t.taping or t.replaying or _transformed():
                return out
            # (no cache of this answer: dynamo in torch 2.6 guards on a dict the mode's closure holds, and the dict's
            # growth then failed the guard on the frame that made it, a crash of a compiled call in the loss code)
            name = getattr(func, "__name__", "")
            if name in _SKIP_NAMES and (name != "__get__" or _property(func) not in _VIEW_PROPERTIES):
                return out
            try:
                made = out if out is not None else written_output(func, args, out)  # (no call for most ops)
                if isinstance(made, tensor):
                    if made.is_floating_point() or made.is_complex():
                        _record(t, func, args, kwargs, ((made, 0),), caller)
                else:
                    outs = made_within(made)
                    if outs:
                        _record(t, func, args, kwargs, outs, caller)
            except (NonFiniteError, AmpGuardWarning):
                raise
            except Exception as exc:
                internal_failure(FEATURE, exc)
            return out

    return Tape


def written_output(func: Any, args: tuple, out: Any) -> Any:
    """What a torch call made: its output, or for ``Tensor.__setitem__`` (``scores[mask] = -inf``), which returns
    nothing, the tensor it wrote into. The record, the replay and a reproducer take its output from here."""
    return args[0] if out is None and args and func is _Tensor.__setitem__ else out


def _property(getter: Any) -> str:
    """The name of the tensor property whose ``__get__`` this is (``Tensor.T.__get__``: 'T')."""
    return getattr(getattr(getter, "__self__", None), "__name__", "")


def _record(t: _Thread, func: Any, args: tuple, kwargs: dict, outs: Any, frame: Any) -> None:
    window = t.window
    index = len(window)
    if t.eager_stack:
        # trace='eager', inside an outermost call: the op is checked as it runs, and not kept. A replay runs the call
        # whole, as under trace='replay' (the op's arguments may be gone by then: FSDP frees the parameters it
        # gathered), and a large model's forward does not fill the window and end the checks.
        _failure.check_eager(func, _six_frames(frame), index, outs, args, kwargs)
        return
    if index >= MAX_WINDOW:
        t.taping = False
        return
    weak_args = weak(args, True)  # before this op's outputs are known as made: an in-place op returns its input
    weak_kwargs = weak(kwargs, True) if kwargs else kwargs
    refs = _made(t, outs, index)
    op = TapeOp(func, weak_args, weak_kwargs, refs, _six_frames(frame), _autocast_state() if _any_autocast() else None,
                _torch.is_grad_enabled(), index)
    window.append(op)
    if t.eager:
        _failure.check_eager(func, op.frames, index, outs, args, kwargs)  # (the arguments: the record's are weak)


def _six_frames(f: Any) -> tuple:
    """(code, instruction offset) of ``f`` and the five frames above it, as far as there are (a line number only when
    a message needs one). Written out: at every recorded op, a loop over the six cost a quarter more."""
    a = (f.f_code, f.f_lasti)
    if (f := f.f_back) is None:
        return (a,)
    b = (f.f_code, f.f_lasti)
    if (f := f.f_back) is None:
        return a, b
    c = (f.f_code, f.f_lasti)
    if (f := f.f_back) is None:
        return a, b, c
    d = (f.f_code, f.f_lasti)
    if (f := f.f_back) is None:
        return a, b, c, d
    e = (f.f_code, f.f_lasti)
    if (f := f.f_back) is None:
        return a, b, c, d, e
    return a, b, c, d, e, (f.f_code, f.f_lasti)


def start_tape(g: _guard.Guard) -> None:
    global _tape
    t = _here.state
    if t.tape is not None:
        t.taping = True
        return
    if _tape is None:
        _tape = _make_tape()()  # one recorder, pushed at every step: it keeps no state of its own
    _push_under(_tape)
    t.tape = _tape
    t.taping = True


def _push_under(mode: Any) -> None:
    """Put the recorder at the bottom of torch's function-mode stack, under the modes the user entered before it.
    The user leaves those while it records (``with torch.device(d): out = model(x)``, then the loss code), and a
    mode's exit pops the top mode: on top, the recorder would be popped in its place, and the user's mode left on
    for the rest of the run. Only the default device's mode (``torch.set_default_device``) stays under it: torch
    keeps that one at the bottom, and its exit checks that it is there."""
    C = _torch._C
    n = C._len_torch_function_stack()
    if not n:
        C._push_on_torch_function_stack(mode)  # (the usual case)
        return
    bottom = getattr(getattr(_torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    _beneath(n - (C._get_function_stack_at(0) is bottom), C._push_on_torch_function_stack, mode)


def _beneath(depth: int, action: Callable[..., Any], *args: Any) -> None:
    """``action(*args)`` on torch's function-mode stack with its top ``depth`` modes taken off, then put back in
    their order."""
    C = _torch._C
    above = [C._pop_torch_function_stack() for _ in range(depth)]
    action(*args)
    for other in reversed(above):
        C._push_on_torch_function_stack(other)


def end_tape(t: _Thread | None = None) -> None:
    """Stop recording and take the tape off torch's mode stack (from under the modes the user entered since), unless
    torch is dispatching a call to it: then at the next hook. ``t``: this thread's state, where the caller holds it
    already (most hooks, several times a step)."""
    if t is None:
        t = _here.state
    mode = t.tape
    if mode is None:
        return  # (taping is only ever on while a tape is)
    t.taping = False
    C = _torch._C
    n = C._len_torch_function_stack()
    if n and C._get_function_stack_at(n - 1) is mode:
        C._pop_torch_function_stack()
        t.tape = None
        return
    for i in range(n - 2, -1, -1):  # under modes the user entered since: taken out from under them
        if C._get_function_stack_at(i) is mode:
            _beneath(n - 1 - i, C._pop_torch_function_stack)
            t.tape = None
            return
    # Not on the stack: torch is dispatching a call to it (Tensor.backward), and puts it back after; taken off
    # at the next hook.


# -- loss sinks and backward -------------------------------------------------------------------
def add_loss(g: _guard.Guard, loss: Any) -> None:
    """The loss sink (on a watched device); it covers every output that flowed into it, so those are not read."""
    if not watched(g, loss):
        return
    t = _here.state
    pending = t.pending
    if pending:
        # (an output whose status was not taken when made, a grad-enabled call's, is covered by the loss)
        kept = []
        for p in pending:  # (a loop, not a comprehension: a call fewer at every step)
            if p.call is None or p.status is not None:
                kept.append(p)
        t.pending = kept
    ref = _weak_one(loss, False, t.produced)
    t.losses.append(ref)
    if loss.numel() == 1:
        value = _sync.host_value(loss)
        if value is not None and math.isfinite(value):
            return  # a finite loss on the CPU, read at once: nothing to check at the step
        part = loss.detach()  # a scalar, without its graph: its 2-norm is its magnitude, exact
    else:
        part = weakref.ref(loss)  # read if still held; its gradients are checked in any case
    t.pending.append(Pending(g, "loss", False, [part], part, ref=ref))


def _backward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g = _guard.current(FEATURE)
    t = _here.state
    if g is None or t.replaying:
        return wrapped(*args, **kwargs)
    try:
        _recover()
        if t.tape is not None:
            end_tape(t)  # under Tensor.backward the mode is ours to pop only at the next hook
        _add_losses(g, args[0] if args else kwargs.get("tensors"), plain=False)
        t.backward_since_read = True
        t.passing = False
        t.backwards += 1
    except (AmpGuardError, AmpGuardWarning) as intended:
        raise intended.with_traceback(None) from None  # the traceback starts here: no ampguard frame below
    except Exception as exc:
        internal_failure(FEATURE, exc)
    try:
        return wrapped(*args, **kwargs)
    except BaseException:
        drop(g)  # the user's exception wins over checks queued before it
        raise


def tensor_backward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.backward()``: the loss code ends here, before torch dispatches the call. With the recorder still on
    its mode stack, torch hands the call to it (``handle_torch_function``), puts it back after the call, and hands
    it every torch call made until the next hook takes it off (the optimizer step's profiler op): some 30-40 us
    a step of a small loop that calls ``loss.backward()``. (``GradScaler.scale()`` and Lightning's closure end the
    record before their ``backward()``.) ``torch.autograd.backward``'s wrapper still does the rest."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    t = _here.state
    if t.tape is not None and not t.replaying:
        try:
            if _guard.current(FEATURE) is not None:
                end_tape(t)
        except Exception as exc:
            internal_failure(FEATURE, exc)
    return wrapped(*args, **kwargs)


def _add_losses(g: _guard.Guard, roots: Any, plain: bool) -> None:
    """Each floating tensor of ``roots`` (what backward() or torch.autograd.grad differentiates) that no GradScaler
    scaled is a loss sink. ``plain``: a torch.Tensor or Parameter only, not a subclass."""
    for r in (roots,) if isinstance(roots, _Tensor) else list(roots or ()):
        if plain and type(r) is not _Tensor and type(r) is not _torch.nn.Parameter:
            continue
        if r.is_floating_point() and not scaled(r):
            add_loss(g, r)


def autograd_grad_call(args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """(outputs, create_graph) of a call ``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph,
    create_graph, ...)``, as it was made (positionally or by keyword)."""
    outputs = args[0] if args else kwargs.get("outputs")
    return outputs, bool(kwargs.get("create_graph", args[4] if len(args) > 4 else False))


def _autograd_grad(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.autograd.grad`` without create_graph: the backward of a loop that computes its gradients itself and
    sets ``.grad`` (no backward() runs, so its loss is the sink here). Nothing else changes: the loss-code record
    goes on and records the call, which a replay runs again. With create_graph it is loss code (a gradient
    penalty), whose output is no loss."""
    __tracebackhide__ = True
    g = _guard.current(FEATURE)
    t = _here.state
    outputs, create_graph = autograd_grad_call(args, kwargs)
    if g is None or t.replaying or _is_compiling() or _transformed():
        # (torch's own calls: AOTAutograd tracing a compiled backward on fake tensors, torch.func's transforms)
        return wrapped(*args, **kwargs)
    if create_graph:
        return _penalty(t, outputs, wrapped(*args, **kwargs)) if t.scaled else wrapped(*args, **kwargs)
    try:
        # (plain tensors only: torch 2.6 traces a compiled backward with this call on fake tensors, whose value
        # cannot be read, and without saying it is compiling, as 2.13 does)
        _add_losses(g, outputs, plain=True)
    except (AmpGuardError, AmpGuardWarning) as intended:
        raise intended.with_traceback(None) from None  # the traceback starts here: no ampguard frame below
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return wrapped(*args, **kwargs)


def _penalty(t: _Thread, outputs: Any, grads: Any) -> Any:
    """Gradients taken with create_graph of a value a GradScaler scaled (the AMP recipe for a gradient penalty): the
    loss made from them carries the scale, and overflows where the scaled gradients do, as GradScaler's skip
    expects. Their nodes are noted by key (not held) for the failure path's replay (failure.scale_overflow)."""
    try:
        for o in (outputs,) if isinstance(outputs, _Tensor) else outputs or ():
            entry = t.scaled.get(id(o))
            if entry is not None and entry[0]() is o:
                keys = t.penalty[1] if t.penalty is not None and t.penalty[0] is entry[1] else set()
                for grad in (grads,) if isinstance(grads, _Tensor) else grads:
                    node = getattr(grad, "grad_fn", None)
                    if node is not None:
                        keys.add((_node_key(node), node.name()))
                t.penalty = (entry[1], keys)
                break
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return grads


def _training_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Lightning: the loss code is in training_step; what runs after it until backward() is Lightning's.

    Under a Trainer's automatic optimization, training_step is itself the outermost call (as under a strategy, which
    runs it as its wrapped module's forward): captured once, with every module call inside it on torch's fast path
    and no record of its loss code. A replay runs training_step again, which computes that loss code, with its
    lines. Lightning calls backward() and the step only once it has returned. Called outside a Trainer (Fabric, a
    loop of the user's own), training_step may step inside: there its module calls stay the outermost calls."""
    g = _guard.current(FEATURE)
    t = _here.state
    if g is None or t.replaying:
        return wrapped(*args, **kwargs)
    known_root(g, instance)  # before: a check inside training_step (manual optimization) names from it
    if g.options.trace != "eager" and getattr(instance, "automatic_optimization", False) is True and \
            getattr(instance, "_trainer", None) is not None:
        result = outermost.run_as_outermost(instance, wrapped, args, kwargs, _enter_training_step,
                                            _exit_training_step)
    else:
        result = wrapped(*args, **kwargs)
    if t.tape is not None and not t.eager:
        end_tape(t)
    return result


def _enter_training_step(module: Any, frame: Any) -> int:
    return enter(module, frame, "training_step")


def _exit_training_step(module: Any, args: tuple, kwargs: dict, output: Any, raised: bool = False) -> None:
    exit(module, args, kwargs, output, raised, tape=False)  # what follows until backward() is Lightning's


def _closure_result(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Lightning's automatic optimization divides training_step's loss by accumulate_grad_batches (by 1 too)
    after training_step returned, and backward() gets the quotient. Recorded as the loss code's last op (or,
    divided by 1, known as the loss itself), so that the loss sink knows where its loss came from and a replay
    computes it."""
    result = wrapped(*args, **kwargs)
    t = _here.state
    if not t.window or t.replaying:
        return result
    g = _guard.current(FEATURE)
    if g is None or g.options.trace == "off":
        return result  # (no loss code is recorded: the loss could not be known anyway)
    try:
        output = args[0] if args else kwargs.get("training_step_output")
        loss = output.get("loss") if isinstance(output, Mapping) else output
        quotient = getattr(result, "closure_loss", None)
        if isinstance(loss, _Tensor) and isinstance(quotient, _Tensor) and quotient is not loss:
            made = _weak_one(loss, False, t.produced)
            if type(made) is Ref and made.event >= 0:
                normalize = args[1] if len(args) > 1 else kwargs.get("normalize", 1)
                if normalize == 1:  # x / 1 is x, bit for bit: the quotient is known as the loss, with no record
                    _known_as(t.produced, quotient, made)
                else:
                    _record(t, _torch.div, (loss, normalize), {}, ((quotient, 0),), sys._getframe(1))
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return result


def _lr_range_test(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Lightning's learning-rate finder raises the learning rate until the loss diverges: a NaN or Inf loss is its
    answer, not an error (it stops or skips there, and restores the model and optimizer after). It runs under a
    guard of its own without the non-finite checks; every other feature stays as it is."""
    if _guard.current(FEATURE) is None:
        return wrapped(*args, **kwargs)
    with _guard.guard(nonfinite="off"):
        return wrapped(*args, **kwargs)


def _lightning_log(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Lightning: ``self.log()``/``log_dict()`` inside training_step is not loss code. Its own torch calls (a
    copy, a conversion, a move per value: some five a value) are neither recorded nor sent through the
    recorder at all: it steps off torch's mode stack while they run."""
    t = _here.state
    if t.replaying:
        return None  # a replay of training_step logs nothing (self.log returns None)
    if t.eager:
        return wrapped(*args, **kwargs)
    return _off_the_record(t, wrapped, args, kwargs)


def _off_the_record(t: _Thread, wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """Run a call that is no loss code (``self.log()``, a metric) with the recorder off torch's mode stack, and
    put it back after, where the loss code was being recorded."""
    if not t.taping:
        return wrapped(*args, **kwargs)
    end_tape(t)
    try:
        return wrapped(*args, **kwargs)
    finally:
        g = _guard.current(FEATURE)
        if g is not None:
            start_tape(g)  # (back on the stack, or recording again where it could not leave it)


def _metric_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """torchmetrics: calling a metric measures the model, it does not train it. It is no outermost call, so its
    value is no sink: a Pearson correlation of constant predictions (a zero-initialised regression head) is NaN by
    design, with torchmetrics' own warning, and is logged as NaN without ampguard. A NaN the model made reaches the
    loss or the model's own output anyway. Module calls inside the metric (FID's Inception, LPIPS's network) are
    the metric's, and its torch calls are no loss code: the record pauses while it runs, as for ``self.log()``
    (a replay would add the batch to the metric's state again). It also saves an outermost call's cost per metric
    call, some 40 us on a CPU."""
    t = _here.state
    if t.replaying:
        return _state_kept(instance, wrapped, args, kwargs)
    t.measuring += 1
    try:  # (under trace='eager' too: a metric's own NaN, by design, is no op to stop at)
        return _off_the_record(t, wrapped, args, kwargs)
    finally:
        t.measuring -= 1


def _state_kept(metric: Any, call: Any, args: tuple, kwargs: dict) -> Any:
    """A metric's call inside a replay (of a Lightning training_step that updates it): its value, with the metric's
    state put back after (see kept), so that a run that goes on (check_unscaled_after's replay) does not count the
    batch twice in the epoch's value."""
    restore = kept(metric)
    try:
        return call(*args, **kwargs)
    finally:
        restore()


_MISSING = object()


def kept(obj: Any, values: bool = True) -> Callable[[], None]:
    """A function that puts ``obj``'s attributes back as they are now: the same objects; the items of its lists,
    dicts, sets and deques (a forward that appends to ``self.history``, counts in ``self.stats["seen"]``, or a
    torchmetrics metric's list state), one level deep; and with ``values`` a tensor's values where it was written in
    place. Without, tensors are not copied: a module that keeps an activation (``self.last = h``) costs no copy.
    nn.Module's own dicts (parameters, buffers, hooks) are left to torch."""
    state = vars(obj)
    own = _module_own() if isinstance(obj, _torch.nn.Module) else frozenset()
    saved = {}
    for k, v in state.items():
        if isinstance(v, _CONTAINERS) and k not in own:
            saved[k] = (v, list(v.items()) if isinstance(v, dict) else list(v))
        elif values and isinstance(v, _Tensor):
            saved[k] = (v, (v._version, v.detach().clone()))
        else:
            saved[k] = (v, None)

    def restore() -> None:
        for k in [k for k in state if k not in saved]:
            del state[k]
        for k, (v, copy) in saved.items():
            if type(copy) is list:
                if isinstance(v, dict):
                    if len(v) != len(copy) or any(v.get(key, _MISSING) is not item for key, item in copy):
                        v.clear()
                        for key, item in copy:  # (item by item: a Counter's update() would count the pairs)
                            v[key] = item
                elif isinstance(v, list):
                    if len(v) != len(copy) or any(a is not b for a, b in zip(v, copy, strict=True)):
                        v[:] = copy
                elif isinstance(v, set):
                    v.clear()
                    v.update(copy)
                else:  # (a deque: its maxlen stays)
                    v.clear()
                    v.extend(copy)
            elif copy is not None and v._version != copy[0] and v.shape == copy[1].shape:
                with _torch.no_grad():
                    v.copy_(copy[1])
            if state.get(k, _MISSING) is not v:
                state[k] = v

    return restore


_CONTAINERS = (list, dict, set, collections.deque)


@functools.cache
def _module_own() -> frozenset:
    """The attributes every nn.Module has (_parameters, _buffers, _modules, its hook dicts)."""
    return frozenset(vars(_torch.nn.Module()))


def lightnings_own_metric(cls: type, original: Any = None) -> str | None:
    """Leave Lightning's ``_ResultMetric`` alone, without a word (a Target's accept: ""), and wrap every other metric
    (None). It is ``self.log()``'s accumulator, called by Lightning's logging alone and no loss code already
    (_lightning_log): its wrappers would cost some 180 bytecodes a step for two logs."""
    return "" if cls.__module__.endswith("trainer.connectors.logger_connector.result") else None


def _metric_wrap_update(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """torchmetrics binds a metric's ``update()`` when the metric is built (or unpickled), in a function of its own:
    ``self.acc.update(preds, y)`` inside the loss code measures as a metric's call does (see _metric_forward). A
    metric built before the patches applied keeps torchmetrics' function: its update() is recorded as loss code,
    which costs time and changes nothing else. One patch on Metric, not one on every metric's update()."""
    update = wrapped(*args, **kwargs)
    if lightnings_own_metric(type(instance)) is not None:
        return update

    @functools.wraps(update)
    def measured(*a: Any, **k: Any) -> Any:
        return _metric_forward(update, instance, a, k)

    return measured


def _scaler_scale(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    g = _guard.current(FEATURE)
    t = _here.state
    if g is not None and not t.replaying:
        end_tape(t)  # the loss code ends here: the scaler's own ops are not the user's
        if t.snapshots:
            t.snapshots = {}  # GradScaler decides this step (and may never call step()): skip mode's copy is moot
    out = wrapped(*args, **kwargs)
    if g is None or t.replaying or not getattr(instance, "_enabled", False):
        return out
    try:
        loss = args[0] if args else kwargs.get("outputs")
        if isinstance(loss, _Tensor) and isinstance(out, _Tensor) and loss.is_floating_point():
            add_loss(g, loss)
            t.scaled[id(out)] = (weakref.ref(out), instance)  # backward() of it is this sink, not a second one
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return out


def scaled(tensor: Any) -> bool:
    t = _here.state
    entry = t.scaled.get(id(tensor))
    return entry is not None and entry[0]() is tensor


def _clip_grad_norm(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """The total norm the loop computes anyway is the gradient sink: no pass of ampguard's own."""
    t = _here.state
    g = _guard.current(FEATURE)
    if g is None or t.replaying:
        return wrapped(*args, **kwargs)
    try:
        args, kwargs, params = clip_arguments(args, kwargs)
        norm_type = args[2] if len(args) > 2 else kwargs.get("norm_type", 2.0)
        usable = float(norm_type) > 0  # a 0-"norm" counts non-zeros: a NaN would not show
    except Exception as exc:
        return fall_back(FEATURE, exc, lambda: wrapped(*args, **kwargs))
    try:
        total = wrapped(*args, **kwargs)
    except BaseException:
        drop(g)  # error_if_nonfinite=True: the user's exception wins, and a loop that catches it skips the batch
        raise
    if usable and isinstance(total, _torch.Tensor) and total.numel() == 1:
        t.clip = (total.detach(), frozenset(id(p) for p in params), t.backwards)
    return total


# -- optimizer hooks ---------------------------------------------------------------------------
def params_of(optimizer: Any) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _gradients_sink(g: _guard.Guard, optimizer: Any) -> Any:
    return lambda: f"gradients of {g.name_of(optimizer)}"


def _add_grads(g: _guard.Guard, optimizer: Any) -> None:
    t = _here.state
    devices = g.options.devices
    strided = _torch.strided
    params, grads = [], []
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None or (devices is not None and grad.device.type not in devices):
                continue
            if grad.is_floating_point():
                if grad.layout is not strided:
                    grad = stored(grad)
            elif grad.is_complex():
                grad = stored(grad)
            else:
                continue
            params.append(p)
            grads.append(grad)
    if not params or no_data(grads[0]):  # (a step under FakeTensorMode: memory estimation)
        return
    clip, t.clip = t.clip, None
    clipped = None
    if clip is not None and clip[2] == t.backwards and all(id(p) in clip[1] for p in params):
        parts = [clipped := clip[0]]  # clip_grad_norm_'s total norm: non-finite when a gradient is (or it overflowed)
    else:
        parts = grads
    status = None
    if _sync.HOST_READS and parts[0].is_cpu:
        # A CPU status is read now, as the read would (no sync on the CPU): finite, it leaves nothing to read, and a
        # step of a CPU loop, whose loss was read at once too, ends its window without the read's bookkeeping. What is
        # left (gradients on a device) waits for the read; a non-finite total waits as the status, which the read
        # judges as it judges a sum's (checked exactly), with no second pass. (A model on a device, its first
        # gradient there, goes to the read at once: no second walk over its gradients.)
        statuses, parts = _gradient_statuses(parts)
        total = sum(_sync.on_host(statuses), 0.0)
        if total - total != 0.0:
            status = total
        elif not parts:
            return
    t.pending.append(Pending(g, _gradients_sink(g, optimizer), False, parts, params=params,
                             optimizer=weakref.ref(optimizer), status=status, tensor=clipped))


@fail_safe(FEATURE)
def optimizer_pre_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
    """torch's global pre-step hook. Inside a compiled function that steps the optimizer (torch's "compile the
    optimizer" recipe) dynamo traces it: it then calls itself through ``torch._dynamo.disable`` (one silent graph
    break before the step, where it runs eagerly, checks and replay included), before it touches any of ampguard's
    objects (dynamo before 2.6 cannot guard on them). Traced, its read broke the graph with a warning and a traceback
    through ampguard, and failed in dynamo's frame."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    if _is_compiling():
        return outside_compile(optimizer_pre_step)(optimizer, args, kwargs)
    t = _here.state
    g = _guard.current(FEATURE)
    if g is None or t.replaying:
        return None
    _recover()
    if t.tape is not None:
        end_tape(t)
    while t.hidden:  # a skipped step that raised: its post-step hook never gave the gradients back
        for param, grad in t.hidden.pop()[1]:
            param.grad = grad
    if DEPTH.counts.get("scaler.step"):
        t.poisoned = t.elsewhere = False  # GradScaler decides this step from its own found_inf
        return None  # under a GradScaler non-finite gradients are its business; read at update()
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
    if closure is None:
        _add_grads(g, optimizer)
        _check_step(g, optimizer)
        return None
    # The closure runs the forward and backward inside step(): read after it, before the update.
    checked = _CheckedClosure(g, optimizer, closure)
    if len(args) > 1:
        return (args[0], checked, *args[2:]), kwargs
    return args, {**kwargs, "closure": checked}


def outside_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as run outside torch.compile (``torch._dynamo.disable``), where dynamo is loaded: a compiled
    optimizer step's hook, and the failure path, whose replay dynamo would trace, and whose eager stance it refuses
    in a compiled function's frame."""
    if "torch._dynamo" not in sys.modules:
        return fn
    # An import statement, not the entry in sys.modules: while another thread imports dynamo (torch imports it on
    # first use, as in another thread's replay), the entry is there half made, and the statement waits for it.
    import torch._dynamo

    return torch._dynamo.disable(fn)


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
            try:
                _check_step(self.guard, self.optimizer)
            except (AmpGuardError, AmpGuardWarning) as intended:
                raise intended.with_traceback(None) from None  # the traceback starts here: no ampguard frame below
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.closure, name)


@fail_safe(FEATURE)
def optimizer_post_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Count the step: a parameter it makes non-finite is named at the next call that reads it."""
    t = _here.state
    if t.hidden and t.hidden[-1][0] is optimizer:
        _, hidden = t.hidden.pop()
        for param, grad in hidden:
            param.grad = grad  # as GradScaler leaves them after a skip; the loop's zero_grad() clears them
        t.snapshots = {}
        return  # nonfinite='skip' ran it without gradients: nothing changed
    g = _guard.current(FEATURE)
    if t.replaying or g is None:
        return
    t.steps += 1
    t.stepped.of(optimizer)
    if g.options.nonfinite == "skip":
        t.snapshots = {}
        g.states[SKIPS_IN_ROW][0] = 0


# -- nonfinite='skip' ------------------------------------------------------------------------------
def _check_step(g: _guard.Guard, optimizer: Any) -> None:
    """The read before a step not driven by a GradScaler; in skip mode, skip the step if it failed."""
    __tracebackhide__ = True
    if g.options.nonfinite != "skip":
        check()  # (t.agree is None outside this function's skip-mode read)
        return
    t = _here.state
    t.agree = _agreeing_group(g)
    try:
        check()
    finally:
        t.agree = None
    if t.poisoned and _guard.current(FEATURE) is g:
        _skip(g, optimizer)


def _skip(g: _guard.Guard, optimizer: Any) -> None:
    """Run ``optimizer``'s step() without gradients (torch's optimizers then change neither parameters nor
    state), put back the buffers the skipped forward changed, and hold the schedulers for it."""
    __tracebackhide__ = True
    t = _here.state
    elsewhere, t.poisoned, t.elsewhere = t.elsewhere, False, False
    in_row = g.states[SKIPS_IN_ROW]
    in_row[0] += 1
    limit = g.options.max_consecutive_skips
    if limit is not None and in_row[0] >= limit:
        in_row[0] = 0
        last = t.last_error
        story = f"\n  The latest:\n{_indent(str(last))}" if last is not None else ""
        error = NonFiniteError(
            f"ampguard: nonfinite='skip' skipped {limit} optimizer steps in a row (max_consecutive_skips={limit}): "
            "every batch meets a non-finite loss or gradients, so skipping cannot save this run. The parameters "
            "are still the last finite ones." + story, kind="nan", sink="loss")
        if last is not None:
            error.__dict__.update(last.__dict__)  # its kind, sink, op, origin and reproducer bundle
        raise error
    hidden = [(p, p.grad) for p in params_of(optimizer) if p.grad is not None]
    for p, _ in hidden:
        p.grad = None
    t.hidden.append((optimizer, hidden))
    _restore_buffers()
    g.stats.optimizer_steps_skipped += 1
    g.stats.nonfinite_steps_skipped += 1
    schedulers.note_nonfinite_skip(g, optimizer)
    # every skip, not once per origin: a long run's log shows when each one happened
    log.warning("ampguard: nonfinite='skip' skipped a step of %s (%s); %d skipped so far, %d in a row",
                g.name_of(optimizer), "another rank's loss or gradients were non-finite" if elsewhere else
                f"non-finite {getattr(t.last_error, 'sink', 'loss or gradients')}",
                g.stats.nonfinite_steps_skipped, in_row[0])
    if elsewhere:
        _failure.warn_elsewhere(g, optimizer)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _snapshot_buffers(g: _guard.Guard, module: Any) -> None:
    """Skip mode: the buffers as they were before this step's forward (BatchNorm's running statistics),
    copied into a stash kept per module: one foreach copy, nothing where the model has no buffers."""
    t = _here.state
    buffers = list(module.buffers())
    if not buffers:
        return
    stashes = g.states[BUFFER_STASHES]
    stash = stashes.get(module)
    torch = _torch
    if stash is None or len(stash) != len(buffers) or any(
            (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device) for a, b in zip(stash, buffers, strict=True)):
        stash = stashes.set(module, [b.detach().clone() for b in buffers])
    else:
        with torch.no_grad():
            torch._foreach_copy_(stash, buffers)
    t.snapshots[id(module)] = (module, buffers, stash)


def _restore_buffers() -> None:
    t = _here.state
    snapshots, t.snapshots = t.snapshots, {}
    with _torch.no_grad():
        for _, buffers, stash in snapshots.values():
            for b, saved in zip(buffers, stash, strict=True):
                if b.shape == saved.shape:
                    b.copy_(saved)


def _agreeing_group(g: _guard.Guard) -> Any:
    """In a distributed run where every rank is guarded, the default group (every rank skips together)."""
    dist = schedulers._process_group(g)
    if dist is None:
        return None
    world = dist.get_world_size()
    if world <= 1 or not schedulers._every_rank_guarded(dist, None, world):
        return None
    return dist


def _all_ranks_flag(dist: Any, statuses: Any) -> Any:
    """1 where any rank's statuses hold a NaN/Inf: one tiny all-reduce, riding this step's read."""
    torch = _torch
    device = _sync.collective_device(dist, None, statuses.device if statuses is not None else torch.device("cpu"))
    if statuses is None:
        flag = torch.zeros(1, device=device)
    else:
        flag = (~torch.isfinite(statuses.to(device))).any().float().reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def stepped_optimizer_of(param: Any) -> Any:
    """The optimizer that stepped ``param`` in this thread, if any (failure path)."""
    t = _here.state
    return next((optimizer for optimizer, _ in t.stepped.items()
                 if any(p is param for p in params_of(optimizer))), None)


# -- reading -----------------------------------------------------------------------------------
def _collect() -> list:
    """This guard's pending sinks as one tensor of statuses (their values, where all are on the CPU); another
    guard's are dropped, never judged here."""
    t = _here.state
    g = _guard.current(FEATURE)
    if g is None:
        return []
    statuses = _statuses(g) if t.pending or t.agree is not None else None
    if type(statuses) is _sync.OnHost:
        return statuses
    if statuses is None and t.agree is None:
        # Nothing to read (no check left, or every sink dropped), but this read still ends the window: consume([])
        return _sync.OnHost() if t.window else []
    own = [statuses] if statuses is not None else []
    return own if t.agree is None else [*own, _all_ranks_flag(t.agree, statuses)]


def _total(collected: list) -> Any:
    """What this rank's checks add to the ranks' agreement at a GradScaler update() (see _sync.gather): their sum,
    not finite where a status is, so where the read may fail. No op for the usual one scalar status, one for a
    stack. A finite total that overflows, or an Inf that an output holds by design (a masked logit), costs only the
    failure path's second all-reduce, in which each rank judges its own checks exactly."""
    if type(collected) is _sync.OnHost:
        return sum(collected, 0.0)
    total = 0.0
    for status in collected:
        total = total + (status if status.dim() == 0 else status.sum())
    return total


def _statuses(g: _guard.Guard) -> Any:
    t = _here.state
    pending, t.pending = t.pending, []
    tensor = _Tensor
    tensors, taken, layout = [], [], []
    for p in pending:
        if p.guard is not g:
            continue  # another guard's: dropped, never judged here
        at = []
        if p.status is not None:
            at.append(~len(taken))
            taken.append(p.status)
        if p.params is not None and p.parts:  # gradients (none left: their total was taken at the step)
            flat, rest = _gradient_statuses(p.parts)
            for status in flat:
                at.append(~len(taken))
                taken.append(status)
            at.extend(range(len(tensors), len(tensors) + len(rest)))
            tensors.extend(rest)
            layout.append((p, at))
            continue
        for part in p.parts:
            value = part if isinstance(part, tensor) else part()
            if value is None:
                continue  # an output the user dropped: nothing can read it any more, nothing is lost
            if value.dim() == 0:  # a scalar (a loss, a clip's total norm) is its own status: no kernel
                at.append(~len(taken))
                taken.append(value.detach() if value.requires_grad else value)
            else:
                at.append(len(tensors))
                tensors.append(stored(value))
        if at:
            layout.append((p, at))
    t.reading = layout
    if not layout:
        return None  # nothing left to read (every output or loss the user dropped)
    statuses = (_norms(tensors) if tensors else []) + taken
    if t.agree is None:  # (with agree, the statuses go into the all-reduce as one tensor)
        host = _sync.on_host(statuses)
        if host is not None:
            return host
    if any(type(s) is float for s in taken):
        # (a device's read, or the all-reduce: a status read as a Python float, a few values' sum or the CPU gradients'
        # total taken at the step, is a tensor again, in double)
        statuses = [s if isinstance(s, tensor) else _torch.tensor(s, dtype=_torch.float64) for s in statuses]
    if len(statuses) == 1:
        return statuses[0]  # (0-dim: the read takes it as one value)
    device = statuses[0].device
    if any(s.device != device for s in statuses):
        statuses = [s.to(device) for s in statuses]
    return _torch.stack(statuses)  # stack promotes: float32 statuses with float64 ones read as float64


def _consume(values: list[float]) -> None:
    """Judge the sinks read, in the order they were added; raise or warn for the first bad one."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    t = _here.state
    layout, t.reading = t.reading, []
    if t.agree is None:
        total = sum(values)
        if total - total == 0.0:  # every status finite (one pass in C): nothing failed, the usual case
            _clear_window()
            return
        elsewhere = 0.0
    else:
        elsewhere, values = values[-1], values[:-1]  # the all-reduced flag of the other ranks
    n = len(values) - sum(1 for _, at in layout for i in at if i < 0)  # where the taken statuses start
    g = _guard.current(FEATURE)
    skip = g is not None and g.options.nonfinite == "skip"
    failed = None
    for p, at in layout:
        if _failed(p, [values[i] if i >= 0 else values[n + ~i] for i in at]):
            if t.penalty is not None and p.ref is not None and _failure.scale_overflow(g, p, t.penalty, t.window):
                continue  # the scaled gradients' overflow: GradScaler skips the step, as without ampguard
            if failed is None or _made_at(p) < _made_at(failed):
                failed = p
            if p.call is None:  # a loss or gradient sink (added at backward or the step: after the outputs)
                if not skip:
                    break
                if t.late and _gradients_cleared(t.window):
                    t.cleared = True  # the loop skipped that batch itself: no step takes what it made
                else:
                    t.poisoned = True  # skip the step it reaches
    if skip and elsewhere and not t.poisoned:
        t.poisoned = t.elsewhere = True  # another rank's loss or gradients: every rank skips together
    if failed is None:
        _clear_window()
        return
    _failure.fail(g, failed)


def _failed(p: Pending, values: list[float]) -> bool:
    """Whether sink ``p`` failed, given its statuses (failure path only). A NaN status is an element's NaN, except a
    gradient's: a sum, which finite values that overflow make NaN too. An Inf status may be such an overflow (a
    sum's, a 2-norm's sum of squares), and counts only where the sink judges Inf at all. Both are checked exactly,
    so large finite values never raise; where they were clip_grad_norm_'s total norm, that is said once (the clip
    zeroed the gradients)."""
    nan = any(v != v for v in values)
    if not nan and (p.nan_only or (math.inf not in values and -math.inf not in values)):
        return False
    if nan and p.params is None:
        return True
    if not _finite_after_all(p):
        return True
    if p.params is not None and p.tensor is not None:
        _say_clip_overflowed(p)
    return False


_CLIP_OVERFLOW = "clip_grad_norm_ overflowed"  # (a key of SAID_ONCE)


def _say_clip_overflowed(p: Pending) -> None:
    """clip_grad_norm_'s total norm was Inf and every gradient is finite: the norm overflowed its dtype (float16
    gradients together above 65504, or float32 and bfloat16 ones of a diverging run), and the clip multiplied every
    gradient by max_norm / Inf = 0. Nothing is non-finite, so nothing raises; the batch taught nothing, silently, at
    every such step. Said once per guard (the failure path: each gradient is read)."""
    said = p.guard.states[SAID_ONCE]
    if _CLIP_OVERFLOW in said:
        return
    said.add(_CLIP_OVERFLOW)
    dtype = next(q.grad.dtype for q in p.params if q.grad is not None)
    name = str(dtype).removeprefix("torch.")
    if dtype == _torch.float16:  # (bfloat16 has float32's range)
        why = (f"clip_grad_norm_ computes the norm of {name} gradients in {name}, and gradients that are each finite "
               f"pass its largest value ({_torch.finfo(dtype).max:.4g}) together. Fix: keep float32 parameters and "
               "train under torch.autocast (with a GradScaler for float16): their gradients are float32.")
    else:
        why = (f"Its sum of squares can pass {name}'s largest value ({_torch.finfo(dtype).max:.2g}) once gradients "
               f"reach about {_torch.finfo(dtype).max ** 0.5:.1g}: gradients that large are a diverging run's (a "
               "learning rate too high, an exploding recurrence). Lower the learning rate, or find what grew.")
    warn_at_user(f"ampguard: clip_grad_norm_ returned an Inf total norm while every gradient was finite, so it "
                 "multiplied each gradient by max_norm / Inf = 0: this optimizer step ran on gradients of 0, and the "
                 "batch taught the model nothing (only momentum and weight decay, if any, moved the parameters). "
                 f"{why} Said once; it happens at every step where the norm overflows.")


def _gradients_set_to_none(window: list) -> bool:
    """Whether the loop cleared the gradients (``zero_grad()``, which sets them to None) since the backward() of the
    window's calls, with no step: it skipped that batch itself, and this is no next micro-batch. The first trained
    parameter of the window's first call tells: O(1), at a call that follows a backward() without a step."""
    for call in window:
        if type(call) is Call:
            module = call.module  # (None: a call without grad, whose module was dropped)
            for param in module.parameters() if module is not None else ():
                if param.requires_grad:
                    return param.grad is None
            return False
    return False


def _gradients_cleared(window: list) -> bool:
    """Whether no gradient is left of the window's calls: the loop that made a non-finite loss skipped that batch
    itself (``if not torch.isfinite(norm): optimizer.zero_grad(); continue``) before any step took its gradients,
    and the check is read at the next batch's call. Skip mode must not skip that clean batch's step then; gradient
    accumulation keeps the gradients, and its step is skipped. The failure path of skip mode only: it reads each
    gradient left (one zeroed with ``set_to_none=False``)."""
    for call in window:
        module = call.module if type(call) is Call else None
        if module is None:
            continue
        for param in module.parameters():
            grad = param.grad
            if grad is not None and bool(stored(grad.detach()).ne(0).any()):
                return False
    return True


def _made_at(p: Pending) -> float:
    """Where in the window the value of a failed sink was made: an output at its call, a loss at the op that made
    it; a gradient (or a value made outside the window) after all of them. Of the sinks that failed in one read, the
    one made first is reported: a metric called on the loss (MeanMetric drops the loss's NaN and divides 0 by 0) or
    an output read after it would otherwise be named in its place; a teacher's output made before the loss is."""
    if p.call is not None:
        return p.call.index if p.call.index >= 0 else math.inf
    ref = p.ref
    return ref.event if type(ref) is Ref and ref.event >= 0 else math.inf


def check_unscaled(g: _guard.Guard, settle: Any, streak: int, scale: float | None, lowest: float | None = None,
                   finite_at: list | None = None, confirmed: bool = False) -> None:
    """GradScaler skipped ``streak`` updates in a row: after this read's own checks, replay the backward
    at scale 1, and where a backward op is non-finite there, at ``lowest`` (see failure.unscaled). Non-finite at
    both, an op makes them non-finite at every scale GradScaler tries: raised where the skipped step before
    agreed (``confirmed``)."""
    __tracebackhide__ = True
    t = _here.state
    window, losses = t.window, t.losses  # a clean read rebinds them to new lists: these stay for the replay
    penalties = g.stats.penalty_overflows
    settle()  # a non-finite loss is reported as such first, with its forward op
    _clear_window()  # (if nothing of this feature was read, settle() left it)
    if _guard.current(FEATURE) is not g or g.options.trace == "off" or not window or \
            g.stats.penalty_overflows != penalties:
        return  # (a loss let through as a gradient penalty's overflow: no replay rescales the penalty, no verdict)
    _failure.unscaled(g, window, losses, streak, scale, lowest, finite_at, confirmed)


def _finite_after_all(p: Pending) -> bool:
    """An Inf status may be a sum of squares that overflowed: check exactly (failure path only). A status taken
    when its output was made holds no part: the output itself is checked, if it is still alive."""
    if p.params is not None:
        return all(finite(q.grad) for q in p.params if q.grad is not None)
    tensors = p.alive()
    if not tensors and p.status is not None:
        tensors = [p.tensor if isinstance(p.tensor, _Tensor) or p.tensor is None else p.tensor()]
    return all(t is not None and finite(t) for t in tensors)


def _clear_window() -> None:
    t = _here.state
    if t.tape is not None:
        end_tape(t)
    t.resume_tape = False
    t.window = []
    t.produced = {}
    t.calls = {}
    t.through = {}  # (passing stays: a DDP forward's window is read at its own outermost call's entry)
    t.stepping = False
    t.losses = []
    t.backward_since_read = False
    t.released = 0
    t.scaled = {}
    t.penalty = None
    t.transformed = False


def check() -> None:
    """Read every pending sink now (one sync, shared with anything else waiting)."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    t = _here.state
    if t.tape is not None:
        end_tape(t)  # the read's own ops are not the user's loss code
    if t.pending or t.agree is not None:  # (at a skip-mode step every rank reads: the flag)
        _sync.read([])[1]()  # (it ends the window too)
    elif t.window and _guard.current(FEATURE) is not None:
        # Nothing to read (an inference loop's finite outputs were read as they were made): the read would only end
        # the window, through every participant's bookkeeping, at each batch of an inference or evaluation loop.
        _clear_window()


def forget_calls() -> None:
    """The module calls open in this thread, as the hooks go off (their closing will not be seen)."""
    t = _here.state
    t.entry = None
    t.eager = False
    t.eager_stack = []


def drop(g: Any = None) -> None:
    """Forget the pending checks (of ``g``, or all) and the window: an exception is on its way."""
    t = _here.state
    t.pending = [p for p in t.pending if g is not None and p.guard is not g]
    t.clip = None
    t.poisoned = t.elsewhere = False  # a skip decided for a step that will not come
    _clear_window()


def settle(g: _guard.Guard, exiting_with_error: bool, leaving: BaseException | None = None) -> None:
    """At guard() exit or uninstall(): read what is still pending, unless an exception is leaving. That exception
    (``leaving``) carries the origin of a pending check that fails (see failure.explain)."""
    __tracebackhide__ = True
    t = _here.state
    if exiting_with_error or _torch is None:
        if leaving is not None and _torch is not None:
            _failure.explain(g, leaving)
        t.raised = None
        drop(g)
        return
    t.raised = None
    if any(p.guard is g for p in t.pending) and _guard.current(FEATURE) is g:
        check()
    drop(g)
