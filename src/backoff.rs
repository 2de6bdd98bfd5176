//! Retry backoff, and what a failure or a delay does against a group's budgets. Pure logic.

/// What a failure or a delay does to a message, once its budgets are applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setback {
    /// Run again at `can_run_after`.
    Retry { attempts: i32, delays: i32, can_run_after: i64 },
    /// Dead-lettered; `note` replaces the caller's error text (why a budget ended it).
    Dead { attempts: i32, delays: i32, note: Option<&'static str> },
}

/// A group's retry settings, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    pub base_micros: i64,
    pub cap_micros: i64,
    pub exponent: f64,
}

impl Backoff {
    /// Wait before the retry that follows failure number `attempts` (1 for the first failure):
    /// `min(cap, base * exponent^(attempts - 1))`.
    pub fn delay_micros(&self, attempts: i32) -> i64 {
        let steps = (attempts.max(1) - 1) as f64;
        let delay = self.base_micros as f64 * self.exponent.powf(steps);
        if !delay.is_finite() || delay >= self.cap_micros as f64 {
            self.cap_micros
        } else {
            (delay as i64).max(0)
        }
    }
}

/// Applies one failure to a message that had failed `previous_attempts` times (and been delayed
/// `delays` times). `max_retries` retries follow the first run, so the budget is spent when
/// `attempts > max_retries`. `retry_after` overrides the backoff for this one retry.
pub fn fail(
    backoff: &Backoff,
    max_retries: i32,
    previous_attempts: i32,
    delays: i32,
    permanent: bool,
    retry_after_micros: Option<i64>,
    now: i64,
) -> Setback {
    let attempts = previous_attempts + 1;
    if permanent || attempts > max_retries {
        return Setback::Dead { attempts, delays, note: None };
    }
    let wait = retry_after_micros.unwrap_or_else(|| backoff.delay_micros(attempts));
    Setback::Retry { attempts, delays, can_run_after: now.saturating_add(wait.max(0)) }
}

/// Applies one requested delay: it counts in `delays`, never against the retry budget, and
/// dead-letters only when the group's `max_delays` budget (if any) is spent.
pub fn delay(max_delays: Option<i32>, attempts: i32, previous_delays: i32, delay_micros: i64, now: i64) -> Setback {
    let delays = previous_delays + 1;
    if max_delays.is_some_and(|max| delays > max) {
        return Setback::Dead { attempts, delays, note: Some("dead-lettered: the group's max_delays budget is spent") };
    }
    Setback::Retry { attempts, delays, can_run_after: now.saturating_add(delay_micros) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: i64 = 1_000_000;
    const B: Backoff = Backoff { base_micros: SECOND, cap_micros: 60 * SECOND, exponent: 2.0 };

    #[test]
    fn backoff_grows_exponentially_up_to_the_cap() {
        assert_eq!(B.delay_micros(1), SECOND);
        assert_eq!(B.delay_micros(2), 2 * SECOND);
        assert_eq!(B.delay_micros(3), 4 * SECOND);
        assert_eq!(B.delay_micros(6), 32 * SECOND);
        assert_eq!(B.delay_micros(7), 60 * SECOND);
        assert_eq!(B.delay_micros(10_000), 60 * SECOND);
        let flat = Backoff { exponent: 1.0, ..B };
        assert_eq!(flat.delay_micros(9), SECOND);
    }

    #[test]
    fn default_budget_allows_four_runs() {
        // max_retries = 3: the first run and three retries fail, the fourth failure is dead.
        let mut attempts = 0;
        let mut outcomes = vec![];
        loop {
            let outcome = fail(&B, 3, attempts, 2, false, None, 0);
            outcomes.push(outcome);
            match outcome {
                Setback::Retry { attempts: a, .. } => attempts = a,
                Setback::Dead { .. } => break,
            }
        }
        assert_eq!(
            outcomes,
            vec![
                Setback::Retry { attempts: 1, delays: 2, can_run_after: SECOND },
                Setback::Retry { attempts: 2, delays: 2, can_run_after: 2 * SECOND },
                Setback::Retry { attempts: 3, delays: 2, can_run_after: 4 * SECOND },
                Setback::Dead { attempts: 4, delays: 2, note: None },
            ]
        );
    }

    #[test]
    fn permanent_and_override() {
        assert_eq!(fail(&B, 3, 0, 0, true, None, 0), Setback::Dead { attempts: 1, delays: 0, note: None });
        assert_eq!(fail(&B, 0, 0, 0, false, None, 0), Setback::Dead { attempts: 1, delays: 0, note: None });
        assert_eq!(fail(&B, 3, 0, 0, false, Some(0), 7), Setback::Retry { attempts: 1, delays: 0, can_run_after: 7 });
    }

    #[test]
    fn delays_count_apart_from_failures_and_have_their_own_budget() {
        assert_eq!(delay(None, 2, 9, SECOND, 5), Setback::Retry { attempts: 2, delays: 10, can_run_after: 5 + SECOND });
        assert_eq!(delay(Some(1), 0, 0, SECOND, 0), Setback::Retry { attempts: 0, delays: 1, can_run_after: SECOND });
        assert!(matches!(delay(Some(1), 0, 1, SECOND, 0), Setback::Dead { delays: 2, note: Some(_), .. }));
    }
}
