"""``save_state`` / ``load_state`` with two sharded models and two optimizers, FULL and SHARDED.

Launched by tests/test_trainer_checkpoint.py.  A tiny GPT-2 and a tiny Llama, each with its own AdamW,
train 2 steps; ``save_state`` (one directory per state dict type); steps 3-4 are recorded; then for each
directory ``load_state`` and steps 3-4 again must give the same losses for *both* models.  The main
process writes the losses and the files each directory holds to ``--output_json``.

Both models go through ``accelerator.prepare``; while ``prepare`` accepts one model only (the second is
refused with "one model per Accelerator"), the second is wrapped by hand and registered the way
``prepare_model`` registers a hand-wrapped model, so the checkpoint code is exercised either way.
"""
import argparse
import json
import os

import torch
import transformers

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.integrations.accelerate import Accelerator

VOCAB, SEQ = 128, 16


def models():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=False))
    return gpt2, llama


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work_dir", required=True)
    p.add_argument("--output_json", required=True)
    args = p.parse_args()
    accelerator = Accelerator()
    gpt2, llama = models()
    opt_a = torch.optim.AdamW(gpt2.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(llama.parameters(), lr=1e-2, weight_decay=0.1)
    model_a, opt_a = accelerator.prepare(gpt2, opt_a)
    try:
        model_b, opt_b = accelerator.prepare(llama, opt_b)
    except ValueError as e:  # refused before anything is wrapped
        if "one model per Accelerator" not in str(e):
            raise
        model_b = FullyShardedDataParallel(llama, auto_wrap_policy=transformer_auto_wrap_policy(llama),
                                           options=accelerator.flatshard_options)
        model_b._is_accelerate_prepared = True
        accelerator._models.append(model_b)
        opt_b = accelerator.prepare(opt_b)
    assert isinstance(model_a, FullyShardedDataParallel) and isinstance(model_b, FullyShardedDataParallel)

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (2 * accelerator.num_processes, SEQ), generator=g) for _ in range(4)]

    def step(x):
        local = x.chunk(accelerator.num_processes)[accelerator.process_index]
        out = []
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            loss = model(local, labels=local).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            out.append(accelerator.gather(loss.detach()).mean().item())
        return out

    for x in data[:2]:
        step(x)
    dirs = {}
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        accelerator.state.fsdp_plugin.set_state_dict_type(kind)
        dirs[kind] = os.path.join(args.work_dir, kind)
        accelerator.save_state(dirs[kind])
    result = {"reference": [step(x) for x in data[2:]], "resumed": {}, "files": {}}
    for kind, directory in dirs.items():
        accelerator.load_state(directory)
        result["resumed"][kind] = [step(x) for x in data[2:]]
        result["files"][kind] = sorted(os.listdir(directory))
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
