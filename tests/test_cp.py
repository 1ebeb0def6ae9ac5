"""Context parallelism: the head-tail layout (bit-for-bit the reference's), shard/unshard
round trips, equal causal work, an autograd all-gather that is right on real gloo groups, and
CP training and log-probs that match the unsharded model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plancc.cp import (
    load_balanced_indices,
    pad_documents,
    load_balanced_indices_packed,
    pad_to_multiple,
    shard,
    shard_packed,
    unshard,
    unshard_packed,
)

from .conftest import PLANS
from .distributed import launch

cp_sizes = st.integers(1, 8)


@st.composite
def layouts(draw):
    cp = draw(cp_sizes)
    seq = 2 * cp * draw(st.integers(1, 8))
    return cp, seq


def head_tail_owner(position: int, seq: int, cp: int) -> int:
    """The reference formula: chunk j of 2*cp belongs to rank j, or 2*cp-1-j in the second half."""
    chunk = position // (seq // (2 * cp))
    return chunk if chunk < cp else 2 * cp - 1 - chunk


@given(layouts())
def test_indices_are_a_balanced_permutation_with_the_head_tail_layout(layout):
    cp, seq = layout
    per_rank = [load_balanced_indices(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(per_rank).tolist()) == list(range(seq))
    assert {len(i) for i in per_rank} == {seq // cp}
    for r, idx in enumerate(per_rank):
        assert all(head_tail_owner(p, seq, cp) == r for p in idx.tolist())
        assert idx.tolist() == sorted(idx.tolist())  # in order
    # causal work: each query attends to (position + 1) keys; equal on every rank
    assert len({int((idx + 1).sum()) for idx in per_rank}) == 1


@given(layouts(), st.integers(0, 2), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]), st.data())
def test_unshard_inverts_shard_on_any_dim_and_dtype(layout, extra_dims, dtype, data):
    cp, seq = layout
    dim = data.draw(st.integers(0, extra_dims))
    shape = [2] * extra_dims
    shape.insert(dim, seq)
    x = (torch.arange(torch.Size(shape).numel()).reshape(shape) % 251).to(dtype)
    shards = [shard(x, cp, r, dim=dim) for r in range(cp)]
    assert all(s.shape[dim] == seq // cp for s in shards)
    assert torch.equal(unshard(shards, dim=dim), x)
    assert torch.equal(shards[cp - 1], x.index_select(dim, load_balanced_indices(seq, cp, cp - 1)))


@given(cp_sizes, st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_packed_layout_is_per_document(cp, multiples):
    lengths = [2 * cp * m for m in multiples]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.arange(int(cu[-1])).unsqueeze(0)
    shards = [shard_packed(x, cu, cp, r) for r in range(cp)]
    assert torch.equal(unshard_packed(shards, cu), x)
    for r in range(cp):
        idx = load_balanced_indices_packed(cu, cp, r)
        start = 0
        for length in lengths:  # within each document: that document's head-tail slice
            doc = idx[(idx >= start) & (idx < start + length)] - start
            assert torch.equal(doc, load_balanced_indices(length, cp, r))
            start += length
    # equal causal work per document (positions restart at each document)
    work = [sum(int(((load_balanced_indices(n, cp, r)) + 1).sum()) for n in lengths) for r in range(cp)]
    assert len(set(work)) == 1


@given(cp_sizes, st.lists(st.integers(1, 30), min_size=1, max_size=5))
def test_pad_documents_rounds_every_document_up_to_the_multiple(cp, lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    padded = pad_documents(cu, cp)
    new = (padded[1:] - padded[:-1]).tolist()
    assert all(n % (2 * cp) == 0 and 0 <= n - old < 2 * cp for n, old in zip(new, lengths))


@given(cp_sizes, st.integers(1, 50))
def test_shard_refuses_lengths_off_the_multiple_and_the_pad_helper_says_how_much(cp, seq):
    x = torch.zeros(1, seq)
    padded, pad = pad_to_multiple(x, cp)
    assert padded.shape[1] % (2 * cp) == 0 and 0 <= pad < 2 * cp and padded.shape[1] == seq + pad
    if pad and cp > 1:
        with pytest.raises(ValueError, match=f"pad it by {pad}"):
            shard(x, cp, 0)


def _gather_cases():
    cases = []

    @settings(max_examples=25, deadline=None, derandomize=True, database=None)
    @given(st.integers(0, 2), st.sampled_from(["float32", "float64"]), st.integers(0, 999),
           st.lists(st.integers(1, 3), min_size=1, max_size=3), st.booleans(), st.data())
    def collect(extra, dtype, seed, docs, packed, data):
        dim = data.draw(st.integers(0, extra))
        lengths = [8 * k for k in docs]  # multiples of 2*cp for cp in {2, 4}
        shape = [2] * extra
        shape.insert(dim, sum(lengths))
        cases.append((tuple(shape), dim, dtype, seed, lengths if packed else None))

    collect()
    return cases


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_forward_is_unshard_and_backward_is_shard_of_the_summed_gradient(world):
    from .cp_worker import check_all_gather

    cases = _gather_cases()
    results = launch(check_all_gather, world, cases)
    for rank, per_case in results.items():
        for case, r in zip(cases, per_case):
            assert r["forward_equal"], (rank, case)
            assert r["grad_err"] <= 1e-6 * max(1.0, r["grad_scale"]), (rank, case, r)
            # backward is reduce-scatter only: no all-reduce of the full sequence
            assert "all_reduce" not in r["backward_collectives"] and r["backward_collectives"], r


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp,tp,sp", [(2, 1, False), (2, 2, False), (2, 2, True)], ids=["cp2", "cp2-tp2", "cp2-tp2-sp"])
def test_cp_token_logprobs_match_unsharded_with_padding_and_packing(cp, tp, sp):
    from .cp_worker import compare_cp_token_logprobs

    results = launch(compare_cp_token_logprobs, cp * tp, str(PLANS / "qwen3.yaml"), "tiny-qwen3", cp, tp, sp)
    for rank, r in results.items():
        assert r["padding"] <= 1e-5 and r["packed"] <= 1e-5, (rank, r)
        assert r["left_padding_vs_alone"] <= 1e-5 and r["left_pad_and_first_zero"], (rank, r)
        assert r["cp_recognized"], (rank, r)
        assert r["misuse"] and "was not parallelized with it" in r["misuse"], (rank, r)


@pytest.mark.extended  # the default run: every shipped plan at cp2 (log-probs), cp2 x dp2 / cp2 x tp2
@pytest.mark.slow  # training (the soft-capped, indexer and Doge test) and cp4 training (below)
@pytest.mark.timeout(600)
def test_cp_training_matches_unsharded_for_every_plan():
    from .numerics_worker import verify_cases
    from .test_numerics import assert_matches

    two = [(str(PLANS / p), m, 1, 2, 1, False) for p, m in
           [("qwen3.yaml", "tiny-qwen3"), ("llama.yaml", "tiny-llama-tied"), ("gemma3.yaml", "tiny-gemma3")]]
    results = launch(verify_cases, 2, two)
    for rank, reports in results.items():
        for i, case in enumerate(two):
            assert_matches(reports[i], f"rank {rank} {case}")
    four = [(str(PLANS / "qwen3.yaml"), "tiny-qwen3-tied", 1, 2, 2, True),
            (str(PLANS / "gemma3.yaml"), "tiny-gemma3", 1, 2, 2, False),
            (str(PLANS / "llama.yaml"), "tiny-llama", 2, 2, 1, False)]
    results = launch(verify_cases, 4, four)
    for rank, reports in results.items():
        for i, case in enumerate(four):
            assert_matches(reports[i], f"rank {rank} {case}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp4_is_exact_on_the_shipped_plans_with_windows_sinks_padding_and_documents():
    """cp=4: chunks of 2 tokens of a 16-token sequence, so every rank's queries cross several
    others' keys; Gemma 3 and gpt-oss window 8 of them (the band blocks), gpt-oss adds sinks;
    the log-probs take right and left padding and packed documents through the block attention."""
    from .cp_worker import compare_cp_token_logprobs
    from .numerics_worker import verify_cases
    from .test_numerics import assert_matches

    cases = [(str(PLANS / "qwen3.yaml"), "tiny-qwen3", 1, 4, 1, False),
             (str(PLANS / "gemma3.yaml"), "tiny-gemma3", 1, 4, 1, False),
             (str(PLANS / "gpt_oss.yaml"), "tiny-gpt-oss", 1, 4, 1, False)]
    results = launch(verify_cases, 4, cases)
    for rank, reports in results.items():
        for i, case in enumerate(cases):
            assert_matches(reports[i], f"rank {rank} {case}")
    results = launch(compare_cp_token_logprobs, 4, str(PLANS / "gpt_oss.yaml"), "tiny-gpt-oss", 4, 1, False)
    for rank, r in results.items():
        assert r["padding"] <= 1e-5 and r["packed_vs_alone"] <= 1e-5, (rank, r)
        assert r["left_padding_vs_alone"] <= 1e-5 and r["left_pad_and_first_zero"], (rank, r)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp_token_logprobs_with_plain_vocab_shard_logits(tmp_path):
    """lm_head `colwise` hands back plain local vocab shards: under cp x tp they are combined
    over tp (the mesh goes along), not read as the whole vocabulary."""
    from .cp_worker import compare_cp_token_logprobs

    plan = tmp_path / "qwen3-lm-head.yaml"
    plan.write_text((PLANS / "qwen3.yaml").read_text().replace("  lm_head: colwise_logits\n", "  lm_head: colwise\n"))
    results = launch(compare_cp_token_logprobs, 4, str(plan), "tiny-qwen3", 2, 2, False)
    for rank, r in results.items():
        assert r["padding"] <= 1e-5 and r["packed"] <= 1e-5, (rank, r)


def _folder(tmp_path, model_type, **fields):
    """A tiny config of ``model_type`` saved as a model folder (no weights: seeded init)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tiny = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "deepseek_v32":  # small MLA ranks and indexer, one KV head per head (as bench/hf_sweep.py)
        tiny.update(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                    head_dim=8, num_key_value_heads=4, index_n_heads=4, index_head_dim=16, n_routed_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32)
    config = AutoConfig.for_model(model_type, **{**tiny, **fields})
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    folder = tmp_path / model_type
    config.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp_is_exact_with_a_sliding_window_from_the_config_and_with_learned_sinks(tmp_path):
    """Mistral passes its window to the attention interface, not on the module; Phi-MoE to its
    mask only; gpt-oss its sinks as ``s_aux``: a window of 6 over 16-token sequences (cp=2: chunks of 4) crosses the
    shards, and the sinks take probability mass on every row."""
    from plancc.models import load_config
    from plancc.tools.import_hf import import_hf

    from .numerics_worker import verify_cases
    from .test_numerics import assert_matches

    mistral = _folder(tmp_path, "mistral", sliding_window=6)
    mistral_plan = tmp_path / "mistral.yaml"
    mistral_plan.write_text(import_hf(str(mistral)))
    gpt_oss = tmp_path / "gpt-oss"
    config = load_config("tiny-gpt-oss")
    config.sliding_window = 6
    config.save_pretrained(gpt_oss)
    # Phi-MoE passes no window at all: its mask takes config.sliding_window
    phimoe = _folder(tmp_path, "phimoe", sliding_window=6, num_local_experts=4, num_experts_per_tok=2)
    phimoe_plan = tmp_path / "phimoe.yaml"
    phimoe_plan.write_text(import_hf(str(phimoe)))
    cases = [(str(mistral_plan), str(mistral), 1, 2, 1, False), (str(PLANS / "gpt_oss.yaml"), str(gpt_oss), 1, 2, 1, False),
             (str(phimoe_plan), str(phimoe), 1, 2, 1, False)]
    results = launch(verify_cases, 2, cases)
    for rank, reports in results.items():
        for i, case in enumerate(cases):
            assert_matches(reports[i], f"rank {rank} {case}")


