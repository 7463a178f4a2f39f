"""primemoe.baseline.moe with expert parallelism over 2 GPUs (NCCL) against the
single-process fp64 reference of the concatenated problem."""

import pytest

from ep_harness import EP_CASES, prepare_spawn, run_ep_case

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

SHAPE = (256, 128, 8, 2)  # H, I, E (E_local = 4 per rank), K

CASES = EP_CASES


@pytest.mark.parametrize("case", CASES)
def test_baseline_expert_parallel_nccl(tmp_path, monkeypatch, case):
    # NVLink multicast must stay off on the test machine.
    prepare_spawn(monkeypatch, tmp_path, NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1",
                  TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    run_ep_case(tmp_path, "nccl", shape=SHAPE, seed=13, device="cuda:0", **CASES[case])
