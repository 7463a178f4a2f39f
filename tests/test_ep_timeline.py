"""scripts/ep_timeline.py's summary: the communication time of a timeline and the fraction of it an overlap hides
(issue 37's measure: sequential step minus overlapped step, over the sequential communication time)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import ep_timeline  # noqa: E402

SEQUENTIAL = [(0, 100, 7, "dispatch.notify"), (100, 900, 7, "dispatch.rows"), (100, 900, 7, "dispatch.wait"),
              (900, 2100, 7, "gemm.fc1_swiglu"), (2100, 2900, 7, "combine.rows"), (2100, 2900, 7, "combine.wait")]
OVERLAPPED = [(0, 100, 7, "dispatch.notify"), (100, 900, 7, "dispatch.rows"), (200, 1500, 7, "gemm.fc1_swiglu"),
              (1500, 2300, 7, "combine.rows")]


def test_communication_counts_the_row_kernels_not_their_waits():
    assert ep_timeline.communication_us(SEQUENTIAL) == 100 + 800 + 800


def test_hidden_fraction():
    assert abs(ep_timeline.hidden_fraction(SEQUENTIAL, OVERLAPPED) - (2900 - 2300) / 1700) < 1e-12
    assert ep_timeline.hidden_fraction(SEQUENTIAL, SEQUENTIAL) == 0.0
    assert ep_timeline.hidden_fraction([(0, 10, 7, "gemm.rows")], [(0, 5, 7, "gemm.rows")]) == 0.0  # no communication


def test_kernel_names_are_shortened():
    assert ep_timeline.short("void primemoe::sm90::grouped_gemm_kernel<(primemoe::GemmSchedule)0, "
                             "(primemoe::GemmEpilogue)1, true, true, false>(primemoe::sm90::GemmParams)") == \
        "gemm.fc1_swiglu"
    assert ep_timeline.short("_ZN8primemoe4sm9019grouped_gemm_kernelILNS_12GemmScheduleE1ELNS_12GemmEpilogueE0ELb0"
                             "ELb0ELb0EEEvNS0_10GemmParamsE") == "gemm.wgrad"
    assert ep_timeline.short("primemoe::(anonymous namespace)::ep_dispatch_rows_kernel(primemoe::EpDispatchArgs)") == \
        "dispatch.rows"
