//! PostgreSQL `timestamptz` as it travels in pgoutput.

use std::fmt;

use chrono::{DateTime, Utc};

/// A `timestamptz` exactly as PostgreSQL sends it: microseconds since
/// 2000-01-01 00:00:00 UTC (PostgreSQL's epoch, not Unix's).
///
/// Kept as the raw integer rather than a `chrono::DateTime` because the
/// applier hands commit timestamps back to PostgreSQL
/// (`pg_replication_origin_xact_setup`) and compares them for last-writer-wins:
/// any conversion that could round or fail would corrupt both. PostgreSQL's
/// `infinity` / `-infinity` (`i64::MAX` / `i64::MIN`) are representable here
/// but not as a `DateTime`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PgTimestamp(pub i64);

/// Seconds from the Unix epoch to PostgreSQL's epoch (2000-01-01 UTC).
const PG_EPOCH_UNIX_SECS: i64 = 946_684_800;
const PG_EPOCH_UNIX_MICROS: i64 = PG_EPOCH_UNIX_SECS * 1_000_000;
/// Days from 1970-01-01 to 2000-01-01.
const PG_EPOCH_UNIX_DAYS: i64 = 10_957;
const MICROS_PER_DAY: i64 = 86_400_000_000;

impl PgTimestamp {
    /// PostgreSQL's `infinity` (DT_NOEND).
    pub const INFINITY: PgTimestamp = PgTimestamp(i64::MAX);
    /// PostgreSQL's `-infinity` (DT_NOBEGIN).
    pub const NEG_INFINITY: PgTimestamp = PgTimestamp(i64::MIN);
    /// 2000-01-01 00:00:00 UTC.
    pub const PG_EPOCH: PgTimestamp = PgTimestamp(0);

    /// The instant as a `DateTime`, or `None` for +-infinity and for the few
    /// far-future/past values PostgreSQL accepts but chrono cannot represent.
    pub fn to_datetime(self) -> Option<DateTime<Utc>> {
        if self == Self::INFINITY || self == Self::NEG_INFINITY {
            return None;
        }
        let unix_micros = self.0.checked_add(PG_EPOCH_UNIX_MICROS)?;
        DateTime::from_timestamp_micros(unix_micros)
    }

    /// The instant of `dt`, truncated (towards the past) to whole
    /// microseconds, PostgreSQL's resolution. Never overflows: chrono's range
    /// (about +-262,000 years) fits in i64 microseconds.
    pub fn from_datetime(dt: DateTime<Utc>) -> PgTimestamp {
        // chrono keeps the sub-second part non-negative, so this is a floor.
        PgTimestamp(
            dt.timestamp()
                .saturating_sub(PG_EPOCH_UNIX_SECS)
                .saturating_mul(1_000_000)
                .saturating_add(i64::from(dt.timestamp_subsec_micros())),
        )
    }
}

impl From<DateTime<Utc>> for PgTimestamp {
    fn from(dt: DateTime<Utc>) -> Self {
        PgTimestamp::from_datetime(dt)
    }
}

impl TryFrom<PgTimestamp> for DateTime<Utc> {
    type Error = TimestampOutOfRange;

    fn try_from(ts: PgTimestamp) -> Result<Self, Self::Error> {
        ts.to_datetime().ok_or(TimestampOutOfRange(ts))
    }
}

/// A [`PgTimestamp`] with no `DateTime` equivalent (infinity or beyond chrono's range).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("PostgreSQL timestamp {0} has no chrono::DateTime equivalent")]
pub struct TimestampOutOfRange(pub PgTimestamp);

/// Prints what PostgreSQL itself prints for a `timestamptz` with
/// `DateStyle=ISO` and `TimeZone=UTC` (e.g. `2026-11-29 16:00:00.123456+00`,
/// fraction without trailing zeros, `BC` suffix for years before 1 AD,
/// `infinity`), so the text can be pasted into SQL as a `timestamptz` literal
/// and compared with what `psql` shows.
///
/// Computed with integer calendar arithmetic instead of chrono so every i64
/// prints, including the years 262144..294276 that PostgreSQL accepts but
/// chrono cannot represent.
impl fmt::Display for PgTimestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::INFINITY {
            return f.write_str("infinity");
        }
        if *self == Self::NEG_INFINITY {
            return f.write_str("-infinity");
        }
        // |days| <= 2^63 / 8.64e10 ~ 1.07e8: no overflow anywhere below.
        let days = self.0.div_euclid(MICROS_PER_DAY) + PG_EPOCH_UNIX_DAYS;
        let micros_of_day = self.0.rem_euclid(MICROS_PER_DAY);
        let (year, month, day) = civil_from_unix_days(days);
        let secs_of_day = micros_of_day / 1_000_000;
        let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
        // Astronomical year 0 is 1 BC, -1 is 2 BC, ...
        let (shown_year, bc) = if year <= 0 {
            (1 - year, true)
        } else {
            (year, false)
        };
        write!(
            f,
            "{shown_year:04}-{month:02}-{day:02} {hour:02}:{minute:02}:{second:02}"
        )?;
        let mut fraction = micros_of_day % 1_000_000;
        if fraction != 0 {
            let mut digits = 6;
            while fraction % 10 == 0 {
                fraction /= 10;
                digits -= 1;
            }
            write!(f, ".{fraction:0digits$}")?;
        }
        f.write_str(if bc { "+00 BC" } else { "+00" })
    }
}

