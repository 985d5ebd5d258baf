"""One rank of tests/test_live_exchange.py: three gloo ranks exchange held bytes; rank 1 dies
before rank 2 posts its receive from it, as a rank killed while live state moves does. Rank 0
sends its bytes to rank 2 and must get through (its receive posted all the same), rank 2 must
raise after receiving them. Writes one JSON line per rank.

    python tests/exchange_death_ranks.py RANK RENDEZVOUS_FILE OUT_DIR
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from parashift.trainer.checkpoint.live import _Transfers

PAYLOAD = torch.arange(1 << 20, dtype=torch.int64).view(torch.uint8)  # 8 MB: more than a socket buffer
TIMEOUT_S = 20  # the group's: what a send left waiting on an unposted receive would wait


def main() -> None:
    rank, rendezvous, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    transfers = _Transfers()
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    said: dict[str, object] = {"rank": rank}
    if rank == 1:
        os._exit(0)  # dies with its connections open: its peers see them closed
    start = time.monotonic()
    try:
        if rank == 0:
            transfers.post(dist.isend, PAYLOAD, dst=2, tag=1)
        else:
            time.sleep(1.0)  # rank 1's death is seen before rank 2 posts its receive from it
            from_dead, from_zero = torch.empty(16, dtype=torch.uint8), torch.zeros_like(PAYLOAD)
            transfers.post(dist.irecv, from_dead, src=1, tag=2)
            transfers.post(dist.irecv, from_zero, src=0, tag=1)
        transfers.finish()
        said["raised"] = None
    except RuntimeError as error:
        said["raised"] = str(error)[:200]
    said["seconds"] = round(time.monotonic() - start, 3)
    if rank == 2:
        said["received_from_0"] = bool(torch.equal(from_zero, PAYLOAD))
    (out / f"rank{rank}.json").write_text(json.dumps(said))
    os._exit(0)  # no teardown: a dead peer's group cannot be destroyed cleanly


if __name__ == "__main__":
    main()
