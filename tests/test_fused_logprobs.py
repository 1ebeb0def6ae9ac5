"""The fused evaluator: log-probs, entropy and the loss from hidden states and the lm_head
weight, never the [N, V] logits. Exact against fp64 log_softmax(h @ W.T) on the full logits
(forward 1e-6 relative, gradients 1e-5 relative beyond the rounding to the input dtype) at
tp 1, 2 and 4, uneven vocab splits, bf16 and fp32, chunk sizes that do not divide N, with
temperature and the sampler's top-k / top-p."""

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from plancc.logprobs import fused_logprobs, fused_nll_loss, fused_token_loss, vocab_parallel_logprobs

from .distributed import launch
from .fused_worker import _grad_error, check_fused_cases, ppo_loss, ppo_terms, reference, sampler_keep

FORWARD_TOL, GRAD_TOL = 1e-6, 1e-5
ROUNDINGS = 8  # fp32 roundings of a gradient's terms allowed where the terms cancel (_rounding_allowance)


def _nucleus_margin(h, w, temperature, top_k, top_p):
    """How far (fp64) every token's mass before it in the sorted distribution is from top_p."""
    x = (h.double() @ w.double().T) / temperature
    if top_k is not None:
        x = x.masked_fill(x < x.topk(min(top_k, x.shape[-1]), -1).values[..., -1:], float("-inf"))
    probs = x.softmax(-1).sort(-1, descending=True).values
    return ((probs.cumsum(-1) - probs) - top_p).abs().min().item()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    hdim=st.integers(1, 24),
    vocab=st.integers(2, 200),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    chunk=st.one_of(st.none(), st.integers(1, 9)),
    temperature=st.sampled_from([1.0, 0.7, 1.5]),
    top_k=st.one_of(st.none(), st.integers(1, 20)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    seed=st.integers(0, 2**16),
)
# a few tokens share the mass after top-p, so the entropy's gradient cancels (_rounding_allowance):
# two tokens, where fp32's own gradient error is 1.9e-5 of the gradient
@example(n=5, hdim=8, vocab=42, dtype="float32", chunk=None, temperature=0.7, top_k=None, top_p=0.25, seed=52)
# three tokens, where the fused gradient was off by 4.0e-5 of the gradient, autograd of the
# naive fp32 log_softmax by 1.2e-6 (the luck of its roundings), both within fp32's roundings
@example(n=2, hdim=1, vocab=11, dtype="float32", chunk=None, temperature=1.0, top_k=None, top_p=0.25, seed=2)
# logits near 14 and a log-prob of -1.27: the forward is off by 1.3e-6 of the log-prob
@example(n=22, hdim=22, vocab=116, dtype="bfloat16", chunk=1, temperature=0.7, top_k=None, top_p=0.875, seed=36474)
# a gradient that cancels to 1e-3 of its terms
@example(n=2, hdim=1, vocab=8, dtype="float32", chunk=None, temperature=1.0, top_k=None, top_p=0.25, seed=2)
# two tokens of logits near 14.4 share the mass (the target outside it): the entropy's gradient
# cancels to 1e-4 of the logits, and the fused one is off by a rounding of the logits
@example(n=13, hdim=21, vocab=114, dtype="float32", chunk=None, temperature=0.7, top_k=None, top_p=0.5, seed=58)
def test_one_rank_matches_fp64_full_logits(n, hdim, vocab, dtype, chunk, temperature, top_k, top_p, seed):
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    h = torch.randn(n, hdim, generator=gen).to(dt).requires_grad_(True)
    w = torch.randn(vocab, hdim, generator=gen).to(dt).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[0] = -100
    opts = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    # top-p's nucleus is a threshold on a cumulative sum: where a token's mass before it lies
    # within fp32's rounding of top_p (top_p = 0.99999 over 200 tokens), fp32 and fp64 may keep
    # different tokens -- both right. Such draws say nothing about the evaluator: skipped.
    assume(top_p is None or _nucleus_margin(h, w, temperature, top_k, top_p) > 1e-5)
    lp, ent = fused_logprobs(h, w, targets, entropy=True, chunk_size=chunk, **opts)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == targets.shape
    ref_h, ref_w = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref_lp, ref_ent = reference(ref_h, ref_w, targets, **opts)
    assert torch.equal(torch.isfinite(lp), torch.isfinite(ref_lp))  # filtered-out targets: -inf
    finite = torch.isfinite(ref_lp)
    # A log-prob is a logit minus the log-normalizer, an entropy the log-normalizer minus the
    # mean logit: differences of numbers the size of the logits, which fp32 holds to a rounding
    # of their size (a draw with logits near 14 and a log-prob of -1.27 was off by 1.3e-6 of
    # the log-prob, within fp32's roundings of 14). So relative to the larger of the two.
    logits = (ref_h.detach() @ ref_w.detach().T).abs().max().item() / temperature
    scale = max(1.0, ref_lp[finite].abs().max().item(), logits)
    assert (lp.double() - ref_lp)[finite].abs().max().item() <= FORWARD_TOL * scale
    assert (ent.double() - ref_ent).abs().max().item() <= FORWARD_TOL * max(1.0, ref_ent.abs().max().item(), logits)
    assert lp[0] == 0 and ent[0] == 0  # ignore_index
    g = torch.randn(n, generator=gen)
    ((torch.where(torch.isfinite(lp), lp, 0.0) * g).sum() + ent.sum()).backward()
    ((torch.where(finite, ref_lp, 0.0) * g.double()).sum() + ref_ent.sum()).backward()
    g_lp = torch.where(finite, g.double(), 0.0)
    allow_h, allow_w = _rounding_allowance(ref_h, ref_w, targets, g_lp, torch.ones(n, dtype=torch.float64), **opts)
    assert _grad_error(h.grad, ref_h.grad, dt, allow_h) <= GRAD_TOL
    assert _grad_error(w.grad, ref_w.grad, dt, allow_w) <= GRAD_TOL


