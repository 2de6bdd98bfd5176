//! What an idle consumer waits for: a notification, or its group's next timed work.

use std::time::Duration;

use tokio::time::Instant;
use tracing::debug;

use super::runner::Ctx;
use crate::sql;

/// The shortest idle wait. Work that `next_due` called due but that a claim did not hand out
/// doubles it, up to `poll_interval`, until a claim finds work. (A retry in a lane another
/// consumer holds is not called due before the hold ends.)
pub(super) const IDLE_FLOOR: Duration = Duration::from_millis(20);

/// What `sqlstreams.next_due` last said, kept until something may have changed it: a
/// notification, a claim that handed out work, or a retry or delay this consumer's outcomes
/// set. An idle consumer that polls again with nothing changed then costs one claim, not two
/// calls. Timed work that other consumers make sends no notification (their retries, their
/// leases that run out when they crash): this consumer sees it at its next `poll_interval`
/// at the latest, as it did before `next_due` existed; the consumer that set a retry sleeps
/// until it.
#[derive(Clone, Copy, Debug)]
pub(super) enum NextDue {
    Unknown,
    /// Nothing waits for a time.
    Nothing,
    At(Instant),
}

/// How long an idle consumer waits for a notification: until its group's next timed work
/// falls due (`sqlstreams.next_due`, asked when `known` may be out of date or its time has
/// come), at most `poll_interval`, and not less than `floor`. If the question fails,
/// `poll_interval`.
pub(super) async fn idle_wait<T, H>(ctx: &Ctx<T, H>, floor: Duration, known: &mut NextDue) -> Duration {
    let floor = floor.min(ctx.config.poll_interval);
    let now = Instant::now();
    if matches!(*known, NextDue::Unknown) || matches!(*known, NextDue::At(at) if at <= now) {
        let asked = async {
            let conn = ctx.group.stream.pool.conn().await?;
            let row = conn.query_one(sql::NEXT_DUE_IN, &[&ctx.group.stream.name, &ctx.group.name]).await?;
            Ok::<_, crate::Error>(row.get::<_, Option<f64>>(0))
        };
        *known = match asked.await {
            Ok(Some(seconds)) => Duration::try_from_secs_f64(seconds.max(0.0))
                .ok()
                .and_then(|wait| now.checked_add(wait))
                .map_or(NextDue::Nothing, NextDue::At),
            Ok(None) => NextDue::Nothing,
            Err(e) => {
                debug!(error = %e, "sqlstreams: could not read when the group's next work falls due");
                NextDue::Unknown
            }
        };
    }
    match *known {
        NextDue::At(at) => at.saturating_duration_since(now).clamp(floor, ctx.config.poll_interval.max(floor)),
        NextDue::Nothing | NextDue::Unknown => ctx.config.poll_interval,
    }
}
