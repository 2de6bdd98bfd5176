//! libpq's environment: what `psql` reads besides the connection string (the `PG*` variables and
//! the password file), read the same way for [`Client::connect_env`](crate::Client::connect_env)
//! and the CLI, so an operator's shell that works for `psql` works for them.
//!
//! What the connection string sets wins; the environment fills only what it leaves out, then
//! libpq's defaults: the host `/var/run/postgresql` when that socket directory exists (Debian's)
//! or `localhost`, port 5432, the OS user, and a database named after the user.
//! See <https://www.postgresql.org/docs/current/libpq-envars.html> and
//! <https://www.postgresql.org/docs/current/libpq-pgpass.html>.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_postgres::config::{Host, SslMode, TargetSessionAttrs};
use tokio_postgres::Config;

use crate::error::{Error, Result};

/// Debian's (and most packages') socket directory, libpq's default host where it exists.
const SOCKET_DIR: &str = "/var/run/postgresql";
const DEFAULT_PORT: u16 = 5432;

/// The settings of `dsn` (a URL or `key=value` string; `None` for none) completed from the
/// process environment as libpq completes them.
pub fn config_from_env(dsn: Option<&str>) -> Result<Config> {
    resolve(dsn, &|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
}

/// [`config_from_env`] with the environment passed in (tests pass their own).
pub(crate) fn resolve(dsn: Option<&str>, env: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
    let mut config = match dsn {
        Some(dsn) => dsn.parse().map_err(|e| Error::Config(format!("connection string: {e}")))?,
        None => Config::new(),
    };
    let bad = |name: &str, value: &str, what: &str| Error::Config(format!("{name}={value}: {what}"));
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        let addrs = env("PGHOSTADDR");
        match env("PGHOST") {
            Some(hosts) => hosts.split(',').for_each(|h| host(&mut config, h)),
            // An address alone is enough: libpq then matches the password file against it.
            None if addrs.is_some() => {}
            None if Path::new(SOCKET_DIR).is_dir() => host(&mut config, SOCKET_DIR),
            None => host(&mut config, "localhost"),
        }
        if let Some(addrs) = addrs {
            for addr in addrs.split(',') {
                config.hostaddr(addr.trim().parse().map_err(|_| bad("PGHOSTADDR", &addrs, "not an IP address"))?);
            }
        }
    }
    for unsupported in ["PGSERVICE", "PGSSLCERT", "PGSSLKEY", "PGREQUIREAUTH", "PGSSLCRL"] {
        if env(unsupported).is_some() {
            tracing::warn!("{unsupported} is set, and this client does not support it: ignored");
        }
    }
    if config.get_ports().is_empty() {
        if let Some(ports) = env("PGPORT") {
            for port in ports.split(',') {
                config.port(port.trim().parse().map_err(|_| bad("PGPORT", &ports, "not a port number"))?);
            }
        }
    }
    if config.get_user().is_none() {
        if let Some(user) = env("PGUSER").or_else(|| env("USER")).or_else(|| env("LOGNAME")) {
            config.user(user);
        }
    }
    if config.get_dbname().is_none() {
        if let Some(db) = env("PGDATABASE") {
            config.dbname(db);
        }
    }
    if config.get_application_name().is_none() {
        if let Some(name) = env("PGAPPNAME") {
            config.application_name(name);
        }
    }
    if config.get_options().is_none() {
        if let Some(options) = env("PGOPTIONS") {
            config.options(options);
        }
    }
    if config.get_connect_timeout().is_none() {
        if let Some(secs) = env("PGCONNECT_TIMEOUT") {
            let secs: i64 = secs.trim().parse().map_err(|_| bad("PGCONNECT_TIMEOUT", &secs, "not whole seconds"))?;
            // libpq: 0 or less waits for ever, and a timeout under 2 seconds is taken as 2.
            if secs > 0 {
                config.connect_timeout(Duration::from_secs(secs.max(2) as u64));
            }
        }
    }
    if !dsn.is_some_and(names_sslmode) {
        if let Some(mode) = env("PGSSLMODE") {
            config.ssl_mode(ssl_mode(&mode).ok_or_else(|| {
                bad("PGSSLMODE", &mode, "not an sslmode (disable, allow, prefer, require, verify-ca, verify-full)")
            })?);
        }
    }
    if !dsn.is_some_and(|d| names_key(d, "target_session_attrs")) {
        if let Some(attrs) = env("PGTARGETSESSIONATTRS") {
            config.target_session_attrs(match attrs.as_str() {
                "any" => TargetSessionAttrs::Any,
                "read-write" => TargetSessionAttrs::ReadWrite,
                "read-only" => TargetSessionAttrs::ReadOnly,
                _ => {
                    let what = "not any, read-write or read-only (libpq's primary, standby and prefer-standby \
                                are not supported by this client)";
                    return Err(bad("PGTARGETSESSIONATTRS", &attrs, what));
                }
            });
        }
    }
    if config.get_password().is_none() {
        if let Some(password) = env("PGPASSWORD") {
            config.password(password);
        } else if let Some(file) =
            env("PGPASSFILE").map(PathBuf::from).or_else(|| env("HOME").map(|h| Path::new(&h).join(".pgpass")))
        {
            if let Some(password) = password_file(&file, &config)? {
                config.password(password);
            }
        }
    }
    Ok(config)
}

