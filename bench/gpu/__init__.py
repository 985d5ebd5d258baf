"""The parts of the prepared GPU check (`bench.gpu_check`): each a module run as its own process
(`python -m parashift.bench.gpu.<part>`), printing one JSON line per case it measured."""
