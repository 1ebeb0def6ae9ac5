"""Rank-side code of tests/test_plain_modules.py (spawned by tests/distributed.py): plancc plans
on plain PyTorch modules, as torch's own tensor-parallel tests write them (no Hugging Face
config, no decoder)."""

from __future__ import annotations

import torch
from torch import nn

from .distributed import init_gloo

PLAN = """
plancc: 1
name: plain
architectures: [Plain]
tensor_parallel:
  emb: embedding_rowwise
  mlp.up: colwise
  mlp.down: rowwise
  out: colwise
sequence_parallel:
  emb: embedding_seq
  norm1: sequence_parallel
  mlp: gather_seq_input
  mlp.down: rowwise_seq
  norm: sequence_parallel
  out: colwise_seq
"""


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Plain(nn.Module):
    """An embedding, one residual MLP block between norms, an output projection: the shape of
    torch's ``MLPStacked``/``Transformer`` test models, with no ``config`` attribute."""

    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.emb, self.norm1, self.mlp = nn.Embedding(vocab, dim), nn.LayerNorm(dim), MLP(dim)
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.mlp(self.norm1(h))
        return self.out(self.norm(h))


def plain_module_under_sequence_parallelism():
    """The plain model parallelized with SP at tp=2 against the same model whole: outputs
    (the vocabulary shards gathered) and every parameter's gradient, as max |difference|."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import plancc

    init_gloo()
    torch.manual_seed(0)
    whole = Plain()
    sharded = Plain()
    sharded.load_state_dict(whole.state_dict())
    mesh = plancc.build_mesh(plancc.Layout(tp=2, sequence_parallel=True), device_type="cpu")
    plancc.parallelize(sharded, plancc.parse_plan(PLAN), mesh)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = whole(tokens)
    local = sharded(tokens)  # [batch, sequence, vocab / tp]: colwise_seq leaves the vocabulary sharded
    local = local.to_local() if isinstance(local, DTensor) else local
    pieces = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(pieces, local.contiguous())
    got = torch.cat(pieces, dim=-1)
    expected.square().sum().backward()
    got_loss = local.square().sum()
    got_loss.backward()
    grads = {}
    for (name, mine), (_, ref) in zip(sharded.named_parameters(), whole.named_parameters(), strict=True):
        g = mine.grad.full_tensor() if isinstance(mine.grad, DTensor) else mine.grad
        grads[name] = float((g - ref.grad).abs().max())
    return {"output": float((got - expected).abs().max()), "grads": grads}
