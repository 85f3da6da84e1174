"""TRL GRPOTrainer with a reference model (beta > 0) on a tiny untied Llama: generation, reward, KL to the
reference; records per-step losses and rewards.  GRPO builds its reference model from the policy's path, so
the tiny model is saved first (each process its own copy: same seed, no collective needed).

Run under accelerate DDP (reference) and via ``-m accel_flatshard.run`` with an FSDP yaml.
"""
import argparse
import os
import sys

import datasets
import torch.distributed as dist
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_common import LossRecorder, numel_info, preference_dataset, tiny_model, tiny_tokenizer, write_json  # noqa: E402


def length_reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--output_json", required=True)
    p.add_argument("--trainer", default="grpo", choices=["grpo", "rloo"])
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if args.trainer == "grpo" else (RLOOConfig, RLOOTrainer)

    init_dir = os.path.join(args.output_dir, f"init_rank{os.environ.get('RANK', '0')}")
    tiny_model("llama").save_pretrained(init_dir)
    prompts = datasets.Dataset.from_dict({"prompt": list(preference_dataset(32)["prompt"])})
    config = config_class(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2,
                        num_generations=2, max_completion_length=4, learning_rate=1e-3, logging_steps=1,
                        save_strategy="no", report_to="none", seed=0, data_seed=0, lr_scheduler_type="constant",
                        disable_tqdm=True, bf16=args.bf16, fp16=False, beta=0.1,
                        use_cpu=args.bf16)  # (TrainingArguments refuses bf16 without a GPU otherwise)
    recorder = LossRecorder()
    trainer = trainer_class(model=init_dir, reward_funcs=length_reward, args=config, train_dataset=prompts,
                          processing_class=tiny_tokenizer(), callbacks=[recorder])
    trainer.train()
    write_json(args.output_json, {
        "losses": recorder.losses, "rewards": [log.get("reward") for log in recorder.logs],
        "model_info": recorder.model_info, "ref_info": numel_info(trainer.ref_model),
        "ref_class": type(trainer.ref_model).__name__,
        "param_dtypes": sorted({str(q.dtype) for q in trainer.model.parameters()}),
        "seam_patched": getattr(type(trainer._dist).summon_full_params, "_accel_flatshard_patch", None) == "trl_summon_full_params",
    }, trainer.accelerator)
    if dist.is_initialized():
        dist.barrier()
    trainer.accelerator.end_training()  # destroys the process group (reference_runner.py keeps it)


if __name__ == "__main__":
    main()
