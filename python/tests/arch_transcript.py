"""A transcript of what the native core computes, standard library only (no torch, no pytest), for
python/aarch64-check.sh: run under the x86_64 wheel and, through qemu, under the aarch64 wheel, the
two transcripts must be the same text - the scans, the replica checksums, the summary's words and
the agreement's verdicts, reports (less the build's commit and the checksum over it) and spike
decisions, to the last bit (floats as hex). The first line names the machine; the check compares
the rest.

  python arch_transcript.py        (prints the transcript)
"""

import array
import json
import platform
import struct

import gradbus


class Lcg:
    """A fixed pseudo-random sequence (the same on every machine and Python)."""

    def __init__(self, seed):
        self.s = seed

    def next(self):
        self.s = (self.s * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        return self.s >> 11

    def normal(self):
        # Sum of 4 uniforms, centred: enough spread for the scans, exact in float64.
        return sum(self.next() / (1 << 53) for _ in range(4)) - 2.0


def floats(rng, n, scale, specials):
    a = array.array("f", (rng.normal() * scale for _ in range(n)))
    for i, v in specials:
        a[i] = v
    return a


def scan(a):
    addr, n = a.buffer_info()
    nan, inf, sumsq, first = gradbus.scan_f32(addr, n)
    return f"{nan} {inf} {sumsq.hex()} {first}"


def main():
    print("machine", platform.machine())
    rng = Lcg(2026)
    nan, inf = float("nan"), float("inf")
    cases = [(1, 1.0, []), (1023, 1e-3, []), (1025, 1e21, []), (5000, 1.0, [(4097, nan)]),
             (70000, 1e-30, [(69999, -inf), (17, inf), (40000, nan)]), (3, 1.0, [(0, 1e-45), (1, -0.0)])]
    for n, scale, specials in cases:
        a = floats(rng, n, scale, specials)
        print("scan", n, scan(a))
        print("checksum", n, f"{gradbus.checksum_f32(a.buffer_info()[0], n):016x}")

    layout = [[("head.weight", 40), ("head.bias", 8)], [("mid.weight", 100)]]
    summary = gradbus.Agreement("skip", spike="skip", spike_window=8, z_limit=3.0, max_consecutive=100, max_fraction=1.0)
    table = gradbus.Agreement("skip", spike="skip", spike_window=8, z_limit=3.0, max_consecutive=100, max_fraction=1.0)
    n_sum, n_max = gradbus.summary_words(len(layout))
    for step in range(40):
        world = 1 + step % 5
        rows = []
        for k in range(world):
            cells = [(0.0, 0.0, (rng.next() / (1 << 53)) * 10.0 ** (step == 30), -1.0) for _ in layout]
            if step % 7 == 3 and k == world - 1:
                cells[1] = (1.0, 0.0, 2.0, 17.0)
            loss = (rng.next() / (1 << 53)) * 3.0 ** (step == 20)
            rows.append(gradbus.encode_row(cells, loss, 0.0, 0))
        parts = [gradbus.contribute(r, len(layout), rank=k) for k, r in enumerate(rows)]
        s = [sum(c) for c in zip(*(struct.unpack(f"<{n_sum}q", p[0]) for p in parts))]
        s = [((x + (1 << 63)) % (1 << 64)) - (1 << 63) for x in s]  # int64 wrapping, as the collective
        m = [max(c) for c in zip(*(struct.unpack(f"<{n_max}q", p[1]) for p in parts))]
        print("summary", step, " ".join(map(str, s + m)))
        d = summary.decide_summary(struct.pack(f"<{n_sum}q", *s), struct.pack(f"<{n_max}q", *m), world, layout, step, 0)
        if d is None:
            d = summary.decide_table(b"".join(rows), world, layout, step, 0)
        t = table.decide_table(b"".join(rows), world, layout, step, 0)
        for path, x in (("summary-path", d), ("table-path", t)):
            report = None
            if x.report is not None:  # less what names the build (its commit, and the checksum over it)
                report = {k: v for k, v in json.loads(x.report).items() if k not in ("gradbus", "crc32c")}
                report = json.dumps(report, sort_keys=True)
            print(path, step, x.action, x.spike, x.loss.hex(), x.grad_norm.hex(), report)
    print("skipped", summary.skipped, table.skipped)


if __name__ == "__main__":
    main()
