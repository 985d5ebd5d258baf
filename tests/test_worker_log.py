"""Worker lines as the run log shows them: readable events, levels kept, ranks named."""

import logging

from parashift.tasks.worker_log import WorkerLog, present
from parashift.trainer import events


def test_events_read_as_sentences() -> None:
    step = events.PREFIX + '{"event": "step", "step": 12, "loss": 2.48929, "lr": 0.001, "step_s": 0.0221, "tokens_per_s": 11488.7}'
    assert present(step, 400) == (logging.INFO, "step 12/400  loss 2.4893  11,489 tok/s  22 ms")
    start = events.PREFIX + '{"event": "start", "step": 10, "resumed": true, "world_size": 2, "pids": [5, 6], "end_step": 40}'
    assert present(start)[1] == "2 workers (pids [5, 6]) resuming at step 10, training to step 40"
    # What every rank restored, and from where: warm workers serve much of it from memory
    moved = events.PREFIX + events.StartEvent(step=20, resumed=True, world_size=2, pids=[5, 6], end_step=40, restore_s=0.02,
                                              restore_bytes={"needed": 3_300_000, "read": 3_300_000, "local": 0,
                                                             "live": 1_800_000, "network": 900_000,
                                                             "store": 1_500_000}).model_dump_json()
    assert present(moved)[1] == ("2 workers (pids [5, 6]) resuming at step 20 (3.3 MB restored in 0.02 s: 1.8 MB from the "
                                 "workers' memory, 0.0 MB from the node's tier, 1.5 MB from storage), training to step 40")
    done = events.PREFIX + '{"event": "finished", "step": 6, "samples_consumed": 48}'
    assert present(done, 12)[1] == "segment done at step 6 (48 samples consumed)"  # a scripted change comes next
    assert present(done, 6)[1] == "finished at step 6 (48 samples consumed)"
    one = events.PREFIX + '{"event": "start", "step": 0, "resumed": false, "world_size": 1, "pids": [5], "end_step": 9}'
    assert present(one)[1] == "1 worker (pids [5]) starting at step 0, training to step 9"
    restoring = events.PREFIX + events.RestoringEvent(step=4, bytes_needed=2_000_000, bytes_read=2_000_000,
                                                      requests=3).model_dump_json()
    # rank 0's share, not the whole move the flow's reshard plan reports
    assert present(restoring)[1].startswith("rank 0 restores step 4: 2.0 MB in 3 reads (its share: 2.0 MB needed")
    # A loop's wait of a millisecond or two for a save is not worth a line in every run log; a long one is
    short = events.PREFIX + events.CheckpointStallEvent(step=21, stall_s=0.001).model_dump_json()
    long = events.PREFIX + events.CheckpointStallEvent(step=41, stall_s=0.8).model_dump_json()
    assert present(short) == (logging.DEBUG, "step 21: the loop waited 0.001 s for a checkpoint")
    assert present(long) == (logging.INFO, "step 41: the loop waited 0.800 s for a checkpoint")


def test_worker_records_keep_their_level_and_rank() -> None:
    assert present("WARNING rank1 parashift.checkpoint: pruning failed") == (
        logging.WARNING, "WARNING rank1 parashift.checkpoint: pruning failed")
    assert present("INFO rank0 parashift.storage: committed")[0] == logging.INFO
    assert present("W1201 05:18:33.122000 1234 torch/distributed/elastic/api.py:1028] Sending process 28324 closing signal SIGTERM")[0] == logging.WARNING


def test_failures_are_errors() -> None:
    assert present("[rank0]: Traceback (most recent call last):")[0] == logging.ERROR
    assert present("  exitcode  : -9 (pid: 766)  (SIGKILL)")[0] == logging.ERROR
    assert present("plain text from a worker") == (logging.INFO, "plain text from a worker")


# What torchrun wrote when kill -9 ended one of two workers (torch 2.x), and an ordinary line.
TORCHRUN_FAILURE = """\
W1202 08:23:13.454000 18230 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 18241 closing signal SIGTERM
E1202 08:23:13.522000 18230 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 18242) of binary: /venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main
    run(args)
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__
    return launch_agent(
           ^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\x20
=======================================================
trainer.worker FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_08:23:13
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 18241)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 18241
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_08:23:13
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 18242)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 18242
=======================================================
plain text after it"""


