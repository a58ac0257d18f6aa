//! gradbus-kernels: the numeric kernels of gradbus, and nothing about ranks or models.
//!
//! Every fast kernel has a naive twin in [`reference`] and a test that compares the two on fresh
//! random inputs that include NaN, Inf, denormal and huge values. Kernels are deterministic: the
//! order of floating-point operations is fixed, so the same input gives the same bits.
//!
//! The CUDA versions (feature `cuda`, module [`cuda`]) keep the CPU kernels' names and argument
//! order; without the feature the module is a stub whose constructors return
//! [`Error::NotCompiledWithCuda`].

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

pub use error::Error;
pub use health::{health_scan, Health};
pub use reduce::{reduce_in_place, reduce_plain, reduce_to_one};
