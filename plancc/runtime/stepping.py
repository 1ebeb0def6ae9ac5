"""The guard that a training step updates the model's own parameters.

A parallelized model's parameters are the objects FSDP2 registers on its modules; an
optimizer built from ``model.parameters()`` holds those. If FSDP2's backward hooks do not
run (a loss that reaches the parameters only beside the model's outputs), the model keeps
its gathered parameters registered after backward, their gradients are never reduced into
the sharded ones, and the optimizer steps nothing: the loss moves, the export holds the
initial weights, and nothing fails. This check makes that a diagnosed error at the first
step, whatever the cause.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import Diagnostic, PlanError, SourceLoc


def unstepped_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[str], bool]:
    """(trainable parameters of ``model`` the optimizer does not hold, whether any parameter
    it holds has a gradient), read after backward and before the optimizer's step."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    any_grad = any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
    return missing, any_grad


def require_stepped(model: nn.Module, optimizer: torch.optim.Optimizer, *, where: SourceLoc) -> None:
    """Raise ``PlanError`` (rule ``untrained-parameters``) when the coming optimizer step
    would not update the model's parameters."""
    missing, any_grad = unstepped_parameters(model, optimizer)
    if not missing and any_grad:
        return
    found = (
        f"after backward the model holds {len(missing)} parameters the optimizer does not "
        f"(first: {missing[0]}): FSDP's backward did not reduce the gradients into the sharded parameters"
        if missing
        else "no parameter the optimizer holds received a gradient"
    )
    raise PlanError(
        [
            Diagnostic(
                rule="untrained-parameters",
                loc=where,
                message=f"{found}; the step would leave the weights as they were, so it was not taken",
                fix="compute the loss from the model's forward outputs (plancc.causal_lm_loss, token_logprobs); "
                "build the optimizer from model.parameters() after plancc.parallelize",
            )
        ]
    )
