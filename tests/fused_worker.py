"""Rank-side code of the fused evaluator tests (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo


def reference(h, w, targets, *, temperature=1.0, top_k=None, top_p=None, ignore_index=-100, dtype=None):
    """fp64 log-probs and entropy from the full logits (filtered like a sampler); with
    ``dtype=torch.float32`` the same computed naively in fp32 (the noise floor of fp32)."""
    import torch

    dtype = dtype or torch.float64
    x = (h.to(dtype) @ w.to(dtype).T) / temperature
    keep = sampler_keep(x, top_k, top_p)
    ls = torch.log_softmax(x.masked_fill(~keep, float("-inf")), -1)
    valid = targets != ignore_index
    lp = torch.where(valid, ls.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    ent = torch.where(valid, -(ls.exp() * ls.masked_fill(~keep, 0.0)).sum(-1), 0.0)
    return lp, ent


def sampler_keep(x, top_k, top_p):
    """Which logits a sampler keeps: the top k (ties kept), then the nucleus reaching top_p."""
    import torch

    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k is not None:
        keep &= x >= x.topk(min(top_k, x.shape[-1]), -1).values[..., -1:]
    if top_p is not None:
        probs, order = x.masked_fill(~keep, float("-inf")).softmax(-1).sort(-1, descending=True)
        kept = (probs.cumsum(-1) - probs) < top_p
        kept[..., 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, kept)
    return keep


def ppo_terms(n, seed):
    """Per-token constants of a PPO-style clipped objective: old log-probs, advantages, a mask."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=gen) * 4
    adv = torch.randn(n, generator=gen)
    mask = (torch.rand(n, generator=gen) > 0.2).float()
    return old, adv, mask


def ppo_loss(lp, index, old, adv, mask, eps=0.2):
    """The clipped surrogate loss of the tokens ``index``, normalized by every token's mask (a
    per-token term: each depends on its own log-prob only)."""
    import torch

    ratio = torch.exp(lp - old[index].to(lp.dtype))
    a = adv[index].to(lp.dtype)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    return -(surrogate * mask[index].to(lp.dtype)).sum() / mask.sum().to(lp.dtype)


