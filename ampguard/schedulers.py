"""GradScaler skip detection, LR-scheduler holding and loss-scale collapse detection.

Patch targets (each undone by the registry, which restores the exact original):

- ``GradScaler.step`` and overrides: after the original, remember which optimizer was
  stepped and the scaler's own per-device ``found_inf`` tensors for it. Nothing is read yet.
- ``GradScaler.update`` and overrides (``ShardedGradScaler.update``): *before* the original,
  which sums every ``found_inf`` into the first one in place and then discards them, read each
  optimizer's ``found_inf`` and the scale in one host-device transfer. That is the only sync
  ampguard adds, once per iteration, and only where a scaler is used. The optimizer was
  skipped exactly when its ``found_inf`` is non-zero: this is the scaler's own decision, so it
  is right for fused optimizers (whose ``step()`` runs and skips inside the kernel), for several
  optimizers on one scaler, for ``update(new_scale=...)`` and for a scale of 0, where comparing
  ``get_scale()`` before and after is not.
- ``LRScheduler.step`` and overrides: held (not executed) when its optimizer had at least one
  skipped step and no applied step since this scheduler's last executed step.

A skipped step leaves the optimizer as it was, except one of torch's: the first step of a fused SGD with momentum
stores momentum buffers that its kernel never wrote. ``update()`` takes them out (see :func:`_fresh_momentum`).

Two features: the GradScaler wrappers are ``SCALER``'s (on wherever a check needs its counts: the hold, the collapse
and unscaled checks, the non-finite checks' read), the scheduler's and the momentum fix are ``FEATURE``'s, the
``schedulers`` option.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any

from . import _guard, _sync
from ._errors import AmpGuardError, AmpGuardWarning, LossScaleCollapseError, NonFiniteError
from ._fallback import fail_safe, fall_back, internal_failure
from ._frames import warn_at_user
from ._guard import DEPTH, Guard
from ._patching import REGISTRY, Switch, Target

FEATURE = "schedulers"  # the hold of LR schedulers (LRScheduler.step)
SCALER = _guard.GRADSCALER  # GradScaler's bookkeeping: whatever the schedulers option, when a check needs it
_SMALLEST_NORMAL_FP32 = 2.0**-126


@dataclasses.dataclass
class OptimizerRecord:
    applied: int = 0
    skipped: int = 0
    scaler: weakref.ref | None = None  # the GradScaler that stepped it last (whose step() may not be read yet)
    ref: weakref.ref | None = None  # the optimizer, weakly (made once: each step's _PendingStep holds it)
    fresh_momentum_said: bool = False  # the notice of _say_fresh_momentum_undone, once per optimizer


@dataclasses.dataclass(slots=True)
class _PendingStep:
    optimizer: weakref.ref
    found_inf: list[Any]  # the scaler's per-device found_inf tensors for this optimizer
    ran: bool | None  # whether its step() ran, where that is the scaler's decision (non-fused): no read
    record: OptimizerRecord
    fresh: list | None  # a fused SGD's momentum buffers this step made: see _fresh_momentum


@dataclasses.dataclass
class ScalerRecord:
    pending: list[_PendingStep] = dataclasses.field(default_factory=list)
    iteration_skipped: list[str] = dataclasses.field(default_factory=list)  # optimizers skipped since update
    iteration_scale: float | None = None
    iteration_tracker: float = 0.0
    consecutive_skips: int = 0
    updates: int = 0  # tracked updates since the first, to tell a scale still calibrating
    # What the latest tracked update() left: (scale tensor, its version, tracker tensor, its version) and the
    # values update() computed from what was read. While both tensors are the same, unmodified, the next
    # iteration knows the scale and tracker without reading them (load_state_dict() or fill_() bump a version).
    after: tuple | None = None
    next: tuple[float, float] | None = None  # (scale, tracker) this update() makes, once predicted
    skipped_in_run: dict[str, None] = dataclasses.field(default_factory=dict)
    momentum_undone: list[OptimizerRecord] = dataclasses.field(default_factory=list)  # to be said after update()
    history: deque = dataclasses.field(default_factory=lambda: deque(maxlen=40))
    # what check_unscaled_after's latest replay found: [1.0] or [a scale below 1] (finite there), [None] (non-finite
    # at every scale tried), or [] (no verdict: no window, or the replay failed); None until a streak reaches it
    unscaled_finite_at: list | None = None
    penalty_now: bool = False  # a loss of this iteration was a gradient penalty's overflow (note_penalty_overflow)
    penalty_skips: int = 0  # of the skips in a row, those whose loss was


class _Tables:
    """This feature's per-object state, owned by one Guard."""

    def __init__(self) -> None:
        self.optimizers: _guard.ObjectState[OptimizerRecord] = _guard.ObjectState(
            lambda optimizer: OptimizerRecord(ref=weakref.ref(optimizer)))
        self.scalers: _guard.ObjectState[ScalerRecord] = _guard.ObjectState(lambda _: ScalerRecord())
        # (applied, skipped) of the scheduler's optimizer at the scheduler's last executed step
        self.snapshots: _guard.ObjectState[list] = _guard.ObjectState(lambda _: [0, 0])


TABLES = _guard.declare_state(FEATURE, _Tables)  # g.states[TABLES]


