"""Packed documents attend one document at a time (issue 40, point 5): no ``[T, T]`` mask over
the packed row, and the numbers of transformers' dense block-diagonal mask
(``PLANCC_DOCUMENT_MASK=dense``, the reference) -- log-probs, loss, gradient and the step, with
full and sliding-window layers. Under context parallelism the cp attention goes document by
document too: ``tests/test_policy.py``'s packed cp cases train it against the unsharded model.
A real world of one rank here."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

LENGTHS = [37, 5, 64, 12, 29, 3, 50]  # one packed microbatch of 7 documents: T = 200


def _config(window: int | None):
    from plancc.models import load_config

    config = load_config("tiny-qwen3")
    if window:  # one sliding layer, one full one
        config.use_sliding_window, config.sliding_window, config.max_window_layers = True, window, 0
        config.layer_types = ["sliding_attention", "full_attention"]
    return config


def _policy(window, device="cpu"):
    import plancc

    return plancc.Policy(
        "plans/qwen3.yaml",
        _config(window),
        device=device,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        max_grad_norm=None,
    )


def _batch():
    gen = torch.Generator().manual_seed(0)
    seq = max(LENGTHS)
    mask = (torch.arange(seq)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return {"input_ids": torch.randint(0, 200, (len(LENGTHS), seq), generator=gen) * mask, "attention_mask": mask}


def _nll(lp, tokens, norm):
    return -(lp * tokens["attention_mask"].float()).sum() / norm.tokens


def _run(monkeypatch, way, window, device="cpu"):
    monkeypatch.setenv("PLANCC_DOCUMENT_MASK", way)
    policy = _policy(window, device)
    assert (policy.model.config._attn_implementation == "plancc_docs") == (way == "documents")
    batch = _batch()
    logprobs = policy.logprobs(batch, pack=True)
    metrics = policy.train(batch, token_loss=_nll, pack=True)
    return logprobs, metrics, [t.detach().clone() for t in policy._shards()]


# CUDA: fp32 through the memory-efficient kernel (flash takes half precision only) against
# the dense mask's kernel, which sums in another order: 1e-4. Run where a GPU is lent
# (bench/gpu/gpu_session.sh, docs/gpu.md).
DEVICES = [
    pytest.param("cpu", 1e-5, id="cpu"),
    pytest.param(
        "cuda", 1e-4, id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
    ),
]


@pytest.mark.parametrize("device, tolerance", DEVICES)
@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding-window-8"])
def test_packed_documents_attend_as_under_the_dense_mask(one_rank, monkeypatch, window, device, tolerance):
    lp_dense, dense, weights_dense = _run(monkeypatch, "dense", window, device)
    lp_docs, docs, weights_docs = _run(monkeypatch, "documents", window, device)
    assert torch.allclose(lp_docs, lp_dense, atol=tolerance, rtol=0)
    assert docs["microbatches"] == 1
    for key in ("loss", "grad_norm"):
        assert docs[key] == pytest.approx(dense[key], rel=tolerance), key
    for a, b in zip(weights_docs, weights_dense, strict=True):
        assert torch.allclose(a, b, rtol=tolerance, atol=tolerance / 10)


class _RowByRow(TorchDispatchMode):
    """Whether any op returned a tensor with two dims of at least ``length`` (a mask or scores
    over the whole packed row against itself)."""

    def __init__(self, length):
        super().__init__()
        self.length, self.seen = length, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and sum(d >= self.length for d in t.shape) >= 2:
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("way", ["documents", "dense"])
def test_no_tensor_spans_the_packed_row_against_itself(one_rank, monkeypatch, way):
    """The dense path builds a [T, T] mask for the packed row of T tokens; per document no tensor
    has two dims of T (the largest attention is the longest document's)."""
    monkeypatch.setenv("PLANCC_DOCUMENT_MASK", way)
    policy = _policy(None)
    with _RowByRow(sum(LENGTHS)) as mode:
        policy.logprobs(_batch(), pack=True)
        policy.train(_batch(), token_loss=_nll, pack=True)
    assert bool(mode.seen) == (way == "dense"), mode.seen[:3]


def test_a_direct_forward_after_a_packed_one_attends_by_its_own_mask(one_rank, monkeypatch):
    """The documents are the forward's they were set for: the model called directly afterwards
    (as a user's eval or plancc's --verify does) attends by its rows' mask, never by the
    boundaries of the last packed row, even when its length happens to match them."""
    monkeypatch.setenv("PLANCC_DOCUMENT_MASK", "documents")
    policy = _policy(None)
    ids = _batch()["input_ids"][:1, :40]
    with torch.no_grad():
        before = policy.model(input_ids=ids, use_cache=False).logits
        policy.logprobs({"input_ids": ids[:, :40], "attention_mask": torch.ones_like(ids)}, pack=True)
        policy.logprobs(
            {"input_ids": ids.reshape(2, 20), "attention_mask": torch.ones(2, 20, dtype=torch.long)}, pack=True
        )  # two documents of 20: 40 positions, the direct call's length
        after = policy.model(input_ids=ids, use_cache=False).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding-window-8"])
def test_a_sink_model_packs_as_its_rows_alone(one_rank, window):
    """gpt-oss attends eagerly (learned sinks): transformers' own packed mask lets its documents
    see each other (0.16 in log-probs measured before this path). Packed, it goes document by
    document through the block attention and equals the rows one by one (padded, the model's
    own eager attention): log-probs, loss, gradient norm and the weights after a step."""
    import plancc
    from plancc.models import load_config

    config = load_config("tiny-gpt-oss")
    if window:
        config.sliding_window = window
    runs = {}
    for pack in (True, False):
        policy = plancc.Policy(
            "plans/gpt_oss.yaml",
            config,
            device="cpu",
            max_grad_norm=None,
            optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        )
        assert policy.model.config._attn_implementation == "plancc_docs_eager"
        batch = _batch()
        logprobs = policy.logprobs(batch, pack=pack)
        metrics = policy.train(batch, token_loss=_nll, pack=pack)
        runs[pack] = logprobs, metrics, [t.detach().clone() for t in policy._shards()]
    (lp_packed, packed, w_packed), (lp_rows, rows, w_rows) = runs[True], runs[False]
    mask = _batch()["attention_mask"].bool()
    assert torch.allclose(lp_packed[mask], lp_rows[mask], atol=1e-5, rtol=0)
    assert packed["microbatches"] == 1
    for key in ("loss", "grad_norm"):
        assert packed[key] == pytest.approx(rows[key], rel=1e-5), key
    for a, b in zip(w_packed, w_rows, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.extended  # the kernel's rule, tiles, sinks and caps: tests/test_flex_blocks.py
@pytest.mark.parametrize(("preset", "window"), [("tiny-qwen3", 8), ("tiny-gpt-oss", None)], ids=["window", "sinks"])
def test_a_packed_row_in_one_flex_call_equals_its_rows_alone(one_rank, monkeypatch, preset, window):
    """CUDA's packed row at cp = 1 (one flex-attention call a layer), run forward-only on the CPU
    (``PLANCC_CP_ATTENTION=flex``): the log-probs of the rows one by one."""
    import plancc
    from plancc.models import load_config
    from plancc.runtime import document_attention

    monkeypatch.setenv("PLANCC_CP_ATTENTION", "flex")
    calls = []
    one_call = document_attention.flex_block_attention
    monkeypatch.setattr(
        document_attention, "flex_block_attention", lambda *a, **k: calls.append(1) or one_call(*a, **k)
    )
    config = _config(window) if preset == "tiny-qwen3" else load_config(preset)
    plan = "plans/qwen3.yaml" if preset == "tiny-qwen3" else "plans/gpt_oss.yaml"
    policy = plancc.Policy(plan, config, device="cpu")
    batch = _batch()
    packed = policy.logprobs(batch, pack=True)
    assert len(calls) == config.num_hidden_layers  # one call a layer, whatever the documents
    rows = policy.logprobs(batch, pack=False)
    mask = batch["attention_mask"].bool()
    assert torch.allclose(packed[mask], rows[mask], atol=1e-5, rtol=0)
