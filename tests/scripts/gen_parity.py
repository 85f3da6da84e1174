"""Greedy generation through a prepared model, then one training step; run under accelerate DDP (reference) and
via ``-m accel_flatshard.run`` with an FSDP yaml (test_generation.py compares the two).

Records (``--output_json``, main process): the greedy tokens of every rank for each way of generating
(``unwrap_model(model).generate`` in every generation mode; inside ``summon_full_params`` with and without
writeback; inside the summon after ``unwrapped.to(torch.bfloat16)``), and the losses of a training step after
all of it.  Under accel_flatshard also: the all-gathers issued per generate() and the most gathered bytes held
at any moment, per mode, and whether the fp32 master shards kept every bit through the bf16 summon.
"""
import argparse
import copy
import json

import torch
import transformers
from accelerate import Accelerator

VOCAB = 128


def tiny_llama(layers: int = 4):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                      tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_json", required=True)
    p.add_argument("--new_tokens", type=int, default=12)
    p.add_argument("--skip_generation", action="store_true", help="only the training steps (the reference)")
    args = p.parse_args()

    accelerator = Accelerator()
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    rank = accelerator.process_index
    g = torch.Generator().manual_seed(100 + rank)  # different prompts per rank
    prompts = torch.randint(3, VOCAB, (2, 6), generator=g)
    gen_kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    sharded = type(model).__name__ == "FullyShardedDataParallel"

    def all_ranks(tokens):
        return accelerator.gather(tokens.contiguous()).tolist()

    result = {"tokens": {}, "gathers": {}, "peak_held": {}, "plan": {}}
    if args.skip_generation:
        pass
    elif sharded:
        from accel_flatshard.features.generation import control_of, set_generation_options, unit_bytes

        group = model.shard_group
        counter = {"n": 0}
        original_all_gather = group.all_gather

        def counting_all_gather(*a, **k):
            counter["n"] += 1
            return original_all_gather(*a, **k)

        group.all_gather = counting_all_gather
        held = {"peak": 0}

        def note_held(*_):
            held["peak"] = max(held["peak"], sum(f.unsharded.untyped_storage().nbytes() for f in model.flat_params))

        for unit in model.units:
            unit.module.register_forward_pre_hook(note_held)
            unit.module.register_forward_hook(note_held)
        total = sum(unit_bytes(u) for u in model.units)
        result["total_bytes"] = total
        result["num_flats"] = len(model.flat_params)
        budget = total // 2
        result["budget"] = budget
        modes = [("full", {"generation_mode": "full"}), ("budget", {"generation_mode": "budget", "generation_budget_mb": budget / 2**20}),
                 ("auto", {"generation_mode": "budget", "generation_budget_mb": None}), ("per_unit", {"generation_mode": "per_unit"})]
        for name, options in modes:
            set_generation_options(model, **options)
            counter["n"], held["peak"] = 0, 0
            with torch.no_grad():
                tokens = unwrapped.generate(prompts, **gen_kwargs)
            result["gathers"][name], result["peak_held"][name] = counter["n"], held["peak"]
            result["plan"][name] = list(control_of(model).last_plan)
            result["tokens"][name] = all_ranks(tokens)
            assert all(not f.unsharded.untyped_storage().nbytes() for f in model.flat_params), f"{name}: units left gathered"
        set_generation_options(model, generation_mode="budget", generation_budget_mb=None)
        masters = [f.local_shard.clone() for f in model.flat_params]
        for writeback in (False, True):
            with model.summon_full_params(writeback=writeback, recurse=False):
                counter["n"] = 0
                tokens = unwrapped.generate(prompts, **gen_kwargs)
                result["gathers"][f"summon_wb{int(writeback)}"] = counter["n"]
            result["tokens"][f"summon_wb{int(writeback)}"] = all_ranks(tokens)
        buffer_dtypes = [b.dtype for b in unwrapped.buffers()]
        with model.summon_full_params():
            unwrapped.to(torch.bfloat16)
            tokens = unwrapped.generate(prompts, **gen_kwargs)
        result["tokens"]["summon_bf16"] = all_ranks(tokens)
        result["masters_fp32"] = all(f.local_shard.dtype == torch.float32 for f in model.flat_params)
        result["params_fp32"] = all(q.dtype == torch.float32 for q in unwrapped.parameters())
        result["buffers_kept"] = [b.dtype for b in unwrapped.buffers()] == buffer_dtypes
        result["masters_bitwise"] = all(torch.equal(a, f.local_shard) for a, f in zip(masters, model.flat_params))
    else:
        for name in ("full", "budget", "auto", "per_unit", "summon_wb0", "summon_wb1"):
            with torch.no_grad():
                result["tokens"][name] = all_ranks(unwrapped.generate(prompts, **gen_kwargs))
        with torch.no_grad():
            result["tokens"]["summon_bf16"] = all_ranks(copy.deepcopy(unwrapped).to(torch.bfloat16)
                                                        .generate(prompts, **gen_kwargs))

    # the training step after generation
    batch = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7 + rank))
    losses = []
    for _ in range(2):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    with torch.no_grad():
        losses.append(accelerator.gather(model(input_ids=batch, labels=batch).loss[None]).mean().item())
        if not args.skip_generation:
            result["tokens"]["after_training"] = all_ranks(unwrapped.generate(prompts, **gen_kwargs))
    result["losses"] = losses
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy the process group before exit


if __name__ == "__main__":
    main()
