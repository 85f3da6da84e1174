"""Under ``accelerate launch`` (tests/test_plan.py): 3 optimizer steps of a saved Hugging Face config's model
through accel_flatshard's Accelerator, each of ``--gradient_accumulation_steps`` micro-batches of ``--batch_size``
x 128 tokens under ``accelerator.accumulate`` (``--sync_each_batch``: GradientAccumulationPlugin's); each rank's
peak of step 3 measured by torch's MemTracker (tests/plan_rows.py), and the warnings of the first forward
(prepare's memory check, given ``--device_memory`` as the free memory of the device) and of the later steps;
``--curve``: also each rank's bytes in use after every op of step 3 (``accel-flatshard plan --plot --measured``)."""
import argparse
import gc
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import GradientAccumulationPlugin
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plan_rows import _LimitedTracker  # noqa: E402

from accel_flatshard.integrations import accelerate as integration  # noqa: E402
from accel_flatshard.integrations.accelerate import Accelerator  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--out", required=True)
p.add_argument("--device_memory", type=int, default=2**40)
p.add_argument("--batch_size", type=int, default=8)
p.add_argument("--gradient_accumulation_steps", type=int, default=1)  # (an FSDP launch does not pass its flag on)
p.add_argument("--sync_each_batch", action="store_true")
p.add_argument("--curve", action="store_true", help="also write each rank's bytes in use after every op of step 3")
args = p.parse_args()
integration.available_bytes = lambda device: args.device_memory  # a device of this size (prepare checks only CUDA's)

torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(
    num_steps=args.gradient_accumulation_steps, sync_each_batch=args.sync_each_batch))
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randint(0, 256, (args.batch_size, 128))
y = x.clone()
caught = {}
for step in range(3):
    tracker = None
    if step == 2:
        tracker = _LimitedTracker(None)
        tracker.curve = [] if args.curve else None
        tracker.track_external(model, optimizer.optimizer, *[f.unsharded for f in model.flat_params], x, y)
    with warnings.catch_warnings(record=True) as caught[step], tracker or warnings.catch_warnings():
        warnings.simplefilter("always")
        for _ in range(args.gradient_accumulation_steps):
            with accelerator.accumulate(model):
                loss = model(input_ids=x, labels=y).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if tracker is not None:
                tracker.reset_mod_stats()  # (it refuses a second forward of the root otherwise)
peak = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
peaks = [None] * accelerator.num_processes
dist.all_gather_object(peaks, peak)
flatshard = lambda ws: [str(w.message) for w in ws if "accel_flatshard: predicted peak" in str(w.message)]  # noqa: E731
curves = [None] * accelerator.num_processes
if args.curve:
    dist.all_gather_object(curves, tracker.curve)
if accelerator.is_main_process:
    Path(args.out).write_text(json.dumps({"peak_bytes": peaks, "warnings_first_forward": flatshard(caught[0]),
                                          "warnings_later": flatshard(caught[1]) + flatshard(caught[2]),
                                          **({"curve": curves, "source": "the step under accelerate launch, "
                                              "torch's MemTracker (step 3)"} if args.curve else {})}))
# Exit cleanly (CI saw this script's rank 0 abort, rarely, after its work was done): free the tracker, the
# wrapped model and its optimizer while the interpreter is whole, then destroy the process group.
del tracker, model, optimizer, loss
gc.collect()
accelerator.end_training()
