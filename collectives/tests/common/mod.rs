//! Helpers shared by the multi-process tests of the collectives.

use gradbus_collectives::{HealthTable, ValueNames, Verdict};

/// The workload values the multi-process tests report (3 of them: the bus takes any number).
pub fn value_names() -> ValueNames {
    ValueNames::new(&["reward", "kl", "spare"])
}

/// Everything a rank decides and reports from after an agreement, floats as bits: the summary,
/// the reduced buckets' health, the global norm, the loss and value aggregates, the verdict. The
/// summary path and the table path must give the same text.
pub fn digest(table: &HealthTable, verdict: &Verdict) -> String {
    let s = &table.summary;
    let mut out = format!(
        "world {}\nsummary {s:?}\nreduced {:?}\ngrad_norm {:016x}\nmean_loss {:016x}\nnonfinite_ranks {:?}\n",
        table.world,
        table.reduced,
        table.grad_norm().to_bits(),
        table.mean_loss().to_bits(),
        table.nonfinite_ranks()
    );
    for (name, v) in s.values() {
        out += &format!(
            "value {name}: mean {:016x} max {:016x} min {:016x}\n",
            table.mean_value(name).to_bits(),
            v.max().to_bits(),
            v.min().to_bits()
        );
    }
    out + &format!("{verdict:?}\n")
}
