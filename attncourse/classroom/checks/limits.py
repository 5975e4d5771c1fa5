"""Time limits for the in-notebook check of an exercise whose cases are sized so that a loop cannot finish.

The grader stops a cell after a minute; `check()` in the learner's own notebook had no limit, so an answer that
simulates where it should count kept the cell busy with no message. An exercise listed in :data:`SECONDS` has each
case stopped after that many seconds (Unix main thread: ``SIGALRM`` with the interpreter's own handler, so no Python
frame of the course runs inside the learner's code), and the check says why.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

SECONDS: dict[str, float] = {}  # exercise id -> seconds per case in the in-notebook check


class TooSlow(Exception):
    """A case ran past its exercise's time limit."""


@contextlib.contextmanager
def time_limit(exercise_id: str):
    """Stop the enclosed case after ``SECONDS[exercise_id]`` seconds with :class:`TooSlow` (no limit when the id is
    not listed, off the main thread, or where ``signal.setitimer`` does not exist)."""
    seconds = SECONDS.get(exercise_id)
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)  # raises KeyboardInterrupt, in C
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except KeyboardInterrupt:
        if time.monotonic() - start < seconds * 0.99:  # a real interrupt from the learner: let it through
            raise
        raise TooSlow(f"your code ran for more than {seconds:g} s on this case and was stopped: the case is sized "
                      "so that a loop over tokens, queries or keys cannot finish; count in closed form") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
