"""The failure path: re-run what produced a non-finite sink, op by op, and find where it began.

A replay re-runs the window, the outermost module calls and the loss code since the last read,
in order, with the same inputs, RNG state, autocast and grad mode. A TorchDispatchMode sees
every aten op, including those inside Python functionals (``F.multi_head_attention_forward``)
and, through the original module and ``set_stance("force_eager")``, inside compiled modules.
Each op records which kinds of non-finite values its output holds and which recorded ops
produced its inputs; the origin is found by walking back from the sink.

A replay leaves no trace: buffers are restored, the RNG state ends as it was, no graph or
reference survives it, no cast enters autocast's cache, parameters are never written. Where it is
unsafe (FSDP's collectives, SyncBatchNorm, a module with ``ampguard_replay = False``) the call is
not re-run, and says why.

Gradient sinks re-run the forward with autograd's anomaly metadata on, then the backward with
``torch.autograd.grad`` (``.grad`` is untouched) and a hook on every node: the first node that
turned finite incoming gradients into non-finite ones is the origin, named by its forward line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import re
import sys
import warnings
import weakref
from collections import UserDict
from collections.abc import Callable, Iterator
from copy import copy as shallow_copy
from typing import Any

from .. import _guard, _sync
from . import report, sinks, torchscript
from .sinks import Call, Ref, T, TapeOp

FRAMES = 40  # user frames kept per replayed op


class OpRecord:
    __slots__ = ("binary", "call", "constant", "divisor", "domain", "dtype", "event", "fn", "frames", "inputs",
                 "kinds", "largest", "leaves", "module", "name", "numbers", "ref", "root", "shape")

    def __init__(self, name: str, fn: Any, frames: tuple, module: Any, root: Any, inputs: tuple, leaves: tuple,
                 kinds: frozenset, ref: Any, shape: Any, dtype: Any, constant: bool, numbers: tuple) -> None:
        self.constant = constant  # depends on no parameter: data, buffers, masks and what is made of them
        self.root = root  # the replayed module the op ran in, for dotted names
        self.name = name  # the aten op, e.g. "aten.bmm"
        self.fn = fn  # the top-level torch function being replayed when the op ran, if any
        self.frames = frames
        self.module = module
        self.inputs = inputs  # indices of the records that produced its tensor inputs
        self.leaves = leaves  # (weakref, kinds, constant) of non-finite tensor inputs no replayed op produced
        self.kinds = kinds  # subset of {"nan", "inf", "-inf"} present in the output
        self.ref = ref
        self.shape = shape
        self.dtype = dtype
        self.numbers = numbers  # non-finite Python numbers among its arguments (x * float("nan"))
        self.event = -1  # the window event it ran in
        self.call = 0  # which top-level torch call ran it (Session.calls then): one number for a composite's ops
        # where it made ±Inf from finite inputs: its first tensor inputs and their largest |x| (see _largest)
        self.largest: tuple | None = None
        self.domain: tuple[float, float] | None = None  # where it made NaN outside its domain: its input's (min, max)
        # where a division made NaN from finite inputs (0/0): (weakref to the divisor, the record that made it or None,
        # its zeros, its elements)
        self.divisor: tuple | None = None
        # where a log made -Inf from finite inputs: whether its input held only 0s and 1s (log of a 0/1 mask, made on
        # purpose), not a magnitude, a count or a target probability that was 0
        self.binary: bool | None = None


class Session:
    """The ops of one replay, in the order they ran."""

    def __init__(self) -> None:
        self.records: list[OpRecord] = []
        self.producer: dict[int, tuple[Any, int]] = {}  # id(tensor) -> (weakref, record index)
        self.leaf_kinds: dict[int, tuple[Any, frozenset]] = {}
        self.cast_of: dict[int, tuple[Any, Any]] = {}  # id(a parameter's copy in another dtype) -> (it, the parameter)
        self.fn: Any = None  # the top-level torch function running now
        self.calls = 0  # top-level torch calls so far: the ops of one call share its number (OpRecord.call)
        self.frames: tuple | None = None  # recorded frames of the loss-code op being replayed
        self.stop: Any = None  # the code object at which frame walks stop (the replay driver)
        self.mapping: dict[int, Any] = {}  # id(input tensor from outside the window) -> its copy
        self.keep: list = []  # originals whose ids are keys of mapping, kept alive while it is used
        self.unreplayed: dict[int, str] = {}  # window event index -> why it was not re-run
        self.replayed: dict[tuple[int, Any], Any] = {}  # (event index, key) -> the replayed output
        self.node_event: dict[int, int] = {}  # id(autograd node the replay made) -> the window event that made it
        self.nodes: list = []  # those nodes, alive while the ids are used
        self.node_module: dict[int, tuple[Any, Any]] = {}  # id(output node of a module's torch call) -> (module, root)
        self.cloned: dict[int, str] = {}  # id(copy of a call's input) -> which input it is
        self.distributed = _sync.distributed()  # the other ranks are not replaying: no collective may run (Collective)
        self.collective: str | None = None  # why the backward replay stopped, if a collective stopped it
        # id(copy of an input) -> (which input, aten op, torch function, frames) of the first replayed op that wrote
        # into it in place: the original call wrote into the input itself, so the replay started from the written value
        self.written: dict[int, tuple] = {}
        self.site: tuple | None = None  # the user's frame that made the call being replayed
        self.alive: list = []  # non-finite outputs, kept for the report while the session lives
        self.event = -1  # the window event being replayed
        self.names = True  # replayed with torch-function naming (see run_window)
        self.stop_after: int | None = None  # a capture for a reproducer stops once this record is made

    def producer_of(self, tensor: Any) -> int | None:
        entry = self.producer.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def kinds_of_leaf(self, tensor: Any) -> frozenset:
        entry = self.leaf_kinds.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        found = kinds(tensor)
        self.leaf_kinds[id(tensor)] = (weakref.ref(tensor), found)
        return found

    def note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        torch = sinks._torch
        from torch.utils._pytree import tree_leaves

        outputs = [o for o in tree_leaves(out)  # (not a meta tensor: a nested tensor's jagged layout makes one)
                   if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex()) and not o.is_meta]
        if not outputs:
            return
        inputs, leaves = [], []
        constant = True
        numbers = []
        tensors = []  # its floating-point tensor inputs, for _largest
        name = _aten_name(func)
        op = name.partition(".")[2]
        overwritten = args[0] if op in sinks.OVERWRITE and args else None  # (its old value is not an input)
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, float) and not math.isfinite(t):
                numbers.append(t)
            elif t is overwritten:
                continue
            elif isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not t.is_meta:
                tensors.append(t)
                index = self.producer_of(t)
                if index is not None:
                    inputs.append(index)
                    constant = constant and self.records[index].constant
                    if t._base is not None:  # a view: an in-place write into its buffer since it was taken is read too
                        wrote = self.producer_of(t._base)
                        if wrote is not None and wrote > index:
                            inputs.append(wrote)
                            constant = constant and self.records[wrote].constant
                else:
                    leaf_constant = not (isinstance(t, torch.nn.Parameter) or t.requires_grad)
                    constant = constant and leaf_constant
                    found = self.kinds_of_leaf(t) if t.numel() else frozenset()
                    if found:
                        leaves.append((weakref.ref(t), found, leaf_constant))
        if self.frames is not None:
            frames = self.frames
        else:
            frames = _walk(sys._getframe(2), self.stop) + ((self.site,) if self.site is not None else ())
        root = T.replay_root
        module = _calling_module(sys._getframe(2), self.stop) if root is not None else None
        if module is None:
            module = root  # an op of the root's own forward (the replay calls it without _call_impl)
        fn = self.fn
        if fn is None:  # no Python-level torch call ran it: TorchScript may have (a script module or function)
            fn = torchscript.running(sys._getframe(2), module)
        written = op not in sinks.UNINITIALIZED  # (else: no op made its bits)
        schema = getattr(func, "_schema", None)
        mutable = schema is not None and schema.is_mutable
        made_by = (name, fn, frames, module, root, tuple(leaves), tuple(numbers))
        if mutable and self.cloned:
            self._note_written(outputs, name, frames)
        if name == "aten._to_copy" and tensors and isinstance(tensors[0], torch.nn.Parameter):
            for o in outputs:  # (autocast's copy of a weight: an overflow's input is named by its parameter)
                self.cast_of[id(o)] = (weakref.ref(o), weakref.ref(tensors[0]))
        made_inf = None  # the records of outputs this op made ±Inf in (rare: a list only then)
        for o in outputs:
            found = kinds(o) if o.numel() and written else frozenset()
            self._add(o, found, inputs, constant, made_by)
            if found & _INFS:
                made_inf = [*(made_inf or ()), self.records[-1]]
            if mutable and o._base is not None:
                self._wrote_into(o._base, found, inputs, constant, made_by)
        if (made_inf or (outputs and "nan" in self.records[-1].kinds)) and not leaves and not numbers and \
                not any(self.records[i].kinds for i in inputs):
            self._measure(op.rstrip("_"), tensors, made_inf)
        if self.stop_after is not None and len(self.records) > self.stop_after:
            raise Reached

    def _measure(self, op: str, tensors: list, made_inf: list | None) -> None:
        """The op made NaN or ±Inf from finite inputs: what its message tells of them. ±Inf: how large they were (an
        overflow, or a singularity), and a log's whether it took a 0/1 mask. NaN: a root's or log's input range, a
        division's divisor."""
        made = self.records[-1]
        if made_inf:
            largest = self._largest(tensors[:_LARGEST_OF])
            binary = measured(tensors[0], _binary) if _LOGS.fullmatch(op) and tensors else None
            for r in made_inf:
                r.largest, r.binary = largest, binary
        if "nan" in made.kinds and tensors:
            if op in _DOMAIN:
                made.domain = _range(tensors[0])
            if op in DIVISIONS and len(tensors) == 2:  # (x / y: a reciprocal or rsqrt has no divisor of its own)
                made.divisor = self._zeros_of(tensors[1])

    def _largest(self, tensors: list) -> tuple:
        """An op made ±Inf from finite inputs: how large its inputs were, to tell a result that passed its dtype's
        largest value (an overflow) from a singularity (log(0), x/0). Only such ops: the failure path.
        ((weakref to the parameter or tensor it is, views or was cast from, the record that made it or None, its
        largest |x|, whether it holds a 0), ...)"""
        found = []
        for t in tensors:
            size = _largest_abs(t)
            if size is None:
                continue
            base = t._base if t._base is not None else t  # (weight.t() in a linear: its parameter names it)
            cast = self.cast_of.get(id(base))
            if cast is not None and cast[0]() is base and cast[1]() is not None:
                base = cast[1]()
            found.append((weakref.ref(base), self.producer_of(t), *size))
        return tuple(found)

    def _zeros_of(self, tensor: Any) -> tuple | None:
        """(weakref, the record that made it or None, its zeros, its elements) of a division's divisor, where the
        division made NaN from finite inputs: which of its values were 0, and what made them. The failure path."""
        zeros = measured(tensor, _zeros)
        return (weakref.ref(tensor), self.producer_of(tensor), *zeros) if zeros and zeros[0] else None

    def _note_written(self, outputs: list, name: str, frames: tuple) -> None:
        """An in-place op wrote into a copy of a call's input (or a view of one): the call writes into its input."""
        for o in outputs:
            for t in (o, o._base):
                if t is not None and id(t) in self.cloned and id(t) not in self.written:
                    self.written[id(t)] = (self.cloned[id(t)], name, self.fn, frames)

    def _add(self, tensor: Any, found: frozenset, inputs: list, constant: bool, made_by: tuple) -> None:
        """The record of ``tensor``, holding ``found``, as made by the op ``made_by`` (name, the torch function it ran
        inside, frames, module, root, leaves, numbers) from the records ``inputs``; what reads ``tensor`` from now on
        reads this record."""
        name, fn, frames, module, root, leaves, numbers = made_by
        if found and len(self.alive) < 4096:
            self.alive.append(tensor)
        record = OpRecord(name, fn, frames, module, root, tuple(inputs), leaves, found, weakref.ref(tensor),
                          sinks.shape_of(tensor), tensor.dtype, constant, numbers)
        record.event = self.event
        record.call = self.calls
        self.producer[id(tensor)] = (weakref.ref(tensor), len(self.records))
        self.records.append(record)

    def _wrote_into(self, base: Any, brought: frozenset, inputs: list, constant: bool, made_by: tuple) -> None:
        """An in-place op wrote ``brought`` (the kinds of the view it wrote) into a view of ``base``
        (``buffer[:, :n].copy_(x)``, how padding, packing and caches fill a buffer): what reads ``base`` from now on
        reads this write, and the writes before it. Made in the replay, the buffer holds what its writes brought,
        not what its unwritten part holds (``torch.empty``'s memory may hold the NaN bits of a freed tensor)."""
        if not (base.is_floating_point() or base.is_complex()):
            return
        previous = self.producer_of(base)
        if previous is not None:
            self._add(base, brought | self.records[previous].kinds, [*inputs, previous],
                      constant and self.records[previous].constant, made_by)
        else:  # (from outside the replay: read as it is now)
            self._add(base, kinds(base) if base.numel() else frozenset(), inputs, constant, made_by)


