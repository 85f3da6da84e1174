"""A Hugging Face ``Trainer`` run that resumes by itself: ``resume_from_checkpoint=True`` when the output directory
holds a complete checkpoint (tests/test_resume.py; ``FLATSHARD_ASYNC_SAVE=1`` writes its checkpoints in the
background).  Prints ``step <n> loss`` per optimizer step and ``resumed from <dir> at step <n>`` (main process);
writes the final full weights to ``<output_dir>/final`` with ``save_pretrained``.  ``--fsdp``: the Trainer's own
``TrainingArguments(fsdp=...)`` instead of an accelerate yaml (``torchrun -m accel_flatshard.run``).
"""
import argparse
import os

import accel_flatshard

accel_flatshard.register()  # before transformers.trainer is imported: the Trainer's Accelerator is ours

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from accel_flatshard.state import newest_complete_checkpoint  # noqa: E402


class Report(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step:
            print(f"resumed from {newest_complete_checkpoint(args.output_dir, 'checkpoint-')} at step "
                  f"{state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"step {state.global_step} loss", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fsdp", default=None, help="TrainingArguments(fsdp=...), e.g. 'full_shard auto_wrap' (no yaml)")
    args = p.parse_args()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 256, (args.steps * 8, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
                                 learning_rate=3e-3, save_strategy="steps", save_steps=2, save_total_limit=2,
                                 logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
                                 **({"fsdp": args.fsdp, "fsdp_config": {"transformer_layer_cls_to_wrap": ["GPT2Block"]}}
                                    if args.fsdp else {}))
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[Report()])
    resume = newest_complete_checkpoint(args.output_dir, "checkpoint-") is not None
    trainer.train(resume_from_checkpoint=True if resume else None)
    state = trainer.accelerator.get_state_dict(trainer.model)
    trainer.accelerator.unwrap_model(trainer.model).save_pretrained(
        os.path.join(args.output_dir, "final"), state_dict=state, is_main_process=trainer.accelerator.is_main_process)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
