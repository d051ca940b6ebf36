"""The patch registry: wrap a method across a class hierarchy, lazily, and restore it exactly.

A patch on a base class does not reach a subclass that overrides the method without calling
``super()`` (``SequentialLR.step``, ``ShardedGradScaler.update``), so every patch is applied
to the base *and* to each subclass that defines the method in its own ``__dict__``: the ones
that exist now (walked through ``__subclasses__()``) and the ones defined later (through an
``__init_subclass__`` that ampguard adds to the base and removes again).

Patches apply when the program imports the target module (wrapt post-import hooks), never
earlier. wrapt cannot unregister a hook, so each hook checks whether the registry is still
installed. Every replaced attribute is recorded with the exact object it replaced; uninstall
puts that object back, so ``vars(cls)[name] is original`` holds afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import pkgutil
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import wrapt

from ._errors import AmpGuardWarning
from ._fallback import internal_failure
from ._frames import warn_at_user

log = logging.getLogger("ampguard")

_MISSING = object()


class Wrapper(wrapt.FunctionWrapper):
    """wrapt's FunctionWrapper of a module's function, which torch.compile traces as the function it wraps (see
    ``_compiling``), and which copies and pickles as a function does. wrapt's proxies refuse both, and a patched
    function ends up in copied and pickled structures: torch.export deep-copies a config holding ``warnings.warn``,
    a checkpoint's hyperparameters may hold ``functools.partial(clip_grad_norm_, max_norm=1.0)``. A class's methods
    keep wrapt's own class: a subclass's bound calls cost some 0.3 us more each."""

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        return self

    def __reduce_ex__(self, protocol: int) -> Any:
        """By reference, as pickle saves a function: loaded where ampguard is not installed (an inference server
        reading the checkpoint), it is torch's own function; where it is, the patched one."""
        original = self.__wrapped__
        module, name = getattr(original, "__module__", None), getattr(original, "__qualname__", None)
        if not module or not name:
            raise TypeError(f"cannot pickle {original!r}")
        return pkgutil.resolve_name, (f"{module}:{name}",)


def _module_function_wrapper(original: Any, wrapper: Callable[..., Any]) -> Wrapper:
    """A Wrapper of ``original`` whose class names torch's function as ``_torchdynamo_inline``: dynamo traces that
    function (through getattr), and ``inspect.getattr_static``, which dynamo's trace rules read, finds an object of
    each function's own. One property shared by every Wrapper made each patched function load as that one property
    there, so that two patched functions with different rules (``torch.autograd.grad`` traced in graphs,
    ``destroy_process_group`` skipped) failed dynamo's import ("Duplicate torch object")."""
    function = original
    while isinstance(function, wrapt.FunctionWrapper):  # (another feature's wrapper of the same function)
        function = function.__wrapped__
    cls = type("Wrapper", (Wrapper,), {"_torchdynamo_inline": staticmethod(function), "__module__": __name__})
    return cls(original, wrapper)


@dataclasses.dataclass(frozen=True)
class Target:
    """One patched method: what it wraps, why, and which import triggers it."""

    module: str  # the import that triggers the patch, e.g. "torch"
    owner: str  # "pkg.mod:Class" of the base class (or "pkg.mod" for a function), resolved once imported
    name: str  # the method name on the base class and on overriding subclasses
    wrapper: Callable[..., Any]  # wrapt signature: wrapper(wrapped, instance, args, kwargs)
    why: str
    # accept(cls, original) -> None to wrap, or the reason to leave this class's method untouched (warned about;
    # "" leaves it without a word)
    accept: Callable[[type, Any], str | None] | None = None
    # Leave the base class's own method as it is and wrap only the overrides: the base's never needs the wrapper
    overrides_only: bool = False
    # The feature (an option: "nonfinite", "lint", ...; or _guard.BLOCKS, while a guard() block is open) whose wrapper
    # this is: applied once some live guard has it on, as a Switch is. None: needed by every feature.
    feature: str | None = None


