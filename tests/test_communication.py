"""Every collective a shipped plan sends is one we meant: the collectives of one forward and
one backward of one decoder layer at tp=2 (with and without SP; ep=2 for the MoE plans), counted
by the dry run (the same code a job runs, on a fake process group), pinned to the lean pattern
of torchtitan and Megatron: one collective per block input in each direction, and otherwise
only the all-reduces of replicated weights' gradients (norms under SP, q/k norms).

Exactness of the same plans (`--verify`) is tests/test_numerics.py's and tests/test_moe.py's."""

from __future__ import annotations

import pytest

import plancc
from plancc.models import load_config
from plancc.tools.dryrun import layer_traffic

from .conftest import PLANS

AR, AG, RS, A2A = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"

# (plan, preset, layout) -> (forward, backward) collectives of one decoder layer on the tp (or,
# with ep, every) axis. Dense blocks: one all-reduce per block without SP; one all-gather in,
# one reduce-scatter out under SP, and the reverse in backward. Extra backward all-reduces are
# replicated weights' gradients: Qwen3/Gemma3 q/k norms (2), SP norms (2 per layer, Gemma3 4).
LEAN = {
    ("qwen3", "tiny-qwen3", "tp2"): ({AR: 2}, {AR: 2 + 2}),
    ("qwen3", "tiny-qwen3", "tp2+sp"): ({AG: 2, RS: 2}, {RS: 2, AG: 2, AR: 2 + 2}),
    ("llama", "tiny-llama", "tp2"): ({AR: 2}, {AR: 2}),
    ("llama", "tiny-llama", "tp2+sp"): ({AG: 2, RS: 2}, {RS: 2, AG: 2, AR: 2}),
    ("gemma3", "tiny-gemma3", "tp2"): ({AR: 2}, {AR: 2 + 2}),
    ("gemma3", "tiny-gemma3", "tp2+sp"): ({AG: 2, RS: 2}, {RS: 2, AG: 2, AR: 4 + 2}),
    # Phi-3's qkv is gathered (its forward slices it with global sizes): one all-gather more each
    # way, and o_proj (rowwise_rep) slices its gathered input, gathering its gradient back
    ("phi3", "tiny-phi3", "tp2"): ({AG: 2, AR: 2}, {AG: 3, AR: 2}),
    ("phi3", "tiny-phi3", "tp2+sp"): ({AG: 4, RS: 2}, {RS: 2, AG: 5, AR: 2}),
    # MoE blocks: the experts' partial outputs all-reduced; backward: the tokens' and the routing
    # weights' gradients (each rank routes every token to its own experts only)
    ("qwen3_moe", "tiny-qwen3-moe", "tp2"): ({AR: 2}, {AR: 1 + 2 + 2}),
    ("mixtral", "tiny-mixtral", "tp2"): ({AR: 2}, {AR: 1 + 2}),
    ("gpt_oss", "tiny-gpt-oss", "tp2"): ({AR: 2}, {AR: 1 + 2}),
    # MLA (the dense first layer): the low-rank q and kv latents' gradients, the shared rotary
    # key's, and the dense MLP's gate and up (no hidden-sized all-reduce in attention at all)
    ("deepseek_v3", "tiny-deepseek-v3", "tp2"): ({AR: 2}, {AR: 3 + 2}),
    # expert parallelism: tokens out, their ids out, results back (3 all-to-alls) and the reverse
    # of the two with gradients; FSDP's gather and reduce-scatter of the layer on the ep ranks
    ("qwen3_moe", "tiny-qwen3-moe", "ep2"): ({A2A: 3, AG: 1}, {A2A: 5, AG: 1, RS: 1}),
    ("mixtral", "tiny-mixtral", "ep2"): ({A2A: 3, AG: 1}, {A2A: 5, AG: 1, RS: 1}),
    ("gpt_oss", "tiny-gpt-oss", "ep2"): ({A2A: 3, AG: 1}, {A2A: 5, AG: 1, RS: 1}),
}
LAYOUTS = {
    "tp2": plancc.Layout(tp=2),
    "tp2+sp": plancc.Layout(tp=2, sequence_parallel=True),
    "ep2": plancc.Layout(dp=2, ep=2),
}