_INFS = frozenset(("inf", "-inf"))
_LARGEST_OF = 4  # inputs measured: a matmul's two and a bias, say
DIVISIONS = frozenset(("div", "divide", "true_divide", "reciprocal", "rsqrt"))  # (aten names)
# ops NaN outside their domain: below 0 (a root, a log, a fractional power of a negative base), outside [-1, 1]
_DOMAIN = frozenset(("sqrt", "rsqrt", "log", "log2", "log10", "pow", "acos", "asin", "arccos", "arcsin"))


def measured(tensor: Any, measure: Callable[[Any], Any]) -> Any:
    """``measure`` of the values a tensor stores (a sparse tensor's values, a complex one's parts), outside the
    replay's own record, or None where it stores none. The failure path only: each reads the device."""
    with sinks._torch._C.DisableTorchFunction():
        values = sinks.stored(tensor.detach())
        return measure(values) if values.numel() else None


def _range(tensor: Any) -> tuple[float, float] | None:
    """(min, max) of an op's first input where the op made NaN from finite inputs outside its domain, to tell a
    value that rounding took past the bound from one far past it."""
    found = measured(tensor, lambda v: None if v.is_complex() else tuple(map(float, sinks._torch.aminmax(v.float()))))
    return found if found and math.isfinite(found[0]) and math.isfinite(found[1]) else None  # (written over in place)


