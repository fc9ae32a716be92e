//! Log sequence numbers, printed and parsed the way PostgreSQL does ("16/B374D848").

use std::fmt;
use std::str::FromStr;

/// A WAL position. Ordered, so "has X been applied past Y" is a comparison.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// PostgreSQL's InvalidXLogRecPtr; START_REPLICATION at 0/0 means "from the slot's confirmed position".
    pub const INVALID: Lsn = Lsn(0);

    pub fn is_invalid(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl fmt::Debug for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lsn({self})")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {input:?}: expected two hex numbers separated by '/', e.g. 16/B374D848")]
pub struct ParseLsnError {
    pub input: String,
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError {
            input: s.to_owned(),
        };
        let (hi, lo) = s.trim().split_once('/').ok_or_else(err)?;
        if hi.is_empty() || lo.is_empty() || hi.len() > 8 || lo.len() > 8 {
            return Err(err());
        }
        let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Self {
        Lsn(v)
    }
}

impl serde::Serialize for Lsn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Lsn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn prints_like_postgres() {
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn(u64::MAX).to_string(), "FFFFFFFF/FFFFFFFF");
    }

    #[test]
    fn parses_what_it_prints() {
        for v in [0u64, 1, 0x1_0000_0000, 0x16_B374_D848, u64::MAX] {
            assert_eq!(Lsn(v).to_string().parse::<Lsn>(), Ok(Lsn(v)));
        }
        assert_eq!("0/16b374d8".parse::<Lsn>(), Ok(Lsn(0x16B3_74D8)));
    }

    #[test]
    fn rejects_garbage() {
        for s in [
            "",
            "/",
            "1/",
            "/1",
            "1",
            "x/1",
            "1/2/3",
            "123456789/0",
            "-1/0",
        ] {
            assert!(s.parse::<Lsn>().is_err(), "{s:?} parsed");
        }
    }

    #[test]
    fn serde_as_string() {
        let j = serde_json::to_string(&Lsn(0x16_B374_D848)).unwrap();
        assert_eq!(j, "\"16/B374D848\"");
        assert_eq!(
            serde_json::from_str::<Lsn>(&j).unwrap(),
            Lsn(0x16_B374_D848)
        );
    }
}