def relayed(lines: list[str], close: bool = True) -> list[tuple[int, str]]:
    """The records a WorkerLog makes of `lines`."""
    records: list[tuple[int, str]] = []
    log = WorkerLog(lambda level, message: records.append((level, message)))
    for line in lines:
        log(line)
    if close:
        log.close()
    return records


def test_torchruns_failure_report_is_one_error_record() -> None:
    records = relayed(TORCHRUN_FAILURE.splitlines())
    lines = TORCHRUN_FAILURE.splitlines()
    assert records == [(logging.WARNING, lines[0]), (logging.ERROR, lines[1]),
                       (logging.ERROR, "\n".join(lines[2:-1])), (logging.INFO, "plain text after it")]


def test_tracebacks_of_ranks_are_gathered_apart_and_chained_ones_together() -> None:
    step = events.PREFIX + '{"event": "step", "step": 3, "loss": 2.5, "lr": 0.001, "step_s": 0.02, "tokens_per_s": 100.0}'
    lines = ["[rank0]: Traceback (most recent call last):",
             "[rank1]: Traceback (most recent call last):",
             '[rank0]:   File "trainer/worker.py", line 40, in main',
             step,  # another process's output, amid both
             '[rank1]:   File "trainer/worker.py", line 41, in main',
             "[rank0]: KeyError: 'x'",
             "",  # excepthook writes blank lines without the rank
             "[rank0]: During handling of the above exception, another exception occurred:",
             "",
             "[rank0]: Traceback (most recent call last):",
             '[rank0]:   File "trainer/worker.py", line 42, in main',
             "[rank0]: RuntimeError: boom",
             "[rank1]: ValueError: bad",
             "INFO rank1 parashift.trainer: after"]
    records = relayed(lines)
    assert records[0] == (logging.INFO, "step 3  loss 2.5000  100 tok/s  20 ms")
    assert records[1] == (logging.ERROR, "\n".join(lines[i] for i in (0, 2, 5, 6, 7, 8, 9, 10, 11)))
    assert records[2] == (logging.ERROR, "\n".join(lines[i] for i in (1, 4, 12)))
    assert records[3] == (logging.INFO, "INFO rank1 parashift.trainer: after")
    assert len(records) == 4


def test_a_report_still_open_when_the_workers_exit_is_emitted_on_close() -> None:
    lines = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "w.py", line 1, in f', "[rank1]: OSError: gone"]
    assert relayed(lines, close=False) == []
    assert relayed(lines) == [(logging.ERROR, "\n".join(lines))]


def test_a_killed_rank_is_named_over_the_peers_whose_collectives_broke_after_it() -> None:
    """torchrun's summary of a clean-clone failure (2026-12-04): rank 1 was SIGKILLed, rank 2's
    gloo read got "Connection reset by peer" and exited 1, and torchrun called rank 2 the root
    cause. The reason names rank 1."""
    from parashift.launcher.segment import root_cause

    summary = """
Failures:
[1]:
  time      : 2026-12-04_10:01:02
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_10:01:02
  host      : box
  rank      : 2 (local_rank: 2)
  exitcode  : 1 (pid: 4243)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
""".splitlines()
    assert root_cause(summary) == (1, -9)
    peers_only = [line.replace("exitcode  : -9", "exitcode  : 1") for line in summary]
    assert root_cause(peers_only) == (2, 1)  # no signal death: torchrun's root cause stands
    assert root_cause(["nothing to see"]) is None
    # torchrun killed the remaining peer by signal too: the launcher's own order of exits decides.
    both = [line.replace("exitcode  : 1 (pid: 4243)", "exitcode  : -9 (pid: 4243)") for line in summary]
    assert root_cause(both, first_exited=[1]) == (1, -9)
    assert root_cause(both, first_exited=[2]) == (2, -9)


