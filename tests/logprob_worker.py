"""Rank-side code of the logprob tests (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo


def check_vocab_parallel_cases(cases):
    """Each case: (shape, vocab, widths per rank, dtype name, chunk, seed). Every rank takes
    its column slice of the same full logits; returns max |diff| of logprobs and grads vs
    log_softmax(...).gather on the full logits (fp64 reference)."""
    import torch
    import torch.distributed as dist

    from plancc.logprobs import vocab_parallel_logprobs

    init_gloo()
    rank = dist.get_rank()
    out = []
    calls: list[tuple[str, int]] = []  # every collective the evaluator issues: (name, elements)
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(("all_reduce", tensor.numel()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        for shape, vocab, widths, dtype_name, chunk, seed in cases:
            gen = torch.Generator().manual_seed(seed)
            dtype = getattr(torch, dtype_name)
            full = (torch.randn(*shape, vocab, generator=gen) * 3).to(dtype)
            targets = torch.randint(0, vocab, tuple(shape), generator=gen)
            weights = torch.randn(*shape, generator=gen)
            start = sum(widths[:rank])
            local = full[..., start:start + widths[rank]].clone().requires_grad_(True)
            calls.clear()
            lp = vocab_parallel_logprobs(local, targets, group=dist.group.WORLD, chunk_size=chunk)
            forward_calls = list(calls)
            (lp * weights).sum().backward()
            backward_calls = len(calls) - len(forward_calls)
            ref_in = full.double().requires_grad_(True)
            ref = torch.log_softmax(ref_in, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            (ref * weights.double()).sum().backward()
            ref_grad = ref_in.grad[..., start:start + widths[rank]]
            out.append({
                "lp": (lp.double() - ref).abs().max().item(),
                "grad": (local.grad.double() - ref_grad).abs().max().item(),
                "dtype_out": str(lp.dtype),
                "scale": max(1.0, ref.abs().max().item()),
                "grad_scale": max(1.0, ref_in.grad.abs().max().item()),
                "forward_collectives": forward_calls,
                "backward_collectives": backward_calls,
                "tokens": targets.numel(),
            })
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()
    return out


def compare_token_logprobs(plan_path, preset, tp, sp):
    """token_logprobs of a parallelized model vs the unsharded one, with right padding and
    with packed documents. Returns max |diff| for each."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.logprobs import token_logprobs
    from plancc.job.verify import build_pair

    init_gloo()
    try:
        mesh = plancc.build_mesh(tp=tp, sequence_parallel=sp, device_type="cpu")
        model, reference, config = build_pair(plancc.load_plan(plan_path), preset, mesh)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, 11:] = 0  # right padding
        packed = torch.randint(0, config.vocab_size, (1, 16), generator=gen)
        cu = torch.tensor([0, 5, 12, 16])
        with torch.no_grad():
            got_pad = token_logprobs(model, ids, attention_mask=mask, mesh=mesh)
            want_pad = token_logprobs(reference, ids, attention_mask=mask)
            got_packed = token_logprobs(model, packed, cu_seqlens=cu, mesh=mesh)
            want_packed = token_logprobs(reference, packed, cu_seqlens=cu)
            separate = torch.cat([token_logprobs(reference, packed[:, a:b]) for a, b in [(0, 5), (5, 12), (12, 16)]], 1)
            left = mask.flip(1)  # row 1 left-padded: 5 pads, then 11 real tokens
            got_left = token_logprobs(model, ids, attention_mask=left, mesh=mesh)
            alone = token_logprobs(reference, ids[1:, 5:])  # the same sequence with no padding at all
        return {
            "padding": (got_pad - want_pad).abs().max().item(),
            "packed": (got_packed - want_packed).abs().max().item(),
            "packed_vs_separate": (want_packed - separate).abs().max().item(),
            "pad_zero": bool((got_pad[1, 11:] == 0).all()),
            "left_padding_vs_alone": (got_left[1:, 5:] - alone).abs().max().item(),
            "left_pad_and_first_zero": bool((got_left[1, :6] == 0).all()),
            "first_zero": bool((got_pad[:, 0] == 0).all() and (got_packed[0, [0, 5, 12]] == 0).all()),
        }
    finally:
        dist.destroy_process_group()
