//! Connection settings for a SQL Server source.
//!
//! Two spellings are accepted:
//!
//! * a URL, `mssql://user@host:port/database?encrypt=true&trust_server_certificate=false&…`
//!   (`sqlserver://` works too), and
//! * an ADO.NET connection string, `server=tcp:host,1433;database=…;user id=…`.
//!
//! The password never appears in either: it comes from [`SourceSecrets`]
//! (the caller reads an environment variable or a file), and text that carries
//! one is refused, so it cannot leak into a workflow file or a log. Nothing in
//! [`MssqlConfig`] is secret, which is why its `Debug` and `Display` are safe.
//!
//! [`SourceSecrets`]: crate::source::SourceSecrets

use std::fmt;
use std::time::Duration;

use tiberius::{AuthMethod, Config, EncryptionLevel};

use crate::source::SourceError;

/// The environment variable the command line reads the password from (documented in docs/sqlserver.md).
pub const PASSWORD_ENV: &str = "MSSQL_CDC_PASSWORD";

/// How the connection is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encrypt {
    /// TLS after the pre-login exchange (TDS 7.x); the default.
    Required,
    /// TLS before anything else (TDS 8 strict mode).
    Strict,
    /// No TLS at all; only with `allow_plaintext=true`.
    Off,
}

/// How the server's certificate is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// Against the system's / the TLS library's root certificates.
    Roots,
    /// Against the CA certificate in this file (PEM or DER).
    CaFile(String),
    /// Not at all (`trust_server_certificate=true`): encrypted, but open to a man in the middle.
    Any,
}

/// Parsed connection settings (no password).
#[derive(Debug, Clone, PartialEq)]
pub struct MssqlConfig {
    pub host: String,
    pub port: u16,
    /// A named instance (`host\INSTANCE`); its TCP port must be given as well.
    pub instance: Option<String>,
    pub database: String,
    pub user: String,
    pub encrypt: Encrypt,
    pub trust: Trust,
    pub connect_timeout: Duration,
    pub command_timeout: Duration,
    pub application_name: String,
    /// The server's zone when the server cannot say (before SQL Server 2022):
    /// a Windows or IANA zone name, or a fixed offset such as `UTC+02:00`.
    /// Checked against the server's current offset when the source opens
    /// (`MssqlSource::server_time_zone`).
    pub time_zone: Option<String>,
    /// How many idle connections the source keeps for reuse.
    pub pool_size: usize,
}

const DEFAULT_PORT: u16 = 1433;
const DEFAULT_CONNECT_TIMEOUT_S: u64 = 15;
const DEFAULT_COMMAND_TIMEOUT_S: u64 = 60;
const DEFAULT_APP_NAME: &str = "mssql-cdc";
const DEFAULT_POOL_SIZE: usize = 4;

fn cfg_err(msg: impl Into<String>) -> SourceError {
    SourceError::Config(msg.into())
}

fn parse_bool(key: &str, v: &str) -> Result<bool, SourceError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "1" | "on" => Ok(true),
        "false" | "no" | "0" | "off" => Ok(false),
        _ => Err(cfg_err(format!("SQL Server connection: '{key}={v}' is not a boolean; write true or false"))),
    }
}

fn parse_secs(key: &str, v: &str) -> Result<Duration, SourceError> {
    match v.trim().parse::<u64>() {
        Ok(s) if s > 0 && s <= 86_400 => Ok(Duration::from_secs(s)),
        _ => Err(cfg_err(format!("SQL Server connection: '{key}={v}' must be a whole number of seconds between 1 and 86400"))),
    }
}

/// Settings gathered from either spelling before they are checked together.
#[derive(Default)]
struct Raw {
    host: Option<String>,
    port: Option<u16>,
    instance: Option<String>,
    database: Option<String>,
    user: Option<String>,
    encrypt: Option<String>,
    trust_server_certificate: Option<bool>,
    ca_file: Option<String>,
    allow_plaintext: bool,
    connect_timeout: Option<Duration>,
    command_timeout: Option<Duration>,
    application_name: Option<String>,
    time_zone: Option<String>,
    pool_size: Option<usize>,
}

