//! Log sequence numbers.
//!
//! SQL Server stores an LSN as `binary(10)`: four bytes of VLF sequence, four
//! of log block and two of slot, big-endian. Comparing the ten bytes left to
//! right orders LSNs by time, so we keep the bytes and derive `Ord` from them.
//! Arithmetic (`increment`, `decrement`) treats the bytes as one 80-bit
//! unsigned integer, which is what `sys.fn_cdc_increment_lsn` promises: the
//! adjacent value, whether or not a log record exists there.
//!
//! In Delta tables an LSN is written as its fixed-width lowercase hex text
//! (`0x` + 20 digits): it sorts as the bytes do, Delta keeps min/max
//! statistics on it (it does not for binary columns) and a person can paste it
//! into a query.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A SQL Server log sequence number (`binary(10)`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub [u8; 10]);

/// The largest value 80 bits hold.
const MAX_U80: u128 = (1u128 << 80) - 1;

impl Lsn {
    /// The all-zero LSN, which `fn_cdc_get_min_lsn` returns for an unknown instance.
    pub const ZERO: Lsn = Lsn([0; 10]);

    /// Builds an LSN from its (VLF, block, slot) parts.
    pub fn from_parts(vlf: u32, block: u32, slot: u16) -> Lsn {
        let mut b = [0u8; 10];
        b[0..4].copy_from_slice(&vlf.to_be_bytes());
        b[4..8].copy_from_slice(&block.to_be_bytes());
        b[8..10].copy_from_slice(&slot.to_be_bytes());
        Lsn(b)
    }

    /// The LSN as an 80-bit unsigned integer.
    pub fn to_u128(self) -> u128 {
        let mut b = [0u8; 16];
        b[6..16].copy_from_slice(&self.0);
        u128::from_be_bytes(b)
    }

    /// The LSN of an 80-bit integer; values past 80 bits saturate.
    pub fn from_u128(v: u128) -> Lsn {
        let v = v.min(MAX_U80);
        let b = v.to_be_bytes();
        let mut out = [0u8; 10];
        out.copy_from_slice(&b[6..16]);
        Lsn(out)
    }

    /// The next LSN (`sys.fn_cdc_increment_lsn`); saturates at the maximum.
    pub fn increment(self) -> Lsn {
        Lsn::from_u128(self.to_u128().saturating_add(1))
    }

    /// The previous LSN (`sys.fn_cdc_decrement_lsn`); saturates at zero.
    pub fn decrement(self) -> Lsn {
        Lsn::from_u128(self.to_u128().saturating_sub(1))
    }

    /// True for the all-zero value, which SQL Server uses for "no bound".
    pub fn is_zero(self) -> bool {
        self.0 == [0; 10]
    }

    /// The fixed-width hex text written to Delta (`0x` + 20 lowercase digits).
    pub fn to_hex(self) -> String {
        format!("0x{}", hex::encode(self.0))
    }

    /// Parses `0x…` hex (20 digits, case-insensitive) or `VVVVVVVV:BBBBBBBB:SSSS`.
    pub fn parse(text: &str) -> Result<Lsn, LsnParseError> {
        let t = text.trim();
        let digits: String = if let Some(rest) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
            rest.to_string()
        } else if t.split(':').count() == 3 {
            let parts: Vec<&str> = t.split(':').collect();
            if parts[0].len() != 8 || parts[1].len() != 8 || parts[2].len() != 4 {
                return Err(LsnParseError(text.to_string()));
            }
            parts.concat()
        } else {
            return Err(LsnParseError(text.to_string()));
        };
        if digits.len() != 20 {
            return Err(LsnParseError(text.to_string()));
        }
        let bytes = hex::decode(&digits).map_err(|_| LsnParseError(text.to_string()))?;
        let mut out = [0u8; 10];
        out.copy_from_slice(&bytes);
        Ok(Lsn(out))
    }
}

/// Text that is not an LSN.
#[derive(Debug, Clone, thiserror::Error)]
#[error("'{0}' is not an LSN: write 0x followed by 20 hex digits (for example 0x0000002a000001f00003)")]
pub struct LsnParseError(pub String);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lsn({})", self.to_hex())
    }
}

impl FromStr for Lsn {
    type Err = LsnParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Lsn::parse(s)
    }
}

impl Serialize for Lsn {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Lsn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Lsn::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hex_round_trip_and_parts() {
        let l = Lsn::from_parts(0x31, 0xda0, 1);
        assert_eq!(l.to_hex(), "0x0000003100000da00001");
        assert_eq!(Lsn::parse("00000031:00000da0:0001").unwrap(), l);
        assert_eq!(Lsn::parse("0x0000003100000DA00001").unwrap(), l);
        assert!(Lsn::parse("0x12").is_err());
        assert!(Lsn::parse("nonsense").is_err());
    }

    #[test]
    fn increment_carries_across_parts() {
        let l = Lsn::from_parts(1, 0, u16::MAX);
        assert_eq!(l.increment(), Lsn::from_parts(1, 1, 0));
        assert_eq!(l.increment().decrement(), l);
        assert_eq!(Lsn::ZERO.decrement(), Lsn::ZERO);
    }

    #[test]
    fn serde_is_hex_text() {
        let l = Lsn::from_parts(2, 3, 4);
        let j = serde_json::to_string(&l).unwrap();
        assert_eq!(j, "\"0x00000002000000030004\"");
        assert_eq!(serde_json::from_str::<Lsn>(&j).unwrap(), l);
    }

    proptest! {
        #[test]
        fn order_matches_integer_and_hex(a in any::<[u8; 10]>(), b in any::<[u8; 10]>()) {
            let (x, y) = (Lsn(a), Lsn(b));
            prop_assert_eq!(x.cmp(&y), x.to_u128().cmp(&y.to_u128()));
            prop_assert_eq!(x.cmp(&y), x.to_hex().cmp(&y.to_hex()));
            prop_assert_eq!(Lsn::from_u128(x.to_u128()), x);
        }
    }
}
