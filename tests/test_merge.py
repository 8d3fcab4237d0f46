"""merge_attention_states: two attentions over disjoint key sets merge into attention over both."""
from __future__ import annotations

import numpy as np
import pytest

from _util import BF16, assert_close, randn, to_numpy
from cupy_paged.api.merge import merge_attention_states
from naive import naive_attention

GPU = pytest.mark.gpu


def _halves(rng, tokens=5, heads=4, kv_heads=2, dim=64, keys=37, cut=12):
    """Varlen-layout attention over keys [:cut], [cut:] and all of them (float64 naive)."""
    q = randn(rng, (tokens, heads, dim), np.float32)
    k = randn(rng, (keys, kv_heads, dim), np.float32)
    v = randn(rng, (keys, kv_heads, dim), np.float32)
    scale = dim ** -0.5
    a = naive_attention(q, k[:cut], v[:cut], scale)
    b = naive_attention(q, k[cut:], v[cut:], scale)
    full = naive_attention(q, k, v, scale)
    return a, b, full


def _as(xp, array, dtype):
    return xp.asarray(np.asarray(array, np.float32).astype(dtype))


@pytest.mark.parametrize("side", ["cpu", pytest.param("gpu", marks=GPU)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
def test_merge_equals_attention_over_both(side, dtype):
    xp = np if side == "cpu" else pytest.importorskip("cupy")
    (oa, la), (ob, lb), (full, full_lse) = _halves(np.random.default_rng(1))
    out, lse = merge_attention_states(_as(xp, oa, dtype), _as(xp, la, np.float32),
                                      _as(xp, ob, dtype), _as(xp, lb, np.float32))
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    assert_close(out, full, dtype if dtype != np.float32 else np.float16)
    assert_close(lse, full_lse, np.float32, what="lse", rtol=1e-5)


@pytest.mark.parametrize("side", ["cpu", pytest.param("gpu", marks=GPU)])
def test_merge_decode_layout_and_empty_sides(side):
    """[B, Sq, H, D] with lse [B, H, Sq]; a side with lse -inf is ignored even if its output is NaN."""
    xp = np if side == "cpu" else pytest.importorskip("cupy")
    rng = np.random.default_rng(2)
    batch, seqlen, heads, dim = 3, 2, 4, 128
    oa = randn(rng, (batch, seqlen, heads, dim), np.float16)
    ob = randn(rng, (batch, seqlen, heads, dim), np.float16)
    la = rng.standard_normal((batch, heads, seqlen)).astype(np.float32)
    lb = rng.standard_normal((batch, heads, seqlen)).astype(np.float32)
    la[0, 1, 0] = -np.inf
    oa[0, 0, 1] = np.nan  # the matching row of out_a: never read
    la[2, 3, 1] = lb[2, 3, 1] = -np.inf  # neither side saw a key
    out, lse = merge_attention_states(xp.asarray(oa), xp.asarray(la), xp.asarray(ob), xp.asarray(lb))
    out, lse = to_numpy(out).astype(np.float64), to_numpy(lse)
    # Expected, row by row, from the definition.
    for b in range(batch):
        for i in range(seqlen):
            for h in range(heads):
                x, y = float(la[b, h, i]), float(lb[b, h, i])
                if x == y == -np.inf:
                    assert (out[b, i, h] == 0).all() and lse[b, h, i] == -np.inf
                    continue
                top = max(x, y)
                wa, wb = np.exp(x - top), np.exp(y - top)
                parts = [w * p[b, i, h].astype(np.float64) for w, p in ((wa, oa), (wb, ob)) if w > 0]
                np.testing.assert_allclose(out[b, i, h], sum(parts) / (wa + wb), rtol=0, atol=2e-3)
                np.testing.assert_allclose(lse[b, h, i], top + np.log(wa + wb), rtol=1e-5)


def test_merge_into_out_and_bad_input():
    rng = np.random.default_rng(3)
    oa = randn(rng, (4, 2, 32), np.float32)
    la = np.zeros((2, 4), np.float32)
    out, lse = merge_attention_states(oa, la, oa.copy(), la, out=oa)
    assert out is oa
    np.testing.assert_allclose(lse, np.log(2.0), rtol=1e-6)
    with pytest.raises(ValueError, match="lse_a"):
        merge_attention_states(oa, la.T.copy(), oa, la)
    with pytest.raises(ValueError, match="out_b"):
        merge_attention_states(oa, la, oa[:2], la)
    with pytest.raises(TypeError, match="lse_b"):
        merge_attention_states(oa, la, oa, la.astype(np.float64))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_of_torch_cpu_tensors_returns_torch_tensors(dtype):
    """Torch CPU tensors in, torch CPU tensors out (the caller's ``out`` itself where given), the
    same values as from NumPy."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    oa, ob = randn(rng, (5, 2, 32), np.float32), randn(rng, (5, 2, 32), np.float32)
    la, lb = randn(rng, (2, 5), np.float32), randn(rng, (2, 5), np.float32)
    want, want_lse = merge_attention_states(oa, la, ob, lb)
    ta, tb = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (oa, ob))
    got, got_lse = merge_attention_states(ta, torch.from_numpy(la), tb, torch.from_numpy(lb))
    assert isinstance(got, torch.Tensor) and isinstance(got_lse, torch.Tensor)
    assert got.dtype == ta.dtype and got_lse.dtype == torch.float32
    tol = 2e-2 if dtype == "bfloat16" else 1e-6
    np.testing.assert_allclose(got.float().numpy(), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_lse.numpy(), want_lse, rtol=1e-6)
    out = torch.full_like(ta, float("nan"))
    result, _ = merge_attention_states(ta, torch.from_numpy(la), tb, torch.from_numpy(lb), out=out)
    assert result is out and torch.equal(out, got)


_SPECIAL_LSE = [(np.nan, 0.0), (0.0, np.nan), (np.nan, np.nan), (np.inf, 0.0), (0.0, np.inf), (np.inf, -np.inf),
                (np.inf, np.inf), (np.inf, np.nan), (-np.inf, -np.inf)]
# (out, lse) of each case with out_a = 2, out_b = 5: a NaN or +inf LSE on either side makes the row NaN
# (merge.cu's weight exp(inf - inf) is NaN), never a row that looks empty (zeros, -inf).
_SPECIAL_WANT = [(np.nan, np.nan)] * 8 + [(0.0, -np.inf)]


@pytest.mark.parametrize("side", ["cpu", pytest.param("gpu", marks=GPU)])
def test_nan_and_infinite_lse_are_not_read_as_empty_rows(side):
    """A NaN LSE (a broken partial result) made the CPU's merged row zeros with LSE -inf, which reads
    as a row with no key: the other side's valid result lost without a sign.  Both backends give NaN
    for a NaN or +inf LSE."""
    n = len(_SPECIAL_LSE)
    lse_a = np.array([[a for a, _ in _SPECIAL_LSE]], np.float32)
    lse_b = np.array([[b for _, b in _SPECIAL_LSE]], np.float32)
    a, b = np.full((n, 1, 8), 2.0, np.float32), np.full((n, 1, 8), 5.0, np.float32)
    if side == "gpu":
        import cupy

        a, b, lse_a, lse_b = (cupy.asarray(x) for x in (a, b, lse_a, lse_b))
    out, lse = merge_attention_states(a, lse_a, b, lse_b)
    out, lse = to_numpy(out), to_numpy(lse)
    want_out = np.array([o for o, _ in _SPECIAL_WANT], np.float32)
    want_lse = np.array([[lv for _, lv in _SPECIAL_WANT]], np.float32)
    np.testing.assert_array_equal(out[:, 0, :], np.repeat(want_out[:, None], 8, axis=1))
    np.testing.assert_array_equal(lse, want_lse)
