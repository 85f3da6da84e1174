"""A small model that exercises the awkward cases: tied weights across units, a parameter-less unit,
a unit called twice in one forward, frozen parameters."""
import torch
import torch.nn as nn

D = 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class Scale(nn.Module):
    """A unit without parameters."""

    def forward(self, x):
        return x * 1.5


class Toy(nn.Module):
    def __init__(self, seed=0, tie_blocks=True, freeze_embed=False):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.scale = Scale()
        self.head = nn.Linear(D, 1)
        if tie_blocks:  # a weight shared by two units: owned by their common ancestor (the root)
            self.blocks[2].lin.weight = self.blocks[0].lin.weight
        if freeze_embed:
            self.embed.requires_grad_(False)

    def forward(self, x):
        x = self.embed(x)
        x = self.blocks[0](x)
        x = self.scale(x)
        x = self.blocks[1](x)
        x = self.blocks[1](x)  # the same unit twice in one forward
        x = self.blocks[2](x)
        return self.head(x).pow(2).mean()


def toy_batches(steps, batch=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, D, generator=g) for _ in range(steps)]
