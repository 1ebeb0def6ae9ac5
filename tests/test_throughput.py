"""Only real tokens computed, and even dp ranks (issue 40, points 1 and 4).

A microbatch is cut to its own rows' last attended position (rounded to the layout's sequence
multiple), not padded to the whole batch's length; its results come back at the batch's width.
``Policy.balanced_slices`` gives every dp rank as many rows as ``slice_of`` with the token counts
as even as possible; the loss is normalized globally, so the step is the same."""

import pytest
import torch

from plancc.engine.batches import Microbatch, balanced_partition


def _batch(lengths, seq, *, left=False):
    ids = torch.arange(1, len(lengths) * seq + 1).reshape(len(lengths), seq)
    positions = torch.arange(seq)[None, :]
    n = torch.tensor(lengths)[:, None]
    mask = (positions >= seq - n) if left else (positions < n)
    return {"input_ids": ids * mask, "attention_mask": mask.long()}


@pytest.mark.parametrize("multiple", [1, 4])
def test_a_microbatch_of_short_rows_is_cut_to_their_own_length_not_the_batchs(multiple):
    batch = _batch([3, 64, 5, 6], seq=64)
    mb = Microbatch.of(batch, [0, 2, 3], multiple=multiple, pack=False)
    assert mb.input_ids.shape == (3, -(-6 // multiple) * multiple)  # the longest of these rows: 6
    assert torch.equal(mb.input_ids[:, :6], batch["input_ids"][[0, 2, 3], :6])
    back = mb.unpack(torch.ones(mb.input_ids.shape))
    assert back.shape == (3, 64) and back[:, mb.input_ids.shape[1] :].abs().sum() == 0


def test_left_padded_rows_keep_every_position_up_to_the_last_attended_one():
    batch = _batch([3, 5], seq=12, left=True)  # attended at the end: nothing to cut
    mb = Microbatch.of(batch, [0, 1], multiple=1, pack=False)
    assert mb.input_ids.shape == (2, 12)


def test_a_row_of_one_token_still_gives_the_model_two_positions():
    mb = Microbatch.of(_batch([1, 1], seq=8), [0, 1], multiple=1, pack=False)
    assert mb.input_ids.shape == (2, 2)


def test_balanced_partition_keeps_row_counts_and_evens_the_tokens():
    lengths = [2048, 16, 20, 1900, 31, 1700, 18, 25]  # long-tailed, the long rows on the first half
    groups = balanced_partition(lengths, 2)
    assert [len(g) for g in groups] == [4, 4] and sorted(sum(groups, [])) == list(range(8))
    loads = [sum(lengths[r] for r in g) for g in groups]
    contiguous = [sum(lengths[:4]), sum(lengths[4:])]
    assert max(loads) < max(contiguous) and max(loads) - min(loads) <= max(lengths)
    assert groups == balanced_partition(lengths, 2)  # every rank computes the same


def test_uniform_lengths_keep_the_contiguous_slices():
    assert balanced_partition([16] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_balanced_slices_give_the_same_step_as_contiguous_ones_at_dp2():
    from .distributed import launch
    from .throughput_worker import balanced_and_contiguous_steps

    results = launch(balanced_and_contiguous_steps, 2, "plans/qwen3.yaml", "tiny-qwen3")
    tokens = {rank: (r["contiguous_tokens"], r["balanced_tokens"]) for rank, r in results.items()}
    assert max(t[1] for t in tokens.values()) < max(t[0] for t in tokens.values()), tokens
    for rank, r in results.items():
        assert r["balanced_loss"] == pytest.approx(r["contiguous_loss"], rel=1e-6), (rank, r)
        assert r["max_parameter_diff"] <= 1e-6, (rank, r)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("loss", ["loss_fn", "token_loss"])
def test_train_reads_the_device_as_often_for_eight_microbatches_as_for_two(loss, pack):
    """The agreement on refused losses and the finiteness check happen once per step (issue 40,
    point 3): the host reads of a step (``item``, ``tolist``, ``float``, ``int``, ``bool``) do not
    grow with the microbatches, a metric the loss returns as a tensor included (transformers' mask
    builder reads once per forward in its own code: not counted). A fake world of one rank: its collectives are exact."""
    import traceback

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import plancc

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        policy = plancc.Policy("plans/qwen3.yaml", "tiny-qwen3", device="cpu")
        batch = {"input_ids": torch.randint(0, 200, (8, 16)), "attention_mask": torch.ones(8, 16, dtype=torch.long)}
        counts = {}
        originals = {
            name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "__int__", "__bool__")
        }

        def counting(name):
            def read(self, *args, **kwargs):
                # transformers' mask builder asks once per forward whether there is padding or
                # packing (its own read, in its code): plancc's reads are counted
                if not any(f.filename.endswith("masking_utils.py") for f in traceback.extract_stack(limit=4)):
                    counts[name] = counts.get(name, 0) + 1
                return originals[name](self, *args, **kwargs)

            return read

        reads = []
        try:
            for name in originals:
                setattr(torch.Tensor, name, counting(name))
            for rows in (4, 1):  # 2 microbatches, then 8
                counts.clear()
                nll = lambda lp, fields, norm: (-lp.sum() / norm.tokens, {"nll_sum": -lp.detach().sum()})  # noqa: E731
                policy.train(batch, **{loss: nll}, micro_batch_size=rows, pack=pack)
                reads.append(dict(counts))
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
    finally:
        dist.destroy_process_group()
    assert reads[0] == reads[1], reads
