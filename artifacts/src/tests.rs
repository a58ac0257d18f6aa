//! Every artifact kind against every damage: a flipped byte at every position, a truncation at
//! every length, a missing key, an unknown format version, a missing `DONE`.

use super::*;
use gradbus_collectives::forecast::{self, Forecast};
use gradbus_collectives::sdc::{OutlierDetector, OutlierRule};
use gradbus_collectives::spikes::SpikeDetector;
use gradbus_collectives::{Action, Cause, Classification, HealthTable, LocalScalars, RankHealth, Report, SampleId};
use gradbus_collectives::{Summary, ValueNames};
use gradbus_kernels::Health;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

fn report() -> Report {
    Report {
        step: 3,
        minibatch: 1,
        attempt: 1,
        verdict: Action::Abort,
        cause: Cause::LocalGradients,
        ranks: vec![1],
        bucket: 0,
        param: "head.weight".into(),
        element: 5,
        nan: 1,
        inf: 0,
        per_rank: vec![RankHealth {
            rank: 1,
            nan: 1,
            inf: 0,
            first_bucket: 0,
            samples: vec![SampleId::Index(17), SampleId::Name("p-3".into())],
        }],
        loss_finite: true,
        classification: Some(Classification::Deterministic),
    }
}

fn line() -> MetricsLine {
    MetricsLine {
        step: 2,
        minibatch: 1,
        attempt: 0,
        loss: f64::NAN,
        reward: 0.25,
        kl: 1e-3,
        grad_norm: f64::INFINITY,
        bucket_norms: vec![0.5, f64::NAN],
        nonfinite_ranks: vec![1],
        max_logratio_response: 3.5,
        max_logratio_masked: -1.0,
        headroom: 85.2,
        spike: None,
        sdc: None,
        skip_cause: Some("non-finite gradients".into()),
        min_response_logp: -7.0,
        lr: 1e-3,
        verdict: Action::Skip,
        skipped: 1,
        checksum: 0x0123_4567_89ab_cdef,
        time_update_ms: 12.5,
    }
}

fn checkpoint_meta() -> CheckpointMeta {
    CheckpointMeta {
        step: 4,
        adam_t: 16,
        config_hash: 7,
        layout_hash: 9,
        spikes: [SpikeDetector::new(8, 6.0), SpikeDetector::new(8, 6.0)],
        forecast: forecast_after(&[10.0, 20.5]),
        warnings: 2,
        history: SavedHistory { consecutive_skips: 1, skipped: 3, recent: [true, false].into(), suspects: vec![2] },
        run: Some(RunRecord { gradbus: crate::version::build(), world: 2, config: "seed = 1\n".into() }),
        sdc: None,
    }
}

fn forecast_after(values: &[f64]) -> Forecast {
    let mut f = Forecast::new(forecast::DEFAULT_WINDOW);
    for &x in values {
        f.observe(x, 88.7);
    }
    f
}

fn dump_meta() -> DumpMeta {
    DumpMeta {
        config: "seed = 1\n".into(),
        rank: 1,
        world: 2,
        step: 3,
        minibatch: 1,
        attempt: 0,
        b: 2,
        t: 3,
        loss: 0.5,
        local_health: vec![HealthRecord { nan: 1, inf: 0, sumsq_bits: 2.5f64.to_bits(), first_bad: Some(5) }],
        health_chunks: 1,
        report: report(),
    }
}

const A: [f32; 5] = [1.0, f32::NAN, -0.0, 1e-41, 3.0];
const B: [f32; 3] = [0.5, -2.0, 7.0];

/// Every single-byte change (XOR 1) of `good` is refused by `check`.
fn every_flip_is_refused(good: &[u8], check: impl Fn(&[u8]) -> Result<(), ArtifactError>, what: &str) {
    check(good).unwrap_or_else(|e| panic!("{what}: the intact artifact is refused: {e}"));
    for i in 0..good.len() {
        let mut bad = good.to_vec();
        bad[i] ^= 1;
        assert!(check(&bad).is_err(), "{what}: a flipped byte at {i} of {} was accepted", good.len());
    }
}

/// Every proper prefix of `good` is refused.
fn every_truncation_is_refused(good: &[u8], check: impl Fn(&[u8]) -> Result<(), ArtifactError>, what: &str) {
    for n in 0..good.len() {
        assert!(check(&good[..n]).is_err(), "{what}: truncated to {n} of {} bytes was accepted", good.len());
    }
}

