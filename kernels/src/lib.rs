//! gradbus-kernels: the numeric kernels of gradbus, and nothing about ranks or models.
//!
//! Every fast kernel has a naive twin in [`reference`] and a test that compares the two on fresh
//! random inputs that include NaN, Inf, denormal and huge values. Kernels are deterministic: the
//! order of floating-point operations is fixed, so the same input gives the same bits.
//!
//! The CPU kernels run at one instruction-set level ([`simd`]: AVX-512, AVX2 or AVX, each with FMA,
//! or the baseline), the best the CPU has unless `GRADBUS_SIMD` or a test forces one; the level
//! changes the speed, never a bit (`kernels/tests/simd.rs` runs every level the CPU has).
//!
//! The CUDA versions (feature `cuda`, module [`cuda`]) keep the CPU kernels' names and argument
//! order; without the feature the module is a stub whose constructors return
//! [`Error::NotCompiledWithCuda`].

/// Call `$body($args)` through a copy compiled for the level `simd::active()` names - AVX-512F,
/// AVX2 or AVX (each with FMA) - or the baseline build: the fastest code the machine runs (or the
/// path a test or benchmark forced), from one body. Only for bodies whose result cannot depend on
/// the instruction set (integer arithmetic, elementwise IEEE operations without fused multiply-add:
/// Rust never contracts `a * b + c`, whatever features are enabled). Use it as the whole body of a
/// function.
macro_rules! simd_dispatch {
    ($body:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?) => {{
        #[cfg(target_arch = "x86_64")]
        {
            /// # Safety
            /// The CPU must support AVX-512F, AVX2 and FMA.
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            /// # Safety
            /// The CPU must support AVX2 and FMA.
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            /// # Safety
            /// The CPU must support AVX and FMA.
            #[target_feature(enable = "avx,fma")]
            unsafe fn avx($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            match $crate::simd::active() {
                // SAFETY (each arm): `active()` returns only levels the CPU supports, and each level
                // has the features its copy enables (`simd::Level::supported`).
                $crate::simd::Level::Avx512 => return unsafe { avx512($($arg),*) },
                $crate::simd::Level::Avx2 => return unsafe { avx2($($arg),*) },
                $crate::simd::Level::Avx => return unsafe { avx($($arg),*) },
                $crate::simd::Level::Baseline => {}
            }
        }
        $body($($arg),*)
    }};
}

pub mod backend;
pub mod checksum;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
pub mod cuda_grid;
pub mod error;
pub mod health;
pub mod ops;
pub mod reduce;
pub mod reference;
pub mod rng;
pub mod simd;

pub use checksum::{checksum, Checksum};
pub use error::Error;
pub use health::{all_finite, health_scan, scan_and_scale, Health, Peak};
pub use reduce::{reduce_in_place, reduce_plain, reduce_to_one, reduce_with_peaks};
