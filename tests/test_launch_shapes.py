"""What the decode launch decides from shapes alone, without a GPU: the split count and the
pipeline shape (kernels/_decode_shapes.py's ``choose_splits`` and ``choose_tiles``)."""
import pytest

from cupy_paged._core.types import BF16
from cupy_paged.kernels import _decode_shapes as decode

H200_SMS = 132


def test_small_tiles_halve_the_keys_warps_and_shared_memory():
    """The small shape: half the keys, half the warps, about half the shared memory of the main
    shape (the Q tile's rows stay), registered for plain launches only."""
    for head_dim, small in decode.SMALL_TILES.items():
        tiles = decode.TILES[head_dim]
        assert (small.keys, small.warps, small.stages) == (tiles.keys // 2, tiles.warps // 2, tiles.stages)
        assert small.smem_bytes(head_dim) < 0.55 * tiles.smem_bytes(head_dim)
        keys = decode.all_keys()
        assert decode.kernel_key(BF16, head_dim, small) in keys
        assert decode.kernel_key(BF16, head_dim, small, rotary=True) not in keys


@pytest.mark.parametrize("ctas,splits,want_small", [
    (256, 0, False),   # one wave of the registered shape already (64 sequences x 4 kv heads)
    (264, 0, False),   # exactly one wave
    (265, 0, True),    # one CTA more: two waves of the registered shape, one of the small
    (512, 0, True),    # 64 sequences x 8 kv heads
    (528, 1, True),    # one split asked for: the same launch
    (300, 0, True),    # under 0.8 of a small wave: still the small shape (and no split, test_shape_...)
    (529, 0, True),    # two waves of the small shape, three of the registered
    (1024, 0, True),   # 128 sequences x 8 kv heads: two waves against four
    (2048, 0, True),   # 256 x 8: four against eight
    (512, 3, False),   # splits asked for: their CTAs are sized for the registered shape
])
def test_choose_tiles_takes_fewer_waves_or_keeps_the_registered_shape(monkeypatch, ctas, splits, want_small):
    """With the H200's slots (2 registered CTAs an SM, 4 small ones), the small shape is taken
    exactly when it runs the grid in fewer waves: every grid of more than one registered wave."""
    slots = {decode.TILES[128]: 2 * H200_SMS, decode.SMALL_TILES[128]: 4 * H200_SMS}
    monkeypatch.setattr(decode, "slots", lambda device, dtype, head_dim, tiles: slots[tiles])
    got = decode.choose_tiles(0, BF16, 128, ctas, splits)
    assert got == (decode.SMALL_TILES[128] if want_small else decode.TILES[128])


def test_choose_splits_keeps_a_full_wave_and_splits_a_lone_sequence():
    assert decode.choose_splits(256, 1280, 64, H200_SMS * 2) == 1
    assert decode.choose_splits(8, 32768, 64, H200_SMS * 2) > 1
    assert decode.choose_splits(1, 3 * 64, 64, H200_SMS * 2) == 1  # fewer than 4 tiles: never split


@pytest.fixture
def fake_h200(monkeypatch):
    """Kernel look-ups without a GPU: 188 registers for every shape, 132 SMs; the shape memo
    cleared before and after (it would keep the fakes)."""
    from types import SimpleNamespace

    from cupy_paged.kernels import decode as launch

    fake = (lambda key, name, smem=0: SimpleNamespace(num_regs=188, key=key, name=name))
    for module in (decode, launch):
        monkeypatch.setattr(module, "get_function", fake)
    monkeypatch.setattr(decode, "_num_sms", lambda device: H200_SMS)
    launch._shape.cache_clear()
    yield launch
    launch._shape.cache_clear()


@pytest.mark.parametrize("batch,max_keys,num_splits,rotary,want_small,want_splits", [
    (33, 32768, 0, False, False, 1),   # 264 CTAs: one main-shape wave, not split
    (40, 32768, 0, False, True, 1),    # 320 CTAs: the small shape, and not split on it either
    (66, 32768, 0, False, True, 1),    # 528 CTAs: one small wave
    (40, 32768, 3, False, False, 3),   # a split asked for: the main shape
    (40, 32768, 0, True, False, 1),    # rotary: the main shape only
    (8, 32768, 0, False, False, None),  # few CTAs: the main shape, split to fill the machine
])
def test_shape_takes_the_small_shape_unsplit(fake_h200, batch, max_keys, num_splits, rotary, want_small, want_splits):
    shape = fake_h200._shape(0, BF16, (batch, 1, 32, 128), 8, max_keys, num_splits, None, rotary, False)
    assert shape.tiles == (decode.SMALL_TILES[128] if want_small else decode.TILES[128])
    assert shape.threads == shape.tiles.threads
    if want_splits is None:
        assert shape.splits > 1 and shape.combine is not None
    else:
        assert shape.splits == want_splits and (shape.combine is None) == (want_splits == 1)