def check_fused_cases(cases):
    """Each case runs at tp in {1, 2, 4} on 4 ranks (tp=2: two groups of two): every rank
    takes its (uneven) rows of the same lm_head weight; returns, per case and tp, the worst
    forward / entropy / gradient errors against fp64 on the full logits, relative to scale."""
    import torch
    import torch.distributed as dist

    from plancc.logprobs import fused_logprobs, fused_nll_loss, fused_token_loss
    from plancc.runtime.fused_logprobs import default_columns

    rank, world = init_gloo()
    assert world == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {1: (None, 0, 1), 2: (pairs[rank // 2], rank % 2, 2), 4: (dist.group.WORLD, rank, 4)}
    out = []
    try:
        for case in cases:
            gen = torch.Generator().manual_seed(case["seed"])
            dtype = getattr(torch, case["dtype"])
            n, hdim, vocab = case["n"], case["h"], case["v"]
            h_full = torch.randn(n, hdim, generator=gen).to(dtype)
            w_full = (torch.randn(vocab, hdim, generator=gen) * case.get("w_scale", 1.0)).to(dtype)
            targets = torch.randint(0, vocab, (n,), generator=gen)
            targets[:: max(2, n // 3)] = -100  # some ignored positions
            g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
            opts = case.get("opts", {})
            ref_h = h_full.double().requires_grad_(True)
            ref_w = w_full.double().requires_grad_(True)
            ref_lp, ref_ent = reference(ref_h, ref_w, targets, **opts)
            finite = torch.isfinite(ref_lp)
            ((torch.where(finite, ref_lp, 0.0) * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
            for tp in (1, 2, 4):
                group, tp_rank, size = groups[tp]
                bounds = _split(vocab, size, case["uneven"])
                lo, hi = bounds[tp_rank], bounds[tp_rank + 1]
                h = h_full.clone().requires_grad_(True)
                w = w_full[lo:hi].clone().requires_grad_(True)
                lp, ent = fused_logprobs(h, w, targets, group=group, entropy=True, chunk_size=case["chunk"], **opts)
                ((torch.where(torch.isfinite(lp), lp, 0.0) * g_lp).sum() + (ent * g_ent).sum()).backward()
                row = {"case": case["name"], "tp": tp, "dtype": case["dtype"]}
                row |= _errors(lp, ent, h.grad, w.grad, ref_lp, ref_ent, ref_h.grad, ref_w.grad[lo:hi], dtype)
                row["same_inf"] = bool((torch.isfinite(lp) == finite).all())
                filtered = "top_k" in opts or "top_p" in opts
                row["by_columns"] = (
                    case["chunk"] is None and not filtered and default_columns(n, hi - lo, h.device) is not None
                )
                if not opts:  # the weighted loss with gradients formed in forward
                    h2 = h_full.clone().requires_grad_(True)
                    w2 = w_full[lo:hi].clone().requires_grad_(True)
                    weights = torch.rand(n, generator=torch.Generator().manual_seed(1))
                    loss, _ = fused_nll_loss(h2, w2, targets, weights, group=group, chunk_size=case["chunk"])
                    loss.backward()
                    rh = h_full.double().requires_grad_(True)
                    rw = w_full.double().requires_grad_(True)
                    want = -(reference(rh, rw, targets)[0] * weights.double()).sum()
                    want.backward()
                    row["loss"] = abs(loss.item() - want.item()) / max(1.0, abs(want.item()))
                    row["loss_grad"] = max(
                        _grad_error(h2.grad, rh.grad, dtype), _grad_error(w2.grad, rw.grad[lo:hi], dtype)
                    )
                    # a clipped objective with its gradients formed in forward, against fp64 autograd
                    old, adv, mask = ppo_terms(n, case["seed"])
                    h3 = h_full.clone().requires_grad_(True)
                    w3 = w_full[lo:hi].clone().requires_grad_(True)
                    loss, _ = fused_token_loss(
                        h3,
                        w3,
                        targets,
                        lambda lp, i: ppo_loss(lp, i, old, adv, mask),
                        group=group,
                        chunk_size=case["chunk"],
                    )
                    loss.backward()
                    rh = h_full.double().requires_grad_(True)
                    rw = w_full.double().requires_grad_(True)
                    want = ppo_loss(reference(rh, rw, targets)[0], slice(None), old, adv, mask)
                    want.backward()
                    row["token_loss"] = abs(loss.item() - want.item()) / max(1.0, abs(want.item()))
                    row["token_loss_grad"] = max(
                        _grad_error(h3.grad, rh.grad, dtype), _grad_error(w3.grad, rw.grad[lo:hi], dtype)
                    )
                out.append(row)
    finally:
        dist.destroy_process_group()
    return out


def _split(vocab, size, uneven):
    """Row bounds of each rank's shard; uneven: the first rank gets about a third more."""
    if size == 1:
        return [0, vocab]
    base = vocab // size
    widths = [base] * size
    if uneven:
        widths[0] += base // 3
        widths[-1] -= base // 3
    widths[-1] += vocab - sum(widths)
    return [0, *__import__("itertools").accumulate(widths)]


def _grad_error(got, want, dtype, allowance=None):
    """Worst gradient error relative to the gradient's scale, after allowing the rounding of
    the fp64 reference to the parameter dtype (a bf16 gradient cannot be closer than that),
    and, per entry, an ``allowance`` of absolute error beyond that (fp32's rounding of the
    terms of a cancelling sum: ``_rounding_allowance`` in tests/test_fused_logprobs.py)."""
    import torch

    scale = max(1e-30, want.abs().max().item())
    rounding = (want.to(dtype).double() - want).abs() if dtype != torch.float32 else torch.zeros_like(want)
    if allowance is not None:
        rounding = rounding + allowance
    return (((got.double() - want).abs() - rounding).clamp(min=0).max() / scale).item()


def _errors(lp, ent, gh, gw, ref_lp, ref_ent, ref_gh, ref_gw, dtype):
    import torch

    finite = torch.isfinite(ref_lp) & torch.isfinite(lp)
    scale = max(1.0, ref_lp[finite].abs().max().item())
    return {
        "lp": ((lp.double() - ref_lp)[finite].abs().max() / scale).item(),
        "ent": ((ent.double() - ref_ent).abs().max() / max(1.0, ref_ent.abs().max().item())).item(),
        "grad_h": _grad_error(gh, ref_gh, dtype),
        "grad_w": _grad_error(gw, ref_gw, dtype),
    }


def hidden_gradient_under_sp(dtype_name):
    """Sequence-parallel hidden states ``[B, S/tp, H]`` gathered to the fused token loss and
    lm_head (vocab-sharded over tp), forward and backward two ways on the same numbers: as
    ``model_token_loss`` hands them (a replicated DTensor: the gradient leaves ``Partial`` and
    DTensor's backward reduce-scatters it to the shards), and as a plain tensor (the evaluator
    all-reduces the ``[N, H]`` gradient, the gather's backward takes a chunk). Returns the
    largest gradient difference and each way's bytes on the tp group by kind of collective."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from plancc.runtime.collectives import CountCollectives, mesh_axes
    from plancc.runtime.fused_logprobs import fused_token_loss

    rank, world = init_gloo()
    try:
        dtype = getattr(torch, dtype_name)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        gen = torch.Generator().manual_seed(4)
        rows, seq, hidden, vocab = 2, 16, 32, 96
        h_full = torch.randn(rows, seq, hidden, generator=gen).to(dtype)
        w_full = (torch.randn(vocab, hidden, generator=gen) * 0.2).to(dtype)
        targets = torch.randint(0, vocab, (rows, seq), generator=gen)
        terms = torch.randn(rows * seq, generator=gen)
        local_w = w_full.chunk(world)[rank].clone().requires_grad_(True)
        weight = DTensor.from_local(local_w, mesh, [Shard(0)], run_check=False)

        def loss_fn(lp, index):
            return (lp * terms[index]).sum()

        out = {}
        for way in ("partial", "all_reduce"):
            shard = h_full.chunk(world, dim=1)[rank].clone().requires_grad_(True)
            gathered = DTensor.from_local(shard, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
            given = gathered if way == "partial" else gathered.to_local()
            counter = CountCollectives(mesh_axes(mesh))
            with counter:  # the loss forms its gradients in forward: both passes counted
                loss, _ = fused_token_loss(given, weight, targets, loss_fn, group=mesh.get_group())
                loss.backward()
            traffic = {}
            for c in counter.traffic().collectives:
                if c.axis == "tp":
                    traffic[c.kind] = traffic.get(c.kind, 0) + c.wire_bytes
            out[way] = {"grad": shard.grad.float().clone(), "weight_grad": local_w.grad.float().clone(),
                        "traffic": traffic}
            local_w.grad = None
        diff = (out["partial"]["grad"] - out["all_reduce"]["grad"]).abs().max().item()
        scale = out["all_reduce"]["grad"].abs().max().item()
        wdiff = (out["partial"]["weight_grad"] - out["all_reduce"]["weight_grad"]).abs().max().item()
        dist.barrier()
        return {"grad_diff": diff / scale, "weight_grad_diff": wdiff, "partial": out["partial"]["traffic"],
                "all_reduce": out["all_reduce"]["traffic"]}
    finally:
        dist.destroy_process_group()
