"""The simulator's own checks (tests/sim_cuda.py), each shown on a deliberately broken order or placement."""
import pytest
import torch

from sim_cuda import SimulatedCuda


def _sim():
    sim = SimulatedCuda()
    return sim, sim.current_stream(0), sim.Stream(device="cuda:0")


def test_a_read_on_another_stream_must_follow_the_write():
    sim, compute, side = _sim()
    with sim:
        x = torch.zeros(4)  # written on the compute stream
        with sim.stream(side):
            x + 1
    assert sim.violations and "read on side" in sim.violations[0]
    sim, compute, side = _sim()
    with sim:
        x = torch.zeros(4)
        side.wait_stream(compute)
        with sim.stream(side):
            x + 1
    assert sim.violations == []


def test_a_collectives_output_is_written_when_it_is_issued_not_when_allocated():
    """An event recorded between the allocation and the write does not cover the write."""
    sim, compute, side = _sim()
    with sim:
        with sim.stream(side):
            out = torch.empty(4)
            early = sim.Event()
            early.record(side)
            out.copy_(torch.ones(4))  # the collective
        compute.wait_event(early)
        out.sum()
    assert any("read on compute0 before its write on" in v for v in sim.violations)


def test_an_in_place_write_must_follow_reads_on_other_streams():
    sim, compute, side = _sim()
    with sim:
        x = torch.zeros(4)
        side.wait_stream(compute)
        with sim.stream(side):
            x.sum()  # e.g. an all-gather reading the shard
        x.add_(1)  # the optimizer's in-place update, without waiting for the gather
    assert any("written on compute0 while" in v for v in sim.violations)


@pytest.mark.parametrize("record", [False, True])
def test_a_buffer_used_on_another_stream_is_freed_only_with_record_stream(record):
    sim, compute, side = _sim()
    with sim:
        with sim.stream(side):
            y = torch.ones(4)  # allocated on the side stream
        compute.wait_stream(side)
        y.mul_(2)  # used on the compute stream
        if record:
            sim.record_stream(y, compute)
        del y
    assert bool(sim.violations) != record
    if record:  # held back until the host has seen the compute stream pass the free
        assert len(sim._dead) == 1
        sim._host_waits_for(compute)
        sim._count("tensor")
        assert sim._dead == []


def test_host_memory_read_on_the_host_must_follow_the_device_to_host_copy():
    sim, compute, side = _sim()
    with sim:
        grad = torch.ones(4)  # on the device
        host = torch.empty(4)
        sim.place(host, "host", pinned=True)
        side.wait_stream(compute)
        with sim.stream(side):
            host.copy_(grad, non_blocking=True)  # pinned: asynchronous on the side stream
        done = sim.Event()
        done.record(side)
        host.mul_(0.5)  # a CPU optimizer step before the copy is known complete
    assert any("on host before its write on" in v for v in sim.violations)
    sim.violations.clear()
    with sim:
        with sim.stream(side):
            host.copy_(grad, non_blocking=True)
        done = sim.Event()
        done.record(side)
        done.synchronize()
        host.mul_(0.5)
    assert sim.violations == []
    sim.assert_on_host({"grad shard": host})
    with pytest.raises(AssertionError, match="device"):
        sim.assert_on_host({"grad": grad})


@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_copy_between_host_and_device_blocks_the_host_unless_pinned_and_non_blocking(non_blocking):
    """As ``cudaMemcpy``: a blocking copy (``.copy_(src)``, ``.to(device)``) returns once done, so the host
    may then write the source; a non_blocking copy from pinned memory may still read it."""
    sim, compute, side = _sim()
    with sim:
        host = torch.ones(4)
        sim.place(host, "host", pinned=True)
        sim.name(host, "the pinned shard")
        device = torch.empty(4)  # on the device
        side.wait_stream(compute)
        with sim.stream(side):
            device.copy_(host, non_blocking=non_blocking)  # host -> device on a side stream
        host.add_(1.0)  # the host optimizer writes the shard
    if non_blocking:
        (violation,) = sim.violations
        assert violation == ("the pinned shard written on host while " + side.name + " may still read it "
                             "(by aten::add_)")  # the tensor, the stream and the op
    else:
        assert sim.violations == []


def test_a_buffer_freed_after_a_recorded_stream_waited_for_its_use_is_safe():
    """The block waits in the pool until every ``record_stream``ed stream passed the free: if one of them
    waited for the other stream's use, that use is done before the block is reused."""
    sim, compute, side = _sim()
    other = sim.Stream(device="cuda:0")
    with sim:
        with sim.stream(side):
            y = torch.ones(4)  # allocated on the side stream
        other.wait_stream(side)
        with sim.stream(other):
            y.mul_(2)  # written on a third stream (the replica all-reduce)
        compute.wait_stream(other)
        sim.record_stream(y, compute)  # kept for the compute stream, which waited for the third
        del y
    assert sim.violations == []


