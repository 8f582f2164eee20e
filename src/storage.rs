//! Object-store options (`target.storage_options`): the check that keeps
//! secrets out of workflow files, and the reading of the references that
//! stand for them.
//!
//! Why refuse a literal secret rather than warn: workflow files live in
//! repositories, orchestrator variables and CI logs; a key written there is
//! leaked whatever the program does next. A secret is written as a
//! reference: `env:NAME` (read from the environment when the step runs) or
//! `file:PATH` (read from a file, e.g. a mounted Kubernetes secret), or left
//! out so the store's own chain finds it (an instance role, a managed or
//! workload identity, `GOOGLE_APPLICATION_CREDENTIALS`).
//!
//! Which keys are secrets: object_store's and deltalake's own names and
//! aliases for access keys, secret keys, session and bearer tokens, SAS
//! tokens, account keys, client secrets and inline service-account keys
//! ([`SECRET_KEYS`]), compared lowercased as deltalake compares them; and,
//! as a backstop for a key added by a later release, any key whose name
//! says secret, password, token or key ([`is_secret_key`]). Paths to
//! credential files and identifiers (a role ARN, a client id) are not
//! secrets and stay literal.
//!
//! Two settings are refused because they make a promise delta-rs 1.x does
//! not keep: `aws_conditional_put` other than `etag` (commits then fail or,
//! on a store that ignores the condition, overwrite each other), and an S3
//! locking provider (the DynamoDB lock is gone: a user would believe in a
//! lock that does not exist).
//!
//! And the store itself is asked, not trusted ([`check_conditional_puts`]):
//! every guarantee of the steps run side by side rests on a commit being
//! put-if-absent, and nothing in a URL says whether an S3-compatible store
//! honours `If-None-Match`. Before a step that writes creates or migrates
//! its tables, one object (`_delta_log/_mssql_cdc_put_check` of a table of
//! ours, or of an empty folder) is put with the create-only condition, and
//! again if the first put was accepted; a store that accepts both is
//! refused unless the workflow says `target.single_writer = true`. One or
//! two requests per store and call, against the tens a commit takes; the
//! object stays, so later calls are refused at the first put.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

use deltalake::logstore::object_store::{PutMode, PutOptions, PutPayload};
use deltalake::ObjectStore;

use crate::error::{StepError, StepResult};

/// Storage option keys that hold secrets (lowercase), with their aliases.
pub const SECRET_KEYS: &[&str] = &[
    // S3
    "aws_access_key_id",
    "access_key_id",
    "aws_secret_access_key",
    "secret_access_key",
    "aws_session_token",
    "aws_token",
    "session_token",
    "token",
    "aws_sse_customer_key_base64",
    "sse_customer_key_base64",
    // Azure
    "azure_storage_account_key",
    "azure_storage_access_key",
    "azure_storage_master_key",
    "master_key",
    "account_key",
    "access_key",
    "azure_storage_client_secret",
    "azure_client_secret",
    "client_secret",
    "azure_storage_sas_key",
    "azure_storage_sas_token",
    "sas_key",
    "sas_token",
    "azure_storage_token",
    "bearer_token",
    "azure_fabric_session_token",
    "fabric_session_token",
    // GCS
    "google_service_account_key",
    "service_account_key",
];

/// Keys whose names look like secrets but hold paths or identifiers.
const NOT_SECRETS: &[&str] = &[
    "aws_web_identity_token_file",
    "aws_container_authorization_token_file",
    "azure_federated_token_file",
    "aws_sse_kms_key_id",
    "aws_conditional_put",
    "aws_copy_if_not_exists",
];

/// Proxy keys: a URL with a password in it is a secret.
const PROXY_KEYS: &[&str] = &["proxy_url", "aws_proxy_url", "azure_proxy_url", "google_proxy_url"];

/// Whether a storage option key holds a secret.
pub fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    if NOT_SECRETS.contains(&k.as_str()) {
        return false;
    }
    if SECRET_KEYS.contains(&k.as_str()) {
        return true;
    }
    let token_like = k.contains("token") && !k.ends_with("_file") && !k.ends_with("_url");
    k.contains("secret") || k.contains("password") || k.contains("passwd") || k.contains("sas_") || token_like || k.ends_with("_key") || k.ends_with("key_base64")
}

/// A value that stands for another: `env:NAME` or `file:PATH`.
fn reference(value: &str) -> Option<(&'static str, &str)> {
    value.strip_prefix("env:").map(|n| ("env", n)).or_else(|| value.strip_prefix("file:").map(|p| ("file", p)))
}

