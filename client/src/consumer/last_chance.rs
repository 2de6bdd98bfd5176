//! How long a consumer told to stop still waits for the database once its grace is over.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long outcomes and claims in flight are still waited for, and outcomes retried, once the
/// consumer cancelled its handlers (its shutdown's grace ran out): so a database that cannot
/// take them (down, ending every session, or a lock held for ever) does not hold the shutdown.
/// What is not recorded then runs again after its lease.
pub(crate) const LAST_CHANCE: Duration = Duration::from_secs(2);

/// The end of the last chance: `LAST_CHANCE` after `cancel`.
#[derive(Clone)]
pub(crate) struct LastChance {
    cancel: CancellationToken,
    ends: Arc<OnceLock<Instant>>,
}

impl LastChance {
    pub fn new(cancel: CancellationToken) -> LastChance {
        LastChance { cancel, ends: Arc::default() }
    }

    /// `step`'s output, or `None` if the last chance ended first.
    pub async fn within<F: Future>(&self, step: F) -> Option<F::Output> {
        tokio::pin!(step);
        if !self.cancel.is_cancelled() {
            tokio::select! {
                out = &mut step => return Some(out),
                _ = self.cancel.cancelled() => {}
            }
        }
        let ends = *self.ends.get_or_init(|| Instant::now() + LAST_CHANCE);
        tokio::time::timeout_at(ends, step).await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn after(seconds: u64, value: u32) -> u32 {
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        value
    }

    #[tokio::test(start_paused = true)]
    async fn a_step_runs_to_its_end_until_the_cancel_and_then_for_the_last_chance() {
        let cancel = CancellationToken::new();
        let last = LastChance::new(cancel.clone());
        assert_eq!(last.within(after(3600, 1)).await, Some(1), "before the cancel, however long");
        let started = Instant::now();
        let cancelling = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            cancelling.cancel();
        });
        // Cancelled after 1 s: steps end by 1 s + LAST_CHANCE.
        assert_eq!(last.within(after(2, 2)).await, Some(2), "done within the last chance");
        assert_eq!(last.within(after(5, 3)).await, None, "cut at its end");
        assert_eq!(started.elapsed(), Duration::from_secs(1) + LAST_CHANCE);
        assert_eq!(last.within(std::future::ready(4)).await, Some(4), "a step ready at once still counts");
    }
}
