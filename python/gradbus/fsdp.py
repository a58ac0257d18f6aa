"""The gradbus guard inside PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`).

    fully_shard(block) for each block; fully_shard(model)                 # as usual
    guard = gradbus.fsdp.Guard(model, policy="skip", run_dir="runs/job")
    opt = gradbus.torch.GuardedOptimizer(torch.optim.AdamW(model.parameters()), guard)
    ...
    loss.backward(); opt.step()        # steps only when every rank agreed to proceed

Per-rank attribution needs each rank's own gradients before they are summed, and FSDP2's parameters
are sharded DTensors outside the autograd graph (a tensor hook on them never fires). The one place
where a rank's whole local gradient of a fully_shard'ed module exists is the reduce-scatter input:
FSDP2 copies every unsharded gradient of the module's parameter group into one flat buffer
(dim-0 chunks, rank-major: row r holds every parameter's r-th shard, each padded with zeros to equal
rows) and hands it to its `ReduceScatter` comm. The guard installs its own comm on every FSDPModule
(`FSDPModule.set_custom_reduce_scatter`): it scans that buffer in place (float32 on the CPU: the
runtime's Rust scan; other dtypes and CUDA: torch ops on the device, in the reduce dtype), maps the
first non-finite element back to (parameter, element of the unsharded parameter), then calls the comm
that was installed before it (FSDP's default: `dist.reduce_scatter_single`) with the same arguments,
so a clean run is bitwise FSDP2's. `verdict()` (taken by `gradbus.torch.GuardedOptimizer.step`)
exchanges every rank's row and runs the runtime's `decide` (`gradbus.guard`, the core).

Cost: one read of the rank's local gradient, as large as the reduce-scatter's input (no copy; the
scan runs on FSDP's reduce-scatter stream on a GPU), plus one small all-gather per update.
FSDP2 may pre-divide the buffer by a factor before its comm runs; that keeps every element's
finiteness (the NaN/Inf counts and the element are exact), and scales the sum of squares that feeds
spike detection.

Invariants: one bucket per FSDPModule with parameters, numbered in `model.modules()` order, the same
layout on every rank; the guard never writes a gradient.

Supported: torch >= 2.8 with `FSDPModule.set_custom_reduce_scatter`, a 1-D mesh (FSDP, not HSDP or
2-D), Shard(0) placements, world size >= 2, one parameter group per module, every parameter of a
sharded module given a gradient in every backward (otherwise FSDP's reduce-scatter input has another
layout, which the guard refuses with a clear error).
"""

import math
from dataclasses import dataclass
from typing import Any, List, Tuple

import torch

from gradbus.guard import BucketGuard, GuardedOptimizer, NonFiniteGradients, Verdict

__all__ = ["Guard", "GuardedOptimizer", "NonFiniteGradients", "Verdict"]


def _fsdp_api() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None
    if FSDPModule is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"gradbus.fsdp: torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter, where the "
            "guard reads each rank's gradients (hint: torch >= 2.8)"
        )
    return FSDPModule


@dataclass
class _Group:
    """One FSDP parameter group's reduce-scatter input layout: `world` rows of `row` elements; in each
    row, parameter k's shard starts at `starts[k]` and holds `shard[k]` elements (padding included)
    of the parameter's `numel[k]`; `packed[k]` is its offset in the bucket's packed layout."""

    module: str
    world: int
    row: int
    starts: List[int]
    shard: List[int]
    numel: List[int]
    packed: List[int]
    _consts: Any = None

    def packed_index(self, f: int) -> int:
        """The packed-layout index of the reduce-scatter input's element `f`."""
        r, o = divmod(f, self.row)
        k = max(i for i, s in enumerate(self.starts) if s <= o)
        return self.packed[k] + r * self.shard[k] + (o - self.starts[k])

    def packed_index_tensor(self, f: torch.Tensor) -> torch.Tensor:
        """`packed_index` on a float64 scalar tensor on the buffer's device (-1 stays -1): no host sync."""
        if self._consts is None or self._consts[0].device != f.device:
            self._consts = [torch.tensor(v, dtype=torch.int64, device=f.device) for v in (self.starts, self.shard, self.packed)]
        starts, shard, packed = self._consts
        i = f.clamp(min=0).long()
        r, o = i // self.row, i % self.row
        k = torch.searchsorted(starts, o.reshape(1), right=True)[0] - 1
        return torch.where(f < 0, f, (packed[k] + r * shard[k] + (o - starts[k])).double())


