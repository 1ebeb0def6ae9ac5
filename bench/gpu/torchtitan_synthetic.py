"""torchtitan's own trainer on plancc's benchmark model and data (issue 60, point 5).

Imported by torchtitan through ``--experimental.custom_import bench.gpu.torchtitan_synthetic``: it
registers the train spec ``plancc_llama`` -- torchtitan's Llama 3 (model, ``parallelize_llama``
with its per-block ``torch.compile``, FSDP2, AdamW, cross-entropy loss), unchanged, with one flavor
added and the tokenizer and text dataset swapped for rows of uniform random token ids, since the
GPU machine has no hub and no dataset. ``bench/gpu/train_gpu.py --compare-torchtitan`` trains
plancc on the same model and the same kind of rows.

The flavor ``1B`` is Llama 3.2 1B's shape (dim 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192,
vocabulary 128256) with an untied output layer, as torchtitan builds Llama; plancc's side builds
``llama-3.2-1b`` with ``tie_word_embeddings: false`` so both train the same parameters.
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.models import llama3
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.protocols.train_spec import register_train_spec

FLAVORS = {
    "1B": TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
    ),
    "tiny": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, rope_theta=500000),
}


class RandomRows(IterableDataset):
    """Endless rows of ``seq_len + 1`` uniform token ids: the input and its next-token labels."""

    def __init__(self, seq_len: int, vocab: int, seed: int):
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            row = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=gen)
            yield {"input": row[:-1]}, row[1:]


def build_random_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **_):
    vocab = FLAVORS[job_config.model.flavor].vocab_size
    dataset = RandomRows(job_config.training.seq_len, vocab, seed=dp_rank)
    return ParallelAwareDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=job_config.training.local_batch_size
    )


def _register() -> None:
    spec = llama3.get_train_spec()
    spec.model_args = FLAVORS
    spec.build_tokenizer_fn = None
    spec.build_dataloader_fn = build_random_dataloader
    spec.build_validator_fn = None
    register_train_spec("plancc_llama", spec)


_register()
