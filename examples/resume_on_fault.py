#!/usr/bin/env python
"""Train with asynchronous checkpoints and come back by itself after a rank dies.

The script checkpoints every ``--checkpointing_steps`` with ``accelerator.save_state()`` (automatic naming,
``total_limit=2``; ``async_save=True``: training goes on while the files are written) and, when it starts, loads the
newest *complete* checkpoint if there is one (``accelerator.load_state()``; a checkpoint whose save was
interrupted has no commit marker and is skipped).  Under ``--max_restarts`` torchrun's elastic agent restarts every
rank when one dies, so a fault costs at most the steps since the last complete checkpoint.  The yaml's own (static)
rendezvous needs no other flag: accel_flatshard gives each restart's process groups a key prefix of their own in the
agent's store (docs/checkpoints.md, "Restart after a fault")::

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml --max_restarts 3 \\
        examples/resume_on_fault.py --output_dir /tmp/fault_demo --steps 40 --step_delay 0.5

    # in another terminal, while it trains: kill one rank, watch the job print "resumed from ..." and go on
    kill -9 $(pgrep -f "resume_on_fault.py" | tail -1)

The final weights (``<output_dir>/final/model.safetensors``) equal an uninterrupted run's exactly: the model,
optimizer, scheduler, RNG and this script's progress (a registered checkpointing object) come back as saved, and
the data loader skips the batches already trained on.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict, List, Optional

import torch
import transformers
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

from accel_flatshard import Accelerator
from accel_flatshard.state import newest_complete_checkpoint


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_dir", required=True, help="checkpoints go to <output_dir>/checkpoints/checkpoint_<n>")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--checkpointing_steps", type=int, default=2)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sync_save", action="store_true", help="save_state writes the files before returning")
    p.add_argument("--step_delay", type=float, default=0.0, help="seconds to sleep per step (time to kill a rank)")
    return p.parse_args(argv)


class Progress:
    """The optimizer steps done, saved with every checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = state["step"]


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    config = ProjectConfiguration(project_dir=args.output_dir, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=config)
    set_seed(0)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * args.steps))
    tokens = torch.randint(0, 256, (args.steps * args.per_device_batch_size * accelerator.num_processes, 32),
                           generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=args.per_device_batch_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    checkpoints = os.path.join(args.output_dir, "checkpoints")
    if newest_complete_checkpoint(checkpoints) is not None:  # (incomplete ones are skipped)
        accelerator.load_state()  # the newest complete checkpoint_<n>; the next save continues the numbering
        accelerator.print(f"resumed from {newest_complete_checkpoint(checkpoints)} at step {progress.step}")
    model.train()
    for (batch,) in accelerator.skip_first_batches(loader, progress.step):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.step += 1
        accelerator.print(f"step {progress.step} loss {accelerator.gather(loss.detach()).mean().item():.6f}")
        if progress.step % args.checkpointing_steps == 0:
            accelerator.save_state(async_save=not args.sync_save)  # returns once the state is in host memory
        time.sleep(args.step_delay)
    state = accelerator.get_state_dict(model)  # collective; the full weights on the main process
    accelerator.unwrap_model(model).save_pretrained(os.path.join(args.output_dir, "final"), state_dict=state,
                                                    is_main_process=accelerator.is_main_process)
    accelerator.end_training()  # waits for the last checkpoint's background write


if __name__ == "__main__":
    main()