class _GuardedReduceScatter:
    """The ReduceScatter comm the guard installs: tally the input, then the previous comm."""

    def __init__(self, guard: "Guard", index: int, inner: Any):
        self.guard, self.index, self.inner = guard, index, inner

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        self.guard._tally_input(self.index, input_tensor)
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op)


def _param_groups(module: Any) -> List[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.9: at most one
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    return groups


class Guard(BucketGuard):
    """The guard on a model whose submodules were `fully_shard`ed.

    model: the root module (after fully_shard). policy, run_dir, and the keyword arguments: as
    `gradbus.torch.Guard`; the table is exchanged over the FSDP mesh's process group.
    """

    def __init__(self, model: torch.nn.Module, policy: str = "abort", run_dir: Any = None, **kwargs: Any):
        FSDPModule = _fsdp_api()
        names = {id(p): n for n, p in model.named_parameters()}
        sharded = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]
        if not sharded:
            raise ValueError("gradbus.fsdp.Guard: no FSDPModule in the model (hint: call fully_shard on it first)")
        layouts: List[List[Tuple[str, int]]] = []
        self._groups: List[_Group] = []
        pg = None
        comms = []
        for fqn, m in sharded:
            groups = _param_groups(m)
            if not groups:
                continue  # a module whose parameters all belong to its fully_shard'ed children
            if len(groups) > 1:
                raise NotImplementedError(f"gradbus.fsdp: module {fqn or '(root)'} has {len(groups)} parameter groups (per-parameter meshes): not supported")
            g = groups[0]
            mesh = g.mesh_info
            if type(mesh).__name__ != "FSDPMeshInfo":
                raise NotImplementedError(
                    f"gradbus.fsdp: module {fqn or '(root)'} uses {type(mesh).__name__}: only a 1-D FSDP mesh is "
                    "supported (hint: HSDP and 2-D meshes are not yet)"
                )
            world = mesh.shard_mesh_size
            if world < 2:
                raise NotImplementedError("gradbus.fsdp: world size 1: FSDP2 reduces nothing, so there is nothing to guard")
            pg = mesh.shard_process_group if pg is None else pg
            entries, starts, shard, numel, packed = [], [], [], [], []
            at_row = at_packed = 0
            for p in g.fsdp_params:
                name = names.get(id(p.sharded_param), f"{fqn}.param{len(entries)}")
                if p.fsdp_placement.dim != 0:
                    raise NotImplementedError(f"gradbus.fsdp: parameter {name} is sharded on dim {p.fsdp_placement.dim}: only Shard(0)")
                size = p._orig_size
                n = math.prod(size)
                rows = -(-size[0] // world) if len(size) else 1
                per = rows * (n // size[0] if len(size) and size[0] else 1)
                entries.append((name, n))
                starts.append(at_row)
                shard.append(per)
                numel.append(n)
                packed.append(at_packed)
                at_row += per
                at_packed += n
            self._groups.append(_Group(fqn or "(root)", world, at_row, starts, shard, numel, packed))
            layouts.append(entries)
            comms.append((m, len(layouts) - 1, g))
        super().__init__("gradbus.fsdp", layouts, policy, run_dir, pg, **kwargs)
        for m, index, g in comms:
            m.set_custom_reduce_scatter(_GuardedReduceScatter(self, index, g._reduce_scatter_comm))

    def _tally_input(self, index: int, flat: torch.Tensor) -> None:
        """Record the health of module group `index`'s reduce-scatter input `flat`, its first
        non-finite element mapped to the bucket's packed layout."""
        g = self._groups[index]
        if flat.numel() != g.world * g.row:
            raise RuntimeError(
                f"gradbus.fsdp: module {g.module}: FSDP's reduce-scatter input holds {flat.numel()} elements, "
                f"its parameters {g.world * g.row} (hint: every parameter of a fully_shard'ed module needs a "
                "gradient in every backward for the guard to map elements back to parameters)"
            )
        # FSDP hands the buffer to its comm after copying every gradient into it and writes it
        # again only after the comm returns.
        cell = self.health(flat)
        if isinstance(cell, tuple):
            if cell[3] >= 0:
                cell = cell[:3] + (float(g.packed_index(int(cell[3]))),)
        else:
            cell = torch.cat([cell[:3], g.packed_index_tensor(cell[3]).reshape(1)])
        self.check(index, cell)
