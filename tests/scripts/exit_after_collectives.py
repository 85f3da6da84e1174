"""A rank that built a ShardGroup and ran many asynchronous gloo all-reduces (as clipping, the error agreement and
the replica all-reduce do), then returns at once without destroy_process_group: the shape of a training script's
end.  Launched with torchrun by tests/test_exit.py."""
import torch
import torch.distributed as dist

from accel_flatshard.core.comm import ShardGroup

dist.init_process_group("gloo")
group = ShardGroup()
for _ in range(200):
    total = torch.ones(1 << 14)
    dist.all_reduce(total, group=group.shard_group, async_op=True).wait()
    del total
