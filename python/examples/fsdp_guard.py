"""FSDP2 (`fully_shard`) with the gradbus guard: a small model, each block and the root sharded on a 1-D
mesh, optionally with a NaN planted in one rank's gradient.

    torchrun --standalone --nproc-per-node 2 python/examples/fsdp_guard.py --policy abort --plant 1:2:mid.lin.weight:4000
    torchrun --standalone --nproc-per-node 2 python/examples/fsdp_guard.py --policy skip --plant 1:2:mid.lin.weight:4000

The two lines a script adds are marked "gradbus". --plant RANK:STEP:PARAM:ELEMENT writes a NaN into
PARAM's gradient element ELEMENT (of the unsharded parameter) on rank RANK at update STEP, through a
hook on FSDP's unsharded parameter (example_cli.py: a stand-in for a loss gone non-finite). --policy none runs FSDP2
alone. Runs on the CPU over gloo, or with --cuda on GPUs over NCCL. Exit: 0, or 3 when the guard
aborted.
"""

from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

import example_cli

# Widths not divisible by 2 or 3: FSDP pads the dim-0 shards, and the guard maps around the padding.
D_IN, D_H, D_OUT = 24, 67, 5


def model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(
        OrderedDict(
            inp=nn.Sequential(OrderedDict(lin=nn.Linear(D_IN, D_H), act=nn.Tanh())),
            mid=nn.Sequential(OrderedDict(lin=nn.Linear(D_H, D_H), act=nn.Tanh())),
            head=nn.Linear(D_H, D_OUT),
        )
    )


def batch(rank: int, step: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, D_IN, generator=g).to(device), torch.randn(8, D_OUT, generator=g).to(device)


def unsharded(net: nn.Module, name: str) -> torch.Tensor:
    """FSDP's unsharded parameter `name` (the tensor autograd writes; it exists after the forward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in net.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    if p._param_fqn == name:
                        return p.unsharded_param
    raise KeyError(name)


def main() -> int:
    ap = example_cli.parser(__doc__, "runs/fsdp")
    ap.add_argument("--cuda", action="store_true", help="NCCL on GPUs (default: gloo on the CPU)")
    a = ap.parse_args()
    import gradbus.fsdp as gf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, device = example_cli.init(a.cuda)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    net = model().to(device)
    for block in (net.inp, net.mid):
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    if a.policy != "none":
        guard = gf.Guard(net, policy=a.policy, run_dir=a.run_dir)  # gradbus
        opt = gf.GuardedOptimizer(opt, guard)  # gradbus

    def train():
        for step in range(a.steps):
            opt.zero_grad()
            x, y = batch(rank, step, device)
            loss = nn.functional.mse_loss(net(x), y)
            handle = example_cli.plant(a.plant, rank, step, lambda name: unsharded(net, name))
            loss.backward()
            if handle is not None:
                handle.remove()
            v = opt.step()
            print(f"[rank {rank}] step {step}: loss {loss.item():.4f}, {getattr(v, 'action', 'proceed')}", flush=True)

    return example_cli.run(train, gf.NonFiniteGradients)


if __name__ == "__main__":
    example_cli.exit_now(main())
