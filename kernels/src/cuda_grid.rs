//! Launch shapes of the CUDA kernels (`kernels/cuda/*.cu`): the grid and block of every launch as a
//! pure function of the problem's size, in one place for the CUDA backend (`cuda/mod.rs`) and for
//! the tests that run the same sources on the CPU through the shim (`kernels/tests/cuda_shim.rs`),
//! so that both launch every kernel alike. Compiled with or without the `cuda` feature.
//!
//! Invariant: no shape depends on the device. The kernels' reductions have the shape of their
//! launch, so a result depends on the sizes alone: the same bits on every GPU model. The constants
//! here are the `#define`s of the `.cu` files; the shim tests fail if one side changes alone.

use crate::ops::GrpoStats;

/// One kernel source of `kernels/cuda/`: its text, and the kernels the backend loads from it.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    /// The file name, e.g. `health.cu`.
    pub file: &'static str,
    /// The CUDA C++ source.
    pub text: &'static str,
    /// Its `extern "C"` kernels.
    pub kernels: &'static [&'static str],
}

macro_rules! sources {
    ($($file:literal => [$($k:literal),* $(,)?]),* $(,)?) => {
        /// Every kernel source and its kernels: the backend compiles them (NVRTC) and looks the
        /// kernels up by these names, the NVRTC compile test checks each is in the PTX, and the CPU
        /// shim's tests build the same texts with `g++`.
        pub const SOURCES: &[Source] = &[$(Source { file: $file, text: include_str!(concat!("../cuda/", $file)), kernels: &[$($k),*] }),*];
    };
}

sources! {
    "health.cu" => ["health_scan_f32", "health_scan_bf16", "read_only_f32"],
    "scale.cu" => ["scale_f32", "scale_bf16", "fill_f32", "copy_2d_f32"],
    "adamw.cu" => ["adamw_update_f32", "checksum_lanes_f32"],
    "encoder.cu" => ["encoder_forward_f32", "encoder_backward_wte_f32", "encoder_backward_wpe_f32"],
    "layernorm.cu" => ["layernorm_forward_f32", "layernorm_backward_inp_f32", "layernorm_backward_params_f32"],
    "gelu.cu" => ["gelu_forward_f32", "gelu_backward_f32"],
    "residual.cu" => ["residual_forward_f32", "residual_backward_f32"],
    "attention.cu" => ["attention_forward_f32", "attention_backward_scores_f32", "attention_backward_dq_f32", "attention_backward_dkv_f32"],
    "softmax.cu" => ["logsoftmax_gather_forward_f32", "logsoftmax_gather_backward_f32"],
    "matmul.cu" => ["bias_fill_f32", "bias_backward_f32"],
    "loss.cu" => ["grpo_forward_f32", "grpo_reduce_f32", "grpo_backward_f32"],
    "sample.cu" => ["sample_f32"],
}

/// Blocks and threads per block, x, y, z.
pub type Dim = (u32, u32, u32);

/// One launch's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks.
    pub grid: Dim,
    /// Threads per block.
    pub block: Dim,
}

/// Threads per block of the elementwise kernels (grid-stride loops).
pub const ELEM_THREADS: u32 = 256;
/// Most blocks of an elementwise launch (a grid-stride loop covers the rest).
pub const ELEM_MAX_BLOCKS: u64 = 65_535;
/// Threads per block of the health scan (`HEALTH_THREADS` in health.cu).
pub const HEALTH_THREADS: u32 = 256;
/// Elements per block of the health scan (`HEALTH_TILE` in health.cu).
pub const HEALTH_TILE: u64 = 32_768;
/// Lanes of the replica checksum, one thread each (`CHECKSUM_LANES` in adamw.cu).
pub const CHECKSUM_LANES: u32 = crate::checksum::LANES as u32;

/// An elementwise kernel over `n` elements (`n` > 0).
pub fn elementwise(n: u64) -> Launch {
    Launch {
        grid: (n.div_ceil(ELEM_THREADS as u64).clamp(1, ELEM_MAX_BLOCKS) as u32, 1, 1),
        block: (ELEM_THREADS, 1, 1),
    }
}

/// Tiles of the health scan of `n` elements (`n` > 0): the number of partial rows.
pub fn health_tiles(n: u64) -> u64 {
    n.div_ceil(HEALTH_TILE)
}

/// The health scan (and its read-only baseline) over `n` elements, `n` > 0 and at most
/// `u32::MAX` tiles (`None` beyond).
pub fn health(n: u64) -> Option<Launch> {
    let tiles = u32::try_from(health_tiles(n)).ok()?;
    Some(Launch { grid: (tiles, 1, 1), block: (HEALTH_THREADS, 1, 1) })
}

