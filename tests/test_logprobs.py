"""Vocab-parallel log-probs are exact: forward equals log_softmax(...).gather on the full
logits, gradients equal autograd's, for random shapes, dtypes, uneven vocab splits, chunk
sizes and tp in {1, 2}; token_logprobs of a TP(+SP) model equals the unsharded model's."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plancc.logprobs import vocab_parallel_logprobs

from .conftest import PLANS
from .distributed import launch
from .logprob_worker import check_vocab_parallel_cases, compare_token_logprobs

# fp32 logits: 1e-6 (the bar); bf16 logits are exact inputs too (the computation is fp32).
TOL = {"float32": 1e-6, "bfloat16": 1e-5, "float64": 1e-6}


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    vocab=st.integers(2, 300),
    dtype=st.sampled_from(["float32", "bfloat16", "float64"]),
    chunk=st.one_of(st.none(), st.integers(1, 7)),
    seed=st.integers(0, 2**16),
)
def test_single_rank_matches_log_softmax_gather(shape, vocab, dtype, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * 3).to(getattr(torch, dtype)).requires_grad_(True)
    targets = torch.randint(0, vocab, tuple(shape), generator=gen)
    weights = torch.randn(*shape, generator=gen)
    lp = vocab_parallel_logprobs(logits, targets, chunk_size=chunk)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    ref_in = logits.detach().double().requires_grad_(True)
    ref = torch.log_softmax(ref_in, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert (lp.double() - ref).abs().max().item() <= TOL[dtype] * max(1.0, ref.abs().max().item())
    (lp * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    grad_tol = {"float32": 1e-6, "float64": 1e-6, "bfloat16": 1e-2}[dtype]  # bf16 grad is rounded to bf16
    scale = max(1.0, ref_in.grad.abs().max().item())
    assert (logits.grad.double() - ref_in.grad).abs().max().item() <= grad_tol * scale


def test_logits_are_not_modified_in_place():
    logits = torch.randn(3, 11)
    before = logits.clone()
    vocab_parallel_logprobs(logits, torch.tensor([0, 5, 10]), chunk_size=2)
    assert torch.equal(logits, before)


def _two_rank_cases():
    cases = []

    @settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @given(
        shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
        v0=st.integers(1, 150),
        v1=st.integers(1, 150),
        dtype=st.sampled_from(["float32", "bfloat16"]),
        chunk=st.one_of(st.none(), st.integers(1, 5)),
        seed=st.integers(0, 2**16),
    )
    def collect(shape, v0, v1, dtype, chunk, seed):
        cases.append((tuple(shape), v0 + v1, [v0, v1], dtype, chunk, seed))

    collect()
    return cases


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_uneven_vocab_splits_match_the_full_logits():
    """Cases drawn by hypothesis in the test process, checked on a real gloo group of 2."""
    cases = _two_rank_cases()
    results = launch(check_vocab_parallel_cases, 2, cases)
    for rank, per_case in results.items():
        for case, r in zip(cases, per_case):
            dtype = case[3]
            assert r["dtype_out"] == "torch.float32"
            assert r["lp"] <= TOL[dtype] * r["scale"], (rank, case, r)  # relative to the largest |log p|
            assert r["grad"] <= (1e-6 if dtype == "float32" else 1e-2) * r["grad_scale"], (rank, case, r)
            # communication is O(tokens), never O(tokens x vocab): a max, then (sum-exp, target
            # logit) stacked; backward recomputes locally and communicates nothing
            assert r["forward_collectives"] == [("all_reduce", r["tokens"]), ("all_reduce", 2 * r["tokens"])]
            assert r["backward_collectives"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_token_logprobs_tp2_matches_unsharded_with_padding_and_packing(sp):
    results = launch(compare_token_logprobs, 2, str(PLANS / "qwen3.yaml"), "tiny-qwen3", 2, sp)
    for rank, r in results.items():
        assert r["padding"] <= 1e-5 and r["packed"] <= 1e-5, (rank, r)
        assert r["packed_vs_separate"] <= 1e-5, r  # packing really isolates documents
        assert r["pad_zero"] and r["first_zero"], r
        assert r["left_padding_vs_alone"] <= 1e-5 and r["left_pad_and_first_zero"], r


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lm_head", ["colwise_rep", "colwise"], ids=["whole-logits", "plain-vocab-shard"])
def test_token_logprobs_reads_plain_logits_right_whatever_the_lm_head_style(tmp_path, lm_head):
    """Plain (non-DTensor) logits are the whole vocabulary (HF's colwise_rep, as `plancc
    import-hf` writes) or a local vocab shard (colwise): treating the first as shards summed
    tp copies and shifted every log-prob by log(tp) = 0.693."""
    plan = tmp_path / "qwen3-lm-head.yaml"
    plan.write_text((PLANS / "qwen3.yaml").read_text().replace("  lm_head: colwise_logits\n", f"  lm_head: {lm_head}\n"))
    results = launch(compare_token_logprobs, 2, str(plan), "tiny-qwen3", 2, False)
    for rank, r in results.items():
        assert r["padding"] <= 1e-5 and r["packed"] <= 1e-5, (rank, r)
