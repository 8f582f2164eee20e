//! The simulator's collations: how its string columns order and compare.
//!
//! SQL Server gives every char/varchar/nchar/nvarchar/text column a collation
//! (`sys.columns.collation_name`), and every ORDER BY, `=`, `<` and unique
//! index on the column follows it. The engine never implements a collation:
//! it asks the server (`CdcSource::compare_keys`, range predicates, seeks).
//! So the simulator answers with an order of its own, which the engine does
//! not share, or a test could not tell an engine that compares strings itself
//! from one that asks.
//!
//! The model is a small multi-level collation in the manner of Windows'
//! sorting (and of the Unicode Collation Algorithm), written for the
//! behaviours SQL Server documents for its collation names:
//!
//! 1. **Primary level**, always: characters compare by class, then value.
//!    Spaces, punctuation and symbols come first (by code point), then
//!    digits, then letters by their base letter (case folded, accents
//!    removed), then anything else by code point. So `-x < 10 < 9 < a < B <
//!    c`, `é < f`, unlike code-point order (`B < a`, `f < é`).
//! 2. **Accent level**, for `_AS`: the accented letter (`e < é`).
//! 3. **Case level**, for `_CS`: lower case before upper case (`a < A`).
//!
//! Width is folded at the primary level (a fullwidth `ｚ` is `z`), as every
//! collation without `_WS` has it. Trailing spaces never count (`'a' =
//! 'a  '`): SQL Server pads the shorter string before it compares. `_BIN2`
//! and `_BIN` order by code point (trailing spaces still ignored).
//!
//! Where it differs from SQL Server, on purpose or for want of tables: accents
//! are known for the Latin-1 and Latin Extended-A letters only (other marked
//! letters are letters of their own); `ß` is not `ss`; no character is
//! ignorable; kana are not folded; `SQL_` collations order non-Unicode
//! columns by the same rules, not by their code page's table; `BIN` is
//! `BIN2`. `_WS` and `_KS` names, and names this model cannot read, are
//! refused when a table is created. What the engine must survive is the kind
//! of difference from code-point order, not the server's exact tables.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The collation a string column gets when its table does not name one
/// (SQL Server's default for a US English install).
pub const DEFAULT_COLLATION: &str = "SQL_Latin1_General_CP1_CI_AS";

/// One collation of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collation {
    /// `_BIN` / `_BIN2`: code-point order.
    Binary,
    /// A linguistic collation.
    Linguistic { case_sensitive: bool, accent_sensitive: bool },
}

/// Latin letters with accents and the base letter each sorts with.
const ACCENTED: &[(&str, char)] = &[
    ("ÀÁÂÃÄÅàáâãäåĀāĂăĄą", 'a'),
    ("ÇçĆćĈĉĊċČč", 'c'),
    ("ĎďĐđ", 'd'),
    ("ÈÉÊËèéêëĒēĔĕĖėĘęĚě", 'e'),
    ("ĜĝĞğĠġĢģ", 'g'),
    ("ĤĥĦħ", 'h'),
    ("ÌÍÎÏìíîïĨĩĪīĬĭĮįİ", 'i'),
    ("Ĵĵ", 'j'),
    ("Ķķ", 'k'),
    ("ĹĺĻļĽľĿŀŁł", 'l'),
    ("ÑñŃńŅņŇň", 'n'),
    ("ÒÓÔÕÖØòóôõöøŌōŎŏŐő", 'o'),
    ("ŔŕŖŗŘř", 'r'),
    ("ŚśŜŝŞşŠš", 's'),
    ("ŢţŤťŦŧ", 't'),
    ("ÙÚÛÜùúûüŨũŪūŬŭŮůŰűŲų", 'u'),
    ("Ŵŵ", 'w'),
    ("ÝýÿŶŷŸ", 'y'),
    ("ŹźŻżŽž", 'z'),
];

/// A fullwidth form (U+FF01 to U+FF5E) as its ASCII character.
fn unwiden(c: char) -> char {
    match c as u32 {
        0xFF01..=0xFF5E => char::from_u32(c as u32 - 0xFEE0).unwrap_or(c),
        _ => c,
    }
}

fn lower(c: char) -> char {
    c.to_lowercase().next().unwrap_or(c)
}

/// (base letter, whether it carries an accent) of a letter.
fn base_letter(c: char) -> (char, bool) {
    for (set, base) in ACCENTED {
        if set.contains(c) {
            return (*base, true);
        }
    }
    (lower(c), false)
}

/// The primary weight of a character: class, then value (4 bytes, the
/// first never below 0x02, so a level's end, 0x01, sorts before any weight).
fn primary(c: char) -> [u8; 4] {
    let c = unwiden(c);
    let (class, value) = if c.is_alphabetic() {
        (0x05, base_letter(c).0 as u32)
    } else if c.is_ascii_digit() {
        (0x04, c as u32)
    } else if c.is_whitespace() || c.is_ascii_punctuation() || (!c.is_alphanumeric() && (c as u32) < 0x3000) {
        (0x03, c as u32)
    } else {
        (0x06, c as u32)
    };
    [class, (value >> 16) as u8, (value >> 8) as u8, value as u8]
}

