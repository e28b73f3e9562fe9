"""The KV layout both ends share: segments, offsets into the real cache tensor,
compatibility messages, and the descriptors NIXL is given."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.workers.kv_transfer.blocks import Run, check_blocks, runs
from pdserve.workers.kv_transfer.layout import (
    BLOCK_MAJOR,
    LAYER_MAJOR,
    KVLayout,
    LayoutMismatchError,
    Segment,
    segments,
)


def cache(
    layers: int = 3, blocks: int = 10, block_size: int = 4, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return torch.zeros((layers, blocks, 2, block_size, 2, 8), dtype=dtype)


def block_major(layers: int = 3, blocks: int = 10) -> torch.Tensor:
    """Indexed like `cache()`, stored blocks outermost (as the engine's)."""
    return torch.zeros((blocks, layers, 2, 4, 2, 8)).transpose(0, 1)


def layout_of(tensor: torch.Tensor, model: str = "m") -> KVLayout:
    return KVLayout.of(tensor, model=model, weights="w")


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ([3, 4, 5, 9], [10, 11, 12, 13], [Segment(3, 10, 3), Segment(9, 13, 1)]),
        ([0, 1, 2], [5, 6, 7], [Segment(0, 5, 3)]),
        # Consecutive on one side only: no merge.
        ([0, 1, 2], [5, 9, 6], [Segment(0, 5, 1), Segment(1, 9, 1), Segment(2, 6, 1)]),
        ([7, 8, 0, 1], [1, 2, 3, 4], [Segment(7, 1, 2), Segment(0, 3, 2)]),
        ([], [], []),
    ],
)
def test_segments_merge_runs_consecutive_on_both_sides(
    src: list[int], dst: list[int], expected: list[Segment]
) -> None:
    assert segments(src, dst) == expected


def test_segments_refuse_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="3 to send, 2 to receive"):
        segments([1, 2, 3], [1, 2])


@pytest.mark.parametrize(
    "kv", [cache(), cache(dtype=torch.bfloat16), block_major()], ids=["f32", "bf16", "block"]
)
def test_offsets_and_sizes_match_the_cache_tensor_in_memory(kv: torch.Tensor) -> None:
    layout = layout_of(kv)
    assert layout.block_bytes == kv[0, 0].numel() * kv.element_size()
    for layer, block in [(0, 0), (1, 3), (2, 9)]:
        assert kv[layer, block].data_ptr() - kv.data_ptr() == layout.offset(layer, block)
    # A run of consecutive blocks of one layer is one contiguous range.
    assert kv[1, 3:7].is_contiguous() == (layout.order == LAYER_MAJOR)


def test_a_block_major_run_holds_every_layer_in_one_range() -> None:
    kv = block_major()
    layout = layout_of(kv)
    assert layout.order == BLOCK_MAJOR
    assert kv.transpose(0, 1)[3:7].is_contiguous()
    assert layout.offset(0, 7) - layout.offset(0, 3) == 4 * 3 * layout.block_bytes


def test_a_cache_dense_in_neither_order_is_refused() -> None:
    with pytest.raises(ValueError, match="must be dense"):
        layout_of(cache()[:, ::2])


def test_layouts_of_different_memory_orders_do_not_meet() -> None:
    with pytest.raises(LayoutMismatchError, match="order: a has layer_major, b has block_major"):
        layout_of(cache()).check_compatible(layout_of(block_major()), local="a", remote="b")


def test_a_peer_that_names_no_order_is_layer_major() -> None:
    raw = layout_of(cache()).to_json()
    del raw["order"]
    assert KVLayout.from_json(raw).order == LAYER_MAJOR


def test_compatible_layouts_may_differ_in_block_count() -> None:
    layout_of(cache(blocks=10)).check_compatible(layout_of(cache(blocks=50)), local="a", remote="b")


@pytest.mark.parametrize(
    ("theirs", "field", "ours_value", "their_value"),
    [
        (cache(block_size=8), "block_size", "4", "8"),
        (cache(dtype=torch.bfloat16), "dtype", "float32", "bfloat16"),
        (cache(layers=4), "num_layers", "3", "4"),
    ],
)
def test_a_mismatch_names_the_setting_and_both_values(
    theirs: torch.Tensor, field: str, ours_value: str, their_value: str
) -> None:
    with pytest.raises(LayoutMismatchError) as refused:
        layout_of(cache()).check_compatible(layout_of(theirs), local="prefill", remote="decode")
    assert str(refused.value) == (
        f"KV cache layouts differ: {field}: prefill has {ours_value}, decode has {their_value}"
    )


def test_every_difference_is_named_and_the_model_too() -> None:
    ours, theirs = layout_of(cache(), "llama"), layout_of(cache(layers=2, block_size=16), "qwen")
    with pytest.raises(LayoutMismatchError) as refused:
        ours.check_compatible(theirs, local="here", remote="there")
    message = str(refused.value)
    for part in ("model: here has llama, there has qwen", "num_layers", "block_size"):
        assert part in message


def test_the_layout_survives_json_and_a_malformed_one_is_refused() -> None:
    layout = layout_of(cache())
    assert KVLayout.from_json(layout.to_json()) == layout
    raw = layout.to_json()
    del raw["head_dim"]
    with pytest.raises(ValueError, match="malformed KV layout"):
        KVLayout.from_json(raw)


