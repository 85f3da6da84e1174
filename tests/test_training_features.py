"""Mixed precision, gradient accumulation, activation checkpointing and global grad-norm clipping,
each compared with a single-process reference."""
import pytest
import torch
import torch.distributed as dist

from accel_flatshard import FullyShardedDataParallel, MixedPrecision, transformer_auto_wrap_policy
from dist_helpers import spawn
from models import MODELS, batches, first_grads, global_mean, param_groups, train

TOL = 1e-6


def _wrap(model_name, **kwargs):
    model = MODELS[model_name]()
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **kwargs)


# ---------------------------------------------------------------------------- mixed precision
def _reference_mixed(model_name, dtype, steps, world_size):
    """Single process, same policy: fp32 master weights, forward/backward on a `dtype` copy, fp32 step."""
    master = MODELS[model_name]()
    compute = MODELS[model_name]().to(dtype)
    opt = torch.optim.AdamW(param_groups(master), lr=1e-3)
    losses = []
    for x in batches(steps, batch=2 * world_size):
        with torch.no_grad():
            for pc, pm in zip(compute.parameters(), master.parameters()):
                pc.copy_(pm)
        loss = compute(x, labels=x).loss
        loss.backward()
        for pc, pm in zip(compute.parameters(), master.parameters()):
            pm.grad = pc.grad.float()
            pc.grad = None
        opt.step()
        opt.zero_grad()
        losses.append(loss.float().item())
    return losses


def _mixed_worker(rank, world_size, model_name, dtype, steps):
    fp32 = _wrap(model_name)
    fp32(batches(1)[0][:1], labels=batches(1)[0][:1]).loss.backward()
    fp32_bytes = fp32.shard_group.bytes_gathered
    wrapped = _wrap(model_name, mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype))
    before = wrapped.shard_group.bytes_gathered
    wrapped(batches(1)[0][:1], labels=batches(1)[0][:1]).loss.backward()
    mp_bytes = wrapped.shard_group.bytes_gathered - before
    wrapped.zero_grad()
    losses = train(wrapped, batches(steps, batch=2 * world_size), rank, world_size)
    master_dtypes = {f.local_shard.dtype for f in wrapped.flat_params}
    grad_dtypes = {p.grad.dtype for p in wrapped.parameters() if p.grad is not None}
    return losses, fp32_bytes, mp_bytes, master_dtypes, grad_dtypes


@pytest.mark.parametrize("model_name,dtype", [("gpt2", torch.bfloat16), ("llama", torch.float16)])
def test_mixed_precision_matches_single_process_with_same_policy(model_name, dtype):
    steps = 6
    ref = _reference_mixed(model_name, dtype, steps, 2)
    for losses, fp32_bytes, mp_bytes, master_dtypes, _ in spawn(2, _mixed_worker, model_name, dtype, steps):
        # Tolerance: bf16/fp16 keep 8/11 mantissa bits (relative rounding 4e-3 / 5e-4).  The only difference
        # from the reference is the order of the low-precision gradient sum over 2 ranks, which moves the fp32
        # update by about one low-precision ulp of the gradient; 1e-2 on a loss of ~4.9 is well above that
        # and far below the change one skipped or doubled reduction causes.
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-2
        assert master_dtypes == {torch.float32}, "the local shard is the fp32 master copy"
        assert mp_bytes * 2 == fp32_bytes, "all-gather in 16-bit moves half the bytes of fp32"


def _scaler_worker(rank, world_size):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    wrapped = _wrap("llama", mixed_precision=MixedPrecision(param_dtype=torch.float16))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 10)
    x = batches(1, batch=2 * world_size)[0].chunk(world_size)[rank]
    before = [p.detach().clone() for p in wrapped.parameters()]
    scaler.scale(wrapped(x, labels=x).loss).backward()
    if rank == 1:  # an overflow on one rank only
        next(p for p in wrapped.parameters() if p.grad is not None and p.grad.numel()).grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(a, b) for a, b in zip(before, wrapped.parameters()))
    return skipped, scaler.get_scale()


def test_fp16_overflow_on_one_rank_skips_the_step_on_all_ranks():
    results = spawn(2, _scaler_worker)
    assert [r[0] for r in results] == [True, True]
    assert results[0][1] == results[1][1] == 2.0 ** 9


# ---------------------------------------------------------------------------- gradient accumulation
MICRO = 4


