"""Finding the outermost module call while nested calls stay on torch's fast path.

torch runs ``Module._call_impl``'s slow path (about 11 us more per call) for every module call
while any global module hook exists. ampguard needs only the outermost call of each forward, so:

- one global forward *pre*-hook is registered while the feature is on (no global forward hook);
- when it fires for an outermost call, it takes itself off torch's global dict ("suspends"), so
  every nested call of that forward finds no global hook and takes the fast path;
- an always-call forward hook on that one module instance (and a pre-hook that counts the module
  calling itself) ends the call, even when its forward raises, and puts the global hook back.

A ``KeyboardInterrupt`` skips torch's always-call hooks. The next hook that sees this thread's
outermost call still open checks whether that call's frame is still running; if not, the call
was interrupted, and the global hook goes back (:func:`recover`).

Suspension is process-wide (torch's hook dicts are): while one thread is inside an outermost
call, module calls that another thread starts are not seen as outermost calls. Their losses and
gradients are still checked; their outputs are not.

``trace="eager"`` needs every nested call for module names and is slow anyway: it does not suspend, and while
such a call is open in some thread a global forward hook sees each nested call end too.

A model compiled in place (``model.compile()``) runs its whole ``_call_impl`` compiled, hooks included, so no
hook sees its calls. While the feature is on, its ``_compiled_call_impl`` is wrapped (:class:`_CompiledInPlace`):
the wrapper makes the call an outermost call in eager Python around the compiled one, as the hooks would.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .._fallback import fail_safe, internal_failure
from .._guard import PerThread

_lock = threading.Lock()
NOT_OUTERMOST, OUTERMOST, OUTERMOST_KEEP_HOOKS = 0, 1, 2
# torch.compiler.is_compiling, set with the sinks' when the feature's hooks switch on. While dynamo traces a module
# call inside a compiled function the hooks return at once: dynamo folds this call to True, and nothing of
# ampguard's enters the graph (a graph break there would split it, and change the run's numbers). See _compiling.
def _compiling() -> bool:
    return False


class _Hooks:
    """The one registration in force: ids in torch's dicts, and the callbacks into the sinks."""

    def __init__(self) -> None:
        self.generation = 0  # changes at every switch on and off: hooks of an older one do nothing
        self.handle: Any = None  # torch's handle of the global pre-hook
        self.dict: dict | None = None  # torch's _global_forward_pre_hooks
        self.ids: tuple[int, int] = (-1, -1)  # hook ids for the instance pre-hook and forward hook
        self.attached: dict[int, Any] = {}  # id(module) -> module with instance hooks now
        # enter(module, frame): NOT_OUTERMOST, or OUTERMOST (suspend), or OUTERMOST_KEEP_HOOKS (trace='eager')
        self.enter: Callable[[Any, Any], int] = lambda module, frame: NOT_OUTERMOST
        # exit(module, args, kwargs, output, raised): raised, when the call ends in an exception (no output)
        self.exit: Callable[..., None] = lambda module, args, kwargs, output, raised=False: None
        self.nested: Callable[[Any], None] = lambda module: None
        self.nested_end: Callable[[Any], None] = lambda module: None
        self.post_handle: Any = None  # torch's handle of trace='eager''s global forward hook (see EAGER)


H = _Hooks()


class _Open:
    """This thread's open outermost call (a plain object each hook takes once: see _guard.PerThread)."""

    def __init__(self) -> None:
        self.root: Any = None  # the open outermost call's module in this thread
        self.frame: Any = None  # the frame of torch's call of it, to tell a nested call from a stale one
        self.nesting = 0  # calls of that same module inside it
        self.change: _WhileOpen | None = None  # what its start changed in torch's hooks (SUSPENDED or EAGER)
        self.generation = -1
        self.entry: tuple | None = None  # (args, kwargs) as the call was made, before the module's own pre-hooks


# This thread's open call. Public: the sinks' hooks ask at every step whether one is open (OPEN.state.root), with a
# read and no call, before they call recover().
OPEN = PerThread(_Open)


