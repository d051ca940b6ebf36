"""The one host-device read per step that every feature's on-device checks share.

Features never call ``.item()``/``.tolist()`` themselves. Whoever needs values now (GradScaler
skip detection at ``update()``, the non-finite sinks at an optimizer step) calls :func:`read`;
every participant's waiting tensors ride on that same transfer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ._errors import AmpGuardError, AmpGuardWarning
from ._fallback import internal_failure

# (feature, collect, consume, total): collect() -> tensors waiting for a read (or OnHost values); consume(values) judges
# them; total(collected) -> a 0-dim tensor or a float, not finite where the checks may fail (or None: no total)
_participants: list[tuple[str, Callable[[], list], Callable[[list[float]], None], Any]] = []


class OnHost(list):
    """Values a participant read itself from CPU tensors (see :func:`on_host`)."""


# The CPU's own shortcuts: statuses read one by one where they are (on_host), taken as sums (sinks.sum_status), a
# few values read as Python floats (sinks.few_values_sum) and small gradients summed a buffer at a time
# (sinks._gradient_statuses). Tests turn it off to run the device path on a CPU.
HOST_READS = True


def on_host(statuses: list[Any]) -> OnHost | None:
    """The values of 0-dim ``statuses`` read one by one, if all are on the CPU (a Python float among them is a value
    read already: sinks.few_values_sum). A CPU read is no device sync, and on a small step each op that would make
    one tensor of them (a stack, then its read) costs more than the reads it saves: each op runs cold there, at some
    5-15 us."""
    if not HOST_READS:
        return None
    values = OnHost()
    for s in statuses:  # (one pass, no comprehension: at every step of a CPU loop without a GradScaler)
        if type(s) is float:
            values.append(s)
        elif s.is_cpu:
            values.append(s.item())  # (a CPU read: nothing is synced, whatever follows)
        else:
            return None
    return values


def host_value(scalar: Any) -> float | None:
    """The value of a one-element ``scalar`` read at once if it is on the CPU (see :func:`on_host`), else None."""
    return scalar.item() if HOST_READS and scalar.is_cpu else None


_available: list = []  # whether this torch build has torch.distributed, asked once (a property of the build)


def process_group() -> Any:
    """torch.distributed where its default process group is up, else None: whether ranks may have to agree (asked at
    every GradScaler update()), and whether a failure path may run a collective."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    if not _available:
        _available.append(bool(dist.is_available()))
    return dist if _available[0] and dist.is_initialized() else None


def distributed() -> bool:
    """Whether this run has more than one rank (a process group is up): a failure path there must run no
    collective alone, and a check must be read where every rank reads."""
    dist = process_group()
    return dist is not None and dist.get_world_size() > 1


def collective_device(dist: Any, group: Any, device: Any) -> Any:
    """Where a collective on ``group`` can reduce a tensor made on ``device``: NCCL reduces CUDA tensors only, so a
    CPU one goes to this rank's current CUDA device there; any other backend takes it where it is."""
    torch = sys.modules["torch"]
    if device.type == "cpu" and "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def participate(feature: str, collect: Callable[[], list], consume: Callable[[list[float]], None],
                total: Callable[[Any], Any] | None = None) -> Callable[[], None]:
    """Join the shared read; returns ``leave``. A feature joins while it is on (its switch calls both), so that a
    read where it is off calls nothing of its (as a wrapper of a feature that is off is not applied). A failure in
    ``collect``/``consume`` switches off ``feature`` only."""
    entry = (feature, collect, consume, total)
    members = _participants

    def leave() -> None:  # idempotent; from the list it joined, even where a test has put another in its place
        if entry in members:
            members.remove(entry)

    members.append(entry)
    return leave


def gather(flags: bool = False) -> tuple[list, list, list]:
    """Collect every participant's waiting tensors for a read: (the tensors to read after the caller's own, each
    participant's share of them as (feature, consume, offset from the first or -1 for OnHost, n or the values), and,
    with ``flags``, each participant's total). A total is not finite where that participant's checks may fail:
    ranks that must decide together all-reduce it before the read (schedulers._all_ranks_skips), in the same
    collective as their found_inf."""
    parts: list = []
    shares: list = []
    totals: list = []
    offset = 0
    for feature, collect, consume, total in _participants:
        try:
            tensors = collect()
        except Exception as exc:
            internal_failure(feature, exc)
            continue
        if flags and total is not None and (tensors or type(tensors) is OnHost):
            try:
                totals.append(total(tensors))
            except Exception as exc:
                internal_failure(feature, exc)
        if type(tensors) is OnHost:  # (even empty: the participant's consume() ends its step)
            shares.append((feature, consume, -1, tensors))
        elif tensors:
            n = 0
            for t in tensors:
                n += t.numel()
            shares.append((feature, consume, offset, n))
            offset += n
            parts.extend(tensors)
    return parts, shares, totals


def read(own: list[Any], device: Any = None, gathered: tuple[list, list, list] | None = None) -> \
        tuple[list[float], Callable[[], None]]:
    """Read ``own`` and every participant's waiting tensors (``gathered``, or gathered now) in one transfer (a
    participant's :class:`OnHost` values, read from CPU tensors, are handed back as they are).

    Returns the values of ``own`` (every element of each tensor, in order) and ``settle``, which
    hands each participant its values. ``settle`` may raise an intended error (NonFiniteError),
    so call it once the caller's own bookkeeping is done.
    """
    theirs, shares, _ = gather() if gathered is None else gathered
    parts = list(own)
    n_own = 0
    for t in parts:
        n_own += t.numel()
    parts.extend(theirs)
    if not parts and not shares:
        return [], _nothing
    values: list = []
    if len(parts) == 1:  # (usually the one status tensor of a step: read where it is, no cat)
        one = parts[0]
        dim = one.dim()  # (no reshape where none is needed: a view op costs as much as a small step's Python)
        values = one.tolist() if dim == 1 else [one.item()] if dim == 0 else one.reshape(-1).tolist()
    elif parts:
        if device is None:
            device = parts[0].device
        # cat promotes: float32 with the scaler's int32 growth tracker reads as float32, and a float64 part
        # (a finite float64 status may exceed float32) makes the whole read float64. No conversion op.
        flat = [t if t.device == device else t.to(device, non_blocking=True) for t in parts]
        values = sys.modules["torch"].cat([t if t.dim() == 1 else t.reshape(-1) for t in flat]).tolist()

    def settle() -> None:
        __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
        for feature, consume, start, n in shares:
            try:
                consume(values[n_own + start:n_own + start + n] if start >= 0 else n)  # (n: an OnHost share's values)
            except (AmpGuardError, AmpGuardWarning):
                raise
            except Exception as exc:
                internal_failure(feature, exc)

    return values[:n_own], settle


def _nothing() -> None:
    return None
