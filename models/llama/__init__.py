"""The Llama family (Llama 2/3, Qwen2, Mistral without a sliding window), registered as `llama`:
model.py (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention), spec.py, family.py (the
sharding table), graph.py (the planner's graph), hf.py (Hugging Face checkpoints in and out)."""