def switch_on(enter: Callable[[Any, Any], int], exit: Callable[..., None], nested: Callable[[Any], None],
              nested_end: Callable[[Any], None]) -> Callable[[], None]:
    """Register the global pre-hook; ``enter(module, frame)`` says whether a call is outermost,
    ``exit(module, args, kwargs, output, raised)`` ends one (``raised``: it ends in an exception), ``nested(module)``
    and ``nested_end(module)`` see calls inside one start and end while the hooks are on (trace='eager')."""
    from torch.nn.modules import module as nn_module
    from torch.utils.hooks import RemovableHandle

    with _lock:
        H.generation += 1
        H.enter, H.exit, H.nested, H.nested_end = enter, exit, nested, nested_end
        first = RemovableHandle.next_id
        RemovableHandle.next_id += 2  # two ids of our own for the instance hooks, never reused by torch
        H.ids = (first, first + 1)
        H.dict = nn_module._global_forward_pre_hooks
        H.handle = handle = nn_module.register_module_forward_pre_hook(_global_pre)
    for module in list(_compiled_in_place):
        see_compiled_in_place(module)

    def off() -> None:  # idempotent, and only ever undoes this registration
        with _lock:
            handle.remove()
            if H.handle is not handle:
                return
            H.generation += 1
            H.handle = None
            SUSPENDED.reset()
            EAGER.reset()  # (its hook goes)
            for module in list(H.attached.values()):
                _detach(module)
            H.attached.clear()
        for module in list(_compiled_in_place):
            wrapper = vars(module).get("_compiled_call_impl")
            if type(wrapper) is _CompiledInPlace:
                vars(module)["_compiled_call_impl"] = wrapper.compiled  # torch's own, exactly as compile() set it
        forget()

    return off


def forget() -> None:
    """This thread's open call is closed without being seen closing (switch-off, interruption)."""
    local = OPEN.state
    module = local.root
    if module is not None and local.generation == H.generation and id(module) in H.attached:
        _detach(module)  # (a call that run_as_outermost() opened has no instance hooks)
    local.root = local.frame = local.entry = None
    local.nesting = 0
    change = local.change
    if change is not None:
        local.change = None
        change.end(local.generation)


class _WhileOpen:
    """A change to torch's process-wide hook dicts that lasts while an outermost call of one kind is open in any
    thread: made as the first opens, undone as the last closes. Counted under the lock, per registration: a call
    that began before a switch-off counts for nothing after it (that registration is gone)."""

    __slots__ = ("count", "make", "undo")

    def __init__(self, make: Callable[[], None], undo: Callable[[], None]) -> None:
        self.count = 0
        self.make, self.undo = make, undo

    def begin(self, generation: int) -> None:
        with _lock:
            if generation != H.generation:
                return
            self.count += 1
            if self.count == 1:
                self.make()

    def end(self, generation: int) -> None:
        with _lock:
            if generation != H.generation:
                return
            if self.count > 1:
                self.count -= 1
            else:  # (the last one open; never below 0)
                self.count = 0
                self.undo()

    def reset(self) -> None:
        """At switch-off, under the lock: no call counts any more."""
        if self.count:
            self.count = 0
            self.undo()


def _pre_hook_off() -> None:
    if H.dict is not None and H.handle is not None:
        H.dict.pop(H.handle.id, None)


def _pre_hook_back() -> None:
    if H.dict is not None and H.handle is not None:  # (not after a switch-off: that registration is gone)
        H.dict[H.handle.id] = _global_pre


def _post_hook_on() -> None:
    from torch.nn.modules import module as nn_module

    H.post_handle = nn_module.register_module_forward_hook(_global_post, always_call=True)


def _post_hook_off() -> None:
    if H.post_handle is not None:
        H.post_handle.remove()
        H.post_handle = None


# OUTERMOST calls take the global pre-hook off, so that their nested calls stay on torch's fast path.
SUSPENDED = _WhileOpen(_pre_hook_off, _pre_hook_back)
# OUTERMOST_KEEP_HOOKS calls (trace='eager') keep it, and add a global forward hook: each nested call's end.
EAGER = _WhileOpen(_post_hook_on, _post_hook_off)


