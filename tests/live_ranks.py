"""One rank of tests/test_live_restore.py: for each case, save a checkpoint under the old plan
with the real saver on a real gloo group and keep the state (`live.hold`), tear the group
down, then restore under the new plan twice, from live workers and from storage alone, and
write both results' comparison as one JSON line.

    python tests/live_ranks.py RANK OUT_DIR STORE_ROOT CASES_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from parashift.ptc.reconfig import LIVE, live_holder
from parashift.storage import CheckpointStore, ObjectStore
from parashift.trainer.checkpoint import Checkpointer, restore_latest, restore_totals
from parashift.trainer.checkpoint import live as live_state
from parashift.trainer.layout import state_layout
from parashift.trainer.state import rank_private

sys.path.insert(0, str(Path(__file__).parent))
from states import box_of, global_state  # noqa: E402
from test_reconfig import CONFIG, PLANS  # noqa: E402


def group_of(rendezvous: str, rank: int, world: int) -> dist.ProcessGroup:
    """A gloo world met through a file of its own (no port chosen ahead, which another process
    may take meanwhile)."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    return dist.new_group(backend="gloo")


def main() -> None:
    rank, out, root = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cases = json.loads(sys.argv[4])
    results = []
    for case in cases:
        old, new = state_layout(PLANS[case["old"]], CONFIG), state_layout(PLANS[case["new"]], CONFIG)
        store = CheckpointStore(ObjectStore(f"file://{root}/{case['job']}"), case["job"])
        state = global_state(old)
        # A pending case: step 3 committed, then step 5 (other values) held and described by a
        # pending manifest only, as warm workers do at a planned change.
        later = {name: t + 1 for name, t in state.items()}
        by_step = {3: state, 5: later}
        if rank < old.world_size:
            group = group_of(case["rendezvous"][0], rank, old.world_size)
            mine = {name: box_of(state[name], box).clone() for name, box in old.boxes_of(rank).items()}
            saver = Checkpointer(store, old, rank, group)
            saver.save(3, mine, {"samples_consumed": 24}, {}, {}, blocking=True)
            if case.get("pending"):
                mine = {name: box_of(later[name], box).clone() for name, box in old.boxes_of(rank).items()}
                saver.write_pending(5, mine, {"samples_consumed": 40}, {}, {})
            saver.close()
            kept = None
            if "failure" not in case:
                kept = live_state.hold(case["job"], 5 if case.get("pending") else 3, old, rank, mine)
            elif rank != case["failure"]:  # a survivor of that rank's death: step 5, described by nothing
                mine = {name: box_of(later[name], box).clone() for name, box in old.boxes_of(rank).items()}
                generators = {name: t for name, t in later.items() if rank_private(name) is not None}
                facts = live_state.Unrecorded(old, {"samples_consumed": 40}, {}, {"loss": 1.5})
                kept = live_state.hold(case["job"], 5, old, rank, mine, others=generators, unrecorded=facts)
            if kept is not None and rank == case.get("corrupt"):  # this rank's memory is no longer the committed bytes
                kept.data[0][0] ^= 0xFF
            dist.destroy_process_group()
        if rank >= new.world_size:
            continue
        group = group_of(case["rendezvous"][1], rank, new.world_size)
        peers = live_state.LivePeers.gather(case["job"], rank, group)
        if peers is not None and case.get("group_only"):  # as where a peer's memory cannot be read
            peers.nearby = {}
        if peers is not None and peers.recorders:  # a failure's survivors: the step described first
            peers.record(store, rank, max(store.manifest_steps(), default=-1))
        seen = []
        # Every box this rank holds exactly is read into the held memory itself (the worker
        # offers the optimizer's; here all of them), then compared with storage like the rest.
        held = live_state.held_boxes(case["job"], new, rank, new.boxes_of(rank))
        live = restore_latest(store, new, rank, group, live=peers, destinations=dict(held),
                              on_reads=lambda step, reads, seen=seen: seen.append(reads))
        totals = restore_totals(seen[-1], group)
        stored = restore_latest(store, new, rank, group)
        assert live is not None and stored is not None
        wanted = new.boxes_of(rank)
        results.append({
            "case": case["job"],
            "rank": rank,
            "step": live.step,
            "pending": live.pending,
            "pending_steps": store.pending_steps(),
            "folders": sorted(store.manifest_steps() + store.uncommitted_steps()),
            "same_keys": sorted(live.tensors) == sorted(stored.tensors),
            "bitwise": live.step != stored.step or all(torch.equal(live.tensors[n], stored.tensors[n]) for n in stored.tensors),
            "slices": all(torch.equal(t, box_of(by_step[live.step][n], wanted[n])) for n, t in live.tensors.items()),
            "holders": sorted({live_holder(r.object)[0] for r in seen[-1].requests if r.source == LIVE}),
            "totals": totals,
            "peers": None if peers is None else sorted(peers.holdings),
            "recorders": None if peers is None else peers.recorders,
            "moved": None if peers is None else peers.moved,
            "held": sorted(held),
            "wanted": sorted(wanted),
            "in_held_memory": sorted(n for n, t in held.items() if live.tensors[n].data_ptr() == t.data_ptr()),
        })
        live_state.release()
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
