//! Concurrency: the per-key policy (`parallel`, `exclusive`, `ordered`) a group applies to a
//! message, and where it comes from. Pure logic. The SQL API calls it `concurrency` (a message's
//! request) and `concurrency_override` (a group's), the Rust client `Concurrency`.

use crate::error::quoted;
use crate::error::{Result, StreamError};
use crate::names;

/// When a keyed message must wait, within one consumer group: its concurrency policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Concurrency {
    /// Same-key messages may run concurrently and out of order.
    Parallel,
    /// One delivery per key at a time (its lane's hold); a later message may overtake a retry.
    Exclusive,
    /// A message waits until every earlier same-key message is resolved.
    Ordered,
}

impl Concurrency {
    pub fn as_str(self) -> &'static str {
        match self {
            Concurrency::Parallel => "parallel",
            Concurrency::Exclusive => "exclusive",
            Concurrency::Ordered => "ordered",
        }
    }

    /// Parses a policy name; `what` names the argument in the error.
    pub fn parse(what: &str, value: &str) -> Result<Concurrency> {
        match value {
            "parallel" => Ok(Concurrency::Parallel),
            "exclusive" => Ok(Concurrency::Exclusive),
            "ordered" => Ok(Concurrency::Ordered),
            other => Err(StreamError::invalid(
                format!("{what} '{other}' is not a concurrency policy"),
                "Use 'parallel', 'exclusive' or 'ordered' (or NULL for the default).",
            )),
        }
    }

    /// Parses a policy the extension stored itself (a check constraint admits only valid ones).
    pub fn from_stored(value: &str) -> Result<Concurrency> {
        Concurrency::parse("stored concurrency", value)
            .map_err(|_| StreamError::Internal(format!("unknown stored concurrency {value:?}")))
    }

    /// Whether same-key rows of this policy are chained behind each other in a claim result.
    pub fn is_keyed_gate(self) -> bool {
        self != Concurrency::Parallel
    }
}

/// The policy a group applies to one message.
///
/// A group's override covers every keyed message from every producer; without it the message's
/// own request applies, and a keyed message that requested nothing is parallel. A message
/// without a key is always parallel: there is nothing to order it against.
pub fn resolve(group_override: Option<Concurrency>, requested: Option<Concurrency>, has_key: bool) -> Concurrency {
    if !has_key {
        return Concurrency::Parallel;
    }
    group_override.or(requested).unwrap_or(Concurrency::Parallel)
}

/// What a producer asked for, validated before anything is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProduceRequest<'a> {
    pub message_key: Option<&'a str>,
    pub concurrency: Option<Concurrency>,
    pub compaction: bool,
}

impl<'a> ProduceRequest<'a> {
    pub fn validate(
        message_key: Option<&'a str>,
        concurrency: Option<&str>,
        compaction: bool,
    ) -> Result<ProduceRequest<'a>> {
        let concurrency = concurrency.map(|c| Concurrency::parse("concurrency", c)).transpose()?;
        if concurrency == Some(Concurrency::Ordered) && compaction {
            return Err(StreamError::invalid(
                "an ordered message cannot use compaction",
                "Ordered delivery must run every message, while compaction lets a newer message supersede an older one: \
                 produce with compaction => false, or request 'exclusive' delivery for latest-state messages.",
            ));
        }
        if message_key.is_none() {
            if let Some(policy @ (Concurrency::Exclusive | Concurrency::Ordered)) = concurrency {
                return Err(StreamError::invalid(
                    format!("concurrency '{}' requires a message_key", policy.as_str()),
                    "Pass the key the policy orders by (an account, an order, a user), or omit concurrency.",
                ));
            }
            if compaction {
                return Err(StreamError::invalid(
                    "compaction requires a message_key",
                    "Pass the key whose latest state the message carries, or produce with compaction => false.",
                ));
            }
        }
        if message_key.is_some_and(str::is_empty) {
            return Err(StreamError::invalid(
                format!("message_key {} is empty", quoted(message_key)),
                "Pass a non-empty key, or NULL for a message without a key.",
            ));
        }
        if let Some(key) = message_key {
            names::check_key_length("message_key", key)?;
        }
        Ok(ProduceRequest { message_key, concurrency, compaction })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Concurrency::*;

    #[test]
    fn override_beats_request_and_keyless_is_parallel() {
        assert_eq!(resolve(None, None, true), Parallel);
        assert_eq!(resolve(None, Some(Exclusive), true), Exclusive);
        assert_eq!(resolve(Some(Ordered), None, true), Ordered);
        assert_eq!(resolve(Some(Ordered), Some(Exclusive), true), Ordered);
        assert_eq!(resolve(Some(Parallel), Some(Ordered), true), Parallel);
        assert_eq!(resolve(Some(Ordered), Some(Ordered), false), Parallel);
        assert_eq!(resolve(None, Some(Exclusive), false), Parallel);
    }

    #[test]
    fn policy_names_round_trip() {
        for p in [Parallel, Exclusive, Ordered] {
            assert_eq!(Concurrency::parse("concurrency", p.as_str()).unwrap(), p);
        }
        let err = Concurrency::parse("concurrency", "serial").unwrap_err().to_string();
        assert!(err.contains("'serial'"), "{err}");
    }

    #[test]
    fn produce_requests_are_validated() {
        let long = "k".repeat(crate::names::MAX_KEY_BYTES + 1);
        assert!(ProduceRequest::validate(Some(&long[1..]), Some("ordered"), false).is_ok(), "the longest key");
        assert!(ProduceRequest::validate(Some("acct-42"), Some("ordered"), false).is_ok());
        assert!(ProduceRequest::validate(Some("acct-42"), Some("exclusive"), true).is_ok());
        assert!(ProduceRequest::validate(Some("acct-42"), None, true).is_ok());
        assert!(ProduceRequest::validate(None, None, false).is_ok());
        assert!(ProduceRequest::validate(None, Some("parallel"), false).is_ok());

        let refused = [
            (Some("acct-42"), Some("ordered"), true),
            (None, Some("ordered"), false),
            (None, Some("exclusive"), false),
            (None, None, true),
            (Some("acct-42"), Some("fifo"), false),
            (Some(""), None, false),
            (Some(&long), None, false),
        ];
        for (key, policy, compaction) in refused {
            assert!(
                ProduceRequest::validate(key, policy, compaction).is_err(),
                "{key:?} {policy:?} {compaction} should be refused"
            );
        }
    }
}
