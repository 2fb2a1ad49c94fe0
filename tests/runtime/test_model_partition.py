"""Layer partitioning: the cost model, the balanced split and the --pp-layer-partition override."""

from __future__ import annotations

import pytest

from runtime.model.config import ModelConfig
from runtime.model.errors import PartitionError
from runtime.model.partition import (layer_cost, last_stage_extra_cost, parse_partition,
                                     resolve_partition, split_layers)

SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                      tie_word_embeddings=True)


def test_cost_model_counts_macs_per_token():
    # q 576*576 + k,v 2*576*192 + o 576*576 + gate/up/down 3*576*1536 + attention 2*9*64*256
    assert layer_cost(SMOLLM2) == 331776 * 2 + 2 * 110592 + 3 * 884736 + 2 * 9 * 64 * 256 == 3833856
    assert last_stage_extra_cost(SMOLLM2) == 576 + 49152 * 576 + 4 * 49152 == 28508736


def test_smollm2_splits():
    assert split_layers(30, 1, SMOLLM2) == [(0, 30)]
    assert split_layers(30, 2, SMOLLM2) == [(0, 19), (19, 30)]  # LM head ~ 7.4 layers
    assert split_layers(30, 3, SMOLLM2) == [(0, 13), (13, 25), (25, 30)]
    assert split_layers(30, 4, SMOLLM2) == [(0, 10), (10, 19), (19, 28), (28, 30)]


def test_split_minimises_the_slowest_stage():
    per, extra = layer_cost(SMOLLM2), last_stage_extra_cost(SMOLLM2)
    for pp in (2, 3, 4, 5):
        ranges = split_layers(30, pp, SMOLLM2)
        assert ranges[0][0] == 0 and ranges[-1][1] == 30
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
        costs = [(e - s) * per for s, e in ranges]
        costs[-1] += extra
        # moving one layer across the last boundary in either direction is no better
        n = ranges[-1][1] - ranges[-1][0]
        for m in (n - 1, n + 1):
            if 1 <= m <= 30 - (pp - 1):
                alt = max(-(-(30 - m) // (pp - 1)) * per, m * per + extra)
                assert max(costs) <= alt


def test_split_with_measured_costs():
    # 2-core CPU, batch 32 decode, one thread: 7.0 ms per layer, 30 ms LM head + final norm
    assert split_layers(30, 2, SMOLLM2, measured=(7.0, 30.0)) == [(0, 17), (17, 30)]
    assert split_layers(30, 2, SMOLLM2, measured=(1.0, 0.0)) == [(0, 15), (15, 30)]


def test_split_without_lm_head_weight_is_even():
    tiny_head = SMOLLM2.model_copy(update={"vocab_size": 1})
    assert split_layers(30, 2, tiny_head) == [(0, 15), (15, 30)]
    assert split_layers(31, 2, tiny_head) == [(0, 16), (16, 31)]


def test_split_errors():
    with pytest.raises(PartitionError, match="31 stages"):
        split_layers(30, 31, SMOLLM2)
    with pytest.raises(PartitionError):
        split_layers(30, 0, SMOLLM2)


def test_parse_partition():
    assert parse_partition("19,11", 30, 2) == [(0, 19), (19, 30)]
    assert parse_partition(" 10, 10 ,10", 30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert resolve_partition(SMOLLM2, 2, "15,15") == [(0, 15), (15, 30)]
    assert resolve_partition(SMOLLM2, 2, None) == [(0, 19), (19, 30)]


@pytest.mark.parametrize("spec, match", [
    ("19;11", "comma-separated"), ("19,x", "comma-separated"), ("", "comma-separated"),
    ("30", "1 stages but pp_size is 2"), ("10,10,10", "3 stages but pp_size is 2"),
    ("30,0", "at least one layer"), ("31,-1", "at least one layer"), ("19,12", "sums to 31"),
])
def test_parse_partition_errors_name_the_flag(spec, match):
    with pytest.raises(PartitionError, match=match) as err:
        parse_partition(spec, 30, 2)
    assert "--pp-layer-partition" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_moe_layers_cost_their_active_experts_and_mixed_layers_are_balanced():
    from runtime.bench.gpu_models import model_config
    moe = model_config("qwen3-30b-a3b")
    h, mi = 2048, 768
    attn = h * (32 + 2 * 4) * 128 + 32 * 128 * h + 2 * 32 * 128 * 256
    assert layer_cost(moe) == attn + 128 * h + 4 * 128 + 8 * 3 * h * mi   # 8 of 128 experts
    assert last_stage_extra_cost(moe) / layer_cost(moe) > 4                # Qwen's 151,936-token head
    assert split_layers(48, 2, moe) == [(0, 27), (27, 48)]   # the head ~ 5.3 layers
    # dense layers 0-3 (mlp_only_layers, 2x wider than 8 experts): the first stage takes fewer layers
    mixed = moe.model_copy(update={"moe_dense_layers": (0, 1, 2, 3), "intermediate_size": 12288})
    costs = [layer_cost(mixed, layer=i) for i in range(48)]
    assert costs[0] > costs[4]
    ranges = split_layers(48, 3, mixed)
    stage = [sum(costs[a:b]) + (last_stage_extra_cost(mixed) if b == 48 else 0) for a, b in ranges]
    assert split_layers(48, 3, moe) == [(0, 18), (18, 36), (36, 48)]
    assert ranges == [(0, 16), (16, 35), (35, 48)]
    best = max(stage)
    for cut1 in range(1, 47):        # no contiguous cut has a smaller largest stage
        for cut2 in range(cut1 + 1, 48):
            alt = [sum(costs[:cut1]), sum(costs[cut1:cut2]), sum(costs[cut2:]) + last_stage_extra_cost(mixed)]
            assert max(alt) >= best - 1e-6
