"""Reproducer bundles: a NaN at hour 37 of a multi-GPU job, replayed on a workstation in seconds.

On the failure path only (``repro_dir`` set), after the replay has found the origin, one more
replay captures the *smallest module whose call holds the origin op* at the entry of that call:
the module (its class from your code, its parameters), its buffers as they were then, its inputs,
the RNG state, autocast and grad mode. An op of the loss code, outside any module, is bundled as
the op and its inputs. A backward origin bundles the outermost call (its forward and backward).

A bundle is one ``torch.save`` file whose outer layer loads with ``weights_only=True`` (metadata,
tensors, and the module's own pickle as bytes). ``python -m ampguard repro PATH`` loads it,
rebuilds the module (that part needs ``weights_only=False``: a module is an object of your code),
runs it under a fresh guard and prints the same origin report.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import os
import platform
import sys
import time
from typing import Any

from .. import _guard, _sync
from .._errors import NonFiniteError
from . import replay, report, sinks, torchscript
from .sinks import T, TapeOp, log

FORMAT = "ampguard-repro/1"


@dataclasses.dataclass
class Origin:
    """What the failure path found, for the bundle: the window, the event the op ran in, and (forward)
    the index of its record in a replay of that window with the same naming. It travels on the thread
    state (``T.repro_origin``) from the error's build to attach()."""

    window: list
    event: int
    record: int | None
    direction: str  # "forward" or "backward"
    module: Any = None  # the innermost module the op ran in (forward), None for the loss code or the root
    names: bool = True


class NotBundled(Exception):
    """Why no bundle was written; the message says it in one line."""


def attach(g: _guard.Guard, error: NonFiniteError, window: list | None = None) -> None:
    """Write the bundle for ``error`` into ``g.options.repro_dir``; set ``error.repro`` and say where (or why not)."""
    origin, T.repro_origin = T.repro_origin, None
    try:
        if origin is None:
            for call in window or ():
                module = call.module if type(call) is not TapeOp else None  # (None too: dropped, see sinks.Call)
                if module is not None:
                    _check_bundlable(getattr(module, "_orig_mod", module))  # FSDP: says why
        path = write(g, error, origin)
        error.repro = path
        line = f"  reproducer: {path}\n    python -m ampguard repro {path}"
    except NotBundled as why:
        line = f"  no reproducer written: {why}"
    except Exception as exc:  # the error is the news; a failed bundle must not hide it
        log.error("ampguard: writing a reproducer failed", exc_info=exc)
        line = f"  no reproducer written: {type(exc).__name__}: {exc} (see the 'ampguard' log)"
    error.add_line(line)