# -- GradScaler.step -----------------------------------------------------------------------
def _scaler_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    g = _guard.current(SCALER)
    if g is None or DEPTH.counts.get("scaler.step") or not getattr(instance, "_enabled", False):
        # GradScaler(enabled=False) (the GradScaler(enabled=use_amp) idiom) is no GradScaler: its step()
        # is a plain optimizer step, whose gradients the non-finite check reads before the update.
        return wrapped(*args, **kwargs)
    ran = _RAN
    ran.optimizer = None
    optimizer = args[0] if args else kwargs.get("optimizer")
    fresh = None
    try:
        if FEATURE in g._on:  # (documented with the schedulers option)
            fresh = _fresh_momentum(optimizer)
    except Exception as exc:
        internal_failure(SCALER, exc)
    result = DEPTH.outermost("scaler.step", wrapped, args, kwargs)
    try:
        _remember_step(g, instance, optimizer, ran.optimizer is optimizer, fresh)
    except Exception as exc:
        internal_failure(SCALER, exc)
    finally:
        ran.optimizer = None
    return result


class _Ran(threading.local):
    optimizer: Any = None  # the optimizer whose step() ran inside the open GradScaler.step() (post-step hook)


_RAN = _Ran()


def _decides_by_running(optimizer: Any) -> bool:
    """Whether GradScaler.step() runs this optimizer's step() exactly when found_inf is 0, and torch's
    post-step hooks see it run: then whether it ran is the scaler's decision, and nothing needs a read.
    Not for fused/capturable optimizers (they get found_inf and skip inside the kernel) or a step()
    replaced on the instance (other than by an LR scheduler's call tracker) or outside torch's hooked step."""
    # (isinstance first: an optimizer-like object may have no __dict__ for vars())
    if not isinstance(optimizer, sys.modules["torch.optim"].Optimizer) or \
            getattr(optimizer, "_step_supports_amp_scaling", False) or \
            not getattr(type(optimizer).step, "hooked", False):
        return False
    own = optimizer.__dict__.get("step")  # (the isinstance above: an Optimizer has a __dict__)
    return own is None or getattr(own, "_wrapped_by_lr_sched", False)


def _fresh_momentum(optimizer: Any) -> list | None:
    """Before a GradScaler step: the momentum buffers a fused step is about to make, as a list per param
    group of [(parameter, whether it had a state entry)], or None.

    torch's fused SGD takes a step as the first of a param group when none of its parameters with a gradient has a
    momentum buffer. It then makes the buffers with ``empty_like`` and leaves their initialisation to the kernel,
    which returns at once when GradScaler found inf/NaN gradients: the skipped step stores uninitialised memory as
    the momentum, and the first applied step adds it to the weights (a NaN, an Inf or a 1e31 from the allocator).
    An fp16 GradScaler skips its first steps while it calibrates, so this is the usual start of such a run. Found
    here (one membership test per group once the buffers exist); undone at update() if the step was skipped."""
    if not isinstance(optimizer, sys.modules["torch.optim"].SGD):  # (a GradScaler step: torch.optim is imported)
        return None
    made = []
    state = optimizer.state
    for group in optimizer.param_groups:
        if not group.get("fused") or not group.get("momentum"):
            continue
        params = []
        for p in group["params"]:
            if p.grad is None:
                continue
            entry = state.get(p)
            if entry is not None and entry.get("momentum_buffer") is not None:
                params = None  # (not the group's first step: the kernel reads its buffers, and skips leave them)
                break
            params.append((p, entry is not None))
        if params:
            made.append(params)
    return made or None


def _undo_fresh_momentum(optimizer: Any, fresh: list) -> None:
    """A skipped fused SGD step that made momentum buffers: take them out, so that the optimizer's state is what
    it was before the step, as after a skipped step of any other optimizer, and the first applied step makes them
    from its gradients."""
    state = optimizer.state
    for params in fresh:
        for p, had_entry in params:
            entry = state.get(p)
            if entry is None:
                continue
            entry.pop("momentum_buffer", None)
            if not entry and not had_entry:
                del state[p]


def _say_fresh_momentum_undone(g: Guard, record: ScalerRecord) -> None:
    """Once per optimizer, after update() has run: the same run without ampguard trains on uninitialised memory."""
    undone, record.momentum_undone = record.momentum_undone, []
    for opt_record in undone:
        optimizer = opt_record.ref() if opt_record.ref is not None else None
        if optimizer is None or opt_record.fresh_momentum_said:
            continue
        opt_record.fresh_momentum_said = True
        warn_at_user(
            f"ampguard: GradScaler skipped the first step of {g.name_of(optimizer)} (SGD with fused=True and "
            "momentum), and torch's fused SGD stores the momentum buffers of such a step uninitialised (made with "
            "empty_like, never written when the kernel skips). ampguard took them out, so the first applied step "
            "starts the momentum from its gradients, as SGD(fused=False) does. Without ampguard that step adds "
            "uninitialised memory to the weights. Fix: construct the SGD without fused=True.")


def _remember_step(g: Guard, scaler: Any, optimizer: Any, ran: bool, fresh: list | None) -> None:
    state = scaler._per_optimizer_states.get(id(optimizer))
    found = list(state["found_inf_per_device"].values()) if state else None
    if not found:
        return  # an optimizer with the legacy grad_scaler= contract decides for itself; not tracked
    t = g.states[TABLES]
    record = t.scalers.of(scaler)
    opt_record = t.optimizers.of(optimizer)
    if record.pending:  # several optimizers, or one stepped twice in an iteration: the latest step stands
        record.pending = [p for p in record.pending if p.optimizer() is not optimizer]
    record.pending.append(_PendingStep(opt_record.ref, found, ran if _decides_by_running(optimizer) else None,
                                       opt_record, fresh))
    owner = opt_record.scaler
    if owner is None or owner() is not scaler:
        opt_record.scaler = weakref.ref(scaler)


