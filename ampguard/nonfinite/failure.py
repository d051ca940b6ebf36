"""A sink failed: replay what produced it, and write the error for the person reading it at 2 a.m."""

from __future__ import annotations

import inspect
import logging
import math
import re
import sys
import weakref
from typing import Any

from .. import _guard, _sync
from .._errors import AmpGuardError, AmpGuardWarning, NonFiniteError
from .._frames import warn_at_user
from ..lints import eps_message
from . import replay, report, repro, sinks, torchscript
from .sinks import Call, Pending, T

WARNED = _guard.declare_state("nonfinite_warned", set)  # warn and skip modes: the keys reported once

log = logging.getLogger("ampguard")

_CAUSES = ("  Common causes under AMP: log/div of 0 or of a value that saturated in fp16; an activation above "
           "65504 in fp16; a collapsing loss scale; Adam's eps rounding to 0 in fp16.")
_LATE = ("  Read at this module call: no optimizer step came between that loss's backward() and this forward "
         "(gradient accumulation, or a loop that skipped the step), so its check was read here, and the origin above "
         "is the previous batch's. If your loop skips non-finite batches itself, nonfinite='skip' does that for you: "
         "ampguard skips the step and the run goes on.")
_LATE_CLEARED = ("  Read at this module call: no optimizer step came between that loss's backward() and this forward, "
                 "and no gradient of it is left (your loop skipped that batch itself, with zero_grad()): no step "
                 "took what it made, so none is skipped.")
_NOT_REPRODUCED = ("  Replayed from the same inputs, RNG state, autocast and grad mode, {what} stayed finite: the "
                   "value did not reproduce. Causes: {first}a nondeterministic kernel, state that the first call "
                   "changed (a cache, a counter, an input updated in place), or a transient hardware fault.")
# A gradient that the replayed backward makes finite was most often changed after backward(): by code that writes to
# .grad (gradient surgery, noise, a manual all-reduce or rescale), which no replay of the forward and backward sees.
_CHANGED_AFTER = ("code that changed the gradient after backward() and before the step (a write to .grad or "
                  ".grad.data, gradient surgery or noise, a manual all-reduce or rescale), ")
_BACKWARD_NOT_REPRODUCED = _NOT_REPRODUCED.format(what="the replayed backward", first=_CHANGED_AFTER)
_FROM_ANOTHER_RANK = ("  Replayed from the same inputs, RNG state, autocast and grad mode, this rank's own backward "
                      "stayed finite: the value came into its gradients from outside it. This is a distributed run: "
                      "DDP/FSDP all-reduce gradients, so another rank's non-finite gradients reach this rank's too. "
                      "That rank's message names the origin. If no rank reports one, the value did not reproduce: "
                      "look for " + _CHANGED_AFTER + "a nondeterministic kernel, or a transient hardware fault.")
_FORWARD_MADE = "  The forward made it:"  # a backward node met a non-finite value its forward saved (0 x NaN)
_FORWARD_MET = "  The forward met it:"  # ... one that entered the forward non-finite (the data, a parameter)
_OVERFLOWED = "  Its incoming gradients were finite, up to"  # a backward node's gradients passed their dtype's largest


def _forward_made(lines: list[str]) -> bool:
    """Whether _replay_backward's lines name a forward value (see _made_in_forward), not a backward op."""
    return bool(lines) and lines[0].startswith((_FORWARD_MADE, _FORWARD_MET))


def _overflowed(lines: list[str]) -> str | None:
    """The dtype that _replay_backward's lines say the gradients overflowed, if they say so (see _overflow_lines)."""
    line = next((line for line in lines if line.startswith(_OVERFLOWED)), None)
    return line.rpartition(" overflowed ")[2].partition(" ")[0] if line is not None else None


def _backward_made(lines: list[str], scaled: bool = False) -> str:
    """What the loss-was-finite line says made the gradients non-finite, where a backward op did; ``scaled``: under
    a GradScaler (its replay without scaling)."""
    dtype = _overflowed(lines)
    if dtype is None:
        return "the backward pass made it. Look for ops with unbounded gradients (sqrt or pow at 0, log near 0, " \
            "division by a small value, the torch.where trick)"
    if scaled:
        return f"the backward pass overflowed {dtype} even unscaled (above). Make the loss smaller (a mean, not a " \
            "sum; a smaller weight), or train under bf16 autocast (no GradScaler needed)"
    return f"the backward pass overflowed {dtype} (above). Make the loss smaller (a mean, not a sum; a smaller " \
        "weight), or keep the parameters in float32 and train under autocast with a GradScaler, which scales the " \
        "gradients to fit"


def fail(g: _guard.Guard, p: Pending) -> None:
    """Count, explain and raise (or warn once per sink and module) for the failed sink ``p``."""
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    g.stats.nonfinite_detected += 1
    window, losses, transformed, penalty = T.window, T.losses, T.transformed, T.penalty
    T.pending = [q for q in T.pending if q.guard is not g]
    sinks._clear_window()
    # (the class held weakly: a set that lasts as long as the guard would keep it, and with it the globals of the
    # script that defined it; a weak reference equals another to the same class, never one to a class since gone)
    module = p.call.module if p.call is not None else None
    of = weakref.ref(type(module)) if module is not None else p.call.module_name if p.call is not None else None
    if not _first_time(g, (p.sink, of)):
        return  # warn mode replays once per sink and module
    T.repro_origin = None
    T.transformed = transformed  # (the window's, for the message, while it is built)
    try:
        error = sinks.outside_compile(build)(g, p, window, losses)
    except (AmpGuardError, AmpGuardWarning):
        raise
    except Exception as exc:  # the explanation failed, the detection did not: still report it
        log.error("ampguard: the replay of a non-finite %s failed", p.sink, exc_info=exc)
        error = _plain(p, [f"  (ampguard could not replay it: {type(exc).__name__}: {exc}; see the 'ampguard' "
                           "log. What the sinks know follows.)"])
    finally:
        T.transformed = False
    # a loss whose backward() no optimizer step followed (not an op trace='eager' found)
    if T.late and p.call is None and p.params is None and type(p) is not sinks.Found:
        error.add_line(_LATE_CLEARED if T.cleared else _LATE)
    T.cleared = False
    if penalty is not None and p.ref is not None:  # (a loss, in a window with a gradient penalty)
        try:
            line = _applied_all_the_same(g, p, penalty, window)
        except Exception as exc:  # (the failure path's replay: the error goes out as it is)
            log.debug("ampguard: the replay of a gradient penalty's loss failed", exc_info=exc)
            line = None
        if line is not None:
            error.add_line(line)
    if g.options.repro_dir is not None:
        repro.attach(g, error, window)
    emit(g, error)


def explain(g: _guard.Guard, error: BaseException) -> None:
    """An error of the user's code, or of torch's (a distribution's parameter check, ``multinomial``'s probabilities),
    is leaving while a check of ``g`` waits for its read: the NaN often reached that code before the read did. The
    checks are read now, and where one fails, ``error`` carries its message as a note (Python 3.11 on) or, where it
    has no cause or context of its own, as its cause. The error itself leaves unchanged. Where none fails and the
    error came out of an outermost call (a forward that builds ``Normal(mu, std)`` from a NaN), that call is
    replayed, and the first op in it that made a NaN (else an Inf) is named the same way. Not for control flow (an
    iterator's end), nor where the read could harm: an interrupt or an exit, an out-of-memory error (a replay would
    allocate again), a run whose ranks read together (this rank alone would wait in the read's collective), warn
    and skip modes (their warning would meet a filter that makes it an error, in place of the user's)."""
    raised, T.raised = T.raised, None
    try:
        if not_explained(error) or g.options.nonfinite != "raise" or sinks._read_by_every_rank(g) or \
                _guard.current(sinks.FEATURE) is not g:
            return
        if any(p.guard is g for p in T.pending):
            sinks.check()
        if raised is not None and raised.is_from(error):  # (kept only where trace is on: see sinks._keep_raised)
            found = sinks.outside_compile(_raised_origin)(g, raised)
            if found is not None:
                _note(error, found, "\nampguard replayed the call that raised the error above:")
    except NonFiniteError as found:
        _note(error, found, "\nThe error above came after a value ampguard was about to check:")
    except Exception as exc:  # (the user's error leaves as it came)
        log.debug("ampguard: the pending checks could not be read as an error left", exc_info=exc)


def not_explained(error: BaseException) -> bool:
    """An error that :func:`explain` leaves alone whatever is pending: not an Exception (an interrupt, an exit),
    ampguard's own, control flow (an iterator's end), an out-of-memory error (a replay would allocate again)."""
    torch = sinks._torch
    if not isinstance(error, Exception) or \
            isinstance(error, (AmpGuardError, AmpGuardWarning, StopIteration, StopAsyncIteration)) or \
            isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    try:
        return "out of memory" in str(error)
    except Exception:  # (an error whose __str__ fails: left as it came)
        return True


def _note(error: BaseException, found: NonFiniteError, lead: str) -> None:
    found.__traceback__ = None
    if hasattr(error, "add_note"):
        error.add_note(f"{lead}\n{found}")
    elif error.__cause__ is None and error.__context__ is None:
        error.__cause__ = found


def _raised_origin(g: _guard.Guard, raised: sinks.Raised) -> NonFiniteError | None:
    """Replay the window up to the call that raised, and that call until it raises again; the first op that made a
    NaN (else a +Inf: -Inf alone is a mask's), traced back to its origin, or None where none did."""
    call = raised.call
    window = [*raised.window[:call.index], call]
    session = replay.Session()
    with replay.untouched(window):
        try:
            replay.run_window(session, window)
        except Exception as again:  # (the call raising again, as it did: what ran before it is recorded)
            log.debug("ampguard: the call that raised raised again in its replay", exc_info=again)
    records = session.records
    start = next((i for i, rec in enumerate(records) if "nan" in rec.kinds), replay.first_made(session))
    if start is None:
        return None
    module = call.module_name if call.method is None else f"{call.module_name}.{call.method}"
    p = sinks.Pending(g, f"call of '{module}' that raised it", False, [], None, call)
    kind = replay.primary(records[start].kinds) or "nan"
    found = _origin_error(g, p, session, window, replay.walk(session, start), kind, [],
                          head=f"ampguard: {report.kind_word(kind)} was made in the call of '{module}' before it "
                               "raised.")
    T.repro_origin = None  # (no bundle: the error is the user's, not a NonFiniteError raised)
    return found


