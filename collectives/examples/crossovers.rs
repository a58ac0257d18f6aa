//! The agreement's cost model at MPI's constants (`Calibration::MPI`) and MPI's row
//! (`RowShape::mpi`, the codec's length): the smallest world size at which it chooses the summary
//! per value count and bucket count, and both paths at the sizes of issue 18 with 5 values. Its
//! output is docs/agreement.md's two tables; re-run it when the row or the constants change:
//! `cargo run --release -q -p gradbus-collectives --example crossovers`.

use gradbus_collectives::choice::{cost, Calibration};
use gradbus_collectives::wire::RowShape;
use gradbus_collectives::AgreementPath;

/// `n` with thousands separators.
fn grouped(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn main() {
    println!("| values | 1 bucket | 7 (the default tiny config) | 30 | 100 | 300 | 1750 |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for v in [0usize, 5, 20, 100] {
        let cells: Vec<String> = [1usize, 7, 30, 100, 300, 1750]
            .iter()
            .map(|&b| {
                (1..=65536)
                    .find(|&w| {
                        AgreementPath::cheaper(w, RowShape::mpi(b, v), Calibration::MPI) == AgreementPath::Summary
                    })
                    .map_or("none".into(), |w| w.to_string())
            })
            .collect();
        println!("| {v} | {} |", cells.join(" | "));
    }
    println!();
    println!(
        "| world | buckets | table row B | table: bytes into each rank | summary B | summary: bytes into each rank \
         | exchanges table / summary | model us table / summary |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (w, b) in [(8usize, 7usize), (1024, 100), (1024, 1750), (16384, 100), (16384, 1750)] {
        let c = cost(w, RowShape::mpi(b, 5), Calibration::MPI);
        println!(
            "| {w} | {b} | {} | {} | {} | {} | {} / {} | {} / {} |",
            c.row_bytes,
            grouped(c.table_bytes - c.row_bytes),
            grouped(c.summary_bytes),
            grouped(c.summary_bytes_in),
            c.rounds,
            2 * c.rounds,
            grouped(c.table_us().round() as usize),
            grouped(c.summary_us().round() as usize)
        );
    }
}