fn unseal_bytes<T: DeserializeOwned>(b: &[u8], format: u32) -> Result<T, ArtifactError> {
    let text = std::str::from_utf8(b).map_err(|e| ArtifactError::Schema { file: "t".into(), what: e.to_string() })?;
    unseal(text, format, "t")
}

#[test]
fn sealed_json_round_trips_with_non_finite_numbers_as_null() {
    let l = line();
    let text = l.to_line();
    assert!(text.starts_with("{\"format\":1,\"step\":2,") && text.contains("\"loss\":null"), "{text}");
    assert!(!text.contains("NaN") && !text.contains("inf"), "{text}");
    let back: MetricsLine = unseal(&text, METRICS_FORMAT, "m").unwrap();
    assert!(back.loss.is_nan() && back.grad_norm.is_nan() && back.bucket_norms[1].is_nan());
    assert_eq!((back.reward, back.checksum, back.verdict), (l.reward, l.checksum, l.verdict));
    let r = report();
    let text = report_text(&r);
    assert!(text.starts_with("{\n  \"format\": 3,\n  \"gradbus\": {\n    \"version\": "), "{text}");
    assert_eq!(parse_report(&text, "r").unwrap(), r);
}

#[test]
fn metrics_line_refuses_flips_truncation_missing_key_and_unknown_version() {
    let good = line().to_line().into_bytes();
    let check = |b: &[u8]| unseal_bytes::<MetricsLine>(b, METRICS_FORMAT).map(|_| ());
    every_flip_is_refused(&good, check, "metrics line");
    every_truncation_is_refused(&good, check, "metrics line");

    let mut v = serde_json::to_value(line()).unwrap();
    v.as_object_mut().unwrap().remove("spike");
    let e = unseal::<MetricsLine>(&seal(METRICS_FORMAT, &v, false), METRICS_FORMAT, "metrics.jsonl:4").unwrap_err();
    assert!(e.to_string().contains("metrics.jsonl:4") && e.to_string().contains("missing field `spike`"), "{e}");

    let e = unseal::<MetricsLine>(&seal(99, &line(), false), METRICS_FORMAT, "m").unwrap_err();
    assert!(matches!(e, ArtifactError::Version { found: 99, expected: 1, .. }), "{e}");

    let mut v = serde_json::to_value(line()).unwrap();
    v["loss"] = serde_json::json!("NaN");
    let e = unseal::<MetricsLine>(&seal(METRICS_FORMAT, &v, false), METRICS_FORMAT, "m").unwrap_err();
    assert!(e.to_string().contains("key `loss`: invalid type: string \"NaN\""), "a NaN string is not a number: {e}");
    let mut v = serde_json::to_value(line()).unwrap();
    v["step"] = serde_json::json!(-1);
    let e = unseal::<MetricsLine>(&seal(METRICS_FORMAT, &v, false), METRICS_FORMAT, "metrics.jsonl:9").unwrap_err();
    assert!(e.to_string().starts_with("metrics.jsonl:9: key `step`: invalid value"), "{e}");
}

#[test]
fn a_flipped_digit_is_a_checksum_mismatch_with_expected_and_found() {
    let text = line().to_line().replace("\"reward\":0.25", "\"reward\":0.35");
    let e = unseal::<MetricsLine>(&text, METRICS_FORMAT, "metrics.jsonl:1").unwrap_err();
    let ArtifactError::Checksum { expected, found, .. } = e else { panic!("{e}") };
    assert_ne!(expected, found);
    assert!(e.to_string().contains(&format!("expected {expected:08x}, found {found:08x}")), "{e}");
}

#[test]
fn report_refuses_flips_truncation_missing_key_and_unknown_version() {
    let good = report_text(&report()).into_bytes();
    let check = |b: &[u8]| {
        let t = std::str::from_utf8(b).map_err(|e| ArtifactError::Schema { file: "t".into(), what: e.to_string() })?;
        parse_report(t, "t").map(|_| ())
    };
    // The final newline is not content: every other byte is.
    every_flip_is_refused(&good[..good.len() - 1], check, "report.json");
    every_truncation_is_refused(&good[..good.len() - 1], check, "report.json");
    let mut v = serde_json::to_value(report()).unwrap();
    v.as_object_mut().unwrap().remove("classification");
    v["per_rank"][0].as_object_mut().unwrap().remove("samples");
    let e = parse_report(&seal(1, &v, true), "report.json").unwrap_err();
    assert!(e.to_string().contains("missing field `classification`"), "{e}");
    // Format 3 must name its build.
    let e = parse_report(&seal(REPORT_FORMAT, &report(), true), "report.json").unwrap_err();
    assert!(e.to_string().contains("report.json: missing key `gradbus`"), "{e}");
    let e = parse_report(&seal(4, &report(), true), "report.json").unwrap_err();
    assert!(matches!(e, ArtifactError::Version { found: 4, expected: 3, .. }), "{e}");
}

