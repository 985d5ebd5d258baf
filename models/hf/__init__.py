"""Any causal language model of `transformers`, registered as `hf`: trained under data
parallelism, FSDP and HSDP (FSDP2 per decoder layer, as the model's own layer list gives them),
checkpointed and resharded like every family. No tensor or pipeline parallelism: that needs a
sharding table, which only a family of our own has."""
