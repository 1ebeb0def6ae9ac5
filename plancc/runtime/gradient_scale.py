"""The gradient-scaling invariant of plancc's training, stated once.

A step's loss is the global batch's loss ``L = sum_d L_d``: data-parallel rank ``d`` computes
its share ``L_d`` (its rows, normalized by the *global* token or sequence count, ``BatchTotals``).
The gradient every rank must end with is ``dL/dθ``. Three things happen between a rank's
``backward()`` and the gradient FSDP leaves in ``p.grad``:

1. **Context parallelism copies the loss.** The ``cp`` ranks of one dp rank each evaluate their
   shard of the positions and all-gather the log-probs (``runtime.vocab_parallel_logprobs``), so each of them
   computes the whole ``L_d``. The gather's backward is a reduce-scatter: each rank receives the
   *sum* of the ``cp`` identical upstream gradients at its positions. Summed over the cp ranks,
   the parameter gradients are ``cp * dL_d/dθ``.
2. **FSDP sums over dp x cp and divides.** Its reduce-scatter runs over the ``dp * cp`` ranks
   that shard the parameters (``Layout.fsdp_size``) and divides by ``fsdp_divisor``: FSDP's own
   default for the units sharded over that mesh. Under HSDP it reduce-scatters over a replica's
   ``dp_shard * cp`` ranks and all-reduces the shards between the ``dp_replicate`` replicas: the
   same sum over all ``dp * cp`` ranks, divided by the same divisor. Experts spread over ep shard over only
   ``dp / ep`` ranks, but their all-to-all's backward already brought each ep rank's tokens, so
   ``runtime.parallelize`` tells them to divide by the same ``fsdp_divisor``.
3. **The loss is scaled** by ``loss_scale`` before ``backward()``.

So the gradient is ``loss_scale * cp * sum_d dL_d/dθ / fsdp_divisor`` and equals ``dL/dθ`` when
``loss_scale = fsdp_divisor / cp = dp``. ``runtime.parallelize`` takes the divisor and
``plancc.Policy.train`` the scale from here; ``tests/test_gradient_scale.py`` checks the
gradients at dp2, cp2 and dp2 x cp2 against the unsharded model.
"""

from __future__ import annotations

from ..layout import Layout


def fsdp_divisor(layout: Layout) -> float:
    """What FSDP divides the summed gradients by: every rank that shards the parameters."""
    return float(layout.dp * layout.cp)


def cp_loss_copies(layout: Layout) -> int:
    """How many ranks compute each dp rank's loss share (each cp rank computes all of it)."""
    return layout.cp


def loss_scale(layout: Layout) -> float:
    """The factor a rank's share of the global loss is multiplied by before ``backward()`` so
    that FSDP's gradients are the global loss's (the module's docstring says why)."""
    return fsdp_divisor(layout) / cp_loss_copies(layout)


def token_loss_scale(layout: Layout) -> float:
    """``loss_scale`` for a loss each cp rank computes only its own positions' share of
    (``Policy.train(token_loss=)``: the fused evaluator never gathers the log-probs). Nothing
    is copied, the cp ranks' gradients add up to ``dL_d/dθ`` (point 1 does not apply), so the
    scale is FSDP's whole divisor."""
    return fsdp_divisor(layout)
