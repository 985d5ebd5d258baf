"""The GPT family (GPT-2 style), registered as `gpt`: model.py (the module), spec.py (its spec
section), family.py (its sharding table and what the trainer asks of it), graph.py (the
planner's graph)."""