def _accumulate(model, data, rank, world_size, use_no_sync):
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    losses, grad_bytes = [], 0
    for global_batch in data:
        micro_batches = global_batch.chunk(world_size)[rank].chunk(MICRO)
        total = 0.0
        for i, mb in enumerate(micro_batches):
            last = i == MICRO - 1
            ctx = model.no_sync() if use_no_sync and not last else _null()
            with ctx:
                loss = model(mb, labels=mb).loss / MICRO
                loss.backward()
            total += loss.detach()
            if i == MICRO - 2:
                grad_bytes = max(grad_bytes, _grad_bytes(model))
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(total, world_size))
    return losses, grad_bytes


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _grad_bytes(model):
    n = 0
    for f in model.flat_params:
        if f.unsharded.grad is not None:
            n += f.unsharded.grad.numel() * f.unsharded.grad.element_size()
        if f.sharded_grad is not None:
            n += f.sharded_grad.numel() * f.sharded_grad.element_size()
    return n


def _accum_worker(rank, world_size, model_name, steps):
    results = {}
    for use_no_sync in (True, False):
        results[use_no_sync] = _accumulate(_wrap(model_name), batches(steps, batch=MICRO * world_size),
                                           rank, world_size, use_no_sync)
    return results


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_gradient_accumulation_with_and_without_no_sync_matches_the_concatenated_batch(model_name):
    steps, world_size = 4, 2
    ref = train(MODELS[model_name](), batches(steps, batch=MICRO * world_size))
    for results in spawn(world_size, _accum_worker, model_name, steps):
        for use_no_sync, (losses, _) in results.items():
            err = max(abs(a - b) for a, b in zip(losses, ref))
            assert err < TOL, f"no_sync={use_no_sync}: loss differs by {err:.3g}"
        no_sync_bytes, plain_bytes = results[True][1], results[False][1]
        assert plain_bytes * world_size == no_sync_bytes, (plain_bytes, no_sync_bytes)


# ---------------------------------------------------------------------------- activation checkpointing
def _checkpoint_worker(rank, world_size, model_name, how):
    data = batches(3, batch=2 * world_size)
    wrapped = _wrap(model_name)
    if how == "hf_reentrant":
        wrapped.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    elif how == "hf_non_reentrant":
        wrapped.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif how == "torch_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        block = type(wrapped.units[1].module)
        apply_activation_checkpointing(wrapped.module, check_fn=lambda m: isinstance(m, block))
    wrapped.train()
    grads = first_grads(wrapped, data[0], rank, world_size)
    losses = train(wrapped, data, rank, world_size)
    return grads, losses, all(not f.unsharded.untyped_storage().nbytes() for f in wrapped.flat_params)


@pytest.mark.parametrize("model_name,how", [("gpt2", "hf_reentrant"), ("llama", "hf_non_reentrant"),
                                            ("gpt2", "torch_wrapper")])
def test_activation_checkpointing_gives_the_same_loss_and_grads(model_name, how):
    ref_model = MODELS[model_name]()
    data = batches(3, batch=4)
    ref_grads = first_grads(ref_model, data[0])
    ref_losses = train(ref_model, data)
    grads, losses, all_freed = spawn(2, _checkpoint_worker, model_name, how)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
    scale = max(g.abs().max().item() for g in ref_grads.values())
    assert max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads) / scale < TOL
    assert all_freed


# ---------------------------------------------------------------------------- clipping
def _clip_worker(rank, world_size, fsdp_group_size, norm_type):
    wrapped = _wrap("llama", fsdp_group_size=fsdp_group_size)
    x = batches(1, batch=2 * world_size)[0]
    local = x.chunk(world_size)[rank]
    wrapped(local, labels=local).loss.backward()
    norm = wrapped.clip_grad_norm_(0.05, norm_type=norm_type)
    torch.optim.SGD(wrapped.parameters(), lr=1.0).step()
    with wrapped.summon_full_params():
        params = {k: v.clone() for k, v in wrapped.state_dict().items()}
    return norm.item(), params


@pytest.mark.parametrize("world_size,fsdp_group_size,norm_type", [(2, None, 2.0), (4, 2, 2.0), (2, None, float("inf"))])
def test_clip_grad_norm_is_the_global_norm(world_size, fsdp_group_size, norm_type):
    ref = MODELS["llama"]()
    x = batches(1, batch=2 * world_size)[0]
    ref(x, labels=x).loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type).item()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    ref_params = ref.state_dict()
    for norm, params in spawn(world_size, _clip_worker, fsdp_group_size, norm_type):
        assert abs(norm - ref_norm) / ref_norm < 1e-6, (norm, ref_norm)
        assert max((params[k] - ref_params[k]).abs().max().item() for k in ref_params) < 1e-6