def _first_time(g: _guard.Guard, key: Any) -> bool:
    """Raise mode: always. Warn and skip mode: once per key (a sink and its module, or an eager op's site)."""
    if g.options.nonfinite not in ("warn", "skip"):
        return True
    warned = g.states[WARNED]
    if key in warned:
        return False
    warned.add(key)
    return True


def emit(g: _guard.Guard, error: NonFiniteError) -> None:
    __tracebackhide__ = True
    mode = g.options.nonfinite
    if mode == "skip":
        # (skip mode's consecutive-skip error quotes it; it is warned, never raised. A raised error is never kept:
        # its traceback would hold the failed step's frames, and their batch and loss graph, past the user's except)
        T.last_error = error
    if mode == "skip" and T.poisoned:
        held = "LR schedulers held" if "schedulers" in g._on else "LR schedulers not held: schedulers=False"
        warn_at_user("ampguard: nonfinite='skip': the optimizer step this reached is skipped (parameters, optimizer "
                     f"state and buffers as before the batch, {held}); the run goes on. Once per origin:\n"
                     + str(error))
        return
    if mode in ("warn", "skip"):
        warn_at_user(str(error))
        return
    raise error


def warn_elsewhere(g: _guard.Guard, optimizer: Any) -> None:
    """Skip mode: this rank skipped a step because another rank's loss or gradients were non-finite."""
    if _first_time(g, ("another rank", None)):
        warn_at_user(f"ampguard: nonfinite='skip': the step of {g.name_of(optimizer)} is skipped on every rank: "
                     "another rank's loss or gradients were non-finite (that rank's warning names the origin). "
                     "Every rank skips together, so the replicas stay identical.")


def build(g: _guard.Guard, p: Pending, window: list, losses: list) -> NonFiniteError:
    if type(p) is sinks.Found:
        return p.error  # (trace='eager' found its op as it ran)
    if p.params is not None:
        return _gradient_error(g, p, window, losses)
    return _forward_error(g, p, window)


# -- loss and output sinks -------------------------------------------------------------------
def _sink_tensor(p: Pending) -> Any:
    return p.tensor() if isinstance(p.tensor, weakref.ref) else p.tensor


def _plain(p: Pending, lines: list[str], kind: str | None = None) -> NonFiniteError:
    tensor = _sink_tensor(p)
    if kind is None:
        kind = (replay.primary(replay.kinds(tensor)) if tensor is not None else None) or "nan"
    head = [f"ampguard: {report.kind_word(kind)} reached the {p.sink}."]
    tail = [f"  {p.sink}: {report.describe_tensor(tensor)}", _CAUSES]
    return NonFiniteError("\n".join(head + lines + tail), kind=kind, sink=p.sink)


def _compiled_graph(tensor: Any) -> bool:
    """Whether ``tensor`` was made by a graph torch.compile made (AOTAutograd's node is its autograd node)."""
    node = getattr(tensor, "grad_fn", None)
    return node is not None and node.name().startswith("CompiledFunction")


def _forward_error(g: _guard.Guard, p: Pending, window: list) -> NonFiniteError:
    if g.options.trace == "off":
        return _plain(p, ["  No origin is known (tracing is off: trace='off'); run with trace='replay' (the "
                          "default) to find the op that created it."])
    reason = replay.unsafe(p.call) if p.call is not None else None
    if reason is not None:
        return _plain(p, [f"  No origin is known: the call was not replayed, because {reason}."])
    if p.call is None and (p.ref is None or p.ref.event < 0):
        loss = p.ref.ref() if isinstance(p.ref, sinks.Ref) else None  # (the sink holds it detached)
        if _compiled_graph(loss):
            return _plain(p, ["  No origin is known: the loss was made inside a torch.compile'd function, whose "
                              "module calls ampguard does not see (they are one compiled graph). Compile the "
                              "model instead (torch.compile(model): its calls are seen and replayed eagerly), or "
                              "run the step uncompiled, to have the op named."])
        lines = ["  No origin is known: the loss was not computed from a module call ampguard saw (it checks the "
                 "outermost module calls and the loss code that follows them)."]
        if T.transformed:
            lines.append(_TRANSFORMED)
        elif "torch._dynamo" in sys.modules:  # (torch.compile was used in this process)
            lines.append("  Module calls inside a torch.compile'd function are not seen, nor are the calls of a model "
                         "compiled in place (model.compile()) before ampguard was installed: its whole call runs "
                         "compiled, hooks included. Compile the model once ampguard is installed, or as "
                         "model = torch.compile(model), or run the step uncompiled, to have the op named.")
        return _plain(p, lines)
    session = replay.Session()
    target = _replay_sink(session, p, window)
    if target is not None and not _reproduced(p, target):
        # The named replay ran torch's slow paths; the original may have run a fused one. Replay as it ran.
        fused = replay.Session()
        again = _replay_sink(fused, p, window, names=False)
        if again is not None and _reproduced(p, again):
            return _explain(g, p, fused, window, again, note=_FUSED)
        return _plain(p, [_NOT_REPRODUCED.format(what="the " + p.sink, first=""),
                          "  It stayed finite both on torch's slow path (replayed with torch-function naming) and at "
                          "the dispatch level (the fused fast path, if the call takes one).",
                          *_written_inputs(session, False)])
    return _explain(g, p, session, window, target)


_FUSED = ("  (Replayed at the dispatch level only: under torch-function naming the value stayed finite, because "
          "torch's fused fast path ran in the original call and its slow path in that replay.)")


def scale_overflow(g: _guard.Guard, p: Pending, penalty: tuple, window: list) -> bool:
    """Whether the non-finite loss ``p``, in a window whose loss code took gradients of a value a GradScaler scaled
    (``penalty``: sinks._Thread.penalty; the AMP recipe for a gradient penalty:
    ``torch.autograd.grad(scaler.scale(out), ..., create_graph=True)``), is those
    scaled gradients' overflow: the scaler skips this step, and the loss is finite when what the loss code took from
    them is (a replay with that replaced), or the replay cannot tell (the penalty's values were freed). That is
    GradScaler's business, as without ampguard: the scale backs off and the run goes on, and a streak of them meets
    max_consecutive_skips. A NaN that is there without the penalty (log(0) in the loss, the data, a parameter) is
    raised as always, as is a loss the penalty did not reach (the critic's output given to scale() for the penalty's
    own gradients). Where it is the overflow, it is counted (stats.penalty_overflows, and the scaler's streak for a
    collapse's message). Failure path only."""
    scaler, keys = penalty
    if _skips(scaler) is False:
        return False  # (the step is applied: see _applied_all_the_same)
    if g.options.trace != "off":
        try:
            verdict = sinks.outside_compile(_without_penalty)(p, window, keys)
        except Exception as exc:  # (the failure path's replay: no verdict)
            log.debug("ampguard: the replay of a gradient penalty's loss failed", exc_info=exc)
            verdict = None
        if verdict is False:
            return False
    g.stats.penalty_overflows += 1
    schedulers = sys.modules.get("ampguard.schedulers")
    if schedulers is not None and schedulers.SCALER in g._on:
        schedulers.note_penalty_overflow(g, scaler)
    log.info("ampguard: a loss made after a gradient penalty of scaled gradients was non-finite where GradScaler "
             "skipped the step: left to the scaler, as its overflow")
    return True


def _skips(scaler: Any) -> bool | None:
    """Whether ``scaler`` found inf/NaN gradients for an optimizer this iteration (it skips that step); None where
    it has not unscaled them yet, or its update() has ended the iteration (a read after it: GradScaler tracking
    switched off by an internal fault, where no read rides on update())."""
    found = [f for state in scaler._per_optimizer_states.values()
             for f in state.get("found_inf_per_device", {}).values()]
    return any(bool(f.item()) for f in found) if found else None


def _applied_all_the_same(g: _guard.Guard, p: Pending, penalty: tuple, window: list) -> str | None:
    """The line for a loss that a gradient penalty of scaled gradients made non-finite (see scale_overflow) at a
    step GradScaler applied: where the penalty's value is inf its gradient vanishes (through a sqrt or a norm), so
    the gradients stay finite, GradScaler neither skips nor backs off, and the penalty stops training without a
    sign. None where that is not what happened."""
    scaler, keys = penalty
    if g.options.trace == "off" or _skips(scaler) is not False:
        return None
    if sinks.outside_compile(_without_penalty)(p, window, keys) is not True:
        return None
    return (f"  A gradient penalty made it: the loss is finite with the values it took from the scaled gradients "
            f"(torch.autograd.grad of a value GradScaler scaled, create_graph=True) replaced. At scale "
            f"{scaler.get_scale():g} they overflow where they pass float16's 65504 (a gradient of a sum over the "
            "batch is the scale times that sum: a last layer's bias gets scale x batch size); a division by 0 or a "
            "log of 0 in the penalty is inf at any scale. Its gradient vanished (through a sqrt or a norm, or in a "
            "term without a graph), so the step's gradients were finite: GradScaler applied the step and does not "
            "back off, and the penalty stays inf without training. Fix: take the gradients of a mean rather than a "
            "sum (scaler.scale(out.mean()), and multiply by the batch size as you unscale them: the same penalty, "
            "from values the batch size smaller), or train in bf16 autocast (no GradScaler needed).")


def _without_penalty(p: Pending, window: list, keys: set) -> bool | None:
    """Whether loss ``p`` is finite when the tensors its loss code took from the scaled gradients (those computed
    from an autograd node of ``keys``) hold ones instead: replayed twice, as it ran and so. None where the first
    replay does not reproduce the value (an input was freed, so that it could not run)."""
    torch = sinks._torch
    session = replay.Session()
    target = _replay_sink(session, p, window)
    if target is None or not _reproduced(p, target):
        return None
    penalty = [o for o in session.keep if _reaches(o, keys)]
    if not penalty:
        return False
    without = replay.Session()
    for o in penalty:
        without.mapping[id(o)] = torch.ones_like(o.detach())
        without.keep.append(o)
    target = _replay_sink(without, p, window)
    return target is not None and not replay.kinds(target)


def _reaches(tensor: Any, keys: set) -> bool:
    """Whether ``tensor`` was computed from an autograd node of ``keys`` (sinks._penalty's): its graph stays walkable
    after backward() freed what it saved."""
    stack, seen = [getattr(tensor, "grad_fn", None)], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if (sinks._node_key(node), node.name()) in keys:
            return True
        stack.extend(edge for edge, _ in node.next_functions)
    return False


