//! `gradbus worker --bench-allreduce ...`: one process of the all-reduce benchmark (or, with
//! `--agreement`, of the agreement benchmark), and [`BenchFlags`], the one parser of the
//! benchmark's flags. `gradbus bench allreduce` parses its command line with it (adding only
//! `--np` and `--run-dir`) and starts N processes with [`BenchFlags::to_args`], either itself
//! (the shm bus: `--out FILE`, where rank 0 writes the result) or through `mpirun` (MPI and the
//! hierarchical transport: rank 0 prints). Rank and size come from the launcher's environment.
//!
//! `mpirun --allow-run-as-root --bind-to none -np 2 gradbus worker --bench-allreduce --transport mpi
//! --sizes 64MiB` (feature `mpi`) compares the shm bus with `MPI_Allreduce`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use gradbus_collectives::bench::{self, BenchArgs, BenchTransport};

use crate::error::WorkerError;
use crate::rank::RankInfo;

/// Usage of the hidden subcommand.
pub const USAGE: &str = "usage: gradbus worker --bench-allreduce [--sizes 1MiB,64MiB] [--iters N] [--warmup N] \
[--timeout S] [--transport shm|mpi|hier] [--nodes K] [--json] [--out FILE] \
| --bench-allreduce --agreement [--buckets 7,100,1750] [--iters N] [--json]";

/// The benchmark's flags, whichever way it is started (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct BenchFlags {
    /// `--sizes`: message sizes per rank in bytes (multiples of 4).
    pub sizes: Vec<usize>,
    /// `--iters`: timed all-reduces per round (at least 1).
    pub iters: usize,
    /// `--warmup`: untimed all-reduces per size.
    pub warmup: usize,
    /// `--timeout`: the deadline of every barrier.
    pub timeout: Duration,
    /// `--transport`: what is measured besides the shm bus.
    pub transport: BenchTransport,
    /// `--nodes`: fake nodes of `--transport hier`.
    pub nodes: usize,
    /// `--json`: JSON lines instead of the table.
    pub json: bool,
    /// `--agreement`: the agreement benchmark instead of the all-reduce one (under `mpirun`).
    pub agreement: bool,
    /// `--buckets`: bucket counts of the agreement benchmark.
    pub buckets: Vec<usize>,
    /// `--out`: rank 0 writes the result to this file (atomically) instead of stdout.
    pub out: Option<PathBuf>,
}

impl Default for BenchFlags {
    fn default() -> BenchFlags {
        BenchFlags {
            sizes: vec![1 << 20, 16 << 20, 64 << 20, 256 << 20],
            iters: 20,
            warmup: 3,
            timeout: Duration::from_secs(120),
            transport: BenchTransport::Shm,
            nodes: 2,
            json: false,
            agreement: false,
            buckets: vec![7, 100, 1750],
            out: None,
        }
    }
}

/// A usage error naming the flag and its value, with a hint.
fn bad(flag: &str, value: &str, what: &str, hint: &str) -> WorkerError {
    WorkerError::Usage(format!("{flag} {value}: {what}\n  hint: {hint}"))
}

/// A whole number of a flag.
fn number(flag: &str, v: &str, example: &str) -> Result<usize, WorkerError> {
    v.parse().map_err(|_| bad(flag, v, "not a whole number", &format!("e.g. {flag} {example}")))
}

/// A comma-separated list of whole numbers of a flag.
fn numbers(flag: &str, v: &str, example: &str) -> Result<Vec<usize>, WorkerError> {
    v.split(',').map(|n| number(flag, n.trim(), example)).collect()
}

impl BenchFlags {
    /// The flags of `gradbus worker --bench-allreduce`: nothing but the benchmark's.
    pub fn parse(args: Vec<OsString>) -> Result<BenchFlags, WorkerError> {
        let usage = |e: lexopt::Error| WorkerError::Usage(format!("{e}\n  hint: {USAGE}"));
        let mut flags = BenchFlags::default();
        let mut p = lexopt::Parser::from_args(args);
        while let Some(arg) = p.next().map_err(usage)? {
            let flag = match arg {
                lexopt::Arg::Long(f) => f.to_owned(),
                other => return Err(usage(other.unexpected())),
            };
            if !flags.parse_long(&flag, &mut p)? {
                return Err(usage(lexopt::Arg::Long(&flag).unexpected()));
            }
        }
        Ok(flags)
    }

