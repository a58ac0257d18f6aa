//! The instruction-set level the CPU kernels run at: one choice for the whole crate, made once per
//! process (the best the CPU has, or `GRADBUS_SIMD`), overridable per thread (`with_level`) so that a
//! test or a benchmark can run every path this CPU has and say which one ran.
//!
//! Invariants: the level decides speed, never bits. Every kernel gives the same bits at every level:
//! elementwise IEEE operations (Rust never contracts `a * b + c`), integer arithmetic, and in the
//! GEMM one fused multiply-add chain per output element in a fixed order, whose `mul_add` is the same
//! IEEE fma in an AVX-512, AVX2 or AVX instruction or a libm call. `active()` never returns a level
//! the CPU lacks: `simd_dispatch!` and the kernels' calls of `#[target_feature]` code rely on it for
//! their safety.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::error::Error;

/// An instruction-set level, from the target's baseline up. Each level above the baseline includes
/// FMA: the GEMM's fused multiply-add is what the levels are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// The target's baseline (SSE2 on x86_64): `mul_add` is a libm call, correct and slow.
    Baseline,
    /// AVX and FMA, no AVX2 (e.g. AMD Piledriver): 16 registers of 8 f32, float operations only.
    Avx,
    /// AVX2 and FMA: 16 registers of 8 f32, with 256-bit integer operations.
    Avx2,
    /// AVX-512F, with AVX2 and FMA: 32 registers of 16 f32.
    Avx512,
}

impl Level {
    /// Every level, from the baseline up.
    pub const ALL: [Level; 4] = [Level::Baseline, Level::Avx, Level::Avx2, Level::Avx512];

    /// The environment variable that forces the process's level (`baseline`, `avx`, `avx2`, `avx512`).
    pub const ENV: &'static str = "GRADBUS_SIMD";

    /// The level's name, as `GRADBUS_SIMD` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Level::Baseline => "baseline",
            Level::Avx => "avx",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    /// The CPU features the level needs, as `/proc/cpuinfo` names them.
    pub fn features(self) -> &'static str {
        match self {
            Level::Baseline => "none beyond the target's baseline",
            Level::Avx => "avx fma",
            Level::Avx2 => "avx2 fma",
            Level::Avx512 => "avx512f avx2 fma",
        }
    }

    /// Whether this CPU runs the level.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Level::Baseline => true,
                Level::Avx => has!("avx") && has!("fma"),
                Level::Avx2 => has!("avx2") && has!("fma"),
                Level::Avx512 => has!("avx512f") && has!("avx2") && has!("fma"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Level::Baseline
        }
    }

    /// The level a name (`GRADBUS_SIMD`'s value) stands for, if this CPU runs it.
    pub fn parse(name: &str) -> Result<Level, Error> {
        let names = || Level::ALL.map(Level::name).join(", ");
        let level = Level::ALL.into_iter().find(|l| l.name() == name).ok_or_else(|| Error::Simd {
            what: format!("{}={name:?} is not an instruction-set level", Level::ENV),
            hint: format!("use one of {}, or unset it for the best this CPU has", names()),
        })?;
        if !level.supported() {
            return Err(Error::Simd {
                what: format!("{}={name}: this CPU lacks {}", Level::ENV, level.features()),
                hint: format!("this CPU runs {}", available().map(Level::name).collect::<Vec<_>>().join(", ")),
            });
        }
        Ok(level)
    }

    fn code(self) -> u8 {
        self as u8 + 1
    }

    fn from_code(c: u8) -> Level {
        Level::ALL[c as usize - 1]
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The best level this CPU runs.
pub fn detected() -> Level {
    available().last().unwrap_or(Level::Baseline)
}

/// Every level this CPU runs, from the baseline up.
pub fn available() -> impl Iterator<Item = Level> {
    Level::ALL.into_iter().filter(|l| l.supported())
}

/// `GRADBUS_SIMD`, checked: `None` when unset or empty.
pub fn from_env() -> Result<Option<Level>, Error> {
    match std::env::var(Level::ENV) {
        Err(_) => Ok(None),
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => Level::parse(&v).map(Some),
    }
}

/// The process's level (0: not chosen yet).
static PROCESS: AtomicU8 = AtomicU8::new(0);

thread_local! {
    /// This thread's override (0: none), set by `with_level` only.
    static FORCED: Cell<u8> = const { Cell::new(0) };
}

/// The process's level: `GRADBUS_SIMD`, else the best this CPU runs; chosen at the first call.
///
/// Panics, naming the variable, when `GRADBUS_SIMD` is set to something this CPU cannot run: a
/// kernel has no way to return the error, and running another path than the one asked for would
/// make every number measured with it a lie. Call `from_env` first to report it as an error.
pub fn process_level() -> Level {
    match PROCESS.load(Ordering::Relaxed) {
        0 => {
            let level = from_env().unwrap_or_else(|e| panic!("{e}")).unwrap_or_else(detected);
            PROCESS.store(level.code(), Ordering::Relaxed);
            level
        }
        c => Level::from_code(c),
    }
}

/// The level the kernels take on this thread: `with_level`'s, else the process's. Always one the CPU
/// runs.
#[inline]
pub fn active() -> Level {
    match FORCED.with(Cell::get) {
        0 => process_level(),
        c => Level::from_code(c),
    }
}

/// Run `f` with every kernel on this thread at `level` (the previous override back afterwards, also
/// when `f` panics); an error, and `f` not run, when this CPU lacks the level.
pub fn with_level<T>(level: Level, f: impl FnOnce() -> T) -> Result<T, Error> {
    if !level.supported() {
        return Err(Error::Simd {
            what: format!("the {level} path needs {}, which this CPU lacks", level.features()),
            hint: format!("this CPU runs {}", available().map(Level::name).collect::<Vec<_>>().join(", ")),
        });
    }
    struct Restore(u8);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|c| c.replace(level.code())));
    Ok(f())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_level_forces_this_thread_only_and_restores() {
        let outer = active();
        for level in available() {
            let seen = with_level(level, || {
                let other = std::thread::spawn(active).join().unwrap();
                assert_eq!(other, process_level(), "another thread keeps the process level");
                let inner = with_level(Level::Baseline, active).unwrap();
                (active(), inner)
            })
            .unwrap();
            assert_eq!(seen, (level, Level::Baseline));
            assert_eq!(active(), outer);
        }
        let _ = std::panic::catch_unwind(|| with_level(Level::Baseline, || panic!("inside")));
        assert_eq!(active(), outer, "restored after a panic");
    }

    #[test]
    fn levels_parse_by_name_and_unknown_or_missing_ones_are_clear_errors() {
        for level in available() {
            assert_eq!(Level::parse(level.name()).unwrap(), level);
        }
        let e = Level::parse("sse9").unwrap_err().to_string();
        assert!(e.contains("GRADBUS_SIMD=\"sse9\"") && e.contains("avx512"), "{e}");
        assert_eq!(available().next(), Some(Level::Baseline));
        assert_eq!(detected(), available().last().unwrap());
        if let Some(missing) = Level::ALL.into_iter().find(|l| !l.supported()) {
            let e = Level::parse(missing.name()).unwrap_err().to_string();
            assert!(e.contains("lacks"), "{e}");
            assert!(with_level(missing, || ()).is_err());
        }
    }
}
