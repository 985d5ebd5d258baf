"""Devices shared by jobs: how many each job of a pool gets (`allocator`), decided on every pool
event from each job's predicted (then measured) step time per device count."""
