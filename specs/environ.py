"""Every `PARASHIFT_*` environment variable, named once, with why it is one.

A job's settings come from its spec or its Plan, which travel to every process that needs them
(the workers read both from files their launcher writes). An environment variable is left only
where a value must reach a process the spec does not describe, or describes a machine rather
than a job:

- set by a launcher for the processes it starts (a fact of that launch, not of the job);
- a machine's own setting (its address, a cache folder, whether to fork workers on it);
- an instrument of the tests and benchmarks (never needed to run a job).

`tests/test_imports.py` checks that no other module spells one out.
"""

from __future__ import annotations

PREFIX = "PARASHIFT_"  # what a launcher passes on to the workers it starts (with torchrun's own)

# Set by a launcher for the processes it starts
WARM_WORKER = "PARASHIFT_WARM_WORKER"  # launcher.warm_pool: this process runs one job after another
STORE_PREFIX = "PARASHIFT_STORE_PREFIX"  # launcher.warm_pool: this job's keys in the pool's rendezvous store
NODE = "PARASHIFT_NODE"  # launcher.launch, across nodes: the node this worker runs on
NODES = "PARASHIFT_NODES"  # launcher.launch, across nodes: every node of the launch, in order
LEASE_TOKEN = "PARASHIFT_LEASE_TOKEN"  # storage.lease: the flow's lease, fencing what its workers commit
SOURCE = "PARASHIFT_SOURCE"  # flows.git: the commit a spec came from, recorded with each checkpoint
FORKSERVER = "PARASHIFT_FORKSERVER"  # launcher.forkserver: the socket a forked worker's client asks
FORKSERVER_PID = "PARASHIFT_FORKSERVER_PID"  # launcher.forkserver: the server that socket belongs to
LAUNCHER_PID = "PARASHIFT_LAUNCHER_PID"  # launcher.processes: the process that started this one (read once)

# A machine's own settings
NODE_ADDR = "PARASHIFT_NODE_ADDR"  # this node's address for its peers (default: its hostname's)
HF_CACHE = "PARASHIFT_HF_CACHE"  # where Hugging Face checkpoints read by URL are cached on this machine
STORAGE_ROOT = "PARASHIFT_STORAGE_ROOT"  # flows.git: where relative local storage URLs of a checkout resolve
FORK_WORKERS = "PARASHIFT_FORK_WORKERS"  # "0": workers are interpreters of their own, never forked
FORK_CUDA = "PARASHIFT_FORK_CUDA"  # "1": CUDA workers are forked too (off until a GPU run shows it pays)
FORKSERVER_DIR = "PARASHIFT_FORKSERVER_DIR"  # launcher.forkservers: where this user's forkservers listen

# Instruments of the tests and benchmarks
SAMPLE_LOG = "PARASHIFT_SAMPLE_LOG"  # a folder where each worker logs the samples it trains on