def _largest_abs(tensor: Any) -> tuple[float, bool] | None:
    """(the largest |x| of a tensor, whether it holds a 0), to tell an overflow from a singularity."""
    return measured(tensor, lambda v: (float(v.abs().amax()), bool((v == 0).any())))


_LOGS = re.compile(r"log(2|10)?")


def _binary(values: Any) -> bool:
    """Whether a tensor holds only 0s and 1s (a mask, before a log made -Inf of its 0s)."""
    return bool(((values == 0) | (values == 1)).all())


def _zeros(values: Any) -> tuple[int, int]:
    """(zeros, elements): where a division's divisor or a singular op's saved input was 0."""
    return int((values == 0).sum()), values.numel()


def kinds(tensor: Any) -> frozenset:
    """Which of NaN, +Inf and -Inf a tensor holds (failure path: reads the device)."""
    torch = sinks._torch
    with torch._C.DisableTorchFunction():
        t = sinks.stored(tensor.detach())  # (a sparse tensor's values, a complex one's parts)
        if bool(torch.isfinite(t).all()):
            return frozenset()
        found = set()
        if bool(torch.isnan(t).any()):
            found.add("nan")
        if bool(torch.isposinf(t).any()):
            found.add("inf")
        if bool(torch.isneginf(t).any()):
            found.add("-inf")
        return frozenset(found)


def _aten_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or str(func)
    namespace = getattr(func, "namespace", "aten")
    return f"{namespace}.{name}"


def _walk(frame: Any, stop: Any) -> tuple:
    out = []
    while frame is not None and len(out) < FRAMES:
        if frame.f_code is stop:
            break
        out.append((frame.f_code, frame.f_lasti))  # as the normal path records them: see _frames.line_at
        frame = frame.f_back
    return tuple(out)


