//! What this machine and this moment are called, for the launcher's job ids and the run
//! directory's lock: the host name, and UTC calendar time without a time-zone database.

use std::time::{SystemTime, UNIX_EPOCH};

/// This machine's host name, if the OS gives one.
pub fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is a valid writable buffer of the length passed; gethostname writes at most that
    // many bytes and we only read up to the first NUL (or the whole buffer if it was truncated).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8(buf[..end].to_vec()).ok()
}

/// UTC calendar time of `t`: (year, month, day, hour, minute, second).
pub fn utc(t: SystemTime) -> (i64, u32, u32, u64, u64, u64) {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (y, mo, d) = civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    (y, mo, d, s / 3600, s / 60 % 60, s % 60)
}

/// `t` as `2026-11-29T17:55:30Z`.
pub fn utc_stamp(t: SystemTime) -> String {
    let (y, mo, d, h, mi, s) = utc(t);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

/// Gregorian (year, month, day) of a day count since 1970-01-01 (H. Hinnant's algorithm).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn calendar_days_and_stamps() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_786), (2026, 11, 29));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        let t = UNIX_EPOCH + Duration::from_secs(20_786 * 86_400 + 17 * 3600 + 55 * 60 + 30);
        assert_eq!(utc_stamp(t), "2026-11-29T17:55:30Z");
        assert!(hostname().is_some_and(|h| !h.is_empty()));
    }
}