def _replay_sink(session: replay.Session, p: Pending, window: list, names: bool = True) -> Any:
    """Replay ``window`` into ``session`` (leaving no trace: see replay.untouched); the replayed value of sink ``p``,
    or None where the replay did not make it."""
    with replay.untouched(window):
        replay.run_window(session, window, names=names)
        return _replayed(session, p)


def _reproduced(p: Pending, target: Any) -> bool:
    found = replay.kinds(target)
    return bool(found) and (not p.nan_only or "nan" in found)


def _replayed(session: replay.Session, p: Pending) -> Any:
    if p.call is not None:
        return replay.replayed_output(session, p.call, p.key)
    return replay.replayed_ref(session, p.ref) if p.ref is not None else None


def _explain(g: _guard.Guard, p: Pending, session: replay.Session, window: list, target: Any,
             note: str | None = None) -> NonFiniteError:
    """``note``: a line on how the replay ran, right under the first line of the message."""
    if target is None:
        reason = next(iter(session.unreplayed.values()), None)
        why = f"it was not replayed: {reason}" if reason else "it was not made by a replayed call"
        return _plain(p, [f"  No origin is known: {why}."])
    if not _reproduced(p, target):
        lines = [_NOT_REPRODUCED.format(what="the " + p.sink, first="")]
        call = p.call or next((c for c in reversed(window) if type(c) is Call), None)
        if call is not None and call.steps != T.steps:
            lines.append("  An optimizer step was applied after the call, so the replay ran with the updated "
                         "parameters.")
        return _plain(p, [*lines, *_written_inputs(session, False)])
    start = session.producer_of(target)
    kind = replay.primary(replay.kinds(target)) or "nan"
    noted = [note] if note else []
    if start is None:
        return _plain(p, [*noted, "  No origin is known: the replayed value was not made by an op ampguard saw.",
                          *_held_by_a_module(p, target)], kind)
    return _origin_error(g, p, session, window, replay.walk(session, start), kind, noted)


def _held_by_a_module(p: Pending, target: Any) -> list[str]:
    """Where the replayed call returned a tensor that one of its modules holds (a buffer, a parameter, a value it
    caches), say which: the replay runs the call with the module as it is now, and makes nothing of such a tensor."""
    call = p.call
    if call is None or not isinstance(call.module, sinks._torch.nn.Module):
        return []
    for path, module in call.module.named_modules():
        attributes = (*vars(module).items(), *module._parameters.items(), *module._buffers.items())
        for name, value in attributes:
            if value is target:
                owner = torchscript.class_name(call.module) + (f".{path}" if path else "")
                return [f"  The call returned '{name}', a tensor that module '{owner}' holds, as it is, so the replay "
                        "made nothing of it: whatever wrote it (this call when it first ran, an earlier call, or code "
                        "outside them) wrote it before the replay, which runs with the module as it is now. A value "
                        "the module caches, a buffer or a parameter: look where it is assigned."]
    return []


def _label(rec: replay.OpRecord) -> tuple[str, str]:
    """(how the op reads in the message, what err.op is): torch.log where the aten op is the torch call's
    own, aten.bmm inside torch.nn.functional.multi_head_attention_forward where it is one of many."""
    return _op_label(rec.name, rec.fn)


def _op_label(name: str, fn: Any) -> tuple[str, str]:
    aten = name.partition(".")[2].strip("_")
    if fn is not None:
        words = report.op_name(fn)
        if words.rpartition(".")[2].strip("_").rstrip("_") == aten.rstrip("_"):
            return words, words
        return f"{name} inside {words}", name
    return name, name


def _written_inputs(session: replay.Session, reproduced: bool) -> list[str]:
    """Lines naming each input the call writes into in place (``x.sub_(mean)`` in a forward, ``y.clamp_(0, 1)`` in
    the loss code). Found by the replay, at no cost to the normal path: by the check the input held the written
    value, so the replay started from it, not from what the call was given."""
    if not session.written:
        return []
    lines = []
    for where, name, fn, frames in session.written.values():
        own, _, _ = report.sites(frames, fn)
        lines.append(f"  The call writes into its input in place: {where} is changed by {_op_label(name, fn)[0]} at"
                     f"\n    {report.where(own)}")
    lines.append("  So the replay started from the written value, not from what the call was given (ampguard copies no "
                 "input on the normal path): " + (
                     "the origin above is where that value became non-finite." if reproduced else
                     "the likely reason it did not reproduce. Write into a copy instead (an out-of-place op: "
                     "x = x.sub(mean), not x.sub_(mean)) to have the call replayed."))
    return lines


def _became(g: _guard.Guard, window: list, rec: replay.OpRecord) -> str:
    """The line for the op where the value changed kind (-Inf became NaN), with its module as the origin's."""
    own, _, _ = report.sites(rec.frames, rec.fn)
    module = _module_path(g, window, rec.root, rec.module)
    in_module = f" in module '{module}'" if module else ""
    return f"  It became {report.kinds_words(rec.kinds)} in {_label(rec)[0]}{in_module} at\n    {report.where(own)}"


def _roots(g: _guard.Guard, window: list) -> list:
    known = [ref() for ref in g.states[sinks.ROOTS].values()]
    return [m for m in (c.module for c in window if type(c) is Call) if m is not None] + \
        [m for m in known if m is not None]


def _module_path(g: _guard.Guard, window: list, root: Any, module: Any) -> str | None:
    """``module``'s dotted path, from the largest known root that holds the call's root: a LightningModule
    whose training_step calls ``self.D(x)`` makes a module in D read 'D.0', not '0'."""
    path = report.module_path(root, module)
    if path is None:
        return None
    root = getattr(root, "_orig_mod", root)  # (a compiled module is the module it compiles, as in module_path)
    # (the most parameters first; of two with as many, the one with more modules: a LightningModule holds its
    # network and a metric without parameters)
    for big in sorted(_roots(g, window), key=lambda m: (-sum(1 for _ in m.parameters()),
                                                        -sum(1 for _ in m.modules()))):
        big = getattr(big, "_orig_mod", big)
        if big is root:
            break  # (the largest first: nothing larger holds it)
        prefix = next((name for name, m in big.named_modules() if m is root), None)
        if prefix:
            prefix = prefix.replace("._orig_mod", "")
            return prefix if getattr(module, "_orig_mod", module) is root else f"{prefix}.{path}"
    return path


def _names(g: _guard.Guard, window: list) -> dict[int, str]:
    """id(parameter or buffer) -> its name in messages (see report.tensor_names)."""
    sites = {id(c.module): c.site for c in window if type(c) is Call and c.site is not None and c.module is not None}
    return report.tensor_names(_roots(g, window), sites)


def _origin_error(g: _guard.Guard, p: Pending, session: replay.Session, window: list, result: dict,
                  kind: str, noted: list[str], head: str | None = None) -> NonFiniteError:
    """``head``: the first line, where the value reached no sink (see _raised_origin); without a sink tensor, the last
    line that describes it is left out."""
    records = session.records
    rec = records[result["origin"]]
    if g.options.repro_dir is not None and rec.event >= 0:
        T.repro_origin = repro.Origin(window, rec.event, result["origin"], "forward",
                                      module=rec.module if rec.module is not rec.root else None, names=session.names)
    label, op = _label(rec)
    module = _module_path(g, window, rec.root, rec.module)
    own, user_site, user = report.sites(rec.frames, rec.fn)
    names = _names(g, window)
    lines = [head or f"ampguard: {report.kind_word(kind)} reached the {p.sink}.", *noted,
             "  Found by replaying the call op by op (same inputs, RNG state, autocast and grad mode)."]
    origin_kinds = report.kinds_words(rec.kinds)
    in_module = f" in module '{module}'" if module else ""
    entered = result["entered"]
    masked_row = False  # a softmax whose NaN a mask's -Inf alone made (a fully masked row)
    if entered is not None:
        lines.extend(_entered(g, session, names, rec, entered, f"{in_module} at\n    {report.where(own)}",
                              "  It entered"))
        op = module = None
    else:
        masked = _made_from_a_mask(result)
        finite = "inputs finite but for a mask" if masked else "inputs finite"
        masked_row = masked and _NORMALIZES.search(label) is not None
        if rec.numbers:
            finite = f"tensor inputs finite, but it was given the Python number {rec.numbers[0]!r}"
        lines.append(f"  It was created by {label} ({finite}, output {origin_kinds}){in_module} at\n"
                     f"    {report.where(own)}")
        if isinstance(rec.fn, torchscript.Scripted):
            lines.extend(_script_lines(rec.fn, rec.name))
        if user_site is not None and user_site != own:
            lines.append(f"  called from your code at\n    {report.where(user_site)}")
        alive = rec.ref()
        lines.append(f"  value: {report.describe_tensor(alive)}" if alive is not None else
                     f"  value: shape {rec.shape}, {rec.dtype}")
        lines.extend(_inf_lines(session, names, rec, label))
    if result["transition"] is not None:
        lines.append(_became(g, window, records[result["transition"]]))
    lines.extend(_masks(session, names, result["masks"]))
    on_purpose = any(n != n for n in rec.numbers) if entered is None else \
        _a_constant(rec) and "nan" in entered[1]
    if on_purpose and kind == "nan" and p.sink.startswith("output"):
        lines.append("  Your code wrote this NaN itself. If it is on purpose (a marker for missing values that a "
                     "nanmean skips; in training the loss decides), run those calls under `with ampguard.guard("
                     "nonfinite=\"off\"):`: ampguard cannot tell a marker from a mistake.")
    if entered is None:
        lines.extend(_made_advice(session, rec, label))
        lines.extend(_divisor_lines(session, names, rec))
        if result["transition"] is not None and replay.masks_here(rec) and \
                _CLASS_LOSSES.search(_label(records[result["transition"]])[0]):
            lines.append(_MASKED_CLASS_IN_A_LOSS)
    if masked_row:
        lines.append("  A row that masks cover everywhere (a sequence that is all padding, say) has no finite value "
                     "for a softmax to normalize, and becomes NaN: mask with a large negative number "
                     "(torch.finfo(dtype).min) instead of -inf, or leave such rows one unmasked key.")
    lines.extend(_written_inputs(session, True))
    chain = [_label(records[i])[0] for i in result["path"]]
    shown = chain if len(chain) <= 8 else [*chain[:3], f"... {len(chain) - 6} ops ...", *chain[-3:]]
    lines.append(f"  path to the {'sink' if head is None else 'first such value'}: {' -> '.join(shown)}")
    if user:
        lines.append("  your stack at the origin (innermost last):")
        lines.extend("    " + line.rstrip("\n") for line in report.stack_summary(user).format())
    if head is None:
        lines.append(f"  {p.sink}: {report.describe_tensor(_sink_tensor(p))}")
    lines.append(_CAUSES)
    return NonFiniteError("\n".join(lines), kind=kind, sink=p.sink, op=op, module=module,
                          origin=report.stack_summary(user) if user else None, chain=chain)