# -- GradScaler.update ---------------------------------------------------------------------
def _scaler_update(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g = _guard.current(SCALER)
    if g is None or DEPTH.counts.get("scaler.update") or not getattr(instance, "_enabled", False):
        return wrapped(*args, **kwargs)
    record = found = None
    try:
        record = _before_update(g, instance, args[0] if args else kwargs.get("new_scale"))
    except NonFiniteError as intended:
        # A sink read on this update's read failed. Raised once update() has run, so that the scaler ends its
        # iteration as it does without ampguard (found_inf backs the scale off; the next step() is allowed): a
        # loop that catches the error and rolls back can go on with the same scaler.
        found = intended
    except AmpGuardError as intended:
        raise intended.with_traceback(None) from None  # the traceback starts here: no ampguard frame below
    except Exception as exc:
        return fall_back(SCALER, exc, lambda: DEPTH.outermost("scaler.update", wrapped, args, kwargs))
    result = DEPTH.outermost("scaler.update", wrapped, args, kwargs)
    if record is not None and record.momentum_undone:
        _say_fresh_momentum_undone(g, record)  # (a warning turned into an error is the user's: raised from here)
    if found is not None:
        raise found.with_traceback(None) from None
    try:
        scale, tracker = instance._scale, instance._growth_tracker
        if record is not None and record.next is not None and scale is not None and tracker is not None:
            record.after = (scale, scale._version, tracker, tracker._version)
    except Exception as exc:
        internal_failure(SCALER, exc)
    return result


def _process_group(g: Guard) -> Any:
    """torch.distributed where ranks may have to agree on skips (the option on, a process group initialized)."""
    return _sync.process_group() if g.options.distributed else None


def _resolve(g: Guard, scaler: Any, record: ScalerRecord, extra: Any = None, failed: list | None = None) -> \
        float | None:
    """Read the pending optimizers' found_inf and the scale, in one transfer; count the steps.

    In a distributed run every rank's found_inf goes through one all-reduce first, so every rank
    takes the same decision, and ranks that disagree raise AmpGuardError together.
    Returns the value of ``extra`` (a tensor ``new_scale``) when one is given. With ``failed``, a
    NonFiniteError of a check that rode on the read is put there, not raised: the caller ends its
    bookkeeping first.
    """
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    pending, record.pending = record.pending, []
    if not pending and extra is None:
        return None
    failing: list[int] = []  # (in a distributed run) the ranks whose checks may fail at this read
    dist = _process_group(g) if pending else None
    ranks = _ranks(dist, scaler) if dist is not None else None
    found = _known(record, scaler, pending) if ranks is None and extra is None else None
    if found is not None:
        # Every optimizer's step() ran or not by the scaler's own decision, and the scale and tracker are
        # what the last update() made them: nothing of the scaler's to read (others' checks may still be).
        _, settle = _sync.read([])
        values, i = record.next, 0
    else:
        scale = scaler._scale
        gathered = None
        if ranks is None:
            own = [t for p in pending for t in p.found_inf]
        else:
            gathered = _sync.gather(flags=True)  # the other features' checks: their totals join the all-reduce
            own = [_all_ranks_skips(ranks, pending, scale.device, gathered[2])]
        own.append(scale)
        own.append(scaler._growth_tracker)  # with the scale: the scale after update() follows without a read
        if extra is not None:
            own.append(extra.detach().to(device=scale.device, dtype=scale.dtype).reshape(()))
        values, settle = _sync.read(own, scale.device, gathered)  # the one host-device sync of this iteration
        if ranks is None:
            found, i = [], 0
            for p in pending:
                found.append(sum(values[i:i + len(p.found_inf)]))
                i += len(p.found_inf)
        else:
            found, i = _agreed_skips(g, ranks, pending, values), ranks.world * len(pending)
            failing = _checks_that_may_fail(ranks, len(pending), values)  # (alike on every rank: the table's)
    stats = g.stats
    for p, found_inf in zip(pending, found):  # noqa: B905 (one each, as made above; strict= is a keyword call)
        optimizer = p.optimizer()
        if optimizer is None:
            continue
        opt_record = p.record
        if found_inf != 0:
            opt_record.skipped += 1
            stats.optimizer_steps_skipped += 1
            record.iteration_skipped.append(g.name_of(optimizer))
            if p.fresh:
                _undo_fresh_momentum(optimizer, p.fresh)
                record.momentum_undone.append(opt_record)
        else:
            opt_record.applied += 1
            stats.optimizer_steps_applied += 1
    if pending:
        record.iteration_scale = values[i]
        record.iteration_tracker = values[i + 1]
    streak = record.consecutive_skips + 1 if record.iteration_skipped else 0
    judge = settle  # the other features' checks that rode on this read; may raise NonFiniteError
    unscaled = False
    after = g.options.check_unscaled_after if streak else None
    if after is not None and after <= streak <= after + 1:
        # The failure path: are the gradients non-finite without any scaling, and at the lowest scale GradScaler
        # tries before the streak is stopped? Replayed at the check_unscaled_after-th skip, and at the next where
        # that replay found them so: one bad batch only skips, as without ampguard, so two batches in a row must
        # agree. (In a distributed run every rank replays both, as the verdicts are gathered alike on every rank.)
        confirm = streak > after and record.unscaled_finite_at == [None]
        unscaled = streak == after or confirm or ranks is not None
        sinks = sys.modules.get("ampguard.nonfinite.sinks")
        if unscaled and sinks is not None:
            record.unscaled_finite_at = []
            judge = functools.partial(sinks.check_unscaled, g, settle, streak, scale=record.iteration_scale,
                                      lowest=_lowest_scale(g, scaler, record.iteration_scale, streak),
                                      finite_at=record.unscaled_finite_at, confirmed=confirm)  # (settles first)
    if ranks is not None and (failing or unscaled):
        judge = _judged_together(ranks, judge, any(found))  # (the failure path, taken alike on every rank)
    try:
        judge()
    except NonFiniteError as exc:
        if failed is None:
            raise
        failed.append(exc)
    return values[-1] if extra is not None else None


def _lowest_scale(g: Guard, scaler: Any, scale: float | None, streak: int) -> float | None:
    """The lowest scale GradScaler tries in a streak of skips that has reached ``streak`` at ``scale``, before
    ampguard stops it: at max_consecutive_skips, or where the scale would fall below the smallest normal float32."""
    if scale is None:
        return None
    limit = g.options.max_consecutive_skips
    backoff = scaler._backoff_factor
    if not 0.0 < backoff < 1.0:
        return scale  # (a scale that never backs off: set_backoff_factor() takes any value)
    lowest = _fp32(scale * backoff ** max(limit - streak, 0)) if limit is not None else 0.0
    return max(lowest, _SMALLEST_NORMAL_FP32)


def _known(record: ScalerRecord, scaler: Any, pending: list[_PendingStep]) -> list[float] | None:
    """Each pending optimizer's found_inf where this iteration's skips, scale and tracker are known
    without a read (see ScalerRecord.after), else None."""
    after = record.after
    if after is None:
        return None
    scale, tracker = scaler._scale, scaler._growth_tracker
    if scale is not after[0] or scale._version != after[1] or tracker is not after[2] or tracker._version != after[3]:
        return None
    # update() sums the found_inf of every optimizer the scaler stepped or unscaled: all of them are pending
    states = scaler._per_optimizer_states
    if len(states) != len(pending):
        return None
    found = []
    for p in pending:  # (a loop, not any()/all(): this runs at every update())
        if p.ran is None or id(p.optimizer()) not in states:
            return None
        found.append(0.0 if p.ran else 1.0)
    return found


@dataclasses.dataclass(frozen=True)
class _Ranks:
    dist: Any
    group: Any  # the scaler's process group (ShardedGradScaler's), None for the default one
    rank: int
    world: int


def _ranks(dist: Any, scaler: Any) -> _Ranks | None:
    """In a distributed run (``dist``: torch.distributed, initialized), the process group whose ranks must agree,
    or None where there is one rank (or not every rank is guarded: then each rank decides alone, and none waits
    for a collective the others skip)."""
    group = getattr(scaler, "process_group", None)
    world = dist.get_world_size(group)
    if world <= 1 or not _every_rank_guarded(dist, group, world):
        return None
    return _Ranks(dist, group, dist.get_rank(group), world)


def _group_key(dist: Any, group: Any) -> tuple:
    """A process group as ampguard's records per group know it (with the default group's id: a new run's differs)."""
    return id(dist.distributed_c10d._get_default_group()), id(group)


def _group_members(dist: Any, group: Any, world: int) -> tuple[int, ...]:
    """The global ranks of ``group`` (of the default group: 0 to world - 1), the ones users see in their logs."""
    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))


