//! The report's text summary: counts of each verdict, the skips' causes, the reruns, the first
//! update under the headroom margin, the warnings the run wrote (warnings.jsonl), the spikes, the
//! abort and the replay command.

use std::fmt::Write as _;

use gradbus_artifacts::WarningLine;
use gradbus_collectives::Report;

use super::{Analysis, Options, RunData};

/// The text summary.
pub fn summary(data: &RunData, a: &Analysis, opts: &Options) -> String {
    let u = &data.updates;
    let mut s = String::new();
    let at = |i: usize| format!("step {} update {}", u[i].step, u[i].minibatch);
    let steps: std::collections::BTreeSet<u64> = u.iter().map(|x| x.step).collect();
    let count = |v: &str| u.iter().filter(|x| x.verdict == v).count();
    let _ = writeln!(
        s,
        "run {}: {} step(s) ({}..={}), {} update(s) ({} per step): {} proceed, {} skip, {} rerun, {} abort",
        opts.run_dir.display(),
        steps.len(),
        steps.first().copied().unwrap_or(0),
        steps.last().copied().unwrap_or(0),
        u.len(),
        a.per_step,
        count("proceed"),
        count("skip"),
        count("rerun"),
        count("abort"),
    );
    let mut causes: std::collections::BTreeMap<&str, usize> = Default::default();
    for c in u.iter().filter_map(|x| x.skip_cause.as_deref()) {
        *causes.entry(c).or_default() += 1;
    }
    let causes: Vec<String> = causes.iter().map(|(c, n)| format!("{n} {c}")).collect();
    let _ = writeln!(
        s,
        "skips: {}{}",
        count("skip"),
        if causes.is_empty() { String::new() } else { format!(" ({})", causes.join(", ")) }
    );
    let reruns: Vec<String> = (0..u.len()).filter(|&i| u[i].verdict == "rerun").map(at).collect();
    let _ = writeln!(
        s,
        "reruns: {}{}",
        reruns.len(),
        if reruns.is_empty() { String::new() } else { format!(" ({})", list(&reruns)) }
    );
    match a.warnings.first() {
        None => {
            let _ = writeln!(s, "warnings (headroom < {}): none", opts.margin);
        }
        Some(&first) => {
            let before = match a.abort {
                Some(ab) if ab >= first => format!(", {} update(s) before the abort", ab - first),
                _ => String::new(),
            };
            let _ = writeln!(
                s,
                "warnings (headroom < {}): {} update(s); first at {} (headroom {:.2}){before}",
                opts.margin,
                a.warnings.len(),
                at(first),
                u[first].headroom,
            );
        }
    }
    if let Some(w) = &data.warnings {
        let _ = writeln!(s, "{}", written_warnings(w, data.abort.as_ref(), a.per_step));
    }
    for (name, spikes) in [("loss", &a.loss_spikes), ("grad norm", &a.norm_spikes)] {
        let items: Vec<String> =
            spikes.iter().map(|f| format!("{} = {:.4} ({})", at(f.update), f.spike.value, f.spike.rules())).collect();
        let _ = writeln!(
            s,
            "{name} spikes (z > {} over {} updates, or > 10x the first-100 max): {}{}",
            opts.z_limit,
            opts.window,
            items.len(),
            if items.is_empty() { String::new() } else { format!(": {}", list(&items)) }
        );
    }
    match (&data.abort, a.abort) {
        (Some(r), _) => {
            let _ = writeln!(s, "abort: {r}");
        }
        (None, Some(i)) => {
            let _ = writeln!(s, "abort: {} (no report.json)", at(i));
        }
        (None, None) => {
            let _ = writeln!(s, "abort: none");
        }
    }
    if data.abort.is_some() || data.has_dumps {
        let _ = writeln!(s, "replay: gradbus replay {} --trace", opts.run_dir.display());
    }
    s
}

/// At most 8 items, then "... and N more".
fn list(items: &[String]) -> String {
    if items.len() <= 8 {
        items.join("; ")
    } else {
        format!("{}; ... and {} more", items[..8].join("; "), items.len() - 8)
    }
}

/// The line of the warnings the run wrote (`warnings.jsonl`: what its progress bar counted): how
/// many, the first (its update, value, rank and forecast) and how many updates before the abort.
fn written_warnings(w: &[WarningLine], abort: Option<&Report>, per_step: u64) -> String {
    let Some(first) = w.first() else { return "warnings.jsonl: none".to_string() };
    let (step, update) = (first.update / per_step, first.update % per_step);
    let forecast =
        first.forecast_updates.map_or_else(|| "no trend".to_string(), |f| format!("forecast {f:.1} update(s)"));
    let before = match abort.map(|r| r.step * per_step + r.minibatch as u64) {
        Some(ab) if ab >= first.update => format!(", {} update(s) before the abort", ab - first.update),
        _ => String::new(),
    };
    format!(
        "warnings.jsonl: {} update(s); first at step {step} update {update} ({} {:.2} on rank {}, limit {:.2}, {forecast}){before}",
        w.len(),
        first.quantity,
        first.value,
        first.rank,
        first.limit,
    )
}