#[test]
fn reports_of_format_1_and_2_are_still_read() {
    let mut old = report();
    old.per_rank[0].samples.clear();
    let mut v = serde_json::to_value(&old).unwrap();
    v["per_rank"][0].as_object_mut().unwrap().remove("samples");
    // As gradbus wrote it before reports named their build (1) and each bad rank's samples (2).
    assert_eq!(parse_report(&seal(1, &v, true), "report.json").unwrap(), old);
    v["gradbus"] = serde_json::to_value(crate::version::build()).unwrap();
    assert_eq!(parse_report(&seal(2, &v, true), "report.json").unwrap(), old);
    // A format-2 report that has samples is not one gradbus wrote.
    v["per_rank"][0]["samples"] = serde_json::json!([]);
    assert!(parse_report(&seal(2, &v, true), "report.json").is_err());
    // Format 3 round trips, samples included.
    assert_eq!(parse_report(&report_text(&report()), "report.json").unwrap(), report());
}

#[test]
fn container_round_trip_is_bitwise() {
    let bytes = encode(&checkpoint_meta(), &[("a", &A), ("empty", &[]), ("b", &B)]);
    let l: Loaded<CheckpointMeta> = decode(&bytes, "x").unwrap();
    assert_eq!(l.meta, checkpoint_meta());
    assert!(l.get("a").unwrap().iter().zip(&A).all(|(x, y)| x.to_bits() == y.to_bits()));
    assert_eq!(l.get("empty").unwrap().len(), 0);
    assert!(l.get("nope").unwrap_err().to_string().contains("missing tensor `nope`"));
}

#[test]
fn checkpoint_state_and_dump_refuse_every_flip_and_truncation() {
    let state = encode(&checkpoint_meta(), &[("params", &A), ("m", &B)]);
    let check = |b: &[u8]| decode::<CheckpointMeta>(b, "state.bin").map(|_| ());
    every_flip_is_refused(&state, check, "checkpoint state");
    every_truncation_is_refused(&state, check, "checkpoint state");
    let dump = encode(&dump_meta(), &[("params", &A), ("inputs", &B)]);
    let check = |b: &[u8]| decode::<DumpMeta>(b, "rank-1.bin").map(|_| ());
    every_flip_is_refused(&dump, check, "dump");
    every_truncation_is_refused(&dump, check, "dump");
    // A dump is not a checkpoint.
    let e = decode::<CheckpointMeta>(&dump, "rank-1.bin").unwrap_err();
    assert!(e.to_string().contains("a dump, not a checkpoint"), "{e}");
}

#[test]
fn a_flipped_tensor_byte_names_the_tensor_with_expected_and_found() {
    let mut state = encode(&checkpoint_meta(), &[("params", &A), ("m", &B)]);
    let n = state.len();
    state[n - 2] ^= 0x40;
    let e = decode::<CheckpointMeta>(&state, "state.bin").unwrap_err();
    assert!(matches!(&e, ArtifactError::Checksum { section, .. } if section == "tensor `m`"), "{e}");
}

#[derive(Serialize, Deserialize)]
struct NoStep {
    adam_t: u64,
}
impl Kind for NoStep {
    const KIND: &'static str = "checkpoint";
    const FORMAT: u32 = CHECKPOINT_FORMAT;
}
#[derive(Serialize, Deserialize)]
struct NoB {
    rank: usize,
}
impl Kind for NoB {
    const KIND: &'static str = "dump";
    const FORMAT: u32 = DUMP_FORMAT;
}
#[derive(Serialize, Deserialize)]
struct Future(CheckpointMeta);
impl Kind for Future {
    const KIND: &'static str = "checkpoint";
    const FORMAT: u32 = 7;
}

