"""A plain accelerate loop with two models: a policy that is trained and a frozen reference model, both
given to ``accelerator.prepare`` (the pattern of DPO/KL-regularised fine-tuning scripts).

Loss = language-model loss + 0.1 * KL(policy || reference) on the same batch; the reference runs under
``torch.no_grad()``.  Records per-step losses (mean over processes), what each prepared model holds on
this rank, and both full state dicts' sums from ``accelerator.get_state_dict``.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_common import lm_dataset, numel_info, tiny_model  # noqa: E402


def grad_bytes(model):
    """Bytes of gradient storage the prepared model holds (parameters' .grad, and a sharding wrapper's
    flat gradient buffers when it has them)."""
    n = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    for flat in getattr(model, "flat_params", []):
        for g in (flat.sharded_grad, flat.unsharded.grad):
            if g is not None:
                n += g.numel() * g.element_size()
    return n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prepare_reference", default="together", choices=["together", "evaluation_mode"],
                   help="prepare(policy, reference, ...) (torch FSDP allows it; DDP refuses a frozen model) or "
                        "prepare_model(reference, evaluation_mode=True)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--output_json", required=True)
    args = p.parse_args()

    accelerator = Accelerator()
    policy = tiny_model("llama", seed=0)
    reference = tiny_model("llama", seed=1).requires_grad_(False).eval()
    data = lm_dataset(args.steps * 2 * accelerator.num_processes).with_format("torch")
    loader = DataLoader(data, batch_size=2, shuffle=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    if args.prepare_reference == "together":
        policy, reference, optimizer, loader = accelerator.prepare(policy, reference, optimizer, loader)
    else:
        policy, optimizer, loader = accelerator.prepare(policy, optimizer, loader)
        reference = accelerator.prepare_model(reference, evaluation_mode=True)

    losses, norms = [], []
    for batch in loader:
        ids = batch["input_ids"]
        out = policy(input_ids=ids, labels=ids)
        with torch.no_grad():
            ref_logits = reference(input_ids=ids).logits
        kl = F.kl_div(F.log_softmax(ref_logits, -1), F.log_softmax(out.logits, -1), log_target=True,
                      reduction="batchmean")
        loss = out.loss + 0.1 * kl
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(policy.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep gradient buffers: their sizes are reported below
        losses.append(accelerator.reduce(loss.detach(), "mean").item())

    result = {"losses": losses, "grad_norms": norms, "policy": numel_info(policy), "reference": numel_info(reference),
              "policy_grad_bytes": grad_bytes(policy), "reference_grad_bytes": grad_bytes(reference),
              "distributed_type": str(accelerator.distributed_type)}
    for name, model in (("policy", policy), ("reference", reference)):
        state = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            result[f"{name}_state_sum"] = float(sum(v.double().sum() for v in state.values()))
            result[f"{name}_state_keys"] = len(state)
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
