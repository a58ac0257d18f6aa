"""gradbus for PyTorch: the gradbus runtime's gradient guard for an existing DDP training script.

Every rank's gradients are checked for NaN/Inf bucket by bucket inside DDP's all-reduce (the Rust
health scan of the runtime), one small all-gather per step exchanges every rank's table, and every
rank runs the runtime's own `decide` on it, so all ranks reach the same verdict - proceed, skip,
rerun or abort - with a report naming the rank, parameter and element. See `gradbus.torch`.

`gradbus._core` is the native core (Rust, PyO3); `gradbus.torch` imports torch, this module does not.
"""

from gradbus._core import CELL, Agreement, scan_f32

__all__ = ["CELL", "Agreement", "scan_f32"]