/// Checks the options as written (before anything is read or written): a
/// secret only by reference, no empty reference, no setting that would make
/// concurrent commits unsafe. The error names the key, never its value.
pub fn check(options: &BTreeMap<String, String>) -> Result<(), String> {
    for (key, value) in options {
        let k = key.to_ascii_lowercase();
        match reference(value) {
            Some((kind, rest)) if rest.trim().is_empty() => {
                return Err(format!("target.storage_options.{key} is \"{kind}:\" with nothing after it: name the {}", if kind == "env" { "environment variable" } else { "file" }));
            }
            Some(_) => {}
            None if is_secret_key(&k) => {
                return Err(format!(
                    "target.storage_options.{key} holds a secret written into the file: write env:NAME (an environment variable) or \
                     file:PATH (a file holding it), or leave it out and let the store's own credentials supply it (an instance role, \
                     a managed or workload identity)"
                ));
            }
            None if PROXY_KEYS.contains(&k.as_str()) && proxy_has_password(value) => {
                return Err(format!("target.storage_options.{key} has a password in its URL: write it as env:NAME or file:PATH"));
            }
            None => {}
        }
        if (k == "aws_conditional_put" || k == "conditional_put") && !value.eq_ignore_ascii_case("etag") && reference(value).is_none() {
            return Err(format!(
                "target.storage_options.{key} is \"{value}\": commits to S3 are made safe against a concurrent writer only by conditional \
                 writes (\"etag\", the default); remove it, or set it to \"etag\""
            ));
        }
        if k == "aws_s3_locking_provider" || k == "aws_s3_locking_provider_dynamodb" {
            return Err(format!(
                "target.storage_options.{key}: this release's Delta library has no DynamoDB lock (it commits by conditional writes, which \
                 S3 has honoured since 2024); remove the option. A store that does not honour If-None-Match is not safe for two writers"
            ));
        }
    }
    Ok(())
}

fn proxy_has_password(url: &str) -> bool {
    url::Url::parse(url).map(|u| u.password().is_some()).unwrap_or(false)
}

/// The options with each reference read: `env:NAME` from the environment,
/// `file:PATH` from the file (a relative path from `base`, the workflow
/// file's folder; one trailing newline dropped). An error names the key and
/// where it looked, never a value.
pub fn resolve(options: &BTreeMap<String, String>, base: &Path) -> StepResult<HashMap<String, String>> {
    let mut out = HashMap::new();
    for (k, v) in options {
        let value = match reference(v) {
            Some(("env", var)) => std::env::var(var)
                .map_err(|_| StepError::Config(format!("target.storage_options.{k} names the environment variable {var}, which is not set")))?,
            Some((_, path)) => {
                let p = base.join(path);
                let text = std::fs::read_to_string(&p).map_err(|e| {
                    StepError::Config(format!("target.storage_options.{k} names the file {}, which cannot be read: {e}", p.display()))
                })?;
                text.strip_suffix("\r\n").or_else(|| text.strip_suffix('\n')).unwrap_or(&text).to_string()
            }
            None => v.clone(),
        };
        // The check of the file's values, for a value given by reference:
        // read only now.
        let key = k.to_ascii_lowercase();
        if (key == "aws_conditional_put" || key == "conditional_put") && !value.eq_ignore_ascii_case("etag") {
            return Err(StepError::Config(format!(
                "target.storage_options.{k} names a value other than \"etag\": commits to S3 are made safe against a concurrent \
                 writer only by conditional writes (\"etag\", the default); remove it, or set it to \"etag\""
            )));
        }
        out.insert(k.clone(), value);
    }
    Ok(out)
}

/// The stores this process has found to honour create-only puts (scheme and
/// authority: a bucket, a container), so a fleet call asks each once.
static CONDITIONAL_PUTS_SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// The probe object: one fixed name under `_delta_log/`, where a folder
/// whose only entries are not commits is still "no table yet" to
/// `delta::open_existing`, and which Delta readers skip (not a commit or
/// checkpoint name). It is left in place, not deleted: an "already exists"
/// on the first put proves the condition as well as one on the second, so
/// each store keeps one probe object for good, whatever a call's
/// credentials may delete and however often steps run.
const PROBE_PATH: &str = "_delta_log/_mssql_cdc_put_check";

