"""The one checkpoint component: training state <-> a parallelizable tensor collection in storage.

Everything checkpointed is a named global tensor of one of the kinds of state
(`trainer.state`: parameters, optimizer state, generators), placed by the Plan's Layout
(`trainer.layout`); the data position travels in the manifest. The Layout comes from the Plan,
not from the live tensors, so nothing is exchanged to know who writes what. Split by job:

- `saver`: `Checkpointer`, the asynchronous sharded save and the manifest commit;
- `restore`: `restore_latest`, the newest checkpoint every rank can use, read exactly;
- `live`: the committed state warm workers keep for the next segment, served from memory;
- `group`: the CPU collectives both agree through;
- planning a reshard before a launch needs no processes and lives in `ptc.reshard`.
"""

from parashift.ptc.reshard import (
    check_matches,
    check_usable,
    node_objects,
    reads_for,
    reshard_plan,
    stored_boxes,
)
from parashift.storage import node_tier
from parashift.trainer.checkpoint.restore import (
    CheckpointsUnusable,
    Restored,
    execute_reads,
    load_tensors,
    restore_latest,
    restore_totals,
)
from parashift.trainer.checkpoint.saver import Checkpointer, SaveReport, build_manifest

__all__ = [
    "Checkpointer",
    "CheckpointsUnusable",
    "Restored",
    "SaveReport",
    "build_manifest",
    "check_matches",
    "check_usable",
    "execute_reads",
    "load_tensors",
    "node_objects",
    "node_tier",
    "reads_for",
    "reshard_plan",
    "restore_latest",
    "restore_totals",
    "stored_boxes",
]
