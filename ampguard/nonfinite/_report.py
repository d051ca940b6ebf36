"""Walk back from a failed sink to the op that created the value, and write the error."""

from __future__ import annotations

import linecache
import math
import traceback
from typing import Any

_LIMITS = {"torch.float16": 65504.0, "torch.bfloat16": 3.39e38, "torch.float32": 3.40e38, "torch.float64": 1.8e308}


def kind_of(value: float) -> str | None:
    if value != value:
        return "nan"
    if value == math.inf:
        return "inf"
    if value == -math.inf:
        return "-inf"
    return None


def op_name(func: Any) -> str:
    import torch

    if isinstance(func, str):
        return func  # a region recorded as one op (a compiled module)
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":
        return "Tensor attribute"
    if getattr(torch.Tensor, name, None) is func or getattr(func, "__objclass__", None) is torch._C.TensorBase:
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch._C") or module == "torch._tensor":
        module = "torch"
    return f"{module}.{name}"


def stack_summary(frames: tuple) -> traceback.StackSummary:
    """User frames (innermost first as recorded) as a StackSummary, innermost last."""
    entries = []
    for code, lineno in reversed(frames):
        entries.append(traceback.FrameSummary(code.co_filename, lineno, code.co_name,
                                              line=linecache.getline(code.co_filename, lineno).strip()))
    return traceback.StackSummary.from_list(entries)


def walk(records: list, values: list[float], start: int) -> tuple[int, int | None, list[int]]:
    """(origin, transition, chain) from the record at ``start`` back along non-finite inputs.

    The origin is the op whose inputs were all finite and whose output was not. ``transition``
    is the op, if any, where the kind changed (an -inf turned into NaN, say).
    """
    chain = [start]
    current = start
    transition = None
    seen = {start}
    while True:
        here = kind_of(values[current])
        bad_inputs = [i for i in records[current].inputs if i not in seen and kind_of(values[i]) is not None]
        if not bad_inputs:
            break
        same = [i for i in bad_inputs if kind_of(values[i]) == here]
        nxt = (same or bad_inputs)[0]
        if kind_of(values[nxt]) != here:
            transition = current
        seen.add(nxt)
        chain.append(nxt)
        current = nxt
    chain.reverse()
    return current, transition, chain


def describe_tensor(tensor: Any) -> str:
    """Shape, dtype, how many NaN/Inf, and the finite abs-max against the dtype's limit."""
    import torch

    if tensor is None:
        return "the tensor was already freed"
    t = tensor.detach()
    nan = int(torch.isnan(t).sum())
    pos = int(torch.isposinf(t).sum())
    neg = int(torch.isneginf(t).sum())
    finite = t[torch.isfinite(t)]
    text = f"shape {tuple(t.shape)}, {t.dtype}; {nan} NaN, {pos} +Inf, {neg} -Inf of {t.numel()} elements"
    if finite.numel():
        amax = float(finite.abs().max())
        limit = _LIMITS.get(str(t.dtype))
        text += f"; finite max |x| = {amax:.3g}"
        if limit:
            text += f" ({amax / limit:.0%} of the {str(t.dtype).replace('torch.', '')} limit {limit:.4g})"
    return text


def site(record: Any) -> str:
    if not record.frames:
        return "(no user frame)"
    code, lineno = record.frames[0]
    line = linecache.getline(code.co_filename, lineno).strip()
    return f"{code.co_filename}:{lineno} in {code.co_name}\n      {line}"