def layer_counts(plan_path, preset, layout):
    """(forward, backward) collective counts of one decoder layer, and its traffic."""
    traffic = layer_traffic(plancc.load_plan(plan_path), load_config(preset), layout, seq_len=16)
    assert traffic.index >= 0, "the layer was measured"
    return traffic.layer.counts("forward"), traffic.layer.counts("backward"), traffic.layer


@pytest.mark.parametrize("plan,preset,layout", sorted(LEAN), ids=["-".join(k) for k in sorted(LEAN)])
def test_a_layer_sends_the_lean_pattern(plan, preset, layout):
    forward, backward, _ = layer_counts(PLANS / f"{plan}.yaml", preset, LAYOUTS[layout])
    assert (forward, backward) == LEAN[(plan, preset, layout)]


def test_validate_dry_run_reports_a_layers_collectives(cli):
    """What `plancc validate --dry-run` prints and puts in its JSON: one layer's collectives."""
    import json

    code, out, err = cli("validate", PLANS / "qwen3.yaml", "--model", "tiny-qwen3", "--tp", "2", "--sp",
                         "--dry-run", "--seq-len", "16")
    assert code == 0, err
    assert "decoder layer 1 of 2 (batch 1 x 16 tokens): forward 2 all-gather, 2 reduce-scatter on tp" in out
    code, out, _ = cli("validate", PLANS / "qwen3.yaml", "--model", "tiny-qwen3", "--tp", "2", "--dry-run",
                       "--seq-len", "16", "--format", "json")
    per_layer = json.loads(out)["summary"]["dry_run"]["collectives"]["per_layer"]
    # tiny-qwen3: hidden 64, head_dim 16, fp32; a ring all-reduce at tp=2 moves its payload once.
    # Two block-input gradients (attention, MLP) and the q_norm and k_norm weight gradients.
    activation, norm_weight = 1 * 16 * 64 * 4, 16 * 4
    assert per_layer["backward"]["tp"]["all_reduce"] == {"count": 4, "wire_bytes": 2 * activation + 2 * norm_weight}


def old_styles(text: str) -> str:
    """The plan as it was before the block-input styles: each projection wraps its own input."""
    lines = [line for line in text.splitlines() if ": shared_input" not in line]
    text = "\n".join(lines) + "\n"
    return text.replace(": gather_seq_input", ": {style: gather_seq_input, use_local_output: true}")


@pytest.mark.parametrize("layout", ["tp2", "tp2+sp"])
def test_the_old_styles_sent_several_all_reduces_per_block(layout, write_plan):
    """The comparison the bench makes at real size (docs/performance.md), pinned at tp=2: under
    SP the old gather sent 3 + 2 all-reduces of the block gradients per layer where one
    reduce-scatter per block is enough; without SP 5 all-reduces where 2 are."""
    old = write_plan(old_styles((PLANS / "qwen3.yaml").read_text()))
    forward, backward, before = layer_counts(old, "tiny-qwen3", LAYOUTS[layout])
    _, _, now = layer_counts(PLANS / "qwen3.yaml", "tiny-qwen3", LAYOUTS[layout])
    if layout == "tp2":
        assert backward == {AR: 5 + 2}  # q, k, v, gate, up each, and the q/k norms
    else:  # the same, the SP norms', and the gather's gradient sliced back locally
        assert backward == {AG: 2, AR: 5 + 2 + 2}
    was, is_now = before.wire_bytes("backward"), now.wire_bytes("backward")
    assert is_now <= 0.5 * was, (is_now, was)
    assert forward == LEAN[("qwen3", "tiny-qwen3", layout)][0]  # forward never changed


def test_wire_bytes_follow_the_ring_formulas():
    """One Qwen3 layer at tp=2, batch 1 x 16 tokens, hidden 64, fp32 (4 bytes): an all-reduce of
    S bytes sends 2(n-1)/n S per rank; SP's all-gather (n-1) x its input shard, its
    reduce-scatter (n-1)/n x its input."""
    hidden = 1 * 16 * 64 * 4
    _, _, tp = layer_counts(PLANS / "qwen3.yaml", "tiny-qwen3", LAYOUTS["tp2"])
    assert tp.wire_bytes("forward") == 2 * hidden  # two all-reduces, 2(1)/2 S each
    _, _, sp = layer_counts(PLANS / "qwen3.yaml", "tiny-qwen3", LAYOUTS["tp2+sp"])
    assert sp.wire_bytes("forward") == 2 * hidden // 2 + 2 * hidden // 2  # AG of S/2, RS of S
