"""Warnings keep their place: ampguard's frames do not count in a ``stacklevel``.

torch and Lightning warn with ``stacklevel=N`` to point at their caller. Inside a call that
ampguard wraps (``LRScheduler.step``, ``GradScaler.update``, ``optimizer_step``), ampguard's
wrapper frames sit between that caller and the library, so the warning would name
``ampguard/...`` instead of the user's line, and ``-W error::UserWarning:__main__`` would stop
matching. Patch target (undone by the registry, which restores the exact function):

- ``warnings.warn``: count ``stacklevel`` frames up from the caller, skipping ampguard's own,
  then warn with the level that reaches the same frame. Category, message and every filter act
  as without ampguard; only the location is corrected, and only when ampguard's frames were in
  the way. Warnings raised from C (``TORCH_WARN``) do not pass here: they name the frame that runs
  when they are raised, and the loss-code record calls an op from a frame that reads as the user's
  (``_frames.from_caller``), which counts as ampguard's here.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ._frames import is_from_caller
from ._patching import REGISTRY, Target

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ours: dict[Any, bool] = {}


def _is_ours(code: Any) -> bool:
    ours = _ours.get(code)
    if ours is None:
        ours = _ours[code] = code.co_filename.startswith(_HERE) or is_from_caller(code)
    return ours


def _warn(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if len(args) > 2:
        stacklevel = args[2]
    else:
        stacklevel = kwargs.get("stacklevel", 1)
    if not isinstance(stacklevel, int) or stacklevel < 1:
        return wrapped(*args, **kwargs)  # as warnings.warn itself treats it
    frame = sys._getframe(1)  # the frame that called warnings.warn: level 1
    skipped, level = 0, 1
    while frame is not None and level < stacklevel:
        frame = frame.f_back
        if frame is not None and _is_ours(frame.f_code):
            skipped += 1
        else:
            level += 1
    while frame is not None and _is_ours(frame.f_code):  # it would name ampguard itself: the caller instead
        frame = frame.f_back
        skipped += 1
    corrected = stacklevel + skipped + 1  # + 1: this function is a frame too
    if len(args) > 2:
        return wrapped(*args[:2], corrected, *args[3:], **kwargs)
    return wrapped(*args, **{**kwargs, "stacklevel": corrected})


REGISTRY.add(Target("warnings", "warnings", "warn", _warn,
                    "a warning torch or Lightning raises inside a call ampguard wraps names the user's line"))
