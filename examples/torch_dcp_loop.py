#!/usr/bin/env python
"""A torchtitan-style loop: checkpoints with torch's own state-dict API and DCP, no accel_flatshard call.

Saves with ``dcp.save(get_state_dict(model, optimizer))`` (or ``dcp.async_save``: training goes on while the files
are written) and resumes with ``dcp.load`` into ``get_state_dict``'s result + ``set_state_dict``, as code written for
torch FSDP does.  On the prepared model each rank's state dict holds ShardedTensors of its own pieces (no gather),
and the checkpoint is DCP's standard format: it loads at another world size, or into a plain model::

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/torch_dcp_loop.py \\
        --output_dir /tmp/dcp_demo --steps 6 --checkpointing_steps 3 --async_save
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/torch_dcp_loop.py \\
        --output_dir /tmp/dcp_demo --steps 6 --resume_from /tmp/dcp_demo/step-3

The resumed run prints the same losses for steps 4..6 as the first run.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from accelerate.utils import set_seed
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from accel_flatshard import Accelerator


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_dir", required=True, help="checkpoints go to <output_dir>/step-<n>")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--checkpointing_steps", type=int, default=3)
    p.add_argument("--async_save", action="store_true", help="dcp.async_save instead of dcp.save")
    p.add_argument("--resume_from", default=None, help="a checkpoint directory written by this script")
    p.add_argument("--per_device_batch_size", type=int, default=4)
    return p.parse_args(argv)


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator()
    set_seed(0)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    world, rank = accelerator.num_processes, accelerator.process_index
    tokens = torch.randint(0, 256, (args.steps, args.per_device_batch_size * world, 32),
                           generator=torch.Generator().manual_seed(0))

    step = 0
    if args.resume_from:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # the targets: this rank's pieces
        state = {"model": model_sd, "optim": optim_sd, "train": {"step": torch.tensor(0)}}
        dcp.load(state, checkpoint_id=args.resume_from)  # reads only what overlaps them (any saving world size)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(state["train"]["step"])
        accelerator.print(f"resumed from {args.resume_from} at step {step}")

    # the background save runs its own collectives: a process group of its own, not the one training uses
    save_group = dist.new_group(backend="gloo") if args.async_save else None
    pending = None
    model.train()
    while step < args.steps:
        batch = tokens[step].chunk(world)[rank]
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        accelerator.print(f"step {step} loss {accelerator.gather(loss.detach()).mean().item():.8f}")
        if step % args.checkpointing_steps == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "train": {"step": torch.tensor(step)}}
            path = os.path.join(args.output_dir, f"step-{step}")
            if pending is not None:
                pending.result()  # one save in flight at a time
            if args.async_save:
                # returns once the state is copied to host memory; (torch 2.13's default stager deep-copies tensors and
                # does not know ShardedTensor: BlockingAsyncStager copies them with torch's state-dict utilities)
                pending = dcp.async_save(state, checkpoint_id=path, async_stager=BlockingAsyncStager(),
                                         process_group=save_group)
            else:
                dcp.save(state, checkpoint_id=path)
            accelerator.print(f"saved {path}")
    if pending is not None:
        pending.result()
    accelerator.end_training()


if __name__ == "__main__":
    main()