    /// Parses the long flag `--{flag}` when it is one of the benchmark's (taking its value from
    /// `p`): `Ok(true)`; `Ok(false)` for any other flag, which the caller handles.
    pub fn parse_long(&mut self, flag: &str, p: &mut lexopt::Parser) -> Result<bool, WorkerError> {
        let mut value = || -> Result<String, WorkerError> {
            let v = p.value().map_err(|e| WorkerError::Usage(format!("{e}\n  hint: see `gradbus bench --help`")))?;
            Ok(v.to_string_lossy().into_owned())
        };
        let f = format!("--{flag}");
        match flag {
            "sizes" => {
                let v = value()?;
                self.sizes = bench::parse_sizes(&v).map_err(|e| bad(&f, &v, &e, "e.g. --sizes 1MiB,64MiB"))?;
                if self.sizes.is_empty() {
                    return Err(bad(&f, &v, "no size given", "e.g. --sizes 1MiB,64MiB"));
                }
            }
            "iters" => {
                let v = value()?;
                self.iters = number(&f, &v, "20")?;
                if self.iters == 0 {
                    return Err(bad(&f, &v, "nothing would be timed", "use --iters 1 or more"));
                }
            }
            "warmup" => self.warmup = number(&f, &value()?, "3")?,
            "timeout" => {
                let v = value()?;
                let s = v.parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0);
                let s = s.ok_or_else(|| bad(&f, &v, "not a number of seconds", "e.g. --timeout 60"))?;
                self.timeout = Duration::from_secs_f64(s);
            }
            "transport" => {
                let v = value()?;
                self.transport = v.parse().map_err(|_| bad(&f, &v, "unknown transport", "use shm, mpi or hier"))?;
            }
            "nodes" => self.nodes = number(&f, &value()?, "2")?,
            "json" => self.json = true,
            "agreement" => self.agreement = true,
            "buckets" => self.buckets = numbers(&f, &value()?, "7,100,1750")?,
            "out" => self.out = Some(PathBuf::from(value()?)),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The flags as arguments that [`BenchFlags::parse_long`] reads back to `self`.
    pub fn to_args(&self) -> Vec<OsString> {
        let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let mut args: Vec<OsString> = Vec::new();
        for (flag, value) in [
            ("--sizes", list(&self.sizes)),
            ("--iters", self.iters.to_string()),
            ("--warmup", self.warmup.to_string()),
            ("--timeout", self.timeout.as_secs_f64().to_string()),
            ("--transport", self.transport.to_string()),
            ("--nodes", self.nodes.to_string()),
            ("--buckets", list(&self.buckets)),
        ] {
            args.extend([flag.into(), value.into()]);
        }
        for (flag, on) in [("--json", self.json), ("--agreement", self.agreement)] {
            if on {
                args.push(flag.into());
            }
        }
        if let Some(out) = &self.out {
            args.extend(["--out".into(), out.into()]);
        }
        args
    }
}

/// Run one benchmark process with the arguments after `--bench-allreduce`.
pub fn main(args: Vec<OsString>) -> Result<(), WorkerError> {
    crate::check_simd()?;
    let flags = BenchFlags::parse(args)?;
    let info = RankInfo::discover()?;
    if info.nodes > 1 {
        return Err(WorkerError::Usage(format!(
            "the benchmark runs on one node; this job has {} (GRADBUS_FAKE_NODES?)",
            info.nodes
        )));
    }
    let text = if flags.agreement {
        let values = crate::update::UpdateValues::names();
        let rows = gradbus_collectives::bench_agreement::rank_main(
            info.rank,
            info.world,
            &flags.buckets,
            &values,
            flags.iters,
        )?;
        rows.map(|rows| match flags.json {
            true => rows.iter().map(|r| serde_json::to_string(r).expect("json") + "\n").collect(),
            false => gradbus_collectives::bench_agreement::format_table(&rows),
        })
    } else {
        let mut b = BenchArgs::new(info.rank, info.world, info.job_id.clone(), flags.sizes.clone());
        (b.iters, b.warmup, b.timeout, b.transport, b.nodes) =
            (flags.iters, flags.warmup, flags.timeout, flags.transport, flags.nodes);
        let rows = bench::rank_main(b)?;
        rows.map(|rows| if flags.json { bench::json_lines(&rows) } else { bench::format_table(&rows) })
    };
    let Some(text) = text else { return Ok(()) };
    match &flags.out {
        None => print!("{text}"),
        Some(out) => {
            let tmp = out.with_extension("tmp");
            let io = |e| WorkerError::io(&out.display().to_string(), e);
            std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, out)).map_err(io)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<BenchFlags, WorkerError> {
        BenchFlags::parse(args.iter().map(OsString::from).collect())
    }

    #[test]
    fn flags_parse_and_travel_to_the_ranks_unchanged() {
        assert_eq!(parse(&[]).unwrap(), BenchFlags::default());
        let f = parse(&[
            "--sizes",
            "4KiB,1MiB",
            "--iters",
            "5",
            "--warmup",
            "0",
            "--timeout",
            "2.5",
            "--transport",
            "hier",
            "--nodes",
            "3",
            "--json",
            "--agreement",
            "--buckets",
            "1,2",
            "--out",
            "/r/o",
        ])
        .unwrap();
        assert_eq!(
            (f.sizes.as_slice(), f.iters, f.warmup, f.timeout),
            (&[4096, 1 << 20][..], 5, 0, Duration::from_millis(2500))
        );
        assert_eq!((f.transport, f.nodes, f.json, f.agreement), (BenchTransport::Hier, 3, true, true));
        assert_eq!((f.buckets.as_slice(), f.out.as_deref()), (&[1, 2][..], Some(std::path::Path::new("/r/o"))));
        let args: Vec<String> = f.to_args().iter().map(|a| a.to_string_lossy().into_owned()).collect();
        let back = parse(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(back, f);
        assert_eq!(
            parse(&BenchFlags::default().to_args().iter().map(|a| a.to_str().unwrap()).collect::<Vec<_>>()).unwrap(),
            BenchFlags::default()
        );
    }

    #[test]
    fn bad_flags_name_the_flag_and_give_a_hint() {
        for (args, says) in [
            (&["--sizes", "3"][..], "--sizes 3"),
            (&["--sizes", ""], "--sizes : no size given"),
            (&["--iters", "0"], "--iters 0: nothing would be timed"),
            (&["--iters", "x"], "--iters x: not a whole number"),
            (&["--timeout", "-1"], "--timeout -1: not a number of seconds"),
            (&["--transport", "tcp"], "--transport tcp: unknown transport"),
            (&["--buckets", "7,x"], "--buckets x: not a whole number"),
            (&["--sizes"], "missing argument"),
            (&["--frob"], "--frob"),
            (&["extra"], "extra"),
        ] {
            let e = parse(args).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(says) && text.contains("hint:"), "{args:?}: {text}");
            assert_eq!(e.code(), crate::exit::Code::Usage);
        }
    }
}
