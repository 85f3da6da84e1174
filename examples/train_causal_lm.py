#!/usr/bin/env python
"""Fine-tune / train a causal language model with accel_flatshard through Accelerate.

In the style of Hugging Face's ``run_clm_no_trainer.py``, offline and small by default:

* model: a preset built from a config object (``gpt2-tiny``, ``llama-tiny``) or a local directory
  written by ``save_pretrained``;
* data: plain-text files read through ``datasets`` (``--train_file`` / ``--validation_file``); by default
  the Python Language Reference that ships with the Python installation (``pydoc_data.topics``),
  written once to ``<output_dir>/corpus/``;
* tokenizer: a byte-level tokenizer built here (no download), or a local tokenizer directory;
* tokenise, group into blocks, train with gradient accumulation and clipping, evaluate perplexity,
  checkpoint every ``--checkpointing_steps``, resume with ``--resume_from_checkpoint``, and finish with
  ``save_pretrained`` (model and tokenizer) exactly as ``run_clm_no_trainer.py`` does (every rank calls it,
  no ``state_dict=``: the unwrapped model's ``state_dict()`` gathers the full one);
* last, a separate process (transformers only: it does not import accel_flatshard, accelerate's
  launcher environment removed) loads that directory with ``from_pretrained`` and prints its perplexity
  on the validation text, which equals the in-training evaluation (``--evaluate_saved_model DIR`` alone).

Run (2 CPU processes, really sharded)::

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/train_causal_lm.py
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from itertools import chain
from typing import Dict, List, Optional

import datasets
import torch
import transformers
from accelerate.logging import get_logger
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

logger = get_logger(__name__)
PRESETS = ("gpt2-tiny", "llama-tiny")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_name_or_path", default="gpt2-tiny",
                   help=f"a preset ({', '.join(PRESETS)}) or a local directory with config and weights")
    p.add_argument("--tokenizer_name", default=None, help="local tokenizer directory (default: byte-level, built here)")
    p.add_argument("--train_file", default=None, help="a .txt file (default: Python's own language reference)")
    p.add_argument("--validation_file", default=None)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=150, help="overrides num_train_epochs when set")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--lr_scheduler_type", default="cosine")
    p.add_argument("--num_warmup_steps", type=int, default=10)
    p.add_argument("--max_eval_samples", type=int, default=128)
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--output_dir", default="outputs/train_causal_lm")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpointing_steps", default=None, help="an integer (every n steps) or 'epoch'")
    p.add_argument("--resume_from_checkpoint", default=None, help="a directory written by --checkpointing_steps, or 'latest'")
    p.add_argument("--with_tracking", action="store_true", help="log metrics with the installed trackers")
    p.add_argument("--report_to", default="all")
    p.add_argument("--evaluate_saved_model", default=None, metavar="DIR",
                   help="only evaluate the model and tokenizer saved in DIR (one process, transformers only)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- data and tokenizer
def default_corpus(directory: str) -> Dict[str, str]:
    """Write the Python Language Reference (shipped with CPython as pydoc_data.topics) as train/validation text."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split it out
        raise SystemExit("pydoc_data is not installed with this Python; pass --train_file/--validation_file") from e
    os.makedirs(directory, exist_ok=True)
    files = {"train": os.path.join(directory, "train.txt"), "validation": os.path.join(directory, "validation.txt")}
    names = sorted(topics)
    parts = {"train": [t for i, t in enumerate(names) if i % 10 != 3],
             "validation": [t for i, t in enumerate(names) if i % 10 == 3]}
    for split, path in files.items():
        if not os.path.exists(path):
            tmp = f"{path}.tmp.{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("\n\n".join(topics[name] for name in parts[split]))
            os.replace(tmp, path)
    return files


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per byte (+ end-of-text): nothing to download or train, any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in sorted(_bytes_to_unicode().items())}
    vocab["<|endoftext|>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>", unk_token="<|endoftext|>")


def build_model(name: str, vocab_size: int, block_size: int) -> transformers.PreTrainedModel:
    if os.path.isdir(name):
        return transformers.AutoModelForCausalLM.from_pretrained(name)
    padded_vocab = (vocab_size + 63) // 64 * 64
    if name == "gpt2-tiny":
        config = transformers.GPT2Config(vocab_size=padded_vocab, n_positions=block_size, n_embd=128, n_layer=4,
                                         n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=256, eos_token_id=256)
    elif name == "llama-tiny":
        config = transformers.LlamaConfig(vocab_size=padded_vocab, hidden_size=128, intermediate_size=352,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=block_size, bos_token_id=256, eos_token_id=256,
                                          tie_word_embeddings=False)
    else:
        raise SystemExit(f"--model_name_or_path {name!r}: not a local directory nor one of {PRESETS}")
    return transformers.AutoModelForCausalLM.from_config(config)


