//! gradbus-kernels: the numeric kernels of gradbus, and nothing about ranks or models.
//!
//! Every fast kernel has a naive twin in [`reference`] and a test that compares the two on fresh
//! random inputs that include NaN, Inf, denormal and huge values. Kernels are deterministic: the
//! order of floating-point operations is fixed, so the same input gives the same bits.
//!
//! The CUDA versions (feature `cuda`, module [`cuda`]) keep the CPU kernels' names and argument
//! order; without the feature the module is a stub whose constructors return
//! [`Error::NotCompiledWithCuda`].

/// Call `$body($args)` through a copy compiled for AVX-512F, or AVX2, when the CPU has it, else the
/// baseline build: the fastest code the machine runs, from one body. Only for bodies whose result
/// cannot depend on the instruction set (integer arithmetic, elementwise IEEE operations without
/// fused multiply-add: Rust never contracts `a * b + c`). Use it as the whole body of a function.
macro_rules! simd_dispatch {
    ($body:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?) => {{
        #[cfg(target_arch = "x86_64")]
        {
            /// # Safety
            /// The CPU must support AVX-512F.
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            /// # Safety
            /// The CPU must support AVX2.
            #[target_feature(enable = "avx2")]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F (checked just above).
                return unsafe { avx512($($arg),*) };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                return unsafe { avx2($($arg),*) };
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
pub mod error;
pub mod health;
pub mod ops;
pub mod reduce;
pub mod reference;
pub mod rng;

pub use checksum::{checksum, Checksum};
pub use error::Error;
pub use health::{health_scan, Health};
pub use reduce::{reduce_in_place, reduce_plain, reduce_to_one};
