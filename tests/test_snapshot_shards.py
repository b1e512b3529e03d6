"""A weight snapshot for engines of their own without a rank-0 funnel: every training rank
publishes its own rows of each tensor, and the engine joins the ranks' pieces of a bucket into
whole tensors (``rollout.engines.weights.buckets.pack_pieces`` / ``assemble_pieces``)."""

from __future__ import annotations

import torch

from rollout.engines.weights.buckets import assemble_pieces, pack_pieces, unpack_bucket


def _shards(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Rank r's rows of ``tensor`` as FSDP2 shards it (torch.chunk on dim 0, empty past the
    end when there are fewer rows than ranks)."""
    chunks = list(torch.chunk(tensor, world, dim=0))
    empty = tensor.new_empty((0, *tensor.shape[1:]))
    return chunks + [empty] * (world - len(chunks))


def test_the_ranks_pieces_join_into_the_whole_tensors():
    gen = torch.Generator().manual_seed(0)
    state = {
        "model.embed_tokens.weight": torch.randn(7, 4, generator=gen),  # 7 rows over 3 ranks
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen),
        "model.norm.weight": torch.randn(2, generator=gen),  # fewer rows than ranks
        "rotary.inv_freq": torch.randn(3, generator=gen),  # not sharded: rank 0 sends it
    }
    world = 3
    per_rank = []
    for rank in range(world):
        pieces = []
        for name, tensor in state.items():
            if name == "rotary.inv_freq":
                if rank == 0:
                    pieces.append((name, tensor))
                continue
            pieces.append((name, _shards(tensor, world)[rank]))
        flat, specs = pack_pieces(pieces, torch.bfloat16)
        assert flat.dtype == torch.uint8
        per_rank.append(unpack_bucket(flat, specs))
    whole = assemble_pieces(per_rank)
    assert [name for name, _ in whole] == list(state)
    for name, tensor in whole:
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name


def test_a_rank_publishes_only_its_own_rows():
    """No rank packs the model: a rank's bucket is its shard's bytes, about 1/world of the
    whole bucket."""
    tensor = torch.randn(64, 32)
    whole, _ = pack_pieces([("w", tensor)], torch.float32)
    mine, _ = pack_pieces([("w", _shards(tensor, 4)[1])], torch.float32)
    assert mine.numel() * 4 == whole.numel()
