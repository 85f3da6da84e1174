"""Schedule defects found against torch FSDP that also show on CPU, and unit-by-unit device placement.

Single process (gloo, world size 1); each test compares with the plain model or measures.
"""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from models import batches, llama, llama_layer_class
from toy import Block, Scale, Toy, toy_batches


pytestmark = pytest.mark.usefixtures("world_of_one")


def _wrap_toy(model):
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy([Block, Scale]))


def test_a_frozen_unit_is_resharded_when_its_backward_is_done():
    """Defect 6: a unit without trainable parameters stayed gathered until the end of backward."""
    model = llama(n_layer=3)
    model.model.layers[1].requires_grad_(False)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy([llama_layer_class()]))
    units = {u.name: u for u in wrapped.units}
    frozen, below = units["model.layers.1"], units["model.layers.0"]
    seen = []
    schedule = wrapped.schedule
    original = schedule._post_backward

    def spy(unit, flat):  # layer 0's gradients are complete: layer 1's backward was over before
        if unit is below:
            seen.append(frozen.sharded_state.name)
        original(unit, flat)

    schedule._post_backward = spy
    x = batches(1)[0]
    wrapped(input_ids=x, labels=x).loss.backward()
    assert seen == ["SHARDED"]


def test_a_frozen_unit_called_twice_trains_like_the_plain_model():
    """The frozen unit is resharded after each use's backward and gathered again for the next."""
    def frozen_toy():
        toy = Toy(tie_blocks=False)
        toy.blocks[1].requires_grad_(False)  # the block the toy calls twice
        return toy

    wrapped, reference = _wrap_toy(frozen_toy()), frozen_toy()
    for model in (wrapped, reference):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        model.losses = []
        for x in toy_batches(3):
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            model.losses.append(loss.item())
    assert wrapped.losses == pytest.approx(reference.losses, abs=1e-6)


def test_shards_written_after_a_forward_without_backward_are_seen_by_the_next_forward():
    """Defect 7: the root (and last unit) stayed gathered after a grad-enabled forward; zeroing every
    weight inside summon_full_params was then ignored by the next forward (loss 0.068 instead of 0)."""
    wrapped, reference = _wrap_toy(Toy()), Toy()
    x = toy_batches(1)[0]
    for model in (wrapped, reference):
        model(x)  # grad enabled, no backward
    with wrapped.summon_full_params():
        with torch.no_grad():
            for p in wrapped.parameters():
                p.zero_()
    with torch.no_grad():
        for p in reference.parameters():
            p.zero_()
    assert reference(x).item() == 0.0
    assert wrapped(x).item() == 0.0


class _LiveBytesOn(TorchDispatchMode):
    """Peak bytes of live storages created on one device (``meta`` stands in for a GPU here)."""

    def __init__(self, device_type):
        super().__init__()
        self.device_type, self.refs, self.peak = device_type, [], 0

    def live(self):
        storages = {}
        self.refs = [r for r in self.refs if r() is not None]
        for ref in self.refs:
            storage = ref().untyped_storage()
            storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self.refs.append(weakref.ref(t))
        self.peak = max(self.peak, self.live())
        return out


@pytest.mark.parametrize("source", ["cpu", "meta"])
def test_wrapping_for_a_device_holds_one_unit_unsharded_there(source):
    """Defect 2: prepare() moved the whole model to the GPU before sharding.  The wrapper copies (CPU) or
    materialises (meta) each unit into its device buffer while sharding it: the device's peak is the
    shards plus one unit."""
    with torch.device(source):
        model = llama(n_layer=4, hidden=64)
    with _LiveBytesOn("meta") as device_bytes:
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy([llama_layer_class()]),
                                           device_id=torch.device("meta"))
        shards = device_bytes.live()
    unit_bytes = [sum(f.layout.padded_numel * f.unsharded.element_size() for f in u.flat_params) for u in wrapped.units]
    model_bytes = sum(p.numel() * 4 for p in llama(n_layer=4, hidden=64).parameters())
    assert all(p.device.type == "meta" for p in wrapped.parameters())
    assert shards == pytest.approx(model_bytes, rel=0.01)  # W = 1: the shards are the whole model
    assert device_bytes.peak - shards <= max(unit_bytes)


@pytest.mark.parametrize("source", ["cpu", "meta"])
def test_prepare_leaves_placement_to_the_wrapper(source):
    """Defect 2, accelerate side: prepare() upcasts where the model is and does not move (or materialise)
    it whole on the GPU; the wrapper then places it unit by unit (test above)."""
    from types import SimpleNamespace

    from accel_flatshard.integrations.accelerate import Accelerator

    accelerator = SimpleNamespace(device=torch.device("cuda", 0), state=SimpleNamespace(mixed_precision="bf16"),
                                  flatshard_options=SimpleNamespace(sync_module_states=True))
    with torch.device(source):
        model = Toy().to(torch.bfloat16)
    with pytest.warns(UserWarning, match="upcasting"):
        Accelerator._materialize_and_place(accelerator, model)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {(source, torch.float32)}