/// Proleptic Gregorian (year, month, day) of a day number counted from
/// 1970-01-01, for any `days` whose magnitude is far below i64::MAX / 400.
///
/// Works in 400-year eras (146097 days each) starting on March 1st, so the
/// leap day is the last day of the shifted year and month lengths follow the
/// 153-days-per-5-months pattern.
fn civil_from_unix_days(days: i64) -> (i64, u32, u32) {
    // Day 0 of era 0 is 0000-03-01, which is 719468 days before 1970-01-01.
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097); // 0..=146096
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365; // 0..=399
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100); // 0..=365
    let month_from_march = (5 * day_of_year + 2) / 153; // 0..=11
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1; // 1..=31
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    // Both values are range-limited by the arithmetic above.
    (year, month as u32, day as u32)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    /// (microseconds since 2000-01-01, PostgreSQL 18's `x::text` with
    /// TimeZone=UTC, DateStyle=ISO) pairs captured with psql.
    const FROM_POSTGRES: &[(i64, &str)] = &[
        (849_283_200_123_456, "2026-11-29 16:00:00.123456+00"),
        (849_283_200_120_000, "2026-11-29 16:00:00.12+00"),
        (0, "2000-01-01 00:00:00+00"),
        (-63_082_281_600_000_000, "0001-01-01 00:00:00+00"),
        (-63_082_281_600_500_000, "0001-12-31 23:59:59.5+00 BC"),
        (-211_810_204_800_000_000, "4713-01-01 00:00:00+00 BC"),
        (252_455_616_000_000_000, "10000-01-01 00:00:00+00"),
        (-1, "1999-12-31 23:59:59.999999+00"),
        (-960_867_740_000_000, "1969-07-20 20:17:40+00"),
        (i64::MAX, "infinity"),
        (i64::MIN, "-infinity"),
    ];

    #[test]
    fn prints_like_postgres() {
        for &(micros, text) in FROM_POSTGRES {
            assert_eq!(PgTimestamp(micros).to_string(), text, "{micros}");
        }
        // PostgreSQL's last representable instant (END_TIMESTAMP - 1).
        assert_eq!(
            PgTimestamp(9_223_371_331_199_999_999).to_string(),
            "294276-12-31 23:59:59.999999+00"
        );
    }

    #[test]
    fn chrono_round_trip() {
        for &(micros, _) in FROM_POSTGRES {
            let ts = PgTimestamp(micros);
            match ts.to_datetime() {
                Some(dt) => assert_eq!(PgTimestamp::from(dt), ts),
                None => assert!(micros == i64::MAX || micros == i64::MIN),
            }
        }
        let dt = DateTime::parse_from_rfc3339("2026-11-29T16:00:00.123456789Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(PgTimestamp::from(dt), PgTimestamp(849_283_200_123_456));
        assert_eq!(
            DateTime::<Utc>::try_from(PgTimestamp(849_283_200_123_456)).unwrap(),
            DateTime::parse_from_rfc3339("2026-11-29T16:00:00.123456Z").unwrap()
        );
        assert!(DateTime::<Utc>::try_from(PgTimestamp::INFINITY).is_err());
        // Beyond chrono's range but valid in PostgreSQL.
        assert_eq!(PgTimestamp(9_223_371_331_199_999_999).to_datetime(), None);
    }

    #[test]
    fn display_agrees_with_chrono_everywhere_chrono_works() {
        // A deterministic spread over chrono's whole range, both signs.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let micros = (x as i64) >> (x % 40); // many magnitudes
            let ts = PgTimestamp(micros);
            let Some(dt) = ts.to_datetime() else { continue };
            let year = chrono::Datelike::year(&dt);
            if year <= 0 {
                continue; // chrono prints astronomical years; covered by the table above
            }
            let mut expected = dt.format("%Y-%m-%d %H:%M:%S%.6f").to_string();
            while expected.ends_with('0') {
                expected.pop();
            }
            if expected.ends_with('.') {
                expected.pop();
            }
            if year > 9999 {
                expected = expected.trim_start_matches('+').to_owned();
            }
            assert_eq!(ts.to_string(), format!("{expected}+00"), "{micros}");
        }
    }
}
