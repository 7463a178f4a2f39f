"""Which C++ TORCH_CHECK failures in primemoe's CPU kernels surface as Python errors."""
import subprocess
import sys

CASES = {
    "bad_args": "torch.ops.primemoe.dispatch_layout(ids, 8, 0, 0, 1)",
    "bad_dtype": "torch.ops.primemoe.gather_rows(torch.randn(4, 8), torch.zeros(4, dtype=torch.int32), 1, None)",
    "bad_id": "torch.ops.primemoe.dispatch_layout(ids, 8, 0, 8, 1)",
    "aten_error": "torch.ones(3) @ torch.ones(4)",
}
for name, call in CASES.items():
    code = ("import faulthandler, torch, primemoe; faulthandler.enable()\n"
            "ids = torch.randint(0, 8, (16, 2)); ids[4, 1] = 999\n"
            f"try:\n    {call}\nexcept RuntimeError as e:\n    print('raised:', str(e).splitlines()[0][:100])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"{name}: rc={r.returncode} {r.stdout.strip()} {r.stderr.strip()[-300:] if r.returncode else ''}")