impl Raw {
    /// Applies one option that both spellings share (keys already lower-cased,
    /// spaces and underscores removed). Returns false for an unknown key.
    fn option(&mut self, key: &str, original_key: &str, v: &str) -> Result<bool, SourceError> {
        match key {
            "encrypt" => self.encrypt = Some(v.trim().to_ascii_lowercase()),
            "trustservercertificate" => self.trust_server_certificate = Some(parse_bool(original_key, v)?),
            "cafile" | "trustservercertificateca" => self.ca_file = Some(v.trim().to_string()),
            "allowplaintext" => self.allow_plaintext = parse_bool(original_key, v)?,
            "connecttimeouts" | "connecttimeout" | "connectiontimeout" | "logintimeout" => {
                self.connect_timeout = Some(parse_secs(original_key, v)?)
            }
            "commandtimeouts" | "commandtimeout" => self.command_timeout = Some(parse_secs(original_key, v)?),
            "applicationname" | "app" => self.application_name = Some(v.to_string()),
            "timezone" => self.time_zone = Some(v.trim().to_string()),
            "poolsize" => {
                self.pool_size = Some(v.trim().parse::<usize>().ok().filter(|n| *n <= 64).ok_or_else(|| {
                    cfg_err(format!("SQL Server connection: '{original_key}={v}' must be a number of connections from 0 to 64"))
                })?)
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn finish(self) -> Result<MssqlConfig, SourceError> {
        let host = self.host.filter(|h| !h.is_empty()).ok_or_else(|| cfg_err("SQL Server connection: no host; write mssql://user@host:1433/database"))?;
        let database = self
            .database
            .filter(|d| !d.is_empty())
            .ok_or_else(|| cfg_err("SQL Server connection: no database; add it as the URL path (mssql://user@host/database) or as database=… in a connection string"))?;
        let user = self
            .user
            .filter(|u| !u.is_empty())
            .ok_or_else(|| cfg_err("SQL Server connection: no login name; write mssql://user@host/database (the password comes from the environment, never the URL)"))?;
        let encrypt = match self.encrypt.as_deref() {
            None | Some("true") | Some("yes") | Some("mandatory") | Some("required") => Encrypt::Required,
            Some("strict") => Encrypt::Strict,
            Some("false") | Some("no") | Some("optional") => {
                if !self.allow_plaintext {
                    return Err(cfg_err(
                        "SQL Server connection: encrypt=false would send the password and the data in clear text; \
                         keep TLS on (the default), or add allow_plaintext=true if this is a throw-away local server",
                    ));
                }
                Encrypt::Off
            }
            Some(other) => return Err(cfg_err(format!("SQL Server connection: encrypt={other} is not understood; write true, strict or false"))),
        };
        let trust = match (self.trust_server_certificate.unwrap_or(false), self.ca_file) {
            (true, Some(_)) => {
                return Err(cfg_err(
                    "SQL Server connection: trust_server_certificate=true and ca_file contradict each other; keep ca_file to check the certificate",
                ))
            }
            (true, None) => Trust::Any,
            (false, Some(f)) if !f.is_empty() => Trust::CaFile(f),
            _ => Trust::Roots,
        };
        if let Some(tz) = &self.time_zone {
            if super::client::resolve_zone(tz).is_none() {
                return Err(cfg_err(format!(
                    "SQL Server connection: time_zone={tz} is neither a Windows or IANA zone name nor a fixed offset like UTC+02:00"
                )));
            }
        }
        if self.instance.is_some() && self.port.is_none() {
            return Err(cfg_err(
                "SQL Server connection: a named instance needs its TCP port (this program does not ask the SQL Browser); \
                 write host:port, or server=host,port",
            ));
        }
        Ok(MssqlConfig {
            host,
            port: self.port.unwrap_or(DEFAULT_PORT),
            instance: self.instance,
            database,
            user,
            encrypt,
            trust,
            connect_timeout: self.connect_timeout.unwrap_or(Duration::from_secs(DEFAULT_CONNECT_TIMEOUT_S)),
            command_timeout: self.command_timeout.unwrap_or(Duration::from_secs(DEFAULT_COMMAND_TIMEOUT_S)),
            application_name: self.application_name.unwrap_or_else(|| DEFAULT_APP_NAME.to_string()),
            time_zone: self.time_zone,
            pool_size: self.pool_size.unwrap_or(DEFAULT_POOL_SIZE),
        })
    }
}

fn norm_key(k: &str) -> String {
    k.trim().to_ascii_lowercase().chars().filter(|c| *c != ' ' && *c != '_').collect()
}

impl MssqlConfig {
    /// Parses a URL (`mssql://…`, `sqlserver://…`) or an ADO.NET connection string.
    pub fn parse(text: &str) -> Result<MssqlConfig, SourceError> {
        let t = text.trim();
        let lower = t.to_ascii_lowercase();
        if lower.starts_with("mssql://") || lower.starts_with("sqlserver://") {
            Self::parse_url(t)
        } else if t.contains('=') {
            Self::parse_ado(t)
        } else {
            Err(cfg_err("SQL Server connection: expected mssql://user@host:port/database or an ADO.NET string such as server=tcp:host,1433;database=db;user id=login"))
        }
    }

    fn parse_url(t: &str) -> Result<MssqlConfig, SourceError> {
        // Do not echo the text back: it might hold a password.
        let url = url::Url::parse(t).map_err(|e| cfg_err(format!("SQL Server connection: the URL does not parse ({e})")))?;
        if url.password().is_some() {
            return Err(cfg_err(format!(
                "SQL Server connection: the URL carries a password; remove it from the URL and put it in the {PASSWORD_ENV} \
                 environment variable (or the password file the workflow names)"
            )));
        }
        let decode = |s: &str| -> Result<String, SourceError> {
            percent_decode(s).ok_or_else(|| cfg_err("SQL Server connection: the URL has an invalid %-escape"))
        };
        let mut raw = Raw { user: Some(decode(url.username())?), ..Raw::default() };
        let host = url.host_str().unwrap_or_default();
        raw.host = Some(host.trim_start_matches('[').trim_end_matches(']').to_string());
        raw.port = url.port();
        let path = decode(url.path().trim_start_matches('/'))?;
        // mssql://host/INSTANCE/database names an instance.
        match path.split_once('/') {
            Some((inst, db)) if !inst.is_empty() => {
                raw.instance = Some(inst.to_string());
                raw.database = Some(db.to_string());
            }
            _ => raw.database = Some(path),
        }
        for (k, v) in url.query_pairs() {
            let key = norm_key(&k);
            match key.as_str() {
                "password" | "pwd" => {
                    return Err(cfg_err(format!(
                        "SQL Server connection: the URL carries a password parameter; remove it and put the password in the {PASSWORD_ENV} environment variable"
                    )))
                }
                "instance" => raw.instance = Some(v.to_string()),
                _ => {
                    if !raw.option(&key, &k, &v)? {
                        return Err(cfg_err(format!(
                            "SQL Server connection: unknown URL parameter '{k}'; known: encrypt, trust_server_certificate, ca_file, \
                             allow_plaintext, connect_timeout_s, command_timeout_s, application_name, time_zone, pool_size, instance"
                        )));
                    }
                }
            }
        }
        raw.finish()
    }

    fn parse_ado(t: &str) -> Result<MssqlConfig, SourceError> {
        let mut raw = Raw::default();
        for part in split_ado(t)? {
            let (k, v) = part;
            let key = norm_key(&k);
            match key.as_str() {
                "password" | "pwd" => {
                    return Err(cfg_err(format!(
                        "SQL Server connection: the connection string carries a password; remove it and put the password in the {PASSWORD_ENV} environment variable"
                    )))
                }
                "server" | "datasource" | "address" | "addr" | "networkaddress" => {
                    let s = v.trim();
                    let s = s.strip_prefix("tcp:").or_else(|| s.strip_prefix("TCP:")).unwrap_or(s);
                    let (hostpart, port) = match s.rsplit_once(',') {
                        Some((h, p)) => (
                            h,
                            Some(p.trim().parse::<u16>().map_err(|_| cfg_err(format!("SQL Server connection: '{p}' in server= is not a port number")))?),
                        ),
                        None => (s, None),
                    };
                    let (host, instance) = match hostpart.split_once('\\') {
                        Some((h, i)) => (h, Some(i.to_string())),
                        None => (hostpart, None),
                    };
                    raw.host = Some(if host == "." || host.eq_ignore_ascii_case("(local)") { "localhost".into() } else { host.trim().to_string() });
                    raw.port = port;
                    raw.instance = instance;
                }
                "database" | "initialcatalog" => raw.database = Some(v.trim().to_string()),
                "userid" | "uid" | "user" | "username" => raw.user = Some(v.trim().to_string()),
                _ => {
                    if !raw.option(&key, &k, &v)? {
                        return Err(cfg_err(format!("SQL Server connection: unknown connection-string key '{}'", k.trim())));
                    }
                }
            }
        }
        raw.finish()
    }

    /// The tiberius configuration for one connection, with this password.
    pub fn tiberius_config(&self, password: &str) -> Config {
        let mut c = Config::new();
        c.host(&self.host);
        c.port(self.port);
        if let Some(i) = &self.instance {
            c.instance_name(i);
        }
        c.database(&self.database);
        c.application_name(&self.application_name);
        c.authentication(AuthMethod::sql_server(&self.user, password));
        c.encryption(match self.encrypt {
            Encrypt::Required => EncryptionLevel::Required,
            Encrypt::Strict => EncryptionLevel::Strict,
            Encrypt::Off => EncryptionLevel::NotSupported,
        });
        match &self.trust {
            Trust::Roots => {}
            Trust::CaFile(f) => c.trust_cert_ca(f),
            Trust::Any => c.trust_cert(),
        }
        c.handshake_timeout(Some(self.connect_timeout));
        c.command_timeout(Some(self.command_timeout));
        c
    }
}

impl fmt::Display for MssqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mssql://{}@{}:{}/", self.user, self.host, self.port)?;
        if let Some(i) = &self.instance {
            write!(f, "{i}/")?;
        }
        write!(f, "{}?encrypt={}", self.database, match self.encrypt {
            Encrypt::Required => "true",
            Encrypt::Strict => "strict",
            Encrypt::Off => "false",
        })?;
        match &self.trust {
            Trust::Roots => {}
            Trust::CaFile(p) => write!(f, "&ca_file={p}")?,
            Trust::Any => write!(f, "&trust_server_certificate=true")?,
        }
        Ok(())
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Splits `k=v;k='v;v';k="v"` into pairs.
fn split_ado(t: &str) -> Result<Vec<(String, String)>, SourceError> {
    let mut out = Vec::new();
    let chars: Vec<char> = t.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let start = i;
        while i < chars.len() && chars[i] != '=' && chars[i] != ';' {
            i += 1;
        }
        let key: String = chars[start..i].iter().collect();
        if i >= chars.len() || chars[i] == ';' {
            if !key.trim().is_empty() {
                return Err(cfg_err(format!("SQL Server connection: '{}' in the connection string has no value", key.trim())));
            }
            i += 1;
            continue;
        }
        i += 1; // '='
        while i < chars.len() && chars[i] == ' ' {
            i += 1;
        }
        let mut val = String::new();
        if i < chars.len() && (chars[i] == '\'' || chars[i] == '"') {
            let q = chars[i];
            i += 1;
            loop {
                if i >= chars.len() {
                    return Err(cfg_err("SQL Server connection: a quoted value in the connection string is not closed"));
                }
                if chars[i] == q {
                    if i + 1 < chars.len() && chars[i + 1] == q {
                        val.push(q);
                        i += 2;
                        continue;
                    }
                    i += 1;
                    break;
                }
                val.push(chars[i]);
                i += 1;
            }
            while i < chars.len() && chars[i] != ';' {
                i += 1;
            }
        } else {
            while i < chars.len() && chars[i] != ';' {
                val.push(chars[i]);
                i += 1;
            }
            val = val.trim_end().to_string();
        }
        i += 1; // ';'
        out.push((key, val));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_with_every_option() {
        let c = MssqlConfig::parse(
            "mssql://cdc_reader@db.example.com:14330/Sales?encrypt=true&trust_server_certificate=false&ca_file=/etc/ca.pem\
             &connect_timeout_s=5&command_timeout_s=120&application_name=nightly&time_zone=W.%20Europe%20Standard%20Time&pool_size=2",
        )
        .unwrap();
        assert_eq!(c.host, "db.example.com");
        assert_eq!(c.port, 14330);
        assert_eq!(c.database, "Sales");
        assert_eq!(c.user, "cdc_reader");
        assert_eq!(c.encrypt, Encrypt::Required);
        assert_eq!(c.trust, Trust::CaFile("/etc/ca.pem".into()));
        assert_eq!(c.connect_timeout, Duration::from_secs(5));
        assert_eq!(c.command_timeout, Duration::from_secs(120));
        assert_eq!(c.application_name, "nightly");
        assert_eq!(c.time_zone.as_deref(), Some("W. Europe Standard Time"));
        assert_eq!(c.pool_size, 2);
    }

    #[test]
    fn url_defaults_are_safe() {
        let c = MssqlConfig::parse("mssql://reader@localhost/db").unwrap();
        assert_eq!(c.port, 1433);
        assert_eq!(c.encrypt, Encrypt::Required);
        assert_eq!(c.trust, Trust::Roots);
        assert_eq!(c.connect_timeout, Duration::from_secs(15));
        assert_eq!(c.command_timeout, Duration::from_secs(60));
        let i = MssqlConfig::parse("sqlserver://reader@host:1434/SQLEXPRESS/db%20one").unwrap();
        assert_eq!(i.instance.as_deref(), Some("SQLEXPRESS"));
        assert_eq!(i.database, "db one");
    }

    #[test]
    fn password_in_url_is_refused_and_not_echoed() {
        for text in ["mssql://sa:Secr3t!@localhost/db", "mssql://sa@localhost/db?password=Secr3t!"] {
            let e = MssqlConfig::parse(text).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, SourceError::Config(_)));
            assert!(msg.contains(PASSWORD_ENV), "{msg}");
            assert!(!msg.contains("Secr3t"), "{msg}");
        }
        let e = MssqlConfig::parse("server=tcp:h,1433;database=d;user id=u;password=Secr3t!").unwrap_err();
        assert!(e.to_string().contains(PASSWORD_ENV));
        assert!(!e.to_string().contains("Secr3t"));
    }

    #[test]
    fn plaintext_needs_explicit_consent() {
        let e = MssqlConfig::parse("mssql://u@h/d?encrypt=false").unwrap_err();
        assert!(e.to_string().contains("allow_plaintext=true"), "{e}");
        let c = MssqlConfig::parse("mssql://u@h/d?encrypt=false&allow_plaintext=true").unwrap();
        assert_eq!(c.encrypt, Encrypt::Off);
        assert!(MssqlConfig::parse("mssql://u@h/d?encrypt=maybe").is_err());
        assert!(MssqlConfig::parse("mssql://u@h/d?trust_server_certificate=true&ca_file=x.pem").is_err());
    }

    #[test]
    fn bad_urls_say_what_to_fix() {
        assert!(MssqlConfig::parse("mssql://u@h/").unwrap_err().to_string().contains("no database"));
        assert!(MssqlConfig::parse("mssql://h/d").unwrap_err().to_string().contains("no login"));
        assert!(MssqlConfig::parse("mssql://u@h/d?encrpyt=true").unwrap_err().to_string().contains("unknown URL parameter"));
        assert!(MssqlConfig::parse("mssql://u@h/d?command_timeout_s=0").is_err());
        assert!(MssqlConfig::parse("mssql://u@h/d?time_zone=Mars/Olympus").is_err());
        assert!(MssqlConfig::parse("just words").is_err());
    }

    #[test]
    fn ado_strings() {
        let c = MssqlConfig::parse("Server=tcp:sql1.corp,1533;Database=Sales;User Id=reader;TrustServerCertificate=true;Connect Timeout=7;Application Name='cdc; nightly'").unwrap();
        assert_eq!((c.host.as_str(), c.port), ("sql1.corp", 1533));
        assert_eq!(c.database, "Sales");
        assert_eq!(c.user, "reader");
        assert_eq!(c.trust, Trust::Any);
        assert_eq!(c.connect_timeout, Duration::from_secs(7));
        assert_eq!(c.application_name, "cdc; nightly");
        let n = MssqlConfig::parse("data source=host\\INST,1500;initial catalog=db;uid=r").unwrap();
        assert_eq!(n.instance.as_deref(), Some("INST"));
        assert_eq!(n.port, 1500);
        assert!(MssqlConfig::parse("data source=host\\INST;initial catalog=db;uid=r").is_err());
        assert!(MssqlConfig::parse("server=h;database=d;user id=u;encrypt=false").is_err());
        assert!(MssqlConfig::parse("server=h;database=d;user id=u;colour=blue").is_err());
    }

    #[test]
    fn display_and_debug_never_hold_the_password() {
        let c = MssqlConfig::parse("mssql://reader@h:1433/d?trust_server_certificate=true").unwrap();
        assert_eq!(c.to_string(), "mssql://reader@h:1433/d?encrypt=true&trust_server_certificate=true");
        let _cfg = c.tiberius_config("Secr3t!");
        assert!(!format!("{c:?}").contains("Secr3t"));
        let s = crate::source::SourceSecrets { password: Some("Secr3t!".into()) };
        assert!(!format!("{s:?}").contains("Secr3t"));
    }
}
