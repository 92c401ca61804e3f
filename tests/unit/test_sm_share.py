"""The SM share of a rank (dcpkit._sm_share): the grids of ranks sharing a GPU stay within it."""

import pytest

from dcpkit._sm_share import mps_thread_percentage, sm_share

MPS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


@pytest.mark.parametrize(
    "sm, ranks, env, want",
    [
        (132, 1, {}, 132),  # one GPU per rank
        (132, 4, {}, 33),  # ranks share a GPU, no percentage: the reported SMs divided
        (132, 3, {}, 44),
        (33, 4, {MPS: "25"}, 33),  # MPS already reports the 25 % share: not divided again
        (66, 2, {MPS: "50"}, 66),
        (132, 4, {MPS: "100"}, 33),  # no limit set: the whole GPU, divided
        (66, 4, {MPS: "50"}, 33),  # a share larger than 1/ranks is capped at 1/ranks
        (132, 2, {MPS: "not a number"}, 66),  # unreadable: nothing assumed
        (132, 2, {MPS: "0"}, 66),
        (132, 2, {MPS: "nan"}, 66),
        (1, 8, {}, 1),  # never below one CTA
    ],
)
def test_sm_share(sm, ranks, env, want):
    assert sm_share(sm, ranks, env) == want


def test_shares_of_all_ranks_fit_the_gpu_whatever_percentage_each_set():
    full = 132
    for ranks in (2, 3, 4):
        for pct in (10, 25, 33, 50, 75, 100):
            reported = full * pct // 100
            total = ranks * sm_share(reported, ranks, {MPS: str(pct)})
            assert total <= full, (ranks, pct, total)


def test_percentage_parsing():
    assert mps_thread_percentage({}) is None
    assert mps_thread_percentage({MPS: " 25 "}) == 25.0
    assert mps_thread_percentage({MPS: "101"}) is None
    assert mps_thread_percentage({MPS: "-5"}) is None
    # what the driver would not read as a share: no share is assumed from it
    for raw in ("1_0", "nan", "inf", "", "25%", "abc"):
        assert mps_thread_percentage({MPS: raw}) is None, raw
    assert mps_thread_percentage({MPS: "12.5"}) == 12.5


@pytest.mark.parametrize("ranks_on_gpu, zero_copy", [(1, 132), (2, 33), (4, 33)])
def test_gather_zero_copy_grid_takes_half_the_share_only_where_ranks_share_a_gpu(
    ranks_on_gpu, zero_copy
):
    """A zero-copy gather call (one waiter) takes half the SM share where ranks share a GPU,
    the whole share with one GPU per rank; a copy-out call always takes the whole share."""
    from dcpkit.ops.kv_gather import KVGather

    kv = KVGather.__new__(KVGather)
    kv.max_ctas = 132 if ranks_on_gpu == 1 else 66
    kv.ranks_on_gpu = ranks_on_gpu
    kv.world_size = 2
    kv.algorithm = "push"
    kv.row_bytes = 1024
    T = 16 * 1024  # 16 MiB per rank: far more vectors than any grid
    assert kv.ctas_for(T) == zero_copy
    assert kv.ctas_for(T, copy_out=True) == kv.max_ctas
    assert kv.ctas_for(1) == 1  # a small call is sized by its vectors alone
    kv.algorithm = "pull"  # every waiter pulls: the whole share
    assert kv.ctas_for(T) == kv.max_ctas == kv.ctas_for(T, copy_out=True)
