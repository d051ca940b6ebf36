"""Words for a non-finite value: kinds, tensors, names from the model that owns them, and sites.

A site is two places: the op's own line (which may be inside torch or a model library, such
as ``F.multi_head_attention_forward``), and the user's call site, the first frame outside
site-packages and the standard library, with ampguard's and torch's plumbing trimmed.
"""

from __future__ import annotations

import linecache
import math
import os
import sys
import sysconfig
import traceback
from typing import Any

from .._frames import line_at
from . import sinks, torchscript

_LIMITS = {"torch.float16": 65504.0, "torch.bfloat16": 3.39e38, "torch.float32": 3.40e38, "torch.float64": 1.8e308}
_HERE = os.path.dirname(os.path.abspath(__file__))
_PLUMBING = tuple(os.path.join("torch", p) for p in (
    "_ops.py", os.path.join("utils", "_python_dispatch.py"), "overrides.py", os.path.join("utils", "_contextlib.py"),
    os.path.join("autograd", "grad_mode.py"), os.path.join("amp", "autocast_mode.py"),
    os.path.join("_dynamo", "eval_frame.py"), os.path.join("nn", "modules", "module.py"), "_compile.py",
    os.path.join("utils", "_pytree.py"), "_jit_internal.py", os.path.join("autograd", "function.py"),
    os.path.join("_library", "custom_ops.py"), os.path.join("_library", "autograd.py")))
_OVERRIDES = os.path.join("torch", "overrides.py")
_LIBRARIES: tuple[str, ...] = ()


def kind_of(value: float) -> str | None:
    if value != value:
        return "nan"
    if value == math.inf:
        return "inf"
    if value == -math.inf:
        return "-inf"
    return None


def kind_word(kind: str | None) -> str:
    return {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}.get(kind or "nan", "NaN")


def kinds_words(kinds: Any) -> str:
    return ", ".join(kind_word(k) for k in ("nan", "inf", "-inf") if k in kinds) or "finite values"


def op_name(func: Any) -> str:
    """A torch-level function as users write it: torch.log, Tensor.div, torch.nn.functional.linear."""
    import torch

    if isinstance(func, str):
        return func  # (a torchscript.Scripted too: the script an op ran inside)
    if type(func) is torchscript.ScriptCall:
        return str(func.label())
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):  # torch.ops.mylib.op (a custom op)
        return str(func).removesuffix(".default")
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":
        return "Tensor attribute"
    if getattr(torch.Tensor, name, None) is func or getattr(func, "__objclass__", None) is torch._C.TensorBase:
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch._C") or module == "torch._tensor":
        module = "torch"
    return f"{module}.{name}"


def describe_tensor(tensor: Any) -> str:
    """Shape, dtype, how many NaN/Inf, and the finite abs-max against the dtype's limit."""
    import torch

    if tensor is None:
        return "freed before the check: no element counts"
    with torch._C.DisableTorchFunction():
        t = tensor.detach()
        shard = " in this rank's shard" if type(t).__name__ == "DTensor" else ""  # (stored() reads the local shard)
        sparse, dtype = t.layout is not torch.strided, t.dtype
        shape, layout = sinks.shape_of(t), f", {str(t.layout).replace('torch.', '')}" if sparse else ""
        what = ("stored " if sparse else "") + ("real and imaginary part" if t.is_complex() else "element")
        t = sinks.stored(t)  # (a sparse tensor's values: its implicit zeros are finite; a complex one's parts)
        nan = int(torch.isnan(t).sum())
        pos = int(torch.isposinf(t).sum())
        neg = int(torch.isneginf(t).sum())
        finite = t[torch.isfinite(t)]
        text = f"shape {shape}, {dtype}{layout}; {nan} NaN, {pos} +Inf, {neg} -Inf of {t.numel()} " \
            f"{what}{'s' if t.numel() != 1 else ''}{shard}"
        if finite.numel():
            amax = float(finite.abs().max())
            limit = _LIMITS.get(str(t.dtype))
            text += f"; finite max |x| = {amax:.3g}"
            if limit:
                text += f" ({amax / limit:.0%} of the {str(t.dtype).replace('torch.', '')} limit {limit:.4g})"
    return text