def test_cp_is_refused_at_the_plans_line_for_a_model_whose_attention_it_cannot_replace(tmp_path):
    import plancc
    from plancc.checks import check_plan
    from plancc.tools.import_hf import import_hf

    folder = _folder(tmp_path, "phi", sliding_window=None)
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(import_hf(str(folder)))
    plan = plancc.load_plan(plan_path)
    assert not [d for d in check_plan(plan, str(folder), tp=2) if d.is_error]  # tp alone stays fine
    (problem,) = [d for d in check_plan(plan, str(folder), cp=2) if d.is_error]
    assert problem.rule == "context-parallel" and problem.loc.line > 0
    assert "no attention modules that call transformers' attention interface" in problem.message
    assert problem.fix and "--cp 1" in problem.fix


def _key_pickers(tmp_path):
    """Soft-capped logits (Gemma 2, a cap of 1 that binds on these scores, a window of 6), a
    sparse-attention indexer keeping 6 keys (DeepSeek-V3.2) and Doge's dynamic mask keeping 6:
    fewer than the 32-token rows verify trains on, so the picks bind across the shards."""
    from plancc.tools.import_hf import import_hf

    folders = {
        "gemma2": _folder(tmp_path, "gemma2", sliding_window=6, attn_logit_softcapping=1.0),
        "deepseek_v32": _folder(tmp_path, "deepseek_v32", index_topk=6),
        # 2 KV heads: A's 2 rows split over tp2 x fsdp2 unevenly, which torch's distribute_tensor
        # refuses (runtime.materialize fills them itself)
        "doge": _folder(tmp_path, "doge", keep_window_size=6, sliding_window=None),
    }
    built = {}
    for name, folder in folders.items():
        plan_path = tmp_path / f"{name}.yaml"
        plan_path.write_text(import_hf(str(folder)))
        built[name] = (str(plan_path), str(folder))
    return built


