"""TRL DPOTrainer on a tiny untied Llama, with a separate reference model or with LoRA (no reference
model: the adapter is disabled for the reference pass), as a user writes it; records per-step losses.

Run under accelerate DDP (reference) and via ``-m accel_flatshard.run`` with an FSDP yaml.
"""
import argparse
import os
import sys

import torch.distributed as dist
from trl import DPOConfig, DPOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_common import LossRecorder, lora_config, numel_info, preference_dataset, tiny_model, tiny_tokenizer, write_json  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ref", choices=["ref", "lora"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--output_json", required=True)
    p.add_argument("--grad_accum", type=int, default=1)
    args = p.parse_args()

    config = DPOConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2,
                       learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                       data_seed=0, lr_scheduler_type="constant", disable_tqdm=True, max_length=32, beta=0.1,
                       bf16=False, fp16=False, gradient_accumulation_steps=args.grad_accum)
    recorder = LossRecorder()
    model = tiny_model("llama")
    kwargs = {}
    if args.mode == "ref":
        kwargs["ref_model"] = tiny_model("llama", seed=1)  # a different model: the reference matters
    else:
        kwargs["peft_config"] = lora_config()
    trainer = DPOTrainer(model=model, args=config, train_dataset=preference_dataset(64),
                         processing_class=tiny_tokenizer(), callbacks=[recorder], **kwargs)
    trainer.train()
    state = trainer.accelerator.state
    result = {"losses": recorder.losses, "logs": recorder.logs, "model_info": recorder.model_info,
              "distributed_type": str(state.distributed_type), "num_processes": state.num_processes,
              "train_runtime": trainer.state.log_history[-1].get("train_runtime")}
    if trainer.ref_model is not None:
        result["ref_info"] = numel_info(trainer.ref_model)
        result["ref_class"] = type(trainer.ref_model).__name__
    write_json(args.output_json, result, trainer.accelerator)
    if dist.is_initialized():
        dist.barrier()
    trainer.accelerator.end_training()  # destroys the process group (reference_runner.py keeps it)


if __name__ == "__main__":
    main()
