"""TRL SFTTrainer on a tiny untied Llama (or tied GPT-2), as a user writes it; records per-step losses.

Run under accelerate DDP (reference) and via ``-m accel_flatshard.run`` with an FSDP yaml.
"""
import argparse
import os
import sys

import torch.distributed as dist
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_common import LossRecorder, lm_dataset, tiny_model, tiny_tokenizer, write_json  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--output_json", required=True)
    p.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    p.add_argument("--resume_from", default=None, help="checkpoint directory to resume from")
    p.add_argument("--save_final", action="store_true", help="trainer.save_model(output_dir/final) at the end")
    args = p.parse_args()

    config = SFTConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2,
                       gradient_accumulation_steps=1, learning_rate=1e-3, logging_steps=1,
                       save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                       report_to="none", max_length=32, seed=0, data_seed=0, dataloader_num_workers=0,
                       lr_scheduler_type="constant", disable_tqdm=True, bf16=False, fp16=False)
    recorder = LossRecorder()
    trainer = SFTTrainer(model=tiny_model(args.model), args=config, train_dataset=lm_dataset(64),
                         processing_class=tiny_tokenizer(), callbacks=[recorder])
    trainer.train(resume_from_checkpoint=args.resume_from)
    if args.save_final:
        if trainer.is_fsdp_enabled:  # the transformers docs' advice for a final FSDP save
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(os.path.join(args.output_dir, "final"))
    state = trainer.accelerator.state
    write_json(args.output_json, {
        "losses": recorder.losses, "model_info": recorder.model_info,
        "distributed_type": str(state.distributed_type), "num_processes": state.num_processes,
        "accelerator_class": type(trainer.accelerator).__module__ + "." + type(trainer.accelerator).__name__,
    }, trainer.accelerator)
    if dist.is_initialized():
        dist.barrier()
    trainer.accelerator.end_training()  # destroys the process group (reference_runner.py keeps it)


if __name__ == "__main__":
    main()