def load_blocks(args, main_process_first, tokenizer) -> datasets.DatasetDict:
    """Text -> token blocks; ``main_process_first``: a context manager (accelerate's, or a no-op)."""
    if args.train_file:
        files = {"train": args.train_file}
        if args.validation_file:
            files["validation"] = args.validation_file
    else:
        with main_process_first():
            files = default_corpus(os.path.join(args.output_dir, "corpus"))
    raw = datasets.load_dataset("text", data_files=files, cache_dir=os.path.join(args.output_dir, "hf_cache"))
    if "validation" not in raw:
        raw = raw["train"].train_test_split(test_size=0.05, seed=args.seed)
        raw["validation"] = raw.pop("test")

    def tokenize(batch):
        return tokenizer([line + "\n" for line in batch["text"]])

    def group_texts(examples):
        # concatenate everything, cut into block_size pieces (the remainder is dropped)
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = len(concatenated["input_ids"]) // args.block_size * args.block_size
        result = {k: [t[i : i + args.block_size] for i in range(0, total, args.block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = [ids[:] for ids in result["input_ids"]]
        return result

    with main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], desc="tokenize")
        blocks = tokenized.map(group_texts, batched=True, desc=f"group into blocks of {args.block_size}")
    if args.max_eval_samples:
        blocks["validation"] = blocks["validation"].select(range(min(args.max_eval_samples, len(blocks["validation"]))))
    return blocks


# ---------------------------------------------------------------------- training
def evaluate(model, loader, accelerator) -> Dict[str, float]:
    model.eval()
    losses = []
    for batch in loader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(batch["input_ids"].shape[0])))
    losses = torch.cat(losses)
    eval_loss = torch.mean(losses).item()
    model.train()
    return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0))}


def perplexity_of_saved_model(args: argparse.Namespace) -> float:
    """Load ``args.evaluate_saved_model`` with ``from_pretrained`` (transformers alone, one process) and
    evaluate it on the validation blocks exactly as :func:`evaluate` does during training."""
    directory = args.evaluate_saved_model
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    blocks = load_blocks(args, contextlib.nullcontext, tokenizer)["validation"]
    blocks.set_format("torch")
    losses = []
    with torch.no_grad():
        for batch in DataLoader(blocks, batch_size=args.per_device_eval_batch_size):
            losses.append(model(**batch).loss.repeat(batch["input_ids"].shape[0]))
    return math.exp(min(torch.cat(losses).mean().item(), 50.0))