def _modes(session: Session) -> Any:
    torch = sinks._torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Checker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if session.distributed:
                _refuse_collective(func)
            out = func(*args, **(kwargs or {}))
            session.note(func, args, kwargs or {}, out)
            return out

    class Names(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            outer, session.fn = session.fn, func if session.fn is None else session.fn
            if outer is None:
                session.calls += 1
            try:
                out = func(*args, **(kwargs or {}))
            finally:
                session.fn = outer
            if outer is None and T.replay_root is not None:
                _claim_module(session, out, sys._getframe(1))
            return out

    return Checker(), Names()


# -- unsafe calls --------------------------------------------------------------------------
def unsafe(call: Call) -> str | None:
    """Why re-running this call could harm the run, or None."""
    module = call.module
    if module is None:
        return None  # (dropped: nothing to re-run; the replay says so)
    module = getattr(module, "_orig_mod", module)
    for m in module.modules():
        if getattr(m, "ampguard_replay", True) is False:
            return f"module '{type(m).__name__}' opts out (ampguard_replay = False)"
        names = {c.__name__ for c in type(m).__mro__}
        flat = any(getattr(p, "_fsdp_flattened", False) for p in m.parameters(recurse=False))  # FSDP1's inner module
        if names & {"FullyShardedDataParallel", "FSDPModule"} or flat:
            return ("it runs FSDP's collectives in its forward; re-running it on one rank would hang the others. "
                    + _eager_advice(": it names the op under FSDP, in a slower run"))
        if "SyncBatchNorm" in names and m.training and _sync.distributed():
            return "SyncBatchNorm all-reduces in its forward; re-running it on one rank would hang the others"
    return None


def _eager_advice(gain: str) -> str:
    """Where no replay can run: what trace='eager' would check (and ``gain``), or, in a run under it, what it did."""
    g = _guard.current(sinks.FEATURE)
    if g is not None and g.options.trace == "eager":
        return "This run's trace='eager' checked each op of the forward for NaN as it ran, and none made one"
    return "trace='eager' (AMPGUARD_TRACE=eager) checks each op as it runs, with no replay" + gain


# -- running the window ----------------------------------------------------------------------
@contextlib.contextmanager
def untouched(window: list) -> Iterator[None]:
    """Buffers, the modules' own attributes and RNG states exactly as they were afterwards; the normal path stands
    aside. Attributes: a forward that counts its calls (``self.calls += 1``), or keeps what it computed
    (``self.last_attention = weights``, for logging), would otherwise be left counting the replay, or holding
    the replay's tensor and its graph in place of the user's."""
    torch = sinks._torch
    roots = {id(m): m for m in (c.module for c in window if type(c) is Call) if m is not None}
    saved = [(b, b.detach().clone()) for m in roots.values() for b in m.buffers()]
    modules = {id(m): m for root in roots.values() for m in root.modules()}
    metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)  # its state: tensors and lists it updates
    attributes = [sinks.kept(m, metric is not None and isinstance(m, metric)) for m in modules.values()]
    cpu = torch.default_generator.get_state()
    # A generator of the model's own (noise drawn with generator=self.gen) or given to a call: the replay draws from it
    # too, and a run that goes on (check_unscaled_after's replay) drew other numbers from it afterwards.
    generators = {id(v): v for m in modules.values() for v in vars(m).values() if type(v) is torch.Generator}
    generators.update((id(v), v) for c in window if type(c) is Call for v in (*_flat(c.args), *_flat(c.kwargs))
                      if type(v) is torch.Generator)
    generator_states = [(gen, gen.get_state()) for gen in generators.values()]
    python_rng = random.getstate()  # (a forward that draws with Python's or NumPy's global RNG: random.random())
    numpy = sys.modules.get("numpy")
    numpy_rng = numpy.random.get_state() if numpy is not None else None
    cuda = None
    if torch.cuda.is_initialized():
        cuda = [g.get_state() for g in torch.cuda.default_generators]
    # Compiled code runs eagerly, so its ops are seen. Without dynamo loaded nothing is compiled, and
    # importing it here would cost seconds on the failure path.
    stance = torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules and \
        hasattr(torch.compiler, "set_stance") else contextlib.nullcontext()
    # A replay at a module call inside the user's autocast region (a late read) would leave its casts of the weights
    # in that region's cache, for the user's forward to take: an activation-checkpointed region then recorded no
    # cast, and its recomputation in backward, which casts, failed torch's check that it repeats the forward.
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    T.replaying += 1
    _guard.replay_counted(1)
    outer_root, T.replay_root = T.replay_root, None
    try:
        with stance, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a replay repeats warnings the user has seen already
            yield
    finally:
        T.replaying -= 1
        _guard.replay_counted(-1)
        T.replay_root = outer_root
        torch.set_autocast_cache_enabled(cache)
        for restore in attributes:
            restore()
        with torch.no_grad():
            for b, copy in saved:
                if b.shape == copy.shape:
                    b.copy_(copy)
        torch.default_generator.set_state(cpu)
        if cuda is not None:
            for g, state in zip(torch.cuda.default_generators, cuda, strict=False):
                g.set_state(state)
        for gen, state in generator_states:
            gen.set_state(state)
        random.setstate(python_rng)
        if numpy_rng is not None:
            numpy.random.set_state(numpy_rng)


def _flat(value: Any) -> tuple:
    """The items of a recorded call's arguments (a tuple or a dict), one level down."""
    return tuple(value.values()) if isinstance(value, dict) else tuple(value or ())


_CALL_IMPL: Any = None


def _calling_module(frame: Any, stop: Any) -> Any:
    """The module whose call is innermost on the stack: the ``self`` of the nearest Module._call_impl.

    Read from the stack, not kept by hooks: a module's own forward hooks run inside its _call_impl, so
    their ops are its own; and the replay attaches nothing, since hooks on a module make torch skip
    its fused fast paths (an eval-mode TransformerEncoderLayer's)."""
    global _CALL_IMPL
    if _CALL_IMPL is None:
        _CALL_IMPL = sinks._torch.nn.Module._call_impl.__code__
    while frame is not None and frame.f_code is not stop:
        if frame.f_code is _CALL_IMPL:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


class Reached(Exception):
    """A capture replay made the record it was looking for (see Session.stop_after)."""


COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})  # torch.distributed's ops' namespaces


class Collective(Exception):
    """A collective met by a replay in a distributed run (an all-reduce in a model's forward, or in a backward, as
    tensor parallelism's gradient all-reduce is). Only this rank replays: run here, the collective would pair with
    another rank's unrelated one, mixing their data, or wait for one forever. Raised before it runs."""

    @property
    def reason(self) -> str:
        return (f"it runs a collective ({self}), which one rank cannot re-run alone: the other ranks are not "
                "replaying, so it would pair with one of their own collectives or wait for one forever. "
                + _eager_advice(""))