def _entered(g: _guard.Guard, session: replay.Session, names: dict, rec: Any, entered: tuple, where: str,
             lead: str) -> list[str]:
    """The lines for a value that entered the replayed ops already non-finite (``walk``'s ``entered``): a constant
    in the code, the data, a parameter (and the step that made it) or buffer. ``where``: ' in module .. at ..'."""
    tensor, kinds = entered[0](), report.kinds_words(entered[1])
    label = _label(rec)[0]
    if _a_constant(rec):
        by = report.op_name(rec.fn) if rec.fn is not None else label
        lines = [f"{lead} already non-finite ({kinds}): a constant in your code (a Python number or a tensor "
                 f"literal), given to {by}{where}"]
    else:
        lines = [f"{lead} already non-finite ({kinds}): {_leaf_name(session, names, tensor)}, an input of "
                 f"{label}{where}"]
        lines.extend(_made_by_a_step(g, tensor) or [
            "  No replayed op produced that input: it is the data, a parameter or buffer, or the output of code "
            "ampguard did not replay."])
    if tensor is not None:
        lines.append(f"  input: {report.describe_tensor(tensor)}")
    return lines


def _a_constant(rec: Any) -> bool:
    """Whether the op made a Python number or a literal a tensor where the code ran (``torch.tensor(nan)``)."""
    return rec.name.startswith("aten.lift_fresh")


def _made_from_a_mask(walked: dict) -> bool:
    """Whether the walk's origin made its value from inputs finite but for the masks it passed."""
    return bool(walked["masks"]) and walked["path"][0] == walked["origin"]


# (the op, as a label reads; the kind it made; why an op of that kind makes it from finite inputs, and the fix)
_OP_ADVICE = (
    (re.compile(r"ctc_loss"), "inf",
     "ctc_loss is +Inf for a sample whose target cannot be aligned to its input: a target longer than the input, or "
     "one whose repeated labels need blanks between them that the input has no room for. Pass zero_infinity=True "
     "(nn.CTCLoss(zero_infinity=True)) to give such samples a zero loss and gradient, or drop them from the data."),
    (re.compile(r"(?<![a-z_])(std|var)(_mean)?\b"), "nan",
     "std and var divide by the number of elements less their correction, 1 by default: over a single element (a "
     "batch of one, a dimension of size 1) that is 0/0. Pass correction=0 (unbiased=False) where that can happen."),
    (re.compile(r"nll_loss|cross_entropy"), "nan",
     "cross_entropy and nll_loss with reduction='mean' divide by the total weight of the targets that are not "
     "ignore_index: a batch whose targets are all ignored (all padding), or whose classes all weigh 0, is 0/0. Skip "
     "such batches, or take reduction='sum' and divide by the count of targets, at least 1."),
    (re.compile(r"(?<![a-z_])(div|divide|true_divide)_?\b"), "nan",
     "A division of finite values is NaN only as 0/0: a sum divided by a count that is 0 (a masked mean whose mask "
     "selects nothing) or a vector divided by its norm when it is all zeros. Divide by count.clamp(min=1), or by "
     "norm + eps (F.normalize does)."),
    (re.compile(r"(?<![a-z_])(mean|nanmean)\b"), "nan",
     "The mean of no elements is NaN (0/0): a selection that is empty (x[mask] where the mask selects nothing, a "
     "batch with no positive pairs). Skip that case, or take x.sum() / count.clamp(min=1)."),
    (re.compile(r"(?<![a-z_])(exp|exp2)_?\b"), "inf",
     "exp overflows to +Inf above 88.7 in float32 and above 11.1 in float16: subtract the maximum first, as softmax, "
     "log_softmax and logsumexp do, clamp its input (a log-variance: logvar.clamp(max=...)), or compute it in "
     "float32."),
    (re.compile(r"(?<![a-z_])(log|log2|log10)_?\b"), "-inf",
     "log(0) is -Inf: a probability that underflowed to 0 (below 1e-45 in float32, 6e-8 in float16). Take "
     "log_softmax or logsigmoid instead of the log of softmax or sigmoid, or clamp it (min=eps) first."),
    (re.compile(r"(?<![a-z_])(acos|asin|arccos|arcsin)_?\b"), "nan",
     "acos and asin are NaN outside [-1, 1], and a cosine computed in floating point (a normalized dot product) can "
     "pass 1 by a rounding error: clamp it to [-1 + eps, 1 - eps] first (the eps also bounds the gradient at ±1)."),
    (re.compile(r"(layer|group|batch|instance|rms)_norm"), "nan",
     "A normalization divides by sqrt(variance + eps) (rms_norm: by sqrt(mean(x^2) + eps)). It is NaN from finite "
     "inputs only where the values it normalizes together are all equal, so that the variance is 0 (a padding "
     "position whose embedding is all zeros, a constant channel), and its eps is 0: 0/0. Give it an eps (1e-5 is "
     "torch's default), or leave such rows out before it."),
    (re.compile(r"(?<![a-z_])(mul|multiply|matmul|b?mm|einsum|dot)_?\b"), "nan",
     "A product is NaN only as 0 x ±Inf: a factor held ±Inf where the other held 0. Most often that is p * log(p) "
     "at a position a mask set to -Inf (an entropy or a KL over masked logits, where p is 0 and log(p) -Inf). Take "
     "Categorical(logits=...).entropy(), or mask with torch.finfo(dtype).min instead of -inf and multiply by "
     "log_softmax: both stay finite where p is 0, gradients included. (torch.special.xlogy(p, p) and entr(p) are 0 "
     "there too, but their gradients are NaN.)"),
    (re.compile(r"(?<![a-z_])(r?sqrt|log|log2|log10|pow)_?\b"), "nan",
     "This op is NaN for a negative input (pow: a negative base to a fractional power). A quantity that is never "
     "negative in exact arithmetic can round below 0 (a variance as E[x^2] - E[x]^2, a squared distance as "
     "|a|^2 + |b|^2 - 2ab): clamp it (min=0, or min=eps where the gradient at 0 matters) before this op."),
)


# aten ops that make ±Inf from finite inputs at a singularity, not only by passing the dtype's largest value: at an
# input of 0 (log(0), x/0, rsqrt(0), pow(0, -1)), or elsewhere (atanh(1), log1p(-1), lgamma(-1))
_SINGULAR_AT_0 = frozenset(("div", "divide", "true_divide", "floor_divide", "reciprocal", "rsqrt", "sqrt", "log",
                            "log2", "log10", "xlogy", "pow", "float_power"))
_DIVIDED_BY_0 = ("  A division (or a reciprocal) of finite values is ±Inf where its divisor is 0: a difference of "
                 "equal values, a count or a norm that is 0, a std of a constant. Add eps to the divisor (keeping its "
                 "sign), or clamp it (min=eps) where it is never negative.")
_EPS_IN_FP16 = ("  This divisor is float16, where an eps below 3e-8 (1e-8, or 1e-12 as in a hand-written RMSNorm) "
                "rounds to 0 and adds nothing: compute the divisor in float32 (.float() before the eps is added), or "
                "use an eps of at least 1e-6.")
_DERIVATIVE_AT_0 = ("  Inside torch.autograd.grad this division is a derivative's: sqrt, a power below 1 or a norm has "
                    "an infinite derivative at 0 (d/dx sqrt(x) = 1 / (2 sqrt(x))). Keep that op's input away from 0 "
                    "(sqrt(x + eps)), or leave the points where it is 0 out of the derivative.")
# singular away from 0 (atanh(1)), or where a matrix is (logdet, an inverse or a solve of a singular one)
_SINGULAR = re.compile(r"\w*log\w*|atanh|arctanh|digamma|lgamma|polygamma|mvlgamma|tan|erfinv|special_\w+|"
                       r"\w*inv\w*|\w*solve\w*")
_HUGE = 1e9  # an input above this in float32 or bfloat16 is no activation or weight of a healthy run


def _inf_lines(session: replay.Session, names: dict, rec: Any, label: str) -> list[str]:
    """Why an op made ±Inf from finite inputs. A division at a divisor of 0 says so (a derivative's, inside
    torch.autograd.grad). An op with no singularity (a matmul, a sum, a square) overflowed: its result passed its
    dtype's largest value; how large its inputs were, and the usual cause (fp16 activations, or a run diverging).
    Other singular ops get no line here. (``rec.largest`` is measured only where every input was finite, and no
    Python number or mask made the Inf.)"""
    limit = report._LIMITS.get(str(rec.dtype))
    op = rec.name.partition(".")[2].strip("_")
    singular = any(zero for *_, zero in rec.largest or ()) if op in _SINGULAR_AT_0 else _SINGULAR.fullmatch(op)
    if singular and op in replay.DIVISIONS and "nan" not in rec.kinds:  # (a 0/0 is NaN, with advice of its own)
        lines = [_DERIVATIVE_AT_0 if "torch.autograd.grad" in label else _DIVIDED_BY_0]
        return [*lines, _EPS_IN_FP16] if str(rec.dtype) == "torch.float16" else lines
    if not rec.largest or limit is None or singular or not any(amax for _, _, amax, _ in rec.largest):
        return []  # (from inputs that are all 0, no result can pass a dtype's largest value)
    dtype = str(rec.dtype).removeprefix("torch.")
    sizes = []
    for ref, producer, amax, _ in rec.largest:
        tensor = ref()
        name = names.get(id(tensor)) if tensor is not None else None  # (a parameter: also its autocast copy)
        if name is None and producer is not None:
            name = f"the output of {_label(session.records[_outside(session, rec, producer)])[0]}"
        sizes.append(f"{name or _leaf_name(session, names, tensor)} {amax:.3g}")
    lines = [f"  Its inputs were finite, so the result passed the largest {dtype} value ({limit:.4g}): it overflowed. "
             f"Their largest |x|: {', '.join(sizes)}."]
    if _op_advice(label, rec.kinds):
        pass  # (an op of its own, exp: its advice follows)
    elif dtype == "float16":
        lines.append("  In float16 that is an activation above 65504. Keep this op in float32 (outside autocast, or "
                     "on .float() inputs), or keep its inputs smaller (a normalization before it).")
    elif max(amax for _, _, amax, _ in rec.largest) > _HUGE:
        lines.append("  Values this large usually grow over training: a learning rate too high for the model (the "
                     "loss rising), or data far from unit scale. Lower the learning rate, clip the gradients "
                     "(clip_grad_norm_), or normalize the inputs.")
    return lines


