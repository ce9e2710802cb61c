"""Run the engine in a worker thread while the page redraws live plots, with a clean Stop.

The script thread polls the worker's events and calls `on_events` (which draws); Streamlit's own
calls stay on the script thread. Stop (or leaving the page) interrupts the script thread; the
`finally` then sets the run's `cancel` Event, the engine raises `Cancelled` within one step, the
worker ends and nothing is saved. Each job has its own Event and queue: no module globals.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable


class Job:
    """`work(on_step, cancel) -> result` on a thread; `events` collects what `on_step` received."""

    def __init__(self, work: Callable):
        self.cancel = threading.Event()
        self.events: queue.Queue = queue.Queue()
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, args=(work,), daemon=True)

    def _main(self, work) -> None:
        try:
            self.result = work(self.events.put, self.cancel)
        except BaseException as err:  # handed to the script thread, which shows or re-raises it
            self.error = err

    def follow(self, on_events: Callable[[list], None], every: float = 0.25):
        """Start, call `on_events(new_events)` at most every `every` seconds, return the result.

        Raises the worker's error (`Cancelled` included). An interruption of the script thread
        (Stop, navigation) cancels the worker and waits for it before propagating.
        """
        self.thread.start()
        try:
            while self.thread.is_alive() or not self.events.empty():
                self.thread.join(timeout=every)
                batch = []
                while not self.events.empty():
                    batch.append(self.events.get_nowait())
                if batch:
                    on_events(batch)
        finally:
            if self.thread.is_alive():
                self.cancel.set()
                self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result

