"""The checked calls that the CPU backend and the CUDA kernels both run from."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class VarlenProblem:
    """A checked ``flash_attn_varlen_func`` call.

    ``q``/``out`` are ``[total_q, H, D]``; ``k``/``v`` are ``[total_k, Hkv, D]``, or
    paged caches ``[num_blocks, block_size, Hkv, D]`` when ``block_table`` is set.
    ``window`` folds ``causal`` in: causal means right = 0.  ``alibi_slopes`` is float32
    ``[H]`` or ``[B, H]``.  ``lse`` is ``[H, total_q]`` float32 or None; on a GPU ``out`` and
    ``lse`` may be None with ``want_lse`` saying whether the launch makes an LSE.
    """

    backend: str
    q: object
    k: object
    v: object
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int
    block_table: object
    softmax_scale: float
    window: tuple[int, int]  # causal is folded in: a right bound of 0
    softcap: float
    alibi_slopes: object
    out: object
    lse: object
    want_lse: bool = False
    max_seqlen_k: int = 0

    @property
    def batch(self) -> int:
        return int(self.cu_seqlens_q.shape[0]) - 1

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[-2])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[-1])

    @property
    def block_size(self) -> int | None:
        return None if self.block_table is None else int(self.k.shape[1])



@dataclasses.dataclass
class DecodeProblem:
    """A checked ``flash_attn_with_kvcache`` call.

    ``q``/``out`` ``[B, Sq, H, D]``; caches ``[num_blocks, block_size, Hkv, D]`` with
    ``block_table`` int32 ``[B, max_blocks]``, or ``block_table`` None and a contiguous cache
    ``[Bc, S, Hkv, D]`` (sequence b is row ``cache_batch_idx[b]``, default b); ``cache_seqlens``
    int32 ``[B]``, or a Python int for every sequence; ``k_new``/``v_new`` ``[B, Sn, Hkv, D]`` or
    None; ``lse`` ``[B, H, Sq]`` or None (on a GPU, ``want_lse`` says whether the launch makes
    one).  No index array is built for the caller: the kernels take the None and the int as
    they are.
    """

    backend: str
    q: object
    k_cache: object
    v_cache: object
    k_new: object
    v_new: object
    cache_seqlens: object
    block_table: object
    softmax_scale: float
    window: tuple[int, int]  # causal is folded in: a right bound of 0
    softcap: float
    alibi_slopes: object
    num_splits: int
    out: object
    lse: object
    rotary_cos: object = None       # [seqlen_ro, rotary_dim / 2] or None
    rotary_sin: object = None
    rotary_interleaved: bool = True  # GPT-J pairs (2i, 2i + 1); False: GPT-NeoX (i, i + rotary_dim / 2)
    rotary_per_token: bool = False   # q token i at position cache_seqlens[b] + i (causal or windowed)
    cache_batch_idx: object = None   # int32 [B]: the contiguous cache's row of each sequence
    cache_leftpad: object = None     # int32 [B]: each sequence's first valid cache position
    want_lse: bool = False

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rotary_cos is None else 2 * int(self.rotary_cos.shape[1])

    @property
    def batch(self) -> int:
        return int(self.q.shape[0])

    @property
    def seqlen_q(self) -> int:
        return int(self.q.shape[1])

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k_new is None else int(self.k_new.shape[1])

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[2])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_cache.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[3])

    @property
    def block_size(self) -> int:
        return int(self.k_cache.shape[1])

