//! How long a consumer stays with a lane it holds: a claim whose carried acks just released a
//! lane takes that lane again first, while it has work, for up to `STAY_CLAIMS` claims in a
//! row; then the lane furthest behind, as any claim.
//!
//! Why: a lone consumer draining a backlog otherwise never takes the lane its acks released
//! (having just been read on, it is the lane least behind), so every claim ended one hold and
//! took another lane, and notified the stream's channel for the lane it left (src/claim.rs,
//! `signal_left`), waking every listening connection of the stream. Staying, it ends and takes
//! the same lane in one transaction and notifies nobody, since nobody else could have taken the
//! lane meanwhile. The other lanes wait at most `STAY_CLAIMS` claims longer than before.
//!
//! Kept per backend: a consumer whose claims land on different backends (a pooler in
//! transaction mode) only stays less. Nothing here decides what is safe: a claim takes a lane
//! it prefers exactly as any other (`SKIP LOCKED`, under its hold rules).

use std::cell::Cell;

/// The most claims in a row that take one lane first because the previous one held it.
pub const STAY_CLAIMS: u32 = 4;

thread_local! {
    /// (group, the lane the last claim took first, how many claims in a row took it first).
    static LAST: Cell<Option<(i64, i32, u32)>> = const { Cell::new(None) };
}

/// The lane of `released` (lanes the claim's carried acks released) to take before the lane
/// furthest behind: the one this backend's last claim of `group_id` took first, unless
/// `STAY_CLAIMS` claims in a row took it already.
pub fn preferred(group_id: i64, released: &[i32]) -> Option<i32> {
    match LAST.get() {
        Some((group, lane, claims)) if group == group_id && claims < STAY_CLAIMS && released.contains(&lane) => {
            Some(lane)
        }
        _ => None,
    }
}

/// Records the lanes a claim of `group_id` took, best first.
pub fn took(group_id: i64, taken: &[i32]) {
    let Some(&first) = taken.first() else { return LAST.set(None) };
    let claims = match LAST.get() {
        Some((group, lane, claims)) if group == group_id && lane == first => claims.saturating_add(1),
        _ => 1,
    };
    LAST.set(Some((group_id, first, claims)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_is_preferred_for_at_most_stay_claims_in_a_row() {
        LAST.set(None);
        assert_eq!(preferred(1, &[3]), None, "nothing taken yet");
        took(1, &[3, 5]);
        for _ in 1..STAY_CLAIMS {
            assert_eq!(preferred(1, &[3, 5]), Some(3));
            took(1, &[3]);
        }
        assert_eq!(preferred(1, &[3]), None, "{STAY_CLAIMS} claims took lane 3 first");
        took(1, &[7]);
        assert_eq!(preferred(1, &[3]), None, "lane 3 is not the last lane taken first");
        assert_eq!(preferred(1, &[7]), Some(7));
        assert_eq!(preferred(2, &[7]), None, "another group");
        took(1, &[]);
        assert_eq!(preferred(1, &[7]), None, "a claim that took nothing");
    }
}
