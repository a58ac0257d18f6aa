//! Without the `cuda` feature the CUDA API is a stub: it compiles and says so, it does not panic.
#![cfg(not(feature = "cuda"))]

use gradbus_kernels::cuda::{self, Gpu};
use gradbus_kernels::Error;

#[test]
fn without_the_feature_the_api_returns_not_compiled_with_cuda() {
    assert!(!cuda::driver_present());
    assert!(matches!(cuda::probe(), Err(Error::NotCompiledWithCuda)));
    assert!(matches!(Gpu::new(0), Err(Error::NotCompiledWithCuda)));
}
