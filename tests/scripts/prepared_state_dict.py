"""The prepared model's own ``state_dict()`` / ``load_state_dict()`` in a plain accelerate loop (unchanged
between DDP and accel_flatshard, as users write it for torch FSDP, whose default is the full state dict).

1. two training steps, then ``accelerator.save(model.state_dict(), path)`` on every rank;
2. the same call under ``if accelerator.is_main_process:`` only (timed; any error recorded);
3. the loss on a fixed batch, two more steps, then ``model.load_state_dict(sd)`` with the saved dict on every
   rank: the loss on the batch again, and one more step's loss; then the same with the dict on rank 0 only
   (``{}`` elsewhere; under DDP, which cannot do that, on every rank again).
"""
import argparse
import json
import os
import sys
import time

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import gpt2  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    args = p.parse_args()
    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    model = gpt2(seed=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2 * world, 16), generator=g) for _ in range(6)]
    probe = torch.randint(0, 64, (2, 16), generator=g)

    def step(i):
        ids = batches[i].chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return accelerator.reduce(loss.detach(), "mean").item()

    def probe_loss():
        with torch.no_grad():
            return model(input_ids=probe, labels=probe).loss.item()

    out = {"losses": [step(0), step(1)]}
    path = os.path.join(args.output_dir, "prepared_state_dict.pt")
    accelerator.save(model.state_dict(), path)  # every rank; the main process writes
    accelerator.wait_for_everyone()

    error, start = None, time.time()
    if accelerator.is_main_process:
        try:
            model.state_dict()
        except RuntimeError as e:
            error = str(e)
    out["main_only"] = {"error": error, "seconds": time.time() - start}
    accelerator.wait_for_everyone()

    out["probe_saved"] = probe_loss()
    out["losses"] += [step(2), step(3)]
    out["probe_trained"] = probe_loss()
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved)  # every rank passes the full dict
    out["probe_loaded_every_rank"] = probe_loss()
    out["step_after_load"] = step(4)
    # rank 0 only, the other ranks pass {} (what model.state_dict() gave them); DDP needs the dict everywhere
    rank0_only = hasattr(model, "load_local_state_dict")
    model.load_state_dict(saved if accelerator.is_main_process or not rank0_only else {})
    out["probe_loaded_rank0"] = probe_loss()
    out["step_after_rank0_load"] = step(5)
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(out, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy the process group before exit


if __name__ == "__main__":
    main()
