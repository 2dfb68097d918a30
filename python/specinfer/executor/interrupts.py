"""Deferring Ctrl-C across the few lines that must not be cut in half.

After the Rust core's ``update()`` has committed a step, the Python request states must
receive the same tokens; a KeyboardInterrupt landing in between would leave the two out of
step. :func:`deferred_keyboard_interrupt` holds SIGINT for the duration of such a block and
raises the KeyboardInterrupt right after it, once the state is whole again.

Only the main thread receives signals in Python, and only there can a handler be installed;
elsewhere (and when the program installed its own SIGINT handler) the block runs as is.
"""
from __future__ import annotations

import _signal  # signal's C module: signal.signal / getsignal wrap it in enums (~12 us a step)
import signal
import threading
from contextlib import contextmanager

_SIGINT = int(signal.SIGINT)


@contextmanager
def deferred_keyboard_interrupt():
    if threading.current_thread() is not threading.main_thread() or \
            _signal.getsignal(_SIGINT) is not signal.default_int_handler:
        yield
        return
    received = []

    def hold(signum, frame):
        received.append(signum)

    _signal.signal(_SIGINT, hold)
    try:
        yield
    finally:
        _signal.signal(_SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
