"""What every rank of a step agrees on before it reduces anything: the metrics of the caller's
loss by name (a name some ranks' loss does not give counts 0 there; the same names in another
order are summed by name), and the rows themselves (the fingerprint of a tp group's rows stays
exact whatever dtype the masks beside them have)."""

import pytest

from .conftest import PLANS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_metrics_are_summed_by_name_whatever_each_rank_reports():
    from .agreement_worker import _global_batch, uneven_metric_names
    from .distributed import launch

    results = launch(uneven_metric_names, 2, str(PLANS / "qwen3.yaml"), "tiny-qwen3", [{"dp": 2}, {"tp": 2}])
    batch = _global_batch()
    big_rows = float((batch["input_ids"] >= 128).any(1).sum())
    rows = float(batch["input_ids"].shape[0])
    for rank, out in results.items():
        # dp2: rank 0's loss never reports big_rows, rank 1's does; the keys come in another order
        assert out["{'dp': 2}"] == {"big_rows": big_rows, "z_rows": rows, "a_twice_rows": 2 * rows}, rank
        # tp2: both ranks hold the whole batch (one copy of each row), the keys in another order
        assert out["{'tp': 2}"] == {"big_rows": big_rows, "z_rows": rows, "a_twice_rows": 2 * rows}, rank
        assert "were given different rows" in out["different_rows"], rank
