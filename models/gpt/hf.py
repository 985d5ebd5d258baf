"""The GPT family written as a Hugging Face checkpoint: `transformers`' OPT computes what
models/gpt/model.py computes (pre-norm blocks, learned positions, q, k, v and output projections
with biases, a 4x GELU MLP, a final LayerNorm), with `tie_word_embeddings` off for our own head.

    ours                              OPT (`model.decoder.` before each but lm_head)     held
    tok_emb.weight                    embed_tokens.weight                                as is
    pos_emb.weight                    embed_positions.weight                             2 rows first
    blocks.i.attn_norm.*              layers.i.self_attn_layer_norm.*                    as is
    blocks.i.attn.{q,k,v}_proj.*      layers.i.self_attn.{q,k,v}_proj.*                  as is
    blocks.i.attn.out_proj.weight     layers.i.self_attn.out_proj.weight                 transposed
    blocks.i.mlp_norm.*               layers.i.final_layer_norm.*                        as is
    blocks.i.mlp.up_proj.*            layers.i.fc1.*                                     as is
    blocks.i.mlp.down_proj.weight     layers.i.fc2.weight                                transposed
    norm.*                            final_layer_norm.*                                 as is
    lm_head.weight                    lm_head.weight                                     as is

Why OPT and not GPT-2, whose shape this family follows: GPT-2 fuses q, k and v into one Conv1D
weight, so no tensor of ours would be one of its tensors; OPT keeps them apart. OPT's position
table holds two rows before position 0 (an offset it adds to every position id): written as
zeros, never read. Export only: a GPT checkpoint continues as `family: gpt` or, exported, as
`family: hf`.
"""

from __future__ import annotations

from typing import Any

import torch
from parashift.models.gpt.spec import GPTSpec
from parashift.models.hf_names import NameMap

POSITION_OFFSET = 2  # transformers' OPTLearnedPositionalEmbedding.offset

_IN_LAYER = {  # ours (inside a block) -> OPT's (inside a layer), transposed?
    **{f"attn_norm.{k}": (f"self_attn_layer_norm.{k}", False) for k in ("weight", "bias")},
    **{f"attn.{p}_proj.{k}": (f"self_attn.{p}_proj.{k}", False) for p in "qkv" for k in ("weight", "bias")},
    "attn.out_proj.weight": ("self_attn.out_proj.weight", True),
    "attn.out_proj.bias": ("self_attn.out_proj.bias", False),
    **{f"mlp_norm.{k}": (f"final_layer_norm.{k}", False) for k in ("weight", "bias")},
    **{f"mlp.up_proj.{k}": (f"fc1.{k}", False) for k in ("weight", "bias")},
    "mlp.down_proj.weight": ("fc2.weight", True),
    "mlp.down_proj.bias": ("fc2.bias", False),
}
_OUTSIDE = {"tok_emb.weight": "model.decoder.embed_tokens.weight",
            "pos_emb.weight": "model.decoder.embed_positions.weight",
            "norm.weight": "model.decoder.final_layer_norm.weight", "norm.bias": "model.decoder.final_layer_norm.bias",
            "lm_head.weight": "lm_head.weight"}


# Our parameter name -> (OPT's name, whether the tensor is held transposed).
hf_name = NameMap(_OUTSIDE, _IN_LAYER, "model.decoder.layers")


def hf_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as OPT holds it, once renamed and transposed: the position table with its
    offset rows first."""
    if name == "pos_emb.weight":
        return torch.cat([tensor.new_zeros(POSITION_OFFSET, tensor.shape[1]), tensor])
    return tensor


def hf_config(spec: GPTSpec) -> dict[str, Any]:
    """A `transformers` OPT config for this model (no padding token: every id is a token here,
    and OPT's would otherwise keep that embedding from training further)."""
    return {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.d_model,
        "word_embed_proj_dim": spec.d_model,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "ffn_dim": 4 * spec.d_model,
        "max_position_embeddings": spec.seq_len,
        "activation_function": "gelu",  # exact GELU, as F.gelu
        "do_layer_norm_before": True,
        "layer_norm_elementwise_affine": True,
        "enable_bias": True,
        "tie_word_embeddings": False,
        "dropout": spec.dropout,
        "attention_dropout": spec.dropout,
        "activation_dropout": 0.0,
        "layerdrop": 0.0,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }
