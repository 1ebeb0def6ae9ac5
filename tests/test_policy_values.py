"""``plancc.Policy``'s options one way each: the layout a ``Layout`` (plancc 0.x's keywords
deprecated, never silently chosen over it), how rows are cut one ``Microbatching``, how weights
go out one ``WeightFormat`` -- each also spelled by its fields as keywords, never both."""


import pytest
import torch

import plancc


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


