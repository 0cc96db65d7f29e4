"""Gloo's abort on a size mismatch, held off until every rank raises the mismatch instead.

Gloo checks the size of each message on its IO thread. When the ranks' collectives differ in
size (another shape or dtype at the same number), that check throws there, nothing catches it,
and C++ terminates the process within milliseconds ("Received data size doesn't match"): no
Python code of the rank runs again, and its peers learn only "Connection reset by peer".

The doctor installs a terminate handler (:func:`install`) that, for an exception of Gloo's on a
thread other than the main one, holds that thread instead of aborting and wakes the doctor. The
doctor compares the ranks' open collectives at once (``tandem.doctor.hang``) and calls
:func:`decide`: on a mismatch every rank raises ``CollectiveMismatchError`` naming both sides,
and this process exits with that error while the IO thread (which only the broken collective
needed) stays held; on none (another cause) the abort goes ahead as before, seconds later.

Linux with libstdc++ (torch's own builds) only; elsewhere nothing is installed.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

_HANDLER = ctypes.CFUNCTYPE(None)
# The doctor's survey answers within 5 s; then this process exits with the error. Past these
# the abort goes ahead after all: nothing holds a process forever.
_DECIDE_WITHIN_S = 15.0
_HOLD_S = 60.0

#: Set on Gloo's IO thread when it would abort: the doctor surveys at once.
aborting = threading.Event()
_decided = threading.Event()
_found = False
_state: dict[str, Any] = {}  # the library, the previous handler, ours (kept alive), the waker


def install(wake: Callable[[], None]) -> bool:
    """Hold Gloo's aborts for the doctor (``wake()`` tells it); idempotent. False where this
    platform's C++ runtime does not allow it."""
    if "ours" in _state or not sys.platform.startswith("linux"):
        return "ours" in _state
    try:
        lib = ctypes.CDLL("libstdc++.so.6")
        set_terminate = lib._ZSt13set_terminatePFvvE  # std::set_terminate
        current_type = lib.__cxa_current_exception_type
    except (OSError, AttributeError):
        return False
    set_terminate.restype = ctypes.c_void_p
    set_terminate.argtypes = [ctypes.c_void_p]
    current_type.restype = ctypes.c_void_p
    ours = _HANDLER(_on_terminate)
    _state.update(set_terminate=set_terminate, current_type=current_type, ours=ours, wake=wake)
    _state["previous"] = set_terminate(ctypes.cast(ours, ctypes.c_void_p))
    return True


def uninstall() -> None:
    """Give C++ its previous terminate handler back (at exit: no Python past finalization)."""
    if "ours" in _state:
        _state["set_terminate"](_state["previous"])
        del _state["ours"]


def decide(found: bool) -> None:
    """The doctor's verdict on a held abort: ``found``, a mismatch every rank now raises."""
    global _found
    _found = found
    _decided.set()


def _on_terminate() -> None:
    # On the thread that is terminating, with its exception still current.
    held = (
        _exception_type().startswith("N4gloo")  # gloo::EnforceNotMet, gloo::IoException
        and threading.current_thread() is not threading.main_thread()
        and not sys.is_finalizing()
    )
    if held:
        aborting.set()
        _state["wake"]()
        if _decided.wait(_DECIDE_WITHIN_S) and _found:
            threading.Event().wait(_HOLD_S)  # the main thread raises; the process exits
    previous = _state.get("previous")
    if previous:
        _HANDLER(previous)()  # prints the exception and aborts, as without us
    ctypes.CDLL(None).abort()


def _exception_type() -> str:
    """The mangled name of the exception being thrown (``N4gloo13EnforceNotMetE``), or ""."""
    info = _state["current_type"]()  # a std::type_info*: its name follows the vtable pointer
    if not info:
        return ""
    name = ctypes.c_char_p.from_address(info + ctypes.sizeof(ctypes.c_void_p)).value
    return (name or b"").decode(errors="replace")
