//! The layout of the flat gradient buffer: named parameter slots and the buckets cut from them.
//!
//! Invariants: slots are laid out in REVERSE parameter order (the last parameter at offset 0), each
//! starting on a 64-byte boundary, so a bucket is one contiguous range and bucket #0 holds the last
//! parameters - the ones backward finishes first. A bucket closes once it holds at least
//! `bucket_bytes`; a parameter is never split. Parameters, gradients and optimizer moments all use
//! this one layout, so "offset i" means the same element in each of them.

use std::ops::Range;

/// Floats per 64-byte line: every slot starts on such a boundary.
pub const ALIGN_FLOATS: usize = 16;

/// A parameter as the model declares it, in forward order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Unique name, e.g. `blocks.1.attn.qkv.weight`.
    pub name: String,
    /// Number of f32 elements.
    pub numel: usize,
}

impl ParamSpec {
    /// A spec from a name and an element count.
    pub fn new(name: impl Into<String>, numel: usize) -> ParamSpec {
        ParamSpec { name: name.into(), numel }
    }
}

/// Where one parameter lives in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The parameter's name.
    pub name: String,
    /// Index of the parameter in forward order.
    pub param: usize,
    /// First element of the slot in the flat buffer (a multiple of `ALIGN_FLOATS`).
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
    /// The bucket that holds it.
    pub bucket: usize,
}

impl Slot {
    /// The slot's range of the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// One bucket: a contiguous range of the flat buffer and the parameters in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Elements of the flat buffer covered (padding between slots included).
    pub range: Range<usize>,
    /// Forward-order indices of the parameters it holds, last parameter first.
    pub params: Vec<usize>,
}

/// Slots and buckets of one model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// One slot per parameter, indexed by forward-order parameter index.
    pub slots: Vec<Slot>,
    /// Buckets in reduce order: #0 holds the last parameters.
    pub buckets: Vec<Bucket>,
    /// Length of the flat buffer in elements (a multiple of `ALIGN_FLOATS`).
    pub len: usize,
}

fn align_up(n: usize) -> usize {
    n.div_ceil(ALIGN_FLOATS) * ALIGN_FLOATS
}

impl Layout {
    /// Lay out `params` (forward order) with buckets of at least `bucket_bytes` (0 = one bucket
    /// per parameter).
    pub fn new(params: &[ParamSpec], bucket_bytes: usize) -> Layout {
        let mut slots: Vec<Option<Slot>> = vec![None; params.len()];
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut offset = 0;
        let mut open: Option<Bucket> = None;
        for p in (0..params.len()).rev() {
            let b = open.get_or_insert_with(|| Bucket { range: offset..offset, params: Vec::new() });
            b.params.push(p);
            slots[p] = Some(Slot {
                name: params[p].name.clone(),
                param: p,
                offset,
                numel: params[p].numel,
                bucket: buckets.len(),
            });
            offset = align_up(offset + params[p].numel);
            b.range.end = offset;
            if b.range.len() * 4 >= bucket_bytes {
                buckets.extend(open.take());
            }
        }
        buckets.extend(open.take());
        Layout { slots: slots.into_iter().map(|s| s.expect("every parameter placed")).collect(), buckets, len: offset }
    }

    /// The parameter and element index at a flat offset; `None` for padding or out of range.
    pub fn locate(&self, offset: usize) -> Option<(&Slot, usize)> {
        let b = self.buckets.iter().find(|b| b.range.contains(&offset))?;
        b.params.iter().map(|&p| &self.slots[p]).find(|s| s.range().contains(&offset)).map(|s| (s, offset - s.offset))
    }

    /// The slot of a parameter by name.
    pub fn slot(&self, name: &str) -> Option<&Slot> {
        self.slots.iter().find(|s| s.name == name)
    }

    /// A hash of names, sizes and cuts (FNV-1a), so that ranks can check that they agree on the layout.
    pub fn hash(&self) -> u64 {
        let mut h = Fnv::default();
        for s in &self.slots {
            h.write(s.name.as_bytes());
            h.write(&(s.numel as u64).to_le_bytes());
            h.write(&(s.offset as u64).to_le_bytes());
        }
        for b in &self.buckets {
            h.write(&(b.range.start as u64).to_le_bytes());
        }
        h.0
    }
}