@dataclasses.dataclass(frozen=True)
class Switch:
    """A global hook that is not an attribute (torch's optimizer/module hooks): ``on()`` returns ``off``.

    It is on only while its feature is enabled: a global module hook puts every module call on
    PyTorch's slower hook path, which a feature that is off must not cost.
    """

    module: str
    feature: str | None  # None: on while ampguard is installed, whatever the features
    on: Callable[[], Callable[[], None]]
    why: str


@dataclasses.dataclass
class _Record:
    cls_ref: weakref.ref
    name: str
    original: Any  # the exact object found in vars(cls), or _MISSING if ampguard added the name
    replacement: Any


class Registry:
    """Owns every attribute ampguard replaced; the one place that patches and restores."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._targets: list[Target] = []
        self._records: dict[tuple[int, str], _Record] = {}
        self._bases: list[tuple[Target, type]] = []  # targets applied so far, with their base class
        self._import_hooks: set[str] = set()
        self._switches: list[Switch] = []
        self._switched_on: dict[int, Callable[[], None]] = {}  # id(switch) -> off
        self._features: frozenset[str] = frozenset()  # the features the active guard has on
        self.installed = False

    # -- declaration -------------------------------------------------------------------
    def add(self, target: Target) -> None:
        """Declare a target; ampguard's modules do this when imported, before any install."""
        with self._lock:
            self._targets.append(target)

    def add_switch(self, switch: Switch) -> None:
        with self._lock:
            self._switches.append(switch)

    # -- install / uninstall -----------------------------------------------------------
    def install(self) -> None:
        with self._lock:
            if self.installed:
                return
            self.installed = True
            modules = [t.module for t in self._targets] + [s.module for s in self._switches]
            for module in dict.fromkeys(modules):
                # A new hook fires at once for an imported module; one registered by an earlier
                # install in this process does not fire again, so apply those here.
                if not self._register_import_hook(module) and module in sys.modules:
                    self._on_import(sys.modules[module])

    @property
    def dirty(self) -> bool:
        """Something is still patched or switched on: an uninstall() was interrupted, or is due."""
        return self.installed or bool(self._records) or bool(self._switched_on)

    def uninstall(self) -> None:
        """Undo everything, one item at a time, each forgotten only once undone: an interrupted
        uninstall is finished by the next one."""
        with self._lock:
            if not self.dirty:
                return
            self.installed = False
            self._features = frozenset()
            for key in reversed(list(self._switched_on)):
                self._switched_on[key]()  # off() is idempotent: an interrupted one may run again
                del self._switched_on[key]
            for key in reversed(list(self._records)):
                record = self._records[key]
                cls = record.cls_ref()
                if cls is not None:
                    self._restore(cls, record)
                del self._records[key]
            self._bases.clear()

    @staticmethod
    def _restore(cls: type, record: _Record) -> None:
        current = vars(cls).get(record.name, _MISSING)
        if current is record.original:
            return  # never replaced (an install interrupted between recording and patching), or restored
        if current is not record.replacement:
            log.warning("%s.%s was replaced by someone else after ampguard patched it; leaving it as it is",
                        cls.__qualname__, record.name)
            return
        if record.original is _MISSING:
            delattr(cls, record.name)
        else:
            setattr(cls, record.name, record.original)

    def set_features(self, features: frozenset[str]) -> None:
        """Turn each switch on or off to match the features the live guards have on, and apply the targets of
        a feature that came on. A target stays applied when its feature goes off again (its wrapper then
        returns at once): taking one wrapper out of a stack of them is not an exact restore."""
        with self._lock:
            added = features - self._features if self.installed else frozenset()
            self._features = features if self.installed else frozenset()
            walks: dict[int, list] = {}
            for target in self._targets:
                if target.feature in added and target.module in sys.modules:
                    self._apply(target, walks)
            self._update_switches()

    def _wanted(self, target: Target) -> bool:
        """A feature that no live guard has on costs no wrapper: a wrapped method call is some 6,000 machine
        instructions through wrapt's binding before the wrapper returns at once."""
        return target.feature is None or target.feature in self._features

    def _update_switches(self) -> None:
        for switch in self._switches:
            key = id(switch)
            wanted = (switch.feature in self._features or (switch.feature is None and self.installed)) and \
                switch.module in sys.modules
            if wanted and key not in self._switched_on:
                self._switched_on[key] = switch.on()
            elif not wanted and key in self._switched_on:
                self._switched_on.pop(key)()

    # -- import hooks ------------------------------------------------------------------
    def _register_import_hook(self, module: str) -> bool:
        """Register the hook once per process; True if it was registered now."""
        if module in self._import_hooks:
            return False
        self._import_hooks.add(module)
        wrapt.register_post_import_hook(self._on_import, module)
        return True

    def _on_import(self, module: Any) -> None:
        # Runs inside the user's import statement: an exception here would fail their import.
        try:
            with self._lock:
                if not self.installed:
                    return
                walks: dict[int, list] = {}
                for target in self._targets:
                    if target.module == module.__name__ and self._wanted(target):
                        self._apply(target, walks)
                self._update_switches()
        except AmpGuardWarning:
            raise
        except Exception as exc:
            _report_failure(f"patching {getattr(module, '__name__', module)}", exc)

    # -- the hierarchy machinery -------------------------------------------------------
    def _resolve(self, target: Target) -> Any:
        module_name, _, qualname = target.owner.partition(":")
        obj = sys.modules.get(module_name)
        if obj is None:
            log.debug("ampguard: %s is not imported; %s is not patched", module_name, target.owner)
            return None
        # (as pkgutil.resolve_name does for an imported module. Each name is interned: CPython's type attribute
        # cache keeps the name it was looked up by, and a fresh string at every install() was an allocation that
        # outlived the call, some 50 KB over a test run's install/uninstall cycles)
        for name in qualname.split(".") if qualname else ():
            obj = getattr(obj, sys.intern(name))
        return obj

    def _apply(self, target: Target, walks: dict[int, list] | None = None) -> None:
        """Wrap ``target`` on its base and every subclass that defines it. ``walks``: each base's classes, kept over
        one pass that applies several targets (torchmetrics' Metric has two: one walk of its 250 classes)."""
        base = self._resolve(target)
        if base is None:
            return
        if isinstance(base, types.ModuleType):  # a module-level function: no hierarchy to walk
            self._wrap(base, target)
            return
        self._hook_subclassing(base)
        if not any(t is target for t, _ in self._bases):
            self._bases.append((target, base))
        if walks is None:
            classes: Any = _walk(base)
        else:
            classes = walks.get(id(base))
            if classes is None:
                classes = walks[id(base)] = list(_walk(base))
        for cls in classes:
            if cls is not base or not target.overrides_only:
                self._wrap(cls, target)

    def _wrap(self, cls: type, target: Target) -> None:
        # Keyed by target too: two features may wrap the same method (GradScaler.scale); the
        # second wraps the first, and uninstall undoes them in reverse order.
        if target.name not in vars(cls):
            return  # (most classes of a walked hierarchy: a torchmetrics install walks some 250 metrics)
        key = (id(cls), target.name, id(target))
        record = self._records.get(key)
        if record is not None and record.cls_ref() is cls and _in_chain(vars(cls).get(target.name), record.replacement):
            return  # installing twice wraps once
        original = vars(cls)[target.name]
        if target.accept is not None:
            reason = target.accept(cls, original)
            if reason is not None:
                if reason:  # ("": left alone without a word)
                    _warn_untouched(cls, target, reason, original)
                return
        # A module's function is traced by torch.compile as the original (a class's method is bound first: dynamo
        # would call the original unbound)
        kind = _module_function_wrapper if isinstance(cls, types.ModuleType) else wrapt.FunctionWrapper
        replacement = kind(original, target.wrapper)
        # Recorded first: an interrupt between the two leaves a record uninstall() resolves, never a
        # replaced attribute nobody knows about.
        self._records[key] = _Record(weakref.ref(cls), target.name, original, replacement)
        setattr(cls, target.name, replacement)

    def _hook_subclassing(self, base: type) -> None:
        key = (id(base), "__init_subclass__")
        if key in self._records:
            return
        original = vars(base).get("__init_subclass__", _MISSING)
        registry = self

        if original is _MISSING:
            def __init_subclass__(cls: type, **kwargs: Any) -> None:
                super(base, cls).__init_subclass__(**kwargs)
                registry._on_subclass(cls)
        else:
            def __init_subclass__(cls: type, **kwargs: Any) -> None:
                original.__get__(None, cls)(**kwargs)
                registry._on_subclass(cls)

        replacement = classmethod(__init_subclass__)
        self._records[key] = _Record(weakref.ref(base), "__init_subclass__", original, replacement)
        base.__init_subclass__ = replacement

    def _on_subclass(self, cls: type) -> None:
        # Runs inside the user's class statement: never let an ampguard failure break it.
        try:
            with self._lock:
                if not self.installed:
                    return
                for target, base in self._bases:
                    if issubclass(cls, base):
                        self._wrap(cls, target)
        except AmpGuardWarning:
            raise  # the user turned ampguard's warnings into errors
        except Exception as exc:
            _report_failure(f"patching subclass {cls.__qualname__}", exc)


