//! Validation of the user's words: stream and group names, `start_at`, intervals.
//! Pure functions; every refusal names the value and says what to do instead.

use crate::error::{quoted, Result, StreamError};

/// Longest stream or group name, in characters. Names are data (they never reach SQL text),
/// so the limit is about keeping views and logs readable, not about identifiers.
pub const MAX_NAME_CHARS: usize = 200;

/// Checks a stream or group name: present, not blank, at most `MAX_NAME_CHARS` characters,
/// no control characters.
pub fn validate_name<'a>(kind: &str, name: Option<&'a str>) -> Result<&'a str> {
    // The docs' own names: stream 'ledger.adjustments', its group 'apply-balance'.
    let example = if kind == "group" { "apply-balance" } else { "ledger.adjustments" };
    let name = name.ok_or_else(|| {
        StreamError::invalid(
            format!("{kind} name must not be NULL"),
            format!("Pass a {kind} name such as '{example}'."),
        )
    })?;
    if name.trim().is_empty() {
        return Err(StreamError::invalid(
            format!("{kind} name must not be empty"),
            format!("Pass a {kind} name such as '{example}'."),
        ));
    }
    let chars = name.chars().count();
    if chars > MAX_NAME_CHARS {
        return Err(StreamError::invalid(
            format!("{kind} name \"{}...\" is {chars} characters long", name.chars().take(40).collect::<String>()),
            format!("Use a {kind} name of at most {MAX_NAME_CHARS} characters."),
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(StreamError::invalid(
            format!("{kind} name {name:?} contains a control character"),
            format!("Use a {kind} name made of printable characters."),
        ));
    }
    Ok(name)
}

/// Where a new group's cursor starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartAt {
    /// Every message of the stream, from id 1.
    Beginning,
    /// Only messages produced after the group is created.
    Head,
}

impl StartAt {
    pub fn parse(value: Option<&str>) -> Result<StartAt> {
        match value {
            Some("beginning") => Ok(StartAt::Beginning),
            Some("head") => Ok(StartAt::Head),
            other => Err(StreamError::invalid(
                format!("start_at {} is not valid", quoted(other)),
                "Use 'beginning' (every message) or 'head' (only messages produced from now on).",
            )),
        }
    }
}

/// Checks that a duration argument is positive; returns it in microseconds.
pub fn positive_micros(what: &str, micros: Option<i128>, example: &str) -> Result<i64> {
    match micros {
        Some(m) if m > 0 && m <= i64::MAX as i128 => Ok(m as i64),
        Some(m) if m > 0 => Err(StreamError::invalid(
            format!("{what} {} is too long", seconds(m)),
            format!("Pass {} {what} such as {example}.", article(what)),
        )),
        Some(m) => Err(StreamError::invalid(
            format!("{what} must be positive, not {}", seconds(m)),
            format!("Pass a positive {what} such as {example}."),
        )),
        None => Err(StreamError::invalid(
            format!("{what} must not be NULL"),
            format!("Pass a positive {what} such as {example}."),
        )),
    }
}

/// "a" or "an", as `word` is spoken (a setting's name: "an idempotency_ttl", "a lease").
fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

/// A duration of `micros` microseconds as a refusal names it: in seconds, as every interval
/// argument can be written (`'-5 seconds'`; an interval of days or months counts its days as 24
/// hours and its months as 30 days, as Postgres does to compare intervals).
pub fn seconds(micros: i128) -> String {
    let (sign, magnitude) = if micros < 0 { ("-", micros.unsigned_abs()) } else { ("", micros.unsigned_abs()) };
    let (whole, fraction) = (magnitude / 1_000_000, magnitude % 1_000_000);
    let fraction =
        if fraction == 0 { String::new() } else { format!(".{fraction:06}").trim_end_matches('0').to_string() };
    let unit = if whole == 1 && fraction.is_empty() { "second" } else { "seconds" };
    format!("{sign}{whole}{fraction} {unit}")
}

/// The longest a stream's `idempotency_ttl` or `dead_retention` may be: a hundred years as
/// Postgres counts an interval (a month is 30 days). Produces and retention add it to or subtract
/// it from now(), which must stay a timestamp.
const MAX_STREAM_PERIOD_MICROS: i64 = 100 * 12 * 30 * 86_400 * 1_000_000;

/// A stream's period setting: positive, and at most a hundred years.
pub fn stream_period(what: &str, micros: Option<i128>, example: &str) -> Result<i64> {
    let micros = positive_micros(what, micros, example)?;
    if micros > MAX_STREAM_PERIOD_MICROS {
        return Err(StreamError::invalid(
            format!("{what} {} is longer than 100 years", seconds(micros.into())),
            format!("Pass {} {what} such as {example}, at most '100 years'.", article(what)),
        ));
    }
    Ok(micros)
}

/// An argument that must not be NULL; the refusal says where the value comes from.
pub fn required<T>(what: &str, value: Option<T>, from: &str) -> Result<T> {
    value.ok_or_else(|| StreamError::invalid(format!("{what} must not be NULL"), format!("Pass the {what} {from}.")))
}