# -- sites -------------------------------------------------------------------------------------
def _libraries() -> tuple[str, ...]:
    global _LIBRARIES
    if not _LIBRARIES:
        paths = sysconfig.get_paths()
        roots = {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"], _HERE}
        from .._frames import _internal_roots

        roots.update(_internal_roots())
        _LIBRARIES = tuple(os.path.abspath(r).rstrip(os.sep) + os.sep for r in roots)
    return _LIBRARIES


def is_library(filename: str) -> bool:
    """Installed code (site-packages, the standard library, torch, Lightning, ampguard), not the user's."""
    if filename.startswith("<"):
        return not filename.startswith("<stdin>") and not filename.startswith("<string>")
    path = os.path.abspath(filename)
    return path.startswith(_libraries()) or f"{os.sep}site-packages{os.sep}" in path or \
        f"{os.sep}dist-packages{os.sep}" in path


def _plumbing(filename: str) -> bool:
    return filename.startswith(_HERE) or filename.endswith(_PLUMBING) or \
        (filename.startswith("<") and "torch" in filename)


def normalise(frames: tuple) -> list[tuple[str, int, str]]:
    """Frames as (filename, lineno, function), innermost first, from recorded (code, f_lasti) pairs
    or parsed text."""
    out = []
    for f in frames:
        if isinstance(f[0], str):
            out.append(f)
        else:
            code, lasti = f
            out.append((code.co_filename, line_at(code, lasti), code.co_name))
    kept, dispatched = [], False
    for f in out:
        if dispatched:  # a torch function handing itself to a mode (the loss-code record): its line says nothing
            dispatched = False
            continue
        dispatched = f[2] == "handle_torch_function" and f[0].endswith(_OVERRIDES)
        if not _plumbing(f[0]):
            kept.append(f)
    return kept


def sites(frames: tuple, fn: Any = None) -> tuple[tuple | None, tuple | None, list]:
    """(the op's own frame, the user's call site, the user's frames innermost first).

    ``fn``: the torch function the op ran inside. Its own body's frames are skipped, so that an op inside
    ``F.cross_entropy`` is placed at the line that called ``F.cross_entropy`` (in a library's loss code, say),
    not at a line of torch's functional.py."""
    frames_ = normalise(frames)
    inside = _source_file(fn)
    if inside is not None:
        past = 0
        while past < len(frames_) - 1 and frames_[past][0] == inside:
            past += 1
        frames_ = frames_[past:]
    own = frames_[0] if frames_ else None
    user = [f for f in frames_ if not is_library(f[0])]
    return own, user[0] if user else None, user


def _source_file(fn: Any) -> str | None:
    """The file of the torch module that defines ``fn`` (torch/nn/functional.py for F.cross_entropy), or None."""
    name = getattr(fn, "__module__", None)
    if not name or not name.startswith("torch"):
        return None
    module = sys.modules.get(name)
    return getattr(module, "__file__", None)


def where(frame: tuple | None) -> str:
    if frame is None:
        return "(no frame)"
    filename, lineno, function = frame
    line = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno}" + (f" in {function}" if function else "") + (f"\n      {line}" if line else "")


def stack_summary(user: list) -> traceback.StackSummary:
    """The user's frames as a StackSummary, innermost last (as tracebacks read)."""
    return traceback.StackSummary.from_list([
        traceback.FrameSummary(f, n, fn, line=linecache.getline(f, n).strip()) for f, n, fn in reversed(user)])


# -- names -------------------------------------------------------------------------------------
def module_path(root: Any, module: Any) -> str | None:
    """The dotted path of ``module`` in ``root``; the root itself by its class name."""
    if module is None or root is None:
        return None
    root = getattr(root, "_orig_mod", root)
    module = getattr(module, "_orig_mod", module)
    if module is root:
        return torchscript.class_name(root)
    for name, m in root.named_modules():
        if m is module:
            return name.replace("._orig_mod", "")  # a compiled submodule reads as the attribute it is
    return torchscript.class_name(module)


def tensor_names(roots: list, sites: dict | None = None) -> dict[int, str]:
    """id(parameter or buffer) -> "parameter 'blocks.0.fc.weight'", named in the root that owns the most.

    A submodule called on its own is a root too; the model that contains it gives the full path. Roots that
    share no parameters can give one name twice (a GAN's generator and critic, each a Sequential: '0.weight'):
    such a name says whose it is, by the root's class and, from ``sites`` (id(root) -> (code, offset) of
    the user's line that called it), where it was called.
    """
    ordered = sorted({id(r): r for r in roots if r is not None}.values(),  # (of two as large, the container last)
                     key=lambda r: (sum(1 for _ in r.parameters()) + sum(1 for _ in r.buffers()),
                                    sum(1 for _ in r.modules())))
    names: dict[int, str] = {}
    owner: dict[int, Any] = {}
    for root in ordered:  # largest last: its names win
        paths: dict[int, list] = {}  # a tied weight (an embedding and the output head) has several
        for name, p in root.named_parameters(remove_duplicate=False):
            paths.setdefault(id(p), ["parameter"]).append(name)
        for name, b in root.named_buffers(remove_duplicate=False):
            paths.setdefault(id(b), ["buffer"]).append(name)
        for key, (kind, first, *others) in paths.items():
            also = ", ".join(f"'{o}'" for o in others)
            names[key] = f"{kind} '{first}'" + (f" (tied: also {also})" if others else "")
            owner[key] = root
    givers: dict[str, set] = {}
    for key, name in names.items():
        givers.setdefault(name, set()).add(id(owner[key]))
    for key, name in names.items():
        if len(givers[name]) > 1:
            root = owner[key]
            site = (sites or {}).get(id(root))
            at = f" called at {site[0].co_filename}:{line_at(*site)}" if site is not None else ""
            names[key] = f"{name} of the {torchscript.class_name(root)}{at}"
    return names