def _rounding_allowance(h, w, targets, g_lp, g_ent, *, temperature, top_k, top_p, ignore_index=-100):
    """How far each entry of the gradients of h and w may be off by fp32's roundings alone:
    ROUNDINGS units of fp32's roundoff of the sum of the absolute values of its terms (fp64).

    Each logit's gradient is g_lp (1[j = t] - p_j) - g_ent p_j (log p_j + H), formed from
    numbers of the size of |log p_j| + H. Where a few tokens share the mass, log p_j + H nearly
    cancels (the entropy is flat there), and any fp32 computation -- autograd of the naive
    log_softmax included -- is off by a rounding of |log p_j| + H, not of the small result.
    And log p_j is itself x_j - logsumexp(x), a difference of numbers the size of the logits:
    with two tokens of logits near 14.4 sharing the mass, the fused gradient was off by 2.5x a
    rounding of |log p_j| + H and within one of the logits (the forward's tolerance is relative
    to the logits for the same reason). No rounding-free term is allowed for: a wrong or
    missing term is off by its full size."""
    x = (h.detach() @ w.detach().T) / temperature
    keep = sampler_keep(x, top_k, top_p)
    ls = torch.log_softmax(x.masked_fill(~keep, float("-inf")), -1)
    p = ls.exp()
    ent = -(p * ls.masked_fill(~keep, 0.0)).sum(-1, keepdim=True)
    valid = (targets != ignore_index).double().unsqueeze(1)
    onehot = torch.zeros_like(x).scatter(1, targets.clamp(min=0).unsqueeze(1), 1.0)
    lse = torch.logsumexp(x.masked_fill(~keep, float("-inf")), -1, keepdim=True)
    size = (x.abs() + lse.abs()).masked_fill(~keep, 0.0)  # what log p_j = x_j - lse is formed from
    terms = g_lp.abs().unsqueeze(1) * (onehot + p * (1 + size)) + g_ent.abs().unsqueeze(1) * p * (
        ls.abs() + ent + size
    )
    terms = (terms * valid).masked_fill(~keep, 0.0) / temperature
    allowed = ROUNDINGS * 2.0**-24  # fp32's unit roundoff
    return allowed * (terms @ w.detach().abs()), allowed * (terms.T @ h.detach().abs())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_1_2_4_with_uneven_vocab_splits_match_fp64():
    cases = [
        {"name": "fp32", "n": 37, "h": 16, "v": 103, "dtype": "float32", "chunk": 5, "uneven": True, "seed": 1},
        {"name": "bf16", "n": 29, "h": 24, "v": 90, "dtype": "bfloat16", "chunk": 4, "uneven": True, "seed": 2},
        {
            "name": "even-one-chunk",
            "n": 16,
            "h": 8,
            "v": 64,
            "dtype": "float32",
            "chunk": 64,
            "uneven": False,
            "seed": 3,
            "w_scale": 3.0,
        },
        {
            "name": "temperature",
            "n": 21,
            "h": 8,
            "v": 77,
            "dtype": "float32",
            "chunk": 6,
            "uneven": True,
            "seed": 4,
            "opts": {"temperature": 0.6},
        },
        {
            "name": "top-k-top-p",
            "n": 25,
            "h": 8,
            "v": 81,
            "dtype": "float32",
            "chunk": 7,
            "uneven": True,
            "seed": 5,
            "opts": {"temperature": 1.3, "top_k": 9, "top_p": 0.7},
        },
        {
            "name": "top-p-bf16",
            "n": 19,
            "h": 8,
            "v": 70,
            "dtype": "bfloat16",
            "chunk": 3,
            "uneven": False,
            "seed": 6,
            "opts": {"top_p": 0.5},
        },
        # the default chunking: forward and backward walk blocks of 16 vocab columns (every
        # rank holds at least twice as many columns as there are tokens), blocks that divide
        # no rank's shard
        {"name": "columns", "n": 18, "h": 16, "v": 203, "dtype": "float32", "chunk": None, "uneven": True, "seed": 7},
        {
            "name": "columns-bf16-temperature",
            "n": 13,
            "h": 8,
            "v": 150,
            "dtype": "bfloat16",
            "chunk": None,
            "uneven": True,
            "seed": 8,
            "opts": {"temperature": 0.8},
        },
    ]
    rows = launch(check_fused_cases, 4, cases)
    seen = set()
    for rank_rows in rows.values():
        for row in rank_rows:
            seen.add((row["case"], row["tp"]))
            assert row["by_columns"] == row["case"].startswith("columns"), row
            assert row["same_inf"], row
            assert row["lp"] <= FORWARD_TOL and row["ent"] <= FORWARD_TOL, row
            assert row["grad_h"] <= GRAD_TOL and row["grad_w"] <= GRAD_TOL, row
            if "loss" in row:
                assert row["loss"] <= FORWARD_TOL and row["loss_grad"] <= GRAD_TOL, row
                assert row["token_loss"] <= FORWARD_TOL and row["token_loss_grad"] <= GRAD_TOL, row
    assert len(seen) == len(cases) * 3