/// The arguments every call that answers a claim starts with, validated: the stream, the
/// group and the lease token of the claim.
pub struct Answer<'a> {
    pub stream: &'a str,
    pub group: &'a str,
    pub token: pgrx::Uuid,
}

impl<'a> Answer<'a> {
    pub fn validate(stream: Option<&'a str>, group: Option<&'a str>, token: Option<pgrx::Uuid>) -> Result<Self> {
        Ok(Answer {
            stream: validate_name("stream", stream)?,
            group: validate_name("group", group)?,
            token: required("lease_token", token, "from the claim result the call answers")?,
        })
    }
}

/// Message ids from the claim result a call answers; `what` names the argument. NULL
/// elements name no message and are ignored (as in 0.1.0).
pub fn message_ids(what: &str, ids: Option<Vec<Option<i64>>>) -> Result<Vec<i64>> {
    let ids = required(what, ids, "from the claim result the call answers")?;
    Ok(ids.into_iter().flatten().collect())
}

/// A message id from the claim result a call answers.
pub fn message_id(id: Option<i64>) -> Result<i64> {
    required("message_id", id, "from the claim result the call answers")
}

/// Longest message key, in bytes. Keys are indexed (the exception queue, compaction
/// heads), and a btree entry must stay well under Postgres' limit of about 2.7 kB; a key that
/// passed produce must never make a later claim or outcome fail.
pub const MAX_KEY_BYTES: usize = 1024;

/// Checks that a key (`message_key`, `idempotency_key`) fits in an index entry: at most
/// `MAX_KEY_BYTES` bytes.
pub fn check_key_length(what: &str, key: &str) -> Result<()> {
    let max = MAX_KEY_BYTES;
    if key.len() <= max {
        return Ok(());
    }
    let start: String = key.chars().take(40).collect();
    Err(StreamError::invalid(
        format!("{what} '{start}...' is {} bytes long", key.len()),
        format!("Use a {what} of at most {max} bytes; for a longer natural key, pass a hash of it (such as md5)."),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_is_named_in_seconds() {
        for (micros, text) in [
            (0, "0 seconds"),
            (1_000_000, "1 second"),
            (-1_000_000, "-1 second"),
            (1_000_001, "1.000001 seconds"),
            (-250_000, "-0.25 seconds"),
            (999_999, "0.999999 seconds"),
            (86_400_250_000, "86400.25 seconds"),
            (-86_400_250_000, "-86400.25 seconds"),
        ] {
            assert_eq!(seconds(micros), text);
        }
        // Beyond what a bigint of microseconds holds, as an interval of years can be.
        assert_eq!(seconds(i128::from(i64::MAX) * 10), "92233720368547.75807 seconds");
        assert_eq!(seconds(i128::MIN), "-170141183460469231731687303715884.105728 seconds");
        assert_eq!(seconds(i128::MAX), "170141183460469231731687303715884.105727 seconds");
    }

    #[test]
    fn names_are_checked() {
        assert_eq!(validate_name("stream", Some("ledger.adjustments")).unwrap(), "ledger.adjustments");
        assert!(validate_name("group", Some(" ")).unwrap_err().hint().unwrap().contains("'apply-balance'"));
        assert!(validate_name("stream", None).unwrap_err().hint().unwrap().contains("'ledger.adjustments'"));
        let long = stream_period("idempotency_ttl", Some(i128::from(MAX_STREAM_PERIOD_MICROS) + 1), "'1 day'");
        assert!(long.unwrap_err().hint().unwrap().starts_with("Pass an idempotency_ttl such as '1 day'"));
        assert_eq!(validate_name("stream", Some("Robert'); DROP TABLE x;--")).unwrap(), "Robert'); DROP TABLE x;--");
        assert!(validate_name("stream", None).is_err());
        assert!(validate_name("stream", Some("")).is_err());
        assert!(validate_name("stream", Some("   ")).is_err());
        assert!(validate_name("stream", Some("a\nb")).is_err());
        assert!(validate_name("group", Some(&"x".repeat(MAX_NAME_CHARS))).is_ok());
        assert!(validate_name("group", Some(&"x".repeat(MAX_NAME_CHARS + 1))).is_err());
        // Characters, not bytes.
        assert!(validate_name("group", Some(&"é".repeat(MAX_NAME_CHARS))).is_ok());
    }

    #[test]
    fn start_at_is_parsed() {
        assert_eq!(StartAt::parse(Some("beginning")).unwrap(), StartAt::Beginning);
        assert_eq!(StartAt::parse(Some("head")).unwrap(), StartAt::Head);
        let err = StartAt::parse(Some("tail")).unwrap_err().to_string();
        assert!(err.contains("'tail'"), "{err}");
        assert!(StartAt::parse(None).is_err());
    }

    #[test]
    fn durations_must_be_positive() {
        assert_eq!(positive_micros("lease", Some(30_000_000), "'30 seconds'").unwrap(), 30_000_000);
        assert!(positive_micros("lease", Some(0), "'30 seconds'").is_err());
        assert!(positive_micros("lease", Some(-1), "'30 seconds'").is_err());
        assert!(positive_micros("lease", None, "'30 seconds'").is_err());
    }
}