def wrap_on_class(cls: type, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Wrap ``cls``'s own ``name`` with wrapt, for a Switch; return its ``off``, which puts the exact original back
    unless something replaced the wrapper since. For a base class with a vast hierarchy (``nn.Module``, ``Tensor``),
    where a registry Target would walk every subclass at each install and hook every class statement: a subclass's
    own override is not wrapped."""
    original = vars(cls)[name]
    replacement = wrapt.FunctionWrapper(original, wrapper)
    setattr(cls, name, replacement)

    def off() -> None:
        if vars(cls).get(name) is replacement:
            setattr(cls, name, original)

    return off


def clip_arguments(args: tuple, kwargs: dict) -> tuple[list, dict, list]:
    """For wrappers of ``clip_grad_norm_``/``clip_grad_value_``: (args, kwargs, the parameters as a list),
    with that list in the arguments' place. A generator can be read once, and both the wrapper and the
    clip need it; the list clips exactly the same parameters."""
    torch = sys.modules["torch"]  # (a clip of torch's is running: imported; no import statement at every step)
    args, kwargs = list(args), dict(kwargs)
    where, key = (args, 0) if args else (kwargs, "parameters")
    params = where[key]
    if isinstance(params, torch.Tensor):
        return args, kwargs, [params]
    params = where[key] = list(params)
    return args, kwargs, params


def _in_chain(obj: Any, replacement: Any) -> bool:
    """Whether ``replacement`` is ``obj`` or one of the wrappers ``obj`` wraps."""
    while isinstance(obj, wrapt.FunctionWrapper):
        if obj is replacement:
            return True
        obj = obj.__wrapped__
    return False


def _walk(base: type) -> Iterator[type]:
    seen: set[int] = set()
    stack = [base]
    while stack:
        cls = stack.pop()
        if id(cls) in seen:
            continue
        seen.add(id(cls))
        yield cls
        stack.extend(type.__subclasses__(cls))


# class -> the method names warned about, held weakly: keyed by id(), a class defined after another was freed could
# get its id and never be warned about (a test's second 1.x-signature class, once, in a full run)
_untouched_warned: weakref.WeakKeyDictionary[type, set[str]] = weakref.WeakKeyDictionary()


def _warn_untouched(cls: type, target: Target, reason: str, original: Any = None) -> None:
    warned = _untouched_warned.setdefault(cls, set())
    if target.name in warned:
        return
    warned.add(target.name)
    # a debug record, not a warning record: the warning below is the one message the user sees
    log.debug("ampguard leaves %s.%s untouched: %s", cls.__qualname__, target.name, reason)
    message = f"ampguard leaves {cls.__qualname__}.{target.name} untouched: {reason}"
    code = getattr(getattr(original, "__func__", original), "__code__", None)
    if code is not None:
        # At the method itself: it may be patched long after its class statement (when Lightning is
        # imported), from whatever line of yours was running then.
        warnings.warn_explicit(message, AmpGuardWarning, code.co_filename, code.co_firstlineno,
                               module=cls.__module__)
    else:
        warn_at_user(message)  # at the class statement


def _report_failure(what: str, exc: BaseException) -> None:
    internal_failure(what, exc)


REGISTRY = Registry()
