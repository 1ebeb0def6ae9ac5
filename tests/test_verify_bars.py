"""What `--verify` compares: the plan, not dropout's random masks, against bars that fp32
itself can meet on the model."""

from transformers import AutoConfig

from plancc.job.verify import TOLERANCES, VerifyReport, within_tolerance, without_dropout


def test_dropout_is_off_for_the_comparison_and_said_so():
    config = AutoConfig.for_model("seed_oss")  # attention and residual dropout 0.1 by default
    quiet, dropped = without_dropout(config)
    assert sorted(dropped) == ["attention_dropout=0.1", "residual_dropout=0.1"]
    assert quiet.attention_dropout == quiet.residual_dropout == 0.0
    assert config.attention_dropout == 0.1  # the caller's config is left as it was
    assert without_dropout(quiet)[1] == []


def test_the_bar_is_fp32s_or_twice_what_fp32_misses_on_the_model():
    """gemma4_unified_text: its own fp32-vs-fp64 gradient difference is 2.3e-5, so a correct
    plan differs from the unsharded model by ~2e-5 and a fixed 1e-5 bar fails it."""
    borderline = VerifyReport(grad_max_rel=2.0e-5, grad_floor=2.3e-5)
    assert borderline.tolerance("grad_rel") == 4.6e-5 and within_tolerance(borderline)
    plain = VerifyReport(grad_max_rel=2.0e-5, grad_floor=6e-7)
    assert plain.tolerance("grad_rel") == TOLERANCES["grad_rel"] and not within_tolerance(plain)
    assert VerifyReport(logits_floor=1e-6).tolerance("logits_rel") == TOLERANCES["logits_rel"]
