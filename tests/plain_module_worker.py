"""Rank-side code of tests/test_plain_modules.py (spawned by tests/distributed.py): plancc plans
on plain PyTorch modules, as torch's own tensor-parallel tests write them (no Hugging Face
config, no decoder)."""

from __future__ import annotations

from pathlib import Path

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


ROOT_PLAN = PLAN + """
  "": {style: prepare_output, output_layouts: "shard(-1)", desired_output_layouts: replicate}
"""


def a_root_rule_gathers_the_output():
    """torch's plan key ``""`` (the model itself): a prepare_output on the root hands back the
    whole vocabulary, as the unsharded model's output."""
    import plancc

    init_gloo()
    torch.manual_seed(0)
    whole, sharded = Plain(), Plain()
    sharded.load_state_dict(whole.state_dict())
    mesh = plancc.build_mesh(plancc.Layout(tp=2, sequence_parallel=True), device_type="cpu")
    plan = plancc.parse_plan(ROOT_PLAN)
    plancc.parallelize(sharded, plan, mesh)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    got = sharded(tokens)
    return {"shape": list(got.shape), "diff": float((got - whole(tokens)).abs().max()), "type": type(got).__name__}


def fsdp_shards_on_the_dims_the_plan_names(tp: int):
    """Qwen3 with ``fsdp.shard_placement`` (FSDP2's shard_placement_fn) at dp=2 (x tp): the
    named parameters sharded by FSDP on dim 1, the loss and every gradient equal to the
    unsharded model's."""
    import copy

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import plancc
    from plancc.models import build_model, load_config

    init_gloo()
    config = load_config("tiny-qwen3")
    torch.manual_seed(0)
    whole = build_model(copy.deepcopy(config), device="cpu")
    text = Path("plans/qwen3.yaml").read_text().replace(
        "fsdp:\n", "fsdp:\n  shard_placement:\n    model.layers.*.mlp.down_proj.weight: shard(1)\n"
        "    model.embed_tokens.weight: shard(-1)\n", 1
    )
    plan = plancc.parse_plan(text)
    mesh = plancc.build_mesh(plancc.Layout(dp=dist.get_world_size() // tp, tp=tp), device_type="cpu")
    model = build_model(copy.deepcopy(config), device="meta")
    plancc.parallelize(model, plan, mesh)
    plancc.materialize(model, "cpu", full_state_dict={k: v.clone() for k, v in whole.state_dict().items()})
    ids = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    mine = ids[mesh["dp"].get_local_rank() * 2 :][:2]
    loss = plancc.causal_lm_loss(model, mine, mesh=mesh)
    loss.backward()
    reference = whole(input_ids=ids, labels=ids).loss
    reference.backward()
    dp_placements = {}
    worst = 0.0
    params = dict(model.named_parameters())
    for name, ref in whole.named_parameters():
        got = params[name]
        # the dp axis: Shard(dim), or _StridedShard(dim) where tp shards the same dim first
        dp_placements[name] = got.placements[0].dim if isinstance(got, DTensor) else None
        grad = got.grad.full_tensor() if isinstance(got.grad, DTensor) else got.grad
        worst = max(worst, float((grad - ref.grad).abs().max()))
    losses = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach().reshape(1))
    mean = float(torch.stack(losses).mean())
    return {
        "down": dp_placements["model.layers.0.mlp.down_proj.weight"],
        "embed": dp_placements["model.embed_tokens.weight"],
        "up": dp_placements["model.layers.0.mlp.up_proj.weight"],
        "loss_diff": abs(mean - float(reference)),
        "grad_diff": worst,
    }


class Mix(nn.Module):
    """A block called as torch's examples call attention: a tensor, an argument left alone
    (a scalar scale), and a keyword tensor (a per-position gain)."""

    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
        out = self.down(torch.relu(self.up(x)) * scale)
        return out * gain if gain is not None else out


class PlainWithArguments(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.emb, self.norm1, self.mix = nn.Embedding(vocab, dim), nn.LayerNorm(dim), Mix(dim)
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        gain = 1 + torch.arange(tokens.shape[1], dtype=h.dtype)[None, :, None] / 10  # [1, seq, 1], whole
        h = h + self.mix(self.norm1(h), torch.tensor(0.5), gain=gain)
        return self.out(self.norm(h))


ARGUMENTS_PLAN = """
plancc: 1
name: plain-arguments
architectures: [PlainWithArguments]
tensor_parallel:
  emb: embedding_rowwise
  mix.up: colwise
  mix.down: rowwise
  out: colwise
sequence_parallel:
  emb: embedding_seq
  norm1: sequence_parallel
  mix:
    style: prepare_input
    input_layouts: [shard(1), null]          # the sequence shard gathered; the scale left alone
    desired_input_layouts: [replicate, null]
    input_kwarg_layouts: {gain: replicate}   # the whole gain cut to this rank's positions
    desired_input_kwarg_layouts: {gain: shard(1)}
  mix.down: rowwise_seq
  norm: sequence_parallel
  out: colwise_seq
  "": {style: prepare_output, output_layouts: "shard(-1)", desired_output_layouts: replicate}
"""


def positional_and_keyword_inputs_laid_out_one_by_one():
    """torch's PrepareModuleInput forms in a plan (a list with null, keyword layouts) on a
    plain model under SP: outputs and gradients equal to the whole model's."""
    from torch.distributed.tensor import DTensor

    import plancc

    init_gloo()
    torch.manual_seed(0)
    whole, sharded = PlainWithArguments(), PlainWithArguments()
    sharded.load_state_dict(whole.state_dict())
    mesh = plancc.build_mesh(plancc.Layout(tp=2, sequence_parallel=True), device_type="cpu")
    plancc.parallelize(sharded, plancc.parse_plan(ARGUMENTS_PLAN), mesh)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    expected, got = whole(tokens), sharded(tokens)
    expected.square().sum().backward()
    got.square().sum().backward()
    worst = 0.0
    for (_, mine), (_, ref) in zip(sharded.named_parameters(), whole.named_parameters(), strict=True):
        grad = mine.grad.full_tensor() if isinstance(mine.grad, DTensor) else mine.grad
        worst = max(worst, float((grad - ref.grad).abs().max()))
    return {"output": float((got - expected).abs().max()), "grads": worst}
