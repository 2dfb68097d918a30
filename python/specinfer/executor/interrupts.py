"""Deferring Ctrl-C across the few lines that must not be cut in half.

After the Rust core's ``update()`` has committed a step, the Python request states must
receive the same tokens; a KeyboardInterrupt landing in between would leave the two out of
step. ``with deferred_keyboard_interrupt():`` holds SIGINT for the duration of such a block and
raises the KeyboardInterrupt right after it, once the state is whole again (a block left by an
exception drops it: that exception is the one the caller sees).

Only the main thread receives signals in Python, and only there can a handler be installed;
elsewhere (and when the program installed its own SIGINT handler) the block runs as is. The
handler is swapped with ``_signal`` (signal's C module: signal.signal / getsignal wrap it in
enums) and the context manager is a plain class: this runs on every step's critical path.
"""
from __future__ import annotations

import _signal
import signal
import threading

_SIGINT = int(signal.SIGINT)
_MAIN = threading.main_thread().ident


class _Deferred:
    __slots__ = ("received", "active")

    def __init__(self):
        self.received = False
        self.active = False

    def _hold(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> "_Deferred":
        if threading.get_ident() == _MAIN and _signal.getsignal(_SIGINT) is signal.default_int_handler:
            _signal.signal(_SIGINT, self._hold)
            self.active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.active:
            _signal.signal(_SIGINT, signal.default_int_handler)
            if self.received and exc_type is None:
                raise KeyboardInterrupt
        return False


def deferred_keyboard_interrupt() -> _Deferred:
    return _Deferred()
