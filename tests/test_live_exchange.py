"""A rank that dies while live state moves (`trainer.checkpoint.live.LivePeers.exchange`) must not
leave a live peer waiting on a transfer that was never posted: every transfer is posted and
waited for, and the failure is raised after. Real gloo processes: rank 1 dies before rank 2
posts its receive from it; rank 0's send to rank 2 still gets through at once. Before, rank 2's
receive from the dead peer raised as it was posted, its receive from rank 0 was never posted,
and rank 0's send waited as long as rank 2's group lived: in a warm worker, which outlives its
job, possibly beyond the launcher's grace for a failure's survivors, which then ends rank 0 and
the state it holds (checked once: with the old posting, this test's rank 2 never got rank 0's
bytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_a_dead_peer_does_not_leave_a_live_sender_waiting(tmp_path: Path) -> None:
    ranks = [subprocess.Popen([sys.executable, str(HERE / "exchange_death_ranks.py"), str(rank),
                               str(tmp_path / "rendezvous"), str(tmp_path)]) for rank in range(3)]
    for process in ranks:
        process.wait(timeout=120)
    zero, two = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 2))
    assert zero["raised"] is None and zero["seconds"] < 10, zero  # the group's timeout is 20 s
    assert two["received_from_0"], two
    assert two["raised"], "rank 2 says its peer died, once its other transfers are done"
