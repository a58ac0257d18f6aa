//! Model ops, llm.c style: one `<op>_forward` / `<op>_backward` pair of free functions per op, on raw
//! f32 slices with the dimensions passed explicitly and the shape of every buffer written beside it.
//!
//! Invariants: backward functions ACCUMULATE into their gradient outputs with `+=` (the caller zeroes
//! them when it wants a fresh gradient), so a parameter used twice, or a residual stream, just adds up.
//! Every op runs single-threaded in a fixed order of floating-point operations, so the same inputs give
//! the same bits. Nothing here guards against non-finite values: they flow through with IEEE semantics
//! (0 * inf = NaN), because the forensics trace must see them where they are born. Dimension names:
//! B batch, T time, C channels, V vocabulary, NH heads, OC output channels.

pub mod adamw;
pub mod attention;
pub mod embedding;
pub mod gelu;
pub mod grpo;
pub mod layernorm;
pub mod matmul;
pub mod residual;
pub mod sample;
pub mod scale;
pub mod softmax;

pub use adamw::{adamw_scaled, adamw_update, AdamwScalars};
pub use attention::{attention_backward, attention_forward, attention_forward_rows};
pub use embedding::{encoder_backward, encoder_forward};
pub use gelu::{gelu_backward, gelu_forward};
pub use grpo::{grpo_backward, grpo_forward, GrpoGrads, GrpoSaved, GrpoScalars, GrpoStats};
pub use layernorm::{layernorm_backward, layernorm_forward, LN_EPS};
pub use matmul::{matmul_backward, matmul_forward};
pub use residual::{residual_backward, residual_forward};
pub use sample::sample;
pub use scale::scale;
pub use softmax::{logsoftmax_gather_backward, logsoftmax_gather_forward};