@pytest.mark.parametrize("order", ["record_stream-then-resize", "resize-then-record_stream"])
def test_record_stream_of_a_storage_already_resized_to_0_keeps_nothing(order):
    """On a GPU, resizing the storage to 0 hands the block back to its stream's pool at once; a later
    ``record_stream`` of the empty storage does nothing, so the other stream's read is unprotected."""
    sim, compute, side = _sim()
    gathered = torch.empty(0)
    with sim:
        with sim.stream(side):
            gathered.untyped_storage().resize_(16)
            sim.alloc(gathered, "unsharded", key="flat")  # allocated on the all-gather stream
            gathered.fill_(1.0)  # the all-gather
        compute.wait_stream(side)
        gathered.sum()  # read by the compute stream
        if order == "record_stream-then-resize":
            sim.record_stream(gathered, compute)
        gathered.untyped_storage().resize_(0)
        if order == "resize-then-record_stream":
            sim.record_stream(gathered, compute)
        sim.free("flat")
    if order == "record_stream-then-resize":
        assert sim.violations == []
    else:
        (violation,) = sim.violations
        assert "freed while compute0 may still use it" in violation


@pytest.mark.parametrize("ordered", [True, False])
def test_a_buffer_allocated_on_one_stream_is_used_on_another_only_after_the_allocation(ordered):
    """Per-stream pools: a block allocated on the compute stream may still be in use by the compute stream's
    earlier work (a buffer freed there), so a side stream must be ordered after the allocation before it
    writes the block (here: a resize, not an op, so no write covers it)."""
    sim, compute, side = _sim()
    buffer = torch.empty(0)
    with sim:
        torch.ones(4).mul_(2)  # earlier compute-stream work
        buffer.untyped_storage().resize_(16)
        sim.alloc(buffer, "unsharded", key="flat")  # allocated on the compute stream (current)
        if ordered:
            side.wait_stream(compute)
        with sim.stream(side):
            buffer.fill_(1.0)  # first written by the side stream
    if ordered:
        assert sim.violations == []
    else:
        (violation,) = sim.violations
        assert violation.startswith("unsharded") and "before it waited for its allocation on compute0" in violation


# ---------------------------------------------------------------------- device <-> host copies
@pytest.mark.parametrize("how", ["cpu()", "to-cpu-non_blocking", "to-cpu-non_blocking-then-synchronize"])
def test_a_device_to_host_copy_is_read_by_the_host_only_once_complete(how, tmp_path):
    """``.cpu()`` blocks the host until the copy is done; ``.to("cpu", non_blocking=True)`` copies
    asynchronously into pinned memory, which the host may read (torch.save, an op) only after a sync."""
    sim, compute, side = _sim()
    with sim:
        result = torch.ones(4).mul_(3)  # a device result
        assert result.device == torch.device("cuda", 0) and result.is_cuda  # as on a GPU
        host = result.cpu() if how == "cpu()" else result.to("cpu", non_blocking=True)
        assert host.device == torch.device("cpu")
        if how.endswith("synchronize"):
            done = sim.Event()
            done.record(compute)
            done.synchronize()
        torch.save(host, tmp_path / "result.pt")  # the host reads it
    pinned = sim._placement(host)
    assert pinned.placement == "host" and pinned.pinned == (how != "cpu()")
    if how == "to-cpu-non_blocking":
        (violation,) = sim.violations
        assert "read on host before its write on compute0 was waited for" in violation and "torch.save" in violation
    else:
        assert sim.violations == []


@pytest.mark.parametrize("pinned", [False, True])
def test_a_non_blocking_copy_into_pageable_host_memory_is_synchronous(pinned):
    """``host.copy_(device, non_blocking=True)``: asynchronous only into pinned memory; into pageable memory
    CUDA completes it before returning, so the host may read at once."""
    sim, compute, side = _sim()
    with sim:
        result = torch.ones(4).mul_(3)
        host = torch.empty(4)
        sim.place(host, "host", pinned=pinned)
        host.copy_(result, non_blocking=True)
        host.tolist()  # the host reads it
    assert bool(sim.violations) == pinned, sim.violations


@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_host_to_device_copy_from_pinned_memory_may_still_read_it(non_blocking):
    """``.to("cuda", non_blocking=True)`` from pinned memory reads it asynchronously: the host must not write
    it until the copy is known done; a blocking ``.to("cuda")`` returns once the copy is done."""
    sim, compute, side = _sim()
    with sim:
        host = torch.ones(4)
        sim.place(host, "host", pinned=True)
        on_device = host.to("cuda", non_blocking=non_blocking)
        assert on_device.is_cuda
        host.add_(1.0)  # the host writes the pinned source
    assert bool(sim.violations) == non_blocking, sim.violations


def test_the_host_cannot_read_device_memory_directly():
    """numpy() of a CUDA tensor raises on a GPU; the simulator reports it (CPU tensors would allow it)."""
    sim, compute, side = _sim()
    with sim:
        torch.ones(4).mul_(2).numpy()
    assert any("numpy() of a device tensor" in v for v in sim.violations), sim.violations


def test_to_another_tensor_goes_to_that_tensors_memory():
    sim, compute, side = _sim()
    with sim:
        on_device = torch.ones(4).mul_(2)
        host = torch.zeros(4)
        sim.place(host, "host")
        assert host.to(on_device).is_cuda and not on_device.to(host).is_cuda
    assert sim.violations == []
