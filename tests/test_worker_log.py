"""Worker lines as the run log shows them: readable events, levels kept, ranks named."""

import logging

from tasks.worker_log import present
from trainer import events


def test_events_read_as_sentences() -> None:
    step = events.PREFIX + '{"event": "step", "step": 12, "loss": 2.48929, "lr": 0.001, "step_s": 0.0221, "tokens_per_s": 11488.7}'
    assert present(step, 400) == (logging.INFO, "step 12/400  loss 2.4893  11,489 tok/s  22 ms")
    start = events.PREFIX + '{"event": "start", "step": 10, "resumed": true, "world_size": 2, "pids": [5, 6], "end_step": 40}'
    assert present(start)[1] == "2 workers (pids [5, 6]) resuming at step 10, training to step 40"


def test_worker_records_keep_their_level_and_rank() -> None:
    assert present("WARNING rank1 parashift.checkpoint: pruning failed") == (
        logging.WARNING, "WARNING rank1 parashift.checkpoint: pruning failed")
    assert present("INFO rank0 parashift.storage: committed")[0] == logging.INFO
    assert present("W1201 05:18:33.122000 1234 torch/distributed/elastic/api.py:1028] Sending process 28324 closing signal SIGTERM")[0] == logging.WARNING


def test_failures_are_errors() -> None:
    assert present("[rank0]: Traceback (most recent call last):")[0] == logging.ERROR
    assert present("  exitcode  : -9 (pid: 766)  (SIGKILL)")[0] == logging.ERROR
    assert present("plain text from a worker") == (logging.INFO, "plain text from a worker")
