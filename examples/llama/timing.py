"""Seconds by bucket (attention, the rest of the model, graph replays), cheap enough to leave on.

On the CPU a span is two ``perf_counter`` calls.  On the GPU the work is asynchronous, so a span
records two CUDA events on the current stream and the elapsed times are read once per step
(``collect``), after the step has synchronised anyway to bring its sampled tokens to the host.
"""
from __future__ import annotations

import collections
import contextlib
import time


class Timer:
    """Accumulated seconds per bucket name.

    Parameters
    ----------
    gpu : bool
        Time device work with CUDA events instead of the host clock.
    seconds : collections.Counter, optional
        Add into this counter (timers of steps in flight at once share one).

    Examples
    --------
    >>> timer = Timer(gpu=False)
    >>> with timer.span("attention"):
    ...     pass
    >>> timer.collect(); timer.seconds["attention"] >= 0.0
    True
    """

    def __init__(self, gpu: bool, seconds: collections.Counter | None = None):
        self.gpu = gpu
        self.seconds: collections.Counter = collections.Counter() if seconds is None else seconds
        self._events: list = []   # CUDA events, reused step after step
        self._pending: list = []  # (bucket, start index, end index) not yet read
        self._used = 0

    def _event(self):
        import cupy

        if self._used == len(self._events):
            self._events.append(cupy.cuda.Event())
        event = self._events[self._used]
        self._used += 1
        event.record()
        return self._used - 1

    @contextlib.contextmanager
    def span(self, bucket: str):
        """Time the enclosed work into ``bucket``."""
        if not self.gpu:
            start = time.perf_counter()
            yield
            self.seconds[bucket] += time.perf_counter() - start
            return
        start = self._event()
        yield
        self._pending.append((bucket, start, self._event()))

    def collect(self) -> None:
        """Add the pending GPU spans (waits for their end events)."""
        if not self._pending:
            return
        import cupy

        self._events[self._pending[-1][2]].synchronize()
        for bucket, start, end in self._pending:
            self.seconds[bucket] += cupy.cuda.get_elapsed_time(self._events[start], self._events[end]) / 1e3
        self._pending.clear()
        self._used = 0


    def discard(self) -> None:
        """Forget the pending spans (of work that failed before it was all enqueued)."""
        self._pending.clear()
        self._used = 0


class NoTimer:
    """A stand-in with :class:`Timer`'s interface that times nothing (for warm-ups and captures)."""

    gpu = False

    @contextlib.contextmanager
    def span(self, bucket: str):
        yield

    def collect(self) -> None:
        pass

    def discard(self) -> None:
        pass
