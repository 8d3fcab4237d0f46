"""The Llama forward pass of one scheduled step, on NumPy (CPU reference backend) or CuPy arrays.

A step's tokens come packed along one axis (``plan.input_ids [T]``, several sequences, each a
prefill chunk or one decode token).  Everything but attention is per token, so the layers are
plain matrix products over ``[T, hidden]``; attention goes through ``plan.attention``, which
writes each layer's new K/V into the paged cache and attends every token to its own sequence.

Numerics: weights and matrix products in the weights' dtype (bfloat16 on the GPU: cuBLAS with
float32 accumulation, called through :mod:`llama.cublas` so that CUDA graphs can capture it); the residual stream, RMSNorm, rotary and SwiGLU's activation in float32
(float64 for a float64 model), cast back to the weights' dtype at each matrix product.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import fused
from .config import LlamaConfig
from .timing import NoTimer


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """``[head_dim / 2]`` float64 rotary frequencies, with Llama 3 or linear ``rope_scaling``.

    Examples
    --------
    >>> from llama.config import CPU_DEFAULT
    >>> inverse_frequencies(CPU_DEFAULT)[:2].round(4).tolist()
    [1.0, 0.5623]
    """
    dim = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not implemented (default, linear, llama3 are)")
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv
    # Long wavelengths (beyond context / low) are slowed by `factor`, short ones (below
    # context / high) kept; in between the two are blended by where the wavelength falls.
    blend = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    return (1.0 - blend) * inv / factor + blend * inv


def rotary_tables(config: LlamaConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[max_positions, head_dim / 2]`` float64 of each position's angles."""
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inverse_frequencies(config))
    return np.cos(angles), np.sin(angles)


@dataclasses.dataclass
class _Layer:
    """One layer's weights; the matrices ``[in, out]`` as written, ``[out, in]`` with the model's
    ``weight_layout="out_in"``."""

    input_norm: object   # [hidden] accumulation dtype
    qkv: object          # [hidden, q_size + 2 * kv_size]: q, k and v projections side by side
    out: object          # [q_size, hidden]
    post_norm: object    # [hidden]
    gate_up: object      # [hidden, 2 * intermediate]: gate then up
    down: object         # [intermediate, hidden]


