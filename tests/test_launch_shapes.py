"""What the decode launch decides from shapes alone, without a GPU: the split count and the
pipeline shape (kernels/_decode_shapes.py's ``choose_splits`` and ``choose_tiles``)."""
import pytest

from cupy_paged._core.types import BF16, HEAD_DIMS
from cupy_paged.kernels import _decode_shapes as decode

H200_SMS = 132


def test_small_tiles_fit_twice_the_ctas_of_the_registered_ones():
    """The small shape of every head dim: half the keys, half the warps, about half the shared
    memory (the Q tile's rows stay; so about twice the CTAs an SM where shared memory is the limit)."""
    for head_dim in HEAD_DIMS:
        tiles, small = decode.TILES[head_dim], decode.SMALL_TILES[head_dim]
        assert (small.keys, small.warps, small.stages) == (tiles.keys // 2, tiles.warps // 2, tiles.stages)
        assert small.smem_bytes(head_dim) < 0.55 * tiles.smem_bytes(head_dim)
        assert decode.kernel_key(BF16, head_dim, small) in decode.all_keys()


@pytest.mark.parametrize("ctas,splits,want_small", [
    (256, 0, False),   # one wave of the registered shape already (64 sequences x 4 kv heads)
    (264, 0, False),   # exactly one wave
    (265, 0, True),    # one CTA more: two waves of the registered shape, one of the small
    (512, 0, True),    # 64 sequences x 8 kv heads
    (528, 1, True),    # one split asked for: the same launch
    (529, 0, True),    # two waves of the small shape, three of the registered
    (1024, 0, True),   # 128 sequences x 8 kv heads: two waves against four
    (2048, 0, True),   # 256 x 8: four against eight
    (512, 3, False),   # splits asked for: their CTAs are sized for the registered shape
])
def test_choose_tiles_takes_fewer_waves_or_keeps_the_registered_shape(monkeypatch, ctas, splits, want_small):
    """With the H200's slots (2 registered CTAs an SM, 4 small ones), the small shape is taken
    exactly when it runs the grid in fewer waves: every grid of more than one registered wave."""
    slots = {decode.TILES[128]: 2 * H200_SMS, decode.SMALL_TILES[128]: 4 * H200_SMS}
    monkeypatch.setattr(decode, "_slots", lambda device, dtype, head_dim, tiles: slots[tiles])
    got = decode.choose_tiles(0, BF16, 128, ctas, splits)
    assert got == (decode.SMALL_TILES[128] if want_small else decode.TILES[128])


def test_choose_splits_keeps_a_full_wave_and_splits_a_lone_sequence():
    assert decode.choose_splits(256, 1280, 64, H200_SMS, 2) == 1
    assert decode.choose_splits(8, 32768, 64, H200_SMS, 2) > 1
    assert decode.choose_splits(1, 3 * 64, 64, H200_SMS, 2) == 1  # fewer than 4 tiles: never split
