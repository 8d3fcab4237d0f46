"""An independent dense Llama forward for tests/test_llama_engine.py: one sequence, causal
attention over all its tokens at once, straight from Hugging Face's weight names, in float64
NumPy (no cupy_paged, none of examples/llama's code).  Plain rotary only: no rope_scaling."""
from __future__ import annotations

import numpy as np


def dense_logits(config, w: dict, tokens) -> np.ndarray:
    """``[len(tokens), vocab]`` float64 logits of one sequence: causal attention over all its
    tokens at once, straight from the Hugging Face names, in plain NumPy."""
    assert not config.rope_scaling, "the dense forward has plain rotary embeddings only"
    w = {name: np.asarray(a, np.float64) for name, a in w.items()}
    n, d = len(tokens), config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def rms(x, weight):
        return weight * x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + config.rms_norm_eps)

    # rotate_half form: x * cos + rotate_half(x) * sin, frequencies repeated over both halves.
    freq = config.rope_theta ** (-np.arange(0, d, 2) / d)
    angle = np.arange(n)[:, None] * np.concatenate([freq, freq])[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

    def rope(x):
        return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1) * sin

    causal = np.tril(np.ones((n, n), bool))
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv_heads, d))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv_heads, d)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores = np.where(causal[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T