def _detach(module: Any) -> None:
    pre, post = H.ids
    try:
        module._forward_pre_hooks.pop(pre, None)
        module._forward_hooks.pop(post, None)
        module._forward_hooks_with_kwargs.pop(post, None)
        module._forward_hooks_always_called.pop(post, None)
    except AttributeError:  # a module without torch's hook dicts never had ours
        pass
    H.attached.pop(id(module), None)


def running(frame: Any) -> bool:
    """Whether ``frame`` is on this thread's stack now (the open call was not interrupted)."""
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def recover() -> bool:
    """Close this thread's open call if it was interrupted (a KeyboardInterrupt skipped torch's
    always-call hooks); True if one was. Cheap when none is open."""
    local = OPEN.state
    if local.root is None or running(local.frame):
        return False
    forget()
    return True


# -- the hooks ----------------------------------------------------------------------------------
@fail_safe("nonfinite")
def _global_pre(module: Any, args: Any) -> None:
    if _compiling():
        return
    __tracebackhide__ = True  # pytest shows the user's frames, not ampguard's
    local = OPEN.state
    if local.root is not None:
        if running(local.frame):
            H.nested(module)  # hooks are on inside an open call: trace='eager', or another thread resumed them
            return
        forget()  # interrupted: this is a new call
    frame = sys._getframe(2)  # torch's inner(): running while this call is
    hooked = bool(module._forward_pre_hooks)  # (before _open puts ampguard's own there)
    _open(module, frame, H.enter(module, frame))
    if local.root is module:
        local.entry = (args, _entry_kwargs(frame) if hooked else None)


def _entry_kwargs(frame: Any) -> dict | None:
    """The call's keyword arguments as it was made, for a module with pre-hooks of its own, which may change them
    before the forward hooks see them. The global hook runs before the module's own, and a replay calls the module
    with its hooks: given what they returned, it would apply them twice."""
    kwargs = frame.f_locals.get("kwargs")  # (inner()'s, as torch's _call_impl was called; a copy: a hook may edit it)
    return dict(kwargs) if type(kwargs) is dict else None


def _open(module: Any, frame: Any, mode: int) -> None:
    if mode == NOT_OUTERMOST:
        return
    pre, post = H.ids  # the instance hooks that end this call (_detach() takes them off)
    module._forward_pre_hooks[pre] = _instance_pre
    module._forward_hooks[post] = _instance_post
    module._forward_hooks_with_kwargs[post] = True
    module._forward_hooks_always_called[post] = True
    H.attached[id(module)] = module
    _begin(module, frame, mode)


def _begin(module: Any, frame: Any, mode: int) -> int:
    """This thread's outermost call is now ``module``'s; the global hook is off for it unless trace='eager'.
    Returns the call's generation."""
    local = OPEN.state
    local.root, local.frame, local.nesting, local.generation = module, frame, 0, H.generation
    local.change = change = SUSPENDED if mode == OUTERMOST else EAGER
    change.begin(local.generation)
    return local.generation


@fail_safe("nonfinite")
def _global_post(module: Any, args: Any, output: Any) -> None:
    """The end of each module call while a trace='eager' call is open (torch calls it even when the call raises)."""
    if _compiling():
        return
    H.nested_end(module)


@fail_safe("nonfinite")
def _instance_pre(module: Any, args: Any) -> None:
    if _compiling():
        return
    __tracebackhide__ = True
    local = OPEN.state
    if module is not local.root:
        return  # another thread calls the same module
    if running(local.frame):
        local.nesting += 1  # the module calling itself
        return
    forget()  # the open call was interrupted; this call is a new one
    frame = sys._getframe(2)
    _open(module, frame, H.enter(module, frame))


