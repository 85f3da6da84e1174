"""LoRA (PEFT) with ``transformers.Trainer`` on a tiny untied Llama; saves the adapter with
``trainer.save_model`` at the end.  Records per-step losses (Trainer's logged loss, mean over processes)."""
import argparse
import os
import sys

import torch.distributed as dist
import transformers
from peft import get_peft_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_common import LossRecorder, lm_dataset, lora_config, tiny_model, write_json  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--output_json", required=True)
    args = p.parse_args()

    targs = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, data_seed=0, lr_scheduler_type="constant",
        disable_tqdm=True, max_grad_norm=1.0, dataloader_num_workers=0)
    model = get_peft_model(tiny_model("llama"), lora_config())
    data = lm_dataset(64).map(lambda ex: {"labels": ex["input_ids"]})
    recorder = LossRecorder()
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[recorder],
                                   data_collator=transformers.default_data_collator)
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "final"))
    state = trainer.accelerator.state
    write_json(args.output_json, {"losses": recorder.losses, "model_info": recorder.model_info,
                                  "distributed_type": str(state.distributed_type)}, trainer.accelerator)
    if dist.is_initialized():
        dist.barrier()
    trainer.accelerator.end_training()  # destroys the process group (reference_runner.py keeps it)


if __name__ == "__main__":
    main()