/// The replica checksum's lanes: one block, a thread per lane.
pub fn checksum_lanes() -> Launch {
    Launch { grid: (1, 1, 1), block: (CHECKSUM_LANES, 1, 1) }
}

/// Threads per block of the kernels that give a block to each row (layer norm, the encoder's
/// dwte): one thread of the block runs the row's sums in order, all of them write its elements.
pub const ROW_THREADS: u32 = 128;
/// Threads per block of attention's per-row kernels (forward, backward scores).
pub const ATTENTION_THREADS: u32 = 64;
/// Threads of the sampling kernel's one block.
pub const SAMPLE_THREADS: u32 = 128;

/// One block of `threads` per row, `rows` > 0 and below 2^31 (`None` beyond).
pub fn per_row(rows: u64, threads: u32) -> Option<Launch> {
    let rows = u32::try_from(rows).ok().filter(|&r| r > 0 && r <= i32::MAX as u32)?;
    Some(Launch { grid: (rows, 1, 1), block: (threads, 1, 1) })
}

/// One thread (the sequential reductions, e.g. the loss's means).
pub fn single() -> Launch {
    Launch { grid: (1, 1, 1), block: (1, 1, 1) }
}

/// One block of `threads` (the sampler).
pub fn one_block(threads: u32) -> Launch {
    Launch { grid: (1, 1, 1), block: (threads, 1, 1) }
}

/// The number of floats of the loss's stats, in the order loss.cu lists.
pub const LOSS_STATS: usize = 12;

/// The stats loss.cu's `grpo_reduce_f32` writes, as [`GrpoStats`] (the 12th float, the divisor, is
/// `GrpoStats::denom`).
pub fn grpo_stats(s: &[f32]) -> GrpoStats {
    assert_eq!(s.len(), LOSS_STATS, "loss.cu writes {LOSS_STATS} stats");
    GrpoStats {
        loss: s[0],
        ratio: s[1],
        kl: s[2],
        max_ratio_logratio_response: s[3],
        max_ratio_logratio_masked: s[4],
        max_kl_logratio_response: s[5],
        max_kl_logratio_masked: s[6],
        max_logratio_response: s[7],
        max_logratio_masked: s[8],
        min_response_logp: s[9],
        response_tokens: s[10] as usize,
    }
}

/// The positions of each distinct token of `tokens` (B T of them), as the encoder's dwte backward
/// takes them: `rows` the distinct ids in increasing order, `starts` (rows + 1) where each one's
/// positions begin in `order`, `order` every position sorted by (token, position). A counting
/// sort over `v` ids; ids >= `v` are left out (the forward refused them).
pub fn token_rows(tokens: &[u32], v: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut count = vec![0u32; v];
    for &t in tokens.iter().filter(|&&t| (t as usize) < v) {
        count[t as usize] += 1;
    }
    let (mut rows, mut starts, mut at) = (Vec::new(), vec![0u32], vec![0u32; v]);
    for (id, &n) in count.iter().enumerate().filter(|(_, &n)| n > 0) {
        at[id] = *starts.last().expect("starts begins with 0");
        rows.push(id as u32);
        starts.push(at[id] + n);
    }
    let mut order = vec![0u32; *starts.last().expect("starts begins with 0") as usize];
    for (pos, &t) in tokens.iter().enumerate().filter(|(_, &t)| (t as usize) < v) {
        order[at[t as usize] as usize] = pos as u32;
        at[t as usize] += 1;
    }
    (rows, starts, order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_rows_list_each_tokens_positions_in_order() {
        let (rows, starts, order) = token_rows(&[3, 1, 3, 0, 1, 3, 9], 4);
        assert_eq!(rows, [0, 1, 3]);
        assert_eq!(starts, [0, 1, 3, 6]);
        assert_eq!(order, [3, 1, 4, 0, 2, 5]);
    }

    #[test]
    fn shapes_cover_their_sizes() {
        assert_eq!(elementwise(1).grid, (1, 1, 1));
        assert_eq!(elementwise(257).grid, (2, 1, 1));
        assert_eq!(elementwise(1 << 40).grid.0 as u64, ELEM_MAX_BLOCKS);
        assert_eq!(health(HEALTH_TILE + 1).unwrap().grid, (2, 1, 1));
        assert!(health(HEALTH_TILE << 33).is_none());
        assert!(per_row(0, ROW_THREADS).is_none() && per_row(1 << 31, ROW_THREADS).is_none());
    }
}
