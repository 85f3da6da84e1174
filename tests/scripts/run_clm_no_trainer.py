"""A faithful, offline copy of Hugging Face's ``examples/pytorch/language-modeling/run_clm_no_trainer.py``.

Same accelerate usage, same control flow (argument names, optimizer groups, scheduler, gradient
accumulation, ``--checkpointing_steps`` / ``--resume_from_checkpoint``, evaluation with
``gather_for_metrics``, perplexity) and the same save tail::

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save)

What differs, because there is no internet: the model is built from a small GPT-2 config (no
download), the text is made here (token ids of a small repeating grammar), there is no tokenizer to
save.  It imports no accel_flatshard: the tests run it under accelerate DDP and through
``-m accel_flatshard.run`` with an FSDP config.

Test-only additions after the HF tail (off by default), the other ways people save a model:
``--save_model_dir`` (``accelerator.save_model``), ``--torch_save_path`` (``torch.save`` of
``unwrap_model(model).state_dict()`` taken on every rank, written by the main process),
``--get_state_dict_dir`` (``save_pretrained(state_dict=accelerator.get_state_dict(model))``) and
``--main_only_dir`` (``save_pretrained`` under ``if accelerator.is_main_process:``, timed, its error
recorded).  ``--results_json``: perplexity, losses and those records (main process).
"""
import argparse
import json
import math
import os
import time

import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import GPT2Config, AutoModelForCausalLM, default_data_collator, get_scheduler

logger = get_logger(__name__)
VOCAB = 96


def parse_args():
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a causal language modeling task")
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=1)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    # test-only additions (see the module docstring)
    parser.add_argument("--save_model_dir", type=str, default=None)
    parser.add_argument("--torch_save_path", type=str, default=None)
    parser.add_argument("--get_state_dict_dir", type=str, default=None)
    parser.add_argument("--main_only_dir", type=str, default=None)
    parser.add_argument("--results_json", type=str, default=None)
    return parser.parse_args()


def make_datasets(block_size: int, seed: int) -> datasets.DatasetDict:
    """Token ids of a small grammar (learnable), grouped into blocks like run_clm's group_texts."""
    g = torch.Generator().manual_seed(seed)
    words = [torch.randint(1, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (20,), generator=g)]
    stream = []
    for i in torch.randint(0, len(words), (1400,), generator=g).tolist():
        stream += words[i] + [0]
    blocks = [stream[i : i + block_size] for i in range(0, len(stream) // block_size * block_size, block_size)]
    split = len(blocks) * 9 // 10
    make = lambda b: datasets.Dataset.from_dict({"input_ids": b, "attention_mask": [[1] * block_size] * len(b),
                                                 "labels": [x[:] for x in b]})
    return datasets.DatasetDict(train=make(blocks[:split]), validation=make(blocks[split:]))


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_error()
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process:
        if args.output_dir is not None:
            os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    lm_datasets = make_datasets(args.block_size, args.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=args.block_size, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)

    train_dataset = lm_datasets["train"]
    eval_dataset = lm_datasets["validation"]
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps
        if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0
    starting_epoch = 0
    resume_step = None
    losses_per_step = []
    if args.resume_from_checkpoint:
        checkpoint_path = args.resume_from_checkpoint
        path = os.path.basename(args.resume_from_checkpoint)
        accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
        accelerator.load_state(checkpoint_path)
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
            starting_epoch = resume_step // len(train_dataloader)
            completed_steps = resume_step // args.gradient_accumulation_steps
            resume_step -= starting_epoch * len(train_dataloader)
    progress_bar.update(completed_steps)

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                losses_per_step.append(accelerator.reduce(loss.detach(), "mean").item())
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
            if isinstance(checkpointing_steps, int):
                if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                    output_dir = f"step_{completed_steps}"
                    if args.output_dir is not None:
                        output_dir = os.path.join(args.output_dir, output_dir)
                    accelerator.save_state(output_dir)
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        if args.checkpointing_steps == "epoch":
            output_dir = f"epoch_{epoch}"
            if args.output_dir is not None:
                output_dir = os.path.join(args.output_dir, output_dir)
            accelerator.save_state(output_dir)

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
        )
        if accelerator.is_main_process:
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump({"perplexity": perplexity}, f)

    # ---- test-only additions: the other ways people save a model
    records = {"perplexity": perplexity, "eval_loss": eval_loss.item(), "losses": losses_per_step}
    if args.save_model_dir:
        accelerator.save_model(model, args.save_model_dir)
    if args.torch_save_path:
        state_dict = accelerator.unwrap_model(model).state_dict()
        if accelerator.is_main_process:
            torch.save(state_dict, args.torch_save_path)
    if args.get_state_dict_dir:
        accelerator.unwrap_model(model).save_pretrained(
            args.get_state_dict_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
            state_dict=accelerator.get_state_dict(model))
    if args.main_only_dir:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            start = time.time()
            try:
                accelerator.unwrap_model(model).save_pretrained(args.main_only_dir)
                records["main_only"] = {"error": None, "seconds": time.time() - start}
            except Exception as e:  # recorded for the test; a real script would stop here
                records["main_only"] = {"error": f"{type(e).__name__}: {e}", "seconds": time.time() - start}
        accelerator.wait_for_everyone()
    if args.results_json and accelerator.is_main_process:
        with open(args.results_json, "w") as f:
            json.dump(records, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
