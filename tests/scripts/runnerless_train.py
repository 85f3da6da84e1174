"""A plain accelerate script whose first import is accelerate (it imports torch: the harder order for
accel_flatshard_autoload), launched with ``accelerate launch --config_file <yaml> runnerless_train.py`` and no
runner.  Records (main process, ``--output_json``) which Accelerator ran, the distributed type, each rank's
trainable parameter elements after ``prepare`` and the model's total, and the losses of 3 steps.
"""
from accelerate import Accelerator  # noqa: I001 - first on purpose

import argparse
import json

import torch
import transformers


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_json", required=True)
    args = p.parse_args()
    accelerator = Accelerator()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    local = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1 + accelerator.process_index)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 16), generator=g).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    result = {"accelerator_class": f"{type(accelerator).__module__}.{type(accelerator).__name__}",
              "distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
              "total_numel": total, "local_numel": accelerator.gather_for_metrics([local], use_gather_object=True),
              "losses": losses}
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
