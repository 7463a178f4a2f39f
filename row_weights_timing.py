import torch

import primemoe  # noqa: F401

lib = torch.ops.primemoe
for T, K, E in ((8192, 8, 128), (16384, 8, 128)):
    idx = torch.randint(0, E, (T, K), device="cuda")
    w = torch.rand(T, K, device="cuda")
    _, off, s2r, r2s = lib.dispatch_layout(idx, E, 0, E, 64)
    dtw = torch.randn(r2s.numel(), device="cuda")
    cases = {
        "row_weights torch": lambda: torch.where(r2s >= 0, w.reshape(-1).float()[r2s.clamp(min=0).long()], 0.0),
        "row_weights op": lambda: lib.gather_scalars(w.reshape(-1, 1), r2s),
        "d_topk_weights torch": lambda: torch.where(s2r >= 0, dtw[s2r.clamp(min=0).long()], 0.0),
        "d_topk_weights op": lambda: lib.gather_scalars(dtw.unsqueeze(1), s2r),
    }
    assert torch.equal(cases["row_weights torch"](), cases["row_weights op"]())
    assert torch.equal(cases["d_topk_weights torch"](), cases["d_topk_weights op"]())
    for rnd in range(3):
        for name, fn in cases.items():
            for _ in range(50):
                fn()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(1000):
                fn()
            e.record()
            torch.cuda.synchronize()
            print(f"T={T} round {rnd} {name:22s} {s.elapsed_time(e):.1f} us per call", flush=True)