def check_saved_model_in_a_clean_process(directory: str, argv: List[str], in_training: float) -> None:
    """Run this script with ``--evaluate_saved_model`` in a fresh process without the launcher's
    distributed environment; print both perplexities and fail if they differ."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "MASTER_ADDR", "MASTER_PORT") and not k.startswith(("ACCELERATE_", "FSDP_", "TORCHELASTIC_"))}
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--evaluate_saved_model", directory]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"evaluating the saved model failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    reloaded = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"from_pretrained({directory!r}) in a clean process (accel_flatshard imported: "
          f"{reloaded['accel_flatshard_imported']}): perplexity {reloaded['perplexity']:.4f}; "
          f"in training: {in_training:.4f}")
    if abs(reloaded["perplexity"] - in_training) > 1e-4 * in_training:
        raise SystemExit(f"the saved model's perplexity {reloaded['perplexity']} differs from the in-training "
                         f"evaluation {in_training}: the saved file is not the trained model")


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.evaluate_saved_model:
        perplexity = perplexity_of_saved_model(args)
        print(json.dumps({"perplexity": perplexity, "accel_flatshard_imported": "accel_flatshard" in sys.modules}))
        return
    train(args, sys.argv[1:] if argv is None else argv)


def train(args: argparse.Namespace, argv: List[str]) -> None:
    from accelerate.utils import set_seed

    from accel_flatshard.integrations.accelerate import Accelerator

    kwargs = {"log_with": args.report_to, "project_dir": args.output_dir} if args.with_tracking else {}
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **kwargs)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.WARNING)
    logging.getLogger(__name__).setLevel(logging.INFO)  # this script's messages; libraries stay quiet
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer_name) if args.tokenizer_name else byte_tokenizer()
    model = build_model(args.model_name_or_path, len(tokenizer), args.block_size)
    blocks = load_blocks(args, accelerator.main_process_first, tokenizer)
    blocks.set_format("torch")
    train_loader = DataLoader(blocks["train"], shuffle=True, batch_size=args.per_device_train_batch_size)
    eval_loader = DataLoader(blocks["validation"], batch_size=args.per_device_eval_batch_size)

    no_decay = ("bias", "norm", "ln_")  # by name: the prepared model's parameters are flat shards
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if not any(k in n.lower() for k in no_decay)], "weight_decay": args.weight_decay},
         {"params": [p for n, p in named if any(k in n.lower() for k in no_decay)], "weight_decay": 0.0}],
        lr=args.learning_rate,
    )
    steps_per_epoch = math.ceil(len(train_loader) / accelerator.num_processes / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    scheduler = transformers.get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                                           num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                                           num_training_steps=args.max_train_steps * accelerator.num_processes)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    # the loader is sharded now: recompute
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    args.num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    if args.with_tracking:
        accelerator.init_trackers("train_causal_lm", {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})

    total_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"***** Running training: {len(blocks['train'])} blocks of {args.block_size} tokens, {args.num_train_epochs} "
                f"epoch(s), {args.max_train_steps} steps, total batch {total_batch} *****")
    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        path = args.resume_from_checkpoint
        if path == "latest":
            candidates = [d for d in os.listdir(args.output_dir) if d.startswith(("step_", "epoch_"))]
            path = os.path.join(args.output_dir, max(candidates, key=lambda d: os.path.getctime(os.path.join(args.output_dir, d))))
        accelerator.print(f"Resumed from checkpoint: {path}")
        accelerator.load_state(path)
        name = os.path.basename(os.path.normpath(path))
        if name.startswith("epoch_"):
            starting_epoch = int(name[len("epoch_"):]) + 1
            completed_steps = starting_epoch * steps_per_epoch
        else:
            micro_steps = int(name[len("step_"):]) * args.gradient_accumulation_steps
            starting_epoch = micro_steps // len(train_loader)
            completed_steps = micro_steps // args.gradient_accumulation_steps
            resume_step = micro_steps - starting_epoch * len(train_loader)

    progress = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process, desc="train")
    progress.update(completed_steps)
    start, log_loss, log_count, history = time.time(), 0.0, 0, []
    metrics: Dict[str, float] = {}
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        loader = train_loader
        if epoch == starting_epoch and resume_step is not None:
            loader = accelerator.skip_first_batches(train_loader, resume_step)  # same order as the first run
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                log_loss += loss.detach().float().item()
                log_count += 1
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            progress.update(1)
            if completed_steps % args.logging_steps == 0 or completed_steps == args.max_train_steps:
                mean = accelerator.reduce(torch.tensor(log_loss / max(log_count, 1), device=accelerator.device), "mean").item()
                history.append({"step": completed_steps, "loss": mean})
                progress.set_postfix(loss=f"{mean:.3f}")
                accelerator.print(f"step {completed_steps:4d}  loss {mean:.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                                  f"{time.time() - start:.0f}s")
                if args.with_tracking:
                    accelerator.log({"train_loss": mean, "lr": scheduler.get_last_lr()[0]}, step=completed_steps)
                log_loss, log_count = 0.0, 0
            if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= args.max_train_steps:
                break
        metrics = evaluate(model, eval_loader, accelerator)
        accelerator.print(f"epoch {epoch}: eval loss {metrics['eval_loss']:.4f}  perplexity {metrics['perplexity']:.2f}")
        if args.with_tracking:
            accelerator.log({**metrics, "epoch": epoch}, step=completed_steps)
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if completed_steps >= args.max_train_steps:
            break

    accelerator.wait_for_everyone()
    final_dir = os.path.join(args.output_dir, "final")
    unwrapped = accelerator.unwrap_model(model)
    # as run_clm_no_trainer.py: every rank calls it (the full state dict is gathered collectively)
    unwrapped.save_pretrained(final_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(final_dir)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({**metrics, "train_history": history, "train_seconds": time.time() - start}, f, indent=1)
    accelerator.print(f"saved {type(unwrapped).__name__} and tokenizer to {final_dir} ({time.time() - start:.0f}s)")
    if accelerator.is_main_process and metrics:
        check_saved_model_in_a_clean_process(final_dir, argv, metrics["perplexity"])
    accelerator.wait_for_everyone()
    if args.with_tracking:
        accelerator.end_training()  # last: it also destroys the process group


if __name__ == "__main__":
    try:
        main()
    finally:  # clean shutdown on normal exit and on errors: no rank leaves communicators open
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