fn host(config: &mut Config, host: &str) {
    config.host(host.trim());
}

/// libpq's modes as tokio-postgres has them. The client's `require` verifies the server
/// (crate::tls), so `verify-ca` and `verify-full` are met by it; `allow` is taken as `prefer`.
fn ssl_mode(mode: &str) -> Option<SslMode> {
    match mode {
        "disable" => Some(SslMode::Disable),
        "allow" | "prefer" => Some(SslMode::Prefer),
        "require" | "verify-ca" | "verify-full" => Some(SslMode::Require),
        _ => None,
    }
}

/// Whether the connection string sets `sslmode` itself: its `prefer` cannot be told from the
/// default once parsed.
fn names_sslmode(dsn: &str) -> bool {
    names_key(dsn, "sslmode")
}

/// Whether `dsn` sets `key`, as a URL query parameter or a `key=value` pair.
fn names_key(dsn: &str, key: &str) -> bool {
    if dsn.starts_with("postgres://") || dsn.starts_with("postgresql://") {
        let query = dsn.split_once('?').map_or("", |(_, q)| q);
        query.split('&').any(|pair| pair.split('=').next() == Some(key))
    } else {
        dsn.split_whitespace().any(|pair| pair.split('=').next().map(str::trim) == Some(key))
    }
}

/// The password file's password for this connection, as libpq finds it: the first line whose
/// host, port, database and user match (`*` matches anything; a connection through the default
/// socket directory matches `localhost`, one through another directory its path). A missing or
/// unreadable file is no password; so is a file others may read, with a warning, as libpq does.
fn password_file(path: &Path, config: &Config) -> Result<Option<String>> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(None) };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).map(|m| m.permissions().mode()).unwrap_or(0o077);
        if mode & 0o077 != 0 {
            tracing::warn!(
                "password file {} has group or world access and is ignored; permissions should be u=rw (0600) or less",
                path.display()
            );
            return Ok(None);
        }
    }
    let user = config.get_user().unwrap_or_default();
    let dbname = config.get_dbname().unwrap_or(user);
    let port = config.get_ports().first().copied().unwrap_or(DEFAULT_PORT).to_string();
    let hosts: Vec<String> = match config.get_hosts() {
        [] => config.get_hostaddrs().iter().map(|a| a.to_string()).collect(),
        hosts => hosts
            .iter()
            .map(|h| match h {
                Host::Tcp(name) => name.clone(),
                #[cfg(unix)]
                Host::Unix(dir) if dir == Path::new(SOCKET_DIR) => "localhost".to_owned(),
                #[cfg(unix)]
                Host::Unix(dir) => dir.display().to_string(),
            })
            .collect(),
    };
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = split_fields(line);
        let [h, p, d, u, password, ..] = fields.as_slice() else { continue };
        if hosts.iter().any(|host| h.matches(host)) && p.matches(&port) && d.matches(dbname) && u.matches(user) {
            return Ok(Some(password.text.clone()));
        }
    }
    Ok(None)
}

/// One field of a password file line: its text with escapes removed, and whether it was a bare
/// `*` (an escaped `\*` is a literal star).
struct Field {
    text: String,
    any: bool,
}

impl Field {
    fn matches(&self, value: &str) -> bool {
        self.any || self.text == value
    }
}

