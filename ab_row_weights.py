"""Layer forward / backward with the rows' routing weights and d_topk_weights by gather_scalars (new) or by the
torch composition it replaced (old), alternating back to back in one process."""
import inspect
import statistics
import sys
import time

import torch

sys.path.insert(0, "scripts")
from layer_inputs import layer_inputs  # noqa: E402
from primemoe import ops  # noqa: E402

new_rw, new_bwd = ops.row_weights, ops.moe_backward_composed


def old_rw(topk_weights, row_to_slot):
    w = topk_weights.reshape(-1).float()[row_to_slot.clamp(min=0).long()]
    return torch.where(row_to_slot >= 0, w, 0.0)


src = inspect.getsource(new_bwd).replace(
    "lib.gather_scalars(dtw_rows.unsqueeze(1), slot_to_row)",
    "torch.where(slot_to_row >= 0, dtw_rows[slot_to_row.clamp(min=0).long()], 0.0)")
assert "torch.where(slot_to_row" in src
ns = dict(vars(ops), row_weights=old_rw)
exec(src, ns)
old_bwd = ns["moe_backward_composed"]


def phase_ms(fn, secs=1.0):
    for timed in (False, True):
        events = []
        end = time.time() + secs
        while time.time() < end:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


for shape, T in (("qwen3-30b-a3b", 8192), ("qwen3-235b-a22b", 8192), ("qwen3-30b-a3b", 16384)):
    x, idx, w, w1, w2, dy = layer_inputs(shape, T)
    _, fc1_out = ops.moe_forward_composed(x, idx, w, w1, w2, True, True)
    res = {}
    for rnd in range(3):
        for name, rw, bwd in (("old", old_rw, old_bwd), ("new", new_rw, new_bwd)):
            ops.row_weights = rw
            f = phase_ms(lambda: ops.moe_forward_composed(x, idx, w, w1, w2, True, True))
            b = phase_ms(lambda: bwd(dy, x, idx, w, w1, w2, fc1_out, True))
            res.setdefault(name, []).append((f, b))
    for name, v in res.items():
        print(f"{shape} T={T} {name}: fwd {statistics.median(a for a, _ in v):.4f} ms, "
              f"bwd {statistics.median(b for _, b in v):.4f} ms  rounds {v}", flush=True)
    ops.row_weights = new_rw
    del x, w1, w2, dy, fc1_out
    torch.cuda.empty_cache()
