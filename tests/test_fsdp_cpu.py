"""FSDP2 (torch.distributed.fsdp.fully_shard) on a model with primemoe.nn.MoE at EP = 1, two gloo ranks on the CPU:
each rank trains on its half of every batch with AdamW; the sharded run's losses and final weights match one
unsharded process trained on the whole batches (issue 40's FSDP2 part; the GPU run is for a GPU session)."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import PRIMEMOE_ROOT

RANK = r'''
import sys, os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import primemoe
rank, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
world = 2
dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
H, I, E, K, V = 32, 16, 8, 2, 64

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.moe = primemoe.nn.MoE(H, I, E, K, dtype=torch.float32)
        self.head = torch.nn.Linear(H, V)
    def forward(self, tok):
        h = self.emb(tok)
        return self.head(h + self.moe(h))

def train(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tok in batches:
        loss = torch.nn.functional.cross_entropy(model(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())
        loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.detach())
    return losses

torch.manual_seed(0)
ref = Net()
model = Net(); model.load_state_dict(ref.state_dict())
g = torch.Generator().manual_seed(1)
batches = [torch.randint(0, V, (4, 17), generator=g) for _ in range(4)]
# Unsharded reference on the whole batch; each rank trains FSDP on its half.
ref_losses = train(ref, batches)
mesh = init_device_mesh("cpu", (world,))
fully_shard(model.moe, mesh=mesh); fully_shard(model, mesh=mesh)
losses = train(model, [b[2 * rank:2 * rank + 2] for b in batches])
loss = torch.stack(losses); dist.all_reduce(loss); loss /= world
full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
if rank == 0:
    torch.save({"ref": torch.stack(ref_losses), "fsdp": loss, "ref_state": ref.state_dict(), "state": full}, out)
dist.destroy_process_group()
# No interpreter teardown: a gloo thread destroyed during it can abort the process ("terminate called without an
# active exception"), after the results are written.
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
'''


def test_fully_shard_matches_the_unsharded_run(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PRIMEMOE_ROOT, os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out.pt"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "store"), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    result = torch.load(out)
    # Same math, sharded: the gradient's reduction order differs (fp32), nothing else.
    torch.testing.assert_close(result["fsdp"], result["ref"], rtol=1e-5, atol=1e-5)
    assert result["ref"][-1] < result["ref"][0], "the loss should fall"
    for name, want in result["ref_state"].items():
        torch.testing.assert_close(result["state"][name], want, rtol=1e-4, atol=1e-5, msg=name)