def _default_store(dist: Any) -> Any:
    """The default process group's store, where ampguard's ranks leave each other words; None in a torch without
    one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _store_prefix(what: str, members: tuple[int, ...]) -> str:
    """Where in the process group's store ampguard keeps ``what`` for the group of ``members``."""
    return f"ampguard/{what}/{'-'.join(map(str, members[:64]))}/{len(members)}/"


HANDSHAKE_TIMEOUT_S = 60.0  # how long the first update() waits for the other ranks to say they are guarded
_handshakes: dict[tuple, bool] = {}


def _every_rank_guarded(dist: Any, group: Any, world: int) -> bool:
    """Once per process group, before ampguard's first collective: is every rank of it guarded?

    A rank started without the guard (a launcher that did not pass AMPGUARD=1 on) never joins
    ampguard's all-reduce, and the guarded ranks would wait in it forever. Each guarded rank counts
    itself in the group's store and waits up to HANDSHAKE_TIMEOUT_S for the others; the first rank to
    decide writes the verdict with an atomic compare-and-set, so every rank takes the same one, even
    a guarded rank that arrives after the timeout.
    """
    key = _group_key(dist, group)  # every update() asks: O(1) when known
    known = _handshakes.get(key)
    if known is not None:
        return known
    store = _default_store(dist)
    if store is None:  # a torch without it: trust that every rank is guarded, as before
        return True
    prefix = _store_prefix("handshake", _group_members(dist, group, world))
    arrived = int(store.add(prefix + "arrived", 1))
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while arrived < world and time.monotonic() < deadline:
        time.sleep(0.01)
        arrived = int(store.add(prefix + "arrived", 0))
    verdict = store.compare_set(prefix + "verdict", "", "all" if arrived >= world else "local")
    ok = verdict == b"all"  # Store.compare_set returns the value now stored, as bytes
    _handshakes[key] = ok
    if not ok:
        warn_at_user(
            f"ampguard: not every rank of this run is guarded: {arrived} of {world} ranks reached ampguard's first "
            f"decision within {HANDSHAKE_TIMEOUT_S:g} s. A rank started without the guard (a launcher that did not "
            "pass AMPGUARD=1 on) never joins ampguard's all-reduce, so every guarded rank now takes its GradScaler "
            "decisions alone, without a collective, and none waits for the others. Start every rank under "
            "AMPGUARD=1 or python -m ampguard (torchrun and Lightning pass the environment on) to have them agree.")
    return ok