impl Collation {
    /// Appends the memcomparable sort key of `s`: equal keys are equal
    /// strings under the collation, and key order is its order.
    pub fn sort_key(&self, s: &str, out: &mut Vec<u8>) {
        let s = s.trim_end_matches(' ');
        let Collation::Linguistic { case_sensitive, accent_sensitive } = *self else {
            out.extend_from_slice(s.as_bytes());
            return;
        };
        for c in s.chars() {
            out.extend_from_slice(&primary(c));
        }
        if accent_sensitive {
            out.push(0x01);
            for c in s.chars() {
                let c = unwiden(c);
                // The accented letter itself (case folded) tells accents apart; 0x02 0 0 0 is "no accent".
                let w = if c.is_alphabetic() && base_letter(c).1 { lower(c) as u32 } else { 0 };
                out.extend_from_slice(&[0x02, (w >> 16) as u8, (w >> 8) as u8, w as u8]);
            }
        }
        if case_sensitive {
            out.push(0x01);
            for c in s.chars() {
                out.push(if unwiden(c).is_uppercase() { 0x03 } else { 0x02 });
            }
        }
    }

    /// Compares two strings under the collation.
    pub fn compare(&self, a: &str, b: &str) -> Ordering {
        let (mut ka, mut kb) = (Vec::new(), Vec::new());
        self.sort_key(a, &mut ka);
        self.sort_key(b, &mut kb);
        ka.cmp(&kb)
    }
}

/// The collation of a name, read once per name and shared.
pub fn collation(name: &str) -> Result<Arc<Collation>, String> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<Collation>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = name.to_ascii_uppercase();
    if let Some(c) = cache.lock().map_err(|e| e.to_string())?.get(&key) {
        return Ok(c.clone());
    }
    let built = Arc::new(parse(name)?);
    cache.lock().map_err(|e| e.to_string())?.insert(key, built.clone());
    Ok(built)
}

fn parse(name: &str) -> Result<Collation, String> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("'{name}' is not a collation name"));
    }
    let parts: Vec<String> = name.split('_').map(str::to_ascii_uppercase).collect();
    let has = |p: &str| parts.iter().any(|x| x == p);
    if has("BIN2") || has("BIN") {
        return Ok(Collation::Binary);
    }
    if has("WS") || has("KS") {
        return Err(format!("the simulator does not model width- or kana-sensitive collations ('{name}')"));
    }
    let case_sensitive = match (has("CS"), has("CI")) {
        (true, false) => true,
        (false, true) => false,
        _ => return Err(format!("collation '{name}' names neither _CI nor _CS")),
    };
    let accent_sensitive = match (has("AS"), has("AI")) {
        (true, false) => true,
        (false, true) => false,
        _ => return Err(format!("collation '{name}' names neither _AI nor _AS")),
    };
    Ok(Collation::Linguistic { case_sensitive, accent_sensitive })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Ordering::*;

    fn cmp(name: &str, a: &str, b: &str) -> Ordering {
        collation(name).unwrap().compare(a, b)
    }

    #[test]
    fn the_default_is_case_width_and_padding_insensitive_but_accent_sensitive() {
        let c = DEFAULT_COLLATION;
        assert_eq!(cmp(c, "abc", "ABC"), Equal);
        assert_eq!(cmp(c, "z", "\u{ff5a}"), Equal, "fullwidth z");
        assert_eq!(cmp(c, "a", "a   "), Equal);
        assert_eq!(cmp(c, "e", "\u{e9}"), Less);
        assert_eq!(cmp(c, "\u{c9}", "\u{e9}"), Equal, "É and é differ in case only");
        // Linguistic, not code-point order.
        assert_eq!(cmp(c, "a", "B"), Less);
        assert_eq!(cmp(c, "\u{e9}", "f"), Less);
        assert_eq!(cmp(c, "10", "9"), Less);
        assert_eq!(cmp(c, "-x", "0"), Less);
        assert_eq!(cmp(c, "ab", "abc"), Less);
        assert_eq!(cmp(c, "\u{e9}a", "eb"), Less, "the base letters decide before the accents");
    }

    #[test]
    fn case_sensitive_accent_insensitive_and_binary() {
        assert_eq!(cmp("Latin1_General_CS_AS", "abc", "ABC"), Less, "lower case first");
        assert_eq!(cmp("Latin1_General_CS_AS", "ABC", "abd"), Less, "letters before case");
        assert_eq!(cmp("Latin1_General_CS_AS", "z", "\u{ff5a}"), Equal);
        assert_eq!(cmp("Latin1_General_CI_AI", "e", "\u{c9}"), Equal);
        assert_eq!(cmp("Latin1_General_BIN2", "B", "a"), Less);
        assert_eq!(cmp("Latin1_General_BIN2", "a", "a  "), Equal);
        assert_ne!(cmp("Latin1_General_BIN2", "a", "A"), Equal);
    }

    #[test]
    fn unknown_names_are_refused() {
        assert!(collation("Latin1_General_CI_AS_WS").is_err());
        assert!(collation("Latin1_General").is_err());
        assert!(collation("x; DROP").is_err());
    }
}