@fail_safe("nonfinite")
def _instance_post(module: Any, args: Any, kwargs: Any, output: Any) -> None:
    if _compiling():
        return
    __tracebackhide__ = True
    local = OPEN.state
    if module is not local.root:
        return
    if local.nesting:
        local.nesting -= 1
        return
    generation, entry, frame = local.generation, local.entry, local.frame
    forget()
    if generation == H.generation:
        if entry is not None:  # the arguments as the call was made: the forward hooks get what pre-hooks returned
            args = entry[0]
            if entry[1] is not None:
                kwargs = entry[1]
        H.exit(module, args, kwargs or {}, output, _raised_through(frame))


def _raised_through(frame: Any) -> bool:
    """Whether this always-call hook runs because the call raised: torch calls it from the ``except`` that ends the
    call's ``_call_impl``, so the exception being handled came out of the call's frame (``frame``: ``_call_impl``'s
    own where it runs the hooks itself, as in torch 2.4; the ``inner()`` it calls, one level in, in 2.6 and later).
    A call made inside the user's own ``except`` block sees the user's exception, which never passed through this
    call's frame."""
    tb = sys.exc_info()[2]
    return tb is not None and (tb.tb_frame is frame or (tb.tb_next is not None and tb.tb_next.tb_frame is frame))


# -- a module pickled or copied while it has the instance hooks ------------------------------------
_HOOK_DICTS = (("_forward_pre_hooks", 0), ("_forward_hooks", 1), ("_forward_hooks_with_kwargs", 1),
               ("_forward_hooks_always_called", 1))  # (the dict, which of H.ids)


