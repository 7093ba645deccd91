"""Stopping a run without losing it: SIGTERM/SIGUSR1 (cluster preemption) and SIGINT (Ctrl-C) only
set a flag, and the loop checkpoints at the next step boundary. A second Ctrl-C stops at once
(KeyboardInterrupt), for a user who does not want to wait for the step to end."""
from __future__ import annotations

import signal
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopFlag:
    """Set by a stop signal; the handler only records the signal (safe at any point)."""

    def __init__(self):
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""

    @property
    def interrupted(self) -> bool:
        """Ctrl-C (SIGINT), as opposed to a scheduler's stop."""
        return self.signal == signal.SIGINT


@contextmanager
def stop_on_signals(flag: StopFlag):
    def handler(signum, _frame):
        flag.signal = flag.signal or signum
        if signum == signal.SIGINT:   # the next Ctrl-C raises KeyboardInterrupt: stop now
            signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield flag
    finally:
        # After a scheduler's stop the run is ending with its checkpoint written: a second one (torchrun
        # forwards the group's SIGTERM to its ranks) is ignored, so that it cannot kill the process
        # before it has said how it ended (a rank's exit note). Ctrl-C keeps its own rule.
        stopping = flag.signal in (signal.SIGTERM, signal.SIGUSR1)
        for s, h in previous.items():
            signal.signal(s, signal.SIG_IGN if stopping and s != signal.SIGINT else h)
