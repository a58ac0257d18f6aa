"""gradbus for PyTorch: the gradbus runtime's gradient guard for an existing DDP training script.

Every rank's gradients are checked for NaN/Inf bucket by bucket inside DDP's all-reduce (the Rust
health scan of the runtime), the ranks agree through the runtime's O(buckets) summary (the per-rank
table only when something is wrong), and every rank runs the runtime's own `decide`, so all ranks
reach the same verdict - proceed, skip, rerun or abort - with a report naming the rank, parameter
and element. See `gradbus.torch` and docs/pytorch.md.

`gradbus._core` is the native core (Rust, PyO3); `gradbus.torch` imports torch, this module does not.
"""

from gradbus._core import (
    CELL,
    Agreement,
    Decision,
    checksum_f32,
    contribute,
    decode_row,
    encode_row,
    row_words,
    scan_f32,
    summary_words,
)

__all__ = [
    "CELL",
    "Agreement",
    "Decision",
    "checksum_f32",
    "contribute",
    "decode_row",
    "encode_row",
    "row_words",
    "scan_f32",
    "summary_words",
]