def _outside(session: replay.Session, rec: replay.OpRecord, producer: int) -> int:
    """The record that made what ``rec``'s torch call was given, past the views and copies the call made of it
    itself: a matmul's bmm reads views that the matmul made of q and k, which were the user's chunk and transpose."""
    records = session.records
    for _ in range(16):
        made = records[producer]
        if rec.fn is None or made.fn is not rec.fn or made.call != rec.call or not made.inputs:
            break
        producer = made.inputs[0]
    return producer


def _outside_domain(rec: replay.OpRecord) -> list[str]:
    """How far past its domain's bound the input of a root, log, fractional power, acos or asin that made NaN was
    (measured in the replay): -1e-9 from values near 1 is rounding, which _OP_ADVICE's clamp fixes; -0.2 from
    values below 0.4 is a quantity of the wrong sign, which a clamp hides."""
    if rec.domain is None:
        return []
    low, high = rec.domain
    if rec.name.partition(".")[2].strip("_") in ("acos", "asin", "arccos", "arcsin"):
        return [f"  Its input ranged from {low:.9g} to {high:.9g}."]
    dtype = str(rec.dtype).removeprefix("torch.")
    eps = f"{sinks._torch.finfo(rec.dtype).eps:.0e}".replace("e-0", "e-")  # (float32: 1e-7; float16: 1e-3)
    return [f"  Its input was as low as {low:.4g}, and its largest |x| {max(abs(low), abs(high)):.4g}. A rounding "
            f"error is some {eps} ({dtype}) of the values it was computed from; a value far below that is a quantity "
            "of the wrong sign, which a clamp would hide: make it positive by construction (softplus or exp of a "
            "learned value, a square)."]


_SPREADS = re.compile(r"(?<![a-z_])(std|var)(_mean)?\b")  # the divisors that are 0 over values that are all equal


def _divisor_lines(session: replay.Session, names: dict, rec: replay.OpRecord) -> list[str]:
    """What the replay measured of a division that made NaN from finite inputs (0/0): how many of its divisor's
    values were 0, and what made it; a std or variance is 0 over values that are all equal (a constant column)."""
    if rec.divisor is None:
        return []
    ref, producer, zeros, total = rec.divisor
    if producer is not None:
        made = session.records[_outside(session, rec, producer)]
        label, at = _call_at(made)
        what = f"the output of {at}"
    else:
        made, label, what = None, "", _leaf_name(session, names, ref())
    lines = [f"  Its divisor, {what}, was 0 at {zeros:,} of {total:,} elements."]
    if made is not None and _SPREADS.search(made.name):
        lines.append(f"  {label} is 0 over values that are all equal: a constant feature or target column, or a "
                     "group of one element with correction=0. Divide by it plus eps, or by .clamp(min=eps); leave "
                     "constant columns out.")
    return lines


def _made_advice(session: replay.Session, rec: replay.OpRecord, label: str) -> list[str]:
    """What the replay measured of the op that made the value from finite inputs, and the advice for that op: the
    same lines whether the loss saw the value or only the backward met it."""
    return [*_outside_domain(rec), *_op_advice(label, rec.kinds, _log_input(session, rec), rec.dtype)]


def _op_advice(label: str, kinds: Any, log_input: str | None = None, dtype: Any = None) -> list[str]:
    """The lines of _OP_ADVICE for the op ``label`` that made ``kinds`` from finite inputs. A log that made -Inf is
    advised by what its input was (see _log_input): log_softmax fixes a probability that underflowed, not a masked
    one, nor a 0 in the data; in float16, an eps added to the data rounds to 0 below 3e-8."""
    if _LOG.search(label) and "-inf" in kinds and log_input != "probability":
        if log_input == "masked":
            return [_LOG_OF_A_MASKED_PROBABILITY]
        return [_LOG_OF_A_ZERO, _EPS_IN_FP16_LOG] if str(dtype) == "torch.float16" else [_LOG_OF_A_ZERO]
    return [f"  {advice}" for pattern, kind, advice in _OP_ADVICE if kind in kinds and pattern.search(label)]


_LOG = re.compile(r"(?<![a-z_])(log|log2|log10)_?\b")
_CLASS_LOSSES = re.compile(r"cross_entropy|nll_loss|kl_div")
_MASKED_CLASS_IN_A_LOSS = (
    "  That -Inf is a mask's, written into the logits on purpose, and the loss took it: a class's -Inf "
    "log-probability enters cross_entropy where the target is that class, and where label_smoothing or a "
    "probability target gives it weight (every class, masked ones too). Leave the masked classes out of the logits "
    "(index the allowed ones) and of the targets, or smooth over the allowed classes only. (A finfo.min mask does "
    "not help: the smoothing sums those log-probabilities, and the sum overflows.)")
# ops that select, reshape or copy values without computing new ones
_MOVES = re.compile(r"select|slice|index|gather|narrow|view|unsafe_view|reshape|squeeze|unsqueeze|expand|permute|"
                    r"transpose|t|clone|contiguous|to_copy|alias|unbind|split|flatten|detach|lift_fresh")
_LOG_OF_A_MASKED_PROBABILITY = (
    "  Its input was the softmax of logits a mask set to -Inf: that probability is exactly 0, and log(0) is -Inf, "
    "whatever the precision (log_softmax is -Inf there too). For an entropy take Categorical(logits=...).entropy(); "
    "otherwise mask with torch.finfo(dtype).min instead of -inf and take log_softmax, or clamp the probability "
    "(min=eps) before the log.")
_EPS_IN_FP16_LOG = ("  This log ran in float16, where an eps below 3e-8 (1e-8, 1e-9) added to its input rounds to 0 "
                    "and adds nothing: take the log in float32 (.float() before the eps is added), or use an eps of "
                    "at least 1e-6.")
_LOG_OF_A_ZERO = (
    "  log(0) is -Inf: its input held 0. Where that 0 is in the data (a magnitude, a count, a target probability), "
    "clamp it (min=eps) or add eps before the log. Where it is a probability that underflowed (below 1e-45 in "
    "float32, 6e-8 in float16), take log_softmax or logsigmoid instead of the log of softmax or sigmoid.")


def _log_input(session: replay.Session, rec: replay.OpRecord) -> str | None:
    """What the op's first input was: "masked", a softmax of an input that held -Inf (a masked logit: its 0s are
    masked positions' probabilities); "probability", a softmax's or sigmoid's output (its 0s underflowed); None."""
    if not rec.inputs:
        return None
    made = session.records[rec.inputs[0]]
    for _ in range(8):  # back through what selects, reshapes or copies it: p[:, 0], p.view(-1), p.float()
        if not _MOVES.fullmatch(made.name.partition(".")[2].strip("_")) or not made.inputs:
            break
        made = session.records[made.inputs[0]]
    if "softmax" in made.name and "log" not in made.name:
        return "masked" if any("-inf" in session.records[i].kinds for i in made.inputs) else "probability"
    return "probability" if "sigmoid" in made.name else None


_NORMALIZES = re.compile(r"softmax|logsumexp|scaled_dot_product_attention|multi_head_attention")


def _masks(session: replay.Session, names: dict, masks: list) -> list[str]:
    """The line naming the masks a walk did not follow, if it passed any."""
    if not masks:
        return []
    made = sorted({_leaf_name(session, names, m[1][0]()) if m[0] == "leaf" else _mask_made(session.records[m[1]])
                   for m in masks})
    # a mask depends on no parameter (an attention mask), or was written as -inf into values that do (masked logits)
    written = [m for m in masks if m[0] == "record" and not session.records[m[1]].constant]
    why = "depending on no parameter, as attention masks do" if not written else \
        "written as -inf on purpose, as a masked_fill of logits is" if len(written) == len(masks) else \
        "written as -inf on purpose, or depending on no parameter, as attention masks do"
    return [f"  -Inf that masks put there ({why}) was not counted as a cause: {', '.join(made)}."]


def _mask_made(rec: replay.OpRecord) -> str:
    """A mask made by a recorded op, named with the line of the user's that made it (a library's mask: the call)."""
    return "the mask made by " + _call_at(rec)[1]


def _call_at(rec: replay.OpRecord) -> tuple[str, str]:
    """(the torch call the user wrote that ran the recorded op, that name with the user's line: "Tensor.nan_to_num
    at train.py:18"; a library's op: the line of the call into it)."""
    own, user_site, _ = report.sites(rec.frames, rec.fn)
    line = user_site or own
    label = report.op_name(rec.fn) if rec.fn is not None else rec.name
    return label, label + (f" at {line[0]}:{line[1]}" if line is not None else "")


def _leaf_name(session: replay.Session, names: dict, tensor: Any) -> str:
    if tensor is None:
        return "a tensor freed before the report"
    name = names.get(id(tensor))
    if name is not None:
        return name
    if id(tensor) in session.cloned:
        return f"{session.cloned[id(tensor)]} (the data, or a tensor made by code ampguard did not record)"
    return "a tensor made outside the replayed calls"


# -- gradient sinks ----------------------------------------------------------------------------
_NODE = re.compile(r"^(?P<name>[A-Za-z0-9_]+?)Backward\d*$")
_WORD = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")  # where CamelCase starts a new word


def _forward_of(node: str) -> str:
    """The op whose backward autograd node ``node`` is, by a name it has: torch.sqrt for SqrtBackward0,
    torch.log_softmax for LogSoftmaxBackward0, aten._to_copy for ToCopyBackward0 (a .float() or .to()). torch names
    the node after its aten op in CamelCase; the node's own name where no op has that name."""
    m = _NODE.match(node)
    if not m:
        return node
    name = re.sub(r"(?<=\d)_d(?=_|$)", "d", _WORD.sub("_", m["name"]).lower())  # MaxPool2DWith..: max_pool2d_with..
    import torch  # (imported: a replay ran)

    if callable(getattr(torch, name, None)):
        return f"torch.{name}"
    space, _, rest = name.partition("_")  # linalg_vector_norm: torch.linalg.vector_norm
    if space in ("linalg", "special", "fft") and callable(getattr(getattr(torch, space), rest, None)):
        return f"torch.{space}.{rest}"
    return next((f"aten.{op}" for op in (name, f"_{name}") if hasattr(torch.ops.aten, op)), node)


