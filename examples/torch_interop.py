"""A PyTorch attention layer over a paged KV cache, through cupy_paged.

``PagedAttention`` is an ``nn.Module`` with GQA projections whose K/V live in a paged cache held as
torch buffers (``[num_blocks, block_size, num_kv_heads, head_dim]``).  torch tensors go straight in
and come back as torch tensors, on torch's current stream on the GPU:

* a prefill step (several sequences packed along the token axis): ``write_kv_cache`` scatters the
  new K/V into their slots, ``flash_attn_varlen_func(..., block_table=...)`` attends over the cache;
* a decode step (one token per sequence): ``flash_attn_with_kvcache`` appends the new K/V in place
  and attends in one call.

The last step's outputs are checked against torch's own dense ``scaled_dot_product_attention`` over
each whole sequence.  On a CUDA GPU (bf16) the CUDA kernels run, else the CPU reference (float32):

    python examples/torch_interop.py
"""
from __future__ import annotations

import numpy as np
import torch

import cupy_paged


class PagedAttention(torch.nn.Module):
    """Causal GQA self-attention whose keys and values are kept in a paged cache."""

    def __init__(self, hidden, num_heads, num_kv_heads, head_dim, num_blocks, block_size, **factory):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.block_size = head_dim, block_size
        self.q_proj = torch.nn.Linear(hidden, num_heads * head_dim, bias=False, **factory)
        self.k_proj = torch.nn.Linear(hidden, num_kv_heads * head_dim, bias=False, **factory)
        self.v_proj = torch.nn.Linear(hidden, num_kv_heads * head_dim, bias=False, **factory)
        self.o_proj = torch.nn.Linear(num_heads * head_dim, hidden, bias=False, **factory)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, **factory), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, **factory), persistent=False)

    def _qkv(self, x):
        n = x.shape[0]
        return (self.q_proj(x).view(n, self.num_heads, self.head_dim),
                self.k_proj(x).view(n, self.num_kv_heads, self.head_dim),
                self.v_proj(x).view(n, self.num_kv_heads, self.head_dim))

    def prefill(self, x, block_table, lengths_before, lengths_new):
        """``x``: ``[total_new_tokens, hidden]``, each sequence's new tokens in turn after its
        ``lengths_before`` cached ones.  Returns ``[total_new_tokens, hidden]``."""
        q, k, v = self._qkv(x)
        # the index helpers take NumPy arrays (host work, once per step)
        seq_ids = np.repeat(np.arange(len(lengths_new)), lengths_new.numpy())
        positions = np.concatenate([np.arange(b, b + n) for b, n in zip(lengths_before.tolist(), lengths_new.tolist())])
        device = x.device
        slots = cupy_paged.slot_mapping_from_positions(block_table.cpu().numpy(), seq_ids, positions, self.block_size)
        cupy_paged.write_kv_cache(self.k_cache, self.v_cache, k, v, torch.as_tensor(slots, device=device))
        cu_q, max_q = cupy_paged.cu_seqlens_from_lengths(lengths_new.tolist())
        cu_k, max_k = cupy_paged.cu_seqlens_from_lengths((lengths_before + lengths_new).tolist())
        out = cupy_paged.flash_attn_varlen_func(q, self.k_cache, self.v_cache, torch.as_tensor(cu_q, device=device),
                                                torch.as_tensor(cu_k, device=device), max_q, max_k, causal=True,
                                                block_table=block_table)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def decode(self, x, block_table, lengths_before):
        """``x``: ``[batch, hidden]``, one new token per sequence.  Returns ``[batch, hidden]``."""
        q, k, v = self._qkv(x)
        out = cupy_paged.flash_attn_with_kvcache(q[:, None], self.k_cache, self.v_cache, k=k[:, None], v=v[:, None],
                                                 cache_seqlens=lengths_before, block_table=block_table, causal=True)
        return self.o_proj(out.reshape(x.shape[0], -1))


def dense_reference(layer, xs):
    """torch's dense causal attention over each whole sequence: its last row per sequence."""
    rows = []
    for x in xs:
        n, group = x.shape[0], layer.num_heads // layer.num_kv_heads
        q, k, v = (t.transpose(0, 1).float() for t in layer._qkv(x))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), is_causal=True)
        rows.append(layer.o_proj(out.transpose(0, 1).reshape(n, -1).to(x.dtype))[-1])
    return torch.stack(rows)


def main():
    cuda = torch.cuda.is_available()
    factory = dict(device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    torch.manual_seed(0)
    layer = PagedAttention(hidden=256, num_heads=8, num_kv_heads=2, head_dim=64, num_blocks=32, block_size=16,
                           **factory)
    # three sequences, their blocks scattered over the pool (-1: unallocated)
    block_table = torch.tensor(cupy_paged.block_table_from_lists([[5, 0, 9], [3], [7, 1, 2, 8]], max_blocks=4),
                               device=factory["device"])
    prompt_lengths = torch.tensor([37, 10, 50])
    xs = [torch.randn(int(n) + 4, 256, **factory) for n in prompt_lengths]  # prompts and 4 decode steps
    with torch.no_grad():
        layer.prefill(torch.cat([x[:n] for x, n in zip(xs, prompt_lengths.tolist())]), block_table,
                      torch.zeros(3, dtype=torch.int64), prompt_lengths)
        for step in range(4):
            before = prompt_lengths + step
            x = torch.stack([seq[n] for seq, n in zip(xs, before.tolist())])
            out = layer.decode(x, block_table, before.to(device=factory["device"], dtype=torch.int32))
        ref = dense_reference(layer, xs)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"{'CUDA ' + str(factory['dtype']) if cuda else 'CPU reference, float32'}: paged decode after a paged "
          f"prefill vs torch dense SDPA, max |diff| {err:.2e}; out is a {type(out).__name__} on {out.device}")
    assert err < (5e-2 if cuda else 1e-4), err


if __name__ == "__main__":
    main()
