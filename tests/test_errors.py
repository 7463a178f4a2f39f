"""Bad input to primemoe.moe gets a clear Python error naming the argument (DESIGN.md section 4)."""

import pytest
import torch

from helpers import make_problem

import primemoe

T, H, I, E, K = 5, 16, 8, 4, 2


def good_args():
    p = make_problem(T, H, I, E, K)
    return dict(x=p.x, topk_idx=p.topk_idx, topk_weights=p.topk_weights, w1=p.w1, w2=p.w2)


def non_contiguous(t):
    # Same shape and values, transposed storage.
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# name -> (changes to the good arguments, exception, message pattern)
BAD_INPUTS = {
    "x_not_a_tensor": (dict(x=[[1.0] * H] * T), TypeError, "x: expected a torch.Tensor"),
    "x_1d": (dict(x=torch.randn(H).bfloat16()), ValueError, "x: expected a 2-D"),
    "x_3d": (dict(x=torch.randn(1, T, H).bfloat16()), ValueError, "x: expected a 2-D"),
    "topk_idx_1d": (dict(topk_idx=torch.zeros(T, dtype=torch.long)), ValueError, "topk_idx: expected a 2-D"),
    "topk_weights_1d": (dict(topk_weights=torch.rand(T)), ValueError, "topk_weights: expected a 2-D"),
    "w1_2d": (dict(w1=torch.randn(2 * I, H).bfloat16()), ValueError, "w1: expected a 3-D"),
    "w2_2d": (dict(w2=torch.randn(H, I).bfloat16()), ValueError, "w2: expected a 3-D"),
    "topk_idx_other_T": (dict(topk_idx=torch.zeros(T + 1, K, dtype=torch.long)), ValueError,
                         "topk_idx: expected 5 rows"),
    "topk_idx_no_slots": (dict(topk_idx=torch.zeros(T, 0, dtype=torch.long), topk_weights=torch.rand(T, 0)),
                          ValueError, "topk_idx: expected at least one slot"),
    "topk_weights_other_T": (dict(topk_weights=torch.rand(T - 1, K)), ValueError, "topk_weights: expected shape"),
    "topk_weights_other_K": (dict(topk_weights=torch.rand(T, K + 1)), ValueError, "topk_weights: expected shape"),
    "w1_other_H": (dict(w1=torch.randn(E, 2 * I, H + 8).bfloat16()), ValueError,
                   r"w1: expected shape \[E_local, 2I, 16\]"),
    "w1_odd_2I": (dict(w1=torch.randn(E, 2 * I + 1, H).bfloat16()), ValueError, "w1: expected an even"),
    "w1_no_experts": (dict(w1=torch.randn(0, 2 * I, H).bfloat16(), w2=torch.randn(0, H, I).bfloat16()),
                      ValueError, "w1: expected at least one local expert"),
    "w2_other_H": (dict(w2=torch.randn(E, H + 8, I).bfloat16()), ValueError, "w2: expected shape"),
    "w2_other_I": (dict(w2=torch.randn(E, H, I + 8).bfloat16()), ValueError, "w2: expected shape"),
    "w2_other_E": (dict(w2=torch.randn(E + 1, H, I).bfloat16()), ValueError, "w2: expected shape"),
    "topk_idx_float": (dict(topk_idx=torch.zeros(T, K)), TypeError, "topk_idx: expected dtype int64 or int32"),
    "topk_idx_int16": (dict(topk_idx=torch.zeros(T, K, dtype=torch.int16)), TypeError, "topk_idx: expected dtype"),
    "topk_weights_int": (dict(topk_weights=torch.ones(T, K, dtype=torch.long)), TypeError,
                         "topk_weights: expected dtype float32 or bfloat16"),
    "topk_weights_fp16": (dict(topk_weights=torch.rand(T, K).half()), TypeError, "topk_weights: expected dtype"),
    "x_int": (dict(x=torch.ones(T, H, dtype=torch.int32)), TypeError, "x: expected a floating dtype"),
    "w1_dtype_not_x": (dict(w1=torch.randn(E, 2 * I, H)), TypeError, "w1: expected dtype torch.bfloat16"),
    "w2_dtype_not_x": (dict(w2=torch.randn(E, H, I)), TypeError, "w2: expected dtype torch.bfloat16"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_the_argument(case):
    changes, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        primemoe.moe(**{**good_args(), **changes})


@pytest.mark.parametrize("name", ["x", "topk_idx", "topk_weights", "w1", "w2"])
def test_non_contiguous_argument(name):
    args = good_args()
    args[name] = non_contiguous(args[name])
    assert not args[name].is_contiguous()
    with pytest.raises(ValueError, match=f"{name}: expected a contiguous tensor"):
        primemoe.moe(**args)


@pytest.mark.parametrize("name", ["topk_idx", "topk_weights", "w1", "w2"])
def test_device_mismatch(name):
    # A meta tensor stands in for a tensor on another device.
    args = good_args()
    args[name] = torch.empty_like(args[name], device="meta")
    with pytest.raises(ValueError, match=f"{name}: expected device cpu"):
        primemoe.moe(**args)


def test_device_mismatch_against_x():
    args = good_args()
    args["x"] = torch.empty_like(args["x"], device="meta")
    with pytest.raises(ValueError, match="topk_idx: expected device meta"):
        primemoe.moe(**args)


@pytest.mark.parametrize("precision", ["fp16", "FP8", "", None])
def test_unknown_precision(precision):
    with pytest.raises(ValueError, match="precision: expected one of"):
        primemoe.moe(**good_args(), precision=precision)


def test_precision_not_in_this_build():
    with pytest.raises(NotImplementedError, match=r"precision: 'mxfp8' .* needs a Blackwell \(sm_100\) GPU and is "
                                                  "not built"):
        primemoe.moe(**good_args(), precision="mxfp8")


@pytest.mark.parametrize("bad_id", [E, 999, -2])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_debug_mode_checks_ids_eagerly(monkeypatch, bad_id, idx_dtype):
    monkeypatch.setenv("PRIMEMOE_DEBUG", "1")
    args = good_args()
    args["topk_idx"] = args["topk_idx"].to(idx_dtype)
    args["topk_idx"][3, 1] = bad_id
    with pytest.raises(ValueError, match=rf"topk_idx\[3, 1\] = {bad_id} is not an expert id"):
        primemoe.moe(**args)


def test_out_of_range_id_raises_on_cpu_without_debug(monkeypatch):
    monkeypatch.delenv("PRIMEMOE_DEBUG", raising=False)
    args = good_args()
    args["topk_idx"][0, 0] = 999
    with pytest.raises(ValueError, match="999"):
        primemoe.moe(**args)


# _take_error records -> the message check_errors raises (the same text the next primemoe call raises).
DEVICE_ERRORS = {
    (1, 999, 8, 6, 1): "primemoe: topk_idx[6, 1] = 999 is not an expert id (expected -1 or a value in [0, 8)); "
                         "that slot was skipped",
    (2, 1, 0, -1, 0): "primemoe: rank 0 timed out waiting for rank 1 (its send counts); "
                      "the results of that call are invalid: that rank did not start the same dispatch (it raised an "
                      "error, e.g. more tokens than max_tokens_per_rank, or it makes a different sequence of primemoe "
                      "calls)",
    (2, -1, 1, 3, 1): "primemoe: rank 1 timed out waiting for a source rank (its rows for local expert 3); "
                      "the results of that call are invalid",
    (2, 0, 1, -1, 2): "primemoe: rank 1 timed out waiting for rank 0 (its combine results); "
                      "the results of that call are invalid",
    (2, -1, 5, 2, 3): "primemoe: rank 5 timed out waiting for a source rank (the rows of local expert 2, before "
                      "its expert GEMM); the results of that call are invalid",
    (3, 1, 640, 900, 0): "primemoe: rank 1 would have received 900 rows (with its experts' padding) in one dispatch, "
                         "more than the 640 its Buffer holds (max_recv_rows): it was sent none of them and the "
                         "results of that call are invalid (seen by rank 0; create the Buffer with a larger "
                         "max_recv_rows)",
    (7, 0, 0, 0, 0): "primemoe: device error code 7",
}


@pytest.mark.parametrize("record", DEVICE_ERRORS)
def test_device_error_messages(record):
    assert torch.ops.primemoe._describe_error(list(record)) == DEVICE_ERRORS[record]


def test_describe_error_rejects_a_short_record():
    with pytest.raises(RuntimeError, match="record: expected the 5 fields"):
        torch.ops.primemoe._describe_error([1, 2])