def test_a_killed_rank_is_named_though_seen_gone_after_a_peer() -> None:
    """A suite run under load (2026-12-07): rank 2 was SIGKILLed, yet the launcher's poll saw
    rank 1 gone first (the dying rank was descheduled in the kernel while rank 1 raised on the
    closed connection and exited), and torchrun's root cause was rank 1 as well. The signal
    death outranks the order of exits; rank 0, which torchrun ended itself, is no candidate."""
    from parashift.launcher.segment import root_cause

    summary = """
[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:63720.
W1207 02:37:34.933000 8029 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8033 closing signal SIGTERM
Failures:
[1]:
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 8035)  (SIGKILL)
[2]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 8033)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 8034)
""".splitlines()
    assert root_cause(summary, first_exited=[1]) == (2, -9)
    # Ended by torchrun's own SIGTERM: a consequence, whatever the order it was listed in.
    termed = [line.replace("-9 (pid: 8035)  (SIGKILL)", "1 (pid: 8035)").replace("1 (pid: 8033)", "-15 (pid: 8033)")
              for line in summary]
    assert root_cause(termed) == (1, 1)
    assert root_cause(termed, first_exited=[2]) == (2, 1)
    # Across nodes each node's lines come prefixed with its name (flows/node.py): read alike
    # (until 2026-12-07 such a summary matched nothing, and the reason named no rank).
    assert root_cause([f"[b] {line}" for line in summary]) == (2, -9)


def test_a_killed_rank_torchrun_also_closed_is_named() -> None:
    """Under load (2026-12-07, 6 of 44 runs of 20 torchrun kills): rank 2 SIGKILLed, its forked
    client not yet ended when rank 1, broken by it, exited; torchrun then sent SIGTERM to ranks
    0 and 2. Rank 2 ended by SIGKILL, a signal torchrun did not send
    it: its end was its own, and it is the cause (it was read as a consequence, and rank 1 named)."""
    from parashift.launcher.segment import root_cause

    summary = """
[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:47778.
W1207 06:21:39.137000 15113 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 15119 closing signal SIGTERM
W1207 06:21:39.137000 15113 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 15121 closing signal SIGTERM
E1207 06:21:39.173000 15113 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 15120) of binary: python
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 15119)
[2]:
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 15121)  (SIGKILL)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 15120)
""".splitlines()
    assert root_cause(summary) == (2, -9)
    assert root_cause(summary, first_exited=[1]) == (2, -9)
    # Ended by what torchrun sent: its SIGTERM, or its SIGKILL once the SIGTERM's grace ran out.
    escalated = [*summary[:3], summary[3].replace("SIGTERM", "SIGKILL"), *summary[3:]]
    assert root_cause(escalated) == (1, 1)
    assert root_cause([line.replace("-9 (pid: 15121)  (SIGKILL)", "-15 (pid: 15121)") for line in summary]) == (1, 1)


def test_counts_read_in_words() -> None:
    from parashift.specs.words import counted, counted_each

    assert (counted(1, "device"), counted(3, "device")) == ("1 device", "3 devices")
    assert counted_each([1], "device") == "1 device"
    assert counted_each([2, 3, 1], "device", " -> ") == "2 -> 3 -> 1 devices"


def test_the_run_summary_names_a_failure_by_the_launchers_line_not_a_peers_traceback() -> None:
    """A warm rank SIGKILLed mid-step: its peers' tracebacks (gloo's "Connection reset by peer")
    reach the log first, then the launcher's line naming the killed rank. The summary's warning
    is that line (it showed a peer's traceback); a traceback alone is still shown."""
    import logging

    from parashift.commands.run import RunWarnings

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, message, None, None)

    warnings = RunWarnings()
    peer = ("Traceback (most recent call last):\n  File \"trainer.py\", line 381, in _report\n"
            "RuntimeError: Read error [127.0.0.1]:16820: Connection reset by peer.")
    for message in (peer, peer, "workers failed: rank 2 killed by signal 9 (a warm worker; another process takes "
                                "its place); the surviving workers hold step 42 in memory"):
        warnings.emit(record(message))
    assert warnings.line() == ("3 warnings in the log (2 tracebacks of workers); the first other: workers failed: "
                               "rank 2 killed by signal 9 (a warm "
                               "worker; another process takes its place); the surviving workers hold step 42 in memory")
    alone = RunWarnings()
    alone.emit(record(peer))
    assert alone.line().startswith("1 warning in the log; the first: Traceback (most recent call last): File")
