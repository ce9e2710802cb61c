"""Run the engine in a worker thread while the page redraws live plots, with a clean Stop.

The script thread polls the worker's events and calls `on_events` (which draws); Streamlit's own
calls stay on the script thread. Stop (or leaving the page) interrupts the script thread; the
`finally` then sets the run's `cancel` Event, the engine raises `Cancelled` within one step, the
worker ends and nothing is saved. Each job has its own Event and queue: no module globals.
`PageJob` is the page side of that protocol, shared by the Run and Compare pages.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import streamlit as st

from kvlens.errors import Cancelled, KvlensError
from kvlens.ui import session
from kvlens.ui.state import get_model


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


class PageJob:
    """A page's Run/Stop protocol: flags `{prefix}_running` and `{prefix}_stopped` in the session.

    Call `begin()` at the top of the page (a job interrupted by Stop or navigation has ended by
    then; Stop's callback recorded whether one was running, and `begin` says so), draw
    `stop_button()`, and `run(make_work, on_events, status)` when the user starts one.
    """

    def __init__(self, prefix: str, stopped: str):
        self.prefix, self.message = prefix, stopped
        self.running, self.stopped = f"{prefix}_running", f"{prefix}_stopped"

    def begin(self) -> bool:
        """Whether a job was stopped (said in a warning): the page then shows no empty-state hint."""
        st.session_state[self.running] = False
        stopped = st.session_state.pop(self.stopped, False)
        if stopped:
            st.warning(self.message)
        return bool(stopped)

    def stop_button(self, where=st, **kwargs) -> None:
        where.button(
            "Stop",
            icon=":material/stop:",
            key=f"{self.prefix}_stop",
            width="stretch",
            on_click=self._stop,
            **kwargs,
        )

    def _stop(self) -> None:
        st.session_state[self.stopped] = st.session_state.get(self.running, False)

    def run(self, make_work: Callable, on_events: Callable[[list], None], status):
        """Load the model, run `make_work(model)` (a `Job`'s work) and return its result; None after
        showing in `status` why not (a bad setting, or Stop)."""
        st.session_state.pop(self.stopped, None)
        try:
            model = get_model(
                st.session_state.get(session.MODEL, "default"), st.session_state.get(session.DEVICE, "auto")
            )
            job = Job(make_work(model))
            st.session_state[self.running] = True  # left set when Stop interrupts: its callback reads it
            result = job.follow(on_events)
        except (Cancelled, KvlensError) as err:
            st.session_state[self.running] = False
            if isinstance(err, Cancelled):
                status.warning(self.message)
            else:
                status.error(str(err))
            return None
        st.session_state[self.running] = False
        return result