def test_cp_accepts_layers_that_pick_keys_and_says_what_their_mask_costs(tmp_path):
    import plancc
    from plancc.checks import check_plan

    for name, (plan_path, folder) in _key_pickers(tmp_path).items():
        found = [d for d in check_plan(plancc.load_plan(plan_path), folder, cp=2) if d.rule == "context-parallel"]
        assert not [d for d in found if d.is_error], (name, found)
        if name != "gemma2":  # the indexer and the dynamic mask attend under a dense [S/cp, S] mask
            (warning,) = found
            assert "[S/cp, S] mask" in warning.message and "keys" in warning.message, warning


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soft_capped_logits_indexers_and_dynamic_masks_are_exact_under_cp(tmp_path):
    """Logits, loss, every gradient and a step equal the unsharded model at cp=2 x tp=2 (and
    Doge at cp=2 x dp=2): the soft cap in the block attention's tiled kernel, the indexer scoring every
    rank's keys, Doge's mask from every key's dt (its gradient reduce-scattered back).

    Doge is held to the fixed bars on its first forward and backward, not on the losses of the
    steps after: its top-k of keys takes near-ties (``A`` starts at 0, every key's bias 1) that a
    step's last-bit rounding flips, so its later losses move by ~1e-3 at plain dp=2 already,
    without context parallelism (and agree to 1e-7 with the top-k off)."""
    from .numerics_worker import verify_cases
    from .test_numerics import assert_matches

    built = _key_pickers(tmp_path)
    # cp2 x tp2 for the three (cp2 alone: bench/hf_sweep.py --cp); Doge at cp2 x dp2 as well
    cases = [(plan, folder, 1, 2, 2, False) for plan, folder in built.values()]
    cases.append((*built["doge"], 2, 2, 1, False))
    results = launch(verify_cases, 4, cases)
    for rank, reports in results.items():
        for i, case in enumerate(cases):
            if "doge" in case[0]:
                r = reports[i]
                assert "error" not in r, r.get("trace")
                assert r["logits_max_rel"] <= 1e-5 and r["loss_abs"] <= 1e-5 and r["grad_max_rel"] <= 1e-4, r
                assert r["step_loss_abs"][0] <= 1e-5 and r["params_compared"] >= 20, r
            else:
                assert_matches(reports[i], f"rank {rank} {case}")


