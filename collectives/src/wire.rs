//! The agreement's row: the words one rank contributes to the table path (every rank's row,
//! gathered), encoded and decoded here and nowhere else - by the MPI and NCCL transports and by the
//! PyTorch guard's native core - and the hash of each collective that every rank folds into a
//! per-update sequence hash, so that ranks which called different collectives find out and all fail
//! alike.
//!
//! ```text
//!  row = [ head (RowShape::head words, the transport's: op hash, reducer flag, config/layout hashes)
//!        | local health per bucket (4 words: nan, inf, sumsq bits, first bad or NONE)
//!        | local peak per bucket (1 word, `agreement::peak_word`; 0 where not tallied)
//!        | reduced health per bucket (4 words; only when RowShape::reduced)
//!        | reduced checksum per bucket (1 word; only when RowShape::reduced)
//!        | report (LocalScalars: loss bits, one word per value, replica checksum, state) ]
//! ```
//!
//! Invariants: a row's length is `RowShape::len` (the cost model reads it there); decoding is the
//! exact inverse of encoding (every word is bits, no float arithmetic), so every rank decodes the
//! same gathered words into the same table.

use gradbus_kernels::Health;

#[cfg(any(feature = "mpi", feature = "cuda"))]
use crate::agreement::NONE;
pub(crate) use crate::agreement::{health_of, health_words};
use crate::agreement::{peak_of_word, LocalScalars, ValueNames};
#[cfg(any(feature = "mpi", feature = "cuda"))]
use crate::layout::Fnv;
#[cfg(any(feature = "mpi", feature = "cuda"))]
use crate::verdict::StepId;
use crate::verdict::{HealthTable, Reduced};

/// Words of a health cell.
pub const CELL: usize = 4;

/// What a row holds besides the local health and the report: the transport's header words and
/// whether the reduced buckets' health travels too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowShape {
    /// Header words before the cells (the transport's own: op hash, reducer flag, config hashes).
    pub head: usize,
    /// Buckets.
    pub buckets: usize,
    /// Whether the row carries the reduced buckets' health and checksums after the local
    /// cells.
    pub reduced: bool,
    /// Workload values in the report (`ValueNames::len`).
    pub values: usize,
}

impl RowShape {
    /// The MPI transports' row (`mpi`): head `[op hash, reducer flag]`, the local cells and the
    /// reduced ones (every reducer's, compared as bits), the report.
    pub fn mpi(buckets: usize, values: usize) -> RowShape {
        RowShape { head: 2, buckets, reduced: true, values }
    }

    /// The NCCL transport's row (`nccl`): head `[op hash, config hash, layout hash]`, the local
    /// health, the report (every rank scans the same reduced bits itself).
    pub fn nccl(buckets: usize, values: usize) -> RowShape {
        RowShape { head: 3, buckets, reduced: false, values }
    }

    /// Words of one row.
    pub fn len(&self) -> usize {
        self.head + (CELL + 1) * self.buckets * (1 + self.reduced as usize) + LocalScalars::words(self.values)
    }

    /// Bytes of one row.
    pub fn bytes(&self) -> usize {
        8 * self.len()
    }

    /// Never empty (the report has at least the loss and the replica words); for clippy's
    /// `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// One rank's row: `head` (`self.head` words), its local health and peak word per bucket, the
    /// reduced buckets' health and checksums when the shape carries them (zeros when this
    /// rank has none: not a reducer), its report.
    ///
    /// # Panics
    /// When a part does not fit the shape (a program bug).
    pub fn encode(
        &self,
        head: &[u64],
        (local, peaks): (&[Health], &[u64]),
        reduced: Option<(&[Health], &[u64])>,
        report: &LocalScalars,
    ) -> Vec<u64> {
        let parts = (head.len(), local.len(), peaks.len(), report.values.len());
        assert_eq!(parts, (self.head, self.buckets, self.buckets, self.values));
        let mut w = Vec::with_capacity(self.len());
        w.extend_from_slice(head);
        w.extend(local.iter().flat_map(health_words));
        w.extend_from_slice(peaks);
        if self.reduced {
            match reduced {
                Some((r, hashes)) => {
                    assert_eq!((r.len(), hashes.len()), (self.buckets, self.buckets));
                    w.extend(r.iter().flat_map(health_words));
                    w.extend_from_slice(hashes);
                }
                None => w.resize(w.len() + (CELL + 1) * self.buckets, 0),
            }
        }
        w.extend(report.to_words());
        debug_assert_eq!(w.len(), self.len());
        w
    }

    /// The parts of one row of `self.len()` words.
    pub fn decode<'a>(&self, row: &'a [u64]) -> RowView<'a> {
        assert_eq!(row.len(), self.len(), "a row of {} words, its shape {self:?} says {}", row.len(), self.len());
        let cells = self.head + (CELL + 1) * self.buckets;
        let end = cells + if self.reduced { (CELL + 1) * self.buckets } else { 0 };
        RowView {
            head: &row[..self.head],
            local: &row[self.head..cells],
            reduced: &row[cells..end],
            report: &row[end..],
            buckets: self.buckets,
        }
    }

    /// The rows of a gathered table (`world` rows back to back), in rank order.
    ///
    /// # Errors
    /// When the words are not a whole number of rows (a message naming both lengths).
    pub fn rows<'a>(&self, all: &'a [u64]) -> Result<Vec<RowView<'a>>, String> {
        if all.is_empty() || all.len() % self.len() != 0 {
            return Err(format!(
                "a table of {} words is not a whole number of rows of {} words ({} buckets, {} values)",
                all.len(),
                self.len(),
                self.buckets,
                self.values
            ));
        }
        Ok(all.chunks_exact(self.len()).map(|r| self.decode(r)).collect())
    }
}

