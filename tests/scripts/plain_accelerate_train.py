"""A plain Accelerate training script in the style of Hugging Face's ``*_no_trainer.py`` examples.

It imports only accelerate / transformers / datasets / torch: the tests run it unmodified under
accelerate's DDP (reference) and through ``python -m accel_flatshard.run`` under an FSDP config, and
compare what it records (``--output_json``, written by the main process):

* ``losses`` / ``grad_norms``: one per optimizer step (mean over micro-batches and processes);
* ``resumed``: for each ``--resume_from`` directory, the losses of the steps after the checkpoint;
* ``eval``: sample count seen through ``gather_for_metrics`` and the mean eval loss;
* ``logits``: the trained model's logits on a fixed input (to compare with ``from_pretrained``).
"""
import argparse
import json
import math
import os

import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DistributedType, ProjectConfiguration, gather_object
from torch.utils.data import DataLoader

VOCAB, SEQ = 128, 16


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--model_dir", default=None, help="load with from_pretrained from this local directory")
    p.add_argument("--no_cache", action="store_true", help="config.use_cache = False (torch.compile: no per-layer recompiles)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--max_grad_norm", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prepare_style", default="together", choices=["together", "reversed", "optimizer_after"])
    p.add_argument("--sync_each_batch", action="store_true")
    p.add_argument("--save_at", type=int, default=None, help="optimizer step after which to save_state")
    p.add_argument("--save", nargs="*", default=[], help="TYPE=DIR pairs, TYPE in FULL_STATE_DICT/SHARDED_STATE_DICT")
    p.add_argument("--resume_from", nargs="*", default=[], help="directories saved at --save_at to resume from")
    p.add_argument("--auto_ckpt_dir", default=None, help="automatic_checkpoint_naming, total_limit=2; saves at 2, 4, 6")
    p.add_argument("--save_pretrained_dir", default=None)
    p.add_argument("--save_model_dir", default=None, help="accelerator.save_model(model, dir)")
    p.add_argument("--output_json", required=True)
    return p.parse_args(argv)


class StepCounter:
    """A custom object registered for checkpointing."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def build_model(args):
    transformers.logging.set_verbosity_error()
    if args.model_dir:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model_dir)
    torch.manual_seed(args.seed)
    if args.model == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config.use_cache = not args.no_cache
    return transformers.AutoModelForCausalLM.from_config(config)


def token_dataset(n, seed):
    datasets.disable_progress_bars()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    ds = ds.map(lambda ex: {"labels": ex["input_ids"]})
    ds.set_format("torch")
    return ds


def optimizer_for(model, lr):
    no_decay = ("bias", "ln_", "norm")  # by name: parameters may be flattened/sharded by the backend
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def layout(accelerator):
    """What accelerate reports of the data-parallel layout (parallelism_config sizes, device-mesh dimensions)."""
    pc, mesh = accelerator.parallelism_config, accelerator.torch_device_mesh
    return {"parallelism": None if pc is None else [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size],
            "mesh_dims": None if mesh is None else list(mesh.mesh_dim_names)}


def main(argv=None, accelerator_cls=None):
    args = parse_args(argv)
    project_config = None
    if args.auto_ckpt_dir:
        project_config = ProjectConfiguration(project_dir=args.auto_ckpt_dir, automatic_checkpoint_naming=True,
                                              total_limit=2)
    kwargs = {"gradient_accumulation_steps": args.gradient_accumulation_steps}
    if args.sync_each_batch:
        from accelerate.utils import GradientAccumulationPlugin

        kwargs = {"gradient_accumulation_plugin": GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_each_batch=True)}
    accelerator = (accelerator_cls or Accelerator)(project_config=project_config, **kwargs)

    model = build_model(args)
    # with fsdp_cpu_ram_efficient_loading, from_pretrained leaves ranks > 0 on the meta device
    meta_params = gather_object([sum(int(p.is_meta) for p in model.parameters())])
    micro_per_rank = args.steps * args.gradient_accumulation_steps
    train_ds = token_dataset(micro_per_rank * args.per_device_batch_size * accelerator.num_processes, seed=1)
    eval_ds = token_dataset(10, seed=2)  # not a multiple of the global batch: gather_for_metrics trims
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch_size, shuffle=False)
    eval_dl = DataLoader(eval_ds, batch_size=args.per_device_batch_size, shuffle=False)

    def make_scheduler(opt):
        return transformers.get_scheduler("linear", optimizer=opt, num_warmup_steps=2,
                                          num_training_steps=args.steps * accelerator.num_processes)

    if args.prepare_style == "together":
        optimizer = created_optimizer = optimizer_for(model, args.lr)
        scheduler = make_scheduler(optimizer)
        model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    elif args.prepare_style == "reversed":
        optimizer = created_optimizer = optimizer_for(model, args.lr)
        scheduler = make_scheduler(optimizer)
        scheduler, eval_dl, train_dl, optimizer, model = accelerator.prepare(scheduler, eval_dl, train_dl, optimizer, model)
    else:  # optimizer made from the prepared model
        model = accelerator.prepare(model)
        optimizer = created_optimizer = optimizer_for(model, args.lr)
        scheduler = make_scheduler(optimizer)
        optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(optimizer, train_dl, eval_dl, scheduler)

    raw_optimizer = optimizer.optimizer
    model_params = {id(p) for p in model.parameters()}
    links = {  # prepare keeps the optimizer object, its parameters are the model's, the scheduler drives it
        "optimizer_is_original": raw_optimizer is created_optimizer and scheduler.scheduler.optimizer is created_optimizer,
        "optimizer_params_in_model": all(id(p) in model_params for g in raw_optimizer.param_groups for p in g["params"]),
        "optimizer_param_count": sum(len(g["params"]) for g in raw_optimizer.param_groups),
    }

    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    hook_calls = {"save": 0, "load": 0}
    accelerator.register_save_state_pre_hook(lambda models, weights, out: hook_calls.__setitem__("save", hook_calls["save"] + 1))
    accelerator.register_load_state_pre_hook(lambda models, inp: hook_calls.__setitem__("load", hook_calls["load"] + 1))

    def train(first_step, loader):
        losses, norms, micro = [], [], []
        step = first_step
        model.train()
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                micro.append(accelerator.gather(loss.detach()).mean().item())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    norms.append(float(norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                counter.count += 1
                losses.append(sum(micro) / len(micro))
                micro = []
                if args.save_at is not None and step == args.save_at:
                    for pair in args.save:
                        kind, directory = pair.split("=", 1)
                        if accelerator.distributed_type == DistributedType.FSDP:
                            accelerator.state.fsdp_plugin.set_state_dict_type(kind)
                        accelerator.save_state(directory)
                if args.auto_ckpt_dir and step in (2, 4, 6):
                    accelerator.save_state()
                if step >= args.steps:
                    break
        return losses, norms

    result = {"num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
              "accelerator_class": f"{type(accelerator).__module__}.{type(accelerator).__name__}",
              "model_class": type(accelerator.unwrap_model(model)).__name__, "meta_params_per_rank": meta_params,
              "links": links, **layout(accelerator)}
    if args.resume_from:
        result["resumed"] = []
        for directory in args.resume_from:
            accelerator.load_state(directory)
            loaded_count = counter.count
            skipped = accelerator.skip_first_batches(train_dl, args.save_at * args.gradient_accumulation_steps)
            losses, norms = train(args.save_at, skipped)
            result["resumed"].append({"dir": directory, "losses": losses, "grad_norms": norms,
                                      "counter_after_load": loaded_count})
    else:
        result["losses"], result["grad_norms"] = train(0, train_dl)

    # evaluation: every sample counted once through gather_for_metrics
    model.eval()
    seen, total = 0, 0.0
    with torch.no_grad():
        for batch in eval_dl:
            loss = model(**batch).loss
            per_sample = accelerator.gather_for_metrics(loss.detach().repeat(batch["input_ids"].shape[0]))
            seen += per_sample.numel()
            total += per_sample.sum().item()
        logits = model(input_ids=torch.arange(SEQ).unsqueeze(0) % VOCAB).logits.float()
    result["eval"] = {"samples": seen, "loss": total / max(seen, 1), "perplexity": math.exp(total / max(seen, 1))}
    result["logits"] = logits[0, :4, :8].tolist()
    result["logits_full_sum"] = float(logits.double().sum())
    result["hook_calls"] = hook_calls
    result["dynamo_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # > 0: something was compiled

    if args.save_pretrained_dir:
        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(args.save_pretrained_dir, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
        result["saved_class"] = type(unwrapped).__name__
    if args.save_model_dir:
        accelerator.save_model(model, args.save_model_dir)

    if args.auto_ckpt_dir:
        accelerator.wait_for_everyone()
        result["auto_checkpoints"] = sorted(os.listdir(os.path.join(args.auto_ckpt_dir, "checkpoints")))
        accelerator.load_state()  # the latest one: checkpoint after step 6
        result["auto_counter_after_load"] = counter.count

    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
