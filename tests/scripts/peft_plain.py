"""LoRA (PEFT) with a plain accelerate loop, in the style of peft's ``peft_lora_clm_accelerate`` example.

Imports only accelerate / peft / transformers / torch.  Records per-step losses (mean over processes)
and saves the adapter twice: with ``save_pretrained(state_dict=accelerator.get_state_dict(model))`` into
``output_dir`` and, as most PEFT scripts do, without ``state_dict=`` (on every rank) into
``output_dir/no_state_dict``.
"""
import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from peft import get_peft_model
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_common import lm_dataset, lora_config, numel_info, tiny_model  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--output_json", required=True)
    args = p.parse_args()

    accelerator = Accelerator()
    model = get_peft_model(tiny_model("llama"), lora_config())
    data = lm_dataset(args.steps * 2 * accelerator.num_processes).with_format("torch")
    loader = DataLoader(data, batch_size=2, shuffle=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    model.train()
    for batch in loader:
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    info = numel_info(model)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    unwrapped.save_pretrained(os.path.join(args.output_dir, "no_state_dict"),
                              is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump({"losses": losses, "model_info": info, "unwrapped_class": type(unwrapped).__name__,
                       "distributed_type": str(accelerator.distributed_type)}, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
