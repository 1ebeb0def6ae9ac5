"""Compiled decoder blocks (the plan's ``compile:`` section): ``torch.compile`` on each decoder
layer, as torchtitan compiles each transformer block -- after the TP styles and activation
checkpointing (the compiled graph holds the layer's DTensor ops and its recomputation), before
FSDP2 (whose all-gathers and reduce-scatters stay outside the graphs, in its hooks). Every block
of one architecture has the same code, so dynamo compiles one graph and the others reuse it.
"""

from __future__ import annotations

from torch import nn

from ..compiler.plan import CompileSpec


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder's layers: the longest ``nn.ModuleList`` of the model (``model.layers``)."""
    lists = [child for module in model.modules() for child in module.children() if isinstance(child, nn.ModuleList)]
    longest = max(lists, key=len, default=None)
    return list(longest) if longest is not None else []


def compile_blocks(model: nn.Module, spec: CompileSpec | None) -> int:
    """Compile each decoder block of ``model`` in place (``nn.Module.compile``: the module keeps
    its name, parameters and hooks; its forward runs compiled); returns how many.

    Static shapes (``dynamic=False``): a microbatch of a new length compiles the block anew, up
    to dynamo's recompile limit (``torch._dynamo.config.recompile_limit``, 8 a block's code in
    torch 2.13), past which that shape runs eagerly -- exact either way. Dynamic shapes, dynamo's
    choice on the first recompile, traced the backward of TP's DTensor blocks into a chain too
    deep for Python's stack (RecursionError at the second length, torch 2.13)."""
    if spec is None:
        return 0
    blocks = decoder_blocks(model)
    for block in blocks:
        block.compile(backend=spec.backend, fullgraph=spec.fullgraph, dynamic=False)
    return len(blocks)