/// One decoded row: borrowed words, parts by name.
#[derive(Clone, Copy, Debug)]
pub struct RowView<'a> {
    /// The transport's header words.
    pub head: &'a [u64],
    local: &'a [u64],
    reduced: &'a [u64],
    report: &'a [u64],
    buckets: usize,
}

impl RowView<'_> {
    /// The rank's local health in bucket `b`.
    pub fn local(&self, b: usize) -> Health {
        health_of(&self.local[CELL * b..CELL * (b + 1)])
    }

    /// The rank's peak in bucket `b` (`None` where the transport tallies none).
    pub fn peak(&self, b: usize) -> Option<(f32, u64)> {
        peak_of_word(self.local[CELL * self.buckets + b])
    }

    /// The words of the reduced buckets' health and hashes (empty when the shape carries none):
    /// compared between reducers as bits.
    pub fn reduced_words(&self) -> &[u64] {
        self.reduced
    }

    /// The reduced buckets' health and checksums (empty when the shape carries none).
    pub fn reduced(&self) -> Reduced {
        if self.reduced.is_empty() {
            return Reduced { health: Vec::new(), reference: Vec::new() };
        }
        let (health, reference) = self.reduced.split_at(CELL * self.buckets);
        Reduced { health: health.chunks_exact(CELL).map(health_of).collect(), reference: reference.to_vec() }
    }

    /// The rank's report.
    pub fn report(&self) -> LocalScalars {
        LocalScalars::from_words(self.report)
    }
}

/// The `HealthTable` of every rank's decoded row (in rank order) with the reduced buckets
/// `reduced` and the agreed collective hash `ops` (when the transport checks one).
pub fn table_of(rows: &[RowView<'_>], names: &ValueNames, reduced: Reduced, ops: Option<u64>) -> HealthTable {
    let (n, nb) = (rows.len(), reduced.health.len());
    let mut local = vec![Health::default(); nb * n];
    let mut peaks = vec![None; nb * n];
    for (k, r) in rows.iter().enumerate() {
        for b in 0..nb {
            (local[b * n + k], peaks[b * n + k]) = (r.local(b), r.peak(b));
        }
    }
    let reports = rows.iter().map(RowView::report).collect();
    HealthTable::detailed(n, names, local, peaks, reduced, reports, ops)
}

/// Hash of one collective, folded into the per-update sequence hash.
#[cfg(any(feature = "mpi", feature = "cuda"))]
pub(crate) fn fold_op(h: &mut Fnv, phase: &str, at: StepId, bucket: Option<usize>) {
    h.write(phase.as_bytes());
    h.write(&at.step.to_le_bytes());
    h.write(&at.minibatch.to_le_bytes());
    h.write(&at.attempt.to_le_bytes());
    h.write(&bucket.map_or(NONE, |b| b as u64).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agreement::peak_word;

    fn health(k: u64) -> Health {
        Health { nan: k % 3, inf: k % 2, sumsq: k as f64 * 0.5, first_bad: (k % 3 > 0).then_some(k * 7) }
    }

    #[test]
    fn a_row_decodes_to_what_was_encoded_in_every_shape() {
        for (head, reduced, values) in [(0, false, 2), (2, true, 0), (3, false, 5)] {
            let shape = RowShape { head, buckets: 3, reduced, values };
            let names = ValueNames::new(&(0..values).map(|i| format!("v{i}")).collect::<Vec<_>>());
            let mut all = Vec::new();
            let mut want = Vec::new();
            let red: Vec<Health> = (0..3).map(|b| health(100 + b)).collect();
            let hashes = [7u64, 8, 9];
            for rank in 0..4u64 {
                let local: Vec<Health> = (0..3).map(|b| health(rank * 3 + b)).collect();
                let peaks: Vec<u64> = (0..3).map(|b| peak_word(Some((rank as f32 + 0.5, b)))).collect();
                let report = LocalScalars {
                    loss: rank as f64 - 0.25,
                    values: (0..values).map(|i| i as f64 * 1.5 + rank as f64).collect(),
                    replica: u64::MAX - rank,
                    state: rank,
                };
                let hw: Vec<u64> = (0..head as u64).map(|i| i + 10 * rank).collect();
                let mine = (rank % 2 == 0).then_some((&red[..], &hashes[..]));
                let row = shape.encode(&hw, (&local, &peaks), mine, &report);
                assert_eq!(row.len(), shape.len());
                all.extend(row);
                want.push((hw, local, report));
            }
            let rows = shape.rows(&all).unwrap();
            assert_eq!(rows.len(), 4);
            for (k, (r, (hw, local, report))) in rows.iter().zip(&want).enumerate() {
                assert_eq!(r.head, &hw[..]);
                assert_eq!((0..3).map(|b| r.local(b)).collect::<Vec<_>>(), *local);
                assert_eq!(r.peak(2), Some((k as f32 + 0.5, 2)));
                assert_eq!(r.report(), *report);
            }
            if reduced {
                assert_eq!(rows[0].reduced(), Reduced { health: red.clone(), reference: hashes.to_vec() });
                assert!(rows[1].reduced_words().iter().all(|&w| w == 0), "a non-reducer's part is zeros");
            } else {
                assert!(rows[0].reduced().health.is_empty());
            }
            let none = Reduced { health: vec![Health::default(); 3], reference: vec![0; 3] };
            let t = table_of(&rows, &names, none, None);
            assert_eq!((t.world, t.buckets), (4, 3));
            assert_eq!(*t.cell(2, 1), health(1 * 3 + 2));
            assert_eq!(t.peaks[2 * 4 + 1], Some((1.5, 2)));
            assert!(shape.rows(&all[1..]).unwrap_err().contains("not a whole number of rows"));
        }
    }
}
