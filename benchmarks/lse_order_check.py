"""Check of a fixed fault: flash_attn_func's LSE, fresh inputs each call, read back at once and
compared with torch's own logsumexp of the same scores (and the output with torch's attention).

Prints each call whose LSE differs (how far, how many rows, zeros, equal to the previous call's)
and the counts.  On the H200 (2026-12-03, torch tensors): 3 of 300 and 9 of 400 calls wrong
without a sanitizer, 3 of 400 with ``torch.cuda.synchronize()`` before the read, 0 of 400 with
``CUDA_LAUNCH_BLOCKING=1``; the outputs always right.  The cause: the LSE's copy ran on torch's
``ExternalStream(0)``, a pooled stream, not stream 0 (benchmarks/NOTES_calls.md).  After the fix
(``_core.arrays.torch_stream``): 0 of 400 in each of the three modes (fifteenth session).

    python benchmarks/lse_order_check.py [CALLS] [sync|nosync] [torch_func|cupy_func|torch_varlen]

``cupy_func``: the same call on CuPy views of the tensors; ``torch_varlen``: the batch through
``flash_attn_varlen_func``, its ``[H, total]`` LSE permuted here (which call paths share the fault).
"""
import sys


def main(argv) -> int:
    import torch

    import cupy_paged

    calls = int(argv[1]) if len(argv) > 1 else 200
    B, SQ, SK, H, HKV, D = 2, 70, 90, 8, 2, 64
    sync = len(argv) > 2 and argv[2] == "sync"
    mode = argv[3] if len(argv) > 3 else "torch_func"  # torch_func, cupy_func, torch_varlen
    bad_lse = bad_out = 0
    prev = None
    for i in range(calls):
        q = torch.randn(B, SQ, H, D, device="cuda", dtype=torch.float16)
        k = torch.randn(B, SK, HKV, D, device="cuda", dtype=torch.float16)
        v = torch.randn(B, SK, HKV, D, device="cuda", dtype=torch.float16)
        if mode == "torch_func":
            out, lse, _ = cupy_paged.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        elif mode == "cupy_func":
            import cupy
            cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
            torch.cuda.synchronize()
            cout, clse, _ = cupy_paged.flash_attn_func(cq, ck, cv, causal=True, return_attn_probs=True)
            out, lse = torch.from_dlpack(cout), torch.from_dlpack(clse)
            cupy.cuda.get_current_stream().synchronize()
        else:  # torch_varlen: the same batch through flash_attn_varlen_func, its LSE [H, total] permuted here
            cu_q = torch.arange(0, (B + 1) * SQ, SQ, device="cuda", dtype=torch.int32)
            cu_k = torch.arange(0, (B + 1) * SK, SK, device="cuda", dtype=torch.int32)
            o, l = cupy_paged.flash_attn_varlen_func(q.reshape(-1, H, D), k.reshape(-1, HKV, D), v.reshape(-1, HKV, D),
                                                     cu_q, cu_k, SQ, SK, causal=True, return_softmax_lse=True)
            out, lse = o.reshape(B, SQ, H, D), l.reshape(H, B, SQ).permute(1, 0, 2)
        if sync:
            torch.cuda.synchronize()
        got_lse, got_out = lse.cpu(), out.float().cpu()
        kk = k.float().repeat_interleave(H // HKV, dim=2)
        vv = v.float().repeat_interleave(H // HKV, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) * D ** -0.5
        mask = torch.ones(SQ, SK, dtype=torch.bool, device="cuda").tril(SK - SQ)
        s = s.masked_fill(~mask, float("-inf"))
        want_lse = torch.logsumexp(s, -1).cpu()
        want_out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv).cpu()
        if not torch.allclose(got_lse, want_lse, rtol=2e-3, atol=2e-3):
            bad_lse += 1
            diff = (got_lse - want_lse).abs()
            print(f"call {i}: LSE max diff {diff.max():.3g}, rows off {(diff > 2e-3).sum().item()} of {diff.numel()}, "
                  f"zeros {(got_lse == 0).sum().item()}, equal to the previous call's "
                  f"{prev is not None and (got_lse == prev).sum().item()}", flush=True)
        prev = got_lse
        bad_out += not torch.allclose(got_out, want_out, rtol=1e-2, atol=1e-2)
    print(f"{calls} calls: {bad_lse} LSE mismatches, {bad_out} output mismatches", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
