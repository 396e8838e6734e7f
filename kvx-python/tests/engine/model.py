"""A small Llama model the tests make themselves: random normal weights (float32, fixed seed)
written as safetensors, and a word-level tokenizer (token ``i`` is the word ``w{i}``), so vLLM
loads it from a local directory with no model hub. Every output token depends on the whole
prompt, so a wrong KV block changes the greedy output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LAYERS = 4
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 512
VOCAB = 4096
MAX_POSITIONS = 2048
SEED = 20261202
# Spread of the weights: large enough that the top two logits of a step are rarely near a tie
# (greedy outputs then compare exactly across batch shapes).
STD = 0.08


@dataclass(frozen=True)
class Size:
    """The model's shape; the default is the suite's model (bench/ttft.py makes larger ones)."""

    layers: int = LAYERS
    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    intermediate: int = INTERMEDIATE
    vocab: int = VOCAB
    max_positions: int = MAX_POSITIONS
    std: float = STD


DEFAULT = Size()


def config(size: Size = DEFAULT) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.hidden // size.heads,
        "vocab_size": size.vocab,
        "max_position_embeddings": size.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def weights(size: Size = DEFAULT) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    hidden, heads, kv_heads, inter = size.hidden, size.heads, size.kv_heads, size.intermediate
    head_dim = hidden // heads

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, size.std, size=shape).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.normal(0.0, 1.0, size=(size.vocab, hidden)).astype(np.float32),
        "model.norm.weight": np.ones(hidden, dtype=np.float32),
        "lm_head.weight": normal(size.vocab, hidden),
    }
    for i in range(size.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        w[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    return w


def tokenizer_json(vocab_size: int = VOCAB) -> dict:
    """A word-level tokenizer over ``w0`` ... ``w{vocab_size-1}``, split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return json.loads(tok.to_str())


def make(directory: Path, size: Size = DEFAULT) -> Path:
    """Write the model (of shape ``size``) into ``directory`` (created); return it."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(size), indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    save_file(weights(size), str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(size.vocab)))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "w0",
                "eos_token": "w1",
                "unk_token": "w2",
                "model_max_length": size.max_positions,
            }
        )
    )
    return directory
