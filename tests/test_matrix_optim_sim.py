"""The matrix optimizers' exchange on the simulated CUDA schedule (tests/sim_cuda.py; accel_flatshard/features/matrix_optim.py).

One process, a shard group of one: every transfer of the two exchanges is a copy, issued where a transfer would
be, on the adapter's "matrix_exchange" side stream.  Muon over a tiny Llama's hidden matrices and AdamW over the
rest then step on the simulator exactly as without it and as the plain model steps them, with no ordering
violation, through a SHARDED save and load of the optimizer state (the load's pieces go back to their owner).
This file is in the mutation table's pool (tests/sim_table.py): each ordering call of matrix_optim.py, broken,
fails it.
"""

import pytest
import torch

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.state import load_sharded_optimizer, save_sharded_optimizer
from models import batches, llama, llama_layer_class
from sim_cuda import one_thread, simulate_cuda  # noqa: F401 - one_thread: a fixture

pytestmark = [pytest.mark.usefixtures("world_of_one", "one_thread"),
              pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")]


def _optimizers(model):
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("model.embed", "lm_head"))]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    # foreach=False: the same for-loop kernel with and without the simulator
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1), torch.optim.AdamW(rest, lr=1e-2, foreach=False)]


def _train(model, optimizers, data, tmp=None):
    """Steps; with ``tmp``: after the second, the optimizer state is saved, a step runs, and it is loaded back."""
    losses = []
    for i, x in enumerate(data):
        if tmp is not None and i == 2:
            save_sharded_optimizer(model, optimizers[0], str(tmp / "muon"))
        if tmp is not None and i == 3:
            load_sharded_optimizer(model, optimizers[0], str(tmp / "muon"))
        loss = model(x, labels=x).loss
        loss.backward()
        for o in optimizers:
            o.step()
        for o in optimizers:
            o.zero_grad()
        losses.append(loss.detach())
    return losses


def _wrapped():
    model = llama(n_layer=2)
    optimizers = _optimizers(model)  # built before wrapping, as with accelerator.prepare
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy([llama_layer_class()])), \
        optimizers


def test_muon_steps_on_the_simulated_gpu_as_without_it_and_as_the_plain_model(tmp_path):
    data = batches(5)
    plain = llama(n_layer=2)
    expected = _train(plain, _optimizers(plain), data[:2])  # (save and load need a wrapper: two steps here)
    unsimulated, opts = _wrapped()
    reference = _train(unsimulated, opts, data, tmp_path / "reference")
    model, opts = _wrapped()
    sim = simulate_cuda(model)
    with sim:  # (the matrix exchange runs on the model's adapter: the simulator's)
        got = _train(model, opts, data, tmp_path / "simulated")
    assert sim.violations == [], "\n".join(sim.violations[:8])
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
    torch.testing.assert_close(got[:2], expected, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), unsimulated.parameters()):
        assert torch.equal(p, q), name
    # both exchanges of every step ran on the side stream: the compute stream waited for two of its events per step
    # (the gradients' arrival, the values' return), and the return read the owners' buffers there
    waits = [source for what, waiter, source in sim.log if what == "wait_event" and waiter == "compute0"]
    assert sum(source.startswith("matrix_exchange:") for source in waits) == 2 * len(data), waits
    streams = {stream for what, stream, kind in sim.log if what == "read" and kind == "matrix_work"}
    assert {s.split(":")[0] for s in streams} == {"compute0", "matrix_exchange"}, streams


def test_muon_over_a_model_offloaded_from_a_gpu_is_refused_at_its_first_step_naming_the_option():
    """CPU offload on CUDA keeps the shards in host memory while the exchange runs on the device: not supported,
    said at Muon's first step (before any exchange), with the yaml option to turn off; nothing is updated."""
    from accel_flatshard import CPUOffload

    model = llama(n_layer=2)
    optimizers = _optimizers(model)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy([llama_layer_class()]),
                                       cpu_offload=CPUOffload(True))
    sim = simulate_cuda(wrapped)
    with sim:
        x = batches(1)[0]
        wrapped(x, labels=x).loss.backward()
        before = [p.detach().clone() for p in wrapped.parameters()]
        with pytest.raises(NotImplementedError, match="Muon with CPU offload onto .*train without fsdp_offload_params"):
            optimizers[0].step()
    assert all(torch.equal(a, b) for a, b in zip(before, wrapped.parameters()))