#[test]
fn checkpoint_metadata_and_dump_refuse_a_missing_key_and_an_unknown_version() {
    let e = decode::<CheckpointMeta>(&encode(&NoStep { adam_t: 3 }, &[]), "state.bin").unwrap_err();
    assert!(e.to_string().contains("state.bin: header: key `meta`: missing field `step`"), "{e}");
    let e = decode::<DumpMeta>(&encode(&NoB { rank: 1 }, &[]), "rank-1.bin").unwrap_err();
    assert!(e.to_string().contains("rank-1.bin: header: key `meta`: missing field"), "{e}");
    let e = decode::<CheckpointMeta>(&encode(&Future(checkpoint_meta()), &[]), "state.bin").unwrap_err();
    assert!(matches!(e, ArtifactError::Version { what: "format", found: 7, expected: 3, .. }), "{e}");
    let mut old = encode(&checkpoint_meta(), &[]);
    old[4..8].copy_from_slice(&1u32.to_le_bytes());
    let e = decode::<CheckpointMeta>(&old, "state.bin").unwrap_err();
    assert!(e.to_string().contains("unknown container version 1, this build reads 2"), "{e}");
}

/// Metadata as JSON, encoded under a chosen format version.
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
struct Raw<const F: u32>(serde_json::Value);
impl<const F: u32> Kind for Raw<F> {
    const KIND: &'static str = "checkpoint";
    const FORMAT: u32 = F;
}

#[test]
fn a_checkpoint_of_format_1_is_read_without_its_run_and_format_2_must_have_one() {
    let mut v1 = serde_json::to_value(checkpoint_meta()).unwrap();
    v1.as_object_mut().unwrap().remove("run");
    v1.as_object_mut().unwrap().remove("forecast");
    let l = decode::<CheckpointMeta>(&encode(&Raw::<1>(v1.clone()), &[("params", &A)]), "state.bin").unwrap();
    assert_eq!(l.meta, CheckpointMeta { run: None, forecast: forecast_after(&[]), ..checkpoint_meta() });
    let e = decode::<CheckpointMeta>(&encode(&Raw::<2>(v1.clone()), &[]), "state.bin").unwrap_err();
    assert!(e.to_string().contains("missing field `run`"), "{e}");
    // A format-1 header that somehow has `run` is not one gradbus wrote: refused, not overwritten.
    v1["run"] = serde_json::Value::Null;
    assert!(decode::<CheckpointMeta>(&encode(&Raw::<1>(v1), &[]), "state.bin").is_err());
}

#[test]
fn a_checkpoint_of_format_2_is_read_with_an_empty_forecast_and_format_3_must_have_one() {
    let mut v2 = serde_json::to_value(checkpoint_meta()).unwrap();
    v2.as_object_mut().unwrap().remove("forecast");
    let l = decode::<CheckpointMeta>(&encode(&Raw::<2>(v2.clone()), &[("params", &A)]), "state.bin").unwrap();
    assert_eq!(l.meta, CheckpointMeta { forecast: forecast_after(&[]), ..checkpoint_meta() });
    let e = decode::<CheckpointMeta>(&encode(&Raw::<3>(v2.clone()), &[]), "state.bin").unwrap_err();
    assert!(e.to_string().contains("missing field `forecast`"), "{e}");
    v2["forecast"] = serde_json::to_value(forecast_after(&[1.0])).unwrap();
    assert!(decode::<CheckpointMeta>(&encode(&Raw::<2>(v2), &[]), "state.bin").is_err());
}

#[test]
fn warning_lines_round_trip_with_a_null_forecast_and_refuse_damage() {
    let limit = 88.72;
    let mut f = Forecast::new(forecast::DEFAULT_WINDOW);
    let lines: Vec<WarningLine> = [70.0, 75.0, f64::INFINITY]
        .iter()
        .enumerate()
        .map(|(u, &x)| WarningLine::new(u as u64, "k3_exp", &f.observe(x, limit), 1, forecast::Alert::Warn))
        .collect();
    assert_eq!(lines[0].forecast_updates, None);
    let text: String = lines.iter().map(|l| l.to_line() + "\n").collect();
    assert!(text.lines().next().unwrap().starts_with(r#"{"format":1,"update":0,"quantity":"k3_exp","value":70.0,"limit":88.72,"rank":1,"forecast_updates":null,"action":"warn","crc32c":"#), "{text}");
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("warnings.jsonl");
    std::fs::write(&path, &text).unwrap();
    let read = read_warnings(&path).unwrap();
    assert!(read[2].value.is_nan(), "a non-finite value is written as null, read as NaN");
    assert_eq!(read[..2], lines[..2]);
    std::fs::write(&path, text.replacen("\"rank\":1", "\"rank\":2", 1)).unwrap();
    let e = read_warnings(&path).unwrap_err();
    assert!(e.to_string().contains("warnings.jsonl:1: checksum mismatch"), "{e}");
}

#[test]
fn open_lines_keeps_the_verified_lines_asked_for_and_drops_a_torn_last_one() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("warnings.jsonl");
    let o = forecast::Outlook { value: 80.0, limit: 88.72, headroom: 8.72, updates: Some(1.5) };
    let line = |u| WarningLine::new(u, "loss.exp", &o, 0, forecast::Alert::Stop).to_line();
    std::fs::write(&path, format!("{}\n{}\n{}", line(3), line(9), &line(12)[..20])).unwrap();
    let keep = |w: &WarningLine| w.update < 5;
    let (_, torn) = open_lines(&path, WARNINGS_FORMAT, Some(&keep as _)).unwrap();
    assert!(torn.is_some(), "the torn last line is reported");
    assert_eq!(read_warnings(&path).unwrap().iter().map(|w| w.update).collect::<Vec<_>>(), [3]);
    // A damaged line that is not the last stops the resume, and nothing is rewritten.
    let bad = format!("{}\n{}\n", line(3).replace("loss.exp", "loss.exq"), line(4));
    std::fs::write(&path, &bad).unwrap();
    assert!(open_lines(&path, WARNINGS_FORMAT, Some(&keep as _)).is_err());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), bad);
    // A fresh run starts an empty file.
    open_lines::<WarningLine>(&path, WARNINGS_FORMAT, None).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
}

