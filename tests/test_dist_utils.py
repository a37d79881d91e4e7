import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import budget_s, run_ranks, test_timeout


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would hang here forever without the harness timeout


@test_timeout(10)
def test_run_ranks_collects_results():
    assert run_ranks(_sum_ranks, 2, timeout_s=budget_s(10)) == [1.0, 1.0]


@test_timeout(10)
def test_run_ranks_reports_failure_instead_of_hanging():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_fail_on_rank_one, 2, timeout_s=budget_s(10))
