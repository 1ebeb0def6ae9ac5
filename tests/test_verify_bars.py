"""What `--verify` compares: the plan, not dropout's random masks, against bars that fp32
itself can meet on the model."""

from transformers import AutoConfig

from plancc.job.verify import EXACT_FACTOR, TOLERANCES, VerifyReport, within_tolerance, without_dropout


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


def test_beyond_the_bar_a_gradient_passes_only_as_near_exact_as_fp32_is():
    """Doge's dynamic-mask A: two fp32 models 2.05e-5 apart (beyond 2x the floor) -- each about
    the floor away from the fp64 gradient, so rounding; a doubled gradient is ~1 from exact."""
    rounding = VerifyReport(grad_max_rel=2.05e-5, grad_floor=7.9e-6, grad_exact_rel=1.55e-5)
    assert within_tolerance(rounding)
    doubled = VerifyReport(grad_max_rel=1.0, grad_floor=7.9e-6, grad_exact_rel=1.0)
    assert not within_tolerance(doubled)
    far = VerifyReport(grad_max_rel=2.05e-5, grad_floor=7.9e-6, grad_exact_rel=EXACT_FACTOR * 7.9e-6 * 1.01)
    assert not within_tolerance(far)
    unmeasured = VerifyReport(grad_max_rel=2.05e-5, grad_floor=7.9e-6)  # no fp64 run: the plain bar
    assert not within_tolerance(unmeasured)