def write(g: _guard.Guard, error: NonFiniteError, origin: Origin | None) -> str:
    torch = sinks._torch
    if origin is None:
        raise NotBundled("no origin was found to bundle (the replay did not reproduce it, or did not run)")
    window = origin.window
    event = window[origin.event]
    captured = _capture(origin)
    target = captured.pop("target")
    if target is None:  # an op of the loss code, or of a method's own code (training_step's)
        name = report.op_name(captured.pop("func"))
        try:
            _resolve_func(name)
        except (ImportError, AttributeError, ValueError):
            raise NotBundled(f"the op {name} is not one of torch's, and a bundle names its op by its path in torch "
                             "(a TorchScript function or a custom op is not)") from None
        kind, payload = "op", {"func": name, "args": captured.pop("args"), "kwargs": captured.pop("kwargs")}
        names = {"module_class": None, "module_path": None, "root_class": None}
    else:
        root, module = getattr(event.module, "_orig_mod", event.module), target
        _check_bundlable(module)
        kind, payload = "module", {"module": module, "args": captured.pop("args"), "kwargs": captured.pop("kwargs")}
        names = {"module_class": f"{type(module).__module__}.{type(module).__qualname__}",
                 "module_path": report.module_path(root, module), "root_class": type(root).__qualname__}
    buffer = io.BytesIO()
    try:
        torch.save(payload, buffer)
    except Exception as exc:
        raise NotBundled(f"the module or its inputs cannot be pickled ({type(exc).__name__}: {exc})") from None
    data = buffer.getvalue()
    weights_only = kind == "op" and _loads_weights_only(data)
    size = len(data) + sum(t.numel() * t.element_size() for t in captured["buffers"].values())
    limit = g.options.repro_max_mb
    if size > limit * 2**20:
        raise NotBundled(f"the bundle would be {size / 2**20:.1f} MB, over repro_max_mb={limit:g}; raise "
                         "repro_max_mb to write it")
    rank = _rank()
    meta = {
        "format": FORMAT, "kind": kind, "direction": origin.direction, **names,
        "versions": {"torch": str(torch.__version__), "ampguard": str(_version()), "python": platform.python_version()},
        "options": {k: repr(v) for k, v in g.options.as_dict().items()},
        "message": str(error), "op": error.op, "sink": error.sink, "script": sys.argv[0] if sys.argv else "",
        "rank": rank, "payload": _as_tensor(data), "payload_weights_only": weights_only, **captured,
    }
    folder = os.path.abspath(os.path.expanduser(g.options.repro_dir))
    os.makedirs(folder, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"ampguard-repro-{stamp}-{os.getpid()}" + (f"-rank{rank}" if rank is not None else "")
    path = os.path.join(folder, name + ".pt")
    n = 1
    while os.path.exists(path):
        path = os.path.join(folder, f"{name}-{n}.pt")
        n += 1
    tmp = path + ".partial"
    torch.save(meta, tmp)
    os.replace(tmp, path)  # a bundle is whole or absent
    g.reproducers.append(path)
    return path


def _capture(origin: Origin) -> dict:
    """Replay the window up to the origin once more and take the inputs and buffers of the smallest module
    call holding it, at that call's entry."""
    torch = sinks._torch
    window = origin.window
    event = window[origin.event]
    session = replay.Session()
    if type(event) is TapeOp:
        target = root = None
    else:
        if event.swapped is not None:
            raise NotBundled("the call ran under torch.func.functional_call, with parameters the module does not "
                             "hold: a bundle holds the module's own")
        root = getattr(event.module, "_orig_mod", event.module)
        target = getattr(origin.module, "_orig_mod", origin.module) if origin.module is not None else root
    with replay.untouched(window):
        if root is not None and target is root and event.method is not None:  # an op in training_step's own code
            return _capture_method_op(session, window, origin)
        if target is None or target is root:  # the loss code, or the root (the replay calls its forward itself)
            replay.run_window(session, window[:origin.event], names=origin.names)
            try:
                if target is None:
                    args = replay._map(session, event.args, True, "an input of the loss code")
                    kwargs = replay._map(session, event.kwargs, True, "an input of the loss code")
                    return {**_snapshot(None, args, kwargs, event.autocast, event.grad, False), "target": None,
                            "func": event.func}
                args, kwargs = replay._map_call(session, event, torchscript.class_name(root))
            except replay.Freed as freed:
                raise NotBundled(str(freed)) from None
            return {**_snapshot(root, args, kwargs, event.autocast, event.grad, event.inference, rng=event.rng),
                    "target": root}
        taken: dict = {}

        def pre(module: Any, args: tuple, kwargs: dict) -> None:
            taken.clear()  # the latest entry before the origin op: a module called twice is bundled at the call
            taken.update(_snapshot(module, args, kwargs, sinks._autocast_state(), torch.is_grad_enabled(),
                                   torch.is_inference_mode_enabled(), rng=sinks._rng_state()))

        _replay_to_origin(session, window, origin, target.register_forward_pre_hook(pre, with_kwargs=True), taken,
                          "the call that holds the origin")
    return {**taken, "target": target}


def _replay_to_origin(session: replay.Session, window: list, origin: Origin, watching: Any, taken: dict,
                      what: str) -> None:
    """The replay that found the origin once more, stopped at its record, with ``watching`` (a context: a hook, a
    mode) filling ``taken`` on the way; NotBundled where nothing was taken."""
    session.stop_after = origin.record
    try:
        with watching:
            replay.run_window(session, window[:origin.event + 1], names=origin.names)
    except replay.Reached:
        pass
    if not taken:
        raise NotBundled(session.unreplayed.get(origin.event, f"the capture replay did not reach {what}"))


def _capture_method_op(session: replay.Session, window: list, origin: Origin) -> dict:
    """An origin in the code of the method a call ran (Lightning's training_step), outside its submodules: the loss
    code of that step. Bundled as the loss code's ops are, the op and its inputs: the top-level torch call during
    which the replay makes the origin's record, with its inputs as it began (a copy taken then only where the op
    writes into one)."""
    torch = sinks._torch
    from torch.utils._python_dispatch import _disable_current_modes

    taken: dict = {}

    class Entry(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            state = (sinks._autocast_state(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            before = (args, kwargs)
            if _writes_into_input(func):
                with _disable_current_modes():  # (the copy is no op of the replay's: not recorded)
                    before = (_detached(args), _detached(kwargs))
            try:
                return func(*args, **kwargs)
            except replay.Reached:
                if not taken:
                    with _disable_current_modes():
                        taken.update(_snapshot(None, *before, *state), func=func)
                raise

    _replay_to_origin(session, window, origin, Entry(), taken, "the op that made the origin")
    return {**taken, "target": None}


def _writes_into_input(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("__")) or \
        (name.startswith("__i") and name.endswith("__"))


def _snapshot(module: Any, args: Any, kwargs: Any, autocast: Any, grad: bool, inference: bool,
              rng: Any = None) -> dict:
    from torch.utils._pytree import tree_leaves

    torch = sinks._torch
    cpu, cuda = rng if rng is not None else sinks._rng_state()
    return {
        "args": _detached(args), "kwargs": _detached(kwargs),
        "buffers": {name: b.detach().clone() for name, b in module.named_buffers()} if module is not None else {},
        "rng_cpu": cpu.clone(), "rng_cuda": (cuda[0], cuda[1].clone()) if cuda is not None else None,
        "autocast": [(device, str(dtype).replace("torch.", "")) for device, dtype in (autocast or ())],
        "grad": bool(grad), "inference": bool(inference), "training": bool(getattr(module, "training", True)),
        "devices": sorted({t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                          or {"cpu"}),
        "torch_default_dtype": str(torch.get_default_dtype()).replace("torch.", ""),
    }


def _detached(value: Any) -> Any:
    """A copy of every tensor in ``value``, off the run's graph (a leaf that requires grad where it did)."""
    from torch.utils._pytree import tree_map_only

    def copy(t: Any) -> Any:
        out = t.detach().clone()
        return out.requires_grad_(True) if t.requires_grad and (out.is_floating_point() or out.is_complex()) else out

    return tree_map_only(sinks._torch.Tensor, copy, value)


def _check_bundlable(module: Any) -> None:
    for m in module.modules():
        names = {c.__name__ for c in type(m).__mro__}
        if names & {"FullyShardedDataParallel", "FSDPModule"}:
            raise NotBundled("FSDP-sharded modules are not bundled: each rank holds only a shard of the "
                             "parameters, so no one file can rebuild the module")
        if any(getattr(p, "_is_sharded", False) or type(p).__name__ == "DTensor" for p in m.parameters(recurse=False)):
            raise NotBundled("modules with sharded (DTensor) parameters are not bundled: each rank holds only a shard")


def _as_tensor(data: bytes) -> Any:
    """The inner payload as a uint8 tensor: torch before 2.5 loads no ``bytes`` with weights_only=True (protocol 2
    pickles them through ``_codecs.encode``, which its allowlist lacks), and every torch loads a tensor."""
    return sinks._torch.frombuffer(bytearray(data), dtype=sinks._torch.uint8)


def _as_bytes(payload: Any) -> bytes:
    """The inner payload's bytes (a bundle written before the payload was a tensor holds bytes)."""
    if isinstance(payload, bytes):
        return payload
    payload = payload.contiguous().cpu()
    return ctypes.string_at(payload.data_ptr(), payload.numel()) if payload.numel() else b""


def _loads_weights_only(data: bytes) -> bool:
    try:
        sinks._torch.load(io.BytesIO(data), weights_only=True)
        return True
    except Exception:
        return False


def _rank() -> int | None:
    return sys.modules["torch.distributed"].get_rank() if _sync.distributed() else None


def _version() -> str:
    from .. import __version__

    return __version__

# -- python -m ampguard repro ---------------------------------------------------------------------
class BadBundle(Exception):
    """A bundle that cannot be replayed here; the message is the one line the command prints."""


def _missing(path: str) -> BadBundle:
    return BadBundle(f"no such file: {path}")


def _op_module(func: Any, kwargs: dict) -> Any:
    """A loss-code op as a module call, so the guard records it and its replay names the op. An op that writes into
    its first argument (``scores[mask] = -inf``, ``x.mul_(s)``) writes into a copy of it: the bundle's tensor is a
    leaf that requires grad, which takes no in-place write."""
    import torch

    in_place = _writes_into_input(func)

    class OpCall(torch.nn.Module):
        def forward(self, *args: Any) -> Any:
            if in_place and args and isinstance(args[0], torch.Tensor):
                args = (args[0].clone(), *args[1:])
            return sinks.written_output(func, args, func(*args, **kwargs))

    return OpCall()


def _resolve_func(name: str) -> Any:
    """torch.log, Tensor.div, torch.nn.functional.cross_entropy: the op a bundle names, from torch."""
    import importlib

    import torch

    if name.startswith("Tensor."):
        return getattr(torch.Tensor, name[len("Tensor."):])
    if name.startswith("aten."):  # torch.ops.aten.add.Tensor, as op_name names it
        op = torch.ops.aten
        for part in name.split(".")[1:]:
            op = getattr(op, part)
        return op
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def load(path: str, device: str | None) -> tuple[dict, Any, Any, Any, str]:
    """(metadata, module, args, kwargs, how it was loaded); BadBundle with one line when it cannot be."""
    import torch

    # without --device, tensors go where they were recorded; on a machine without CUDA, to the CPU for now, and
    # run() says to pass --device cpu
    where = torch.device(device) if device is not None else None if torch.cuda.is_available() else torch.device("cpu")
    try:
        meta = torch.load(path, weights_only=True, map_location=where)
    except FileNotFoundError:  # (removed since run() looked)
        raise _missing(path) from None
    except Exception as exc:
        raise BadBundle(f"{path} is not a readable ampguard bundle ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise BadBundle(f"{path} is not an ampguard reproducer bundle (format {FORMAT} expected)")
    if meta["kind"] == "op":
        payload = torch.load(io.BytesIO(_as_bytes(meta["payload"])), weights_only=True, map_location=where)
        try:
            func = _resolve_func(payload["func"])
        except (ImportError, AttributeError, ValueError):
            raise BadBundle(f"the op {payload['func']} does not exist in torch {torch.__version__}") from None
        module = _op_module(func, payload["kwargs"])
        how = "loaded with weights_only=True (an op and its tensors)"
        return meta, module, payload["args"], {}, how
    try:
        payload = torch.load(io.BytesIO(_as_bytes(meta["payload"])), weights_only=False, map_location=where)
    except (ImportError, AttributeError) as exc:
        cls = meta.get("module_class") or "?"
        if cls.startswith("__main__."):
            raise BadBundle(f"the bundled module's class {cls[len('__main__.'):]} was defined in the script that ran "
                            f"({meta.get('script') or 'its __main__'}), which another process cannot import: define "
                            "it in a module of your code and run again") from None
        raise BadBundle(f"the bundled module's class {cls} cannot be imported here ({type(exc).__name__}: {exc}); run "
                        "from where your code is importable (its folder, or with it installed)") from None
    except Exception as exc:
        raise BadBundle(f"the module in {path} cannot be rebuilt ({type(exc).__name__}: {exc})") from None
    module = payload["module"]
    with torch.no_grad():
        for name, b in module.named_buffers():
            saved = meta["buffers"].get(name)
            if saved is not None and saved.shape == b.shape:
                b.copy_(saved)  # as they were when the call began
    how = (f"the metadata loaded with weights_only=True; the module ({meta['module_class']}) is an object of your "
           "code, which weights_only cannot rebuild, so that part was unpickled: open bundles only from runs you trust")
    return meta, module, payload["args"], payload["kwargs"], how


def run(path: str, device: str | None = None) -> int:
    """Replay a bundle under a fresh guard. 1: the value reproduced (the report is printed); 0: it did not;
    2: the bundle cannot be replayed here (one line)."""
    if not os.path.exists(path):  # (said before torch's import, which takes seconds)
        print(f"ampguard repro: {_missing(path)}", file=sys.stderr)
        return 2
    import torch

    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        print("ampguard repro: --device cuda was asked for, and this machine has no CUDA device; run with --device "
              "cpu to replay it on the CPU", file=sys.stderr)
        return 2
    try:
        meta, module, args, kwargs, how = load(path, device)
    except BadBundle as bad:
        print(f"ampguard repro: {bad}", file=sys.stderr)
        return 2

    import ampguard

    target = device or (meta["devices"][0] if meta["devices"] else "cpu")
    if target.startswith("cuda") and not torch.cuda.is_available():
        print(f"ampguard repro: the bundle was recorded on {target}, and this machine has no CUDA device; run with "
              "--device cpu to replay it on the CPU", file=sys.stderr)
        return 2
    what = (f"module '{meta['module_path']}' ({meta['module_class']}) of {meta['root_class']}"
            if meta["kind"] == "module" else "the loss-code op, outside any module")
    v = meta["versions"]
    print(f"ampguard repro: {path}\n  bundled: {what}, {meta['direction']} pass; recorded with torch {v['torch']}, "
          f"ampguard {v['ampguard']}, Python {v['python']}" + (f", rank {meta['rank']}" if meta["rank"] is not None
                                                                 else "")
          + f"\n  {how}\n  originally: {meta['message'].splitlines()[0]}\n  replaying on {target} ...", flush=True)
    if device is not None:
        module.to(device)
    module.train(meta["training"])
    torch.default_generator.set_state(meta["rng_cpu"].cpu())
    if meta["rng_cuda"] is not None and target.startswith("cuda"):
        torch.cuda.default_generators[torch.cuda.current_device()].set_state(meta["rng_cuda"][1].cpu())
    dev_type = torch.device(target).type
    stack = contextlib.ExitStack()
    for recorded, dtype in meta["autocast"]:
        stack.enter_context(torch.autocast(dev_type if recorded in ("cpu", "cuda") else recorded,
                                           dtype=getattr(torch, dtype)))
    grad = torch.inference_mode() if meta["inference"] else torch.set_grad_enabled(meta["grad"])
    try:
        with ampguard.guard(nonfinite="raise", trace="replay", repro_dir=None):
            with stack, grad:
                out = module(*args, **kwargs)
            for p in sinks.T.pending:
                p.nan_only = False  # any NaN/Inf of the bundled output is the news here
            if meta["direction"] == "backward" and not meta["inference"]:
                outs = [o for o, _ in sinks.made_within(out) if o.requires_grad]
                params = [q for q in module.parameters() if q.requires_grad]
                if outs and params:
                    sum(o.float().sum() for o in outs).backward()
                    torch.optim.SGD(params, lr=0.0).step()  # the gradient sink: read before the step
            ampguard.nonfinite.check()
    except NonFiniteError as error:
        print(f"\n{error}\n\nampguard repro: reproduced.", flush=True)
        return 1
    state = "state, " if meta["kind"] == "module" else ""
    print(f"ampguard repro: did not reproduce: replayed from the same inputs, {state}"
          "RNG state, autocast and grad mode, every value stayed finite. The original was a transient fault "
          "(nondeterminism, a hardware error), or this device differs from the one that made it "
          f"(recorded on {', '.join(meta['devices'])}, replayed on {target}).")
    return 0
