"""Stopping a training run cleanly: the first SIGINT or SIGTERM checkpoints after the current step."""

from __future__ import annotations

import signal
import sys
import threading

from tqdm import tqdm


class StopRequest:
    """The first Ctrl-C (SIGINT) or SIGTERM (what schedulers send before they kill a job) asks the loop to
    checkpoint and stop after the current step; a second one aborts at once (KeyboardInterrupt). Signal
    handlers can only be installed from the main thread; elsewhere the signals keep their handlers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal: str | None = None  # the name of the first signal received

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self):
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        tqdm.write(f"{self.signal}: saving a checkpoint after this step (send it again to abort)", file=sys.stderr)

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
