"""Rank-side code of the context-parallel tests (spawned by tests/distributed.py)."""

from __future__ import annotations

from .distributed import init_gloo


def check_all_gather(cases):
    """Each case: (shape, dim, dtype name, seed, document lengths or None). Every rank takes
    its load-balanced shard (per document when packed) of the same tensor; returns per case
    whether forward == the tensor and backward == this rank's shard of the gradients summed
    over ranks."""
    import torch
    import torch.distributed as dist

    from plancc.cp import all_gather, shard, shard_packed

    rank, world = init_gloo()
    out = []
    calls: list[str] = []  # the collectives issued in backward
    real = {"all_reduce": dist.all_reduce, "rs": dist.reduce_scatter_single}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    dist.all_reduce = counted("all_reduce", real["all_reduce"])
    dist.reduce_scatter_single = counted("reduce_scatter", real["rs"])
    try:
        for shape, dim, dtype_name, seed, docs in cases:
            cu = None if docs is None else torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()])

            def cut(t, r):
                return shard(t, world, r, dim=dim) if cu is None else shard_packed(t, cu, world, r, dim=dim)

            dtype = getattr(torch, dtype_name)
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(*shape, generator=gen).to(dtype)
            # every rank back-propagates a different gradient through the full sequence
            grads = [torch.randn(*shape, generator=gen).to(dtype) for _ in range(world)]
            mine = cut(x, rank).clone().requires_grad_(True)
            full = all_gather(mine, dist.group.WORLD, dim=dim, cu_seqlens=cu)
            calls.clear()
            full.backward(grads[rank])
            backward_calls = list(calls)
            expected_grad = cut(sum(g.double() for g in grads), rank)
            out.append({
                "forward_equal": bool(torch.equal(full.detach(), x)),
                "grad_err": (mine.grad.double() - expected_grad).abs().max().item(),
                "grad_scale": expected_grad.abs().max().item(),
                "backward_collectives": backward_calls,
            })
    finally:
        dist.all_reduce, dist.reduce_scatter_single = real["all_reduce"], real["rs"]
        dist.destroy_process_group()
    return out


def compare_cp_token_logprobs(plan_path, preset, cp, tp, sp):
    """token_logprobs under cp (x tp) vs the unsharded model, with padding and packing."""
    import torch
    import torch.distributed as dist

    import plancc
    from plancc.logprobs import token_logprobs
    from plancc.job.verify import build_pair

    init_gloo()
    try:
        mesh = plancc.build_mesh(cp=cp, tp=tp, sequence_parallel=sp, device_type="cpu")
        model, reference, config = build_pair(plancc.load_plan(plan_path), preset, mesh)
        gen = torch.Generator().manual_seed(1)
        n = 4 * cp * tp  # every length below is a multiple of 2*cp(*tp)
        ids = torch.randint(0, config.vocab_size, (2, 2 * n), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, n + 3:] = 0  # right padding
        lengths = [n, 2 * n // 2, n // 2 * 2]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        packed = torch.randint(0, config.vocab_size, (1, int(cu[-1])), generator=gen)
        with torch.no_grad():
            got_pad = token_logprobs(model, ids, attention_mask=mask, mesh=mesh, cp=mesh)
            want_pad = token_logprobs(reference, ids, attention_mask=mask)
            got_packed = token_logprobs(model, packed, cu_seqlens=cu, mesh=mesh, cp=mesh)
            want_packed = token_logprobs(reference, packed, cu_seqlens=cu)
            left = mask.flip(1)  # row 1 left-padded
            pads = int((left[1] == 0).sum())
            got_left = token_logprobs(model, ids, attention_mask=left, mesh=mesh, cp=mesh)
            got_auto = token_logprobs(model, ids, attention_mask=mask, mesh=mesh)  # cp not named: recognized
            try:  # the unsharded reference is no cp model: naming cp for it is a mistake
                token_logprobs(reference, ids, cp=mesh)
                misuse = None
            except ValueError as exc:
                misuse = str(exc)
            alone = token_logprobs(reference, ids[1:, pads:])
            # each document by itself: the ground truth where the reference's own packing detection
            # fails (transformers' eager sliding-window mask lets gpt-oss's documents see each other)
            documents = torch.cat([token_logprobs(reference, packed[:, s:e])
                                   for s, e in zip(cu.tolist(), cu.tolist()[1:])], dim=1)
        return {"padding": (got_pad - want_pad).abs().max().item(),
                "packed": (got_packed - want_packed).abs().max().item(),
                "packed_vs_alone": (got_packed - documents).abs().max().item(),
                "left_padding_vs_alone": (got_left[1:, pads:] - alone).abs().max().item(),
                "left_pad_and_first_zero": bool((got_left[1, :pads + 1] == 0).all()),
                "cp_recognized": bool(torch.equal(got_auto, got_pad)),
                "misuse": misuse}
    finally:
        dist.destroy_process_group()


def logprobs_verify_every_plan(cases, data, kernel=None):
    """``plancc logprobs --cp 2 --verify`` as the CLI's workers run it, for every (plan, preset)
    of ``cases`` and packed and unpacked, in one process group: {case: (ok, max |diff|)}.
    ``kernel``: the CP attention's (``PLANCC_CP_ATTENTION``), or the default."""
    import os

    import torch.distributed as dist

    if kernel is not None:
        os.environ["PLANCC_CP_ATTENTION"] = kernel

    from plancc.job.config import RunConfig
    from plancc.job.runner import run_logprobs
    from plancc.layout import Layout

    out = {}
    try:
        for plan, preset in cases:
            for pack in (False, True):
                cfg = RunConfig.of(plan=plan, model=preset, layout=Layout(cp=2), mode="logprobs", data=data,
                                verify=True, pack=pack, batch_size=4, device="cpu", timeout_s=120)
                result = run_logprobs(cfg)
                out[f"{preset} {'packed' if pack else 'unpacked'}"] = (result["ok"], result["max_abs_diff"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out
