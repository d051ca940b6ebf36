"""Lightning: inject the closure an ``optimizer_step`` override forgot, and ``AmpGuardCallback``.

Patch target: every override of ``LightningModule.optimizer_step``, in ``lightning.pytorch`` and
``pytorch_lightning``, applied when the program imports either. Lightning's own hook always passes
the closure, so it is left as it is. The override receives

- its closure argument: Lightning's ``Closure`` behind a transparent proxy (``isinstance``
  holds), run at most once by the override's own calls (calls the optimizer makes inside
  ``step()`` re-evaluate, as LBFGS needs);
- ``optimizer``: a transparent proxy whose ``step()`` without a closure gets that closure.

ampguard injects only where that carries out what the code meant: ``optimizer.step()`` without
the closure runs ``training_step`` and applies the step, and ``closure(); optimizer.step()``
hands the step the cached result (under 16-mixed the GradScaler then really steps). An override
that never runs the closure, or an optimizer whose ``step()`` drops it, still fails with
Lightning's own error: ampguard never turns that failure into a warning. Each injection counts
in ``Guard.stats.closures_injected`` and warns once per class, at the user's line, with the
user's own name for the closure.

Importing this module does not import Lightning; ``AmpGuardCallback`` does, on first access.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import wrapt

from . import _guard
from ._errors import AmpGuardWarning
from ._fallback import internal_failure
from ._frames import user_frames
from ._guard import DEPTH
from ._patching import REGISTRY, Target

FEATURE = "closures"
WARNED = _guard.declare_state("closures_warned", set)  # g.states[WARNED]: the LightningModule classes warned about
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


class _HookClosure(wrapt.ObjectProxy):
    """Lightning's closure as the override sees it: still a ``Closure`` to ``isinstance``."""

    def __init__(self, closure: Any) -> None:
        super().__init__(closure)
        self._self_ran = False  # the real closure ran at least once during this hook call
        self._self_fresh = False  # a result from the override's own call that no step has used yet
        self._self_in_step = 0
        self._self_result: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._self_in_step:
            if self._self_fresh:
                self._self_fresh = False
                return self._self_result
        elif self._self_ran:
            return self._self_result  # the override's own calls run training_step at most once
        self._self_result = self.__wrapped__(*args, **kwargs)
        self._self_fresh = not self._self_in_step
        self._self_ran = True
        return self._self_result


class _StepInjector(wrapt.ObjectProxy):
    """The optimizer as the override sees it: ``step()`` without a closure gets Lightning's."""

    def __init__(self, optimizer: Any, closure: _HookClosure) -> None:
        super().__init__(optimizer)
        self._self_closure = closure
        self._self_injected: list[tuple[str, str, int]] = []  # (case, file, line)

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        hook_closure = self._self_closure
        injected = None
        if closure is None:
            # the user's line: past Lightning's own frames when the override called super().optimizer_step()
            site = user_frames(sys._getframe(1), limit=1, budget=16)
            code, line = site[0] if site else (sys._getframe(1).f_code, sys._getframe(1).f_lineno)
            case = "ran-then-step" if hook_closure._self_fresh else "step-without-closure"
            injected = (case, code.co_filename, line, hook_closure._self_ran)
            closure = hook_closure
        hook_closure._self_in_step += 1
        try:
            return self.__wrapped__.step(closure=closure, **kwargs)
        finally:
            hook_closure._self_in_step -= 1
            if injected is not None:
                case, filename, line, ran_before = injected
                if case == "ran-then-step" or (hook_closure._self_ran and not ran_before):
                    self._self_injected.append((case, filename, line))  # only what really happened


def _slot(args: list, kwargs: dict, position: int, name: str) -> tuple[Any, Any] | None:
    """Where the hook received an argument, as (container, key), keeping the caller's form."""
    if len(args) > position:
        return args, position
    if name in kwargs:
        return kwargs, name
    return None


_closure_names: dict[Any, str] = {}


def _closure_name(function: Any) -> str:
    """What the override calls its closure parameter (``optimizer_closure``, ``closure``, ...)."""
    function = getattr(function, "__func__", function)  # wrapt hands over the bound method: self counts here
    code = getattr(function, "__code__", None)
    name = _closure_names.get(code)
    if name is None:
        try:
            params = list(inspect.signature(function).parameters.values())
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            name = positional[4].name if len(positional) > 4 else "optimizer_closure"
        except (TypeError, ValueError):
            name = "optimizer_closure"
        _closure_names[code] = name
    return name


def _optimizer_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    g = _guard.current(FEATURE)
    if g is None or DEPTH.counts.get("optimizer_step") or not getattr(instance, "automatic_optimization", True):
        return wrapped(*args, **kwargs)
    try:
        new_args, new_kwargs = list(args), dict(kwargs)
        optimizer_at = _slot(new_args, new_kwargs, 2, "optimizer")
        closure_at = _slot(new_args, new_kwargs, 3, "optimizer_closure")
        if optimizer_at is None or closure_at is None or not callable(closure_at[0][closure_at[1]]):
            return wrapped(*args, **kwargs)
        hook_closure = _HookClosure(closure_at[0][closure_at[1]])
        proxy = _StepInjector(optimizer_at[0][optimizer_at[1]], hook_closure)
        optimizer_at[0][optimizer_at[1]] = proxy
        closure_at[0][closure_at[1]] = hook_closure
    except Exception as exc:
        internal_failure(FEATURE, exc)
        return wrapped(*args, **kwargs)
    # No step and no closure, or an optimizer that drops the closure: the closure never runs and
    # Lightning raises its own error, as it should.
    result = DEPTH.outermost("optimizer_step", wrapped, new_args, new_kwargs)
    try:
        events = list(proxy._self_injected)
        if events:
            g.stats.closures_injected += len(events)
            _warn_once(g, type(instance), _closure_name(wrapped), *events[0])
    except AmpGuardWarning:
        raise
    except Exception as exc:
        internal_failure(FEATURE, exc)
    return result