/// Dump metadata as JSON, encoded under a chosen format version.
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
struct RawDump<const F: u32>(serde_json::Value);
impl<const F: u32> Kind for RawDump<F> {
    const KIND: &'static str = "dump";
    const FORMAT: u32 = F;
}

#[test]
fn a_dump_of_format_1_is_read_with_empty_samples() {
    let mut meta = dump_meta();
    meta.report.per_rank[0].samples.clear();
    let mut v1 = serde_json::to_value(&meta).unwrap();
    v1["report"]["per_rank"][0].as_object_mut().unwrap().remove("samples");
    let l = decode::<DumpMeta>(&encode(&RawDump::<1>(v1.clone()), &[]), "rank-1.bin").unwrap();
    assert_eq!(l.meta.report, meta.report);
    let e = decode::<DumpMeta>(&encode(&RawDump::<2>(v1), &[]), "rank-1.bin").unwrap_err();
    assert!(e.to_string().contains("missing field `samples`"), "{e}");
}

fn save(dir: &Path, step: u64) {
    let mut meta = checkpoint_meta();
    meta.step = step;
    save_checkpoint(&dir.join(format!("step-{step:06}")), &meta, &[("params", &A)], 1, || {}).unwrap();
}

#[test]
fn resume_takes_the_newest_intact_checkpoint_and_names_each_refused_one() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    for step in [2, 4, 6, 8] {
        save(root, step);
    }
    assert_eq!(newest_intact_checkpoint(root).unwrap().1.meta.step, 8);
    // step-8: no DONE (an interrupted write); step-6: a flipped byte in state.bin; step-4: DONE damaged.
    std::fs::remove_file(root.join("step-000008/DONE")).unwrap();
    let p = root.join("step-000006/state.bin");
    let mut b = std::fs::read(&p).unwrap();
    b[40] ^= 1;
    std::fs::write(&p, &b).unwrap();
    let p = root.join("step-000004/DONE");
    let t = std::fs::read_to_string(&p).unwrap().replace("\"state_bytes\":", "\"state_bytes\": ");
    std::fs::write(&p, t).unwrap();

    let (dir, l, refused) = newest_intact_checkpoint(root).unwrap();
    assert_eq!((dir.file_name().unwrap().to_str().unwrap(), l.meta.step), ("step-000002", 2));
    let why: Vec<String> = refused.iter().map(|e| e.to_string()).collect();
    assert_eq!(why.len(), 3, "{why:?}");
    assert!(why[0].contains("step-000008/DONE") && why[0].contains("no DONE marker"), "{}", why[0]);
    assert!(why[1].contains("step-000006/state.bin: checksum mismatch in whole file"), "{}", why[1]);
    assert!(why[1].contains("expected") && why[1].contains("found"), "{}", why[1]);
    assert!(why[2].contains("step-000004/DONE: checksum mismatch"), "{}", why[2]);

    // A truncated state.bin of the last intact one: nothing left.
    let p = root.join("step-000002/state.bin");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 3]).unwrap();
    let refused = newest_intact_checkpoint(root).unwrap_err();
    assert_eq!(refused.len(), 4);
    assert!(refused[3].to_string().contains("step-000002/state.bin: truncated"), "{}", refused[3]);
}