def _first_bad(params: list, grads: bool) -> Any:
    for param in params:
        t = param.grad if grads else param
        if t is not None and replay.kinds(t):
            return param, t
    return None, None


_TRANSFORMED = ("  A module was called under a torch.func transform (vmap, grad, jacrev: an ensemble of stacked "
                "models, per-sample gradients) since the last check: ampguard neither sees nor replays such calls, "
                "whose tensors are batched. Call the model once outside the transform on the same input (one "
                "member's parameters, one sample) to have the op named.")


def _gradient_error(g: _guard.Guard, p: Pending, window: list, losses: list) -> NonFiniteError:
    names = _names(g, window)
    param, grad = _first_bad(p.params, grads=True)
    name = _param_name(names, p.params, param)
    found = replay.kinds(grad) if grad is not None else frozenset({"nan"})
    kind = replay.primary(found) or "nan"
    sink = f"gradient of {name}"
    lines = [f"ampguard: {report.kind_word(kind)} in the {sink} before the optimizer step (the step was not "
             "taken; the parameters are unchanged).",
             f"  {sink}: {report.describe_tensor(grad)}"]
    op = module = origin = None
    more: list[str] = []  # what the replayed backward found
    if g.options.trace == "off":
        lines.append("  No origin is known (trace='off').")
    elif not any(type(c) is Call and c.grad for c in window):
        lines.append("  No origin is known: no module call with gradients was seen since the last check.")
        if T.transformed:
            lines.append(_TRANSFORMED)
    else:
        op, module, origin, more = _replay_backward(g, window, losses)
        lines.extend(more)
    if op is None and _sync.distributed():
        if _FROM_ANOTHER_RANK not in more:  # (that line says it already, with the replay's evidence)
            lines.append("  This is a distributed run: DDP/FSDP all-reduce gradients, so another rank's non-finite "
                         "gradients reach this rank's too. Where another rank's message names an origin, the value "
                         "came from there; where none does, it was made where no replay could run (here, or on "
                         "another rank).")
    elif op is not None and op.startswith("hook "):
        lines.append("  The loss was finite: the hook made it (dividing by a gradient's norm, which is 0 where no "
                     "gradient reaches the parameter, is one way).")
    elif _BACKWARD_NOT_REPRODUCED in more or _forward_made(more) or (T.transformed and not losses):
        pass  # the replayed backward stayed finite, the forward made it, or no loss was seen (a torch.func.grad's):
        # "the loss was finite: the backward pass made it" would be false
    else:
        lines.append(f"  The loss was finite: {_backward_made(more)}.")
    return NonFiniteError("\n".join(lines), kind=kind, sink=sink, op=op, module=module, origin=origin)


def _replay_backward(g: _guard.Guard, window: list, losses: list, found_kinds: set | None = None,
                     scale: float = 1.0) -> tuple[Any, str | None, Any, list[str]]:
    """(the forward op, its module, your stack at it, the lines) of the first backward node that made finite
    gradients non-finite in a replay: at scale 1 (the recorded loss is the unscaled one), or at ``scale``, the loss
    multiplied as GradScaler.scale() multiplies it."""
    session = replay.Session()
    with replay.untouched(window), replay.anomaly_metadata():
        replay.run_window(session, window)
        loss = next((t for ref in reversed(losses) if (t := replay.replayed_ref(session, ref)) is not None), None)
        if loss is None:
            loss = replay.grad_loss(session, window)  # a loop of torch.autograd.grad and .grad = g
        how = []
        sink = session.producer_of(loss) if loss is not None else None
        if loss is None or loss.grad_fn is None:
            call = next(c for c in reversed(window) if type(c) is Call and c.grad)
            outs = [replay.replayed_output(session, call, k) for _, k in call.outputs]
            outs = [o for o in outs if o is not None and o.grad_fn is not None]
            if not outs:
                reason = next(iter(session.unreplayed.values()), None)
                why = f"it was not replayed: {reason}" if reason else "the replayed forward made no graph"
                return None, None, None, [f"  No origin is known: {why}."]
            loss = sum((o.float().sum() for o in outs), sinks._torch.zeros(()))
            how = ["  (The loss code was not recorded, so the replayed backward started from the model's output "
                   "with a gradient of ones, not the original one.)"]
        if scale != 1.0:
            loss = loss * sinks._torch.full((), scale, dtype=sinks._torch.float32, device=loss.device)
        params = [q for c in window if type(c) is Call and c.module is not None for q in c.module.parameters()]
        found = replay.backward_origin(session, loss, params)
    if not found and session.collective is not None:
        return None, None, None, [*how, f"  No origin is known: the backward was not replayed: {session.collective}."]
    if not found or ("hook" in found and found_kinds is not None):
        # (a hook at scale 1, in GradScaler's check, is judged as the overflow it usually stands in for)
        # (in a distributed run, this rank's own backward being finite says the value came from another rank)
        finite = _FROM_ANOTHER_RANK if session.distributed else _BACKWARD_NOT_REPRODUCED
        return None, None, None, [*how, finite, *_written_inputs(session, False)]
    if "hook" in found:
        return _hooked(g, window, found, how)
    if found_kinds is not None:
        found_kinds.update(found["kinds"])
    made = replay.first_made(session) if found.get("saved") else None
    if made is not None:
        return _made_in_forward(g, window, session, made, sink, found, how)
    event = session.node_event.get(found["node_id"])
    if g.options.repro_dir is not None and event is not None:
        T.repro_origin = repro.Origin(window, event, None, "backward")
    function = found.get("function")
    own, user_site, user = report.sites(replay.event_frames(session, window, found["node_id"], found["frames"]))
    made_in = session.node_module.get(found["node_id"])
    # TorchScript's autodiff: the backward of several of a script's ops as one node, made as the script returns
    scripted = _script_at(session, own) if found["node"].endswith("DifferentiableGraphBackward") else None
    if made_in is None and scripted is not None:
        made_in = (scripted[1].module, scripted[1].root)
    module = _module_path(g, window, made_in[1], made_in[0]) if made_in is not None else None
    in_module = f" in module '{module}'" if module else ""
    if function is not None:  # a custom autograd.Function: its class, and the backward it defines
        forward = f"{function.__qualname__}.apply"
        lines = [f"  The backward of {forward} (the custom autograd.Function {function.__qualname__}) turned finite "
                 f"gradients into {report.kinds_words(found['kinds'])}. Its backward is at\n    "
                 f"{report.where(_defined_at(function.backward))}\n  and it was applied{in_module} at\n    "
                 f"{report.where(own)}"]
    elif scripted is not None:
        script = scripted[0]
        forward = str(script)
        node = found["node"].rpartition("::")[2]
        lines = [f"  The backward of {script} (torch's {node}, the backward of several of the script's ops at once) "
                 f"turned finite gradients into {report.kinds_words(found['kinds'])}. The script was called{in_module} "
                 f"at\n    {report.where(own)}", *_unbounded_lines(script)]
    else:
        forward = _forward_of(found["node"])
        lines = [f"  The backward of {forward} ({found['node']}) turned finite gradients into "
                 f"{report.kinds_words(found['kinds'])}. Its forward op is{in_module} at\n    {report.where(own)}",
                 *_overflow_lines(found.get("incoming"), forward), *_zero_lines(forward, found.get("zeros"))]
    if user_site is not None and user_site != own:
        lines.append(f"  called from your code at\n    {report.where(user_site)}")
    return forward, module, report.stack_summary(user) if user else None, \
        [*lines, *_written_inputs(session, True), *how]


# op -> (the saved values whose 0s are its singularity, what its gradient is, the fix) where the gradient is
# unbounded at an input of 0
_UNBOUNDED_AT_0 = {
    "torch.sqrt": (("result",), "1 / (2 sqrt(x)), +Inf at 0", "A norm or distance written by hand, sqrt(sum(d ** 2)), "
                   "is 0 for a zero vector (a point and itself, a padded row): take torch.linalg.vector_norm or "
                   "torch.cdist, whose gradient at 0 is 0, or add eps inside the sqrt."),
    "torch.pow": (("self",), "a x^(a-1) for x ** a, unbounded at 0 for a power a below 1", "Clamp the base (min=eps) "
                  "before the power: a focal loss's (1 - p) ** gamma meets 0 where p rounds to 1. A norm written as a "
                  "power of a sum of squares: take torch.linalg.vector_norm, whose gradient at 0 is 0."),
    "torch.rsqrt": (("result",), "-1 / (2 x^1.5), unbounded at 0", "Add eps before the rsqrt (as layer norms do)."),
    "torch.log": (("self",), "1 / x, unbounded at 0", "Clamp the input (min=eps) before the log, or take log_softmax "
                  "or logsigmoid instead of the log of a probability."),
    "torch.div": (("other",), "1 / y for x / y (and -x / y^2), unbounded where the divisor y is 0",
                  "A torch.where that picks another value where y is 0 still sends the gradient through the division "
                  "there: divide by torch.where(y == 0, 1, y) inside the where as well (the double where), or by "
                  "y.clamp(min=1) for a count."),
}
_SAVED_AS = {"self": "its input", "result": "its output", "other": "its divisor"}


def _zero_lines(forward: str, zeros: list | None) -> list[str]:
    """What the replay measured where a backward met its op's singularity at 0: which of the values the forward saved
    held zeros, and how many."""
    known = _UNBOUNDED_AT_0.get(forward)
    zeros = [z for z in zeros or () if known is not None and z[0] in known[0]]
    if not zeros:
        return []
    measured = "; ".join(f"{_SAVED_AS.get(name, name)} was 0 at {n:,} of {total:,} elements"
                         for name, n, total in zeros)
    _, gradient, fix = known
    return [f"  In the replay {measured}. The gradient of {forward} is {gradient}. {fix}"]


