//! `gradbus worker --bench-allreduce ...`: one process of the all-reduce benchmark, for launches by
//! `mpirun` (the `gradbus bench allreduce` CLI spawns its own processes). Rank and size come from the
//! MPI launcher's environment; rank 0 prints the table (or JSON lines).
//!
//! `mpirun --allow-run-as-root --bind-to none -np 2 gradbus worker --bench-allreduce --transport mpi
//! --sizes 64MiB` (feature `mpi`) compares the shm bus with `MPI_Allreduce`.

use gradbus_collectives::bench::{self, BenchArgs, BenchTransport};

use crate::rank::RankInfo;

/// Usage of the hidden subcommand.
pub const USAGE: &str = "usage: gradbus worker --bench-allreduce [--sizes 1MiB,64MiB] [--iters N] [--warmup N] \
[--transport shm|mpi|hier] [--nodes K] [--json] | --bench-allreduce --agreement [--buckets 7,100,1750] [--iters N] [--json]";

/// Run one benchmark process with the arguments after `--bench-allreduce`; `Err` is a message.
pub fn main(args: Vec<std::ffi::OsString>) -> Result<(), String> {
    use lexopt::prelude::*;
    let info = RankInfo::discover().map_err(|e| e.to_string())?;
    let mut b = BenchArgs::new(info.rank, info.world, format!("bench-{}", info.job_id), vec![64 << 20]);
    let (mut json, mut agreement, mut buckets) = (false, false, vec![7, 100, 1750]);
    let mut p = lexopt::Parser::from_args(args);
    let err = |e: lexopt::Error| e.to_string();
    while let Some(arg) = p.next().map_err(err)? {
        match arg {
            Long("sizes") => b.sizes = bench::parse_sizes(&p.value().map_err(err)?.string().map_err(err)?)?,
            Long("iters") => b.iters = p.value().map_err(err)?.parse().map_err(err)?,
            Long("warmup") => b.warmup = p.value().map_err(err)?.parse().map_err(err)?,
            Long("transport") => {
                b.transport = p.value().map_err(err)?.string().map_err(err)?.parse::<BenchTransport>()?
            }
            Long("nodes") => b.nodes = p.value().map_err(err)?.parse().map_err(err)?,
            Long("json") => json = true,
            Long("agreement") => agreement = true,
            Long("buckets") => {
                let v = p.value().map_err(err)?.string().map_err(err)?;
                buckets = v
                    .split(',')
                    .map(|b| b.trim().parse().map_err(|_| format!("--buckets: bad count {b:?}")))
                    .collect::<Result<_, _>>()?;
            }
            other => return Err(other.unexpected().to_string()),
        }
    }
    if info.nodes > 1 {
        return Err(format!("the benchmark runs on one node; this job has {} (GRADBUS_FAKE_NODES?)", info.nodes));
    }
    if agreement {
        let values = crate::update::UpdateValues::names();
        let rows = gradbus_collectives::bench_agreement::rank_main(b.rank, b.np, &buckets, &values, b.iters)
            .map_err(|e| format!("{e:#}"))?;
        if let Some(rows) = rows {
            let lines: Vec<String> = rows.iter().map(|r| serde_json::to_string(r).expect("json") + "\n").collect();
            print!("{}", if json { lines.concat() } else { gradbus_collectives::bench_agreement::format_table(&rows) });
        }
        return Ok(());
    }
    let rows = bench::rank_main(b).map_err(|e| format!("{e:#}"))?;
    if let Some(rows) = rows {
        print!("{}", if json { bench::json_lines(&rows) } else { bench::format_table(&rows) });
    }
    Ok(())
}
