"""deferred_keyboard_interrupt (executor/interrupts.py): Ctrl-C during the block lands right after
it, the block itself runs whole; the default handler is back afterwards; an exception leaving the
block wins; another thread, or a program's own SIGINT handler, is left alone."""
from __future__ import annotations

import signal
import threading

import pytest

from specinfer.executor.interrupts import deferred_keyboard_interrupt


def test_ctrl_c_inside_the_block_is_raised_after_it():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_keyboard_interrupt():
            signal.raise_signal(signal.SIGINT)
            done.append("rest of the block")
    assert done == ["rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with deferred_keyboard_interrupt():  # nothing received: nothing raised
        done.append("again")
    assert done[-1] == "again"
    with pytest.raises(KeyboardInterrupt):  # outside a block Ctrl-C is immediate again
        signal.raise_signal(signal.SIGINT)


def test_an_exception_leaving_the_block_wins_and_the_handler_is_restored():
    with pytest.raises(ValueError):
        with deferred_keyboard_interrupt():
            signal.raise_signal(signal.SIGINT)
            raise ValueError("the block's own failure")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_other_threads_and_the_programs_own_handler_are_left_alone():
    seen = []
    out = []

    def worker():
        with deferred_keyboard_interrupt():
            out.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert out == [signal.default_int_handler]

    def own(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, own)
    try:
        with deferred_keyboard_interrupt():
            signal.raise_signal(signal.SIGINT)
            assert seen == [signal.SIGINT]  # the program's handler ran at once
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)