def _overflow_lines(incoming: tuple | None, forward: str = "") -> list[str]:
    """A backward node that made ±Inf from finite gradients larger than the dtype it made holds (a cast of an fp32
    gradient to fp16, by autocast or .float()): they overflowed it, which no op's singularity did. So did the
    backward of an op with no singularity (a matmul, a linear, a convolution, a product or a sum), whose gradients
    times the values it saved passed the dtype's largest value."""
    if incoming is None:
        return []
    largest, dtype = incoming
    limit = report._LIMITS.get(str(dtype))
    name = str(dtype).removeprefix("torch.")
    if limit is None:
        return []
    if largest > limit:
        return [f"{_OVERFLOWED} |x| = {largest:.3g}, more than {name} holds ({limit:.4g}): they overflowed {name} "
                "here, at no singularity."]
    if not _NO_SINGULARITY.fullmatch(forward.rpartition(".")[2].strip("_")):
        return []  # (a division, a root, a log: its singularity, or its own arithmetic; not known here)
    return [f"{_OVERFLOWED} |x| = {largest:.3g}, and {forward} has no singularity: its backward multiplies them by "
            f"values its forward saved, and the products passed {name}'s largest value ({limit:.4g}). They "
            f"overflowed {name} here."]


# ops whose backward is products and sums of the gradients and the values the forward saved: non-finite from
# finite values only by passing the dtype's largest value
_NO_SINGULARITY = re.compile(r"(add|b|baddb)?mm|addmv|mv|matmul|linear|einsum|bilinear|conv\w*|convolution\w*|mul|"
                             r"add|sub|sum|mean|cat|stack|embedding\w*")


_SITES_SHOWN = 5  # lines listed where a script's graph has the op more than once


def _script_lines(label: torchscript.Scripted, op: str) -> list[str]:
    """The lines for op ``op`` inside TorchScript ``label``, under the line that called the script: where the script's
    graph calls the op (TorchScript runs no Python frame, so no Python line is where it is)."""
    found = torchscript.sites(label, op)
    kind = torchscript.graph_kind(op)
    lead = f"  That line runs {label}, which runs no Python frame"
    if not found:
        return [f"{lead}. Its graph has no {kind} node to place the op by (torch may run it inside another op)."]
    if len(found) == 1:
        head = f"{lead}. In its source, the op is at"
    else:
        head = f"{lead}. Its source has {kind} at {len(found)} places"
        head += f" (the first {_SITES_SHOWN} below):" if len(found) > _SITES_SHOWN else ":"
    return [head, *(f"    {report.where(site)}" for site in found[:_SITES_SHOWN])]


def _unbounded_lines(label: torchscript.Scripted) -> list[str]:
    """The lines naming where the script has an op whose gradient is unbounded near some input, for a NaN made in
    its backward (see torchscript.unbounded_sites)."""
    found = torchscript.unbounded_sites(label)
    if not found:
        return []
    head = "  Its ops whose gradient is unbounded near some input (sqrt or pow at 0, log near 0, division by a small " \
           "value)" + (f", the first {_SITES_SHOWN}:" if len(found) > _SITES_SHOWN else ":")
    return [head, *(f"    {kind} at {report.where(site)}" for kind, site in found[:_SITES_SHOWN])]


def _script_at(session: replay.Session, site: tuple | None) -> tuple[torchscript.Scripted, Any] | None:
    """The TorchScript that the replay ran at ``site`` (the line that called it), from its ops' records, and the
    first of those records (for its module)."""
    if site is None:
        return None
    records = [rec for rec in session.records
               if type(rec.fn) is torchscript.Scripted and report.sites(rec.frames, rec.fn)[0] == site]
    if not records:
        return None
    return torchscript.scripted([o for rec in records for o in rec.fn.objects]), records[0]


def _made_in_forward(g: _guard.Guard, window: list, session: replay.Session, made: int, sink: int | None,
                     found: dict, how: list) -> tuple[Any, str | None, Any, list[str]]:
    """The backward node met a non-finite value the forward saved for it: the forward made it (a fully masked
    attention row, a padded position), and the loss never used it, so the loss is finite. Name that op, and the ops
    that kept it from the loss (``sink``: the loss's record)."""
    walked = replay.walk(session, made)
    rec = session.records[walked["origin"]]
    label, op = _label(rec)
    module = _module_path(g, window, rec.root, rec.module)
    own, user_site, user = report.sites(rec.frames, rec.fn)
    in_module = f" in module '{module}'" if module else ""
    node = found["node"]
    entered = walked["entered"]
    called = f"\n  called from your code at\n    {report.where(user_site)}" \
        if user_site is not None and user_site != own else ""
    if entered is not None:  # the data (or a parameter, a constant) held it: no forward op made it
        lines = _entered(g, session, _names(g, window), rec, entered,
                         f"{in_module} at\n    {report.where(own)}{called}", f"{_FORWARD_MET} it entered")
        op = module = None
    else:
        finite = "inputs finite but for a mask" if _made_from_a_mask(walked) else "inputs finite"
        lines = [f"{_FORWARD_MADE} {label} created {report.kinds_words(rec.kinds)} ({finite}){in_module} at"
                 f"\n    {report.where(own)}{called}", *_made_advice(session, rec, label),
                 *_inf_lines(session, _names(g, window), rec, label)]
    if walked["transition"] is not None:
        lines.append(_became(g, window, session.records[walked["transition"]]))
    lines.extend(_masks(session, _names(g, window), walked["masks"]))
    hiders, first = _hiders(session, made, sink) if sink is not None else ("", "")
    if hiders:
        why = f"{hiders} took that value and returned finite values, so the loss stayed finite"
    elif entered is not None:
        why = "An op that saturates (tanh, a clamp) or a mask kept that value from the loss, so it stayed finite"
    else:
        why = "The loss did not use that value (a masked, padded or dropped position, say), so it stayed finite"
    if entered is not None:
        keep = f"Keep the input finite where it comes from: {first or 'saturating it'} hides it from the loss, not " \
            "from the backward"
    elif _made_from_a_mask(walked) or not first:
        keep = "Keep the value finite where it is made (a fully masked attention row: mask with a large negative " \
            "number, or give such rows one unmasked key)"
    else:
        keep = f"Keep the value finite where it is made: {first} hides it from the loss, not from the backward"
    met, made = found["saved"], found["kinds"]
    lines.append(f"  {why}; the backward of {node} met {report.kinds_words(met)} among the values the forward saved, "
                 f"and finite gradients times it gave {report.kinds_words(made)} ({_times(met, made)}). {keep}.")
    return op, module, report.stack_summary(user) if user else None, [*lines, *_written_inputs(session, True), *how]


def _times(met: frozenset, made: frozenset) -> str:
    """The arithmetic by which finite gradients times the saved values ``met`` gave ``made``."""
    if "nan" in met:
        return "anything times NaN is NaN"
    if "nan" in made:
        return f"0 x {report.kinds_words(met - {'nan'}).replace(', ', ' or ')} is NaN"
    return "a finite value times ±Inf is ±Inf"