def _all_ranks_skips(ranks: _Ranks, pending: list[_PendingStep], device: Any, totals: list) -> Any:
    """A (world, optimizers) tensor of every rank's found_inf sums: one tiny all-reduce, no host sync.

    The total of the rank's other checks that ride on this read (see _sync.gather) goes into its first sum times 0:
    nothing where it is finite, NaN where one of those checks may fail (a found_inf sum is never NaN). A column of
    its own would cost more than the op: gloo all-reduces 2 floats between 2 ranks in some 0.4 ms on this 2-core
    machine, and 4 in 0.9-1.4 ms."""
    import torch

    device = _sync.collective_device(ranks.dist, ranks.group, device)
    zero = torch.zeros((), device=device)
    mine = [sum((t.to(device).reshape(()) for t in p.found_inf), zero) for p in pending]
    for total in totals:
        if isinstance(total, torch.Tensor):
            mine[0] = mine[0] + total.to(device=device, dtype=zero.dtype) * 0
        elif total - total != 0.0:  # (a CPU rank's total, read already: no op where it is finite, the usual case)
            mine[0] = mine[0] + math.nan
    table = torch.zeros(ranks.world, len(pending), device=device)
    table[ranks.rank] = torch.stack(mine)
    ranks.dist.all_reduce(table, group=ranks.group)  # every rank's row lands everywhere
    return table


def _checks_that_may_fail(ranks: _Ranks, n: int, values: list[float]) -> list[int]:
    """The ranks whose first found_inf sum is NaN: their checks' total was not finite (see _all_ranks_skips)."""
    return [r for r in range(ranks.world) if values[r * n] != values[r * n]]


def _agreed_skips(g: Guard, ranks: _Ranks, pending: list[_PendingStep], values: list[float]) -> list[float]:
    """Per optimizer, whether every rank skipped; AmpGuardError on every rank if they disagree. A NaN sum (a rank
    whose checks may fail, which every rank then judges together) says nothing of that rank's skip: the others'
    decide it, or, with none left, it counts as a skip."""
    n = len(pending)
    found = []
    for j, p in enumerate(pending):
        per_rank = [values[r * n + j] for r in range(ranks.world)]
        skipped = [r for r, v in enumerate(per_rank) if v != 0 and v == v]
        applied = [r for r, v in enumerate(per_rank) if v == 0]
        if skipped and applied:
            raise _disagreement(g, ranks, p, skipped, applied)
        found.append(0.0 if applied else 1.0)
    return found


def _global_ranks(ranks: _Ranks, of_group: list[int]) -> list[int]:
    """The global ranks, the ones users see in their logs, of ranks in the scaler's group."""
    members = _group_members(ranks.dist, ranks.group, ranks.world)
    return [members[r] for r in of_group]


_KINDS = ("nan", "inf", "-inf")
_rounds: dict[tuple, int] = {}  # per process group: failure-path agreements so far (alike on every rank)


def _judged_together(ranks: _Ranks, judge: Any, skipped: bool) -> Any:
    """``judge``, after which every rank of the group knows whether any rank's checks failed, and raises if one did.

    A rank whose loss or output is non-finite raises its NonFiniteError at this update(), and so may one whose
    backward, replayed at scale 1 after ``check_unscaled_after`` skips, is non-finite. Alone, it would stop while
    the others went on into the next forward's or backward's collective and waited there for it: until the launcher
    killed them, or for the collective's timeout. Where that may happen (some rank's checks' total was not finite,
    or the skips reached check_unscaled_after: known alike on every rank), every rank judges its own checks and then
    all-reduces its verdict: the failure path's one more collective. A rank whose checks passed raises too, quoting
    the failed rank's message."""

    def judge_together() -> None:
        __tracebackhide__ = True
        mine: BaseException | None = None
        try:
            judge()
        except (AmpGuardError, AmpGuardWarning) as intended:
            mine = intended
        failed = _verdicts(ranks, mine)
        if mine is not None:
            raise mine
        if failed:
            raise _failed_elsewhere(ranks, failed, skipped)

    return judge_together


def _verdicts(ranks: _Ranks, mine: BaseException | None) -> dict[int, dict]:
    """Every rank's verdict (one more all-reduce): {global rank: what its error says of itself} for those that
    raise. The words go through the process group's store, the verdicts through the collective."""
    import json

    import torch

    dist = ranks.dist
    key = _group_key(dist, ranks.group)
    _rounds[key] = round_ = _rounds.get(key, 0) + 1
    members = _group_members(dist, ranks.group, ranks.world)
    prefix = f"{_store_prefix('failed', members)}{round_}/"
    store = _default_store(dist)  # (None: the other ranks' messages say less)
    said_here = False  # whether this rank's words are in the store: its verdict says so (2, else 1)
    if mine is not None and store is not None:
        try:
            store.set(prefix + str(ranks.rank), json.dumps(
                {"headline": str(mine).split("\n", 1)[0], "kind": getattr(mine, "kind", None),
                 "sink": getattr(mine, "sink", None)}))
            said_here = True
        except Exception:
            pass
    flags = torch.zeros(ranks.world, device=_sync.collective_device(dist, ranks.group, torch.device("cpu")))
    if mine is not None:
        flags[ranks.rank] = 2.0 if said_here else 1.0
    dist.all_reduce(flags, group=ranks.group)
    failed = {}
    for r, flag in enumerate(flags.tolist()):
        if flag and r != ranks.rank:
            said = {}
            if flag == 2.0:  # (only then: a get of a key never set waits for the store's timeout)
                try:
                    said = json.loads(store.get(prefix + str(r)))
                except Exception:  # (no store here)
                    pass
            failed[members[r]] = said
    return failed