def test_runs_cut_where_ids_stop_being_consecutive() -> None:
    assert runs([10, 11, 12, 13, 2, 7, 8]) == [Run(10, 4, 0), Run(2, 1, 4), Run(7, 2, 5)]
    assert runs([]) == []


def test_block_ids_outside_the_cache_are_refused() -> None:
    check_blocks([0, 9], 10, "destination")
    with pytest.raises(ValueError, match=r"destination block ids \[10, -1\] outside"):
        check_blocks([3, 10, -1], 10, "destination")


def test_nixl_descriptors_are_the_segments_layer_by_layer() -> None:
    nixl = pytest.importorskip("pdserve.workers.kv_transfer.nixl")
    kv = cache()
    layout = layout_of(kv)
    merged = segments([3, 4, 5, 9], [0, 1, 2, 7])

    rows = nixl.descriptors(merged, layout, kv.data_ptr(), 0, "src")

    expected = [
        (kv[layer, start].data_ptr(), count * layout.block_bytes, 0)
        for layer in range(3)
        for start, count in [(3, 3), (9, 1)]
    ]
    assert rows == expected
    far = nixl.descriptors(merged, layout, 1 << 40, 2, "dst")
    assert far[1] == ((1 << 40) + layout.offset(0, 7), layout.block_bytes, 2)


def test_nixl_descriptors_of_a_block_major_cache_are_one_per_segment() -> None:
    nixl = pytest.importorskip("pdserve.workers.kv_transfer.nixl")
    kv = block_major()
    layout = layout_of(kv)
    merged = segments([3, 4, 5, 9], [0, 1, 2, 7])

    rows = nixl.descriptors(merged, layout, kv.data_ptr(), 0, "src")

    whole_block = 3 * layout.block_bytes  # every layer of one block
    assert rows == [
        (kv[0, 3].data_ptr(), 3 * whole_block, 0),
        (kv[0, 9].data_ptr(), whole_block, 0),
    ]


def test_a_peers_layout_is_checked_field_by_field() -> None:
    good = layout_of(cache()).to_json()
    for field, bad in [
        ("num_layers", "3"), ("num_blocks", True), ("block_size", 0), ("head_dim", -8),
        ("dtype", "complex128"), ("model", ""), ("weights", 7), ("num_kv_heads", 2**50),
        ("order", "diagonal"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=f"malformed KV layout: bad .*{field}"):
            KVLayout.from_json({**good, field: bad})
    with pytest.raises(ValueError, match="not an object"):
        KVLayout.from_json([good])


def test_other_weights_are_refused_naming_both_digests() -> None:
    ours = KVLayout.of(cache(), model="m", weights="aaaa1111")
    theirs = KVLayout.of(cache(), model="m", weights="bbbb2222")
    with pytest.raises(LayoutMismatchError) as refused:
        ours.check_compatible(theirs, local="decode", remote="prefill")
    assert str(refused.value) == (
        "KV cache layouts differ: weights: decode has aaaa1111, prefill has bbbb2222"
    )


@pytest.mark.parametrize("make", [cache, block_major], ids=["layer_major", "block_major"])
def test_prepared_rows_of_a_transfer_are_its_copies(make: Callable[[], torch.Tensor]) -> None:
    """The rows a transfer names in the prepared lists, merged where they run on in
    memory on both sides, are exactly the copies `descriptors` describes."""
    nixl = pytest.importorskip("pdserve.workers.kv_transfer.nixl")
    kv = make()
    layout = layout_of(kv)
    src, dst = [3, 4, 5, 9, 0], [0, 1, 2, 7, 8]

    rows = nixl.block_rows(layout, kv.data_ptr(), 0)
    pairs = zip(
        rows[nixl.indices(src, layout)].tolist(),
        rows[nixl.indices(dst, layout)].tolist(),
        strict=True,
    )
    merged: list[list[int]] = []
    for (address, length, _), (far, _, _) in pairs:
        last = merged[-1] if merged else None
        if last and last[0] + last[2] == address and last[1] + last[2] == far:
            last[2] += length
        else:
            merged.append([address, far, length])

    copies = segments(src, dst)
    ours = nixl.descriptors(copies, layout, kv.data_ptr(), 0, "src")
    theirs = nixl.descriptors(copies, layout, kv.data_ptr(), 0, "dst")
    assert merged == [[a, b, n] for (a, n, _), (b, _, _) in zip(ours, theirs, strict=True)]
    layers = 1 if layout.order == BLOCK_MAJOR else layout.num_layers
    assert nixl.count_runs(src, dst) * layers == len(ours)


@pytest.mark.parametrize("length", [0, 1, 2, 40, 500])
def test_runs_are_counted_alike_at_every_length(length: int) -> None:
    nixl = pytest.importorskip("pdserve.workers.kv_transfer.nixl")
    generator = torch.Generator().manual_seed(length)
    src = torch.randperm(2 * length + 1, generator=generator)[:length].sort().values.tolist()
    dst = [block + (index // 7) for index, block in enumerate(src)]

    assert nixl.count_runs(src, dst) == len(segments(src, dst))
