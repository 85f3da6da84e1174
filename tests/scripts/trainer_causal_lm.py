"""A plain Hugging Face ``Trainer`` script (it imports only transformers / datasets / torch).

The tests run it unmodified under accelerate's DDP (reference) and through
``accelerate launch --config_file <fsdp yaml> -m accel_flatshard.run`` and compare what it records in
``--output_json`` (written by the main process):

* ``losses``: the training loss of every optimizer step (``logging_steps=1``; the Trainer averages it
  over processes);
* ``world_size`` / ``parallel_mode``: what the Trainer's ``TrainingArguments`` see; ``parallelism``: the
  accelerator's ``parallelism_config`` sizes; ``global_batch``: the Trainer's total train batch size;
* ``local_trainable_numel`` (one entry per rank): elements of the trainable parameters this rank holds
  (``numel`` of ``model.parameters()`` after training: a rank's shard when sharded, everything otherwise)
  and ``total_trainable_numel``: the model's size before training;
* ``world_size_before_trainer``: ``TrainingArguments.world_size`` before the Trainer exists; ``main_was_first``
  (per rank): whether the main process had finished its ``main_process_first`` block when this rank entered it;
* ``final_dir``: where ``trainer.save_model`` wrote the final model (FULL_STATE_DICT for the final save,
  as the transformers docs advise for FSDP, unless ``--final_save_as_configured``), to be loaded with
  ``from_pretrained``; ``state_dict_type`` (``_after_final_save``): the plugin's, before and after it;
* ``--fsdp`` / ``--fsdp_version``: the Trainer's own ``TrainingArguments(fsdp=..., fsdp_config=...)`` (no yaml);
* ``best_model_checkpoint`` / ``eval_loss_after`` with ``--load_best_model_at_end``;
* ``--optim``: ``TrainingArguments(optim=...)``, e.g. ``adamw_bnb_8bit``.
"""
import argparse
import json
import os
import time

import datasets
import torch
import transformers
from transformers import Trainer, TrainingArguments

VOCAB, SEQ = 128, 16


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--output_json", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    p.add_argument("--save_only_model", action="store_true")
    p.add_argument("--resume_from", default=None, help="checkpoint directory to resume from")
    p.add_argument("--load_best_model_at_end", action="store_true")
    p.add_argument("--final_dir", default=None, help="trainer.save_model(final_dir) after training")
    p.add_argument("--stop_after", type=int, default=None, help="stop training after this many steps")
    p.add_argument("--torch_compile", action="store_true", help="TrainingArguments(torch_compile=True), use_cache=False")
    p.add_argument("--fsdp", default=None, help="TrainingArguments(fsdp=...), e.g. 'full_shard auto_wrap' (no yaml)")
    p.add_argument("--fsdp_version", type=int, default=None, help="with --fsdp: fsdp_config['version']")
    p.add_argument("--optim", default=None, help="TrainingArguments(optim=...), e.g. adamw_bnb_8bit")
    p.add_argument("--final_save_as_configured", action="store_true",
                   help="final save_model() without switching to FULL_STATE_DICT first")
    return p.parse_args()


def build_model(use_cache=True):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                      tie_word_embeddings=False, use_cache=use_cache)
    return transformers.LlamaForCausalLM(config)


def token_dataset(n, seed):
    datasets.disable_progress_bars()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    ds.set_format("torch")
    return ds


class StopAfter(transformers.TrainerCallback):
    """Ends training after a given step (as a crash would), leaving the checkpoints written so far."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if self.step is not None and state.global_step >= self.step:
            control.should_training_stop = True
        return control


def main():
    args = parse_args()
    model = build_model(use_cache=not args.torch_compile)
    total_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    evaluate = args.load_best_model_at_end
    fsdp = {}
    if args.fsdp:
        fsdp = {"fsdp": args.fsdp, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
        if args.fsdp_version is not None:
            fsdp["fsdp_config"]["version"] = args.fsdp_version
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_only_model=args.save_only_model,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=args.save_steps or None,
        load_best_model_at_end=args.load_best_model_at_end,
        metric_for_best_model="eval_loss" if evaluate else None,
        greater_is_better=False if evaluate else None,
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
        torch_compile=args.torch_compile,
        **({"optim": args.optim} if args.optim else {}),
        **fsdp,
    )
    world_size_before_trainer = training_args.world_size
    # main_process_first must hold the other ranks until the main one is done (datasets' map cache relies on it)
    marker = args.output_json + ".main_first"
    os.makedirs(os.path.dirname(os.path.abspath(marker)), exist_ok=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # both ranks reach the block together: only its own wait can order them
    with training_args.main_process_first(desc="marker"):
        if int(os.environ.get("RANK", "0")) == 0:
            time.sleep(2.0)
            open(marker, "w").close()
        main_was_first = os.path.exists(marker)
    global_batch = args.per_device_batch_size * args.gradient_accumulation_steps * training_args.world_size
    train_ds = token_dataset(args.steps * global_batch, seed=1)
    eval_ds = token_dataset(2 * args.per_device_batch_size * training_args.world_size, seed=2)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_ds,
                      eval_dataset=eval_ds if evaluate else None, callbacks=[StopAfter(args.stop_after)])
    trainer.train(resume_from_checkpoint=args.resume_from)

    pc = getattr(trainer.accelerator, "parallelism_config", None)
    local_numel = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result = {
        "world_size": training_args.world_size,
        "world_size_before_trainer": world_size_before_trainer,
        "main_was_first": trainer.accelerator.gather_for_metrics([main_was_first], use_gather_object=True),
        "state_dict_type": str(trainer.accelerator.state.fsdp_plugin.state_dict_type) if trainer.is_fsdp_enabled else None,
        "reshard_after_forward": getattr(getattr(trainer.accelerator, "flatshard_options", None), "reshard_after_forward",
                                         None),
        "parallel_mode": str(training_args.parallel_mode),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "parallelism": None if pc is None else [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size],
        "global_batch": trainer.get_total_train_batch_size(training_args)
        if hasattr(trainer, "get_total_train_batch_size") else global_batch,
        "is_fsdp2": bool(getattr(trainer.accelerator, "is_fsdp2", False)),
        "accelerator_class": f"{type(trainer.accelerator).__module__}.{type(trainer.accelerator).__name__}",
        "total_trainable_numel": total_numel,
        "local_trainable_numel": trainer.accelerator.gather_for_metrics([local_numel], use_gather_object=True),
        "losses": {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e},
        "global_step": trainer.state.global_step,
        "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],  # > 0: something was compiled
        "best_model_checkpoint": trainer.state.best_model_checkpoint,
        "checkpoints": sorted(d for d in os.listdir(args.output_dir) if d.startswith("checkpoint-"))
        if os.path.isdir(args.output_dir) else [],
    }
    if evaluate:  # history first: the evaluation below is logged at the last step too
        result["eval_history"] = {str(e["step"]): e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
        result["eval_loss_after"] = trainer.evaluate()["eval_loss"]
    if args.final_dir:
        if trainer.is_fsdp_enabled and not args.final_save_as_configured:
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(args.final_dir)
        result["final_dir"] = args.final_dir
        if trainer.is_fsdp_enabled:
            result["state_dict_type_after_final_save"] = str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
    if trainer.accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # destroys the process group: no rank exits with gloo threads running


if __name__ == "__main__":
    main()
