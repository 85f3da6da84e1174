"""Low-RAM initialisation: meta-device models materialised unit by unit."""
import pytest
import torch
import torch.nn as nn

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from dist_helpers import spawn
from models import full_params, gpt2
from toy import Block, Scale, Toy


def _deterministic_init(module: nn.Module) -> None:
    """An init that depends only on the module's tensors' shapes: the same eagerly and on meta."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None:
                t.copy_(torch.linspace(-0.5, 0.5, t.numel()).view(t.shape) * (1 + len(name)))


def _meta_worker(rank, world_size, mode):
    policy = transformer_auto_wrap_policy([Block, Scale])
    if mode == "rank0_real":
        if rank == 0:
            model = Toy()
        else:
            with torch.device("meta"):
                model = Toy()
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy, sync_module_states=True)
    else:
        with torch.device("meta"):
            model = Toy()
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy, param_init_fn=_deterministic_init,
                                           sync_module_states=False)
    tied = wrapped.module.blocks[2].lin.weight is wrapped.module.blocks[0].lin.weight
    x = torch.ones(2, 12)
    wrapped(x).backward()  # trains: the materialised model is a working one
    wrapped.zero_grad()
    return full_params(wrapped), tied


@pytest.mark.parametrize("mode", ["rank0_real", "param_init_fn"])
def test_meta_device_model_gets_the_same_parameters_as_eager_init(mode):
    eager = Toy()
    if mode == "param_init_fn":
        for m in eager.modules():
            _deterministic_init(m)
        eager.blocks[2].lin.weight = eager.blocks[0].lin.weight
    expected = eager.state_dict()
    for params, tied in spawn(2, _meta_worker, mode):
        assert tied, "tied parameters stay tied after materialisation"
        assert params.keys() == expected.keys()
        for k in expected:
            assert torch.equal(params[k], expected[k]), k
