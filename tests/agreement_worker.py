"""Rank functions for tests/test_agreement.py: what every rank of a step must agree on."""

import math

import torch
import torch.distributed as dist

from .distributed import sized

VOCAB = 256


def _global_batch(rows=4, seq=10):
    ids = torch.randint(0, VOCAB // 2, (rows, seq), generator=torch.Generator().manual_seed(5))
    ids[3, 1] = VOCAB - 1  # one "big" row, in dp rank 1's half only
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _loss_with_uneven_metrics(lp, mb, norm):
    """An NLL whose metrics differ in name and order by rank: ``big_rows`` only where a row holds
    a token >= VOCAB / 2 (data-dependent: a clip fraction reported only when something clipped),
    and two metrics inserted in an order that depends on the rank."""
    mask = mb["attention_mask"].clone()
    mask[:, 0] = 0
    metrics = {}
    big = (mb["input_ids"] >= VOCAB // 2).any(1)
    if big.any():
        metrics["big_rows"] = big.sum().float()
    rows = float(mb["input_ids"].shape[0])
    pairs = [("z_rows", rows), ("a_twice_rows", 2 * rows)]
    for key, value in pairs if dist.get_rank() % 2 else reversed(pairs):
        metrics[key] = value
    return -(lp * mask).sum() / norm.tokens, metrics


def uneven_metric_names(plan, model_name, layouts):
    """For each layout: the metrics one step reports with a loss whose metric names differ by
    rank; and whether tp ranks given rows that differ in one token (a float token mask beside
    them) are told so."""
    from plancc import Policy
    from plancc.engine.batches import BatchError

    out = {}
    batch = _global_batch()
    for layout in layouts:
        policy = Policy(plan, model_name, device="cpu", layout=sized(**layout))
        rows = policy.slice_of(batch["input_ids"].shape[0])
        mine = {k: v[rows] for k, v in batch.items()}
        row = policy.train(mine, _loss_with_uneven_metrics, micro_batch_size=1)
        out[str(layout)] = {k: row.get(k) for k in ("big_rows", "z_rows", "a_twice_rows")}
        if layout.get("tp", 1) > 1:
            ids = mine["input_ids"].clone()
            if dist.get_rank() == 1:
                ids[0, 1] += 1  # one token, near the start: a small term of a large sum
            token_mask = torch.ones_like(ids, dtype=torch.float32)
            token_mask[:, 0] = 0
            try:
                policy.logprobs({**mine, "input_ids": ids, "token_mask": token_mask})
                out["different_rows"] = "accepted"
            except BatchError as exc:
                out["different_rows"] = str(exc)
    return out


def _raised(call):
    """(the exception's type and first line, or None; seconds until it was raised)."""
    import time

    started = time.perf_counter()
    try:
        call()
        outcome = None
    except Exception as exc:  # what the test inspects
        outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return outcome, time.perf_counter() - started


CONSUMED: dict[str, int] = {}  # tensors each case's consumer took before it or its peer raised


def _consume_failing_on(rank, agree_every=None):
    def consume(policy):
        key = f"{rank}/{agree_every}"
        CONSUMED[key] = 0
        for index, (name, _) in enumerate(policy.weights(bucket_bytes=1 << 14, agree_every=agree_every)):
            if dist.get_rank() == rank and index == 3:
                raise RuntimeError(f"the consumer on rank {rank} refused {name}")
            CONSUMED[key] = index + 1

    return consume


def failures_agreed(plan, model_name, root, layout=None):
    """A failure of one rank's file work or weights consumer, raised on every rank at once, then
    log-probs as before it: each case's (outcome, seconds) per rank, and whether the log-probs
    after it equal the ones before."""
    import os
    from pathlib import Path

    from plancc import Layout, Policy

    policy = Policy(plan, model_name, device="cpu", layout=Layout(**(layout or {"dp": 2})), timeout_s=120)
    batch = _global_batch()
    mine = {k: v[policy.slice_of(4)] for k, v in batch.items()}
    before = policy.logprobs(mine)
    cases = {
        "save: rank 0's folder read-only while publishing": ("meta:readonly@0", lambda: policy.save(Path(root) / "ck")),
        "save: rank 1's shard folder read-only": ("save:readonly@1", lambda: policy.save(Path(root) / "ck")),
        "export: rank 0's folder read-only": ("export:readonly@0", lambda: policy.export_hf(Path(root) / "out")),
        "weights(): the consumer raises on rank 0": ("", lambda: _consume_failing_on(0)(policy)),
        "weights(): the consumer raises on rank 1": ("", lambda: _consume_failing_on(1)(policy)),
        "weights(agree_every=4): the consumer raises on rank 1": ("", lambda: _consume_failing_on(1, 4)(policy)),
    }
    out = {}
    for case, (fault, call) in cases.items():
        os.environ["PLANCC_FAULT"] = fault
        try:
            outcome, seconds = _raised(call)
        finally:
            os.environ.pop("PLANCC_FAULT", None)
        after = policy.logprobs(mine)
        out[case] = {"outcome": outcome, "seconds": seconds, "same_logprobs": bool(torch.equal(after, before))}
    out["saved after the failures"] = str(policy.save(Path(root) / "ck"))
    out["consumed"] = dict(CONSUMED)
    out["tensors per bucket"] = [len(b["tensors"]) for b in policy.weights_manifest(bucket_bytes=1 << 14)["buckets"]]
    return out


def dropout_streams(plan, model_name, layouts):
    """For each layout: the first numbers each rank's training draws (LoRA's dropout masks come
    from this stream) after a Policy with LoRA dropout is built."""
    from plancc import Policy

    out = {}
    for layout in layouts:
        # (LoRA dropout under tp is refused: a rowwise layer's input shards would share masks)
        lora = {"r": 4, "targets": ["model.layers.*.self_attn.q_proj"], "dropout": 0.5 if layout.get("tp", 1) == 1 else 0.0}
        Policy(plan, model_name, device="cpu", lora=lora, layout=sized(**layout))
        drawn = [None] * dist.get_world_size()
        dist.all_gather_object(drawn, torch.rand(6).tolist())
        out[str(layout)] = drawn
    return out


# (name, value on the rank that misbehaves, whether only rank 1 misbehaves): a metric no step can sum
BAD_METRICS = [
    ("loss", 123456.0, False),  # would replace the step's own loss
    ("grad_norm", 0.0, True),
    ("", 1.0, False),
    ("  ", 1.0, True),
    (7, 1.0, True),  # not a string
    ("clip", "high", True),  # a string value
    ("clip", torch.ones(3), True),  # three elements
    ("clip", None, True),
]
GOOD_METRICS = [("loss_fn_value", 2.5), ("ratio", torch.tensor([0.25])), ("count", 3), ("flag", True)]


def metric_fuzz(plan, model_name, layouts):
    """For each layout: every bad metric (on every rank, or on rank 1 alone) -> the outcome on this
    rank, then whether the next step trains; the good ones' reported sums; and tp ranks handed
    the same rows with different advantages or token masks -> the outcome."""
    from plancc import Policy
    from plancc.engine.batches import BatchError

    batch = _global_batch()
    out = {}
    for layout in layouts:
        policy = Policy(plan, model_name, device="cpu", layout=sized(**layout))
        rows = policy.slice_of(batch["input_ids"].shape[0])
        mine = {k: v[rows] for k, v in batch.items()}
        found = out.setdefault(str(layout), {})
        for name, value, one_rank in BAD_METRICS:

            def loss(lp, mb, norm, name=name, value=value, one_rank=one_rank):
                nll = -(lp * mb["attention_mask"]).sum() / norm.tokens
                return nll, ({name: value} if not one_rank or dist.get_rank() == 1 else {})

            try:
                row = policy.train(mine, loss)
                found[f"{name!r}={value!r}"] = f"accepted, loss {row['loss']}"
            except BatchError as exc:
                found[f"{name!r}={value!r}"] = f"BatchError: {exc}"
            found[f"then {name!r}={value!r}"] = math.isfinite(policy.train(mine, _nll)["loss"])
        row = policy.train(mine, lambda lp, mb, norm: (_nll(lp, mb, norm), dict(GOOD_METRICS)))
        found["good"] = {name: row.get(name) for name, _ in GOOD_METRICS}
        if layout.get("tp", 1) > 1 or layout.get("pp", 1) > 1:
            for field in ("advantages", "token_mask"):
                value = torch.ones_like(mine["input_ids"], dtype=torch.float32)
                if dist.get_rank() == 1:
                    value[0, 2] = -1.0 if field == "advantages" else 0.0
                try:
                    policy.train({**mine, field: value}, _nll)
                    found[field] = "accepted"
                except BatchError as exc:
                    found[field] = f"BatchError: {exc}"
    return out


def _nll(lp, mb, norm):
    mask = mb["attention_mask"].clone()
    mask[:, 0] = 0
    return -(lp * mask).sum() / norm.tokens
