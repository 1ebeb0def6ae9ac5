"""``plancc.Policy``'s options one way each: the layout a ``Layout`` (plancc 0.x's keywords
deprecated, never silently chosen over it), how rows are cut one ``Microbatching``, how weights
go out one ``WeightFormat`` -- each also spelled by its fields as keywords, never both."""

import warnings

import pytest
import torch

import plancc
from plancc.engine.options import legacy_layout_keywords, policy_layout


def test_a_value_or_its_keywords_never_both_and_never_a_misspelt_one():
    assert plancc.Microbatching.of(None, {"max_tokens": 64}) == plancc.Microbatching(max_tokens=64)
    cut = plancc.Microbatching(micro_batch_size=2, pack=True)
    assert plancc.Microbatching.of(cut, {}) is cut
    with pytest.raises(TypeError, match="not both"):
        plancc.Microbatching.of(cut, {"max_tokens": 64})
    with pytest.raises(TypeError, match="'maxtokens'"):
        plancc.Microbatching.of(None, {"maxtokens": 64})
    assert plancc.WeightFormat.of(None, {"dtype": torch.bfloat16}).dtype is torch.bfloat16
    with pytest.raises(TypeError, match="weight_format= or its keywords"):
        plancc.WeightFormat.of(plancc.WeightFormat(), {"bucket_bytes": 1})


def test_the_old_layout_keywords_warn_and_never_override_the_layout():
    layout = plancc.Layout(dp=2, tp=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert policy_layout(layout, {"tp": 2}) is layout  # agrees: the layout, with a warning
        assert policy_layout(layout, {}) is layout
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "layout=plancc.Layout" in str(caught[0].message)
    with pytest.raises(plancc.LayoutError, match="tp=4 \\(the layout has 2\\)"):
        policy_layout(layout, {"tp": 4})
    with pytest.raises(TypeError, match="'tpp'"):
        legacy_layout_keywords({"tpp": 2})