def _failed_elsewhere(ranks: _Ranks, failed: dict[int, dict], skipped: bool) -> NonFiniteError:
    first, said = next(iter(failed.items()))
    which = f"rank {first}" if len(failed) == 1 else "ranks " + ", ".join(map(str, failed))
    lines = [f"ampguard: {which} stopped at this GradScaler.update() on a non-finite value. This rank's own checks "
             "were finite; it stops with them."]
    for rank, words in failed.items():
        if words.get("headline"):
            lines.append(f"  rank {rank}: {words['headline']}")
    lines.append(f"  {which}'s own message names the op and the line. Every rank raises here together, so that "
                 "none waits in a collective for a rank that has stopped.")
    lines.append("  This rank's GradScaler skipped the optimizer step (the parameters are unchanged): DDP and FSDP "
                 "reduce the gradients, so the non-finite gradients reached this rank too." if skipped else
                 "  Every rank's GradScaler applied its optimizer step: no gradient was non-finite.")
    kind = said.get("kind") if said.get("kind") in _KINDS else "nan"
    return NonFiniteError("\n".join(lines), kind=kind, sink=f"{said.get('sink') or 'a check'} on rank {first}")


def _disagreement(g: Guard, ranks: _Ranks, p: _PendingStep, skipped: list[int], applied: list[int]) -> AmpGuardError:
    optimizer = p.optimizer()
    name = g.name_of(optimizer) if optimizer is not None else "an optimizer"
    skipped, applied = _global_ranks(ranks, skipped), _global_ranks(ranks, applied)
    return AmpGuardError(
        f"ampguard: the ranks disagree on GradScaler's skip decision for {name}: rank(s) {skipped} skipped the step "
        f"(inf/NaN gradients) while rank(s) {applied} applied it.\n"
        "  The parameters have diverged across ranks: from here on every rank trains a different model, and the "
        "loss scales differ too.\n"
        "  This happens when found_inf is not all-reduced across ranks, for example ShardedGradScaler with a fused "
        "optimizer (its step() checks infs per device without an all-reduce), or a scaler whose gradients are not "
        "synchronised by DDP/FSDP.\n"
        "  Fix: use a non-fused optimizer with ShardedGradScaler (its unscale_(), which step() calls for them, "
        "all-reduces found_inf), then resume from the last checkpoint. If the ranks train independent models on "
        "purpose, install with distributed=False.")


def _before_update(g: Guard, scaler: Any, new_scale: Any) -> ScalerRecord:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    record = g.states[TABLES].scalers.of(scaler)
    # A check that rode on this iteration's read and failed (NonFiniteError) is raised once the iteration is
    # counted and its scale predicted: update() runs before the error reaches the user (see _scaler_update), and a
    # loop that catches it goes on with the scale, the skip count and the history as the scaler has them.
    failed: list = []
    if new_scale is not None and isinstance(new_scale, sys.modules["torch"].Tensor):
        new_value = _resolve(g, scaler, record, new_scale, failed)
    else:  # (the usual update(), without new_scale: no isinstance)
        new_value = None if new_scale is None else float(new_scale)  # (first: a value torch refuses counts nothing)
        _resolve(g, scaler, record, None, failed)
    record.after = record.next = None  # set again once this update() is done, if it was predicted

    scale = record.iteration_scale
    skipped, record.iteration_skipped = record.iteration_skipped, []
    record.iteration_scale = None
    if scale is None:  # update() without any tracked step this iteration
        if failed:
            raise failed[0]
        return record
    record.history.append(scale)
    record.updates += 1
    if skipped:
        record.consecutive_skips += 1
        record.skipped_in_run.update(dict.fromkeys(skipped))
        penalty, record.penalty_now = record.penalty_now, False
        record.penalty_skips = (record.penalty_skips if record.consecutive_skips > 1 else 0) + penalty
    else:
        record.consecutive_skips = 0
        if record.skipped_in_run:
            record.skipped_in_run.clear()

    # What update() computes (torch's _amp_update_scale_ kernel, in float32)
    tracker = record.iteration_tracker
    if new_value is not None:
        predicted = _fp32(new_value)  # written with fill_() into the float32 scale; the tracker is left as it is
    elif skipped:
        predicted, tracker = _fp32(scale * scaler._backoff_factor), 0.0
    elif tracker + 1 == scaler._growth_interval:
        grown = _fp32(scale * scaler._growth_factor)
        predicted = grown if math.isfinite(grown) else scale  # update() keeps the scale if growth overflows
        tracker = 0.0
    else:
        predicted, tracker = scale, tracker + 1
    # (each branch's value is a float32 one: the scale read from its float32 tensor, or rounded above)
    g.stats.note_scale(predicted)  # what get_scale() returns after this update(), as update() computes it
    record.next = (predicted, tracker)
    if failed:
        raise failed[0]
    if predicted - predicted != 0.0 or predicted < _SMALLEST_NORMAL_FP32:  # (not finite, or below: no call)
        raise _collapse(g, record, skipped, scale, predicted,
                        f"the loss scale would become {predicted:g}" +
                        (" (set through update(new_scale=...))" if new_value is not None else ""))
    limit = g.options.max_consecutive_skips
    if limit is not None and record.consecutive_skips >= limit:
        raise _collapse(g, record, skipped, scale, predicted,
                        f"GradScaler skipped the optimizer step {record.consecutive_skips} times in a row "
                        f"(max_consecutive_skips={limit})")
    return record