def module_state(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``nn.Module.__getstate__`` (``torch.save(model)``, ``copy.deepcopy``, pickling), without ampguard's instance
    hooks. A module has them while its outermost call is open, and after a Ctrl-C inside that call until the next
    hook sees it (torch runs no always-call hook for a KeyboardInterrupt). A notebook interrupted in its training
    cell, whose next cell saved the model whole or copied it, wrote ampguard's hook functions into the file, which
    then failed to load where ampguard is not installed, and gave the copy hooks that nothing would ever take off.
    An interrupted call of this thread's is closed here, as the next hook would close it; one still running (the
    module copying itself, another thread's call) keeps its hooks, and the state leaves them out."""
    try:
        recover()
    except Exception as exc:
        internal_failure("nonfinite", exc)
    state = wrapped(*args, **kwargs)
    if id(instance) not in H.attached:  # (every other module: one lookup)
        return state
    try:
        ids = H.ids
        state = dict(state)  # (a copy: the state may be the module's own __dict__)
        for name, which in _HOOK_DICTS:
            hooks = state.get(name)
            if hooks is not None and ids[which] in hooks:
                state[name] = hooks = hooks.copy()
                del hooks[ids[which]]
    except Exception as exc:
        internal_failure("nonfinite", exc)
    return state


# -- torch.compile(module)'s warning -------------------------------------------------------------
def global_hooks_but_ours(wrapped: Callable[[], Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.nn.modules.module._has_any_global_hook``, with ampguard's own hooks left out. A module made by
    ``torch.compile(module)`` asks it at every call, to warn that global hooks fire an extra time for it. Those of
    ampguard do not: that call is one outermost call (``sinks.kind``: 'compiled'), its nested calls find no global
    hook. Shown at every call of every compiled model, the warning was about ampguard, and a run that turns warnings
    into errors (pytest's ``filterwarnings = error``) failed at the model's first call. A hook of anyone else's still
    gets torch's warning."""
    found = wrapped(*args, **kwargs)
    if not found:
        return found
    try:
        nn_module = sys.modules["torch.nn.modules.module"]  # (imported: its function is the one wrapped)
        ours = (H.handle.id if H.handle is not None else None, H.post_handle.id if H.post_handle is not None else None)
        for hooks in (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks,
                      nn_module._global_forward_hooks_always_called, nn_module._global_forward_hooks_with_kwargs):
            for key in hooks:
                if key not in ours:
                    return found
        return bool(nn_module._global_backward_pre_hooks or nn_module._global_backward_hooks)
    except Exception as exc:
        internal_failure("nonfinite", exc)
        return found


# -- models compiled in place -------------------------------------------------------------------
_compiled_in_place: weakref.WeakSet = weakref.WeakSet()  # every model compile() was seen compiling in place


def compiled_in_place(module: Any) -> bool:
    """Whether calls of ``module`` run its in-place compiled call, through :class:`_CompiledInPlace`."""
    return type(vars(module).get("_compiled_call_impl")) is _CompiledInPlace


def see_compiled_in_place(module: Any) -> None:
    """After ``module.compile()``: wrap the compiled call torch put on it (kept known, to wrap again at the next
    switch-on and to unwrap at switch-off)."""
    compiled = vars(module).get("_compiled_call_impl")
    if compiled is None:
        return
    _compiled_in_place.add(module)
    if type(compiled) is not _CompiledInPlace and H.handle is not None:
        vars(module)["_compiled_call_impl"] = _CompiledInPlace(module, compiled)


class _CompiledInPlace:
    """Stands in for the compiled call of a model compiled in place: its call is an outermost call, entered and
    ended here in eager Python, with the global hook taken off while the compiled code runs (as an outermost
    call's nested calls find it, and as dynamo guarded it when it traced the call)."""

    __slots__ = ("compiled", "module")

    def __init__(self, module: Any, compiled: Any) -> None:
        self.module = weakref.ref(module)
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        compiled = self.compiled
        module = self.module()
        if module is None or _compiling():
            return compiled(*args, **kwargs)
        local = OPEN.state
        if local.change is EAGER and running(local.frame):
            # inside a trace='eager' call, whose hooks see each nested call start and end: not this one's, which
            # runs compiled, hooks included
            H.nested(module)
            try:
                return compiled(*args, **kwargs)
            finally:
                H.nested_end(module)
        return run_as_outermost(module, compiled, args, kwargs, H.enter, H.exit)


def run_as_outermost(module: Any, fn: Callable[..., Any], args: tuple, kwargs: dict,
                     enter: Callable[[Any, Any], int], exit: Callable[..., None]) -> Any:
    """``fn(*args, **kwargs)`` as an outermost call of ``module``, entered and ended here in eager Python, not by
    torch's hooks: a model compiled in place, whose hooks run inside compiled code, and Lightning's training_step,
    which is no module call. The global hook is off while it runs, as for a hooked outermost call. Where no
    outermost call opens (one is open already, the feature is off), ``fn`` runs as it is."""
    __tracebackhide__ = True
    # (this frame, held by the open call until forget(), never by a local: a frame whose local holds the frame itself
    # is a cycle that outlives the call until the garbage collector runs, and keeps its callers' frames and their
    # locals alive with it: the input of the call)
    generation = _enter_here(module, sys._getframe(0), enter)
    if generation is None:
        return fn(*args, **kwargs)
    output, raised = None, None  # (None after a KeyboardInterrupt, which torch's always-call hooks skip too)
    try:
        output = fn(*args, **kwargs)
        raised = False
    except Exception:
        raised = True  # it made nothing (as torch's always-call hooks see it)
        raise
    finally:
        forget()  # (and the global hook is back)
        if raised is not None and generation == H.generation:
            _exit_here(exit, module, args, kwargs, output, raised)
    return output


@fail_safe("nonfinite")
def _enter_here(module: Any, frame: Any, enter: Callable[[Any, Any], int]) -> int | None:
    """The generation of the outermost call opened for ``module``, or None (no call opened: the call is not an
    outermost one, or it is one of trace='eager', which sees nothing inside compiled code anyway)."""
    __tracebackhide__ = True
    local = OPEN.state
    if local.root is not None:
        if running(local.frame):
            return None  # inside an outermost call: part of it
        forget()
    if H.handle is None:
        return None
    mode = enter(module, frame)
    return None if mode == NOT_OUTERMOST else _begin(module, frame, mode)


@fail_safe("nonfinite")
def _exit_here(exit: Callable[..., None], module: Any, args: tuple, kwargs: dict, output: Any, raised: bool) -> None:
    __tracebackhide__ = True
    exit(module, args, kwargs, output, raised)