/// A checkpoint's JSON header carries f64 windows of f32 values widened (the spike detectors'
/// history, the headroom forecast); a resume continues them bit for bit only if every such number
/// reads back as the same bits. serde_json rounds 17-digit numbers twice unless its
/// `float_roundtrip` feature is on (the workspace's Cargo.toml turns it on): ~3% of f32 values in
/// [40, 89) came back one ulp off without it, e.g. 47.654869079589844.
#[test]
fn sealed_json_reads_back_every_widened_f32_bit_for_bit() {
    let mut values: Vec<f64> = vec![47.654869079589844];
    let mut x: u32 = 0x4220_0000; // 40.0f32; step through the f32s of [40, 89)
    while f32::from_bits(x) < 89.0 {
        values.push(f32::from_bits(x) as f64);
        x += 997;
    }
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Window {
        values: Vec<f64>,
    }
    let text = seal(1, &Window { values: values.clone() }, false);
    let back = unseal::<Window>(&text, 1, "t").unwrap().values;
    let off = values.iter().zip(&back).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(off, 0, "{off} of {} widened f32 values read back with other bits", values.len());
}

/// A checkpoint of a run with the outlier rule on, where a bucket's gradient was all zero on every
/// rank (its level, log2 of 0, is -inf), reads back whole: the level is written as "-inf" (serde_json
/// alone wrote null, which `--resume` then refused: "invalid type: null, expected f64"); one
/// written that way reads the null as -inf; a level that is none is refused naming its key.
#[test]
fn a_checkpoint_whose_outlier_history_has_a_zero_bucket_reads_back_and_so_does_an_older_null() {
    let (names, reduced, hashes) = (ValueNames::default(), [Health::default(); 2], [1, 2]);
    let mut d = OutlierDetector::new(OutlierRule::default(), 2);
    for ss in [[1.0, 2.0], [0.0, 4.0], [3.0, 0.5]] {
        let local = ss.map(|sumsq| Health { sumsq, ..Health::default() });
        let s = Summary::of_rank(&names, 0, &local, Some((&reduced, &hashes)), &LocalScalars::default());
        d.observe(&HealthTable::summarized(1, s).unwrap());
    }
    let meta = CheckpointMeta { sdc: Some(SavedSdc { outliers: Some(d.clone()), detections: 1 }), ..checkpoint_meta() };
    let l = decode::<CheckpointMeta>(&encode(&meta, &[("params", &A)]), "state.bin").unwrap();
    assert_eq!(l.meta, meta);
    let mut v = serde_json::to_value(&meta).unwrap();
    let level = &mut v["sdc"]["outliers"]["history"][0][1];
    assert_eq!(*level, serde_json::json!("-inf"), "the zero bucket's level");
    *level = serde_json::Value::Null;
    let old = decode::<CheckpointMeta>(&encode(&Raw::<3>(v.clone()), &[]), "state.bin").unwrap();
    assert_eq!(old.meta, meta, "null, as written before, is the zero bucket's -inf");
    v["sdc"]["outliers"]["history"][0][1] = serde_json::json!("-Infinity");
    let e = decode::<CheckpointMeta>(&encode(&Raw::<3>(v), &[]), "state.bin").unwrap_err().to_string();
    let key = "state.bin: header: key `meta.sdc.outliers.history[0][1]`: invalid value: string \"-Infinity\"";
    assert!(e.starts_with(key) && e.contains("expected a level"), "{e}");
}

#[test]
fn quarantine_lines_name_each_bad_rank_with_samples_and_verify() {
    let mut r = report();
    r.per_rank.push(RankHealth { rank: 2, nan: 1, inf: 0, first_bucket: 0, samples: vec![] });
    let lines = QuarantineLine::of_report(&r);
    assert_eq!(lines.len(), 1, "a rank without samples has no line");
    assert_eq!((lines[0].rank, lines[0].update, lines[0].verdict), (1, r.step, r.verdict));
    let text = lines[0].to_line();
    assert!(text.contains(r#""samples":[17,"p-3"]"#), "{text}");
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("quarantine.jsonl");
    std::fs::write(&path, format!("{text}\n")).unwrap();
    assert_eq!(read_quarantine(&path).unwrap(), lines);
    std::fs::write(&path, text.replace("17", "18")).unwrap();
    assert!(read_quarantine(&path).unwrap_err().to_string().contains("checksum mismatch"));
}