def note_penalty_overflow(g: Guard, scaler: Any) -> None:
    """A loss of this iteration was non-finite through a gradient penalty of ``scaler``'s scaled gradients, and left
    to it as their overflow (failure.scale_overflow): a collapse says so."""
    g.states[TABLES].scalers.of(scaler).penalty_now = True


def _fp32(x: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def _collapse(g: Guard, record: ScalerRecord, skipped: list[str], scale: float, predicted: float,
              what: str) -> LossScaleCollapseError:
    names = list(record.skipped_in_run) or skipped or ["(no optimizer skipped)"]
    history = list(record.history)
    shown = ", ".join(f"{s:g}" for s in history[-12:])
    message = (
        f"ampguard: loss-scale collapse: {what}.\n"
        f"  optimizer(s) whose steps were skipped: {', '.join(names)}\n"
        f"  loss scale, oldest to newest (last {min(len(history), 12)} updates): {shown}\n"
        f"  the next scale would be {predicted:g}; at 0 the unscaled gradients become NaN without GradScaler "
        "noticing, and the parameters turn NaN.\n"
        "  The parameters are still the last finite ones: nothing was applied from the overflowing steps.\n"
        + "\n".join(_causes(g, record, history)))
    return LossScaleCollapseError(message, optimizers=names, scale_history=history)


def _causes(g: Guard, record: ScalerRecord, history: list[float]) -> list[str]:
    """Only the causes that fit what ampguard saw: was the loss checked, is the scale still calibrating,
    did the scale-1 replay run."""
    mode = g.options.nonfinite if "nonfinite" in g._on else "off"
    goes_on = mode in ("warn", "skip")  # (these modes warn of what they find, and go on)
    warned = g.stats.nonfinite_detected if goes_on else 0
    checked = mode == "raise" or (goes_on and not warned)
    calibrating = record.consecutive_skips == record.updates  # no update since the first one let a step through
    unscaled = g.options.check_unscaled_after
    lines = ["  What ampguard saw:"]
    if calibrating:
        lines.append(f"    - every update since the first skipped ({record.consecutive_skips} of them): the scale may "
                     f"still be calibrating down from {history[0]:g} (a large init_scale). Then the fix is a "
                     "smaller init_scale, or a larger max_consecutive_skips.")
    if warned:
        lines.append(f"    - ampguard's non-finite check found {warned} non-finite value(s) in this run and went on "
                     f"(nonfinite='{mode}'): its warnings name the op and the line.")
    elif checked and record.penalty_skips:
        lines.append(f"    - at {record.penalty_skips} of these steps the loss was inf/NaN through a gradient penalty "
                     "taken of the scaled gradients (torch.autograd.grad of a value GradScaler scaled, with "
                     "create_graph=True). ampguard leaves that to GradScaler as their overflow, and no replay can "
                     "run the penalty at another scale. If it never settles, the penalty is inf/NaN at every scale "
                     "(a division by, or the log of, a gradient norm that is 0): compute it in float32 and guard "
                     "those ops.")
    elif checked:
        lines.append("    - the loss was finite at every one of these steps (ampguard checked it), so the forward "
                     "pass is not the cause and the parameters were finite.")
        replayed = unscaled is not None and record.consecutive_skips >= unscaled and g.options.trace != "off"
        verdicts = record.unscaled_finite_at  # (the latest replay's: see ScalerRecord)
        finite_at = verdicts[0] if verdicts else None
        if replayed and finite_at == 1.0:
            lines.append(f"    - replayed at scale 1 after {unscaled} skips, the gradients were finite: the overflow "
                         "happens only at the scales tried, in fp16 activations' gradients (they exceed 65504). "
                         "Fix: train in bf16 autocast (no GradScaler needed), or keep the largest activations in "
                         "float32.")
        elif replayed and finite_at is not None:
            lines.append(f"    - replayed after {unscaled} skips, the gradients overflowed even at scale 1, and were "
                         f"finite at scale {finite_at:g}: unscaled, fp16 activations' gradients exceed 65504 (a "
                         "loss summed over many elements, or weighted up), so GradScaler must run below 1. Fix: a "
                         "smaller loss (a mean, not a sum), bf16 autocast (no GradScaler needed), or the largest "
                         "activations in float32.")
        elif replayed and verdicts:  # [None]
            lines.append(f"    - an op whose gradients are inf/NaN whatever the scale (a custom autograd Function, "
                         f"sqrt or pow at 0): replayed after {record.consecutive_skips} skips, the gradients were "
                         "inf/NaN at every scale tried. ampguard names the op where the replays of two skipped steps "
                         "in a row agree (one bad batch only skips), and the run stopped before the second.")
        elif replayed:
            lines.append(f"    - an op whose gradients are inf/NaN whatever the scale (a custom autograd Function, "
                         f"sqrt or pow at 0): check_unscaled_after's replay after {unscaled} skips gave no verdict "
                         "(no module call with gradients was recorded, or the replay failed: see ampguard's log).")
        else:
            lines.append("    - an op whose gradients are inf/NaN whatever the scale (a custom autograd Function, "
                         "sqrt or pow at 0): check_unscaled_after (off or not reached here) replays the step at "
                         "scale 1 and names it.")
    else:
        lines.append("    - the forward pass may already overflow fp16 (an inf/NaN loss), or the parameters may be "
                     "inf/NaN: ampguard's non-finite check is off (nonfinite='raise' finds the op), or "
                     "torch.autograd.detect_anomaly.")
    if not calibrating:
        lines.append("    - a learning rate so high that training diverged.")
    return lines


# -- LRScheduler.step ----------------------------------------------------------------------
def _scheduler_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g = _guard.current(FEATURE)
    if g is None or DEPTH.counts.get("scheduler.step"):
        # Inside a scheduler step already: the inner schedulers of SequentialLR/ChainedScheduler,
        # or an override's super().step(). The outermost call has decided for all of them.
        return wrapped(*args, **kwargs)
    try:
        t = g.states[TABLES]
        optimizer = getattr(instance, "optimizer", None)
        opt_record = t.optimizers.get(optimizer) if optimizer is not None else None  # None: never through a scaler
        snapshot = t.snapshots.get(instance) if opt_record is not None else None
        hold = opt_record is not None and _should_hold(g, t, instance, opt_record, snapshot, args, kwargs)
    except AmpGuardError as intended:
        raise intended.with_traceback(None) from None  # the traceback starts here: no ampguard frame below
    except Exception as exc:
        internal_failure(FEATURE, exc)
        return wrapped(*args, **kwargs)
    if hold:
        g.stats.scheduler_steps_held += 1
        return None
    result = DEPTH.outermost("scheduler.step", wrapped, args, kwargs)
    if opt_record is not None:
        try:
            if snapshot is None:
                t.snapshots.set(instance, [opt_record.applied, opt_record.skipped])
            else:
                snapshot[0], snapshot[1] = opt_record.applied, opt_record.skipped
        except Exception as exc:
            internal_failure(FEATURE, exc)
    return result


def _should_hold(g: Guard, t: _Tables, scheduler: Any, opt_record: OptimizerRecord, snapshot: list | None,
                 args: tuple, kwargs: dict) -> bool:
    """Whether GradScaler skipped every step of the scheduler's optimizer since the scheduler's last step."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    scaler = opt_record.scaler() if opt_record.scaler is not None else None
    record = t.scalers.get(scaler) if scaler is not None else None
    if record is not None and record.pending and any(p.record is opt_record for p in record.pending):
        if _follows_no_count(scheduler, args, kwargs):
            return False
        # scheduler.step() before scaler.update(): decide now, from the same found_inf.
        _resolve(g, scaler, record)
    applied, skipped = snapshot or (0, 0)
    return opt_record.skipped > skipped and opt_record.applied == applied and \
        not _follows_no_count(scheduler, args, kwargs)


def _follows_no_count(scheduler: Any, args: tuple, kwargs: dict) -> bool:
    """A scheduler step that the count of optimizer steps does not drive: never held."""
    if isinstance(scheduler, sys.modules["torch.optim.lr_scheduler"].ReduceLROnPlateau):
        return True  # driven by a metric, not by the count of steps
    if kwargs.get("epoch") is not None or (args and args[0] is not None):
        return True  # an explicit epoch says where the schedule is; honour it
    return bool(getattr(scheduler, "_is_initial", False))  # the step a scheduler takes in its own constructor


class _Skipping(threading.local):
    optimizer: Any = None  # the optimizer whose step() nonfinite='skip' runs without gradients now


_SKIPPING = _Skipping()


def note_nonfinite_skip(g: Guard, optimizer: Any) -> None:
    """nonfinite='skip' runs ``optimizer``'s step() without gradients: a skipped step, as GradScaler's are,
    so its schedulers are held for it."""
    if _guard.current(SCALER) is not g:
        return
    g.states[TABLES].optimizers.of(optimizer).skipped += 1
    _SKIPPING.optimizer = optimizer


@fail_safe(SCALER)
def _optimizer_post_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A step taken outside GradScaler.step() changed the parameters: count it as applied."""
    g = _guard.current(SCALER)
    if g is None:
        return
    if DEPTH.counts.get("scaler.step"):  # (first: nonfinite='skip' never skips a step a GradScaler decides)
        _RAN.optimizer = optimizer  # the scaler let it run; counted at update()
        return
    if _SKIPPING.optimizer is optimizer:
        _SKIPPING.optimizer = None  # nonfinite='skip' took it: the parameters did not change
        return
    g.stats.optimizer_steps_applied += 1
    record = g.states[TABLES].optimizers.get(optimizer)
    if record is not None:
        record.applied += 1  # an optimizer that also goes through a scaler: its schedulers follow this step


def _switch_step_counter() -> Any:
    from torch.optim import optimizer as optim_module

    return optim_module.register_optimizer_step_post_hook(_optimizer_post_step).remove


REGISTRY.add_switch(Switch("torch", SCALER, _switch_step_counter, "count optimizer steps taken without a GradScaler"))

for _name, _wrapper, _why in (
    ("step", _scaler_step, "remember which optimizer was stepped and the scaler's found_inf for it"),
    ("update", _scaler_update, "read found_inf before update() consumes it; count skips; detect collapse; take "
     "out the uninitialised momentum a skipped first step of a fused SGD leaves"),
):
    REGISTRY.add(Target("torch", "torch.amp.grad_scaler:GradScaler", _name, _wrapper, _why, feature=SCALER))
REGISTRY.add(Target("torch", "torch.optim.lr_scheduler:LRScheduler", "step", _scheduler_step,
                    "hold the step when GradScaler skipped every optimizer step since the last one", feature=FEATURE))
