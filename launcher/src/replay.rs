//! `gradbus replay DUMP [--trace] [--json]`: re-execute a failed update in this one process, from
//! the failure dump the workers wrote, and say whether it reproduced bit for bit; with `--trace`,
//! name the first op whose output was non-finite and the operands that produced it.

use std::ffi::OsString;
use std::path::PathBuf;

use gradbus_worker::exit::Code;
use gradbus_worker::forensics;

use crate::error::Error;

/// Help text.
pub const HELP: &str = "\
gradbus replay DUMP [--trace] [--json]

Re-executes the update a failure dump holds (weights at the start of the update, the rank's
mini-batch, the config) in this process, and compares each bucket's health - NaN and Inf counts,
first bad index, bits of the sum of squares - with what the rank recorded.

    DUMP      RUN_DIR, RUN_DIR/dumps, or one RUN_DIR/dumps/rank-K.bin
              (a directory: the first rank the report names)
    --trace   check every tensor of forward then backward; report the first non-finite one
    --json    print the result as one JSON object
";

/// Run the subcommand.
pub fn execute(args: Vec<OsString>) -> Result<Code, Error> {
    use lexopt::prelude::*;
    let usage = |message: String| Error::Usage { message, hint: "see `gradbus replay --help`".into() };
    let (mut dump, mut trace, mut as_json) = (None::<PathBuf>, false, false);
    let mut p = lexopt::Parser::from_args(args);
    while let Some(arg) = p.next().map_err(|e| usage(e.to_string()))? {
        match arg {
            Long("trace") => trace = true,
            Long("json") => as_json = true,
            Long("help") | Short('h') => {
                print!("{HELP}");
                return Ok(Code::Done);
            }
            Value(v) if dump.is_none() => dump = Some(v.into()),
            other => return Err(usage(other.unexpected().to_string())),
        }
    }
    let dump = dump.ok_or_else(|| usage("missing DUMP".into()))?;
    let r = forensics::replay(&dump, trace).map_err(|e| Error::Usage {
        message: e.to_string(),
        hint: "pass RUN_DIR or a file under RUN_DIR/dumps".into(),
    })?;
    if as_json {
        println!("{}", serde_json::to_string(&r).expect("json"));
        return Ok(Code::Done);
    }
    println!("replayed {} (rank {}, step {}, update {}) in one process", r.dump.display(), r.rank, r.step, r.minibatch);
    println!("loss: {} ({})", r.loss, if r.loss.is_finite() { "finite" } else { "NOT finite" });
    for (b, h) in r.buckets.iter().enumerate() {
        let first = h.first_bad.map_or_else(|| "none".to_string(), |i| i.to_string());
        println!("bucket #{b}: nan {} inf {} first_bad {first}", h.nan, h.inf);
    }
    println!(
        "reproduced bit for bit: {}",
        if r.identical {
            "yes (every bucket's health equals the rank's record)"
        } else {
            "NO (the recorded health differs: a transient or injected fault)"
        }
    );
    if trace {
        match &r.first {
            Some(f) => println!("first non-finite: {}", f.describe()),
            None => println!("first non-finite: none (every tensor of forward and backward is finite)"),
        }
    }
    Ok(Code::Done)
}