# hybrids whose mixers shard by heads: gated delta nets, Mamba2 beside attention, Mamba
HYBRIDS = {
    "qwen3_next": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "nemotron_h": dict(num_hidden_layers=3, hybrid_override_pattern="M*M", mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=2, ssm_state_size=16, chunk_size=8),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  mamba_d_state=8, mamba_expand=2, num_experts=4, num_experts_per_tok=2),
    # lightning attention in blocks of 4 positions: 16-token rows cross the shards' chunk edges
    "minimax": dict(num_hidden_layers=2, block_size=4, num_local_experts=4, num_experts_per_tok=2),
}


def _hybrid(tmp_path, model_type):
    from plancc.tools.import_hf import import_hf

    folder = _folder(tmp_path, model_type, sliding_window=None, **HYBRIDS[model_type])
    plan_path = tmp_path / f"{model_type}.yaml"
    plan_path.write_text(import_hf(str(folder)))
    return plan_path, folder


@pytest.mark.parametrize("model_type,too_many", [("qwen3_next", 4), ("nemotron_h", 8), ("jamba", 3), ("minimax", 8)])
def test_cp_accepts_hybrids_and_refuses_a_cp_that_does_not_divide_their_heads(tmp_path, model_type, too_many):
    import plancc
    from plancc.checks import check_plan

    plan_path, folder = _hybrid(tmp_path, model_type)
    plan = plancc.load_plan(plan_path)
    assert not [d for d in check_plan(plan, str(folder), cp=2) if d.is_error]
    problems = [d for d in check_plan(plan, str(folder), cp=too_many)
                if d.is_error and "does not divide" in d.message]
    assert problems and problems[0].rule == "context-parallel" and "--cp in {1, 2" in problems[0].fix, problems


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hybrid_models_are_exact_under_cp_with_their_mixers_sharded_by_heads(tmp_path):
    """A gated delta net (Qwen3-Next), Mamba2 beside attention (Nemotron-H), Mamba (Jamba) and
    MiniMax's lightning attention:
    logits, loss, every gradient and a step equal the unsharded model at cp=2, and at cp=2 x tp=2,
    by verify's own rule: the fp32 bars, or -- where the chunked scans' fp32 rounding is larger
    than them -- no further from the fp64 gradients than 4x the unsharded fp32 model is."""
    from plancc.job.verify import VerifyReport, within_tolerance

    from .numerics_worker import verify_cases

    def assert_matches(report, label):
        assert "error" not in report, f"{label}: {report.get('trace', report)}"
        assert within_tolerance(VerifyReport(**report)), f"{label}: {report}"
        assert report["params_compared"] >= 20, label

    built = {t: _hybrid(tmp_path, t) for t in HYBRIDS}
    two = [(str(plan), str(folder), 1, 2, 1, False) for plan, folder in built.values()]
    results = launch(verify_cases, 2, two)
    for rank, reports in results.items():
        for i, case in enumerate(two):
            assert_matches(reports[i], f"rank {rank} {case}")
    plan, folder = built["qwen3_next"]
    four = [(str(plan), str(folder), 1, 2, 2, False)]
    results = launch(verify_cases, 4, four)
    for rank, reports in results.items():
        assert_matches(reports[0], f"rank {rank} {four[0]}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h"])
