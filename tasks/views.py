"""What the UI shows of a segment (the plan it runs, what its workers read, the run's tag for its
device count), made once its workers have trained their first step.

These are for the record: none of them decides anything the workers do. Made during a change,
they took the CPU the change needs: the reshard view 0.1-0.26 s of layout work on the 293 MB
trace (BENCHMARKS.md, twenty-eighth session), the plan's task run and its two artifacts, the tag's
two API calls, each also work for the Prefect server, on the cores the new workers start on.

    with OnceTrained(show_plan, show_reads, show_tag) as shown:
        launch_training(..., trained=shown.trained)
    plan_shown, reads_shown, _ = shown.results()
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

from prefect.futures import PrefectFuture


class OnceTrained:
    """`calls`, made in order once `trained` is set (by the launch, at the segment's first
    step), or once the segment has ended without one; none where the launch raised (the `with`
    block). They run in a thread of the flow run's context, so a task they submit is this run's."""

    def __init__(self, *calls: Callable[[], Any]) -> None:
        self.trained = threading.Event()
        self._wanted = True
        self._outcomes: list[Any] = []
        run = contextvars.copy_context().run
        self._thread = threading.Thread(target=run, args=(self._make, calls), name="parashift-views", daemon=True)
        self._thread.start()

    def __enter__(self) -> OnceTrained:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._wanted = kind is None  # the launch raised: nothing is shown, and the thread ends
        self.trained.set()
        self._thread.join()

    def _make(self, calls: tuple[Callable[[], Any], ...]) -> None:
        self.trained.wait()
        for call in calls if self._wanted else ():
            try:
                self._outcomes.append(call())
            except Exception as error:  # noqa: BLE001 - a view never stops training: the caller says it
                self._outcomes.append(error)

    def results(self) -> list[Any]:
        """Each call's outcome, waited for: a submitted task's result (or the error it failed
        with), else what the call returned or raised."""
        return [outcome.result(raise_on_failure=False) if isinstance(outcome, PrefectFuture) else outcome
                for outcome in self._outcomes]
