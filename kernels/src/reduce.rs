//! The reduce step of the gradient bus: sum the same chunk of every rank's gradient slot, in rank
//! order, and write the sum back into every slot, tallying each SOURCE rank's health on the way.
//!
//! Invariants: the sum is `((s0 + s1) + s2) + ...` element by element, always in that order, so every
//! rank gets bitwise-identical results and every run repeats them. Each source is read once from
//! memory (the block it is scanned from stays in L1 for the add) and each destination written once:
//! the memcpy floor. The tallies describe the sources BEFORE they are overwritten.

use crate::health::{scan_block, Health, BLOCK};

/// Rank-ordered in-place all-reduce of `slots` (all the same length). `tally[k]` receives the health
/// of `slots[k]` as it was on entry; the return value is the health of the sum.
///
/// Panics if the slots differ in length or `tally.len() != slots.len()`: callers build both from one
/// layout, so a mismatch is a bug, not an input error.
pub fn reduce_in_place(slots: &mut [&mut [f32]], tally: &mut [Health]) -> Health {
    reduce(slots, tally, None)
}

/// `reduce_in_place` that writes the sum into `slots[root]` only (the other slots keep their
/// values): the same rank-ordered sum and the same tallies. The hierarchical transport uses it to
/// leave a node's sum in its leader's slot.
pub fn reduce_to_one(slots: &mut [&mut [f32]], tally: &mut [Health], root: usize) -> Health {
    assert!(root < slots.len(), "root {root} of {} slots", slots.len());
    reduce(slots, tally, Some(root))
}

/// The one reduce loop: every slot (`to = None`) or one slot (`Some(root)`) receives the sum.
fn reduce(slots: &mut [&mut [f32]], tally: &mut [Health], to: Option<usize>) -> Health {
    assert_eq!(slots.len(), tally.len(), "one tally per slot");
    let Some(len) = slots.first().map(|s| s.len()) else {
        return Health::default();
    };
    assert!(slots.iter().all(|s| s.len() == len), "slots of one bucket chunk must have one length");
    let mut sum = Health::default();
    let mut acc = [0f32; BLOCK];
    let mut lo = 0;
    while lo < len {
        let hi = (lo + BLOCK).min(len);
        let acc = &mut acc[..hi - lo];
        for (k, slot) in slots.iter().enumerate() {
            let src = &slot[lo..hi];
            tally[k].merge(&scan_block(src), lo as u64);
            if k == 0 {
                acc.copy_from_slice(src);
            } else {
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a += s;
                }
            }
        }
        sum.merge(&scan_block(acc), lo as u64);
        match to {
            None => slots.iter_mut().for_each(|slot| slot[lo..hi].copy_from_slice(acc)),
            Some(root) => slots[root][lo..hi].copy_from_slice(acc),
        }
        lo = hi;
    }
    sum
}