def _refuse_collective(func: Any) -> None:
    """Raise :class:`Collective` if the aten-level op ``func`` is one of torch.distributed's, before it runs."""
    if getattr(func, "namespace", None) in COLLECTIVES:
        raise Collective(_aten_name(func))


def _no_collectives() -> Any:
    """A dispatch mode for the backward replay that stops at the first collective (see :class:`Collective`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoCollectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _refuse_collective(func)
            return func(*args, **(kwargs or {}))

    return NoCollectives()


class Freed(Exception):
    """An input of a recorded call that the user no longer held: ampguard keeps no tensor alive. ``advice``: what to
    do to have it replayed, where the usual advice (keep the batch) does not fit."""

    advice = ("ampguard keeps no tensor alive past your last reference, so keep the batch referenced until the "
              "check (at the optimizer step; for a call under no_grad, such as evaluation or prediction, at the next "
              "call of the same module) to have it replayed")

    def __init__(self, message: str, advice: str | None = None) -> None:
        super().__init__(message)
        if advice is not None:
            self.advice = advice


def _map(session: Session, value: Any, clone: bool, where: str = "an input", items: bool = False) -> Any:
    """``value`` for the replay: a tensor's copy (``clone``) or replayed counterpart, containers mapped through.
    ``where`` names it in messages; with ``items``, an item of a container is named by its index, key or field (a
    call's argument: "argument 0 of the call of 'M', field 'mask'"; not the loss code's op arguments)."""
    torch = sinks._torch
    if isinstance(value, Ref):
        if value.event >= 0 and (value.event, value.key) in session.replayed:
            return session.replayed[(value.event, value.key)]
        original = value.ref()
        if original is None:
            if value.event >= 0 and value.event in session.unreplayed:
                raise Freed(f"{where} comes from a call that was not replayed "
                            f"({session.unreplayed[value.event]})")
            if value.event == sinks.RELEASED:
                raise Freed(f"{where} was freed before the check: it is an earlier micro-batch of a step that "
                            "accumulates gradients, whose checks are read together at the step (on a device, in one "
                            "sync; in a distributed run, where every rank decides together)",
                            "to have it replayed, keep the micro-batches referenced until the step, or run without "
                            "accumulation (accumulate_grad_batches=1) while you look for it")
            if value.event == sinks.UNSEEN:
                raise Freed(f"{where} was made, from tensors with grad, by code that ampguard's record did not see, "
                            "and freed before the check (code below the record: a TorchScript module's method, a C++ "
                            "extension's function, or code that ran before the step's first model call)",
                            "keep that tensor referenced until the check (at the optimizer step) to have the rest "
                            "replayed from it; the code that made it cannot be replayed")
            raise Freed(f"{where} was freed before the check")
        value = original
    if isinstance(value, torch.Tensor):
        mapped = session.mapping.get(id(value))
        if mapped is not None:
            return mapped
        if clone and not isinstance(value, torch.nn.Parameter):
            copy = value.detach().clone().requires_grad_(value.requires_grad) if value.is_leaf or \
                not value.requires_grad else value.detach().clone()
            session.mapping[id(value)] = copy
            session.keep.append(value)
            session.cloned[id(copy)] = where
            return copy
        return value
    if isinstance(value, tuple):
        mapped = [_map(session, v, clone, _part(where, items, f"item {i}"), items) for i, v in enumerate(value)]
        return sinks._remade(value, mapped) if hasattr(type(value), "_fields") else tuple(mapped)
    if isinstance(value, list):
        return [_map(session, v, clone, _part(where, items, f"item {i}"), items) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _map(session, v, clone, _part(where, items, f"item {k!r}"), items) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # (a batch with ``ids`` and ``mask`` fields: the replay names a field's NaN as the data's, and writes into no
        # tensor of the user's)
        fields = [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]
        mapped = [(name, _map(session, v, clone, _part(where, items, f"field {name!r}"), items)) for name, v in fields]
        return value if all(m is v for (_, v), (_, m) in zip(fields, mapped, strict=True)) else _with(value, mapped)
    if isinstance(value, UserDict):  # (Hugging Face's BatchEncoding: a tokenizer's batch)
        return _with(value, [("data", _map(session, value.data, clone, where, items))])
    return value


def _part(where: str, items: bool, part: str) -> str:
    return f"{where}, {part}" if items else where


def _with(value: Any, attributes: list[tuple[str, Any]]) -> Any:
    """A shallow copy of ``value`` with ``attributes`` set (a frozen dataclass's too); ``value`` itself where its class
    refuses the copy or the attributes: the replay then reads its tensors as they are."""
    try:
        made = shallow_copy(value)
        for name, v in attributes:
            object.__setattr__(made, name, v)
    except Exception:
        return value
    return made


def _map_call(session: Session, call: Call, label: str) -> tuple[tuple, dict]:
    args = tuple(_map(session, a, True, f"argument {i} of the call of '{label}'", True)
                 for i, a in enumerate(call.args))
    kwargs = {k: _map(session, v, True, f"argument {k!r} of the call of '{label}'", True)
              for k, v in call.kwargs.items()}
    return args, kwargs


def _autocast(state: tuple | None) -> contextlib.ExitStack:
    torch = sinks._torch
    stack = contextlib.ExitStack()
    wanted = dict(state or ())
    for device in sinks._autocast_devices:
        if device in wanted:
            stack.enter_context(torch.autocast(device, dtype=wanted[device]))
        elif torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def _set_rng(rng: tuple) -> None:
    torch = sinks._torch
    cpu, cuda = rng
    torch.default_generator.set_state(cpu)
    if cuda is not None and torch.cuda.is_initialized():
        torch.cuda.default_generators[cuda[0]].set_state(cuda[1])


def run_window(session: Session, window: list, names: bool = True) -> None:
    """Re-run every call and loss-code op of the window in order, under the session's checker.

    ``names=False`` replays at the dispatch level only: a TorchFunctionMode makes torch take its slow
    paths (``has_torch_function`` is true under one), so a fused fast path (an eval-mode
    TransformerEncoder's ``_transformer_encoder_layer_fwd``) only runs as it did without it."""
    checker, named = _modes(session)
    if not names:
        named = contextlib.nullcontext()
    session.stop = run_window.__code__
    session.names = names
    for index, event in enumerate(window):
        session.event = index
        try:
            _run_event(session, event, index, checker, named)
        except Freed as freed:
            session.unreplayed[index] = f"{freed}: {freed.advice}"
        except Collective as collective:
            session.unreplayed[index] = collective.reason


def _run_event(session: Session, event: Any, index: int, checker: Any, names: Any) -> None:
    torch = sinks._torch
    if type(event) is Call:
        reason = unsafe(event)
        if reason is not None:
            session.unreplayed[index] = reason
            return
        module = event.module
        if module is None:
            raise Freed(f"module '{event.module_name}', called without grad, was freed before the check",
                        "ampguard holds a module called without grad (evaluation, prediction) no longer than you do: "
                        "keep it referenced until the check (the next call of the same module) to have the call "
                        "replayed")
        module = getattr(module, "_orig_mod", module)
        args, kwargs = _map_call(session, event, torchscript.class_name(module))
        _set_rng(event.rng)
        grad = torch.inference_mode() if event.inference else torch.set_grad_enabled(event.grad)
        state = contextlib.nullcontext()
        if event.swapped is not None:  # under torch.func.functional_call: the tensors it put in, as they were
            from torch.nn.utils.stateless import _reparametrize_module

            state = _reparametrize_module(module, _map(session, event.swapped, False, "a tensor functional_call "
                                                       f"put in '{type(module).__name__}'"))
        T.replay_root = module
        session.site = (event.site[0], event.site[1]) if event.site else None
        try:
            with grad, _autocast(event.autocast), state, names, checker:
                # Through nn.Module.__call__, as the user's call went, so that the module's own hooks run (a forward
                # hook that post-processes the output, a pre-hook that normalises the input); ampguard's see a replay
                # and stand aside. Not through a __call__ the class overrides: the arguments were recorded past it.
                out = torch.nn.Module.__call__(module, *args, **kwargs) if event.method is None else \
                    getattr(module, event.method)(*args, **kwargs)  # (training_step under a strategy)
        finally:
            T.replay_root = None
            session.site = None
        _map_outputs(session, index, out)
        _claim_nodes(session, index, out)
    else:
        op: TapeOp = event
        where = "an input of the loss code"
        try:
            args = _map(session, op.args, True, where)
            kwargs = _map(session, op.kwargs, True, where)
        except Freed as freed:  # (which op it was given to, and where)
            own, user_site, _ = report.sites(op.frames, op.func)
            site = user_site or own
            at = f" at {site[0]}:{site[1]}" if site is not None else ""
            freed.args = (str(freed).replace(where, f"{where} (given to {report.op_name(op.func)}{at})", 1),)
            raise
        if op.func is torch.autograd.grad:
            args, kwargs = _retaining(args, kwargs)
        session.frames = op.frames
        try:
            with torch.set_grad_enabled(op.grad), _autocast(op.autocast), names, checker:
                out = sinks.written_output(op.func, args, op.func(*args, **kwargs))
        finally:
            session.frames = None
        _map_outputs(session, index, out)
        _claim_nodes(session, index, out)


def _retaining(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """torch.autograd.grad's arguments with retain_graph=True. In the loss code it is a gradient penalty, or a loop's
    own backward (it sets .grad from what grad returns): the backward replay runs through that graph again, which the
    replayed grad would otherwise have freed. The values it returns are the same."""
    if len(args) > 3:  # grad(outputs, inputs, grad_outputs, retain_graph, ...)
        return (*args[:3], True, *args[4:]), kwargs
    return args, {**kwargs, "retain_graph": True}


def grad_loss(session: Session, window: list) -> Any:
    """The replayed loss that the last torch.autograd.grad of the loss code without create_graph took, or None: the
    loss of a loop that computes its gradients itself, where the loss sink did not take it (a tensor subclass)."""
    torch = sinks._torch
    for event in reversed(window):
        if type(event) is not TapeOp or event.func is not torch.autograd.grad:
            continue
        outputs, create_graph = sinks.autograd_grad_call(event.args, event.kwargs or {})
        if create_graph:
            continue  # a gradient penalty: part of the loss, not the step's backward
        refs = [outputs] if isinstance(outputs, Ref) else \
            [o for o in outputs if isinstance(o, Ref)] if isinstance(outputs, (tuple, list)) else []
        for ref in refs:
            loss = replayed_ref(session, ref)
            if loss is not None:
                return loss
    return None


def _claim_module(session: Session, out: Any, frame: Any) -> None:
    """The module whose torch call made each output's autograd node, for naming a backward origin. Only the
    call's own output nodes: a composite call's inner nodes (log_softmax's inside cross_entropy) stay unnamed,
    which is better than a guess."""
    root = T.replay_root
    module = None
    for t, _ in sinks.made_within(out):
        node = t.grad_fn
        if node is None or id(node) in session.node_module:
            continue
        if module is None:
            module = _calling_module(frame, session.stop) or root
        session.node_module[id(node)] = (module, root)
        session.nodes.append(node)


def _claim_nodes(session: Session, index: int, out: Any) -> None:
    """Every autograd node this event made: from its outputs back to the nodes earlier events made.
    A backward origin is then named at the event's own line (the loss code's, or the model call's)
    rather than at the replay's stack."""
    torch = sinks._torch
    outs = [out] if isinstance(out, torch.Tensor) else [t for t, _ in sinks.made_within(out)]
    stack = [t.grad_fn for t in outs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in session.node_event:
            continue
        session.node_event[id(node)] = index
        session.nodes.append(node)
        stack.extend(n for n, _ in node.next_functions)


def event_frames(session: Session, window: list, node_id: int, parsed: tuple) -> tuple:
    """The frames to name a backward origin by: a loss-code op's recorded frames; for a node made inside
    a module call, its forward stack down to the model, then the user's call of the model."""
    index = session.node_event.get(node_id)
    if index is None or index >= len(window):
        return parsed
    event = window[index]
    if type(event) is TapeOp:
        return event.frames
    inner = []
    for frame in parsed:  # innermost first; the replay's own frames start at _run_event
        if frame[2] == "_run_event" and frame[0].endswith("replay.py"):
            break
        inner.append(frame)
    return (*inner, event.site) if event.site else tuple(inner)


def _map_outputs(session: Session, index: int, out: Any) -> None:
    if isinstance(out, sinks._torch.Tensor):
        session.replayed[(index, 0)] = out
        return
    for t, k in sinks.made_within(out):
        session.replayed[(index, k)] = t


def replayed_output(session: Session, event: Any, key: Any) -> Any:
    return session.replayed.get((event.index, key))


def replayed_ref(session: Session, ref: Ref) -> Any:
    """The replayed counterpart of a recorded tensor, if its event was replayed."""
    return session.replayed.get((ref.event, ref.key)) if ref.event >= 0 else None


# -- walking back ------------------------------------------------------------------------------
_ORDER = ("nan", "inf", "-inf")


def primary(found: frozenset) -> str | None:
    return next((k for k in _ORDER if k in found), None)


def walk(session: Session, start: int) -> dict:
    """From the record at ``start`` back along non-finite inputs to the op that created the value.

    From a NaN or +Inf, an input that holds only -Inf and depends on no parameter (an attention
    mask, however it was reshaped or cast) is not followed: masks hold -inf on purpose, and
    ``finfo.min`` becomes -inf in fp16. A -Inf made from the parameters (``log(0)``) is followed, and so is a log(0)
    of data that held 0s among other values (see _a_mask).
    Nor is a mask followed from the masked scores on the way back from a NaN (-Inf only where
    masked: a mask added, ``scores + mask``, or written, ``scores.masked_fill(pad, -inf)``): when
    masks are all the -Inf those scores hold, the op that turned them NaN (a softmax over a fully
    masked row) is the origin, and not the line that built the causal mask, which every step has.
    (A masked -Inf that reached the loss as +Inf, a target whose class is masked, is still
    followed to the mask that made it.)
    Produced inputs are preferred to inputs that entered from outside, and the input of the same
    kind to one of another.
    """
    records = session.records
    path = [start]
    current = start
    transition = None
    masks: list = []
    entered = None
    seen = {start}
    only_minus = frozenset({"-inf"})
    under = None  # (the NaN record walked from, the transition before it) while the walk follows a -Inf from it
    while True:
        rec = records[current]
        here = primary(rec.kinds)
        produced = [i for i in rec.inputs if i not in seen and records[i].kinds]
        leaves = list(rec.leaves)
        masking = here in ("nan", "inf")
        if masking or (under is not None and rec.kinds == only_minus and not rec.constant):
            found = len(masks)
            masks.extend(("record", i) for i in produced if _a_mask(records, i))
            produced = [i for i in produced if not _a_mask(records, i)]
            if masking:
                masks.extend(("leaf", leaf) for leaf in leaves if leaf[1] == only_minus and leaf[2])
                leaves = [leaf for leaf in leaves if not (leaf[1] == only_minus and leaf[2])]
            elif not produced and not leaves and (len(masks) > found or masks_here(rec)):
                # -Inf only where a mask made it: added (``scores + mask``) or written here (``masked_fill(m, -inf)``)
                if len(masks) == found:
                    masks.append(("record", current))
                current, transition = under
                del path[path.index(current) + 1:]
                break
        if produced:
            nxt = _best(produced, here, lambda i: records[i].kinds)
            under = (current, transition) if here == "nan" else under if here == "-inf" else None
            if here not in records[nxt].kinds:
                transition = current
            seen.add(nxt)
            path.append(nxt)
            current = nxt
            continue
        if leaves:
            entered = leaves[0]
        break
    path.reverse()
    return {"origin": current, "transition": transition, "path": path, "masks": masks, "entered": entered}


def _a_mask(records: list, i: int) -> bool:
    """Whether record ``i`` holds a mask: -Inf only, depending on no parameter, and not made by a log of data that
    was 0 (a magnitude, a count, a target probability: log(0) of those is the cause, not a mask). A log of a 0/1
    mask is a mask, as any other -Inf is that its op did not make at a singularity (a Python -inf written in, a
    cast of finfo.min to fp16)."""
    rec = records[i]
    if rec.kinds != frozenset({"-inf"}) or not rec.constant:
        return False
    for _ in range(32):  # back through what carried the -Inf (views, casts, a sum with other masks)
        carried = next((j for j in rec.inputs if records[j].kinds == rec.kinds), None)
        if carried is None:
            break
        rec = records[carried]
    return rec.binary is not False


def masks_here(rec: OpRecord) -> bool:
    """Whether the op wrote -Inf given as a Python number, and no other non-finite number: a mask written into the
    scores (``scores.masked_fill(pad, -inf)``, ``torch.where(keep, scores, -inf)``)."""
    return bool(rec.numbers) and all(n == -math.inf for n in rec.numbers)


def _best(candidates: list, here: str | None, kinds_of: Any) -> Any:
    for kind in ((here,) if here else ()) + _ORDER:
        for c in candidates:
            if kind in kinds_of(c):
                return c
    return candidates[0]


# -- backward --------------------------------------------------------------------------------
_TRACEBACK_LINE = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+), in (?P<func>.+)')


def backward_origin(session: Session, loss: Any, params: list) -> dict | None:
    """Run the backward of a replayed ``loss`` with a hook on every node; the first node whose
    incoming gradients were finite and whose outgoing ones are not, with its forward stack."""
    torch = sinks._torch
    found: dict = {}
    handles = []
    nodes = _nodes(loss.grad_fn)

    for node in nodes:
        def hook(grad_inputs: tuple, grad_outputs: tuple, node: Any = node) -> None:
            if found:
                return
            outgoing = [g for g in grad_inputs if g is not None]
            incoming = [g for g in grad_outputs if g is not None]
            bad = [kinds(g) for g in outgoing]
            if any(bad) and not any(kinds(g) for g in incoming):
                stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
                made = frozenset().union(*bad)
                found.update(node=node.name(), kinds=made, frames=_parse(stack or []),
                             node_id=id(node), function=getattr(node, "_forward_cls", None),
                             saved=_saved_non_finite(node, "nan" in made), zeros=_saved_zeros(node),
                             incoming=None if "nan" in made else _largest_incoming(incoming, outgoing, bad))

        handles.append(node.register_hook(hook))
    inputs = [p for p in params if p.requires_grad]
    grads: tuple = ()
    try:
        if inputs:  # (the graph retained: a hook reads the node's saved forward values after it ran)
            with _no_collectives() if session.distributed else contextlib.nullcontext():
                grads = torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=True)
    except Collective as collective:
        session.collective = collective.reason
    finally:
        for h in handles:
            h.remove()
    if found or session.collective is not None:
        return found or None
    for param, grad in zip(inputs, grads, strict=True):  # every op's backward stayed finite: a hook on the tensor?
        bad = kinds(grad) if grad is not None else frozenset()
        hooks = getattr(param, "_backward_hooks", None)
        if bad and hooks:
            return {"hook": list(hooks.values()), "param": param, "kinds": bad}
    return None


def _largest_incoming(incoming: list, outgoing: list, bad: list) -> tuple | None:
    """A node made only ±Inf from finite gradients: (their largest |x|, the dtype of the gradient it made Inf), to
    tell an overflow (an fp16 gradient above 65504) from a singularity (sqrt's at 0)."""
    sizes = [size[0] for size in map(_largest_abs, incoming) if size is not None]
    dtype = next(g.dtype for g, k in zip(outgoing, bad, strict=True) if k)
    return (max(sizes), dtype) if sizes else None


def _saved_non_finite(node: Any, made_nan: bool) -> frozenset:
    """Which of NaN, +Inf and -Inf the forward values the node saved for its backward hold: then finite gradients
    became non-finite by meeting them (0 x NaN), and the value came from the forward. -Inf alone counts only where
    the node made NaN (0 x -Inf): p * log(p) at a masked p of 0, which a torch.where hid from the loss. Where it made
    ±Inf only, a -Inf it saved is a mask's, and the node's own singularity is the likelier cause."""
    met = frozenset().union(*(kinds(t) for _, t in _saved(node)))
    return met if made_nan or met - {"-inf"} else frozenset()


def _saved_zeros(node: Any) -> list[tuple[str, int, int]]:
    """(name, zeros, elements) of each floating value the node saved that holds exact zeros: where the gradient of a
    sqrt, log, rsqrt or fractional power is unbounded, the replay's measure of the singularity it met."""
    if node.name().startswith("PowBackward"):
        exponent = getattr(node, "_saved_exponent", None)
        if not (isinstance(exponent, (int, float)) and exponent < 1):
            return []  # a pow is singular at 0 for a power below 1 only (a tensor's power is not judged)
    found = []
    for name, t in _saved(node):
        zeros = measured(t, _zeros)
        if zeros and zeros[0]:
            found.append((name, *zeros))
    return found


def _saved(node: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of each non-empty floating tensor an autograd node saved for its backward (``_saved_self`` is
    "self"; a saved list's tensors each under its name)."""
    torch = sinks._torch
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                value = getattr(node, name)
            except RuntimeError:  # (freed, or saved in a form without a Python view)
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and sinks.floating_tensor(t):
                    yield name.removeprefix("_saved_"), t


def first_made(session: Session) -> int | None:
    """The first replayed forward op whose output holds NaN or +Inf, if any (-Inf alone is a mask's)."""
    return next((i for i, rec in enumerate(session.records) if rec.kinds - {"-inf"}), None)


def hid(session: Session, start: int, sink: int) -> list[int]:
    """The replayed ops on the sink's path that took the non-finite value made at ``start`` (or one made from it) and
    returned finite values: ``nan_to_num``, ``torch.where``, a boolean index, a saturating ``tanh``. They are why the
    sink stayed finite while the backward met the value. Failure path."""
    records = session.records
    on_path, stack = set(), [sink]
    while stack:
        i = stack.pop()
        if i not in on_path:
            on_path.add(i)
            stack.extend(records[i].inputs)
    carried, found = {start}, []
    for i in range(start + 1, sink + 1):
        rec = records[i]
        if not any(j in carried for j in rec.inputs):
            continue
        if rec.kinds:
            carried.add(i)
        elif i in on_path and (rec.dtype.is_floating_point or rec.dtype.is_complex):  # (isnan's mask hides nothing)
            found.append(i)
    return found


def _nodes(root: Any) -> list:
    out, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() != "torch::autograd::AccumulateGrad":
            out.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return out


def _parse(stack: list) -> tuple:
    """format_stack() lines as (filename, lineno, function) tuples, innermost first."""
    out = []
    for entry in stack:
        m = _TRACEBACK_LINE.search(entry)
        if m:
            out.append((m["file"], int(m["line"]), m["func"].strip()))
    out.reverse()
    return tuple(out)


@contextlib.contextmanager
def anomaly_metadata() -> Iterator[None]:
    """Every node made inside records its forward stack, as detect_anomaly does, without its checks."""
    torch = sinks._torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.set_detect_anomaly(True, check_nan=False):
            yield
