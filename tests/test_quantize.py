"""accel_flatshard/core/int8.py: block-wise int8 quantization for communication, one behaviour per test.

In-process and fast.  The error bound the module states (its docstring) is checked on chosen cases and, with
hypothesis, over random lengths, block sizes, magnitudes and dtypes; the reduction helpers are checked with W
ranks simulated in this process (a list of W full gradients and an all-to-all done by indexing) against the exact
sum computed in float64.
"""
from __future__ import annotations

import math
from typing import List

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.overrides import TorchFunctionMode

from accel_flatshard.core import int8
from accel_flatshard.core.flat_param import FlatParamLayout
from accel_flatshard.core.int8 import (QMAX,
                                       dequantize_blocks,
                                       quantize_blocks,
                                       quantize_for_reduction,
                                       reduction_wire_bytes,
                                       shard_blocks,
                                       sum_dequantized,
                                       wire_bytes)

SLACK = 1 + 2**-14  # float32 rounding of scale, quotient and product (module docstring)
FLOOR = 2.0**-143  # absolute floor: subnormal scales only
TINY = torch.finfo(torch.float32).tiny  # smallest normal float32, 2**-126
SUBNORMAL = 2.0**-149


def _randn(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax, in float64 (reference: a plain loop over blocks)."""
    x64 = x.double()
    out = torch.empty_like(x64)
    for start in range(0, x.numel(), block):
        out[start : start + block] = x64[start : start + block].abs().max()
    return out


def _bound(x: torch.Tensor, block: int) -> torch.Tensor:
    return _block_absmax(x, block) / 254 * SLACK + FLOOR


def _error(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    return (dequantized.double() - x.double()).abs()


def _round_trip(x: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q, scales = quantize_blocks(x, block, "test data")
    return dequantize_blocks(q, scales, block, dtype=dtype)


# ---------------------------------------------------------------------- layout and byte counts
def test_shard_blocks_counts_a_short_last_block():
    assert [shard_blocks(n, 256) for n in (1, 255, 256, 257, 512, 1000)] == [1, 1, 1, 2, 2, 4]


def test_wire_bytes_is_the_int8_data_plus_one_float32_scale_per_block():
    q, scales = quantize_blocks(_randn(1000), 256, "shard")
    assert wire_bytes(1000, 256) == 1000 + 4 * 4 == q.numel() * q.element_size() + scales.numel() * 4


def test_reduction_wire_bytes_is_one_row_per_rank_of_the_send_buffers():
    q, scales = quantize_for_reduction(_randn(4 * 1008), 4, 256, "grad")
    assert reduction_wire_bytes(1008, 4, 256) == 4 * wire_bytes(1008, 256) == q.nbytes + scales.nbytes


@pytest.mark.parametrize("block", [0, -1, 2.0, True])
def test_a_block_size_that_is_not_a_positive_int_is_refused(block):
    with pytest.raises(ValueError, match="block must be a positive int"):
        quantize_blocks(_randn(8), block, "x")


@pytest.mark.parametrize("tensor", [torch.zeros(2, 4), torch.zeros(8, dtype=torch.int32),
                                    torch.zeros(8, dtype=torch.float64)], ids=["2-D", "int32", "float64"])
def test_a_tensor_that_is_not_1d_float32_bf16_or_fp16_is_refused(tensor):
    with pytest.raises(ValueError, match="1-D float32, bfloat16 or float16"):
        quantize_blocks(tensor, 4, "x")
    with pytest.raises(ValueError, match="1-D float32, bfloat16 or float16"):
        quantize_for_reduction(tensor, 2, 4, "x")


# ---------------------------------------------------------------------- quantize
def test_codes_are_int8_of_the_input_length_and_scales_float32_one_per_block():
    q, scales = quantize_blocks(_randn(1000), 256, "x")
    assert (q.dtype, q.shape, scales.dtype, scales.shape) == (torch.int8, (1000,), torch.float32, (4,))


def test_the_scale_is_the_block_absmax_over_127():
    x = _randn(600)
    _, scales = quantize_blocks(x, 256, "x")
    expected = torch.stack([x[i : i + 256].abs().max() for i in range(0, 600, 256)]) / 127
    assert torch.equal(scales, expected)


def test_codes_are_symmetric_and_minus_128_is_unused():
    x = torch.tensor([-5.0, -4.99, 5.0, 0.0, -1e-3, -5.0])
    q, _ = quantize_blocks(x, 3, "x")
    assert q.min().item() == -QMAX and q.max().item() == QMAX
    assert q.tolist() == [-127, -127, 127, 0, 0, -127]


def test_the_input_is_not_modified():
    x = _randn(700)
    before = x.clone()
    quantize_blocks(x, 64, "x")
    assert torch.equal(x, before)


def test_fp32_error_is_within_half_a_step_of_the_block_absmax():
    x = _randn(1 << 16) * torch.exp2(torch.randint(-20, 20, (1 << 16,), generator=torch.Generator().manual_seed(1)))
    deq = _round_trip(x, 256)
    ratio = (_error(x, deq) / (_block_absmax(x, 256) / 254)).max().item()
    assert ratio <= SLACK, ratio


def test_an_all_zero_block_gets_scale_zero_and_dequantizes_to_exact_zeros():
    x = torch.cat([_randn(8), torch.zeros(8), -torch.zeros(8)])
    q, scales = quantize_blocks(x, 8, "x")
    assert scales[1:].tolist() == [0.0, 0.0] and not q[8:].any()
    assert torch.equal(dequantize_blocks(q, scales, 8)[8:], torch.zeros(16))


def test_a_constant_block_dequantizes_to_itself_or_a_float32_neighbour():
    values = _randn(4096, seed=3)
    x = values.repeat_interleave(16)  # 4096 constant blocks of 16
    deq = _round_trip(x, 16).view(4096, 16)
    assert torch.equal(deq, deq[:, :1].expand(4096, 16))  # one value a block
    got = deq[:, 0]
    neighbours = (torch.nextafter(values, torch.full_like(values, math.inf)),
                  torch.nextafter(values, torch.full_like(values, -math.inf)))
    assert ((got == values) | (got == neighbours[0]) | (got == neighbours[1])).all()
    assert (got == values).float().mean().item() > 0.98  # (0.994 measured for Gaussian values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_constant_block_of_bf16_or_fp16_round_trips_exactly_into_its_dtype(dtype):
    x = _randn(1024, seed=4, dtype=dtype).repeat_interleave(8)
    assert torch.equal(_round_trip(x, 8, dtype=dtype), x)


def test_a_block_of_one_element_round_trips_to_itself_or_a_neighbour():
    x = _randn(513)
    deq = _round_trip(x, 1)
    assert (_error(x, deq) <= x.double().abs() * 2**-23).all()
    q, scales = quantize_blocks(x, 1, "x")
    assert q.abs().eq(QMAX).all() and scales.numel() == 513
    # a short last block of one element (n = 257, block 256)
    y = _randn(257, seed=5)
    assert (_error(y, _round_trip(y, 256)) <= _bound(y, 256)).all()


def test_subnormal_blocks_stay_within_the_stated_floor():
    normal_block = _randn(16, seed=6)
    subnormal = _randn(16, seed=7) * (TINY / 8)  # subnormal values: absmax < 2**-126, the scale is subnormal
    deep_subnormal = torch.tensor([3.0, -17.0, 40.0, 63.0] * 4) * SUBNORMAL  # absmax 63 * 2**-149: scale 0
    x = torch.cat([normal_block, subnormal, deep_subnormal])
    assert (x[16:] != 0).all() and (x[16:].abs() < TINY).all()
    q, scales = quantize_blocks(x, 16, "x")
    deq = dequantize_blocks(q, scales, 16)
    assert scales[2].item() == 0.0 and not deq[32:].any()  # underflowed scale: exact zeros, error <= absmax
    assert (_error(x, deq) <= _bound(x, 16)).all()
    assert (_error(x[:16], deq[:16]) <= _block_absmax(x[:16], 16) / 254 * SLACK).all()  # no floor for normal


def test_padding_of_a_flat_buffer_dequantizes_to_exact_zeros_in_every_shard():
    layout = FlatParamLayout(["a", "b", "c"], [torch.Size([37]), torch.Size([5, 7]), torch.Size([300])], world_size=2)
    flat = torch.zeros(layout.padded_numel)
    payload = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for i, slot in enumerate(layout.slots):
        flat[slot.offset : slot.offset + slot.numel] = _randn(slot.numel, seed=10 + i)
        payload[slot.offset : slot.offset + slot.numel] = True
    shards = flat.view(2, layout.shard_numel)
    block = 64
    assert layout.shard_numel % block != 0  # each shard ends in a short block that holds the tail padding
    gathered_q = torch.empty(2, layout.shard_numel, dtype=torch.int8)
    gathered_scales = torch.empty(2, shard_blocks(layout.shard_numel, block))
    for rank in range(2):  # each rank quantizes its own shard: blocks never straddle two shards
        quantize_blocks(shards[rank], block, f"shard {rank}", out=(gathered_q[rank], gathered_scales[rank]))
    unsharded = torch.full((layout.padded_numel,), math.nan)
    dequantize_blocks(gathered_q, gathered_scales, block, out=unsharded)
    assert torch.equal(unsharded[~payload], torch.zeros(int((~payload).sum())))
    assert (_error(flat, unsharded).view(2, -1) <= torch.stack([_bound(s, block) for s in shards])).all()


def test_the_largest_float32_stays_finite_and_within_the_bound():
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, big / 2, 1.0])
    deq = _round_trip(x, 4)
    assert torch.isfinite(deq).all()
    assert (_error(x, deq) <= _bound(x, 4)).all()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_value_raises_naming_what_is_quantized(bad):
    x = _randn(1000)
    x[900] = bad  # in the short last block
    with pytest.raises(ValueError, match=r"unit model\.layers\.3 weights: 1 non-finite .* elements 768\.\.999 of 1000"):
        quantize_blocks(x, 256, "unit model.layers.3 weights")


def test_nan_in_a_bf16_tensor_raises_too():
    x = _randn(64, dtype=torch.bfloat16)
    x[3] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        quantize_blocks(x, 16, "bf16 weights")


class _CountCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: List[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_the_work_does_not_grow_with_the_number_of_blocks():
    """Vectorised: the same torch calls for 4 blocks and for 16384 (no Python loop over blocks: within one piece of
    PIECE_ELEMENTS, a call's ops cover all its blocks), and exactly one finiteness reduction a call."""
    counts = []
    for n in (64, 16 * 16384):
        assert n <= int8.PIECE_ELEMENTS
        x = _randn(n + 3)  # full blocks and a short one
        with _CountCalls() as mode:
            q, scales = quantize_blocks(x, 16, "x")
            dequantize_blocks(q, scales, 16)
        counts.append(mode.calls)
    assert counts[0] == counts[1]
    assert counts[0].count("isfinite") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pieces_change_no_result(monkeypatch, dtype):
    """CPU passes run piece by piece (PIECE_ELEMENTS): codes, scales, dequantized values and sums are bitwise those
    computed on the whole tensor at once, for pieces of parts of a row, of several rows, and of odd sizes."""
    x = (_randn(3 * 1003, seed=5) * torch.exp(_randn(3 * 1003, seed=6) * 2)).to(dtype)  # (fp16 holds e**8)
    x[100:400] = 0  # an all-zero block or two

    def everything():
        q, scales = quantize_blocks(x, 16, "x")
        rq, rscales = quantize_for_reduction(x, 3, 16, "x")
        dequantized = [dequantize_blocks(rq, rscales, 16, dtype=d) for d in (torch.float32, torch.bfloat16)]
        return [q, scales, rq, rscales, *dequantized, sum_dequantized(rq, rscales, 16, torch.empty(1003))]

    monkeypatch.setattr(int8, "PIECE_ELEMENTS", int8._WHOLE)
    whole = everything()
    for limit in (1, 7, 64, 1003, 2500):
        monkeypatch.setattr(int8, "PIECE_ELEMENTS", limit)
        for expected, got in zip(whole, everything()):
            assert torch.equal(expected, got), limit


def test_the_sum_makes_no_dequantized_copy_of_a_row():
    """sum_dequantized adds the W sources piece by piece: its scratch is one piece, not a chunk (W=4, 4 pieces)."""
    rq, rscales = quantize_for_reduction(_randn(4 * 4 * int8.PIECE_ELEMENTS), 4, 256, "x")
    allocated = []

    class _Allocations(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is torch.empty:
                allocated.append(result.numel())
            return result

    out = torch.empty(4 * int8.PIECE_ELEMENTS)
    with _Allocations():
        sum_dequantized(rq, rscales, 256, out)
    assert allocated and max(allocated) <= int8.PIECE_ELEMENTS


# ---------------------------------------------------------------------- dequantize
def test_quantize_and_dequantize_write_into_given_buffers():
    x = _randn(300)
    send_q, send_scales = torch.zeros(2, 300, dtype=torch.int8), torch.zeros(2, 5)
    q, scales = quantize_blocks(x, 64, "x", out=(send_q[1], send_scales[1]))
    assert q.data_ptr() == send_q[1].data_ptr() and scales.data_ptr() == send_scales[1].data_ptr()
    assert not send_q[0].any() and send_q[1].any()
    out = torch.empty(300, dtype=torch.bfloat16)
    assert dequantize_blocks(q, scales, 64, out=out) is out


@pytest.mark.parametrize("dtype, unit_roundoff, subnormal_floor", [(torch.bfloat16, 2**-8, 0.0),
                                                                   (torch.float16, 2**-11, 2**-25)])
def test_dequantizing_into_bf16_or_fp16_rounds_the_float32_value_once(dtype, unit_roundoff, subnormal_floor):
    x = _randn(5000, seed=8)
    q, scales = quantize_blocks(x, 128, "x")
    as_fp32 = dequantize_blocks(q, scales, 128)
    out = dequantize_blocks(q, scales, 128, out=torch.empty(5000, dtype=dtype))
    assert torch.equal(out, as_fp32.to(dtype))
    rounding_bound = as_fp32.double().abs() * unit_roundoff + subnormal_floor
    assert ((out.double() - as_fp32.double()).abs() <= rounding_bound).all()
    assert (_error(x, out) <= _bound(x, 128) + rounding_bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_bf16_or_fp16_input_has_the_fp32_bound_on_its_exact_values(dtype):
    x = (_randn(3000, seed=9) * 3).to(dtype)
    assert (_error(x, _round_trip(x, 100)) <= _bound(x.float(), 100)).all()


def test_gathered_rows_dequantize_into_one_flat_buffer():
    shards = [_randn(100, seed=s) for s in range(3)]
    quantized = [quantize_blocks(s, 32, "shard") for s in shards]
    flat = dequantize_blocks(torch.stack([q for q, _ in quantized]), torch.stack([s for _, s in quantized]), 32,
                             out=torch.empty(300))
    assert torch.equal(flat, torch.cat([dequantize_blocks(q, s, 32) for q, s in quantized]))


def test_dequantize_refuses_scales_of_the_wrong_count_or_an_out_of_the_wrong_size():
    q, scales = quantize_blocks(_randn(100), 32, "x")
    with pytest.raises(ValueError, match="float32 scales"):
        dequantize_blocks(q, scales[:3], 32)
    with pytest.raises(ValueError, match="contiguous float tensor of 100"):
        dequantize_blocks(q, scales, 32, out=torch.empty(99))
    with pytest.raises(ValueError, match="out is torch.float32 but dtype"):
        dequantize_blocks(q, scales, 32, out=torch.empty(100), dtype=torch.bfloat16)


# ---------------------------------------------------------------------- property tests
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_EXPONENTS = {"fp32": (-150, 120), "bf16": (-130, 120), "fp16": (-20, 10)}  # keeps fp16 inside its range


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3000), block=st.integers(1, 700), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(sorted(_DTYPES)), data=st.data())
def test_property_error_bound_for_random_shapes_blocks_and_magnitudes(n, block, seed, dtype, data):
    low, high = _EXPONENTS[dtype]
    exponent = data.draw(st.integers(low, high), label="exponent")
    spread = data.draw(st.integers(0, 30), label="spread within a block")
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(exponent + torch.randint(-spread, spread + 1, (n,), generator=g).clamp(max=high - exponent)
                       .double())
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(_DTYPES[dtype])
    q, scales = quantize_blocks(x, block, "random data")
    assert q.abs().max().item() <= QMAX
    deq = dequantize_blocks(q, scales, block)
    assert (_error(x, deq) <= _bound(x.float(), block)).all()
    out = dequantize_blocks(q, scales, block, out=torch.empty(n, dtype=_DTYPES[dtype]))
    assert torch.equal(out, deq.to(_DTYPES[dtype]))  # the bound, then one rounding to the output dtype


# ---------------------------------------------------------------------- the reduction's math
def _simulated_reduction(grads: List[torch.Tensor], block: int) -> List[torch.Tensor]:
    """Every rank's reduced shard: quantize_for_reduction on each rank, an all-to-all by indexing, the sum."""
    world = len(grads)
    sent = [quantize_for_reduction(g, world, block, f"rank {r} gradient") for r, g in enumerate(grads)]
    chunk = grads[0].numel() // world
    results = []
    for rank in range(world):
        received_q = torch.stack([q[rank] for q, _ in sent])  # row s from rank s
        received_scales = torch.stack([s[rank] for _, s in sent])
        results.append(sum_dequantized(received_q, received_scales, block, torch.empty(chunk)))
    return results


def _reduction_bound(grads: List[torch.Tensor], block: int, rank: int) -> torch.Tensor:
    """Per element of rank's shard: the W per-source bounds plus float32 rounding of W - 1 adds."""
    world, chunk = len(grads), grads[0].numel() // len(grads)
    parts = [g[rank * chunk : (rank + 1) * chunk] for g in grads]
    per_source = sum(_bound(p, block) for p in parts)
    return per_source + (world - 1) * 2**-24 * sum(p.double().abs() + _bound(p, block) for p in parts)


def test_each_row_of_the_reduction_buffers_is_the_chunk_of_that_rank_quantized_on_its_own():
    grad = _randn(3 * 200)
    q, scales = quantize_for_reduction(grad, 3, 64, "g")
    assert q.shape == (3, 200) and scales.shape == (3, 4)
    for rank in range(3):
        q_r, s_r = quantize_blocks(grad[rank * 200 : (rank + 1) * 200], 64, "chunk")
        assert torch.equal(q[rank], q_r) and torch.equal(scales[rank], s_r)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_simulated_quantized_reduction_matches_the_exact_sum_within_the_bound(world):
    chunk, block = 1000, 256
    grads = [_randn(world * chunk, seed=100 + r) * (r + 1) for r in range(world)]
    exact = torch.stack([g.double() for g in grads]).sum(0)
    for rank, reduced in enumerate(_simulated_reduction(grads, block)):
        assert reduced.dtype == torch.float32
        error = (reduced.double() - exact[rank * chunk : (rank + 1) * chunk]).abs()
        assert (error <= _reduction_bound(grads, block, rank)).all()


def test_the_sum_adds_the_sources_in_rank_order():
    grads = [_randn(2 * 96, seed=r) * 10.0**r for r in range(4)]  # magnitudes where the order shows
    sent = [quantize_for_reduction(g, 2, 32, "g") for g in grads]
    received_q = torch.stack([q[1] for q, _ in sent])
    received_scales = torch.stack([s[1] for _, s in sent])
    reduced = sum_dequantized(received_q, received_scales, 32, torch.empty(96))
    in_order = dequantize_blocks(received_q[0], received_scales[0], 32)
    for source in range(1, 4):
        in_order = in_order + dequantize_blocks(received_q[source], received_scales[source], 32)
    assert torch.equal(reduced, in_order)
    again = sum_dequantized(received_q, received_scales, 32, torch.empty(96))
    assert torch.equal(reduced, again)


def test_a_gradient_that_does_not_split_into_w_chunks_is_refused():
    with pytest.raises(ValueError, match="do not split into 4 equal chunks"):
        quantize_for_reduction(_randn(10), 4, 8, "g")


def test_a_non_finite_gradient_raises_naming_it_and_where():
    grad = _randn(2 * 100)
    grad[150] = math.inf  # chunk 1 (elements 100..199), its block 1
    with pytest.raises(ValueError, match=r"gradient of unit layers\.0: 1 non-finite .* elements 132\.\.163 of 200"):
        quantize_for_reduction(grad, 2, 32, "gradient of unit layers.0")


def test_the_sum_is_kept_in_float32():
    q, scales = quantize_for_reduction(_randn(64), 2, 8, "g")
    with pytest.raises(ValueError, match="float32"):
        sum_dequantized(q, scales, 8, torch.empty(32, dtype=torch.bfloat16))


@settings(max_examples=100, deadline=None)
@given(world=st.integers(1, 6), chunk=st.integers(1, 400), block=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       exponent=st.integers(-60, 60))
def test_property_the_quantized_reduction_is_within_the_summed_bounds(world, chunk, block, seed, exponent):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(world * chunk, generator=g) * 2.0**exponent for _ in range(world)]
    exact = torch.stack([gr.double() for gr in grads]).sum(0)
    for rank, reduced in enumerate(_simulated_reduction(grads, block)):
        error = (reduced.double() - exact[rank * chunk : (rank + 1) * chunk]).abs()
        assert (error <= _reduction_bound(grads, block, rank)).all()