_MESSAGES = {
    "step-without-closure": (
        "{cls}.optimizer_step called optimizer.step() without the closure. Lightning 2.x would stop with "
        "\"The closure hasn't been executed\"; ampguard passed the closure, so training_step ran and the step "
        "was applied."),
    "ran-then-step": (
        "{cls}.optimizer_step called {closure}() and then optimizer.step() without it. Under 16-mixed this "
        "silently never updates the weights; ampguard gave the step the closure's result, so the step was "
        "applied."),
}


def _warn_once(g: _guard.Guard, cls: type, closure: str, case: str, filename: str, lineno: int) -> None:
    warned = g.states[WARNED]
    if cls in warned:
        return
    warned.add(cls)
    message = (_MESSAGES[case].format(cls=cls.__qualname__, closure=closure)
               + f" Fix: pass the closure: optimizer.step(closure={closure}).")
    warnings.warn_explicit(message, AmpGuardWarning, filename, lineno, module=cls.__module__)


def _accept(cls: type, function: Any) -> str | None:
    """Leave a hook whose signature Lightning 2.x cannot call untouched, with the reason."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())[1:]  # drop self
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    old_form = len(required) > 4 or (len(positional) >= 4 and positional[3].name == "optimizer_idx")
    if old_form:
        return (f"its signature {signature} is Lightning 1.x's; Lightning 2.x calls "
                "optimizer_step(epoch, batch_idx, optimizer, optimizer_closure). Update the signature and pass "
                "the closure: optimizer.step(closure=optimizer_closure).")
    if len(positional) < 4 and not any(p.kind is p.VAR_KEYWORD for p in params):
        return f"its signature {signature} cannot receive the optimizer_closure that Lightning passes."
    return None


for _namespace in NAMESPACES:
    # LightningModule's own optimizer_step always passes the closure: only overrides get the proxies
    REGISTRY.add(Target(_namespace, f"{_namespace}.core.module:LightningModule", "optimizer_step", _optimizer_step,
                        "give an override that forgot the closure a closure-injecting optimizer", _accept,
                        overrides_only=True, feature=FEATURE))


# -- AmpGuardCallback ------------------------------------------------------------------
def _callback_bases() -> tuple[type, ...]:
    import importlib.util

    bases = []
    for namespace in NAMESPACES:
        if namespace in sys.modules or importlib.util.find_spec(namespace.partition(".")[0]) is not None:
            bases.append(importlib.import_module(f"{namespace}.callbacks").Callback)
    if not bases:
        raise ImportError("ampguard.lightning.AmpGuardCallback needs lightning or pytorch-lightning installed")
    return tuple(bases)


def _make_callback_class() -> type:
    bases = _callback_bases()

    class AmpGuardCallback(*bases):  # type: ignore[misc]
        """Installs ampguard for the fit and logs its counters through the module's loggers.

        A Callback of every installed Lightning namespace, so ``lightning`` and
        ``pytorch_lightning`` Trainers both accept it. If a guard is already installed it is
        used and left installed; the callback's options, if any, apply for the stage in a
        ``guard()`` block on top of it. What it installed or entered ends at teardown, or when
        the stage raises (Lightning calls ``on_exception`` then, and may not call ``teardown``).
        """

        def __init__(self, **options: Any) -> None:
            from ._options import validate

            super().__init__()
            self.options = validate(options)
            self._owns_guard = False
            self._block: Any = None  # the guard() block entered for the stage, over a guard already installed

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            from . import active, guard, install

            if active() is None:
                install(**self.options)
                self._owns_guard = True
            elif self.options:
                block = guard(**self.options)
                block.__enter__()
                self._block = block

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._release(exception)

        def _release(self, exception: BaseException | None) -> None:
            from . import uninstall

            block, self._block = self._block, None
            if block is not None:
                if exception is None:
                    block.__exit__(None, None, None)
                else:
                    block.__exit__(type(exception), exception, exception.__traceback__)  # its checks are dropped
            if self._owns_guard:
                self._owns_guard = False
                if exception is not None:
                    _guard._settle(_guard.active(), error=True, leaving=exception)  # the stage's exception wins
                uninstall()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            g = _guard.active()
            if g is None:
                return
            s = g.stats
            metrics = {"ampguard/optimizer_steps_skipped": float(s.optimizer_steps_skipped),
                       "ampguard/scheduler_steps_held": float(s.scheduler_steps_held)}
            if s.loss_scale is not None:
                metrics["ampguard/loss_scale"] = float(s.loss_scale)
            # Without a logger the counters still reach trainer.callback_metrics; logger=True would make
            # Lightning warn that nobody listens.
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False,
                               logger=bool(getattr(trainer, "loggers", None)))

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self._release(None)

    AmpGuardCallback.__module__ = __name__
    return AmpGuardCallback


def __getattr__(name: str) -> Any:
    if name == "AmpGuardCallback":
        cls = _make_callback_class()
        globals()["AmpGuardCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
