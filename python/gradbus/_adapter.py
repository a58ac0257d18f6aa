"""What the framework adapters (gradbus.megatron, gradbus.fsdp) share: a guard over a fixed set of
gradient buckets that the framework hands over one by one before reducing them, with no "last bucket"
moment of its own, so the table is exchanged when the verdict is asked for.

Invariants: the bucket numbering and each bucket's layout are fixed at construction, the same on every
rank; a verdict requires every bucket to have been recorded since the previous one (else it raises,
naming the buckets, before any collective, on every rank alike when the ranks run the same program).
"""

from typing import Any, List, Tuple

from gradbus.torch import Guard, Verdict


class BucketGuard(Guard):
    """`gradbus.torch.Guard` over `layouts[b]` = [(name, numel), ...] for buckets b = 0..n-1."""

    def __init__(self, framework: str, layouts: List[List[Tuple[str, int]]], policy: str, run_dir: Any, process_group: Any, **kwargs: Any):
        super().__init__(policy, names=None, run_dir=run_dir, process_group=process_group, **kwargs)
        self.framework = framework
        self.layouts = layouts
        self._seen: set = set()

    def check(self, index: int, cell: Any) -> None:
        """Record bucket `index`'s local health (from `health`) for the next verdict."""
        self.record(index, self.layouts[index], cell)
        self._seen.add(index)

    def verdict(self) -> Verdict:
        """Exchange every rank's table of this update and decide; the same on every rank."""
        missing = [i for i in range(len(self.layouts)) if i not in self._seen]
        if missing:
            raise RuntimeError(
                f"{self.framework}: buckets {missing} of {len(self.layouts)} were not checked since the last "
                "verdict (hint: step the optimizer once per update, after the gradients are reduced)"
            )
        self._seen = set()
        self.exchange()
        return super().verdict()
