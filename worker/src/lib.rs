//! gradbus-worker: one rank of a gradbus job - rank discovery, config, the reference RL workload,
//! the step loop over a `Transport`, checkpoints, failure dumps, replay and the forensics trace.

pub mod env;
pub mod exit;
pub mod loss;
pub mod model;
pub mod probe;
