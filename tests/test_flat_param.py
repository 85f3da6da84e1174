"""FlatParamLayout / FlatParameter: pure tensor logic, no process group."""
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from accel_flatshard.core.flat_param import FlatParameter, FlatParamLayout


def test_offsets_are_aligned_and_padded_size_divides_world_times_alignment():
    layout = FlatParamLayout(["a", "b", "c"], [(3, 5), (7,), (2, 2)], world_size=4, alignment=8)
    assert [s.offset for s in layout.slots] == [0, 16, 24]
    assert layout.unpadded_numel == 28
    assert layout.padded_numel % (4 * 8) == 0 and layout.padded_numel >= 28
    assert layout.shard_numel * 4 == layout.padded_numel


def test_shard_pieces_partition_every_parameter_exactly():
    layout = FlatParamLayout(["a", "b"], [(10, 3), (17,)], world_size=3, alignment=4)
    covered = {i: [] for i in range(2)}
    for rank in range(3):
        for piece in layout.shard_pieces(rank):
            covered[piece.slot_index] += list(range(piece.param_start, piece.param_start + piece.length))
    assert sorted(covered[0]) == list(range(30))
    assert sorted(covered[1]) == list(range(17))


def _padding_mask(layout):
    """True where no parameter lives in the flat buffer."""
    mask = torch.ones(layout.padded_numel, dtype=torch.bool)
    for slot in layout.slots:
        mask[slot.offset : slot.offset + slot.numel] = False
    return mask


def test_padding_mask_marks_only_gaps():
    layout = FlatParamLayout(["a", "b"], [(3,), (2,)], world_size=2, alignment=4)
    mask = _padding_mask(layout)
    assert mask.tolist()[:8] == [False, False, False, True, False, False, True, True]
    assert int((~mask).sum()) == 5


def _linear_params(seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(5, 3)
    return lin, [lin.weight, lin.bias]


def test_params_become_views_of_their_local_shard_slices():
    lin, params = _linear_params()
    full_w, full_b = lin.weight.detach().clone(), lin.bias.detach().clone()
    flats = []
    for rank in range(2):
        lin_r, params_r = _linear_params()
        flat = FlatParameter(params_r, ["weight", "bias"], [[(lin_r, "weight")], [(lin_r, "bias")]], rank, 2)
        flat.set_local_shard_from_full(flat.full_flat_from_params())
        flat.point_params_at_shard()
        flats.append(flat)
    got_w = torch.cat([f.params[0].detach() for f in flats])
    got_b = torch.cat([f.params[1].detach() for f in flats])
    assert torch.equal(got_w, full_w.reshape(-1)) and torch.equal(got_b, full_b)
    # writing through a parameter writes the shard (what optimizers do)
    flats[0].params[0].data.add_(1.0)
    assert torch.equal(flats[0].local_shard[: flats[0].pieces[0].length], full_w.reshape(-1)[: flats[0].pieces[0].length] + 1)


def test_freed_storage_regrows_in_place_and_saved_views_see_new_data():
    lin, params = _linear_params()
    flat = FlatParameter(params, ["weight", "bias"], [[(lin, "weight")], [(lin, "bias")]], 0, 1)
    assert not flat.unsharded.untyped_storage().nbytes()
    full = flat.full_flat_from_params()
    flat.alloc_unsharded().copy_(full)
    w, b = flat.unsharded_views()
    x = torch.randn(2, 5, requires_grad=True)
    out = torch.nn.functional.linear(x, w, b).sum()  # autograd saves the weight view for x's gradient
    flat.free_unsharded()
    assert flat.unsharded.untyped_storage().nbytes() == 0
    flat.alloc_unsharded().copy_(full * 2)  # "gathered" back into the same storage, new values
    out.backward()
    assert torch.allclose(x.grad, 2 * lin_weight_sum(full))
    assert torch.allclose(flat.unsharded.grad[:15].view(3, 5), torch.ones(2, 3).t() @ x.detach())


def lin_weight_sum(full):
    return full[:15].view(3, 5).sum(0).expand(2, 5)


def test_padding_gradient_is_zero_and_invisible():
    lin, params = _linear_params()
    flat = FlatParameter(params, ["weight", "bias"], [[(lin, "weight")], [(lin, "bias")]], 0, 1, alignment=8)
    flat.alloc_unsharded().copy_(flat.full_flat_from_params())
    w, b = flat.unsharded_views()
    (torch.nn.functional.linear(torch.randn(4, 5), w, b) ** 2).sum().backward()
    mask = _padding_mask(flat.layout)
    assert mask.any() and torch.count_nonzero(flat.unsharded.grad[mask]) == 0


def test_install_views_keeps_parameters_registered():
    lin, params = _linear_params()
    flat = FlatParameter(params, ["weight", "bias"], [[(lin, "weight")], [(lin, "bias")]], 0, 1)
    flat.alloc_unsharded().copy_(flat.full_flat_from_params())
    flat.install_views(flat.unsharded_views())
    assert lin.weight.shape == (3, 5) and not isinstance(lin.weight, nn.Parameter)
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    flat.uninstall_views()
    assert isinstance(lin.weight, nn.Parameter)


_shapes = st.lists(st.lists(st.integers(1, 7), min_size=0, max_size=3), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(shapes=_shapes, world_size=st.integers(1, 8), alignment=st.sampled_from([1, 2, 4, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_property_shard_then_gather_reproduces_every_parameter_bit_for_bit(shapes, world_size, alignment, dtype):
    shapes = [tuple(s) for s in shapes]
    values = [torch.randn(s).to(dtype) if s else torch.randn(()).to(dtype) for s in shapes]
    holders = []
    flats = []
    for rank in range(world_size):
        module = nn.Module()
        params = []
        for i, v in enumerate(values):
            p = nn.Parameter(v.clone())
            module.register_parameter(f"p{i}", p)
            params.append(p)
        fqns = [f"p{i}" for i in range(len(values))]
        flat = FlatParameter(params, fqns, [[(module, f)] for f in fqns], rank, world_size, alignment=alignment)
        flat.set_local_shard_from_full(flat.full_flat_from_params())
        flat.point_params_at_shard()
        holders.append(module)
        flats.append(flat)
    layout = flats[0].layout
    assert layout.padded_numel % (world_size * alignment) == 0
    # simulated all-gather: concatenation of the local shards in rank order
    gathered = torch.cat([f.local_shard for f in flats])
    for slot, v in zip(layout.slots, values):
        assert torch.equal(gathered[slot.offset: slot.offset + slot.numel].view(slot.shape), v)
    # the users' parameters cover exactly their slices, and padding never shows up in them
    for i, v in enumerate(values):
        pieces = torch.cat([f.params[i].detach() for f in flats])
        assert pieces.numel() == v.numel() and torch.equal(pieces, v.reshape(-1))
    assert sum(p.numel() for f in flats for p in f.params) == sum(v.numel() for v in values)
