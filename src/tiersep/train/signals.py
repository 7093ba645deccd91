"""Preemption: SIGTERM/SIGUSR1 only set a flag; the loop checkpoints at the next step boundary."""
from __future__ import annotations

import signal
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopFlag:
    """Set by SIGTERM/SIGUSR1; the handler only records the signal (safe at any point)."""

    def __init__(self):
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""


@contextmanager
def stop_on_signals(flag: StopFlag):
    def handler(signum, _frame):
        flag.signal = signum

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
