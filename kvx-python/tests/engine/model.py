"""A small Llama model the tests make themselves: random normal weights (float32, fixed seed)
written as safetensors, and a word-level tokenizer (token ``i`` is the word ``w{i}``), so vLLM
loads it from a local directory with no model hub. Every output token depends on the whole
prompt, so a wrong KV block changes the greedy output."""

from __future__ import annotations

import json
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


def config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    head_dim = HIDDEN // HEADS

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, STD, size=shape).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.normal(0.0, 1.0, size=(VOCAB, HIDDEN)).astype(np.float32),
        "model.norm.weight": np.ones(HIDDEN, dtype=np.float32),
        "lm_head.weight": normal(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        w[p + "self_attn.q_proj.weight"] = normal(HEADS * head_dim, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    return w


def tokenizer_json() -> dict:
    """A word-level tokenizer over ``w0`` ... ``w{VOCAB-1}``, split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return json.loads(tok.to_str())


def make(directory: Path) -> Path:
    """Write the model into ``directory`` (created); return it."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config(), indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    save_file(weights(), str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "w0",
                "eos_token": "w1",
                "unk_token": "w2",
                "model_max_length": MAX_POSITIONS,
            }
        )
    )
    return directory