def test_loss_with_gradients_formed_in_forward_equals_autograd_of_the_logprobs():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(23, 12, generator=gen, requires_grad=True)
    w = torch.randn(50, 12, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=gen)
    weights = torch.rand(23, generator=gen)
    loss, lp = fused_nll_loss(h, w, targets, weights, chunk_size=4)
    assert not lp.requires_grad
    (2.0 * loss).backward()  # the incoming gradient scales what forward formed
    h2, w2 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    want = -(fused_logprobs(h2, w2, targets) * weights).sum()
    (2.0 * want).backward()
    assert torch.allclose(loss, want, rtol=1e-6)
    # relative to each gradient's scale: the two sum their terms in different orders (the
    # backward of fused_logprobs here walks vocab columns, the loss chunks of 4 tokens)
    assert _grad_error(h.grad, h2.grad.double(), torch.float32) <= GRAD_TOL
    assert _grad_error(w.grad, w2.grad.double(), torch.float32) <= GRAD_TOL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_a_clipped_objective_with_gradients_formed_in_forward_matches_fp64(dtype, chunk):
    gen = torch.Generator().manual_seed(3)
    dt = getattr(torch, dtype)
    h = torch.randn(30, 16, generator=gen).to(dt).requires_grad_(True)
    w = torch.randn(90, 16, generator=gen).to(dt).requires_grad_(True)
    targets = torch.randint(0, 90, (30,), generator=gen)
    targets[::4] = -100
    old, adv, mask = ppo_terms(30, seed=4)

    def loss_fn(lp, index):
        return ppo_loss(lp, index, old, adv, mask)

    loss, lp = fused_token_loss(h, w, targets, loss_fn, chunk_size=chunk)
    assert not lp.requires_grad and lp[0] == 0  # ignore_index
    loss.backward()
    ref_h, ref_w = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = loss_fn(reference(ref_h, ref_w, targets)[0], slice(None))
    want.backward()
    assert abs(loss.item() - want.item()) <= FORWARD_TOL * max(1.0, abs(want.item()))
    assert _grad_error(h.grad, ref_h.grad, dt) <= GRAD_TOL
    assert _grad_error(w.grad, ref_w.grad, dt) <= GRAD_TOL
    # the same objective through fused_logprobs (its backward recomputes the softmax) agrees
    h2, w2 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    loss_fn(fused_logprobs(h2, w2, targets, chunk_size=chunk), slice(None)).backward()
    assert _grad_error(h.grad, h2.grad.double(), dt) <= GRAD_TOL