def test_hybrid_log_probs_under_cp_take_padding_as_the_unsharded_model(tmp_path, model_type):
    """Right and left padding reach the mixers as their own masks (the cp input hook drops the
    model's): a left-padded row equals the row alone, a right-padded one the unsharded model."""
    from .cp_worker import compare_cp_token_logprobs

    plan, folder = _hybrid(tmp_path, model_type)
    results = launch(compare_cp_token_logprobs, 2, str(plan), str(folder), 2, 1, False)
    for rank, r in results.items():
        assert r["padding"] <= 1e-5 and r["packed"] <= 1e-5, (rank, r)
        assert r["left_padding_vs_alone"] <= 1e-5 and r["left_pad_and_first_zero"], (rank, r)


def test_cp_is_accepted_for_attention_models_with_windows_and_sinks(tmp_path):
    import plancc
    from plancc.checks import check_plan

    assert not [d for d in check_plan(plancc.load_plan(PLANS / "gpt_oss.yaml"), "tiny-gpt-oss", cp=2) if d.is_error]
    assert not [d for d in check_plan(plancc.load_plan(PLANS / "gemma3.yaml"), "tiny-gemma3", cp=2) if d.is_error]


SHIPPED = {"qwen3.yaml": "tiny-qwen3", "llama.yaml": "tiny-llama", "gemma3.yaml": "tiny-gemma3",
           "qwen3_moe.yaml": "tiny-qwen3-moe", "mixtral.yaml": "tiny-mixtral", "deepseek_v3.yaml": "tiny-deepseek-v3",
           "gpt_oss.yaml": "tiny-gpt-oss", "phi3.yaml": "tiny-phi3"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_shipped_plan_verifies_its_log_probs_at_cp2_packed_and_unpacked(tmp_path):
    """The guard the MLA regression lacked: every plan under ``plans/`` through ``plancc logprobs
    --cp 2 --verify`` (the CLI's worker path), rows of 16 to 30 tokens -- padded to the batch's
    longest, packed with every document padded to a multiple of 2*cp -- against the unsharded
    model at the command's 1e-5. Gemma 3 and gpt-oss window them, gpt-oss adds sinks, DeepSeek-V3's
    value head is narrower than its query/key head."""
    import json

    from .cp_worker import logprobs_verify_every_plan

    plans = sorted(p.name for p in PLANS.glob("*.yaml"))
    assert plans == sorted(SHIPPED), "a new shipped plan: give it its tiny preset here"
    gen = torch.Generator().manual_seed(0)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": torch.randint(3, 250, (n,), generator=gen).tolist()}) + "\n"
                            for n in (16, 30, 23, 17, 29, 20, 26, 18)))
    cases = [(str(PLANS / plan), preset) for plan, preset in SHIPPED.items()]
    results = launch(logprobs_verify_every_plan, 2, cases, str(data))
    assert len(results[0]) == 2 * len(SHIPPED), results
    for name, (ok, worst) in results[0].items():
        assert ok and worst <= 1e-5, (name, worst)