/// A password file line's fields: `:` separates them, `\:` and `\\` escape. The password is the
/// fifth; anything after it is ignored.
fn split_fields(line: &str) -> Vec<Field> {
    let mut fields = Vec::new();
    let (mut text, mut raw) = (String::new(), String::new());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                raw.push(c);
                if let Some(next) = chars.next() {
                    text.push(next);
                    raw.push(next);
                }
            }
            ':' => {
                fields.push(Field { any: raw == "*", text: std::mem::take(&mut text) });
                raw.clear();
            }
            c => {
                text.push(c);
                raw.push(c);
            }
        }
    }
    fields.push(Field { any: raw == "*", text });
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_connection_string_wins_and_the_environment_fills_the_rest() {
        let vars = [
            ("PGHOST", "db.example"),
            ("PGPORT", "6543"),
            ("PGUSER", "app"),
            ("PGDATABASE", "shop"),
            ("PGSSLMODE", "require"),
            ("PGAPPNAME", "ops"),
            ("PGCONNECT_TIMEOUT", "1"),
        ];
        let c = resolve(None, &env(&vars)).unwrap();
        assert_eq!(c.get_hosts(), [Host::Tcp("db.example".into())]);
        assert_eq!(c.get_ports(), [6543]);
        assert_eq!((c.get_user(), c.get_dbname(), c.get_application_name()), (Some("app"), Some("shop"), Some("ops")));
        assert_eq!(c.get_ssl_mode(), SslMode::Require);
        assert_eq!(c.get_connect_timeout(), Some(&Duration::from_secs(2)));

        let c = resolve(Some("postgres://other@h2:7000/x?sslmode=prefer"), &env(&vars)).unwrap();
        assert_eq!(c.get_hosts(), [Host::Tcp("h2".into())]);
        assert_eq!(c.get_ports(), [7000]);
        assert_eq!((c.get_user(), c.get_dbname()), (Some("other"), Some("x")));
        assert_eq!(c.get_ssl_mode(), SslMode::Prefer, "the string's sslmode=prefer is not overridden");

        let c = resolve(Some("host=h3 user=kv"), &env(&vars)).unwrap();
        assert_eq!((c.get_ports(), c.get_user(), c.get_dbname()), (&[6543][..], Some("kv"), Some("shop")));
        assert_eq!(c.get_ssl_mode(), SslMode::Require);
    }

    #[test]
    fn refused_values_name_the_variable() {
        for (name, value) in [("PGPORT", "x"), ("PGSSLMODE", "sometimes"), ("PGCONNECT_TIMEOUT", "soon")] {
            let err = resolve(None, &env(&[(name, value)])).unwrap_err().to_string();
            assert!(err.contains(&format!("{name}={value}")), "{err}");
        }
    }

    #[test]
    fn the_password_file_matches_like_libpq() {
        let dir = std::env::temp_dir().join(format!("sqlstreams-pgpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pgpass");
        std::fs::write(
            &file,
            "# comment\nother:*:*:app:wrong\ndb.example:6543:*:app:s\\:e\\\\cret\n*:*:*:*:fallback\n",
        )
        .unwrap();
        #[cfg(unix)]
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        let path = file.to_str().unwrap();
        let vars = [("PGHOST", "db.example"), ("PGPORT", "6543"), ("PGUSER", "app"), ("PGPASSFILE", path)];
        assert_eq!(resolve(None, &env(&vars)).unwrap().get_password(), Some(&b"s:e\\cret"[..]));
        let vars = [("PGHOST", "elsewhere"), ("PGUSER", "app"), ("PGPASSFILE", path)];
        assert_eq!(resolve(None, &env(&vars)).unwrap().get_password(), Some(&b"fallback"[..]));
        let vars = [("PGPASSWORD", "given"), ("PGPASSFILE", path)];
        assert_eq!(resolve(None, &env(&vars)).unwrap().get_password(), Some(&b"given"[..]));
        // A literal star, and a password that ends at the next unescaped colon.
        std::fs::write(&file, "h\\*:*:*:app:star:extra\n*:*:*:app:other\n").unwrap();
        let vars = [("PGHOST", "h*"), ("PGUSER", "app"), ("PGPASSFILE", path)];
        assert_eq!(resolve(None, &env(&vars)).unwrap().get_password(), Some(&b"star"[..]));
        let vars = [("PGHOST", "hx"), ("PGUSER", "app"), ("PGPASSFILE", path)];
        assert_eq!(resolve(None, &env(&vars)).unwrap().get_password(), Some(&b"other"[..]), "\\* is no wildcard");
        // Another socket directory matches its path, not localhost.
        std::fs::write(&file, "localhost:*:*:app:local\n/tmp/sock:*:*:app:sock\n").unwrap();
        let vars = [("PGHOST", "/tmp/sock"), ("PGUSER", "app"), ("PGPASSFILE", path)];
        assert_eq!(resolve(None, &env(&vars)).unwrap().get_password(), Some(&b"sock"[..]));
        #[cfg(unix)]
        {
            std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
            let config = resolve(None, &env(&[("PGPASSFILE", path)])).unwrap();
            assert_eq!(config.get_password(), None, "a file others may read is ignored, as libpq does");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