/// Asks the store behind each object-store location (once per bucket or
/// container, per process) whether it honours a create-only put: the same
/// object is put twice with `PutMode::Create` and the second must fail with
/// "already exists". A local path is not asked (the file system's
/// create-new is the condition). `locations` are `(name in the file,
/// location)` as [`crate::workflow::Workflow::target_tables`] lists them.
///
/// A store that accepts the second put is refused (a `Config` error, exit 2)
/// unless `single_writer` is set, which logs a warning instead: the user
/// says no two steps ever write these tables at once (such a store is not
/// remembered, so it is asked again for each workflow). A store that cannot
/// be reached is the store's error (as any other step's request would be);
/// one that refuses the write for want of permission is a `Config` error.
pub async fn check_conditional_puts(
    locations: &[(String, String)],
    storage: &HashMap<String, String>,
    single_writer: bool,
    checked: &[&str],
) -> StepResult<()> {
    for (name, location) in locations {
        // A path is not turned into a URL here: that would create its folder.
        if !location.contains("://") {
            continue;
        }
        let url = crate::delta::table_url(location)?;
        if matches!(url.scheme(), "file" | "memory") {
            continue;
        }
        // The bucket alone does not name a store: the endpoint (an
        // S3-compatible server) and the account (Azure) do too.
        let store_name = format!("{}://{}", url.scheme(), url.authority().to_ascii_lowercase());
        let mut key = store_name.clone();
        let mut named: Vec<String> = storage
            .iter()
            .filter(|(k, _)| {
                let k = k.to_ascii_lowercase();
                k.contains("endpoint") || k.contains("account_name") || k.ends_with("_url") || k.contains("use_emulator")
            })
            .map(|(k, v)| format!("{}={v}", k.to_ascii_lowercase()))
            .collect();
        named.sort();
        for n in named {
            key.push(' ');
            key.push_str(&n);
        }
        if CONDITIONAL_PUTS_SEEN.lock().unwrap().get_or_insert_with(HashSet::new).contains(&key) {
            continue;
        }
        // The probe goes only into a folder that is empty or holds a table
        // of this program: another's folder gets nothing written (the step
        // that opens it as a target refuses it). `checked` names the
        // locations the caller has already found to be so.
        if !checked.contains(&location.as_str()) {
            match crate::delta::open_existing(location, storage).await {
                Ok(None) => {}
                Ok(Some(t)) if crate::delta::kind_property(&t).is_some() => {}
                Ok(Some(_)) | Err(StepError::Config(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        let table = deltalake::DeltaTableBuilder::from_url(url.clone())
            .map_err(StepError::delta(location.clone()))?
            .with_storage_options(storage.clone())
            .build()
            .map_err(StepError::delta(location.clone()))?;
        let store = table.object_store();
        let path = deltalake::Path::from(PROBE_PATH);
        let create = || PutOptions { mode: PutMode::Create, ..Default::default() };
        let store_err = |source: deltalake::ObjectStoreError| match source {
            // Credentials that may read but not write (or none at all): a
            // setting to change, not a call to repeat.
            e @ (deltalake::ObjectStoreError::PermissionDenied { .. } | deltalake::ObjectStoreError::Unauthenticated { .. }) => {
                StepError::Config(format!(
                    "the store of {name} '{location}' refused this program's write ({e}): the credentials must allow writing and \
                     listing under the target tables' folders"
                ))
            }
            source => StepError::Delta { table: location.clone(), source: deltalake::DeltaTableError::ObjectStore { source } },
        };
        let refused = |e: &deltalake::ObjectStoreError| {
            // The condition held. (S3 and GCS map 412 to AlreadyExists; an
            // Azure-compatible store answering 412 comes through as
            // Precondition.)
            matches!(
                e,
                deltalake::ObjectStoreError::AlreadyExists { .. }
                    | deltalake::ObjectStoreError::Precondition { .. }
                    | deltalake::ObjectStoreError::NotModified { .. }
            )
        };
        let honoured = match store.put_opts(&path, PutPayload::from_static(b"mssql-cdc put-if-absent probe"), create()).await {
            // The probe of an earlier call is there, and the store refused to replace it.
            Err(e) if refused(&e) => true,
            Ok(_) => match store.put_opts(&path, PutPayload::from_static(b"mssql-cdc put-if-absent probe"), create()).await {
                Err(e) if refused(&e) => true,
                Ok(_) | Err(deltalake::ObjectStoreError::NotImplemented { .. }) | Err(deltalake::ObjectStoreError::NotSupported { .. }) => false,
                Err(e) => return Err(store_err(e)),
            },
            // S3 with conditional puts turned off (`aws_conditional_put =
            // disabled`, which deltalake-aws also takes from the environment)
            // refuses every create-only put, so every commit would fail:
            // a setting to change, not a store to call again.
            Err(e @ (deltalake::ObjectStoreError::NotImplemented { .. } | deltalake::ObjectStoreError::NotSupported { .. })) => {
                return Err(StepError::Config(format!(
                    "the store of {name} '{location}' refuses create-only puts ({e}), which every Delta commit is: remove \
                     AWS_CONDITIONAL_PUT from the environment and aws_conditional_put from target.storage_options"
                )));
            }
            Err(e) => return Err(store_err(e)),
        };
        if !honoured {
            let why = format!(
                "the store of {name} '{location}' ({store_name}) accepted a second create-only put of the same object: it does not \
                 honour If-None-Match, so two steps committing to one table at once could overwrite each other's commits \
                 and lose rows"
            );
            if !single_writer {
                return Err(StepError::Config(format!(
                    "{why}. Use a store that honours conditional writes (AWS S3, Azure Blob and ADLS, GCS, MinIO and \
                     most S3-compatible stores do), or, only if no two steps of any workflow writing these tables ever \
                     run at the same time (not even `stream` beside `backfill`), set target.single_writer = true"
                )));
            }
            tracing::warn!("{why}; going on because target.single_writer = true");
            // Not remembered: another workflow of this process on the same
            // store (a fleet) may not have said single_writer.
            continue;
        }
        CONDITIONAL_PUTS_SEEN.lock().unwrap().get_or_insert_with(HashSet::new).insert(key);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn every_secret_key_is_refused_literal_and_accepted_by_reference() {
        for key in SECRET_KEYS.iter().map(|k| k.to_string()).chain(["AWS_SECRET_ACCESS_KEY".into(), "Azure_Storage_Account_Key".into()]) {
            let err = check(&opts(&[(&key, "s3cr3t-value")])).expect_err(&key);
            assert!(err.contains(&key) && !err.contains("s3cr3t-value"), "{err}");
            check(&opts(&[(&key, "env:SOME_VAR")])).unwrap_or_else(|e| panic!("{key}: {e}"));
            check(&opts(&[(&key, "file:/run/secrets/x")])).unwrap_or_else(|e| panic!("{key}: {e}"));
        }
    }

    #[test]
    fn paths_identifiers_and_settings_stay_literal() {
        let fine = opts(&[
            ("AWS_REGION", "eu-west-1"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:5000"),
            ("AWS_ALLOW_HTTP", "true"),
            ("aws_web_identity_token_file", "/var/run/token"),
            ("azure_federated_token_file", "/var/run/azure"),
            ("azure_storage_account_name", "lake"),
            ("azure_client_id", "0000-1111"),
            ("aws_sse_kms_key_id", "arn:aws:kms:x"),
            ("azure_storage_use_emulator", "true"),
            ("google_service_account", "/etc/gcp/key.json"),
            ("aws_conditional_put", "etag"),
            ("proxy_url", "http://proxy:3128"),
        ]);
        check(&fine).unwrap();
    }

    #[test]
    fn a_new_secret_sounding_key_is_refused_by_its_name() {
        for key in ["azure_storage_new_secret", "x_password", "some_token", "mystery_key"] {
            assert!(check(&opts(&[(key, "v")])).is_err(), "{key}");
        }
    }

    #[test]
    fn unsafe_commit_settings_and_empty_references_are_refused() {
        assert!(check(&opts(&[("aws_conditional_put", "disabled")])).unwrap_err().contains("etag"));
        assert!(check(&opts(&[("AWS_S3_LOCKING_PROVIDER", "dynamodb")])).unwrap_err().contains("DynamoDB"));
        assert!(check(&opts(&[("AWS_SECRET_ACCESS_KEY", "env:")])).unwrap_err().contains("nothing after it"));
        assert!(check(&opts(&[("proxy_url", "http://u:pw@proxy:3128")])).unwrap_err().contains("password"));
    }

    #[test]
    fn references_are_read_from_the_environment_and_from_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("key"), "from-a-file\n").unwrap();
        std::env::set_var("MSSQL_CDC_STORAGE_TEST_VAR", "from-env");
        let got = resolve(&opts(&[("a", "env:MSSQL_CDC_STORAGE_TEST_VAR"), ("b", "file:key"), ("c", "plain")]), dir.path()).unwrap();
        assert_eq!((got["a"].as_str(), got["b"].as_str(), got["c"].as_str()), ("from-env", "from-a-file", "plain"));
        let e = resolve(&opts(&[("b", "file:missing")]), dir.path()).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
        let e = resolve(&opts(&[("a", "env:MSSQL_CDC_STORAGE_TEST_UNSET")]), dir.path()).unwrap_err().to_string();
        assert!(e.contains("MSSQL_CDC_STORAGE_TEST_UNSET"), "{e}");
    }

    #[test]
    fn a_conditional_put_setting_given_by_reference_is_checked_once_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("mode"), "disabled\n").unwrap();
        std::fs::write(dir.path().join("etag"), "ETag\n").unwrap();
        let file = opts(&[("aws_conditional_put", "file:mode")]);
        assert!(check(&file).is_ok(), "a reference is read only when resolved");
        let e = resolve(&file, dir.path()).unwrap_err().to_string();
        assert!(e.contains("aws_conditional_put") && e.contains("etag") && !e.contains("disabled"), "{e}");
        assert!(resolve(&opts(&[("AWS_CONDITIONAL_PUT", "file:etag")]), dir.path()).is_ok());
    }
}