def test_a_token_loss_that_is_not_a_scalar_is_refused_and_no_grad_forms_no_gradients():
    h, w, targets = torch.randn(5, 4, requires_grad=True), torch.randn(10, 4), torch.tensor([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="scalar tensor"):
        fused_token_loss(h, w, targets, lambda lp, index: -lp)
    with torch.no_grad():
        loss, lp = fused_token_loss(h, w, targets, lambda lp, index: -lp.sum())
    assert not loss.requires_grad and torch.allclose(loss, -fused_logprobs(h, w, targets).sum().detach())


def test_a_token_loss_that_would_drop_another_tensors_gradient_is_refused():
    gen = torch.Generator().manual_seed(5)
    h, w = torch.randn(12, 8, generator=gen, requires_grad=True), torch.randn(20, 8, generator=gen)
    targets = torch.randint(0, 20, (12,), generator=gen)
    coef = torch.tensor(0.5, requires_grad=True)  # a learned coefficient: a leaf of its own
    values = torch.nn.Linear(8, 1)(h.detach()).squeeze(-1)  # a value head's output: a graph from outside

    def scaled(lp, index):
        return (coef * lp).sum()

    def value_weighted(lp, index):
        return (values[index] * lp).sum()

    for loss_fn in (scaled, value_weighted):
        with pytest.raises(ValueError, match="requires grad besides the log-probs"):
            fused_token_loss(h, w, targets, loss_fn, chunk_size=5)
    # detached, the same tensor is a constant and the loss goes through
    loss, _ = fused_token_loss(h, w, targets, lambda lp, index: (values.detach()[index] * lp).sum(), chunk_size=5)
    loss.backward()
    assert h.grad is not None


def test_targets_outside_the_vocabulary_are_refused_and_ignore_index_gives_zero():
    h, w = torch.randn(3, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused_logprobs(h, w, torch.tensor([1, 10, 2]))
    lp = fused_logprobs(h, w, torch.tensor([1, -100, 2]))
    assert lp[1] == 0 and lp[0] < 0
    logits = torch.randn(3, 10, requires_grad=True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_parallel_logprobs(logits, torch.tensor([1, -5, 2]))
    lp = vocab_parallel_logprobs(logits, torch.tensor([1, -100, 2]))
    assert lp[1] == 0  # was -logsumexp
    lp.sum().backward()
    assert torch.count_nonzero(logits.grad[1]) == 0


def _qwen_vocab_model():
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.timeout(300)
def test_token_logprobs_on_qwens_vocabulary_never_holds_the_logits(monkeypatch):
    """Batch 2 x 1024 with a 151,936-token vocabulary: the fp32 logits are 1.16 GiB. The fused
    forward stays under 10% of that above the model and inputs; the logits path holds about
    twice it; both give the same log-probs (entropy too, against the full softmax)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from plancc.logprobs import fusable, token_logprobs

    model = _qwen_vocab_model()
    ids = torch.randint(0, 151936, (2, 1024), generator=torch.Generator().manual_seed(1))
    logits_bytes = ids.numel() * 151936 * 4

    def peak_above_inputs(evaluate):
        tracker = MemTracker()
        tracker.track_external(model, ids)
        with tracker, torch.no_grad():
            result = evaluate()
        peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return result, peak - params - ids.numel() * ids.element_size()

    assert fusable(model)
    (fused, entropy), fused_extra = peak_above_inputs(lambda: token_logprobs(model, ids, entropy=True))
    monkeypatch.setenv("PLANCC_FUSED_LM_HEAD", "0")  # the logits path, for comparison
    logits_path, logits_extra = peak_above_inputs(lambda: token_logprobs(model, ids))
    assert fused_extra <= 0.10 * logits_bytes, fused_extra / logits_bytes
    assert logits_extra >= logits_bytes  # the measurement sees the logits when they exist
    torch.testing.assert_close(fused, logits_path, rtol=0, atol=1e-5)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[:1, :64]).logits.double(), -1)
    want = -(logp.exp() * logp).sum(-1)[0, :-1]
    torch.testing.assert_close(entropy[0, 1:64].double(), want, rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_the_hidden_gradient_under_sp_is_reduce_scattered_not_all_reduced(dtype, tolerance):
    """Under SP the fused loss's ``[N, H]`` hidden gradient is each tp rank's partial sum over its
    vocabulary columns: it leaves as ``Partial`` and DTensor reduce-scatters it to the sequence
    shards -- half an all-reduce's bytes, in the compute dtype -- where the evaluator used to
    all-reduce it in fp32 and the gather's backward kept a chunk. The shards' gradients agree
    (fp32: to rounding; bf16: the partial sums rounded before they are added, within 1e-2 of
    the largest)."""
    from .distributed import launch
    from .fused_worker import hidden_gradient_under_sp

    for rank, r in launch(hidden_gradient_under_sp, 2, dtype).items():
        assert r["grad_diff"] <= tolerance and r["weight_grad_diff"] == 0, (rank, r)
        now, before = r["partial"], r["all_reduce"]
        assert "reduce_scatter" not in before, (rank, r)
        # the per-token statistics' all-reduces are the same both ways; beyond them, an fp32
        # all-reduce of [N, H] against a reduce-scatter of it in the compute dtype
        hidden_all_reduce = before["all_reduce"] - now["all_reduce"]
        assert hidden_all_reduce == 2 * (2 - 1) * (32 * 32 * 4) // 2, (rank, r)  # 2(tp-1)/tp x N x H x 4 bytes
        assert now["reduce_scatter"] * (4 if dtype == "bfloat16" else 2) == hidden_all_reduce, (rank, r)
