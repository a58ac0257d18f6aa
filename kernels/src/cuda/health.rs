//! The fused health scan on the device: NaN and Inf counts, the f64 sum of squares of the finite
//! elements and the first bad index of an f32 or bf16 buffer, to the host or into a device row.

use super::*;

impl Gpu {
    /// The fused health scan of `x` (f32): NaN and Inf counts, f64 sum of squares of the finite
    /// elements, first non-finite index. Synchronizes (the result is a host value).
    pub fn health_scan<S: DevicePtr<f32>>(&self, x: &S) -> Result<Health, Error> {
        self.scan_to_host(x, "health_scan_f32")
    }

    /// The health scan of bf16 elements (raw 16-bit words), widened exactly to f32.
    pub fn health_scan_bf16<S: DevicePtr<u16>>(&self, x: &S) -> Result<Health, Error> {
        self.scan_to_host(x, "health_scan_bf16")
    }

    /// The health scan of `x` into the 4 words of `row` on the device ([nan, inf, sum of squares
    /// as f64 bits, first bad index or `u64::MAX`]), enqueued: a bucket's tallies stay on the device
    /// until the agreement copies the whole table to the host at once.
    pub fn health_scan_into<S: DevicePtr<f32>, D: DevicePtrMut<u64>>(&self, x: &S, row: &mut D) -> Result<(), Error> {
        self.scan_into(x, "health_scan_f32", row)
    }

    /// The health scan's read-only baseline over `x`: the same tiles and loads, an xor per element
    /// (`health.cu`), enqueued. For the bandwidth benchmark.
    pub fn read_only<S: DevicePtr<f32>>(&self, x: &S) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let l = shape("read_only", grid::health(n))?;
        let mut scratch = self.scan_scratch(l.grid.0 as usize)?;
        let part = scratch.as_mut().expect("allocated");
        let (xp, _x) = x.device_ptr(&self.stream);
        let (pp, _p) = part.device_ptr_mut(&self.stream);
        // SAFETY: read_only_f32(const float *x, u64 n, unsigned *part): x holds n f32, part at least
        // one word per tile (the scratch has 4 u64 per tile).
        launch!(self, "read_only_f32", l, [&xp, &n, &pp])
    }

    /// The scratch of a scan over `tiles` tiles: 4 words per tile, 4 for a result, one counter (0).
    fn scan_scratch(&self, tiles: usize) -> Result<std::sync::MutexGuard<'_, Option<CudaSlice<u64>>>, Error> {
        let words = 4 * tiles + 5;
        let mut scratch = self.scan_scratch.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(scratch.as_ref(), Some(s) if s.len() >= words) {
            *scratch = Some(self.zeros::<u64>(words)?); // zero: the counter starts at 0
        }
        Ok(scratch)
    }

    fn scan_into<T, S: DevicePtr<T>, D: DevicePtrMut<u64>>(
        &self,
        x: &S,
        kernel: &'static str,
        row: &mut D,
    ) -> Result<(), Error> {
        if row.len() != 4 {
            return Err(Error::Shape { what: "health_scan", detail: format!("a row is 4 words, not {}", row.len()) });
        }
        let n = x.len() as u64;
        if n == 0 {
            return self.upload_into(&[0, 0, 0f64.to_bits(), NO_BAD], row);
        }
        let l = shape("health_scan", grid::health(n))?;
        let tiles = l.grid.0 as usize;
        let mut scratch = self.scan_scratch(tiles)?;
        let part = scratch.as_mut().expect("allocated");
        let counter_word = (part.len() - 1) as u64;
        let (xp, _x) = x.device_ptr(&self.stream);
        let (pp, _p) = part.device_ptr_mut(&self.stream);
        let (rp, _r) = row.device_ptr_mut(&self.stream);
        let cp = pp + 8 * counter_word; // the last word: zero, and reset by the last block
                                        // SAFETY: health_scan_<T>(const T *x, u64 n, u64 *part, unsigned *counter, u64 *out): x
                                        // holds n elements of the kernel's dtype (the caller picked the kernel of S's element type);
                                        // tile b < ceil(n / TILE) reads indices < n only and writes part[4b..4b+4) < 4 * tiles; the
                                        // counter is the scratch's last word (zero since allocation: every launch's last block
                                        // resets it); out is `row`, 4 words (checked).
        match kernel {
            "health_scan_f32" => launch!(self, "health_scan_f32", l, [&xp, &n, &pp, &cp, &rp]),
            _ => launch!(self, "health_scan_bf16", l, [&xp, &n, &pp, &cp, &rp]),
        }
    }

    fn scan_to_host<T, S: DevicePtr<T>>(&self, x: &S, kernel: &'static str) -> Result<Health, Error> {
        let mut row = self.zeros::<u64>(4)?;
        self.scan_into(x, kernel, &mut row)?;
        Ok(health_of_row(&self.download(&row)?))
    }
}

/// "No first bad index" in a health row.
const NO_BAD: u64 = u64::MAX;

/// A health row's 4 words as a [`Health`].
pub fn health_of_row(row: &[u64]) -> Health {
    Health { nan: row[0], inf: row[1], sumsq: f64::from_bits(row[2]), first_bad: (row[3] != NO_BAD).then_some(row[3]) }
}