def _hiders(session: replay.Session, made: int, sink: int) -> tuple[str, str]:
    """(the ops that kept the value made at ``made`` from the loss, each named once with the user's line that ran it,
    at most three; the first one's name): ('', '') where the replay saw none (the loss code was not recorded)."""
    named: dict[str, str] = {}
    for i in replay.hid(session, made, sink):
        label, at = _call_at(session.records[i])
        named.setdefault(at, label)
    if not named:
        return "", ""
    shown = list(named)[:3] + ([f"{len(named) - 3} more"] if len(named) > 3 else [])
    return (shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"), next(iter(named.values()))


def _hooked(g: _guard.Guard, window: list, found: dict, how: list) -> tuple[Any, None, Any, list[str]]:
    """Every op's backward stayed finite and a hook on the parameter (Tensor.register_hook) made its gradient
    non-finite: name the hooks, where each is defined, and the parameter."""
    names = _names(g, window)
    labels, sites = [], []
    for hook in found["hook"]:
        function = hook if inspect.isfunction(hook) or inspect.ismethod(hook) else type(hook).__call__  # an object
        labels.append(getattr(hook, "__qualname__", None) or type(hook).__qualname__)
        sites.append(_defined_at(function))
    which = "a hook" if len(labels) == 1 else f"one of the {len(labels)} hooks"
    lines = [f"  Every op's backward stayed finite in the replay; the gradient of "
             f"{names.get(id(found['param']), 'a parameter')} became {report.kinds_words(found['kinds'])} in {which} "
             "registered on it with Tensor.register_hook:"]
    lines.extend(f"    {label} at {report.where(site)}" for label, site in zip(labels, sites, strict=True))
    user = [site for site in sites[:1] if site is not None and not report.is_library(site[0])]
    return f"hook {', '.join(labels)}", None, report.stack_summary(user) if user else None, [*lines, *how]


def _defined_at(function: Any) -> tuple | None:
    """(file, line, name) of the ``def`` of ``function`` (a custom autograd.Function's backward, a gradient
    hook), for the message."""
    try:
        function = inspect.unwrap(function)
        lines, start = inspect.getsourcelines(function)
        at = next((i for i, text in enumerate(lines) if text.lstrip().startswith("def ")), 0)  # past decorators
        return inspect.getsourcefile(function), start + at, function.__qualname__
    except (OSError, TypeError):
        return None


# -- GradScaler's skips: gradients non-finite at every scale ---------------------------------------
def unscaled(g: _guard.Guard, window: list, losses: list, streak: int, scale: float | None,
             lowest: float | None = None, finite_at: list | None = None, confirmed: bool = False) -> None:
    """GradScaler skipped ``streak`` steps in a row; the backward replayed at scale 1 tells an op whose
    gradients are non-finite at every scale (raise, naming it) from an overflow (return: only skips).

    Gradients that a backward op makes non-finite at scale 1 may still be an overflow: an fp16 gradient above 65504
    unscaled (a loss summed over many elements, or weighted up), which GradScaler fixes by backing off below 1, and
    trains there. So they are replayed once more at ``lowest``, the lowest scale GradScaler tries before ampguard
    stops the streak, and finite there they only skip, as without ampguard.

    Non-finite at every scale, they may still be one batch's (an outlier), which GradScaler skips and trains on:
    it raises only where the skipped step before was non-finite at every scale too (``confirmed``). ``finite_at``
    gets the scale at which the gradients were finite, or None where they were not (for the next skip's replay and
    the collapse error's causes)."""
    __tracebackhide__ = True
    if not any(type(c) is Call and c.grad for c in window):
        return
    kinds: set = set()
    try:
        op, module, origin, lines = sinks.outside_compile(_replay_backward)(g, window, losses, kinds)
        if op is None and not _forward_made(lines):
            if finite_at is not None:
                finite_at.append(1.0)
            return  # finite at scale 1: a genuine overflow, which GradScaler's backing off handles
        below = lowest is not None and lowest < 1.0 and not _forward_made(lines)  # (a forward value: every scale)
        if below:
            op_low, _, _, lines_low = sinks.outside_compile(_replay_backward)(g, window, losses, set(), lowest)
            if op_low is None and not _forward_made(lines_low):
                if finite_at is not None:
                    finite_at.append(lowest)
                return  # an overflow even unscaled: GradScaler backs off below 1 and trains there
    except (AmpGuardError, AmpGuardWarning):
        raise
    except Exception as exc:  # a failed diagnosis must not turn skips into a crash: GradScaler goes on
        log.error("ampguard: the scale-1 replay after %d GradScaler skips failed", streak, exc_info=exc)
        return
    if finite_at is not None:
        finite_at.append(None)
    if not confirmed:
        return  # the next skipped step, a new batch, is replayed too; only if it agrees is the streak stopped
    kind = replay.primary(frozenset(kinds)) or "nan"
    sink = "gradients at every loss scale"
    if not _first_time(g, (sink, op)):
        return
    g.stats.nonfinite_detected += 1
    at = f" (loss scale {scale:g})" if scale is not None else ""
    limit = g.options.max_consecutive_skips
    stop = "the scale collapses" if limit is None else f"max_consecutive_skips={limit} stops the run"
    tried = f"at scale 1 and at scale {lowest:g} (the lowest GradScaler tries before {stop})," if below else \
        "at scale 1"
    verdict = "no loss scale can fix them, and without this check the scale would collapse" if limit is None else \
        "backing off cannot fix them before max_consecutive_skips stops the run"
    head = [f"ampguard: GradScaler skipped {streak} optimizer steps in a row{at} because of inf/NaN gradients, "
            f"and replayed {tried} the gradients are still {report.kind_word(kind)}: {verdict}.",
            "  Found by replaying the step's forward and backward (same inputs, RNG state, autocast and grad mode) "
            "without scaling the loss. The skipped step before this one was non-finite at every scale too, so it "
            "is not one bad batch (GradScaler skips such a batch and trains on)."]
    made_by = "a non-finite input of the forward did (above)" if lines and lines[0].startswith(_FORWARD_MET) else \
        "the forward made it (above)" if _forward_made(lines) else _backward_made(lines, scaled=True)
    tail = [f"  The loss was finite: {made_by}. This check replays after "
            f"check_unscaled_after={g.options.check_unscaled_after} skips in a row, and raises where two skipped steps "
            "in a row agree."]
    error = NonFiniteError("\n".join(head + lines + tail), kind=kind, sink=sink, op=op, module=module, origin=origin)
    if g.options.repro_dir is not None:
        repro.attach(g, error, window)
    emit(g, error)


# -- parameters a step made non-finite -------------------------------------------------------
def _param_name(names: dict, params: list, param: Any) -> str:
    """Its dotted name in the model that owns it, or its place in the optimizer if no model call was seen."""
    if param is None:
        return "a parameter"
    return names.get(id(param)) or f"parameter '#{next(i for i, q in enumerate(params) if q is param)}'"


def _made_by_a_step(g: _guard.Guard, tensor: Any) -> list[str]:
    """A parameter that entered non-finite after an optimizer step of this thread. That step made it when
    its settings say so (a non-finite learning rate, an fp16 eps that rounds to 0); otherwise code outside the
    optimizer may have written it since, and the message says both."""
    if not isinstance(tensor, sinks._torch.nn.Parameter):
        return []
    optimizer = sinks.stepped_optimizer_of(tensor)
    if optimizer is None:
        return ["  No optimizer step of this run touched it: it was loaded or set that way."]
    name = g.name_of(optimizer)
    checked = ("its gradients were finite at that step (ampguard checks them before every step, or GradScaler "
               "let the step through)")
    hint = eps_message(optimizer)
    bad = _non_finite_settings(optimizer, tensor) or _non_finite_state(optimizer, tensor)
    if hint or bad:
        why = f"its {bad}" if bad else "eps rounds to 0 (below)"
        lines = [f"  The optimizer step of {name} made it: {checked}, and {why}."]
        if bad.startswith("state 'momentum_buffer'") and _group_of(optimizer, tensor).get("fused"):
            lines.append("  torch's fused SGD (fused=True) stores the momentum buffers of a first step that GradScaler "
                         "skips uninitialised; ampguard takes them out unless its schedulers option is off. Otherwise "
                         "the state came from a checkpoint, or was written by hand.")
    else:
        lines = [f"  The optimizer step of {name} ran on it after its last check: {checked}. So either that step "
                 "made it (a learning rate that diverges, an eps that rounds to 0), or code outside the optimizer "
                 "wrote it after the step (parameters set by hand, a checkpoint loaded)."]
    if hint:
        lines.append("  " + hint[0].upper() + hint[1:])
    return lines


def _non_finite_state(optimizer: Any, param: Any) -> str:
    """"state 'exp_avg' for this parameter is not finite (NaN)" where the optimizer's own state for ``param`` holds a
    non-finite value: the step computed the parameter from it. Read on the failure path, for that one parameter."""
    state = getattr(optimizer, "state", None)
    entry = state.get(param) if isinstance(state, dict) else None
    for key, value in (entry or {}).items():
        if isinstance(value, sinks._torch.Tensor) and (value.is_floating_point() or value.is_complex()) and \
                value.numel():
            found = replay.kinds(value)  # (a sharded state's shard on this rank: reading the whole is a collective)
            if found:
                return f"state '{key}' for this parameter is not finite ({report.kinds_words(found)})"
    return ""


def _group_of(optimizer: Any, param: Any) -> dict:
    """The param group of ``optimizer`` that holds ``param`` (empty if none does)."""
    return next((group for group in optimizer.param_groups if any(p is param for p in group["params"])), {})


def _non_finite_settings(optimizer: Any, param: Any) -> str:
    """'learning rate is inf' (or another float setting) for the param group of ``param``, or ''."""
    for key, value in _group_of(optimizer, param).items():
        number = value.item() if isinstance(value, sinks._torch.Tensor) and value.numel() == 1 else value
        if isinstance(number, float) and not math.isfinite(number):
            return f"{'learning rate' if key == 'lr' else key} is {number}"
    return ""


# -- eager -----------------------------------------------------------------------------------
def check_eager(func: Any, frames: tuple, index: int, outs: list, args: tuple, kwargs: dict) -> None:
    """trace='eager': stop at the op that made a NaN from inputs without one, as it runs (``frames``: the op's, as a
    TapeOp keeps them; ``index``: its place in the window)."""
    __tracebackhide__ = True
    torch = sinks._torch
    if getattr(func, "__name__", None) in sinks.UNINITIALIZED:
        return
    with torch._C.DisableTorchFunction():
        bad = [o for o, _ in outs if bool(torch.isnan(o).any())]
        if not bad:
            return
        from torch.utils._pytree import tree_leaves

        leaves = tree_leaves((args, kwargs))
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
        numbers = [v for v in leaves if isinstance(v, float) and v != v]
        if any(bool(torch.isnan(t).any()) for t in inputs):
            return
        infinite = [v for v in leaves if isinstance(v, float) and v in (math.inf, -math.inf)] or \
            [t for t in inputs if bool(torch.isinf(t).any())]  # (an Inf in: the op did not make it from finite values)
    g = _guard.current(sinks.FEATURE)
    if g is None:
        return
    label = op = report.op_name(func)
    inside = _inside_script(func, args, kwargs) if type(func) is torchscript.ScriptCall else None
    if inside is not None:
        label, op = f"{inside} inside {label}", inside
    stack = T.eager_stack
    module = _module_path(g, T.window, stack[0], stack[-1]) if stack else None
    own, user_site, user = report.sites(frames)
    how = f"from the Python number {numbers[0]!r} it was given" if numbers else \
        "from inputs that held Inf but no NaN" if infinite else "from inputs without NaN"
    lines = [f"ampguard: {label} created NaN {how}"
             + (f" in module '{module}'" if module else "") + f" at\n    {report.where(own)}"]
    if inside is not None:
        lines.extend(_script_lines(func.label(), inside))
    if user_site is not None and user_site != own:
        lines.append(f"  called from your code at\n    {report.where(user_site)}")
    lines.append(f"  value: {report.describe_tensor(bad[0])}")
    if not numbers and not infinite:
        lines.extend(_op_advice(label, ("nan",)))
    if user:
        lines.append("  your stack at the origin (innermost last):")
        lines.extend("    " + line.rstrip("\n") for line in report.stack_summary(user).format())
    lines.append(_CAUSES)
    sink = "the output of this op"
    error = NonFiniteError("\n".join(lines), kind="nan", sink=sink, op=op, module=module,
                           origin=report.stack_summary(user) if user else None, chain=[label])
    if g.options.nonfinite == "raise" and sinks._read_by_every_rank(g):
        if not any(type(p) is sinks.Found for p in T.pending):  # (the first origin; what it reaches is no other)
            T.pending.append(sinks.Found(g, error, bad[0], index))
        return
    g.stats.nonfinite_detected += 1
    if _first_time(g, (sink, own)):
        emit(g, error)


def _inside_script(call: Any, args: tuple, kwargs: dict) -> str | None:
    """The aten op inside a script function that made its NaN output, which trace='eager' found: none of the script's
    ops ran in Python to be checked. Found by running the script again on copies of its inputs under the replay's
    dispatch mode, with the run's state left as it was (failure path only); None if that finds none."""
    torch = sinks._torch
    from torch.utils._pytree import tree_leaves, tree_map

    try:
        session = replay.Session()
        checker, _ = replay._modes(session)
        args, kwargs = tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, (args, kwargs))
        with replay.untouched([]), torch.no_grad(), checker:
            out = call(*args, **kwargs)
        for made in tree_leaves(out):
            start = session.producer_of(made) if isinstance(made, torch.Tensor) else None
            if start is not None and "nan" in session.records[start].kinds:
                return session.records[replay.walk(session, start)["origin"]].name
    except Exception as exc:  # (the message names the script function and the line that called it, as before)
        log.debug("ampguard: the script function could not be run again", exc_info=exc)
    return None
