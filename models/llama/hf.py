"""The Llama family and Hugging Face checkpoints: names, configs and weights in both directions.

`transformers`' Llama, Qwen2 and Mistral (without a sliding window shorter than the context)
compute what models/llama/model.py computes; this module maps one onto the other:

    ours                               Hugging Face                                   held
    tok_emb.weight                     model.embed_tokens.weight                      as is
    blocks.i.attn_norm.weight          model.layers.i.input_layernorm.weight          as is
    blocks.i.attn.{q,k,v}_proj.*       model.layers.i.self_attn.{q,k,v}_proj.*        as is
    blocks.i.attn.out_proj.weight      model.layers.i.self_attn.o_proj.weight         transposed
    blocks.i.mlp_norm.weight           model.layers.i.post_attention_layernorm.weight as is
    blocks.i.mlp.{gate,up}_proj.*      model.layers.i.mlp.{gate,up}_proj.*            as is
    blocks.i.mlp.down_proj.weight      model.layers.i.mlp.down_proj.weight            transposed
    norm.weight                        model.norm.weight                              as is
    lm_head.weight                     lm_head.weight (absent when tied)              as is

Both use rotate_half rotary embeddings, so q and k need no permutation (torchtitan's complex
rotary does; its adapter permutes). Folders and weights: models/hub.py (safetensors only).
"""

from __future__ import annotations

from typing import Any

from parashift.models.hf_names import NameMap
from parashift.models.hub import CONFIG_NAME, CheckpointUnreadable, checkpoint_weights, read_config
from parashift.models.llama.spec import Llama3RopeScaling, LlamaSpec
from parashift.specs.base import FieldIssues

# Architectures whose math is the Llama family's (checked against `transformers` by tests).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}

_IN_LAYER = {  # ours (inside a block) -> Hugging Face (inside a layer), transposed?
    "attn_norm.weight": ("input_layernorm.weight", False),
    "mlp_norm.weight": ("post_attention_layernorm.weight", False),
    "attn.out_proj.weight": ("self_attn.o_proj.weight", True),
    "attn.out_proj.bias": ("self_attn.o_proj.bias", False),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", True),
    "mlp.down_proj.bias": ("mlp.down_proj.bias", False),
    **{f"attn.{p}_proj.{k}": (f"self_attn.{p}_proj.{k}", False) for p in "qkv" for k in ("weight", "bias")},
    **{f"mlp.{p}_proj.{k}": (f"mlp.{p}_proj.{k}", False) for p in ("gate", "up") for k in ("weight", "bias")},
}
_OUTSIDE = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}


# Our parameter name -> (Hugging Face name, whether the tensor is held transposed).
hf_name = NameMap(_OUTSIDE, _IN_LAYER, "model.layers")


# ---------------------------------------------------------------------------------- configs

def spec_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The LlamaSpec fields a Hugging Face config gives; FieldIssues (at `model.init_from`)
    naming the field and the architecture when the config is not the Llama family's math."""
    arch = (config.get("architectures") or [None])[0]
    kind = ARCHITECTURES.get(arch) if arch else config.get("model_type")

    def refuse(message: str) -> FieldIssues:
        return FieldIssues([(("init_from",), f"{where}: {message}")])

    if kind not in ARCHITECTURES.values():
        raise refuse(f"architecture {arch or config.get('model_type')!r} is not the Llama family's "
                     f"({', '.join(ARCHITECTURES)}); family: hf trains any transformers causal LM")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {config['hidden_act']!r}: the Llama family's MLP is SwiGLU (silu)")
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type != "llama3":
            raise refuse(f"rope scaling {rope_type!r} is not supported (llama3 is)")
        scaling = Llama3RopeScaling(**{k: scaling[k] for k in Llama3RopeScaling.model_fields if k in scaling})
    heads = config["num_attention_heads"]
    qwen = kind == "qwen2"
    bias = bool(config.get("attention_bias", False))
    return {
        "n_layers": config["num_hidden_layers"],
        "d_model": config["hidden_size"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "ffn_dim": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": True if qwen else bias,  # Qwen2: q, k and v always have biases
        "output_bias": False if qwen else bias,  # Llama's attention_bias covers o_proj too
        "mlp_bias": bool(config.get("mlp_bias", False)),
    }


def hf_config(spec: LlamaSpec) -> dict[str, Any]:
    """A `transformers` config for this model: Qwen2's where q, k, v alone have biases,
    Llama's otherwise (refused where neither expresses the biases)."""
    if spec.attention_bias and not spec.output_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    elif spec.attention_bias == spec.output_bias:
        arch, model_type = "LlamaForCausalLM", "llama"
    else:
        raise ValueError("an output-projection bias without q, k, v biases has no Hugging Face architecture")
    rope: dict[str, Any] = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    if spec.rope_scaling is not None:
        rope = {**rope, **spec.rope_scaling.model_dump()}
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "num_hidden_layers": spec.n_layers,
        "hidden_size": spec.d_model,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hd,
        "intermediate_size": spec.hidden,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,  # transformers 4.x reads these two,
        "rope_scaling": spec.rope_scaling.model_dump() if spec.rope_scaling else None,
        "rope_parameters": rope,  # 5.x this one
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": max(spec.seq_len, spec.rope_scaling.original_max_position_embeddings
                                       if spec.rope_scaling else spec.seq_len),
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        config.update({"attention_bias": spec.attention_bias, "mlp_bias": spec.mlp_bias})
    elif spec.mlp_bias:
        raise ValueError("Qwen2 has no MLP biases")
    return config


def resolve(spec: LlamaSpec) -> LlamaSpec:
    """The spec with the shape fields of its `init_from` folder's config; a field the spec sets
    that contradicts the config is an error at that field."""
    if spec.init_from is None:
        return spec
    config = read_config(spec.init_from)
    fields = spec_fields(config, spec.init_from)
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if window is not None and window < spec.seq_len:
        raise FieldIssues([(("seq_len",), f"{spec.init_from}: sliding_window {window} is shorter than seq_len "
                                          f"{spec.seq_len}: the Llama family attends to the whole context")])
    issues = []
    for name, value in fields.items():
        given = getattr(spec, name)
        if name in spec.model_fields_set and given != value and not (name == "n_kv_heads" and given is None):
            issues.append(((name,), f"is {given!r} but {spec.init_from}/{CONFIG_NAME} says {value!r}"))
    if issues:
        raise FieldIssues(issues)
    return spec.model_copy(update=fields)


def part_from_checkpoint(spec: LlamaSpec, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> Any:
    """The `index` of our parameter `name` from the spec's `init_from` checkpoint (float32),
    reading only those bytes: a rank reads its box, never the whole tensor."""
    assert spec.init_from is not None
    key, transposed = hf_name(name)
    if key == "lm_head.weight" and spec.tie_embeddings:
        key = "model.embed_tokens.weight"
    weights = checkpoint_weights(spec.init_from)
    stored = weights.shape(key)
    if (stored[::-1] if transposed else stored) != tuple(shape):
        raise CheckpointUnreadable(f"{spec.init_from}: {key} is {list(stored)}, the model's {name} needs {list(shape)}"
                         + (" (transposed)" if transposed else ""))
    tensor = weights.part(key, index[::-1]).t() if transposed else weights.part(key, index)
    return tensor.float().contiguous()
