"""`parashift run`'s embedded Prefect API, started at the command's first step.

Without a configured API, Prefect starts its ephemeral one at a flow's first API call: it
imports its whole server package into the calling process (~2.8 s of a core here) only to
launch `uvicorn` in a subprocess, then polls it until it answers (~3 s more). Started here
instead, as the same app with the same settings and environment Prefect gives it, the server
boots while this process checks the spec, imports torch and boots the job's workers, and this
process never imports the server package. Where any Prefect settings source (environment,
profile, prefect.toml) names an API, that one is used and nothing starts here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

from parashift.commands.serve import free_port, stop_group, wait_healthy
from parashift.tasks.events import mark_embedded

# What Prefect's own ephemeral server runs with (prefect.server.api.server.SubprocessASGIServer):
# no UI, and the app in its ephemeral mode (here wrapped: commands/prefect_app.py).
EPHEMERAL_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
UVICORN_STARTUP_FAILURE = 3  # uvicorn's exit code when it cannot serve (its port was taken meanwhile)
PORT_TRIES = 5


# Linux's prctl, looked up here so that the child only calls it (None elsewhere: no such signal).
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: SIGTERM when `parashift run` dies, even by SIGKILL (its own session keeps
    a terminal's Ctrl-C, meant for the run, from stopping the API under the run's last calls).
    The signal follows the thread that forked, here the command's main thread, which lives as
    long as the run."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedAPI:
    """A Prefect API server this process owns: `start`ed early, `use`d once it answers."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.used = False
        self._env: dict[str, str] = {}

    def start(self) -> None:
        from prefect.settings import get_current_settings

        # Prefect passes the settings it resolved (profile included) to its server; so does this.
        env = {**os.environ, **EPHEMERAL_ENV, **get_current_settings().to_environment_variables(exclude_unset=True)}
        self._env = env
        self._spawn(env)
        atexit.register(self.stop)  # registered before Prefect's log and event workers: stopped after they drain

    def _spawn(self, env: dict[str, str]) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        app_dir = Path(find_spec("prefect").origin).parent  # type: ignore[arg-type, union-attr]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
             "parashift.commands.prefect_app:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509 - one prctl call, looked up before

    def use(self) -> str:
        """Wait until the server answers (Prefect's ephemeral timeout, from its settings), then
        make it this process's API: every Prefect client of this process, in any thread, talks to it."""
        import prefect.context
        from prefect.settings import (
            PREFECT_API_URL,
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
            PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
            PREFECT_UI_URL,
        )

        assert self.process is not None, "start() first"
        timeout_s = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        for _ in range(PORT_TRIES):
            try:
                wait_healthy(self.process, self.url, timeout_s, what="the embedded Prefect API")
                break
            except RuntimeError:
                if self.process.poll() != UVICORN_STARTUP_FAILURE:
                    raise
                self._spawn(self._env)  # its port was taken between choosing it and binding it
        else:
            raise RuntimeError(f"the embedded Prefect API found no free port in {PORT_TRIES} tries")
        # The settings every thread falls back to (Prefect's test harness swaps the same object):
        # its log and event workers run in threads of their own. No UI is served (as on
        # Prefect's own ephemeral API): no "View at" links to it. No flow-run heartbeats: they
        # let a server mark a run whose process died, and this one dies with the run (their
        # thread sleeps in 1 s steps, and the flow's end waits for it: ~0.9 s a run, measured).
        context = prefect.context.get_settings_context()
        settings = context.settings.copy_with_update(
            updates={PREFECT_API_URL: self.url, PREFECT_UI_URL: "", PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
        prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.SettingsContext(profile=context.profile, settings=settings)
        if PREFECT_API_URL.value() != self.url:  # a Prefect that no longer reads that object
            raise RuntimeError(f"Prefect did not take the embedded API {self.url} as its own")
        mark_embedded(self.url)  # no other process can reach it: the run hears no resource events
        self.used = True
        return self.url

    def stop(self) -> None:
        """SIGTERM once used (its last requests finish). One never used, where the command
        refused the job before its flow, is killed at once: nothing was asked of it, and a
        SIGTERM waits for its startup to finish first (2.4 s more for a second run's refusal,
        measured); SQLite's journal keeps its database whole."""
        if self.process is None or self.process.poll() is not None:
            return
        if self.used:
            stop_group(self.process)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_unless_configured() -> EmbeddedAPI | None:
    """An embedded API, started now; None where Prefect's settings (any source) name an API,
    or turn its ephemeral API off (Prefect then says what is missing, as without parashift)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    api = EmbeddedAPI()
    api.start()
    return api