@pytest.mark.slow
@pytest.mark.extended  # the one-call kernel's rule, tiles, sinks and caps: tests/test_flex_blocks.py
@pytest.mark.timeout(900)
def test_the_one_call_flex_kernel_verifies_log_probs_inside_the_models_at_cp2(tmp_path):
    """CUDA's default CP kernel, a flex-attention call a layer, run forward-only on the CPU inside
    real models through ``logprobs --cp 2 --verify``: Gemma 3's and gpt-oss's windows, gpt-oss's
    sinks, DeepSeek-V3's narrower value head, packed rows and padded ones."""
    import json

    from .cp_worker import logprobs_verify_every_plan

    gen = torch.Generator().manual_seed(0)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": torch.randint(3, 250, (n,), generator=gen).tolist()}) + "\n"
                            for n in (16, 30, 23, 17, 29, 20, 26, 18)))
    cases = [(str(PLANS / plan), SHIPPED[plan]) for plan in ("gemma3.yaml", "gpt_oss.yaml", "deepseek_v3.yaml")]
    results = launch(logprobs_verify_every_plan, 2, cases, str(data), "flex")
    assert len(results[0]) == 2 * len(cases), results
    for name, (ok, worst) in results[0].items():
        assert ok and worst <= 1e-5, (name, worst)
