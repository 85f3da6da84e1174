"""A user's own ``nn.Module`` (no ``_no_split_modules``, blocks in an ``nn.ModuleList``) trained by a plain
accelerate loop.  Run under accelerate's DDP (reference) and, unmodified, through ``-m accel_flatshard.run``
with the README yaml (TRANSFORMER_BASED_WRAP, no class list).  Writes ``--output_json`` (main process):
``losses`` per step (mean over processes), and when the prepared model is sharded, the parameter elements
each rank holds (``local_numel``) and the model's total (``total_numel``)."""
import argparse
import json

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_json", required=True)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    accelerator = Accelerator()
    set_seed(0)
    model = Net()
    total = sum(q.numel() for q in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(args.steps, accelerator.num_processes, 4, 8, generator=gen)
    ys = torch.randn(args.steps, accelerator.num_processes, 4, generator=gen)
    losses = []
    for step in range(args.steps):
        x, y = xs[step, accelerator.process_index], ys[step, accelerator.process_index]
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    flat = getattr(model, "flat_params", None)
    local = sum(f.local_shard.numel() for f in flat) if flat is not None else None
    held = gather_object([local])
    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump({"losses": losses, "local_numel": held, "total_numel": total,
                       "model_class": type(model).__name__}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy the process group before exit


if __name__ == "__main__":
    main()