class LlamaModel:
    """A Llama decoder on one device, fed one :class:`cupy_paged.StepPlan` per step.

    Parameters
    ----------
    config : LlamaConfig
    weights : dict
        Hugging Face names -> NumPy arrays (``llama.weights``); copied to ``xp`` in ``dtype``.
    xp : module
        ``numpy`` (CPU reference backend) or ``cupy``.
    dtype : dtype
        Weights and attention dtype: bfloat16 / float16 with CuPy; float32 / float64 with NumPy.
    max_positions : int, optional
        Rotary table length (default ``config.max_position_embeddings``).
    weight_layout : {"in_out", "out_in"}
        How the products' weights are held: ``[in, out]`` (``x @ w``), or ``[out, in]`` as the
        checkpoint stores them, read transposed (``x @ w.T``: torch's ``F.linear`` layout, which
        cuBLAS runs with other kernels; ``benchmarks/bench_gemm.py`` times both).

    Examples
    --------
    >>> from llama.config import CPU_DEFAULT
    >>> from llama.weights import random_weights
    >>> model = LlamaModel(CPU_DEFAULT, random_weights(CPU_DEFAULT), np, np.float32)
    >>> model.layers[0].qkv.shape
    (128, 256)
    """

    def __init__(self, config: LlamaConfig, weights: dict, xp=np, dtype=np.float32, max_positions=None,
                 weight_layout: str = "in_out"):
        self.config, self.xp, self.dtype = config, xp, np.dtype(dtype)
        self.acc = np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)
        if weight_layout not in ("in_out", "out_in"):
            raise ValueError(f"weight_layout must be 'in_out' or 'out_in'; got {weight_layout!r}")
        self.weight_layout = weight_layout
        rows_out = weight_layout == "out_in"
        self.gemm = None  # the GPU's llama.cublas.Gemm (tune_products chooses its kernels)
        if xp is np:
            self.matmul = (lambda a, w: np.matmul(a, w.T)) if rows_out else np.matmul
        else:
            from .cublas import Gemm

            self.gemm = Gemm()
            self.matmul = functools.partial(self.gemm, b_rows_out=True) if rows_out else self.gemm
        self.tuned_products: dict = {}  # (rows, product) -> llama.cublas.Gemm.tune's report

        def matrix(*names):  # HF [out, in] matrices -> one [in, sum(out)] (or [sum(out), in]) device matrix
            joined = np.concatenate([weights[n] for n in names], axis=0)
            return xp.asarray(np.ascontiguousarray((joined if rows_out else joined.T).astype(self.dtype)))

        def vector(name):
            return xp.asarray(weights[name].astype(self.acc))

        self.embed = xp.asarray(np.ascontiguousarray(weights["model.embed_tokens.weight"].astype(self.dtype)))
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(_Layer(
                vector(p + "input_layernorm.weight"),
                matrix(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                matrix(p + "self_attn.o_proj.weight"), vector(p + "post_attention_layernorm.weight"),
                matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), matrix(p + "mlp.down_proj.weight")))
        self.norm = vector("model.norm.weight")
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = matrix(head)  # [hidden, vocab] ([vocab, hidden] out_in)
        cos, sin = rotary_tables(config, max_positions or config.max_position_embeddings)
        self.cos, self.sin = xp.asarray(cos.astype(self.acc)), xp.asarray(sin.astype(self.acc))
        # Tensor parallelism (llama.parallel): the sum over ranks of the attention output and MLP
        # projections' partial results; alone, nothing to add.
        self.all_reduce = None
        # bfloat16 / float16 on the GPU: the steps between the products as one kernel each.
        self.fused = None
        # The fused path's decode steps rotate q and the new k inside the decode kernel
        # (``flash_attn_with_kvcache``'s rotary_cos/rotary_sin, which are of q's dtype), the other
        # steps in ``rotary_split``: both read the tables rounded to the weights' dtype, so a token
        # gets the same rotation whichever step computes it (Hugging Face's Llama also casts its
        # cos/sin to the activations' dtype).
        self.rotary_tables_q = None
        if fused.supported(xp, self.dtype):
            self.fused = fused.FusedOps(self.dtype, config.rms_norm_eps)
            cos_q, sin_q = self.cos.astype(self.dtype), self.sin.astype(self.dtype)
            self.cos, self.sin = cos_q.astype(self.acc), sin_q.astype(self.acc)
            self.rotary_tables_q = (cos_q, sin_q)
        # Decode steps on the fused path: rotary inside the attention launch (False: rotary_split).
        self.rotary_in_attention = self.fused is not None

    def tune_products(self, rows: int) -> dict:
        """Time the candidate cuBLAS kernels of each of a step's products at ``rows`` tokens
        (qkv, out, gate_up, down, the LM head) and use the fastest for that shape from now on
        (``llama.cublas.Gemm.tune``; the CUDA graphs of decode steps tune their batch sizes before
        capturing).  Outside any capture.  Returns ``{product: report}``; nothing on the CPU."""
        if self.gemm is None:
            return {}
        rows_out, layer = self.weight_layout == "out_in", self.layers[0]
        reports = {}
        for name, weight, out_dtype in (("qkv", layer.qkv, None), ("out", layer.out, None),
                                        ("gate_up", layer.gate_up, None), ("down", layer.down, None),
                                        ("lm_head", self.lm_head, np.float32 if self.fused is not None else None)):
            n, k = weight.shape if rows_out else weight.shape[::-1]
            reports[name] = self.gemm.tune(rows, n, k, self.dtype, out_dtype, rows_out)
            if "gemmex_us" in reports[name] or (rows, name) not in self.tuned_products:  # keep the timings
                self.tuned_products[(rows, name)] = reports[name]
        return reports

    @property
    def max_positions(self) -> int:
        """Longest sequence the rotary tables cover."""
        return int(self.cos.shape[0])

    def rms_norm(self, x, weight):
        """``x [T, hidden]`` (accumulation dtype) normalised by its root mean square, times ``weight``."""
        xp = self.xp
        scale = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + self.config.rms_norm_eps)
        return x * scale * weight

    def rotate(self, x, cos, sin):
        """Rotary embedding of ``x [T, heads, head_dim]`` in the GPT-NeoX layout HF Llama uses: dim
        ``i`` pairs with ``i + head_dim / 2``.  ``cos``/``sin`` ``[T, 1, head_dim / 2]``.
        Returns ``[T, heads, head_dim]`` C-contiguous in the weights' dtype."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].astype(self.acc), x[..., half:].astype(self.acc)
        rotated = self.xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(self.dtype)

    def _attention_block(self, index, layer, x, cos, sin, plan, cache, timer):
        """Residual plus the attention of one layer, ``x [T, hidden]`` in the accumulation dtype."""
        c, xp = self.config, self.xp
        tokens = x.shape[0]
        h = self.rms_norm(x, layer.input_norm).astype(self.dtype)
        qkv = self.matmul(h, layer.qkv)
        q = self.rotate(qkv[:, :c.q_size].reshape(tokens, c.num_attention_heads, c.head_dim), cos, sin)
        k = self.rotate(qkv[:, c.q_size:c.q_size + c.kv_size].reshape(tokens, c.num_key_value_heads, c.head_dim),
                        cos, sin)
        # The kernels take rows of 16-byte aligned, contiguous heads: v gets its own array, in the
        # model's dtype as q and k (NumPy's matmul of bfloat16 returns float32).
        v = xp.ascontiguousarray(qkv[:, c.q_size + c.kv_size:], dtype=self.dtype).reshape(
            tokens, c.num_key_value_heads, c.head_dim)
        with timer.span("attention"):
            attended = plan.attention(q, k, v, *cache.layer(index))
        return x + self._reduced(self.matmul(attended.reshape(tokens, c.q_size), layer.out).astype(self.acc))

    def _mlp_block(self, layer, x):
        """Residual plus SwiGLU: ``down(silu(gate(h)) * up(h))``."""
        size = self.config.intermediate_size
        gate_up = self.matmul(self.rms_norm(x, layer.post_norm).astype(self.dtype), layer.gate_up)
        gate, up = gate_up[:, :size].astype(self.acc), gate_up[:, size:].astype(self.acc)
        hidden = (gate / (1.0 + self.xp.exp(-gate)) * up).astype(self.dtype)
        return x + self._reduced(self.matmul(hidden, layer.down).astype(self.acc))

    def _reduced(self, partial):
        return partial if self.all_reduce is None else self.all_reduce(partial)

    def forward(self, plan, cache, timer=None, all_rows: bool = False):
        """Run every layer over the step's tokens; the logits of the rows that sample.

        Parameters
        ----------
        plan : cupy_paged.StepPlan
            ``input_ids`` and ``positions`` ``[T]``; its ``attention`` writes the cache.
        cache : cupy_paged.PagedAttentionCache
            ``layer(i)`` gives layer ``i``'s K/V caches.
        timer : llama.timing.Timer, optional
            Attention time goes into its ``"attention"`` bucket.
        all_rows : bool
            Logits of every token instead of ``plan.logits_indices`` (a captured decode step,
            whose sampled rows are all its rows, padding included).

        Returns
        -------
        array
            ``[len(plan.logits_indices), vocab]`` (or ``[T, vocab]``) logits in the accumulation
            dtype (float32; float64 for a float64 model).
        """
        xp, timer = self.xp, timer or NoTimer()
        if self.fused is not None and self.all_reduce is None:
            return self._forward_fused(plan, cache, timer, all_rows)
        positions = xp.asarray(plan.positions)
        rows = None if all_rows else xp.asarray(plan.logits_indices)
        x = self.embed[xp.asarray(plan.input_ids)].astype(self.acc)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        for index, layer in enumerate(self.layers):
            x = self._attention_block(index, layer, x, cos, sin, plan, cache, timer)
            x = self._mlp_block(layer, x)
        if rows is not None:
            if rows.shape[0] == 0:  # a step of prompt chunks that sample nothing: no LM head
                return xp.empty((0, self.config.vocab_size), self.acc)
            x = x[rows]
        logits = self.matmul(self.rms_norm(x, self.norm).astype(self.dtype), self.lm_head)
        return logits.astype(self.acc)

    def _decode_attention(self, qkv, plan, k_cache, v_cache):
        """A decode step's attention of one layer from the ``qkv [T, (heads + 2 kv_heads) D]``
        product: one ``flash_attn_with_kvcache`` launch that rotates q and the new k at each
        sequence's position (``plan.cache_seqlens``, the tokens before it), appends k and v
        through ``plan.block_table`` and attends; q, k and v are views of ``qkv`` (no split
        kernel, no copy).  Returns ``[T, heads, D]``."""
        import cupy_paged

        c, tokens = self.config, qkv.shape[0]
        q = qkv[:, :c.q_size].reshape(tokens, 1, c.num_attention_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(tokens, 1, c.num_key_value_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].reshape(tokens, 1, c.num_key_value_heads, c.head_dim)
        cos, sin = self.rotary_tables_q
        out = cupy_paged.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, plan.cache_seqlens,
                                                 block_table=plan.block_table, causal=True,
                                                 rotary_interleaved=False)
        return out.reshape(tokens, c.num_attention_heads, c.head_dim)

    def _forward_fused(self, plan, cache, timer, all_rows: bool):
        """:meth:`forward` through the fused kernels: per layer the four products, the attention
        launch, one rotary-and-split kernel (none on a decode step with ``rotary_in_attention``:
        the decode kernel rotates), SwiGLU, and two residual-add-and-RMSNorm kernels (the
        second normalises for the next layer, or for the LM head after the last)."""
        c, xp, f = self.config, self.xp, self.fused
        ids = xp.asarray(plan.input_ids, dtype=np.int32)
        positions = xp.asarray(plan.positions, dtype=np.int32)
        x, h = f.add_rms_norm(f.embed(self.embed, ids), None, self.layers[0].input_norm)
        tokens = x.shape[0]
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        rotary_decode = self.rotary_in_attention and plan.path == "decode"
        for index, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            qkv = self.matmul(h, layer.qkv)
            if rotary_decode:
                with timer.span("attention"):
                    attended = self._decode_attention(qkv, plan, *cache.layer(index))
            else:
                q, k, v = f.rotary_split(qkv, positions, self.cos, self.sin, c.num_attention_heads,
                                         c.num_key_value_heads, c.head_dim)
                with timer.span("attention"):
                    attended = plan.attention(q, k, v, *cache.layer(index))
            x, h = f.add_rms_norm(x, self.matmul(attended.reshape(tokens, c.q_size), layer.out), layer.post_norm,
                                  out=x)
            hidden = f.swiglu(self.matmul(h, layer.gate_up))
            x, h = f.add_rms_norm(x, self.matmul(hidden, layer.down), next_norm, out=x)
        if not all_rows:
            rows = xp.asarray(plan.logits_indices)
            if rows.shape[0] == 0:
                return xp.empty((0, c.vocab_size), self.acc)
            h = h[rows]
        return self.matmul(h, self.lm_head, out_dtype=np.float32)
