"""A decoder's cache held where the NPU reads it (shard.runtime.executors.rknn_held): the NC1HWC2 views
the host writes a step's new rows through, and the C API's structures as rknpu2's rknn_api.h lays
them out. Running it needs librknnrt.so on a board; off the board it says so."""

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.errors import RunError, TargetError
from shard.runtime.executors.rknn_held import InOutNum, Runtime, TensorAttr, TensorMem, native_view
from shard.runtime.generate import Cache


def packed(logical: np.ndarray, c2: int, row: int) -> np.ndarray:
    """[N, C, H, W] in the NPU's NC1HWC2 (one block of C2 channels, W padded to `row`), flat."""
    n, c, h, w = logical.shape
    out = np.zeros((n, 1, h, row, c2), logical.dtype)
    out[:, 0, :, :w, :c] = logical.transpose(0, 2, 3, 1)
    return out.reshape(-1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.sampled_from([4, 8, 16]), st.sampled_from([0, 8]),
       st.integers(1, 4), st.integers(0, 20))
def test_rows_written_through_the_view_land_where_the_npu_reads_them(heads, capacity, width, pad, count, start):
    c2, row = 8, width + pad
    count, start = min(count, capacity), min(start, capacity - min(count, capacity))
    memory = [np.zeros(capacity * row * c2, np.float16) for _ in range(2)]
    views = [native_view(m, [1, 1, capacity, width, c2], [1, heads, capacity, width], row) for m in memory]
    cache = Cache([views[0]], [views[1]], length=start)
    rng = np.random.default_rng(0)
    new = {"key.0": rng.standard_normal((1, heads, count, width)).astype(np.float32),
           "value.0": rng.standard_normal((1, heads, count, width)).astype(np.float32)}
    cache.write(new, count)
    for m, name in zip(memory, ("key.0", "value.0")):
        logical = np.zeros((1, heads, capacity, width), np.float16)
        logical[:, :, start:start + count] = new[name]
        np.testing.assert_array_equal(m, packed(logical, c2, row))   # the padding channels and columns stay 0
    assert cache.length == start + count


def test_a_cache_moves_up_a_bucket_into_another_held_memory():
    def held(capacity):
        memory = np.zeros(capacity * 4 * 8, np.float16)
        return memory, native_view(memory, [1, 1, capacity, 4, 8], [1, 2, capacity, 4])

    small, large = held(8), held(16)
    cache = Cache([small[1]], [held(8)[1]], buckets=(16,), storage=lambda c: ([large[1]], [held(16)[1]]))
    cache.write({"key.0": np.ones((1, 2, 3, 4), np.float32), "value.0": np.ones((1, 2, 3, 4), np.float32)}, 3)
    cache.make_room(9)
    assert cache.keys[0] is large[1] and cache.capacity == 16
    want = np.zeros((1, 2, 16, 4), np.float16)
    want[:, :, :3] = 1
    np.testing.assert_array_equal(large[0], packed(want, 8, 4))


def test_a_view_of_more_channels_than_a_block_is_refused():
    with pytest.raises(RunError, match="one channel block"):
        native_view(np.zeros(2 * 16 * 4 * 8, np.float16), [1, 2, 16, 4, 8], [1, 12, 16, 4])
    with pytest.raises(RunError, match="one channel block"):
        native_view(np.zeros(16 * 4 * 8, np.float16), [1, 1, 16, 4, 8], [1, 2, 8, 4])


def test_the_structures_are_laid_out_as_rknn_api_h():
    # rknn_tensor_attr: 16 dims and a 256-byte name (RKNN_MAX_DIMS, RKNN_MAX_NAME_LEN), `fl` an int8_t
    # padded before `zp`, `pass_through` a uint8_t padded before `h_stride`; rknn_tensor_mem on 64 bits
    assert TensorAttr.zp.offset == 4 * 2 + 4 * 16 + 256 + 4 * 5 + 4
    assert TensorAttr.h_stride.offset == TensorAttr.pass_through.offset + 4
    assert ctypes.sizeof(TensorAttr) == 376 and ctypes.sizeof(TensorMem) == 40 and ctypes.sizeof(InOutNum) == 8


def test_off_the_board_the_held_cache_says_what_it_needs():
    try:
        ctypes.CDLL("librknnrt.so")
        pytest.skip("librknnrt.so is here: a board")
    except OSError:
        pass
    with pytest.raises(TargetError, match="librknnrt.so"):
        Runtime()