/// The element range of chunk `r` of `len` elements split among `n` reducers: cut into units of
/// `align` elements, the units dealt out as evenly as possible (the first `units % n` chunks get one
/// more), the last chunk holding the ragged end. Chunks are contiguous, ordered and cover `0..len`.
pub fn chunk_range(len: usize, n: usize, r: usize, align: usize) -> Range<usize> {
    assert!(n > 0 && r < n && align > 0);
    let units = len.div_ceil(align);
    let (base, extra) = (units / n, units % n);
    let start = r * base + r.min(extra);
    let end = start + base + usize::from(r < extra);
    (start * align).min(len)..(end * align).min(len)
}

/// FNV-1a 64: a stable hash with no dependency (std's hasher is not stable across releases).
#[derive(Clone, Copy, Debug)]
pub struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    /// Fold bytes into the hash.
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(sizes: &[usize]) -> Vec<ParamSpec> {
        sizes.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), n)).collect()
    }

    #[test]
    fn buckets_are_reverse_ordered_aligned_and_cover_everything() {
        let l = Layout::new(&specs(&[100, 7, 300, 1, 50]), 400 * 4);
        // Bucket #0 starts with the last parameter at offset 0.
        assert_eq!(l.slots[4].offset, 0);
        assert_eq!(l.buckets[0].params[0], 4);
        assert!(l.slots.iter().all(|s| s.offset % ALIGN_FLOATS == 0));
        let mut covered = 0;
        for b in &l.buckets {
            assert_eq!(b.range.start, covered, "buckets are contiguous");
            covered = b.range.end;
        }
        assert_eq!(covered, l.len);
        // 50 -> 64, +1 -> 80, +300 -> 384, +7 -> 400 >= 400: bucket closes; then p0 alone.
        assert_eq!(l.buckets.len(), 2);
        assert_eq!(l.buckets[0].params, vec![4, 3, 2, 1]);
        assert_eq!(l.buckets[1].params, vec![0]);
    }

    #[test]
    fn locate_maps_offsets_to_parameters_and_skips_padding() {
        let l = Layout::new(&specs(&[10, 20]), 0);
        let (s, i) = l.locate(l.slots[0].offset + 9).unwrap();
        assert_eq!((s.name.as_str(), i), ("p0", 9));
        assert!(l.locate(l.slots[1].offset + 20).is_none(), "padding belongs to no parameter");
        assert!(l.locate(l.len).is_none());
        assert_eq!(l.buckets.len(), 2, "bucket_bytes 0: one bucket per parameter");
    }

    #[test]
    fn hash_changes_with_names_sizes_and_cuts() {
        let a = Layout::new(&specs(&[10, 20]), 0).hash();
        assert_eq!(a, Layout::new(&specs(&[10, 20]), 0).hash());
        assert_ne!(a, Layout::new(&specs(&[10, 21]), 0).hash());
        assert_ne!(a, Layout::new(&specs(&[10, 20]), 1 << 20).hash());
    }

    #[test]
    fn chunks_cover_the_range_in_order_and_differ_by_at_most_one_unit() {
        for len in [0, 1, 2, 15, 16, 17, 31, 33, 100, 1000, 4099] {
            for n in 1..=5 {
                for align in [1, 16] {
                    let mut at = 0;
                    let mut sizes = Vec::new();
                    for r in 0..n {
                        let c = chunk_range(len, n, r, align);
                        assert_eq!(c.start, at, "len {len} n {n} align {align} r {r}");
                        assert!(c.start <= c.end);
                        at = c.end;
                        sizes.push(c.len());
                        if c.end < len {
                            assert_eq!(c.end % align, 0, "inner cuts on unit boundaries");
                        }
                    }
                    assert_eq!(at, len, "chunks cover the range");
                    let units = len.div_ceil(align);
                    let max = sizes.iter().max().unwrap();
                    assert!(*max <= units.div_ceil(n) * align, "len {len} n {n} align {align}: {sizes:?}");
                }
            }
        }
    }

    #[test]
    fn chunks_of_small_ranges() {
        assert_eq!(chunk_range(1, 3, 0, 1), 0..1);
        assert_eq!(chunk_range(1, 3, 1, 1), 1..1);
        assert_eq!(chunk_range(1, 3, 2, 1), 1..1);
        assert_eq!(chunk_range(0, 2, 1, 16), 0..0);
        assert_eq!(chunk_range(10, 3, 0, 1), 0..4);
        assert_eq!(chunk_range(10, 3, 1, 1), 4..7);
        assert_eq!(chunk_range(10, 3, 2, 1), 7..10);
        assert_eq!(chunk_range(48, 2, 1, 16), 32..48);
    }
}
