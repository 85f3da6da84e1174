"""TRL KTOTrainer with a separate reference model on a tiny untied Llama; records per-step losses.

Run under accelerate DDP (reference) and via ``-m accel_flatshard.run`` with an FSDP yaml.
"""
import argparse
import os
import sys

import datasets
import torch.distributed as dist
from trl import KTOConfig, KTOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_common import LossRecorder, numel_info, preference_dataset, tiny_model, tiny_tokenizer, write_json  # noqa: E402


def unpaired_dataset(n):
    pairs = preference_dataset(n)
    return datasets.Dataset.from_dict({
        "prompt": list(pairs["prompt"]) * 2, "completion": list(pairs["chosen"]) + list(pairs["rejected"]),
        "label": [True] * n + [False] * n,
    })


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--output_json", required=True)
    args = p.parse_args()

    config = KTOConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
                       learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                       data_seed=0, lr_scheduler_type="constant", disable_tqdm=True, max_length=32,
                       bf16=False, fp16=False)
    recorder = LossRecorder()
    trainer = KTOTrainer(model=tiny_model("llama"), ref_model=tiny_model("llama", seed=1), args=config,
                         train_dataset=unpaired_dataset(32), processing_class=tiny_tokenizer(), callbacks=[recorder])
    trainer.train()
    state = trainer.accelerator.state
    write_json(args.output_json, {
        "losses": recorder.losses, "model_info": recorder.model_info, "ref_info": numel_info(trainer.ref_model),
        "ref_class": type(trainer.ref_model).__name__, "distributed_type": str(state.distributed_type),
    }, trainer.accelerator)
    if dist.is_initialized():
        dist.barrier()
    trainer.accelerator.end_training()  # destroys the process group (reference_runner.py keeps it)


if __name__ == "__main__":
    main()
